"""One block of envs, stepped together by one thread, writing into caller-owned arrays.

An :class:`EnvBlock` is what an env thread steps in-process and what a block server
steps in a worker process (:mod:`lightning_rollout.loop.process`): the same code on
both sides. A step takes the block's inputs for ``n`` of its envs (row ``i`` is env
``envs[i]``) and writes each env's ``"next"`` entries, reward and flags into row
``i`` of the arrays it is given: no per-env dictionaries on the way out, and for
gymnasium envs with one array observation none on the way in either (actions are
converted and validated once for the block, observations are checked once for the
block). Errors come out as :class:`EnvFailure`, naming the env's index in the block
and the phase, which the caller turns into the user-facing error.

Threading: a block is owned by one thread. ``busy_env``, ``busy_phase`` and
``busy_since`` are plain attributes written by that thread around each env call and
read, without a lock, by the driver's ``step_timeout`` check (a stale read costs at
most one check period).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..envs import ActionError, EnvAdapter, GymAdapter
from ..specs import ArraySpec, NestedKey
from .buffers import check_entries

__all__ = ["EnvBlock", "EnvFailure", "RemoteTraceback"]


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process (chained as the cause of the error)."""


class EnvFailure(Exception):
    """An env call of a block failed (internal: the env thread names the env and step).

    Attributes:
        j: the env's index in its block.
        phase: ``"reset"``, ``"step"``, ``"check"`` or ``"create"``.
        kind: ``"env"``, or ``"action"`` when the policy's action was invalid.
        cause: the exception (or its remote traceback).
        process: the index of the worker process the env runs in (``None``: in-process).
    """

    process: int | None = None

    def __init__(self, j: int, phase: str, kind: str, cause: BaseException) -> None:
        remote = isinstance(cause, RemoteTraceback)  # its text starts with the remote "Type: message" line
        if remote:
            text = str(cause).split("\n", 1)[0]
        elif kind == "action" or phase == "check":  # our own messages: no exception type in front
            text = str(cause)
        else:
            text = f"{type(cause).__name__}: {cause}"
        super().__init__(text)
        self.j, self.phase, self.kind, self.cause = j, phase, kind, cause


class _CheckFailed(Exception):
    """What an env returned does not match its spec (the message of :func:`check_entries`)."""


class EnvBlock:
    """The envs of one block: reset, step and sample random actions, writing into given arrays.

    Args:
        adapters: the block's envs (index ``j`` in the block).
        validate: check each observation against ``checked_next`` / ``checked_root``
            (shape, dtype, NaN) and each action against the action space.
        checked_next: the ``"next"`` entries to check after a step (``{key: ArraySpec}``).
        checked_root: the root entries to check after a reset.
        zero_done: root done flags a TorchRL env reads at the root: passed as zeros.
    """

    def __init__(self, adapters: Sequence[EnvAdapter], *, validate: bool,
                 checked_next: Mapping[NestedKey, ArraySpec], checked_root: Mapping[NestedKey, ArraySpec],
                 zero_done: Mapping[NestedKey, ArraySpec]) -> None:
        self.adapters = list(adapters)
        self.validate = validate
        self.checked_next = dict(checked_next)
        self.checked_root = dict(checked_root)
        self.zero_done = {k: np.zeros(spec.shape, bool) for k, spec in zero_done.items()}
        self.busy_env = -1
        self.busy_phase = "step"
        self.busy_since = 0.0  # perf_counter() while inside an env call, else 0.0
        first = self.adapters[0]
        # The fast path: gymnasium envs with one array observation and no info entries, one action space.
        self._gym = (all(isinstance(a, GymAdapter) and a.plain_observation for a in self.adapters)
                     and all(a.action_space == first.action_space for a in self.adapters[1:]))
        spec = self.checked_next.get("observation")
        self._obs_spec = (spec.shape, spec.dtype) if spec is not None else None
        self._accepted_dtypes: set[np.dtype] = set()  # observation dtypes seen to cast safely to the column's

    # -- calls ------------------------------------------------------------------------
    # ``stop`` (ignored here) keeps the signatures of RemoteEnvs, whose calls wait on another process.
    def reset(self, j: int, seed: int | None, stop: threading.Event | None = None) -> dict[NestedKey, Any]:
        """Reset env ``j``; its root entries, checked. Raises :class:`EnvFailure`."""
        self.busy_env, self.busy_phase, self.busy_since = j, "reset", time.perf_counter()
        try:
            root = self.adapters[j].reset(seed)
        except Exception as exc:
            raise EnvFailure(j, "reset", "env", exc) from exc
        finally:
            self.busy_since = 0.0
        if self.validate:
            problem = check_entries(root, self.checked_root)
            if problem is not None:
                raise EnvFailure(j, "check", "env", _CheckFailed(problem))
        return root

    def random_action(self, j: int, columns: Mapping[NestedKey, ArraySpec],
                      stop: threading.Event | None = None) -> dict[NestedKey, np.ndarray]:
        """A uniformly random valid action of env ``j``, laid out as ``columns``."""
        return self.adapters[j].random_action(columns)

    def step(self, inputs: Mapping[NestedKey, np.ndarray], envs: Sequence[int], out: Mapping[NestedKey, np.ndarray],
             rewards: np.ndarray, terminated: np.ndarray, truncated: np.ndarray,
             stop: threading.Event | None = None) -> None:
        """Step envs ``envs`` with row ``i`` of ``inputs`` for env ``envs[i]``; write its ``"next"``
        entries to row ``i`` of ``out`` (keyed by the env's key, without ``"next"``), its reward and
        flags to ``rewards[i]``, ``terminated[i]``, ``truncated[i]``. Raises :class:`EnvFailure`."""
        if self._gym:
            self._step_gym(inputs["action"], envs, out, rewards, terminated, truncated)
            return
        adapters, zero_done, validate, checked = self.adapters, self.zero_done, self.validate, self.checked_next
        for i, j in enumerate(envs):
            row = {k: v[i] for k, v in inputs.items()}
            row.update(zero_done)
            self.busy_env, self.busy_since = j, time.perf_counter()
            try:
                nxt, rewards[i], terminated[i], truncated[i] = adapters[j].step(row)
            except ActionError as exc:  # the policy's fault, not the env's
                raise EnvFailure(j, "step", "action", exc) from exc
            except Exception as exc:
                raise EnvFailure(j, "step", "env", exc) from exc
            finally:
                self.busy_since = 0.0
            if validate:
                problem = check_entries(nxt, checked)
                if problem is not None:
                    raise EnvFailure(j, "check", "env", _CheckFailed(problem))
            for k, buf in out.items():
                buf[i] = nxt[k]

    def _step_gym(self, actions: np.ndarray, envs: Sequence[int], out: Mapping[NestedKey, np.ndarray],
                  rewards: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> None:
        """Gymnasium envs with one array observation: actions converted for the block at once, each
        ``env.step`` result written straight to its row, observations checked for the block."""
        adapters = self.adapters
        try:
            env_actions = adapters[0].actions(actions)
        except ActionError:  # find the env whose action is invalid, for the message
            for i, j in enumerate(envs):
                try:
                    adapters[j].actions(actions[i:i + 1])
                except ActionError as exc:
                    raise EnvFailure(j, "step", "action", exc) from exc
            raise
        obs_out = out["observation"]
        expected = self._obs_spec if self.validate else None
        for i, j in enumerate(envs):
            self.busy_env, self.busy_since = j, time.perf_counter()
            try:
                obs, rewards[i], terminated[i], truncated[i], _ = adapters[j].env.step(env_actions[i])
            except Exception as exc:
                raise EnvFailure(j, "step", "env", exc) from exc
            finally:
                self.busy_since = 0.0
            if expected is not None and (getattr(obs, "shape", None) != expected[0] or (
                    getattr(obs, "dtype", None) != expected[1] and obs.dtype not in self._accepted_dtypes)):
                obs = np.asarray(obs)
                problem = check_entries({"observation": obs}, self.checked_next)
                if problem is not None:
                    raise EnvFailure(j, "check", "env", _CheckFailed(problem))
                if type(obs) is np.ndarray and obs.shape == expected[0]:
                    self._accepted_dtypes.add(obs.dtype)  # e.g. float64 observations of a float32 space
            obs_out[i] = obs
        if expected is not None and obs_out.dtype.kind == "f":
            n = len(envs)
            bad = np.isnan(obs_out[:n].reshape(n, -1)).any(axis=1)
            if bad.any():
                i = int(bad.argmax())
                raise EnvFailure(envs[i], "check", "env", _CheckFailed("entry 'observation' contains NaN"))

    def close(self) -> None:
        """Close every env; errors are swallowed (closing must not hide the error being raised)."""
        for adapter in self.adapters:
            try:
                adapter.close()
            except Exception:
                pass
