"""PyTorch Lightning integration, the only part of lightning_rollout that imports Lightning:
:class:`RolloutDataModule` (``Trainer.fit(model, datamodule=RolloutDataModule(...))``), the callbacks receiving
collection events (:class:`RolloutCallback`) and the built-in ones. ``docs/lightning.rst`` is the guide.
"""

from .callbacks import (EpisodeStatsLogger, EvalRound, RolloutCallback, RolloutEvaluation, RolloutProgressBar,
                        RolloutRichProgressBar)
from .datamodule import RolloutDataModule
from .video import VideoRecording

__all__ = ["EpisodeStatsLogger", "EvalRound", "RolloutCallback", "RolloutDataModule", "RolloutEvaluation",
           "RolloutProgressBar", "RolloutRichProgressBar", "VideoRecording"]
