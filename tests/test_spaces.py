"""Gymnasium spaces through ``ThreadedCollector``: nested ``Dict`` / ``Tuple`` observations, entry names
that TorchRL or the loop use themselves, random actions of unbounded ``Box`` spaces, float64 values.

The envs encode where each value comes from (env id, episode, step) in their observations, so every
entry of a batch is checked against the step that produced it. They are module-level classes: worker
processes (``num_workers=2``) import them by name.
"""

from __future__ import annotations

import functools
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch
from torchrl.collectors import Collector
from torchrl.data import Bounded, Composite
from torchrl.envs import GymWrapper

from lightning_rollout import EnvError, ThreadedCollector

pytestmark = [pytest.mark.timeout(180), pytest.mark.skipif(sys.platform == "win32", reason="POSIX processes")]

EPS = 2.0 ** -40  # 1 + EPS is a float64 value float32 cannot hold
LENGTH = 3  # steps per episode of the envs below


# -- envs ------------------------------------------------------------------------------------------
class NestedSpacesEnv(gym.Env):
    """Observation ``Dict({"a": Tuple((Box float64 [3], Discrete(5))), "b": Box float32 [3]})`` (or, with
    ``top_tuple``, ``Tuple((Box float64 [3], Discrete(5)))``): the box holds ``[env_id, episode, t] + EPS``,
    the index ``(env_id + episode + t) % 5``, ``b`` ``[env_id, episode, t]``. Episodes of ``LENGTH`` steps."""

    metadata: dict = {"render_modes": []}
    action_space = gym.spaces.Discrete(2)

    def __init__(self, env_id: int = 0, *, top_tuple: bool = False) -> None:
        self.env_id, self.top_tuple = env_id, top_tuple
        pair = gym.spaces.Tuple((gym.spaces.Box(-1e9, 1e9, (3,), np.float64), gym.spaces.Discrete(5)))
        self.observation_space = pair if top_tuple else gym.spaces.Dict(
            {"a": pair, "b": gym.spaces.Box(-1e9, 1e9, (3,), np.float32)})
        self.episode, self.t = -1, 0

    def _obs(self):
        where = np.array([self.env_id, self.episode, self.t], np.float64)
        pair = (where + EPS, np.int64((self.env_id + self.episode + self.t) % 5))
        return pair if self.top_tuple else {"a": pair, "b": where.astype(np.float32)}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.episode += 1
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), 1.0, self.t >= LENGTH, False, {}


class Float64Env(gym.Env):
    """Observation ``[env_id, episode, t] + EPS`` (float64, under ``"x"`` with ``dict_obs``), ``info["t"]``
    ``[t + EPS]`` (float64), a float64 ``Box`` action. Episodes of ``LENGTH`` steps."""

    metadata: dict = {"render_modes": []}
    action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float64)

    def __init__(self, env_id: int = 0, *, dict_obs: bool = False) -> None:
        box = gym.spaces.Box(-np.inf, np.inf, (3,), np.float64)
        self.observation_space = gym.spaces.Dict({"x": box}) if dict_obs else box
        self.env_id, self.dict_obs = env_id, dict_obs
        self.episode, self.t = -1, 0

    def _out(self):
        obs = np.array([self.env_id, self.episode, self.t], np.float64) + EPS
        return ({"x": obs} if self.dict_obs else obs), {"t": np.array([self.t + EPS])}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.episode += 1
        self.t = 0
        return self._out()

    def step(self, action):
        self.t += 1
        obs, info = self._out()
        return obs, 1.0, self.t >= LENGTH, False, info


class NamedEntryEnv(gym.Env):
    """A ``Dict`` observation with an entry ``name`` (a nested key: a ``Dict`` path) and ``"x"``."""

    metadata: dict = {"render_modes": []}
    action_space = gym.spaces.Discrete(2)

    def __init__(self, name: str | tuple[str, ...] = "x") -> None:
        path = name if isinstance(name, tuple) else (name,)
        space: gym.Space = gym.spaces.Box(-10, 10, (1,), np.float32)
        for part in reversed(path[1:]):
            space = gym.spaces.Dict({part: space})
        self.observation_space = gym.spaces.Dict({path[0]: space, "x": gym.spaces.Box(-10, 10, (1,), np.float32)})

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.observation_space.sample(), {"extra": np.zeros(1, np.float32)}

    def step(self, action):
        return self.observation_space.sample(), 0.0, False, False, {"extra": np.zeros(1, np.float32)}


class BoxActionEnv(gym.Env):
    """A ``Box(low, high, (2,))`` float32 action space; every action received is kept in ``received``."""

    metadata: dict = {"render_modes": []}
    observation_space = gym.spaces.Box(-1, 1, (1,), np.float32)

    def __init__(self, low, high) -> None:
        self.action_space = gym.spaces.Box(np.broadcast_to(np.float32(low), (2,)),
                                           np.broadcast_to(np.float32(high), (2,)), (2,), np.float32)
        self.received: list[np.ndarray] = []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.received.append(np.array(action, copy=True))
        return np.zeros(1, np.float32), 0.0, False, len(self.received) % 5 == 0, {}


def _collect(factories, policy=None, *, frames: int, **kwargs) -> list:
    collector = ThreadedCollector(factories, policy, frames_per_batch=frames, total_frames=2 * frames,
                                  envs_per_thread=kwargs.pop("envs_per_thread", 1), seed=0, **kwargs)
    try:
        return [batch.clone() for batch in collector]
    finally:
        collector.shutdown()


# -- nested Dict / Tuple observations ----------------------------------------------------------------
def _check_nested(batch, *, top_tuple: bool) -> None:
    """Every root and ``"next"`` entry is what env ``row`` emitted at the step its ``step_count`` names."""
    box_key, index_key = (("observation", "0"), ("observation", "1")) if top_tuple else (("a", "0"), ("a", "1"))
    for prefix in ((), ("next",)):
        box = batch[(*prefix, *box_key)]
        assert box.dtype == torch.float64 and box.shape == (*batch.batch_size, 3)
        where = box.round()
        assert torch.equal(box - where, torch.full_like(box, EPS)), "float64 values stored exactly"
        env, episode, t = where.unbind(-1)
        assert torch.equal(env, torch.arange(batch.shape[0], dtype=torch.float64)[:, None].expand_as(env))
        assert torch.equal(t.long(), batch[(*prefix, "step_count")].squeeze(-1))
        index = batch[(*prefix, *index_key)]
        assert index.dtype == torch.int64 and index.shape == batch.batch_size
        assert torch.equal(index, (env + episode + t).long() % 5)
        if not top_tuple:
            assert torch.equal(batch[(*prefix, "b")], where.float())
    root_t = batch["a" if not top_tuple else "observation", "0"][..., 2].round()
    assert torch.equal(batch["next", "step_count"].squeeze(-1), root_t.long() + 1)
    assert batch["next", "done"].any(), "episodes ended within the batches"


@pytest.mark.parametrize("num_workers", [1, 2], ids=["threads", "worker processes"])
def test_dict_of_tuple_observations_hold_what_the_env_emitted(num_workers):
    batches = _collect([functools.partial(NestedSpacesEnv, i) for i in range(4)], frames=16,
                       num_workers=num_workers, envs_per_thread=2)
    for batch in batches:
        assert batch.batch_size == (4, 4)
        _check_nested(batch, top_tuple=False)


@pytest.mark.parametrize("num_workers", [1, 2], ids=["threads", "worker processes"])
def test_top_level_tuple_observation_is_stored_under_observation(num_workers):
    batches = _collect([functools.partial(NestedSpacesEnv, i, top_tuple=True) for i in range(2)], frames=8,
                       num_workers=num_workers)
    for batch in batches:
        assert {"0", "1"}.isdisjoint(batch.keys()), "no tuple entries at the root"
        _check_nested(batch, top_tuple=True)


class DictBoxEnv(gym.Env):
    """A ``Dict`` of a float64 ``Box``, a nested ``Dict`` of a ``Discrete`` and a ``MultiBinary``: what
    TorchRL's ``GymWrapper`` converts without stacking."""

    metadata: dict = {"render_modes": []}
    observation_space = gym.spaces.Dict({
        "pos": gym.spaces.Box(-1, 1, (2,), np.float64),
        "inner": gym.spaces.Dict({"flag": gym.spaces.Discrete(3), "bits": gym.spaces.MultiBinary(4)}),
    })
    action_space = gym.spaces.Box(-1, 1, (1,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 0.0, False, False, {}


def test_nested_dict_observation_keys_shapes_and_dtypes_match_torchrl_collector():
    ours = _collect([DictBoxEnv] * 2, frames=8, num_workers=1)[0]
    theirs_collector = Collector(lambda: GymWrapper(DictBoxEnv(), categorical_action_encoding=True), None,
                                 frames_per_batch=4, total_frames=4)
    theirs = next(iter(theirs_collector))
    theirs_collector.shutdown()

    def leaves(td, lead: int):
        return {k: (tuple(v.shape[lead:]), v.dtype) for k, v in td.items(True, True)
                if (k[-1] if isinstance(k, tuple) else k) not in ("is_init", "step_count", "episode_reward")}

    mine, torchrl = leaves(ours, 2), leaves(theirs, 1)
    assert mine == torchrl, set(mine.items()) ^ set(torchrl.items())


# -- entry names TorchRL or the loop use -----------------------------------------------------------
RESERVED = ["action", "reward", "done", "terminated", "truncated", "next", "is_init", "step_count", "episode_reward",
            "policy_version", "collector", "_loop"]


@pytest.mark.parametrize("name", RESERVED)
def test_observation_entry_named_after_a_torchrl_or_loop_key_is_refused_naming_it(name):
    with pytest.raises(ValueError, match=rf"entry '{name}' of the observation space collides with .*rename it"):
        ThreadedCollector(functools.partial(NamedEntryEnv, name), None, frames_per_batch=4, num_workers=1)


def test_nested_observation_entry_under_a_reserved_key_is_refused():
    with pytest.raises(ValueError, match=r"entry \('reward', 'x'\) of the observation space \(under 'reward'\)"):
        ThreadedCollector(functools.partial(NamedEntryEnv, ("reward", "x")), None, frames_per_batch=4, num_workers=1)


def test_reserved_observation_entry_is_refused_with_worker_processes_naming_it():
    # the same ValueError as in one process: this process builds the first shard's envs before any child starts
    with pytest.raises(ValueError, match="entry 'done' of the observation space collides with TorchRL's done flag"):
        ThreadedCollector([functools.partial(NamedEntryEnv, "done")] * 2, None, frames_per_batch=4, num_workers=2,
                          envs_per_thread=1)


@pytest.mark.parametrize("name", ["reward", "collector"])
def test_info_key_named_after_a_torchrl_or_loop_key_is_refused_naming_it(name):
    with pytest.raises(ValueError, match=rf"entry '{name}' of the info_keys collides with"):
        ThreadedCollector(NamedEntryEnv, None, frames_per_batch=4, num_workers=1,
                          info_keys={name: Bounded(-1, 1, (1,))})


def test_torchrl_env_entry_named_after_a_loop_key_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"entry 'collector' of the env's specs collides with .*RenameTransform"):
        ThreadedCollector(lambda: GymWrapper(NamedEntryEnv("collector")), None, frames_per_batch=4)


def test_observation_entry_named_observation_in_a_dict_is_kept():
    batch = _collect([functools.partial(NamedEntryEnv, "observation")], frames=4, num_workers=1)[0]
    assert batch["observation"].shape == batch["next", "observation"].shape == (4, 1)


# -- random actions of unbounded Box spaces ---------------------------------------------------------
BOUNDS = {
    "bounded below": (0.0, np.inf),
    "bounded above": (-np.inf, 0.0),
    "unbounded": (-np.inf, np.inf),
    "bounded": (-1.0, 1.0),
    "per dim": ([0.0, -np.inf], [np.inf, 2.0]),
}


def _assert_within(actions: np.ndarray, low, high) -> None:
    low, high = np.broadcast_to(low, (2,)), np.broadcast_to(high, (2,))
    assert np.isfinite(actions).all(), actions
    assert (actions >= low).all() and (actions <= high).all(), actions
    assert len(np.unique(actions)) > len(actions) // 2, "the actions are random"


class _Made:
    """A factory of :class:`BoxActionEnv` (through ``wrap``) keeping every env it made."""

    def __init__(self, low, high, wrap=lambda env: env) -> None:
        self.low, self.high, self.wrap = low, high, wrap
        self.envs: list[BoxActionEnv] = []

    def __call__(self):
        env = BoxActionEnv(self.low, self.high)
        self.envs.append(env)
        return self.wrap(env)

    def received(self) -> np.ndarray:
        return np.concatenate([np.stack(env.received) for env in self.envs if env.received])


@pytest.mark.parametrize("bounds", BOUNDS.values(), ids=BOUNDS.keys())
def test_default_random_policy_sends_finite_actions_within_the_box(bounds):
    made = _Made(*bounds)
    batches = _collect([made] * 2, frames=32, num_workers=1)
    received = made.received()
    assert len(received) >= 64
    _assert_within(received, *bounds)
    _assert_within(torch.cat([b["action"] for b in batches]).reshape(-1, 2).numpy(), *bounds)


@pytest.mark.parametrize("bounds", [BOUNDS["bounded below"], BOUNDS["per dim"]], ids=["bounded below", "per dim"])
@pytest.mark.parametrize("init_random_frames", [0, 16], ids=["random policy", "random frames"])
def test_torchrl_env_random_actions_are_finite_within_the_box(bounds, init_random_frames):
    made = _Made(*bounds, wrap=GymWrapper)
    policy = None if not init_random_frames else (lambda observation: torch.zeros(observation.shape[0], 2))
    _collect([made] * 2, policy, frames=16, num_workers=1, init_random_frames=init_random_frames)
    per_env = init_random_frames // 2 or None  # the first random steps of each env (all with no policy)
    random = np.concatenate([np.stack(env.received[:per_env]) for env in made.envs if env.received])
    assert len(random) >= (init_random_frames or 32)
    _assert_within(random, *bounds)


def test_random_sample_draws_unbounded_dims_as_gymnasium_box_sample():
    from lightning_rollout.specs import random_sample

    low = torch.tensor([0.0, -torch.inf, -torch.inf, -1.0])
    high = torch.tensor([torch.inf, torch.inf, 3.0, 1.0])
    spec = Composite(action=Bounded(low, high, (4,), dtype=torch.float32))
    torch.manual_seed(0)
    sample = random_sample(spec, (20_000,))["action"]
    assert sample.shape == (20_000, 4) and sample.dtype == torch.float32 and torch.isfinite(sample).all()
    mean, std = sample.mean(0), sample.std(0)
    # low + Exponential(1): mean low + 1, std 1; Normal(0, 1); high - Exponential(1): mean high - 1; uniform
    assert sample[:, 0].min() >= 0 and abs(mean[0] - 1) < 0.05 and abs(std[0] - 1) < 0.05
    assert abs(mean[1]) < 0.05 and abs(std[1] - 1) < 0.05
    assert sample[:, 2].max() <= 3 and abs(mean[2] - 2) < 0.05 and abs(std[2] - 1) < 0.05
    assert sample[:, 3].min() >= -1 and sample[:, 3].max() <= 1 and abs(std[3] - 2 / 12 ** 0.5) < 0.05


# -- float64 values ------------------------------------------------------------------------------------
def _check_float64(batch, key) -> None:
    for prefix in ((), ("next",)):
        obs = batch[(*prefix, key)]
        assert obs.dtype == torch.float64
        where = obs.round()
        assert torch.equal(obs - where, torch.full_like(obs, EPS)), obs
        assert torch.equal(where[..., 2].long(), batch[(*prefix, "step_count")].squeeze(-1))
        info = batch[(*prefix, "t")]
        assert info.dtype == torch.float64 and torch.equal(info, where[..., 2:] + EPS)


@pytest.mark.parametrize("layout", ["env_time", "flat"])
@pytest.mark.parametrize("num_workers", [1, 2], ids=["threads", "worker processes"])
@pytest.mark.parametrize("dict_obs", [False, True], ids=["box", "dict"])
def test_float64_observations_and_info_round_trip_exactly(layout, num_workers, dict_obs):
    key = "x" if dict_obs else "observation"
    seen: list[torch.Tensor] = []

    def policy(tensordict):  # runs in this process, on what the batch is built from
        seen.append(tensordict[key].clone())
        return tensordict.set("action", torch.zeros(*tensordict.batch_size, 1, dtype=torch.float64))

    batches = _collect([functools.partial(Float64Env, i, dict_obs=dict_obs) for i in range(4)], policy, frames=16,
                       num_workers=num_workers, envs_per_thread=2, layout=layout, info_keys=["t"])
    for batch in batches:
        _check_float64(batch, key)
    assert any(b["next", "done"].any() for b in batches)
    observed = torch.cat([s.reshape(-1, 3) for s in seen])
    assert observed.dtype == torch.float64 and torch.equal(observed - observed.round(), torch.full_like(observed, EPS))


@pytest.mark.parametrize("num_envs", [1, 2])
def test_scalar_discrete_observation_reaches_an_exact_tensordict_module_in_its_row_shape(num_envs):
    """Taxi's observation is one integer (``Discrete(500)``, shape ``[]``): a one-env collector calls the
    policy on the unbatched row (a 0-d tensor), as TorchRL's ``Collector`` does; the batch holds it."""
    from tensordict.nn import TensorDictModule

    seen: list[torch.Size] = []

    def policy(obs: torch.Tensor) -> torch.Tensor:
        seen.append(obs.shape)
        return torch.zeros(obs.shape, dtype=torch.int64)  # action 0 ("south") for every row

    module = TensorDictModule(policy, in_keys=["observation"], out_keys=["action"])
    collector = ThreadedCollector(lambda: gym.make("Taxi-v4"), module, num_envs=num_envs, frames_per_batch=4 * num_envs,
                                  total_frames=4 * num_envs, seed=0)
    try:
        batch = next(iter(collector))
    finally:
        collector.shutdown()
    expected = torch.Size([]) if num_envs == 1 else torch.Size([num_envs])
    assert seen and set(seen) == {expected}
    assert batch.batch_size == ((4,) if num_envs == 1 else (num_envs, 4))
    assert batch["observation"].dtype == torch.int64 and (batch["action"] == 0).all()
    reference = gym.make("Taxi-v4")
    obs, _ = reference.reset(seed=0)
    assert batch["observation"].reshape(-1)[0].item() == obs
