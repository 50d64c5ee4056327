"""A natively batched env as one block: its envs step in one call.

When an env factory makes a batched env (a :class:`~lightning_rollout.envs.BatchedTorchRLEnv`: VMAS,
a ``SerialEnv`` or ``ParallelEnv`` built by the factory, a gymnasium vector env through TorchRL's
``GymWrapper``; or an envpool env, :class:`~lightning_rollout.envs.EnvpoolEnv`), each env thread steps
one of them as its block
(:class:`NativeBlock`): the block's envs are the batch's, row-major over its batch dims, and a step
of the block is one ``env.step`` of the whole batch, as TorchRL's collector makes it. Such a
simulator cannot step part of its batch, so a step takes every env of the block (a free-running or
single-env request is refused by the loop); the envs a step ended are reset together, with one
partial reset of the batch (TorchRL's ``_reset`` entries; envpool's ``reset(env_id)``). The batch is
seeded as a whole (``env.set_seed``), with the seed of its first env (envpool: at ``make``).

Threading: a block is owned by one env thread. ``busy_env``, ``busy_phase`` and ``busy_since`` name the
call in progress (its first env: the batch has no single env at fault), read without a lock by the
driver's ``step_timeout`` check.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..envs import BatchedTorchRLEnv, EnvpoolEnv
from ..specs import ArraySpec, NestedKey
from .block import EnvFailure, _CheckFailed, _check, close_quietly

__all__ = ["NativeBlock"]


class NativeBlock:
    """The envs of one natively batched env, stepped in one call (the Block protocol,
    :class:`~lightning_rollout.loop.block.Block`).

    Args:
        env: the batched env.
        validate: check the ``"next"`` entries of every step (shape, dtype, NaN, one look a key for the batch)
            and the root entries of every reset.
        checked_next, checked_root: the entries to check (``{key: ArraySpec}``, one env's).
        watched: someone reads ``busy_since`` (a ``step_timeout``).
    """

    parallel = False  # every env of the batch ends with the batch's step
    owned = True
    partial = False  # it cannot step some of its envs alone

    def __init__(self, env: BatchedTorchRLEnv | EnvpoolEnv, *, validate: bool, checked_next: Mapping[NestedKey, ArraySpec],
                 checked_root: Mapping[NestedKey, ArraySpec], watched: bool = True) -> None:
        self.env = env
        self.rows = env.rows
        self.validate = validate
        self.checked_next = dict(checked_next)
        self.checked_root = dict(checked_root)
        self.watched = watched
        self._all = list(range(self.rows))
        self._pending: Mapping[NestedKey, np.ndarray] | None = None
        self.busy_env = 0
        self.busy_phase = "step"
        self.busy_since = 0.0

    def begin(self, inputs: Mapping[NestedKey, np.ndarray], envs: Sequence[int]) -> None:
        """Keep the inputs of a step of every env (``envs`` is the whole block); it runs in :meth:`finish`."""
        if len(envs) != self.rows:
            raise EnvFailure(envs[0], "step", "env", _CheckFailed(
                f"a natively batched env steps all its {self.rows} envs at once, not {len(envs)} of them"))
        self._pending = inputs

    def ended(self, stop: threading.Event | None = None, *, every: bool = False) -> list[int]:
        """Every env (the batch steps in :meth:`finish`)."""
        return self._all

    def finish(self, envs: Sequence[int], out: Mapping[NestedKey, np.ndarray], rewards: np.ndarray,
               terminated: np.ndarray, truncated: np.ndarray) -> tuple[Sequence[int], EnvFailure | None]:
        """Step the batch with the inputs kept by :meth:`begin`; write its results (row ``i``: env ``i``).

        Raises:
            EnvFailure: the step raised (named by the block's first env), or an env's entries fail the checks.
        """
        inputs, self._pending = self._pending, None
        assert inputs is not None
        self.busy_env, self.busy_phase = 0, "step"
        if self.watched:
            self.busy_since = time.perf_counter()
        try:
            nxt, reward, term, trunc = self.env.step_all(inputs)
        except Exception as exc:
            raise EnvFailure(0, "step", "env", exc) from exc
        finally:
            self.busy_since = 0.0
        if self.validate:
            self._check(nxt)
        for k, buf in out.items():
            buf[...] = nxt[k]
        rewards[...] = reward
        terminated[...] = term
        truncated[...] = trunc
        return envs, None

    def _check(self, values: Mapping[NestedKey, np.ndarray]) -> None:
        """Every checked entry has its shape and dtype for every env, without NaN (one look a key)."""
        for k, spec in self.checked_next.items():
            v = values.get(k)
            problem = None
            if v is None:
                problem = f"entry {k!r} is missing"
            elif v.shape[1:] != spec.shape:
                problem = f"entry {k!r} has shape {v.shape[1:]}, expected {spec.shape}"
            elif v.dtype != spec.dtype and not np.can_cast(v.dtype, spec.dtype, "same_kind"):
                problem = f"entry {k!r} has dtype {v.dtype}, expected {spec.dtype}"
            elif v.dtype.kind == "f":
                total = v.sum()
                if total != total:
                    bad = np.isnan(v.reshape(self.rows, -1)).any(axis=1)
                    if bad.any():
                        raise EnvFailure(int(bad.argmax()), "check", "env", _CheckFailed(f"entry {k!r} contains NaN"))
            if problem is not None:
                raise EnvFailure(0, "check", "env", _CheckFailed(problem))

    def reset(self, j: int, seed: int | None, stop: threading.Event | None = None) -> dict[NestedKey, Any]:
        """Reset env ``j`` alone (a partial reset of the batch, seeded as a whole with ``seed``)."""
        return self._reset([j], seed)[0]

    def reset_many(self, envs: Sequence[int], stop: threading.Event | None = None) -> list[dict[NestedKey, Any]]:
        """Reset envs ``envs`` together (one partial reset of the batch); their root entries, checked."""
        return self._reset(envs, None)

    def _reset(self, envs: Sequence[int], seed: int | None) -> list[dict[NestedKey, Any]]:
        self.busy_env, self.busy_phase = envs[0], "reset"
        if self.watched:
            self.busy_since = time.perf_counter()
        try:
            roots = self.env.reset_some(envs, seed)
        except Exception as exc:
            raise EnvFailure(envs[0], "reset", "env", exc) from exc
        finally:
            self.busy_since = 0.0
        rows = [{k: v[i] for k, v in roots.items()} for i in range(len(envs))]
        if self.validate:
            for j, root in zip(envs, rows):
                _check(j, root, self.checked_root)
        return rows

    def random_action(self, j: int, columns: Mapping[NestedKey, ArraySpec],
                      stop: threading.Event | None = None) -> dict[NestedKey, np.ndarray]:
        """A uniformly random valid action of one env (raises :class:`EnvFailure` as :meth:`EnvBlock.random_action`)."""
        try:
            return self.env.random_action(columns)
        except Exception as exc:
            raise EnvFailure(j, "step", "env", exc) from exc

    def close(self) -> None:
        """Close the batched env (errors are swallowed: closing must not hide the error being raised)."""
        close_quietly([self.env])
