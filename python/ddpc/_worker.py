"""The process ddpc.launch starts for each rank: `python -m ddpc._worker script.py args...` or
`python -m ddpc._worker -m module args...`. It runs the target like `python script.py` would, and
on an uncaught exception writes a JSON error report to $DDPC_ERROR_FILE for the launcher.
`python -m ddpc._worker --exec program args...` (launch --no-python) becomes the program."""
import builtins
import ctypes
import errno
import faulthandler
import importlib.machinery
import io
import json
import os
import runpy
import signal
import socket
import sys
import time
import traceback
import types
from types import TracebackType
from typing import Any, Callable

from ddpc import _oom

# Linux prctl option: deliver a signal to this process when the parent (the launcher) dies.
_PR_SET_PDEATHSIG = 1
# The launcher asks a rank for its threads' Python stacks with this signal.
STACK_SIGNAL = signal.SIGUSR1


def enable_stack_dumps() -> None:
    """On STACK_SIGNAL, print every thread's Python stack to stderr (faulthandler: it works while
    the rank is blocked in C code too, such as a collective). The launcher asks the ranks still
    running for it when another rank timed out waiting for them, to show where they were. A
    fatal signal prints them too (faulthandler.enable)."""
    try:
        faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    except (AttributeError, ValueError, RuntimeError, OSError):
        pass  # no faulthandler signal support here: the summary just has no stacks
    # A crash in native code (SIGSEGV, SIGABRT, SIGFPE, SIGBUS, SIGILL) prints the Python stack
    # of every thread too, so the launcher's summary shows the line that made the call.
    try:
        faulthandler.enable(file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, RuntimeError, OSError):
        pass


def die_with_parent() -> None:
    """Asks the kernel to SIGKILL this process when the process that started it dies, so a
    launcher (or notebook kernel) that is itself killed with SIGKILL leaves no orphan ranks.
    DDPC_PARENT_PID closes the race where the parent died before prctl took effect."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return  # best effort: without it we only lose protection against a killed launcher
    except (OSError, AttributeError):
        return
    expected = os.environ.get("DDPC_PARENT_PID", "")
    if expected.isdigit() and os.getppid() != int(expected):
        os._exit(128 + int(signal.SIGKILL))


def user_traceback(tb: TracebackType | None) -> TracebackType | None:
    """Drops the leading frames that belong to this module and runpy, so the traceback starts at
    the user's code exactly as `python script.py` would print it."""
    skip = {_THIS_FILE, os.path.abspath(runpy.__file__), "<frozen runpy>"}
    while tb is not None:  # may end at None: a SyntaxError in the script has no frame of its own
        filename = tb.tb_frame.f_code.co_filename
        if filename not in skip and os.path.abspath(filename) not in skip:
            break
        tb = tb.tb_next
    return tb


def _trimming_hook(hook: Callable[..., Any]) -> Callable[..., None]:
    """Wraps sys.excepthook so an uncaught exception prints as under `python script.py`,
    without this wrapper's frames; the interpreter still does the exiting (status 1, or death
    by SIGINT for KeyboardInterrupt) as usual."""
    def excepthook(exc_type: type[BaseException], exc: BaseException | None,
                   tb: TracebackType | None) -> None:
        tb = user_traceback(tb)
        if exc is not None:
            exc.__traceback__ = tb  # the default hook prints this, not its tb argument
        hook(exc_type, exc, tb)
    return excepthook


def _describe(exc: BaseException) -> str:
    """str(exc), or what Python itself prints when that raises."""
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - the user's __str__ may do anything
        return "<exception str() failed>"


def _int_env(name: str) -> int:
    try:
        return int(os.environ.get(name, "-1"))
    except ValueError:
        return -1


def write_error_file(path: str, exc: BaseException, tb: TracebackType | None) -> None:
    """Writes the error report atomically (temp file + rename), so the launcher never reads half
    of one. Never raises: a part of the report that cannot be made (an exception whose __str__
    raises) gets a stand-in, and a failure to write is reported on stderr, so nothing here
    hides the user's exception."""
    try:
        exc_type = (type(exc).__qualname__ if type(exc).__module__ == "builtins"
                    else f"{type(exc).__module__}.{type(exc).__qualname__}")
        try:
            text = "".join(traceback.format_exception(type(exc), exc, tb))
        except Exception:  # noqa: BLE001 - as above
            text = "".join(traceback.format_tb(tb)) + f"{exc_type}: {_describe(exc)}\n"
        report: dict[str, Any] = {
            "rank": _int_env("RANK"),
            "local_rank": _int_env("LOCAL_RANK"),
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "exception_type": exc_type,
            "message": _describe(exc),
            "traceback": text,
            "timestamp": time.time(),
        }
        try:
            memory = _oom.facts(exc)
        except Exception:  # noqa: BLE001 - the explanation is optional; the report is not
            memory = None
        if memory is not None:
            report["memory"] = memory
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(report, f, default=repr)
        os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001 - the user's exception goes on regardless
        print(f"ddpc._worker: could not write the error file {path}: "
              f"{type(e).__name__}: {_describe(e)}", file=sys.stderr)


def report_uncaught_exceptions() -> None:
    """In the process a rank of `ddpc.launch --no-python` exec'd (not its children), when that
    program is Python: its uncaught exception goes into the launcher's error file, as this
    wrapper writes it for a script, so the summary shows the traceback, explains an OOM and
    finds a hang's root timeout. Called by init_process_group; once."""
    path = os.environ.get("DDPC_ERROR_FILE", "")
    if (not path or os.environ.get("DDPC_EXEC_PID") != str(os.getpid()) or
            getattr(sys.excepthook, "ddpc_reports", False)):
        return
    previous = sys.excepthook

    def excepthook(exc_type: type[BaseException], exc: BaseException | None,
                   tb: TracebackType | None) -> None:
        if exc is not None and not isinstance(exc, SystemExit):
            write_error_file(path, exc, tb)
        previous(exc_type, exc, tb)
    excepthook.ddpc_reports = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook


_own_module = None  # this module, once a script took its place as __main__ (kept alive)
_THIS_FILE = os.path.abspath(__file__)  # (read now: a -m target's run may rebind __file__)


def _fresh_main() -> types.ModuleType:
    """A new, empty __main__ module in sys.modules, this one kept alive: the user's code must
    not run in this module's namespace (this process started as `python -m ddpc._worker`)."""
    global _own_module
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    _own_module = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    return main


def _run_script(script: str) -> None:
    """Runs script as `python script.py` does: in a __main__ module that stays __main__ after
    its top-level code returns (runpy.run_path restores the old one then, so its threads, its
    atexit handlers and pickles of its classes would no longer find it), with an absolute
    __file__, and sys.path[0] the directory of the script's real path (symlinks resolved)."""
    path = os.path.abspath(script)
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    if not os.path.isfile(path) or path.endswith((".pyc", ".pyo")):
        runpy.run_path(script, run_name="__main__")  # (a folder or zip with __main__.py, a .pyc)
        return
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    main = _fresh_main()
    main.__dict__.update(__file__=path, __cached__=None, __package__=None, __spec__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    exec(code, main.__dict__)


def main(argv: list[str]) -> None:
    """Runs `script args...` or `-m module args...` as __main__ with the usual sys.argv/sys.path."""
    if not argv or (argv[0] in ("-m", "--exec") and len(argv) < 2):
        raise SystemExit("usage: python -m ddpc._worker (script.py | -m module | --exec "
                         "program) [args...]")
    die_with_parent()
    if argv[0] == "--exec":
        # The death signal set above outlives the exec, so the program still dies with the
        # launcher. Python ignores SIGPIPE and SIGXFSZ, and ignored signals outlive an exec too:
        # the program gets their defaults back, as from a shell (a pipeline's `yes | head`).
        for name in ("SIGPIPE", "SIGXFSZ"):
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), signal.SIG_DFL)
        # The exec keeps this process: a Python program (a console script) that joins a group
        # here reports its uncaught exception to the launcher (see report_uncaught_exceptions).
        os.environ["DDPC_EXEC_PID"] = str(os.getpid())
        try:
            os.execvp(argv[1], argv[1:])
        except OSError as e:
            hint = (": it has no #! line (add one, e.g. #!/bin/sh, as its first line)"
                    if e.errno == errno.ENOEXEC else "")
            raise SystemExit(f"ddpc._worker: cannot run {argv[1]!r}: {e.strerror or e}{hint}") \
                from None
    enable_stack_dumps()
    sys.excepthook = _trimming_hook(sys.excepthook)
    error_file = os.environ.get("DDPC_ERROR_FILE", "")
    try:
        if argv[0] == "-m":
            # `python -m` semantics: sys.path[0] is the working directory (already so, because
            # this module was itself started with -m). This is what `python -m` itself calls:
            # unlike run_module, it leaves the module in sys.modules["__main__"] afterwards.
            sys.argv = [argv[1]] + argv[2:]
            _fresh_main()  # (_run_module_as_main runs the module in __main__'s namespace)
            runpy._run_module_as_main(argv[1], alter_argv=True)  # type: ignore[attr-defined]
        else:
            sys.argv = list(argv)
            _run_script(argv[0])
    except SystemExit:
        raise  # exit codes pass through unchanged; a non-zero one shows the script's own stderr
    except BaseException as exc:  # noqa: BLE001 - recorded, then re-raised unchanged
        if error_file:
            write_error_file(error_file, exc, user_traceback(exc.__traceback__))
        raise

if __name__ == "__main__":
    main(sys.argv[1:])
