"""Exceptions raised by collection, and the warning of a layout likely to be slow.

Every failure inside a worker thread (an env's ``reset``/``step``, the policy's forward pass, a hung step) is
re-raised in the thread that asked for data as one of the classes below, the original exception chained as
``__cause__``.
"""

from __future__ import annotations

__all__ = ["CollectionError", "EnvError", "LayoutWarning", "PolicyError", "StepTimeoutError"]


class CollectionError(RuntimeError):
    """Base class of every error raised by collection.

    Attributes:
        partial: transitions collected before the failure, as a TensorDict of batch size ``[n]`` in arrival order
            (``None`` when the failing call collected nothing).
    """

    partial: object | None = None


class EnvError(CollectionError):
    """An environment raised, returned bad data or hung.

    Attributes:
        env_id: index of the failing env in its loop (``0 .. num_envs - 1``).
        step: 0-based count of the env steps that env had completed when it failed (``0`` in the first ``reset``).
        phase: ``"reset"``, ``"step"`` or ``"check"`` (bad shape, dtype or NaN).
    """

    def __init__(self, message: str, *, env_id: int, step: int, phase: str) -> None:
        super().__init__(f"env {env_id} failed in {phase} at step {step}: {message}")
        self.env_id, self.step, self.phase = env_id, step, phase


class PolicyError(CollectionError):
    """The policy raised, or returned an output of the wrong batch size or without ``action``.

    Attributes:
        env_ids: the envs whose requests were in the failing forward pass.
        step: 0-based count of the env steps the reporting env had completed when its request failed (``None``
            when raised outside an env thread).
        reason: ``message`` as given (without the env / step suffix).
    """

    def __init__(self, message: str, *, env_ids: tuple[int, ...] = (), step: int | None = None) -> None:
        suffix = f" (requests from envs {list(env_ids)})" if env_ids else ""
        at = f" at step {step}" if step is not None else ""
        super().__init__(f"policy failed{at}: {message}{suffix}")
        self.env_ids, self.step, self.reason = env_ids, step, message


class StepTimeoutError(EnvError):
    """An env step did not return within ``step_timeout`` seconds: the stuck daemon thread is abandoned (named in
    the message) and every other thread is shut down."""


class LayoutWarning(UserWarning):
    """The layout given (``num_workers``, ``envs_per_thread``) is likely to run well below the ``"auto"`` one, for
    the reason the message gives, with what to pass instead. The layout is used as given; filter the warning
    (``warnings.simplefilter("ignore", LayoutWarning)``) to keep it."""
