"""``parallel_steps``: every env steps in a pool thread of its own, so the envs of a round step concurrently.

Pool threads are named ``lightning_rollout-<name>-env<i>`` (one a unit: with ``parallel_steps`` a unit is one
env) and joined at ``close()``. ``parallel_steps="free"`` lets each env run at its own pace within a call.
"""

from __future__ import annotations

import threading
import time

import gymnasium as gym
import numpy as np
import pytest
import torch

from lightning_rollout import EnvError, MultiEnvLoop, StepTimeoutError, ThreadedCollector
from lightning_rollout.envs import GymMaker
from lightning_rollout.loop.auto import EnvTiming, choose_layout
from conftest import assert_batches_equal, steps_per_env
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


def _pool_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("lightning_rollout-loop-env"))


def test_parallel_steps_run_every_env_of_a_round_at_once_each_in_a_named_pool_thread():
    barrier = threading.Barrier(4)
    with MultiEnvLoop([lambda: _MeetEnv(barrier)] * 4, zero_policy, envs_per_thread=4, parallel_steps=True,
                      lookahead=False) as loop:
        batch = loop.run_env_steps(5)
        threads = _pool_threads()
        assert sorted(t.name for t in loop.threads()) == threads
    assert batch.shape == (4, 5)
    assert threads == [f"lightning_rollout-loop-env{i}" for i in range(4)]
    assert not _pool_threads(), "close() joins the pool threads"


@pytest.mark.parametrize("mode", [True, "free"])
def test_parallel_steps_give_the_same_batches_as_sequential_steps_value_for_value(mode):
    """Free-running envs too: a deterministic policy answers each env from its own observations."""
    kwargs = dict(num_envs=4, envs_per_thread=4, seed=5, lookahead=False)
    # Steps per env (free-running with "free") and flat frames interleaved, then a fresh episode.
    with MultiEnvLoop(GymMaker("CartPole-v1"), balance_policy, parallel_steps=mode, **kwargs) as parallel:
        ours = [parallel.run_env_steps(40), parallel.run_steps(8), parallel.run_env_steps(40), parallel.run_steps(4)]
        episode = parallel.run_episodes(1)[0]
    with MultiEnvLoop(GymMaker("CartPole-v1"), balance_policy, parallel_steps=False, **kwargs) as sequential:
        reference = [sequential.run_env_steps(40), sequential.run_steps(8), sequential.run_env_steps(40),
                     sequential.run_steps(4)]
    if mode == "free":  # arrival order, and so each env's share of a flat batch, follow timing: compare each env's
        ours, reference = [_per_env(ours)], [_per_env(reference)]  # own steps, over the calls, up to the shorter
        for env in range(4):
            n = min(len(ours[0][env]), len(reference[0][env]))
            assert n >= 80
            ours[0][env], reference[0][env] = ours[0][env][:n], reference[0][env][:n]
        ours, reference = [torch.cat(ours[0])], [torch.cat(reference[0])]
    assert_batches_equal(ours, reference)
    assert episode["next", "done"][-1].item()


def _per_env(batches: list) -> list:
    """Each env's steps over ``batches`` (``[envs, time]`` or flat), in order."""
    steps = [b if b.ndim == 1 else b.transpose(0, 1).reshape(-1) for b in batches]  # env-time: time-major
    merged = torch.cat(steps).exclude(("collector", "traj_ids"))  # new ids go in delivery order
    env_ids = merged["collector", "env_id"]
    return [merged[env_ids == env] for env in range(4)]


@pytest.mark.parametrize("mode", [True, "free"])
def test_env_error_in_a_pool_thread_names_the_env_and_keeps_what_was_collected(mode):
    """Lock-step, every env completed the steps before the failed one's: all of them are kept. Free-running, the
    other envs may be behind the failed one: what is kept is each env's first complete, continuous steps."""
    with MultiEnvLoop(count_envs(4, fail_at={2: 3}, length=100), zero_policy, envs_per_thread=4, parallel_steps=mode,
                      lookahead=False) as loop:
        with pytest.raises(EnvError, match=r"env 2 failed in step at step 3: RuntimeError: env 2 step 3 broke") as info:
            loop.run_env_steps(20)
    partial = info.value.partial
    assert (info.value.env_id, info.value.step, info.value.phase) == (2, 3, "step")
    counts = steps_per_env(partial)  # every complete step, in arrival order
    assert counts[2] == 3 and (mode != True or min(counts.values()) >= 3)  # noqa: E712
    for env, n in counts.items():  # CountEnv: [env_id, episode, t]: each env's first, continuous steps
        t = partial[partial["collector", "env_id"] == env]["next", "observation"][..., 2]
        assert t.tolist() == list(range(1, n + 1))
    assert not _pool_threads()


class _NanEnv(gym.Env):
    """Env ``bad``'s step ``at`` returns a NaN observation; every other step ``[env_id, t]``."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, env_id: int, bad: int, at: int) -> None:
        self.env_id, self.bad, self.at, self.t = env_id, bad, at, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.array([self.env_id, 0], np.float32), {}

    def step(self, action):
        nan = self.env_id == self.bad and self.t == self.at
        self.t += 1
        return np.array([self.env_id, np.nan if nan else self.t], np.float32), 1.0, False, False, {}


@pytest.mark.parametrize("parallel", [True, False], ids=["pool threads", "stepping thread"])
def test_a_nan_observation_names_its_env_in_the_check_phase(parallel):
    """``validate=True`` (the default) checks every observation for NaN, wherever the env steps."""
    with MultiEnvLoop([lambda j=j: _NanEnv(j, bad=2, at=2) for j in range(4)], zero_policy, envs_per_thread=4,
                      parallel_steps=parallel, lookahead=False) as loop:
        with pytest.raises(EnvError, match="NaN") as info:
            loop.run_env_steps(10)
    assert (info.value.env_id, info.value.step, info.value.phase) == (2, 2, "check")
    partial = info.value.partial
    assert steps_per_env(partial)[2] == 2 and not partial["next", "observation"].isnan().any()


class _AheadEnv(gym.Env):
    """Env 0's first step waits (up to 10 s) until env 1 has taken ``ahead`` steps, and records in
    ``shared["env0 waited"]`` whether that happened in time; env 1's step ``hang_at`` waits (up to
    10 s) until ``release`` is set. Observations count the env's steps."""

    observation_space = gym.spaces.Box(-1e6, 1e6, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, j: int, shared: dict) -> None:
        self.j, self.shared, self.t = j, shared, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        shared = self.shared
        if self.j == 0 and self.t == 0:
            shared["env0 waited"] = shared["env1 ahead"].wait(timeout=10.0)
        if self.j == 1:
            if self.t == shared.get("hang_at"):
                shared["release"].wait(timeout=10.0)
            if self.t + 1 == shared["ahead"]:
                shared["env1 ahead"].set()
        self.t += 1
        return np.full(1, self.t, np.float32), 1.0, False, False, {}


def _ahead_envs(shared: dict) -> list:
    shared.setdefault("env1 ahead", threading.Event())
    shared.setdefault("release", threading.Event())
    return [lambda j=j: _AheadEnv(j, shared) for j in range(2)]


def test_free_parallel_steps_let_each_env_of_a_quota_run_at_its_own_pace():
    """Env 0's first step ends only once env 1 took three steps: in lock-step env 1 would wait for env 0."""
    shared: dict = {"ahead": 3}
    with MultiEnvLoop(_ahead_envs(shared), zero_policy, envs_per_thread=2, parallel_steps="free",
                      lookahead=False) as loop:
        batch = loop.run_env_steps(5)
        following = loop.run_env_steps(2)
    assert shared["env0 waited"], "env 0's first step timed out: env 1 did not run ahead of it"
    assert batch.shape == (2, 5) and following.shape == (2, 2)
    for env in range(2):  # each env's steps in order, and the next batch carries on where this one ended
        steps = torch.cat([batch["next", "observation"][env, :, 0], following["next", "observation"][env, :, 0]])
        assert steps.tolist() == [1, 2, 3, 4, 5, 6, 7]
        assert torch.equal(following["observation"][env, 0], batch["next", "observation"][env, -1])


def test_free_step_timeout_names_the_hung_env_while_the_others_run_on():
    shared: dict = {"ahead": 10, "hang_at": 1}
    shared["env1 ahead"] = threading.Event()
    shared["env1 ahead"].set()  # env 0 never waits
    before = set(threading.enumerate())
    loop = MultiEnvLoop(_ahead_envs(shared), zero_policy, envs_per_thread=2, parallel_steps="free",
                        lookahead=False, step_timeout=0.5, join_timeout=5.0)
    try:
        with pytest.warns(RuntimeWarning, match="abandoned"):
            with pytest.raises(StepTimeoutError, match=r"env 1 .*step_timeout=0.5") as info:
                loop.run_env_steps(50)
        assert (info.value.env_id, info.value.step) == (1, 1)
        assert steps_per_env(info.value.partial).get(1) == 1  # env 1's one complete step
    finally:
        shared["release"].set()  # the abandoned threads leave the hung step and exit
        for thread in set(threading.enumerate()) - before:
            thread.join(10.0)


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
        assert collector.loop.parallel_steps is True  # lock-step ("free" is never chosen): reproducible
        assert collector.loop.envs_per_thread == 1  # a pool thread an env
        assert [tuple(b.shape) for b in collector] == [(4, 2), (4, 2)]
        assert len(list(collector.loop.threads())) == 4
    finally:
        collector.shutdown()
    given = ThreadedCollector(count_envs(4), zero_policy, frames_per_batch=8, envs_per_thread=2)
    try:
        assert not given.loop.parallel_steps  # a given layout is kept as it is
    finally:
        given.shutdown()


class _AlternatingEnv(gym.Env):
    """Steps alternate between no wait and a 20 ms sleep: a mean of 10 ms and a standard deviation of 10 ms."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self) -> None:
        self.steps = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.steps += 1
        if self.steps % 2:
            time.sleep(0.02)
        return np.zeros(1, np.float32), 1.0, False, False, {}


@pytest.mark.serial
def test_measure_env_times_uneven_steps_and_their_share_without_the_gil():
    from lightning_rollout.loop.auto import measure_env

    timing = measure_env(_AlternatingEnv, steps=10)
    assert timing.step_s >= 5e-3  # about 10 ms: the mean of no wait and a 20 ms sleep
    assert timing.gil_release >= 0.3  # the sleeps release the GIL


class _HangingEnv(gym.Env):
    """Env ``hung`` blocks in its step ``at`` until ``release`` is set; the others end an episode every step
    (so they are reset between steps)."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, j: int, hung: int, at: int, release: threading.Event) -> None:
        self.j, self.hung, self.at, self.release, self.t = j, hung, at, release, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        if self.j == self.hung and self.t == self.at:
            self.release.wait(timeout=10.0)
        self.t += 1
        return np.full(1, self.t, np.float32), 1.0, self.j != self.hung, False, {}


@pytest.mark.parametrize("mode", [True, "free"])
def test_step_timeout_names_the_hung_env_not_the_first_one_started(mode):
    """Env 2 of 4 hangs in its second step while the others end (and are reset) around it: the timeout names
    env 2, whether a round waits for every env (lock-step) or the others run on ("free")."""
    release = threading.Event()
    before = set(threading.enumerate())
    loop = MultiEnvLoop([lambda j=j: _HangingEnv(j, 2, 1, release) for j in range(4)], zero_policy,
                        envs_per_thread=4, parallel_steps=mode, lookahead=False, step_timeout=0.5,
                        join_timeout=5.0)
    try:
        with pytest.warns(RuntimeWarning, match="abandoned"):
            with pytest.raises(StepTimeoutError, match=r"env 2 .*step_timeout=0.5") as info:
                loop.run_env_steps(20)
        assert (info.value.env_id, info.value.step, info.value.phase) == (2, 1, "step")
    finally:
        release.set()  # the abandoned threads leave the hung step and exit
        for thread in set(threading.enumerate()) - before:
            thread.join(10.0)


