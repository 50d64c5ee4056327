"""One step API over ``gymnasium.Env`` and torchrl ``EnvBase``, and spec discovery.

Env threads talk to an :class:`EnvAdapter`; it hides which library the env
comes from and exposes what the loop needs to **preallocate** storage: the
observation keys with their shapes and dtypes (:class:`ArraySpec`).

* :class:`GymAdapter` wraps a ``gymnasium.Env`` whose observation space is a
  ``Box``, ``Discrete``, ``MultiBinary``, ``MultiDiscrete`` or a ``Dict`` of
  those (one key per entry; otherwise the key is ``"observation"``). Discrete
  actions are accepted as an index or one-hot, as the policy gives them.
* :class:`TorchRLAdapter` wraps an unbatched torchrl ``EnvBase`` (transforms
  included); its observation keys come from ``observation_spec``.

Adapters are not thread-safe: each is owned by exactly one env thread after
construction. Construction happens in the caller's thread, so a bad env id or
unsupported space fails at the boundary with a ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import gymnasium as gym
import numpy as np
import torch
from torchrl.envs import EnvBase

__all__ = ["ArraySpec", "EnvAdapter", "EnvFactory", "GymAdapter", "TorchRLAdapter", "make_adapter",
           "resolve_env_factory", "GymMaker"]

NestedKey = str | tuple[str, ...]
EnvFactory = Callable[[], "gym.Env | EnvBase"]
# Keys the loop computes itself; an env that also emits them (torchrl's StepCounter,
# RewardSum) is not asked to store them twice.
_LOOP_KEYS = {"step_count", "episode_reward", "done", "terminated", "truncated", "reward", "is_init"}


@dataclass(frozen=True, slots=True)
class ArraySpec:
    """Shape (without batch dims) and numpy dtype of one stored entry."""

    shape: tuple[int, ...]
    dtype: np.dtype


class EnvAdapter(Protocol):
    """The step API env threads use.

    Attributes:
        observation_spec: ``{key: ArraySpec}`` of what :meth:`reset` and :meth:`step` return.
    """

    observation_spec: dict[NestedKey, ArraySpec]

    def reset(self, seed: int | None = None) -> dict[NestedKey, np.ndarray]:
        """Start a new episode; ``seed`` only on the first reset after seeding."""
        ...

    def step(self, action: np.ndarray) -> tuple[dict[NestedKey, np.ndarray], float, bool, bool]:
        """Apply one action (a row of the policy's output).

        Returns:
            ``(observation, reward, terminated, truncated)``.
        """
        ...

    def random_action(self, template: ArraySpec) -> np.ndarray:
        """A uniformly random action in the policy's format described by ``template``."""
        ...

    def close(self) -> None:
        """Release the env (called once, by the env's thread, when the loop closes)."""
        ...


def _space_spec(space: gym.Space) -> ArraySpec:
    if isinstance(space, (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiBinary, gym.spaces.MultiDiscrete)):
        return ArraySpec(tuple(space.shape), np.dtype(space.dtype))
    raise ValueError(
        f"unsupported observation space {space!r}: use Box, Discrete, MultiBinary, MultiDiscrete or a Dict "
        "of those (wrap the env with a gymnasium ObservationWrapper to flatten others)")


class GymAdapter:
    """:class:`EnvAdapter` over a ``gymnasium.Env``.

    Args:
        env: the env; its spaces are read once here.

    Raises:
        ValueError: the observation or action space is not supported.
    """

    def __init__(self, env: gym.Env) -> None:
        self.env = env
        space = env.observation_space
        if isinstance(space, gym.spaces.Dict):
            self._dict_obs = True
            self.observation_spec = {k: _space_spec(s) for k, s in space.spaces.items()}
        else:
            self._dict_obs = False
            self.observation_spec = {"observation": _space_spec(space)}
        self.action_space = env.action_space
        if not isinstance(self.action_space, (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiBinary,
                                              gym.spaces.MultiDiscrete)):
            raise ValueError(f"unsupported action space {self.action_space!r}: use Box, Discrete, MultiBinary "
                             "or MultiDiscrete")
        self._discrete_n = int(self.action_space.n) if isinstance(self.action_space, gym.spaces.Discrete) else 0
        self._discrete_start = int(getattr(self.action_space, "start", 0)) if self._discrete_n else 0

    def _obs(self, obs: Any) -> dict[NestedKey, np.ndarray]:
        if self._dict_obs:
            return {k: np.asarray(v) for k, v in obs.items()}
        return {"observation": np.asarray(obs)}

    def reset(self, seed: int | None = None) -> dict[NestedKey, np.ndarray]:
        obs, _ = self.env.reset(seed=seed)
        return self._obs(obs)

    def step(self, action: np.ndarray) -> tuple[dict[NestedKey, np.ndarray], float, bool, bool]:
        if self._discrete_n:
            # one-hot (shape [n]) or index (shape [] or [1]), as the policy gives it
            index = int(action.argmax()) if action.size == self._discrete_n and self._discrete_n > 1 else int(action.reshape(-1)[0])
            env_action: Any = index + self._discrete_start
        else:
            env_action = action
        obs, reward, terminated, truncated, _ = self.env.step(env_action)
        return self._obs(obs), float(reward), bool(terminated), bool(truncated)

    def random_action(self, template: ArraySpec) -> np.ndarray:
        sample = self.action_space.sample()
        if self._discrete_n and template.shape and template.shape[-1] == self._discrete_n and self._discrete_n > 1:
            one_hot = np.zeros(template.shape, dtype=template.dtype)
            one_hot[..., int(sample) - self._discrete_start] = 1
            return one_hot
        return np.asarray(sample).astype(template.dtype, copy=False).reshape(template.shape)

    def close(self) -> None:
        self.env.close()


class TorchRLAdapter:
    """:class:`EnvAdapter` over an unbatched torchrl ``EnvBase`` (transforms included).

    Args:
        env: an env with ``batch_size == ()``; parallelism is the loop's job.

    Raises:
        ValueError: a batched env.
    """

    def __init__(self, env: EnvBase) -> None:
        if tuple(env.batch_size) != ():
            raise ValueError(f"torchrl envs must be unbatched (batch_size=()), got batch_size={tuple(env.batch_size)}; "
                             "pass a factory of single envs and set num_envs instead of SerialEnv/ParallelEnv")
        self.env = env
        self.observation_spec = {}
        for key, spec in env.observation_spec.items(True, True):
            leaf = key[-1] if isinstance(key, tuple) else key
            if leaf in _LOOP_KEYS:
                continue
            self.observation_spec[key] = ArraySpec(tuple(spec.shape), np.dtype(_np_dtype(spec.dtype)))
        self._td: Any = None

    def _obs(self, td: Any) -> dict[NestedKey, np.ndarray]:
        return {k: td.get(k).numpy() for k in self.observation_spec}

    def reset(self, seed: int | None = None) -> dict[NestedKey, np.ndarray]:
        if seed is not None:
            self.env.set_seed(seed)
        self._td = self.env.reset()
        return self._obs(self._td)

    def step(self, action: np.ndarray) -> tuple[dict[NestedKey, np.ndarray], float, bool, bool]:
        td = self._td
        td.set("action", torch.as_tensor(action).clone())
        td = self.env.step(td)
        nxt = td.get("next")
        reward = float(nxt.get("reward").reshape(-1)[0])
        terminated = bool(nxt.get("terminated", nxt.get("done")).any())
        truncated = nxt.get("truncated", None)
        truncated_b = bool(truncated.any()) if truncated is not None else False
        self._td = nxt.exclude("reward", "done", "terminated", "truncated")
        return self._obs(nxt), reward, terminated, truncated_b

    def random_action(self, template: ArraySpec) -> np.ndarray:
        return self.env.action_spec.rand().numpy().astype(template.dtype, copy=False).reshape(template.shape)

    def close(self) -> None:
        if not self.env.is_closed:
            self.env.close()


def _np_dtype(dtype: torch.dtype) -> Any:
    return torch.empty((), dtype=dtype).numpy().dtype


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


def make_adapter(env: Any) -> EnvAdapter:
    """Wrap an env instance in the matching adapter.

    Raises:
        ValueError: ``env`` is neither a ``gymnasium.Env`` nor a torchrl ``EnvBase``.
    """
    if isinstance(env, EnvBase):
        return TorchRLAdapter(env)
    if isinstance(env, gym.Env):
        return GymAdapter(env)
    raise ValueError(f"the env factory returned {type(env).__name__}; expected a gymnasium.Env or a torchrl EnvBase")
