"""DDP helper for the Lightning tests: 2 CPU processes (gloo), one collector per rank.

Run as ``python tests/ddp_script.py --out DIR [--strategy ddp|ddp_spawn]``. With
``ddp`` Lightning's script launcher re-executes this file for rank 1; with
``ddp_spawn`` it pickles the trainer, the module and the DataModule (built from a
plain gymnasium id) into two spawned processes. Each rank writes, from
``on_fit_end`` (so it works for both strategies), into ``DIR``:

* ``obs_rank{r}.pt``: the observation of its first training batch;
* ``rank{r}.json``: its local episode returns grouped by batch and by evaluation
  round (one round after step 2, in the validation loop), the metrics it
  logged last (``trainer.callback_metrics``), its frame and episode counts, the
  seconds it waited for its last batch and the number of training steps it ran.

``rollout/fps`` is measured with a fake clock that advances one second per call
(``on_train_start``, then once per batch), so its value is exact.

The fit saves ``last.ckpt``; then every rank resumes from it for one more batch (``ddp``: twice,
``resumed_B`` and ``resumed_C``; ``ddp_spawn``: once, ``resumed_B``) and writes the observation of
its first batch after the resume to ``obs_rank{r}_resumed_{B,C}.pt``.
"""

from __future__ import annotations

import argparse
import json
import os

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
import torch
from tensordict.nn import TensorDictModule
from torchrl.modules import MLP, OneHotCategorical, ProbabilisticActor

from lightning_rollout import EpisodeStatsLogger, RolloutCallback, RolloutDataModule

NUM_ENVS = 2
FRAMES_PER_BATCH = 32
MAX_STEPS = 3


class Agent(pl.LightningModule):
    def __init__(self, out_dir: str, tag: str = "") -> None:
        super().__init__()
        self.tag = tag
        net = TensorDictModule(MLP(in_features=4, out_features=2, num_cells=[16]), in_keys=["observation"],
                               out_keys=["logits"])
        self.actor = ProbabilisticActor(net, in_keys=["logits"], distribution_class=OneHotCategorical)
        self.out_dir = out_dir
        self.steps = 0

    def training_step(self, batch, batch_idx):
        if self.steps == 0:
            path = os.path.join(self.out_dir, f"obs_rank{self.global_rank}{self.tag}.pt")
            torch.save(batch["observation"].clone(), path)
        self.steps += 1
        logits = self.actor(batch.select("observation").clone())["logits"]
        return -logits.log_softmax(-1).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


class TickClock:
    """A clock that advances one second per call (picklable, for ``ddp_spawn``)."""

    def __init__(self) -> None:
        self.now = -1.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


class Reporter(RolloutCallback):
    """This rank's episode returns by batch and by evaluation round; writes the report at ``on_fit_end``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.pending: list[float] = []
        self.per_batch: list[list[float]] = []
        self.eval_rounds: list[list[float]] = []

    def on_episode_end(self, trainer, pl_module, episode) -> None:
        self.pending.append(float(episode.reward))

    def on_rollout_batch(self, trainer, pl_module, batch) -> None:
        self.per_batch.append(self.pending)
        self.pending = []

    def on_eval_end(self, trainer, pl_module, episodes) -> None:
        self.eval_rounds.append([float(e.reward) for e in episodes])

    def on_fit_end(self, trainer, pl_module) -> None:
        dm = trainer.datamodule
        report = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "steps": pl_module.steps,
            "frames": dm.collector.frames,
            "episodes": dm.collector.loop.episodes,
            "last_collect_seconds": dm.last_collect_seconds,
            "per_batch_rewards": self.per_batch,
            "eval_rounds": self.eval_rounds,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        }
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(report, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", choices=["ddp", "ddp_spawn"], default="ddp")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(1)

    dm = RolloutDataModule("CartPole-v1", num_envs=NUM_ENVS, frames_per_batch=FRAMES_PER_BATCH, seed=0,
                           eval_every_n_frames=2 * FRAMES_PER_BATCH, eval_episodes=2, eval_max_episode_steps=40)
    trainer = pl.Trainer(strategy=args.strategy, accelerator="cpu", devices=2, max_steps=MAX_STEPS, logger=False,
                         callbacks=[Reporter(args.out), EpisodeStatsLogger(clock=TickClock()),
                                    ModelCheckpoint(dirpath=args.out, save_last=True, save_top_k=0)],
                         enable_model_summary=False, enable_progress_bar=False, num_sanity_val_steps=0)
    trainer.fit(Agent(args.out), datamodule=dm)
    for tag in ("_resumed_B", "_resumed_C") if args.strategy == "ddp" else ("_resumed_B",):
        resume(args.out, args.strategy, tag)


def resume(out: str, strategy: str, tag: str) -> None:
    """Resume from ``last.ckpt`` for one more batch, with a new DataModule and Trainer (no evaluation)."""
    dm = RolloutDataModule("CartPole-v1", num_envs=NUM_ENVS, frames_per_batch=FRAMES_PER_BATCH, seed=0,
                           eval_episodes=0)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=MAX_STEPS + 1, logger=False,
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
    trainer.fit(Agent(out, tag), datamodule=dm, ckpt_path=os.path.join(out, "last.ckpt"))


if __name__ == "__main__":
    main()
