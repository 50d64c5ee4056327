"""Helpers shared by the Lightning tests (``test_lightning.py``, ``test_lightning_habits.py``).

* :class:`Agent`: a small MLP policy in ``self.actor`` that records what every
  ``training_step`` saw; :func:`make_trainer`: a quiet CPU ``Trainer``.
* :class:`LevelEnv` and :class:`Climber`: a fully deterministic pair whose
  evaluation return is known in advance: the actor's action is a counter that
  ``training_step`` increments, and every step of a 4-step ``LevelEnv`` episode
  pays the action. So an evaluation round run after ``k`` training batches
  returns exactly ``4 * k`` per episode (``4 * k`` for training episodes too, up to
  the policy version that acted them).
* :class:`EventCounter`, :class:`EpisodesPerBatch`: callbacks that record events.
* :func:`read_scalars`: every scalar of a TensorBoard event file; :func:`read_csv_rows`: the rows of a CSV log.
"""

from __future__ import annotations

import csv
import glob
import threading
from pathlib import Path

import gymnasium as gym
import lightning.pytorch as pl
import numpy as np
import torch
from tensordict.nn import TensorDictModule
from torchrl.modules import MLP, OneHotCategorical, ProbabilisticActor

from lightning_rollout import RolloutDataModule

from conftest import THREAD_PREFIX
from lightning_rollout import RolloutCallback

LEVEL_EPISODE_STEPS = 4


def make_actor(obs_dim: int = 4, num_actions: int = 2) -> ProbabilisticActor:
    net = TensorDictModule(MLP(in_features=obs_dim, out_features=num_actions, num_cells=[16]),
                           in_keys=["observation"], out_keys=["logits"])
    return ProbabilisticActor(net, in_keys=["logits"], distribution_class=OneHotCategorical, return_log_prob=True)


class Agent(pl.LightningModule):
    """Small MLP policy in ``self.actor``; records what every ``training_step`` saw."""

    def __init__(self, obs_dim: int = 4, lr: float = 1e-2) -> None:
        super().__init__()
        self.actor = make_actor(obs_dim)
        self.lr = lr
        self.steps = 0
        self.versions: list[list[int]] = []
        self.first_weights: dict[str, torch.Tensor] | None = None

    def training_step(self, batch, batch_idx):
        if self.first_weights is None:
            self.first_weights = {k: v.detach().clone() for k, v in self.actor.state_dict().items()}
        self.steps += 1
        self.versions.append(batch["policy_version"].unique().tolist())
        logits = self.actor(batch.select("observation").clone())["logits"]
        return -logits.log_softmax(-1).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class LevelEnv(gym.Env):
    """Episodes of :data:`LEVEL_EPISODE_STEPS` steps; each step's reward is the action taken."""

    metadata: dict = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(-1.0, 1.0, shape=(3,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(1000)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(3, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.zeros(3, np.float32), float(action), self.t >= LEVEL_EPISODE_STEPS, False, {}


class LevelNet(torch.nn.Module):
    """Answers every observation with the action ``level`` (a buffer, so it travels with the weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.register_buffer("level", torch.zeros((), dtype=torch.long))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.level.expand(observation.shape[:-1]).clone()


class Climber(pl.LightningModule):
    """Every training batch raises the actor's action by one: evaluation after ``k`` batches returns ``4 k``.

    ``optimizer_steps``: optimizer steps per batch; more than one switches to manual optimization
    (as PPO's minibatch epochs do).
    """

    def __init__(self, optimizer_steps: int = 1) -> None:
        super().__init__()
        self.actor = TensorDictModule(LevelNet(), in_keys=["observation"], out_keys=["action"])
        self.optimizer_steps = optimizer_steps
        self.automatic_optimization = optimizer_steps == 1
        self.batches = 0

    def training_step(self, batch, batch_idx):
        self.batches += 1
        self.actor.module.level += 1
        loss = (self.actor.module.weight ** 2).sum() + 0.0 * batch["observation"].sum()
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        for _ in range(self.optimizer_steps):
            optimizer.zero_grad()
            self.manual_backward((self.actor.module.weight ** 2).sum())
            optimizer.step()
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def make_trainer(**kwargs) -> pl.Trainer:
    options = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                   enable_model_summary=False, enable_progress_bar=False, log_every_n_steps=1)
    options.update(kwargs)
    return pl.Trainer(**options)


def rollout_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX) and t.is_alive()]


class EventCounter(RolloutCallback):
    """Counts every collection event it receives (overrides ``on_rollout_step``)."""

    def __init__(self) -> None:
        self.steps = 0
        self.step_dones = 0
        self.step_evals = 0
        self.episodes = 0
        self.episode_frames = 0
        self.eval_episodes = 0
        self.eval_rounds: list[int] = []
        self.batches = 0

    def on_rollout_step(self, trainer, pl_module, step) -> None:
        self.steps += 1
        self.step_dones += int(step.done)
        self.step_evals += int(step.eval)

    def on_episode_end(self, trainer, pl_module, episode) -> None:
        assert not episode.eval
        self.episodes += 1
        self.episode_frames += episode.length

    def on_eval_episode_end(self, trainer, pl_module, episode) -> None:
        assert episode.eval
        self.eval_episodes += 1

    def on_eval_end(self, trainer, pl_module, episodes) -> None:
        self.eval_rounds.append(len(episodes))

    def on_rollout_batch(self, trainer, pl_module, batch) -> None:
        self.batches += 1


class EpisodesPerBatch(RolloutCallback):
    """Returns and lengths of the episodes each batch finished; means of each evaluation round."""

    def __init__(self) -> None:
        self.pending: list[tuple[float, int]] = []
        self.per_batch: list[list[tuple[float, int]]] = []
        self.eval_means: list[float] = []

    def on_episode_end(self, trainer, pl_module, episode) -> None:
        self.pending.append((episode.reward, episode.length))

    def on_rollout_batch(self, trainer, pl_module, batch) -> None:
        self.per_batch.append(self.pending)
        self.pending = []

    def on_eval_end(self, trainer, pl_module, episodes) -> None:
        self.eval_means.append(sum(e.reward for e in episodes) / len(episodes))


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the single TensorBoard event file under ``log_dir``: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = glob.glob(str(log_dir / "**" / "events.out.tfevents.*"), recursive=True)
    assert len(files) == 1, files
    acc = EventAccumulator(files[0])
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_csv_rows(log_dir: Path) -> list[dict[str, str]]:
    """The rows of the single ``metrics.csv`` a ``CSVLogger`` wrote under ``log_dir``."""
    (path,) = log_dir.glob("**/metrics.csv")
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


FPB = 16  # frames per batch of the Climber tests: 2 envs x 8 steps


def climber_dm(**kwargs) -> RolloutDataModule:
    """A DataModule of 2 :class:`LevelEnv` envs, ``FPB`` frames a batch and 2 evaluation episodes, ``kwargs`` added."""
    options = dict(num_envs=2, frames_per_batch=FPB, eval_episodes=2)
    options.update(kwargs)
    return RolloutDataModule(LevelEnv, **options)


def eval_return(batches: int) -> float:
    """What an evaluation episode returns after ``batches`` training batches of a Climber."""
    return float(LEVEL_EPISODE_STEPS * batches)
