"""PyTorch Lightning integration: the only part of lightning_rollout that imports Lightning.

* :class:`RolloutDataModule`: ``Trainer.fit(model, datamodule=RolloutDataModule(...))``;
  its validation loop runs evaluation episodes (:class:`EvalRound`).
* :class:`RolloutCallback`: base class of callbacks receiving collection events.
* :class:`EpisodeStatsLogger`, :class:`RolloutEvaluation`, :class:`RolloutProgressBar`:
  built-in callbacks (metrics against frames, ``eval/...`` metrics, RL progress bar).
"""

from .callbacks import EpisodeStatsLogger, EvalRound, RolloutCallback, RolloutEvaluation, RolloutProgressBar
from .datamodule import RolloutDataModule

__all__ = ["EpisodeStatsLogger", "EvalRound", "RolloutCallback", "RolloutDataModule", "RolloutEvaluation",
           "RolloutProgressBar"]
