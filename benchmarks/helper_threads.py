"""The ceiling of helper threads: GIL-releasing envs, one helper thread each, and no collector.

``python -m benchmarks.helper_threads [--env sleep|stragglers] [--policy] [--no-pin] [--gather-us US]``

Each helper steps its env when its lock is released (resetting it at an episode's end, as a ``SAME_STEP``
vector env does) and reports on a queue; the owner either releases all and waits for all (``lock-step``), or
gives each env its next step as soon as its last one ended (``free``, gathering the envs that end within
``gather_s`` of the first, up to half of them, as the collector's free-running blocks do). The owner runs the
batched policy on every env's observation and hands the answered envs their actions, as the collector's block
thread does. What is left between these figures and the ideal ``num_envs / step_time`` is the GIL hand-offs of
the helpers (gymnasium's wrappers run in Python before and after each wait) and of the policy's forward pass
(each torch op releases the GIL, and a helper waking meanwhile takes it). The helpers and the owner share one
core during a run, as the collector places a block whose steps wait (``--no-pin``: anywhere).

The ``gil`` and ``stragglers`` scenarios run :class:`HelperThreads` as contenders of their own (lock-step, and
free-running with a 50 us gather or none, :func:`benchmarks.contenders.helper_threads`), so the collector is
compared with this ceiling in the same run; ``docs/performance.rst`` reads them.
"""

from __future__ import annotations

import argparse
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence

import gymnasium as gym
import numpy as np
import torch

from .envs import SLEEP, STRAGGLER, gym_factory, measure_step_time

__all__ = ["HelperThreads", "main", "run"]

_POLL_S = 0.05  # every wait wakes this often to see whether the owner is closing


class HelperThreads:
    """``len(envs)`` envs, each stepped in its own helper thread and answered by the thread that calls
    :meth:`run` (the owner).

    Args:
        envs: the envs (one array observation each, stacked into one ``[num_envs, ...]`` batch).
        policy: ``obs[num_envs, ...] -> actions[num_envs, ...]``, called by the owner on every env's latest
            observation (``None``: every action 0, no policy call).
        free: each env's next step starts as soon as its last one ended and the policy answered it (else
            lock-step: every env steps, the owner waits for all of them, then answers all).
        gather_s: free-running only: after the first env ends, wait up to this long (seconds) for more, up to
            half the envs, to answer them with one policy call.
        pin: the helpers (as ``SCHED_BATCH``), and the owner during :meth:`run`, run on one core (the lowest
            this process may use), the placement the previous core gave a block whose steps wait (the current
            core's pool threads are not placed; ``--no-pin`` measures what they get); with fewer than two cores,
            or without CPU affinity, nothing moves.

    Threading: helper ``j`` touches only ``envs[j]``, ``results[j]`` and its lock; the owner reads a result
    after the helper has put ``j`` on the queue, and writes an action before releasing the helper's lock.
    Between :meth:`run` calls no step is in flight. :meth:`close` stops and joins the helpers.
    """

    def __init__(self, envs: Sequence[gym.Env], policy: Callable[[np.ndarray], np.ndarray] | None, *, free: bool,
                 gather_s: float = 0.0005, pin: bool = True) -> None:
        self.envs, self.policy, self.free, self.gather_s = list(envs), policy, free, gather_s
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_setaffinity") else set()
        self.cores = frozenset({min(allowed)}) if pin and len(allowed) >= 2 else None
        n = len(self.envs)
        self.obs = np.stack([env.reset(seed=j)[0] for j, env in enumerate(self.envs)])
        self.actions: list[object] = [0] * n
        self.results: list[np.ndarray | BaseException | None] = [None] * n  # helper j's last observation
        self._go = [threading.Lock() for _ in range(n)]
        for go in self._go:
            go.acquire()  # held: nothing to do
        self._done: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._closing = False
        self._helpers = [threading.Thread(target=self._serve, args=(j,), name=f"bench-helper-env{j}", daemon=True)
                         for j in range(n)]
        for helper in self._helpers:
            helper.start()

    def _serve(self, j: int) -> None:
        env, go = self.envs[j], self._go[j]
        if self.cores is not None:
            os.sched_setaffinity(0, self.cores)  # this thread only
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # waking up does not preempt the owner
        while True:
            if not go.acquire(timeout=_POLL_S):
                if self._closing:
                    return
                continue
            if self._closing:
                return
            try:
                obs, _, terminated, truncated, _ = env.step(self.actions[j])
                if terminated or truncated:
                    obs, _ = env.reset()
                self.results[j] = obs
            except BaseException as exc:  # re-raised by the owner
                self.results[j] = exc
            self._done.put(j)

    def _ended(self, want: int) -> list[int]:
        """At least one ended env (then, free-running, more for up to ``gather_s``, at most ``want``)."""
        while True:
            try:
                ended = [self._done.get(timeout=_POLL_S)]
                break
            except queue.Empty:
                if not any(helper.is_alive() for helper in self._helpers):
                    raise RuntimeError("every helper thread has ended") from None
        deadline = time.perf_counter() + self.gather_s
        while len(ended) < want:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            try:
                ended.append(self._done.get(timeout=left))
            except queue.Empty:
                break
        for j in ended:
            result = self.results[j]
            if isinstance(result, BaseException):
                raise result
            self.obs[j] = result
        return ended

    def _answer(self, envs: Sequence[int]) -> None:
        """Act on every env's observation, then start the steps of ``envs``."""
        if self.policy is not None:
            chosen = self.policy(self.obs)
            for j in envs:
                self.actions[j] = chosen[j]
        for j in envs:
            self._go[j].release()

    def run(self, frames: int) -> int:
        """Step until at least ``frames`` transitions ended; returns how many did (every step started ends).
        With ``pin``, the calling thread runs on the helpers' core until it returns."""
        if self.cores is None:
            return self._run(frames)
        saved = os.sched_getaffinity(0)
        os.sched_setaffinity(0, self.cores)  # this thread only
        try:
            return self._run(frames)
        finally:
            os.sched_setaffinity(0, saved)

    def _run(self, frames: int) -> int:
        n = len(self.envs)
        taken = 0
        self._answer(range(n))
        if self.free:
            in_flight = n
            while taken < frames:
                ended = self._ended(max(1, n // 2))
                taken, in_flight = taken + len(ended), in_flight - len(ended)
                if taken + in_flight < frames:
                    self._answer(ended)
                    in_flight += len(ended)
            while in_flight:  # let every step in flight end: none is left running between runs
                ended = self._ended(in_flight)
                taken, in_flight = taken + len(ended), in_flight - len(ended)
        else:
            while True:
                got = 0
                while got < n:
                    got += len(self._ended(n - got))
                taken += n
                if taken >= frames:
                    break
                self._answer(range(n))
        return taken

    def close(self) -> None:
        """Stop the helpers (between runs: none is stepping) and join them; then close the envs."""
        self._closing = True
        for go in self._go:
            try:
                go.release()
            except RuntimeError:  # not held: that helper is stepping (a run that raised) and sees the flag next
                pass
        for helper in self._helpers:
            helper.join(5.0)
        for env in self.envs:
            env.close()


def run(env_id: str, *, free: bool, policy: bool, num_envs: int = 16, steps: int = 6400, pin: bool = True,
        gather_s: float = 0.0005) -> float:
    """Steps per second of ``num_envs`` envs of ``env_id`` stepped by helper threads (with the benchmarks'
    small MLP when ``policy``)."""
    from .contenders import Workload

    act = Workload(env_id, num_envs, num_envs).callable_policy() if policy else None
    session = HelperThreads([gym_factory(env_id)() for _ in range(num_envs)], act, free=free, pin=pin,
                            gather_s=gather_s)
    try:
        start = time.perf_counter()
        taken = session.run(steps)
        return taken / (time.perf_counter() - start)
    finally:
        session.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", choices=["sleep", "stragglers"], default="sleep")
    parser.add_argument("--policy", action="store_true", help="run the small MLP on the envs answered")
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="let the helpers run on every core")
    parser.add_argument("--gather-us", type=float, default=500.0,
                        help="free-running: how long to gather the envs that end after the first (microseconds)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    env_id = SLEEP if args.env == "sleep" else STRAGGLER
    ideal = 16 / measure_step_time(env_id, 500)
    for free in (False, True):
        rate = run(env_id, free=free, policy=args.policy, pin=args.pin, gather_s=args.gather_us * 1e-6)
        print(f"{args.env} {'free' if free else 'lock-step'}{' + policy' if args.policy else ''}"
              f"{'' if args.pin else ', helpers on every core'}: "
              f"{rate:,.0f} steps/s, {rate / ideal:.2f} of the ideal {ideal:,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
