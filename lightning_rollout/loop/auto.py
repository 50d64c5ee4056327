"""``"auto"`` layout: how many worker processes and envs per thread, from a short measure of one env.

At start-up :func:`measure_env` builds one env and times ``steps`` random-action
steps of it (the step time, and how much it varies), leaving out the waits for a
CPU that other processes' load imposed (Linux's schedstats). For a step of
``cheap_s`` or more it then reads, five times, how much of a step holds the GIL
and keeps the median: the env steps on while a probe thread sleeps about 100 us
over and over; a wake-up that waits for the GIL tens of microseconds past its
usual overshoot found it held (:class:`_GilProbe`). The probe hardly slows the
env, reads shares, not speeds, and so gives the same answer on a loaded machine
(a 2 ms pure-Python step reads 0-10% without the GIL, one of 100-150 us under
40%, a 2 ms ``time.sleep`` 70% or more). Its cost: about 0.2 s for a 2 ms step, a
few milliseconds for a cheap one.

:func:`choose_layout` applies the rule documented in ``docs/tuning.rst``:

* a step that releases the GIL (at least ``releases``, half of it, without it)
  and takes at least ``helper_s`` (500 us): threads of the main process, every
  env in one block whose envs each step in a helper thread (``parallel_steps``).
  When the timed steps vary (``step_cv`` at least ``uneven_cv``, 0.3), the reason
  says that ``parallel_steps="free"`` would let each env run at its own pace,
  which ``"auto"`` does not pick: a stochastic policy's runs would not be
  reproducible;
* otherwise worker processes, with at least two cores, when the env time of a
  step of all envs that the other processes would take off the main process
  (``num_envs x step time x (1 - 1 / processes)``) exceeds ``round_trip_s``
  (300 us: a round trip to the children and back, and the copies out, cost
  100-400 us a step here). One process a core, at most one per env, and at most
  as many as give each a share of at least ``share_s`` (200 us) of env time a
  step; the main process steps the first share and one thread of it drives the
  children. Not when ``expected_frames`` steps would save less than
  ``startup_s`` (10 s; on two cores the gain counts as the measured 1.45x), nor
  when the env factory cannot be pickled: then threads, and the reason says so;
* otherwise threads of the main process: every env in one thread for a cheap
  step; for a step that releases the GIL, with ``parallel_steps``; for one that
  holds it (a cheap step is not measured and counts as holding it), blocks of
  about ``thread_s`` (1 ms) of env time a thread, never a helper thread per env.

The measuring env is created and closed here, in the calling thread, and its random
actions do not touch torch's global generator (it is forked around the measure).
A measure that fails or takes over ``timeout`` seconds (an env that hangs) falls back
to one env per thread in the main process, and says so.

A caller that keeps ``num_workers=1`` while the measured env would get worker processes
under ``num_workers="auto"`` gets the layout it asked for and, in :attr:`LayoutChoice.warning`,
why it is likely slower and what to pass.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import pickle
import statistics
import threading
import time
from dataclasses import dataclass, replace
from collections.abc import Callable
from typing import Any

import torch

from .._checks import check_int
from .._exit import abandon
from ..envs import EnvFactory, make_adapter
from .process import steps_in_main_process
from .schedstat import RunDelay

_UNPICKLABLE = ("the env factory cannot be pickled for worker processes (a gym id, a module-level function or a "
                "functools.partial can be)")
_DAEMONIC = ("this is a daemonic process (e.g. a DataLoader worker), which may not start worker processes")

__all__ = ["EnvTiming", "LayoutChoice", "apply_choice", "cgroup_cpu_limit", "choose_layout", "measure_env",
           "usable_cores"]

log = logging.getLogger("lightning_rollout")

# Measured on a 2-core VM (docs/performance.rst, gil_bound): the main process and one worker process
# driven by one thread against one thread for every env, 100 us GIL-holding steps, 16 envs.
_TWO_CORE_SPEEDUP = 1.45


@dataclass(frozen=True)
class EnvTiming:
    """What a few timed steps of one env showed.

    Attributes:
        step_s: mean seconds of one ``reset``-free env step (adapter included), less the measuring thread's
            waits for a CPU where Linux tells them.
        gil_release: share of a step spent without the GIL, ``0.0`` (pure Python) to ``1.0`` (a wait);
            ``NaN``: not measured (a cheap step), which counts as holding it.
        step_cv: how much the step times vary: their standard deviation over their mean (``0.0``: all
            alike; a heavy-tailed step time, 1 or more).
        batch: the rows of a natively batched env, which is not timed (``step_s`` is ``NaN``); ``None`` for
            a single env.
    """

    step_s: float
    gil_release: float
    step_cv: float = 0.0
    batch: int | None = None


@dataclass(frozen=True)
class LayoutChoice:
    """The layout chosen for a loop, and why.

    Attributes:
        num_workers: processes stepping the envs (1: envs in threads of the main process; ``n``: with
            one env thread the main process and ``n - 1`` worker processes, with several ``n`` worker
            processes; see :class:`~lightning_rollout.MultiEnvLoop`).
        envs_per_thread: envs stepped together by one thread (divides ``num_envs``).
        reason: one sentence, logged at INFO.
        parallel_steps: the envs of a block step concurrently, one helper thread each.
        warning: why the ``num_workers=1`` the caller kept is likely to run well below the ``"auto"`` layout
            (the measure found that worker processes would pay), with what to pass; ``None`` otherwise.
            :class:`~lightning_rollout.ThreadedCollector` raises it as a ``LayoutWarning``.
    """

    num_workers: int
    envs_per_thread: int
    reason: str
    parallel_steps: bool = False
    warning: str | None = None


def usable_cores() -> int:
    """CPU cores this process may run on: its CPU affinity, capped by its cgroup's CPU limit when one is set
    (a container's ``--cpus``, a Kubernetes CPU limit: whole cores, at least 1; see :func:`cgroup_cpu_limit`)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return cores if limit is None else max(1, min(cores, int(limit)))


def cgroup_cpu_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """The CPU limit of this process's cgroup, in cores (quota / period), or ``None`` when there is none or it
    cannot be read (not Linux, no cgroup files).

    Reads cgroup v2's ``cpu.max`` (``"max 100000"``: no limit; ``"150000 100000"``: 1.5 cores), else cgroup
    v1's ``cpu.cfs_quota_us`` (``-1``: no limit) and ``cpu.cfs_period_us`` under the ``cpu`` controller, in
    the process's cgroup folder and every folder above it up to the mount root (a container sees its own
    cgroup there); the smallest limit found applies, as the kernel enforces every ancestor's. Never raises.
    """
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        parts = [p for p in path.split("/") if p]
        if controllers == "":  # cgroup v2
            mounts, read = [root], _v2_limit
        elif "cpu" in controllers.split(","):  # cgroup v1
            mounts, read = [os.path.join(root, "cpu"), os.path.join(root, "cpu,cpuacct")], _v1_limit
        else:
            continue
        for mount in mounts:
            for depth in range(len(parts), -1, -1):  # the process's folder, then each one above it
                limit = read(os.path.join(mount, *parts[:depth]))
                if limit is not None:
                    limits.append(limit)
    return min(limits) if limits else None


def _v2_limit(folder: str) -> float | None:
    quota, _, period = (_read_text(os.path.join(folder, "cpu.max")) or "").partition(" ")
    return _ratio(quota, period)


def _v1_limit(folder: str) -> float | None:
    return _ratio(_read_text(os.path.join(folder, "cpu.cfs_quota_us")) or "",
                  _read_text(os.path.join(folder, "cpu.cfs_period_us")) or "")


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _ratio(quota: str, period: str) -> float | None:
    """``quota / period`` when both are positive integers, else ``None`` (``"max"``, ``-1``: no limit; or
    unreadable)."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


class _GilProbe:
    """A thread that reads how much of the time another thread holds the GIL, barely slowing it.

    :meth:`run` sleeps about ``period`` seconds (0.5x to 1.5x, in a fixed pseudo-random order that no env's
    rhythm can lock onto) over and over, and times each sleep from one wake-up to the next with this thread's
    run-queue waits taken off (:class:`RunDelay`). Unless ``alone`` gives it, its first ``solo`` sleeps,
    before :attr:`ready` is set and while nothing else runs, give how far a wake-up overshoots alone (their
    median, kept in :attr:`alone`). Past that, a wake-up that overshoots by ``threshold`` more found the GIL
    held, and the probe counts the whole sleep it ends as held: a thread that holds the GIL keeps it until it
    lets it go, or for the 5 ms switch interval, tens to thousands of microseconds, where a wake-up's
    overshoot alone varies by 10-40 us. :attr:`held` is the share of the time from :attr:`ready` until
    :attr:`stop` is set (or ``limit`` seconds) counted as held; ``None`` before :meth:`run` returns or when it
    measured nothing. The probe itself holds the GIL a few microseconds a sleep."""

    def __init__(self, *, alone: float | None = None, period: float = 100e-6, solo: int = 20,
                 threshold: float = 30e-6, limit: float = 5.0) -> None:
        self.alone, self.period, self.solo, self.threshold, self.limit = alone, period, solo, threshold, limit
        self.ready, self.stop = threading.Event(), threading.Event()
        self.held: float | None = None

    def run(self) -> None:
        delay = RunDelay()
        try:
            sleep, clock = time.sleep, time.perf_counter
            pauses = [self.period * (0.5 + ((i * 37) % 64) / 63) for i in range(64)]  # 0.5x to 1.5x
            t, d = clock(), delay()
            if self.alone is None:
                overshoots = []
                for i in range(self.solo):
                    sleep(pauses[i % 64])
                    t1, d1 = clock(), delay()
                    overshoots.append(t1 - t - (d1 - d) - pauses[i % 64])
                    t, d = t1, d1
                self.alone = statistics.median(overshoots)
            alone = self.alone
            held = total = 0.0
            start, i = t, 0
            self.ready.set()
            while not self.stop.is_set() and t - start < self.limit:
                pause = pauses[i % 64]
                sleep(pause)
                t1, d1 = clock(), delay()
                cycle = t1 - t - (d1 - d)
                total += cycle
                if cycle - pause - alone > self.threshold:  # woke up to a held GIL
                    held += cycle
                t, d, i = t1, d1, i + 1
            self.held = min(1.0, held / total) if total > 0 else None
        finally:
            delay.close()
            self.ready.set()


def measure_env(factory: EnvFactory, *, steps: int = 30, max_episode_steps: int | None = None,
                cheap_s: float = 100e-6, rounds: int = 5, probe_s: float = 0.1) -> EnvTiming:
    """Time one env built by ``factory``, and for a step of ``cheap_s`` or more measure how much of it holds the
    GIL; see the module docs.

    The env is built, stepped and closed in the calling thread, with random actions: 3 warm-up steps (the
    first steps of an env pay for caches and lazy imports), ``steps`` timed steps (resets after an episode's
    end are not timed, nor are this thread's waits for a CPU that other processes' load took, where Linux's
    schedstats tell them), then ``rounds`` readings of the GIL, each over ``max(probe_s / rounds, 2 steps)`` of
    stepping while a probe thread times its own short sleeps (:class:`_GilProbe`); the median reading is kept
    (``NaN`` if none came). A cheap env (under ``cheap_s`` a step) is not measured for the GIL: its layout
    does not depend on it. Cost: ``steps + 3`` steps, and for a step of ``cheap_s`` or more ``rounds x
    max(probe_s / rounds, 2 steps)`` of stepping and a few milliseconds: about 0.2 s for a 2 ms step (0.07 s
    timed, 0.1 s probed), a few milliseconds for a cheap one.

    Raises:
        Exception: whatever building or stepping the env raised.
    """
    adapter = make_adapter(factory(), max_episode_steps=max_episode_steps)
    if adapter.batched:  # a natively batched env: its layout is one env thread a batch, whatever its speed
        adapter.close()
        return EnvTiming(step_s=float("nan"), gil_release=float("nan"), batch=adapter.rows)
    delay = RunDelay()
    try:
        columns = adapter.keys.action
        root = adapter.reset(None)

        def step(timed: bool = True) -> float:
            """One random-action step (and the reset after an episode's end); its seconds, less this thread's
            run-queue waits (``timed=False``: ``0.0``, and no read of them, which lets the GIL go)."""
            nonlocal root
            row = {**root, **adapter.random_action(columns)}
            d0 = delay() if timed else 0.0
            t0 = time.perf_counter()
            _, _, terminated, truncated = adapter.step(row)
            seconds = time.perf_counter() - t0 - (delay() - d0) if timed else 0.0
            if terminated or truncated:
                root = adapter.reset(None)
            return max(0.0, seconds)

        for _ in range(3):
            step()
        times = [step() for _ in range(steps)]
        step_s = statistics.fmean(times)
        cv = statistics.pstdev(times, step_s) / step_s if step_s > 0 else 0.0
        if step_s < cheap_s:
            return EnvTiming(step_s=step_s, gil_release=float("nan"), step_cv=cv)
        window = max(probe_s / rounds, 2 * step_s)
        readings, alone = [], None
        for _ in range(rounds):
            held, alone = _held_share(step, window, alone)
            if held is not None:
                readings.append(held)
        release = 1.0 - statistics.median(readings) if readings else float("nan")
        return EnvTiming(step_s=step_s, gil_release=release, step_cv=cv)
    finally:
        delay.close()
        adapter.close()


def _held_share(step: Callable[[bool], float], window: float,
                alone: float | None) -> tuple[float | None, float | None]:
    """The share of the time that ``window`` seconds of ``step(False)`` calls (two at least) held the GIL, as a
    :class:`_GilProbe` reads it (``None`` when it read nothing), and the probe's overshoot alone (``alone``, or
    measured first when ``None``). Raises what ``step`` raised, the probe stopped."""
    probe = _GilProbe(alone=alone, limit=window * 4 + 1.0)
    thread = threading.Thread(target=probe.run, name="lightning_rollout-auto-probe", daemon=True)
    thread.start()
    try:
        probe.ready.wait(1.0)  # the probe has timed its sleeps alone: from now on it reads the steps
        end, n = time.perf_counter() + window, 0
        while n < 2 or time.perf_counter() < end:
            step(False)
            n += 1
    finally:
        probe.stop.set()
        thread.join(1.0)  # within one sleep of the probe: this thread no longer takes the GIL
    return probe.held, probe.alone


def choose_layout(num_envs: int, timing: EnvTiming, *, cores: int | None = None, cheap_s: float = 100e-6,
                  thread_s: float = 1e-3, startup_s: float = 10.0, round_trip_s: float = 300e-6,
                  helper_s: float = 500e-6, share_s: float = 200e-6, uneven_cv: float = 0.3,
                  releases: float = 0.5, expected_frames: int | None = None, num_workers: int | str = "auto",
                  envs_per_thread: int | str = "auto", no_processes: str = _UNPICKLABLE) -> LayoutChoice:
    """The layout for ``num_envs`` envs with ``timing`` on ``cores`` cores (see the module docs).

    A step releases the GIL when at least ``releases`` of it is spent without it; any other step (``NaN``:
    not measured, a cheap one) holds it and never gets a helper thread per env (``parallel_steps``).
    A value other than ``"auto"`` for ``num_workers`` or ``envs_per_thread`` is kept, and the other
    one is chosen around it (``num_workers="threads"``: auto, but no worker processes, for the reason
    ``no_processes``, which the choice's reason repeats).
    """
    if timing.batch is not None:  # a natively batched env steps its batch in one call: one env thread a batch
        return LayoutChoice(1, timing.batch, f"a natively batched env of {timing.batch} envs: one env thread steps "
                                             "each batch in one call")
    cores = usable_cores() if cores is None else cores
    step_us = timing.step_s * 1e6
    holds_gil = not timing.gil_release >= releases  # NaN (not measured: cheap) counts as holding it
    gil = ("not measured for the GIL" if timing.gil_release != timing.gil_release
           else f"{timing.gil_release:.0%} of it without the GIL: it {'holds' if holds_gil else 'releases'} the GIL")
    if num_workers == "auto":
        # every process's share of a step at least share_s of env time: past that, each further process adds
        # its send, reply and copy out to the one driving thread's serial part more than it takes off the others
        most = min(cores, num_envs)  # a process a core, at most one per env
        processes = min(most, max(2, int(num_envs * timing.step_s / share_s + 1e-9)))
        speedup = _TWO_CORE_SPEEDUP if cores == 2 else processes
        spread_s = num_envs * timing.step_s * (1 - 1 / processes)  # env time a step the children take over
        saved_s = None if expected_frames is None else expected_frames * timing.step_s * (1 - 1 / speedup)
        helpers = not holds_gil and timing.step_s >= helper_s  # long steps that release the GIL: helper threads
        if cores < 2 or num_envs < 2 or helpers or spread_s < round_trip_s:
            num_workers = 1
            why = f"the env step takes {step_us:.0f} us ({gil}): threads of the main process"
        elif saved_s is not None and saved_s < startup_s:
            num_workers = 1
            why = (f"the env step takes {step_us:.0f} us, but {expected_frames} frames are too few to repay starting "
                   f"worker processes: threads of the main process")
        else:
            num_workers = processes
            why = (f"the env step takes {step_us:.0f} us ({gil}), {spread_s * 1e6:.0f} us of each step of the "
                   f"{num_envs} envs for other processes: {num_workers} processes on {cores} cores"
                   + ("" if num_workers == most else
                      f" (a share of at least {share_s * 1e6:.0f} us of env time each)"))
    elif num_workers == "threads":  # processes were ruled out by the caller (see auto_layout)
        num_workers = 1
        why = f"the env step takes {step_us:.0f} us ({gil}), but {no_processes}: threads of the main process"
    else:
        why = f"num_workers={num_workers} as given"
    parallel = False
    if envs_per_thread == "auto":
        if int(num_workers) > 1:
            envs_per_thread = num_envs  # one thread drives every process: one wake-up a step for all of them
            why += ", one thread of the main process driving them all"
        elif timing.step_s < cheap_s:
            envs_per_thread = num_envs  # hand-offs between threads would cost more than they overlap
            why += f", all {num_envs} envs in one thread"
        elif not holds_gil:
            envs_per_thread, parallel = num_envs, True  # one block, each env's step in its own helper thread
            why += f", all {num_envs} envs in one thread, each stepped in its own helper thread"
            if timing.step_cv >= uneven_cv:  # lock-step waits for the slowest env of every step
                why += (f"; the step times vary (cv {timing.step_cv:.1f}): parallel_steps='free' lets each env run at "
                        "its own pace (1.5x on heavy-tailed step times in docs/performance.rst), but a stochastic "
                        "policy's runs are then not reproducible")
        else:  # holds the GIL, but processes were ruled out: a thread's block of about thread_s
            want = max(1, min(num_envs, math.ceil(thread_s / max(timing.step_s, 1e-9))))
            while num_envs % want:
                want += 1
            envs_per_thread = want
            why += (f", {want} env{'s' if want > 1 else ''} per thread, with no helper thread per env: a step that "
                    "holds the GIL would not overlap another")
    else:
        why += f", envs_per_thread={envs_per_thread} as given"
    if int(num_workers) > 1:  # which processes step envs (see WorkerProcesses)
        n = int(num_workers)
        why += (f" (the main process and {n - 1} worker process{'es' if n > 2 else ''})"
                if steps_in_main_process(num_envs, int(envs_per_thread)) else f" ({n} worker processes)")
    return LayoutChoice(int(num_workers), int(envs_per_thread), why, parallel)


def auto_layout(factory: EnvFactory, num_envs: int, *, num_workers: int | str, envs_per_thread: int | str,
                max_episode_steps: int | None = None, expected_frames: int | None = None, name: str = "loop",
                timeout: float = 10.0) -> LayoutChoice:
    """Measure one env and choose; logs the choice at INFO on the ``lightning_rollout`` logger."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            with torch.random.fork_rng(devices=[]):
                box["timing"] = measure_env(factory, max_episode_steps=max_episode_steps)
        except Exception as exc:  # reported by the loop itself when it builds the envs
            box["error"] = exc

    thread = threading.Thread(target=target, name="lightning_rollout-auto-measure", daemon=True)
    thread.start()
    thread.join(timeout)
    if "timing" not in box:
        if thread.is_alive():
            abandon(thread)  # stuck in the env: a daemon that cannot crash the interpreter's exit (see _exit)
        why = (f"measuring one env failed ({type(box['error']).__name__}: {box['error']})" if "error" in box
               else f"measuring one env took over {timeout} s")
        workers = 1 if is_auto(num_workers) else int(num_workers)
        ept = 1 if is_auto(envs_per_thread) else int(envs_per_thread)
        choice = LayoutChoice(workers, ept, f"{why}: num_workers={workers}, envs_per_thread={ept}")
        log.info("%s: %s", name, choice.reason)
        return choice
    timing = box["timing"]
    choice = choose_layout(num_envs, timing, num_workers=num_workers, envs_per_thread=envs_per_thread,
                           expected_frames=expected_frames)
    best = choice if is_auto(num_workers) else choose_layout(num_envs, timing, expected_frames=expected_frames)
    no_processes = None
    if best.num_workers > 1:
        no_processes = (_DAEMONIC if mp.current_process().daemon else None if _picklable(factory) else _UNPICKLABLE)
    if is_auto(num_workers) and best.num_workers > 1 and no_processes is not None:
        choice = choose_layout(num_envs, timing, num_workers="threads", envs_per_thread=envs_per_thread,
                               no_processes=no_processes)
    elif choice.num_workers == 1 and best.num_workers > 1 and no_processes is None:  # processes kept out by hand
        choice = replace(choice, warning=(
            f"num_workers=1 keeps every env in this process, but num_workers='auto' would step them in "
            f"{best.num_workers} processes ({best.reason}); on two cores, one process ran at 0.66-0.79x the 'auto' "
            f"layout on the benchmarks' GIL-bound env, HalfCheetah and Pong; pass num_workers='auto' (or "
            f"{best.num_workers})"))
    log.info("%s: num_workers=%d, envs_per_thread=%d, parallel_steps=%s (%s)", name, choice.num_workers,
             choice.envs_per_thread, choice.parallel_steps, choice.reason)
    return choice


def resolve_layout(factory: EnvFactory, num_envs: int, *, num_workers: int | str, envs_per_thread: int | str,
                   max_episode_steps: int | None = None, expected_frames: int | None = None,
                   step_timeout: float | None = None, name: str = "loop") -> LayoutChoice | None:
    """The ``"auto"`` choice for a loop of ``num_envs`` envs (``None`` when neither knob is ``"auto"``). One env
    needs no measure; the measure is bounded by ``step_timeout`` (at most 10 s)."""
    if not (is_auto(num_workers) or is_auto(envs_per_thread)):
        return None
    if num_envs == 1:
        return LayoutChoice(1, 1, "one env")
    return auto_layout(factory, num_envs, num_workers=num_workers, envs_per_thread=envs_per_thread,
                       max_episode_steps=max_episode_steps, expected_frames=expected_frames, name=name,
                       timeout=10.0 if step_timeout is None else min(10.0, float(step_timeout)))


def apply_choice(choice: LayoutChoice | None, *, num_workers: int | str, envs_per_thread: int | str,
                 parallel_steps: bool | str) -> tuple[Any, Any, Any]:
    """The knobs a loop runs with, given :func:`resolve_layout`'s ``choice``: its layout when there is one,
    and for ``parallel_steps="auto"`` what it picked (False without a choice: with the layout set, envs step
    one after the other). ``(num_workers, envs_per_thread, parallel_steps)``; other values pass through."""
    if is_auto(parallel_steps):
        parallel_steps = choice is not None and choice.parallel_steps
    if choice is not None:
        num_workers, envs_per_thread = choice.num_workers, choice.envs_per_thread
    return num_workers, envs_per_thread, parallel_steps


def layout_warning(num_envs: int, envs_per_thread: int, num_workers: int, *, cores: int | None = None) -> str | None:
    """Why worker processes driven by several env threads are likely to run well below the ``"auto"``
    layout, with what to pass instead; ``None`` for one env thread or no worker processes.

    With several env threads, ``num_workers`` worker processes step every env (see
    :func:`~lightning_rollout.loop.process.steps_in_main_process`) while the main process runs the threads'
    bookkeeping and the policy: one busy process more than ``num_workers``. More threads than processes put
    several blocks in each process, which take turns on its GIL, each step of each a round trip of its own.
    On two cores, 16 envs: HalfCheetah with ``num_workers=2, envs_per_thread=8`` ran at 0.52x ``"auto"``, a
    GIL-bound env with ``num_workers=2, envs_per_thread=1`` at 0.31x one process."""
    blocks = num_envs // envs_per_thread
    if num_workers < 2 or blocks < 2:
        return None
    cores = usable_cores() if cores is None else cores
    one_thread = f"envs_per_thread={num_envs} (one env thread: the main process steps a share)"
    # Each alternative offered is one this rule does not warn about in turn.
    if blocks > num_workers:
        per = math.ceil(blocks / num_workers)
        even = (f", or envs_per_thread={num_envs // num_workers} (a block a process)"
                if num_envs % num_workers == 0 and num_workers + 1 <= cores else "")
        return (f"{blocks} env threads over {num_workers} worker processes: each process serves up to {per} blocks, "
                f"which take turns on its GIL, and each block's step is a round trip of its own; pass {one_thread}"
                f"{even}")
    if num_workers + 1 > cores:
        fewer = f", or num_workers={cores - 1}" if 2 <= cores - 1 and blocks <= cores - 1 else ""
        return (f"with {blocks} env threads, {num_workers} worker processes step every env while the main process "
                f"runs the threads and the policy: {num_workers + 1} busy processes on {cores} cores; pass "
                f"{one_thread}{fewer}")
    return None


def one_env_threads_warning(num_envs: int, envs_per_thread: int) -> str | None:
    """Why one env thread per env, asked of a collector, is likely to run well below the ``"auto"`` layout,
    with what to pass instead; ``None`` for blocks of several envs or a single env.

    Each env's thread then hands every one of its steps to the policy's thread on its own, and writes and
    publishes its own step: a hand-off costs more than a cheap step, and the helper threads of one block
    (``parallel_steps=True``) overlap GIL-releasing steps at a smaller cost. On two cores, 16 envs, it ran at
    0.1-0.8x ``"auto"`` on every env of the benchmarks (CartPole, 2 ms sleeps, stragglers, a large policy,
    HalfCheetah, Pong). :class:`~lightning_rollout.MultiEnvLoop` keeps it as its default, the seed's design,
    without this warning."""
    if envs_per_thread != 1 or num_envs < 2:
        return None
    return (f"envs_per_thread=1 runs {num_envs} env threads of one env each, every env step a hand-off of its own "
            "to the policy's thread: on two cores it ran at 0.1-0.8x the 'auto' layout on every env of the "
            f"benchmarks; pass envs_per_thread='auto', or envs_per_thread={num_envs} (one thread; with "
            "parallel_steps=True for steps that release the GIL)")


def _picklable(factory: EnvFactory) -> bool:
    try:
        pickle.dumps(factory)
        return True
    except Exception:
        return False


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def check_knobs(*, envs_per_thread: Any, num_workers: Any) -> None:
    """Each of ``envs_per_thread`` / ``num_workers`` is ``"auto"`` or an int ``>= 1`` (else ``ValueError``)."""
    for knob, value in (("envs_per_thread", envs_per_thread), ("num_workers", num_workers)):
        if not is_auto(value):
            check_int(knob, value, 1)
