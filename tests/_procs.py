"""Process helpers shared by the multi-process tests: a free port on 127.0.0.1, and starting a
set of processes and collecting their output without leaving any of them behind."""
from __future__ import annotations

import socket
import subprocess
import time
from typing import List, Mapping, Optional, Sequence, Tuple


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
