"""One step API over ``gymnasium.Env`` and torchrl ``EnvBase``, described by TorchRL specs.

Env threads talk to an :class:`EnvAdapter`. It hides which library the env
comes from and describes the env by the leaves of its TorchRL specs
(:class:`~lightning_rollout.specs.EnvKeys`), so the loop preallocates one
column per leaf, nested keys included.

* :class:`GymAdapter` wraps a ``gymnasium.Env``. Its specs are TorchRL's own
  conversion of each leaf space (``Box``, ``Discrete``, ``MultiBinary``,
  ``MultiDiscrete``), in ``Dict`` spaces nested to any depth and ``Tuple``
  spaces as keys ``"0"``, ``"1"``... under their parent (TorchRL's
  ``GymWrapper`` stacks a ``Tuple`` of like spaces into one entry and cannot
  convert a mixed one); a non-``Dict`` observation (a ``Tuple`` too) is stored
  under ``"observation"``. Observation entries named after a root key of
  TorchRL's or of the loop (``action``, ``reward``, ``done``, ``is_init``...,
  :data:`~lightning_rollout.specs.TORCHRL_ROOT_KEYS` and
  :data:`~lightning_rollout.specs.LOOP_ROOT_KEYS`) are refused with a
  ``ValueError`` naming the entry. It adds what TorchRL's ``InitTracker``,
  ``StepCounter`` and ``RewardSum`` transforms would add: ``is_init``,
  ``step_count`` and ``episode_reward``. Discrete actions are accepted as an
  index or one-hot, as the policy gives them, and are checked against the
  action space (:class:`ActionError` names what is wrong). ``info_keys`` adds
  entries of the env's ``info`` dict as observation entries (see :class:`GymAdapter`).
* :class:`TorchRLAdapter` wraps an unbatched torchrl ``EnvBase`` (transforms
  included): its keys are the leaves of its ``full_*_spec`` (none named after
  the loop's own :data:`~lightning_rollout.specs.LOOP_ROOT_KEYS`); a step is
  ``env.step`` on a tensordict holding the root entries handed to it.

Random actions (``random_action``, and the default random policy) are drawn as
gymnasium's ``Box.sample`` draws them, finite in dims with an infinite bound
(:func:`~lightning_rollout.specs.random_sample`).

Adapters are not thread-safe: each is owned by exactly one env thread after
construction. Construction happens in the caller's thread, so a bad env id or
unsupported space fails at the boundary with a ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Composite, TensorSpec, Unbounded
from torchrl.envs import EnvBase

from .specs import (LOOP_ROOT_KEYS, TORCHRL_ROOT_KEYS, ArraySpec, EnvKeys, NestedKey, columns_of, key_parts, leaves,
                    random_sample, reserved_key_problem)

__all__ = ["ActionError", "ArraySpec", "BatchedTorchRLEnv", "EnvAdapter", "EnvFactory", "EnvpoolEnv", "GymAdapter",
           "GymMaker", "InfoKeys", "TorchRLAdapter", "make_adapter", "resolve_env_factory"]

EnvFactory = Callable[[], "gym.Env | EnvBase"]
#: Entries of a gymnasium env's ``info`` read into batches (``info_keys=``): a list of keys (their specs
#: inferred from the first reset's ``info``) or ``{key: TorchRL spec}``. A tuple key reads nested dicts.
InfoKeys = Sequence[NestedKey] | Mapping[NestedKey, TensorSpec]

_FLAG = ArraySpec((1,), np.dtype(bool))
_RETURN = ArraySpec((1,), np.dtype(np.float32))
#: Root names a gymnasium env's observation (or info) entries may not have: TorchRL's and the loop's own.
_GYM_RESERVED = {**TORCHRL_ROOT_KEYS, **LOOP_ROOT_KEYS}
_SUPPORTED = (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiBinary, gym.spaces.MultiDiscrete)


class ActionError(ValueError):
    """The policy's action is not a valid action of the env (wrong shape, out of bounds, NaN...)."""


class EnvAdapter(Protocol):
    """The step API env threads use.

    Attributes:
        keys: every leaf the env reads and writes (see :class:`~lightning_rollout.specs.EnvKeys`).
        observation_spec: the TorchRL composite of the root entries (for wrapping a policy).
        action_spec: the TorchRL composite of the actions (for random actions).
    """

    keys: EnvKeys
    observation_spec: Composite
    action_spec: Composite
    loop_keys: bool  # the loop writes is_init/step_count/episode_reward/reward/done flags itself
    rows: int  # 1 (a natively batched env, ``batched``, has its batch's)
    batched: bool  # a natively batched env (BatchedTorchRLEnv, EnvpoolEnv), stepped as one block

    def reset(self, seed: int | None = None) -> dict[NestedKey, Any]:
        """Start a new episode; returns every ``keys.root`` entry. ``seed`` only on reseeding resets."""
        ...

    def step(self, root: Mapping[NestedKey, np.ndarray]) -> tuple[dict[NestedKey, Any], float, bool, bool]:
        """Apply the action(s) in ``root`` (one env's row: root entries and policy outputs).

        Returns:
            ``(next, reward, terminated, truncated)``: ``next`` holds every
            ``keys.next`` entry (with ``loop_keys``, only the observations);
            ``reward`` is the sum over the reward leaves (for episode
            statistics); the flags say whether the episode ended.
        """
        ...

    def random_action(self, columns: Mapping[NestedKey, ArraySpec]) -> dict[NestedKey, np.ndarray]:
        """A random valid action, one array per action key, in the layout of ``columns`` (uniform where
        the action space is bounded; finite, as gymnasium's ``Box.sample``, where it is not)."""
        ...

    def close(self) -> None:
        """Release the env (called once, by the env's thread, when the loop closes)."""
        ...


# -- gymnasium --------------------------------------------------------------------------------------
def _space_leaves(space: gym.Space, prefix: tuple[str, ...], out: dict[NestedKey, gym.Space]) -> None:
    if isinstance(space, gym.spaces.Dict):
        for k, s in space.spaces.items():
            _space_leaves(s, (*prefix, str(k)), out)
    elif isinstance(space, gym.spaces.Tuple):
        for i, s in enumerate(space.spaces):
            _space_leaves(s, (*prefix, str(i)), out)
    elif isinstance(space, _SUPPORTED):
        out[prefix[0] if len(prefix) == 1 else prefix] = space
    else:
        raise ValueError(f"unsupported space {space!r} at {prefix!r}: use Box, Discrete, MultiBinary, "
                         "MultiDiscrete, or Dict / Tuple of those (wrap the env with a gymnasium wrapper otherwise)")


def _gym_spec(space: gym.Space, *, categorical: bool) -> Any:
    from torchrl.envs.libs.gym import _gym_to_torchrl_spec_transform

    return _gym_to_torchrl_spec_transform(space, categorical_action_encoding=categorical)


_MISSING = object()


def info_key_list(info_keys: InfoKeys | None) -> list[NestedKey]:
    """The keys of ``info_keys`` (a list of keys or a ``{key: spec}`` dict), nested keys as tuples.

    Raises:
        ValueError: ``info_keys`` is a single string, or a key is neither a string nor a tuple of strings.
    """
    if info_keys is None:
        return []
    if isinstance(info_keys, str):
        raise ValueError(f"info_keys must be a list of keys or a dict {{key: TorchRL spec}}, got the string "
                         f"{info_keys!r}; write info_keys=[{info_keys!r}]")
    keys: list[NestedKey] = []
    for k in info_keys:
        if isinstance(k, tuple) and len(k) == 1:
            k = k[0]
        if not (isinstance(k, str) or (isinstance(k, tuple) and k and all(isinstance(p, str) for p in k))):
            raise ValueError(f"info key {k!r} must be a string or a tuple of strings (a nested key)")
        keys.append(k)
    return keys


def _info_value(info: Mapping[str, Any], key: NestedKey) -> Any:
    """``info[key]`` (``info[a][b]`` for a nested key ``(a, b)``), or ``_MISSING``."""
    value: Any = info
    for part in key_parts(key):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _infer_info_spec(key: NestedKey, value: Any) -> TensorSpec:
    """An ``Unbounded`` spec of ``value``'s shape and dtype, as TorchRL's ``default_info_dict_reader`` infers
    it (a Python float is float32, an int int64, a bool bool, a numpy value keeps its dtype)."""
    try:
        tensor = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"info entry {key!r} of the first reset is {value!r}, not a number or a numeric array; "
                         "pass info_keys={key: spec} for entries that are not numeric at reset") from exc
    return Unbounded(tuple(tensor.shape), dtype=tensor.dtype)


def _leaf_values(value: Any, path: tuple[str, ...], out: dict[NestedKey, Any], keys: set[tuple[str, ...]]) -> None:
    if path in keys:
        out[path[0] if len(path) == 1 else path] = value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _leaf_values(v, (*path, str(k)), out, keys)
    else:
        for i, v in enumerate(value):
            _leaf_values(v, (*path, str(i)), out, keys)


class GymAdapter:
    """:class:`EnvAdapter` over a ``gymnasium.Env``.

    The loop fills ``is_init``, ``step_count``, ``episode_reward``, the reward
    and the done flags itself (``loop_keys``), one vectorised write per block of
    envs, and ends episodes at its ``max_episode_steps``: :meth:`step` returns the
    observation entries only.

    ``info_keys`` reads entries of the ``info`` dict that ``reset`` and ``step`` return
    into observation entries: at the root (from ``reset``, or the step before) and
    under ``"next"`` (from ``step``), one column each, like the other observation
    entries. Their specs are given (``{key: TorchRL spec}``; values are cast to the
    spec's dtype) or, for a list of keys, inferred from the info of one reset done
    here (an ``Unbounded`` spec of the value's shape and dtype, as TorchRL's
    ``default_info_dict_reader`` infers it). An entry missing from a later ``info``
    is stored as zeros, as TorchRL's reader fills it.

    Args:
        env: the env; its spaces are read once here.
        validate: check every action against the action space (a few microseconds a step).
        info_keys: entries of ``info`` to add: a list of keys (specs inferred) or a
            dict ``{key: TorchRL spec}`` (unbatched specs); a tuple key reads nested dicts.

    Raises:
        ValueError: the observation or action space is not supported; an observation
            entry or info key is named after a root key of TorchRL's or of the loop
            (``action``, ``reward``, ``done``, ``terminated``, ``truncated``, ``next``,
            ``is_init``, ``step_count``, ``episode_reward``, ``collector``,
            ``policy_version``, ``_loop``); an info key clashes with an observation
            entry, is missing from the first reset's ``info`` without a spec, or is
            not numeric there.
    """

    loop_keys = True
    rows = 1
    batched = False

    def __init__(self, env: gym.Env, *, validate: bool = True, info_keys: InfoKeys | None = None) -> None:
        self.env = env
        self.validate = validate
        obs_space = env.observation_space
        spaces: dict[NestedKey, gym.Space] = {}
        self._dict_obs = isinstance(obs_space, (gym.spaces.Dict, gym.spaces.Tuple))
        self._obs_root: tuple[str, ...] = () if isinstance(obs_space, gym.spaces.Dict) else ("observation",)
        _space_leaves(obs_space, self._obs_root, spaces)
        if not spaces:
            raise ValueError(f"the observation space {obs_space!r} has no entries")
        problem = reserved_key_problem(spaces, _GYM_RESERVED, where="observation space",
                                       fix="rename it in the env (e.g. with a gymnasium ObservationWrapper)")
        if problem is not None:
            raise ValueError(problem)
        self._obs_paths = {key_parts(k) for k in spaces}
        self.observation_spec = Composite({k: _gym_spec(s, categorical=True) for k, s in spaces.items()})
        self.observation_spec["is_init"] = Unbounded((1,), dtype=torch.bool)
        self.observation_spec["step_count"] = Unbounded((1,), dtype=torch.int64)
        self.observation_spec["episode_reward"] = Unbounded((1,), dtype=torch.float32)
        self._info = self._info_columns(env, info_keys)
        for k, (spec, _) in self._info.items():
            self.observation_spec[k] = spec
        action_space = env.action_space
        if not isinstance(action_space, _SUPPORTED):
            raise ValueError(f"unsupported action space {action_space!r}: use Box, Discrete, MultiBinary or "
                             "MultiDiscrete")
        self.action_space = action_space
        self.action_spec = Composite(action=_gym_spec(action_space, categorical=False))
        observation = columns_of(self.observation_spec, where="observation space")
        self.keys = EnvKeys(
            observation=observation, state={}, reward={"reward": _RETURN},
            done={"done": _FLAG, "terminated": _FLAG, "truncated": _FLAG},
            action=columns_of(self.action_spec, where="action space"))
        self._discrete_n = int(action_space.n) if isinstance(action_space, gym.spaces.Discrete) else 0
        self._start = int(getattr(action_space, "start", 0)) if self._discrete_n else 0
        self._nvec = np.asarray(action_space.nvec) if isinstance(action_space, gym.spaces.MultiDiscrete) else None
        self._box_bounds: tuple[float, float] | None = None  # (low, high) when every dim has the same bounds
        if isinstance(action_space, gym.spaces.Box) and action_space.shape:
            low, high = np.unique(action_space.low), np.unique(action_space.high)
            if low.size == 1 and high.size == 1:
                self._box_bounds = (float(low[0]), float(high[0]))

    def _info_columns(self, env: gym.Env, info_keys: InfoKeys | None) -> dict[NestedKey, tuple[TensorSpec, Any]]:
        """``{key: (spec, numpy dtype)}`` of the info entries (one reset of ``env`` when a spec is inferred)."""
        keys = info_key_list(info_keys)
        if not keys:
            return {}
        given = dict(zip(keys, info_keys.values())) if isinstance(info_keys, Mapping) else {}
        taken = set(self.observation_spec.keys(True, True))
        first_info: Mapping[str, Any] | None = None
        out: dict[NestedKey, tuple[TensorSpec, Any]] = {}
        for k in keys:
            if k in taken or (isinstance(k, tuple) and k[0] in self.observation_spec.keys()):
                raise ValueError(f"info key {k!r} clashes with an observation entry of the env (or the loop's "
                                 "is_init / step_count / episode_reward)")
            problem = reserved_key_problem([k], _GYM_RESERVED, where="info_keys",
                                           fix="store it in info under another name (e.g. with a gymnasium Wrapper)")
            if problem is not None:
                raise ValueError(problem)
            spec = given.get(k)
            if spec is None:
                if given:
                    raise ValueError(f"info_keys as a dict maps every key to a TorchRL spec; {k!r} has None")
                if first_info is None:
                    _, first_info = env.reset()
                value = _info_value(first_info, k)
                if value is _MISSING:
                    raise ValueError(f"info key {k!r} is not in the info of the env's first reset (it has "
                                     f"{sorted(first_info)}); pass info_keys={{{k!r}: spec}} to give its spec, "
                                     "e.g. Unbounded((), dtype=torch.bool) for an 'is_success' set at the end")
                spec = _infer_info_spec(k, value)
            elif not isinstance(spec, TensorSpec):
                raise ValueError(f"the spec of info key {k!r} must be a TorchRL TensorSpec, got {type(spec).__name__}")
            out[k] = (spec, torch.empty((), dtype=spec.dtype).numpy().dtype)
        return out

    def _obs(self, obs: Any, info: Mapping[str, Any]) -> dict[NestedKey, Any]:
        if not self._dict_obs:
            out: dict[NestedKey, Any] = {"observation": np.asarray(obs)}
        else:
            out = {}
            _leaf_values(obs, self._obs_root, out, self._obs_paths)
            out = {k: np.asarray(v) for k, v in out.items()}
        for k, (spec, dtype) in self._info.items():
            value = _info_value(info, k)
            out[k] = np.zeros(spec.shape, dtype) if value is _MISSING else np.asarray(value, dtype=dtype)
        return out

    def reset(self, seed: int | None = None) -> dict[NestedKey, Any]:
        obs, info = self.env.reset(seed=seed)
        out = self._obs(obs, info)
        out["is_init"] = True
        out["step_count"] = 0
        out["episode_reward"] = 0.0
        return out

    @property
    def plain_observation(self) -> bool:
        """True when the env's observation is one array (``"observation"``) and no info entry is read."""
        return not self._dict_obs and not self._info

    def actions(self, action: np.ndarray) -> list[Any]:
        """Rows of ``action`` (``[n, *action_shape]``) -> what ``env.step`` takes, one per row, converted
        and validated for the rows at once where the space allows it. Raises :class:`ActionError`."""
        if self._discrete_n > 1 and action.ndim == 2 and action.shape[1] == self._discrete_n:  # one-hot rows
            # numpy scalars of the space's dtype, as a gymnasium vector env passes them (Discrete.contains
            # checks a Python int against the dtype's range first, which costs more than the step's physics)
            index = action.argmax(1)
            if self._start:
                index += self._start
            return list(index if index.dtype == self.action_space.dtype else index.astype(self.action_space.dtype))
        if self._box_bounds is not None and action.shape[1:] == self.action_space.shape:
            if self.validate:
                low, high = self._box_bounds
                if not (low <= action.min() and action.max() <= high):  # NaN fails both comparisons
                    return [self._action(row) for row in action]  # raises for the first invalid row
            return list(action.astype(self.action_space.dtype, copy=False))
        return [self._action(row) for row in action]

    def _action(self, action: np.ndarray) -> Any:
        """The policy's action row -> what ``env.step`` takes; raises :class:`ActionError`."""
        space = self.action_space
        if self._discrete_n:
            n = self._discrete_n
            if action.size == n and n > 1:  # one-hot
                index = int(action.argmax())
            elif action.size == 1:  # an index (or, for n == 1, the one-hot [1]: both mean action 0)
                value = action.reshape(-1)[0]
                top = 2 if n == 1 else n
                if self.validate and (not np.isfinite(value) or value != int(value) or not 0 <= value < top):
                    raise ActionError(f"action {value!r} is not an index in [0, {n}) of {space!r}")
                index = 0 if n == 1 else int(value)
            else:
                raise ActionError(f"action of shape {action.shape} for {space!r}: give an index or a one-hot of {n}")
            return index + self._start
        if self._nvec is not None:
            nvec = self._nvec
            if action.shape == nvec.shape:
                indices = action
            elif action.ndim == 1 and nvec.ndim == 1 and action.size == int(nvec.sum()):  # concatenated one-hots
                indices = np.array([a.argmax() for a in np.split(action, np.cumsum(nvec)[:-1])])
            else:
                raise ActionError(f"action of shape {action.shape} for {space!r}: give {nvec.shape} indices or "
                                  f"{int(nvec.sum())} concatenated one-hots")
            if self.validate and (np.any(indices < 0) or np.any(indices >= nvec) or np.any(indices != np.round(indices))):
                raise ActionError(f"action {indices!r} is out of {space!r}")
            return indices.astype(space.dtype)
        if action.shape != space.shape:
            raise ActionError(f"action of shape {action.shape} for {space!r} (expected {space.shape})")
        if self.validate and self._box_bounds is not None:
            # One min and one max per step when the bounds are uniform (NaN fails both comparisons).
            low, high = self._box_bounds
            if not (low <= action.min() and action.max() <= high):
                self._refuse_box(action)
        elif self.validate and isinstance(space, gym.spaces.Box):
            if not (np.all(action >= space.low) and np.all(action <= space.high)):
                self._refuse_box(action)
        return action.astype(space.dtype, copy=False)

    def _refuse_box(self, action: np.ndarray) -> None:
        if action.dtype.kind == "f" and np.isnan(action).any():
            raise ActionError(f"action {action!r} contains NaN")
        raise ActionError(f"action {action!r} is out of the bounds of {self.action_space!r} (clip or squash it)")

    def step(self, root: Mapping[NestedKey, np.ndarray]) -> tuple[dict[NestedKey, Any], float, bool, bool]:
        obs, reward, terminated, truncated, info = self.env.step(self._action(root["action"]))
        return self._obs(obs, info), float(reward), bool(terminated), bool(truncated)

    def random_action(self, columns: Mapping[NestedKey, ArraySpec]) -> dict[NestedKey, np.ndarray]:
        template = columns["action"]
        sample = self.action_space.sample()
        if self._discrete_n and template.shape == (self._discrete_n,):
            one_hot = np.zeros(template.shape, dtype=template.dtype)
            one_hot[int(sample) - self._start] = 1
            return {"action": one_hot}
        if self._nvec is not None and template.shape != self._nvec.shape:
            one_hots = [np.eye(int(n), dtype=template.dtype)[int(s)] for n, s in zip(self._nvec, sample)]
            return {"action": np.concatenate(one_hots)}
        value = np.asarray(sample)
        if self._discrete_n:
            value = value - self._start
        return {"action": value.astype(template.dtype, copy=False).reshape(template.shape)}

    def close(self) -> None:
        self.env.close()


class EnvpoolEnv(GymAdapter):
    """An envpool env (``envpool.make_gymnasium(...)``): its ``rows`` envs stepped in one call, as one block
    (:class:`~lightning_rollout.loop.native.NativeBlock`), described as a :class:`GymAdapter` describes one env
    (envpool's spaces are one env's). The loop resets the envs a step ended itself (``env.reset(env_id)``), so
    envpool's own autoreset step never happens and never counts as a frame. Its seed is envpool's, given at
    ``make``; a seed given to the loop does not reseed it.

    Not thread-safe: owned by one env thread.

    Raises:
        ValueError: a space :class:`GymAdapter` does not support.
    """

    batched = True

    def __init__(self, env: Any, *, validate: bool = True) -> None:
        super().__init__(env, validate=validate)
        self.rows = int(env.spec.config.num_envs)

    def _roots(self, obs: np.ndarray) -> dict[NestedKey, np.ndarray]:
        n = len(obs)
        return {"observation": obs, "is_init": np.ones((n, 1), bool), "step_count": np.zeros((n, 1), np.int64),
                "episode_reward": np.zeros((n, 1), np.float32)}

    def reset_all(self, seed: int | None = None) -> dict[NestedKey, np.ndarray]:
        """Reset every env; their root entries, ``[rows, ...]``."""
        return self._roots(self.env.reset()[0])

    def reset_some(self, envs: Sequence[int], seed: int | None = None) -> dict[NestedKey, np.ndarray]:
        """Reset envs ``envs`` only; their root entries, row ``i`` for env ``envs[i]``."""
        obs, info = self.env.reset(np.asarray(envs, dtype=np.int32))
        order = np.argsort(np.argsort(np.asarray(envs)))  # envpool answers in env-id order
        ids = info.get("env_id") if isinstance(info, Mapping) else None
        if ids is not None:
            order = np.searchsorted(np.asarray(ids), np.asarray(envs))
        return self._roots(obs[order])

    def step_all(self, root: Mapping[NestedKey, np.ndarray]
                 ) -> tuple[dict[NestedKey, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
        """Step every env with the actions of ``root`` (``[rows, ...]``); as :meth:`BatchedTorchRLEnv.step_all`."""
        actions = np.asarray(self.actions(root["action"]))
        obs, reward, terminated, truncated, _ = self.env.step(actions)
        return {"observation": obs}, reward.astype(np.float64), terminated, truncated


def _is_envpool(env: Any) -> bool:
    return any(cls.__module__.startswith("envpool") for cls in type(env).__mro__)


# -- torchrl --------------------------------------------------------------------------------------
class _TorchRLEnv:
    """What both TorchRL adapters share: one env's keys, from one row of the env's specs, and the done
    flags that end an episode."""

    loop_keys = False

    def _describe(self, env: EnvBase, max_episode_steps: int | None) -> EnvBase:
        """Set ``keys``, the specs and the done key lists from ``env`` (with TorchRL's ``StepCounter`` for
        ``max_episode_steps``, as torchrl's collectors do for ``max_frames_per_traj``); returns the env.

        Raises:
            ValueError: a spec that cannot be stored in columns, an entry named after the loop's own, or a
                ``step_count`` entry that the cap would clash with.
        """
        if max_episode_steps is not None:
            from torchrl.envs import StepCounter

            if any("step_count" in key_parts(k) for k in env.output_spec.keys(True, True)):
                raise ValueError("A 'step_count' key is already present in the environment and the "
                                 "'max_frames_per_traj' argument may conflict with a 'StepCounter' that has already "
                                 "been set. Possible solutions: Set max_frames_per_traj to 0 or remove the "
                                 "StepCounter limit from the environment transforms.")  # TorchRL's check and message
            env = env.append_transform(StepCounter(max_episode_steps))
        row = (0,) * len(env.batch_size)  # one env's specs: the first row of a batched env's
        self.keys = EnvKeys.from_specs(observation=env.full_observation_spec[row], state=env.full_state_spec[row],
                                       reward=env.full_reward_spec[row], done=env.full_done_spec[row],
                                       action=env.full_action_spec[row], where="env's")
        problem = reserved_key_problem([*self.keys.root, *self.keys.next, *self.keys.action], LOOP_ROOT_KEYS,
                                       where="env's specs", fix="rename it with TorchRL's RenameTransform")
        if problem is not None:
            raise ValueError(problem)
        self.observation_spec = env.full_observation_spec[row]
        self.action_spec = env.full_action_spec[row]
        self._root_keys = list(self.keys.root)
        self._next_keys = list(self.keys.next)
        self._reward_keys = list(self.keys.reward)
        self._root_done = "done" in self.keys.done
        term = [k for k in self.keys.done if key_parts(k)[-1] == "terminated"]
        trunc = [k for k in self.keys.done if key_parts(k)[-1] == "truncated"]
        done = [k for k in self.keys.done if key_parts(k)[-1] == "done"]
        self._terminated_keys = term or done
        self._truncated_keys = trunc
        return env

    def random_action(self, columns: Mapping[NestedKey, ArraySpec]) -> dict[NestedKey, np.ndarray]:
        """A random valid action of one env (the specs' first row)."""
        sample = random_sample(self.action_spec)
        return {k: sample.get(k).numpy().astype(c.dtype, copy=False).reshape(c.shape) for k, c in columns.items()}

    def close(self) -> None:
        if not self.env.is_closed:
            self.env.close()


class TorchRLAdapter(_TorchRLEnv):
    """:class:`EnvAdapter` over an unbatched torchrl ``EnvBase`` (transforms included).

    Args:
        env: an env with ``batch_size == ()``; parallelism is the loop's job.
        max_episode_steps: appends TorchRL's ``StepCounter(max_episode_steps)``, as
            torchrl's collectors do for ``max_frames_per_traj``.

    Raises:
        ValueError: a batched env, a spec that cannot be stored in columns, or an entry
            named after the loop's ``collector``, ``policy_version`` or ``_loop``.
    """

    rows = 1
    batched = False

    def __init__(self, env: EnvBase, *, max_episode_steps: int | None = None) -> None:
        if tuple(env.batch_size) != ():
            raise ValueError(f"TorchRLAdapter steps one env, got batch_size={tuple(env.batch_size)} (a batched env "
                             "is a BatchedTorchRLEnv)")
        self.env = self._describe(env, max_episode_steps)

    def reset(self, seed: int | None = None) -> dict[NestedKey, Any]:
        if seed is not None:
            self.env.set_seed(seed)
        return leaves(self.env.reset(), self._root_keys)

    def step(self, root: Mapping[NestedKey, np.ndarray]) -> tuple[dict[NestedKey, Any], float, bool, bool]:
        td = TensorDict({k: torch.from_numpy(np.array(v)) for k, v in root.items()}, batch_size=[])
        for prefix, dims in self.keys.sub_batch.items():
            sub = td.get(prefix, None)
            if sub is not None:
                sub.batch_size = torch.Size(dims)
        td = self.env.step(td)
        nxt = td.get("next")
        out = leaves(nxt, self._next_keys)
        reward = float(sum(float(out[k].sum()) for k in self._reward_keys if k in out))
        terminated = any(bool(out[k].any()) for k in self._terminated_keys if k in out)
        truncated = any(bool(out[k].any()) for k in self._truncated_keys if k in out)
        if self._root_done and not (terminated or truncated) and bool(out["done"].any()):
            terminated = True
        return out, reward, terminated, truncated


class BatchedTorchRLEnv(_TorchRLEnv):
    """A natively batched torchrl ``EnvBase`` (``batch_size`` ``[B]`` or more dims: VMAS, envpool's
    ``MultiThreadedEnv``, a ``SerialEnv`` made by a factory, any simulator that steps many envs in one call): its
    ``rows`` envs, row-major over the batch dims, stepped in one call. The loop steps it as one block
    (:class:`~lightning_rollout.loop.native.NativeBlock`); its keys and specs are one env's (the first row).

    Not thread-safe: owned by one env thread.

    Args:
        env: the batched env.
        max_episode_steps: appends TorchRL's ``StepCounter(max_episode_steps)`` (one count per env).

    Raises:
        ValueError: a spec that cannot be stored in columns, or an entry named after the loop's own.
    """

    batched = True

    def __init__(self, env: EnvBase, *, max_episode_steps: int | None = None) -> None:
        self.env = self._describe(env, max_episode_steps)
        self.batch_size = torch.Size(env.batch_size)
        self.rows = int(self.batch_size.numel())

    def _rows_of(self, td: TensorDictBase, keys: Sequence[NestedKey]) -> dict[NestedKey, np.ndarray]:
        """``keys`` of ``td`` (batch ``batch_size``) as ``[rows, *shape]`` arrays."""
        return {k: v.reshape(self.rows, *v.shape[len(self.batch_size):]) for k, v in leaves(td, keys).items()}

    def reset_all(self, seed: int | None = None) -> dict[NestedKey, np.ndarray]:
        """Reset every env (``seed``: the batch's seed, as ``env.set_seed``); their root entries, ``[rows, ...]``."""
        if seed is not None:
            self.env.set_seed(seed)
        return self._rows_of(self.env.reset(), self._root_keys)

    def reset_some(self, envs: Sequence[int], seed: int | None = None) -> dict[NestedKey, np.ndarray]:
        """Reset envs ``envs`` only (TorchRL's partial reset: their done flags raised, ``env.maybe_reset``), the
        batch reseeded with ``seed`` first when given; their root entries, row ``i`` for env ``envs[i]``."""
        if seed is not None:
            self.env.set_seed(seed)
        mask = torch.zeros(self.rows, dtype=torch.bool)
        mask[list(envs)] = True
        mask = mask.reshape(self.batch_size)
        flags = TensorDict({}, batch_size=self.batch_size)
        for k, spec in self.env.full_done_spec.items(True, True):
            flags.set(k, mask.reshape(*self.batch_size, *[1] * (len(spec.shape) - len(self.batch_size)))
                      .expand(spec.shape).clone())
        roots = self._rows_of(self.env.maybe_reset(flags), self._root_keys)
        return {k: v[list(envs)] for k, v in roots.items()}

    def step_all(self, root: Mapping[NestedKey, np.ndarray]
                 ) -> tuple[dict[NestedKey, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
        """Step every env with ``root`` (``[rows, ...]`` arrays: root entries and actions). Returns their
        ``"next"`` entries (``[rows, ...]``), rewards (``[rows]`` float64, summed over reward leaves), terminated
        and truncated (``[rows]`` bool)."""
        lead = tuple(self.batch_size)
        td = TensorDict({k: torch.from_numpy(np.asarray(v)).reshape(*lead, *v.shape[1:]) for k, v in root.items()},
                        batch_size=self.batch_size)
        for prefix, dims in self.keys.sub_batch.items():
            sub = td.get(prefix, None)
            if sub is not None:
                sub.batch_size = torch.Size([*lead, *dims])
        out = self._rows_of(self.env.step(td).get("next"), self._next_keys)
        per_env = (self.rows, -1)
        reward = np.zeros(self.rows)
        for k in self._reward_keys:
            reward += out[k].reshape(per_env).sum(1)
        terminated = np.zeros(self.rows, dtype=bool)
        for k in self._terminated_keys:
            terminated |= out[k].reshape(per_env).any(1)
        truncated = np.zeros(self.rows, dtype=bool)
        for k in self._truncated_keys:
            truncated |= out[k].reshape(per_env).any(1)
        if self._root_done:
            terminated |= out["done"].reshape(per_env).any(1) & ~(terminated | truncated)
        return out, reward, terminated, truncated


# -- factories ------------------------------------------------------------------------------------------
class GymMaker:
    """A picklable factory ``gym.make(env_id, **kwargs)`` (a lambda would not cross to
    ``ddp_spawn`` ranks or worker processes).

    Args:
        env_id: a registered gymnasium id.
        **kwargs: passed to ``gymnasium.make``.
    """

    def __init__(self, env_id: str, **kwargs: Any) -> None:
        self.env_id = env_id
        self.kwargs = kwargs

    def __call__(self) -> gym.Env:
        return gym.make(self.env_id, **self.kwargs)

    def __repr__(self) -> str:
        args = "".join(f", {k}={v!r}" for k, v in self.kwargs.items())
        return f"GymMaker({self.env_id!r}{args})"


def resolve_env_factory(env: str | EnvFactory, **make_kwargs: Any) -> EnvFactory:
    """Turn a gymnasium id or a factory into a factory.

    Raises:
        ValueError: ``env`` is neither a registered gymnasium id nor callable.
    """
    if isinstance(env, str):
        if env not in gym.registry:
            close = [k for k in gym.registry if k.lower().startswith(env.lower().split("-")[0])][:5]
            hint = f" (did you mean one of {close}?)" if close else ""
            raise ValueError(f"unknown gymnasium env id {env!r}{hint}; pass a registered id or a factory callable")
        return GymMaker(env, **make_kwargs)
    if not callable(env):
        raise ValueError(f"env must be a gymnasium id or a callable returning an env, got {type(env).__name__}")
    return env


def close_env_quietly(env: EnvBase) -> None:
    """Close a TorchRL env that is being refused (ending the processes of a batched one), unless it is
    closed already; an error while closing is dropped, so the refusal's own error is the one raised."""
    try:
        if not env.is_closed:
            env.close()
    except Exception:  # noqa: S110 - the refusal is the error the caller needs
        pass


def make_adapter(env: Any, *, max_episode_steps: int | None = None, validate: bool = True,
                 info_keys: InfoKeys | None = None) -> EnvAdapter | BatchedTorchRLEnv | EnvpoolEnv:
    """Wrap an env instance in the matching adapter (``max_episode_steps`` goes to a TorchRL env as a
    ``StepCounter``; the loop applies it to gymnasium envs): a :class:`GymAdapter`, a :class:`TorchRLAdapter`,
    or, for a batched env (a TorchRL env with a batch size, a gymnasium vector env wrapped in TorchRL's
    ``GymWrapper``, which handles its autoreset), a :class:`BatchedTorchRLEnv`; an envpool env is an
    :class:`EnvpoolEnv` (TorchRL 0.14's envpool wrappers do not take envpool 1.2's gymnasium spaces).

    ``info_keys`` go to a :class:`GymAdapter`. A TorchRL env reads its ``info`` with its own
    ``set_info_dict_reader``; its ``info_keys`` must then be a list of entries of its observation
    spec (they are only named, for :class:`~lightning_rollout.events.EpisodeEnd` ``.info``).
    A TorchRL env that is refused (batched, or with specs no column fits) is closed first.

    Raises:
        ValueError: ``env`` is neither a ``gymnasium.Env``, a gymnasium vector env nor a torchrl ``EnvBase``;
            ``info_keys`` that a TorchRL env does not have.
    """
    if _is_envpool(env):
        return EnvpoolEnv(env, validate=validate)
    if isinstance(env, gym.vector.VectorEnv):  # a vector env as TorchRL steps it (its autoreset handled there)
        from torchrl.envs.libs.gym import GymWrapper

        try:
            env = GymWrapper(env)
        except Exception as exc:
            env.close()
            raise ValueError(f"got a gymnasium vector env ({type(env).__name__}) that cannot be taken apart into its "
                             f"single envs, and that TorchRL's GymWrapper does not take ({type(exc).__name__}: {exc}); "
                             "pass a factory of one env and num_envs") from exc
    if isinstance(env, EnvBase):
        try:
            adapter: TorchRLAdapter | BatchedTorchRLEnv = (
                TorchRLAdapter(env, max_episode_steps=max_episode_steps) if tuple(env.batch_size) == ()
                else BatchedTorchRLEnv(env, max_episode_steps=max_episode_steps))
        except BaseException:
            close_env_quietly(env)  # refused (a batched env, specs no column fits): its workers end here
            raise
        missing = [k for k in info_key_list(info_keys) if k not in adapter.keys.observation]
        if missing or isinstance(info_keys, Mapping):
            adapter.close()
            raise ValueError(f"info_keys {missing or list(info_keys)} for a TorchRL env: a TorchRL env reads its "
                             "info itself, with env.set_info_dict_reader(default_info_dict_reader(keys, spec=...)); "
                             "then name those observation entries in a list")
        return adapter
    if isinstance(env, gym.Env):
        return GymAdapter(env, validate=validate, info_keys=info_keys)
    closer = getattr(env, "close", None)
    if callable(closer):
        closer()
    raise ValueError(f"the env factory returned {type(env).__name__}; expected a gymnasium.Env or a torchrl EnvBase")
