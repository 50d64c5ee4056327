"""A batched env swapped in as is: ``ThreadedCollector(batched_env)`` gives ``Collector(batched_env)``'s batches.

Each form of batched env a TorchRL user hands to ``Collector`` (``SerialEnv``, ``ParallelEnv``, a
``TransformedEnv`` of one, nested to two batch dims, ``GymEnv(num_envs=k)``) and a gymnasium vector
env in each autoreset mode is taken apart into its single envs. With a deterministic env and policy the
batches are equal, leaf by leaf, to TorchRL's own; otherwise keys, shapes, dtypes and dim names are.
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
from torchrl.testing.mocking_classes import CountingEnv

from lightning_rollout import ThreadedCollector

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
    for theirs, ours in zip(expected, got, strict=True):
        assert ours.batch_size == theirs.batch_size and ours.names == theirs.names
        want, have = leaves(theirs), leaves(ours)
        assert set(have) == set(want)
        for key, value in want.items():
            assert have[key].dtype == value.dtype, key
            assert torch.equal(have[key], value), key


def test_gym_env_with_num_envs_gives_the_layout_of_torchrls_collector():
    expected = first_batches(Collector, GymEnv("CartPole-v1", num_envs=2), None, count=1)[0]
    got = first_batches(ThreadedCollector, GymEnv("CartPole-v1", num_envs=2), None, count=1)[0]
    assert got.batch_size == expected.batch_size == (2, 6) and got.names == expected.names
    assert {k: (v.shape, v.dtype) for k, v in leaves(got).items()} == {
        k: (v.shape, v.dtype) for k, v in leaves(expected).items()}


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


@pytest.mark.parametrize("mode", list(AutoresetMode), ids=lambda m: m.name)
@pytest.mark.parametrize("vector", [gym.vector.SyncVectorEnv, gym.vector.AsyncVectorEnv],
                         ids=lambda v: v.__name__)
def test_a_gymnasium_vector_env_is_its_single_envs_in_any_autoreset_mode(vector, mode):
    # 48 frames of 2 CartPoles: episodes end inside the batch; no autoreset step is counted as a frame
    got = first_batches(ThreadedCollector, vector([cartpole] * 2, autoreset_mode=mode), None, count=1,
                        frames_per_batch=96, seed=3)[0]
    singles = first_batches(ThreadedCollector, [cartpole] * 2, None, count=1, frames_per_batch=96, seed=3)[0]
    assert got.batch_size == (2, 48) and got.names == [None, "time"]
    assert got["next", "done"].any()
    assert (got["next", "reward"] == 1).all()  # CartPole pays 1 for every real step, 0 for an autoreset step
    assert leaves(got).keys() == leaves(singles).keys()
    for key, value in leaves(singles).items():
        assert torch.equal(leaves(got)[key], value), key


@pytest.mark.parametrize("mode", [AutoresetMode.SAME_STEP, AutoresetMode.DISABLED], ids=lambda m: m.name)
def test_a_gymnasium_vector_env_has_the_shape_of_torchrls_wrapper_of_it(mode):
    # TorchRL's GymWrapper takes these two modes of a vector env (it refuses NEXT_STEP)
    expected = first_batches(Collector, GymWrapper(gym.vector.SyncVectorEnv([cartpole] * 2, autoreset_mode=mode)),
                             None, count=1)[0]
    got = first_batches(ThreadedCollector, gym.vector.SyncVectorEnv([cartpole] * 2, autoreset_mode=mode), None,
                        count=1)[0]
    assert got.batch_size == expected.batch_size and got.names == expected.names
    shared = set(leaves(expected)) & set(leaves(got))
    assert {("next", "observation"), ("next", "reward"), ("next", "done"), "action"} <= shared


def test_num_envs_that_disagrees_with_the_batched_env_is_refused():
    with pytest.raises(ValueError, match="num_envs=4 but the batched env holds 3 envs"):
        ThreadedCollector(SerialEnv(3, counting_env), ones_policy, frames_per_batch=12, num_envs=4)


def test_a_wrapped_vector_env_is_refused_with_what_to_do():
    env = gym.wrappers.vector.RecordEpisodeStatistics(gym.vector.SyncVectorEnv([cartpole] * 2))
    with pytest.raises(ValueError, match="cannot be taken apart.*factory of one env"):
        ThreadedCollector(env, None, frames_per_batch=12)


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
