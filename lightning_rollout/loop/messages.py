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

Between an env thread and a worker process (:mod:`lightning_rollout.loop.process`), over the block's
``Pipe``, the same kind of records, pickled: the parent's commands and the child's replies below. The two
of every step (:class:`StepEnvs` of the whole block, :class:`ChildOk` without a payload) are pickled once
and sent as bytes.

=================================  =========================================================
parent -> child                    child -> parent
=================================  =========================================================
(at start, before any command)     :class:`ChildStarted`, then :class:`ChildReady`
:class:`AttachBuffers`             :class:`ChildOk`: the shared buffers are attached
:class:`StepEnvs`                  :class:`ChildOk`: the results are in the shared buffers
:class:`ResetEnv`                  :class:`ChildOk`: the env's root entries are in ``root``
:class:`RandomAction`              :class:`ChildOk` with the action's entries
:class:`CloseEnvs`                 :class:`ChildOk`, then the child's server ends
=================================  =========================================================

Any of them may be answered by :class:`ChildFailed` instead, naming the env of the block whose call
failed; a :class:`CloseEnvs` instead of :class:`AttachBuffers` gives the construction up (no reply).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ..specs import NestedKey

__all__ = ["STEP", "STOP", "EpisodeReady", "EpisodeRequest", "QuotaEnded", "QuotaRequest", "Reply", "Request",
           "ResetDone", "ResetRequest", "StepReady", "StepRequest", "StopRequest", "WorkerFailed",
           "AttachBuffers", "ChildFailed", "ChildOk", "ChildReady", "ChildReply", "ChildStarted", "CloseEnvs",
           "ParentCommand", "RandomAction", "ResetEnv", "StepEnvs"]


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


# -- env thread -> worker process (over the block's pipe) ------------------------------------------------
class AttachBuffers(NamedTuple):
    """The block's shared buffers (torch tensors in shared memory, by key; ``stats``: reward, terminated,
    truncated) and the specs its :class:`~lightning_rollout.loop.block.EnvBlock` checks."""

    inputs: dict[NestedKey, Any]
    next: dict[NestedKey, Any]
    root: dict[NestedKey, Any]
    stats: tuple[Any, Any, Any]
    checked_next: dict[NestedKey, Any]
    checked_root: dict[NestedKey, Any]
    zero_done: dict[NestedKey, Any]


class StepEnvs(NamedTuple):
    """Step these envs of the block (``None``: all of them); row ``i`` of the buffers is the ``i``-th."""

    envs: tuple[int, ...] | None


class ResetEnv(NamedTuple):
    """Reset env ``j`` of the block with ``seed`` (``None``: unseeded)."""

    j: int
    seed: int | None


class RandomAction(NamedTuple):
    """A uniformly random action for env ``j`` of the block, as entries of ``columns``."""

    j: int
    columns: dict[NestedKey, Any]


class CloseEnvs(NamedTuple):
    """Close the block's envs and end its server."""


# -- worker process -> env thread --------------------------------------------------------------------------
class ChildStarted(NamedTuple):
    """The child runs lightning_rollout's code (sent before it unpickles its env factories)."""


class ChildReady(NamedTuple):
    """The block's envs are built and reset: the first env's keys and specs, and each env's first root
    entries (``roots``, reset with its seed)."""

    keys: Any
    observation_spec: Any
    action_spec: Any
    loop_keys: bool
    roots: list[dict[NestedKey, Any]]


class ChildOk(NamedTuple):
    """The command succeeded; ``payload``: what it returns (a random action's entries), else ``None``."""

    payload: Any = None


class ChildFailed(NamedTuple):
    """Env ``j`` of the block failed in ``phase`` (``"create"``, ``"reset"``, ``"step"``, ``"check"``,
    ``"attach"``); ``kind``: ``"action"`` when the action was at fault, else ``"env"``; ``message`` and the
    child's ``traceback`` as text."""

    j: int
    phase: str
    kind: str
    message: str
    traceback: str


ParentCommand = AttachBuffers | StepEnvs | ResetEnv | RandomAction | CloseEnvs
ChildReply = ChildStarted | ChildReady | ChildOk | ChildFailed
