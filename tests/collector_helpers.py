"""Helpers for tests/test_collector.py: actors, envs and checks shared by the ThreadedCollector tests.

Kept apart from ``conftest.py`` (shared by the whole suite) so these TorchRL-heavy
helpers are only imported by the collector tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.envs import Compose, GymEnv, RewardSum, StepCounter, TransformedEnv
from torchrl.modules import OneHotCategorical, ProbabilisticActor, ValueOperator

from conftest import MockEnv, mock_envs

CARTPOLE = "CartPole-v1"
OBS_DIM, N_ACTIONS = 4, 2

# Keys TorchRL's Collector gives for CartPole and a ProbabilisticActor(return_log_prob=True).
TORCHRL_KEYS = {
    "observation", "action", "action_log_prob", "logits", "done", "terminated", "truncated",
    ("next", "observation"), ("next", "reward"), ("next", "done"), ("next", "terminated"), ("next", "truncated"),
    ("collector", "traj_ids"),
}
# What StepCounter + RewardSum add to TorchRL's batch (ThreadedCollector always has them).
COUNTER_KEYS = {"step_count", "episode_reward", ("next", "step_count"), ("next", "episode_reward")}
# What only ThreadedCollector adds, for a gymnasium env: InitTracker's is_init (TorchRL 0.15's default).
OWN_KEYS = {"is_init", ("next", "is_init")}


def make_actor(seed: int = 0) -> ProbabilisticActor:
    """A CartPole actor: linear logits, one-hot categorical actions, ``action_log_prob`` written."""
    torch.manual_seed(seed)
    net = TensorDictModule(nn.Linear(OBS_DIM, N_ACTIONS), in_keys=["observation"], out_keys=["logits"])
    return ProbabilisticActor(net, in_keys=["logits"], out_keys=["action"], distribution_class=OneHotCategorical,
                              return_log_prob=True)


def make_critic(seed: int = 1) -> ValueOperator:
    torch.manual_seed(seed)
    return ValueOperator(nn.Linear(OBS_DIM, 1), in_keys=["observation"])


def cartpole_with_counters() -> TransformedEnv:
    """TorchRL's CartPole with ``StepCounter`` and ``RewardSum``, unbatched."""
    return TransformedEnv(GymEnv(CARTPOLE), Compose(StepCounter(), RewardSum()))


def balance_policy(obs: torch.Tensor) -> torch.Tensor:
    """A deterministic plain-callable CartPole policy: push toward the side the pole leans to."""
    return (obs[:, 2] > 0).long()


def stream_envs(n: int, length: int = 5) -> list[Callable[[], MockEnv]]:
    """``n`` factories of :class:`conftest.MockEnv` (observation ``[env_id, episode, t]``);
    episodes last ``length`` steps and terminate, reward 1 per step."""
    return mock_envs(n, length_fn=lambda env_id, episode: length, reward_fn=lambda env_id, episode, t: 1.0)


def stream_policy(obs: torch.Tensor) -> torch.Tensor:
    return torch.zeros(obs.shape[0], dtype=torch.long)


def wait_for(condition: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    """Wait (polling) until ``condition()`` holds; fail after ``timeout`` s. Not a race-winning sleep:
    the test proceeds as soon as the state it needs is there."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.01)


def leaf_keys(td: TensorDictBase) -> set:
    return set(td.keys(include_nested=True, leaves_only=True))


def assert_traj_ids_follow_done(batches: Iterable[TensorDictBase]) -> None:
    """``batches`` in env_time layout, consecutive: within each env row (across batch boundaries)
    a new trajectory id starts right after every done and never otherwise, and no id is shared
    by two rows or reused later in a row."""
    batches = list(batches)
    traj = torch.cat([b["collector", "traj_ids"] for b in batches], dim=1)
    done = torch.cat([b["next", "done"] for b in batches], dim=1).squeeze(-1)
    seen: set[int] = set()
    for row_traj, row_done in zip(traj, done):
        changed = row_traj[1:] != row_traj[:-1]
        assert torch.equal(changed, row_done[:-1]), (row_traj.tolist(), row_done.tolist())
        runs = [int(row_traj[0])] + [int(x) for x in row_traj[1:][changed]]
        assert len(set(runs)) == len(runs), f"a trajectory id was reused within a row: {runs}"
        assert not seen & set(runs), f"trajectory ids shared between env rows: {seen & set(runs)}"
        seen |= set(runs)
