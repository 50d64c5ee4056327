"""PyTorch Lightning integration: the only part of lightning_rollout that imports Lightning.

* :class:`RolloutDataModule`: ``Trainer.fit(model, datamodule=RolloutDataModule(...))``; its validation loop
  (and ``Trainer.validate`` / ``Trainer.test``) runs evaluation episodes (:class:`EvalRound`).
* :class:`RolloutCallback`: base class of callbacks receiving collection events.
* :class:`EpisodeStatsLogger`, :class:`RolloutEvaluation`, :class:`RolloutProgressBar`,
  :class:`RolloutRichProgressBar`: built-in callbacks (metrics against frames, ``eval/...`` metrics, RL bars).
* :class:`VideoRecording`: what ``RolloutEvaluation(record_video=...)`` records (to TensorBoard and MP4).
"""

from .callbacks import (
    EpisodeStatsLogger,
    EvalRound,
    RolloutCallback,
    RolloutEvaluation,
    RolloutProgressBar,
    RolloutRichProgressBar,
)
from .datamodule import RolloutDataModule
from .video import VideoRecording

__all__ = ["EpisodeStatsLogger", "EvalRound", "RolloutCallback", "RolloutDataModule", "RolloutEvaluation",
           "RolloutProgressBar", "RolloutRichProgressBar", "VideoRecording"]
