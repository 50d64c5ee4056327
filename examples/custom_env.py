"""Your own gymnasium env, collected in threads: why threads pay off when a step waits.

`RemoteSimulator` stands for a simulator in another process or machine: each
`step` waits `latency` seconds for an answer (here `time.sleep`, which releases
the GIL, as socket reads and most C/C++ simulators do). Stepped one after the
other (gymnasium's `SyncVectorEnv`), N envs cost N waits a step; in
lightning_rollout's threads the waits overlap, and the policy still sees one
batched forward pass.

    python examples/custom_env.py --num-envs 16 --latency 0.002 --frames 4000
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from lightning_rollout import ThreadedCollector


class RemoteSimulator(gym.Env):
    """A 1-D point that must be kept near 0; every step waits ``latency`` seconds (GIL released).

    Observation: ``Box(-10, 10, (2,), float32)`` = (position, velocity).
    Actions: ``Discrete(3)`` = push left, none, right. Reward: ``1 - |position| / 10``.
    Episodes are truncated after ``max_steps`` steps.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, latency: float = 0.002, max_steps: int = 200) -> None:
        self.latency = latency
        self.max_steps = max_steps
        self.observation_space = gym.spaces.Box(-10.0, 10.0, (2,), np.float32)
        self.action_space = gym.spaces.Discrete(3)
        self._state = np.zeros(2, np.float32)
        self._t = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._state = self.np_random.uniform(-1, 1, size=2).astype(np.float32)
        self._t = 0
        return self._state.copy(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        time.sleep(self.latency)  # the round trip to the simulator
        position, velocity = self._state
        velocity = float(np.clip(velocity + 0.1 * (int(action) - 1), -1, 1))
        position = float(np.clip(position + 0.1 * velocity, -10, 10))
        self._state = np.array([position, velocity], np.float32)
        self._t += 1
        terminated = abs(position) >= 10
        return self._state.copy(), 1.0 - abs(position) / 10, terminated, self._t >= self.max_steps, {}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-envs", type=int, default=16)
    parser.add_argument("--latency", type=float, default=0.002, help="seconds each env step waits")
    parser.add_argument("--frames", type=int, default=4_000)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    n, frames = args.num_envs, args.frames - args.frames % args.num_envs
    net = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 3))

    def policy(obs: torch.Tensor) -> torch.Tensor:  # a plain callable: batch of observations -> actions
        return net(obs).argmax(-1)

    # 1. one env after the other (what a single-threaded vectorized env does)
    vec = gym.vector.SyncVectorEnv([lambda: RemoteSimulator(args.latency) for _ in range(n)])
    obs, _ = vec.reset(seed=0)
    start = time.perf_counter()
    for _ in range(frames // n):
        with torch.no_grad():
            actions = policy(torch.as_tensor(obs)).numpy()
        obs, *_ = vec.step(actions)
    sync_fps = frames / (time.perf_counter() - start)
    vec.close()

    # 2. one thread per env, one batched forward pass for all (flush what is ready after 1 ms)
    collector = ThreadedCollector(lambda: RemoteSimulator(args.latency), policy, frames_per_batch=frames,
                                  total_frames=frames, num_envs=n, max_wait=0.001, seed=0)
    start = time.perf_counter()
    for batch in collector:
        pass
    threaded_fps = frames / (time.perf_counter() - start)
    mean_batch = collector.autobatch_policy.mean_batch_size
    collector.shutdown()

    ideal = n / args.latency
    result = {"num_envs": n, "latency_s": args.latency, "sync_vector_env_fps": round(sync_fps),
              "threaded_fps": round(threaded_fps), "speedup": round(threaded_fps / sync_fps, 1),
              "ideal_fps": round(ideal), "fraction_of_ideal": round(threaded_fps / ideal, 2),
              "mean_policy_batch": round(mean_batch, 1)}
    print(f"SyncVectorEnv (sequential): {result['sync_vector_env_fps']:>6} steps/s")
    print(f"ThreadedCollector         : {result['threaded_fps']:>6} steps/s  ({result['speedup']}x, "
          f"{result['fraction_of_ideal']:.0%} of the ideal {result['ideal_fps']} = num_envs / latency; "
          f"mean policy batch {result['mean_policy_batch']})")
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
