"""Recurrent PPO: a TorchRL `LSTMModule` policy on CartPole with the velocities hidden.

CartPole's observation is (cart position, cart velocity, pole angle, pole angular
velocity). `HideVelocities` keeps positions only, so a policy must remember past
observations to tell which way the pole is falling: a memoryless policy cannot
balance it for long (`--memory none` trains the same network with the LSTM replaced
by a feed-forward layer of the same width, the control).

The recurrent state is the collector's job: the actor's `LSTMModule` writes its state
under `("next", "recurrent_state_h"/"recurrent_state_c")`, and the `RolloutDataModule`
feeds it back into each env's next step and zeroes it at each episode start (gymnasium
envs get `is_init` from the loop, no primer needed). Batches are `[num_envs, T]`
(`layout="env_time"`), so the loss replays whole rows in TorchRL's recurrent mode
(`set_recurrent_mode(True)`: one LSTM pass over each row, split at episode starts,
starting from the state stored at the row's first step), and minibatches are made of
whole env rows, never shuffled frames. Actor and critic share the LSTM (CleanRL's
`ppo_atari_lstm` layout); hyperparameters after RL Baselines3 Zoo's `CartPoleNoVel-v1`.

    python examples/ppo_lstm_cartpole.py --frames 500000 --seed 0 --out runs/lstm
    python examples/ppo_lstm_cartpole.py --memory none --seed 0          # the memoryless control
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

import gymnasium as gym
import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn
from torchrl.modules import LSTMModule, ProbabilisticActor, ValueOperator, set_recurrent_mode
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fit_and_summarize, stop_at_bar  # noqa: E402

from lightning_rollout.lightning import RolloutDataModule  # noqa: E402


class HideVelocities(gym.ObservationWrapper):
    """CartPole observing (cart position, pole angle) only, each scaled by its termination bound (so in [-1, 1])."""

    SCALE = np.array([2.4, 0.2095], dtype=np.float32)

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, shape=(2,), dtype=np.float32)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return (observation[[0, 2]] / self.SCALE).astype(np.float32)


def make_env() -> gym.Env:
    """A partially observed CartPole-v1 (a module-level function: picklable for worker processes)."""
    return HideVelocities(gym.make("CartPole-v1"))


@dataclass
class Config:
    frames: int = 500_000          # total env frames
    num_envs: int = 8
    steps_per_env: int = 32        # sequence length of a batch row; batch = num_envs * steps_per_env frames
    epochs: int = 20               # PPO epochs over each batch
    envs_per_minibatch: int = 8    # minibatches are whole env rows (sequences), never shuffled frames
    lr: float = 1e-3               # decays linearly to 0 over the run
    gamma: float = 0.98
    gae_lambda: float = 0.8
    clip: float = 0.2
    entropy_coef: float = 0.0
    value_coef: float = 0.5
    max_grad_norm: float = 0.5
    hidden: int = 64
    memory: str = "lstm"           # "lstm", or "none" for the memoryless control
    eval_every_frames: int = 20_480
    eval_episodes: int = 8
    target_return: float = 475.0   # CartPole-v1's "solved" bar
    seed: int = 0
    out: str = "runs/ppo_lstm_cartpole"

    @property
    def frames_per_batch(self) -> int:
        return self.num_envs * self.steps_per_env


def make_networks(*, obs_dim: int, n_actions: int, hidden: int, memory: str
                  ) -> tuple[ProbabilisticActor, TensorDictSequential]:
    """Actor and critic on a shared trunk writing `"embed"` ([*, hidden]): an LSTM, or (`memory="none"`) a
    feed-forward layer of the same width."""
    if memory == "lstm":
        trunk = LSTMModule(input_size=obs_dim, hidden_size=hidden, in_key="observation", out_key="embed")
    elif memory == "none":
        trunk = TensorDictModule(nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh()), in_keys=["observation"],
                                 out_keys=["embed"])
    else:
        raise ValueError(f"memory must be 'lstm' or 'none', got {memory!r}")
    policy_head = TensorDictModule(nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, n_actions)),
                                   in_keys=["embed"], out_keys=["logits"])
    actor = ProbabilisticActor(TensorDictSequential(trunk, policy_head), in_keys=["logits"],
                               distribution_class=torch.distributions.OneHotCategorical, return_log_prob=True)
    value_head = ValueOperator(nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1)),
                               in_keys=["embed"])
    critic = TensorDictSequential(trunk, value_head)
    return actor, critic


class RecurrentPPO(pl.LightningModule):
    """Clipped PPO over `[num_envs, T]` batches of sequences. `self.actor` is what the RolloutDataModule acts
    with (sequential mode, one step at a time); the loss replays each row in recurrent mode."""

    def __init__(self, *, obs_dim: int = 2, n_actions: int = 2, hidden: int = 64, memory: str = "lstm",
                 lr: float = 1e-3, gamma: float = 0.98, gae_lambda: float = 0.8, clip: float = 0.2,
                 entropy_coef: float = 0.0, value_coef: float = 0.5, max_grad_norm: float = 0.5, epochs: int = 20,
                 envs_per_minibatch: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.actor, self.critic = make_networks(obs_dim=obs_dim, n_actions=n_actions, hidden=hidden, memory=memory)
        # deactivate_vmap: GAE runs the critic on observations and next observations as a loop of two calls,
        # not under torch.vmap, whose tracing refuses the LSTM's split at episode starts (data-dependent)
        self.advantage = GAE(gamma=gamma, lmbda=gae_lambda, value_network=self.critic, average_gae=True,
                             deactivate_vmap=True)
        self.loss = ClipPPOLoss(self.actor, self.critic, clip_epsilon=clip, entropy_coeff=entropy_coef,
                                critic_coeff=value_coef, loss_critic_type="l2", normalize_advantage=False)

    def training_step(self, batch: TensorDictBase, batch_idx: int) -> None:
        hp = self.hparams
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        with set_recurrent_mode(True):  # [num_envs, T]: the LSTM runs along "time", split at episode starts
            with torch.no_grad():
                self.advantage(batch)   # critic on observations and next observations, GAE along time
            for _ in range(hp.epochs):
                for rows in torch.randperm(batch.shape[0]).split(hp.envs_per_minibatch):
                    losses = self.loss(batch[rows])  # whole sequences: [envs_per_minibatch, T]
                    loss = losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"]
                    optimizer.zero_grad()
                    self.manual_backward(loss)
                    nn.utils.clip_grad_norm_(self.parameters(), hp.max_grad_norm)
                    optimizer.step()
        scheduler.step()
        self.log_dict({"train/loss_objective": losses["loss_objective"], "train/loss_critic": losses["loss_critic"],
                       "train/entropy": losses["entropy"], "train/lr": scheduler.get_last_lr()[0]},
                      on_step=True, on_epoch=False, batch_size=1)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr, eps=1e-5)
        dm = self.trainer.datamodule
        batches = max(1, dm.total_frames // dm.frames_per_batch) if dm.total_frames > 0 else 0
        decay = (lambda i: max(0.0, 1.0 - i / batches)) if batches else (lambda i: 1.0)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, decay)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=Config.frames)
    parser.add_argument("--num-envs", type=int, default=Config.num_envs)
    parser.add_argument("--steps-per-env", type=int, default=Config.steps_per_env)
    parser.add_argument("--epochs", type=int, default=Config.epochs)
    parser.add_argument("--memory", choices=["lstm", "none"], default=Config.memory)
    parser.add_argument("--eval-every-frames", type=int, default=Config.eval_every_frames)
    parser.add_argument("--eval-episodes", type=int, default=Config.eval_episodes)
    parser.add_argument("--target-return", type=float, default=Config.target_return)
    parser.add_argument("--seed", type=int, default=Config.seed)
    parser.add_argument("--out", default=Config.out)
    args = parser.parse_args(argv)
    cfg = Config(frames=args.frames, num_envs=args.num_envs, steps_per_env=args.steps_per_env, epochs=args.epochs,
                 envs_per_minibatch=min(Config.envs_per_minibatch, args.num_envs), memory=args.memory,
                 eval_every_frames=args.eval_every_frames, eval_episodes=args.eval_episodes,
                 target_return=args.target_return, seed=args.seed, out=args.out)
    pl.seed_everything(cfg.seed, verbose=False)
    torch.set_num_threads(1)

    datamodule = RolloutDataModule(
        make_env, num_envs=cfg.num_envs, frames_per_batch=cfg.frames_per_batch,
        total_frames=cfg.frames - cfg.frames % cfg.frames_per_batch, layout="env_time", on_policy=True,
        seed=cfg.seed, eval_every_n_frames=cfg.eval_every_frames, eval_episodes=cfg.eval_episodes)
    logger = TensorBoardLogger(cfg.out, name=f"ppo_{cfg.memory}", version=f"seed{cfg.seed}")
    solved = stop_at_bar(cfg.target_return, frames=cfg.frames, eval_every_frames=cfg.eval_every_frames)
    trainer = pl.Trainer(max_epochs=1, logger=logger, callbacks=[solved], log_every_n_steps=1,
                         enable_checkpointing=False, enable_model_summary=False,
                         enable_progress_bar=sys.stderr.isatty(), accelerator="cpu")
    model = RecurrentPPO(hidden=cfg.hidden, memory=cfg.memory, lr=cfg.lr, gamma=cfg.gamma,
                         gae_lambda=cfg.gae_lambda, clip=cfg.clip, entropy_coef=cfg.entropy_coef,
                         value_coef=cfg.value_coef, max_grad_norm=cfg.max_grad_norm, epochs=cfg.epochs,
                         envs_per_minibatch=cfg.envs_per_minibatch)
    result = fit_and_summarize(trainer, model, datamodule, target=cfg.target_return)
    result.update(memory=cfg.memory)
    print("RESULT " + json.dumps(result))
    print(f"[{cfg.memory}] best eval return {result['best_eval_return']:.1f} (bar {cfg.target_return}), first at "
          f"{result['solved_at_frames']} frames; {result['frames']} frames in {result['seconds']} s")
    return result


if __name__ == "__main__":
    main()
