"""SAC on MuJoCo HalfCheetah-v5 with PyTorch Lightning, a TorchRL replay buffer, and lightning_rollout.

Read it top to bottom: the config, the policy and the actor the collector acts with, the two
learners, the LightningModule (each training step adds the frames just collected to a TorchRL
`ReplayBuffer` and takes the gradient steps they are due), and `main`, which wires a
`RolloutDataModule` into `Trainer.fit` with TensorBoard logging against frames and deterministic
evaluation episodes as the validation loop.

Two learners take the same gradient step (`--learner`):

* `plain` (the default): the SAC step written out in plain PyTorch, CleanRL style, the two critics
  evaluated together (their weights stacked, one batched matmul a layer);
* `torchrl`: TorchRL's `SACLoss` and `SoftUpdate`.

`--compile true` runs either learner's loss through `torch.compile`. docs/training.rst gives the
learners' times against Stable-Baselines3's (`python -m benchmarks.e2e.learners`).

Hyperparameters: RL Baselines3 Zoo's SAC for HalfCheetah-v4 (`rl_zoo3/hyperparams/sac.yml` of rl-zoo3
2.9.2, entry `HalfCheetah-v4: &mujoco-defaults`: `policy: 'MlpPolicy'`, `learning_starts: 10000`,
`n_timesteps: 1e6`), applied to v5; every value that entry leaves out is Stable-Baselines3's SAC default:
one env, learning rate 3e-4 (Adam), buffer 1e6, minibatches of 256, tau 0.005, gamma 0.99, `train_freq: 1`
and `gradient_steps: 1`, the entropy coefficient learned from 1.0 towards a target entropy of
-dim(action), two critics, networks of 2 x 256 ReLU units, the actor's log std clipped to [-20, 2].

Off-policy, with a controlled update-to-data ratio (UTD, gradient steps per env frame; the zoo's is 1):
the `RolloutDataModule` runs with `layout="flat"` and `on_policy=False`, so the env keeps stepping (one
step ahead, with its own copy of the actor, refreshed before each batch) while the learner trains. The
first `learning_starts` frames are uniformly random actions; after them, the learner has taken
`utd * (frames - learning_starts)` gradient steps at the end of every training step, as
Stable-Baselines3 has after the same number of frames (it takes its steps one frame at a time, here they
come `frames_per_batch` frames at a time).

    pip install "gymnasium[mujoco]"
    python examples/sac_mujoco.py --frames 50000 --seed 0 --out runs/sac_mujoco
    python examples/sac_mujoco.py --learner torchrl   # TorchRL's SACLoss
    tensorboard --logdir runs/sac_mujoco
"""

from __future__ import annotations

import copy
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn
from torch.nn import functional as F
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs.utils import ExplorationType, exploration_type
from torchrl.modules import ProbabilisticActor, TanhNormal, ValueOperator
from torchrl.objectives import SACLoss, SoftUpdate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import config_from_args, env_dims, fit_and_summarize, make_trainer, print_summary  # noqa: E402

from lightning_rollout.lightning import RolloutDataModule  # noqa: E402

# what the loss reads from a transition; the rest of a batch (policy outputs, counters) stays out of the buffer
REPLAY_KEYS = ("observation", "action", ("next", "observation"), ("next", "reward"), ("next", "done"),
               ("next", "terminated"))


@dataclass
class Config:
    env: str = "HalfCheetah-v5"
    frames: int = 50_000            # total env frames
    num_envs: int = 1               # SB3's default n_envs
    frames_per_batch: int = 250     # frames collected per training step
    utd: float = 1.0                # gradient steps per env frame (train_freq 1, gradient_steps 1)
    learning_starts: int = 10_000   # random frames before the first gradient step
    buffer_size: int = 1_000_000
    batch_size: int = 256           # transitions per gradient step
    lr: float = 3e-4                # actor, critics and entropy coefficient
    gamma: float = 0.99
    tau: float = 0.005              # soft target update per gradient step
    hidden: int = 256
    learner: str = "plain"          # "plain": the step in plain PyTorch; "torchrl": TorchRL's SACLoss
    compile: bool = False           # the learner's loss through torch.compile (tens of seconds to compile)
    eval_every_frames: int = 10_000
    eval_episodes: int = 4
    target_return: float | None = None  # stop at the first evaluation above it (None: run every frame)
    seed: int = 0
    out: str = "runs/sac_mujoco"


# the Config fields the command line sets (--frames, --eval-every-frames...), and --target-return
CLI_OPTIONS = ("env", "frames", "frames_per_batch", "utd", "learning_starts", "batch_size", "learner",
               "compile", "eval_every_frames", "eval_episodes", "seed", "out")


# ---------------------------------------------------------------------------------------------------------------
# The policy and the acting module, the same for both learners
# ---------------------------------------------------------------------------------------------------------------
class GaussianPolicy(nn.Module):
    """SB3's SAC actor: an MLP, then the mean and the state-dependent log std of a Gaussian (log std clipped to
    [-20, 2]); actions are its samples squashed by tanh into the action box [-1, 1]."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.mean = nn.Linear(hidden, act_dim)
        self.log_std = nn.Linear(hidden, act_dim)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``obs`` ``[..., obs_dim]`` (MuJoCo's float64 included) -> ``loc``, ``log_std``: ``[..., act_dim]``."""
        h = self.body(obs.float())
        return self.mean(h), self.log_std(h).clamp(-20.0, 2.0)

    def sample(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A squashed sample (reparametrised: gradients flow to the weights) and its log-density ``[...]``."""
        loc, log_std = self(obs)
        u = loc + log_std.exp() * torch.randn_like(loc)
        gaussian = -0.5 * ((u - loc) / log_std.exp()) ** 2 - log_std - 0.5 * math.log(2 * math.pi)
        log_det_jacobian = 2.0 * (math.log(2.0) - u - F.softplus(-2.0 * u))  # log(1 - tanh(u)^2), stably
        return u.tanh(), (gaussian - log_det_jacobian).sum(-1)


class Actor(nn.Module):
    """What the collector acts with, wrapped as ``TensorDictModule(Actor(policy), in_keys=["observation"],
    out_keys=["action"])``: a squashed Gaussian sample, or ``tanh`` of the mean under TorchRL's deterministic
    exploration type (which evaluation sets), as SB3's. A plain ``TensorDictModule`` over a tensor function is
    called on the stacked observations directly, with no TensorDict a step."""

    def __init__(self, policy: GaussianPolicy) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        if exploration_type() in (ExplorationType.DETERMINISTIC, ExplorationType.MODE, ExplorationType.MEAN):
            return self.policy(observation)[0].tanh()
        return self.policy.sample(observation)[0]


# ---------------------------------------------------------------------------------------------------------------
# Learner 1 (the default, --learner plain): the SAC gradient step in plain PyTorch
# ---------------------------------------------------------------------------------------------------------------
class Critics(nn.Module):
    """``n`` critics Q(observation, action), 2 x ``hidden`` ReLU MLPs, evaluated together: each layer's weights
    stacked ``[n, in, out]``, one batched matmul a layer (PyTorch's ``nn.Linear`` initialisation)."""

    def __init__(self, n: int, in_dim: int, hidden: int) -> None:
        super().__init__()
        self.weights, self.biases = nn.ParameterList(), nn.ParameterList()
        for fan_in, fan_out in ((in_dim, hidden), (hidden, hidden), (hidden, 1)):
            bound = 1.0 / math.sqrt(fan_in)
            self.weights.append(nn.Parameter(torch.empty(n, fan_in, fan_out).uniform_(-bound, bound)))
            self.biases.append(nn.Parameter(torch.empty(n, 1, fan_out).uniform_(-bound, bound)))

    def forward(self, obs: torch.Tensor, action: torch.Tensor, *, detach: bool = False) -> torch.Tensor:
        """``[B, obs_dim]``, ``[B, act_dim]`` -> ``[n, B]``; ``detach``: no gradient to the critics' weights
        (the actor's loss), the action's gradient kept."""
        x = torch.cat([obs.float(), action], -1).expand(len(self.weights[0]), -1, -1)
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            x = torch.baddbmm(b.detach() if detach else b, x, w.detach() if detach else w)
            x = x.relu() if i < len(self.weights) - 1 else x
        return x.squeeze(-1)


class PlainSAC(nn.Module):
    """The gradient step written out, CleanRL style: two critics (and their soft-updated targets) against the
    clipped double-Q target, the actor against the smaller critic, the entropy coefficient towards
    ``target_entropy``; one backward of the three losses (each reads the others' inputs detached), one Adam step."""

    def __init__(self, policy: GaussianPolicy, obs_dim: int, act_dim: int, cfg: Config) -> None:
        super().__init__()
        self.policy, self.cfg, self.target_entropy = policy, cfg, -float(act_dim)
        self.critics = Critics(2, obs_dim + act_dim, cfg.hidden)
        self.target_critics = copy.deepcopy(self.critics).requires_grad_(False)
        self.log_alpha = nn.Parameter(torch.zeros(()))  # the entropy coefficient starts at 1.0
        self.loss_fn = torch.compile(self.loss) if cfg.compile else self.loss

    def loss(self, obs: torch.Tensor, action: torch.Tensor, reward: torch.Tensor, next_obs: torch.Tensor,
             terminated: torch.Tensor) -> dict[str, torch.Tensor]:
        """One minibatch's losses (``obs``, ``next_obs`` ``[B, obs_dim]``, ``action`` ``[B, act_dim]``, ``reward``
        and ``terminated`` ``[B]``); ``"loss"`` is what the step differentiates."""
        alpha = self.log_alpha.detach().exp()
        with torch.no_grad():
            next_action, next_log_prob = self.policy.sample(next_obs)
            next_q = self.target_critics(next_obs, next_action).min(0).values - alpha * next_log_prob
            q_target = reward + self.cfg.gamma * (~terminated) * next_q
        loss_qvalue = 0.5 * ((self.critics(obs, action) - q_target) ** 2).mean(-1).sum()  # SB3's: summed
        action_pi, log_prob = self.policy.sample(obs)
        loss_actor = (alpha * log_prob - self.critics(obs, action_pi, detach=True).min(0).values).mean()
        loss_alpha = -(self.log_alpha * (log_prob.detach() + self.target_entropy)).mean()
        return {"loss": loss_qvalue + loss_actor + loss_alpha, "loss_actor": loss_actor, "loss_qvalue": loss_qvalue,
                "alpha": alpha, "entropy": -log_prob.mean()}

    def step(self, data: TensorDictBase, optimizer: torch.optim.Optimizer,
             backward: Callable[[torch.Tensor], None]) -> dict[str, torch.Tensor]:
        nxt = data["next"]
        losses = self.loss_fn(data["observation"], data["action"], nxt["reward"].squeeze(-1), nxt["observation"],
                              nxt["terminated"].squeeze(-1))
        optimizer.zero_grad()
        backward(losses["loss"])
        optimizer.step()
        with torch.no_grad():
            for target, online in zip(self.target_critics.parameters(), self.critics.parameters()):
                target.lerp_(online, self.cfg.tau)
        return losses


# ---------------------------------------------------------------------------------------------------------------
# Learner 2 (--learner torchrl): TorchRL's SACLoss and SoftUpdate
# ---------------------------------------------------------------------------------------------------------------
class QNet(nn.Module):
    """One critic: Q(observation, action), an MLP over the two concatenated."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim + act_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                 nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """``[..., obs_dim]``, ``[..., act_dim]`` -> ``[..., 1]``."""
        return self.net(torch.cat([obs.float(), action], -1))


class TorchRLSAC(nn.Module):
    """The same step through TorchRL: a ``ProbabilisticActor`` (``TanhNormal``) over the same policy weights,
    ``SACLoss`` (it makes the second critic and the targets from ``qvalue``), ``SoftUpdate``; ``compile``: the
    loss through ``torch.compile``."""

    def __init__(self, policy: GaussianPolicy, obs_dim: int, act_dim: int, cfg: Config) -> None:
        super().__init__()

        class LocScale(nn.Module):
            def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                loc, log_std = policy(obs)
                return loc, log_std.exp()

        actor = ProbabilisticActor(TensorDictModule(LocScale(), in_keys=["observation"], out_keys=["loc", "scale"]),
                                   in_keys=["loc", "scale"], distribution_class=TanhNormal)
        qvalue = ValueOperator(QNet(obs_dim, act_dim, cfg.hidden), in_keys=["observation", "action"])
        self.loss = SACLoss(actor, qvalue, num_qvalue_nets=2, loss_function="l2", alpha_init=1.0,
                            target_entropy=-float(act_dim))
        self.loss.make_value_estimator(gamma=cfg.gamma)  # one-step TD target from the target critics
        self.target_update = SoftUpdate(self.loss, tau=cfg.tau)
        self.loss_fn = torch.compile(self.loss) if cfg.compile else self.loss

    def step(self, data: TensorDictBase, optimizer: torch.optim.Optimizer,
             backward: Callable[[torch.Tensor], None]) -> dict[str, torch.Tensor]:
        losses = self.loss_fn(data)
        # the actor's loss reads detached critics, the critics' targets no actor gradient, the entropy
        # coefficient's loss detached log-probabilities: one backward of the sum is three separate ones
        optimizer.zero_grad()
        backward(losses["loss_actor"] + losses["loss_qvalue"] + losses["loss_alpha"])
        optimizer.step()
        self.target_update.step()
        return {key: losses[key] for key in ("loss_actor", "loss_qvalue", "alpha", "entropy")}


LEARNERS = {"plain": PlainSAC, "torchrl": TorchRLSAC}


# ---------------------------------------------------------------------------------------------------------------
# The LightningModule: the replay buffer, the update-to-data bookkeeping, the learner's steps
# ---------------------------------------------------------------------------------------------------------------
class SAC(pl.LightningModule):
    """SAC with a learned entropy coefficient; ``self.actor`` is what the RolloutDataModule acts with (a copy
    of it, off-policy)."""

    def __init__(self, obs_dim: int, act_dim: int, cfg: Config) -> None:
        super().__init__()
        if cfg.learner not in LEARNERS:
            raise ValueError(f"learner must be one of {sorted(LEARNERS)}, got {cfg.learner!r}")
        self.save_hyperparameters({"obs_dim": obs_dim, "act_dim": act_dim, **cfg.__dict__})
        self.cfg = cfg
        self.automatic_optimization = False  # many gradient steps per collected batch
        self.policy = GaussianPolicy(obs_dim, act_dim, cfg.hidden)
        self.actor = TensorDictModule(Actor(self.policy), in_keys=["observation"], out_keys=["action"])
        self.learner = LEARNERS[cfg.learner](self.policy, obs_dim, act_dim, cfg)
        # a buffer never holds more than the run's frames (no eviction below buffer_size)
        self.buffer = ReplayBuffer(storage=LazyTensorStorage(min(cfg.buffer_size, cfg.frames)),
                                   batch_size=cfg.batch_size)
        self.frames_seen = 0    # env frames added to the buffer
        self.updates_done = 0   # gradient steps taken

    def learn(self, batch: TensorDictBase, optimizer: torch.optim.Optimizer,
              backward: Callable[[torch.Tensor], None] = torch.Tensor.backward) -> dict[str, torch.Tensor] | None:
        """Add ``batch`` (``[frames]``, any order) to the replay buffer, then take the gradient steps due:
        ``utd * (frames_seen - learning_starts)`` in all. Returns the last step's losses (detached; ``None``: none
        due).

        Plain PyTorch (``training_step`` passes Lightning's optimizer and ``manual_backward``), so a loop
        written by hand drives the same learner."""
        self.buffer.extend(batch.select(*REPLAY_KEYS).reshape(-1))
        self.frames_seen += batch.numel()
        due = int(self.cfg.utd * max(0, self.frames_seen - self.cfg.learning_starts)) - self.updates_done
        if due <= 0:
            return None
        for _ in range(due):
            losses = self.learner.step(self.buffer.sample(), optimizer, backward)
        self.updates_done += due
        return {key: value.detach() for key, value in losses.items()}

    def training_step(self, batch: TensorDictBase, batch_idx: int) -> None:
        losses = self.learn(batch, self.optimizers(), self.manual_backward)
        if losses is not None:
            self.log_dict({f"train/{key}": value for key, value in losses.items()}
                          | {"train/updates": float(self.updates_done)}, on_step=True, on_epoch=False, batch_size=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # one Adam over actor, critics and log(alpha): Adam's update is per parameter, so with one learning
        # rate this is SB3's three Adam optimizers (the target critics are not trained); fused: one kernel
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=self.cfg.lr, fused=True)


def make_datamodule(cfg: Config) -> RolloutDataModule:
    """Off-policy collection: ``[frames_per_batch]`` batches in arrival order, the env one step ahead."""
    return RolloutDataModule(
        cfg.env, num_envs=cfg.num_envs, frames_per_batch=cfg.frames_per_batch,
        total_frames=cfg.frames - cfg.frames % cfg.frames_per_batch, layout="flat", on_policy=False,
        init_random_frames=cfg.learning_starts, seed=cfg.seed,
        eval_every_n_frames=cfg.eval_every_frames if cfg.eval_episodes else None,
        eval_episodes=cfg.eval_episodes)  # --eval-episodes 0: no evaluation


def main(argv: list[str] | None = None) -> dict:
    cfg = config_from_args(Config, CLI_OPTIONS, argv=argv, description=__doc__)
    pl.seed_everything(cfg.seed, verbose=False)
    torch.set_num_threads(1)  # small networks: intra-op threads only fight the env threads for the 2 cores
    result = fit_and_summarize(make_trainer(cfg, name="sac"), SAC(*env_dims(cfg.env), cfg), make_datamodule(cfg),
                               target=cfg.target_return)
    print_summary(result, out=cfg.out)
    return result


if __name__ == "__main__":
    main()
