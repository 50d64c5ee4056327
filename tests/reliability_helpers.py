"""Helpers for the reliability tests (test_properties.py, test_faults.py, test_soak.py).

* :func:`bounded` runs a call in a helper thread and fails the test, with a dump of
  every thread's stack (``sys._current_frames``), if it has neither returned nor
  raised within a bound: a hang is reported as a hang, not as the runner's timeout.
  :class:`InThread` is the same for a call the test starts and waits for later.
* :func:`rollout_threads` / :func:`assert_no_rollout_threads`: the
  ``lightning_rollout-*`` threads alive now.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import pytest

THREAD_PREFIX = "lightning_rollout-"


def rollout_threads(exclude: set[threading.Thread] | frozenset = frozenset()) -> list[threading.Thread]:
    return [t for t in threading.enumerate()
            if t.name.startswith(THREAD_PREFIX) and t.is_alive() and t not in exclude]


def assert_no_rollout_threads(exclude: set[threading.Thread] | frozenset = frozenset()) -> None:
    alive = rollout_threads(exclude)
    assert not alive, f"threads still alive: {[t.name for t in alive]}\n{dump_stacks()}"


def dump_stacks() -> str:
    """Every thread's current stack, named."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, ident)} ---\n{''.join(traceback.format_stack(frame))}")
    return "\n".join(parts)


class InThread:
    """``fn()`` started now in a thread of its own (``name``); :meth:`result` waits for it."""

    def __init__(self, fn: Callable[[], Any], *, name: str, daemon: bool = False) -> None:
        self._box: dict[str, Any] = {}

        def target() -> None:
            try:
                self._box["value"] = fn()
            except BaseException as exc:  # handed back to the test's thread
                self._box["error"] = exc

        self.thread = threading.Thread(target=target, name=name, daemon=daemon)
        self.thread.start()

    def result(self, timeout: float, what: str = "call") -> Any:
        """``fn``'s result, or its exception re-raised here. Fails the test with every thread's stack
        when ``fn`` has not ended within ``timeout`` s."""
        self.thread.join(timeout)
        if self.thread.is_alive():
            pytest.fail(f"{what} did not return within {timeout} s (a hang); thread stacks:\n{dump_stacks()}")
        if "error" in self._box:
            raise self._box["error"]
        return self._box.get("value")


def bounded(fn: Callable[[], Any], timeout: float = 30.0, what: str = "call") -> Any:
    """``fn()`` in a helper thread; its result, or its exception re-raised here.

    Fails the test with every thread's stack when ``fn`` takes longer than ``timeout`` s.
    """
    return InThread(fn, name="test-bounded", daemon=True).result(timeout, what)
