"""The benchmark envs, and factories of them for every contender's library.

* ``CartPole-v1``: the cheap env (a few microseconds of Python per step).
* ``bench/Sleep-v0`` (:class:`SleepEnv`): each step ``time.sleep(0.002)``, which
  releases the GIL, as a C/C++ simulator, I/O or a remote env would.
* ``bench/Straggler-v0`` (:class:`StragglerEnv`): each step sleeps a time drawn
  from a Pareto distribution (shape 2, so infinite variance) with a mean of 1 ms,
  capped at 50 ms so one draw cannot stall a run.
* ``bench/GilBound-v0`` (:class:`GilBoundEnv`): each step runs pure Python for
  100 us, holding the GIL throughout, as a Python simulator or ALE does: threads
  cannot overlap it, processes can.

Both synthetic envs have CartPole's spaces (``Box(4)`` observations, ``Discrete(2)``
actions) so the same policy serves every scenario, and episodes of 200 steps
(truncated). They are registered with gymnasium when this module is imported,
so process-based contenders (which import it to unpickle the factories) see them.
Factories are ``functools.partial`` objects of module-level functions: picklable
for ``ParallelEnv``, ``MultiSyncCollector`` and ``AsyncVectorEnv``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

__all__ = ["CARTPOLE", "GIL_BOUND", "SLEEP", "STRAGGLER", "GilBoundEnv", "SleepEnv", "StragglerEnv", "envpool_make",
           "gym_factory", "measure_step_time", "torchrl_factory"]

CARTPOLE = "CartPole-v1"
SLEEP = "bench/Sleep-v0"
STRAGGLER = "bench/Straggler-v0"
GIL_BOUND = "bench/GilBound-v0"
EPISODE_STEPS = 200


class SleepEnv(gym.Env):
    """CartPole's spaces; each step sleeps ``step_time`` seconds (GIL released)."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, step_time: float = 0.002) -> None:
        self.step_time = step_time
        self._obs = np.zeros(4, dtype=np.float32)

    def _delay(self) -> float:
        return self.step_time

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._obs = self.np_random.uniform(-0.05, 0.05, 4).astype(np.float32)
        return self._obs.copy(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        time.sleep(self._delay())
        self._obs = np.clip(self._obs + (0.01 if int(action) else -0.01), -1.0, 1.0).astype(np.float32)
        return self._obs.copy(), 1.0, False, False, {}


class StragglerEnv(SleepEnv):
    """Step time drawn per step: Pareto(shape ``alpha``) with mean ``mean_step_time``, capped at ``cap``."""

    def __init__(self, mean_step_time: float = 0.001, alpha: float = 2.0, cap: float = 0.05) -> None:
        super().__init__(mean_step_time)
        self.alpha = alpha
        self.scale = mean_step_time * (alpha - 1) / alpha  # Pareto minimum x_m, so the mean is mean_step_time
        self.cap = cap

    def _delay(self) -> float:
        return min(self.cap, (self.np_random.pareto(self.alpha) + 1.0) * self.scale)


class GilBoundEnv(SleepEnv):
    """Each step spins in Python for ``step_time`` seconds: the GIL is held for the whole step."""

    def __init__(self, step_time: float = 100e-6) -> None:
        super().__init__(step_time)

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        end = time.perf_counter() + self.step_time
        x = 0
        while time.perf_counter() < end:
            x += 1
        self._obs = np.clip(self._obs + (0.01 if int(action) else -0.01), -1.0, 1.0).astype(np.float32)
        return self._obs.copy(), 1.0, False, False, {}


gym.register(SLEEP, entry_point=SleepEnv, max_episode_steps=EPISODE_STEPS)
gym.register(GIL_BOUND, entry_point=GilBoundEnv, max_episode_steps=EPISODE_STEPS)
gym.register(STRAGGLER, entry_point=StragglerEnv, max_episode_steps=EPISODE_STEPS)


def _make_gym(env_id: str) -> gym.Env:
    if env_id.startswith("ALE/"):
        import ale_py  # registers the ALE ids (the bench-real extra)

        gym.register_envs(ale_py)
    return gym.make(env_id)


def envpool_make(env_id: str, num_envs: int, batch_size: int | None = None) -> Any:
    """The envpool twin of a gymnasium id, configured like gymnasium's (an Atari env: raw 210x160 RGB frames,
    frameskip 4, sticky actions 0.25, no episodic life, no reward clipping, no noop starts)."""
    import envpool

    kwargs: dict[str, Any] = {"env_type": "gymnasium", "num_envs": num_envs, "batch_size": batch_size or num_envs}
    task = env_id
    if env_id.startswith("ALE/"):
        task = env_id.split("/", 1)[1]
        kwargs.update(img_height=210, img_width=160, gray_scale=False, stack_num=1, frame_skip=4, noop_max=1,
                      repeat_action_probability=0.25, episodic_life=False, reward_clip=False, use_fire_reset=False)
    return envpool.make(task, **kwargs)


def _make_torchrl(env_id: str):  # -> torchrl GymEnv (imported lazily: workers of gym contenders skip torchrl)
    from torchrl.envs import GymEnv

    return GymEnv(env_id)


def gym_factory(env_id: str) -> Callable[[], gym.Env]:
    """A picklable factory of one ``gymnasium.Env``."""
    return functools.partial(_make_gym, env_id)


def torchrl_factory(env_id: str) -> Callable[[], object]:
    """A picklable factory of one unbatched torchrl ``GymEnv`` (one-hot actions)."""
    return functools.partial(_make_torchrl, env_id)


def measure_step_time(env_id: str, steps: int = 200) -> float:
    """Mean seconds per ``step`` of one env in this thread (resets excluded)."""
    env = _make_gym(env_id)
    env.reset(seed=0)
    total = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        total += time.perf_counter() - t0
        if terminated or truncated:
            env.reset()
    env.close()
    return total / steps
