"""MultiEnvLoop / EnvLoop: the seed's tests, data integrity, batching, events, faults, configuration.

The mock env's observation is ``[env_id, episode, t]``, so every check below is
exact: a lost, duplicated or reordered transition breaks the continuity of its
env's stream.
"""

from __future__ import annotations

import random
import threading
from collections import defaultdict

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.envs.utils import ExplorationType

from lightning_rollout import (AutobatchPolicy, CollectionError, EnvError, EnvLoop, EpisodeEnd, EventProcessor,
                               Interrupter, MultiEnvLoop, PolicyError, TimeStep)
from conftest import ArgmaxNet, CountingPolicy, MockEnv, called_from_probe, default_length, default_reward, mock_envs

pytestmark = pytest.mark.timeout(60)

# The seed's (num_envs, autobatch_size) matrix.
MATRIX = [(1, 1), (4, 4), (1, 2), (1, 3), (2, 3), (2, 4), (5, 19), (2, 1), (8, 1), (3, 2), (8, 2), (8, 3), (8, 7)]


def smallest_divisor(n: int) -> int:
    return next((d for d in range(2, n + 1) if n % d == 0), 1)


# envs_per_thread > 1 wherever it divides num_envs
GROUPED = [(n, a, smallest_divisor(n)) for n, a in MATRIX if smallest_divisor(n) > 1]


def flat(td: TensorDict, key) -> np.ndarray:
    return td.get(key).numpy()


# -- stream checks -----------------------------------------------------------------------------------

class StreamChecker:
    """Accumulates step-mode batches and checks every env's stream and bookkeeping.

    * continuity: ``("next","observation")`` of step t is ``observation`` of step t+1
      unless step t is done, and a step after a done starts a fresh episode (t == 0);
    * ``step_count`` / ``episode_reward`` agree with the rewards, reward matches the env;
    * ``done == terminated | truncated``, root flags are False;
    * trajectory ids: one per (env, episode), never shared.
    """

    def __init__(self) -> None:
        self.last: dict[int, tuple[np.ndarray, bool]] = {}  # env -> (next obs, done) of its last step
        self.steps: dict[int, int] = defaultdict(int)
        self.traj_of: dict[tuple[int, int], int] = {}
        self.episodes_seen: set[tuple[int, int]] = set()
        self.dones = 0

    def cut(self, env_ids) -> None:
        """On-policy loops (no staged step): run_episodes cut these envs' running episodes after their
        last delivered step, so their next step-mode step starts a fresh episode."""
        for e in env_ids:
            if e in self.last:
                self.last[e] = (self.last[e][0], True)

    def add(self, td: TensorDict) -> None:
        if td.batch_dims == 2:  # [env, time] -> time-major arrival order, env by env
            td = td.transpose(0, 1).reshape(-1)
        n = td.shape[0]
        obs, nobs = flat(td, "observation"), flat(td, ("next", "observation"))
        env_ids, traj = flat(td, ("collector", "env_id")), flat(td, ("collector", "traj_ids"))
        reward = flat(td, ("next", "reward"))[:, 0]
        term, trunc, done = (flat(td, ("next", k))[:, 0] for k in ("terminated", "truncated", "done"))
        sc, nsc = flat(td, "step_count")[:, 0], flat(td, ("next", "step_count"))[:, 0]
        er, ner = flat(td, "episode_reward")[:, 0], flat(td, ("next", "episode_reward"))[:, 0]
        assert np.array_equal(done, term | trunc)
        for key in ("done", "terminated", "truncated"):
            assert not td.get(key).any()
        assert td.get("policy_version").shape == (n,)
        self.dones += int(done.sum())
        for r in range(n):
            e = int(env_ids[r])
            assert obs[r][0] == e and nobs[r][0] == e, "row stored under the wrong env id"
            ep, t = int(obs[r][1]), int(obs[r][2])
            if e in self.last:
                prev_next, prev_done = self.last[e]
                if prev_done:
                    assert t == 0, f"env {e}: step after a done does not start an episode: {obs[r]}"
                    assert (e, ep) not in self.episodes_seen, f"env {e}: episode {ep} seen twice"
                else:
                    assert np.array_equal(prev_next, obs[r]), \
                        f"env {e}: stream broken (lost or duplicated step): {prev_next} then {obs[r]}"
            else:
                assert t == 0 or (e, ep) not in self.episodes_seen
            self.last[e] = (nobs[r], bool(done[r]))
            self.steps[e] += 1
            # bookkeeping
            assert sc[r] == t and nsc[r] == t + 1
            assert reward[r] == pytest.approx(default_reward(e, ep, t))
            expected_before = sum(default_reward(e, ep, i) for i in range(t))
            assert er[r] == pytest.approx(expected_before)
            assert ner[r] == pytest.approx(expected_before + reward[r])
            if term[r]:
                assert t + 1 == default_length(e, ep) and nobs[r][2] == t + 1
            # trajectory ids
            key = (e, ep)
            if key in self.traj_of:
                assert self.traj_of[key] == traj[r], f"env {e} episode {ep} changed traj id"
            else:
                assert traj[r] not in self.traj_of.values(), "a traj id was reused"
                self.traj_of[key] = int(traj[r])
            if done[r]:
                self.episodes_seen.add(key)


def check_trajectory(td: TensorDict, *, truncate_at: int | None = None) -> tuple[int, int, int]:
    """A complete, fresh trajectory; returns ``(env_id, episode, traj_id)``."""
    T = td.shape[0]
    assert td.batch_dims == 1 and T > 0
    obs, nobs = flat(td, "observation"), flat(td, ("next", "observation"))
    done = flat(td, ("next", "done"))[:, 0]
    assert done[-1] and not done[:-1].any(), "trajectory must end with its only done"
    e, ep = int(obs[0][0]), int(obs[0][1])
    assert obs[0][2] == 0, "a trajectory starts with a fresh reset"
    assert (obs[:, 0] == e).all() and (obs[:, 1] == ep).all()
    assert np.array_equal(obs[:, 2], np.arange(T))
    assert np.array_equal(nobs[:-1], obs[1:])
    assert (flat(td, ("collector", "env_id")) == e).all()
    traj = flat(td, ("collector", "traj_ids"))
    assert (traj == traj[0]).all()
    assert np.array_equal(flat(td, "step_count")[:, 0], np.arange(T))
    rewards = flat(td, ("next", "reward"))[:, 0]
    assert flat(td, ("next", "episode_reward"))[-1, 0] == pytest.approx(rewards.sum())
    expected_len = default_length(e, ep) if truncate_at is None else min(truncate_at, default_length(e, ep))
    assert T == expected_len
    return e, ep, int(traj[0])


class Trajectories:
    """Checks a sequence of run_episodes results: complete, fresh, unique traj ids."""

    def __init__(self) -> None:
        self.keys: set[tuple[int, int]] = set()
        self.traj_ids: set[int] = set()

    def add(self, trajectories: list[TensorDict], stream: StreamChecker | None = None) -> None:
        for td in trajectories:
            e, ep, traj = check_trajectory(td)
            assert (e, ep) not in self.keys and traj not in self.traj_ids
            if stream is not None:
                assert (e, ep) not in stream.traj_of, "an episode was returned by both run_steps and run_episodes"
                assert traj not in stream.traj_of.values()
            self.keys.add((e, ep))
            self.traj_ids.add(traj)


# -- the seed's tests --------------------------------------------------------------------------------

def test_env_loop_run_steps_returns_requested_number():
    with EnvLoop(mock_envs(1), CountingPolicy(), autobatch_size=1) as loop:
        stream = StreamChecker()
        for n in (1, 8):
            td = loop.run_steps(n)
            assert td.batch_size == (n,)
            stream.add(td)


def test_env_loop_run_episodes_returns_complete_fresh_trajectories():
    with EnvLoop(mock_envs(1), CountingPolicy(), autobatch_size=1) as loop:
        seen = Trajectories()
        for k in (1, 8):
            trajectories = loop.run_episodes(k)
            assert len(trajectories) == k
            seen.add(trajectories)


def run_steps_matrix(loop: MultiEnvLoop) -> None:
    stream = StreamChecker()
    warmup = loop.run_steps(8)  # past the double-batching start-up
    assert warmup.batch_size == (8,)
    stream.add(warmup)
    for i in range(17):
        td = loop.run_steps(i)
        assert td.batch_size == (i,)
        stream.add(td)
    assert sum(stream.steps.values()) == 8 + sum(range(17))


@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "on_policy"])
@pytest.mark.parametrize("num_envs, autobatch_size", MATRIX)
def test_run_steps_returns_exactly_the_requested_number_in_order(num_envs, autobatch_size, lookahead):
    with MultiEnvLoop(mock_envs(num_envs), CountingPolicy(), autobatch_size=autobatch_size,
                      lookahead=lookahead) as loop:
        run_steps_matrix(loop)


@pytest.mark.parametrize("num_envs, autobatch_size, envs_per_thread", GROUPED)
def test_run_steps_with_several_envs_per_thread(num_envs, autobatch_size, envs_per_thread):
    with MultiEnvLoop(mock_envs(num_envs), CountingPolicy(), autobatch_size=autobatch_size,
                      envs_per_thread=envs_per_thread) as loop:
        run_steps_matrix(loop)
        groups = num_envs // envs_per_thread  # one group: stepped in the calling thread; else a pool thread each
        assert len(list(loop.threads())) == (0 if groups == 1 else groups)


@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "on_policy"])
def test_run_steps_from_one_env_thread_is_run_env_steps_read_in_time_order(lookahead):
    """With every env in one thread, ``run_steps`` writes its whole rounds as one quota: its rows are
    ``run_env_steps``' batch read in time order (env by env within a step), value for value, including
    when a call is not a whole number of rounds (the rest of its last round opens the next call)."""
    net = ArgmaxNet()
    with (MultiEnvLoop(mock_envs(3), net, envs_per_thread=3, lookahead=lookahead) as flat_loop,
          MultiEnvLoop(mock_envs(3), net, envs_per_thread=3, lookahead=lookahead) as grid_loop):
        rows = torch.cat([flat_loop.run_steps(n) for n in (12, 7, 5, 0, 6)])  # 30 rows: 10 rounds
        grid = grid_loop.run_env_steps(10)
    expected = grid.transpose(0, 1).reshape(-1)
    assert rows["next", "done"].any()
    for key in expected.keys(True, True):
        assert torch.equal(rows[key], expected[key]), key


def run_episodes_matrix(loop: MultiEnvLoop) -> None:
    seen = Trajectories()
    warmup = loop.run_episodes(8)
    assert len(warmup) == 8
    seen.add(warmup)
    for i in range(17):
        trajectories = loop.run_episodes(i)
        assert len(trajectories) == i
        seen.add(trajectories)


@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "on_policy"])
@pytest.mark.parametrize("num_envs, autobatch_size", MATRIX)
def test_run_episodes_returns_complete_fresh_trajectories(num_envs, autobatch_size, lookahead):
    with MultiEnvLoop(mock_envs(num_envs), CountingPolicy(), autobatch_size=autobatch_size,
                      lookahead=lookahead) as loop:
        run_episodes_matrix(loop)


@pytest.mark.parametrize("num_envs, autobatch_size, envs_per_thread", GROUPED)
def test_run_episodes_with_several_envs_per_thread(num_envs, autobatch_size, envs_per_thread):
    with MultiEnvLoop(mock_envs(num_envs), CountingPolicy(), autobatch_size=autobatch_size,
                      envs_per_thread=envs_per_thread) as loop:
        run_episodes_matrix(loop)


def test_run_episodes_asks_a_random_subset_when_fewer_than_num_envs():
    with MultiEnvLoop(mock_envs(8), CountingPolicy(), autobatch_size=8) as loop:
        trajectories = loop.run_episodes(3, rng=random.Random(0))
        envs = [int(flat(td, ("collector", "env_id"))[0]) for td in trajectories]
        assert envs == random.Random(0).sample(range(8), 3)


MIXED = [("steps", 5), ("episodes", 3), ("env_steps", 2), ("steps", 7), ("episodes", 1), ("steps", 1),
         ("env_steps", 3), ("episodes", 6), ("steps", 12), ("steps", 0), ("env_steps", 1), ("episodes", 0),
         ("steps", 4)]


@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "on_policy"])
@pytest.mark.parametrize("num_envs, autobatch_size, envs_per_thread",
                         [(1, 1, 1), (4, 4, 1), (3, 2, 1), (8, 3, 1), (4, 2, 2), (8, 7, 4)])
def test_mixed_call_sequences_lose_and_duplicate_nothing(num_envs, autobatch_size, envs_per_thread, lookahead):
    g = envs_per_thread
    with MultiEnvLoop(mock_envs(num_envs), CountingPolicy(), autobatch_size=autobatch_size,
                      envs_per_thread=g, lookahead=lookahead) as loop:
        stream, seen = StreamChecker(), Trajectories()
        for kind, n in MIXED:
            if kind == "steps":
                td = loop.run_steps(n * g)  # whole blocks, so run_env_steps may follow
                assert td.batch_size == (n * g,)
                stream.add(td)
            elif kind == "env_steps":
                td = loop.run_env_steps(n)
                assert td.batch_size == (num_envs, n) and td.names == [None, "time"]
                for i in range(num_envs):  # row i is env i
                    assert (flat(td, ("collector", "env_id"))[i] == i).all()
                stream.add(td)
            else:
                trajectories = loop.run_episodes(n)
                assert len(trajectories) == n
                seen.add(trajectories, stream)
                if not lookahead:
                    stream.cut({int(flat(td, ("collector", "env_id"))[0]) for td in trajectories})
        # run_episodes cut the running step-mode episode of the envs it took: truncated, not terminated
        assert stream.dones > 0


def test_staged_step_of_a_cut_episode_is_delivered_truncated():
    lengths = {0: 50}  # episode 0 of env 0 is long; every other episode is 2 steps

    with MultiEnvLoop(mock_envs(1, length_fn=lambda e, ep: lengths.get(ep, 2)), CountingPolicy(),
                      autobatch_size=1) as loop:
        first = loop.run_steps(2)
        assert not first.get(("next", "done")).any()
        [episode] = loop.run_episodes(1)
        assert flat(episode, "observation")[0][1] > 0  # a fresh episode, not the tail of episode 0
        after = loop.run_steps(1)
        if loop.lookahead:
            # the step that was staged before run_episodes: episode 0's third step, cut there
            assert flat(after, "observation")[0].tolist() == [0, 0, 2]
            # what the step ended with, not the root of the episode after it
            assert flat(after, ("next", "observation"))[0].tolist() == [0, 0, 3]
            assert after.get(("next", "truncated")).all() and not after.get(("next", "terminated")).any()
            assert after.get(("next", "done")).all()


@pytest.mark.parametrize("lookahead", [True, False])
def test_a_reset_between_calls_keeps_the_observation_the_last_step_ended_with(lookahead):
    # The env's next step starts from the reset's root; the step before it (delivered, or staged ahead and
    # delivered cut) still ends with the observation the env returned, not the reset's.
    with MultiEnvLoop(mock_envs(2, length_fn=lambda e, ep: 50), CountingPolicy(), autobatch_size=2,
                      lookahead=lookahead) as loop:
        first = loop.run_env_steps(2)
        assert first.get(("next", "observation"))[:, -1, 2].tolist() == [2, 2]
        loop.reset_envs([1])
        after = loop.run_env_steps(2)
        obs, nxt = after.get("observation"), after.get(("next", "observation"))
        if lookahead:  # env 1's staged step, cut: it ends where the env was, then the new episode starts
            assert obs[1, 0].tolist() == [1, 0, 2] and nxt[1, 0].tolist() == [1, 0, 3]
            assert after.get(("next", "truncated"))[1, 0].all()
            assert obs[1, 1].tolist() == [1, 1, 0]
        else:
            assert obs[1, 0].tolist() == [1, 1, 0] and nxt[1, 0].tolist() == [1, 1, 1]
        assert obs[0].tolist() == [[0, 0, 2], [0, 0, 3]] and nxt[0].tolist() == [[0, 0, 3], [0, 0, 4]]
        # every step's root is the "next" of the step before it, within an episode
        done = after.get(("next", "done")).squeeze(-1)
        assert torch.equal(obs[:, 1:][~done[:, :-1]], nxt[:, :-1][~done[:, :-1]])


# -- data layout ---------------------------------------------------------------------------------------

def test_run_env_steps_rows_are_each_envs_consecutive_steps():
    with MultiEnvLoop(mock_envs(3), CountingPolicy(), autobatch_size=3) as loop:
        td = loop.run_env_steps(4)
        assert td.batch_size == (3, 4)
        obs = flat(td, "observation")
        for i in range(3):
            assert (obs[i, :, 0] == i).all()
        StreamChecker().add(td)


@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "on_policy"])
@pytest.mark.parametrize("steps", [1, 2, 3, 130])
def test_run_env_steps_bookkeeping_is_step_by_step_whatever_the_batch_length(steps, lookahead):
    # A run of steps settles its counters in one go; episodes of 2 to 4 steps end inside every batch of more
    # than one step, at its last step, and across batches (130 steps: past the storage's wrap-around).
    with MultiEnvLoop(mock_envs(3), CountingPolicy(), envs_per_thread=3, lookahead=lookahead) as loop:
        stream = StreamChecker()
        for _ in range(max(2, 12 // steps)):
            stream.add(loop.run_env_steps(steps))
        assert stream.dones > 0


@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "on_policy"])
def test_is_init_marks_the_first_step_of_every_episode_as_torchrls_init_tracker_does(lookahead):
    with MultiEnvLoop("CartPole-v1", None, num_envs=3, envs_per_thread=3, lookahead=lookahead, seed=1) as loop:
        first, second = loop.run_env_steps(40), loop.run_env_steps(40)
    td = torch.cat([first, second], dim=1)
    assert td["next", "done"].any()
    is_init, done = td["is_init"][..., 0], td["next", "done"][..., 0]
    assert is_init[:, 0].all(), "the first step after the construction's reset"
    assert torch.equal(is_init[:, 1:], done[:, :-1]), "after every done step, and only there"
    assert not td["next", "is_init"].any()


def test_storage_grows_for_a_longer_batch_and_keeps_the_steps_not_handed_out():
    # run_steps leaves a step written ahead (lookahead) in a storage of a few rows; a longer batch then needs
    # more rows, and the stream goes on without a gap or a duplicate
    with MultiEnvLoop(mock_envs(2), CountingPolicy(), envs_per_thread=2) as loop:
        stream = StreamChecker()
        for call in (lambda: loop.run_steps(2), lambda: loop.run_env_steps(40), lambda: loop.run_steps(6),
                     lambda: loop.run_env_steps(3), lambda: loop.run_env_steps(90)):
            stream.add(call())
        assert stream.dones > 0


def test_transition_dtypes_and_shapes_follow_torchrl():
    with MultiEnvLoop(mock_envs(2), CountingPolicy(), autobatch_size=2) as loop:
        td = loop.run_steps(4)
    assert td.get(("next", "reward")).shape == (4, 1) and td.get(("next", "reward")).dtype == torch.float32
    for key in ("done", "terminated", "truncated", ("next", "done"), ("next", "terminated"), ("next", "truncated")):
        assert td.get(key).shape == (4, 1) and td.get(key).dtype == torch.bool
    assert td.get("observation").shape == (4, 3) and td.get("action").shape == (4,)
    assert td.get("policy_version").dtype == torch.int64


def test_traj_ids_are_unique_per_trajectory_and_continue_from_traj_id_start():
    with MultiEnvLoop(mock_envs(2), CountingPolicy(), autobatch_size=2, traj_id_start=100) as loop:
        stream = StreamChecker()
        stream.add(loop.run_steps(20))
        assert min(stream.traj_of.values()) >= 100
        assert len(set(stream.traj_of.values())) == len(stream.traj_of)


def test_time_limited_episode_ends_truncated_and_emits_episode_end():
    processor = Recorder()
    with MultiEnvLoop(mock_envs(2), CountingPolicy(), autobatch_size=2, max_episode_steps=2,
                      processor=processor) as loop:
        td = loop.run_steps(8)
        [episode] = loop.run_episodes(1)
    term, trunc = td.get(("next", "terminated"))[:, 0], td.get(("next", "truncated"))[:, 0]
    done = td.get(("next", "done"))[:, 0]
    assert torch.equal(done, term | trunc)
    assert not term.any()  # every mock episode lasts >= 3 steps: the cap at 2 cuts them all
    assert torch.equal(trunc, td.get(("next", "step_count"))[:, 0] == 2)
    assert episode.shape == (2,) and episode.get(("next", "truncated"))[-1].item()
    assert all(e.truncated and not e.terminated and e.length == 2 for e in processor.ends)
    assert len(processor.ends) == int(done.sum()) + 1


def test_env_truncation_is_kept_apart_from_termination():
    # MockEnv truncates itself at step 4; episodes of length 3 terminate first
    with MultiEnvLoop(mock_envs(4, truncate_at=4), CountingPolicy(), autobatch_size=4) as loop:
        td = loop.run_env_steps(12)
    term, trunc = td.get(("next", "terminated")), td.get(("next", "truncated"))
    assert term.any() and trunc.any() and not (term & trunc).any()
    assert torch.equal(td.get(("next", "done")), term | trunc)
    assert (td.get(("next", "step_count"))[trunc] == 4).all()


def test_random_steps_per_env_come_first_with_version_minus_one():
    with MultiEnvLoop(mock_envs(2), CountingPolicy(), autobatch_size=2, random_steps_per_env=3) as loop:
        td = loop.run_env_steps(5)
    versions = td.get("policy_version")
    assert (versions[:, :3] == -1).all() and (versions[:, 3:] == 0).all()


def test_gymnasium_id_string_is_accepted():
    policy = lambda obs: torch.zeros(obs.shape[0], dtype=torch.long)  # noqa: E731
    with MultiEnvLoop("CartPole-v1", policy, num_envs=2, seed=0) as loop:
        td = loop.run_steps(6)
        assert td.get("observation").shape == (6, 4)
        assert torch.equal(td.get(("next", "done")), td.get(("next", "terminated")) | td.get(("next", "truncated")))


# -- autobatching through the loop ---------------------------------------------------------------------

@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "on_policy"])
@pytest.mark.parametrize("autobatch_size", [4, None])
def test_n_envs_with_autobatch_size_n_act_in_forward_passes_of_n(autobatch_size, lookahead):
    counting = CountingPolicy()
    with MultiEnvLoop(mock_envs(4), counting, autobatch_size=autobatch_size, lookahead=lookahead) as loop:
        for _ in range(5):
            loop.run_steps(8)
        loop.run_env_steps(6)
        assert counting.calls > 0
        assert counting.batch_sizes == [4] * counting.calls
        assert counting.mean_batch_size == 4 == loop.policy.mean_batch_size


def test_several_envs_per_thread_are_one_request_of_several_rows():
    counting = CountingPolicy()
    with MultiEnvLoop(mock_envs(4), counting, envs_per_thread=4) as loop:
        StreamChecker().add(loop.run_steps(12))
    assert counting.batch_sizes == [4] * counting.calls


def test_two_loops_can_share_one_policy_without_deadlock(within):
    counting = CountingPolicy()
    shared = AutobatchPolicy(counting, autobatch_size=None)
    try:
        with EnvLoop(mock_envs(1), shared, name="a") as a, EnvLoop(mock_envs(1), shared, name="b") as b:
            for _ in range(3):
                assert within(lambda: a.run_steps(5)).batch_size == (5,)
                assert within(lambda: b.run_steps(3)).batch_size == (3,)
                assert len(within(lambda: a.run_episodes(1))) == 1
    finally:
        shared.close()


def test_interrupted_loop_does_not_stall_another_loop_sharing_its_policy(within):
    shared = AutobatchPolicy(CountingPolicy(), autobatch_size=None)
    interrupter = Interrupter()
    try:
        with MultiEnvLoop(mock_envs(3), shared, name="a") as a, MultiEnvLoop(mock_envs(2), shared, name="b") as b:
            stream_a = StreamChecker()
            # stopped after its 2nd step: requests are still in flight when the call returns
            stream_a.add(within(lambda: a.run_steps(1000, interrupter=interrupter,
                                                    processor=StopAfter(interrupter, 2))))
            assert within(lambda: b.run_steps(10)).shape == (10,)
            assert len(within(lambda: b.run_episodes(2))) == 2
            interrupter.reset()
            stream_a.add(within(lambda: a.run_steps(9)))
    finally:
        shared.close()


# -- policy versions ---------------------------------------------------------------------------------

class VersionedPolicy(torch.nn.Module):
    """A module whose action is its (integer) weight, so each transition shows the weights it used."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()), requires_grad=False)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.full((obs.shape[0],), int(self.w.item()), dtype=torch.long)


@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "on_policy"])
def test_every_transition_carries_the_policy_version_that_acted(lookahead):
    module = TensorDictModule(VersionedPolicy(), in_keys=["observation"], out_keys=["action"])
    with MultiEnvLoop(mock_envs(3), module, autobatch_size=3, lookahead=lookahead) as loop:
        before = loop.run_env_steps(2)
        assert (before.get("policy_version") == 0).all()
        assert loop.update_policy({"module.w": torch.tensor(1.0)}) == 1
        after = loop.run_env_steps(3)
    versions = after.get("policy_version")
    assert torch.equal(after.get("action"), versions)  # the version says which weights acted
    if lookahead:
        # at most the one step each env had staged before the update was acted with the old weights
        assert (versions[:, 1:] == 1).all()
    else:
        assert (versions == 1).all()


# -- events ---------------------------------------------------------------------------------------

class Recorder(EventProcessor):
    def __init__(self, wants_timesteps: bool = False) -> None:
        self.wants_timesteps = wants_timesteps
        self.thread = threading.current_thread()
        self.steps: list[TimeStep] = []
        self.ends: list[EpisodeEnd] = []
        self.eval_steps: list[TimeStep] = []
        self.eval_ends: list[EpisodeEnd] = []

    def _here(self) -> None:
        assert threading.current_thread() is self.thread, "events must be delivered in the driver's thread"

    def on_timestep(self, step):
        self._here()
        self.steps.append(step)

    def on_episode_end(self, episode):
        self._here()
        self.ends.append(episode)

    def on_eval_timestep(self, step):
        self._here()
        self.eval_steps.append(step)

    def on_eval_episode_end(self, episode):
        self._here()
        self.eval_ends.append(episode)


def test_episode_end_events_match_finished_episodes_and_timesteps_are_off_by_default():
    processor = Recorder()
    with MultiEnvLoop(mock_envs(3), CountingPolicy(), autobatch_size=3, processor=processor) as loop:
        td = loop.run_steps(30)
    done = td.get(("next", "done"))[:, 0]
    assert processor.steps == [] and processor.eval_steps == [] and processor.eval_ends == []
    assert len(processor.ends) == int(done.sum()) > 0
    rows = torch.nonzero(done)[:, 0].tolist()
    for end, r in zip(processor.ends, rows):
        assert end.env_id == td.get(("collector", "env_id"))[r].item()
        assert end.length == td.get(("next", "step_count"))[r, 0].item()
        assert end.reward == pytest.approx(td.get(("next", "episode_reward"))[r, 0].item())
        assert end.terminated and not end.truncated and not end.eval
        assert end.progress.frames == r + 1


def test_timestep_events_when_the_processor_wants_them():
    processor = Recorder(wants_timesteps=True)
    with MultiEnvLoop(mock_envs(2), CountingPolicy(), autobatch_size=2) as loop:
        td = loop.run_steps(10, processor=processor)
        loop.run_env_steps(2, processor=processor)
    assert len(processor.steps) == 14
    assert [s.progress.frames for s in processor.steps] == list(range(1, 15))
    for step, r in zip(processor.steps, range(10)):
        assert step.env_id == td.get(("collector", "env_id"))[r].item()
        assert step.reward == pytest.approx(td.get(("next", "reward"))[r, 0].item())
        assert step.step_count == td.get(("next", "step_count"))[r, 0].item()
        assert step.done == td.get(("next", "done"))[r, 0].item()


def test_eval_loop_calls_the_eval_hooks_only():
    processor = Recorder(wants_timesteps=True)
    with MultiEnvLoop(mock_envs(2), CountingPolicy(), autobatch_size=2, eval=True,
                      exploration_type=ExplorationType.DETERMINISTIC) as loop:
        trajectories = loop.run_episodes(3, processor=processor)
    assert processor.steps == [] and processor.ends == []
    assert len(processor.eval_ends) == 3 and all(e.eval for e in processor.eval_ends)
    assert len(processor.eval_steps) == sum(td.shape[0] for td in trajectories)
    assert sorted(e.length for e in processor.eval_ends) == sorted(td.shape[0] for td in trajectories)


def test_run_episodes_emits_one_episode_end_per_trajectory():
    processor = Recorder()
    with MultiEnvLoop(mock_envs(2), CountingPolicy(), autobatch_size=2, processor=processor) as loop:
        trajectories = loop.run_episodes(5)
    assert len(processor.ends) == 5
    assert sorted(e.reward for e in processor.ends) == pytest.approx(
        sorted(float(td.get(("next", "reward")).sum()) for td in trajectories))


# -- interrupter ------------------------------------------------------------------------------------

class StopAfter(EventProcessor):
    wants_timesteps = True

    def __init__(self, interrupter: Interrupter, after: int) -> None:
        self.interrupter, self.after, self.seen = interrupter, after, 0

    def on_timestep(self, step):
        self.seen += 1
        if self.seen == self.after:
            self.interrupter.stop()


@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "on_policy"])
def test_interrupted_run_steps_returns_early_and_loses_nothing(lookahead, within):
    interrupter = Interrupter()
    with MultiEnvLoop(mock_envs(3), CountingPolicy(), autobatch_size=3, lookahead=lookahead) as loop:
        stream = StreamChecker()
        td = within(lambda: loop.run_steps(1000, interrupter=interrupter,
                                          processor=StopAfter(interrupter, 5)))
        assert 5 <= td.shape[0] < 1000
        stream.add(td)
        assert within(lambda: loop.run_steps(7, interrupter=interrupter)).shape == (0,)  # still stopped
        interrupter.reset()
        stream.add(within(lambda: loop.run_steps(20, interrupter=interrupter)))
        assert sum(stream.steps.values()) == td.shape[0] + 20


class _CutAt(MockEnv):
    """Stops ``interrupter`` at its ``at``-th step (counted from 0); stepped in the calling thread (both envs in
    one group), the call ends right after that round."""

    def __init__(self, env_id: int, interrupter: Interrupter, at: int) -> None:
        super().__init__(env_id)
        self.interrupter, self.at = interrupter, at

    def step(self, action):
        result = super().step(action)
        if self.num_steps - 1 == self.at:
            self.interrupter.stop()
        return result


@pytest.mark.parametrize("first", ["run_env_steps", "run_steps"])
def test_steps_left_by_a_call_cut_short_reach_the_next_calls_whatever_their_size(first, within):
    """A call cut short keeps what it stepped past the cut; the next calls, of one step an env, deliver it in
    order."""
    interrupter = Interrupter()
    factories = [lambda: _CutAt(0, interrupter, 2), lambda: MockEnv(1)]
    with MultiEnvLoop(factories, CountingPolicy(), envs_per_thread=2, lookahead=True) as loop:
        stream = StreamChecker()
        if first == "run_env_steps":
            td = within(lambda: loop.run_env_steps(8, interrupter=interrupter))
            assert td.shape == (2, 3)
        else:
            td = within(lambda: loop.run_steps(16, interrupter=interrupter))
            assert td.shape == (6,)
        stream.add(td)
        interrupter.reset()
        for _ in range(4):
            stream.add(within(lambda: loop.run_env_steps(1)))
        assert dict(stream.steps) == {0: 7, 1: 7}


def test_interrupted_run_episodes_returns_what_finished(within):
    interrupter = Interrupter()
    interrupter.stop()
    with MultiEnvLoop(mock_envs(2), CountingPolicy(), autobatch_size=2) as loop:
        assert len(within(lambda: loop.run_episodes(100, interrupter=interrupter))) < 100
        interrupter.reset()
        Trajectories().add(within(lambda: loop.run_episodes(3, interrupter=interrupter)))



def test_episodes_of_an_interrupted_run_episodes_never_answer_a_later_call_and_still_start_new_trajectories(within):
    """An interrupted call's episode requests still run. Their episodes are dropped, not returned by the next
    ``run_episodes`` (they ran before it was called, maybe with older weights), and the env's next steps start a
    new trajectory as they would have had the call waited for them."""
    from process_helpers import CountEnv

    stopped = Interrupter()
    stopped.stop()
    with MultiEnvLoop([lambda: CountEnv(0, length=5)], CountingPolicy(), lookahead=False) as loop:
        first = within(lambda: loop.run_steps(3))  # episode 0, steps 0-2: none ends it
        assert within(lambda: loop.run_episodes(1, interrupter=stopped)) == []  # its episode (1) runs anyway
        (episode,) = within(lambda: loop.run_episodes(1))
        later = within(lambda: loop.run_steps(3))
    episode_numbers = set(flat(episode, "observation")[:, 1].tolist())
    assert episode_numbers == {2}  # its own: 1 was reset for the interrupted call and never stepped
    assert set(flat(later, "observation")[:, 1].tolist()) == {3}  # the reset after the episode
    ids = [set(flat(td, ("collector", "traj_ids")).tolist()) for td in (first, episode, later)]
    assert all(len(i) == 1 for i in ids) and len(set.union(*ids)) == 3  # three trajectories, three ids


# -- faults ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "on_policy"])
@pytest.mark.parametrize("envs_per_thread", [1, 2])
def test_env_raising_on_step_k_raises_env_error_naming_env_and_step(envs_per_thread, lookahead, within):
    factories = mock_envs(4)
    factories[1] = lambda: MockEnv(1, raise_on_step=5)
    loop = MultiEnvLoop(factories, CountingPolicy(), autobatch_size=2, envs_per_thread=envs_per_thread,
                        lookahead=lookahead)
    # run_env_steps makes every env step 20 times, so env 1 must reach its step 5
    with pytest.raises(EnvError, match="env 1 failed in step at step 5") as info:
        within(lambda: loop.run_env_steps(20))
    exc = info.value
    assert (exc.env_id, exc.step, exc.phase) == (1, 5, "step")
    assert isinstance(exc.__cause__, RuntimeError) and "exploded on step 5" in str(exc.__cause__)
    assert loop.closed
    with pytest.raises(CollectionError, match="closed"):
        loop.run_steps(1)


@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "on_policy"])
@pytest.mark.parametrize("envs_per_thread", [1, 2])
def test_env_error_in_run_steps_carries_the_collected_transitions(envs_per_thread, lookahead, within):
    # every env raises on its step 9: 200 rows from 4 envs force at least one of them there
    loop = MultiEnvLoop(mock_envs(4, raise_on_step=9), CountingPolicy(), autobatch_size=2,
                        envs_per_thread=envs_per_thread, lookahead=lookahead)
    with pytest.raises(EnvError, match="failed in step at step 9") as info:
        within(lambda: loop.run_steps(200))
    exc = info.value
    assert exc.step == 9 and 0 <= exc.env_id < 4
    assert isinstance(exc.partial, TensorDict) and 0 < exc.partial.shape[0] < 200
    StreamChecker().add(exc.partial)
    # the failing env's steps 0..8 all reached the caller before its error did
    mine = flat(exc.partial, ("collector", "env_id")) == exc.env_id
    assert flat(exc.partial, "observation")[mine].shape[0] == 9
    assert loop.closed


def test_env_raising_in_reset_raises_env_error_in_run_episodes(within):
    factories = mock_envs(2)
    factories[0] = lambda: MockEnv(0, raise_on_reset=2)
    loop = MultiEnvLoop(factories, CountingPolicy(), autobatch_size=2)
    with pytest.raises(EnvError) as info:
        within(lambda: [loop.run_episodes(2) for _ in range(5)])
    assert info.value.env_id == 0 and info.value.phase == "reset"
    assert isinstance(info.value.__cause__, RuntimeError)
    assert loop.closed


def test_env_failing_in_its_first_reset_is_reported_by_the_constructor(within):
    """Envs are reset at construction (as TorchRL's collector does, to probe the policy on real observations)."""
    factories = mock_envs(2)
    factories[1] = lambda: MockEnv(1, raise_on_reset=0)
    with pytest.raises(EnvError, match="env 1 failed in reset") as info:
        within(lambda: MultiEnvLoop(factories, CountingPolicy(), autobatch_size=2))
    assert info.value.phase == "reset" and info.value.step == 0


class BrokenPolicy(CountingPolicy):
    """Works for the loop's probe and ``ok_calls`` forward passes, then raises or answers a wrong batch size."""

    def __init__(self, mode: str, ok_calls: int) -> None:
        super().__init__()
        self.mode, self.ok_calls = mode, ok_calls

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        action = super().__call__(obs)
        if not called_from_probe() and self.calls > self.ok_calls:
            if self.mode == "raise":
                raise KeyError("broken weights")
            return torch.cat([action, action])
        return action


@pytest.mark.parametrize("mode, match", [("raise", "KeyError"), ("wrong_size", "leading dim must be the batch size")])
@pytest.mark.parametrize("method", ["run_steps", "run_episodes", "run_env_steps"])
def test_failing_policy_raises_policy_error_in_the_caller(mode, match, method, within):
    loop = MultiEnvLoop(mock_envs(3), BrokenPolicy(mode, ok_calls=4), autobatch_size=3)
    call = {"run_steps": lambda: loop.run_steps(300), "run_episodes": lambda: loop.run_episodes(50),
            "run_env_steps": lambda: loop.run_env_steps(100)}[method]
    with pytest.raises(PolicyError, match=match) as info:
        within(call)
    if mode == "raise":  # the original exception is kept in the chain
        chain, cause = [], info.value
        while cause is not None:
            chain.append(cause)
            cause = cause.__cause__
        assert any(isinstance(c, KeyError) for c in chain)
    assert set(info.value.env_ids) <= {0, 1, 2} and info.value.env_ids
    assert "at step" in str(info.value)
    if method == "run_steps":  # at least the first round of every env was delivered before the failure
        assert info.value.partial is not None and info.value.partial.shape[0] >= 3
        StreamChecker().add(info.value.partial)
    assert loop.closed


def test_close_joins_every_thread_and_is_idempotent():
    before = {t for t in threading.enumerate() if t.name.startswith("lightning_rollout-")}
    loop = MultiEnvLoop(mock_envs(4), CountingPolicy(), autobatch_size=2, name="closing")
    loop.run_steps(3)  # one request still in flight or staged
    threads = list(loop.threads())
    loop.close()
    loop.close()
    assert not any(t.is_alive() for t in threads)
    assert {t for t in threading.enumerate() if t.name.startswith("lightning_rollout-")} == before
    with pytest.raises(CollectionError):
        loop.run_episodes(1)


def test_env_threads_are_named_daemons():
    with MultiEnvLoop(mock_envs(2), CountingPolicy(), name="named") as loop:
        names = sorted(t.name for t in loop.threads())
        assert names == ["lightning_rollout-named-env0", "lightning_rollout-named-env1"]
        assert all(t.daemon for t in loop.threads())


# -- configuration ---------------------------------------------------------------------------------

@pytest.mark.parametrize("env, kwargs, match", [
    (MockEnv, {"num_envs": 0}, r"num_envs must be .*>= 1"),
    (MockEnv, {"num_envs": -2}, r"num_envs must be .*>= 1"),
    (MockEnv, {"num_envs": 2, "autobatch_size": 0}, r"autobatch_size must be .*(>= 1|positive)"),
    ("NoSuchEnv-v0", {"num_envs": 2}, "unknown gymnasium env id 'NoSuchEnv-v0'"),
    ("CartPol-v1", {"num_envs": 1}, "did you mean"),
    (MockEnv, {"num_envs": 4, "envs_per_thread": 3}, r"num_envs \(4\) must be a multiple of envs_per_thread \(3\)"),
    (MockEnv, {"num_envs": 2, "envs_per_thread": 0}, r"envs_per_thread must be .*>= 1"),
    (MockEnv, {"num_envs": 2, "max_episode_steps": 0}, r"max_episode_steps must be .*>= 1"),
    (MockEnv, {"num_envs": 2, "step_timeout": 0}, r"step_timeout must be .*> 0"),
    (MockEnv, {"num_envs": 2, "step_timeout": float("inf")}, r"step_timeout must be a finite number"),
    (MockEnv, {"num_envs": 2, "step_timeout": True}, r"step_timeout must be a finite number"),
    (lambda: object(), {"num_envs": 1}, "expected a gymnasium.Env or a torchrl EnvBase"),
    (42, {"num_envs": 1}, "env must be a gymnasium id or a callable"),
    ([], {}, "list of env factories is empty"),
])
def test_bad_configuration_raises_value_error_saying_what_to_change(env, kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiEnvLoop(env, CountingPolicy(), **kwargs)


def test_loop_settings_that_belong_to_a_shared_policy_are_rejected():
    shared = AutobatchPolicy(CountingPolicy())
    try:
        with pytest.raises(ValueError, match="set them there, not on the loop"):
            MultiEnvLoop(mock_envs(2), shared, autobatch_size=2)
    finally:
        shared.close()


def test_env_loop_refuses_several_envs():
    with pytest.raises(ValueError, match="use MultiEnvLoop"):
        EnvLoop(MockEnv, CountingPolicy(), num_envs=2)


@pytest.mark.parametrize("call", ["run_steps", "run_episodes", "run_env_steps"])
def test_negative_counts_are_rejected(call):
    with MultiEnvLoop(mock_envs(1), CountingPolicy()) as loop:
        with pytest.raises(ValueError, match="must be >= 0"):
            getattr(loop, call)(-1)


# -- TorchRL envs ----------------------------------------------------------------------------------

def cartpole_factory():
    from torchrl.envs import Compose, DoubleToFloat, GymEnv, RewardSum, StepCounter, TransformedEnv

    return TransformedEnv(GymEnv("CartPole-v1"), Compose(DoubleToFloat(), StepCounter(max_steps=15), RewardSum()))


def cartpole_actor():
    from tensordict.nn import TensorDictModule as Mod
    from torchrl.modules import OneHotCategorical, ProbabilisticActor

    torch.manual_seed(0)
    net = Mod(torch.nn.Linear(4, 2), in_keys=["observation"], out_keys=["logits"])
    return ProbabilisticActor(net, in_keys=["logits"], out_keys=["action"], distribution_class=OneHotCategorical,
                              return_log_prob=True)


def test_torchrl_env_with_transforms_runs_through_the_loop():
    with MultiEnvLoop(cartpole_factory, cartpole_actor(), num_envs=2, autobatch_size=2, seed=1) as loop:
        assert set(loop.env_keys.observation) == {"observation", "step_count", "episode_reward"}  # StepCounter, RewardSum
        td = loop.run_steps(40)
        trajectories = loop.run_episodes(2)
        grid = loop.run_env_steps(5)
    assert td.get("action").shape == (40, 2) and td.get("action").sum(-1).eq(1).all()  # one-hot
    assert td.get("action_log_prob").shape == (40,) and td.get("logits").shape == (40, 2)
    assert td.get("observation").dtype == torch.float32
    assert torch.equal(td.get(("next", "done")), td.get(("next", "terminated")) | td.get(("next", "truncated")))
    assert (td.get(("next", "step_count")) <= 15).all()
    # continuity in each env's stream
    for e in (0, 1):
        rows = td[td.get(("collector", "env_id")) == e]
        for t in range(rows.shape[0] - 1):
            if not rows.get(("next", "done"))[t].item():
                assert torch.equal(rows.get(("next", "observation"))[t], rows.get("observation")[t + 1])
    for episode in trajectories:
        done = episode.get(("next", "done"))[:, 0]
        assert done[-1] and not done[:-1].any() and episode.shape[0] <= 15
    assert grid.batch_size == (2, 5)
