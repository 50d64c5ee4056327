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

__all__ = ["Envs", "SerialEnvs", "ThreadEnvs"]

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
                batch = batch_rows(envs[-1])
                if batch is None:
                    continue
                if parallel:
                    raise ValueError(f"parallel_steps=True steps each env in a pool thread; a natively batched "
                                     f"env steps its {batch} envs in one call: leave parallel_steps out")
                if len(factories) % batch or group != batch:
                    raise ValueError(
                        f"the env factory makes a natively batched env of {batch} envs, stepped in one call: "
                        f"num_envs ({len(factories)}) must be a multiple of {batch} and envs_per_thread "
                        f"({group}) equal to it; pass envs_per_thread={batch}")
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
            if not u.keys.same_layout(units[0].keys):
                raise ValueError(f"env {sum(x.rows for x in units[:i])} has specs {u.keys}, env 0 has "
                                 f"{units[0].keys}; all envs of a loop must share their keys, shapes and dtypes")
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
        if len(self.units) == 1:
            return [(0, rows if len(rows) < self.num_envs else None)]
        unit = np.searchsorted(self.bounds, rows, side="right") - 1
        parts = []
        for u in np.unique(unit).tolist():
            mine = rows[unit == u] - self.bounds[u]
            parts.append((u, mine if len(mine) < self.units[u].rows else None))
        return parts

    def _seeded(self, rows: np.ndarray, seeds: Sequence[int | None]) -> list[tuple[int, list[int], list[int | None]]]:
        """``(unit, its rows, their seeds)`` for a reset of ``rows``."""
        seed_of = dict(zip(np.asarray(rows).tolist(), seeds))
        out = []
        for u, local in self._parts(np.asarray(rows)):
            a = int(self.bounds[u])
            local = list(range(self.units[u].rows)) if local is None else local.tolist()
            out.append((u, local, [seed_of.get(r + a) for r in local]))
        return out

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
        rows = self._sent[0] if len(self._sent) == 1 else np.sort(np.concatenate(self._sent))
        self._sent = []
        for u, local in self._parts(rows):
            try:
                self.units[u].step(local)
            except EnvFailure as failure:
                failed = failure.shifted(int(self.bounds[u]))
                a = self.bounds[u]
                failed.completed = np.concatenate([rows[rows < a], failed.completed])
                failed.lost = np.concatenate([failed.lost, rows[rows >= self.bounds[u + 1]]])
                raise failed from failure.cause
        return rows


class _PoolThread:
    """One unit stepped by its own thread: calls arrive on ``calls``, answers go to the executor's queue."""

    def __init__(self, index: int, unit: Unit, answers: queue.SimpleQueue[Any], stop: threading.Event,
                 name: str) -> None:
        self.index, self.unit, self.answers, self.stop = index, unit, answers, stop
        self.calls: queue.SimpleQueue[tuple[str, Any, Any] | None] = queue.SimpleQueue()
        self.since = 0.0  # perf_counter() when the call in flight was handed over, 0.0 when idle
        self.phase = "step"
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        torch.set_grad_enabled(False)  # (torch's thread count is process-wide: the loop sets it for each call)
        while (call := self.calls.get()) is not None and not self.stop.is_set():  # close() sends None
            kind, rows, seeds = call
            try:
                if kind == "step":
                    self.unit.step(rows)
                else:
                    self.unit.reset(rows, seeds)
                answer: Any = (self.index, kind, rows)
            except BaseException as exc:  # noqa: BLE001 - every failure is answered, never lost
                answer = (self.index, kind, exc if isinstance(exc, EnvFailure) else EnvFailure(0, kind, "env", exc))
            self.since = 0.0
            self.answers.put(answer)


class ThreadEnvs(_Local):
    """One pool thread a unit (see the module docstring); the thread that drives it only waits."""

    def __init__(self, units: Sequence[Unit], seeds: Sequence[int | None], *, name: str) -> None:
        super().__init__(units, seeds)
        self._stop = threading.Event()
        self._answers: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self.pool = [_PoolThread(i, u, self._answers, self._stop, f"lightning_rollout-{name}-env{int(a)}")
                     for i, (u, a) in enumerate(zip(self.units, self.bounds))]
        self._ready: list[np.ndarray] = []  # rows of the steps answered, for recv
        self._count = 0  # rows in _ready
        self._abandoned: set[threading.Thread] = set()

    def _call(self, kind: str, rows: np.ndarray, seeds: Sequence[int | None] = ()) -> int:
        """Hand each unit its part of ``rows``; returns how many units were asked."""
        now = time.perf_counter()
        parts = self._parts(rows) if kind == "step" else self._seeded(rows, seeds)
        for part in parts:
            thread = self.pool[part[0]]
            thread.since, thread.phase = now, kind
            thread.calls.put((kind, part[1], part[2] if kind == "reset" else None))
        return len(parts)

    def _answer(self, timeout: float) -> str | None:
        """The next answer's kind (a step's rows kept for :meth:`recv`), ``None`` when none came within ``timeout``."""
        try:
            u, kind, result = self._answers.get(timeout=timeout)
        except queue.Empty:
            return None
        a = int(self.bounds[u])
        if isinstance(result, EnvFailure):
            failure = result.shifted(a)
            failure.completed = np.concatenate([*self._ready, failure.completed])  # answers before it stay
            self._ready, self._count = [], 0
            raise failure from result.cause
        if kind == "step":
            self._ready.append((np.arange(self.units[u].rows) if result is None else np.asarray(result)) + a)
            self._count += len(self._ready[-1])
        return kind

    def reset(self, rows: np.ndarray, seeds: Sequence[int | None]) -> None:
        waiting = self._call("reset", rows, seeds)
        while waiting and not self._stop.is_set():
            if self._answer(POLL_S) == "reset":
                waiting -= 1

    def send(self, rows: np.ndarray) -> None:
        self._call("step", rows)

    def recv(self, min_rows: int, wait: float) -> np.ndarray:
        deadline = time.perf_counter() + wait
        while True:
            remaining = deadline - time.perf_counter()
            enough = remaining <= 0 or self._count >= min_rows
            if self._answer(0.0 if enough else min(remaining, POLL_S)) is None and enough:
                break
        ready, self._ready, self._count = self._ready, [], 0
        if not ready:
            return np.empty(0, dtype=np.int64)
        return ready[0] if len(ready) == 1 else np.sort(np.concatenate(ready))

    def stuck(self, timeout: float) -> tuple[int, str, str] | None:
        now = time.perf_counter()
        for thread, a in zip(self.pool, self.bounds):
            since = thread.since
            if since and now - since > timeout:
                self._abandoned.add(thread.thread)  # close() will not wait for it
                return int(a), thread.phase, thread.thread.name
        return None

    def close(self, timeout: float) -> list[str]:
        self._stop.set()
        for thread in self.pool:
            thread.calls.put(None)
        left = []
        for thread in self.pool:
            if thread.thread not in self._abandoned:
                thread.thread.join(timeout)
            if thread.thread.is_alive():
                abandon(thread.thread)
                left.append(thread.thread.name)
            else:
                close_quietly([thread.unit])
        return left
