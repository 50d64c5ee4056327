"""Executors: a vector env of ``num_envs`` rows over units, in envpool's ``send`` / ``recv`` shape: the loop writes
the inputs into ``slots.inputs`` and sends rows; ``recv`` returns the rows whose step ended, their results in
``slots``. :class:`SerialEnvs` steps every unit in the calling thread at ``recv``; :class:`ThreadEnvs` gives each
unit a pool thread (``lightning_rollout-<name>-env<i>``); :class:`~lightning_rollout.loop.processes.ProcessEnvs`
puts shards in worker processes. A unit's rows are sent whole. One thread drives an executor; ``close`` may run
in any.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torchrl.envs import EnvBase

from .._exit import abandon, sigint_blocked
from ..envs import EnvFactory, EnvFailure, InfoKeys, Slots, Unit, close_quietly, make_unit
from ..specs import ArraySpec, NestedKey

__all__ = ["Envs", "SerialEnvs", "ThreadEnvs", "merged_rows", "split_rows"]

POLL_S = 0.05


class Envs:
    """What every executor provides.

    Attributes:
        num_envs: rows.
        unit: a unit like those stepped (one env's keys and specs; ``unit.loop_keys``, ``unit.partial``).
        slots: the per-row arrays (:class:`~lightning_rollout.envs.Slots`); ``inputs`` allocated by :meth:`attach`.
        roots: ``[num_envs, ...]`` every env's root entries after its first (seeded) reset.
    """

    num_envs: int
    unit: Unit
    slots: Slots
    roots: dict[NestedKey, np.ndarray]

    def attach(self, inputs: dict[NestedKey, ArraySpec]) -> None:
        """Allocate ``slots.inputs`` for these entries (once, before the first :meth:`send`)."""
        raise NotImplementedError

    def reset(self, rows: np.ndarray, seeds: Sequence[int | None]) -> None:
        """Reset ``rows`` (idle) now, each with its seed, into ``slots.root``; raises EnvFailure."""
        raise NotImplementedError

    def send(self, rows: np.ndarray) -> None:
        """Start a step of ``rows`` (idle, whole units, ascending), their inputs in ``slots.inputs``."""
        raise NotImplementedError

    def recv(self, min_rows: int, wait: float) -> np.ndarray:
        """The rows whose step ended since the last call (ascending within a unit), as soon as ``min_rows`` did or
        after ``wait`` seconds (maybe none). Raises EnvFailure (that call's other rows lost with it)."""
        raise NotImplementedError

    def stuck(self, timeout: float) -> tuple[int, str, str] | None:
        """``(row, phase, thread or process name)`` of an env call running for over ``timeout`` s, else ``None``."""
        return None

    def close(self, timeout: float) -> list[str]:
        """Close every env; returns the names of threads left running (abandoned)."""
        raise NotImplementedError


def merged_rows(parts: Sequence[np.ndarray]) -> np.ndarray:
    """``parts`` (rows answered) as one ascending array."""
    return np.sort(np.concatenate(parts)) if len(parts) > 1 else parts[0] if parts else np.empty(0, dtype=np.int64)


def split_rows(bounds: np.ndarray, rows: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``(part i, its rows less bounds[i])`` for ascending ``rows``, part ``i`` holding ``bounds[i]:bounds[i + 1]``."""
    part = np.searchsorted(bounds, rows, side="right") - 1
    return [(p, rows[part == p] - bounds[p]) for p in np.unique(part).tolist()]


def batch_rows(env: Any) -> int | None:
    """The envs a natively batched ``env`` steps in one call (a TorchRL env with a batch size, a gymnasium vector
    env, envpool); ``None`` for a single env."""
    if isinstance(env, EnvBase):
        return int(env.batch_size.numel()) if tuple(env.batch_size) else None
    if isinstance(env, gym.vector.VectorEnv):
        return int(env.num_envs)
    config = getattr(getattr(env, "spec", None), "config", None)  # envpool
    return int(config.num_envs) if hasattr(config, "num_envs") else None


def build_units(factories: Sequence[EnvFactory], *, group: int, max_episode_steps: int | None, validate: bool,
                info_keys: InfoKeys | None, parallel: bool = False) -> list[Unit]:
    """The units of envs made by ``factories`` (one a row): ``group`` envs a unit, a natively batched env a unit
    of its own (its factory repeated for its rows; not with ``parallel``); built envs are closed when one fails.
    Raises EnvFailure (a factory raised, named by its row), ValueError (an env no unit takes, or a natively
    batched env that does not fit ``group``)."""
    units: list[Unit] = []
    envs: list[Any] = []
    i = 0
    try:
        while i < len(factories):
            for j in range(i, min(i + group, len(factories))):
                try:
                    envs.append(factories[j]())
                except Exception as exc:
                    raise EnvFailure(j, "reset", "env", exc) from exc
                if (batch := batch_rows(envs[-1])) is None:
                    continue
                if parallel:
                    raise ValueError(f"parallel_steps=True steps each env in a pool thread; a natively batched "
                                     f"env steps its {batch} envs in one call: leave parallel_steps out")
                if len(factories) % batch or group != batch:
                    raise ValueError(f"the env factory makes a natively batched env of {batch} envs, stepped in one "
                                     f"call: num_envs ({len(factories)}) must be a multiple of {batch} and "
                                     f"envs_per_thread ({group}) equal to it; pass envs_per_thread={batch}")
                break
            built, envs = envs, []  # make_unit closes them if it refuses them
            units.append(make_unit(built, max_episode_steps=max_episode_steps, validate=validate, info_keys=info_keys))
            i += units[-1].rows
    except BaseException:
        close_quietly(envs)
        close_quietly(units)
        raise
    return units


class _Local(Envs):
    """Units of this process: described, bound to their rows, reset once (seeded) at construction."""

    def __init__(self, units: Sequence[Unit], seeds: Sequence[int | None]) -> None:
        for i, u in enumerate(units[1:], 1):
            u.keys.check_same(units[0].keys, sum(x.rows for x in units[:i]))
        self.units, self.unit = list(units), units[0]
        self.bounds = np.cumsum([0, *(u.rows for u in units)])
        self.num_envs = int(self.bounds[-1])
        self.use(Slots.allocate(self.num_envs, inputs={}, next=self.unit.writes, root=self.unit.keys.root))
        with sigint_blocked():  # a batched env (ParallelEnv) starts its processes here: Ctrl-C stays ours
            _Local.reset(self, np.arange(self.num_envs), seeds)  # the pool threads start later
        self.roots = {k: v.copy() for k, v in self.slots.root.items()}

    def use(self, slots: Slots) -> None:
        """Read and write ``slots`` (these units' rows) from now on."""
        self.slots = slots
        for u, a, b in zip(self.units, self.bounds, self.bounds[1:]):
            u.bind(slots.rows(int(a), int(b)))

    def attach(self, inputs: dict[NestedKey, ArraySpec]) -> None:
        self.slots.inputs = Slots.allocate(self.num_envs, inputs=inputs, next={}, root={}).inputs
        self.use(self.slots)

    def _parts(self, rows: np.ndarray) -> list[tuple[int, np.ndarray | None]]:
        """``(unit, its rows or None for all of them)`` for ``rows``."""
        if len(rows) == self.num_envs:
            return [(u, None) for u in range(len(self.units))]
        return [(u, mine if len(mine) < self.units[u].rows else None) for u, mine in split_rows(self.bounds, rows)]

    def _seeded(self, rows: np.ndarray, seeds: Sequence[int | None]) -> list[tuple[int, list[int], list[int | None]]]:
        """``(unit, its rows, their seeds)`` for a reset of ``rows``."""
        seed_of = dict(zip(np.asarray(rows).tolist(), seeds))
        parts = [(u, list(range(self.units[u].rows)) if local is None else local.tolist())
                 for u, local in self._parts(np.asarray(rows))]
        return [(u, local, [seed_of.get(r + int(self.bounds[u])) for r in local]) for u, local in parts]

    def reset(self, rows: np.ndarray, seeds: Sequence[int | None]) -> None:
        for u, local, mine in self._seeded(rows, seeds):
            try:
                self.units[u].reset(local, mine)
            except EnvFailure as failure:
                raise failure.shifted(int(self.bounds[u])) from failure.cause

    def close(self, timeout: float) -> list[str]:
        close_quietly(self.units)
        return []

    def release(self) -> None:
        """Drop every view of the slots (closed), so shared memory is freed without the garbage collector."""
        for unit in self.units:
            unit.slots = None  # type: ignore[assignment]
        self.slots = None  # type: ignore[assignment]


class SerialEnvs(_Local):
    """Units stepped one after the other in the thread that calls :meth:`recv` (see the module docstring)."""

    def __init__(self, units: Sequence[Unit], seeds: Sequence[int | None]) -> None:
        super().__init__(units, seeds)
        self._sent: list[np.ndarray] = []

    def send(self, rows: np.ndarray) -> None:
        self._sent.append(rows)

    def recv(self, min_rows: int, wait: float) -> np.ndarray:
        if not self._sent:
            time.sleep(min(wait, POLL_S))
            return np.empty(0, dtype=np.int64)
        rows, self._sent = merged_rows(self._sent), []
        for u, local in self._parts(rows):
            try:
                self.units[u].step(local)
            except EnvFailure as failure:
                failed, a = failure.shifted(int(self.bounds[u])), self.bounds[u]
                failed.completed = np.concatenate([rows[rows < a], failed.completed])
                failed.lost = np.concatenate([failed.lost, rows[rows >= self.bounds[u + 1]]])
                raise failed from failure.cause
        return rows


class ThreadEnvs(_Local):
    """One pool thread a unit (see the module docstring); the driving thread only waits, woken once a wait: by the
    answer that completes the rows it waits for (``_want``), a failure, or a reset's answer. ``_lock`` guards
    ``_done``, ``_rows`` and ``_want``; ``_wake`` is a lock, not an ``Event``: a Ctrl-C landing in an ``Event``'s
    Python-level lock entry would leave it held, and every pool thread blocked on it."""

    def __init__(self, units: Sequence[Unit], seeds: Sequence[int | None], *, name: str) -> None:
        super().__init__(units, seeds)
        self._stop, self._lock, self._wake = threading.Event(), threading.Lock(), threading.Lock()
        self._wake.acquire()
        self._done: list[tuple[int, str, Any]] = []
        self._rows = self._want = 0
        self._stash: list[np.ndarray] = []  # rows of steps answered while a reset waited, for recv
        self._calls: list[queue.SimpleQueue[tuple[str, Any, Any] | None]] = [queue.SimpleQueue() for _ in units]
        self.since = [0.0] * len(units)  # perf_counter() when unit i's call in flight was handed over, 0.0 if idle
        self.phase = ["step"] * len(units)
        self.pool = [threading.Thread(target=self._serve, args=(i,), name=f"lightning_rollout-{name}-env{int(a)}",
                                      daemon=True) for i, a in enumerate(self.bounds[:-1])]
        for thread in self.pool:
            thread.start()
        self._abandoned: set[threading.Thread] = set()

    def _serve(self, i: int) -> None:
        """Pool thread ``i``: step or reset ``units[i]`` as asked, answer each call (its failure too)."""
        torch.set_grad_enabled(False)  # (torch's thread count is process-wide: the loop sets it for each call)
        unit = self.units[i]
        while (call := self._calls[i].get()) is not None and not self._stop.is_set():  # close() sends None
            kind, rows, seeds = call
            try:
                unit.step(rows) if kind == "step" else unit.reset(rows, seeds)
                answer: Any = rows
            except BaseException as exc:  # noqa: BLE001 - every failure is answered, never lost
                answer = exc if isinstance(exc, EnvFailure) else EnvFailure(0, kind, "env", exc)
            self.since[i] = 0.0
            with self._lock:
                self._done.append((i, kind, answer))
                if kind == "step" and not isinstance(answer, EnvFailure):
                    self._rows += unit.rows if answer is None else len(answer)
                    if self._rows < self._want:
                        continue
                if self._want:
                    self._want = 0
                    self._wake.release()

    def send(self, rows: np.ndarray, kind: str = "step", seeds: Sequence[int | None] = ()) -> int:
        """Hand each unit its part of ``rows`` (a step, or a reset with ``seeds``); returns how many units it asked."""
        now = time.perf_counter()
        parts = self._parts(rows) if kind == "step" else self._seeded(rows, seeds)
        for part in parts:
            self.since[part[0]], self.phase[part[0]] = now, kind
            self._calls[part[0]].put((kind, part[1], part[2] if kind == "reset" else None))
        return len(parts)

    def _take(self, min_rows: int, timeout: float) -> tuple[list[np.ndarray], int]:
        """The step rows answered and the resets, once the answers hold ``min_rows`` step rows, a failure or a reset,
        or after ``timeout`` s. Raises the first failure (the steps with it completed; a later one waits)."""
        with self._lock:
            urgent = any(kind != "step" or isinstance(r, EnvFailure) for _, kind, r in self._done)
            self._want = min_rows if self._rows < min_rows and not urgent else 0
            waits = self._want > 0
        if waits and not self._wake.acquire(timeout=timeout):
            with self._lock:  # not woken: stop waiting; woken since the timeout: hold _wake again
                if not self._want:
                    self._wake.acquire()
                self._want = 0
        with self._lock:
            done, self._done, self._rows = self._done, [], 0
        failures = [a for a in done if isinstance(a[2], EnvFailure)]
        steps = [(np.arange(self.units[u].rows) if r is None else np.asarray(r)) + int(self.bounds[u])
                 for u, kind, r in done if kind == "step" and not isinstance(r, EnvFailure)]
        if failures:
            with self._lock:
                self._done[:0] = failures[1:]
            u, _, cause = failures[0]
            failure = cause.shifted(int(self.bounds[u]))
            failure.completed = np.concatenate([*steps, failure.completed])
            raise failure from cause.cause
        return steps, sum(kind != "step" for _, kind, _ in done)

    def reset(self, rows: np.ndarray, seeds: Sequence[int | None]) -> None:
        waiting = self.send(rows, "reset", seeds)
        while waiting and not self._stop.is_set():
            steps, resets = self._take(self.num_envs + 1, POLL_S)  # woken by a reset or a failure
            self._stash += steps
            waiting -= resets

    def recv(self, min_rows: int, wait: float) -> np.ndarray:
        deadline, ready, self._stash = time.perf_counter() + wait, self._stash, []
        count = sum(map(len, ready))
        while True:
            remaining = deadline - time.perf_counter()
            try:
                steps, _ = self._take(min_rows - count if remaining > 0 else 0, max(0.0, min(remaining, POLL_S)))
            except EnvFailure as failure:
                failure.completed = np.concatenate([*ready, failure.completed])  # answers taken before it stay
                raise
            ready += steps
            count += sum(map(len, steps))
            if count >= min_rows or remaining <= 0 or self._stop.is_set():
                break
        return merged_rows(ready)

    def stuck(self, timeout: float) -> tuple[int, str, str] | None:
        now = time.perf_counter()
        for i, (thread, since) in enumerate(zip(self.pool, list(self.since))):
            if since and now - since > timeout:
                self._abandoned.add(thread)  # close() will not wait for it
                return int(self.bounds[i]), self.phase[i], thread.name
        return None

    def close(self, timeout: float) -> list[str]:
        self._stop.set()
        for calls in self._calls:
            calls.put(None)
        left = []
        for thread, unit in zip(self.pool, self.units):
            if thread not in self._abandoned:
                thread.join(timeout)
            if thread.is_alive():
                abandon(thread)
                left.append(thread.name)
            else:
                close_quietly([unit])
        return left
