"""PPO with action masks on Taxi-v4: the mask comes from the env's `info`, invalid actions are never taken.

Gymnasium's Taxi reports in `info["action_mask"]` which of its 6 actions change the
state (moves into walls, a pickup away from the passenger and a drop-off away from the
four stops are no-ops or illegal). `RolloutDataModule(info_keys=...)` reads that entry
into every row the policy sees and every batch (`batch["action_mask"]`, root and
`("next", ...)`), and the actor samples from TorchRL's `MaskedCategorical` over it, so
a masked action has probability zero. `training_step` counts, from the batches, the
actions taken where the mask was 0: the whole run must end with 0 (`--no-mask` trains
the same network with a plain `Categorical`, whose count shows what the mask prevents).

The bar is Taxi's own: gymnasium registers it with `reward_threshold=8` ("optimum =
8.46": +20 for the delivery, -1 per other step, so a shortest route from a uniform
start scores 8.46 on average). Training stops at the first evaluation round (fresh
deterministic episodes) whose mean return reaches it.

    python examples/ppo_masked_taxi.py --frames 500000 --seed 0 --out runs/taxi
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.data import Binary
from torchrl.modules import MaskedCategorical, ProbabilisticActor, ValueOperator
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fit_and_summarize, stop_at_bar  # noqa: E402

from lightning_rollout.lightning import RolloutDataModule  # noqa: E402

N_STATES, N_ACTIONS = 500, 6  # Taxi's Discrete(500) observation and Discrete(6) action
# The info entry read into batches, with its spec: Taxi gives an int8 array, stored here as bool (what
# MaskedCategorical takes). `info_keys=["action_mask"]` would infer Unbounded((6,), int8) from the first reset.
INFO_KEYS = {"action_mask": Binary(n=N_ACTIONS, dtype=torch.bool)}


@dataclass
class Config:
    frames: int = 500_000          # total env frames
    num_envs: int = 16
    steps_per_env: int = 128       # batch = num_envs * steps_per_env frames
    epochs: int = 4
    minibatches: int = 4
    lr: float = 1e-3
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip: float = 0.2
    entropy_coef: float = 0.01
    value_coef: float = 0.5
    max_grad_norm: float = 0.5
    hidden: int = 64
    eval_every_frames: int = 16_384
    eval_episodes: int = 32
    target_return: float = 8.0    # gymnasium's reward_threshold for Taxi (optimum 8.46)
    masked: bool = True
    seed: int = 0
    out: str = "runs/ppo_masked_taxi"

    @property
    def frames_per_batch(self) -> int:
        return self.num_envs * self.steps_per_env


def make_networks(*, hidden: int, masked: bool) -> tuple[ProbabilisticActor, ValueOperator]:
    """Actor and critic over the state index (an embedding is a learned one-hot layer)."""
    def net(out: int, last_std: float) -> nn.Sequential:
        body = nn.Sequential(nn.Embedding(N_STATES, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                             nn.Linear(hidden, out))
        nn.init.orthogonal_(body[2].weight, 2**0.5)
        nn.init.zeros_(body[2].bias)
        nn.init.orthogonal_(body[4].weight, last_std)
        nn.init.zeros_(body[4].bias)
        return body

    logits = TensorDictModule(net(N_ACTIONS, 0.01), in_keys=["observation"], out_keys=["logits"])
    if masked:  # the distribution reads the env's mask: masked actions get probability 0 (and are never the mode)
        actor = ProbabilisticActor(logits, in_keys={"logits": "logits", "mask": "action_mask"},
                                   distribution_class=MaskedCategorical, return_log_prob=True)
    else:
        actor = ProbabilisticActor(logits, in_keys=["logits"], distribution_class=torch.distributions.Categorical,
                                   return_log_prob=True)
    critic = ValueOperator(net(1, 1.0), in_keys=["observation"])
    return actor, critic


def invalid_actions(batch: TensorDictBase) -> int:
    """Actions of `batch` taken where the env's mask (of the state they were chosen in) was 0."""
    allowed = batch["action_mask"].gather(-1, batch["action"].unsqueeze(-1)).squeeze(-1)
    return int((~allowed).sum())


class MaskedPPO(pl.LightningModule):
    """Clipped PPO with a masked categorical policy; counts invalid actions in every batch."""

    def __init__(self, *, hidden: int = 64, masked: bool = True, lr: float = 1e-3, gamma: float = 0.99,
                 gae_lambda: float = 0.95, clip: float = 0.2, entropy_coef: float = 0.01, value_coef: float = 0.5,
                 max_grad_norm: float = 0.5, epochs: int = 4, minibatches: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.actor, self.critic = make_networks(hidden=hidden, masked=masked)
        self.advantage = GAE(gamma=gamma, lmbda=gae_lambda, value_network=self.critic, average_gae=True)
        self.loss = ClipPPOLoss(self.actor, self.critic, clip_epsilon=clip, entropy_coeff=entropy_coef,
                                critic_coeff=value_coef, loss_critic_type="l2", normalize_advantage=False)
        self.invalid_actions = 0  # over every batch trained on
        self.frames_seen = 0

    def training_step(self, batch: TensorDictBase, batch_idx: int) -> None:
        hp = self.hparams
        self.invalid_actions += invalid_actions(batch)
        self.frames_seen += batch.numel()
        with torch.no_grad():
            self.advantage(batch)
        data = batch.reshape(-1)
        optimizer = self.optimizers()
        minibatch = data.numel() // hp.minibatches
        for _ in range(hp.epochs):
            for idx in torch.randperm(data.numel()).split(minibatch):
                losses = self.loss(data[idx])
                loss = losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"]
                optimizer.zero_grad()
                self.manual_backward(loss)
                nn.utils.clip_grad_norm_(self.parameters(), hp.max_grad_norm)
                optimizer.step()
        self.log_dict({"train/invalid_actions": float(self.invalid_actions), "train/entropy": losses["entropy"],
                       "train/loss_critic": losses["loss_critic"]}, on_step=True, on_epoch=False, batch_size=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, eps=1e-5)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=Config.frames)
    parser.add_argument("--num-envs", type=int, default=Config.num_envs)
    parser.add_argument("--steps-per-env", type=int, default=Config.steps_per_env)
    parser.add_argument("--eval-every-frames", type=int, default=Config.eval_every_frames)
    parser.add_argument("--eval-episodes", type=int, default=Config.eval_episodes)
    parser.add_argument("--target-return", type=float, default=Config.target_return)
    parser.add_argument("--no-mask", action="store_true", help="plain Categorical (the control: invalid actions)")
    parser.add_argument("--seed", type=int, default=Config.seed)
    parser.add_argument("--out", default=Config.out)
    args = parser.parse_args(argv)
    cfg = Config(frames=args.frames, num_envs=args.num_envs, steps_per_env=args.steps_per_env,
                 eval_every_frames=args.eval_every_frames, eval_episodes=args.eval_episodes,
                 target_return=args.target_return, masked=not args.no_mask, seed=args.seed, out=args.out)
    pl.seed_everything(cfg.seed, verbose=False)
    torch.set_num_threads(1)

    datamodule = RolloutDataModule(
        "Taxi-v4", num_envs=cfg.num_envs, frames_per_batch=cfg.frames_per_batch,
        total_frames=cfg.frames - cfg.frames % cfg.frames_per_batch, layout="env_time", on_policy=True,
        info_keys=INFO_KEYS, seed=cfg.seed, eval_every_n_frames=cfg.eval_every_frames,
        eval_episodes=cfg.eval_episodes)
    logger = TensorBoardLogger(cfg.out, name="taxi" if cfg.masked else "taxi_unmasked", version=f"seed{cfg.seed}")
    solved = stop_at_bar(cfg.target_return, frames=cfg.frames, eval_every_frames=cfg.eval_every_frames)
    trainer = pl.Trainer(max_epochs=1, logger=logger, callbacks=[solved], log_every_n_steps=1,
                         enable_checkpointing=False, enable_model_summary=False,
                         enable_progress_bar=sys.stderr.isatty(), accelerator="cpu")
    model = MaskedPPO(hidden=cfg.hidden, masked=cfg.masked, lr=cfg.lr, gamma=cfg.gamma, gae_lambda=cfg.gae_lambda,
                      clip=cfg.clip, entropy_coef=cfg.entropy_coef, value_coef=cfg.value_coef,
                      max_grad_norm=cfg.max_grad_norm, epochs=cfg.epochs, minibatches=cfg.minibatches)
    result = fit_and_summarize(trainer, model, datamodule, target=cfg.target_return)
    result.update(masked=cfg.masked, invalid_actions=model.invalid_actions,
                  frames_checked=model.frames_seen)
    print("RESULT " + json.dumps(result))
    print(f"best eval return {result['best_eval_return']:.2f} (bar {cfg.target_return}), first at "
          f"{result['solved_at_frames']} frames; invalid actions: {model.invalid_actions} of "
          f"{model.frames_seen} frames; {result['seconds']} s")
    return result


if __name__ == "__main__":
    main()
