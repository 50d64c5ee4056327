"""A batched env swapped in as is: ``ThreadedCollector(batched_env)`` gives ``Collector(batched_env)``'s batches.

The forms a TorchRL user hands to ``Collector`` (``SerialEnv``, ``ParallelEnv``, a ``TransformedEnv`` of one,
nested to two batch dims, a lone factory of one), natively batched envs (a mock built with a batch size, a vector
env of its own kind, envpool, VMAS) and the layouts they take. With a deterministic env and policy the batches
are equal, leaf by leaf, to TorchRL's own. Which forms are taken apart into single envs and which are stepped as
they are: ``tests/test_batched_vs_collector.py``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator

import gymnasium as gym
import pytest
import torch
from gymnasium.vector import AutoresetMode
from tensordict import TensorDictBase
from tensordict.nn import InteractionType, NormalParamExtractor, TensorDictModule
from torchrl.collectors import Collector
from torchrl.envs import (Compose, DoubleToFloat, EnvBase, EnvCreator, GymEnv, GymWrapper, InitTracker, ParallelEnv,
                          RewardSum, SerialEnv, StepCounter, TransformedEnv)
from torchrl.modules import ProbabilisticActor, TanhNormal
from torchrl.testing.mocking_classes import CountingBatchedEnv, CountingEnv

from lightning_rollout import CollectionError, EnvError, MultiEnvLoop, ThreadedCollector

pytestmark = pytest.mark.timeout(120)


def counting_env() -> EnvBase:
    """Counts up by its action (1 here), done after 4 steps: the same values in any collector."""
    return CountingEnv(max_steps=4)


def ones_policy(td: TensorDictBase) -> TensorDictBase:
    return td.set("action", torch.ones((*td.shape, 1), dtype=torch.int))


BATCHED_FORMS: dict[str, Callable[[], EnvBase]] = {
    "SerialEnv": lambda: SerialEnv(3, counting_env),
    "ParallelEnv": lambda: ParallelEnv(2, counting_env),
    "TransformedEnv(SerialEnv)": lambda: TransformedEnv(SerialEnv(2, counting_env),
                                                        Compose(StepCounter(3), RewardSum(), InitTracker())),
    "batch of one": lambda: TransformedEnv(ParallelEnv(1, counting_env), StepCounter()),
    "SerialEnv of SerialEnv": lambda: SerialEnv(2, functools.partial(SerialEnv, 3, counting_env)),
}


def leaves(td: TensorDictBase) -> dict:
    return dict(td.items(include_nested=True, leaves_only=True))


def assert_same_batches(expected: list[TensorDictBase], got: list[TensorDictBase]) -> None:
    """Equal batch sizes, dim names, keys, dtypes and values, batch by batch."""
    for theirs, ours in zip(expected, got, strict=True):
        assert ours.batch_size == theirs.batch_size and ours.names == theirs.names
        want, have = leaves(theirs), leaves(ours)
        assert set(have) == set(want)
        for key, value in want.items():
            assert have[key].dtype == value.dtype and torch.equal(have[key], value), key


def first_batches(collector_cls: type, env: EnvBase | gym.vector.VectorEnv, policy, count: int = 2,
                  **kwargs) -> list[TensorDictBase]:
    frames = kwargs.pop("frames_per_batch", 12)
    extra = {"auto_register_policy_transforms": False} if collector_cls is Collector else {}
    collector = collector_cls(env, policy, frames_per_batch=frames, total_frames=frames * count, **extra, **kwargs)
    try:
        return list(collector)
    finally:
        collector.shutdown()


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchRL's FutureWarnings about its own defaults
        yield


@pytest.mark.parametrize("form", list(BATCHED_FORMS))
def test_a_batched_torchrl_env_gives_the_batches_of_torchrls_collector(form):
    make = BATCHED_FORMS[form]
    expected = first_batches(Collector, make(), ones_policy)
    got = first_batches(ThreadedCollector, make(), ones_policy)
    assert_same_batches(expected, got)


@pytest.mark.parametrize("form", ["SerialEnv", "TransformedEnv(SerialEnv)"])
def test_a_lone_factory_of_a_batched_env_without_num_envs_gives_the_batches_of_torchrls_collector(form):
    """TorchRL's ``Collector`` calls a lone factory and takes its env's batch (the sota SAC-async
    collector's form); so does ours, rather than counting the factory as one env."""
    make = BATCHED_FORMS[form]
    expected = first_batches(Collector, make, ones_policy)
    got = first_batches(ThreadedCollector, make, ones_policy)
    assert_same_batches(expected, got)


def test_a_lone_factory_of_a_natively_batched_env_without_num_envs_is_stepped_as_its_instance():
    def factory() -> EnvBase:
        return CountingEnv(max_steps=4, batch_size=[4])

    expected = first_batches(Collector, factory, ones_policy, frames_per_batch=24)
    got = first_batches(ThreadedCollector, factory, ones_policy, frames_per_batch=24)
    assert_same_batches(expected, got)


def test_the_policy_sees_the_batched_envs_shape_as_with_torchrls_collector():
    shapes: dict[str, list[tuple[int, ...]]] = {}
    for cls in (Collector, ThreadedCollector):
        seen = shapes.setdefault(cls.__name__, [])

        def policy(td: TensorDictBase) -> TensorDictBase:
            seen.append(tuple(td.batch_size))  # noqa: B023 (called before the loop moves on)
            return ones_policy(td)

        first_batches(cls, BATCHED_FORMS["SerialEnv of SerialEnv"](), policy)
    assert set(shapes["ThreadedCollector"]) == set(shapes["Collector"]) == {(2, 3)}


def cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


def test_num_envs_that_disagrees_with_the_batched_env_is_refused():
    with pytest.raises(ValueError, match="num_envs=4 but the batched env holds 3 envs"):
        ThreadedCollector(SerialEnv(3, counting_env), ones_policy, frames_per_batch=12, num_envs=4)


def test_a_wrapped_vector_env_that_torchrl_cannot_wrap_either_is_refused_with_what_to_do():
    env = gym.wrappers.vector.RecordEpisodeStatistics(
        gym.vector.SyncVectorEnv([cartpole] * 2, autoreset_mode=AutoresetMode.SAME_STEP))
    with pytest.raises(ValueError, match="GymWrapper does not take.*factory of one env"):
        ThreadedCollector(env, None, frames_per_batch=12)


class OwnVectorEnv(gym.vector.SyncVectorEnv):
    """A vector env of a kind of its own (not a plain SyncVectorEnv, so not taken apart)."""


def test_a_vector_env_of_its_own_kind_is_stepped_as_torchrls_wrapper_of_it_steps_it():
    def own() -> gym.vector.VectorEnv:
        return OwnVectorEnv([cartpole] * 2, autoreset_mode=AutoresetMode.SAME_STEP)

    expected = first_batches(Collector, GymWrapper(own()), None, count=1, frames_per_batch=96)[0]
    got = first_batches(ThreadedCollector, own(), None, count=1, frames_per_batch=96)[0]
    assert got.batch_size == expected.batch_size == (2, 48) and got.names == expected.names
    assert {k: (v.shape, v.dtype) for k, v in leaves(got).items()} == {
        k: (v.shape, v.dtype) for k, v in leaves(expected).items()}
    assert got["next", "done"].any() and (got["next", "reward"] == 1).all()  # no reset step counted as a frame


NATIVE_FORMS: dict[str, Callable[[], EnvBase]] = {
    "batch of 4": lambda: CountingBatchedEnv(max_steps=torch.tensor([3, 4, 5, 6]), batch_size=[4]),
    "batch of 2x3": lambda: CountingEnv(max_steps=4, batch_size=[2, 3]),
    "transformed": lambda: TransformedEnv(CountingEnv(max_steps=2, batch_size=[3]),
                                          Compose(StepCounter(4), RewardSum(), InitTracker())),
}


@pytest.mark.parametrize("form", list(NATIVE_FORMS))
def test_a_natively_batched_env_gives_the_batches_of_torchrls_collector(form):
    make = NATIVE_FORMS[form]
    expected = first_batches(Collector, make(), ones_policy, frames_per_batch=24)
    got = first_batches(ThreadedCollector, make(), ones_policy, frames_per_batch=24)
    assert_same_batches(expected, got)


class ResetCountingEnv(CountingBatchedEnv):
    """A natively batched counting env that records which envs each reset call reset."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.resets: list[list[int]] = []

    def _reset(self, tensordict, **kwargs):
        mask = tensordict.get("_reset").reshape(-1) if tensordict is not None and "_reset" in tensordict.keys() \
            else torch.ones(self.batch_size.numel(), dtype=torch.bool)
        self.resets.append(mask.nonzero().reshape(-1).tolist())
        return super()._reset(tensordict, **kwargs)


def test_a_factory_of_natively_batched_envs_gives_each_env_thread_one_batch_reset_together():
    made: list[ResetCountingEnv] = []

    def factory() -> EnvBase:
        made.append(ResetCountingEnv(max_steps=torch.tensor([1, 1, 3]), batch_size=[3]))
        return made[-1]

    with MultiEnvLoop(factory, ones_policy, num_envs=6, envs_per_thread="auto", seed=0) as loop:
        assert loop.envs_per_thread == 3 and len(list(loop.threads())) == 2
        batch = loop.run_env_steps(8)
    # the auto layout built and closed one env to look at it; the loop built one a thread
    built = made[-2:]
    assert batch.batch_size == (6, 8)
    # envs 0 and 1 of each batch are done every second step, env 2 every fourth
    assert batch["observation"][..., 0].tolist() == [[0, 1] * 4, [0, 1] * 4, [0, 1, 2, 3] * 2] * 2
    for env in built:  # the first reset takes every env; then envs 0 and 1, done at the same step, in one call
        assert env.resets[0] == [0, 1, 2] and [0, 1] in env.resets[1:] and [0] not in env.resets[1:]


def test_the_auto_layout_gives_a_natively_batched_env_of_one_row_one_env_thread_a_batch():
    """A batch of one is still a natively batched env: not timed, so "auto" must not read its (absent) step time."""
    with MultiEnvLoop(lambda: CountingEnv(max_steps=4, batch_size=[1]), ones_policy, num_envs=2,
                      envs_per_thread="auto", num_workers="auto") as loop:
        assert (loop.envs_per_thread, loop.num_workers) == (1, 1)
        assert "natively batched" in loop.layout_choice.reason
        assert loop.run_env_steps(3).batch_size == (2, 3)

def test_a_natively_batched_env_that_does_not_fit_the_layout_is_refused_with_what_to_pass():
    def factory() -> EnvBase:
        return CountingEnv(max_steps=4, batch_size=[4])

    with pytest.raises(ValueError, match="natively batched env of 4 envs.*multiple of 4.*envs_per_thread"):
        MultiEnvLoop(factory, ones_policy, num_envs=6, envs_per_thread=2)
    with pytest.raises(ValueError, match="natively batched env of 4 envs.*envs_per_thread \\(2\\) equal to it; "
                                         "pass envs_per_thread=4"):
        MultiEnvLoop(factory, ones_policy, num_envs=8, envs_per_thread=2)
    with pytest.raises(ValueError, match="parallel_steps=True.*natively batched env"):
        MultiEnvLoop(factory, ones_policy, num_envs=4, envs_per_thread=4, parallel_steps=True)


def test_run_episodes_on_a_natively_batched_env_is_refused_with_what_to_do():
    with MultiEnvLoop(lambda: CountingEnv(max_steps=4, batch_size=[2]), ones_policy, num_envs=2,
                      envs_per_thread=2) as loop:
        with pytest.raises(CollectionError, match="natively batched env steps all its envs at once.*rollout"):
            loop.run_episodes(1)


class ExplodingBatchedEnv(CountingEnv):
    """A natively batched counting env whose step raises at its ``at``-th step."""

    def __init__(self, at: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.at, self.calls = at, 0

    def _step(self, tensordict):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("batch exploded")
        return super()._step(tensordict)


def test_a_natively_batched_env_that_raises_in_its_step_names_it_and_keeps_the_steps_before():
    loop = MultiEnvLoop(lambda: ExplodingBatchedEnv(5, max_steps=100, batch_size=[2]), ones_policy, num_envs=2,
                        envs_per_thread=2, lookahead=False)
    with pytest.raises(EnvError, match="RuntimeError: batch exploded") as info:
        loop.run_env_steps(10)
    assert info.value.env_id == 0 and info.value.phase == "step" and isinstance(info.value.__cause__, RuntimeError)
    assert info.value.partial.batch_size == (8,) and loop.closed  # both envs' 4 steps, in arrival order


def sac_train_env(seed: int) -> EnvBase:
    """The env of TorchRL's sota SAC script (``sota-implementations/sac/utils.py``), on Pendulum."""
    parallel_env = ParallelEnv(1, EnvCreator(functools.partial(GymEnv, "Pendulum-v1", device="cpu")),
                               serial_for_single=True)
    parallel_env.set_seed(seed)
    return TransformedEnv(parallel_env, Compose(InitTracker(), StepCounter(200), DoubleToFloat(), RewardSum()))


def sac_actor(env: EnvBase) -> ProbabilisticActor:
    torch.manual_seed(0)
    spec = env.action_spec_unbatched
    net = torch.nn.Sequential(torch.nn.Linear(3, 2 * spec.shape[-1]), NormalParamExtractor())
    return ProbabilisticActor(TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]), spec=spec,
                              in_keys=["loc", "scale"], distribution_class=TanhNormal,
                              distribution_kwargs={"low": spec.space.low, "high": spec.space.high, "tanh_loc": False},
                              default_interaction_type=InteractionType.RANDOM)


def test_the_sota_sac_collector_line_swaps_with_its_env_and_kwargs_unchanged():
    batches = {}
    for cls in (Collector, ThreadedCollector):
        env = sac_train_env(seed=0)
        collector = cls(env, sac_actor(env), init_random_frames=50, frames_per_batch=100, total_frames=200,
                        device=torch.device("cpu"), compile_policy=False, cudagraph_policy=False)
        collector.set_seed(0)
        try:
            batches[cls.__name__] = [batch.reshape(-1) for batch in collector]  # the script's replay buffer input
        finally:
            collector.shutdown()
    for theirs, ours in zip(batches["Collector"], batches["ThreadedCollector"], strict=True):
        assert ours.batch_size == theirs.batch_size == (100,)
        assert {k: (v.shape, v.dtype) for k, v in leaves(ours).items()} == {
            k: (v.shape, v.dtype) for k, v in leaves(theirs).items()}
        assert ours["next", "step_count"].max() <= 200 and ours["action"].abs().max() <= 2.0


# -- simulators of the bench-real extra: envpool, VMAS (skipped without them) ---------------------------------------
def test_an_envpool_env_steps_its_batch_in_one_call_and_resets_only_the_envs_that_ended():
    """TorchRL 0.14's envpool wrappers do not take envpool 1.2's gymnasium spaces, so the reference is envpool
    stepped by hand as TorchRL's collector steps a batched env: the done envs reset before the next step (no
    autoreset step, which would pay reward 0, is ever a frame)."""
    envpool = pytest.importorskip("envpool", reason="envpool is in the bench-real extra")
    import numpy as np

    def policy(td: TensorDictBase) -> TensorDictBase:  # push left when the pole leans left: long, varied episodes
        return td.set("action", (td["observation"][..., 2] > 0).long())

    got = first_batches(ThreadedCollector, envpool.make_gymnasium("CartPole-v1", num_envs=3, seed=7), policy,
                        count=1, frames_per_batch=300)[0]
    env = envpool.make_gymnasium("CartPole-v1", num_envs=3, seed=7)
    obs, _ = env.reset()
    rows = []
    for _ in range(100):
        nxt, reward, terminated, truncated, _ = env.step((obs[:, 2] > 0).astype(np.int64))
        rows.append((obs, nxt, reward, terminated | truncated))
        obs = nxt.copy()
        done = np.flatnonzero(terminated | truncated)
        if done.size:
            obs[done] = env.reset(done.astype(np.int32))[0]
    want = {name: torch.as_tensor(np.stack([r[i] for r in rows], axis=1)) for i, name in
            enumerate(["observation", "next_observation", "reward", "done"])}
    assert got.batch_size == (3, 100) and got["next", "done"].any()
    assert torch.equal(got["observation"], want["observation"].float())
    assert torch.equal(got["next", "observation"], want["next_observation"].float())
    assert torch.equal(got["next", "reward"][..., 0], want["reward"].float())
    assert torch.equal(got["next", "done"][..., 0], want["done"])


def test_a_vmas_env_gives_the_batches_of_torchrls_collector():
    pytest.importorskip("vmas", reason="VMAS is in the multiagent extra")
    from torchrl.envs.libs.vmas import VmasEnv

    def vmas() -> EnvBase:
        return VmasEnv(scenario="navigation", num_envs=6, continuous_actions=True, max_steps=20, device="cpu",
                       n_agents=3, seed=0)

    def policy(td: TensorDictBase) -> TensorDictBase:
        return td.set(("agents", "action"), torch.zeros(*td.shape, 3, 2))

    expected = first_batches(Collector, vmas(), policy, count=1, frames_per_batch=60)[0]
    got = first_batches(ThreadedCollector, vmas(), policy, count=1, frames_per_batch=60)[0]
    assert got.batch_size == expected.batch_size == (6, 10)
    assert_same_batches([expected], [got])
