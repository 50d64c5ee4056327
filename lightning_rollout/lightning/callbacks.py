"""Lightning callbacks that play the seed's event processor.

* :class:`RolloutCallback` is the base class: subclass it and override the
  ``on_rollout_*`` / ``on_episode_end`` / ``on_eval_*`` hooks; put it in
  ``Trainer(callbacks=[...])``. :class:`~lightning_rollout.lightning.RolloutDataModule`
  dispatches the collector's events to every such callback.
* :class:`EpisodeStatsLogger` logs episode return/length, frames, throughput and
  policy lag to ``trainer.logger`` (TensorBoard by default) and the progress bar.
* :class:`RolloutEvaluation` runs fresh deterministic episodes every N training
  steps and logs ``eval/...`` (so ``ModelCheckpoint(monitor="eval/episode_reward")``
  and ``EarlyStopping`` work).

When hooks run: collection events are dispatched in the training process's main
thread while the DataModule fetches a batch, i.e. *before* ``training_step`` of
that batch, where Lightning forbids ``self.log``. So callbacks that log keep
what they saw and log it from ``on_train_batch_end``, where logging is allowed.
Values are reduced across DDP ranks there (every rank calls the same
collectives in the same order each step), so logged metrics are global.

Metrics that exist only at some steps (episode returns: only when an episode
ended; evaluation: every N steps) are not sent to the logger through
``self.log``: Lightning would write their last value again at every later step
of the epoch. They go to ``self.log(..., logger=False)`` (``callback_metrics``,
so ``ModelCheckpoint`` / ``EarlyStopping`` see them, and the progress bar) and
straight to ``trainer.loggers`` at the step Lightning uses for that training step.
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
import torch
from tensordict import TensorDictBase

from ..events import EpisodeEnd, TimeStep

__all__ = ["EpisodeStatsLogger", "RolloutCallback", "RolloutEvaluation"]


class RolloutCallback(pl.Callback):
    """A Lightning callback that also receives collection events.

    Every hook is a no-op by default. ``on_rollout_step`` is dispatched only if
    some callback in ``trainer.callbacks`` overrides it, so per-step events cost
    nothing otherwise. Hooks run in the main thread, before ``training_step`` of
    the batch being collected: do not call ``pl_module.log`` from them (keep the
    values and log in ``on_train_batch_end``).
    """

    def on_rollout_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: TensorDictBase) -> None:
        """A batch was collected (before it is handed to ``training_step``)."""

    def on_rollout_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: TimeStep) -> None:
        """One training transition (only dispatched when overridden somewhere)."""

    def on_episode_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, episode: EpisodeEnd) -> None:
        """A training episode finished (terminated or truncated)."""

    def on_eval_episode_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, episode: EpisodeEnd) -> None:
        """An evaluation episode finished."""

    def on_eval_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, episodes: list[EpisodeEnd]) -> None:
        """An evaluation round finished; ``episodes`` are this rank's episodes of the round."""


def overrides(callback: RolloutCallback, hook: str) -> bool:
    """True when ``callback``'s class overrides ``hook`` of :class:`RolloutCallback`."""
    return getattr(type(callback), hook) is not getattr(RolloutCallback, hook)


def _global_stats(trainer: pl.Trainer, values: list[float]) -> dict[str, float]:
    """Sum, count, min and max of ``values`` over every DDP rank (one collective each)."""
    device = trainer.strategy.root_device
    n = float(len(values))
    packed = torch.tensor([sum(values), n, -min(values, default=math.inf), max(values, default=-math.inf)],
                          dtype=torch.float64, device=device)
    sums = trainer.strategy.reduce(packed[:2].clone(), reduce_op="sum")
    extremes = packed[2:].clone()
    if trainer.world_size > 1:
        torch.distributed.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX)
    return {"sum": float(sums[0]), "count": float(sums[1]), "min": -float(extremes[0]), "max": float(extremes[1])}


def _logger_step(trainer: pl.Trainer) -> int:
    """The step at which Lightning writes what ``self.log`` received in this training step's hooks."""
    return int(getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step))


def _write_to_loggers(trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
    """Write ``metrics`` once to every logger of the trainer, at ``step`` (global rank zero only)."""
    if not metrics or not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
        logger.save()


class EpisodeStatsLogger(RolloutCallback):
    """Log collection statistics at each training step's ``global_step``.

    Metrics (``prefix`` defaults to ``"rollout"``), reduced across ranks:

    * ``rollout/episode_reward`` (mean), ``_max``, ``_min`` and ``rollout/episode_length``:
      in ``callback_metrics`` and the progress bar, over the episodes finished since the
      previous training step (updated only at steps where some episode finished); in
      the logger, over the episodes finished since the previous write (at the steps
      ``log_every_n_steps`` selects, and only if some episode finished), so no episode
      is left out of the curves and no value is written twice;
    * ``rollout/episodes`` and ``rollout/frames``: totals since the start;
    * ``rollout/fps``: frames per second of collection for the last batch;
    * ``rollout/policy_lag``: mean number of weight updates between the policy
      that acted a transition and the current one (0 when on-policy).

    Args:
        prefix: metric name prefix.
        prog_bar: show episode return and frames in the progress bar.
    """

    def __init__(self, *, prefix: str = "rollout", prog_bar: bool = True) -> None:
        self.prefix = prefix
        self.prog_bar = prog_bar
        self._rewards: list[float] = []
        self._lengths: list[float] = []
        self._episodes = 0
        self._batch_frames = 0
        self._batch_seconds = 0.0
        self._lag: float | None = None
        self._unwritten: dict[str, float] = self._no_episodes()

    @staticmethod
    def _no_episodes() -> dict[str, float]:
        return {"sum": 0.0, "count": 0.0, "min": math.inf, "max": -math.inf, "length_sum": 0.0}

    def on_episode_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, episode: EpisodeEnd) -> None:
        self._rewards.append(episode.reward)
        self._lengths.append(float(episode.length))

    def on_rollout_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: TensorDictBase) -> None:
        dm = trainer.datamodule
        self._batch_frames = batch.numel()
        self._batch_seconds = getattr(dm, "last_collect_seconds", 0.0)
        versions = batch.get("policy_version", None)
        if versions is not None and dm is not None and getattr(dm, "collector", None) is not None:
            acted = versions[versions >= 0]
            current = dm.collector.policy_version
            self._lag = float(current - acted.double().mean()) if acted.numel() else None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        p = self.prefix
        rewards = _global_stats(trainer, self._rewards)
        lengths = _global_stats(trainer, self._lengths)
        fps = _global_stats(trainer, [self._batch_frames / self._batch_seconds] if self._batch_seconds > 0 else [])
        dm = trainer.datamodule
        local_frames = float(getattr(getattr(dm, "collector", None), "frames", 0))
        frames = _global_stats(trainer, [local_frames])
        self._episodes += int(rewards["count"])
        log = dict(on_step=True, on_epoch=False, batch_size=1)
        if rewards["count"]:
            only_callbacks = dict(log, logger=False)  # written to the logger below, once
            pl_module.log(f"{p}/episode_reward", rewards["sum"] / rewards["count"], prog_bar=self.prog_bar,
                          **only_callbacks)
            pl_module.log(f"{p}/episode_reward_max", rewards["max"], **only_callbacks)
            pl_module.log(f"{p}/episode_reward_min", rewards["min"], **only_callbacks)
            pl_module.log(f"{p}/episode_length", lengths["sum"] / lengths["count"], **only_callbacks)
            u = self._unwritten
            u["sum"] += rewards["sum"]
            u["count"] += rewards["count"]
            u["min"] = min(u["min"], rewards["min"])
            u["max"] = max(u["max"], rewards["max"])
            u["length_sum"] += lengths["sum"]
        step = _logger_step(trainer)
        if self._unwritten["count"] and ((step + 1) % trainer.log_every_n_steps == 0 or trainer.should_stop):
            u = self._unwritten  # same rule as Lightning's for what self.log sends to the logger
            _write_to_loggers(trainer, {f"{p}/episode_reward": u["sum"] / u["count"],
                                        f"{p}/episode_reward_max": u["max"], f"{p}/episode_reward_min": u["min"],
                                        f"{p}/episode_length": u["length_sum"] / u["count"]}, step)
            self._unwritten = self._no_episodes()
        pl_module.log(f"{p}/episodes", float(self._episodes), **log)
        pl_module.log(f"{p}/frames", frames["sum"], prog_bar=self.prog_bar, **log)
        if fps["count"]:
            pl_module.log(f"{p}/fps", fps["sum"], **log)
        if self._lag is not None:
            pl_module.log(f"{p}/policy_lag", self._lag, **log)
        self._rewards.clear()
        self._lengths.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"episodes": self._episodes}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._episodes = int(state_dict.get("episodes", 0))


class RolloutEvaluation(RolloutCallback):
    """Every ``every_n_steps`` training steps, run fresh deterministic episodes and log ``eval/...``.

    Episodes run on a separate evaluation loop owned by the
    :class:`~lightning_rollout.lightning.RolloutDataModule` (reset on request,
    ``ExplorationType.DETERMINISTIC``, capped at ``max_episode_steps``), with the
    module's current weights. Logged, reduced across ranks: ``eval/episode_reward``
    (mean), ``eval/episode_reward_min``, ``eval/episode_reward_max``,
    ``eval/episode_length``, ``eval/seconds``. ``on_eval_episode_end`` and
    ``on_eval_end`` are dispatched to every :class:`RolloutCallback`.

    Args:
        every_n_steps: evaluate when ``trainer.global_step`` reaches a multiple of it (``>= 1``).
        episodes: episodes per evaluation on each rank (``>= 1``).
        at_train_end: also evaluate when training ends.
        prefix: metric name prefix.

    Raises:
        ValueError: ``every_n_steps`` or ``episodes`` below 1.
    """

    def __init__(self, *, every_n_steps: int, episodes: int = 5, at_train_end: bool = True,
                 prefix: str = "eval") -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if episodes < 1:
            raise ValueError(f"episodes must be >= 1, got {episodes}")
        self.every_n_steps = every_n_steps
        self.episodes = episodes
        self.at_train_end = at_train_end
        self.prefix = prefix
        self._last_step = -1
        self.last_results: list[EpisodeEnd] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step > 0 and step % self.every_n_steps == 0 and step != self._last_step:
            self.evaluate(trainer, pl_module, log=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.at_train_end and trainer.global_step != self._last_step and trainer.global_step > 0:
            self.evaluate(trainer, pl_module, log=False)

    def evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *, log: bool = True) -> list[EpisodeEnd]:
        """Run one evaluation round now; returns this rank's episodes.

        Args:
            log: called from a hook where ``self.log`` is allowed (``on_train_batch_end``):
                the metrics also go to ``callback_metrics`` and the progress bar. Otherwise
                (``on_train_end``) they are only written to the loggers, at the last training
                step. Every rank must call this together (the metrics are reduced across ranks).

        Raises:
            RuntimeError: the trainer's datamodule is not a ``RolloutDataModule``.
        """
        dm = trainer.datamodule
        if dm is None or not hasattr(dm, "run_eval_episodes"):
            raise RuntimeError("RolloutEvaluation needs Trainer.fit(..., datamodule=RolloutDataModule(...))")
        self._last_step = trainer.global_step
        was_training = pl_module.training
        pl_module.eval()
        start = time.perf_counter()
        try:
            episodes = dm.run_eval_episodes(self.episodes)
        finally:
            pl_module.train(was_training)
        seconds = time.perf_counter() - start
        self.last_results = episodes
        rewards = _global_stats(trainer, [e.reward for e in episodes])
        lengths = _global_stats(trainer, [float(e.length) for e in episodes])
        for callback in trainer.callbacks:
            if isinstance(callback, RolloutCallback):
                callback.on_eval_end(trainer, pl_module, episodes)
        if rewards["count"]:
            p = self.prefix
            metrics = {f"{p}/episode_reward": rewards["sum"] / rewards["count"],
                       f"{p}/episode_reward_min": rewards["min"], f"{p}/episode_reward_max": rewards["max"],
                       f"{p}/episode_length": lengths["sum"] / lengths["count"], f"{p}/seconds": seconds}
            if log:  # callback_metrics (ModelCheckpoint, EarlyStopping) and progress bar; not the logger (see module)
                kw = dict(on_step=True, on_epoch=False, batch_size=1, logger=False)
                for name, value in metrics.items():
                    pl_module.log(name, value, prog_bar=name == f"{p}/episode_reward", **kw)
                _write_to_loggers(trainer, metrics, _logger_step(trainer))
            else:
                # on_train_end does not allow self.log; Lightning's step counter has moved past the last
                # training step there, so write at that training step's logger step
                _write_to_loggers(trainer, metrics, max(_logger_step(trainer) - 1, 0))
        return episodes
