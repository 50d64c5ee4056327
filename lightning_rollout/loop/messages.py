"""The messages between the driver (:class:`~lightning_rollout.loop.driver.MultiEnvLoop`) and its env threads.

Requests go driver -> worker on the worker's own ``SimpleQueue`` (``Worker.requests``); replies go
worker -> driver on the loop's one shared ``SimpleQueue`` (``MultiEnvLoop._ready``). Only these small,
immutable records cross threads; transitions stay in the worker's slots or are written straight into
the driver's batch. Each is a typed ``NamedTuple``: immutable like a frozen dataclass, at a tuple's
cost, on the path every step takes. A worker answers each request with exactly one reply (a
:class:`StopRequest` with none; a failure with :class:`WorkerFailed` instead of its reply).

============================  =============================================================
request                       reply
============================  =============================================================
:class:`StepRequest`          :class:`StepReady`: the block's step is in that slot
:class:`QuotaRequest`         :class:`QuotaEnded`: the quota's steps are in the batch
:class:`EpisodeRequest`       :class:`EpisodeReady`: one fresh, complete episode
:class:`ResetRequest`         :class:`ResetDone`
:class:`StopRequest`          (none: the worker returns)
============================  =============================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ..specs import NestedKey

__all__ = ["STEP", "STOP", "EpisodeReady", "EpisodeRequest", "QuotaEnded", "QuotaRequest", "Reply", "Request",
           "ResetDone", "ResetRequest", "StepReady", "StepRequest", "StopRequest", "WorkerFailed"]


# -- driver -> worker --------------------------------------------------------------------------------------
class StepRequest(NamedTuple):
    """Publish one step of the whole block (computing it first unless it is staged)."""


class QuotaRequest(NamedTuple):
    """Write ``count`` steps of the block straight into ``out[w, j, start:]`` (``[W, rows, T, ...]`` arrays
    by key), which the driver does not read until :class:`QuotaEnded` (or the worker's ``quota_end``)."""

    out: dict[NestedKey, np.ndarray]
    start: int
    count: int


class EpisodeRequest(NamedTuple):
    """Run one fresh episode of env ``env_id`` alone (the block's other envs wait); ``request_index``
    orders the answers of one ``run_episodes`` call."""

    env_id: int
    request_index: int


class ResetRequest(NamedTuple):
    """Reset these envs, each with its seed (``None``: unseeded), ending their running episodes."""

    items: Sequence[tuple[int, int | None]]


class StopRequest(NamedTuple):
    """Return (the loop is closing)."""


STEP = StepRequest()
STOP = StopRequest()


# -- worker -> driver --------------------------------------------------------------------------------------
class StepReady(NamedTuple):
    """Worker ``worker``'s block of transitions is ready in its slot ``slot`` (0 or 1)."""

    worker: int
    slot: int


class QuotaEnded(NamedTuple):
    """Worker ``worker``'s quota ended at time index ``end`` (short of the quota when cut or stopped)."""

    worker: int
    end: int


class EpisodeReady(NamedTuple):
    """The episode asked by request ``request_index``: the first ``length`` rows of ``columns``.
    ``fresh``: no staged step ends the env's running trajectory, so its next steps start a new one."""

    worker: int
    request_index: int
    columns: dict[NestedKey, np.ndarray]
    length: int
    fresh: bool


class ResetDone(NamedTuple):
    """Worker ``worker`` reset the envs asked; ``fresh`` as in :class:`EpisodeReady`."""

    worker: int
    fresh: bool


class WorkerFailed(NamedTuple):
    """Worker ``worker`` failed; ``error`` (a ``CollectionError`` naming the env) is raised by the driver."""

    worker: int
    error: BaseException


Request = StepRequest | QuotaRequest | EpisodeRequest | ResetRequest | StopRequest
Reply = StepReady | QuotaEnded | EpisodeReady | ResetDone | WorkerFailed
