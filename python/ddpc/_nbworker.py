"""The process notebook_launcher starts for each rank: `python -m ddpc._nbworker JOB_DIR`. It
loads the function from JOB_DIR/payload.pkl (cloudpickle), joins the process group from the
environment, calls it, and leaves its return value or its error report in JOB_DIR."""
import linecache
import os
import pickle
import sys
import traceback
from types import TracebackType
from typing import Any, Callable

from ddpc._worker import die_with_parent, enable_stack_dumps, write_error_file


def result_path(job_dir: str, rank: int) -> str:
    return os.path.join(job_dir, f"result{rank}.pkl")


def exception_path(job_dir: str, rank: int) -> str:
    return os.path.join(job_dir, f"exception{rank}.pkl")


def error_path(job_dir: str, rank: int) -> str:
    return os.path.join(job_dir, f"rank{rank}-error.json")


def _dump_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _own_frames_dropped(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the user's function on, without this module's frames."""
    here = os.path.abspath(__file__)
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) == here:
        tb = tb.tb_next
    return tb


def run_rank(fn: Callable[..., Any], args: tuple, kwargs: dict, job_dir: str,
             return_all: bool) -> int:
    """init_process_group, fn(*args, **kwargs), destroy_process_group; returns the exit status.
    Rank 0's return value (every rank's with return_all) goes to result<rank>.pkl; an exception
    goes to the JSON error report (plus the exception itself when it pickles)."""
    import cloudpickle

    from ddpc import distributed
    from ddpc.distributed import destroy_process_group, init_process_group

    rank = int(os.environ.get("RANK", "0"))
    try:
        init_process_group()
        # fn may call init_process_group itself, as torch.multiprocessing.spawn code does:
        # that call then returns this group (see init_process_group).
        distributed._state.made_by_notebook_launcher = True  # type: ignore[union-attr]
        try:
            result = fn(*args, **kwargs)
        except SystemExit as e:
            if e.code not in (0, None):
                raise
            result = None  # sys.exit(0) ends fn successfully, as under torch's mp.spawn
        destroy_process_group()
        if rank == 0 or return_all:
            try:
                data = cloudpickle.dumps(result)
            except Exception as e:
                raise TypeError(f"the return value of rank {rank} ({type(result).__name__}) "
                                f"cannot be pickled to send it back to the notebook: {e}; "
                                f"return plain data (numbers, arrays, state_dict on cpu)") from e
            _dump_atomic(result_path(job_dir, rank), data)
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the notebook
        tb = _own_frames_dropped(exc.__traceback__)
        write_error_file(error_path(job_dir, rank), exc, tb)
        try:
            _dump_atomic(exception_path(job_dir, rank), cloudpickle.dumps(exc.with_traceback(None)))
        except Exception:  # noqa: BLE001 - the text report above is what the notebook needs
            pass
        return 1


def main(job_dir: str) -> int:
    """Loads the payload and runs this rank; returns the process exit status."""
    die_with_parent()
    enable_stack_dumps()
    try:
        with open(os.path.join(job_dir, "payload.pkl"), "rb") as f:
            meta = pickle.load(f)
            # The notebook's extra sys.path entries, appended, so functions pickled by reference
            # (from modules the notebook imported after editing sys.path) import here too, while
            # this interpreter's own ddpc stays first.
            sys.path.extend(p for p in meta["sys_path"] if p not in sys.path)
            sys.argv = list(meta["argv"])
            # Source lines of notebook cells, so tracebacks through them show code.
            linecache.cache.update(meta["linecache"])
            fn, args, kwargs = pickle.load(f)
    except BaseException as exc:  # noqa: BLE001 - reported like an error in fn itself
        rank = int(os.environ.get("RANK", "0"))
        write_error_file(error_path(job_dir, rank), exc, exc.__traceback__)
        traceback.print_exc()
        return 1
    return run_rank(fn, args, kwargs, job_dir, meta["return_all"])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m ddpc._nbworker JOB_DIR")
    sys.exit(main(sys.argv[1]))
