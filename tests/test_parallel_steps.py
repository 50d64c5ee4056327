"""``parallel_steps``: the envs of one block step concurrently, each in its own helper thread."""

from __future__ import annotations

import itertools
import os
import threading
import time

import gymnasium as gym
import numpy as np
import pytest
import torch

from lightning_rollout import EnvError, MultiEnvLoop, StepTimeoutError, ThreadedCollector
from lightning_rollout.envs import GymMaker
from lightning_rollout.loop.auto import EnvTiming, choose_layout
from conftest import assert_batches_equal
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


@pytest.mark.parametrize("mode", [True, "free"])
def test_parallel_steps_give_the_same_batches_as_sequential_steps_value_for_value(mode):
    """Free-running envs too: a deterministic policy answers each env from its own observations."""
    kwargs = dict(num_envs=4, envs_per_thread=4, seed=5, lookahead=False)
    # Quotas (free-running with "free") and single block steps (lock-step in either mode) interleaved: the block
    # thread's count of the helpers' ends carries over from one way of waiting to the other.
    with MultiEnvLoop(GymMaker("CartPole-v1"), balance_policy, parallel_steps=mode, **kwargs) as parallel:
        ours = [parallel.run_env_steps(40), parallel.run_steps(8), parallel.run_env_steps(40), parallel.run_steps(4)]
        episode = parallel.run_episodes(1)[0]
    with MultiEnvLoop(GymMaker("CartPole-v1"), balance_policy, parallel_steps=False, **kwargs) as sequential:
        reference = [sequential.run_env_steps(40), sequential.run_steps(8), sequential.run_env_steps(40),
                     sequential.run_steps(4)]
    assert_batches_equal(ours, reference)
    assert episode["next", "done"][-1].item()


@pytest.mark.parametrize("mode", [True, "free"])
def test_env_error_in_a_helper_thread_names_the_env_and_keeps_what_was_collected(mode):
    """Free-running, the other envs catch up with the failed one's complete steps before the error is raised."""
    with MultiEnvLoop(count_envs(4, fail_at={2: 3}), zero_policy, envs_per_thread=4, parallel_steps=mode,
                      lookahead=False) as loop:
        with pytest.raises(EnvError, match=r"env 2 failed in step at step 3: RuntimeError: env 2 step 3 broke") as info:
            loop.run_env_steps(20)
    assert info.value.partial is not None and info.value.partial.shape == (4, 3)
    assert not [t for t in threading.enumerate() if t.name.endswith("-step")]


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


def test_free_step_timeout_names_the_hung_env_while_the_others_of_its_block_run_on():
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
        assert info.value.partial is not None and info.value.partial.shape == (2, 1)  # env 1's one complete step
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
        assert collector.loop.parallel_steps and collector.loop.envs_per_thread == 4
        assert not collector.loop.free_steps  # lock-step: reproducible with a stochastic policy
        assert [tuple(b.shape) for b in collector] == [(4, 2), (4, 2)]
    finally:
        collector.shutdown()
    given = ThreadedCollector(count_envs(4), zero_policy, frames_per_batch=8, envs_per_thread=2)
    try:
        assert not given.loop.parallel_steps  # a given layout is kept as it is
    finally:
        given.shutdown()


def test_auto_layout_says_when_free_steps_would_suit_uneven_gil_releasing_steps():
    """Heavy-tailed step times: the reason names ``parallel_steps="free"`` and its price; the choice stays
    lock-step (reproducible). Even steps, or envs that go to worker processes, get no such note."""
    uneven = choose_layout(16, EnvTiming(step_s=1e-3, gil_release=0.98, step_cv=1.4), cores=2)
    assert (uneven.envs_per_thread, uneven.parallel_steps) == (16, True)
    assert "cv 1.4" in uneven.reason and "parallel_steps='free'" in uneven.reason
    assert "not reproducible" in uneven.reason
    even = choose_layout(16, EnvTiming(step_s=2e-3, gil_release=0.98, step_cv=0.05), cores=2)
    assert even.parallel_steps and "free" not in even.reason
    held = choose_layout(16, EnvTiming(step_s=100e-6, gil_release=0.05, step_cv=1.4), cores=2)
    assert held.num_workers == 2 and "free" not in held.reason
    assert "free" not in choose_layout(16, EnvTiming(step_s=1e-3, gil_release=0.98, step_cv=0.6), cores=2,
                                       uneven_cv=0.8).reason


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


def test_measure_env_reports_how_much_the_step_time_varies():
    from lightning_rollout.loop.auto import measure_env

    timing = measure_env(_AlternatingEnv, steps=10)
    assert timing.step_cv >= 0.5  # about 1: (20 - x) / (20 + x) with x ms for a no-wait step, under 0.5 past 6.7 ms
    assert timing.gil_release >= 0.3  # the sleeps release the GIL


class _WorkEnv(gym.Env):
    """Each step either sleeps ``seconds`` (a wait: no CPU) or hashes a 4 MB buffer (CPU work without the GIL:
    hashlib releases it for large inputs)."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, compute: bool) -> None:
        self.compute = compute
        self.data = bytes(4 << 20)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        if self.compute:
            import hashlib

            hashlib.sha256(self.data).digest()
        else:
            time.sleep(0.001)
        return np.zeros(1, np.float32), 1.0, False, False, {}


def _helper_affinities() -> list[set[int]]:
    return [os.sched_getaffinity(t.native_id) for t in threading.enumerate() if t.name.endswith("-step")]


_pinning = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                              reason="needs CPU affinity and at least two cores")


def _block_thread_affinity() -> set[int]:
    (owner,) = [t for t in threading.enumerate() if t.name.startswith("lightning_rollout-") and "-env" in t.name
                and not t.name.endswith("-step")]
    return os.sched_getaffinity(owner.native_id)


@_pinning
@pytest.mark.parametrize("mode", [True, "free"])
@pytest.mark.parametrize("torch_threads", [1, 2])
def test_a_block_whose_steps_wait_moves_to_one_core_with_its_block_thread(mode, torch_threads, caplog):
    allowed = os.sched_getaffinity(0)
    saved = torch.get_num_threads()
    torch.set_num_threads(torch_threads)  # the block's thread runs the policy with the loop's creator's setting
    try:
        with caplog.at_level("INFO", logger="lightning_rollout"):
            with MultiEnvLoop([lambda: _WorkEnv(compute=False)] * 4, zero_policy, envs_per_thread=4,
                              parallel_steps=mode, lookahead=False) as loop:
                loop.run_env_steps(20)  # 80 calls: the block decides after 64
                loop.run_env_steps(2)  # each helper moves before its next call
                affinities = _helper_affinities()
                policies = {os.sched_getscheduler(t.native_id) for t in threading.enumerate()
                            if t.name.endswith("-step")}
                owner = _block_thread_affinity()
                gather = loop._workers[0].envs._threads.gather_window
    finally:
        torch.set_num_threads(saved)
    assert len(affinities) == 4
    (core,) = affinities[0]  # one core, not the highest, for every helper
    assert core in allowed - {max(allowed)} and all(a == {core} for a in affinities)
    # The block's thread joins them when its forward passes run on one torch thread; else it keeps every core.
    assert owner == ({core} if torch_threads == 1 else allowed)
    assert (gather == 0) == (torch_threads == 1)  # on its helpers' core the block thread does not gather
    # and its helpers do not preempt it when they wake up
    assert policies == {os.SCHED_BATCH if torch_threads == 1 else os.SCHED_OTHER}
    assert f"move to core {core}" in caplog.text
    assert os.sched_getaffinity(0) == allowed  # the thread that built the loop keeps every core


def test_the_one_core_round_robin_starts_at_the_process_id_so_that_processes_spread():
    import multiprocessing

    from lightning_rollout.loop import block

    block._count_from_pid()
    assert next(block._placed_blocks) == os.getpid()
    if hasattr(os, "register_at_fork"):  # a forked child counts from its own id, not its parent's position
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_send_first_placed, args=(child,))
        process.start()
        assert parent.poll(30.0), "the forked child did not answer"
        first, pid = parent.recv()
        process.join(10.0)
        assert first == pid != os.getpid()


def _send_first_placed(conn) -> None:
    from lightning_rollout.loop import block

    conn.send((next(block._placed_blocks), os.getpid()))


@pytest.mark.parametrize(("share", "helpers", "cores", "placed", "expected"), [
    (0.02, 16, {0, 1}, 0, ({0}, True)),  # 0.32 of a core in all: one core, with the owner
    (0.05, 16, {0, 1, 2, 3}, 1, ({1}, True)),  # a second block: the next core but the highest
    (0.05, 16, {0, 1, 2, 3}, 3, ({0}, True)),  # round robin over the cores but the highest
    (0.1, 16, {0, 1, 2, 3}, 0, ({0, 1, 2}, False)),  # 1.6 cores in all: off the highest core, the owner stays
    (0.6, 4, {0, 1}, 0, None),  # the steps compute: nothing moves
    (0.02, 16, {3}, 0, None),  # one core: nothing to choose
])
def test_placement_puts_waiting_helpers_on_one_core_unless_they_need_more(share, helpers, cores, placed, expected):
    from lightning_rollout.loop.block import _placement

    place = _placement(share, helpers, cores, itertools.count(placed))
    assert place == (None if expected is None else (frozenset(expected[0]), expected[1]))


@_pinning
@pytest.mark.parametrize("load", ["idle", "loaded"])
def test_helpers_whose_steps_compute_keep_every_core(request, load):
    """As many computing envs as the test needs cores (two): each helper's steps run on a CPU nearly all the
    time, on a loaded machine too (their waits for a CPU are not counted as waiting)."""
    if load == "loaded":
        request.getfixturevalue("loaded_cores")
    allowed = os.sched_getaffinity(0)
    with MultiEnvLoop([lambda: _WorkEnv(compute=True)] * 2, zero_policy, envs_per_thread=2,
                      parallel_steps=True, lookahead=False) as loop:
        loop.run_env_steps(40)  # 80 calls: the helpers decide after 64
        loop.run_env_steps(2)
        affinities = _helper_affinities()
    assert len(affinities) == 2 and all(a == allowed for a in affinities)


class _NanAtFirstStep(gym.Env):
    """Its first step returns ``[env_id, nan]`` when ``nan``, else ``[env_id, 0]``."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, env_id: int, nan: bool) -> None:
        self.env_id, self.nan = env_id, nan

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.array([self.env_id, 0], np.float32), {}

    def step(self, action):
        return np.array([self.env_id, np.nan if self.nan else 0], np.float32), float(self.env_id), False, False, {}


def test_a_parallel_block_drops_the_rows_of_envs_that_return_nan_and_moves_the_others_up():
    from lightning_rollout.envs import make_adapter
    from lightning_rollout.loop.block import EnvBlock
    from lightning_rollout.specs import ArraySpec

    spec = ArraySpec((2,), np.dtype(np.float32))
    block = EnvBlock([make_adapter(_NanAtFirstStep(j, nan=j in (1, 3))) for j in range(4)], validate=True,
                     checked_next={"observation": spec}, checked_root={"observation": spec}, zero_done={},
                     parallel=True)
    try:
        for j in range(4):
            block.reset(j, None)
        block.begin({"action": np.zeros((4, 2), np.int64)}, range(4))  # action rows of zeros: action 0 for every env
        waiting = {0, 1, 2, 3}
        while waiting:
            waiting -= set(block.ended())
        obs, rewards = np.full((4, 2), -1.0, np.float32), np.full(4, -1.0)
        written, failure = block.finish(range(4), {"observation": obs}, rewards, np.zeros(4, bool),
                                        np.zeros(4, bool))
    finally:
        block.close()
    assert written == [0, 2]
    np.testing.assert_array_equal(obs[:2], [[0, 0], [2, 0]])
    np.testing.assert_array_equal(rewards[:2], [0.0, 2.0])
    assert failure is not None and (failure.j, failure.phase) == (1, "check") and "NaN" in str(failure)


class _HangingEnv(gym.Env):
    """Env ``hung`` blocks in its step ``at`` until ``release`` is set; the others end an episode every step
    (so their block thread resets them between steps)."""

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
def test_step_timeout_names_the_hung_env_of_a_parallel_block_not_the_first_one_started(mode):
    """Env 2 of a block of 4 hangs in its second step while the others end (and are reset) around it: the
    timeout names env 2, whether the block waits for every env (lock-step) or the others run on ("free")."""
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


class _CountingLock:
    """Wraps ``_StepThreads._all``: counts the owner's waits on it and says when the owner is waiting."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock, self.waits, self.waiting = lock, 0, threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        self.waits += 1
        self.waiting.set()
        return self.lock.acquire(blocking, timeout)

    def release(self) -> None:
        self.lock.release()


class _CountedEnds:
    """Wraps ``_StepThreads._count_lock``: sets ``reached`` once the helpers' count of ended calls is at least
    ``until`` (checked as each helper leaves the lock after counting), so a test waits for a state, not a time."""

    def __init__(self, threads) -> None:
        self.threads, self.lock = threads, threads._count_lock
        self.until, self.reached = 0, threading.Event()

    def expect(self, until: int) -> threading.Event:
        self.reached.clear()
        self.until = until
        if self.threads._count >= until:
            self.reached.set()
        return self.reached

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *exc) -> None:
        if self.threads._count >= self.until:
            self.reached.set()
        self.lock.release()


def test_a_lock_step_round_wakes_its_owner_once_when_its_last_env_ends():
    """The owner sleeps through the ends of the other calls of a lock-step round (each used to wake it) and
    is woken by the last one; calls that all ended before it looks do not wake it, nor leave a wake-up
    behind for the next round."""
    from lightning_rollout.loop.block import _StepThreads

    threads = _StepThreads(3, name="t", env_ids=[0, 1, 2])
    counting = threads._all = _CountingLock(threads._all)
    counted = threads._count_lock = _CountedEnds(threads)
    try:
        gates = [threading.Event() for _ in range(3)]
        threads.start((j, lambda e: e.wait(10.0), gates[j]) for j in range(3))
        got: list[list[int]] = []
        owner = threading.Thread(target=lambda: got.append(threads.ended(None, 3, every=True)))
        owner.start()
        assert counting.waiting.wait(10.0)
        for j in (2, 0):  # two calls end while the owner waits: it sleeps on
            gates[j].set()
        gates[1].set()
        owner.join(10.0)
        assert not owner.is_alive() and sorted(got[0]) == [0, 1, 2]
        assert counting.waits == 1
        # a round whose calls all end before the owner looks: it does not wait at all
        threads.start((j, lambda arg: arg, j) for j in range(3))
        assert counted.expect(6).wait(10.0) and threads._count == 6
        assert sorted(threads.ended(None, 3, every=True)) == [0, 1, 2]
        assert counting.waits == 1
        gates = [threading.Event() for _ in range(2)]  # and the next round still waits for its last call
        counting.waiting.clear()
        threads.start((j, lambda e: e.wait(10.0), gates[j]) for j in range(2))
        got.clear()
        owner = threading.Thread(target=lambda: got.append(threads.ended(None, 2, every=True)))
        owner.start()
        assert counting.waiting.wait(10.0)
        gates[0].set()
        assert counted.expect(7).wait(10.0) and threads._count == 7
        assert owner.is_alive() and not got  # one call of two ended and was counted: the owner still waits
        gates[1].set()
        owner.join(10.0)
        assert sorted(got[0]) == [0, 1] and counting.waits == 2
    finally:
        threads.close()


class _RaiseAtFirstStep(_NanAtFirstStep):
    def step(self, action):
        raise RuntimeError(f"env {self.env_id} broke")


@pytest.mark.parametrize(("nan", "raises", "expected"), [
    ({1, 3}, {2}, (1, "check", "NaN")),  # a NaN before the env that raised: the NaN, as stepped in order
    ({3}, {1}, (1, "step", "env 1 broke")),  # the env that raised comes first
    (set(), set(), None),
])
def test_a_lock_step_parallel_step_writes_every_row_and_raises_the_first_failure_in_env_order(nan, raises, expected):
    """Every env's row is written; the step raises the failure of the lowest env index, whether its step raised
    or its observation failed the check, as a sequential step would."""
    from lightning_rollout.envs import make_adapter
    from lightning_rollout.loop.block import EnvBlock, EnvFailure
    from lightning_rollout.specs import ArraySpec

    spec = ArraySpec((2,), np.dtype(np.float32))
    envs = [_RaiseAtFirstStep(j, nan=False) if j in raises else _NanAtFirstStep(j, nan=j in nan) for j in range(4)]
    block = EnvBlock([make_adapter(env) for env in envs], validate=True, checked_next={"observation": spec},
                     checked_root={"observation": spec}, zero_done={}, parallel=True)
    obs, rewards = np.full((4, 2), -1.0, np.float32), np.full(4, -1.0)
    terminated, truncated = np.ones(4, bool), np.ones(4, bool)
    try:
        for j in range(4):
            block.reset(j, None)
        actions = {"action": np.tile([1, 0], (4, 1))}
        if expected is None:
            block.step(actions, range(4), {"observation": obs}, rewards, terminated, truncated)
        else:
            with pytest.raises(EnvFailure) as info:
                block.step(actions, range(4), {"observation": obs}, rewards, terminated, truncated)
    finally:
        block.close()
    if expected is None:
        np.testing.assert_array_equal(obs, [[j, 0] for j in range(4)])
        np.testing.assert_array_equal(rewards, [0.0, 1.0, 2.0, 3.0])
        assert not terminated.any() and not truncated.any()
    else:
        failure = info.value
        assert (failure.j, failure.phase) == expected[:2] and expected[2] in str(failure)
