"""Edge cases of the cpu backend with real processes on 127.0.0.1, over both transports: outputs
that overlap their input anywhere (the result must be the out-of-place one), and timeouts of
queued async collectives (a collective's timeout counts from when it starts executing, as gloo's
does, not from when it was posted).

Each job runs this file as a script in N processes (`python test_cpu_edge.py SCENARIO`) that
rendezvous through init_method=file://."""
from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import Dict, List, Tuple

import numpy as np
import pytest

from _procs import finish_all, start

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.abspath(__file__)

# Above one chunk of both transports (the shared-memory reduce-scatter takes at most 1 MiB / world
# per block and chunk, TCP 512 KiB), and odd, so chunks end unevenly.
BIG = 300_001
TIMEOUT = 2.0  # the group timeout of the queued-collective scenarios, in seconds


# ------------------------------------------------------------------------- worker side


def init(timeout: float = 30.0) -> None:
    import ddpc
    ddpc.init_process_group(backend="cpu", init_method="file://" + os.environ["RDV"],
                            timeout=timeout)


def scenario_overlap() -> Dict:
    """reduce_scatter_tensor and all_gather_into_tensor whose output overlaps the input at every
    kind of offset (block-aligned, below the input, in the middle of a block, one element in)
    give the same bits as with separate buffers. Returns the cases that did not."""
    import ddpc
    init()
    rank, world = ddpc.get_rank(), ddpc.get_world_size()
    bad: List[str] = []
    for n in (7, BIG):
        rng = np.random.default_rng(1000 * rank + n)
        base = rng.integers(-50, 50, world * n).astype(np.float32)
        # The output's offset from the input's start, in elements; the same list on every rank.
        rs_offsets = sorted({-n - 3, -n // 2, 0, 1, n // 2, n + 1, (world - 1) * n + n // 2,
                             world * n - 1} | {r * n for r in range(world)})
        for op in ("sum", "avg"):
            ref = np.empty(n, np.float32)
            ddpc.reduce_scatter_tensor(ref, base.copy(), op=op)
            for d in rs_offsets:
                buf = np.zeros((world + 4) * n, np.float32)
                lo = 2 * n
                buf[lo:lo + world * n] = base
                out = buf[lo + d:lo + d + n]
                ddpc.reduce_scatter_tensor(out, buf[lo:lo + world * n], op=op)
                if not np.array_equal(out, ref):
                    bad.append(f"reduce_scatter {op} n={n}, output at input+{d}: "
                               f"{int((out != ref).sum())} of {n} elements differ")
        ref = np.empty(world * n, np.float32)
        ddpc.all_gather_into_tensor(ref, base[:n].copy())
        ag_offsets = sorted({-n // 2, 1, n // 2, n + 1, (world - 1) * n + n // 2,
                             world * n - n // 2} | {r * n for r in range(world)})
        for d in ag_offsets:
            buf = np.zeros((world + 4) * n, np.float32)
            lo = 2 * n
            buf[lo + d:lo + d + n] = base[:n]
            out = buf[lo:lo + world * n]
            ddpc.all_gather_into_tensor(out, buf[lo + d:lo + d + n])
            if not np.array_equal(out, ref):
                bad.append(f"all_gather n={n}, input at output+{d}: "
                           f"{int((out != ref).sum())} of {world * n} elements differ")
    transport = ddpc.distributed._default_group().transport
    ddpc.destroy_process_group()
    return {"bad": bad, "transport": transport}


def scenario_queue_drain() -> Dict:
    """Every rank queues more async all_reduces than it can finish within the timeout (each one
    far quicker than it): all of them must succeed. Rank 0 sizes the queue from how fast a short
    one drains, so the long one takes about three times the timeout on any machine."""
    import ddpc
    init(timeout=TIMEOUT)
    x = np.ones(1 << 22, dtype=np.float32)  # 16 MiB
    count = np.zeros(1, dtype=np.int64)
    ddpc.barrier()
    for w in [ddpc.all_reduce(x, op="max", async_op=True) for _ in range(10)]:
        w.wait()  # (warm: the first ones, slower, made the queue too short 1 time in 3)
    t0 = time.monotonic()
    for w in [ddpc.all_reduce(x, op="max", async_op=True) for _ in range(20)]:
        w.wait()
    one = (time.monotonic() - t0) / 20
    count[0] = min(20_000, int(3 * TIMEOUT / max(one, 1e-5)) + 1)
    ddpc.broadcast(count, src=0)
    t0 = time.monotonic()
    works = [ddpc.all_reduce(x, op="max", async_op=True) for _ in range(int(count[0]))]
    for w in works:
        w.wait()
    elapsed = time.monotonic() - t0
    assert (x == 1).all()
    ddpc.destroy_process_group()
    return {"count": int(count[0]), "elapsed": elapsed}


def scenario_straggler() -> Dict:
    """Rank 1 posts three async all_reduces at once; rank 0 joins them one at a time, 1.2 s
    apart. Each waits 1.2 s once it starts, well within the 2 s timeout, though the last ends
    3.6 s after its post. DDPC_STALL_WARN=0.9 makes rank 1 note each wait, counted from the same
    start."""
    import ddpc
    init(timeout=TIMEOUT)
    ddpc.barrier()
    x = np.ones(3, dtype=np.float32)
    t0 = time.monotonic()
    if ddpc.get_rank() == 0:
        for _ in range(3):
            time.sleep(1.2)
            ddpc.all_reduce(x)
    else:
        works = [ddpc.all_reduce(x, async_op=True) for _ in range(3)]
        for w in works:
            w.wait()
    elapsed = time.monotonic() - t0
    result = x.tolist()
    ddpc.destroy_process_group()
    return {"x": result, "elapsed": elapsed}


def scenario_missing_after_queue() -> Dict:
    """Rank 1 posts two async all_reduces; rank 0 joins the first 1.5 s late and never the
    second. The second starts when the first ends and must time out one timeout after that,
    naming rank 0."""
    import ddpc
    init(timeout=TIMEOUT)
    ddpc.barrier()
    x = np.ones(3, dtype=np.float32)
    out: Dict = {}
    if ddpc.get_rank() == 0:
        time.sleep(1.5)
        ddpc.all_reduce(x)
        ddpc.get_store().get("edge-test/rank1-done", 30.0)
    else:
        t0 = time.monotonic()
        first = ddpc.all_reduce(x, async_op=True)
        second = ddpc.all_reduce(np.ones(3, dtype=np.float32), async_op=True)
        first.wait()
        out["first"] = time.monotonic() - t0
        try:
            second.wait()
        except ddpc.DistributedTimeoutError as e:
            out["error"] = str(e)
        out["second"] = time.monotonic() - t0
        ddpc.get_store().set("edge-test/rank1-done", b"1")
    ddpc.destroy_process_group()
    return out


def scenario_dropped() -> Dict:
    """Rank 1 posts an async all_reduce and drops the Work and the array at once, before rank 0
    joins: the C core keeps the array until the collective is done. Once it is, gc.collect()
    lets it go (its callback reaps the group), with no further collective to do it."""
    import gc
    import weakref
    import ddpc
    init()
    ddpc.barrier()
    store = ddpc.get_store()
    out: Dict = {}
    if ddpc.get_rank() == 0:
        time.sleep(0.5)
        ddpc.all_reduce(np.ones(BIG, np.float32))
        store.set("edge-test/reduced", b"1")
        store.get("edge-test/checked", 30.0)
    else:
        x = np.ones(BIG, np.float32)
        ref = weakref.ref(x)
        ddpc.all_reduce(x, async_op=True)  # (the Work, dropped here)
        del x
        out["alive_at_drop"] = ref() is not None
        store.get("edge-test/reduced", 30.0)
        t0 = time.monotonic()
        while ref() is not None and time.monotonic() - t0 < 10.0:
            gc.collect()
            time.sleep(0.05)
        out["freed"] = ref() is None
        out["after"] = time.monotonic() - t0
        store.set("edge-test/checked", b"1")
    ddpc.destroy_process_group()
    return out


SCENARIOS = {"overlap": scenario_overlap, "queue_drain": scenario_queue_drain,
             "straggler": scenario_straggler, "missing_after_queue": scenario_missing_after_queue,
             "dropped": scenario_dropped}


if __name__ == "__main__":
    result = SCENARIOS[sys.argv[1]]()
    print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------------------------------- test side


def run_job(scenario: str, world: int, tmp_path, transport: str = "auto", timeout: float = 90.0,
            **env_extra: str) -> List[Tuple[Dict, str]]:
    """Runs SCENARIO in `world` processes; returns each rank's (JSON result, stderr)."""
    env = dict(os.environ)
    env.update({"PYTHONPATH": os.path.join(ROOT, "python"), "WORLD_SIZE": str(world),
                "RDV": str(tmp_path / f"rdv-{scenario}-{world}-{transport}"),
                "DDPC_CPU_TRANSPORT": transport, "DDPC_TOKEN": "test-token",
                "DDPC_QUIET_TOKEN_WARNING": "1", "OMP_NUM_THREADS": "1"})
    env.update(env_extra)
    procs = [start([sys.executable, HERE, scenario], dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(world)]
    results = []
    for r, (rc, out, err) in enumerate(finish_all(procs, timeout)):
        assert rc == 0, (f"rank {r} of {scenario} (world {world}, {transport}) failed, "
                         f"rc={rc}:\n{err}")
        line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert line, f"rank {r} printed no result:\n{out}\n{err}"
        results.append((json.loads(line[-1][len("RESULT "):]), err))
    return results


@pytest.mark.parametrize("world,transport", [(2, "shm"), (2, "tcp"), (3, "shm"), (4, "tcp")])
def test_overlapping_output_gives_the_out_of_place_result(world, transport, tmp_path):
    for rank, (res, _) in enumerate(run_job("overlap", world, tmp_path, transport)):
        assert res["transport"] == transport
        assert res["bad"] == [], f"rank {rank}: " + "; ".join(res["bad"])


def test_a_queue_longer_than_the_timeout_drains(tmp_path):
    for rank, (res, _) in enumerate(run_job("queue_drain", 2, tmp_path, "shm")):
        # (the queue must really outlast the timeout, or this tests nothing)
        assert res["elapsed"] > 1.1 * TIMEOUT, (rank, res)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_queued_collectives_behind_a_late_rank_do_not_time_out(transport, tmp_path):
    (r0, _), (r1, err1) = run_job("straggler", 2, tmp_path, transport, DDPC_STALL_WARN="0.9")
    assert r0["x"] == r1["x"] == [8.0, 8.0, 8.0], (r0, r1)
    assert r1["elapsed"] > 3.3, r1  # (the last one really ended past post + timeout)
    # The stall note counts from the same start as the timeout: each all_reduce has waited about
    # 1 s when it is noted, however long it sat in the queue before.
    notes = re.findall(r"ddpc: rank 1 has waited (\d+) s in all_reduce #(\d+) \(the default "
                       r"group\) for rank 0; it gives up after 2 s", err1)
    assert [s for s, _ in notes] == ["1", "1", "1"], err1
    assert len({seq for _, seq in notes}) == 3, err1


def test_a_missing_rank_times_out_a_timeout_after_the_collective_started(tmp_path):
    (_, _), (r1, _) = run_job("missing_after_queue", 2, tmp_path, "shm")
    assert 1.3 < r1["first"] < TIMEOUT, r1
    assert r1["error"].startswith("all_reduce #3 timed out after 2s on rank 1: rank 0 never "
                                  "arrived"), r1
    # The second started when the first ended (about 1.5 s); it times out 2 s later, and the
    # message then waits up to 2 s for the other ranks to say where they are: about 5.5 s in
    # all. Counting from its post would fail it at about 4 s.
    assert r1["first"] + TIMEOUT + 1.0 < r1["second"] < r1["first"] + TIMEOUT + 4.5, r1


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_dropped_collectives_array_is_let_go_at_the_next_gc(transport, tmp_path):
    (_, _), (r1, _) = run_job("dropped", 2, tmp_path, transport)
    assert r1["alive_at_drop"], r1  # (else the collective was done before the drop: no test)
    assert r1["freed"], r1
    assert r1["after"] < 5.0, r1
