"""PyTorch Lightning integration: the only part of lightning_rollout that imports Lightning.

* :class:`RolloutDataModule`: ``Trainer.fit(model, datamodule=RolloutDataModule(...))``;
  its validation loop runs evaluation episodes (:class:`EvalRound`).
* :class:`RolloutCallback`: base class of callbacks receiving collection events.
* :class:`EpisodeStatsLogger`, :class:`RolloutEvaluation`, :class:`RolloutProgressBar`:
  built-in callbacks (metrics against frames, ``eval/...`` metrics, RL progress bar).
* :class:`VideoRecording`: what ``RolloutEvaluation(record_video=...)`` records (video of
  evaluation episodes, to TensorBoard and MP4 files).
"""

from .callbacks import EpisodeStatsLogger, EvalRound, RolloutCallback, RolloutEvaluation, RolloutProgressBar
from .datamodule import RolloutDataModule
from .video import VideoRecording

__all__ = ["EpisodeStatsLogger", "EvalRound", "RolloutCallback", "RolloutDataModule", "RolloutEvaluation",
           "RolloutProgressBar", "VideoRecording"]
