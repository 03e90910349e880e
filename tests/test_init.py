"""init_process_group: every init method and every launcher's environment, with real processes on
127.0.0.1, plus the bad inputs."""
import multiprocessing as mp
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

import ddpc  # noqa: E402
from _procs import free_port  # noqa: E402

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                 "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK",
                 "PMI_SIZE", "DDPC_TOKEN")


def _rank_main(env, kwargs, q):
    """Joins a group, all-reduces its rank + 1, reports what it saw."""
    for k in LAUNCHER_VARS:
        os.environ.pop(k, None)
    os.environ.update(env)
    import numpy as np
    import ddpc as d
    try:
        d.init_process_group(backend="cpu", timeout=30, **kwargs)
        x = np.array([d.get_rank() + 1.0])
        d.all_reduce(x)
        q.put(("ok", d.get_rank(), d.get_world_size(), d.get_local_rank(), float(x[0])))
        d.destroy_process_group()
    except BaseException as e:  # reported to the test, which asserts on it
        q.put(("error", type(e).__name__, str(e)))


def spawn_collect(target, arg_tuples, timeout=60):
    """Runs target(*args, q) in one spawned process per args; returns what each put on q."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, q)) for args in arg_tuples]
    for p in procs:
        p.start()
    out = [q.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return out


def run_ranks(envs, kwargs_list=None, timeout=60):
    kwargs_list = kwargs_list or [{}] * len(envs)
    return spawn_collect(_rank_main, list(zip(envs, kwargs_list)), timeout)


def check_ok(results, world):
    assert all(r[0] == "ok" for r in results), results
    assert sorted(r[1] for r in results) == list(range(world))
    for r in results:
        assert r[2] == world
        assert r[4] == world * (world + 1) / 2  # sum of rank + 1


def test_env_torchrun_variables():
    port = free_port()
    envs = [dict(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DDPC_TOKEN="t-env")
            for r in range(2)]
    res = run_ranks(envs)
    check_ok(res, 2)
    assert sorted(r[3] for r in res) == [0, 1]


_UNDER_TORCHRUN = """
import os, sys
import numpy as np
import ddpc
rank = int(os.environ["RANK"])
if sys.argv[1] == "rank0_absent" and rank == 0:
    sys.exit(0)
for attempt in range(2):  # (a second group after destroy: a store of its own)
    ddpc.init_process_group(backend="cpu", timeout=float(sys.argv[2]))  # (any GPUs aside)
    x = np.full(3, ddpc.get_rank() + 1.0)
    ddpc.all_reduce(x)
    print(f"rank {ddpc.get_rank()} of {ddpc.get_world_size()}: {x.tolist()}", flush=True)
    ddpc.destroy_process_group()
"""


@pytest.mark.parametrize("how", [["--standalone"], ["--rdzv-backend", "c10d", "--rdzv-endpoint"]])
def test_a_job_started_by_real_torchrun(tmp_path, how):
    """torchrun's agent serves its own store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True):
    rank 0 serves ddpc's on a port of its own and publishes it there (it used to fail with
    "Address already in use"). A rank 0 that never calls init_process_group leaves the others
    a timeout that says what they waited for."""
    import subprocess
    script = tmp_path / "job.py"
    script.write_text(_UNDER_TORCHRUN)
    if how[-1] == "--rdzv-endpoint":
        how = how + [f"127.0.0.1:{free_port()}"]
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *how]
    res = subprocess.run(cmd + [str(script), "normal", "30"], capture_output=True, text=True,
                         timeout=120, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    # (torchrun's ranks share one stdout, so their lines may interleave)
    for r in range(2):
        assert res.stdout.count(f"rank {r} of 2: [3.0, 3.0, 3.0]") == 2, res.stdout
    if how[0] != "--standalone":
        return
    one = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", *how]
    res = subprocess.run(one + [str(script), "normal", "inf"], capture_output=True, text=True,
                         timeout=120, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr  # (one rank, no timeout at all)
    assert res.stdout.count("rank 0 of 1: [1.0, 1.0, 1.0]") == 2, res.stdout
    res = subprocess.run(cmd + [str(script), "rank0_absent", "3"], capture_output=True,
                         text=True, timeout=120, env=env, cwd=tmp_path)
    assert res.returncode != 0
    assert ("DistributedTimeoutError: init_process_group: rank 1 waited 3 s in torchrun's store "
            "for rank 0's address and it never came") in res.stderr, res.stderr


def test_tcp_init_method_with_explicit_rank():
    port = free_port()
    envs = [dict(DDPC_TOKEN="t-tcp")] * 2
    kws = [dict(init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2) for r in range(2)]
    check_ok(run_ranks(envs, kws), 2)


def test_file_init_method(tmp_path):
    path = tmp_path / "rdv"
    envs = [dict(RANK=str(r), WORLD_SIZE="3") for r in range(3)]
    kws = [dict(init_method=f"file://{path}")] * 3
    check_ok(run_ranks(envs, kws), 3)


def test_slurm_variables():
    port = free_port()
    envs = [dict(SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID=str(r),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DDPC_TOKEN="t-slurm")
            for r in range(2)]
    res = run_ranks(envs)
    check_ok(res, 2)
    assert sorted(r[3] for r in res) == [0, 1]


def test_open_mpi_variables():
    port = free_port()
    envs = [dict(OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE="2",
                 OMPI_COMM_WORLD_LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), DDPC_TOKEN="t-ompi") for r in range(2)]
    check_ok(run_ranks(envs), 2)


def test_wrong_token_is_refused():
    port = free_port()
    envs = [dict(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 DDPC_TOKEN="right" if r == 0 else "wrong") for r in range(2)]
    res = run_ranks(envs, timeout=90)
    errors = [r for r in res if r[0] == "error"]
    assert any(e[1] == "AuthError" and "DDPC_TOKEN" in e[2] for e in errors), res


def _reinit_main(env, rounds, slow_rank, init_kwargs, start_delay, q):
    """Joins, all-reduces and leaves `rounds` times in one process; slow_rank dawdles before each
    destroy, so the others come back to init while its old store still serves."""
    import time
    for k in LAUNCHER_VARS:
        os.environ.pop(k, None)
    os.environ.update(env)
    import numpy as np
    import ddpc as d
    time.sleep(start_delay)
    sums = []
    try:
        for i in range(rounds):
            d.init_process_group(backend="cpu", timeout=30, **init_kwargs)
            x = np.array([(d.get_rank() + 1.0) * (i + 1)])
            d.all_reduce(x)
            sums.append(float(x[0]))
            if d.get_rank() == slow_rank:
                time.sleep(0.5)
            d.destroy_process_group()
        q.put(("ok", int(env["RANK"]), sums))
    except BaseException as e:  # reported to the test, which asserts on it
        q.put(("error", type(e).__name__, str(e)))


@pytest.mark.parametrize("slow_rank", [0, 1], ids=["rank0_slow", "rank1_slow"])
def test_a_group_can_be_destroyed_and_initialized_again(slow_rank):
    """Rank 1 back at init before rank 0 has stopped the old store must not join the old one
    (it used to, and then lost it mid-rendezvous)."""
    port = free_port()
    envs = [dict(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 DDPC_TOKEN="t-reinit") for r in range(2)]
    out = spawn_collect(_reinit_main, [(env, 3, slow_rank, {}, 0.0) for env in envs], 90)
    assert sorted(out) == [("ok", 0, [3.0, 6.0, 9.0]), ("ok", 1, [3.0, 6.0, 9.0])], out


def _leave_main(env, how, q):
    """Rank 0 times its destroy_process_group (and keeps what it prints); rank 1 leaves `how`:
    "exit" (os._exit without destroying) or "slow" (destroys 3 s late)."""
    import io
    import time
    for k in LAUNCHER_VARS:
        os.environ.pop(k, None)
    os.environ.update(env)
    import numpy as np
    import ddpc as d
    d.init_process_group(backend="cpu", timeout=30)
    d.all_reduce(np.ones(1))
    if d.get_rank() == 1:
        if how == "exit":
            q.put(("exiting", 1))
            q.close()
            q.join_thread()  # (os._exit would drop what the queue's thread has not sent)
            os._exit(0)
        time.sleep(3.0)
        d.destroy_process_group()
        q.put(("left", 1))
        return
    err, sys.stderr = sys.stderr, io.StringIO()
    t0 = time.monotonic()
    try:
        d.destroy_process_group()
    finally:
        said, sys.stderr = sys.stderr.getvalue(), err
    q.put(("destroyed", 0, time.monotonic() - t0, said))


@pytest.mark.parametrize("how", ["exit", "slow"])
def test_rank_0_waits_for_leavers_but_not_for_the_dead_and_says_so(how):
    port = free_port()
    envs = [dict(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 DDPC_TOKEN="t-leave") for r in range(2)]
    out = spawn_collect(_leave_main, [(env, how) for env in envs], 60)
    _, _, took, said = next(o for o in out if o[0] == "destroyed")
    if how == "exit":
        assert took < 5.0, (took, said)  # (it waited the whole 10 s for a rank that had died)
        assert said == "", said
    else:
        assert 2.5 < took < 9.0, took
        assert said == ("ddpc: rank 0's destroy_process_group waits up to 10 s for rank(s) [1] "
                        "to leave the group first: call destroy_process_group() on every "
                        "rank\n"), said


def test_a_stale_rendezvous_file_is_not_trusted_and_rank_0_removes_its_own(tmp_path):
    """A file:// rendezvous file left by an earlier run names a store that is gone: rank 1 must
    wait for rank 0's new one (it used to connect to the dead port until the timeout). Rank 0
    removes its file at destroy_process_group, so the next round cannot read the old one."""
    path = tmp_path / "rdv"
    path.write_text(f"127.0.0.1 {free_port()} stale-token\n")
    kw = dict(init_method=f"file://{path}")
    out = spawn_collect(_reinit_main, [(dict(RANK=str(r), WORLD_SIZE="2"), 2, 0, kw,
                                        3.0 if r == 0 else 0.0) for r in range(2)], 90)
    assert sorted(out) == [("ok", 0, [3.0, 6.0]), ("ok", 1, [3.0, 6.0])], out
    assert not path.exists()


def test_a_rank_that_never_came_is_named(clean_env, monkeypatch):
    monkeypatch.setenv("DDPC_TOKEN", "t-never")
    port = free_port()
    with pytest.raises(ddpc.DistributedTimeoutError, match=re.escape(
            "timed out after 1.5 s: 1 of 2 rank(s) never got this far: 1 (did they call "
            "init_process_group with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE, or did "
            "they fail before it?)")):
        ddpc.init_process_group(backend="cpu", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=2, timeout=1.5)
    assert not ddpc.is_initialized()


def _claim_main(env, kwargs, timeout, q):
    """_rank_main with its own timeout; errors are reported with their type."""
    for k in LAUNCHER_VARS:
        os.environ.pop(k, None)
    os.environ.update(env)
    import time
    import numpy as np
    import ddpc as d
    mark = os.environ.get("CLAIM_MARK")  # a refused process creates it; the job waits for it
    try:
        d.init_process_group(backend="cpu", timeout=timeout, **kwargs)
        x = np.array([d.get_rank() + 1.0])
        d.all_reduce(x)
        q.put(("ok", d.get_rank(), float(x[0])))
        t0 = time.monotonic()
        while mark and not os.path.exists(mark) and time.monotonic() - t0 < 60:
            time.sleep(0.05)  # (keep the store up until the third process has come)
        d.destroy_process_group()
    except BaseException as e:  # reported to the test, which asserts on it
        q.put(("error", type(e).__name__, str(e)))
        if mark:
            open(mark, "w").close()


@pytest.mark.parametrize("twice", [0, 1])
def test_two_processes_claiming_one_rank_are_told_so(twice, tmp_path):
    """Three processes for a world of 2, two of them with rank `twice`: the one that comes second
    is refused (MismatchError) saying two processes claim that rank, and the other two run the
    job. It used to join (rank 1: the store took either, and a second job's rank on the same
    port could compute with this one) or fail with 'address in use' (rank 0)."""
    port = free_port()
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
               DDPC_TOKEN="t-claim", CLAIM_MARK=str(tmp_path / "refused"))
    ranks = [0, 1, twice]
    out = spawn_collect(_claim_main, [(dict(env, RANK=str(r)), {}, 20.0) for r in ranks], 90)
    assert sorted(o for o in out if o[0] == "ok") == [("ok", 0, 3.0), ("ok", 1, 3.0)], out
    refused = [o for o in out if o[0] == "error"]
    assert len(refused) == 1 and refused[0][1] == "MismatchError", out
    if twice == 1:
        assert re.fullmatch(r"store: the rendezvous store at 127\.0\.0\.1:\d+ already has a "
                            r"process registered as rank 1: two processes claim rank 1\. Give "
                            r"each process of the job its own RANK .*", refused[0][2]), out
    else:
        assert refused[0][2].startswith(
            f"init_process_group: rank 0 cannot serve the rendezvous store on 127.0.0.1:{port}: a "
            f"process that knows this job's token serves it there already, so two processes "
            f"claim rank 0: two of this job's (give each its own RANK"), out


def test_a_rank_with_another_world_size_is_told_so():
    port = free_port()
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DDPC_TOKEN="t-world")
    out = spawn_collect(_claim_main, [(dict(env, RANK="0", WORLD_SIZE="2"), {}, 3.0),
                                      (dict(env, RANK="1", WORLD_SIZE="3"), {}, 3.0)], 60)
    assert ("error", "MismatchError",
            "init_process_group: rank 1 has world_size 3, but rank 0 has 2: every rank must be "
            "started with the same WORLD_SIZE (ddpc.launch and torchrun set it for each, as "
            "--nnodes times --nproc-per-node, so every node must run the same --nproc-per-node; "
            "check world_size= or WORLD_SIZE where the ranks are started)") in out, out
    # Rank 0, waiting for rank 1 in the group's creation, learns why at once (it used to wait
    # out its timeout, 3 s here).
    peer = [o for o in out if o[0] == "error" and o[1] == "PeerError"]
    assert len(peer) == 1, out
    assert re.search(r"rank 1 failed in init_process_group \(pid \d+ on .+\) MismatchError: "
                     r"init_process_group: rank 1 has world_size 3, but rank 0 has 2", peer[0][2]), out


@pytest.fixture
def clean_env(monkeypatch):
    for k in LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    yield
    ddpc.destroy_process_group()


def test_missing_rank_says_how_to_launch(clean_env):
    with pytest.raises(ValueError, match="ddpc.launch"):
        ddpc.init_process_group(backend="cpu")


@pytest.mark.parametrize("env, match", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, r"^the environment's RANK=2 is not a rank of a world of 2 "
                                       r"processes \(the environment's WORLD_SIZE=2\)"),
    ({"SLURM_PROCID": "-1", "SLURM_NTASKS": "2"}, r"^the environment's SLURM_PROCID=-1 is not a "
                                                  r"rank"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, r"^the environment's WORLD_SIZE=0 is not valid: the world "
                                       r"size is the number of processes, at least 1$"),
])
def test_a_bad_rank_from_the_environment_names_the_variable(clean_env, monkeypatch, env, match):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        ddpc.init_process_group(backend="cpu")
    assert not ddpc.is_initialized()


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(backend="mpi"), ValueError, "backend='mpi'"),
    (dict(backend="cpu", init_method="http://x"), ValueError, "not supported"),
    (dict(backend="cpu", init_method="tcp://nohostport"), ValueError, "tcp://host:port"),
    (dict(backend="cpu", timeout=-1), ValueError, "timeout must be positive"),
    (dict(backend="cpu", timeout=float("nan")), ValueError, "timeout must be positive"),
    (dict(backend="cpu", timeout="10"), TypeError, "timeout must be"),
    (dict(backend="cpu", rank=3, world_size=2), ValueError,
     r"^init_process_group's rank=3 is not a rank of a world of 2 processes \(init_process_group"
     r"'s world_size=2\): ranks are 0 to 1"),
    (dict(backend="cpu", bogus=1), TypeError, "bogus"),
    (dict(backend="cpu", rank="0", world_size=1), TypeError,
     r"rank must be an int \(or -1 to read RANK from the environment\), got str '0'"),
    (dict(backend="cpu", rank=0.0, world_size=1), TypeError, "rank must be an int"),
    (dict(backend="cpu", rank=0, world_size=0), ValueError,
     r"world_size=0 is not valid: pass world_size >= 1, or -1 \(the default\) to read "
     r"WORLD_SIZE from the environment"),
    (dict(backend="cpu", rank=0, world_size=2 ** 40), ValueError, "world_size=1099511627776 is "
                                                                  "not valid"),
    (dict(backend="cpu", rank=-3, world_size=2), ValueError, "rank=-3 is not valid"),
    (dict(backend="cpu", init_method="tcp://127.0.0.1:70000", rank=0, world_size=1), ValueError,
     r"init_method port='70000' is not a TCP port: use a number from 1 to 65535"),
    (dict(backend="cpu", init_method="file:///no/such/folder/rdv", rank=0, world_size=1),
     ValueError, r"init_method file:///no/such/folder/rdv: rank 0 cannot write it \(No such file "
                 r"or directory\): the folder must exist"),
])
def test_bad_arguments(clean_env, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ddpc.init_process_group(**kwargs)
    assert not ddpc.is_initialized()


@pytest.mark.parametrize("port, match", [
    ("abc", r"MASTER_PORT='abc' is not a TCP port: use a number from 1 to 65535"),
    ("70000", r"MASTER_PORT='70000' is not a TCP port"),
    ("", "MASTER_PORT is not set"),
    ("0", "MASTER_PORT=0 cannot be used with more than one rank"),
])
def test_bad_master_port(clean_env, monkeypatch, port, match):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", port)
    monkeypatch.setenv("DDPC_TOKEN", "t")
    with pytest.raises(ValueError, match=match):
        ddpc.init_process_group(backend="cpu", rank=1, world_size=2)
    assert not ddpc.is_initialized()


@pytest.mark.parametrize("value", ["ten", "nan", "-5", "0", "inf"])
def test_bad_ddpc_timeout_variable(clean_env, monkeypatch, value):
    monkeypatch.setenv("DDPC_TIMEOUT", value)
    with pytest.raises(ValueError, match=f"DDPC_TIMEOUT={value} is not a setting: use a number "
                                         f"from 0.001 to 1e\\+09"):
        ddpc.init_process_group(backend="cpu", rank=0, world_size=1)
    assert not ddpc.is_initialized()


def test_ddpc_timeout_and_transport_variables_are_read(clean_env, monkeypatch):
    monkeypatch.setenv("DDPC_TIMEOUT", "12.5")
    monkeypatch.setenv("DDPC_CPU_TRANSPORT", "TCP")
    ddpc.init_process_group(backend="cpu", rank=0, world_size=1)
    assert ddpc.distributed._state.timeout == 12.5
    ddpc.destroy_process_group()
    monkeypatch.setenv("DDPC_CPU_TRANSPORT", "udp")
    with pytest.raises(ValueError, match="DDPC_CPU_TRANSPORT=udp is not a setting: use auto or "
                                         "shm or tcp"):
        ddpc.init_process_group(backend="cpu", rank=0, world_size=1)


_THREAD_NAMES = """
import sys
sys.path.insert(0, sys.argv[2])
import ddpc
from _procs import thread_names as names
ddpc.init_process_group(backend="cpu", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0,
                        world_size=1)
print("up", names())
ddpc.destroy_process_group()
# pthread_join returns once the thread has run its last line, a moment before the kernel removes
# its /proc/self/task entry: give a joined thread that moment (a thread still running stays).
import time
deadline = time.monotonic() + 5.0
while any(n.startswith("ddpc-") for n in names()) and time.monotonic() < deadline:
    time.sleep(0.01)
print("down", names())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc/self/task")
def test_ddpc_threads_are_named_and_joined(clean_env):
    """ps -L, top -H, py-spy and gdb show ddpc's threads by name; destroy_process_group ends
    them."""
    import subprocess
    r = subprocess.run([sys.executable, "-c", _THREAD_NAMES, str(free_port()),
                        os.path.dirname(os.path.abspath(__file__))],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    up = next(line for line in r.stdout.splitlines() if line.startswith("up "))
    down = next(line for line in r.stdout.splitlines() if line.startswith("down "))
    assert "'ddpc-comm'" in up and "'ddpc-store'" in up, up
    assert "ddpc-" not in down, down


def test_single_process_and_double_init(clean_env):
    import numpy as np
    ddpc.init_process_group(backend="cpu", rank=0, world_size=1)
    assert ddpc.is_initialized() and ddpc.get_world_size() == 1
    with pytest.raises(RuntimeError, match="already called"):
        ddpc.init_process_group(backend="cpu", rank=0, world_size=1)
    x = np.arange(4.0)
    ddpc.all_reduce(x, op="max")
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
    ddpc.destroy_process_group()
    assert not ddpc.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        ddpc.all_reduce(x)


def test_a_multi_node_master_addr_that_is_loopback_here_is_served_on_every_interface(
        monkeypatch):
    """Debian's /etc/hosts gives a host's own name 127.0.1.1. As MASTER_ADDR of a job that spans
    nodes, that name reaches node 0 from the others but is loopback on node 0 itself: rank 0
    serves the store on every interface then (saying so), and the TCP transport binds a
    non-loopback address. A literal loopback address (every node on one host) stays as it is."""
    import socket
    from ddpc import distributed as dist
    real = socket.gethostbyname
    monkeypatch.setattr(socket, "gethostbyname",
                        lambda name: "127.0.1.1" if name == "node0.example" else real(name))
    with pytest.warns(UserWarning, match=r"MASTER_ADDR=node0\.example resolves to 127\.0\.1\.1 on "
                                         r"this host .* serves the store on every interface"):
        assert dist._server_bind_addr("node0.example", multi_node=True) == "0.0.0.0"
    assert dist._server_bind_addr("node0.example", multi_node=False) == "127.0.1.1"
    assert dist._server_bind_addr("127.0.0.1", multi_node=True) == "127.0.0.1"
    reachable = dist._reachable_addr()
    assert reachable is None or not reachable.startswith("127."), reachable
    if reachable is not None:
        # served on every interface: a client reaches it at this host's network address
        with pytest.warns(UserWarning):
            server = dist._serve_store("node0.example", 0, "t-any", multi_node=True)
        try:
            dist._C.Store(reachable, server.port, "t-any", -1, 5.0).close()
        finally:
            server.stop()
    monkeypatch.setattr(dist, "_reachable_addr", lambda: "10.1.2.3")
    assert dist._local_addr_towards("node0.example", multi_node=True) == "10.1.2.3"
    assert dist._local_addr_towards("node0.example", multi_node=False) == "127.0.0.1"
    assert dist._local_addr_towards("127.0.0.1", multi_node=True) == "127.0.0.1"
