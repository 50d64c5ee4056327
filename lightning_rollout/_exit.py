"""Interpreter exit: close running loops and policies, and never let an abandoned thread abort the process.

One ``atexit`` hook closes every object of :func:`close_at_exit` still alive, the last registered first (before
``multiprocessing``'s hook joins child processes). A thread abandoned after a timeout (:func:`abandon`) cannot be
stopped, and killed inside a torch call at finalization it aborts the process; so the hook waits up to
:data:`EXIT_GRACE_S` s for every ``lightning_rollout-*`` thread (but those of :func:`exempt_at_exit`), and if one
still runs it names them on stderr and ends with :func:`os._exit`, with the exit code the script was about to exit
with (``sys.exit``'s, 1 after an uncaught exception, death by ``SIGINT`` after a ``KeyboardInterrupt``, else 0).
``logging.shutdown`` and ``weakref.finalize`` run first; exit handlers registered before this module are skipped.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import logging
import multiprocessing.util  # noqa: F401 (imported first: its exit hook then runs after ours)
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

__all__ = ["EXIT_GRACE_S", "abandon", "close_at_exit", "exempt_at_exit", "sigint_blocked"]

EXIT_GRACE_S = 2.0  # seconds the exit hook waits, in total, for threads still running after closing
THREAD_PREFIX = "lightning_rollout-"


class _Closable(Protocol):
    def close(self) -> None: ...


_LIVE: weakref.WeakValueDictionary[int, _Closable] = weakref.WeakValueDictionary()  # in registration order
_ORDER = itertools.count()
_ABANDONED: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_EXEMPT: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_LOCK = threading.Lock()
_EXIT_STATUS: list[Any] = []  # the last sys.exit() argument given in the main thread, if any


def _last_uncaught() -> BaseException | None:
    """The exception Python last reported as uncaught (``sys.last_exc``, ``sys.last_value`` before 3.12)."""
    return getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)


_LAST_UNCAUGHT_AT_IMPORT = _last_uncaught()


def close_at_exit(obj: _Closable) -> None:
    """Close ``obj`` at interpreter exit if still alive (weak reference); registered again, it keeps its place."""
    with _LOCK:
        if not any(o is obj for o in _LIVE.values()):
            _LIVE[next(_ORDER)] = obj
    _record_sys_exit()


def exempt_at_exit(thread: threading.Thread) -> None:
    """The exit hook neither waits for nor names ``thread``, a daemon that only waits on a fd or a lock (any thread)."""
    with _LOCK:
        _EXEMPT.add(thread)


def abandon(thread: threading.Thread) -> None:
    """Record a daemon ``thread`` left running after a timeout, to wait for at exit (see the module docstring)."""
    with _LOCK:
        _ABANDONED.add(thread)
    _record_sys_exit()


def _record_sys_exit() -> None:
    """Wrap ``sys.exit`` once so the exit code asked for in the main thread is known at exit."""
    if getattr(sys.exit, "_lightning_rollout_wrapped", False):
        return
    original = sys.exit

    @functools.wraps(original)
    def exit(status: Any = None) -> None:  # noqa: A001 (same name and signature as sys.exit)
        if threading.current_thread() is threading.main_thread():
            _EXIT_STATUS[:] = [status]
        original(status)

    exit._lightning_rollout_wrapped = True  # type: ignore[attr-defined]
    sys.exit = exit


def _intended_status() -> tuple[int, bool]:
    """``(exit code, killed by SIGINT)`` the interpreter was about to exit with (see the module docs)."""
    last = _last_uncaught()
    if last is not None and last is not _LAST_UNCAUGHT_AT_IMPORT:  # an uncaught exception ended the script
        return 1, isinstance(last, KeyboardInterrupt)
    status = _EXIT_STATUS[0] if _EXIT_STATUS else None
    if status is None or isinstance(status, int):  # bools included, as Python does
        return int(status or 0) & 0xFF, False
    return 1, False  # sys.exit("message"): Python prints it and exits with 1


@atexit.register
def _close_live() -> None:
    with _LOCK:
        live = [obj for _, obj in sorted(_LIVE.items(), key=lambda item: item[0], reverse=True)]
    for obj in live:
        with contextlib.suppress(Exception):  # exiting: nothing to report to
            obj.close()
    deadline = time.monotonic() + EXIT_GRACE_S
    ours = {t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)}
    with _LOCK:
        threads = (set(_ABANDONED) | ours) - set(_EXEMPT)
    stuck = [t for t in threads if t.is_alive() and t is not threading.current_thread()]
    for thread in stuck:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [t for t in stuck if t.is_alive()]
    if not stuck:
        return
    # end the process without finalizing (the stuck threads could abort it there)
    code, by_sigint = _intended_status()
    for run in (weakref.finalize._exitfunc, logging.shutdown):  # type: ignore[attr-defined]
        with contextlib.suppress(Exception):  # exiting: nothing to report to
            run()
    names = sorted(t.name for t in stuck)
    how = "by SIGINT (KeyboardInterrupt)" if by_sigint and os.name == "posix" else f"with os._exit({code})"
    with contextlib.suppress(Exception):  # stderr closed
        print(f"lightning_rollout: thread(s) {names} abandoned after a timeout are still running at interpreter "
              f"exit; ending the process {how} so they cannot crash its finalization", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):  # a closed or broken stream
            if stream is not None:
                stream.flush()
    if by_sigint and os.name == "posix":  # POSIX: die by SIGINT, as Python does after a KeyboardInterrupt
        with contextlib.suppress(OSError, ValueError):
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        code = 130
    os._exit(code)


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread for the block: processes started meanwhile start with it blocked (kept across
    ``exec``), so a Ctrl-C to the process group is ours alone; one arriving meanwhile waits for the block's end."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # it unblocks SIGINT in the thread that starts it: before the mask
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
