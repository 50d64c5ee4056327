"""``"auto"`` layout: how many worker processes and envs per thread, from a few timed steps of one env.

At start-up :func:`measure_env` times ``steps`` random-action steps of one env
(the step time, and how much it varies) and runs them again in a helper thread
while the calling thread counts in a tight Python loop: the share of its solo
count rate it keeps while the env steps is the share of a step spent without the
GIL. :func:`choose_layout` applies the rule documented in ``docs/tuning.rst``:

* worker processes, with at least two cores, when the env time of a step of all
  envs that the other processes would take off the main process (``num_envs x step
  time x (1 - 1 / processes)``) exceeds ``round_trip_s`` (300 us: a round trip to
  the children and back, and the copies out, cost 100-400 us a step here), unless
  the step releases the GIL and takes at least ``helper_s`` (500 us: a wait or a
  long C call; then threads, below). ``num_workers`` is the core count (at most
  one process per env, and see ``share_s`` below): the main process steps the
  first share itself and ``num_workers - 1`` children the others, all driven by
  one thread of the main process that sends every child its share of each step,
  steps its own, and gathers the replies. This covers envs that hold the GIL (pure
  Python, ALE; a step under ``cheap_s`` is not measured and counts as holding it)
  and short steps of many envs (MuJoCo: 16 HalfCheetahs of 60 us). At most as many
  processes as give each a share of at least ``share_s`` (200 us) of env time a
  step (16 envs of 100 us: 8 processes): each process adds its send, reply and
  copy out to the driving thread's serial part of every step, and on 16 cores, 16
  processes over 16 such envs measured slower than 8 (``docs/performance.rst``).
  On two cores this changes nothing: two processes whenever processes pay. Not
  when the run is known to be too short to repay the children's start-up
  (``expected_frames`` steps would save less than ``startup_s``, 10 s: spawning a
  process that imports torch takes seconds), or when the env factory cannot be
  pickled (then threads, and the log says why). On two cores the gain measured
  1.5x on a GIL-bound env and 1.3x on HalfCheetah, not 2x: the policy and the
  bookkeeping run in the main process while the child waits
  (``docs/performance.rst``);
* otherwise a cheap step (CartPole, most classic control): all envs in one thread
  of the main process; thread hand-offs would cost more than the step;
* a step that releases the GIL and takes at least ``helper_s``: threads of the main
  process, every env in one block whose envs step concurrently, each in its own
  helper thread (``parallel_steps``): the block's bookkeeping and policy call run
  once a step, and only ``env.step`` itself runs in the helpers. In lock-step: when
  the timed steps vary (their ``step_cv`` at least ``uneven_cv``, 0.3), the reason
  says that ``parallel_steps="free"`` would let each env run at its own pace, which
  ``"auto"`` does not pick because it makes a stochastic policy's runs
  unreproducible.

The measuring env is created and closed here, in the calling thread, and its random
actions do not touch torch's global generator (it is forked around the measure).
A measure that fails or takes over ``timeout`` seconds (an env that hangs) falls back
to one env per thread in the main process, and says so.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from .._exit import abandon
from ..envs import EnvFactory, make_adapter
from .process import steps_in_main_process

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
        step_s: mean seconds of one ``reset``-free env step (adapter included).
        gil_release: share of a step spent without the GIL, ``0.0`` (pure Python) to ``1.0``.
        step_cv: how much the step times vary: their standard deviation over their mean (``0.0``: all
            alike; a heavy-tailed step time, 1 or more).
    """

    step_s: float
    gil_release: float
    step_cv: float = 0.0


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
    """

    num_workers: int
    envs_per_thread: int
    reason: str
    parallel_steps: bool = False


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


def _count_for(seconds: float, stop: threading.Event | None = None) -> int:
    """Increments done in ``seconds`` of a tight Python loop (stopped early by ``stop``)."""
    n = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end and not (stop is not None and stop.is_set()):
        for _ in range(200):
            n += 1
    return n


def measure_env(factory: EnvFactory, *, steps: int = 30, max_episode_steps: int | None = None,
                cheap_s: float = 100e-6) -> EnvTiming:
    """Time ``steps`` random-action steps of one env built by ``factory``; see the module docs. A cheap env
    (under ``cheap_s`` a step) is not measured for the GIL: its layout does not depend on it.

    Raises:
        Exception: whatever building or stepping the env raised.
    """
    adapter = make_adapter(factory(), max_episode_steps=max_episode_steps)
    try:
        columns = adapter.keys.action
        root = adapter.reset(None)

        def run(n: int, times: list[float] | None = None) -> float:
            nonlocal root
            start = time.perf_counter()
            for _ in range(n):
                row = {**root, **adapter.random_action(columns)}
                t0 = time.perf_counter()
                _, _, terminated, truncated = adapter.step(row)
                if times is not None:
                    times.append(time.perf_counter() - t0)
                if terminated or truncated:
                    root = adapter.reset(None)
            return time.perf_counter() - start

        run(3)  # warm-up
        times: list[float] = []
        step_s = run(steps, times) / steps
        mean = statistics.fmean(times)
        cv = statistics.pstdev(times, mean) / mean if mean > 0 else 0.0
        if step_s < cheap_s:
            return EnvTiming(step_s=step_s, gil_release=float("nan"), step_cv=cv)
        window = min(max(step_s * steps, 0.02), 0.5)
        solo = _count_for(window) / window
        done = threading.Event()
        elapsed = [0.0]

        def background() -> None:
            elapsed[0] = run(max(steps, math.ceil(window / max(step_s, 1e-7))))
            done.set()

        thread = threading.Thread(target=background, name="lightning_rollout-auto-measure", daemon=True)
        start = time.perf_counter()
        thread.start()
        count = _count_for(window * 4, stop=done)
        shared = count / (time.perf_counter() - start)
        thread.join(10.0)
        release = max(0.0, min(1.0, shared / solo)) if solo > 0 else 0.0
        return EnvTiming(step_s=step_s, gil_release=release, step_cv=cv)
    finally:
        adapter.close()


def choose_layout(num_envs: int, timing: EnvTiming, *, cores: int | None = None, cheap_s: float = 100e-6,
                  thread_s: float = 1e-3, startup_s: float = 10.0, round_trip_s: float = 300e-6,
                  helper_s: float = 500e-6, share_s: float = 200e-6, uneven_cv: float = 0.3,
                  expected_frames: int | None = None, num_workers: int | str = "auto",
                  envs_per_thread: int | str = "auto") -> LayoutChoice:
    """The layout for ``num_envs`` envs with ``timing`` on ``cores`` cores (see the module docs).

    A value other than ``"auto"`` for ``num_workers`` or ``envs_per_thread`` is kept, and the other
    one is chosen around it (``num_workers="threads"``: auto, but no worker processes).
    """
    cores = usable_cores() if cores is None else cores
    step_us = timing.step_s * 1e6
    if num_workers == "auto":
        holds_gil = not timing.gil_release >= 0.3  # NaN (not measured: cheap) counts as holding it
        # every process's share of a step at least share_s of env time: past that, each further process adds
        # its send, reply and copy out to the one driving thread's serial part more than it takes off the others
        most = min(cores, num_envs)  # a process a core, at most one per env
        processes = min(most, max(2, int(num_envs * timing.step_s / share_s + 1e-9)))
        speedup = _TWO_CORE_SPEEDUP if cores == 2 else processes
        spread_s = num_envs * timing.step_s * (1 - 1 / processes)  # env time a step the children take over
        saved_s = None if expected_frames is None else expected_frames * timing.step_s * (1 - 1 / speedup)
        helpers = not holds_gil and timing.step_s >= helper_s  # long steps that release the GIL: helper threads
        gil = ("not measured for the GIL" if timing.gil_release != timing.gil_release
               else f"{timing.gil_release:.0%} of it without the GIL")
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
    elif num_workers == "threads":  # processes were ruled out by the caller (an unpicklable factory)
        num_workers = 1
        why = "the env factory cannot be pickled for worker processes: threads of the main process"
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
        elif timing.gil_release >= 0.3:
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
            why += f", {want} env{'s' if want > 1 else ''} per thread"
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
    choice = choose_layout(num_envs, box["timing"], num_workers=num_workers, envs_per_thread=envs_per_thread,
                           expected_frames=expected_frames)
    if is_auto(num_workers) and choice.num_workers > 1 and not _picklable(factory):
        choice = choose_layout(num_envs, box["timing"], num_workers="threads", envs_per_thread=envs_per_thread)
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


def _picklable(factory: EnvFactory) -> bool:
    try:
        pickle.dumps(factory)
        return True
    except Exception:
        return False


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"
