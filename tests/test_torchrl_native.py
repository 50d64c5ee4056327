"""The TorchRL-native data path: every kind of TorchRL policy and env spec, recurrent state, determinism.

Where TorchRL's own ``Collector`` can run the same thing, ours is compared with it value for value.
"""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn
from torchrl.collectors import Collector
from torchrl.envs import Compose, GymEnv, InitTracker, SerialEnv, StepCounter, TransformedEnv
from torchrl.envs.utils import ExplorationType, RandomPolicy
from torchrl.modules import EGreedyModule, GRUModule, LSTMModule, OrnsteinUhlenbeckProcessModule
from torchrl.testing.mocking_classes import ContinuousActionVecMockEnv, CountingEnv, NestedCountingEnv

from lightning_rollout import MultiEnvLoop, ThreadedCollector
from lightning_rollout.errors import PolicyError

pytestmark = pytest.mark.timeout(120)
DET = ExplorationType.DETERMINISTIC


@pytest.fixture(autouse=True)
def _quiet_torchrl():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def collect(create_env_fn, policy, frames: int, **kwargs) -> TensorDictBase:
    collector = ThreadedCollector(create_env_fn, policy, frames_per_batch=frames, total_frames=frames, **kwargs)
    try:
        return next(iter(collector))
    finally:
        collector.shutdown()


def torchrl_collect(env, policy, frames: int, **kwargs) -> TensorDictBase:
    collector = Collector(env, policy, frames_per_batch=frames, total_frames=frames,
                          auto_register_policy_transforms=False, **kwargs)
    try:
        return next(iter(collector))
    finally:
        collector.shutdown()


def assert_same(ours: TensorDictBase, theirs: TensorDictBase) -> None:
    assert set(ours.keys(True, True)) == set(theirs.keys(True, True))
    assert ours.batch_size == theirs.batch_size
    for key in theirs.keys(True, True):
        assert ours[key].dtype == theirs[key].dtype, key
        if ours[key].is_floating_point():
            torch.testing.assert_close(ours[key], theirs[key], msg=str(key))
        else:
            assert torch.equal(ours[key], theirs[key]), key


# -- recurrent policies ---------------------------------------------------------------------------------
def recurrent_policy(kind: str) -> tuple[TensorDictSequential, object]:
    torch.manual_seed(0)
    cls = LSTMModule if kind == "lstm" else GRUModule
    rnn = cls(input_size=4, hidden_size=8, in_key="observation", out_key="embed")
    head = TensorDictModule(nn.Linear(8, 2), in_keys=["embed"], out_keys=["logits"])
    act = TensorDictModule(lambda logits: nn.functional.one_hot(logits.argmax(-1), 2), in_keys=["logits"],
                           out_keys=["action"])
    return TensorDictSequential(rnn, head, act), rnn


class SeededCartPole:
    """A picklable factory of TorchRL CartPole with InitTracker, a step limit and the policy's primer,
    seeded with ``seed`` at creation (so ours and TorchRL's see the same streams without set_seed)."""

    def __init__(self, rnn: object, seed: int) -> None:
        self.rnn, self.seed = rnn, seed

    def __call__(self) -> TransformedEnv:
        env = TransformedEnv(GymEnv("CartPole-v1"), Compose(InitTracker(), StepCounter(max_steps=7)))
        env.append_transform(self.rnn.make_tensordict_primer())
        env.set_seed(self.seed)
        return env


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("num_envs", [1, 3])
def test_recurrent_policy_batches_equal_torchrl_collector_value_for_value(kind, num_envs):
    """Hidden state written under "next" is fed back into each env's next step and zeroed at each
    episode start (primer + InitTracker), exactly as TorchRL's collector does it."""
    policy, rnn = recurrent_policy(kind)
    factories = [SeededCartPole(rnn, 10 + i) for i in range(num_envs)]
    theirs_env = factories[0]() if num_envs == 1 else SerialEnv(num_envs, factories)
    theirs = torchrl_collect(theirs_env, policy, 30 * num_envs, exploration_type=DET)
    ours = collect(factories, policy, 30 * num_envs, exploration_type=DET)
    assert theirs["next", "done"].sum() >= num_envs, "episodes must end inside the batch"
    assert_same(ours, theirs)

    state = "recurrent_state_h" if kind == "lstm" else "recurrent_state"
    h, next_h = ours[state], ours["next", state]
    done, init = ours["next", "done"].squeeze(-1), ours["is_init"].squeeze(-1)
    assert (h[init] == 0).all(), "the state is zero at each episode start"
    assert (h[~init] != 0).any()
    carried = ~done[..., :-1]
    assert torch.equal(next_h[..., :-1, :, :][carried], h[..., 1:, :, :][carried]), "('next', state) at t is state at t+1"


def test_recurrent_state_on_a_gym_id_is_carried_without_a_primer():
    """A gymnasium env has no primer: what the policy writes under "next" is still fed back, and
    zeroed when an episode starts (the loop provides is_init)."""
    policy, _ = recurrent_policy("lstm")
    batch = collect("CartPole-v1", policy, 64, num_envs=2, max_frames_per_traj=9, exploration_type=DET)
    h, next_h = batch["recurrent_state_h"], batch["next", "recurrent_state_h"]
    init, done = batch["is_init"].squeeze(-1), batch["next", "done"].squeeze(-1)
    assert init[:, 0].all() and done.any()
    assert (h[init] == 0).all() and (h[~init] != 0).any()
    assert torch.equal(next_h[:, :-1][~done[:, :-1]], h[:, 1:][~done[:, :-1]])
    assert torch.equal(init[:, 1:], done[:, :-1]), "an episode starts right after a done"


# -- every kind of policy ------------------------------------------------------------------------------------
def test_torchrl_random_policy_and_policy_none_give_valid_actions_of_the_spec():
    env = ContinuousActionVecMockEnv()
    for policy in (RandomPolicy(env.action_spec), None):
        batch = collect([ContinuousActionVecMockEnv] * 2, policy, 8)
        assert batch["action"].shape == (2, 4, 7)
        assert env.action_spec.is_in(batch["action"][0, 0])


def test_tensordict_function_and_module_without_in_keys_get_every_root_entry():
    seen: list[set] = []

    def td_policy(td: TensorDictBase) -> TensorDictBase:
        seen.append(set(td.keys(True, True)))
        return td.set("action", td["observation"][..., :1].clone().float().clamp(0, 1).long().squeeze(-1) * 0)

    batch = collect("CartPole-v1", td_policy, 8, num_envs=2)
    assert batch["action"].shape == (2, 4)
    assert {"observation", "is_init", "step_count", "episode_reward", "done", "terminated", "truncated"} <= seen[-1]


def test_module_reading_is_init_and_step_count_is_handed_them():
    class ByStep(nn.Module):
        def forward(self, observation, is_init, step_count):
            return (step_count.squeeze(-1) % 2) * (~is_init.squeeze(-1))

    batch = collect("CartPole-v1", ByStep(), 16, num_envs=2, max_frames_per_traj=5)
    expected = (batch["step_count"].squeeze(-1) % 2) * (~batch["is_init"].squeeze(-1))
    assert torch.equal(batch["action"], expected)


def test_module_with_several_outputs_is_split_as_torchrl_does():
    class TwoHeads(nn.Module):
        def forward(self, observation):
            return observation[..., 0].gt(0).long(), observation.sum(-1, keepdim=True)

    batch = collect("CartPole-v1", TwoHeads(), 8, num_envs=2)
    assert batch["action"].shape == (2, 4) and batch["output1"].shape == (2, 4, 1)


def test_unwrappable_policy_raises_torchrl_type_error():
    class Unwrappable(nn.Module):
        def forward(self, observation, other_stuff):
            return observation

    with pytest.raises(TypeError, match="incongruent signatures|automatically wrap"):
        ThreadedCollector("CartPole-v1", Unwrappable(), frames_per_batch=4)


def test_exploration_modules_keep_their_private_state_out_of_batches():
    """OU noise reads its own "_"-prefixed entries back at the next step (kept at the root as TorchRL's
    step_mdp keeps them); batches leave "_" entries out, as TorchRL's collector does."""
    env = TransformedEnv(ContinuousActionVecMockEnv(), InitTracker())
    actor = TensorDictModule(nn.Linear(7, 7), in_keys=["observation"], out_keys=["action"])
    ou = TensorDictSequential(actor, OrnsteinUhlenbeckProcessModule(spec=env.action_spec))
    make = lambda: TransformedEnv(ContinuousActionVecMockEnv(), InitTracker())  # noqa: E731
    batch = collect([make] * 2, ou, 16)
    assert not [k for k in batch.keys(True, True) if any(p.startswith("_") for p in (k if isinstance(k, tuple) else (k,)))]
    egreedy = TensorDictSequential(TensorDictModule(lambda o: torch.zeros(o.shape[0], 2), in_keys=["observation"],
                                                    out_keys=["action"]),
                                   EGreedyModule(GymEnv("CartPole-v1").action_spec, eps_init=1.0))
    batch = collect("CartPole-v1", egreedy, 64, num_envs=2)
    assert batch["action"].sum(-1).eq(1).all() and batch["action"][..., 0].any() and batch["action"][..., 1].any()


def test_exploration_module_without_a_spec_gets_the_envs_action_spec_as_torchrl_collector_gives_it():
    """``AdditiveGaussianModule(spec=None)``: TorchRL's collector hands it the env's action spec; so does ours
    (a gymnasium env's, through the adapter), and its noise then stays within Pendulum's bounds."""
    from torchrl.modules import AdditiveGaussianModule

    actor = TensorDictModule(lambda o: torch.full((*o.shape[:-1], 1), 1.9), in_keys=["observation"],
                             out_keys=["action"])
    noisy = TensorDictSequential(actor, AdditiveGaussianModule(spec=None, sigma_init=5.0, sigma_end=5.0))
    batch = collect("Pendulum-v1", noisy, 64, num_envs=2, seed=0)
    theirs = TensorDictSequential(actor, AdditiveGaussianModule(spec=None))
    torchrl_collect(GymEnv("Pendulum-v1"), theirs, 8)
    spec, their_spec = noisy.module[1].spec, theirs.module[1].spec
    assert spec == their_spec and torch.equal(spec["action"].space.high, torch.tensor([2.0]))
    action = batch["action"]
    assert action.shape == (2, 32, 1) and (action.abs() <= 2.0).all() and not (action == 1.9).all()


def test_policy_returning_a_tuple_for_one_key_names_the_problem():
    with pytest.raises(PolicyError, match="returned a tuple|one tensor per output"):
        ThreadedCollector("CartPole-v1", TensorDictModule(lambda o: (o, o), in_keys=["observation"],
                                                          out_keys=["action"]), frames_per_batch=4)


# -- env specs -------------------------------------------------------------------------------------------
def test_nested_env_batches_equal_torchrl_collector_with_nested_batch_dims():
    factories = [lambda: NestedCountingEnv(nest_obs_action=True)] * 2
    policy = TensorDictModule(lambda s: torch.ones_like(s), in_keys=[("data", "states")], out_keys=[("data", "action")])
    ours = collect(factories, policy, 10)
    theirs = torchrl_collect(SerialEnv(2, factories[0]), policy, 10)
    assert_same(ours.exclude("collector"), theirs.exclude("collector"))
    assert ours.get("data").batch_size == theirs.get("data").batch_size == (2, 5, 3)


class DictTupleEnv(gym.Env):
    """Nested Dict and Tuple observations, a MultiDiscrete action space."""

    observation_space = gym.spaces.Dict({
        "pos": gym.spaces.Box(-1, 1, (2,)),
        "inner": gym.spaces.Dict({"flag": gym.spaces.Discrete(3)}),
        "pair": gym.spaces.Tuple((gym.spaces.Box(0, 1, (1,)), gym.spaces.MultiBinary(2))),
    })
    action_space = gym.spaces.MultiDiscrete([3, 4])

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action):
        assert self.action_space.contains(np.asarray(action)), action
        self.t += 1
        return self.observation_space.sample(), 1.0, self.t >= 4, False, {}


def test_nested_dict_and_tuple_observations_become_nested_keys_and_random_actions_are_valid():
    batch = collect([DictTupleEnv] * 2, None, 12)
    assert batch["pos"].shape == (2, 6, 2)
    assert batch["inner", "flag"].shape == (2, 6) and batch["inner", "flag"].dtype == torch.int64
    assert batch["pair", "0"].shape == (2, 6, 1) and batch["pair", "1"].shape == (2, 6, 2)
    assert batch["next", "pair", "1"].shape == (2, 6, 2)
    assert batch["action"].shape == (2, 6, 7)  # TorchRL's MultiOneHot; the env got valid indices (it asserts)


def test_discrete_one_random_actions_are_action_zero():
    class OneAction(gym.Env):
        observation_space = gym.spaces.Box(-1, 1, (1,))
        action_space = gym.spaces.Discrete(1)

        def reset(self, *, seed=None, options=None):
            return np.zeros(1, np.float32), {}

        def step(self, action):
            assert action == 0, action
            return np.zeros(1, np.float32), 0.0, False, False, {}

    assert collect([OneAction], None, 4)["action"].shape == (4, 1)


@pytest.mark.parametrize("action", [0.7, 5, float("nan")])
def test_invalid_discrete_action_blames_the_policy(action):
    policy = lambda observation: torch.full((observation.shape[0],), action)  # noqa: E731
    with pytest.raises(PolicyError, match="invalid action"):
        collect("CartPole-v1", policy, 4, num_envs=2)


def test_out_of_bounds_box_action_blames_the_policy():
    policy = lambda observation: torch.full((observation.shape[0], 1), 5.0)  # noqa: E731
    with pytest.raises(PolicyError, match="out of the bounds"):
        collect("Pendulum-v1", policy, 4, num_envs=2)


# -- determinism -----------------------------------------------------------------------------------------------
def test_seeded_runs_with_a_deterministic_policy_are_bit_identical_and_traj_ids_follow_env_order():
    torch.manual_seed(0)
    policy = TensorDictModule(nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2)), in_keys=["observation"],
                              out_keys=["logits"])
    greedy = TensorDictSequential(policy, TensorDictModule(lambda x: x.argmax(-1), in_keys=["logits"],
                                                           out_keys=["action"]))
    runs = [collect("CartPole-v1", greedy, 8 * 40, num_envs=8, seed=7, max_frames_per_traj=12) for _ in range(2)]
    assert_same(runs[0], runs[1])
    traj = runs[0]["collector", "traj_ids"]
    assert torch.equal(traj[:, 0], torch.arange(8)), "first trajectories are numbered in env order"
    done = runs[0]["next", "done"].squeeze(-1)
    # new ids are handed out in (time, env) order, as TorchRL's collector does
    new = traj[:, 1:][done[:, :-1]]
    order = done[:, :-1].T.nonzero()  # (time, env) pairs in time-major order
    assert torch.equal(traj[:, 1:][order[:, 1], order[:, 0]], torch.arange(8, 8 + len(new)))


def test_single_env_batches_are_one_dimensional_like_torchrl():
    batch = collect([CountingEnv], None, 6)
    assert batch.batch_size == (6,) and batch.names == ["time"]


def test_one_env_policy_is_called_unbatched_like_torchrl_but_a_tensor_function_gets_a_batch():
    shapes = []

    def td_policy(td: TensorDictBase) -> TensorDictBase:
        shapes.append(tuple(td.batch_size))
        return td.set("action", torch.zeros((), dtype=torch.long))

    collect("CartPole-v1", td_policy, 4)
    assert set(shapes) == {()}, "TorchRL calls a policy of an unbatched env on an unbatched TensorDict"
    batch = collect("CartPole-v1", lambda obs: torch.zeros(obs.shape[0], dtype=torch.long), 4)  # the seed's form
    assert batch["action"].shape == (4,)


def test_loop_exposes_the_env_keys_and_what_the_policy_is_handed():
    policy, _ = recurrent_policy("lstm")
    with MultiEnvLoop("CartPole-v1", policy, num_envs=2, start=False) as loop:
        assert "is_init" in loop.input_keys and "recurrent_state_h" in loop.input_keys
        assert "observation" in loop.env_keys.observation


def test_policy_gets_a_tensordict_of_k_rows():
    sizes = []

    def td_policy(td: TensorDict) -> TensorDict:
        sizes.append(tuple(td.batch_size))
        return td.set("action", torch.zeros(td.shape[0], dtype=torch.long))

    collect("CartPole-v1", td_policy, 12, num_envs=3)
    assert set(sizes[1:]) <= {(1,), (2,), (3,)} and (3,) in sizes


def test_seeded_runs_of_a_stochastic_policy_sample_the_same_actions():
    """On-policy env_time (the default): each flush has the same rows in env order, and the policy samples
    from its own seeded stream, so even sampled actions are bit-identical run to run."""
    from torchrl.modules import OneHotCategorical, ProbabilisticActor

    torch.manual_seed(0)
    net = TensorDictModule(nn.Linear(4, 2), in_keys=["observation"], out_keys=["logits"])
    actor = ProbabilisticActor(net, in_keys=["logits"], out_keys=["action"], distribution_class=OneHotCategorical,
                               return_log_prob=True)
    runs = []
    for _ in range(2):
        torch.manual_seed(123 + len(runs))  # the global generator differs between the runs
        runs.append(collect("CartPole-v1", actor, 8 * 32, num_envs=8, seed=5))
    assert_same(runs[0], runs[1])
    other = collect("CartPole-v1", actor, 8 * 32, num_envs=8, seed=6)
    assert not torch.equal(other["action"], runs[0]["action"])


def test_the_policy_runs_with_the_collecting_threads_torch_thread_count():
    import threading

    seen: dict[str, int] = {}

    def td_policy(td: TensorDictBase) -> TensorDictBase:
        seen[threading.current_thread().name] = torch.get_num_threads()
        return td.set("action", torch.zeros(td.shape[0], dtype=torch.long))

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        collect("CartPole-v1", td_policy, 16, num_envs=4, envs_per_thread=1, num_workers=1)
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen.values()) == {1}, seen  # the policy runs in the collecting thread, as set
