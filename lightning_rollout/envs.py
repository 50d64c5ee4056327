"""Env units: one step API over gymnasium envs (:class:`GymUnit`), TorchRL envs (:class:`TorchRLUnit`) and envpool
(:class:`EnvpoolUnit`), described by TorchRL specs.

A *unit* steps ``rows`` envs in one call and autoresets the ones a step ended (TorchRL's ``step_and_maybe_reset``),
writing into a :class:`Slots` view of its executor's arrays. A unit is owned by one thread. Errors come out as
:class:`EnvFailure`, naming the row and the phase; a bad env fails at construction with a ``ValueError``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict
from torchrl.data import Composite, TensorSpec, Unbounded
from torchrl.envs import EnvBase, StepCounter
from torchrl.envs.libs.gym import GymWrapper
from torchrl.envs.libs.gym import _gym_to_torchrl_spec_transform as _gym_spec

from ._checks import check_int
from .specs import (LOOP_ROOT_KEYS, TORCHRL_ROOT_KEYS, ArraySpec, EnvKeys, NestedKey, columns_of, key_parts, leaves,
                    reserved_key_problem)

__all__ = ["ActionError", "EnvFactory", "EnvFailure", "EnvpoolUnit", "GymMaker", "GymUnit", "InfoKeys", "Slots",
           "TorchRLUnit", "Unit", "check_entries", "env_factories", "info_key_list", "make_unit", "resolve_env_factory"]

EnvFactory = Callable[[], "gym.Env | EnvBase"]
#: Entries of a gymnasium env's ``info`` read into batches: a list of keys (specs inferred from the first
#: reset's ``info``) or ``{key: TorchRL spec}``. A tuple key reads nested dicts.
InfoKeys = Sequence[NestedKey] | Mapping[NestedKey, TensorSpec]

_FLAG = ArraySpec((1,), np.dtype(bool))
_RETURN = ArraySpec((1,), np.dtype(np.float32))
_GYM_RESERVED = {**TORCHRL_ROOT_KEYS, **LOOP_ROOT_KEYS}
_SUPPORTED = (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiBinary, gym.spaces.MultiDiscrete)
_MISSING = object()
_LOOP_OBS = {"is_init": torch.bool, "step_count": torch.int64, "episode_reward": torch.float32}  # the loop writes


class ActionError(ValueError):
    """The policy's action is not a valid action of the env (wrong shape, out of bounds, NaN...)."""


class Explained(Exception):
    """An error whose message says everything (shown without its type name)."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process (chained as the cause of the error)."""


class EnvFailure(Exception):
    """An env call failed (internal: the loop turns it into :class:`~lightning_rollout.errors.EnvError`).

    ``row``: the env's row in its executor (a unit raises its own, the executor shifts it); ``phase``: ``"reset"``,
    ``"step"`` or ``"check"``; ``kind``: ``"env"``, or ``"action"`` when the policy's action was invalid; ``cause``:
    the exception (or a :class:`RemoteTraceback`); ``process``: the worker process the env runs in (``None``: this
    one); ``completed``: rows of the failing call whose step ended before it (results written); ``lost``: rows of
    that call that will never answer.
    """

    completed: np.ndarray = np.empty(0, dtype=np.int64)
    lost: np.ndarray = np.empty(0, dtype=np.int64)

    def __init__(self, row: int, phase: str, kind: str, cause: BaseException, process: int | None = None) -> None:
        if isinstance(cause, RemoteTraceback):
            text = str(cause).split("\n", 1)[0]
        elif kind == "action" or isinstance(cause, Explained):
            text = str(cause)
        else:
            text = f"{type(cause).__name__}: {cause}"
        super().__init__(text)
        self.row, self.phase, self.kind, self.cause, self.process = row, phase, kind, cause, process

    def shifted(self, offset: int) -> EnvFailure:
        """This failure, for the same env seen ``offset`` rows further in a larger executor."""
        failure = EnvFailure(self.row + offset, self.phase, self.kind, self.cause, self.process)
        failure.completed, failure.lost = self.completed + offset, self.lost + offset
        return failure

    def within(self, rows: Sequence[int] | range) -> EnvFailure:
        """This failure of a call on ``rows`` (in order): those before the failing one completed (and the failing one
        when its step ended and its reset failed), the others lost."""
        rows = np.asarray(list(rows), dtype=np.int64)
        at = int(np.flatnonzero(rows == self.row)[0]) + (self.phase == "reset") if self.row in rows else 0
        self.completed, self.lost = rows[:at], rows[at:]
        return self


def check_entries(values: Mapping[NestedKey, Any], specs: Mapping[NestedKey, ArraySpec], rows: int | None = None
                  ) -> str | None:
    """The first problem of ``values`` against ``specs`` (missing entry, shape, dtype, NaN), or ``None``;
    ``rows``: the values carry that leading batch dim. Python scalars pass unchecked."""
    for k, spec in specs.items():
        if (v := values.get(k)) is None:
            return f"entry {k!r} is missing"
        if not isinstance(v, np.ndarray):
            continue
        shape = v.shape if rows is None else v.shape[1:]
        if shape != spec.shape:
            return f"entry {k!r} has shape {shape}, expected {spec.shape}"
        if v.dtype != spec.dtype and not np.can_cast(v.dtype, spec.dtype, "same_kind"):
            return f"entry {k!r} has dtype {v.dtype}, expected {spec.dtype}"
        if v.dtype.kind == "f":
            total = v.sum()  # one sum finds any NaN
            if total != total and np.isnan(v).any():
                return f"entry {k!r} contains NaN"
    return None


def _checked(row: int, values: Mapping[NestedKey, Any], specs: Mapping[NestedKey, ArraySpec],
             rows: int | None = None) -> None:
    if (problem := check_entries(values, specs, rows)) is not None:
        raise EnvFailure(row, "check", "env", Explained(problem))


@dataclass
class Slots:
    """Views of an executor's per-env arrays (row ``i``: env ``i``), where units read and write.

    Attributes:
        inputs: what the envs read (a gymnasium env's ``"action"``; every root entry and action of a TorchRL env).
        next: what a step writes (the env's ``"next"`` entries; a gymnasium env's observations only).
        root: the root entries after a reset (written for the rows reset).
        reward: float64, the step's reward summed over reward leaves.
        terminated, truncated: bool, the step's flags (an episode cap counts as truncated).
        reset: bool, the row was reset after its step (its new root entries are in ``root``).
    """

    inputs: dict[NestedKey, np.ndarray]
    next: dict[NestedKey, np.ndarray]
    root: dict[NestedKey, np.ndarray]
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    reset: np.ndarray

    def rows(self, a: int, b: int) -> Slots:
        """Rows ``a`` to ``b - 1`` (views)."""
        inputs, nxt, root = ({k: v[a:b] for k, v in d.items()} for d in (self.inputs, self.next, self.root))
        return Slots(inputs, nxt, root, self.reward[a:b], self.terminated[a:b], self.truncated[a:b], self.reset[a:b])

    @classmethod
    def allocate(cls, rows: int, *, inputs: Mapping[NestedKey, ArraySpec], next: Mapping[NestedKey, ArraySpec],
                 root: Mapping[NestedKey, ArraySpec], make: Callable[[tuple[int, ...], np.dtype], np.ndarray] = np.zeros
                 ) -> Slots:
        """Zeroed arrays of ``rows`` rows (``make(shape, dtype)``: e.g. shared memory)."""
        col = lambda specs: {k: make((rows, *s.shape), s.dtype) for k, s in specs.items()}  # noqa: E731
        return cls(col(inputs), col(next), col(root), make((rows,), np.dtype(np.float64)),
                   make((rows,), np.dtype(bool)), make((rows,), np.dtype(bool)), make((rows,), np.dtype(bool)))


class Unit:
    """What every unit provides (see the module docstring). Set by subclasses:

    Attributes:
        envs: the env instances it steps.
        rows: envs stepped by one call.
        keys: one env's leaves (:class:`~lightning_rollout.specs.EnvKeys`).
        observation_spec, action_spec: one env's TorchRL composites (for wrapping a policy, random actions).
        loop_keys: the loop writes ``is_init``, ``step_count``, ``episode_reward`` and the done flags.
        partial: a step may take some of the rows only.
        writes: the entries a step writes into ``Slots.next``.
    """

    envs: list[Any]
    rows: int
    keys: EnvKeys
    observation_spec: Composite
    action_spec: Composite
    loop_keys: bool
    partial: bool = True
    slots: Slots

    def bind(self, slots: Slots) -> None:
        """Use ``slots`` (this unit's rows) from now on."""
        self.slots = slots

    @property
    def writes(self) -> dict[NestedKey, ArraySpec]:
        return self.keys.observation if self.loop_keys else self.keys.next

    def reset(self, rows: Sequence[int], seeds: Sequence[int | None]) -> None:
        """Start a new episode on ``rows`` (reseeded where a seed is given): root entries into ``slots.root``."""
        raise NotImplementedError

    def step(self, rows: np.ndarray | None) -> None:
        """Step ``rows`` (``None``: every row) with ``slots.inputs``; results into ``slots``, done rows reset."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the envs (an error while closing one is dropped)."""
        close_quietly(self.envs)


# -- gymnasium --------------------------------------------------------------------------------------
def _space_leaves(space: gym.Space, prefix: tuple[str, ...]) -> dict[NestedKey, gym.Space]:
    if isinstance(space, (gym.spaces.Dict, gym.spaces.Tuple)):
        items = space.spaces.items() if isinstance(space, gym.spaces.Dict) else enumerate(space.spaces)
        return {key: leaf for k, s in items for key, leaf in _space_leaves(s, (*prefix, str(k))).items()}
    if isinstance(space, _SUPPORTED):
        return {prefix[0] if len(prefix) == 1 else prefix: space}
    raise ValueError(f"unsupported space {space!r} at {prefix!r}: use Box, Discrete, MultiBinary, MultiDiscrete, "
                     "or Dict / Tuple of those (wrap the env with a gymnasium wrapper otherwise)")


def info_key_list(info_keys: InfoKeys | None) -> list[NestedKey]:
    """The keys of ``info_keys`` (a list of keys or a ``{key: spec}`` dict), nested keys as tuples; ``ValueError``
    if ``info_keys`` is a single string, or a key is neither a string nor a tuple of strings."""
    if isinstance(info_keys, str):
        raise ValueError(f"info_keys must be a list of keys or a dict {{key: TorchRL spec}}, got the string "
                         f"{info_keys!r}; write info_keys=[{info_keys!r}]")
    keys = [k[0] if isinstance(k, tuple) and len(k) == 1 else k for k in (info_keys if info_keys is not None else ())]
    for k in keys:
        if not (isinstance(k, str) or (isinstance(k, tuple) and k and all(isinstance(p, str) for p in k))):
            raise ValueError(f"info key {k!r} must be a string or a tuple of strings (a nested key)")
    return keys


def _entry(value: Any, parts: tuple[str, ...]) -> Any:
    """The entry at ``parts`` of nested dicts (and tuples, by index), or ``_MISSING``."""
    for part in parts:
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, (tuple, list)) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return _MISSING
    return value


class GymUnit(Unit):
    """Gymnasium envs, stepped one after the other (``rows = len(envs)``); all share the first's spaces.

    Specs are TorchRL's conversion of each leaf space (``Dict`` spaces nested, ``Tuple`` spaces as keys ``"0"``,
    ``"1"``...); the loop adds ``is_init``, ``step_count`` and ``episode_reward`` (``loop_keys``). Actions are taken as
    an index or one-hot for discrete spaces and checked against the action space (:class:`ActionError`).
    ``info_keys`` (:data:`InfoKeys`) reads ``info`` entries as observations (one missing from an ``info``: zeros).
    ``max_episode_steps`` truncates an episode at that length.

    Raises:
        ValueError: an unsupported space; an observation or info entry named after a root key of TorchRL's or the
            loop's (``action``, ``reward``, ``done``, ``is_init``, ``collector``...); an info key that clashes with an
            observation, is missing from the first reset's ``info`` without a spec, or is not numeric.
    """

    loop_keys = True

    def __init__(self, envs: Sequence[gym.Env], *, validate: bool = True, info_keys: InfoKeys | None = None,
                 max_episode_steps: int | None = None) -> None:
        self.envs = list(envs)
        env = self.envs[0]
        self.rows, self.validate, self.cap = len(self.envs), validate, max_episode_steps
        self.count = [0] * self.rows
        obs_space = env.observation_space
        root: tuple[str, ...] = () if isinstance(obs_space, gym.spaces.Dict) else ("observation",)
        if not (spaces := _space_leaves(obs_space, root)):
            raise ValueError(f"the observation space {obs_space!r} has no entries")
        if problem := reserved_key_problem(spaces, _GYM_RESERVED, where="observation space",
                                           fix="rename it in the env (e.g. with a gymnasium ObservationWrapper)"):
            raise ValueError(problem)
        self._obs_parts = {k: key_parts(k)[len(root):] for k in spaces}  # where in ``obs`` each entry is
        specs = {k: _gym_spec(s, categorical_action_encoding=True) for k, s in spaces.items()}
        self.observation_spec = Composite({**specs, **{k: Unbounded((1,), dtype=d) for k, d in _LOOP_OBS.items()}})
        self._info = self._info_specs(env, info_keys)
        self.observation_spec.update(self._info)
        space = self.action_space = env.action_space
        if not isinstance(space, _SUPPORTED):
            raise ValueError(f"unsupported action space {space!r}: use Box, Discrete, MultiBinary or MultiDiscrete")
        self.action_spec = Composite(action=_gym_spec(space, categorical_action_encoding=False))
        self.keys = EnvKeys(observation=columns_of(self.observation_spec, where="observation space"), state={},
                            reward={"reward": _RETURN}, done={"done": _FLAG, "terminated": _FLAG, "truncated": _FLAG},
                            action=columns_of(self.action_spec, where="action space"))
        for i, other in enumerate(self.envs[1:], 1):
            if other.observation_space != obs_space or other.action_space != space:
                raise ValueError(f"env {i} has spaces {other.observation_space}, {other.action_space}; env 0 has "
                                 f"{obs_space}, {space}: all envs of a loop must share their spaces")
        self._checked = {k: v for k, v in self.keys.observation.items() if k not in _LOOP_OBS}
        self._plain = not isinstance(obs_space, (gym.spaces.Dict, gym.spaces.Tuple)) and not self._info
        self._n = int(space.n) if isinstance(space, gym.spaces.Discrete) else 0
        self._start = int(getattr(space, "start", 0)) if self._n else 0
        self._nvec = np.asarray(space.nvec) if isinstance(space, gym.spaces.MultiDiscrete) else None
        low, high = (np.unique(space.low), np.unique(space.high)) if isinstance(space, gym.spaces.Box) else ((), ())
        # (low, high) of a Box whose dims all share their bounds
        self._box = (float(low[0]), float(high[0])) if space.shape and len(low) == len(high) == 1 else None

    def _info_specs(self, env: gym.Env, info_keys: InfoKeys | None) -> dict[NestedKey, TensorSpec]:
        keys = info_key_list(info_keys)
        given = dict(zip(keys, info_keys.values())) if isinstance(info_keys, Mapping) else {}
        taken = set(self.observation_spec.keys(True, True))
        first: Mapping[str, Any] | None = None
        out: dict[NestedKey, TensorSpec] = {}
        for k in keys:
            if k in taken or (isinstance(k, tuple) and k[0] in self.observation_spec.keys()):
                raise ValueError(f"info key {k!r} clashes with an observation entry of the env (or the loop's "
                                 "is_init / step_count / episode_reward)")
            fix = "store it in info under another name (e.g. with a gymnasium Wrapper)"
            if problem := reserved_key_problem([k], _GYM_RESERVED, where="info_keys", fix=fix):
                raise ValueError(problem)
            if not given:
                if first is None:
                    _, first = env.reset()
                if (value := _entry(first, key_parts(k))) is _MISSING:
                    raise ValueError(f"info key {k!r} is not in the info of the env's first reset (it has "
                                     f"{sorted(first)}); pass info_keys={{{k!r}: spec}} to give its spec, "
                                     "e.g. Unbounded((), dtype=torch.bool) for an 'is_success' set at the end")
                try:
                    tensor = torch.as_tensor(value)
                except (TypeError, ValueError, RuntimeError) as exc:
                    raise ValueError(f"info entry {k!r} of the first reset is {value!r}, not a number or a numeric "
                                     "array; pass info_keys={key: spec} for entries that are not numeric at reset"
                                     ) from exc
                spec = Unbounded(tuple(tensor.shape), dtype=tensor.dtype)
            elif not isinstance(spec := given[k], TensorSpec):
                raise ValueError(f"the spec of info key {k!r} must be a TorchRL TensorSpec, got {type(spec).__name__}")
            out[k] = spec
        return out

    def _write(self, out: dict[NestedKey, np.ndarray], i: int, obs: Any, info: Mapping[str, Any]) -> None:
        """Env ``i``'s observation (and info entries) into row ``i`` of ``out``, checked when validating."""
        if self._plain:
            if self.validate and not (type(obs) is np.ndarray and obs.shape == out["observation"].shape[1:]
                                      and obs.dtype == out["observation"].dtype):
                _checked(i, {"observation": np.asarray(obs)}, self._checked)
            out["observation"][i] = obs
            return
        values = {k: np.asarray(v) for k, parts in self._obs_parts.items() if (v := _entry(obs, parts)) is not _MISSING}
        for k, spec in self._info.items():
            value = _entry(info, key_parts(k))
            values[k] = np.zeros(spec.shape, out[k].dtype) if value is _MISSING else np.asarray(value, out[k].dtype)
        if self.validate:
            _checked(i, values, self._checked)
        for k, v in values.items():
            out[k][i] = v

    def reset(self, rows: Sequence[int], seeds: Sequence[int | None]) -> None:
        for i, seed in zip(rows, seeds):
            try:
                obs, info = self.envs[i].reset(seed=seed)
                self._write(self.slots.root, i, obs, info)
            except EnvFailure:
                raise
            except BaseException as exc:
                raise EnvFailure(i, "reset", "env", exc) from exc
            self.count[i] = 0
            self.slots.reset[i] = True

    def step(self, rows: np.ndarray | None) -> None:
        s, every = self.slots, rows is None
        rows = range(self.rows) if rows is None else rows
        actions = self._actions(s.inputs["action"], rows)
        nxt, reward, terminated, truncated, count = s.next, s.reward, s.terminated, s.truncated, self.count
        out = nxt["observation"] if self._plain else None  # a plain observation: written as it is when it fits
        try:
            for i, action in zip(rows, actions):
                obs, reward[i], term, trunc, info = self.envs[i].step(action)
                if out is not None and (not self.validate or type(obs) is np.ndarray and obs.shape == out.shape[1:]
                                        and obs.dtype == out.dtype):
                    out[i] = obs
                else:
                    self._write(nxt, i, obs, info)
                count[i] += 1
                trunc = trunc or (self.cap is not None and count[i] >= self.cap)
                terminated[i], truncated[i], s.reset[i] = term, trunc, False
                if term or trunc:
                    self.reset([i], [None])
        except EnvFailure as failure:  # a check or a reset failed
            raise failure.within(rows) from failure.cause
        except BaseException as exc:  # KeyboardInterrupt too: the loop re-raises a Ctrl-C as it is
            raise EnvFailure(i, "step", "env", exc).within(rows) from exc
        if self.validate and self._plain and nxt["observation"].dtype.kind == "f":  # NaN: one sum for all rows
            values = nxt["observation"].reshape(self.rows, -1)[slice(None) if every else rows]
            if np.isnan(values.sum()):
                bad, rows = np.isnan(values).any(1), np.asarray(list(rows))
                failure = EnvFailure(int(rows[bad.argmax()]), "check", "env",
                                     Explained("entry 'observation' contains NaN"))
                failure.completed, failure.lost = rows[~bad], rows[bad]
                raise failure

    def _actions(self, action: np.ndarray, rows: Sequence[int] | range) -> list[Any]:
        """Rows ``rows`` of ``action`` -> what ``env.step`` takes, converted (and checked) at once where the space
        allows it. Raises :class:`EnvFailure` (kind ``"action"``) for the first invalid row."""
        action = action[rows] if not isinstance(rows, range) else action
        dtype = self.action_space.dtype  # numpy scalars or arrays, as a vector env passes them
        if self._n > 1 and action.ndim == 2 and action.shape[1] == self._n:  # one-hot rows
            return list((action.argmax(1) + self._start).astype(dtype, copy=False))
        if self._n and action.ndim == 1 and (not self.validate or (  # indices, checked at once
                action.dtype.kind in "iu" and 0 <= action.min() and action.max() < max(self._n, 2))):
            return list(((action if self._n > 1 else np.zeros_like(action)) + self._start).astype(dtype, copy=False))
        if self._box is not None and action.shape[1:] == self.action_space.shape and (
                not self.validate or (self._box[0] <= action.min() and action.max() <= self._box[1])):
            return list(action.astype(dtype, copy=False))
        out = []
        for i, row in zip(rows, action):
            try:
                out.append(self._action(row))
            except ActionError as exc:
                raise EnvFailure(i, "step", "action", exc).within(rows) from exc
        return out

    def _action(self, action: np.ndarray) -> Any:
        """One policy action row -> what ``env.step`` takes; raises :class:`ActionError`."""
        space, n = self.action_space, self._n
        if n:
            if action.size == n and n > 1:  # one-hot
                return int(action.argmax()) + self._start
            if action.size != 1:
                raise ActionError(f"action of shape {action.shape} for {space!r}: give an index or a one-hot of {n}")
            value = action.reshape(-1)[0]  # an index (for n == 1 the one-hot [1] too: both mean action 0)
            if self.validate and (not np.isfinite(value) or value != int(value) or not 0 <= value < max(n, 2)):
                raise ActionError(f"action {value!r} is not an index in [0, {n}) of {space!r}")
            return (0 if n == 1 else int(value)) + self._start
        if (nvec := self._nvec) is not None:
            if action.shape == nvec.shape:
                indices = action
            elif action.ndim == 1 and nvec.ndim == 1 and action.size == int(nvec.sum()):  # concatenated one-hots
                indices = np.array([a.argmax() for a in np.split(action, np.cumsum(nvec)[:-1])])
            else:
                raise ActionError(f"action of shape {action.shape} for {space!r}: give {nvec.shape} indices or "
                                  f"{int(nvec.sum())} concatenated one-hots")
            if self.validate and np.any((indices < 0) | (indices >= nvec) | (indices != np.round(indices))):
                raise ActionError(f"action {indices!r} is out of {space!r}")
            return indices.astype(space.dtype)
        if action.shape != space.shape:
            raise ActionError(f"action of shape {action.shape} for {space!r} (expected {space.shape})")
        if self.validate and isinstance(space, gym.spaces.Box) and not (
                np.all(action >= space.low) and np.all(action <= space.high)):
            if action.dtype.kind == "f" and np.isnan(action).any():
                raise ActionError(f"action {action!r} contains NaN")
            raise ActionError(f"action {action!r} is out of the bounds of {space!r} (clip or squash it)")
        return action.astype(space.dtype, copy=False)


# -- torchrl --------------------------------------------------------------------------------------
def _torchrl_keys(env: EnvBase) -> EnvKeys:
    row = (0,) * len(env.batch_size)  # one env's specs: the first row of a batched env's
    keys = EnvKeys.from_specs(observation=env.full_observation_spec[row], state=env.full_state_spec[row],
                              reward=env.full_reward_spec[row], done=env.full_done_spec[row],
                              action=env.full_action_spec[row], where="env's")
    if problem := reserved_key_problem([*keys.root, *keys.next, *keys.action], LOOP_ROOT_KEYS, where="env's specs",
                                       fix="rename it with TorchRL's RenameTransform"):
        raise ValueError(problem)
    return keys


class TorchRLUnit(Unit):
    """TorchRL envs (unbatched, or batched: ``rows`` is the sum of their batch sizes, row-major over each env's batch
    dims), each stepped with ``env.step_and_maybe_reset``, as TorchRL's ``Collector`` steps it.

    ``max_episode_steps`` appends TorchRL's ``StepCounter(max_episode_steps)``, as ``Collector`` does for
    ``max_frames_per_traj``. A batched env resets the rows a step ended with TorchRL's partial reset; it is seeded as
    a whole (``env.set_seed``) with its first row's seed.

    Raises:
        ValueError: a spec that cannot be stored in columns, an entry named after the loop's own, envs whose specs
            differ, or a ``step_count`` entry that the cap would clash with.
    """

    loop_keys = False

    def __init__(self, envs: Sequence[EnvBase], *, max_episode_steps: int | None = None, validate: bool = True) -> None:
        if max_episode_steps is not None:
            if any("step_count" in key_parts(k) for k in envs[0].output_spec.keys(True, True)):
                raise ValueError("A 'step_count' key is already present in the environment and the "
                                 "'max_frames_per_traj' argument may conflict with a 'StepCounter' that has already "
                                 "been set. Possible solutions: Set max_frames_per_traj to 0 or remove the "
                                 "StepCounter limit from the environment transforms.")  # TorchRL's check and message
            envs = [env.append_transform(StepCounter(max_episode_steps)) for env in envs]
        self.envs, self.validate = list(envs), validate
        self.keys = _torchrl_keys(self.envs[0])
        for i, env in enumerate(self.envs[1:], 1):
            if _torchrl_keys(env) != self.keys or env.batch_size != self.envs[0].batch_size:
                raise ValueError(f"env {i} has specs {_torchrl_keys(env)}, env 0 has {self.keys}; all envs of a loop "
                                 "must share their keys, shapes, dtypes and batch size")
        row = (0,) * len(self.envs[0].batch_size)
        self.observation_spec = self.envs[0].full_observation_spec[row]
        self.action_spec = self.envs[0].full_action_spec[row]
        self.batch = torch.Size(self.envs[0].batch_size)
        self.size = self.batch.numel()
        self.rows, self.partial = self.size * len(self.envs), self.size == 1
        done = list(self.keys.done)
        self._terminated = [k for k in done if key_parts(k)[-1] == "terminated"] or \
            [k for k in done if key_parts(k)[-1] == "done"]
        self._truncated = [k for k in done if key_parts(k)[-1] == "truncated"]
        self._root_done = "done" in self.keys.done

    def _td(self, values: Mapping[NestedKey, np.ndarray]) -> TensorDict:
        lead = tuple(self.batch)
        td = TensorDict({k: torch.from_numpy(np.asarray(v)).reshape((*lead, *v.shape[1:])) for k, v in values.items()},
                        batch_size=self.batch)
        for prefix, dims in self.keys.sub_batch.items():
            if (sub := td.get(prefix, None)) is not None:
                sub.batch_size = torch.Size([*lead, *dims])
        return td

    def _rows_of(self, td: Any, keys: Sequence[NestedKey]) -> dict[NestedKey, np.ndarray]:
        return {k: v.reshape(self.size, *v.shape[len(self.batch):]) for k, v in leaves(td, keys).items()}

    def reset(self, rows: Sequence[int], seeds: Sequence[int | None]) -> None:
        for e, env in enumerate(self.envs):
            a = e * self.size
            if not (mine := [r - a for r in rows if a <= r < a + self.size]):
                continue
            seed = seeds[list(rows).index(mine[0] + a)]
            try:
                if seed is not None:
                    env.set_seed(seed)
                if len(mine) == self.size:
                    td = env.reset()
                else:  # TorchRL's partial reset: the rows' done flags raised
                    mask = torch.zeros(self.size, dtype=torch.bool)
                    mask[mine] = True
                    flags = TensorDict({}, batch_size=self.batch)
                    for k, spec in env.full_done_spec.items(True, True):
                        shaped = mask.reshape(*self.batch, *[1] * (len(spec.shape) - len(self.batch)))
                        flags.set(k, shaped.expand(spec.shape).clone())
                    td = env.maybe_reset(flags)
            except BaseException as exc:
                raise EnvFailure(a + mine[0], "reset", "env", exc) from exc
            values = self._rows_of(td, list(self.keys.root))
            if self.validate:
                _checked(a + mine[0], values, self.keys.root, rows=self.size)
            for k, v in values.items():
                self.slots.root[k][a:a + self.size][mine] = v[mine]
            self.slots.reset[[a + m for m in mine]] = True

    def step(self, rows: np.ndarray | None) -> None:
        s = self.slots
        stepped = np.arange(self.rows) if rows is None else rows
        for e, env in enumerate(self.envs):
            a, b = e * self.size, (e + 1) * self.size
            if not np.any((stepped >= a) & (stepped < b)):
                continue
            try:
                out, root = env.step_and_maybe_reset(self._td({k: v[a:b] for k, v in s.inputs.items()}))
                nxt = self._rows_of(out.get("next"), list(self.keys.next))
                if self.validate and (problem := check_entries(nxt, self.keys.observation, rows=self.size)):
                    bad = next((i for i in range(self.size) if check_entries(
                        {k: v[i] for k, v in nxt.items()}, self.keys.observation) is not None), 0)
                    raise EnvFailure(a + bad, "check", "env", Explained(problem))
            except BaseException as exc:  # the rows before this env's completed
                failure = exc if isinstance(exc, EnvFailure) else EnvFailure(a, "step", "env", exc)
                failure.completed, failure.lost = stepped[stepped < a], stepped[stepped >= a]
                raise failure from failure.cause
            for k, v in nxt.items():
                s.next[k][a:b] = v
            per_env = (self.size, -1)
            s.reward[a:b] = sum(nxt[k].reshape(per_env).sum(1) for k in self.keys.reward) if self.keys.reward else 0
            term = np.any([nxt[k].reshape(per_env).any(1) for k in self._terminated], axis=0)  # False without keys
            trunc = np.any([nxt[k].reshape(per_env).any(1) for k in self._truncated], axis=0)
            if self._root_done:
                term = term | (nxt["done"].reshape(per_env).any(1) & ~(term | trunc))
            s.terminated[a:b], s.truncated[a:b] = term, trunc
            done = term | trunc
            s.reset[a:b] = done
            if done.any():
                for k, v in self._rows_of(root, list(self.keys.root)).items():
                    s.root[k][a:b][done] = v[done]


class EnvpoolUnit(GymUnit):
    """An envpool env (``envpool.make_gymnasium(...)``): its ``rows`` envs in one call, described as a
    :class:`GymUnit` describes one env. The envs a step ended are reset by id at once, so envpool's own
    autoreset step never happens. Its seed is envpool's, given at ``make``."""

    partial = False

    def __init__(self, env: Any, *, validate: bool = True, max_episode_steps: int | None = None) -> None:
        super().__init__([env], validate=validate, max_episode_steps=max_episode_steps)
        self.rows = int(env.spec.config.num_envs)
        self.count = np.zeros(self.rows, dtype=np.int64)

    def reset(self, rows: Sequence[int], seeds: Sequence[int | None]) -> None:
        ids = np.asarray(rows, dtype=np.int32)
        try:
            obs, info = self.envs[0].reset(ids)
        except BaseException as exc:
            raise EnvFailure(int(ids[0]), "reset", "env", exc) from exc
        got = np.asarray(info["env_id"]) if isinstance(info, Mapping) and "env_id" in info else np.sort(ids)
        self.slots.root["observation"][got] = obs
        self.count[got] = 0
        self.slots.reset[got] = True

    def step(self, rows: np.ndarray | None) -> None:
        s = self.slots
        actions = np.asarray(self._actions(s.inputs["action"], range(self.rows)))
        try:
            obs, reward, terminated, truncated, _ = self.envs[0].step(actions)
        except BaseException as exc:
            raise EnvFailure(0, "step", "env", exc) from exc
        if self.validate:
            _checked(0, {"observation": obs}, self._checked, rows=self.rows)
        s.next["observation"][...] = obs
        self.count += 1
        s.reward[...] = reward
        s.terminated[...] = terminated
        s.truncated[...] = truncated if self.cap is None else truncated | (self.count >= self.cap)
        done = s.terminated | s.truncated
        s.reset[...] = False
        if done.any():
            self.reset(list(np.flatnonzero(done)), [])


# -- factories ------------------------------------------------------------------------------------------
class GymMaker:
    """A picklable factory ``gym.make(env_id, **kwargs)`` (a lambda would not cross to ``ddp_spawn`` ranks or
    worker processes)."""

    def __init__(self, env_id: str, **kwargs: Any) -> None:
        self.env_id, self.kwargs = env_id, kwargs

    def __call__(self) -> gym.Env:
        return gym.make(self.env_id, **self.kwargs)

    def __repr__(self) -> str:
        args = "".join(f", {k}={v!r}" for k, v in self.kwargs.items())
        return f"GymMaker({self.env_id!r}{args})"


def resolve_env_factory(env: str | EnvFactory) -> EnvFactory:
    """A factory from a gymnasium id or a factory; ``ValueError`` if ``env`` is neither a registered id nor callable."""
    if isinstance(env, str):
        if env not in gym.registry:
            close = [k for k in gym.registry if k.lower().startswith(env.lower().split("-")[0])][:5]
            hint = f" (did you mean one of {close}?)" if close else ""
            raise ValueError(f"unknown gymnasium env id {env!r}{hint}; pass a registered id or a factory callable")
        return GymMaker(env)
    if not callable(env):
        raise ValueError(f"env must be a gymnasium id or a callable returning an env, got {type(env).__name__}")
    return env


def env_factories(env: str | EnvFactory | Sequence[str | EnvFactory], num_envs: int | None) -> list[EnvFactory]:
    """A factory per env: each of a list, or ``env`` ``num_envs`` times (default 1); see :func:`resolve_env_factory`."""
    if isinstance(env, (list, tuple)):
        if not env:
            raise ValueError("the list of env factories is empty; pass at least one")
        if num_envs is not None and num_envs != len(env):
            raise ValueError(f"num_envs={num_envs} but {len(env)} env factories were given; drop num_envs")
        return [resolve_env_factory(e) for e in env]
    n = 1 if num_envs is None else num_envs
    check_int("num_envs", n, 1)
    return [resolve_env_factory(env)] * n


def close_quietly(envs: Sequence[Any]) -> None:
    """Close envs being refused or shut down; an error while closing is dropped (the caller's error matters)."""
    for env in envs:
        with contextlib.suppress(Exception):  # the error being raised is the one the caller needs
            if not getattr(env, "is_closed", False):
                env.close()


def make_unit(envs: Sequence[Any], *, max_episode_steps: int | None = None, validate: bool = True,
              info_keys: InfoKeys | None = None) -> Unit:
    """The unit stepping ``envs`` (instances of one kind): gymnasium envs, TorchRL envs (a gymnasium vector env
    through TorchRL's ``GymWrapper``), or one envpool env; the envs are closed when refused (``ValueError``: an env of
    another kind, or whose spaces or specs cannot be stored in columns). A TorchRL env reads its own ``info``
    (``set_info_dict_reader``): ``info_keys`` then name entries of its observation spec."""
    envs = list(envs)
    try:
        if any(cls.__module__.startswith("envpool") for cls in type(envs[0]).__mro__):
            if len(envs) != 1:
                raise ValueError("an envpool env is stepped alone: pass one envpool env (its num_envs is the batch)")
            return EnvpoolUnit(envs[0], validate=validate, max_episode_steps=max_episode_steps)
        if all(isinstance(e, gym.vector.VectorEnv) for e in envs):
            try:
                envs = [GymWrapper(e) for e in envs]
            except Exception as exc:
                raise ValueError(f"got a gymnasium vector env ({type(envs[0]).__name__}) that cannot be taken apart "
                                 f"into its single envs, and that TorchRL's GymWrapper does not take "
                                 f"({type(exc).__name__}: {exc}); pass a factory of one env and num_envs") from exc
        if all(isinstance(e, EnvBase) for e in envs):
            unit = TorchRLUnit(envs, max_episode_steps=max_episode_steps, validate=validate)
            named = info_key_list(info_keys)
            missing = [k for k in named if k not in unit.keys.observation]
            if missing or isinstance(info_keys, Mapping):
                raise ValueError(f"info_keys {missing or named} for a TorchRL env: a TorchRL env reads its info "
                                 "itself, with env.set_info_dict_reader(default_info_dict_reader(keys, spec=...)); "
                                 "then name those observation entries in a list")
            return unit
        if all(isinstance(e, gym.Env) for e in envs):
            return GymUnit(envs, validate=validate, info_keys=info_keys, max_episode_steps=max_episode_steps)
        kinds = sorted({type(e).__name__ for e in envs})
        raise ValueError(f"the env factory returned {', '.join(kinds)}; expected a gymnasium.Env or a torchrl EnvBase "
                         "(all envs of a loop of one kind)")
    except BaseException:
        close_quietly(envs)
        raise
