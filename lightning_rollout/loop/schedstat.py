"""How long a thread waited, runnable, for a CPU: what other processes' load adds to a wall-clock interval.

Timings that decide a layout (the ``"auto"`` measure, helper threads' placement) subtract it, so that the same
env reads the same on a loaded machine.
"""

from __future__ import annotations

import os

__all__ = ["RunDelay"]


class RunDelay:
    """Seconds the thread that built it has waited, runnable, for a CPU (Linux's ``run_delay`` in
    ``/proc/thread-self/schedstat``): the part of a wall-clock interval that other processes' load took.
    ``0.0`` throughout where that file cannot be read (not Linux, no schedstats): then nothing is taken off.
    Build, call and close it in one thread."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None
        self._last = 0.0
        self._last = self()

    def __call__(self) -> float:
        if self._fd is not None:
            try:
                self._last = int(os.pread(self._fd, 128, 0).split()[1]) * 1e-9
            except (OSError, ValueError, IndexError):  # unreadable from now on: the last value stays
                self.close()
        return self._last

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
