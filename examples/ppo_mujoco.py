"""PPO on MuJoCo HalfCheetah-v5 with PyTorch Lightning, TorchRL losses and lightning_rollout.

Read it top to bottom: the config (RL Baselines3 Zoo's tuned PPO hyperparameters for
HalfCheetah-v4, from `rl_zoo3/hyperparams/ppo.yml` of rl-zoo3 2.9.2, applied to v5), the
normalisers, the networks, the LightningModule (rewards scaled, GAE, then 20 epochs of
clipped-PPO minibatch updates per collected batch), and `main`, which wires a
`RolloutDataModule` into `Trainer.fit` with TensorBoard logging against frames and
deterministic evaluation episodes as the validation loop.

Normalisation is Stable-Baselines3's `VecNormalize` (RL Zoo's `normalize: true`), kept in the
model instead of the env, so that checkpoints carry it, evaluation reads it frozen, and the
logged returns are the env's own:

* observations: running mean and variance over every observation collected, clipped at 10,
  applied by the actor and the critic (`RunningNorm`, updated by the learner after its epochs on a batch);
* rewards: divided by the running standard deviation of the discounted return (gamma 0.98),
  clipped at 10, before GAE (`ReturnScaler`).

    pip install "gymnasium[mujoco]"
    python examples/ppo_mujoco.py --frames 200000 --seed 0 --out runs/ppo_mujoco
    tensorboard --logdir runs/ppo_mujoco
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from tensordict import TensorDictBase
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn
from torchrl.modules import ProbabilisticActor, TanhNormal, ValueOperator
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import config_from_args, env_dims, fit_and_summarize, make_trainer, print_summary  # noqa: E402

from lightning_rollout.lightning import RolloutDataModule  # noqa: E402


@dataclass
class Config:
    env: str = "HalfCheetah-v5"
    frames: int = 200_000        # total env frames
    num_envs: int = 1            # RL Zoo: n_envs 1
    steps_per_env: int = 512     # n_steps: a batch is num_envs * steps_per_env frames
    minibatch_size: int = 64     # batch_size
    epochs: int = 20             # n_epochs
    lr: float = 2.0633e-05       # learning_rate (constant)
    gamma: float = 0.98
    gae_lambda: float = 0.92
    clip: float = 0.1            # clip_range
    entropy_coef: float = 0.000401762
    value_coef: float = 0.58096
    max_grad_norm: float = 0.8
    log_std_init: float = -2.0   # policy_kwargs: log_std_init=-2, ReLU, pi=[256, 256], vf=[256, 256]
    hidden: int = 256
    eval_every_frames: int = 20_480
    eval_episodes: int = 4
    target_return: float | None = None  # stop at the first evaluation above it (None: run every frame)
    seed: int = 0
    out: str = "runs/ppo_mujoco"

    @property
    def frames_per_batch(self) -> int:
        return self.num_envs * self.steps_per_env


# the Config fields the command line sets (--frames, --eval-every-frames...), and --target-return
CLI_OPTIONS = ("env", "frames", "num_envs", "steps_per_env", "epochs", "eval_every_frames", "eval_episodes",
               "seed", "out")


class RunningNorm(nn.Module):
    """Running mean and variance of ``shape``-sized inputs (SB3's ``RunningMeanStd``, merged a batch at a time);
    ``forward`` standardises and clips at ``clip``. Float32 out, whatever the env's dtype (MuJoCo's float64)."""

    def __init__(self, shape: tuple[int, ...], *, clip: float = 10.0, eps: float = 1e-8) -> None:
        super().__init__()
        self.clip, self.eps = clip, eps
        self.register_buffer("mean", torch.zeros(shape))
        self.register_buffer("var", torch.ones(shape))
        self.register_buffer("count", torch.tensor(1e-4))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        """Merge the moments of ``x`` (``[n, *shape]``) into the running ones."""
        x = x.to(self.mean.dtype)
        n = x.shape[0]
        batch_mean, batch_var = x.mean(0), x.var(0, unbiased=False)
        delta, total = batch_mean - self.mean, self.count + n
        self.mean += delta * n / total
        self.var.copy_((self.var * self.count + batch_var * n + delta**2 * self.count * n / total) / total)
        self.count.copy_(total)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.mean.dtype)
        return ((x - self.mean) / torch.sqrt(self.var + self.eps)).clamp(-self.clip, self.clip)


class ReturnScaler(nn.Module):
    """SB3's reward normalisation: each env's discounted return ``ret = gamma * ret + reward`` (zeroed when its
    episode ends) feeds a running variance; rewards are divided by its standard deviation and clipped."""

    def __init__(self, num_envs: int, *, gamma: float, clip: float = 10.0, eps: float = 1e-8) -> None:
        super().__init__()
        self.gamma, self.clip, self.eps = gamma, clip, eps
        self.returns = RunningNorm(())
        self.register_buffer("ret", torch.zeros(num_envs))

    @torch.no_grad()
    def forward(self, reward: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """Scaled rewards of a batch ``[num_envs, T]`` (time along the last dim), the running return carried
        across batches."""
        ret = torch.empty_like(reward)
        for t in range(reward.shape[-1]):
            self.ret.mul_(self.gamma).add_(reward[:, t])
            ret[:, t] = self.ret
            self.ret[done[:, t]] = 0.0
        self.returns.update(ret.reshape(-1))
        return (reward / torch.sqrt(self.returns.var + self.eps)).clamp(-self.clip, self.clip)


def make_networks(obs_dim: int, act_dim: int, cfg: Config) -> tuple[ProbabilisticActor, ValueOperator, RunningNorm]:
    norm = RunningNorm((obs_dim,))

    def mlp(out: int) -> nn.Sequential:
        return nn.Sequential(norm, nn.Linear(obs_dim, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, cfg.hidden),
                             nn.ReLU(), nn.Linear(cfg.hidden, out))  # ortho_init=False: PyTorch's own init

    class GaussianHead(nn.Module):
        """The mean from the MLP, a learned state-independent log std (SB3's ``log_std_init``)."""

        def __init__(self) -> None:
            super().__init__()
            self.body = mlp(act_dim)
            self.log_std = nn.Parameter(torch.full((act_dim,), cfg.log_std_init))

        def forward(self, obs: torch.Tensor) -> torch.Tensor:
            loc = self.body(obs)
            return torch.cat([loc, self.log_std.expand_as(loc)], -1)

    actor = ProbabilisticActor(
        TensorDictModule(nn.Sequential(GaussianHead(), NormalParamExtractor(scale_mapping="exp")),
                         in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"], distribution_class=TanhNormal, return_log_prob=True)  # actions in [-1, 1]
    critic = ValueOperator(mlp(1), in_keys=["observation"])
    return actor, critic, norm


class PPO(pl.LightningModule):
    """Clipped PPO; ``self.actor`` is what the RolloutDataModule acts with (the same module: on-policy)."""

    def __init__(self, obs_dim: int, act_dim: int, cfg: Config) -> None:
        super().__init__()
        self.save_hyperparameters({"obs_dim": obs_dim, "act_dim": act_dim, **cfg.__dict__})
        self.cfg = cfg
        self.automatic_optimization = False  # several minibatch updates per collected batch
        self.actor, self.critic, self.obs_norm = make_networks(obs_dim, act_dim, cfg)
        self.reward_scale = ReturnScaler(cfg.num_envs, gamma=cfg.gamma)
        self.advantage = GAE(gamma=cfg.gamma, lmbda=cfg.gae_lambda, value_network=self.critic)
        # functional=False: the loss calls the modules as they are instead of swapping functional copies of their
        # weights in on every call (about 10% of a minibatch step here); nothing in PPO needs the functional form
        self.loss = ClipPPOLoss(self.actor, self.critic, clip_epsilon=cfg.clip, entropy_coeff=cfg.entropy_coef,
                                critic_coeff=cfg.value_coef, loss_critic_type="l2", normalize_advantage=True,
                                functional=False)
        self.updates_done = 0  # optimiser steps taken

    def learn(self, batch: TensorDictBase, optimizer: torch.optim.Optimizer,
              backward: Callable[[torch.Tensor], None] = torch.Tensor.backward) -> TensorDictBase:
        """One PPO update on ``batch`` (``[num_envs, T]``, or TorchRL's ``[T]`` for one env): rewards scaled, GAE,
        then ``epochs`` passes of clipped-PPO minibatch steps. Returns the last minibatch's losses.

        Plain PyTorch (``training_step`` passes Lightning's optimizer and ``manual_backward``), so a loop
        written by hand drives the same learner."""
        cfg = self.cfg
        if batch.batch_dims == 1:  # one env: TorchRL's [T] batch, as [1, T]
            batch = batch.unsqueeze(0)
        done = batch["next", "done"].squeeze(-1)
        batch["next", "reward"] = self.reward_scale(batch["next", "reward"].squeeze(-1), done).unsqueeze(-1)
        with torch.no_grad():
            self.advantage(batch)  # "advantage" and "value_target"
        data = batch.reshape(-1)
        for _ in range(cfg.epochs):
            for idx in torch.randperm(data.numel()).split(cfg.minibatch_size):
                losses = self.loss(data[idx])
                loss = losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"]
                optimizer.zero_grad()
                backward(loss)
                nn.utils.clip_grad_norm_(self.parameters(), cfg.max_grad_norm)
                optimizer.step()
                self.updates_done += 1
        # The normaliser moves only now. The epochs above must see the observations normalised as the actor saw
        # them when it acted (as SB3's buffer stores them): with the statistics moved first, the probability ratio
        # starts away from 1 and the clip zeroes the gradient of up to 95% of the first batches' samples.
        self.obs_norm.update(data["observation"])
        return losses.detach()

    def training_step(self, batch: TensorDictBase, batch_idx: int) -> None:
        losses = self.learn(batch, self.optimizers(), self.manual_backward)
        self.log_dict({"train/loss_objective": losses["loss_objective"], "train/loss_critic": losses["loss_critic"],
                       "train/entropy": losses["entropy"]}, on_step=True, on_epoch=False, batch_size=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.cfg.lr, eps=1e-5)  # SB3's PPO: Adam, eps 1e-5


def make_datamodule(cfg: Config) -> RolloutDataModule:
    """On-policy collection: ``[num_envs, steps_per_env]`` batches, each acted by the latest weights."""
    return RolloutDataModule(
        cfg.env, num_envs=cfg.num_envs, frames_per_batch=cfg.frames_per_batch,
        total_frames=cfg.frames - cfg.frames % cfg.frames_per_batch, layout="env_time", on_policy=True,
        seed=cfg.seed, eval_every_n_frames=cfg.eval_every_frames if cfg.eval_episodes else None,
        eval_episodes=cfg.eval_episodes)  # --eval-episodes 0: no evaluation


def main(argv: list[str] | None = None) -> dict:
    cfg = config_from_args(Config, CLI_OPTIONS, argv=argv, description=__doc__)
    pl.seed_everything(cfg.seed, verbose=False)
    torch.set_num_threads(1)  # small networks: intra-op threads only fight the env threads for the 2 cores
    result = fit_and_summarize(make_trainer(cfg, name="ppo"), PPO(*env_dims(cfg.env), cfg), make_datamodule(cfg),
                               target=cfg.target_return)
    print_summary(result, out=cfg.out)
    return result


if __name__ == "__main__":
    main()
