"""lightning_rollout: threaded, autobatched RL data collection for PyTorch Lightning and TorchRL.

Layers (lower ones never import upper ones, and none but ``lightning_rollout.lightning``
imports Lightning): :mod:`~lightning_rollout.policy`, :mod:`~lightning_rollout.envs`,
:mod:`~lightning_rollout.events`, :mod:`~lightning_rollout.loop`,
:mod:`~lightning_rollout.collector`, :mod:`~lightning_rollout.lightning`.
"""

from .collector import ThreadedCollector
from .envs import GymUnit, TorchRLUnit, Unit
from .specs import ArraySpec
from .errors import CollectionError, EnvError, LayoutWarning, PolicyError, StepTimeoutError
from .events import EpisodeEnd, EventProcessor, Interrupter, Progress, TimeStep
from .loop import EnvLoop, MultiEnvLoop
from .policy import Agent, AutobatchPolicy, PolicyAnswer

_LIGHTNING_NAMES = ("EpisodeStatsLogger", "EvalRound", "RolloutCallback", "RolloutDataModule", "RolloutEvaluation",
                    "RolloutProgressBar", "RolloutRichProgressBar", "VideoRecording")


def __getattr__(name: str) -> object:
    # The Lightning layer is imported on first use, so TorchRL-only users never pay for importing Lightning.
    if name in _LIGHTNING_NAMES:
        from . import lightning

        return getattr(lightning, name)
    raise AttributeError(f"module 'lightning_rollout' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = ["Agent", "ArraySpec", "AutobatchPolicy", "CollectionError", "EnvError", "EnvLoop", "EpisodeEnd",
           "EpisodeStatsLogger", "EvalRound", "EventProcessor", "GymUnit", "Interrupter", "LayoutWarning",
           "MultiEnvLoop", "PolicyAnswer", "PolicyError", "Progress", "RolloutCallback", "RolloutDataModule",
           "RolloutEvaluation", "RolloutProgressBar", "RolloutRichProgressBar", "StepTimeoutError", "ThreadedCollector",
           "TimeStep", "TorchRLUnit", "Unit", "VideoRecording"]
