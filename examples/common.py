"""Helpers shared by the examples: a stop-when-solved callback and the learning-curve plot.

Kept apart so each example reads top to bottom as one algorithm (CleanRL style).
"""

from __future__ import annotations

import glob
import os
from typing import Any

import lightning.pytorch as pl

from lightning_rollout.events import EpisodeEnd
from lightning_rollout.lightning import RolloutCallback


class StopWhenSolved(RolloutCallback):
    """Stop training once an evaluation round's mean return reaches ``target``.

    Records ``solved_at_frames`` (frames collected by this rank when solved),
    ``best`` (best mean evaluation return seen) and ``history``.
    """

    def first_frames_reaching(self, threshold: float) -> int | None:
        """Frames collected when an evaluation round first averaged ``threshold`` or more."""
        return next((frames for frames, value in self.history if value >= threshold), None)

    def __init__(self, target: float) -> None:
        self.target = target
        self.best = float("-inf")
        self.last = float("nan")
        self.solved_at_frames: int | None = None
        self.history: list[tuple[int, float]] = []  # (frames, mean evaluation return) per round

    def on_eval_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, episodes: list[EpisodeEnd]) -> None:
        if not episodes:
            return
        self.last = sum(e.reward for e in episodes) / len(episodes)
        self.best = max(self.best, self.last)
        self.history.append((trainer.datamodule.collector.frames, self.last))
        if self.last >= self.target and self.solved_at_frames is None:
            self.solved_at_frames = trainer.datamodule.collector.frames
            trainer.should_stop = True


def read_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """All scalars of the TensorBoard event files under ``log_dir``: ``{tag: [(step, value), ...]}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True)):
        acc = EventAccumulator(path)
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return scalars


def plot_learning_curve(log_dir: str, png_path: str, *, title: str) -> str:
    """Plot training and evaluation episode return against frames; returns ``png_path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scalars = read_scalars(log_dir)
    frames_at = dict(scalars.get("rollout/frames", []))

    def series(tag: str) -> tuple[list[float], list[float]]:
        points = [(frames_at[s], v) for s, v in scalars.get(tag, []) if s in frames_at]
        return [p[0] for p in points], [p[1] for p in points]

    fig, ax = plt.subplots(figsize=(7, 4))
    for tag, label, style in (("rollout/episode_reward", "training episodes", "-"),
                              ("eval/episode_reward", "evaluation (deterministic)", "o-")):
        xs, ys = series(tag)
        if xs:
            ax.plot(xs, ys, style, label=label, alpha=0.8)
    ax.set_xlabel("frames")
    ax.set_ylabel("episode return")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def summary(solver: StopWhenSolved, seconds: float, frames: int) -> dict[str, Any]:
    """What an example prints at the end (and what the slow tests read back)."""
    return {"best_eval_return": solver.best, "last_eval_return": solver.last,
            "solved_at_frames": solver.solved_at_frames, "frames": frames, "seconds": round(seconds, 1),
            "eval_history": solver.history}
