"""Module-level envs and factories for the worker-process tests (a spawned child imports them by name)."""

from __future__ import annotations

import functools
import os
import time

from typing import Any

import gymnasium as gym
import numpy as np

from conftest import MockEnv


class _UnsampledDiscrete(gym.spaces.Discrete):
    """A ``Discrete`` space whose ``sample`` raises (a random action of the env fails)."""

    def sample(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this action space cannot sample")


class CountEnv(gym.Env):
    """Observation ``[env_id, episode, t]``; episodes of ``length`` steps; step ``fail_at`` (0-based, over the
    env's life) raises; reset number ``fail_reset`` raises; step ``hang_at`` sleeps ``hang_s`` seconds; with
    ``fail_sample`` its action space's ``sample`` raises."""

    observation_space = gym.spaces.Box(-1e6, 1e6, (3,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, env_id: int = 0, length: int = 5, fail_at: int | None = None, fail_reset: int | None = None,
                 hang_at: int | None = None, hang_s: float = 60.0, fail_sample: bool = False) -> None:
        self.env_id, self.length, self.fail_at, self.fail_reset = env_id, length, fail_at, fail_reset
        if fail_sample:
            self.action_space = _UnsampledDiscrete(2)
        self.hang_at, self.hang_s = hang_at, hang_s
        self.steps = self.resets = self.episode = self.t = 0

    def _obs(self) -> np.ndarray:
        return np.array([self.env_id, self.episode, self.t], np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if self.fail_reset is not None and self.resets == self.fail_reset:
            raise RuntimeError(f"env {self.env_id} reset {self.resets} broke")
        if self.resets:
            self.episode += 1
        self.resets += 1
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        if self.fail_at is not None and self.steps == self.fail_at:
            raise RuntimeError(f"env {self.env_id} step {self.steps} broke in process {os.getpid()}")
        if self.hang_at is not None and self.steps == self.hang_at:
            time.sleep(self.hang_s)
        self.steps += 1
        self.t += 1
        return self._obs(), 1.0, self.t >= self.length, False, {}


class EnvVarEnv(CountEnv):
    """:class:`CountEnv` whose observation's first entry is the environment variable ``name`` as a float (-1 when
    unset), read when the env is built."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.value = float(os.environ.get(name, "-1"))

    def _obs(self) -> np.ndarray:
        return np.array([self.value, self.episode, self.t], np.float32)


def count_envs(n: int, **kwargs) -> list:
    """``n`` picklable factories of :class:`CountEnv` (env ``i`` gets ``env_id=i``; ``kwargs`` may be
    ``{"fail_at": {2: 3}}``-style dicts keyed by env id)."""
    factories = []
    for i in range(n):
        own = {k: (v.get(i) if isinstance(v, dict) else v) for k, v in kwargs.items()}
        factories.append(functools.partial(CountEnv, i, **own))
    return factories


def zero_policy(obs):
    import torch

    return torch.zeros(obs.shape[0], dtype=torch.long)


def balance_policy(obs):
    """CartPole: push toward the side the pole leans to."""
    return (obs[:, 2] > 0).long()


class BusyEnv(CountEnv):
    """A :class:`CountEnv` whose step spins in Python for ``busy_s`` seconds (the GIL held throughout)."""

    def __init__(self, env_id: int = 0, busy_s: float = 300e-6, **kwargs) -> None:
        super().__init__(env_id, **kwargs)
        self.busy_s = busy_s

    def step(self, action):
        end = time.perf_counter() + self.busy_s
        while time.perf_counter() < end:
            pass
        return super().step(action)


class FrameEnv(MockEnv):
    """:class:`MockEnv` with a 12 KB image observation: every pixel is ``[env_id, episode, t]`` coded as
    ``10000 * env_id + 100 * episode + t``, channel ``c`` adding ``c``."""

    def __init__(self, env_id: int = 0, **kwargs: Any) -> None:
        super().__init__(env_id, **kwargs)
        self.observation_space = gym.spaces.Box(-1e9, 1e9, shape=(3, 32, 32), dtype=np.float32)

    def _obs(self) -> np.ndarray:
        code = 10000 * self.env_id + 100 * self.episode + self.t
        return (np.full((3, 32, 32), code, dtype=np.float32) + np.arange(3, dtype=np.float32)[:, None, None])


def frame_envs(n: int) -> list:
    """``n`` picklable factories of :class:`FrameEnv` (env ``i`` gets ``env_id=i``)."""
    return [functools.partial(FrameEnv, i) for i in range(n)]


def worker_pids() -> set[int]:
    """Pids of the live processes started under this one, less multiprocessing's own helpers, which live as long as
    this process: its resource tracker and its fork server (whose children, the worker processes, count)."""
    import psutil

    pids = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            command = " ".join(p.cmdline())
            if "resource_tracker" in command or ("forkserver" in command and p.ppid() == os.getpid()):
                continue
            pids.add(p.pid)
        except psutil.NoSuchProcess:  # ended (or a zombie) meanwhile
            continue
    return pids
