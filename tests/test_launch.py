"""Tests of python -m ddpc.launch with real worker processes: environment, output prefixes,
failure summaries, restarts, module mode, Ctrl-C, GPU selection (through a stand-in
nvidia-smi) and argument errors."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import types

import pytest

from _procs import finish_all, free_port, start

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYDIR = os.path.join(ROOT, "python")

pytestmark = pytest.mark.timeout(60)


def launcher_env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PYDIR, env.get("PYTHONPATH")) if p)
    for key in ("OMP_NUM_THREADS", "DDPC_TOKEN", "CUDA_VISIBLE_DEVICES"):
        env.pop(key, None)
    env.update(extra)
    return env


def launch(args, tmp_path, timeout=40, env=None):
    """Runs the launcher to completion; returns (exit code, stdout, stderr, seconds)."""
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "ddpc.launch"] + args, cwd=tmp_path,
                         env=env or launcher_env(), capture_output=True, text=True,
                         errors="replace", timeout=timeout)
    return res.returncode, res.stdout, res.stderr, time.monotonic() - t0


def write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def pid_alive(pid):
    """True while pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_gone(pids, seconds=5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


def start_printing_pids(args, tmp_path, n=2):
    """Starts the launcher on ranks that print "PID <pid>" first; returns (the launcher's
    process, the n ranks' pids) once all have printed (the process is killed on failure)."""
    proc = subprocess.Popen([sys.executable, "-m", "ddpc.launch"] + args, cwd=tmp_path,
                            env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    pids = []
    deadline = time.monotonic() + 30
    while len(pids) < n and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.search(r"PID (\d+)", line)
        if m:
            pids.append(int(m.group(1)))
    if len(pids) < n:
        proc.kill()
        proc.wait()
        raise AssertionError(f"only {len(pids)} of {n} ranks started")
    return proc, pids


ENV_KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
            "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
            "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS", "DDPC_TOKEN",
            "DDPC_ERROR_FILE", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"]

ENV_SCRIPT = f"""
    import json, os, sys
    info = {{k: os.environ.get(k) for k in {ENV_KEYS!r}}}
    info.update(argv=sys.argv, path0=sys.path[0], name=__name__)
    print("ENV " + json.dumps(info))
"""


def signal_and_finish(proc, sig):
    """Sends sig to the launcher and returns its remaining (stdout, stderr) once it exited."""
    try:
        proc.send_signal(sig)
        return proc.communicate(timeout=20)
    finally:
        proc.kill()
        proc.wait()


def env_reports(stdout):
    """{rank: info} from the ENV lines, checking each carries its own rank's prefix."""
    reports = {}
    for m in re.finditer(r"^\[rank(\d+)\]: ENV (.*)$", stdout, re.M):
        info = json.loads(m.group(2))
        assert info["RANK"] == m.group(1), "line prefixed with another rank"
        reports[int(info["RANK"])] = info
    return reports


def test_env_vars_for_two_ranks(tmp_path):
    write(tmp_path, "show_env.py", ENV_SCRIPT)
    rc, out, err, _ = launch(["--nproc-per-node", "2", "show_env.py", "--lr", "3e-5"], tmp_path)
    assert rc == 0, err
    reports = env_reports(out)
    assert sorted(reports) == [0, 1]
    r0, r1 = reports[0], reports[1]
    for r, info in reports.items():
        assert info["LOCAL_RANK"] == info["ROLE_RANK"] == str(r)
        assert info["WORLD_SIZE"] == info["LOCAL_WORLD_SIZE"] == info["ROLE_WORLD_SIZE"] == "2"
        assert info["GROUP_RANK"] == "0"
        assert info["MASTER_ADDR"] == "127.0.0.1"
        assert 1 <= int(info["MASTER_PORT"]) <= 65535
        assert info["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert info["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert info["OMP_NUM_THREADS"] == "1"
        assert re.fullmatch(r"[0-9a-f]{32}", info["DDPC_TOKEN"])
        assert info["DDPC_ERROR_FILE"].endswith(f"rank{r}-error.json")
        assert info["CUDA_VISIBLE_DEVICES"] is None
        # The script runs as `python show_env.py --lr 3e-5` would run it.
        assert info["argv"] == ["show_env.py", "--lr", "3e-5"]
        assert info["path0"] == str(tmp_path)
        assert info["name"] == "__main__"
    for key in ("MASTER_PORT", "DDPC_TOKEN", "TORCHELASTIC_RUN_ID"):
        assert r0[key] == r1[key], key
    assert "OMP_NUM_THREADS=1" in err  # the one-line notice

    # A token given in the environment is kept (multi-node jobs share one); a fresh one otherwise.
    rc, out2, err, _ = launch(["--nproc-per-node", "1", "show_env.py"], tmp_path,
                              env=launcher_env(DDPC_TOKEN="feedbeef", OMP_NUM_THREADS="3"))
    assert rc == 0, err
    info = env_reports(out2)[0]
    assert info["DDPC_TOKEN"] == "feedbeef"
    assert info["OMP_NUM_THREADS"] == "3"
    rc, out3, err, _ = launch(["--nproc-per-node", "1", "show_env.py"], tmp_path)
    assert env_reports(out3)[0]["DDPC_TOKEN"] != r0["DDPC_TOKEN"]


def test_settings_that_slow_gpu_training_are_warned_about_for_gpu_jobs_only(tmp_path):
    from ddpc.launch import setting_warnings
    env = {"NCCL_PROTO": "LL128", "CUDA_LAUNCH_BLOCKING": "1", "NCCL_NVLS_ENABLE": "0"}
    got = setting_warnings(env, uses_gpus=True)
    assert len(got) == 2, got
    assert got[0].startswith("NCCL_PROTO=LL128 limits the protocols NCCL may pick"), got
    assert got[1].startswith("CUDA_LAUNCH_BLOCKING=1"), got
    assert all(w.endswith("(python -m ddpc.doctor lists every setting)") for w in got)
    assert setting_warnings({"NCCL_NVLS_ENABLE": "0"}, uses_gpus=True) == []
    assert setting_warnings(env, uses_gpus=False) == []
    # which jobs count as GPU jobs: as many ranks with a GPU as there are GPUs to give
    from ddpc.launch import plan_devices
    assert plan_devices(None, 2, gpu_count=lambda: 2).gpus == 2
    assert plan_devices(None, 3, gpu_count=lambda: 2).gpus == 2
    assert plan_devices(None, 2, gpu_count=lambda: 0).gpus == 0
    # more ranks than GPUs: each has a GPU only when DDPC_SHARE_GPUS=1 lets them share
    short = plan_devices(None, 3, gpu_count=lambda: 2)
    assert short.rank_gpus[2] is None and "DDPC_SHARE_GPUS=1 lets ranks share" in short.notes[0]
    with pytest.raises(ValueError, match="DDPC_SHARE_GPUS=1 to run more ranks than GPUs"):
        plan_devices("0", 2, gpu_count=lambda: 1)
    # a job on CPUs says nothing of NCCL's settings
    write(tmp_path, "show_env.py", ENV_SCRIPT)
    rc, out, err, _ = launch(["--nproc-per-node", "1", "show_env.py"], tmp_path,
                             env=launcher_env(NCCL_PROTO="LL128", CUDA_VISIBLE_DEVICES=""))
    assert rc == 0, err
    assert "NCCL_PROTO" not in err, err


def test_a_bad_ddpc_setting_stops_the_launch_and_a_misspelt_one_is_named(tmp_path):
    """A DDPC_* value that is not a setting: no rank starts (each would refuse it), exit 2 with
    what it takes. A DDPC_* name ddpc does not read, or a misspelt CUDA_VISIBLE_DEVICES: a
    warning naming the likely setting, and the job runs."""
    write(tmp_path, "mark.py", """
        import os
        open(f"ran{os.environ['RANK']}", "w").close()
    """)
    rc, out, err, _ = launch(["--nproc-per-node", "2", "mark.py"], tmp_path,
                             env=launcher_env(DDPC_GRAD_BATCH="sometimes"))
    assert rc == 2, (rc, out, err)
    assert "DDPC_GRAD_BATCH=sometimes is not a setting: use 1 or 0" in err, err
    assert "fix or unset DDPC_GRAD_BATCH" in err, err
    assert not list(tmp_path.glob("ran*")), "a rank started"
    rc, out, err, _ = launch(["--nproc-per-node", "2", "mark.py"], tmp_path,
                             env=launcher_env(DDPC_GRAD_BACH="0", CUDA_VISIBLE_DEVICE="1"))
    assert rc == 0, err
    assert ("ddpc.launch: warning: DDPC_GRAD_BACH is not a ddpc setting, so it changes nothing "
            "(did you mean DDPC_GRAD_BATCH?)") in err, err
    assert ("ddpc.launch: warning: CUDA_VISIBLE_DEVICE=1 is not CUDA's setting "
            "(CUDA_VISIBLE_DEVICES), so it hides no GPU") in err, err
    assert sorted(p.name for p in tmp_path.glob("ran*")) == ["ran0", "ran1"]


def test_output_is_prefixed_per_rank_and_stream(tmp_path):
    write(tmp_path, "talk.py", """
        import os, sys, time
        r = os.environ["RANK"]
        print(f"hello from {r}")
        print(f"warning from {r}", file=sys.stderr)
        sys.stdout.buffer.write(b"bytes \\xff\\xfe\\x00 end\\n")
        sys.stdout.write("progress 10%\\rprogress 100%\\n")
        sys.stdout.write(f"no newline {r}")
        sys.stdout.flush()
        time.sleep(1.5)  # longer than the launcher's partial-line wait
    """)
    rc, out, err, _ = launch(["--nproc-per-node", "2", "talk.py"], tmp_path)
    assert rc == 0, err
    lines = out.splitlines()
    assert all(re.match(r"\[rank[01]\]: ", ln) for ln in lines), lines
    for r in (0, 1):
        assert f"[rank{r}]: hello from {r}" in lines
        assert f"[rank{r}]: warning from {r}" in err.splitlines()
        assert f"[rank{r}]: warning from {r}" not in lines
        assert f"[rank{r}]: no newline {r}" in lines
        assert f"[rank{r}]: progress 100%" in lines
        assert any(ln.startswith(f"[rank{r}]: bytes ") and ln.endswith(" end") for ln in lines)


def test_exception_summary_and_others_stopped(tmp_path):
    write(tmp_path, "fail.py", """
        import os, subprocess, time
        def explode():
            raise ValueError("bad shape 3x4")
        if os.environ["RANK"] == "1":
            while not os.path.exists("rank0-ready"):  # fail once rank 0 is asleep
                time.sleep(0.05)
            explode()
        child = subprocess.Popen(["sleep", "60"])
        print(f"PIDS {os.getpid()} {child.pid}", flush=True)
        open("rank0-ready", "w").close()
        time.sleep(60)
    """)
    rc, out, err, elapsed = launch(["--nproc-per-node", "2", "fail.py"], tmp_path)
    assert rc == 1
    assert elapsed < 20, "the sleeping rank was not stopped promptly"
    assert "rank 1 (local rank 1" in err and "failed first: exit code 1" in err
    assert "rank 1 raised ValueError: bad shape 3x4" in err
    summary = err[err.index("failed first"):]
    assert re.search(r'File ".*fail\.py", line 4, in explode', summary)
    assert "ddpc/_worker.py" not in summary  # the traceback starts at the user's code
    assert "rank 0: stopped by the launcher (SIGTERM)" in summary
    pids = [int(p) for p in re.search(r"\[rank0\]: PIDS (\d+) (\d+)", out).groups()]
    assert wait_gone(pids) == [], "rank 0 or its child survived"


COLLECTIVE_SCRIPT = """
    import os
    import numpy as np
    import ddpc
    ddpc.init_process_group()
    x = np.full(8, ddpc.get_rank() + 1.0, dtype=np.float32)
    ddpc.all_reduce(x)
    print(f"SUM {x[0]} {ddpc.get_world_size()}", flush=True)
    if os.environ.get("FAIL_RANK") == str(ddpc.get_rank()):
        raise RuntimeError("this rank gives up after the first all_reduce")
    ddpc.all_reduce(x)  # the others wait here for a rank that failed
    ddpc.destroy_process_group()
"""


def test_ranks_join_a_real_process_group(tmp_path):
    write(tmp_path, "collective.py", COLLECTIVE_SCRIPT)
    rc, out, err, _ = launch(["--nproc-per-node", "2", "collective.py"], tmp_path)
    assert rc == 0, err
    assert "[rank0]: SUM 3.0 2" in out and "[rank1]: SUM 3.0 2" in out

    rc, out, err, elapsed = launch(["--nproc-per-node", "2", "collective.py"], tmp_path,
                                   env=launcher_env(FAIL_RANK="1"))
    assert rc == 1
    assert elapsed < 30, "the rank waiting for the failed one was not stopped"
    assert "rank 1 (local rank 1" in err and "failed first" in err
    assert "RuntimeError: this rank gives up after the first all_reduce" in err


def test_sigkill_is_reported_as_likely_oom(tmp_path):
    write(tmp_path, "oom.py", """
        import os, signal, sys, time
        if os.environ["RANK"] == "0":
            print("allocating a lot", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    rc, _, err, elapsed = launch(["--nproc-per-node", "2", "oom.py"], tmp_path)
    assert rc == 128 + 9
    assert elapsed < 20
    assert "rank 0" in err and "signal SIGKILL" in err
    assert "out-of-memory" in err
    assert "allocating a lot" in err[err.index("failed first"):]  # stderr tail, no traceback


def test_exit_code_is_passed_on(tmp_path):
    write(tmp_path, "three.py", """
        import os, sys
        sys.exit(3 if os.environ["RANK"] == "1" else 0)
    """)
    rc, _, err, _ = launch(["--nproc-per-node", "2", "three.py"], tmp_path)
    assert rc == 3
    assert "rank 1 (local rank 1" in err and "failed first: exit code 3" in err


def test_max_restarts_restarts_the_group(tmp_path):
    write(tmp_path, "flaky.py", """
        import os
        n = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        print(f"ATTEMPT {n} {os.environ['DDPC_TOKEN']}", flush=True)
        if n == 0 and os.environ["RANK"] == "1":
            raise RuntimeError("transient failure")
    """)
    rc, out, err, _ = launch(["--nproc-per-node", "2", "--max-restarts", "1", "flaky.py"],
                             tmp_path)
    assert rc == 0, err
    attempts = {(r, n): t for r, n, t in
                re.findall(r"^\[rank(\d)\]: ATTEMPT (\d) (\w+)$", out, re.M)}
    # Rank 0 may be stopped before it prints in attempt 0; everything else must be there.
    assert {("1", "0"), ("0", "1"), ("1", "1")} <= set(attempts), attempts
    assert attempts[("1", "0")] != attempts[("1", "1")], "a restart must get a fresh token"
    assert "restarting all 2 local ranks (restart 1 of 1)" in err
    assert "RuntimeError: transient failure" in err

    rc, _, err, _ = launch(["--nproc-per-node", "2", "flaky.py"], tmp_path)
    assert rc == 1 and "restarting" not in err and "gave up" not in err


def test_module_mode(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    write(pkg, "train.py", ENV_SCRIPT)
    rc, out, err, _ = launch(["--nproc-per-node", "2", "-m", "mypkg.train", "--epochs", "1"],
                             tmp_path)
    assert rc == 0, err
    reports = env_reports(out)
    assert sorted(reports) == [0, 1]
    for info in reports.values():
        assert info["name"] == "__main__"
        assert info["argv"] == [str(pkg / "train.py"), "--epochs", "1"]
        assert info["path0"] == str(tmp_path)


def test_ctrl_c_stops_every_worker(tmp_path):
    write(tmp_path, "sleepy.py", """
        import os, time
        print(f"PID {os.getpid()}", flush=True)
        time.sleep(60)
    """)
    proc, pids = start_printing_pids(["--nproc-per-node", "2", "sleepy.py"], tmp_path)
    rest, err = signal_and_finish(proc, signal.SIGINT)
    assert proc.returncode == 130, err
    assert "got SIGINT: stopped 2 running rank(s) with SIGINT\n" in err, err  # no SIGKILL
    assert "KeyboardInterrupt" in err  # the workers got SIGINT first, not a bare kill
    assert wait_gone(pids) == []


def test_multi_node_ranks_on_one_host(tmp_path):
    write(tmp_path, "show_env.py", ENV_SCRIPT)
    env = launcher_env(DDPC_TOKEN="0123456789abcdef")
    procs = [start([sys.executable, "-m", "ddpc.launch", "--nnodes", "2", "--node-rank",
                    str(node), "--master-addr", "127.0.0.1", "--nproc-per-node", "2",
                    "show_env.py"], env, cwd=tmp_path) for node in (0, 1)]
    reports = {}
    for rc, out, err in finish_all(procs, 40):
        assert rc == 0, err
        reports.update(env_reports(out))
    assert sorted(reports) == [0, 1, 2, 3]
    for r, info in reports.items():
        assert info["GROUP_RANK"] == str(r // 2)
        assert info["LOCAL_RANK"] == str(r % 2)
        assert info["WORLD_SIZE"] == "4" and info["LOCAL_WORLD_SIZE"] == "2"
        assert info["MASTER_PORT"] == "29500"
        assert info["DDPC_TOKEN"] == "0123456789abcdef"
        assert info["TORCHELASTIC_RUN_ID"] == "none"


def test_nodes_with_different_nproc_per_node_fail_fast_on_every_node(tmp_path):
    """Node 0 runs 3 ranks, node 1 two: their ranks and WORLD_SIZE disagree. Node 1's ranks fail
    at once (a rank claimed twice, another world size); node 0's used to wait out the whole
    timeout for ranks that never came. They now fail within seconds too, saying why."""
    write(tmp_path, "join.py", """\
        import ddpc
        ddpc.init_process_group(backend="cpu")
        ddpc.barrier()
    """)
    env = launcher_env(DDPC_TOKEN="0123456789abcdef", DDPC_TIMEOUT="60")
    port = free_port()
    t0 = time.monotonic()
    procs = [start([sys.executable, "-m", "ddpc.launch", "--nnodes", "2", "--node-rank",
                    str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                    "--nproc-per-node", str(nproc), "join.py"], env, cwd=tmp_path)
             for node, nproc in ((0, 3), (1, 2))]
    (rc0, _, err0), (rc1, _, err1) = finish_all(procs, 90)
    elapsed = time.monotonic() - t0
    assert rc0 == 1 and rc1 == 1, (err0, err1)
    assert elapsed < 30, f"took {elapsed:.0f} s (the timeout is 60 s):\n{err0}"
    summary0 = err0[err0.index("failed first"):]
    assert re.search(r"(each|every) node must run the same --nproc-per-node", summary0), summary0
    assert "world_size 4, but rank 0 has 6" in summary0 or "claim" in summary0, summary0


def test_torchrun_multi_node_flags(tmp_path):
    """A torchrun multi-node command carries over: elastic N:N, c10d, endpoint, id, underscores."""
    write(tmp_path, "show_env.py", ENV_SCRIPT)
    env = launcher_env(DDPC_TOKEN="0123456789abcdef")
    port = free_port()
    procs = [start([sys.executable, "-m", "ddpc.launch", "--nnodes=2:2", f"--node_rank={node}",
                    "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=job7",
                    "--nproc_per_node=1", "show_env.py"], env, cwd=tmp_path) for node in (0, 1)]
    reports = {}
    for rc, out, err in finish_all(procs, 40):
        assert rc == 0, err
        reports.update(env_reports(out))
    assert sorted(reports) == [0, 1]
    for r, info in reports.items():
        assert info["GROUP_RANK"] == str(r) and info["WORLD_SIZE"] == "2"
        assert info["MASTER_ADDR"] == "127.0.0.1" and info["MASTER_PORT"] == str(port)
        assert info["TORCHELASTIC_RUN_ID"] == "job7"
    # Without --node-rank, torchrun would number the nodes; ddpc asks for it.
    rc, _, err, _ = launch(["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1", "show_env.py"],
                           tmp_path, env=env)
    assert rc == 2 and "argument --node-rank: required with --nnodes 2" in err


FAKE_SMI = """#!/bin/sh
case "$1" in
  --query-gpu=*)
    echo "0, 00000000:18:00.0, GPU-aaaa, NVIDIA H200, 1000, 143771"
    echo "1, 00000000:2A:00.0, GPU-bbbb, NVIDIA H200, 100000, 143771"
    echo "2, 00000000:3A:00.0, GPU-cccc, NVIDIA H200, 140000, 143771" ;;
  --query-compute-apps=*)
    echo "GPU-aaaa, 4242" ;;
  *) exit 1 ;;
esac
"""


def fake_smi_env(tmp_path, **extra):
    """The launcher's environment with FAKE_SMI first on PATH as nvidia-smi."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    return launcher_env(PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}", **extra)


def test_gpu_selection_through_nvidia_smi(tmp_path):
    write(tmp_path, "show_env.py", ENV_SCRIPT)
    env = fake_smi_env(tmp_path)

    rc, out, err, _ = launch(["--gpus", "auto", "--nproc-per-node", "2", "show_env.py"],
                             tmp_path, env=env)
    assert rc == 0, err
    reports = env_reports(out)
    assert sorted(reports) == [0, 1]
    for info in reports.values():  # GPU 0 runs someone else's process
        assert info["CUDA_VISIBLE_DEVICES"] == "1,2"
        assert info["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert re.search(r"rank 0 -> GPU 1 \(00000000:2A:00\.0, NVIDIA H200, 97\.7 of", err)
    assert re.search(r"rank 1 -> GPU 2 \(00000000:3A:00\.0, NVIDIA H200, 136\.7 of", err)

    rc, out, err, _ = launch(["--gpus", "2,0", "show_env.py"], tmp_path, env=env)
    assert rc == 0, err
    assert [i["CUDA_VISIBLE_DEVICES"] for i in env_reports(out).values()] == ["2,0", "2,0"]

    rc, _, err, _ = launch(["--gpus", "auto", "--nproc-per-node", "3", "show_env.py"],
                           tmp_path, env=env)
    assert rc == 2 and "argument --gpus" in err and "GPU 0: pids 4242" in err
    rc, _, err, _ = launch(["--gpus", "1,5", "show_env.py"], tmp_path, env=env)
    assert rc == 2 and "GPU index 5 is not present" in err and "0, 1, 2" in err


@pytest.mark.parametrize("args, message", [
    (["--nproc-per-node", "0", "ok.py"], "argument --nproc-per-node"),
    (["--nproc-per-node", "two", "ok.py"], "expected a positive integer up to 65536, or auto, "
                                           "cpu or gpu, got 'two'"),
    (["--nproc-per-node", str(10 ** 12), "ok.py"], "or auto, cpu or gpu, got '1000000000000'"),
    (["--nnodes", "3000000000", "--node-rank", "0", "--nproc-per-node", "1", "ok.py"],
     "--nnodes 3000000000 times --nproc-per-node 1 is 3000000000 ranks; a job has at most"),
    (["--nnodes", "3000000000", "--node-rank", "0", "ok.py"],
     "argument --nnodes: 3000000000 nodes; a job has at most 2147483647"),
    (["--no-python", "ok.py"], "no program 'ok.py' on PATH"),
    (["--no-python", "./ok.py"], "'./ok.py' is not executable: chmod +x it, or leave "
                                 "--no-python out"),
    (["--no-python", "./none.sh"], "'./none.sh' not found"),
    (["--no-python", "-m", "json"], "argument --no-python: not with -m"),
    (["-r", "4", "ok.py"], "argument -r/--redirects: expected 0 (none), 1 (stdout), 2 (stderr) "
                           "or 3 (both), or per local rank as 0:3,1:1, got '4'"),
    (["--tee", "0:1,x:2", "ok.py"], "argument -t/--tee: expected LOCAL_RANK:CODE pairs"),
    (["--tee", "0:1,3:2", "ok.py"], "argument --tee: local rank 3 is not on this node, which "
                                    "runs local ranks 0..0"),
    (["--local-ranks-filter", "0,-1", "ok.py"], "expected local ranks separated by commas"),
    (["--nproc-per-node", "2", "--local_ranks_filter", "2", "ok.py"],
     "argument --local-ranks-filter: local rank 2 is not on this node, which runs local ranks "
     "0..1"),
    (["--rdzv_conf", "a=1", "ok.py"], "argument --rdzv-conf: torchrun's flag is not supported"),
    (["--virtual-local-rank", "ok.py"], "argument --virtual-local-rank: torchrun's flag is not "
                                        "supported: ddpc binds each rank to GPU LOCAL_RANK"),
    (["--numa_binding", "node", "ok.py"], "argument --numa-binding: torchrun's flag is not "
                                          "supported: ddpc.launch does not pin ranks to CPUs"),
    (["--logs-specs", "mine", "ok.py"], "argument --logs-specs: torchrun's flag is not "
                                        "supported: ddpc.launch has no pluggable log layout"),
    (["--event_log_handler", "console", "ok.py"], "argument --event-log-handler: torchrun's "
                                                  "flag is not supported"),
    (["--signals-to-handle", "SIGTERM,SIGKILL", "ok.py"], "SIGKILL cannot be caught"),
    (["--signals_to_handle", "SIGUSR3", "ok.py"], "'SIGUSR3' is not a signal here"),
    (["--local-addr", "192.0.2.77", "ok.py"], "argument --local-addr: '192.0.2.77' is not an "
                                              "address of this host"),
    (["--run-path", "-m", "json.tool"], "argument --run-path: runs a script file"),
    (["missing.py"], "'missing.py' not found"),
    (["."], "'.' is a directory without __main__.py"),
    (["-m", "no_such_module_xyz"], "no module named 'no_such_module_xyz'"),
    (["--gpus", "1,1", "ok.py"], "argument --gpus: GPU indices must be distinct"),
    (["--gpus", "0", "--nproc-per-node", "2", "ok.py"], "lists 1 GPU(s) but --nproc-per-node"),
    (["--nnodes", "2", "ok.py"], "argument --master-addr: required"),
    (["--nnodes", "2", "--master-addr", "10.0.0.1", "ok.py"], "export DDPC_TOKEN="),
    (["--node-rank", "1", "ok.py"], "argument --node-rank: 1 is not below --nnodes 1"),
    (["--master-port", "70000", "ok.py"], "argument --master-port"),
    (["--timeout-kill", "-1", "ok.py"], "argument --timeout-kill"),
    # A stop must end: a rank that ignores SIGTERM gets SIGKILL after at most an hour.
    (["--timeout-kill", "inf", "ok.py"], "expected a number of seconds above 0 and at most 3600"),
    (["--timeout-kill", "nan", "ok.py"], "argument --timeout-kill/--timeout_kill: expected"),
    (["--shutdown_timeout", "0", "ok.py"], "argument --shutdown-timeout/--shutdown_timeout: "
                                           "expected a number of seconds above 0"),
    (["--shutdown-timeout", "3", "--timeout-kill", "4", "ok.py"],
     "argument --shutdown-timeout: 3 differs from --timeout-kill 4 (torchrun's name for the "
     "same thing)"),
    (["--timeout-kill", "1e300", "ok.py"], "at most 3600 (how long ranks get to exit"),
    (["--timeout-kill", "0", "ok.py"], "got '0'"),
    (["-m", "os.nonexistent"], "no module named 'os.nonexistent': 'os' is a module"),
    (["-m", "json.nonexistent"], "package 'json' ("),
    (["-m", "no_such_pkg_xyz.train"], "no module named 'no_such_pkg_xyz.train': there is no "
                                      "package 'no_such_pkg_xyz'"),
    (["-m", "mypkg..train"], "'mypkg..train' is not a module name"),
    (["--nnodes", "1:2", "ok.py"], "'1:2' is an elastic range, and ddpc runs a fixed number"),
    (["--rdzv-backend", "etcd", "ok.py"], "argument --rdzv-backend: 'etcd' is not supported"),
    (["--rdzv-endpoint", "h0:x", "ok.py"], "argument --rdzv-endpoint/--rdzv_endpoint: expected"),
    (["--rdzv-endpoint", "h0:1234", "--master-port", "99", "ok.py"],
     "port 1234 differs from --master-port 99"),
    (["--rdzv_id", "a", "--run-id", "b", "ok.py"], "'a' differs from --run-id 'b'"),
])
def test_bad_arguments_are_named(tmp_path, args, message):
    write(tmp_path, "ok.py", "print('ran')\n")
    rc, out, err, _ = launch(args, tmp_path)
    assert rc == 2
    assert message in err
    assert "ran" not in out


def test_a_missing_script_or_module_says_what_is_missing(tmp_path):
    """-m with nothing after it asks for a module name; no arguments at all ask for the script;
    neither says its arguments are required (they are not)."""
    rc, _, err, _ = launch(["--nproc-per-node", "2", "-m"], tmp_path)
    assert rc == 2
    assert "argument -m/--module: expected a module name after -m" in err, err
    assert "script_args" not in err
    rc, _, err, _ = launch([], tmp_path)
    assert rc == 2
    assert err.rstrip().endswith("the following arguments are required: script.py|module"), err


def test_a_misspelt_submodule_is_refused_without_running_the_package(tmp_path):
    """-m pkg.typo: refused before any rank starts, naming the module and the package's
    directory, and without importing the package in the launcher (its __init__ is user code).
    A package whose __init__ could provide submodules some other way is left to the ranks."""
    for pkg, init in (("mypkg", "open('imported', 'w').close()\n"),
                      ("extended", "import pkgutil\n__path__ = pkgutil.extend_path(__path__, "
                                   "__name__)\n")):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text(init)
        write(tmp_path / pkg, "train.py", "print('ran')\n")
    (tmp_path / "nspkg").mkdir()  # a namespace package: no __init__ at all
    write(tmp_path / "nspkg", "train.py", "print('ran')\n")
    for module, where in (("mypkg.trian", "mypkg"), ("nspkg.trian", "nspkg")):
        rc, out, err, _ = launch(["--nproc-per-node", "2", "-m", module], tmp_path)
        assert rc == 2, (rc, out, err)
        assert (f"argument -m/--module: no module named '{module}': package '{where}' "
                f"({tmp_path / where}) has no module or subpackage 'trian'") in err, err
        assert "ran" not in out
        assert not (tmp_path / "imported").exists(), "the launcher ran the package's __init__"
    rc, out, err, _ = launch(["--nproc-per-node", "2", "-m", "nspkg.train"], tmp_path)
    assert rc == 0 and "[rank1]: ran" in out, err
    rc, out, err, _ = launch(["--nproc-per-node", "2", "-m", "extended.trian"], tmp_path)
    assert rc == 1 and "No module named extended.trian" in err, err


class _FailsWhileWatched:
    """A WorkerGroup stand-in whose only rank exits with status 1 right after the watcher has
    asked for failures (the window between that question and the next one)."""

    def __init__(self):
        from types import SimpleNamespace

        from ddpc.launch import Worker
        self.workers = [Worker(0, 0, SimpleNamespace(pid=2 ** 22 + 1))]

    def failures(self):
        failed = [w for w in self.workers if w.returncode not in (None, 0)]
        for w in self.workers:
            if w.returncode is None:
                w.returncode, w.exited_at = 1, time.monotonic()
        return failed

    def running(self):
        return [w for w in self.workers if w.returncode is None]

    def stop(self, *args, **kwargs):
        pass

    def finish(self):
        pass

    def wait_change(self, timeout):
        pass


def test_rank_failing_during_the_watch_is_not_a_success(capsys):
    """The launcher's and notebook_launcher's watch loops report a rank that fails between
    their look for failures and their look for running ranks (it used to count as success)."""
    sys.path.insert(0, PYDIR)
    from ddpc.launch import Launcher
    from ddpc.notebook import WorkerError, _wait
    launcher = Launcher(types.SimpleNamespace(plan=types.SimpleNamespace(rank_gpus=None)))
    status, failed = launcher.watch(_FailsWhileWatched())
    assert (status, failed is not None) == (1, True)
    assert "rank 0 (local rank 0" in capsys.readouterr().err
    with pytest.raises(WorkerError, match="rank 0 died with exit code 1"):
        _wait(_FailsWhileWatched(), 1, "/nonexistent", None, False)


# A rank that runs out of GPU memory: torch's own exception type and message format (this CPU
# machine cannot run out for real; tests/test_gpu.py does on the GPUs). OOM_RANK raises, naming
# "GPU OOM_GPU" as torch does; the fake nvidia-smi shows pid 4242 on physical GPU 0.
OOM_SCRIPT = """
    import os, time
    import torch
    if os.environ["RANK"] == os.environ["OOM_RANK"]:
        while not os.path.exists("others-ready"):
            time.sleep(0.05)
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU " + os.environ["OOM_GPU"] +
            " has a total capacity of 139.81 GiB of which 1.06 GiB is free.")
    open("others-ready", "w").close()
    time.sleep(60)
"""


@pytest.mark.parametrize("oom_rank, oom_gpu", [("0", "0"), ("1", "0")], ids=["own", "other"])
def test_cuda_oom_is_explained(tmp_path, oom_rank, oom_gpu):
    write(tmp_path, "oom.py", OOM_SCRIPT)
    env = fake_smi_env(tmp_path, OOM_RANK=oom_rank, OOM_GPU=oom_gpu)
    rc, _, err, _ = launch(["--gpus", "0,1", "oom.py"], tmp_path, env=env)
    assert rc == 1
    summary = " ".join(err[err.index("failed first"):].split())  # unwrapped
    assert f"rank {oom_rank} raised torch.OutOfMemoryError: CUDA out of memory" in summary
    assert (f"rank {oom_rank} ran out of GPU memory on cuda:0 (physical GPU 0, "
            f"00000000:18:00.0)") in summary
    if oom_rank == "1":
        # Rank 1 allocated on rank 0's GPU: the script used a fixed device.
        assert "That is not its own GPU: rank 1 works on cuda:1" in summary
        assert "ddpc.device()" in summary
        assert "Data parallelism splits the batch" not in summary
    else:
        assert "not its own GPU" not in summary
        assert "Other processes hold memory on physical GPU 0: pid 4242" in summary
        assert "Data parallelism splits the batch, not the model" in summary


def test_oom_report_details():
    """The explanation from a report's memory facts: the figures, fragmentation, no GPU info."""
    from ddpc import _oom
    gib = 1 << 30
    report = {"memory": {"kind": "cuda", "failed_device": 1, "bound_device": 1,
                         "allocated": 60 * gib, "reserved": 75 * gib, "peak_allocated": 70 * gib,
                         "free": gib // 2, "total": 80 * gib}}
    text = " ".join(_oom.explain(report, 3))
    assert text.startswith("rank 3 ran out of GPU memory on cuda:1.")
    assert ("This process held 60.0 GiB in tensors (peak 70.0 GiB), 75.0 GiB reserved by "
            "PyTorch's caching allocator; the GPU had 0.5 GiB free of 80.0 GiB.") in text
    assert "15.0 GiB of that was reserved but not in use" in text
    assert "expandable_segments:True" in text
    report["memory"]["reserved"] = 61 * gib
    assert "fragmentation" not in " ".join(_oom.explain(report, 3))
    assert _oom.explain({"message": "x"}, 0) == []
    assert _oom.explain({"memory": {"kind": "cuda"}}, 2)[0] == "rank 2 ran out of GPU memory on its GPU."
    # Facts of a non-OOM exception: none.
    assert _oom.facts(ValueError("shape")) is None
    f = _oom.facts(RuntimeError("CUDA out of memory. Tried ... (GPU 2; 79.15 GiB total capacity)"))
    assert f is not None and f["failed_device"] == 2


# Rank 1 hangs outside any collective; rank 0's next all_reduce times out (3 s) naming it.
HANG_SCRIPT = """
    import time
    import numpy as np
    import ddpc
    ddpc.init_process_group(timeout=3)
    x = np.ones(4, dtype=np.float32)
    ddpc.all_reduce(x)

    def load_next_batch():
        time.sleep(60)  # rank 1 is stuck here

    if ddpc.get_rank() == 1:
        load_next_batch()
    ddpc.all_reduce(x)
"""


def test_a_hang_shows_where_the_missing_rank_was(tmp_path):
    write(tmp_path, "hang.py", HANG_SCRIPT)
    rc, _, err, elapsed = launch(["--nproc-per-node", "2", "hang.py"], tmp_path)
    assert rc == 1
    assert elapsed < 25
    summary = err[err.index("failed first"):]
    assert "rank 0 (local rank 0" in err and "DistributedTimeoutError" in summary
    assert "rank 1" in summary.split("\n")[1]  # the timeout names the rank that never came
    other = summary[summary.index("other ranks:"):]
    assert "rank 1: stopped by the launcher (SIGTERM)" in other
    assert "where its threads were when asked" in other
    assert re.search(r'File ".*hang\.py", line 10 in load_next_batch', other), other
    assert re.search(r'File ".*hang\.py", line 13 in <module>', other), other
    assert "ddpc/_worker.py" not in other and "frozen runpy" not in other


def test_no_stacks_for_an_ordinary_failure(tmp_path):
    """A rank's own error (not a timeout waiting for others) does not dump the others' stacks."""
    write(tmp_path, "collective.py", COLLECTIVE_SCRIPT)
    rc, _, err, _ = launch(["--nproc-per-node", "2", "collective.py"], tmp_path,
                           env=launcher_env(FAIL_RANK="1"))
    assert rc == 1
    assert "where its threads were" not in err


def test_log_dir_keeps_each_rank_and_attempt(tmp_path):
    write(tmp_path, "logs.py", """
        import os, sys, time
        rank = os.environ["RANK"]
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        print(f"out of rank {rank}, attempt {attempt}", flush=True)
        print(f"err of rank {rank}", file=sys.stderr, flush=True)
        if rank == "0":
            open(f"printed-{attempt}", "w").close()
        else:
            while not os.path.exists(f"printed-{attempt}"):  # fail once rank 0 has printed
                time.sleep(0.05)
            raise ValueError("rank 1 fails every time")
    """)
    rc, out, err, _ = launch(["--nproc-per-node", "2", "--max-restarts", "1", "--log_dir",
                              "logs", "logs.py"], tmp_path)
    assert rc == 1
    assert "[rank0]: out of rank 0, attempt 0" in out  # the console still gets everything
    logs = tmp_path / "logs"
    for attempt in (0, 1):
        base = logs / f"attempt_{attempt}"
        for rank in (0, 1):
            # One file per rank and stream, without the console's prefix.
            assert (base / f"rank{rank}" / "stdout.log").read_text() == \
                f"out of rank {rank}, attempt {attempt}\n"
            assert (base / f"rank{rank}" / "stderr.log").read_text().startswith(
                f"err of rank {rank}\n")
        assert "ValueError: rank 1 fails every time" in \
            (base / "rank1" / "stderr.log").read_text()
        assert "rank 1 (local rank 1" in (base / "summary.log").read_text()


def test_a_crash_in_native_code_shows_the_python_line_that_made_the_call(tmp_path):
    """A rank killed by SIGSEGV (here a read of address 0 through ctypes) has no traceback; the
    summary shows its Python stack at the crash (faulthandler), without the launcher's frames."""
    write(tmp_path, "crash.py", """
        import ctypes, os, time

        def step():
            if os.environ["RANK"] == "1":
                ctypes.string_at(0)
            time.sleep(30)

        step()
    """)
    rc, out, err, _ = launch(["--nproc-per-node", "2", "crash.py"], tmp_path)
    assert rc == 128 + signal.SIGSEGV, err  # (torchrun's and a shell's code for the signal)
    summary = err[err.index("ddpc.launch: rank 1 (local rank 1"):]
    assert "failed first: signal SIGSEGV" in summary, summary
    assert "rank 1's Python stacks at the crash (faulthandler):" in summary, summary
    # (the script's path as given, or absolute, as `python crash.py` shows it)
    assert re.search(r'File "(?:.*/)?crash\.py", line 6 in step\n'
                     r' +File "(?:.*/)?crash\.py", line 9 in <module>', summary), summary
    assert "_worker.py" not in summary and "Extension modules" not in summary, summary


def test_a_rank_waiting_long_for_another_says_so_before_the_timeout(tmp_path):
    """DDPC_STALL_WARN seconds into a collective that another rank has not reached, the waiting
    rank says so once on its stderr (where, for whom, when it gives up); the job then goes on."""
    write(tmp_path, "late.py", """
        import time
        import numpy as np
        import ddpc
        ddpc.init_process_group(timeout=60)
        if ddpc.get_rank() == 0:
            time.sleep(2.5)  # (busy: the others wait)
        x = np.ones(2)
        ddpc.all_reduce(x)
        ddpc.all_reduce(x)  # (on time: no note)
        print("sum", x.tolist())
    """)
    rc, out, err, _ = launch(["--nproc-per-node", "2", "late.py"], tmp_path,
                             env=launcher_env(DDPC_STALL_WARN="0.5"))
    assert rc == 0, err
    assert out.count("sum [4.0, 4.0]") == 2, out
    notes = re.findall(r"^\[rank(\d)\]: ddpc: rank \1 has waited (\d+) s in all_reduce #1 "
                       r"\(the default group\) for rank 0; it gives up after 60 s \(timeout= of "
                       r"init_process_group\)\. Nothing is wrong if a rank is only busy", err, re.M)
    assert notes == [("1", notes[0][1])] and 0 <= int(notes[0][1]) <= 2, err
    assert "all_reduce #2" not in err, err


def test_torchruns_console_flags_filter_and_redirect_ranks_output(tmp_path):
    """--local-ranks-filter, --redirects and --tee, as torchrun: the console shows what they
    leave, the log files get everything (a temporary directory, printed, without --log-dir), and
    a hidden rank's failure still reaches the summary."""
    write(tmp_path, "two.py", """
        import os, sys
        rank = os.environ["LOCAL_RANK"]
        print(f"out {rank}", flush=True)
        print(f"err {rank}", file=sys.stderr, flush=True)
        if rank == "1" and len(sys.argv) > 1:
            raise ValueError("rank 1 fails")
    """)

    def shown(out, err):
        return sorted(re.findall(r"^\[rank\d\]: (?:out|err) \d$", out + err, re.M))

    rc, out, err, _ = launch(["--nproc-per-node", "2", "--local-ranks-filter", "1", "two.py"],
                             tmp_path)
    assert rc == 0 and shown(out, err) == ["[rank1]: err 1", "[rank1]: out 1"], (out, err)
    rc, out, err, _ = launch(["--nproc-per-node", "2", "-r", "1", "two.py"], tmp_path)
    assert rc == 0 and shown(out, err) == ["[rank0]: err 0", "[rank1]: err 1"], (out, err)
    where = re.search(r"each rank's output goes to (\S+)", err).group(1)
    assert open(os.path.join(where, "attempt_0", "rank1", "stdout.log")).read() == "out 1\n"
    shutil.rmtree(where)
    rc, out, err, _ = launch(["--nproc-per-node", "2", "--redirects", "0:3", "--tee", "0:2",
                              "--log-dir", "logs", "two.py"], tmp_path)
    assert rc == 0 and shown(out, err) == ["[rank0]: err 0", "[rank1]: err 1",
                                           "[rank1]: out 1"], (out, err)
    assert (tmp_path / "logs" / "attempt_0" / "rank0" / "stdout.log").read_text() == "out 0\n"
    rc, out, err, _ = launch(["--nproc-per-node", "2", "--local-ranks-filter", "0", "two.py",
                              "fail"], tmp_path)
    assert rc == 1 and "[rank1]" not in out
    assert "ddpc.launch: rank 1 (local rank 1" in err and "ValueError: rank 1 fails" in err, err


def test_log_dir_is_checked_before_the_ranks_start(tmp_path):
    """A --log-dir that cannot be a directory stops the launch before any rank starts; an
    empty one means no log directory, as in torchrun (it used to write into ./attempt_0)."""
    write(tmp_path, "mark.py", """
        import os
        open(f"ran{os.environ['RANK']}", "w").close()
    """)
    (tmp_path / "blocked").write_text("a file, not a directory")
    for log_dir, message in (
            ("blocked", "argument --log-dir: 'blocked' is a file, not a directory"),
            ("blocked/sub", "argument --log-dir: cannot create 'blocked/sub': Not a directory")):
        rc, out, err, _ = launch(["--nproc-per-node", "2", "--log-dir", log_dir, "mark.py"],
                                 tmp_path)
        assert rc == 2, (rc, out, err)
        assert message in err, err
        assert not list(tmp_path.glob("ran*")), "a rank started"
    rc, out, err, _ = launch(["--nproc-per-node", "2", "--log-dir", "", "mark.py"], tmp_path)
    assert rc == 0, err
    assert sorted(p.name for p in tmp_path.glob("ran*")) == ["ran0", "ran1"]
    assert not (tmp_path / "attempt_0").exists()


# Rank 2 never joins. Rank 0 times out (2 s) and stops serving the store, so rank 1 (which would
# wait 20 s) gets a PeerError for the lost connection and exits first, while rank 0 is still
# exiting (a slow teardown, as with a large CUDA context).
HANG_CAUSE_SCRIPT = """
    import atexit, os, time
    import ddpc
    rank = int(os.environ["RANK"])
    if rank == 2:
        time.sleep(60)  # the stuck rank
    if rank == 0:
        atexit.register(time.sleep, float(os.environ["EXIT_DELAY"]))
    ddpc.init_process_group(backend="cpu", timeout=2 if rank == 0 else 20)
"""


@pytest.mark.parametrize("delay", ["0.4", "2"], ids=["exits-soon", "exits-slowly"])
def test_a_hang_is_blamed_on_the_timeout_not_on_its_consequence(tmp_path, delay):
    """The timeout is the headline (not the PeerError that followed it), the stuck rank's stack
    is collected, and a rank that is exiting after its error is never sent the stack signal."""
    write(tmp_path, "hang3.py", HANG_CAUSE_SCRIPT)
    rc, _, err, elapsed = launch(["--nproc-per-node", "3", "hang3.py"], tmp_path,
                                 env=launcher_env(EXIT_DELAY=delay))
    assert rc == 1, err
    assert elapsed < 20
    summary = err[err.index("failed first"):]
    head = err[err.rindex("\n", 0, err.index("failed first")) + 1:].split("\n")[:2]
    assert head[0].startswith("ddpc.launch: rank 0 (local rank 0"), summary
    assert "rank 0 raised ddpc.DistributedTimeoutError" in head[1], summary
    other = summary[summary.index("other ranks:"):]
    assert "rank 1: exit code 1 after raising ddpc.PeerError" in other, other
    assert "SIGUSR1" not in err
    assert other.count("where its threads were when asked") == 1, other
    assert re.search(r'File ".*hang3\.py", line 6 in <module>', other), other


def test_torchrun_pet_environment_variables(tmp_path):
    """torchrun's PET_* variables (as Kubeflow's PyTorchJob sets them) configure the nodes; a
    flag on the command line wins over its variable."""
    write(tmp_path, "show_env.py", ENV_SCRIPT)
    port = free_port()
    pet = dict(DDPC_TOKEN="0123456789abcdef", PET_NNODES="2", PET_MASTER_ADDR="127.0.0.1",
               PET_MASTER_PORT=str(port), PET_NPROC_PER_NODE="1")
    procs = [start([sys.executable, "-m", "ddpc.launch"] + flags + ["show_env.py"],
                   launcher_env(**{**pet, "PET_NODE_RANK": str(node), **extra}), cwd=tmp_path)
             for node, flags, extra in ((0, [], {}),
                                        (1, ["--nproc-per-node", "1"],
                                         {"PET_NPROC_PER_NODE": "3"}))]
    reports = {}
    for rc, out, err in finish_all(procs, 40):
        assert rc == 0, err
        assert "PET_NNODES=2 is set: using it as --nnodes" in err
        reports.update(env_reports(out))
    assert sorted(reports) == [0, 1]
    for r, info in reports.items():
        assert info["GROUP_RANK"] == str(r) and info["WORLD_SIZE"] == "2"
        assert info["MASTER_PORT"] == str(port)
    rc, _, err, _ = launch(["show_env.py"], tmp_path, env=launcher_env(PET_NNODES="two"))
    assert rc == 2 and "PET_NNODES='two' (torchrun's environment form of --nnodes)" in err


def test_an_exception_whose_str_raises_is_still_reported(tmp_path):
    write(tmp_path, "badstr.py", """
        class ConfigError(Exception):
            def __str__(self):
                return "bad config: " + {}["name"]  # a bug in the user's __str__
        raise ConfigError()
    """)
    rc, _, err, _ = launch(["badstr.py"], tmp_path)
    assert rc == 1
    summary = err[err.index("failed first"):]
    assert "rank 0 raised __main__.ConfigError: <exception str() failed>" in summary, err
    assert 'badstr.py", line 5, in <module>' in summary
    assert "ddpc/_worker.py" not in err


def test_a_rank_that_cannot_be_started_is_named(tmp_path):
    """Too many open files while starting the ranks: which rank, why, what to do; the ranks
    already started are stopped."""
    import resource
    write(tmp_path, "sleeper.py", "import os, time; print('PID', os.getpid(), flush=True); "
                                  "time.sleep(30)\n")
    res = subprocess.run([sys.executable, "-m", "ddpc.launch", "--nproc-per-node", "8",
                          "sleeper.py"], cwd=tmp_path, env=launcher_env(), capture_output=True,
                         text=True, timeout=40,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                               (16, 16)))
    assert res.returncode == 1, res.stderr
    assert re.search(r"ddpc.launch: could not start rank (\d) \(local rank \1 of 8\): Too many "
                     r"open files; stopped the \1 rank\(s\) already started\. The open-file "
                     r"limit is reached \(ulimit -n is 16", res.stderr), res.stderr
    assert "Traceback" not in res.stderr
    pids = [int(p) for p in re.findall(r"PID (\d+)", res.stdout)]
    assert wait_gone(pids) == []


def test_a_directory_with_main_runs_as_python_runs_it(tmp_path):
    (tmp_path / "app").mkdir()
    write(tmp_path, "app/__main__.py", "import os, sys; print('app ran', os.environ['RANK'], "
                                       "sys.argv[1:])\n")
    rc, out, err, _ = launch(["--nproc-per-node", "2", "app", "--x"], tmp_path)
    assert rc == 0, err
    assert "[rank0]: app ran 0 ['--x']" in out and "[rank1]: app ran 1 ['--x']" in out


def test_torchrun_flags_that_need_nothing_are_accepted(tmp_path):
    write(tmp_path, "ok.py", "print('ran')\n")
    rc, out, err, _ = launch(["--monitor-interval", "5", "--start_method", "spawn", "ok.py"],
                             tmp_path)
    assert rc == 0, err
    assert "[rank0]: ran" in out


PROGRAM = """\
#!/bin/sh
echo "ENV rank=$RANK of $WORLD_SIZE local=$LOCAL_RANK port=$MASTER_PORT args=$*"
if [ "$RANK" = "$FAIL_RANK" ]; then
    echo "rank $RANK: the data file is missing" >&2
    exit 3
fi
"""


def test_no_python_runs_a_program_with_the_ranks_environment(tmp_path):
    """--no-python (torchrun's) runs the target as a program: a shell script here, by path and
    through PATH. A failing rank is named with its exit code and its last stderr lines."""
    prog = write(tmp_path, "run.sh", PROGRAM)
    prog.chmod(0o755)
    rc, out, err, _ = launch(["--nproc-per-node", "2", "--no-python", "./run.sh", "--lr", "1"],
                             tmp_path)
    assert rc == 0, err
    lines = sorted(re.findall(r"^\[rank(\d)\]: ENV rank=(\d) of 2 local=(\d) port=\d+ args=(.*)$",
                              out, re.M))
    assert lines == [("0", "0", "0", "--lr 1"), ("1", "1", "1", "--lr 1")], out
    env = launcher_env(FAIL_RANK="1", PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    rc, out, err, _ = launch(["--nproc-per-node", "2", "--no-python", "run.sh"], tmp_path,
                             env=env)
    assert rc == 3, err
    summary = err[err.index("failed first"):]
    assert "rank 1 (local rank 1" in err and "failed first: exit code 3" in err, err
    assert "last lines of rank 1's stderr" in summary
    assert "rank 1: the data file is missing" in summary


def test_no_python_program_gets_default_signals_and_a_hint_for_a_missing_shebang(tmp_path):
    """Python ignores SIGPIPE and SIGXFSZ, and an exec keeps ignored signals: the program must
    get their defaults back (a pipeline's writer dies of SIGPIPE, as from a shell)."""
    prog = write(tmp_path, "sigs.sh", """\
        #!/bin/sh
        grep SigIgn /proc/self/status
    """)
    prog.chmod(0o755)
    rc, out, err, _ = launch(["--nproc-per-node", "1", "--no-python", "./sigs.sh"], tmp_path)
    assert rc == 0, err
    ignored = int(re.search(r"SigIgn:\s*([0-9a-f]+)", out).group(1), 16)
    assert not ignored & (1 << (signal.SIGPIPE - 1)), hex(ignored)
    assert not ignored & (1 << (signal.SIGXFSZ - 1)), hex(ignored)
    bare = write(tmp_path, "bare.sh", "echo no shebang\n")
    bare.chmod(0o755)
    rc, out, err, _ = launch(["--nproc-per-node", "1", "--no-python", "./bare.sh"], tmp_path)
    assert rc == 1
    assert "cannot run './bare.sh': Exec format error: it has no #! line (add one" in err, err


def test_no_python_python_program_reports_its_traceback(tmp_path):
    """A Python program run as a program (a console script) that joins the group: its uncaught
    exception reaches the launcher's summary as a script's would."""
    prog = write(tmp_path, "train-cli", f"""\
        #!{sys.executable}
        import ddpc
        ddpc.init_process_group(backend="cpu")

        def load(rank):
            if rank == 1:
                raise FileNotFoundError("shard 1 is missing")

        load(ddpc.get_rank())
        ddpc.barrier()
    """)
    prog.chmod(0o755)
    rc, out, err, _ = launch(["--nproc-per-node", "2", "--no-python", "./train-cli"], tmp_path)
    assert rc == 1, err
    summary = err[err.index("failed first"):]
    assert "rank 1 raised FileNotFoundError: shard 1 is missing" in summary, summary
    assert re.search(r'File ".*train-cli", line \d+, in load', summary), summary


def test_no_python_program_dies_with_a_killed_launcher(tmp_path):
    """The death signal the rank's wrapper sets outlives its exec of the program."""
    prog = write(tmp_path, "sleepy.sh", """\
        #!/bin/sh
        echo "PID $$"
        exec sleep 60
    """)
    prog.chmod(0o755)
    proc, pids = start_printing_pids(["--nproc-per-node", "2", "--no-python", "./sleepy.sh"],
                                     tmp_path)
    try:
        assert all(pid_alive(p) for p in pids)
        proc.kill()
    finally:
        proc.kill()
        proc.wait()
    assert wait_gone(pids) == []


def test_piped_stdin_reaches_the_ranks(tmp_path):
    """The ranks inherit the launcher's stdin, as under torchrun: piped input reaches rank 0
    (and breakpoint() in a rank reads the terminal instead of ending with BdbQuit)."""
    write(tmp_path, "read.py", """
        import sys
        print("read", repr(sys.stdin.read()), flush=True)
    """)
    res = subprocess.run([sys.executable, "-m", "ddpc.launch", "--nproc-per-node", "1",
                          "read.py"], cwd=tmp_path, env=launcher_env(), input="hello\n",
                         capture_output=True, text=True, timeout=40)
    assert res.returncode == 0, res.stderr
    assert "[rank0]: read 'hello\\n'" in res.stdout, res.stdout


def test_a_reused_log_dir_keeps_each_run_apart(tmp_path):
    """A second run into the same --log-dir goes to a new DIR/run-N (printed), so it neither
    appends to the first run's rank files nor leaves the first run's later attempts beside its
    own; after the last allowed restart fails, the launcher says it gave up."""
    write(tmp_path, "runs.py", """
        import os, sys
        print(f"run {sys.argv[1]} attempt {os.environ['TORCHELASTIC_RESTART_COUNT']}",
              flush=True)
        sys.exit(3 if sys.argv[1] == "1" else 0)
    """)
    rc, _, err, _ = launch(["--max-restarts", "1", "--log-dir", "logs", "runs.py", "1"],
                           tmp_path)
    assert rc == 3, err
    assert err.rstrip().endswith("ddpc.launch: gave up after 1 restart(s) (--max-restarts 1): "
                                 "the last attempt failed too, as above"), err
    assert "holds an earlier run's logs" not in err
    logs = tmp_path / "logs"
    rc, _, err, _ = launch(["--log-dir", "logs", "--node-rank", "1", "runs.py", "x"], tmp_path)
    assert rc == 2 and sorted(p.name for p in logs.iterdir()) == ["attempt_0", "attempt_1"], err
    for run in (2, 3):
        rc, _, err, _ = launch(["--log-dir", "logs", "runs.py", str(run)], tmp_path)
        assert rc == 0, err
        assert f"ddpc.launch: --log-dir logs holds an earlier run's logs: this run's go to " \
               f"logs/run-{run}\n" in err, err
        assert (logs / f"run-{run}" / "attempt_0" / "rank0" / "stdout.log").read_text() == \
            f"run {run} attempt 0\n"
        assert sorted(p.name for p in (logs / f"run-{run}").iterdir()) == ["attempt_0"]
    # The first run's files hold the first run alone.
    assert (logs / "attempt_0" / "rank0" / "stdout.log").read_text() == "run 1 attempt 0\n"
    assert (logs / "attempt_1" / "rank0" / "stdout.log").read_text() == "run 1 attempt 1\n"
    assert "failed first: exit code 3" in (logs / "attempt_1" / "summary.log").read_text()


def test_two_runs_started_together_on_one_log_dir_keep_apart(tmp_path):
    """The first run claims --log-dir as it starts, before its ranks write anything: a second
    run started meanwhile goes to run-2 (it used to find no attempt_* yet and share the files).
    Run A's rank says it started (a file), then writes nothing until run B's rank printed."""
    write(tmp_path, "quiet.py", """
        import os, sys, time
        if sys.argv[1] == "A":
            open("a_started", "w").close()
            deadline = time.monotonic() + 20
            while not os.path.exists("b_done") and time.monotonic() < deadline:
                time.sleep(0.05)
        print(f"run {sys.argv[1]}", flush=True)
        if sys.argv[1] == "B":
            open("b_done", "w").close()
    """)
    cmd = [sys.executable, "-m", "ddpc.launch", "--log-dir", "logs", "quiet.py"]
    first = subprocess.Popen(cmd + ["A"], cwd=tmp_path, env=launcher_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "a_started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        rc, _, err, _ = launch(["--log-dir", "logs", "quiet.py", "B"], tmp_path)
        assert rc == 0 and "this run's go to logs/run-2" in err, err
        assert first.wait(timeout=30) == 0, first.communicate()
    finally:
        first.kill()
        first.communicate()
    logs = tmp_path / "logs"
    assert (logs / "attempt_0" / "rank0" / "stdout.log").read_text() == "run A\n"
    assert (logs / "run-2" / "attempt_0" / "rank0" / "stdout.log").read_text() == "run B\n"


def test_log_files_keep_the_bytes_the_rank_wrote(tmp_path):
    """A line still waiting for its newline and \\r progress-bar frames reach the --log-dir
    file exactly as written; the console shows them line by line with the rank's prefix."""
    write(tmp_path, "bar.py", """
        import sys, time
        sys.stdout.write("epoch 1: "); sys.stdout.flush()
        time.sleep(1.3)  # longer than the launcher waits before it shows a partial line
        sys.stdout.write("loss=0.5\\n\\rstep 1/2\\rstep 2/2\\ndone")
    """)
    rc, out, err, _ = launch(["--log-dir", "logs", "bar.py"], tmp_path)
    assert rc == 0, err
    path = tmp_path / "logs" / "attempt_0" / "rank0" / "stdout.log"
    assert path.read_bytes() == b"epoch 1: loss=0.5\n\rstep 1/2\rstep 2/2\ndone"
    assert out.splitlines() == ["[rank0]: epoch 1: ", "[rank0]: loss=0.5", "[rank0]: step 2/2",
                                "[rank0]: done"], out


def test_nproc_per_node_takes_torchruns_words(tmp_path):
    """cpu: one rank per CPU this process may use (here the launcher is limited to at most two,
    so the count is its affinity, not the machine's); auto without a visible GPU: the same;
    gpu without one: an error that says so and what to pass; no flag: 1 without GPUs."""
    write(tmp_path, "show_env.py", ENV_SCRIPT)
    cpus = sorted(os.sched_getaffinity(0))[:2]
    no_gpu = launcher_env(CUDA_VISIBLE_DEVICES="")

    def world(args, env):
        res = subprocess.run([sys.executable, "-m", "ddpc.launch"] + args + ["show_env.py"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=40,
                             preexec_fn=lambda: os.sched_setaffinity(0, cpus))
        assert res.returncode == 0, res.stderr
        reports = env_reports(res.stdout)
        assert sorted(reports) == list(range(len(reports))), res.stdout
        return {info["WORLD_SIZE"] for info in reports.values()} | {str(len(reports))}

    assert world(["--nproc-per-node", "cpu"], no_gpu) == {str(len(cpus))}
    assert world(["--nproc_per_node", "auto"], no_gpu) == {str(len(cpus))}
    assert world([], launcher_env(PET_NPROC_PER_NODE="cpu")) == {str(len(cpus))}
    assert world([], no_gpu) == {"1"}
    rc, out, err, _ = launch(["--nproc-per-node", "gpu", "show_env.py"], tmp_path, env=no_gpu)
    assert rc == 2 and "ENV" not in out
    assert "argument --nproc-per-node: gpu means one rank per visible GPU, but no GPU is " \
           "visible here (CUDA_VISIBLE_DEVICES=''): give a number of ranks (--nproc-per-node " \
           "2), or cpu for one per CPU" in err, err


def test_torchruns_newer_flags_work(tmp_path):
    """--shutdown-timeout is --timeout-kill; --local-addr sets DDPC_BIND_ADDR, which the CPU
    backend's TCP transport binds; --run-path runs a script (and wins over --no-python);
    --duplicate-stdout-filters copies matching lines to filtered_stdout.log."""
    # (rank 1 fails only once rank 0 ignores SIGTERM: else, on a busy host, the launcher's
    # SIGTERM could reach rank 0 before its handler, and SIGKILL would never be needed)
    write(tmp_path, "stubborn.py", """
        import os, signal, sys, time
        if os.environ["RANK"] == "1":
            while not os.path.exists("ignoring"):
                time.sleep(0.01)
            sys.exit(4)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open("ignoring", "w").close()
        time.sleep(30)
    """)
    rc, _, err, took = launch(["--nproc-per-node", "2", "--shutdown-timeout", "0.5",
                               "stubborn.py"], tmp_path)
    assert rc == 4, err
    assert "rank 0: stopped by the launcher (SIGKILL)" in err, err
    assert took < 4, f"took {took:.1f} s: the 0.5 s of --shutdown-timeout were not used"

    write(tmp_path, "bound.py", """
        import os, numpy as np, ddpc
        ddpc.init_process_group(backend="cpu")
        x = np.ones(3)
        ddpc.all_reduce(x)
        print("BIND", os.environ.get("DDPC_BIND_ADDR"), x.tolist(), flush=True)
    """)
    rc, out, err, _ = launch(["--nproc-per-node", "2", "--local-addr", "127.0.0.1", "bound.py"],
                             tmp_path, env=launcher_env(DDPC_CPU_TRANSPORT="tcp"))
    assert rc == 0, err
    assert out.count("BIND 127.0.0.1 [2.0, 2.0, 2.0]") == 2, out
    rc, _, err, _ = launch(["--local-addr", "127.0.0.1", "bound.py"], tmp_path,
                           env=launcher_env(DDPC_BIND_ADDR="10.0.0.9"))
    assert rc == 2 and "'127.0.0.1' differs from DDPC_BIND_ADDR='10.0.0.9'" in err, err

    write(tmp_path, "plain.py", "print('ran as python')\n")  # not executable: no --no-python
    rc, out, err, _ = launch(["--no-python", "--run_path", "plain.py"], tmp_path)
    assert rc == 0 and "[rank0]: ran as python" in out, err

    write(tmp_path, "metrics.py", """
        import os
        r = os.environ["RANK"]
        print(f"step 1 loss,x={r}")
        print(f"step 1 lr={r}")
        print(f"eval acc={r}")
    """)
    rc, out, err, _ = launch(["--nproc-per-node", "2", "--log-dir", "logs",
                              "--duplicate-stdout-filters", "loss,,x,acc", "metrics.py"],
                             tmp_path)
    assert rc == 0, err
    lines = (tmp_path / "logs" / "attempt_0" / "filtered_stdout.log").read_text().splitlines()
    assert sorted(lines) == ["[rank0]: eval acc=0", "[rank0]: step 1 loss,x=0",
                             "[rank1]: eval acc=1", "[rank1]: step 1 loss,x=1"], lines
    assert not (tmp_path / "logs" / "attempt_0" / "filtered_stderr.log").exists()


def test_signals_to_handle_are_sent_on_to_the_ranks(tmp_path):
    """--signals-to-handle SIGUSR2 (as SLURM setups pass SIGUSR1): the launcher sends the
    signal itself to the ranks, whose handler can checkpoint, and stops the job."""
    write(tmp_path, "usr2.py", """
        import os, signal, sys, time
        def checkpoint(sig, frame):
            print("checkpoint on", signal.Signals(sig).name, flush=True)
            sys.exit(0)
        signal.signal(signal.SIGUSR2, checkpoint)
        print(f"PID {os.getpid()}", flush=True)
        time.sleep(30)
    """)
    proc, pids = start_printing_pids(["--nproc-per-node", "2", "--signals-to-handle",
                                      "SIGTERM,SIGINT,SIGUSR2", "usr2.py"], tmp_path)
    rest, err = signal_and_finish(proc, signal.SIGUSR2)
    assert proc.returncode == 128 + signal.SIGUSR2, err
    assert rest.count("checkpoint on SIGUSR2") == 2, rest
    assert "ddpc.launch: got SIGUSR2: stopped 2 running rank(s) with SIGUSR2\n" in err, err
    assert wait_gone(pids) == []


def test_a_second_ctrl_c_kills_at_once_and_says_so(tmp_path):
    """Ranks that ignore SIGINT: a second Ctrl-C sends SIGKILL at once, not after
    --timeout-kill, and the message says which happened."""
    write(tmp_path, "deaf.py", """
        import os, signal, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"PID {os.getpid()}", flush=True)
        time.sleep(60)
    """)
    proc, pids = start_printing_pids(["--nproc-per-node", "2", "--timeout-kill", "30",
                                      "deaf.py"], tmp_path)
    try:
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
        took = time.monotonic() - t0
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, err
    assert "ddpc.launch: got SIGINT: stopped 2 running rank(s) with SIGINT, then SIGKILL at " \
           "once on the second SIGINT" in err, err
    assert took < 10, took
    assert wait_gone(pids) == []


def test_ranks_get_the_users_environment_plus_torchruns_defaults(tmp_path):
    """Each rank starts with TORCH_NCCL_ASYNC_ERROR_HANDLING=1 unless the user set it (as under
    torchrun), and without the NCCL_RUNTIME_CONNECT=0 that importing ddpc set in the launcher;
    a value the user set is passed on. The rank reads the environment it was started with
    (/proc/self/environ), before its own import of ddpc."""
    write(tmp_path, "start_env.py", """
        import json
        with open("/proc/self/environ", "rb") as f:
            env = dict(e.decode().partition("=")[::2] for e in f.read().split(b"\\0") if e)
        print("START", json.dumps({k: env.get(k) for k in
                                   ("NCCL_RUNTIME_CONNECT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")}))
    """)

    def started_with(**extra):
        env = launcher_env(**extra)
        for key in ("NCCL_RUNTIME_CONNECT", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
            if key not in extra:
                env.pop(key, None)
        rc, out, err, _ = launch(["start_env.py"], tmp_path, env=env)
        assert rc == 0, err
        return json.loads(re.search(r"^\[rank0\]: START (.*)$", out, re.M).group(1))

    assert started_with() == {"NCCL_RUNTIME_CONNECT": None,
                              "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert started_with(NCCL_RUNTIME_CONNECT="0", TORCH_NCCL_ASYNC_ERROR_HANDLING="0") == {
        "NCCL_RUNTIME_CONNECT": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    assert started_with(NCCL_RUNTIME_CONNECT="1")["NCCL_RUNTIME_CONNECT"] == "1"


def test_console_script_finds_modules_where_the_ranks_do(tmp_path):
    """Under the ddpc-launch console script, sys.path[0] is the script's bin directory; -m is
    checked against the ranks' path (working directory, PYTHONPATH, the rest) instead: a module
    in the working directory runs, one only in the bin directory is refused."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    write(tmp_path, "mypkg/train.py", "print('trained')\n")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    write(bindir, "ddpc_launch_script.py", """
        import sys
        from ddpc.launch import main
        sys.exit(main())
    """)
    write(bindir, "only_in_bin.py", "print('should not run')\n")
    script = str(bindir / "ddpc_launch_script.py")
    res = subprocess.run([sys.executable, script, "-m", "mypkg.train"], cwd=tmp_path,
                         env=launcher_env(), capture_output=True, text=True, timeout=40)
    assert res.returncode == 0 and "[rank0]: trained" in res.stdout, res.stderr
    res = subprocess.run([sys.executable, script, "-m", "only_in_bin"], cwd=tmp_path,
                         env=launcher_env(), capture_output=True, text=True, timeout=40)
    assert res.returncode == 2, res.stderr
    assert f"no module named 'only_in_bin' (the ranks' sys.path starts with the working " \
           f"directory {tmp_path}, then PYTHONPATH)" in res.stderr, res.stderr


def test_ranks_share_gpus_only_when_asked(monkeypatch):
    """DDPC_SHARE_GPUS=1: more ranks than visible GPUs each get one (local rank k on GPU
    k % count), also with --gpus; the note says they share, slowly."""
    from ddpc.launch import plan_devices
    monkeypatch.setenv("DDPC_SHARE_GPUS", "1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    plan = plan_devices(None, 3, gpu_count=lambda: 2)
    assert (plan.nproc, plan.gpus, len(plan.rank_gpus)) == (3, 3, 3), plan
    assert plan.notes == ["3 ranks share 2 visible GPU(s) (DDPC_SHARE_GPUS=1): local rank k "
                          "runs on GPU k % 2, slowly"], plan.notes
    assert plan_devices(None, 2, gpu_count=lambda: 2).notes == []  # (enough GPUs: no sharing)
    listed = plan_devices("0", 3, gpu_count=lambda: 1)
    assert (listed.nproc, listed.gpus, listed.cuda_visible_devices) == (3, 3, "0"), listed
    assert listed.notes == ["3 ranks share GPU(s) 0 (DDPC_SHARE_GPUS=1): local ranks 0..2 run "
                            "on GPUs 0,0,0, slowly"], listed.notes
