"""One block of envs, stepped together by one thread, writing into caller-owned arrays.

:class:`Block` is the one env interface of the loop: a step of some of a block's envs is
``begin`` (their inputs), ``ended`` (which of them ended) and ``finish`` (their results written
into the arrays given), whatever the block is. An :class:`EnvBlock` is what an env thread steps
in-process and what a block server steps in a worker process
(:mod:`lightning_rollout.loop.process`): the same code on both sides. A step takes the block's
inputs for ``n`` of its envs (row ``i`` is env ``envs[i]``) and writes each env's ``"next"``
entries, reward and flags into row ``i`` of the arrays it is given: no per-env dictionaries on
the way out, and for gymnasium envs with one array observation none on the way in either (the
gymnasium fast path: actions are converted and validated once for the block, observations are
checked once for the block). Without helper threads the envs step one after the other in
``finish``. Errors come out as :class:`EnvFailure`, naming the env's index in the block and the
phase, which the caller turns into the user-facing error.

Threading: a block is owned by one thread. ``busy_env``, ``busy_phase`` and
``busy_since`` name the env call in progress that started first, read without a lock
by the driver's ``step_timeout`` check (a stale read costs at most one check period):
the owner's own call (a reset, a sequential step; it notes it around each call) or a
helper's call in flight (from the helpers' ``calls`` and ``started``), whichever
started first.

With ``parallel=True`` the block's envs step concurrently, each in its own helper
thread (``lightning_rollout-<name>-env<i>-step``, a daemon), for envs whose step
releases the GIL (C simulators, sleeps, I/O). Protocol (:class:`_StepThreads`): the
owner notes the time in ``started[j]``, then writes env ``j``'s call into ``calls[j]``
and releases ``go[j]`` (a lock held while there is nothing to do); helper ``j``
acquires it, runs the call, stores the result or the exception in ``results[j]``,
clears ``calls[j]`` and puts ``j`` on the ``done`` queue (so a call is in flight
exactly while ``calls[j]`` is set, and its start time is already written then). The
owner reads ``done`` (polling its stop flag every 50 ms). Two ways to use it:

- lock-step (``ended(every=True)``, and :meth:`EnvBlock.step`, the three calls in one): start
  every env, wait until all ended, write the results in env order (errors are raised as in a
  sequential step, the lowest env index first);
  no helper is left running a call. The owner is woken once, by the last call to end:
  each helper, after putting ``j`` on ``done``, counts the ends under ``count_lock``,
  and the one whose end reaches the owner's ``target`` releases ``all`` (a lock held
  otherwise); the owner sets ``target`` under the same lock and does not wait when
  the count already reached it.
- free-running, :meth:`EnvBlock.begin` / :meth:`EnvBlock.ended` /
  :meth:`EnvBlock.finish`: the owner starts envs as their actions are ready and
  writes the results of those that ended; each env runs at its own pace
  (``Worker._run_free`` in :mod:`lightning_rollout.loop.worker`). After the first
  call that ended the owner keeps gathering, for up to a tenth of the mean call
  duration or until half the calls in flight ended, so that one policy call answers
  envs that end close together; once it shares its helpers' core (below) it takes
  the calls that already ended and does not wait for more.

Resets, random actions and all bookkeeping stay in the owner thread. Helpers poll
their lock every 50 ms and exit once the block is closed; one stuck inside an env
call is abandoned (daemon).

Helpers whose calls mostly wait are placed on cores chosen for them. Each helper
times its first calls, wall clock and its own thread's CPU time, into ``cpu[j]``,
``wall[j]`` and ``calls[j]``, which only it writes. Once ``_PIN_AFTER`` calls have
ended, the owner reads the sums once and decides (``measuring`` then turns False),
by :func:`_placement`, when the process may run on two cores or more and the
helpers spent less than ``_PIN_CPU_SHARE`` of their calls' time on a CPU (sleeps,
I/O, a remote env; a call's waits for a CPU, other processes' load, are left out of
its time, :class:`~lightning_rollout.loop.schedstat.RunDelay`):

- if all the helpers together keep at most ``_ONE_CORE_DEMAND`` cores busy (``n``
  times that share), the block goes to **one core**: the helpers and, when its
  torch runs one intra-op thread, the owner thread itself (the calls of a waiting
  env are mostly Python, which the GIL runs one thread at a time anyway). The core
  is one of the allowed cores but the highest, a different one for each block
  placed (round robin, from an offset given by the process id, so that the blocks
  of several processes on one machine spread too);
- otherwise the helpers move off the highest allowed core, which is left to the
  owner, and the owner is not pinned.

The owner sets ``cores``; each helper moves itself there (``os.sched_setaffinity`` on
its own thread) before its next call; the owner moves itself at once. The thread
that built the loop (a training loop, the driver) is never pinned. Helpers that
share the owner's core also switch themselves to ``SCHED_BATCH``: a helper whose
step ends then does not preempt the owner on wake-up, which would only hand the
core to a thread that must wait for the GIL the owner holds.

Why: GIL hand-offs between threads on one core are context switches; between
cores each one wakes another core (on a VM, an inter-processor interrupt to an
idle virtual CPU), and an owner that runs after its helpers on another core finds
its caches cold. An owner whose forward pass may use several torch threads stays
put: an OpenMP team is not held to one core.
Calls that compute (C code releasing the GIL) keep every core: moving them would
take cores from them.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from .._exit import abandon
from ..envs import ActionError, EnvAdapter, GymAdapter
from ..specs import ArraySpec, NestedKey
from .buffers import check_entries
from .schedstat import RunDelay

__all__ = ["Block", "EnvBlock", "EnvFailure", "RemoteTraceback"]

log = logging.getLogger("lightning_rollout")


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process (chained as the cause of the error)."""


class EnvFailure(Exception):
    """An env call of a block failed (internal: the env thread names the env and step).

    Attributes:
        j: the env's index in its block.
        phase: ``"reset"``, ``"step"``, ``"check"`` or ``"create"``.
        kind: ``"env"``, or ``"action"`` when the policy's action was invalid.
        cause: the exception (or its remote traceback).
        process: the index of the worker process the env runs in (``None``: in-process).
    """

    process: int | None = None

    def __init__(self, j: int, phase: str, kind: str, cause: BaseException) -> None:
        remote = isinstance(cause, RemoteTraceback)  # its text starts with the remote "Type: message" line
        if remote:
            text = str(cause).split("\n", 1)[0]
        elif kind == "action" or phase == "check":  # our own messages: no exception type in front
            text = str(cause)
        else:
            text = f"{type(cause).__name__}: {cause}"
        super().__init__(text)
        self.j, self.phase, self.kind, self.cause = j, phase, kind, cause


class _CheckFailed(Exception):
    """What an env returned does not match its spec (the message of :func:`check_entries`)."""


def _check(j: int, values: Mapping[NestedKey, Any], specs: Mapping[NestedKey, ArraySpec]) -> None:
    """Raise env ``j``'s failed check (:func:`check_entries`) when ``values`` do not match ``specs``."""
    problem = check_entries(values, specs)
    if problem is not None:
        raise EnvFailure(j, "check", "env", _CheckFailed(problem))


def _nan_failure(j: int) -> EnvFailure:
    """Env ``j``'s observation holds a NaN: its failed check, as :func:`check_entries` words it."""
    return EnvFailure(j, "check", "env", _CheckFailed("entry 'observation' contains NaN"))


_POLL_S = 0.05
# ``_StepThreads.ended`` gathers the calls that end close together, so that one policy call of a
# free-running block answers them: it waits up to _GATHER_WINDOW mean call durations after the first,
# until _GATHER_SHARE of the calls in flight ended (a lock-step step waits for all of them anyway).
# Measured on 16 envs, 2 cores (benchmarks gil and stragglers, parallel_steps="free"): a policy call made
# while helpers wake costs ~5x its forward pass in GIL hand-offs, so fewer, larger calls win; without
# gathering, 0.56 and 0.41 of the ideal throughput, with a window of 0.25 0.64 and 0.45. Once the helpers
# moved off the block thread's core (below), 0.1 beat 0.25 in six of six interleaved pairs (2 ms env
# 0.70-0.71 against 0.67-0.69 of the ideal, stragglers 0.52-0.56 against 0.49-0.51); 0 and 0.05 were slower.
# A block thread on its helpers' one core (see _placement) does not gather: the helpers that end while it
# works queue up behind it on that core anyway, and waiting for more only delays them (0 against 0.1 in
# four interleaved pairs: 2 ms env 0.78 against 0.75 in each, stragglers 0.61-0.63 against 0.60-0.62; the
# other way round with the block thread off that core: stragglers 0.46 against 0.56).
_GATHER_WINDOW = 0.1
_GATHER_SHARE = 0.5
_EMA = 0.1
# Helpers whose calls spend less than _PIN_CPU_SHARE of their time on a CPU are placed, decided once
# _PIN_AFTER calls have ended: on one core with their owner when together they keep at most
# _ONE_CORE_DEMAND cores busy, else off the highest core (see the module docs and _placement).
_PIN_AFTER = 64
_PIN_CPU_SHARE = 0.5
_ONE_CORE_DEMAND = 1.0
_placed_blocks: Iterator[int]  # blocks placed on one core: the next one's core (see _count_from_pid)


def _count_from_pid() -> None:
    """Start counting the placed blocks at this process's id, so that the blocks of several processes on one
    machine (DDP ranks, independent runs) spread over the cores instead of all taking the first one."""
    global _placed_blocks
    _placed_blocks = itertools.count(os.getpid())


_count_from_pid()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_count_from_pid)


def _placement(share: float, helpers: int, allowed: frozenset[int] | set[int], blocks: Iterator[int]
               ) -> tuple[frozenset[int], bool] | None:
    """Where the helpers of a block go (see the module docs).

    Args:
        share: the fraction of their calls' wall time the helpers spent on a CPU.
        helpers: how many helpers (envs) the block has.
        allowed: the cores this process may run on.
        blocks: counts the blocks placed on one core (read only when this one is): picks its core.

    Returns:
        ``None`` to leave every thread where it is; else the helpers' cores, and whether that is one
        core, which the owner thread joins when its torch runs one intra-op thread.
    """
    if share >= _PIN_CPU_SHARE or len(allowed) < 2:
        return None
    others = sorted(set(allowed) - {max(allowed)})
    if share * helpers <= _ONE_CORE_DEMAND:
        return frozenset({others[next(blocks) % len(others)]}), True
    return frozenset(others), False


class _StepThreads:
    """One helper thread per env of a block: :meth:`start` hands env ``j`` its call, :meth:`ended`
    waits for calls to end."""

    def __init__(self, n: int, *, name: str, env_ids: Sequence[int]) -> None:
        self._go = [threading.Lock() for _ in range(n)]
        for go in self._go:
            go.acquire()  # held: nothing to do
        self._calls: list[tuple[Callable[[Any], Any], Any] | None] = [None] * n
        self.results: list[tuple[bool, Any] | None] = [None] * n  # (ok, value or exception)
        self._done: queue.SimpleQueue[int] = queue.SimpleQueue()
        # A lock-step round wakes the owner once, when its last call ends (see ``ended``): the helpers count
        # the calls that ended (``_count``, under ``_count_lock``) and the one that reaches ``_target``
        # releases ``_all`` (held otherwise). ``_taken`` counts the ends the owner has read (owner only).
        self._count_lock = threading.Lock()
        self._count = 0
        self._target = -1
        self._taken = 0
        self._all = threading.Lock()
        self._all.acquire()
        self.started = [0.0] * n  # perf_counter() when each helper's last call was handed over
        self.step_time = 0.0  # running mean of a call's duration, seconds (first call of each free wake-up)
        self._closed = False
        self._name = name
        # Pinning (see the module docs): helper j writes cpu[j] and wall[j] while ``measuring``; the owner
        # counts ended calls, decides once, and sets ``cores`` for the helpers to move to.
        self.cpu = [0.0] * n
        self.wall = [0.0] * n
        self.calls = [0] * n
        self.measuring = hasattr(os, "sched_setaffinity")
        self.cores: frozenset[int] | None = None
        # The owner moved to the helpers' one core (set before ``cores``): they then run as SCHED_BATCH, and
        # the owner does not gather (``gather_window``).
        self.shared_core = False
        self.threads = [threading.Thread(target=self._serve, args=(j,), daemon=True,
                                         name=f"lightning_rollout-{name}-env{env_ids[j]}-step") for j in range(n)]
        for thread in self.threads:
            thread.start()

    def _serve(self, j: int) -> None:
        go = self._go[j]
        pinned = False
        delay = RunDelay() if self.measuring else None  # this thread's waits for a CPU: not the call's own time
        try:
            while True:
                if not go.acquire(timeout=_POLL_S):
                    if self._closed:
                        return
                    continue
                if self._closed:
                    return
                call = self._calls[j]
                assert call is not None
                if not pinned and self.cores is not None:
                    pinned = True
                    try:
                        os.sched_setaffinity(0, self.cores)  # this thread only
                        if self.shared_core:  # waking up does not preempt the owner (see the module docs)
                            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
                    except OSError:  # not permitted here (a seccomp profile, a cpuset changed since): stay put
                        pass
                measuring = self.measuring and delay is not None
                if measuring:
                    cpu0, wall0, wait0 = time.thread_time(), time.perf_counter(), delay()
                elif delay is not None:
                    delay.close()
                    delay = None
                try:
                    self.results[j] = (True, call[0](call[1]))
                except BaseException as exc:  # re-raised by the owner, in env order
                    self.results[j] = (False, exc)
                if measuring:
                    self.cpu[j] += time.thread_time() - cpu0
                    self.wall[j] += time.perf_counter() - wall0 - (delay() - wait0)
                    self.calls[j] += 1
                self._calls[j] = None
                self._done.put(j)
                with self._count_lock:
                    self._count += 1
                    last = self._count == self._target
                if last:
                    self._all.release()
        finally:
            if delay is not None:
                delay.close()

    def _decide_pinning(self) -> None:
        """Once, in the owner thread: place the helpers (and maybe the owner) when their calls mostly
        wait (see the module docs)."""
        self.measuring = False
        wall = sum(self.wall)
        share = sum(self.cpu) / wall if wall > 0 else 1.0
        allowed = os.sched_getaffinity(0)
        n = len(self.threads)
        place = _placement(share, n, allowed, _placed_blocks)
        if place is None:
            return
        cores, one = place
        if not one:
            self.cores = cores
            log.info("%s: the env steps of its %d helper threads spend %.0f%% of their time on a CPU: the helpers "
                     "move off core %d, which is left to the block's thread", self._name, n, 100 * share,
                     max(allowed))
            return
        owner = torch.get_num_threads() == 1  # a forward pass that may use several threads keeps its cores
        if owner:
            try:
                os.sched_setaffinity(0, cores)  # the owner thread only
            except OSError:  # not permitted here: the helpers still move
                owner = False
        self.shared_core = owner
        self.cores = cores  # the helpers move before their next call
        log.info("%s: the env steps of its %d helper threads spend %.0f%% of their time on a CPU: the helpers%s "
                 "move to core %d", self._name, n, 100 * share, " and the block's thread" if owner else "",
                 min(cores))

    @property
    def gather_window(self) -> float:
        """How long :meth:`ended` gathers after the first call ended, in mean call durations: none once the
        owner shares the helpers' core (see the module docs)."""
        return 0.0 if self.shared_core else _GATHER_WINDOW

    def start(self, calls: Iterable[tuple[int, Callable[[Any], Any], Any]]) -> None:
        """Hand each helper ``j`` of ``calls`` its call ``fn(arg)`` (each must be idle: its last call ended and
        was read); they share one start time, taken before the first is handed over."""
        now = time.perf_counter()
        started, pending, go = self.started, self._calls, self._go
        for j, fn, arg in calls:
            started[j] = now  # before the call is visible: ``oldest`` reads both
            pending[j] = (fn, arg)
            go[j].release()

    def ended(self, stop: threading.Event | None, in_flight: int = 1, *, every: bool = False) -> list[int]:
        """The helpers whose call ended, in the order they ended, out of ``in_flight`` calls: at least one,
        then more for a short while (see the module docs); with ``every``, all ``in_flight`` of them (a
        lock-step step: no gathering to decide), waking once, when the last one ends. Every wait polls
        ``stop`` every 50 ms.

        Raises:
            _Stopped: ``stop`` was set while waiting (the loop is closing).
        """
        done = self._done
        if every:
            self._wait_all(stop, in_flight)
            ended = [done.get_nowait() for _ in range(in_flight)]  # each helper put j before counting its end
            self._taken += in_flight
            self._maybe_decide_pinning()
            return ended
        ended = [self._next(stop)]
        self._taken += 1
        now = time.perf_counter()
        self.step_time += _EMA * (now - self.started[ended[0]] - self.step_time)
        self._maybe_decide_pinning()
        want = max(1, int(in_flight * _GATHER_SHARE))
        deadline = now + self.gather_window * self.step_time
        while True:
            try:
                j = done.get_nowait()
            except queue.Empty:
                left = deadline - time.perf_counter()
                if left <= 0 or len(ended) >= want:
                    return ended
                try:
                    j = done.get(timeout=left)
                except queue.Empty:
                    return ended
            ended.append(j)
            self._taken += 1

    def _maybe_decide_pinning(self) -> None:
        """Place the helpers once ``_PIN_AFTER`` calls have ended (owner thread; see :meth:`_decide_pinning`)."""
        if self.measuring and sum(self.calls) >= _PIN_AFTER:
            self._decide_pinning()

    def _wait_all(self, stop: threading.Event | None, in_flight: int) -> None:
        """Wait until ``in_flight`` more calls ended than the owner has read: one wake-up, by the helper
        whose call ends last (polls ``stop`` every 50 ms)."""
        from ..policy import _Stopped

        with self._count_lock:
            self._target = self._taken + in_flight
            if self._count >= self._target:  # they all ended already: no helper releases ``_all``
                return
        while not self._all.acquire(timeout=_POLL_S):
            if stop is not None and stop.is_set():
                raise _Stopped() from None

    def oldest(self) -> tuple[int, float]:
        """The helper whose call in flight started first, and ``perf_counter()`` when it started;
        ``(-1, 0.0)`` when none is in flight. Any thread (a stale read is harmless)."""
        best, since = -1, 0.0
        calls, started = self._calls, self.started
        for j in range(len(calls)):
            if calls[j] is not None and (best < 0 or started[j] < since):
                best, since = j, started[j]
        return best, since

    def _next(self, stop: threading.Event | None) -> int:
        """The next helper whose call ends (waits, polling ``stop``)."""
        from ..policy import _Stopped

        while True:
            try:
                return self._done.get(timeout=_POLL_S)
            except queue.Empty:
                if stop is not None and stop.is_set():
                    raise _Stopped() from None

    def close(self, timeout: float = 1.0) -> None:
        """Let every helper exit; one still inside an env call after ``timeout`` s is abandoned."""
        self._closed = True
        for go in self._go:
            try:
                go.release()
            except RuntimeError:  # not held: that helper is busy and will see the flag
                pass
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
                if thread.is_alive():
                    abandon(thread)


class Block(Protocol):
    """What a :class:`~lightning_rollout.loop.worker.Worker` steps: its envs in this process (:class:`EnvBlock`)
    or in worker processes (:class:`~lightning_rollout.loop.process.RemoteEnvs`,
    :class:`~lightning_rollout.loop.process.RemoteGroup`). The worker asks what a block can do through these
    attributes, never by its type.

    A step of some of the block's envs is three calls: :meth:`begin` hands them their inputs, :meth:`ended`
    says which of them ended, :meth:`finish` writes the results of those. A block whose envs step in this
    thread steps them in :meth:`finish`; one whose envs step elsewhere (helper threads, worker processes)
    starts them in :meth:`begin`, so the caller may act for other envs meanwhile.

    Attributes:
        parallel: its envs step concurrently and end one by one, so each may run at its own pace
            (``ended`` reports them as they end; :class:`EnvBlock` with helper threads).
        partial: a step may take some of its envs (every block but a natively batched env,
            :class:`~lightning_rollout.loop.native.NativeBlock`, whose envs step together).
        owned: the worker's thread closes it (``False``: the loop's process pool does).
        busy_env, busy_phase, busy_since: the env call in progress (read by the driver's ``step_timeout``
            check).
    """

    parallel: bool
    partial: bool
    owned: bool
    busy_env: int
    busy_phase: str
    busy_since: float

    def begin(self, inputs: Mapping[NestedKey, np.ndarray], envs: Sequence[int]) -> None:
        """Start a step of each of ``envs`` (idle ones; row ``i`` of ``inputs`` is env ``envs[i]``'s)."""

    def ended(self, stop: threading.Event | None = None, *, every: bool = False) -> list[int]:
        """Envs whose step ended since the last call: at least one (waits, polling ``stop``); ``every``: all
        of those begun."""

    def finish(self, envs: Sequence[int], out: Mapping[NestedKey, np.ndarray], rewards: np.ndarray,
               terminated: np.ndarray, truncated: np.ndarray) -> tuple[Sequence[int], EnvFailure | None]:
        """Write the results of the ended steps of ``envs`` into rows ``0, 1, ...``; returns the envs written
        and the first failure skipped, or raises the :class:`EnvFailure` that ends the whole step."""

    def reset(self, j: int, seed: int | None, stop: threading.Event) -> dict[NestedKey, Any]:
        """Reset env ``j`` (``seed``: reseed it); its root entries, checked."""

    def reset_many(self, envs: Sequence[int], stop: threading.Event) -> list[dict[NestedKey, Any]]:
        """Reset envs ``envs`` (those a step ended); their root entries, in order, checked."""

    def random_action(self, j: int, columns: Mapping[NestedKey, ArraySpec], stop: threading.Event
                      ) -> dict[NestedKey, np.ndarray]:
        """A uniformly random valid action of env ``j``, laid out as ``columns``."""

    def close(self) -> None:
        """Release the envs (errors swallowed)."""


class EnvBlock:
    """The envs of one block: reset, step and sample random actions, writing into given arrays.

    Args:
        adapters: the block's envs (index ``j`` in the block).
        validate: check each observation against ``checked_next`` / ``checked_root``
            (shape, dtype, NaN) and each action against the action space.
        checked_next: the ``"next"`` entries to check after a step (``{key: ArraySpec}``).
        checked_root: the root entries to check after a reset.
        zero_done: root done flags a TorchRL env reads at the root: passed as zeros.
        parallel: step the envs concurrently, one helper thread each (see the module docs);
            ignored for a block of one env.
        name, env_ids: name the helper threads (``lightning_rollout-<name>-env<id>-step``).
        watched: someone reads ``busy_since`` (a ``step_timeout``): a sequential step or a reset then
            notes each env's start; without, ``busy_since`` stays 0.0 through them (helpers' calls are
            noted either way).
    """

    owned = True  # closed by the thread that steps it
    partial = True

    def __init__(self, adapters: Sequence[EnvAdapter], *, validate: bool,
                 checked_next: Mapping[NestedKey, ArraySpec], checked_root: Mapping[NestedKey, ArraySpec],
                 zero_done: Mapping[NestedKey, ArraySpec], parallel: bool = False, name: str = "loop",
                 env_ids: Sequence[int] | None = None, watched: bool = True) -> None:
        self.adapters = list(adapters)
        self.watched = watched
        self._threads = (_StepThreads(len(self.adapters), name=name,
                                      env_ids=env_ids if env_ids is not None else range(len(self.adapters)))
                         if parallel and len(self.adapters) > 1 else None)
        self.validate = validate
        self.checked_next = dict(checked_next)
        self.checked_root = dict(checked_root)
        self.zero_done = {k: np.zeros(spec.shape, bool) for k, spec in zero_done.items()}
        # The owner's own env call in progress (see ``busy_since``): written by the owner around each call.
        self._busy_env = -1
        self._busy_phase = "step"
        self._busy_since = 0.0  # perf_counter() while inside such a call, else 0.0
        first = self.adapters[0]
        # The fast path: gymnasium envs with one array observation and no info entries, one action space.
        self._gym = (all(isinstance(a, GymAdapter) and a.plain_observation for a in self.adapters)
                     and all(a.action_space == first.action_space for a in self.adapters[1:]))
        spec = self.checked_next.get("observation")
        self._obs_spec = (spec.shape, spec.dtype) if validate and spec is not None else None  # checked obs
        self._accepted_dtypes: set[np.dtype] = set()  # observation dtypes seen to cast safely to the column's
        self._in_flight: set[int] = set()  # parallel blocks: envs whose step started and was not reported ended
        self._pending: tuple[Mapping[NestedKey, np.ndarray], Sequence[int]] | None = None  # begun, stepped in finish

    # -- what the driver's step_timeout check reads (any thread) ----------------------
    def _busy(self) -> tuple[int, str, float]:
        """``(env, phase, perf_counter() at its start)`` of the env call in progress that started first:
        the owner's own or a helper's (``since`` 0.0 when none is in progress)."""
        env, phase, since = self._busy_env, self._busy_phase, self._busy_since
        if self._threads is not None:
            j, started = self._threads.oldest()
            if j >= 0 and (not since or started < since):
                return j, "step", started
        return env, phase, since

    @property
    def busy_env(self) -> int:
        """The env (index in the block) of the call in progress that started first."""
        return self._busy()[0]

    @property
    def busy_phase(self) -> str:
        """``"step"`` or ``"reset"``: what that call is."""
        return self._busy()[1]

    @property
    def busy_since(self) -> float:
        """``perf_counter()`` when that call started; 0.0 when no env call is in progress."""
        return self._busy()[2]

    # -- calls ------------------------------------------------------------------------
    # ``stop`` keeps the signatures of RemoteEnvs (whose calls wait on another process); here only a
    # parallel step waits on something (its helper threads) and polls it.
    def reset(self, j: int, seed: int | None, stop: threading.Event | None = None) -> dict[NestedKey, Any]:
        """Reset env ``j``; its root entries, checked. Raises :class:`EnvFailure`."""
        self._busy_env, self._busy_phase = j, "reset"
        if self.watched:
            self._busy_since = time.perf_counter()
        try:
            root = self.adapters[j].reset(seed)
        except Exception as exc:
            raise EnvFailure(j, "reset", "env", exc) from exc
        finally:
            self._busy_since = 0.0
        if self.validate:
            _check(j, root, self.checked_root)
        return root

    def reset_many(self, envs: Sequence[int], stop: threading.Event | None = None) -> list[dict[NestedKey, Any]]:
        """:meth:`reset` each of ``envs`` in turn (raises for the first that fails)."""
        return [self.reset(j, None, stop) for j in envs]

    def random_action(self, j: int, columns: Mapping[NestedKey, ArraySpec],
                      stop: threading.Event | None = None) -> dict[NestedKey, np.ndarray]:
        """A uniformly random valid action of env ``j``, laid out as ``columns``. Raises :class:`EnvFailure`
        (phase ``"step"``: the action of a step) for whatever the env's sampling raised."""
        try:
            return self.adapters[j].random_action(columns)
        except Exception as exc:
            raise EnvFailure(j, "step", "env", exc) from exc

    def step(self, inputs: Mapping[NestedKey, np.ndarray], envs: Sequence[int], out: Mapping[NestedKey, np.ndarray],
             rewards: np.ndarray, terminated: np.ndarray, truncated: np.ndarray,
             stop: threading.Event | None = None) -> None:
        """One step of envs ``envs``, all of them: :meth:`begin`, :meth:`ended` for every one, :meth:`finish`.
        Row ``i`` of ``inputs`` is env ``envs[i]``'s; its ``"next"`` entries go to row ``i`` of ``out`` (keyed
        by the env's key, without ``"next"``), its reward and flags to ``rewards[i]``, ``terminated[i]``,
        ``truncated[i]``. Raises :class:`EnvFailure` (for the lowest env index that failed, as if stepped one
        after the other)."""
        self.begin(inputs, envs)
        self.ended(stop, every=True)
        failure = self.finish(envs, out, rewards, terminated, truncated)[1]
        if failure is not None:
            raise failure

    def _step_here(self, inputs: Mapping[NestedKey, np.ndarray], envs: Sequence[int],
                   out: Mapping[NestedKey, np.ndarray], rewards: np.ndarray, terminated: np.ndarray,
                   truncated: np.ndarray) -> None:
        """Step ``envs`` one after the other in this thread (see :meth:`step`); raises the first failure."""
        if self._gym:
            self._step_gym(inputs["action"], envs, out, rewards, terminated, truncated)
            return
        for i, (j, row) in enumerate(zip(envs, self._rows(inputs, len(envs)))):
            self._busy_env, self._busy_phase, self._busy_since = j, "step", time.perf_counter()
            try:
                result = self.adapters[j].step(row)
            except ActionError as exc:  # the policy's fault, not the env's
                raise EnvFailure(j, "step", "action", exc) from exc
            except Exception as exc:
                raise EnvFailure(j, "step", "env", exc) from exc
            finally:
                self._busy_since = 0.0
            self._write(i, j, result, out, rewards, terminated, truncated)

    # -- a step in three calls: begin, ended, finish (helper threads: each env's step starts and ends on its own)
    @property
    def parallel(self) -> bool:
        """Whether the envs step in helper threads (``parallel=True`` and more than one env)."""
        return self._threads is not None

    def begin(self, inputs: Mapping[NestedKey, np.ndarray], envs: Sequence[int]) -> None:
        """Start a step of each env of ``envs`` (row ``i`` of ``inputs`` for env ``envs[i]``): in its helper
        thread, returning at once (:meth:`ended` reports when each step ends and :meth:`finish` writes its
        results), or, without helpers, kept for :meth:`finish`, which steps them in this thread. Each env of
        ``envs`` must be idle (its last step finished). Raises :class:`EnvFailure` for an invalid action
        (nothing is started then)."""
        threads, adapters = self._threads, self.adapters
        if threads is None:  # stepped in finish, in this thread
            self._pending = (inputs, envs)
            return
        if self._gym:
            threads.start((j, adapters[j].env.step, action)
                          for j, action in zip(envs, self._gym_actions(inputs["action"], envs)))
        else:
            threads.start((j, adapters[j].step, row) for j, row in zip(envs, self._rows(inputs, len(envs))))
        self._in_flight.update(envs)

    def ended(self, stop: threading.Event | None = None, *, every: bool = False) -> list[int]:
        """The envs whose step (started by :meth:`begin`) ended since the last look: at least one
        (waits, polling ``stop`` every 50 ms), in the order they ended; with ``every``, all of those in
        flight. Without helpers: every env begun (it steps in :meth:`finish`).

        Raises:
            _Stopped: ``stop`` was set while waiting.
        """
        if self._threads is None:  # every env begun ends in finish
            return list(self._pending[1]) if self._pending is not None else []
        ended = self._threads.ended(stop, len(self._in_flight), every=every)
        self._in_flight.difference_update(ended)
        return ended

    def finish(self, envs: Sequence[int], out: Mapping[NestedKey, np.ndarray], rewards: np.ndarray,
               terminated: np.ndarray, truncated: np.ndarray) -> tuple[Sequence[int], EnvFailure | None]:
        """Write the results of the ended steps of ``envs``, in order, into rows ``0, 1, ...`` of ``out``,
        ``rewards``, ``terminated`` and ``truncated`` (as :meth:`step` does). With helper threads, envs whose
        step failed or whose result fails the checks are skipped; without, the envs step here, one after the
        other, and the first failure is raised.

        Returns:
            The envs written (row ``i`` is ``written[i]``), and the failure of the first env of
            ``envs`` skipped (``None`` when none was).

        Raises:
            EnvFailure: without helpers, the first env that failed (the step fails as a whole).
        """
        if self._threads is None:  # step them now, in this thread; a failure ends the whole step
            assert self._pending is not None
            (inputs, _), self._pending = self._pending, None
            self._step_here(inputs, envs, out, rewards, terminated, truncated)
            return envs, None
        written: list[int] = []
        failure: EnvFailure | None = None
        gym = self._gym
        obs_out = out["observation"] if gym else None
        expected = self._obs_spec
        results = self._threads.results  # type: ignore[union-attr]
        for j in envs:
            i = len(written)
            ok, result = results[j]  # type: ignore[misc]
            results[j] = None
            try:
                if not ok:
                    raise self._failure_of(j, result)
                if gym:
                    obs, rewards[i], terminated[i], truncated[i], _ = result
                    if expected is not None and (getattr(obs, "shape", None) != expected[0]
                                                 or getattr(obs, "dtype", None) != expected[1]):
                        obs = self._observation(j, obs)  # the full check, unless a dtype already seen to cast safely
                    obs_out[i] = obs
                else:
                    self._write(i, j, result, out, rewards, terminated, truncated)
            except EnvFailure as exc:
                failure = failure or exc
                continue
            written.append(j)
        bad = self._nan_rows(obs_out, len(written)) if gym and written else None
        if bad is not None:  # those envs fail their check: their rows are dropped, the others moved up
            nan = _nan_failure(written[int(bad.argmax())])
            if failure is None or list(envs).index(nan.j) < list(envs).index(failure.j):
                failure = nan
            keep = ~bad
            for array in (rewards, terminated, truncated, *out.values()):
                array[:int(keep.sum())] = array[:len(written)][keep]
            written = [j for j, kept in zip(written, keep) if kept]
        return written, failure

    @staticmethod
    def _failure_of(j: int, value: BaseException) -> EnvFailure:
        """What helper ``j``'s exception means: an :class:`EnvFailure` (the policy's fault for an invalid action);
        a ``KeyboardInterrupt`` or ``SystemExit`` in a helper is not an env error and is re-raised."""
        if not isinstance(value, Exception):
            raise value
        failure = EnvFailure(j, "step", "action" if isinstance(value, ActionError) else "env", value)
        failure.__cause__ = value
        return failure

    # -- what both paths share ------------------------------------------------------------------------
    def _rows(self, inputs: Mapping[NestedKey, np.ndarray], n: int) -> list[dict[NestedKey, Any]]:
        """One input dict per env (generic adapters), with the root done flags a TorchRL env reads."""
        rows = []
        for i in range(n):
            row = {k: v[i] for k, v in inputs.items()}
            row.update(self.zero_done)
            rows.append(row)
        return rows

    def _write(self, i: int, j: int, result: Any, out: Mapping[NestedKey, np.ndarray], rewards: np.ndarray,
               terminated: np.ndarray, truncated: np.ndarray) -> None:
        """Check env ``j``'s step result (generic adapters) and write it into row ``i``."""
        nxt, rewards[i], terminated[i], truncated[i] = result
        if self.validate:
            _check(j, nxt, self.checked_next)
        for k, buf in out.items():
            buf[i] = nxt[k]

    def _gym_actions(self, actions: np.ndarray, envs: Sequence[int]) -> Any:
        """The block's actions converted for gymnasium at once; an invalid one names its env."""
        adapters = self.adapters
        try:
            return adapters[0].actions(actions)
        except ActionError:  # find the env whose action is invalid, for the message
            for i, j in enumerate(envs):
                try:
                    adapters[j].actions(actions[i:i + 1])
                except ActionError as exc:
                    raise EnvFailure(j, "step", "action", exc) from exc
            raise

    def _observation(self, j: int, obs: Any) -> Any:
        """Env ``j``'s observation, checked: a shape and dtype comparison, the full check on a mismatch."""
        expected = self._obs_spec
        if expected is not None and (getattr(obs, "shape", None) != expected[0] or (
                getattr(obs, "dtype", None) != expected[1]
                and getattr(obs, "dtype", None) not in self._accepted_dtypes)):
            obs = np.asarray(obs)
            _check(j, {"observation": obs}, self.checked_next)
            if type(obs) is np.ndarray and obs.shape == expected[0]:
                self._accepted_dtypes.add(obs.dtype)  # e.g. float64 observations of a float32 space
        return obs

    def _nan_rows(self, obs_out: np.ndarray, n: int) -> np.ndarray | None:
        """Which of the first ``n`` rows of ``obs_out`` hold a NaN (``[n]`` bools), ``None`` when none does
        or the observations are not checked (validated float observations only)."""
        if self._obs_spec is None or obs_out.dtype.kind != "f":
            return None
        # One sum finds any NaN (and +inf with -inf, which the row check then clears): cheaper than a
        # row-wise isnan on every step, which is only needed to name the env.
        total = obs_out[:n].sum()
        if total == total:  # not NaN
            return None
        bad = np.isnan(obs_out[:n].reshape(n, -1)).any(axis=1)
        return bad if bad.any() else None

    def _step_gym(self, actions: np.ndarray, envs: Sequence[int], out: Mapping[NestedKey, np.ndarray],
                  rewards: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> None:
        """Gymnasium envs with one array observation, stepped in this thread: actions converted for the
        block at once, each ``env.step`` result written straight to its row, observations checked for
        the block."""
        adapters = self.adapters
        env_actions = self._gym_actions(actions, envs)
        obs_out = out["observation"]
        shape, dtype = self._obs_spec or (None, None)
        ndarray, watched, clock = np.ndarray, self.watched, time.perf_counter
        self._busy_phase = "step"
        try:  # between two envs' calls ``busy_since`` still reads the last call's start: a stale read, harmless
            for i, j in enumerate(envs):
                self._busy_env = j
                if watched:
                    self._busy_since = clock()
                try:
                    obs, rewards[i], terminated[i], truncated[i], _ = adapters[j].env.step(env_actions[i])
                except Exception as exc:
                    raise EnvFailure(j, "step", "env", exc) from exc
                if shape is not None and (obs.__class__ is not ndarray or obs.shape != shape or obs.dtype != dtype):
                    obs = self._observation(j, obs)  # the full check, unless a dtype already seen to cast safely
                obs_out[i] = obs
        finally:
            self._busy_since = 0.0
        bad = self._nan_rows(obs_out, len(envs))
        if bad is not None:
            raise _nan_failure(envs[int(bad.argmax())])

    def close(self) -> None:
        """Stop the helper threads, close every env; errors are swallowed (closing must not hide the
        error being raised)."""
        if self._threads is not None:
            self._threads.close()
        close_quietly(self.adapters)


def close_quietly(adapters: Sequence[EnvAdapter]) -> None:
    """Close every adapter; an error closing one is swallowed (closing must not hide the error being raised)."""
    for adapter in adapters:
        try:
            adapter.close()
        except Exception:
            pass
