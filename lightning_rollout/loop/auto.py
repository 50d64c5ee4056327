"""``"auto"``: the executor for a loop's envs, from a short measure of one env.

:func:`measure_env` times a few random-action steps of one env (run-queue waits left out) and, for a step of
100 us or more, the share of it that holds the GIL; :func:`choose_layout` applies the rule of ``docs/tuning.rst``
(a pool thread an env, worker processes, or every env in the stepping thread). A natively batched env is stepped
as it is; a failed or hung measure falls back to the stepping thread.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from .._checks import check_int
from .._exit import abandon
from ..envs import EnvFactory, close_quietly
from ..policy import BatchedRandomPolicy
from .executors import SerialEnvs, batch_rows, build_units

__all__ = ["EnvTiming", "LayoutChoice", "cgroup_cpu_limit", "choose_layout", "measure_env", "resolve_layout",
           "usable_cores"]

log = logging.getLogger("lightning_rollout")


@dataclass(frozen=True)
class EnvTiming:
    """What a few timed steps of one env showed.

    Attributes:
        step_s: mean seconds of a step (waits for a CPU left out where Linux tells them).
        gil_release: share of a step spent without the GIL (``NaN``: not measured, a cheap step).
        batch: the rows of a natively batched env (not timed); ``None`` for a single env.
    """

    step_s: float
    gil_release: float
    batch: int | None = None


@dataclass(frozen=True)
class LayoutChoice:
    """The layout chosen for a loop, and why (logged at INFO).

    Attributes:
        num_workers: processes stepping envs, this one counted. envs_per_thread: envs a unit steps.
        reason: one sentence. parallel_steps: a pool thread an env.
        warning: why the ``num_workers=1`` a caller kept is likely well below ``"auto"`` (with what to pass).
    """

    num_workers: int
    envs_per_thread: int
    reason: str
    parallel_steps: bool = False
    warning: str | None = None


class RunDelay:
    """Seconds this thread waited, runnable, for a CPU (Linux's ``run_delay``), ``0.0`` where unreadable."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def __call__(self) -> float:
        return 0.0 if self._fd is None else int(os.pread(self._fd, 128, 0).split()[1]) * 1e-9

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity, capped by its cgroup's CPU limit (whole cores, >= 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return cores if limit is None else max(1, min(cores, int(limit)))


def cgroup_cpu_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """This process's cgroup CPU limit in cores (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``, the
    smallest over its folder and those above it), or ``None`` when there is none or it cannot be read."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers and "cpu" not in controllers.split(","):
            continue
        files = ("cpu.cfs_quota_us", "cpu.cfs_period_us") if controllers else ("cpu.max",)  # v1, or v2
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts) + 1):
            folder = os.path.join(root, controllers, *parts[:depth])  # a v1 hierarchy is mounted at its controllers
            try:
                quota, period = (int(x) for x in " ".join(Path(folder, f).read_text() for f in files).split())
            except (OSError, ValueError):
                continue
            if quota > 0 and period > 0:
                limits.append(quota / period)
    return min(limits) if limits else None


def _held_share(step: Any, window: float, period: float = 100e-6) -> float | None:
    """The share of ``window`` seconds of ``step()`` calls that a probe thread found the GIL held: its sleeps of
    about ``period`` woke over 30 us later than they do alone."""
    ready, stop = threading.Event(), threading.Event()
    share: list[float] = []
    pauses = [period * (0.5 + ((i * 37) % 64) / 63) for i in range(64)]  # no rhythm an env can lock onto

    def probe() -> None:
        delay = RunDelay()
        t, d = time.perf_counter(), delay()

        def cycle(i: int) -> float:  # seconds of a sleep and its wake-up, run-queue waits left out
            nonlocal t, d
            time.sleep(pauses[i % 64])
            t0, d0, t, d = t, d, time.perf_counter(), delay()
            return t - t0 - (d - d0)

        alone = statistics.median(cycle(i) - pauses[i] for i in range(20))  # the overshoot with nobody holding it
        ready.set()
        held = total = 0.0
        i = 0
        while not stop.is_set() and total < window * 4 + 1.0:
            seconds = cycle(i)
            total += seconds
            held += seconds if seconds - pauses[i % 64] - alone > 30e-6 else 0.0
            i += 1
        delay.close()
        if total > 0:
            share.append(min(1.0, held / total))

    thread = threading.Thread(target=probe, name="lightning_rollout-auto-probe", daemon=True)
    thread.start()
    try:
        while not ready.is_set() and thread.is_alive():
            time.sleep(0.001)
        end, n = time.perf_counter() + window, 0
        while n < 2 or time.perf_counter() < end:
            step()
            n += 1
    finally:
        stop.set()
        thread.join(1.0)
    return share[0] if share else None


def measure_env(factory: EnvFactory, *, steps: int = 30, rows: int = 4, cheap_s: float = 100e-6, rounds: int = 5,
                probe_s: float = 0.1) -> EnvTiming:
    """Time one env built by ``factory``, stepped as ``rows`` rows of one unit (so the time a row leaves the
    executor's cost of a call out): 2 warm-up calls, ``steps`` timed (or those within 1 s), random actions; for a
    step of ``cheap_s`` or more, read its GIL share ``rounds`` times, or those within 1 s after the first (the
    median kept). Raises what the env raised."""
    env = factory()
    if (batch := batch_rows(env)) is not None:
        close_quietly([env])
        return EnvTiming(step_s=float("nan"), gil_release=float("nan"), batch=batch)
    envs = SerialEnvs(build_units([lambda: env] * rows, group=rows, max_episode_steps=None, validate=False,
                                  info_keys=None), [None] * rows)
    delay = RunDelay()
    try:
        keys, slots, every = envs.unit.keys, envs.slots, np.arange(rows)
        envs.attach({**keys.root, **keys.action, **keys.done})
        random_policy = BatchedRandomPolicy(envs.unit.action_spec)

        def step() -> float:
            for k, v in random_policy(TensorDict({}, batch_size=[rows])).items(True, True):
                slots.inputs[k][...] = v.numpy()
            for k in keys.root:  # a TorchRL env reads its root entries: the last step's, or its reset's
                for i in range(rows):
                    slots.inputs[k][i] = slots.root[k][i] if slots.reset[i] else slots.next.get(k, slots.inputs[k])[i]
            d0, t0 = delay(), time.perf_counter()
            envs.send(every)
            envs.recv(rows, 0.0)
            return max(0.0, time.perf_counter() - t0 - (delay() - d0))

        for _ in range(2):  # warm-up
            step()
        end, times = time.perf_counter() + 1.0, [step(), step()]
        while len(times) < steps and time.perf_counter() < end:
            times.append(step())
        step_s = statistics.fmean(times) / rows
        if step_s < cheap_s:
            return EnvTiming(step_s=step_s, gil_release=float("nan"))
        readings, end = [], time.perf_counter() + 1.0
        for _ in range(rounds):  # those within 1 s after the first (a round takes two calls)
            if (held := _held_share(step, max(probe_s / rounds, 2 * rows * step_s))) is not None:
                readings.append(held)
            if time.perf_counter() > end:
                break
        return EnvTiming(step_s=step_s, gil_release=1.0 - statistics.median(readings) if readings else float("nan"))
    finally:
        delay.close()
        envs.close(0.0)


def choose_layout(num_envs: int, timing: EnvTiming, *, cores: int | None = None, startup_s: float = 10.0,
                  round_trip_s: float = 300e-6, helper_s: float = 500e-6, share_s: float = 200e-6,
                  releases: float = 0.5, expected_frames: int | None = None, num_workers: int | str = "auto",
                  envs_per_thread: int | str = "auto", picklable: bool = True) -> LayoutChoice:
    """The layout for ``num_envs`` envs with ``timing`` on ``cores`` cores (the rule of ``docs/tuning.rst``). A given
    ``num_workers`` or ``envs_per_thread`` is kept (processes then hold whole groups of ``envs_per_thread``)."""
    if timing.batch is not None:
        return LayoutChoice(1, timing.batch, f"a natively batched env of {timing.batch} envs, stepped as it is")
    cores = usable_cores() if cores is None else cores
    step_us = timing.step_s * 1e6
    holds = not timing.gil_release >= releases  # NaN (a cheap step, not measured) counts as holding it
    gil = ("not measured for the GIL" if timing.gil_release != timing.gil_release
           else f"{timing.gil_release:.0%} of it without the GIL")
    given = None if envs_per_thread == "auto" else int(envs_per_thread)
    group = given or 1
    if not holds and timing.step_s >= helper_s:
        return LayoutChoice(1, group, f"the env step takes {step_us:.0f} us ({gil}): a pool thread "
                            + ("an env" if given is None else f"each {group} envs, as given"), given is None)
    if num_workers == "auto":
        processes = min(cores, num_envs // group, max(2, int(num_envs * timing.step_s / share_s + 1e-9)))
        while num_envs // group % processes:
            processes -= 1
        spread_s = num_envs * timing.step_s * (1 - 1 / processes)
        saved_s = None if expected_frames is None else expected_frames / num_envs * (spread_s - round_trip_s)
        if cores >= 2 and processes >= 2 and spread_s >= round_trip_s and (saved_s is None or saved_s >= startup_s):
            if picklable:
                return LayoutChoice(processes, num_envs // processes if given is None else given,
                                    f"the env step takes {step_us:.0f} us ({gil}), {spread_s * 1e6:.0f} us of each "
                                    f"step for other processes: {processes} processes on {cores} cores")
            log.info("worker processes would pay, but the env factory cannot be pickled")
        num_workers = 1
    return LayoutChoice(int(num_workers), num_envs // int(num_workers) if given is None else given,
                        f"the env step takes {step_us:.0f} us ({gil}): "
                        + (f"envs_per_thread={given} as given" if given is not None else "every env in the stepping "
                           "thread" if int(num_workers) == 1 else f"num_workers={num_workers} as given"))


def resolve_layout(factory: EnvFactory, num_envs: int, *, num_workers: int | str, envs_per_thread: int | str,
                   parallel_steps: bool | str = "auto", expected_frames: int | None = None,
                   step_timeout: float | None = None, name: str = "loop"
                   ) -> tuple[LayoutChoice | None, Any, Any, Any]:
    """``(choice, num_workers, envs_per_thread, parallel_steps)`` a loop runs with, ``"auto"`` resolved (``choice``
    is ``None`` when neither layout knob is ``"auto"``); the measure runs in a helper thread for at most
    ``min(step_timeout, 10)`` seconds. A kept ``num_workers=1`` that processes would beat is warned of."""
    if not (is_auto(num_workers) or is_auto(envs_per_thread)):
        return None, num_workers, envs_per_thread, False if is_auto(parallel_steps) else parallel_steps
    if num_envs == 1:
        return LayoutChoice(1, 1, "one env"), 1, 1, False if is_auto(parallel_steps) else parallel_steps
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            with torch.random.fork_rng(devices=[]):
                box["timing"] = measure_env(factory)
        except Exception as exc:  # the loop reports it when it builds the envs
            box["error"] = exc

    thread = threading.Thread(target=target, name="lightning_rollout-auto-measure", daemon=True)
    thread.start()
    thread.join(10.0 if step_timeout is None else min(10.0, float(step_timeout)))
    if "timing" not in box:
        if thread.is_alive():
            abandon(thread)
        workers = 1 if is_auto(num_workers) else int(num_workers)
        choice = LayoutChoice(workers, num_envs // workers if is_auto(envs_per_thread) else int(envs_per_thread),
                              f"measuring one env failed ({box.get('error')!r})")
    else:
        try:  # a daemonic process (a DataLoader worker) may not start processes
            picklable = not mp.current_process().daemon and bool(pickle.dumps(factory))
        except Exception:
            picklable = False
        choice = choose_layout(num_envs, box["timing"], num_workers=num_workers, envs_per_thread=envs_per_thread,
                               expected_frames=expected_frames, picklable=picklable)
        best = choose_layout(num_envs, box["timing"], envs_per_thread=envs_per_thread,
                             expected_frames=expected_frames, picklable=picklable)
        if choice.num_workers == 1 and best.num_workers > 1:
            choice = LayoutChoice(1, choice.envs_per_thread, choice.reason, choice.parallel_steps, warning=(
                f"num_workers=1 keeps every env in this process, but num_workers='auto' would step them in "
                f"{best.num_workers} processes ({best.reason}); pass num_workers='auto' (or {best.num_workers})"))
    log.info("%s: num_workers=%d, envs_per_thread=%d, parallel_steps=%s (%s)", name, choice.num_workers,
             choice.envs_per_thread, choice.parallel_steps, choice.reason)
    return (choice, choice.num_workers, choice.envs_per_thread,
            choice.parallel_steps if is_auto(parallel_steps) else parallel_steps)


def one_env_threads_warning(num_envs: int, envs_per_thread: int) -> str | None:
    """Why one pool thread per env, asked of a collector for envs that do not release the GIL, likely runs
    below ``"auto"`` (each step a thread hand-off); ``None`` otherwise."""
    if envs_per_thread != 1 or num_envs < 2:
        return None
    return (f"envs_per_thread=1 steps each of the {num_envs} envs in a pool thread of its own, a thread hand-off "
            f"every step: it pays only for steps that release the GIL; pass envs_per_thread='auto', or "
            f"envs_per_thread={num_envs} (every env in the stepping thread)")


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def check_knobs(*, envs_per_thread: Any, num_workers: Any, parallel_steps: Any = "auto",
                num_envs: int | None = None) -> None:
    """Each of ``envs_per_thread`` / ``num_workers`` is ``"auto"`` or an int ``>= 1`` (whole groups of
    ``envs_per_thread`` among ``num_envs``, at least one a process), ``parallel_steps`` a bool, ``"free"`` or
    ``"auto"``; else ``ValueError``."""
    for knob, value in (("envs_per_thread", envs_per_thread), ("num_workers", num_workers)):
        if not is_auto(value):
            check_int(knob, value, 1)
    if not (isinstance(parallel_steps, bool) or parallel_steps in ("auto", "free")):
        raise ValueError(f"parallel_steps must be True, False, 'free' or 'auto', got {parallel_steps!r}")
    if num_envs is None:
        return
    if not is_auto(envs_per_thread) and num_envs % envs_per_thread:
        raise ValueError(f"num_envs ({num_envs}) must be a multiple of envs_per_thread ({envs_per_thread})")
    groups = num_envs if is_auto(envs_per_thread) else num_envs // envs_per_thread
    if not is_auto(num_workers) and num_workers > groups:
        raise ValueError(f"num_workers ({num_workers}) must be at most num_envs / envs_per_thread ({groups}): each "
                         "process steps at least one whole group of envs_per_thread envs; pass fewer num_workers "
                         "(or a smaller envs_per_thread)")

