"""The device timeline of a process group's collectives: when each one's input was ready, when
the communication stream began it, and when it finished, read from CUDA events (nccl backend).

    with ddpc.comm_trace() as trace:
        loss = model(x).sum()
        trace.mark("backward")
        loss.backward()
        optimizer.step()
    print(trace.table())

Every gradient bucket of wrap_model is one all_reduce row. Times are milliseconds after the
trace began (its first mark, recorded on the current stream when the ``with`` block starts).
Tracing adds a few CUDA events per collective; it is for looking at a few steps, not for every
step of a run.
"""
import math
from typing import Any, List, NamedTuple, Optional, Tuple

from ddpc import distributed as _dist

_OPS = {0: "all_reduce", 1: "broadcast", 2: "all_gather", 3: "reduce_scatter", 4: "barrier"}
_DTYPES = {code: name for name, code in _dist._DTYPE_CODES.items()}
_SIZES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8,
          "uint8": 1, "int8": 1}
_PATHS = {1: "nccl", 2: "staged", 3: "one-shot"}


class TraceRow(NamedTuple):
    """One collective. Times in ms after the trace began; NaN where a point was not recorded."""
    seq: int        # its sequence number in the group, the same on every rank
    op: str         # "all_reduce", ...
    dtype: str
    count: int      # elements per rank
    nbytes: int
    path: str       # "nccl", "staged" (through host memory) or "one-shot" (small messages)
    deferred: bool  # issued by the backend's posting thread (the buckets of wrap_model)
    ready: float    # the caller's stream reached the post: its input was complete
    start: float    # the communication stream began it, behind the collectives before it
    wire: float     # its input was prepared there (a cast to the wire dtype), else = start
    reduced: float  # the collective itself finished
    done: float     # the work queued after it there finished too (a cast back), else = reduced

    @property
    def queued(self) -> float:
        """How long it waited behind earlier collectives after its input was ready (ms)."""
        return self.start - self.ready

    @property
    def duration(self) -> float:
        """The collective itself (ms): the transfer, plus any wait for a peer that was late."""
        return self.reduced - self.wire


class CommTrace:
    """The rows of one trace: ``rows`` (TraceRow, in posting order), ``marks`` ((label, ms)
    pairs, the first at 0), and ``dropped`` (collectives that did not fit its capacity)."""

    def __init__(self, group: Any, capacity: int) -> None:
        self._group = group
        self._capacity = capacity
        self._labels: List[str] = []
        self._on = False
        self.rows: List[TraceRow] = []
        self.marks: List[Tuple[str, float]] = []
        self.dropped = 0

    def _stream(self) -> int:
        dev = _dist._require().device_index
        if dev is None:
            raise RuntimeError("ddpc.comm_trace needs a rank bound to a GPU (the nccl backend)")
        return _dist._raw_stream(dev)

    def start(self) -> "CommTrace":
        if self._group.backend != "nccl":
            raise ValueError(f"ddpc.comm_trace reads CUDA events, and this process group's "
                             f"backend is {self._group.backend!r}: trace a group made with "
                             f"init_process_group(backend='nccl')")
        stream = self._stream()
        self._group.trace_start(self._capacity)
        self._on = True
        try:
            self.mark("start", stream)
        except BaseException:
            self._on = False  # (__exit__ will not run: the with block never began)
            self._group.trace_stop()
            raise
        return self

    def mark(self, label: str, stream: Optional[int] = None) -> None:
        """A named point on the current CUDA stream (for example where backward begins)."""
        if not self._on:
            raise RuntimeError("this trace is not running: marks go inside its `with` block")
        self._group.trace_mark(self._stream() if stream is None else stream)
        self._labels.append(str(label))

    def stop(self) -> "CommTrace":
        """Waits for the traced collectives (at most the group's timeout) and reads their times."""
        if not self._on:
            return self
        raw, self.dropped = self._group.trace_stop()
        self._on = False
        labels = iter(self._labels)
        for seq, op, dtype, count, path, deferred, *ms in raw:
            if op < 0:
                self.marks.append((next(labels, "mark"), ms[0]))
                continue
            name = _DTYPES.get(dtype, str(dtype))
            self.rows.append(TraceRow(seq, _OPS.get(op, str(op)), name, count,
                                      count * _SIZES.get(name, 0), _PATHS.get(path, str(path)),
                                      bool(deferred), *ms))
        return self

    def __enter__(self) -> "CommTrace":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.stop()
        elif self._on:
            try:  # the block failed: free the trace, but raise the block's error
                self.stop()
            except Exception:
                pass

    def table(self) -> str:
        """The rows as text, one collective a line, with the marks in between."""
        def f(x: float) -> str:
            return "-" if math.isnan(x) else f"{x:8.3f}"
        out = [f"{'seq':>5} {'op':<10} {'MiB':>8} {'dtype':<8} {'path':<8} {'ready':>8} "
               f"{'start':>8} {'reduced':>8} {'done':>8} {'queued':>8} {'took':>8}"]
        events = [(m, 0, label) for label, m in self.marks] + [(r.ready, 1, r) for r in self.rows]
        for _, kind, item in sorted(events, key=lambda e: (e[0], e[1])):
            if kind == 0:
                out.append(f"{'':>5} -- {item}")
                continue
            r = item
            out.append(f"{r.seq:>5} {r.op:<10} {r.nbytes / 2**20:8.2f} {r.dtype:<8} {r.path:<8} "
                       f"{f(r.ready)} {f(r.start)} {f(r.reduced)} {f(r.done)} {f(r.queued)} "
                       f"{f(r.duration)}")
        if self.dropped:
            out.append(f"({self.dropped} more did not fit: pass a larger capacity)")
        return "\n".join(out)


def comm_trace(group: Any = None, capacity: int = 2048) -> CommTrace:
    """A trace of the collectives of `group` (the default group) for a ``with`` block: each
    collective posted inside it gets a row with the times its input was ready, the
    communication stream began it, and it finished (CUDA events; the nccl backend). Reading the
    rows at the block's end waits for those collectives."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity={capacity!r}: pass the number of rows to keep, 1 or more "
                         f"(a training step posts one collective per gradient bucket)")
    return CommTrace(_dist._group(group), capacity)
