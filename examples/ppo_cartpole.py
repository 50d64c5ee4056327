"""PPO on CartPole-v1 with PyTorch Lightning, TorchRL losses and lightning_rollout.

Read it top to bottom: the config, the networks, the LightningModule (GAE, then
a few epochs of clipped-PPO minibatch updates per collected batch), and `main`,
which wires a `RolloutDataModule` (8 envs in threads, on-policy) into
`Trainer.fit` with TensorBoard logging (curves against frames), deterministic
evaluation every few thousand frames as the validation loop, a `ModelCheckpoint`
on `eval/episode_reward` and an `EarlyStopping` at CartPole's "solved" bar.

    python examples/ppo_cartpole.py --frames 300000 --seed 0 --out runs/ppo
    tensorboard --logdir runs/ppo

`--demo` trains for a short budget and writes a learning-curve PNG next to the logs.
The same module trains from a config file with `examples/cli.py` (LightningCLI).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.modules import ProbabilisticActor, ValueOperator
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fit_and_summarize, plot_learning_curve, print_summary, stop_at_bar  # noqa: E402

from lightning_rollout.lightning import RolloutDataModule  # noqa: E402


@dataclass
class Config:
    frames: int = 300_000          # total env frames (per rank)
    num_envs: int = 8
    envs_per_thread: int = 4       # CartPole is cheap: 2 threads of 4 envs beat 8 threads (see docs/tuning)
    steps_per_env: int = 128       # batch = num_envs * steps_per_env frames
    epochs: int = 4                # PPO epochs over each batch
    minibatches: int = 4
    lr: float = 2.5e-4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip: float = 0.2
    entropy_coef: float = 0.01
    value_coef: float = 0.5
    max_grad_norm: float = 0.5
    hidden: int = 64
    eval_every_frames: int = 10_240
    eval_episodes: int = 8
    target_return: float = 475.0   # CartPole-v1's "solved" bar; training stops once evaluation passes it
    seed: int = 0
    out: str = "runs/ppo_cartpole"

    @property
    def frames_per_batch(self) -> int:
        return self.num_envs * self.steps_per_env


def make_networks(obs_dim: int, n_actions: int, hidden: int) -> tuple[ProbabilisticActor, ValueOperator]:
    def mlp(out: int, last_std: float) -> nn.Sequential:
        layers = [nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, out)]
        for layer in layers:
            if isinstance(layer, nn.Linear):  # CleanRL's orthogonal init
                nn.init.orthogonal_(layer.weight, 2**0.5 if layer is not layers[-1] else last_std)
                nn.init.zeros_(layer.bias)
        return nn.Sequential(*layers)

    actor = ProbabilisticActor(
        TensorDictModule(mlp(n_actions, 0.01), in_keys=["observation"], out_keys=["logits"]),
        in_keys=["logits"], distribution_class=torch.distributions.OneHotCategorical, return_log_prob=True)
    critic = ValueOperator(mlp(1, 1.0), in_keys=["observation"])
    return actor, critic


class PPO(pl.LightningModule):
    """Clipped PPO. `self.actor` is what the RolloutDataModule acts with.

    Keyword arguments only, with CartPole's defaults, so LightningCLI can build it from a config file.
    `anneal_lr` decays the learning rate linearly to 0 over the DataModule's `total_frames`.
    """

    def __init__(self, *, obs_dim: int = 4, n_actions: int = 2, hidden: int = 64, lr: float = 2.5e-4,
                 gamma: float = 0.99, gae_lambda: float = 0.95, clip: float = 0.2, entropy_coef: float = 0.01,
                 value_coef: float = 0.5, max_grad_norm: float = 0.5, epochs: int = 4, minibatches: int = 4,
                 anneal_lr: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False  # several minibatch updates per collected batch
        self.actor, self.critic = make_networks(obs_dim=obs_dim, n_actions=n_actions, hidden=hidden)
        self.advantage = GAE(gamma=gamma, lmbda=gae_lambda, value_network=self.critic, average_gae=True)
        self.loss = ClipPPOLoss(self.actor, self.critic, clip_epsilon=clip, entropy_coeff=entropy_coef,
                                critic_coeff=value_coef, loss_critic_type="l2", normalize_advantage=False)

    def training_step(self, batch: TensorDictBase, batch_idx: int) -> None:
        hp = self.hparams
        with torch.no_grad():
            self.advantage(batch)               # adds "advantage" and "value_target", time along the last dim
        data = batch.reshape(-1)
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        minibatch = data.numel() // hp.minibatches
        for _ in range(hp.epochs):
            for idx in torch.randperm(data.numel(), device=data.device).split(minibatch):
                losses = self.loss(data[idx])
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
        batches = dm.total_frames // dm.frames_per_batch if self.hparams.anneal_lr and dm.total_frames > 0 else 0
        decay = (lambda i: max(0.0, 1.0 - i / batches)) if batches else (lambda i: 1.0)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, decay)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=Config.frames)
    parser.add_argument("--num-envs", type=int, default=Config.num_envs)
    parser.add_argument("--envs-per-thread", type=int, default=Config.envs_per_thread)
    parser.add_argument("--steps-per-env", type=int, default=Config.steps_per_env)
    parser.add_argument("--eval-every-frames", type=int, default=Config.eval_every_frames)
    parser.add_argument("--eval-episodes", type=int, default=Config.eval_episodes)
    parser.add_argument("--target-return", type=float, default=Config.target_return)
    parser.add_argument("--seed", type=int, default=Config.seed)
    parser.add_argument("--out", default=Config.out)
    parser.add_argument("--demo", action="store_true", help="short budget (a few minutes on 2 cores) + learning curve")
    args = parser.parse_args(argv)
    cfg = Config(frames=args.frames if not args.demo or args.frames != Config.frames else 120_000,
                 num_envs=args.num_envs, envs_per_thread=args.envs_per_thread, steps_per_env=args.steps_per_env,
                 eval_every_frames=args.eval_every_frames, eval_episodes=args.eval_episodes,
                 target_return=args.target_return, seed=args.seed, out=args.out)
    pl.seed_everything(cfg.seed, verbose=False)
    torch.set_num_threads(1)  # tiny networks: intra-op threads only fight the env threads for the 2 cores

    datamodule = RolloutDataModule(
        "CartPole-v1", num_envs=cfg.num_envs, envs_per_thread=cfg.envs_per_thread,
        frames_per_batch=cfg.frames_per_batch, total_frames=cfg.frames - cfg.frames % cfg.frames_per_batch,
        layout="env_time", on_policy=True, seed=cfg.seed,
        eval_every_n_frames=cfg.eval_every_frames, eval_episodes=cfg.eval_episodes)  # evaluation: the validation loop
    logger = TensorBoardLogger(cfg.out, name="ppo", version=f"seed{cfg.seed}")
    checkpoint = ModelCheckpoint(dirpath=os.path.join(logger.log_dir, "checkpoints"), monitor="eval/episode_reward",
                                 mode="max", save_top_k=1)
    solved = stop_at_bar(cfg.target_return, frames=cfg.frames, eval_every_frames=cfg.eval_every_frames)
    trainer = pl.Trainer(max_epochs=1, logger=logger, callbacks=[checkpoint, solved], log_every_n_steps=1,
                         enable_model_summary=False, enable_progress_bar=sys.stderr.isatty(), accelerator="cpu")
    model = PPO(hidden=cfg.hidden, lr=cfg.lr, gamma=cfg.gamma, gae_lambda=cfg.gae_lambda, clip=cfg.clip,
                entropy_coef=cfg.entropy_coef, value_coef=cfg.value_coef, max_grad_norm=cfg.max_grad_norm,
                epochs=cfg.epochs, minibatches=cfg.minibatches)
    result = fit_and_summarize(trainer, model, datamodule, target=cfg.target_return)
    result["best_checkpoint"] = checkpoint.best_model_path
    if args.demo:
        png = os.path.join(logger.log_dir, "learning_curve.png")
        result["learning_curve"] = plot_learning_curve(logger.log_dir, png, title="PPO on CartPole-v1 (lightning_rollout)",
                                                       since=result["started_at"])
    print_summary(result, out=cfg.out)
    if "learning_curve" in result:
        print(f"learning curve: {result['learning_curve']}")
    return result


if __name__ == "__main__":
    main()
