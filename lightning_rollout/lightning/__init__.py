"""PyTorch Lightning integration: the only part of lightning_rollout that imports Lightning.

* :class:`RolloutDataModule`: ``Trainer.fit(model, datamodule=RolloutDataModule(...))``.
* :class:`RolloutCallback`: base class of callbacks receiving collection events.
* :class:`EpisodeStatsLogger`, :class:`RolloutEvaluation`: built-in callbacks.
"""

from .callbacks import EpisodeStatsLogger, RolloutCallback, RolloutEvaluation
from .datamodule import RolloutDataModule

__all__ = ["EpisodeStatsLogger", "RolloutCallback", "RolloutDataModule", "RolloutEvaluation"]
