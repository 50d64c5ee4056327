"""Exploration mode from the caller's ``set_exploration_type`` context (issue 46, B6).

A ``ProbabilisticActor`` acts by the process-wide exploration mode of tensordict
(``torchrl.envs.utils.exploration_type()``). TorchRL's evaluation idiom is
``with set_exploration_type(ExplorationType.DETERMINISTIC): env.rollout(n, policy)``;
a :class:`MultiEnvLoop` asked for steps or episodes inside that block must act the
same way. Its own ``exploration_type`` still decides outside any block.

TorchRL's ``Collector`` enters ``set_exploration_type(self.exploration_type)`` (its
constructor argument, ``RANDOM`` by default) around every ``rollout()`` of its
iteration, so an outer block does not reach its policy; ``ThreadedCollector`` stands in
for it and keeps that behaviour (checked against ``Collector`` itself below).

The policy: logits ``[0, 1]`` whatever the observation, so the deterministic action
(the mode) is always 1 and a sampled one is 0 about a quarter of the time. The env
pays the action, 8 steps an episode: a deterministic episode returns exactly 8.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict.nn import TensorDictModule
from torchrl.collectors import Collector
from torchrl.envs import GymEnv
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import OneHotCategorical, ProbabilisticActor

from lightning_rollout import MultiEnvLoop, ThreadedCollector

pytestmark = pytest.mark.timeout(120)

EPISODE_STEPS = 8


class PaysTheAction(gym.Env):
    """Episodes of :data:`EPISODE_STEPS` steps, each paying the action taken (0 or 1)."""

    metadata: dict = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(-1.0, 1.0, shape=(4,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(4, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.zeros(4, np.float32), float(action), self.t >= EPISODE_STEPS, False, {}


def prefers_action_one() -> ProbabilisticActor:
    """A sampling policy whose mode is action 1 (logits ``[0, 1]`` for any 4-dim observation)."""
    net = torch.nn.Linear(4, 2)
    with torch.no_grad():
        net.weight.zero_()
        net.bias.copy_(torch.tensor([0.0, 1.0]))
    module = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    return ProbabilisticActor(module, in_keys=["logits"], distribution_class=OneHotCategorical)


def make_loop() -> MultiEnvLoop:
    return MultiEnvLoop([PaysTheAction] * 2, prefers_action_one(), lookahead=False, seed=0, name="context")


def test_run_episodes_inside_a_deterministic_block_acts_deterministically():
    loop = make_loop()
    try:
        sampled = [float(e["next", "reward"].sum()) for e in loop.run_episodes(4)]
        assert min(sampled) < EPISODE_STEPS  # outside any block the loop samples (its exploration_type, RANDOM)
        with set_exploration_type(ExplorationType.DETERMINISTIC):
            inside = [float(e["next", "reward"].sum()) for e in loop.run_episodes(4)]
        assert inside == [float(EPISODE_STEPS)] * 4
    finally:
        loop.close()


def test_run_steps_inside_a_deterministic_block_acts_deterministically():
    loop = make_loop()
    try:
        with set_exploration_type(ExplorationType.DETERMINISTIC):
            steps = loop.run_steps(32)
        assert steps["action"].argmax(-1).tolist() == [1] * 32
        assert not loop.run_steps(32)["action"].argmax(-1).bool().all()  # and samples again after the block
    finally:
        loop.close()


def test_threaded_collector_treats_an_outer_block_as_torchrls_collector_does():
    def all_modes(collector) -> bool:
        with set_exploration_type(ExplorationType.DETERMINISTIC):
            batch = next(iter(collector))
        collector.shutdown()
        return bool(batch["action"].argmax(-1).bool().all())

    torch.manual_seed(0)
    theirs = all_modes(Collector(GymEnv("CartPole-v1"), prefers_action_one(), frames_per_batch=64, total_frames=64,
                                 auto_register_policy_transforms=False))
    ours = all_modes(ThreadedCollector(lambda: GymEnv("CartPole-v1"), prefers_action_one(), frames_per_batch=64,
                                       total_frames=64, num_envs=2, seed=0))
    assert ours == theirs
