"""ThreadedCollector as a drop-in TorchRL collector (issue 3).

Every test shuts its collectors down (the ``make_collector`` / ``make_torchrl_collector``
fixtures do it at teardown; conftest's autouse ``no_thread_leak`` then checks that no
``lightning_rollout-*`` thread survived). Frame counts are small: the file must stay fast
on a shared 2-core machine. Nothing here sleeps to win a race or asserts on timing.
"""

from __future__ import annotations

import gc
import io
import itertools
import threading
import warnings

import gymnasium as gym
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictSequential
from torch import nn
from torchrl.collectors import BaseCollector, Collector
from torchrl.data import LazyTensorStorage, OneHot, ReplayBuffer
from torchrl.data.postprocs import MultiStep
from torchrl.envs import GymEnv, SerialEnv, StepCounter, TransformedEnv
from torchrl.envs.utils import ExplorationType
from torchrl.modules import EGreedyModule, QValueActor, RandomPolicy
from torchrl.testing.mocking_classes import CountingEnv
from torchrl.objectives import ClipPPOLoss, DQNLoss
from torchrl.objectives.value import GAE
from torchrl.trainers import DefaultOptimizationStepper, Trainer, UpdateWeights

from conftest import MockEnv
from collector_helpers import (
    CARTPOLE,
    COUNTER_KEYS,
    OWN_KEYS,
    TORCHRL_KEYS,
    assert_traj_ids_follow_done,
    balance_policy,
    cartpole_with_counters,
    leaf_keys,
    make_actor,
    make_critic,
    stream_envs,
    stream_policy,
    wait_for,
)
from lightning_rollout import CollectionError, EnvError, Interrupter, ThreadedCollector

THREAD_PREFIX = "lightning_rollout-"


@pytest.fixture
def make_collector():
    """``make_collector(*args, **kwargs)`` builds a ThreadedCollector that is shut down at teardown."""
    made: list[ThreadedCollector] = []

    def make(*args, **kwargs) -> ThreadedCollector:
        collector = ThreadedCollector(*args, **kwargs)
        made.append(collector)
        return collector

    yield make
    for collector in made:
        collector.shutdown(raise_on_error=False)


@pytest.fixture
def make_torchrl_collector():
    """``make_torchrl_collector(env, policy, **kwargs)``: TorchRL's own ``Collector``, shut down at teardown."""
    made: list[Collector] = []

    def make(env, policy, **kwargs) -> Collector:
        # opt out of TorchRL appending InitTracker (its future default) so the key sets compared stay put
        collector = Collector(env, policy, auto_register_policy_transforms=False, **kwargs)
        made.append(collector)
        return collector

    yield make
    for collector in made:
        collector.shutdown()


def rollout_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX) and t.is_alive()}


def first_batch(collector):
    return next(iter(collector))


# ---------------------------------------------------------------------------------------------
# Conformance with torchrl.collectors.Collector
# ---------------------------------------------------------------------------------------------

def test_is_a_torchrl_base_collector_with_the_attributes_torchrl_reads(make_collector):
    collector = make_collector(CARTPOLE, make_actor(), frames_per_batch=8, total_frames=16, num_envs=2,
                               init_random_frames=2)
    assert isinstance(collector, BaseCollector)
    assert collector.frames_per_batch == collector.requested_frames_per_batch == 8
    assert collector.total_frames == 16
    assert collector.init_random_frames == 2
    assert collector.replay_buffer is None and collector.postproc is None
    assert collector.policy_version == 0


@pytest.mark.parametrize("env_source", ["gym_id", "gym_factory"])
def test_cartpole_batches_have_torchrl_keys_shapes_dtypes_and_names(env_source, make_collector,
                                                                    make_torchrl_collector):
    """Gymnasium CartPole: ours (from the gym id or a gym factory) vs TorchRL's Collector over GymEnv.

    Key sets differ exactly by what we add to a gymnasium env: InitTracker's is_init and the
    StepCounter/RewardSum entries step_count, episode_reward, ("next", "step_count"),
    ("next", "episode_reward"), which TorchRL only has with those transforms.
    """
    actor = make_actor()
    env = CARTPOLE if env_source == "gym_id" else (lambda: gym.make(CARTPOLE))

    # flat layout vs a single-env TorchRL collector: batch [frames_per_batch]
    theirs = first_batch(make_torchrl_collector(GymEnv(CARTPOLE), actor, frames_per_batch=8, total_frames=8))
    ours = first_batch(make_collector(env, actor, frames_per_batch=8, total_frames=8, num_envs=2, layout="flat"))
    assert leaf_keys(theirs) == TORCHRL_KEYS
    assert leaf_keys(ours) - leaf_keys(theirs) == OWN_KEYS | COUNTER_KEYS
    assert leaf_keys(theirs) - leaf_keys(ours) == set()
    assert ours.batch_size == theirs.batch_size == torch.Size([8])
    for key in leaf_keys(theirs):
        assert ours[key].shape == theirs[key].shape, key
        assert ours[key].dtype == theirs[key].dtype, key
    # Note: TorchRL names a single env's batch ["time"]; the flat layout is arrival order across
    # envs, not one time axis, so it carries no dim name.

    # env_time layout vs TorchRL's collector over a SerialEnv of the same envs
    theirs = first_batch(make_torchrl_collector(SerialEnv(2, lambda: GymEnv(CARTPOLE)), actor, frames_per_batch=8,
                                                total_frames=8))
    ours = first_batch(make_collector(env, actor, frames_per_batch=8, total_frames=8, num_envs=2))
    assert ours.batch_size == theirs.batch_size == torch.Size([2, 4])
    assert ours.names == theirs.names == [None, "time"]
    assert leaf_keys(ours) - leaf_keys(theirs) == OWN_KEYS | COUNTER_KEYS
    assert leaf_keys(theirs) - leaf_keys(ours) == set()
    for key in leaf_keys(theirs):
        assert ours[key].shape == theirs[key].shape, key
        assert ours[key].dtype == theirs[key].dtype, key
    for key in COUNTER_KEYS:
        assert ours[key].shape == torch.Size([2, 4, 1])
    assert ours["step_count"].dtype == torch.int64 and ours["episode_reward"].dtype == torch.float32
    assert "policy_version" not in ours.keys()  # TorchRL's default: track_policy_version=False


def test_transformed_gymenv_batches_match_torchrl_collector_key_for_key(make_collector, make_torchrl_collector):
    """TorchRL GymEnv with StepCounter + RewardSum: the same keys, shapes, dtypes and names as TorchRL's."""
    actor = make_actor()
    theirs = first_batch(make_torchrl_collector(SerialEnv(2, cartpole_with_counters), actor, frames_per_batch=12,
                                                total_frames=12))
    ours = first_batch(make_collector(cartpole_with_counters, actor, frames_per_batch=12, total_frames=12,
                                      num_envs=2))
    assert leaf_keys(theirs) == TORCHRL_KEYS | COUNTER_KEYS
    assert leaf_keys(ours) == leaf_keys(theirs)
    assert ours.batch_size == theirs.batch_size == torch.Size([2, 6])
    assert ours.names == theirs.names == [None, "time"]
    for key in leaf_keys(theirs):
        assert ours[key].shape == theirs[key].shape, key
        assert ours[key].dtype == theirs[key].dtype, key
    assert torch.equal(ours["collector", "traj_ids"][:, 0], theirs["collector", "traj_ids"][:, 0])  # env order


def test_seeded_single_env_stream_equals_torchrl_collector_value_for_value(make_collector, make_torchrl_collector):
    """Same seeded env, same deterministic actor: every entry TorchRL yields is equal, across an episode end."""
    actor = make_actor(seed=3)
    env = cartpole_with_counters()
    env.set_seed(5)
    frames = 64
    theirs = first_batch(make_torchrl_collector(env, actor, frames_per_batch=frames, total_frames=frames,
                                                exploration_type=ExplorationType.DETERMINISTIC))
    ours = first_batch(make_collector(cartpole_with_counters, actor, frames_per_batch=frames, total_frames=frames,
                                      num_envs=1, seed=5, layout="flat",
                                      exploration_type=ExplorationType.DETERMINISTIC))
    assert theirs["next", "done"].any(), "the run should cross an episode end"
    for key in leaf_keys(theirs):
        if ours[key].is_floating_point():
            torch.testing.assert_close(ours[key], theirs[key], msg=str(key))
        else:
            assert torch.equal(ours[key], theirs[key]), key


def test_traj_ids_start_after_every_done_and_are_unique_across_batches(make_collector, make_torchrl_collector):
    kwargs = dict(frames_per_batch=24, total_frames=72, max_frames_per_traj=5)
    ours = list(make_collector(CARTPOLE, make_actor(), num_envs=3, **kwargs))
    assert len(ours) == 3
    assert sum(int(b["next", "done"].sum()) for b in ours) >= 9  # every env ends episodes (cut at 5 steps)
    assert_traj_ids_follow_done(ours)
    # ... which is exactly TorchRL's own rule, checked here on its collector over a SerialEnv
    theirs = list(make_torchrl_collector(SerialEnv(3, lambda: GymEnv(CARTPOLE)), make_actor(), **kwargs))
    assert_traj_ids_follow_done(theirs)

    batch = torch.cat(ours, dim=1)
    done = batch["next", "done"]
    assert torch.equal(done, batch["next", "terminated"] | batch["next", "truncated"])
    assert not batch["done"].any() and not batch["terminated"].any() and not batch["truncated"].any()
    # step counters as StepCounter / RewardSum define them, restarting after every done
    assert torch.equal(batch["next", "step_count"], batch["step_count"] + 1)
    torch.testing.assert_close(batch["next", "episode_reward"], batch["episode_reward"] + batch["next", "reward"])
    assert (batch["step_count"][:, 1:][done[:, :-1]] == 0).all()
    assert (batch["next", "step_count"] <= 5).all()


# ---------------------------------------------------------------------------------------------
# Drop-in use in TorchRL's own machinery
# ---------------------------------------------------------------------------------------------

def test_clip_ppo_with_gae_trains_on_env_time_batches(make_collector):
    actor, critic = make_actor(), make_critic()
    loss_module = ClipPPOLoss(actor, critic)
    advantage = GAE(gamma=0.99, lmbda=0.95, value_network=critic)
    optimizer = torch.optim.Adam(loss_module.parameters(), lr=1e-2)
    collector = make_collector(CARTPOLE, actor, track_policy_version=True, frames_per_batch=16, total_frames=48, num_envs=2)
    before = [p.detach().clone() for p in actor.parameters()]
    for i, batch in enumerate(collector):
        assert batch.names == [None, "time"]
        assert (batch["policy_version"] == i).all()
        advantage(batch)
        losses = loss_module(batch)
        total = sum(v for k, v in losses.items() if k.startswith("loss_"))
        assert torch.isfinite(total)
        total.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in actor.parameters())
        optimizer.step()
        optimizer.zero_grad()
        collector.update_policy_weights_()
    assert i == 2
    assert collector.policy_version == 3
    assert any(not torch.equal(a, b) for a, b in zip(before, actor.parameters()))


def _dqn_policy():
    torch.manual_seed(0)
    spec = OneHot(2)
    qvalue = QValueActor(nn.Linear(4, 2), in_keys=["observation"], spec=spec)
    return qvalue, TensorDictSequential(qvalue, EGreedyModule(spec, eps_init=0.5)), spec


@pytest.mark.parametrize("feed", ["replay_buffer_argument", "extend_flat_batches"])
def test_dqn_loss_trains_from_a_replay_buffer_fed_by_the_collector(feed, make_collector):
    qvalue, policy, spec = _dqn_policy()
    loss_module = DQNLoss(qvalue, action_space=spec, delay_value=False)
    optimizer = torch.optim.Adam(loss_module.parameters(), lr=1e-2)
    rb = ReplayBuffer(storage=LazyTensorStorage(100), batch_size=8)
    if feed == "replay_buffer_argument":
        collector = make_collector(CARTPOLE, policy, track_policy_version=True, frames_per_batch=8, total_frames=24, num_envs=2,
                                   replay_buffer=rb)
    else:
        collector = make_collector(CARTPOLE, policy, track_policy_version=True, frames_per_batch=8, total_frames=24, num_envs=2, layout="flat")
    for i, batch in enumerate(collector):
        if feed == "replay_buffer_argument":
            assert batch is None
        else:
            assert batch.batch_size == torch.Size([8])
            rb.extend(batch)
        assert len(rb) == 8 * (i + 1)
        sample = rb.sample()
        assert sample["action"].shape == torch.Size([8, 2])
        loss = loss_module(sample)["loss"]
        assert torch.isfinite(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        collector.update_policy_weights_()
    assert len(rb) == 24
    stored = rb[:]
    assert (stored["action"].sum(-1) == 1).all()
    assert set(stored["policy_version"].tolist()) == {0, 1, 2}


def test_torchrl_trainer_runs_a_few_batches_with_the_collector(make_collector):
    actor, critic = make_actor(), make_critic()
    loss_module = ClipPPOLoss(actor, critic)
    optimizer = torch.optim.Adam(loss_module.parameters(), lr=1e-2)
    collector = make_collector(CARTPOLE, actor, track_policy_version=True, frames_per_batch=16, total_frames=48, num_envs=2)
    trainer = Trainer(collector=collector, total_frames=48, frame_skip=1, optim_steps_per_batch=2,
                      loss_module=loss_module, optimizer=optimizer,
                      optimization_stepper=DefaultOptimizationStepper(), progress_bar=False, seed=11)
    UpdateWeights(collector, update_weights_interval=1).register(trainer)
    versions: list[list[int]] = []

    def record_versions(batch):
        versions.append(batch["policy_version"].unique().tolist())
        return batch

    trainer.register_op("batch_process", record_versions)
    before = [p.detach().clone() for p in actor.parameters()]
    trainer.train()
    assert trainer.collected_frames == 48
    assert versions == [[0], [1], [2]]
    assert collector.policy_version == 3
    assert any(not torch.equal(a, b) for a, b in zip(before, actor.parameters()))
    # Trainer.train() ends with collector.shutdown()
    assert not any(t.name.startswith(f"{THREAD_PREFIX}collector-") for t in rollout_threads())


# ---------------------------------------------------------------------------------------------
# Policy versions and weight updates
# ---------------------------------------------------------------------------------------------

def _logits(actor, observation):
    with torch.no_grad():
        return actor.module[0](TensorDict(observation=observation, batch_size=observation.shape[:-1]))["logits"]


@pytest.mark.parametrize("how", ["pull_from_policy", "module", "state_dict", "tensordict", "weights_dict"])
def test_on_policy_batch_after_update_has_one_version_acted_by_the_new_weights(how, make_collector):
    actor = make_actor(seed=0)
    collector = make_collector(CARTPOLE, actor, track_policy_version=True, frames_per_batch=8, num_envs=2)
    batches = iter(collector)
    assert (next(batches)["policy_version"] == 0).all()
    new = make_actor(seed=7)
    if how == "pull_from_policy":
        actor.load_state_dict(new.state_dict())  # the training loop changed the policy in place
        collector.update_policy_weights_()
    elif how == "module":
        collector.update_policy_weights_(new)
    elif how == "state_dict":
        collector.update_policy_weights_(new.state_dict())
    elif how == "tensordict":
        collector.update_policy_weights_(TensorDict.from_module(new))
    else:
        collector.update_policy_weights_(weights_dict={"policy": TensorDict.from_module(new)})
    assert collector.policy_version == 1
    batch = next(batches)
    assert batch["policy_version"].unique().tolist() == [1]
    torch.testing.assert_close(batch["logits"], _logits(new, batch["observation"]))


def test_off_policy_acts_with_its_own_copy_and_lags_at_most_one_step_per_env(make_collector):
    """on_policy=False: the user's policy changing in place is not seen before an update; after an
    update each env delivers at most one step of the previous version, the first of its row."""
    actor = make_actor(seed=0)
    original = make_actor(seed=0)
    collector = make_collector(CARTPOLE, actor, track_policy_version=True, frames_per_batch=12, num_envs=3, on_policy=False)
    batches = iter(collector)
    assert (next(batches)["policy_version"] == 0).all()
    actor.load_state_dict(make_actor(seed=10).state_dict())  # trained in place, not pushed yet
    batch = next(batches)
    assert (batch["policy_version"] == 0).all()
    torch.testing.assert_close(batch["logits"], _logits(original, batch["observation"]))
    for version in (1, 2, 3):
        actor.load_state_dict(make_actor(seed=10 + version).state_dict())
        collector.update_policy_weights_()
        batch = next(batches)
        versions = batch["policy_version"]
        assert (versions[:, 1:] == version).all(), versions
        assert ((versions[:, 0] == version) | (versions[:, 0] == version - 1)).all(), versions
        new_rows = versions == version
        torch.testing.assert_close(batch["logits"][new_rows], _logits(actor, batch["observation"][new_rows]))


def test_off_policy_flat_layout_lag_is_at_most_one_step_per_env(make_collector):
    actor = make_actor()
    collector = make_collector(CARTPOLE, actor, track_policy_version=True, frames_per_batch=8, num_envs=2, layout="flat", on_policy=False)
    batches = iter(collector)
    next(batches)
    for version in (1, 2):
        collector.update_policy_weights_()
        batch = next(batches)
        for traj in batch["collector", "traj_ids"].unique():  # a trajectory is one env's consecutive steps
            versions = batch["policy_version"][batch["collector", "traj_ids"] == traj]
            assert (versions[1:] == version).all(), versions
            assert version - 1 <= versions[0] <= version


# ---------------------------------------------------------------------------------------------
# Seeds
# ---------------------------------------------------------------------------------------------

def _stream(batches):
    batch = torch.cat(batches, dim=1)
    return {k: batch[k] for k in ("observation", "action", ("next", "reward"), ("next", "done"))}


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("policy_kind", ["deterministic_actor", "argmax_callable"])
def test_same_seed_gives_identical_per_env_streams_and_other_seeds_differ(policy_kind, make_collector):
    if policy_kind == "deterministic_actor":
        policy, kwargs = make_actor(seed=2), dict(exploration_type=ExplorationType.DETERMINISTIC)
    else:
        policy, kwargs = balance_policy, {}

    def run(seed, via_set_seed=False):
        collector = make_collector(CARTPOLE, policy, frames_per_batch=20, total_frames=40, num_envs=2,
                                   autobatch_size=1, seed=None if via_set_seed else seed, **kwargs)
        if via_set_seed:
            assert collector.set_seed(seed) == seed + 2
        return list(collector)

    a, b, c = run(7), run(7, via_set_seed=True), run(8)
    sa, sb, sc = _stream(a), _stream(b), _stream(c)
    assert _same(sa, sb)
    assert not _same(sa, sc)
    assert not torch.equal(sa["observation"][0, 0], sa["observation"][1, 0]), "envs must get distinct seeds"
    if policy_kind == "deterministic_actor":
        batch = a[0]
        assert torch.equal(batch["action"], nn.functional.one_hot(batch["logits"].argmax(-1), 2))


def test_set_seed_while_running_restarts_every_env_from_its_seeded_state(make_collector):
    reference = first_batch(make_collector(CARTPOLE, balance_policy, frames_per_batch=10, num_envs=2, seed=3))
    collector = make_collector(CARTPOLE, balance_policy, frames_per_batch=10, num_envs=2, seed=100)
    batches = iter(collector)
    next(batches)
    collector.set_seed(3)
    assert _same(_stream([next(batches)]), _stream([reference]))


# ---------------------------------------------------------------------------------------------
# Length, termination, shutdown
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout,total_frames,sizes", [
    ("env_time", 24, [8, 8, 8]),
    ("env_time", 20, [8, 8, 8]),
    ("flat", 19, [8, 8, 8]),
])
def test_finite_collector_stops_after_total_frames_rounded_up_to_whole_batches(layout, total_frames, sizes,
                                                                             make_collector):
    """As TorchRL: whole batches only; a total_frames that is not a multiple of frames_per_batch is
    rounded up, with a warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        collector = make_collector(CARTPOLE, make_actor(), frames_per_batch=8, total_frames=total_frames,
                                   num_envs=2, layout=layout)
    rounded = total_frames % 8 != 0
    assert any("total_frames" in str(w.message) for w in caught) == rounded
    total_frames = sum(sizes)
    assert collector.total_frames == total_frames
    assert len(collector) == len(sizes)
    batches = list(collector)
    assert [b.numel() for b in batches] == sizes
    if layout == "env_time":
        assert [tuple(b.batch_size) for b in batches] == [(2, n // 2) for n in sizes]
    assert collector.frames == total_frames
    assert list(collector) == []  # exhausted: a second pass yields nothing more


def test_frames_per_batch_not_a_multiple_of_num_envs_is_rounded_up_with_a_warning(make_collector):
    """As TorchRL's collector over a batched env: every env does whole time steps."""
    with pytest.warns(UserWarning, match=r"frames_per_batch \(7\) is not exactly divisible"):
        collector = make_collector(CARTPOLE, make_actor(), frames_per_batch=7, total_frames=16, num_envs=2)
    assert collector.frames_per_batch == collector.requested_frames_per_batch == 8
    assert [tuple(b.batch_size) for b in collector] == [(2, 4), (2, 4)]


def test_endless_collector_has_no_len_and_runs_under_islice(make_collector):
    collector = make_collector(CARTPOLE, make_actor(), frames_per_batch=4, num_envs=2)
    with pytest.raises(TypeError):
        len(collector)
    batches = list(itertools.islice(collector, 3))
    assert [tuple(b.batch_size) for b in batches] == [(2, 2)] * 3
    assert collector.frames == 12


def test_shutdown_is_idempotent_and_leaves_no_thread_alive():
    before = set(threading.enumerate())
    collector = ThreadedCollector(CARTPOLE, make_actor(), frames_per_batch=4, num_envs=2, envs_per_thread=1,
                                  name="idem")
    try:
        first_batch(collector)
        running = {t.name for t in rollout_threads() - before}
        assert {"lightning_rollout-idem-env0", "lightning_rollout-idem-env1"} <= running
    finally:
        collector.shutdown()
    collector.shutdown()
    assert not {t for t in set(threading.enumerate()) - before if t.name.startswith(THREAD_PREFIX)}
    with pytest.raises(CollectionError):
        first_batch(collector)


def test_shutdown_of_a_never_iterated_collector_closes_its_envs():
    envs: list[MockEnv] = []

    def factory():
        env = MockEnv(len(envs))
        env.close = lambda env=env: setattr(env, "closed", True)
        envs.append(env)
        return env

    collector = ThreadedCollector([factory, factory], stream_policy, frames_per_batch=2)
    collector.shutdown()
    collector.shutdown()
    assert envs and all(getattr(env, "closed", False) for env in envs)


def test_dropped_collector_stops_its_threads_when_garbage_collected():
    before = set(threading.enumerate())
    collector = ThreadedCollector(CARTPOLE, make_actor(), frames_per_batch=4, num_envs=2, name="dropped")
    first_batch(collector)
    del collector
    gc.collect()
    assert not {t for t in set(threading.enumerate()) - before if t.name.startswith(THREAD_PREFIX)}


def test_env_error_reaches_the_caller_and_shutdown_after_it_is_safe():
    collector = ThreadedCollector([lambda: MockEnv(0, length_fn=lambda e, ep: 50),
                                   lambda: MockEnv(1, length_fn=lambda e, ep: 50, raise_on_step=2)],
                                  stream_policy, frames_per_batch=8)
    try:
        with pytest.raises(EnvError) as info:
            list(collector)
        assert info.value.env_id == 1
        assert isinstance(info.value.__cause__, RuntimeError)
    finally:
        collector.shutdown()
    collector.shutdown()


@pytest.mark.parametrize("layout", ["env_time", "flat"])
def test_interrupted_before_any_frame_yields_no_batch_and_resumes_without_losing_steps(layout, make_collector):
    interrupter = Interrupter()
    collector = make_collector(stream_envs(2, length=1000), stream_policy, frames_per_batch=8, total_frames=16,
                               layout=layout, interruptor=interrupter)
    interrupter.stop()
    assert list(collector) == []
    assert collector.frames == 0
    interrupter.reset()
    batches = list(collector)
    assert [b.batch_size.numel() for b in batches] == [8, 8] and collector.frames == 16
    batch = torch.cat(batches, dim=-1)
    for env in range(2):  # every env's stream starts at t=0 and has no gap (flat: envs may differ in count)
        t = batch["observation"][batch["observation"][..., 0] == env][:, 2]
        assert t.tolist() == list(range(len(t)))
        if layout == "env_time":
            assert len(t) == 8


# ---------------------------------------------------------------------------------------------
# init_random_frames, background collection, state
# ---------------------------------------------------------------------------------------------

def test_init_random_frames_are_valid_random_actions_with_policy_version_minus_one(make_collector):
    collector = make_collector(CARTPOLE, make_actor(), track_policy_version=True, frames_per_batch=8, total_frames=16, num_envs=2,
                               init_random_frames=5)  # rounded up to 3 steps per env
    batch = first_batch(collector)
    versions = batch["policy_version"]
    assert (versions[:, :3] == -1).all() and (versions[:, 3:] == 0).all()
    action = batch["action"]
    assert action.dtype == torch.int64 and action.shape == torch.Size([2, 4, 2])
    assert ((action == 0) | (action == 1)).all() and (action.sum(-1) == 1).all()


def test_policy_none_acts_uniformly_at_random_from_the_action_spec(make_collector):
    batch = first_batch(make_collector(cartpole_with_counters, None, frames_per_batch=8, num_envs=2))
    assert batch["action"].shape == torch.Size([2, 4, 2]) and (batch["action"].sum(-1) == 1).all()


def test_start_fills_the_replay_buffer_in_the_background_until_total_frames(make_collector):
    rb = ReplayBuffer(storage=LazyTensorStorage(64))
    collector = make_collector(CARTPOLE, make_actor(), track_policy_version=True, frames_per_batch=8, total_frames=24, num_envs=2,
                               replay_buffer=rb)
    collector.start()
    wait_for(lambda: collector.frames == 24, what="24 frames in the buffer")
    collector.async_shutdown()
    assert len(rb) == 24
    assert rb[:]["policy_version"].shape == torch.Size([24])


def test_start_with_trajs_per_batch_writes_only_complete_trajectories(make_collector):
    # batches of 6 frames cut 4-step episodes: written raw, the buffer would hold their halves
    env = TransformedEnv(CountingEnv(max_steps=4), StepCounter(4))
    rb = ReplayBuffer(storage=LazyTensorStorage(64))
    collector = make_collector(env, RandomPolicy(env.action_spec), frames_per_batch=6, total_frames=30,
                               trajs_per_batch=2, replay_buffer=rb)
    collector.start()
    wait_for(lambda: not collector.is_running(), what="the background collection to reach total_frames")
    collector.async_shutdown()
    stored = rb[: len(rb)]
    traj_ids, done = stored["collector", "traj_ids"], stored["next", "done"].squeeze(-1)
    assert len(rb) == 28  # 7 whole episodes of 4 steps; the 2 steps of the 8th are still in flight
    for traj in traj_ids.unique():
        steps = done[traj_ids == traj]
        assert steps.shape == (4,) and steps[-1] and not steps[:-1].any()


def test_async_shutdown_stops_an_endless_background_collection(make_collector):
    rb = ReplayBuffer(storage=LazyTensorStorage(1000))
    collector = make_collector(CARTPOLE, make_actor(), frames_per_batch=8, num_envs=2, replay_buffer=rb, name="bg")
    with pytest.raises(RuntimeError):
        make_collector(CARTPOLE, make_actor(), frames_per_batch=8, num_envs=2).start()  # start() needs a buffer
    collector.start()
    wait_for(lambda: len(rb) >= 16, what="two batches in the buffer")
    assert f"{THREAD_PREFIX}bg-background" in {t.name for t in rollout_threads()}
    collector.async_shutdown()
    assert not any(t.name.startswith(f"{THREAD_PREFIX}bg-") for t in rollout_threads())
    collector.async_shutdown()  # idempotent


def test_state_dict_round_trip_through_torch_save_continues_counts(make_collector):
    actor = make_actor(seed=0)
    first = make_collector(CARTPOLE, actor, track_policy_version=True, frames_per_batch=16, total_frames=48, num_envs=2, seed=1)
    seen_traj: set[int] = set()
    for batch in itertools.islice(first, 2):
        seen_traj |= set(batch["collector", "traj_ids"].flatten().tolist())
        with torch.no_grad():
            for p in actor.parameters():
                p.mul_(0.5)
        first.update_policy_weights_()
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    first.shutdown()
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)

    resumed_actor = make_actor(seed=99)
    resumed = make_collector(CARTPOLE, resumed_actor, track_policy_version=True, frames_per_batch=16, total_frames=48, num_envs=2)
    resumed.load_state_dict(state)
    assert resumed.frames == 32 and resumed.policy_version == 2
    for a, b in zip(actor.parameters(), resumed_actor.parameters()):
        assert torch.equal(a, b)
    rest = list(resumed)
    assert len(rest) == 1 and rest[0].numel() == 16  # 48 - 32 frames left
    assert (rest[0]["policy_version"] == 2).all()
    assert min(rest[0]["collector", "traj_ids"].flatten().tolist()) > max(seen_traj)
    assert resumed.frames == 48 and resumed.state_dict()["batches"] == 3


def test_load_state_dict_rejects_a_foreign_state(make_collector):
    collector = make_collector(CARTPOLE, make_actor(), frames_per_batch=8, num_envs=2)
    with pytest.raises(ValueError, match="not a ThreadedCollector state"):
        collector.load_state_dict({"policy_state_dict": {}, "env_state_dict": {}})  # TorchRL Collector's keys
    with pytest.raises(ValueError):
        collector.load_state_dict({})


# ---------------------------------------------------------------------------------------------
# reset, split_trajs, postproc, reset_at_each_iter
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("on_policy", [True, False])
def test_reset_starts_new_episodes_on_the_given_envs(on_policy, make_collector):
    collector = make_collector(stream_envs(2, length=1000), stream_policy, frames_per_batch=4, on_policy=on_policy)
    batches = iter(collector)
    b0 = next(batches)
    assert b0["observation"][:, :, 2].tolist() == [[0, 1], [0, 1]]  # [env, t] -> t
    collector.reset(index=1)
    b1 = next(batches)
    assert b1["observation"][0, :, 2].tolist() == [2, 3]  # env 0 untouched
    if on_policy:
        assert b1["observation"][1, :, 1:].tolist() == [[1, 0], [1, 1]]  # env 1: episode 1 from t=0
        assert (b1["collector", "traj_ids"][1] > b0["collector", "traj_ids"].max()).all()
    else:
        # the step env 1 had computed ahead is delivered, marked truncated: its episode was cut
        assert b1["observation"][1, 0, 1:].tolist() == [0, 2]
        assert b1["next", "truncated"][1, 0].item() and b1["next", "done"][1, 0].item()
        assert b1["observation"][1, 1, 1:].tolist() == [1, 0]
    collector.reset()
    b2 = next(batches)
    if on_policy:
        assert b2["observation"][:, 0, 2].tolist() == [0, 0]


@pytest.mark.parametrize("layout", ["env_time", "flat"])
def test_split_trajs_puts_each_trajectory_in_its_own_masked_row_in_time_order(layout, make_collector):
    collector = make_collector(stream_envs(2, length=3), stream_policy, frames_per_batch=8, total_frames=8,
                               split_trajs=True, layout=layout)
    batch = first_batch(collector)
    mask = batch["collector", "mask"]
    assert int(mask.sum()) == 8
    if layout == "env_time":
        assert sorted(mask.sum(-1).tolist()) == [1, 1, 3, 3]  # two envs x (one full episode of 3 + 1 step)
    for row, row_mask in zip(batch, mask):
        assert row["collector", "traj_ids"][row_mask].unique().numel() == 1
        obs = row["observation"][row_mask]
        assert obs[:, :2].unique(dim=0).shape[0] == 1  # one env, one episode per row
        assert obs[:, 2].tolist() == list(range(len(obs)))  # its steps in time order, from t=0


def test_postproc_is_applied_to_every_batch_and_to_replay_buffer_writes(make_collector):
    multistep = MultiStep(gamma=0.9, n_steps=2)  # a TorchRL postproc on env_time batches
    batches = list(make_collector(CARTPOLE, make_actor(), frames_per_batch=8, total_frames=16, num_envs=2,
                                  postproc=multistep))
    assert len(batches) == 2 and all(("next", "original_reward") in b.keys(True) for b in batches)

    def tag(td):
        td.set("tagged", torch.ones(td.batch_size))
        return td

    rb = ReplayBuffer(storage=LazyTensorStorage(32))
    list(make_collector(CARTPOLE, make_actor(), frames_per_batch=8, total_frames=16, num_envs=2, postproc=tag,
                        replay_buffer=rb))
    assert len(rb) == 16 and (rb[:]["tagged"] == 1).all()


def test_reset_at_each_iter_starts_every_batch_with_fresh_episodes(make_collector):
    collector = make_collector(stream_envs(2, length=1000), stream_policy, frames_per_batch=6, total_frames=18,
                               reset_at_each_iter=True)
    batches = list(collector)
    seen: set[int] = set()
    for episode, batch in enumerate(batches):
        assert batch["observation"][:, :, 2].tolist() == [[0, 1, 2]] * 2
        assert (batch["observation"][:, :, 1] == episode).all()
        traj = set(batch["collector", "traj_ids"].flatten().tolist())
        assert len(traj) == 2 and not traj & seen
        seen |= traj


# ---------------------------------------------------------------------------------------------
# Bad configuration
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    (dict(frames_per_batch=8, num_envs=2, layout="env-time"), r"layout must be 'env_time' or 'flat'"),
    (dict(frames_per_batch=8, num_envs=2, total_frames=0), r"total_frames must be a positive int or -1"),
    (dict(frames_per_batch=0, num_envs=2), r"frames_per_batch must be"),
])
def test_bad_configuration_raises_value_error_saying_what_to_change(kwargs, message):
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match=message):
        ThreadedCollector(CARTPOLE, balance_policy, **kwargs)
    assert not {t for t in set(threading.enumerate()) - before if t.name.startswith(THREAD_PREFIX)}


def test_a_factory_returning_a_batched_env_has_its_batch_stepped_in_one_call_by_one_env_thread():
    collector = ThreadedCollector(lambda: SerialEnv(2, lambda: GymEnv(CARTPOLE)), balance_policy, frames_per_batch=8,
                                  num_envs=4, total_frames=8)
    try:
        assert collector.loop.envs_per_thread == 2 and len(list(collector.loop.threads())) == 2
        batch = next(iter(collector))
    finally:
        collector.shutdown()
    assert batch.batch_size == (4, 2) and batch.names == [None, "time"]
