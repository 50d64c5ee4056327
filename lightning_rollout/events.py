"""Collection events (:class:`TimeStep`, :class:`EpisodeEnd`), the :class:`EventProcessor` that receives them, and
the :class:`Interrupter` stop flag. Evaluation loops emit the same types with ``eval=True`` to the ``on_eval_*``
methods."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EpisodeEnd", "EventProcessor", "Interrupter", "Progress", "TimeStep"]


@dataclass(frozen=True, slots=True)
class Progress:
    """Frames processed so far.

    Attributes:
        frames: transitions delivered since the loop started (training) or episodes finished in this call (evaluation).
        total: the target of the current call or run, ``-1`` when endless.
    """

    frames: int
    total: int = -1


@dataclass(frozen=True, slots=True)
class TimeStep:
    """One transition, as seen by an event processor.

    Attributes:
        env_id: the env that produced it (``0 .. num_envs - 1``).
        reward: the step's reward (float, first element for vector rewards).
        step_count: 1-based length of the running episode after this step.
        episode_reward: the episode's running return after this step.
        terminated, truncated: the step's flags; ``done`` is their ``or``.
        policy_version: version of the policy weights that chose the action.
        progress: frames delivered so far, this one included.
        context: the policy's extra outputs for this row (``action_log_prob``, ``logits``, an exploration rate...).
        eval: True for evaluation loops.
    """

    env_id: int
    reward: float
    step_count: int
    episode_reward: float
    terminated: bool
    truncated: bool
    policy_version: int
    progress: Progress
    context: dict[Any, Any] = field(default_factory=dict)
    eval: bool = False

    @property
    def done(self) -> bool:
        """``terminated or truncated``: the episode ended with this step."""
        return self.terminated or self.truncated


@dataclass(frozen=True, slots=True)
class EpisodeEnd:
    """A finished episode (terminated or truncated).

    Attributes:
        env_id: the env that ran it.
        length: number of steps in the episode (>= 1).
        reward: the episode's return (sum of rewards, undiscounted).
        terminated: True when the MDP reached a terminal state.
        truncated: True when a time limit or a reset cut it.
        policy_version: version of the weights that chose its last action.
        progress: frames delivered so far (training) or episodes finished so far in this call (evaluation).
        eval: True for evaluation episodes.
        info: the loop's ``info_keys`` entries at the episode's last step (what the final ``step`` put in ``info``),
            one numpy array of the entry's spec shape each; empty without ``info_keys``.
    """

    env_id: int
    length: int
    reward: float
    terminated: bool
    truncated: bool
    policy_version: int
    progress: Progress
    eval: bool = False
    info: dict[Any, Any] = field(default_factory=dict)


class EventProcessor:
    """Receives collection events; subclass and override what you need (all methods are no-ops by default).

    Set :attr:`wants_timesteps` to ``True`` (class or instance attribute) to receive :meth:`on_timestep` calls:
    without it no :class:`TimeStep` is ever built. Methods are called from the thread that called ``run_steps`` /
    ``run_episodes`` (or iterates the collector), never from env threads, so no locking is needed; an exception
    raised here propagates to that caller.
    """

    wants_timesteps: bool = False

    def on_timestep(self, step: TimeStep) -> None:
        """Called for every training transition when ``wants_timesteps``."""

    def on_episode_end(self, episode: EpisodeEnd) -> None:
        """Called for every finished training episode."""

    def on_eval_timestep(self, step: TimeStep) -> None:
        """Called for every evaluation transition when ``wants_timesteps``."""

    def on_eval_episode_end(self, episode: EpisodeEnd) -> None:
        """Called for every finished evaluation episode."""


class Interrupter:
    """A stop flag shared between a driver and the loops it drives; :meth:`stop` may be called from any thread (a
    signal handler, a trainer callback, another collector). Loops check it while they wait, so ``run_steps`` /
    ``run_episodes`` return promptly with what was collected so far."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def stop(self) -> None:
        """Ask every loop watching this interrupter to return early."""
        self._event.set()

    def reset(self) -> None:
        """Clear a previous stop request."""
        self._event.clear()

    def should_stop(self) -> bool:
        """True once :meth:`stop` was called (and not reset)."""
        return self._event.is_set()
