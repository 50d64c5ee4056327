"""The messages between the driver (:class:`~lightning_rollout.loop.driver.MultiEnvLoop`) and its env threads.

Requests go driver -> worker on the worker's own ``SimpleQueue`` (``Worker.requests``); replies go
worker -> driver on the loop's one shared ``SimpleQueue`` (``MultiEnvLoop._ready``). Only these small,
immutable records cross threads; transitions stay in the worker's storage
(:class:`~lightning_rollout.loop.buffers.Steps`), from which the driver copies the steps it hands out.
Each is a typed ``NamedTuple``: immutable like a frozen dataclass, at a tuple's cost, on the path every
step takes. Steps are numbered per worker from 0; a request says how far the driver has copied them
out (``consumed`` steps, and ``taken`` rows of the next one), so the worker knows which rows it may write
again and which steps are still undelivered.

============================  =============================================================
request                       reply
============================  =============================================================
:class:`Grant`                :class:`Published` once the grant's steps are in the storage (or
                              the driver cut the grant short)
:class:`EpisodeRequest`       :class:`EpisodeReady`: one fresh, complete episode
:class:`ResetRequest`         :class:`ResetDone`
:class:`StopRequest`          (none: the worker returns)
============================  =============================================================

A worker answers each request with exactly one reply (a :class:`StopRequest` with none; a failure with
:class:`WorkerFailed` instead of its reply). Grants are cumulative: a grant sent while an earlier one is
running raises its end, and the worker then answers the two with one :class:`Published`.

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
from typing import TYPE_CHECKING, Any, NamedTuple

from ..specs import NestedKey

if TYPE_CHECKING:
    from .buffers import Steps

__all__ = ["STOP", "EpisodeReady", "EpisodeRequest", "Grant", "Published", "Reply", "Request", "ResetDone",
           "ResetRequest", "StopRequest", "WorkerFailed",
           "AttachBuffers", "ChildFailed", "ChildOk", "ChildReady", "ChildReply", "ChildStarted", "CloseEnvs",
           "ParentCommand", "RandomAction", "ResetEnv", "StepEnvs"]


# -- driver -> worker --------------------------------------------------------------------------------------
class Grant(NamedTuple):
    """The driver may take the worker's steps up to ``end`` (exclusive): write them (those not written yet) and
    answer :class:`Published` once they are settled in the storage, or when the driver cuts the grant short
    (the loop's ``cut`` flag: the worker stops after its current step). The driver has copied out steps
    ``0`` to ``consumed - 1`` and ``taken`` rows of step ``consumed``; the storage must hold ``capacity``
    steps."""

    end: int
    consumed: int
    taken: int
    capacity: int


class EpisodeRequest(NamedTuple):
    """Run one fresh episode of env ``env_id`` alone (the block's other envs wait); ``request_index``
    orders the answers of one ``run_episodes`` call; ``consumed`` and ``taken`` as in :class:`Grant`."""

    env_id: int
    request_index: int
    consumed: int
    taken: int


class ResetRequest(NamedTuple):
    """Reset these envs, each with its seed (``None``: unseeded), ending their running episodes;
    ``consumed`` and ``taken`` as in :class:`Grant`."""

    items: Sequence[tuple[int, int | None]]
    consumed: int
    taken: int


class StopRequest(NamedTuple):
    """Return (the loop is closing)."""


STOP = StopRequest()


# -- worker -> driver --------------------------------------------------------------------------------------
class Published(NamedTuple):
    """Worker ``worker``'s steps up to ``end`` (exclusive) are settled in its storage (short of its grant when
    the driver cut it: it then takes ``end`` as its grant)."""

    worker: int
    end: int


class EpisodeReady(NamedTuple):
    """The episode of env ``env_id`` asked by request ``request_index``: the first ``length`` steps of ``steps``
    (one row a step). ``fresh``: no undelivered step ends the env's running trajectory, so its next steps start
    a new one."""

    worker: int
    request_index: int
    env_id: int
    steps: Steps
    length: int
    fresh: bool


class ResetDone(NamedTuple):
    """Worker ``worker`` reset the envs asked; ``fresh``: the envs (by id) whose running trajectory no
    undelivered step ends (see :class:`EpisodeReady`)."""

    worker: int
    fresh: tuple[int, ...]


class WorkerFailed(NamedTuple):
    """Worker ``worker`` failed; ``error`` (a ``CollectionError`` naming the env) is raised by the driver."""

    worker: int
    error: BaseException


Request = Grant | EpisodeRequest | ResetRequest | StopRequest
Reply = Published | EpisodeReady | ResetDone | WorkerFailed


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
