"""Independent PPO (IPPO) on MPE's simple_spread: a PettingZoo parallel env through TorchRL's `PettingZooWrapper`.

Three agents must cover three landmarks without colliding. `PettingZooWrapper` groups
them (`MarlGroupMapType.ALL_IN_ONE_GROUP`) under `"agents"`: each env row holds
`("agents", "observation")` of shape `[3, 18]`, the agents' actions, rewards and done
flags under `("agents", ...)` and the env's own `done`/`terminated`/`truncated` at the
root, as TorchRL lays them out; the `RolloutDataModule`'s batches are `[num_envs, T]`
with the agent dim inside (`batch["agents"].batch_size == [num_envs, T, 3]`).

IPPO: one policy network and one value network, shared by the agents (parameter
sharing), each agent acting and being valued on its own observation; GAE and the
clipped loss run per agent, on `("agents", ...)` keys (`set_keys`). The return
reported (`rollout/` and `eval/episode_reward`) is the episode's team return: the
rewards of all agents summed over the episode's 25 steps.

    python examples/ippo_mpe.py --frames 300000 --seed 0 --out runs/ippo
    python examples/ippo_mpe.py --random-baseline      # the mean return of uniformly random actions

Needs the `multiagent` extra (`pip install 'lightning_rollout[multiagent]'`: pettingzoo, mpe2).
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
from torchrl.envs.libs.pettingzoo import PettingZooWrapper
from torchrl.envs.utils import MarlGroupMapType
from torchrl.modules import ProbabilisticActor
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fit_and_summarize  # noqa: E402

from lightning_rollout.lightning import RolloutDataModule  # noqa: E402

N_AGENTS, OBS_DIM, N_ACTIONS, EPISODE_STEPS = 3, 18, 5, 25
# The bar of the learning-results table (docs/performance.rst) and of the slow test: after training, the mean
# evaluation team return beats the mean return of uniformly random actions (about -80, std 24 per episode,
# measured over 1000 episodes: a standard error of 0.75) by this much: 0.4 of a random episode's std, well above
# the noise of a 32-episode evaluation (a standard error of about 3). Measured: +17.8 to +22.1 after 300k frames
# (docs/performance.rst).
MARGIN = 10.0
GROUP = "agents"
KEYS = {k: (GROUP, k) for k in ("observation", "action", "action_log_prob", "logits", "reward", "done",
                                "terminated", "state_value", "advantage", "value_target")}


def make_env() -> PettingZooWrapper:
    """simple_spread with 3 agents, 25 steps, discrete actions; the agents grouped under `"agents"`
    (a module-level function: picklable for worker processes)."""
    from mpe2 import simple_spread_v3

    env = simple_spread_v3.parallel_env(N=N_AGENTS, max_cycles=EPISODE_STEPS, continuous_actions=False)
    return PettingZooWrapper(env, group_map=MarlGroupMapType.ALL_IN_ONE_GROUP, categorical_actions=True)


@dataclass
class Config:
    frames: int = 300_000          # env steps (each is one step of all 3 agents)
    num_envs: int = 8
    envs_per_thread: int = 8       # all envs in one thread: a PettingZooWrapper step is ~2 ms of Python, and one
                                   # thread collected 920 frames/s here against 760 for one env a thread
    steps_per_env: int = 100       # 4 episodes per env and batch
    epochs: int = 4
    minibatches: int = 4
    lr: float = 5e-4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip: float = 0.2
    entropy_coef: float = 0.01
    value_coef: float = 0.5
    max_grad_norm: float = 0.5
    hidden: int = 64
    eval_every_frames: int = 25_600
    eval_episodes: int = 32
    seed: int = 0
    out: str = "runs/ippo_mpe"

    @property
    def frames_per_batch(self) -> int:
        return self.num_envs * self.steps_per_env


def mlp(out: int, hidden: int, last_std: float) -> nn.Sequential:
    """[*, 3, 18] -> [*, 3, out], the same weights for every agent (applied along the agent dim)."""
    layers = [nn.Linear(OBS_DIM, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, out)]
    for layer in layers:
        if isinstance(layer, nn.Linear):
            nn.init.orthogonal_(layer.weight, 2**0.5 if layer is not layers[-1] else last_std)
            nn.init.zeros_(layer.bias)
    return nn.Sequential(*layers)


class IPPO(pl.LightningModule):
    """Clipped PPO per agent with a shared actor and a shared decentralised critic. `self.actor` acts."""

    def __init__(self, *, hidden: int = 64, lr: float = 5e-4, gamma: float = 0.99, gae_lambda: float = 0.95,
                 clip: float = 0.2, entropy_coef: float = 0.01, value_coef: float = 0.5, max_grad_norm: float = 0.5,
                 epochs: int = 4, minibatches: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.actor = ProbabilisticActor(
            TensorDictModule(mlp(N_ACTIONS, hidden, 0.01), in_keys=[KEYS["observation"]], out_keys=[KEYS["logits"]]),
            in_keys=[KEYS["logits"]], out_keys=[KEYS["action"]], distribution_class=torch.distributions.Categorical,
            return_log_prob=True, log_prob_key=KEYS["action_log_prob"])
        self.critic = TensorDictModule(mlp(1, hidden, 1.0), in_keys=[KEYS["observation"]],
                                       out_keys=[KEYS["state_value"]])
        self.advantage = GAE(gamma=gamma, lmbda=gae_lambda, value_network=self.critic)
        self.advantage.set_keys(**{k: KEYS[k] for k in ("reward", "done", "terminated", "advantage",
                                                       "value_target")}, value=KEYS["state_value"])
        self.loss = ClipPPOLoss(self.actor, self.critic, clip_epsilon=clip, entropy_coeff=entropy_coef,
                                critic_coeff=value_coef, loss_critic_type="l2", normalize_advantage=True,
                                normalize_advantage_exclude_dims=(-2,))  # advantages normalised per agent
        self.loss.set_keys(**{k: KEYS[k] for k in ("action", "reward", "done", "terminated", "advantage",
                                                  "value_target")}, value=KEYS["state_value"],
                           sample_log_prob=KEYS["action_log_prob"])

    def training_step(self, batch: TensorDictBase, batch_idx: int) -> None:
        hp = self.hparams
        with torch.no_grad():
            self.advantage(batch)   # per agent: [num_envs, T, 3, 1], time along dim 1
        data = batch.reshape(-1)    # [num_envs * T] env steps, the agent dim inside
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
        self.log_dict({"train/loss_objective": losses["loss_objective"], "train/loss_critic": losses["loss_critic"],
                       "train/entropy": losses["entropy"]}, on_step=True, on_epoch=False, batch_size=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, eps=1e-5)


def random_baseline(*, episodes: int, seed: int) -> dict:
    """Mean team return of uniformly random actions over `episodes` episodes (the same env, seeds and loop as
    the evaluation)."""
    from lightning_rollout import EventProcessor, MultiEnvLoop

    returns: list[float] = []

    class Returns(EventProcessor):
        def on_eval_episode_end(self, episode) -> None:
            returns.append(episode.reward)

    with MultiEnvLoop(make_env, None, num_envs=8, eval=True, seed=seed) as loop:  # None: TorchRL's RandomPolicy
        loop.run_episodes(episodes, processor=Returns())
    mean = sum(returns) / len(returns)
    std = (sum((r - mean) ** 2 for r in returns) / (len(returns) - 1)) ** 0.5
    return {"random_mean_return": mean, "random_std_return": std, "episodes": len(returns), "seed": seed}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=Config.frames)
    parser.add_argument("--num-envs", type=int, default=Config.num_envs)
    parser.add_argument("--steps-per-env", type=int, default=Config.steps_per_env)
    parser.add_argument("--eval-every-frames", type=int, default=Config.eval_every_frames)
    parser.add_argument("--eval-episodes", type=int, default=Config.eval_episodes)
    parser.add_argument("--seed", type=int, default=Config.seed)
    parser.add_argument("--out", default=Config.out)
    parser.add_argument("--random-baseline", type=int, nargs="?", const=1000, default=None, metavar="EPISODES",
                        help="only measure uniformly random actions over EPISODES episodes (default 1000)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.random_baseline is not None:
        result = random_baseline(episodes=args.random_baseline, seed=args.seed)
        print("RESULT " + json.dumps(result))
        return result
    cfg = Config(frames=args.frames, num_envs=args.num_envs, envs_per_thread=args.num_envs,
                 steps_per_env=args.steps_per_env,
                 eval_every_frames=args.eval_every_frames, eval_episodes=args.eval_episodes, seed=args.seed,
                 out=args.out)
    pl.seed_everything(cfg.seed, verbose=False)

    datamodule = RolloutDataModule(
        make_env, num_envs=cfg.num_envs, envs_per_thread=cfg.envs_per_thread, num_workers=1,
        frames_per_batch=cfg.frames_per_batch,
        total_frames=cfg.frames - cfg.frames % cfg.frames_per_batch, layout="env_time", on_policy=True,
        seed=cfg.seed, eval_every_n_frames=cfg.eval_every_frames, eval_episodes=cfg.eval_episodes)
    logger = TensorBoardLogger(cfg.out, name="ippo", version=f"seed{cfg.seed}")
    trainer = pl.Trainer(max_epochs=1, logger=logger, log_every_n_steps=1, enable_checkpointing=False,
                         enable_model_summary=False, enable_progress_bar=sys.stderr.isatty(), accelerator="cpu")
    model = IPPO(hidden=cfg.hidden, lr=cfg.lr, gamma=cfg.gamma, gae_lambda=cfg.gae_lambda, clip=cfg.clip,
                 entropy_coef=cfg.entropy_coef, value_coef=cfg.value_coef, max_grad_norm=cfg.max_grad_norm,
                 epochs=cfg.epochs, minibatches=cfg.minibatches)
    result = fit_and_summarize(trainer, model, datamodule, target=float("inf"))
    print("RESULT " + json.dumps(result))
    print(f"eval team return: last {result['last_eval_return']:.1f}, best {result['best_eval_return']:.1f} after "
          f"{result['frames']} frames in {result['seconds']} s")
    return result


if __name__ == "__main__":
    main()
