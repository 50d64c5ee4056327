"""``parallel_steps``: the envs of one block step concurrently, each in its own helper thread."""

from __future__ import annotations

import threading

import gymnasium as gym
import numpy as np
import pytest
import torch

from lightning_rollout import EnvError, MultiEnvLoop, ThreadedCollector
from lightning_rollout.envs import GymMaker
from lightning_rollout.loop.auto import EnvTiming, choose_layout
from process_helpers import balance_policy, count_envs, zero_policy

pytestmark = pytest.mark.timeout(60)


class _MeetEnv(gym.Env):
    """Each step waits at a barrier shared by every env: it only passes if all envs step at once."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, barrier: threading.Barrier) -> None:
        self.barrier = barrier

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.barrier.wait(timeout=10.0)  # BrokenBarrierError (an env error) if the steps were sequential
        return np.zeros(1, np.float32), 1.0, False, False, {}


def test_parallel_steps_run_every_env_of_a_block_at_once():
    barrier = threading.Barrier(4)
    with MultiEnvLoop([lambda: _MeetEnv(barrier)] * 4, zero_policy, envs_per_thread=4, parallel_steps=True,
                      lookahead=False) as loop:
        batch = loop.run_env_steps(5)
        helpers = [t.name for t in threading.enumerate() if t.name.endswith("-step")]
    assert batch.shape == (4, 5)
    assert sorted(helpers) == [f"lightning_rollout-loop-env{i}-step" for i in range(4)]
    assert not [t for t in threading.enumerate() if t.name.endswith("-step")], "close() joins the helpers"


def test_parallel_steps_give_the_same_batches_as_sequential_steps_value_for_value():
    kwargs = dict(num_envs=4, envs_per_thread=4, seed=5, lookahead=False)
    with MultiEnvLoop(GymMaker("CartPole-v1"), balance_policy, parallel_steps=True, **kwargs) as parallel:
        ours = [parallel.run_env_steps(40), parallel.run_env_steps(40)]
        episode = parallel.run_episodes(1)[0]
    with MultiEnvLoop(GymMaker("CartPole-v1"), balance_policy, parallel_steps=False, **kwargs) as sequential:
        reference = [sequential.run_env_steps(40), sequential.run_env_steps(40)]
    for a, b in zip(ours, reference):
        assert set(a.keys(True, True)) == set(b.keys(True, True))
        for key in b.keys(True, True):
            assert torch.equal(a[key], b[key]), key
    assert episode["next", "done"][-1].item()


def test_env_error_in_a_helper_thread_names_the_env_and_keeps_what_was_collected():
    with MultiEnvLoop(count_envs(4, fail_at={2: 3}), zero_policy, envs_per_thread=4, parallel_steps=True,
                      lookahead=False) as loop:
        with pytest.raises(EnvError, match=r"env 2 failed in step at step 3: RuntimeError: env 2 step 3 broke") as info:
            loop.run_env_steps(20)
    assert info.value.partial is not None and info.value.partial.shape == (4, 3)
    assert not [t for t in threading.enumerate() if t.name.endswith("-step")]


def test_parallel_steps_are_refused_with_worker_processes():
    with pytest.raises(ValueError, match="parallel_steps=True .* worker processes"):
        MultiEnvLoop(count_envs(4), zero_policy, envs_per_thread=2, num_workers=2, parallel_steps=True)
    with pytest.raises(ValueError, match="parallel_steps must be"):
        MultiEnvLoop(count_envs(2), zero_policy, parallel_steps="yes")


def test_auto_layout_steps_gil_releasing_envs_in_parallel(monkeypatch):
    import lightning_rollout.loop.auto as auto

    releasing = EnvTiming(step_s=2e-3, gil_release=0.98)
    assert choose_layout(8, releasing, cores=2).parallel_steps
    monkeypatch.setattr(auto, "measure_env", lambda *a, **k: releasing)
    collector = ThreadedCollector(count_envs(4), zero_policy, frames_per_batch=8, total_frames=16)
    try:
        assert collector.loop.parallel_steps and collector.loop.envs_per_thread == 4
        assert [tuple(b.shape) for b in collector] == [(4, 2), (4, 2)]
    finally:
        collector.shutdown()
    given = ThreadedCollector(count_envs(4), zero_policy, frames_per_batch=8, envs_per_thread=2)
    try:
        assert not given.loop.parallel_steps  # a given layout is kept as it is
    finally:
        given.shutdown()
