"""Lightning callbacks: :class:`RolloutCallback` (base of callbacks receiving collection events),
:class:`EpisodeStatsLogger`, :class:`RolloutEvaluation`, the RL progress bars and :class:`EvalRound`.

Callbacks keep what collection events showed them and log it from ``on_train_batch_end``
(``on_validation_batch_end``), reduced across DDP ranks (same collectives, same order on every rank).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBarTheme
from lightning.pytorch.utilities import rank_zero_info
from tensordict import TensorDictBase

from .._checks import warn_user
from ..events import EpisodeEnd, TimeStep
from .video import VideoRecorder, VideoRecording, as_video_recording

__all__ = ["EpisodeStatsLogger", "EvalRound", "RolloutCallback", "RolloutEvaluation", "RolloutProgressBar",
           "RolloutRichProgressBar"]

StepAxis = Literal["frames", "batches"]


class EvalRound:
    """One evaluation round, already run: the batch ``validation_step`` / ``test_step`` receives. A plain object,
    which Lightning does not move to the device.

    Attributes:
        episodes: this rank's finished evaluation episodes, in request order.
        seconds: wall-clock seconds the round took on this rank.
        frames: frames this rank had collected when the round ran (restored from a checkpoint before any).
    """

    __slots__ = ("episodes", "seconds", "frames")

    def __init__(self, episodes: list[EpisodeEnd], *, seconds: float, frames: int) -> None:
        self.episodes, self.seconds, self.frames = episodes, seconds, frames

    @property
    def mean_reward(self) -> float:
        """Mean return of this rank's episodes (``nan`` when there are none)."""
        return sum(e.reward for e in self.episodes) / len(self.episodes) if self.episodes else math.nan

    def __repr__(self) -> str:
        return (f"EvalRound({len(self.episodes)} episodes, mean_reward={self.mean_reward:.2f}, "
                f"frames={self.frames}, seconds={self.seconds:.3f})")


class RolloutCallback(pl.Callback):
    """A Lightning callback that also receives collection events (every hook a no-op by default).

    Hooks run in the main thread, where Lightning forbids ``pl_module.log``: log in ``on_train_batch_end`` /
    ``on_validation_batch_end`` (``docs/lightning.rst``, "Callbacks are the event processor").
    """

    def on_rollout_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: TensorDictBase) -> None:
        """A batch was collected (before it is handed to ``training_step``)."""

    def on_rollout_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: TimeStep) -> None:
        """One training transition (only dispatched when overridden somewhere)."""

    def on_episode_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, episode: EpisodeEnd) -> None:
        """A training episode finished (terminated or truncated)."""

    def on_eval_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """An evaluation round is about to run its episodes (its envs exist; none was reset for it yet)."""

    def on_eval_episode_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, episode: EpisodeEnd) -> None:
        """An evaluation episode finished."""

    def on_eval_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, episodes: list[EpisodeEnd]) -> None:
        """An evaluation round finished; ``episodes`` are this rank's episodes of the round."""


def _reduce(trainer: pl.Trainer, values: Sequence[float], op: Literal["sum", "max"] = "sum") -> list[float]:
    """``values`` reduced with ``op`` over every DDP rank (one collective; every rank calls it alike)."""
    if trainer.world_size == 1:
        return [float(v) for v in values]
    packed = torch.tensor(values, dtype=torch.float64, device=trainer.strategy.root_device)
    return trainer.strategy.reduce(packed, reduce_op=op).tolist()


def _episode_metrics(trainer: pl.Trainer, p: str, episodes: Sequence[EpisodeEnd]) -> tuple[float, dict[str, float]]:
    """The number of every rank's ``episodes`` and their ``p/episode_reward`` (mean), ``_min``, ``_max`` and
    ``p/episode_length`` (no metric without episodes)."""
    rewards = [e.reward for e in episodes]
    reward_sum, length_sum, count = _reduce(trainer, [sum(rewards), sum(e.length for e in episodes), len(rewards)])
    low, high = _reduce(trainer, [-min(rewards, default=math.inf), max(rewards, default=-math.inf)], "max")
    if not count:
        return 0.0, {}
    return count, {f"{p}/episode_reward": reward_sum / count, f"{p}/episode_reward_min": -low,
                   f"{p}/episode_reward_max": high, f"{p}/episode_length": length_sum / count}


def _logger_step(trainer: pl.Trainer) -> int:
    """The step at which Lightning writes what ``self.log`` received in the current hooks."""
    return int(getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step))


def _check_step(step: str) -> None:
    if step not in ("frames", "batches"):
        raise ValueError(f"step must be 'frames' (total frames collected) or 'batches' (Lightning's step), "
                         f"got {step!r}")


class EpisodeStatsLogger(RolloutCallback):
    """Log collection statistics (``rollout/episode_reward`` ..., listed in ``docs/lightning.rst``, "Logging", and
    ``rollout/<key>`` of each one-element ``info_keys`` entry) after every training batch, reduced across ranks: in
    ``trainer.callback_metrics`` and written to every logger after every batch, whatever ``log_every_n_steps``.

    Args:
        prefix: metric name prefix.
        prog_bar: show the episode return, frames and fps in the progress bar.
        step: x-axis of every logger row: ``"frames"`` (all ranks' frames) or ``"batches"`` (Lightning's step).
        clock: monotonic time source in seconds for ``rollout/fps`` (tests pass a fake).

    Raises:
        ValueError: ``step`` is neither ``"frames"`` nor ``"batches"``.
        TypeError: at ``fit``, when the trainer's datamodule is not a ``RolloutDataModule``.
    """

    def __init__(self, *, prefix: str = "rollout", prog_bar: bool = True, step: StepAxis = "frames",
                 clock: Callable[[], float] = time.perf_counter) -> None:
        _check_step(step)
        self.prefix, self.prog_bar, self.step, self.clock = prefix, prog_bar, step, clock
        self._finished: list[EpisodeEnd] = []  # the episodes of this batch
        self._info_keys: list[Any] = []  # the DataModule's one-element info keys (same on every rank)
        self._episodes = 0
        self._collect_fps: list[float] = []  # this rank's last batch's (none when it took no time)
        self._lag: list[float] = []  # this rank's last batch's mean policy lag (none when no step was acted)
        self._start_time = self._start_frames = 0.0

    def on_episode_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, episode: EpisodeEnd) -> None:
        self._finished.append(episode)

    def on_rollout_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: TensorDictBase) -> None:
        dm = trainer.datamodule  # the RolloutDataModule dispatching this, its collector built
        seconds = dm.last_collect_seconds
        self._collect_fps = [batch.numel() / seconds] if seconds > 0 else []
        versions = batch["policy_version"]
        acted = versions[versions >= 0]
        self._lag = [float(dm.collector.policy_version - acted.double().mean())] if acted.numel() else []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not hasattr(trainer.datamodule, "last_collect_seconds"):
            raise TypeError(f"EpisodeStatsLogger logs what a RolloutDataModule collects, and fit got the datamodule "
                            f"{trainer.datamodule!r}: pass trainer.fit(model, datamodule=RolloutDataModule(...))")
        (self._start_frames,) = _reduce(trainer, [trainer.datamodule.frames])
        self._start_time = self.clock()
        specs = trainer.datamodule.collector.loop.env_keys.observation  # built by now (Lightning's setup_data)
        self._info_keys = [k for k in trainer.datamodule.info_keys if k in specs and math.prod(specs[k].shape) == 1]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        p = self.prefix
        count, metrics = _episode_metrics(trainer, p, self._finished)
        info_sums = [sum(float(np.asarray(e.info[k]).reshape(-1)[0]) for e in self._finished if k in e.info)
                     for k in self._info_keys]
        frames, collect_sum, collect_ranks, lag_sum, lag_ranks, *info_sums = _reduce(
            trainer, [trainer.datamodule.frames, sum(self._collect_fps), len(self._collect_fps), sum(self._lag),
                      len(self._lag), *info_sums])
        self._episodes += int(count)
        elapsed = self.clock() - self._start_time
        if count:
            for key, total in zip(self._info_keys, info_sums):
                metrics[f"{p}/{'/'.join(key) if isinstance(key, tuple) else key}"] = total / count
        metrics[f"{p}/episodes"] = float(self._episodes)
        metrics[f"{p}/frames"] = frames
        if elapsed > 0:
            metrics[f"{p}/fps"] = (frames - self._start_frames) / elapsed
        if collect_ranks:
            metrics[f"{p}/collect_fps"] = collect_sum / collect_ranks
        if lag_ranks:
            metrics[f"{p}/policy_lag"] = lag_sum / lag_ranks
        shown = {f"{p}/episode_reward", f"{p}/frames", f"{p}/fps"} if self.prog_bar else set()
        for name, value in metrics.items():
            pl_module.log(name, value, prog_bar=name in shown, on_step=True, on_epoch=False, batch_size=1, logger=False)
        if trainer.is_global_zero:  # to every logger now, whatever log_every_n_steps, flushed as Lightning does
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=int(frames) if self.step == "frames" else _logger_step(trainer))
                logger.save()
        self._finished.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"episodes": self._episodes}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._episodes = int(state_dict.get("episodes", 0))


class RolloutEvaluation(RolloutCallback):
    """Log each evaluation round that the DataModule runs as ``eval/...`` (``test/...``) metrics; record videos.

    Reduced across ranks, as epoch-level validation metrics (``ModelCheckpoint`` / ``EarlyStopping`` see them):
    ``eval/episode_reward`` (mean), ``_min``, ``_max``, ``eval/episode_length``, ``eval/seconds`` (mean over ranks).

    Args:
        prefix: metric name prefix of validation rounds.
        test_prefix: metric name prefix of ``Trainer.test`` rounds.
        prog_bar: show the mean evaluation return in the progress bar.
        step: x-axis of logger rows, ``"frames"`` or ``"batches"``, as :class:`EpisodeStatsLogger`'s.
        record_video: ``None`` (default): no video; an int ``N`` (one episode every ``N`` rounds) or a
            :class:`~lightning_rollout.lightning.VideoRecording`.

    Raises:
        ValueError: ``step`` is neither ``"frames"`` nor ``"batches"``; a bad ``record_video``.
        ImportError: ``record_video`` without the packages of the ``video`` extra.
        RuntimeError: at the next recorded round or the end of ``fit``, when writing a clip failed (chained).

    Attributes:
        last_round: the last :class:`EvalRound` logged (``None`` before the first).
        evaluations: rounds logged so far (checkpointed: a resumed run keeps its recording schedule).
        last_video: path of the last MP4 handed to the writer (``None`` before); written when ``fit`` returns.
    """

    def __init__(self, *, prefix: str = "eval", test_prefix: str = "test", prog_bar: bool = True,
                 step: StepAxis = "frames", record_video: int | VideoRecording | None = None) -> None:
        _check_step(step)
        self.prefix, self.test_prefix, self.prog_bar, self.step = prefix, test_prefix, prog_bar, step
        self.record_video = as_video_recording(record_video)
        self.video_recorder = VideoRecorder(self.record_video) if self.record_video is not None else None
        self.last_round: EvalRound | None = None
        self.evaluations = 0
        self.last_video: str | None = None
        self._video_dir: str | None = None
        self._recording = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.record_video is not None:
            # trainer.log_dir is a collective (every rank must ask): resolved once, here
            self._video_dir = self.record_video.dirpath or os.path.join(
                trainer.log_dir or trainer.default_root_dir, "videos")

    def on_eval_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._recording = (self.video_recorder is not None and trainer.is_global_zero
                           and self.evaluations % self.record_video.every_n_evals == 0)
        if self._recording:
            self.video_recorder.arm()

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                                batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if isinstance(batch, EvalRound) and not trainer.sanity_checking:
            self._log_round(trainer, pl_module, batch, self.prefix)

    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                          batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if isinstance(batch, EvalRound):
            self._log_round(trainer, pl_module, batch, self.test_prefix)

    def _log_round(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: EvalRound, p: str) -> None:
        """Reduce one round across ranks and log it under ``p/...`` (epoch-level, written at the round's end)."""
        self.last_round = batch
        self.evaluations += 1
        count, metrics = _episode_metrics(trainer, p, batch.episodes)
        frames, seconds = _reduce(trainer, [batch.frames, batch.seconds])
        if self._recording:
            self._recording = False
            self._write_video(trainer, int(frames) if self.step == "frames" else _logger_step(trainer), p)
        if not count:
            return
        metrics[f"{p}/seconds"] = seconds / trainer.world_size
        for name, value in metrics.items():  # the same value on every rank: sync_dist only averages equals
            pl_module.log(name, value, prog_bar=self.prog_bar and name == f"{p}/episode_reward", on_step=False,
                          on_epoch=True, batch_size=1, sync_dist=trainer.world_size > 1)

    def _write_video(self, trainer: pl.Trainer, step: int, prefix: str) -> None:
        assert self.video_recorder is not None and self.record_video is not None and self._video_dir is not None
        if (frames := self.video_recorder.take()) is None:
            return
        mp4_path = (os.path.join(self._video_dir, f"{prefix}-{self.step}-{step:010d}.mp4")
                    if self.record_video.mp4 else None)
        writers = _summary_writers(trainer) if self.record_video.tensorboard else []
        self.video_recorder.write(frames, mp4_path=mp4_path, summary_writers=writers, tag=f"{prefix}/video", step=step)
        self.last_video = mp4_path

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.video_recorder is not None:
            self.video_recorder.wait()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.video_recorder is not None:
            self.video_recorder.wait(raise_errors=False)

    def state_dict(self) -> dict[str, Any]:
        return {"evaluations": self.evaluations}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.evaluations = int(state_dict.get("evaluations", 0))


def _summary_writers(trainer: pl.Trainer) -> list[Any]:
    """The ``torch.utils.tensorboard.SummaryWriter`` of every TensorBoard logger of the trainer (warns about others)."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from torch.utils.tensorboard import SummaryWriter

    experiments = [logger.experiment for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]
    for other in {type(e).__name__ for e in experiments if not isinstance(e, SummaryWriter)}:
        warn_user(f"record_video: the TensorBoard logger writes with {other}, not torch.utils.tensorboard."
                  "SummaryWriter; its video summary is skipped (the MP4 is written)", RuntimeWarning)
    return [e for e in experiments if isinstance(e, SummaryWriter)]


class _RLFigures:
    """What both RL progress bars show: the figures of :class:`EpisodeStatsLogger` and :class:`RolloutEvaluation`."""

    rollout_prefix = "rollout"
    eval_prefix = "eval"

    def shown(self, metrics: Mapping[str, Any]) -> dict[str, int | str | float]:
        """What the bar shows for these progress-bar metrics: ``frames`` and ``fps`` whole, ``ret`` and ``eval``
        with one decimal below 10^4, as strings (TQDM would write ``1.23e+7``), then every other metric unchanged;
        missing or non-finite figures left out."""
        items = dict(metrics)
        r, e = self.rollout_prefix, self.eval_prefix
        shown: dict[str, int | str | float] = {}
        for key, name, whole in ((f"{r}/frames", "frames", True), (f"{r}/fps", "fps", True),
                                 (f"{r}/episode_reward", "ret", False), (f"{e}/episode_reward", "eval", False)):
            value = items.pop(key, None)
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, (int, float)) and math.isfinite(value):
                shown[name] = f"{value:.{0 if whole or abs(value) >= 1e4 else 1}f}"
        shown.update(items)
        return shown

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, int | str | float]:
        """The Lightning bar's metrics as :meth:`shown`, without ``v_num``."""
        items = dict(super().get_metrics(trainer, pl_module))  # type: ignore[misc]
        items.pop("v_num", None)
        return self.shown(items)


class RolloutProgressBar(_RLFigures, TQDMProgressBar):
    """Lightning's TQDM bar showing RL figures in 80 columns (``docs/lightning.rst``, "Progress bar"):
    ``Epoch 0:  45%|████     | 05:12, frames=461824, fps=7123, ret=123.4, eval=500.0``.

    Args:
        refresh_rate, process_position, leave: as ``TQDMProgressBar``.
        rollout_prefix, eval_prefix: prefixes of the metrics to show.
    """

    BAR_FORMAT = "{l_bar}{bar}| {elapsed}{postfix}"

    def __init__(self, *, refresh_rate: int = 1, process_position: int = 0, leave: bool = False,
                 rollout_prefix: str = "rollout", eval_prefix: str = "eval") -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)
        self.rollout_prefix, self.eval_prefix = rollout_prefix, eval_prefix


class RolloutRichProgressBar(_RLFigures, RichProgressBar):
    """Lightning's Rich bar showing the figures of :class:`RolloutProgressBar` on one line of 100 columns:
    ``Epoch 0/0  ━━━━━━━━         45% 0:05:12 frames: 461824 fps: 7123 ret: 123.4 eval: 500.0``.

    Args:
        refresh_rate, leave, theme, console_kwargs: as ``RichProgressBar``.
        rollout_prefix, eval_prefix: prefixes of the metrics to show.

    Raises:
        ModuleNotFoundError: ``rich`` is not installed (from ``RichProgressBar``).
    """

    BAR_WIDTH = 16

    def __init__(self, *, refresh_rate: int = 100, leave: bool = False,
                 theme: RichProgressBarTheme | None = None, console_kwargs: dict[str, Any] | None = None,
                 rollout_prefix: str = "rollout", eval_prefix: str = "eval") -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave, theme=theme or RichProgressBarTheme(),
                         console_kwargs=console_kwargs)
        self.rollout_prefix, self.eval_prefix = rollout_prefix, eval_prefix

    _rerouted: list[tuple[logging.StreamHandler, Any]] = []  # (handler, its own stream) while the bar is live

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start the bar; until teardown, log lines written to its terminal go above it, through its console."""
        super().on_train_start(trainer, pl_module)
        if self.progress is None or self._rerouted:
            return
        from rich.file_proxy import FileProxy

        console = self.progress.console
        terminal = {id(sys.__stdout__), id(sys.__stderr__), id(console.file)}
        loggers = [logging.root, *logging.Logger.manager.loggerDict.values()]  # (placeholders among them)
        self._rerouted = [(h, h.setStream(FileProxy(console, h.stream))) for log in loggers
                          for h in getattr(log, "handlers", ()) if type(h) is logging.StreamHandler
                          and id(h.stream) in terminal]

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Draw the round just logged now (the bar left on screen shows the last evaluation)."""
        super().on_validation_end(trainer, pl_module)
        self.refresh(hard=True)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        for handler, stream in self._rerouted:
            handler.setStream(stream)
        self._rerouted = []

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")

    def configure_columns(self, trainer: pl.Trainer) -> list:
        """Description, a narrow bar, the share of the epoch done and the elapsed time (then Lightning's metrics)."""
        from lightning.pytorch.callbacks.progress.rich_progress import CustomBarColumn
        from rich.progress import TextColumn, TimeElapsedColumn

        return [
            TextColumn("[progress.description]{task.description}"),
            CustomBarColumn(bar_width=self.BAR_WIDTH, complete_style=self.theme.progress_bar,
                            finished_style=self.theme.progress_bar_finished, pulse_style=self.theme.progress_bar_pulse),
            TextColumn("{task.percentage:>3.0f}%", style=self.theme.batch_progress),
            TimeElapsedColumn(),
        ]


class _FitEnd(pl.Callback):
    """Added by the DataModule, run before the checkpoint callbacks: when ``fit`` ends, logs what stopped it
    (INFO) and saves every stale ``last.ckpt`` (``docs/lightning.rst``, "Checkpoints and resume")."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.fast_dev_run:
            return
        if reason := _stop_reason(trainer):
            rank_zero_info(reason)
        stale = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.save_last
                 and getattr(c, "_last_global_step_saved", trainer.global_step) != trainer.global_step]
        if not stale:
            return
        progress = trainer.fit_loop.epoch_progress
        cut = not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch  # Lightning counted the epoch done
        counts = (progress.current, progress.total) if cut else ()
        for count in counts:
            count.processed, count.completed = count.processed - 1, count.completed - 1
        try:
            for checkpoint in stale:
                _save_last(trainer, checkpoint)
        finally:
            for count in counts:
                count.processed, count.completed = count.processed + 1, count.completed + 1


def _save_last(trainer: pl.Trainer, checkpoint: ModelCheckpoint) -> None:
    """Save ``checkpoint``'s last checkpoint now (a file, where ``save_last="link"`` would link an older one);
    Lightning 2.6 has no public way, its private one names, versions and removes the previous ``last``."""
    candidates = {**trainer.callback_metrics, "epoch": torch.tensor(trainer.current_epoch),
                  "step": torch.tensor(trainer.global_step)}
    if checkpoint.save_last != "link":
        checkpoint._save_last_checkpoint(trainer, candidates)
        return
    path = checkpoint.format_checkpoint_name(candidates, checkpoint.CHECKPOINT_NAME_LAST)
    if trainer.is_global_zero and os.path.islink(path):
        os.remove(path)  # a link to an older checkpoint: the file is written in its place
    trainer.strategy.barrier()
    checkpoint.last_model_path = path
    trainer.save_checkpoint(path, weights_only=checkpoint.save_weights_only)


def _stop_reason(trainer: pl.Trainer) -> str | None:
    """What ended ``fit``, in the unit of the limit reached (``None``: no RolloutDataModule, or nothing known)."""
    dm = trainer.datamodule
    if not hasattr(dm, "frames_per_batch"):
        return None
    frames, step, epochs = dm.frames, trainer.global_step, trainer.max_epochs
    batches = frames // dm.frames_per_batch
    per_batch = f", {step / batches:g} a batch here" if batches and step != batches else ""
    reason = next((text for reached, text in (
        (0 < dm.total_frames <= frames, f"RolloutDataModule(total_frames={dm.total_frames}) reached (frames per rank)"),
        (-1 < trainer.max_steps <= step, f"Trainer(max_steps={trainer.max_steps}) reached; it counts optimizer steps"
                                         f"{per_batch} (RolloutDataModule(total_frames=...) counts frames per rank)"),
        (trainer.should_stop, "trainer.should_stop was set (by EarlyStopping, Trainer(max_time=...) or a callback)"),
        (epochs not in (None, -1) and trainer.current_epoch >= epochs,
         f"Trainer(max_epochs={epochs}) reached (an epoch is {trainer.num_training_batches} batches)"),
    ) if reached), None)
    return reason and (f"Training stopped after {batches} batch{'es' * (batches != 1)} ({frames} frames per rank, "
                       f"global_step={step}): {reason}")
