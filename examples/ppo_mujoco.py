"""PPO on MuJoCo HalfCheetah-v5 with PyTorch Lightning and lightning_rollout.

Read it top to bottom: the config (RL Baselines3 Zoo's tuned PPO hyperparameters for
HalfCheetah-v4, from `rl_zoo3/hyperparams/ppo.yml` of rl-zoo3 2.9.2, applied to v5), the
normalisers, the networks and the actor the collector acts with, the two learners, the
LightningModule (rewards scaled, then the learner: GAE and 20 epochs of clipped-PPO minibatch
updates per collected batch), and `main`, which wires a `RolloutDataModule` into `Trainer.fit`
with TensorBoard logging against frames and deterministic evaluation episodes as the
validation loop.

Two learners do the same update on the same minibatches (`--learner`):

* `plain` (the default): GAE and the minibatch step written out in plain PyTorch, CleanRL style;
* `torchrl`: TorchRL's `GAE` and `ClipPPOLoss` over the same weights.

`--compile true` runs either learner's loss through `torch.compile`. docs/training.rst gives the
learners' times against Stable-Baselines3's (`python -m benchmarks.e2e.learners`).

Normalisation is Stable-Baselines3's `VecNormalize` (RL Zoo's `normalize: true`), kept in the
model instead of the env, so that checkpoints carry it, evaluation reads it frozen, and the
logged returns are the env's own:

* observations: running mean and variance over every observation collected, clipped at 10,
  applied by the actor and the critic (`RunningNorm`, updated by the learner after its epochs on a batch);
* rewards: divided by the running standard deviation of the discounted return (gamma 0.98),
  clipped at 10, before GAE (`ReturnScaler`).

    pip install "gymnasium[mujoco]"
    python examples/ppo_mujoco.py --frames 200000 --seed 0 --out runs/ppo_mujoco
    python examples/ppo_mujoco.py --num-envs 8 --steps-per-env 64   # 8 envs, the same 512 frames a batch
    python examples/ppo_mujoco.py --learner torchrl                 # TorchRL's ClipPPOLoss
    tensorboard --logdir runs/ppo_mujoco
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import lightning.pytorch as pl
import numpy as np
import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn
from torch.nn import functional as F
from torchrl.envs.utils import ExplorationType, exploration_type
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
    learner: str = "plain"       # "plain": the update in plain PyTorch; "torchrl": TorchRL's ClipPPOLoss and GAE
    compile: bool = False        # the learner's loss through torch.compile (tens of seconds to compile)
    eval_every_frames: int = 20_480
    eval_episodes: int = 4
    target_return: float | None = None  # stop at the first evaluation above it (None: run every frame)
    seed: int = 0
    out: str = "runs/ppo_mujoco"

    @property
    def frames_per_batch(self) -> int:
        return self.num_envs * self.steps_per_env


# the Config fields the command line sets (--frames, --eval-every-frames...), and --target-return
CLI_OPTIONS = ("env", "frames", "num_envs", "steps_per_env", "epochs", "learner", "compile", "eval_every_frames",
               "eval_episodes", "seed", "out")


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
        across batches (CPU tensors: the recursion runs on their numpy views, a few microseconds a step)."""
        running, rewards, dones = self.ret.numpy(), reward.numpy(), done.numpy()  # running: the buffer itself
        ret = np.empty_like(rewards)
        for t in range(rewards.shape[-1]):
            running *= self.gamma
            running += rewards[:, t]
            ret[:, t] = running
            running[dones[:, t]] = 0.0
        self.returns.update(torch.from_numpy(ret).reshape(-1))
        return (reward / torch.sqrt(self.returns.var + self.eps)).clamp(-self.clip, self.clip)


# ---------------------------------------------------------------------------------------------------------------
# The networks and the acting policy, the same for both learners
# ---------------------------------------------------------------------------------------------------------------
_TANH_LIMIT = 1.0 - 1e-6  # actions kept inside (-1, 1), so that atanh(action) is finite (TorchRL's SafeTanhTransform)


def mlp(in_dim: int, out_dim: int, hidden: int) -> nn.Sequential:
    """2 x ``hidden`` ReLU units (``ortho_init=False``: PyTorch's own init)."""
    return nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, out_dim))


def squashed_log_prob(loc: torch.Tensor, log_std: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """Log-density of ``action = tanh(u)``, ``u ~ Normal(loc, exp(log_std))`` (TorchRL's ``TanhNormal``):
    ``[..., act_dim]`` -> ``[...]``. Plain tensor arithmetic, no distribution object."""
    u = action.clamp(-_TANH_LIMIT, _TANH_LIMIT).atanh()
    gaussian = -0.5 * ((u - loc) / log_std.exp()) ** 2 - log_std - 0.5 * math.log(2 * math.pi)
    log_det_jacobian = 2.0 * (math.log(2.0) - u - F.softplus(-2.0 * u))  # log(1 - tanh(u)^2), stably
    return (gaussian - log_det_jacobian).sum(-1)


class GaussianPolicy(nn.Module):
    """SB3's PPO policy: the observation normaliser, an MLP giving the mean of a Gaussian, a learned
    state-independent log std (``log_std_init``); actions are its samples squashed by tanh into [-1, 1]."""

    def __init__(self, obs_dim: int, act_dim: int, cfg: Config) -> None:
        super().__init__()
        self.obs_norm = RunningNorm((obs_dim,))
        self.mean = mlp(obs_dim, act_dim, cfg.hidden)
        self.log_std = nn.Parameter(torch.full((act_dim,), cfg.log_std_init))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """``[..., obs_dim]`` raw observations -> the Gaussian's mean ``[..., act_dim]``."""
        return self.mean(self.obs_norm(obs))


class Actor(nn.Module):
    """What the collector acts with, wrapped as ``TensorDictModule(Actor(policy), in_keys=["observation"],
    out_keys=["action", "action_log_prob"])``: a squashed Gaussian sample (``tanh`` of the mean under TorchRL's
    deterministic exploration type, which evaluation sets) and its log-density. A few tensor operations a step,
    where TorchRL's ``ProbabilisticActor`` builds a distribution; a plain ``TensorDictModule`` over a tensor
    function is called on the stacked observations directly, with no TensorDict a step."""

    def __init__(self, policy: GaussianPolicy) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, observation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loc = self.policy(observation)
        if exploration_type() in (ExplorationType.DETERMINISTIC, ExplorationType.MODE, ExplorationType.MEAN):
            action = loc.tanh()
        else:
            action = (loc + self.policy.log_std.exp() * torch.randn_like(loc)).tanh()
        action = action.clamp(-_TANH_LIMIT, _TANH_LIMIT)
        return action, squashed_log_prob(loc, self.policy.log_std, action)


# ---------------------------------------------------------------------------------------------------------------
# Learner 1 (the default, --learner plain): GAE and the clipped-PPO minibatch update in plain PyTorch
# ---------------------------------------------------------------------------------------------------------------
class PlainPPO:
    """The update written out, CleanRL style: the batch's entries read once as flat tensors, the observations
    normalised once (the normaliser holds still during the epochs), then per minibatch two MLP forwards, the
    clipped surrogate, the value loss, one backward, gradient clipping and Adam."""

    def __init__(self, policy: GaussianPolicy, value: nn.Module, cfg: Config) -> None:
        self.policy, self.value, self.cfg = policy, value, cfg  # value: the critic's MLP, on normalised inputs
        self.loss_fn = torch.compile(self.loss) if cfg.compile else self.loss

    @torch.no_grad()
    def advantages(self, obs: torch.Tensor, next_obs: torch.Tensor, reward: torch.Tensor, done: torch.Tensor,
                   terminated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """GAE over ``[num_envs, T]`` steps (observations ``[num_envs, T, obs_dim]``): advantages and value
        targets. A value is bootstrapped from ``next_obs`` unless the episode terminated; the sum stops at any
        episode end (a truncated one included)."""
        cfg = self.cfg
        value = self.value(self.policy.obs_norm(torch.cat([obs, next_obs], 1))).squeeze(-1)
        value, next_value = value.split(obs.shape[1], 1)
        delta = (reward + cfg.gamma * next_value * (~terminated) - value).numpy()
        carry = (cfg.gamma * cfg.gae_lambda * (~done)).numpy()
        adv, last = np.empty_like(delta), np.zeros_like(delta[:, 0])
        for t in reversed(range(delta.shape[1])):  # on numpy views: a few microseconds a step
            last = adv[:, t] = delta[:, t] + carry[:, t] * last
        adv = torch.from_numpy(adv)
        return adv, adv + value

    def loss(self, obs: torch.Tensor, action: torch.Tensor, old_log_prob: torch.Tensor, adv: torch.Tensor,
             ret: torch.Tensor) -> dict[str, torch.Tensor]:
        """One minibatch's losses (``obs`` normalised ``[B, obs_dim]``, ``action`` ``[B, act_dim]``, the rest
        ``[B]``); ``"loss"`` is what the step differentiates."""
        cfg = self.cfg
        log_prob = squashed_log_prob(self.policy.mean(obs), self.policy.log_std, action)
        ratio = (log_prob - old_log_prob).exp()
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)  # per minibatch, as SB3's normalize_advantage
        loss_objective = -torch.min(ratio * adv, ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * adv).mean()
        loss_critic = F.mse_loss(self.value(obs).squeeze(-1), ret)
        entropy = -log_prob.mean()  # tanh-squashed Gaussian: no closed form, SB3's estimate
        loss = loss_objective + cfg.value_coef * loss_critic - cfg.entropy_coef * entropy
        return {"loss": loss, "loss_objective": loss_objective, "loss_critic": loss_critic, "entropy": entropy}

    def learn(self, batch: TensorDictBase, optimizer: torch.optim.Optimizer,
              backward: Callable[[torch.Tensor], None]) -> dict[str, torch.Tensor]:
        cfg, nxt = self.cfg, batch["next"]
        adv, ret = self.advantages(batch["observation"], nxt["observation"], nxt["reward"].squeeze(-1),
                                   nxt["done"].squeeze(-1), nxt["terminated"].squeeze(-1))
        obs = self.policy.obs_norm(batch["observation"].flatten(0, 1))
        action, old_log_prob = batch["action"].flatten(0, 1), batch["action_log_prob"].flatten()
        adv, ret = adv.flatten(), ret.flatten()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for _ in range(cfg.epochs):
            for idx in torch.randperm(obs.shape[0]).split(cfg.minibatch_size):
                losses = self.loss_fn(obs[idx], action[idx], old_log_prob[idx], adv[idx], ret[idx])
                optimizer.zero_grad()
                backward(losses["loss"])
                nn.utils.clip_grad_norm_(params, cfg.max_grad_norm, foreach=True)
                optimizer.step()
        return losses


# ---------------------------------------------------------------------------------------------------------------
# Learner 2 (--learner torchrl): TorchRL's GAE and ClipPPOLoss
# ---------------------------------------------------------------------------------------------------------------
class TorchRLPPO(nn.Module):
    """The same update through TorchRL's objectives: a ``ProbabilisticActor`` (``TanhNormal``) over the same
    policy weights for ``ClipPPOLoss``, its ``GAE``, minibatches indexed from the batch with only the keys the
    loss reads (selected once a batch); ``compile``: the loss through ``torch.compile``."""

    def __init__(self, policy: GaussianPolicy, value: nn.Module, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        critic = nn.Sequential(policy.obs_norm, value)

        class LocScale(nn.Module):
            def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                loc = policy(obs)
                return loc, policy.log_std.exp().expand_as(loc)

        actor = ProbabilisticActor(TensorDictModule(LocScale(), in_keys=["observation"], out_keys=["loc", "scale"]),
                                   in_keys=["loc", "scale"], distribution_class=TanhNormal)
        value_op = ValueOperator(critic, in_keys=["observation"])
        self.advantage = GAE(gamma=cfg.gamma, lmbda=cfg.gae_lambda, value_network=value_op)
        # functional=False: the loss calls the modules as they are instead of swapping functional copies of their
        # weights in on every call; nothing in PPO needs the functional form
        self.loss = ClipPPOLoss(actor, value_op, clip_epsilon=cfg.clip, entropy_coeff=cfg.entropy_coef,
                                critic_coeff=cfg.value_coef, loss_critic_type="l2", normalize_advantage=True,
                                functional=False)
        self.loss_fn = torch.compile(self.loss) if cfg.compile else self.loss

    def learn(self, batch: TensorDictBase, optimizer: torch.optim.Optimizer,
              backward: Callable[[torch.Tensor], None]) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        with torch.no_grad():
            self.advantage(batch)  # "advantage" and "value_target"
        data = batch.select("observation", "action", "action_log_prob", "advantage", "value_target").reshape(-1)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for _ in range(cfg.epochs):
            for idx in torch.randperm(data.numel()).split(cfg.minibatch_size):
                losses = self.loss_fn(data[idx])
                loss = losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"]
                optimizer.zero_grad()
                backward(loss)
                nn.utils.clip_grad_norm_(params, cfg.max_grad_norm, foreach=True)
                optimizer.step()
        return {key: losses[key] for key in ("loss_objective", "loss_critic", "entropy")}


LEARNERS = {"plain": PlainPPO, "torchrl": TorchRLPPO}


# ---------------------------------------------------------------------------------------------------------------
# The LightningModule: reward scaling, the learner, the normaliser's update
# ---------------------------------------------------------------------------------------------------------------
class PPO(pl.LightningModule):
    """Clipped PPO; ``self.actor`` is what the RolloutDataModule acts with (the same module: on-policy)."""

    def __init__(self, obs_dim: int, act_dim: int, cfg: Config) -> None:
        super().__init__()
        if cfg.learner not in LEARNERS:
            raise ValueError(f"learner must be one of {sorted(LEARNERS)}, got {cfg.learner!r}")
        self.save_hyperparameters({"obs_dim": obs_dim, "act_dim": act_dim, **cfg.__dict__})
        self.cfg = cfg
        self.automatic_optimization = False  # several minibatch updates per collected batch
        self.policy = GaussianPolicy(obs_dim, act_dim, cfg)
        self.obs_norm = self.policy.obs_norm  # the critic reads the observations through the same normaliser
        self.value = mlp(obs_dim, 1, cfg.hidden)
        self.actor = TensorDictModule(Actor(self.policy), in_keys=["observation"],
                                      out_keys=["action", "action_log_prob"])
        self.learner = LEARNERS[cfg.learner](self.policy, self.value, cfg)
        self.reward_scale = ReturnScaler(cfg.num_envs, gamma=cfg.gamma)
        self.updates_done = 0  # optimiser steps taken

    def learn(self, batch: TensorDictBase, optimizer: torch.optim.Optimizer,
              backward: Callable[[torch.Tensor], None] = torch.Tensor.backward) -> dict[str, torch.Tensor]:
        """One PPO update on ``batch`` (``[num_envs, T]``, or TorchRL's ``[T]`` for one env): rewards scaled, GAE,
        then ``epochs`` passes of clipped-PPO minibatch steps. Returns the last minibatch's losses (detached).

        Plain PyTorch (``training_step`` passes Lightning's optimizer and ``manual_backward``), so a loop
        written by hand drives the same learner."""
        if batch.batch_dims == 1:  # one env: TorchRL's [T] batch, as [1, T]
            batch = batch.unsqueeze(0)
        batch = batch.select("observation", "action", "action_log_prob", ("next", "observation"),
                             ("next", "reward"), ("next", "done"), ("next", "terminated"))  # not the caller's
        reward, done = batch["next", "reward"].squeeze(-1), batch["next", "done"].squeeze(-1)
        batch["next", "reward"] = self.reward_scale(reward, done).unsqueeze(-1)
        losses = self.learner.learn(batch, optimizer, backward)
        self.updates_done += self.cfg.epochs * math.ceil(batch.numel() / self.cfg.minibatch_size)
        # The normaliser moves only now. The epochs above must see the observations normalised as the actor saw
        # them when it acted (as SB3's buffer stores them): with the statistics moved first, the probability ratio
        # starts away from 1 and the clip zeroes the gradient of up to 95% of the first batches' samples.
        self.obs_norm.update(batch["observation"].reshape(-1, batch["observation"].shape[-1]))
        return {key: value.detach() for key, value in losses.items()}

    def training_step(self, batch: TensorDictBase, batch_idx: int) -> None:
        losses = self.learn(batch, self.optimizers(), self.manual_backward)
        self.log_dict({f"train/{key}": value for key, value in losses.items()}, on_step=True, on_epoch=False,
                      batch_size=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # SB3's PPO: Adam, eps 1e-5; fused: one kernel for every parameter's update
        return torch.optim.Adam(self.parameters(), lr=self.cfg.lr, eps=1e-5, fused=True)


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
