"""The env-side loop: one thread per block of ``envs_per_thread`` envs, one step driver.

An env thread (``lightning_rollout-<name>-env<i>``, a daemon) runs a :class:`Worker`. It owns its
block of envs (a :class:`~lightning_rollout.loop.block.Block`: in this process, stepped by this
thread or its helper threads, or in worker processes), their running counters, and the storage
its steps are written to (:class:`~lightning_rollout.loop.buffers.Steps`, time-major, one row per
env). Steps are numbered per worker from 0. Row ``t`` holds step ``t``: the root entries the
policy and the env read, the policy's outputs, the env's ``"next"`` entries and the loop's
bookkeeping. The env writes its observations into row ``t + 1``'s root entries, which are both
step ``t``'s ``"next"`` observations and step ``t + 1``'s inputs (as TorchRL's ``step_mdp``
carries them); a reset after step ``t`` writes its own there, the final ones kept first
(:meth:`~lightning_rollout.loop.buffers.Steps.keep_final`, whose side table the worker prunes as
the driver reports steps copied out). The other carried entries (what a policy writes under
``"next"``, or at the root besides its action) are copied from row ``t`` into row ``t + 1`` when
step ``t`` ends. The next step reads its inputs where they lie.

One step driver. The driver gives a worker a :class:`~.messages.Grant`: it may take the worker's
steps up to ``end``. :meth:`Worker._advance` writes steps until they reach a target, and
everything else is a target:

* a grant: its end; the worker answers :class:`~.messages.Published` once the steps are
  settled (below), or after the step in progress when the driver cuts the grant short (the
  loop's ``cut`` flag);
* double batching (``lookahead``): once a grant is done the worker advances one step more, to
  ``end + 1``, and parks; the next grant finds that step written (acted with the weights of
  its time: one step of policy lag after an update), so inference and env work for the next
  batch overlap the driver's consumption of this one. With ``lookahead=False`` no step is
  written before it is granted;
* an episode (:class:`~.messages.EpisodeRequest`): env ``j`` alone, from a reset, into a
  storage of its own that grows, until the step that ends the episode;
* free-running (``parallel_steps="free"``, a block whose envs step in helper threads): each
  env advances to the target at its own pace, its next step starting as soon as its last one
  ended and the policy answered it; the policy is asked once for all the envs that ended since
  its last call, for the whole block (the rows of envs still stepping are computed and
  dropped, so it sees one batch size).

A step of envs ``envs`` is one pass through :meth:`Worker._step`: act (the policy, or a random
action), ``block.begin`` / ``block.ended`` / ``block.finish`` (the one route to the envs), then
:meth:`Worker._stepped` (per-step counters, where the loop's episode cap or a policy needs them)
and the root entries of the next step.

Settling. A step writes only what the next step needs: the root entries the policy and the env
read, the policy's outputs and version, the env's ``"next"`` entries, its reward and flags.
Everything that follows from those (TorchRL's ``done``, ``is_init``, ``step_count`` and
``episode_reward`` of a gymnasium env, the episode's return and length so far, the counters) is
written by :meth:`Worker._settle_rows` once for a run of steps, vectorised over time: before
steps are published, and where the storage wraps around. ``published`` counts settled steps handed to the driver; a driver that gives up on a
hung worker settles its steps itself (:meth:`Worker.settle`, under ``_settle_lock``, which
orders it with the worker's own settling).

The storage's rows are the driver's to read once published and until it says (in its next
request) it copied them out; the worker writes a row again only after that, and holds a
request's ``capacity`` rows, so a grant never waits for the driver. A worker reads of its loop
only a :class:`WorkerContext`, fixed once the loop is built; the driver holds a worker active
with :meth:`Worker.set_held` and starts it with :meth:`Worker.start`.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import CollectionError, EnvError, PolicyError
from ..policy import Agent, _Stopped
from ..specs import ArraySpec, NestedKey, key_parts, next_key
from .block import Block, EnvFailure
from .buffers import (_GYM_LOOP_KEYS, _LENGTH, _RETURN, _REWARD, _TERMINATED, _TRUNCATED, _VERSION, Layout, Steps,
                      check_entries)
from .messages import (EpisodeReady, EpisodeRequest, Grant, Published, Reply, Request, ResetDone, ResetRequest,
                       StopRequest, WorkerFailed)

if TYPE_CHECKING:
    from torchrl.envs.utils import ExplorationType

    from ..policy import AutobatchPolicy

__all__ = ["Worker", "WorkerContext"]

_POLL_S = 0.05
# The "next" entries of a gymnasium env the loop writes itself (TorchRL's done flags, StepCounter, RewardSum and
# InitTracker): all settled, none written by a step.
_LOOP_NEXT = tuple(next_key(k) for k in ("reward", "terminated", "truncated", "done", *_GYM_LOOP_KEYS))


def _episode_counts(rewards: np.ndarray, done: np.ndarray, step_count: np.ndarray, episode_reward: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TorchRL's ``StepCounter`` and ``RewardSum`` over ``n`` consecutive steps of ``R`` envs, vectorised.

    Args:
        rewards: ``[n, R]`` float64, each step's reward.
        done: ``[n, R]`` bool; an env done at step ``i`` starts a new episode at step ``i + 1``.
        step_count, episode_reward: ``[R]``, the root's counters before step 0.

    Returns:
        ``(count, returns, before)``, each ``[n, R]``: the root's step count of each step (the ``"next"`` one
        is ``count + 1``), the episode return after each step, and before it (the root's ``episode_reward``).
        The returns are the rewards added one at a time, in order, from the episode's start: bit for bit
        what adding each step's reward to a running float64 sum gives.
    """
    n = len(rewards)
    if n == 1:
        return step_count[None], rewards + episode_reward, episode_reward[None]
    returns = rewards.copy()
    returns[0] += episode_reward
    steps = np.arange(n)[:, None]
    ended = done[:-1]  # an episode ended before step i + 1
    before = np.empty_like(returns)
    before[0] = episode_reward
    if ended.any():
        began = np.zeros(done.shape, dtype=np.int64)  # the step each step's episode began at (0: before step 0)
        began[1:] = np.where(ended, steps[1:], 0)
        np.maximum.accumulate(began, axis=0, out=began)
        count = steps - began
        count += np.where(began == 0, step_count, 0)
        going = ~ended
        for i in range(1, n):  # one vector op a step: a running sum restarted at each episode's start
            np.add(returns[i - 1], rewards[i], out=returns[i], where=going[i - 1])
        before[1:] = np.where(ended, 0.0, returns[:-1])
    else:
        count = steps + step_count
        np.cumsum(returns, axis=0, out=returns)
        before[1:] = returns[:-1]
    return count, returns, before


class _Run:
    """Steps of some of a worker's envs into one storage, and how far they got: the worker's own (every env,
    the storage the driver reads) or an episode's (one env, a storage of its own).

    Steps ``0`` to ``t - 1`` are written, ``t0`` to ``t - 1`` not settled yet; ``envs`` are the block's envs
    (block indices), column ``i`` of the storage is ``envs[i]``'s, ``sel`` selects them in the worker's per-env
    arrays. ``episode``: the run ends at the step that ends the env's episode (its env is not reset)."""

    __slots__ = ("store", "envs", "sel", "t", "t0", "episode")

    def __init__(self, store: Steps, envs: Sequence[int], sel: slice | list[int], *, episode: bool = False) -> None:
        self.store, self.envs, self.sel = store, envs, sel
        self.t = self.t0 = 0
        self.episode = episode


@dataclass(frozen=True)
class WorkerContext:
    """What every env thread of a loop reads, fixed once the loop is built: the loop builds one, after its probe
    laid out the columns, and hands it to each :class:`Worker`; a worker holds no reference to its loop.

    ``ready``, ``stop`` and ``cut`` are the loop's own, shared by all its workers: the queue of replies
    (:mod:`lightning_rollout.loop.messages`), the loop's closing flag and the driver's "end the grant after
    this step" flag. The key lists name the columns a step reads: the policy's inputs (``input_cols``; the
    root done flags it reads, which have no column, ``input_done``) and the env's (``env_inputs``; the block
    gives a TorchRL env the root done flags it reads).
    """

    name: str
    layout: Layout
    policy: AutobatchPolicy
    ready: queue.SimpleQueue[Reply]
    stop: threading.Event
    cut: threading.Event
    input_cols: tuple[NestedKey, ...]
    input_done: tuple[NestedKey, ...]
    env_inputs: tuple[NestedKey, ...]
    action_columns: Mapping[NestedKey, ArraySpec]
    exploration_type: ExplorationType
    lookahead: bool
    validate: bool
    free_steps: bool
    max_episode_steps: int | None
    random_steps_per_env: int
    torch_threads: int  # torch.get_num_threads() of the thread that built the loop (a forward may run here)
    blocks: int  # env threads in the loop


class Worker:
    """One env thread: ``len(env_ids)`` envs stepped together, autobatched with other workers.

    Args:
        ctx: the loop's :class:`WorkerContext`.
        index: this worker's index in the loop (its replies name it).
        env_ids: the loop's ids of the block's envs.
        block: the envs (a :class:`~lightning_rollout.loop.block.Block`, built by the loop).
        first_roots: ``{env_id: (seed, root)}``, the construction's reset of each env, used by the thread's first
            reset of that env when it has the same seed (this worker's own: it pops them).
    """

    def __init__(self, ctx: WorkerContext, index: int, env_ids: list[int], *, block: Block,
                 first_roots: dict[int, tuple[int | None, dict[NestedKey, Any]]]) -> None:
        self.ctx = ctx
        self.index = index
        self.envs = block
        self._first_roots = first_roots
        self._seed: int | None = None  # the loop's seed when the thread starts (env i: seed + i)
        layout = ctx.layout
        self.env_ids = env_ids
        self.rows = len(env_ids)
        self._all = range(self.rows)
        # The storage the driver reads (a ring of ``capacity`` steps, resized by a grant) and the step counters:
        # steps 0 to t - 1 are written, t0 to t - 1 not settled yet, 0 to published - 1 handed to the driver.
        # The root entries of step t are in row t.
        self.steps = Steps(layout, self.rows, 3)
        self._ring = _Run(self.steps, self._all, slice(None))
        self._run = self._ring  # the run in progress (step_index, settle)
        self.published = 0
        self.granted = 0
        self._consumed = 0  # the driver copied out steps 0 to _consumed - 1 and _taken rows of step _consumed
        self._taken = 0
        # The envs' root counters at step t0 (a gymnasium env's StepCounter / RewardSum / InitTracker entries).
        self.step_count = np.zeros(self.rows, dtype=np.int64)
        self.episode_reward = np.zeros(self.rows, dtype=np.float64)
        self.is_init = np.ones(self.rows, dtype=bool)
        self.steps_done = np.zeros(self.rows, dtype=np.int64)  # env steps settled since start, per env
        self.random_left = np.full(self.rows, ctx.random_steps_per_env, dtype=np.int64)
        self._random_steps = ctx.random_steps_per_env > 0  # some env still acts at random
        self._out_shapes = [(k, layout.step_specs[k].shape) for k in layout.out_keys]  # what each answer row holds
        # A gymnasium env's loop entries (is_init, step_count, episode_reward) are settled, not carried by a step,
        # unless the policy reads them: then each step writes them for the next (``_count_each_step``, which the
        # loop's own episode cap needs too) into ``_count`` / ``_reward_sum``, the counts after the last step.
        loop_keys = set(_GYM_LOOP_KEYS) if layout.loop_keys else set()
        self._loop_inputs = bool(loop_keys & set(ctx.input_cols))
        self._count_each_step = self._loop_inputs or bool(loop_keys and ctx.max_episode_steps is not None)
        self._count = np.zeros(self.rows, dtype=np.int64)
        self._reward_sum = np.zeros(self.rows, dtype=np.float64)
        self._advance_pairs = [(k, src) for k, src in layout.advance if k not in loop_keys]
        self._root_keys = list(layout.keys.root)  # what a reset gives
        self._zero_done = {k: np.zeros((self.rows, *layout.keys.done[k].shape), bool) for k in layout.done_keys}
        # The columns settling writes (a free-running group's step views only these), and a free-running block's
        # rows of one policy call (``_pre``) and of the steps that ended together (``_post``).
        self._settle_keys = [_REWARD, _TERMINATED, _TRUNCATED, _RETURN, _LENGTH,
                             *((*_LOOP_NEXT, *_GYM_LOOP_KEYS) if layout.loop_keys else ())]
        self._free = ctx.free_steps and block.parallel
        self._pre = layout.allocate(self.rows, steps=True) if self._free else {}
        self._post = layout.allocate(self.rows, steps=True) if self._free else {}
        env_next_cols = {c for k, c in layout.next_columns if c != k}  # the env's "next" columns (not the shared obs)
        self._post_keys = [k for k in layout.step_specs if k in self._settle_keys or k in env_next_cols]
        self._settle_lock = threading.Lock()  # orders this thread's settling with a driver's (settle())
        self.requests: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self.agent: Agent = ctx.policy.register(self.rows, env_ids=tuple(env_ids))
        self.abandoned = False  # set by the driver when a call exceeded step_timeout
        self.pending_error: CollectionError | None = None  # raised once the steps before it are published
        # The agent counts as active while this thread works (``_working``) or while the driver
        # holds it (``_held``: a grant sent, its answer not yet consumed and decided on), so a worker
        # the driver is about to ask again is waited for: with autobatch_size == num_envs every
        # flush then has all envs (lock-step), instead of whichever thread woke first.
        self._gate = threading.Lock()
        self._working = True
        self._held = False
        self._on_envs = False  # a free-running block waiting for its envs' steps (see _run_free)
        self.thread = threading.Thread(target=self._main, name=f"lightning_rollout-{ctx.name}-env{env_ids[0]}",
                                       daemon=True)

    def start(self, seed: int | None) -> None:
        """Start the thread; its envs are first reset with ``seed + env_id`` (``None``: unseeded)."""
        self._seed = seed
        self.thread.start()

    @property
    def held(self) -> bool:
        """Whether the driver holds this worker active (a grant sent, its answer not yet decided on)."""
        return self._held

    def set_held(self, held: bool) -> None:
        """The driver holds (or stops holding) this worker active: see ``_set_activity``."""
        self._set_activity(held=held)

    def step_index(self, j: int) -> int:
        """Env ``j``'s steps so far, the unsettled steps of the run in progress counted: the index of its next
        step (any thread; a stale read is at most one step behind)."""
        run = self._run
        return int(self.steps_done[j]) + max(0, run.t - run.t0)

    # -- the thread ------------------------------------------------------------------------------
    def _main(self) -> None:
        ctx = self.ctx
        torch.set_num_threads(ctx.torch_threads)  # the creating thread's setting (a forward may run here)
        # Env steps and policy calls run without autograd, as in TorchRL's collector (its rollout is under
        # torch.no_grad()); set once for the thread, not around every call.
        torch.set_grad_enabled(False)
        try:
            for j in self._all:
                seed = None if self._seed is None else self._seed + self.env_ids[j]
                self._reset_env(j, seed, self.steps, 0, j)
            while True:
                if self.pending_error is None:  # (a failed reset after a done step: no step until it is raised)
                    t = self._ring.t
                    if t < self.granted:  # steps owed to the driver
                        self._advance(self._ring, self.granted)
                        continue
                    if ctx.lookahead and t == self.granted and t + 2 <= self._consumed + self.steps.capacity:
                        self._advance(self._ring, t + 1)  # the step ahead (double batching), published when granted
                        continue
                request = self._wait_request()
                if request is None:
                    return
                if isinstance(request, Grant):
                    self._grant(request)
                    continue
                self._raise_pending()
                if isinstance(request, ResetRequest):
                    self._delivered(request.consumed, request.taken)
                    fresh = []
                    for env_id, seed in request.items:
                        j = self.env_ids.index(env_id)
                        if not self._cut_episode(j):
                            fresh.append(env_id)
                        self._reset_env(j, seed, self.steps, self._ring.t, j)
                    ctx.ready.put(ResetDone(self.index, tuple(fresh)))
                else:
                    assert isinstance(request, EpisodeRequest)
                    self._run_episode(request)
        except _Stopped:
            return
        except BaseException as exc:  # forwarded to the driver, which re-raises it
            if not isinstance(exc, CollectionError):  # a bug of ours or a stray error: still name the envs
                j = max(self.envs.busy_env, 0)
                wrapped = EnvError(f"{type(exc).__name__}: {exc}", env_id=self.env_ids[j],
                                   step=self.step_index(j), phase="step")
                wrapped.__cause__ = exc
                exc = wrapped
            ctx.ready.put(WorkerFailed(self.index, exc))
        finally:
            self.agent.close()
            if self.envs.owned:  # the blocks of a loop with worker processes are closed by its pool
                self.envs.close()

    def _wait_request(self) -> Request | None:
        self._set_activity(working=False)
        try:
            while True:
                try:
                    request = self.requests.get(timeout=_POLL_S)
                except queue.Empty:
                    if self.ctx.stop.is_set():
                        return None
                    continue
                return None if isinstance(request, StopRequest) else request
        finally:
            self._set_activity(working=True)

    def _delivered(self, consumed: int, taken: int) -> None:
        """The driver copied out steps ``0`` to ``consumed - 1`` and ``taken`` rows of step ``consumed``."""
        self._consumed, self._taken = consumed, taken
        self.steps.drop_final(consumed)

    def _grant(self, grant: Grant) -> None:
        """Take a grant: hold its capacity (keeping the steps the driver has not copied out, and the next root
        entries), raise the end, and answer at once when the steps are written already (the step ahead). A
        failure kept for after a step is raised instead of the answer (``WorkerFailed``), that step published
        (``published``) for the driver to keep."""
        self._delivered(grant.consumed, grant.taken)
        t = self._ring.t
        if grant.capacity > self.steps.capacity:
            self.steps.resize(grant.capacity, grant.consumed, t + 1)
        self.granted = max(self.granted, grant.end)
        if self.pending_error is not None:  # a reset failed after the step written ahead: it is kept, then raised
            self.published = max(self.published, min(t, self.granted))
            self._raise_pending()
        if t >= self.granted:  # written ahead: the grant's steps are all there
            self._publish(self.granted, cut=False)

    def _publish(self, end: int, *, cut: bool) -> None:
        """Hand steps up to ``end`` (settled) to the driver."""
        self.published = max(self.published, end)
        if cut:
            self.granted = end
        self.ctx.ready.put(Published(self.index, end))

    # -- the one step driver -----------------------------------------------------------------------
    def _advance(self, run: _Run, target: int) -> None:
        """Write steps of ``run`` until every env has ``target`` of them, or, for an episode, until the step that
        ends it (see the module docs); the worker's own steps are published when they were granted. Stops early
        after the step in progress when the driver cuts a grant, and raises when the loop is closing or a step
        failed (its settled steps are published for the driver first, without a reply)."""
        ctx = self.ctx
        cut, stop = ctx.cut, ctx.stop
        granted = run is self._ring and target <= self.granted
        stopped = False
        self._run = run
        try:
            if self._free and granted and target - run.t > 1:  # (a step ahead is one step: lock-step)
                stopped = self._run_free(target)
            else:
                store = run.store
                while run.t < target:
                    t = run.t
                    done = self._step(run, t)
                    run.t = t + 1
                    if run.episode:
                        if done[0]:
                            break
                    else:
                        self._reset_done(done, store, t)
                    if run.t % store.capacity == 0:  # the storage wraps around: settle in runs of consecutive rows
                        with self._settle_lock:
                            self._settle_locked(run)
                    if self.pending_error is not None:
                        break
                    if granted and cut.is_set():
                        stopped = True
                        break
                    if stop.is_set():  # the loop is closing (an error elsewhere, Ctrl-C): leave within one step
                        raise _Stopped()
        finally:  # settled, and the granted ones kept for the driver whatever happened (it reads ``published``)
            with self._settle_lock:
                self._settle_locked(run)
                if run is self._ring:
                    self.published = max(self.published, min(run.t0, self.granted))
                self._run = self._ring
        if granted:
            self._raise_pending()  # instead of the answer: the driver keeps the published steps (see finally)
            self._publish(run.t, cut=stopped)

    def _step(self, run: _Run, t: int) -> np.ndarray:
        """Step ``t`` of ``run``'s envs (all at step ``t`` of its storage): act, step the envs, write the root
        entries of step ``t + 1`` (the env's observations are written there by the env itself). Returns the
        done flags (those envs are not reset yet)."""
        ctx, store, envs, sel = self.ctx, run.store, run.envs, run.sel
        row, nxt = store.row(t), store.row(t + 1)
        self._act(row, envs)
        block = self.envs
        try:
            block.begin({k: row[k] for k in ctx.env_inputs}, envs)
            block.ended(ctx.stop, every=True)
            failure = block.finish(envs, {k: (nxt if c == k else row)[c] for k, c in ctx.layout.next_columns},
                                   row[_REWARD], row[_TERMINATED], row[_TRUNCATED])[1]
        except EnvFailure as exc:
            failure = exc
        if failure is not None:
            raise self._failure_error(failure) from failure.cause
        done = self._stepped(row, sel)
        store.ensure(t + 1)
        nxt = store.row(t + 1)  # (views again: ``ensure`` may have grown an episode's storage)
        for k, src in self._advance_pairs:
            nxt[k][...] = row[src]
        if self._loop_inputs:  # the policy reads them at the next step
            nxt["is_init"][...] = False
            nxt["step_count"][:, 0] = self._count[sel]
            nxt["episode_reward"][:, 0] = self._reward_sum[sel]
        return done

    def _stepped(self, row: Mapping[NestedKey, np.ndarray], sel: slice | list[int] | np.ndarray) -> np.ndarray:
        """What a step does once its results are in ``row`` (envs ``sel`` of the worker's arrays): the per-step
        counters when kept (the loop's episode cap truncates here). Returns the done flags."""
        terminated, truncated = row[_TERMINATED], row[_TRUNCATED]
        if not self._count_each_step:
            return terminated | truncated
        count = self._count[sel] + 1
        reward_sum = self._reward_sum[sel] + row[_REWARD]
        cap = self.ctx.max_episode_steps
        if cap is not None:
            truncated |= count >= cap
        done = terminated | truncated
        self._count[sel] = np.where(done, 0, count)  # a done env's episode starts again (its reset's root)
        self._reward_sum[sel] = np.where(done, 0.0, reward_sum)
        return done

    def _reset_done(self, done: np.ndarray, store: Steps, t: int) -> None:
        """Reset the block's envs whose step ``t`` was done (their root entries into row ``t + 1`` of ``store``,
        their final observations kept first).

        A reset that fails after a done step does not lose that step: the error is kept in
        ``pending_error`` and raised once the step is published."""
        envs = done.nonzero()[0].tolist()  # (ndarray.any and np.flatnonzero cost more, through Python)
        if not envs:
            return
        try:
            roots = self.envs.reset_many(envs, self.ctx.stop)  # all at once: one call for a batched env
        except EnvFailure as failure:  # that env has no next root: nothing more is stepped before it is raised
            self.pending_error = self._failure_error(failure)
            return
        store.keep_final(t, envs)
        nxt = store.row(t + 1)
        for j, root in zip(envs, roots):
            self._write_root(root, nxt, j)

    def _reset_env(self, j: int, seed: int | None, store: Steps, t: int, col: int, *, counters: bool = True
                   ) -> None:
        """Reset env ``j``, writing its root entries into column ``col`` of row ``t`` of ``store`` (the step that
        starts its episode; the observations step ``t - 1`` ended with are kept first). ``counters``: zero its
        counters too (a reset outside a run; within one, settling does)."""
        ctx = self.ctx
        # the construction's reset, if still valid (the loop keeps each env's until its thread starts it)
        first = self._first_roots.pop(self.env_ids[j], None) if self._first_roots else None
        if first is not None and first[0] == seed:
            root = first[1]
            problem = check_entries(root, ctx.layout.checked_root) if ctx.validate else None
            if problem is not None:
                raise EnvError(problem, env_id=self.env_ids[j], step=self.step_index(j), phase="check")
        else:
            try:
                root = self.envs.reset(j, seed, ctx.stop)
            except EnvFailure as failure:
                raise self._failure_error(failure) from failure.cause
        if t > 0:
            store.keep_final(t - 1, (col,))
        self._write_root(root, store.row(t), col)
        if counters:
            self.step_count[j] = 0
            self.episode_reward[j] = 0.0
            self.is_init[j] = True
            self._count[j] = 0
            self._reward_sum[j] = 0.0

    def _write_root(self, root: Mapping[NestedKey, Any], row: dict[NestedKey, np.ndarray], col: int) -> None:
        """A reset's root entries into column ``col`` of ``row``; the policy's carried entries start from zeros,
        as a primer's."""
        for k in self._root_keys:
            row[k][col] = root[k]
        for k in self.ctx.layout.policy_carried:
            row[k][col] = 0

    # -- acting ------------------------------------------------------------------------------------
    def _act(self, row: dict[NestedKey, np.ndarray], envs: Sequence[int]) -> None:
        """Fill the policy outputs of ``row`` (one row per env of ``envs``, which step together: all or none
        of them are still on random steps)."""
        if self._random_steps and self.random_left[envs[0]] > 0:
            self._act_random(row, 0, len(envs), envs)
        else:
            self._act_policy(row, envs)

    def _act_random(self, cols: dict[NestedKey, np.ndarray], r0: int, rows: int, envs: Sequence[int]) -> None:
        """A uniformly random action for each of envs ``envs`` in rows ``r0:r0+rows`` (its other outputs
        zero, its policy version -1); counts down their random steps."""
        ctx = self.ctx
        for k in ctx.layout.out_keys:
            cols[k][r0:r0 + rows] = 0
        for r, j in zip(range(r0, r0 + rows), envs):
            try:
                sample = self.envs.random_action(j, ctx.action_columns, ctx.stop)
            except EnvFailure as failure:
                raise self._failure_error(failure) from failure.cause
            for k, v in sample.items():
                cols[k][r] = v
            self.random_left[j] -= 1
        cols[_VERSION][r0:r0 + rows] = -1
        self._random_steps = bool(self.random_left.any())

    def _act_policy(self, cols: dict[NestedKey, np.ndarray], envs: Sequence[int]) -> None:
        """The policy's outputs for ``cols`` (one row per env of ``envs``), one request."""
        ctx = self.ctx
        inputs = {k: cols[k] for k in ctx.input_cols}
        for k in ctx.input_done:  # root done flags: false (no column)
            inputs[k] = self._zero_done[k][:len(envs)]
        try:
            answer = self.agent.act(inputs, exploration_type=ctx.exploration_type, stop=ctx.stop)
        except PolicyError as exc:  # name this env and its step (the shared error names only the batch)
            raise PolicyError(exc.reason, env_ids=exc.env_ids or tuple(self.env_ids[j] for j in envs),
                              step=self.step_index(envs[0])) from exc
        outputs, a, b = answer.outputs, answer.start, answer.stop
        for k, shape in self._out_shapes:
            value = outputs.get(k)
            if value is None or value.shape[1:] != shape:
                got = "nothing" if value is None else f"shape {tuple(value.shape[1:])}"
                raise PolicyError(f"the policy returned {got} for {k!r}; it returned shape {shape} per row when "
                                  "probed at construction", env_ids=tuple(self.env_ids[j] for j in envs),
                                  step=self.step_index(envs[0]))
            cols[k][...] = value if a == 0 and b == len(value) else value[a:b]
        cols[_VERSION][...] = answer.version

    def _failure_error(self, failure: EnvFailure) -> CollectionError:
        """The user-facing error of a failed env call, its cause chained: named by the env's global id and step
        (and its worker process); an invalid action is the policy's fault."""
        j = failure.j
        env_id, step = self.env_ids[j], self.step_index(j)
        where = "" if failure.process is None else f" (in worker process {failure.process})"
        error: CollectionError = (
            PolicyError(f"invalid action for env {env_id}: {failure}", env_ids=(env_id,), step=step)
            if failure.kind == "action"
            else EnvError(f"{failure}{where}", env_id=env_id, step=step, phase=failure.phase))
        error.__cause__ = failure.cause
        return error

    def _raise_pending(self) -> None:
        """Raise the error of a reset that failed after a done step (once that step is published)."""
        error, self.pending_error = self.pending_error, None
        if error is not None:
            raise error

    # -- settling ----------------------------------------------------------------------------------
    def _settle_rows(self, cols: Mapping[NestedKey, np.ndarray], sel: slice | list[int] | np.ndarray, n: int
                     ) -> None:
        """Write the bookkeeping of ``n`` consecutive steps of envs ``sel`` whose rows are ``cols`` (``[n, m,
        ...]`` views), vectorised over them: the episode's return and length so far, a gymnasium env's done
        flags, ``is_init``, ``step_count`` and ``episode_reward`` (root and ``"next"``, exactly as adding the
        rewards step by step gives them), and this worker's counters."""
        rewards, terminated, truncated = cols[_REWARD][:n], cols[_TERMINATED][:n], cols[_TRUNCATED][:n]
        done = terminated | truncated
        is_init_before = self.is_init[sel]
        count, returns, before = _episode_counts(rewards, done, self.step_count[sel].copy(),
                                                 self.episode_reward[sel].copy())
        length = count + 1  # the "next" step count: the episode's length so far
        if self.ctx.layout.loop_keys:
            cols["next", "reward"][:n, :, 0] = rewards
            cols["next", "terminated"][:n, :, 0] = terminated
            cols["next", "truncated"][:n, :, 0] = truncated
            cols["next", "done"][:n, :, 0] = done
            cols["next", "is_init"][:n] = False
            cols["next", "step_count"][:n, :, 0] = length
            cols["next", "episode_reward"][:n, :, 0] = returns
            is_init = cols["is_init"][:n, :, 0]
            is_init[0] = is_init_before
            is_init[1:] = done[:-1]
            cols["step_count"][:n, :, 0] = count
            cols["episode_reward"][:n, :, 0] = before
        cols[_RETURN][:n] = returns
        cols[_LENGTH][:n] = length
        last = done[-1]
        self.steps_done[sel] += n
        self.step_count[sel] = np.where(last, 0, length[-1])
        self.episode_reward[sel] = np.where(last, 0.0, returns[-1])
        self.is_init[sel] = last

    def _settle_locked(self, run: _Run) -> None:
        store = run.store
        for a, b in store.spans(run.t0, run.t):
            self._settle_rows({k: store.cols[k][a:b] for k in self._settle_keys}, run.sel, b - a)
            run.t0 += b - a

    def settle(self, granted: int) -> None:
        """Settle the steps written so far and publish them up to ``granted``, the driver's last grant (which
        this worker may not have read yet: a step it took ahead counts once granted), without a reply. A
        driver whose call failed (the loop closed, or this worker's env hung) calls it to keep the worker's
        complete steps. Thread-safe."""
        with self._settle_lock:
            ring = self._ring
            self._settle_locked(ring)
            self.published = max(self.published, min(ring.t0, max(self.granted, granted)))

    # -- episodes, resets ------------------------------------------------------------------------------
    def _cut_episode(self, j: int) -> bool:
        """Env ``j``'s running episode ends at its last step when the driver has not copied that step out yet:
        it is marked truncated (and done). Returns whether it was (else the env's next steps start a new
        trajectory for the driver)."""
        t = self._ring.t - 1
        if t < self._consumed or (t == self._consumed and j < self._taken):
            return False
        row = self.steps.row(t)
        if not (row[_TERMINATED][j] or row[_TRUNCATED][j]):
            row[_TRUNCATED][j] = True
            for k in self.ctx.layout.done_keys:
                if key_parts(k)[-1] in ("done", "truncated"):
                    row[next_key(k)][j] = True
        return True

    def _run_episode(self, request: EpisodeRequest) -> None:
        """A fresh episode on one env alone, into a storage of its own; the others of this worker wait."""
        ctx = self.ctx
        self._delivered(request.consumed, request.taken)
        j = self.env_ids.index(request.env_id)
        fresh = not self._cut_episode(j)
        run = _Run(Steps(ctx.layout, 1, 64, grow=True), (j,), [j], episode=True)
        self.agent.set_rows(1)
        try:
            self._reset_env(j, None, run.store, 0, 0)
            self._advance(run, sys.maxsize)
        finally:
            self.agent.set_rows(self.rows)
        # Without an undelivered step to end it, the driver starts a new trajectory for the env's next steps.
        ctx.ready.put(EpisodeReady(self.index, request.request_index, request.env_id, run.store, run.t, fresh))
        self._reset_env(j, None, self.steps, self._ring.t, j)

    # -- free-running blocks -------------------------------------------------------------------------
    def _run_free(self, target: int) -> bool:
        """:meth:`_advance` for a block whose envs step in helper threads: every env runs free to ``target``.

        Each env's next step starts as soon as its last one ended and the policy answered it; the policy is
        asked once for all the envs that ended since its last call. So a slow step holds back only its own
        env, not the block. Env ``j``'s step goes to its own row ``t_j`` of the storage. When the driver cuts,
        envs stop at the step the furthest one reaches (the others catch up: every env delivers the same
        number of steps). When an env fails (its step, its checks, or its reset after a done step), it stops
        there and the others catch up to it before the error is raised, so its complete steps are delivered;
        a policy error is raised at once. Each group of steps that ended together settles at once. Returns
        whether the driver cut the run."""
        ctx, layout, store = self.ctx, self.ctx.layout, self.steps
        envs = self.envs
        cut, stop = ctx.cut, ctx.stop
        ring = self._ring
        t = np.full(self.rows, ring.t, dtype=np.int64)  # each env's next step
        stopped = cut.is_set()  # (``target`` is a grant: see _advance)
        end = ring.t if stopped else target  # every env stops at this step
        flying = np.zeros(self.rows, dtype=bool)
        pre, post = self._pre, self._post
        park = ctx.blocks > 1  # let other blocks' requests flush while this one waits on its envs
        cols = store.cols
        ready = list(self._all)
        try:
            while True:
                ready = [j for j in ready if t[j] < end]
                if ready:
                    self._start_free(pre, t, ready)
                    flying[ready] = True
                if not flying.any():
                    break
                if park:
                    self._set_activity(on_envs=True)
                try:
                    ended = sorted(envs.ended(stop))
                finally:
                    if park:
                        self._set_activity(on_envs=False)
                flying[ended] = False
                m = len(ended)
                written, failure = envs.finish(ended, {k: post[c][:m] for k, c in layout.next_columns},
                                               post[_REWARD][:m], post[_TERMINATED][:m], post[_TRUNCATED][:m])
                if failure is not None:  # that env stops here; the others catch up to it
                    self.pending_error = self.pending_error or self._failure_error(failure)
                    end = min(end, int(t[failure.j]))
                m = len(written)
                if m:
                    idx = np.asarray(written, dtype=np.int64)
                    rows = t[idx] % store.capacity
                    done = self._stepped({k: post[k][:m] for k in (_REWARD, _TERMINATED, _TRUNCATED)}, idx)
                    self._settle_rows({k: post[k][None, :m] for k in self._settle_keys}, idx, 1)
                    for k in self._post_keys:
                        cols[k][rows, idx] = post[k][:m]
                    nxt = (t[idx] + 1) % store.capacity
                    for k in layout.shared:
                        cols[k][nxt, idx] = post[k][:m]
                    for k, src in self._advance_pairs:  # (each env's row ``rows`` holds its step's results now)
                        cols[k][nxt, idx] = cols[src][rows, idx]
                    if self._loop_inputs:
                        cols["is_init"][nxt, idx] = False
                        cols["step_count"][nxt, idx, 0] = self._count[idx]
                        cols["episode_reward"][nxt, idx, 0] = self._reward_sum[idx]
                    t[idx] += 1
                    for i in np.flatnonzero(done):
                        j = written[i]
                        try:
                            self._reset_env(j, None, store, int(t[j]), j, counters=False)
                        except EnvError as exc:  # its done step is kept: the others catch up to it
                            self.pending_error = self.pending_error or exc
                            end = min(end, int(t[j]))
                ready = list(written)  # next: their next steps (those still short of the end)
                self.published = max(self.published, min(int(t.min()), target))
                if cut.is_set() and not stopped:  # stop where the furthest env gets to
                    stopped = True
                    end = int((t + flying).max())
                if stop.is_set():
                    raise _Stopped()
        finally:
            ring.t = ring.t0 = int(t.min())
        return stopped

    def _start_free(self, pre: dict[NestedKey, np.ndarray], t: np.ndarray, ready: list[int]) -> None:
        """Act for envs ``ready`` and start their steps (see :meth:`_run_free`); row ``j`` of ``pre`` is env
        ``j``. The policy is asked for the whole block, the rows of envs still stepping computed and dropped: it
        sees the same batch size on every call, as in lock-step (what a compiled or CUDA-graphed policy, or one
        that squeezes its batch, needs)."""
        cols, random_left, capacity = self.steps.cols, self.random_left, self.steps.capacity
        rows = t % capacity
        everyone = np.arange(self.rows)
        for k in self.ctx.layout.carried:  # every env's root entries, each from its own step's row
            pre[k][...] = cols[k][rows, everyone]
        if any(random_left[j] <= 0 for j in ready):
            self._act_policy(pre, self._all)
        for j in ready:
            if random_left[j] > 0:
                self._act_random(pre, j, 1, (j,))
        idx = np.asarray(ready)
        for k in (*self.ctx.layout.out_keys, _VERSION):
            cols[k][rows[idx], idx] = pre[k][idx]
        try:
            self.envs.begin({k: pre[k][idx] for k in self.ctx.env_inputs}, ready)
        except EnvFailure as failure:
            raise self._failure_error(failure) from failure.cause

    def _set_activity(self, working: bool | None = None, held: bool | None = None,
                      on_envs: bool | None = None) -> None:
        """Update the reasons to count as active (any thread); the agent follows ``(working or held)
        and not on_envs``: a free-running block waiting on its envs (``on_envs``) asks nothing of the
        policy, so other blocks' requests need not wait for it, held or not."""
        with self._gate:
            if working is not None:
                self._working = working
            if held is not None:
                self._held = held
            if on_envs is not None:
                self._on_envs = on_envs
            if (self._working or self._held) and not self._on_envs:
                self.agent.unpark()
            else:
                self.agent.park()
