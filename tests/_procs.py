"""Process helpers shared by the multi-process tests: a free port on 127.0.0.1, starting a set
of processes and collecting their output without leaving any of them behind, and the names of
this process's threads."""
from __future__ import annotations

import os
import socket
import subprocess
import time
from typing import List, Mapping, Optional, Sequence, Tuple


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def thread_names() -> List[str]:
    """The names of this process's threads (/proc/self/task/*/comm), sorted; a thread that ends
    while they are read is left out."""
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:
            pass
    return sorted(names)


def start(argv: Sequence[str], env: Mapping[str, str],
          cwd: Optional[str] = None) -> subprocess.Popen:
    """Starts argv with its stdout and stderr captured as text."""
    return subprocess.Popen(list(argv), env=dict(env), cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish_all(procs: Sequence[subprocess.Popen],
               timeout: float) -> List[Tuple[int, str, str]]:
    """Waits for every process, all within `timeout` seconds together; returns (exit code, stdout,
    stderr) of each, in order. Raises subprocess.TimeoutExpired past the deadline. Whatever
    happens, no process is left running: one rank's failure must not leave its peers behind."""
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def spawn_scenarios(target, world: int, timeout: float) -> dict:
    """Runs target(rank, port, results) in `world` spawned processes (a free port for their
    rendezvous); each puts (rank, {scenario: ("ok", value) | ("error", traceback)}) on results.
    Returns {rank: that dict}; fails the test when a rank does not report within timeout."""
    import multiprocessing as mp
    import queue

    import pytest

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(world):
            rank, out = results.get(timeout=timeout)
            got[rank] = out
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(world)) - set(got))} did not report within "
                    f"{timeout:.0f} s")
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    return got


def scenario_result(runs: dict, name: str) -> list:
    """Every rank's value for scenario `name`, asserting that none of them failed."""
    outs = []
    for rank in sorted(runs):
        status, value = runs[rank][name]
        assert status == "ok", f"rank {rank} failed in scenario {name}:\n{value}"
        outs.append(value)
    return outs


def report_scenarios(scenarios, rank: int, results) -> None:
    """Inside a spawned rank: runs each (name, fn) of scenarios as fn(rank) and puts
    (rank, {name: ("ok", value) | ("error", traceback)}) on results, for spawn_scenarios."""
    import traceback

    out = {}
    for name, fn in scenarios:
        try:
            out[name] = ("ok", fn(rank))
        except BaseException:  # reported by the test of that scenario
            out[name] = ("error", traceback.format_exc())
    results.put((rank, out))
