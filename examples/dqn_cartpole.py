"""DQN on CartPole-v1 with PyTorch Lightning, TorchRL's DQNLoss and ReplayBuffer, and lightning_rollout.

Off-policy: a `RolloutDataModule` with `layout="flat"` and `on_policy=False`
keeps 8 envs stepping one step ahead while the learner trains; each training
step adds the new transitions to a TorchRL `ReplayBuffer` and runs a few
gradient steps on samples from it. The epsilon of the epsilon-greedy actor lives
in the policy (a buffer of `EGreedyModule`), travels to the env threads with the
weights, and is logged as `rollout/exploration_rate`.

    python examples/dqn_cartpole.py --frames 150000 --seed 0 --out runs/dqn
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensordict import TensorDictBase
from tensordict.nn import TensorDictSequential
from torch import nn
from torchrl.data import LazyTensorStorage, OneHot, ReplayBuffer
from torchrl.modules import EGreedyModule, QValueActor
from torchrl.objectives import DQNLoss, HardUpdate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fit_and_summarize, print_summary, stop_at_bar  # noqa: E402

from lightning_rollout.lightning import RolloutDataModule  # noqa: E402


@dataclass
class Config:
    """Hyperparameters after RL Baselines3 Zoo's tuned DQN for CartPole-v1 (replay ratio 0.5, fast target sync)."""

    frames: int = 150_000
    num_envs: int = 8
    envs_per_thread: int = 4
    frames_per_batch: int = 256     # frames added to the replay buffer per training step
    updates_per_batch: int = 128    # gradient steps per training step (one per 2 frames)
    learning_starts: int = 1_000    # random frames before learning
    buffer_size: int = 100_000
    sample_size: int = 64
    lr: float = 2.3e-3
    gamma: float = 0.99
    target_update_every: int = 10   # gradient steps between hard target-network updates
    eps_start: float = 1.0
    eps_end: float = 0.04
    eps_frames: int = 8_000         # frames over which epsilon anneals linearly
    hidden: int = 256
    eval_every_frames: int = 10_240
    eval_episodes: int = 8
    target_return: float = 475.0
    seed: int = 0
    out: str = "runs/dqn_cartpole"


def make_actor(*, obs_dim: int, n_actions: int, hidden: int, eps_start: float, eps_end: float,
               eps_frames: int) -> TensorDictSequential:
    q_net = nn.Sequential(nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                          nn.Linear(hidden, n_actions))
    greedy = QValueActor(q_net, in_keys=["observation"], spec=OneHot(n_actions))
    explore = EGreedyModule(OneHot(n_actions), eps_init=eps_start, eps_end=eps_end, annealing_num_steps=eps_frames)
    return TensorDictSequential(greedy, explore)


class DQN(pl.LightningModule):
    """Double DQN with a hard-updated target network. `self.actor` (greedy + epsilon) acts in the envs.

    Keyword arguments only, with CartPole's defaults (see `Config`), so LightningCLI can build it.
    """

    def __init__(self, *, obs_dim: int = 4, n_actions: int = 2, hidden: int = 256, lr: float = 2.3e-3,
                 gamma: float = 0.99, updates_per_batch: int = 128, learning_starts: int = 1_000,
                 buffer_size: int = 100_000, sample_size: int = 64, target_update_every: int = 10,
                 eps_start: float = 1.0, eps_end: float = 0.04, eps_frames: int = 8_000) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.actor = make_actor(obs_dim=obs_dim, n_actions=n_actions, hidden=hidden, eps_start=eps_start,
                                eps_end=eps_end, eps_frames=eps_frames)
        self.loss = DQNLoss(self.actor[0], loss_function="l2", delay_value=True, double_dqn=True,
                            action_space="one_hot")
        self.loss.make_value_estimator(gamma=gamma)
        self.target_updater = HardUpdate(self.loss, value_network_update_interval=target_update_every)
        self.buffer = ReplayBuffer(storage=LazyTensorStorage(buffer_size), batch_size=sample_size)

    def training_step(self, batch: TensorDictBase, batch_idx: int) -> None:
        hp = self.hparams
        self.buffer.extend(batch.exclude("collector").cpu())
        self.actor[1].step(batch.numel())        # anneal epsilon by the frames just collected
        self.log("rollout/exploration_rate", self.actor[1].eps.item(), on_step=True, on_epoch=False, batch_size=1)
        if len(self.buffer) < hp.learning_starts:
            return
        optimizer = self.optimizers()
        for _ in range(hp.updates_per_batch):
            sample = self.buffer.sample().to(self.device)
            loss = self.loss(sample)["loss"]
            optimizer.zero_grad()
            self.manual_backward(loss)
            nn.utils.clip_grad_norm_(self.loss.parameters(), 10.0)
            optimizer.step()
            self.target_updater.step()
        self.log("train/loss", loss, on_step=True, on_epoch=False, batch_size=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.loss.value_network_params.parameters(), lr=self.hparams.lr)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=Config.frames)
    parser.add_argument("--num-envs", type=int, default=Config.num_envs)
    parser.add_argument("--envs-per-thread", type=int, default=Config.envs_per_thread)
    parser.add_argument("--frames-per-batch", type=int, default=Config.frames_per_batch)
    parser.add_argument("--updates-per-batch", type=int, default=Config.updates_per_batch)
    parser.add_argument("--learning-starts", type=int, default=Config.learning_starts)
    parser.add_argument("--eval-every-frames", type=int, default=Config.eval_every_frames)
    parser.add_argument("--eval-episodes", type=int, default=Config.eval_episodes)
    parser.add_argument("--target-return", type=float, default=Config.target_return)
    parser.add_argument("--seed", type=int, default=Config.seed)
    parser.add_argument("--out", default=Config.out)
    args = parser.parse_args(argv)
    cfg = Config(frames=args.frames, num_envs=args.num_envs, envs_per_thread=args.envs_per_thread,
                 frames_per_batch=args.frames_per_batch, updates_per_batch=args.updates_per_batch,
                 learning_starts=args.learning_starts, eval_every_frames=args.eval_every_frames,
                 eval_episodes=args.eval_episodes, target_return=args.target_return, seed=args.seed, out=args.out)
    pl.seed_everything(cfg.seed, verbose=False)
    torch.set_num_threads(1)

    datamodule = RolloutDataModule(
        "CartPole-v1", num_envs=cfg.num_envs, envs_per_thread=cfg.envs_per_thread,
        frames_per_batch=cfg.frames_per_batch, total_frames=cfg.frames - cfg.frames % cfg.frames_per_batch,
        layout="flat", on_policy=False, init_random_frames=cfg.learning_starts, seed=cfg.seed,
        eval_every_n_frames=cfg.eval_every_frames, eval_episodes=cfg.eval_episodes)  # evaluation: the validation loop
    logger = TensorBoardLogger(cfg.out, name="dqn", version=f"seed{cfg.seed}")
    solved = stop_at_bar(cfg.target_return, frames=cfg.frames, eval_every_frames=cfg.eval_every_frames)
    trainer = pl.Trainer(max_epochs=1, logger=logger, callbacks=[solved], log_every_n_steps=10,
                         enable_checkpointing=False, enable_model_summary=False,
                         enable_progress_bar=sys.stderr.isatty(), accelerator="cpu")
    model = DQN(hidden=cfg.hidden, lr=cfg.lr, gamma=cfg.gamma, updates_per_batch=cfg.updates_per_batch,
                learning_starts=cfg.learning_starts, buffer_size=cfg.buffer_size, sample_size=cfg.sample_size,
                target_update_every=cfg.target_update_every, eps_start=cfg.eps_start, eps_end=cfg.eps_end,
                eps_frames=cfg.eps_frames)
    result = fit_and_summarize(trainer, model, datamodule, target=cfg.target_return)
    result["first_frames_eval_300"] = next((f for f, v in result["eval_history"] if v >= 300.0), None)
    print_summary(result, out=cfg.out)
    return result


if __name__ == "__main__":
    main()
