"""SAC on MuJoCo HalfCheetah-v5 with PyTorch Lightning, TorchRL's SACLoss and replay buffer, and lightning_rollout.

Read it top to bottom: the config, the networks, the LightningModule (each training step adds the
frames just collected to a TorchRL `ReplayBuffer` and takes the gradient steps they are due), and
`main`, which wires a `RolloutDataModule` into `Trainer.fit` with TensorBoard logging against frames and
deterministic evaluation episodes as the validation loop.

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
    tensorboard --logdir runs/sac_mujoco
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.data import LazyTensorStorage, ReplayBuffer
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
    eval_every_frames: int = 10_000
    eval_episodes: int = 4
    target_return: float | None = None  # stop at the first evaluation above it (None: run every frame)
    seed: int = 0
    out: str = "runs/sac_mujoco"


# the Config fields the command line sets (--frames, --eval-every-frames...), and --target-return
CLI_OPTIONS = ("env", "frames", "frames_per_batch", "utd", "learning_starts", "batch_size", "eval_every_frames",
               "eval_episodes", "seed", "out")


class GaussianPolicy(nn.Module):
    """SB3's SAC actor body: an MLP, then the mean and the state-dependent log std of a Gaussian (log std
    clipped to [-20, 2]); ``TanhNormal`` squashes its samples into the action box [-1, 1]."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.mean = nn.Linear(hidden, act_dim)
        self.log_std = nn.Linear(hidden, act_dim)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``obs`` ``[..., obs_dim]`` (MuJoCo's float64 included) -> ``loc``, ``scale``: ``[..., act_dim]``."""
        h = self.body(obs.float())
        return self.mean(h), self.log_std(h).clamp(-20.0, 2.0).exp()


class QNet(nn.Module):
    """One critic: Q(observation, action), an MLP over the two concatenated."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim + act_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                 nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """``[..., obs_dim]``, ``[..., act_dim]`` -> ``[..., 1]``."""
        return self.net(torch.cat([obs.float(), action], -1))


def make_networks(obs_dim: int, act_dim: int, cfg: Config) -> tuple[ProbabilisticActor, ValueOperator]:
    actor = ProbabilisticActor(
        TensorDictModule(GaussianPolicy(obs_dim, act_dim, cfg.hidden), in_keys=["observation"],
                         out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"], distribution_class=TanhNormal)  # deterministic action: tanh(loc), as SB3's
    qvalue = ValueOperator(QNet(obs_dim, act_dim, cfg.hidden), in_keys=["observation", "action"])
    return actor, qvalue  # SACLoss makes the second critic and the target critics from `qvalue`


class SAC(pl.LightningModule):
    """SAC with a learned entropy coefficient; ``self.actor`` is what the RolloutDataModule acts with (a copy
    of it, off-policy)."""

    def __init__(self, obs_dim: int, act_dim: int, cfg: Config) -> None:
        super().__init__()
        self.save_hyperparameters({"obs_dim": obs_dim, "act_dim": act_dim, **cfg.__dict__})
        self.cfg = cfg
        self.automatic_optimization = False  # many gradient steps per collected batch
        self.actor, qvalue = make_networks(obs_dim, act_dim, cfg)
        self.loss = SACLoss(self.actor, qvalue, num_qvalue_nets=2, loss_function="l2", alpha_init=1.0,
                            target_entropy=-float(act_dim))
        self.loss.make_value_estimator(gamma=cfg.gamma)  # one-step TD target from the target critics
        self.target_update = SoftUpdate(self.loss, tau=cfg.tau)
        # a buffer never holds more than the run's frames (no eviction below buffer_size)
        self.buffer = ReplayBuffer(storage=LazyTensorStorage(min(cfg.buffer_size, cfg.frames)),
                                   batch_size=cfg.batch_size)
        self.frames_seen = 0    # env frames added to the buffer
        self.updates_done = 0   # gradient steps taken

    def learn(self, batch: TensorDictBase, optimizer: torch.optim.Optimizer,
              backward: Callable[[torch.Tensor], None] = torch.Tensor.backward) -> TensorDictBase | None:
        """Add ``batch`` (``[frames]``, any order) to the replay buffer, then take the gradient steps due:
        ``utd * (frames_seen - learning_starts)`` in all. Returns the last step's losses (``None``: none due).

        Plain PyTorch (``training_step`` passes Lightning's optimizer and ``manual_backward``), so a loop
        written by hand drives the same learner."""
        self.buffer.extend(batch.select(*REPLAY_KEYS).reshape(-1))
        self.frames_seen += batch.numel()
        due = int(self.cfg.utd * max(0, self.frames_seen - self.cfg.learning_starts)) - self.updates_done
        return self.update(due, optimizer, backward) if due > 0 else None

    def update(self, steps: int, optimizer: torch.optim.Optimizer,
               backward: Callable[[torch.Tensor], None] = torch.Tensor.backward) -> TensorDictBase:
        """``steps`` (>= 1) gradient steps on minibatches sampled from the buffer; the last step's losses."""
        for _ in range(steps):
            losses = self.loss(self.buffer.sample())
            # the actor's loss reads detached critics, the critics' targets no actor gradient, the entropy
            # coefficient's loss detached log-probabilities: one backward of the sum is three separate ones
            loss = losses["loss_actor"] + losses["loss_qvalue"] + losses["loss_alpha"]
            optimizer.zero_grad()
            backward(loss)
            optimizer.step()
            self.target_update.step()
        self.updates_done += steps
        return losses.detach()

    def training_step(self, batch: TensorDictBase, batch_idx: int) -> None:
        losses = self.learn(batch, self.optimizers(), self.manual_backward)
        if losses is not None:
            self.log_dict({"train/loss_actor": losses["loss_actor"], "train/loss_qvalue": losses["loss_qvalue"],
                           "train/alpha": losses["alpha"], "train/entropy": losses["entropy"],
                           "train/updates": float(self.updates_done)}, on_step=True, on_epoch=False, batch_size=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # one Adam over actor, critics and log(alpha): Adam's update is per parameter, so with one learning
        # rate this is SB3's three Adam optimizers (the target critics are buffers, not parameters)
        return torch.optim.Adam(self.loss.parameters(), lr=self.cfg.lr)


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
