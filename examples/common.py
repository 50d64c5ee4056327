"""Helpers shared by the examples: the run summary and the learning-curve plot, read from TensorBoard; the
command line and the Trainer of the MuJoCo examples.

Kept apart so each example reads top to bottom as one algorithm (CleanRL style).
``EpisodeStatsLogger`` and ``RolloutEvaluation`` write their scalars against frames
(their default ``step="frames"``), so every curve here is already indexed by frames.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any


def env_dims(env_id: str) -> tuple[int, int]:
    """Observation and action sizes of a gymnasium env with flat ``Box`` spaces (e.g. MuJoCo's)."""
    import gymnasium as gym

    probe = gym.make(env_id)
    dims = probe.observation_space.shape[0], probe.action_space.shape[0]
    probe.close()
    return dims


def config_from_args(config_cls: type, names: Sequence[str], *, argv: list[str] | None = None,
                     description: str | None = None) -> Any:
    """``config_cls`` (a dataclass) with the fields ``names`` read from the command line as ``--field-name``
    options (their defaults: the class's), and ``target_return`` as ``--target-return``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in names:
        default = getattr(config_cls, name)
        kind = _parse_bool if isinstance(default, bool) else type(default)
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=default)
    parser.add_argument("--target-return", type=float, default=None,
                        help="stop at the first evaluation above this return (default: run every frame)")
    return config_cls(**vars(parser.parse_args(argv)))


def _parse_bool(text: str) -> bool:
    """``--flag true`` / ``--flag false`` (and 1/0, yes/no): ``bool("false")`` would be ``True``."""
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def make_trainer(cfg: Any, *, name: str, callbacks: Sequence[Any] = ()) -> Any:
    """The MuJoCo examples' Trainer: one epoch over the DataModule's batches, TensorBoard logs under
    ``cfg.out/name/seed<seed>`` (every training step), no checkpoints, a progress bar on a terminal, and a stop
    at the first evaluation above ``cfg.target_return`` when it is set."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    callbacks = list(callbacks)
    if cfg.target_return is not None:
        callbacks.append(stop_at_bar(cfg.target_return, frames=cfg.frames, eval_every_frames=cfg.eval_every_frames))
    return pl.Trainer(max_epochs=1, logger=TensorBoardLogger(cfg.out, name=name, version=f"seed{cfg.seed}"),
                      callbacks=callbacks, log_every_n_steps=1, enable_model_summary=False,
                      enable_checkpointing=False, enable_progress_bar=sys.stderr.isatty(), accelerator="cpu")


def read_scalars(log_dir: str, *, since: float | None = None) -> dict[str, list[tuple[int, float]]]:
    """All scalars of the TensorBoard event files under ``log_dir``: ``{tag: [(step, value), ...]}``.

    ``since`` (a ``time.time()``): only files written to since then, i.e. this run's, not those an
    earlier run of the same example left in the same folder.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True)):
        if since is not None and os.path.getmtime(path) < since:
            continue
        acc = EventAccumulator(path)
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return scalars


def plot_learning_curve(log_dir: str, png_path: str, *, title: str, since: float | None = None) -> str:
    """Plot training and evaluation episode return against frames (the run's since ``since``, see
    :func:`read_scalars`); returns ``png_path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scalars = read_scalars(log_dir, since=since)
    fig, ax = plt.subplots(figsize=(7, 4))
    for tag, label, style in (("rollout/episode_reward", "training episodes", "-"),
                              ("eval/episode_reward", "evaluation (deterministic)", "o-")):
        points = scalars.get(tag, [])
        if points:
            ax.plot([f for f, _ in points], [v for _, v in points], style, label=label, alpha=0.8)
    ax.set_xlabel("frames")
    ax.set_ylabel("episode return")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def summary(log_dir: str, *, seconds: float, frames: int, target: float | None,
            since: float | None = None) -> dict[str, Any]:
    """What an example prints at the end (and what the slow tests read back), from the evaluation curve.

    ``eval_history`` is ``[(frames, mean evaluation return), ...]``; ``solved_at_frames`` the
    frames of the first evaluation at or above ``target`` (``None`` if none, or no target). ``since``: as in
    :func:`read_scalars`.
    """
    history = [(int(f), float(v)) for f, v in read_scalars(log_dir, since=since).get("eval/episode_reward", [])]
    returns = [v for _, v in history]
    return {"best_eval_return": max(returns, default=float("nan")),
            "last_eval_return": returns[-1] if returns else float("nan"),
            "solved_at_frames": next((f for f, v in history if target is not None and v >= target), None),
            "frames": frames, "seconds": round(seconds, 1), "eval_history": history}


def stop_at_bar(target: float, *, frames: int, eval_every_frames: int) -> Any:
    """Lightning's ``EarlyStopping`` on ``eval/episode_reward``: stops at the first evaluation strictly above
    ``target``, never on a plateau (its patience outlasts the run's evaluations)."""
    from lightning.pytorch.callbacks import EarlyStopping

    return EarlyStopping(monitor="eval/episode_reward", mode="max", stopping_threshold=target,
                         patience=frames // eval_every_frames + 1)


def fit_and_summarize(trainer: Any, model: Any, datamodule: Any, *, target: float | None) -> dict[str, Any]:
    """``trainer.fit(model, datamodule=datamodule)``, timed; then :func:`summary` of this run's logs (not an
    earlier run's in the same folder), with ``log_dir`` and ``started_at`` (its ``time.time()``)."""
    started_at = time.time()
    start = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    result = summary(trainer.logger.log_dir, seconds=time.perf_counter() - start,
                     frames=datamodule.collector.frames, target=target, since=started_at)
    result["log_dir"] = trainer.logger.log_dir
    result["started_at"] = started_at
    return result


def print_summary(result: dict[str, Any], *, out: str) -> None:
    """What an example prints at the end: the ``RESULT {json}`` line (which the tests read back), the final and
    best evaluation returns, and the TensorBoard command for ``out``."""
    print("RESULT " + json.dumps(result))
    print(f"final eval return: {result['last_eval_return']:.1f} (best {result['best_eval_return']:.1f}) "
          f"after {result['frames']} frames in {result['seconds']} s")
    print(f"TensorBoard: tensorboard --logdir {out}")
