"""Timing one contender: build once, warm up, time ``repeats`` runs of a fixed frame count.

Setup (thread and process start-up, env construction) is not timed: the
figures are steady-state collection throughput. Peak memory, when asked, is
the largest resident set of this process plus its children (worker
processes), sampled every 20 ms from construction to close.
"""

from __future__ import annotations

import statistics
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from .contenders import Session

__all__ = ["measure", "merge"]


class _PeakRss:
    """Samples the RSS of this process tree in a daemon thread; ``peak_mb`` after ``stop()``."""

    def __init__(self, interval: float = 0.02) -> None:
        import psutil

        self._proc = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self.peak = self._sample()
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)
        self._thread.start()

    def _sample(self) -> int:
        total = self._proc.memory_info().rss
        for child in self._proc.children(recursive=True):
            try:
                total += child.memory_info().rss
            except Exception:  # a worker that just exited
                pass
        return total

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, self._sample())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self._sample()) / 2**20


def measure(build: Callable[[], Session], frames: int, repeats: int, warmup_frames: int,
            track_memory: bool = False) -> dict[str, Any]:
    """Run one contender; never raises (a failure is recorded as ``error``).

    Returns:
        ``{"steps_per_s": [...], "median", "min", "max", "frames", "setup_s", "stats", "peak_rss_mb", "error"}``.
    """
    result: dict[str, Any] = {"steps_per_s": [], "frames": [], "stats": {}, "peak_rss_mb": None, "error": None}
    rss = _PeakRss() if track_memory else None
    session: Session | None = None
    try:
        t0 = time.perf_counter()
        session = build()
        result["setup_s"] = time.perf_counter() - t0
        if warmup_frames:
            session.run(warmup_frames)
        for _ in range(repeats):
            t0 = time.perf_counter()
            got = session.run(frames)
            elapsed = time.perf_counter() - t0
            result["frames"].append(got)
            result["steps_per_s"].append(got / elapsed)
        result["stats"] = session.stats()
    except Exception as exc:  # keep the other contenders running; the table shows the error
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    finally:
        if session is not None:
            try:
                session.close()
            except Exception as exc:
                result["error"] = result["error"] or f"close failed: {type(exc).__name__}: {exc}"
        if rss is not None:
            result["peak_rss_mb"] = rss.stop()
    values = result["steps_per_s"]
    if values:
        result.update(median=statistics.median(values), min=min(values), max=max(values))
    return result


def merge(before: dict[str, Any] | None, more: dict[str, Any]) -> dict[str, Any]:
    """One contender's result over the rounds so far: ``more`` (a round's :func:`measure`) added to ``before``
    (the rounds before it, or ``None``); repetitions and frames appended, the summary recomputed, the first
    error and the largest setup time and peak memory kept, the last stats."""
    if before is None:
        return more
    merged = {**before, "steps_per_s": before["steps_per_s"] + more["steps_per_s"],
              "frames": before["frames"] + more["frames"], "stats": more["stats"] or before["stats"],
              "error": before["error"] or more["error"]}
    merged["setup_s"] = max(before.get("setup_s", 0.0), more.get("setup_s", 0.0))
    peaks = [p for p in (before["peak_rss_mb"], more["peak_rss_mb"]) if p is not None]
    merged["peak_rss_mb"] = max(peaks) if peaks else None
    if "traceback" in more and "traceback" not in before:
        merged["traceback"] = more["traceback"]
    values = merged["steps_per_s"]
    if values:
        merged.update(median=statistics.median(values), min=min(values), max=max(values))
    return merged
