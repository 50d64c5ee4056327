"""The env-side loop: one thread per block of ``envs_per_thread`` envs.

An env thread (``lightning_rollout-<name>-env<i>``, a daemon) runs a :class:`Worker`
that owns its envs' running state: each env's current root entries (``cur``,
TorchRL's carrier as one row per env), counters, two staging slots, and the envs
themselves: an :class:`~lightning_rollout.loop.block.EnvBlock` in this process
(stepped by this thread, or by its helper threads with ``parallel_steps``), or, with
worker processes, a :class:`~lightning_rollout.loop.process.RemoteEnvs` block in a
worker process, or a :class:`~lightning_rollout.loop.process.RemoteGroup` of parts in
several processes (the main process's share, a
:class:`~lightning_rollout.loop.process.LocalEnvs`, among them). All take the same
calls. It answers the driver's requests (:mod:`lightning_rollout.loop.messages`): a
step of the whole block into a slot, a quota of steps straight into the driver's
batch, a reset, or one fresh episode of one env. What it reads of its loop is a
:class:`WorkerContext`, fixed once the loop is built; the driver holds a worker
active with :meth:`Worker.set_held` and starts it with :meth:`Worker.start`. Each step asks the autobatching policy for the block's
rows, steps the envs, writes the transition into its columns with one vectorised
write per key, and advances the envs' root entries as TorchRL's ``step_mdp`` does: after
a step of the whole block, the next step copies its root rows straight from the
``"next"`` rows that step wrote (``Worker._carry``), one copy a step; ``cur``, the
envs' root entries held apart, is brought up to date only when something else reads
it (a step of part of the block, a reset) and before a quota's batch is reported.

With ``parallel_steps="free"`` a block stepped in helper threads runs its envs free
within a quota: each env's next step starts as soon as its last one ended and the
policy answered it, so a slow step holds back its own env only
(:meth:`Worker._run_quota_free`). Its other requests step the block in lock-step.

Runs and settling. A step writes only what the next step needs: the root entries the
policy and the env read, the policy's outputs and version, the env's ``"next"``
entries, and its rewards and flags into the run's scratch rows. Everything that
follows from those (TorchRL's ``done``, ``is_init``, ``step_count`` and
``episode_reward`` of a gymnasium env, the env ids, the statistics column of events,
the counters) is written by :meth:`Worker._settle` once for a whole run of steps,
vectorised over time: a quota settles when it ends (cut, failed or stopped too), a
single step (a slot, an episode's step, a free-running env's step) at once.
``quota_end`` counts settled steps only; a driver that
gives up on a hung worker settles its steps itself (:meth:`Worker.settle`, under
``_settle_lock``, which orders it with the worker's own settling). The observations of
an in-process gymnasium block are checked for NaN once a quota, at settling, the
earliest NaN failing its step as if checked there (an error raised later in the quota
gives way to it).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from ..envs import EnvAdapter
from ..errors import CollectionError, EnvError, PolicyError
from ..policy import Agent, _Stopped
from ..specs import ArraySpec, NestedKey, next_key
from .block import Block, EnvBlock, EnvFailure
from .buffers import (_ENV_ID, _GYM_LOOP_KEYS, _S_DONE, _S_LENGTH, _S_RETURN, _S_REWARD, _S_TERMINATED,
                      _S_TRUNCATED, _STATS, _TRAJ, _VERSION, Layout, check_entries)
from .messages import (EpisodeReady, EpisodeRequest, QuotaEnded, QuotaRequest, Reply, Request, ResetDone,
                       ResetRequest, StepReady, StepRequest, StopRequest, WorkerFailed)

if TYPE_CHECKING:
    from torchrl.envs.utils import ExplorationType

    from ..policy import AutobatchPolicy
    from .process import RemoteEnvs, RemoteGroup

__all__ = ["Worker", "WorkerContext"]

_POLL_S = 0.05
# A quota settles its steps (and looks for NaN in their observations) at least this often: it bounds the
# scratch rows of a run and how long a NaN observation goes unreported.
_SETTLE_EVERY = 128
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
    """Steps of a worker's envs written and not settled yet (see :meth:`Worker._settle`).

    Step ``t`` of the run's envs is in ``cols[k][t]`` (time-major columns: one row per env, row ``r`` for
    env ``envs[r]``), its rewards and flags in row ``t - t0`` of ``rewards``, ``terminated`` and
    ``truncated`` (scratch rows for ``steps`` steps, reused once settled). Steps ``t0`` to ``t - 1`` are
    written and not settled; ``step_count``, ``episode_reward`` and ``is_init`` are the envs' root counters
    and flag at step ``t0``. With per-step counters (``Worker._count_each_step``), ``count`` and
    ``reward_sum`` run along with the steps.
    """

    __slots__ = ("cols", "envs", "sel", "t0", "t", "rewards", "terminated", "truncated", "step_count",
                 "episode_reward", "is_init", "count", "reward_sum", "quota", "defer_nan")

    def __init__(self, worker: Worker, cols: dict[NestedKey, np.ndarray], t: int, steps: int,
                 envs: Sequence[int], *, quota: bool = False,
                 results: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
        self.cols, self.envs = cols, envs
        rows = len(envs)
        # every env of the block, in order (a range): counters and ``cur`` are then used without indexing
        self.sel: slice | list[int] = slice(None) if isinstance(envs, range) and rows == worker.rows else list(envs)
        if results is None:
            results = (np.empty((steps, rows)), np.empty((steps, rows), dtype=bool),
                       np.empty((steps, rows), dtype=bool))
        self.rewards, self.terminated, self.truncated = results  # [steps, rows] each, given or to be written
        self.quota = quota  # a quota's run: its done envs are reset before it settles
        self.defer_nan = quota and worker._nan_later  # its observations are looked for NaN when it settles
        self.restart(worker, t)

    def restart(self, worker: Worker, t: int) -> None:
        """Begin anew at step ``t`` (nothing unsettled), from the worker's counters as they are now; the
        scratch rows are reused (a slot's run, one step at a time). A run of several steps keeps copies of
        them (resets within it zero the worker's); any other run settles its step before a reset, so views
        of the worker's own do."""
        self.t0 = self.t = t
        sel = self.sel
        self.step_count = worker.step_count[sel]  # copies when ``sel`` indexes, else views
        self.episode_reward = worker.episode_reward[sel]
        is_init = worker.cur.get("is_init") if worker.ctx.layout.loop_keys else None
        self.is_init = None if is_init is None else is_init[sel, 0]
        if isinstance(sel, slice) and self.quota:
            self.step_count, self.episode_reward = self.step_count.copy(), self.episode_reward.copy()
            self.is_init = None if self.is_init is None else self.is_init.copy()
        self.count = self.step_count.copy() if worker._count_each_step else None
        self.reward_sum = self.episode_reward.copy() if worker._count_each_step else None


@dataclass(frozen=True)
class WorkerContext:
    """What every env thread of a loop reads, fixed once the loop is built: the loop builds one, after its probe
    laid out the columns, and hands it to each :class:`Worker`; a worker holds no reference to its loop.

    ``ready``, ``stop`` and ``cut`` are the loop's own, shared by all its workers: the queue of replies
    (:mod:`lightning_rollout.loop.messages`), the loop's closing flag and the driver's "end the quota after
    this step" flag. The key lists name the columns a step reads: the policy's inputs (``input_cols``; the
    root done flags it reads, which have no column, ``input_done``) and the env's (``env_inputs``,
    ``env_input_done``).
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
    env_input_done: tuple[NestedKey, ...]
    action_columns: Mapping[NestedKey, ArraySpec]
    exploration_type: ExplorationType
    lookahead: bool
    validate: bool
    parallel_steps: bool
    free_steps: bool
    max_episode_steps: int | None
    step_timeout: float | None
    random_steps_per_env: int
    torch_threads: int  # torch.get_num_threads() of the thread that built the loop (a forward may run here)
    blocks: int  # env threads in the loop


class Worker:
    """One env thread: ``len(envs)`` envs stepped together, autobatched with other workers.

    Args:
        ctx: the loop's :class:`WorkerContext`.
        index: this worker's index in the loop (its replies name it).
        env_ids: the loop's ids of the block's envs.
        first_roots: ``{env_id: (seed, root)}``, the construction's reset of each env, used by the thread's first
            reset of that env when it has the same seed (this worker's own: it pops them).
        adapters, remote: the envs, in this process (stepped by this thread) or in worker processes.
    """

    def __init__(self, ctx: WorkerContext, index: int, env_ids: list[int], *,
                 first_roots: dict[int, tuple[int | None, dict[NestedKey, Any]]],
                 adapters: list[EnvAdapter] | None = None, remote: RemoteEnvs | RemoteGroup | None = None) -> None:
        self.ctx = ctx
        self.index = index
        self._first_roots = first_roots
        self._seed: int | None = None  # the loop's seed when the thread starts (env i: seed + i)
        layout = ctx.layout
        # The block's envs: in-process (stepped by this thread) or in worker processes.
        self.envs: Block = remote if remote is not None else EnvBlock(
            adapters or [], validate=ctx.validate, checked_next=layout.checked_next if ctx.validate else {},
            checked_root=layout.checked_root if ctx.validate else {},
            zero_done={k: layout.keys.done[k] for k in ctx.env_input_done}, parallel=ctx.parallel_steps,
            name=ctx.name, env_ids=env_ids, watched=ctx.step_timeout is not None)
        self.env_ids = env_ids
        self.env_id_array = np.asarray(env_ids, dtype=np.int64)
        self.rows = len(env_ids)
        self.slots = [layout.allocate(self.rows), layout.allocate(self.rows)]
        # A block stepped in helper threads runs its envs free within a quota (_run_quota_free): the
        # rows of one policy call, the rows of the steps that ended together, and the entries each
        # writes into the batch (known before the step, and the step's result).
        self._free_cols: tuple[dict[NestedKey, np.ndarray], dict[NestedKey, np.ndarray]] | tuple[()] = ()
        self._pre_keys: list[NestedKey] = []
        self._post_keys: list[NestedKey] = []
        if ctx.free_steps and self.envs.parallel:
            self._free_cols = (layout.allocate(self.rows), layout.allocate(self.rows))
            post = {next_key(k) for k in layout.keys.next} - set(layout.out_keys) | {_ENV_ID, _STATS}
            self._post_keys = [k for k in layout.specs if k in post]
            self._pre_keys = [k for k in layout.specs if k not in post and k != _TRAJ]
        # Each env's current root entries (TorchRL's carrier, one row per env); root done flags are false.
        self.cur = {k: np.zeros((self.rows, *s.shape), s.dtype) for k, s in layout.carried.items()}
        # After a step of the whole block the advanced entries are not copied into ``cur``: ``_carry`` holds
        # views of the rows that step wrote (its "next" entries) and the next step's root rows are copied
        # from there, one copy a step. While ``_carry`` is set it, not ``cur``, holds those entries;
        # ``_settle_carry`` copies it into ``cur`` before anything else reads or writes them, and before a
        # batch is handed over.
        # A gymnasium env's loop entries (is_init, step_count, episode_reward) are not advanced with the others:
        # settling carries them into ``cur`` (or, with ``_count_each_step``, each step does).
        loop_keys = set(_GYM_LOOP_KEYS) if layout.loop_keys else set()
        advance = [(k, src) for k, src in layout.advance if k not in loop_keys]
        self._advance = advance
        self._carry: dict[NestedKey, np.ndarray] | None = None
        self.zero_done = {k: np.zeros((self.rows, *layout.keys.done[k].shape), bool) for k in layout.done_keys}
        self.step_count = np.zeros(self.rows, dtype=np.int64)
        self.episode_reward = np.zeros(self.rows, dtype=np.float64)
        self.steps_done = np.zeros(self.rows, dtype=np.int64)  # env steps since start, per env (settled steps)
        self.random_left = np.full(self.rows, ctx.random_steps_per_env, dtype=np.int64)
        self._random_steps = ctx.random_steps_per_env > 0  # some env still acts at random
        self._out_shapes = [(k, layout.specs[k].shape) for k in layout.out_keys]  # what each answer row holds
        # What a step writes and what settling does (see the module docs). A gymnasium env's loop entries are
        # settled, and carried into ``cur`` there, unless the policy reads them: then a step keeps them in
        # ``cur`` itself (``_count_each_step``, which the loop's own episode cap needs too).
        self._loop_inputs = bool(loop_keys & set(ctx.input_cols))
        self._count_each_step = self._loop_inputs or bool(loop_keys and ctx.max_episode_steps is not None)
        settled = {_ENV_ID, _STATS, _TRAJ}
        if loop_keys:
            settled |= set(_LOOP_NEXT) | (set() if self._loop_inputs else loop_keys)
        self._step_keys = [k for k in layout.specs if k not in settled]
        # the columns _settle writes (a free-running quota's run of one step views only these)
        self._settle_keys = [k for k in layout.specs
                             if k in (_ENV_ID, _STATS) or (loop_keys and (k in _LOOP_NEXT or k in loop_keys))]
        self._load_keys = [k for k in self.cur if k not in settled]  # root entries a step copies from ``cur``
        self._root_keys = list(layout.keys.root)  # what a reset gives
        self._slot_runs: list[_Run] = []  # each slot's run of one step (its columns as one time step), reused
        # NaN in an in-process gymnasium block's observations is looked for once a quota (see _settle).
        self._nan_later = self.envs.nan_checked
        self._run: _Run | None = None  # the lock-step run in progress (its steps are not settled yet)
        self._settle_lock = threading.Lock()  # orders this thread's settling with a driver's (settle())
        self.requests: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self.agent: Agent = ctx.policy.register(self.rows, env_ids=tuple(env_ids))
        self.quota_end = 0  # after a quota request: the first time index it did not write
        self.abandoned = False  # set by the driver when a call exceeded step_timeout
        self.pending_error: CollectionError | None = None  # raised once the steps before it are delivered
        # The agent counts as active while this thread works (``_working``) or while the driver
        # holds it (``_held``: a step request sent, its answer not yet consumed and decided on), so
        # a worker the driver is about to ask again is waited for: with autobatch_size == num_envs
        # every flush then has all envs (lock-step), instead of whichever thread woke first.
        self._gate = threading.Lock()
        self._working = True
        self._held = False
        self._on_envs = False  # a free-running block waiting for its envs' steps (see _run_quota_free)
        self._slot_runs = [_Run(self, {k: v[None] for k, v in slot.items()}, 0, 1, range(self.rows))
                           for slot in self.slots]
        self.thread = threading.Thread(target=self._main, name=f"lightning_rollout-{ctx.name}-env{env_ids[0]}",
                                       daemon=True)

    def start(self, seed: int | None) -> None:
        """Start the thread; its envs are first reset with ``seed + env_id`` (``None``: unseeded)."""
        self._seed = seed
        self.thread.start()

    @property
    def held(self) -> bool:
        """Whether the driver holds this worker active (a request sent, its answer not yet decided on)."""
        return self._held

    def set_held(self, held: bool) -> None:
        """The driver holds (or stops holding) this worker active: see ``_set_activity``."""
        self._set_activity(held=held)

    # -- helpers ---------------------------------------------------------------------
    # What the driver's step_timeout check reads (the env call in progress, if any).
    @property
    def busy_since(self) -> float:
        """``perf_counter()`` when the env call in progress started; 0.0 when none is."""
        return self.envs.busy_since

    @property
    def busy_env(self) -> int:
        return self.envs.busy_env

    @property
    def busy_phase(self) -> str:
        return self.envs.busy_phase

    def _reset_env(self, j: int, seed: int | None = None) -> None:
        ctx = self.ctx
        if self._carry is not None:
            self._settle_carry()
        # the construction's reset, if still valid (the loop keeps each env's until its thread starts it)
        first = self._first_roots.pop(self.env_ids[j], None) if self._first_roots else None
        if first is not None and first[0] == seed:
            root = first[1]
            self._check(j, root, ctx.layout.checked_root)
        else:
            try:
                root = self.envs.reset(j, seed, ctx.stop)
            except EnvFailure as failure:
                raise self._failure_error(failure) from failure.cause
        cur = self.cur
        for k in self._root_keys:
            cur[k][j] = root[k]
        for k in ctx.layout.policy_carried:  # recurrent state and kept outputs start from zeros, as a primer's
            cur[k][j] = 0
        self.step_count[j] = 0
        self.episode_reward[j] = 0.0

    def _check(self, j: int, values: dict[NestedKey, Any], specs: dict[NestedKey, ArraySpec]) -> None:
        """Every entry of ``specs`` is in ``values`` with its shape and dtype, without NaN."""
        if self.ctx.validate:
            problem = check_entries(values, specs)
            if problem is not None:
                raise EnvError(problem, env_id=self.env_ids[j], step=self.step_index(j), phase="check")

    def step_index(self, j: int) -> int:
        """Env ``j``'s steps so far, the unsettled steps of the quota in progress counted: the index of its
        next step (any thread; a stale read is at most one step behind)."""
        run = self._run
        if run is None:
            return int(self.steps_done[j])
        return int(self.steps_done[j]) + run.t - run.t0

    def _act(self, cols: dict[NestedKey, np.ndarray], envs: Sequence[int]) -> None:
        """Fill the policy outputs of ``cols`` (one row per env of ``envs``, which step together: all or none
        of them are still on random steps)."""
        if self._random_steps and self.random_left[envs[0]] > 0:
            self._act_random(cols, 0, len(envs), envs)
        else:
            self._act_policy(cols, envs)

    def _act_random(self, cols: dict[NestedKey, np.ndarray], r0: int, rows: int, envs: Sequence[int]) -> None:
        """A uniformly random action for each of envs ``envs`` in rows ``r0:r0+rows`` (its other outputs
        zero, its policy version -1); counts down their random steps."""
        ctx = self.ctx
        for k in ctx.layout.out_keys:
            cols[k][r0:r0 + rows] = 0
        for r, j in zip(range(r0, r0 + rows), envs):
            sample = self.envs.random_action(j, ctx.action_columns, ctx.stop)
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
            inputs[k] = self.zero_done[k][:len(envs)]
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
        """The user-facing error of a failed env call: named by the env's global id and step (and its
        worker process); an invalid action is the policy's fault."""
        j = failure.j
        env_id, step = self.env_ids[j], self.step_index(j)
        if failure.kind == "action":
            return PolicyError(f"invalid action for env {env_id}: {failure}", env_ids=(env_id,), step=step)
        where = "" if failure.process is None else f" (in worker process {failure.process})"
        return EnvError(f"{failure}{where}", env_id=env_id, step=step, phase=failure.phase)

    def _step_block(self, cols: dict[NestedKey, np.ndarray], run: _Run) -> np.ndarray:
        """Step the run's envs with the actions in ``cols`` (the rows of step ``run.t``); write the env's
        entries there and its rewards and flags into the run's row (see :meth:`_stepped`). Returns the done
        flags."""
        ctx = self.ctx
        i = run.t - run.t0
        try:
            self.envs.step({k: cols[k] for k in ctx.env_inputs}, run.envs,
                           {k: cols[nk] for k, nk in ctx.layout.env_next_pairs}, run.rewards[i],
                           run.terminated[i], run.truncated[i], ctx.stop, check_nan=not run.defer_nan)
        except EnvFailure as failure:
            raise self._failure_error(failure) from failure.cause
        return self._stepped(cols, run, i)

    def _stepped(self, cols: Mapping[NestedKey, np.ndarray], run: _Run, i: int) -> np.ndarray:
        """What a step does once its env entries are in ``cols`` (the rows of the run's envs) and its rewards
        and flags in the run's row ``i``: the per-step counters when kept (the loop's episode cap truncates
        here), ``cur`` advanced. Returns the done flags."""
        terminated, truncated = run.terminated[i], run.truncated[i]
        sel = run.sel
        count = run.count
        if count is None:
            done = terminated | truncated
        else:
            reward_sum = run.reward_sum
            assert reward_sum is not None
            count += 1
            reward_sum += run.rewards[i]
            cap = self.ctx.max_episode_steps
            if cap is not None:
                truncated |= count >= cap
            done = terminated | truncated
            if self._loop_inputs:  # the policy reads them at the next step
                cur = self.cur
                cur["is_init"][sel] = False
                cur["step_count"][sel, 0] = count
                cur["episode_reward"][sel, 0] = reward_sum
            count[done] = 0
            reward_sum[done] = 0.0
        if isinstance(sel, slice):  # the whole block: the next step reads them where this one wrote them
            self._carry = {k: cols[src] for k, src in self._advance}
        else:
            self._settle_carry()
            cur = self.cur
            for k, src in self._advance:
                cur[k][sel] = cols[src]
        return done

    def _settle(self, run: _Run) -> CollectionError | None:
        """Write the bookkeeping of the run's unsettled steps (``t0`` to ``t - 1``), vectorised over them:
        the env ids, the statistics column, a gymnasium env's done flags, ``is_init``, ``step_count`` and
        ``episode_reward`` (root and ``"next"``, exactly as adding the rewards step by step gives them), and
        this worker's counters and ``cur``'s loop entries. With ``run.defer_nan`` it first looks for NaN in
        those steps' observations: the earliest step holding one, and every step after it, are dropped
        (``run.t`` is cut there) and its error is returned, naming its lowest env."""
        t0, t1 = run.t0, run.t
        failure: CollectionError | None = None
        if run.defer_nan and t1 > t0:
            found = cast(EnvBlock, self.envs).find_nan(run.cols["next", "observation"][t0:t1], run.envs)  # nan_checked
            if found is not None:
                t1 = run.t = t0 + found[0]
                failure = self._failure_error(found[1])  # step_index: steps_done counts the settled steps
        n = t1 - t0
        if n <= 0:
            return failure
        cols, sel = run.cols, run.sel
        rewards, terminated, truncated = run.rewards[:n], run.terminated[:n], run.truncated[:n]
        done = terminated | truncated
        count, returns, before = _episode_counts(rewards, done, run.step_count, run.episode_reward)
        length = count + 1  # the "next" step count: the episode's length so far
        if self.ctx.layout.loop_keys:
            rows = slice(t0, t1)
            cols["next", "reward"][rows, :, 0] = rewards
            cols["next", "terminated"][rows, :, 0] = terminated
            cols["next", "truncated"][rows, :, 0] = truncated
            cols["next", "done"][rows, :, 0] = done
            cols["next", "is_init"][rows] = False
            cols["next", "step_count"][rows, :, 0] = length
            cols["next", "episode_reward"][rows, :, 0] = returns
            is_init = cols["is_init"][rows, :, 0]
            is_init[0] = run.is_init
            if n > 1:
                is_init[1:] = done[:-1]
            cols["step_count"][rows, :, 0] = count
            cols["episode_reward"][rows, :, 0] = before
        cols[_ENV_ID][t0:t1] = self.env_id_array[sel]
        stats = cols[_STATS][t0:t1]
        stats[..., _S_REWARD] = rewards
        stats[..., _S_RETURN] = returns
        stats[..., _S_LENGTH] = length
        stats[..., _S_TERMINATED] = terminated
        stats[..., _S_TRUNCATED] = truncated
        stats[..., _S_DONE] = done
        last = done[-1]
        self.steps_done[sel] += n
        run.step_count = np.where(last, 0, length[-1])
        run.episode_reward = np.where(last, 0.0, returns[-1])
        run.is_init = last
        self.step_count[sel] = run.step_count
        self.episode_reward[sel] = run.episode_reward
        if self.ctx.layout.loop_keys and not self._loop_inputs:  # carried here, not by each step
            cur = self.cur
            cur["is_init"][sel, 0] = last
            cur["step_count"][sel, 0] = run.step_count
            cur["episode_reward"][sel, 0] = run.episode_reward
        run.t0 = t1
        return failure

    def settle(self, *, last: bool = False) -> CollectionError | None:
        """Settle the steps of the quota in progress written so far (see :meth:`_settle`) and bring
        ``quota_end`` to them; returns the error of the earliest NaN observation found. ``last``: the quota
        ends (this thread). Thread-safe: a driver that gave up on this worker (a hung env) calls it to keep
        the worker's complete steps; a no-op without a quota in progress."""
        with self._settle_lock:
            run = self._run
            if run is None:
                return None
            failure = self._settle(run)
            self.quota_end = run.t0
            if last or failure is not None:  # a NaN ends the quota there: nothing after it is settled
                self._run = None
            return failure

    def _settle_carry(self) -> None:
        """Copy the advanced entries still read from the last step's rows into ``cur`` (see ``_carry``)."""
        carry, self._carry = self._carry, None
        if carry is not None:
            for k, v in carry.items():
                self.cur[k][...] = v

    def _load_root(self, cols: dict[NestedKey, np.ndarray], sel: slice | list[int],
                   keys: Sequence[NestedKey] | None = None) -> None:
        """Write the current root entries ``keys`` (default: those a step reads, ``_load_keys``) of envs
        ``sel`` into ``cols`` (one row per env; the advanced ones from the last step's rows while ``_carry`` holds
        them: a whole block reads them there, part of one settles first)."""
        cur, carry = self.cur, self._carry
        if isinstance(sel, slice):  # every env: ``cur`` as it is, no indexing
            for k in self._load_keys if keys is None else keys:
                cols[k][...] = cur[k] if carry is None or k not in carry else carry[k]
            return
        if carry is not None:
            self._settle_carry()
        for k in self._load_keys if keys is None else keys:
            cols[k][...] = cur[k][sel]

    def _compute(self, run: _Run, cols: dict[NestedKey, np.ndarray] | None = None) -> np.ndarray:
        """One step of the run's envs at ``run.t`` (written, not settled; ``run.t`` advanced); returns its
        done flags (those envs are not reset yet: :meth:`_reset_done`). ``cols``: that step's rows when the
        caller has them (a slot), else views of the run's columns."""
        t = run.t
        if cols is None:
            cols = {k: run.cols[k][t] for k in self._step_keys}
        self._load_root(cols, run.sel)
        self._act(cols, run.envs)
        done = self._step_block(cols, run)
        run.t = t + 1
        return done

    def _reset_done(self, run: _Run, done: np.ndarray) -> None:
        """Reset the run's envs whose last step was done.

        A reset that fails after a done step does not lose that step: the error is kept in
        ``pending_error`` and raised by :meth:`_raise_pending` once the block is delivered."""
        for i in done.nonzero()[0].tolist():  # (ndarray.any and np.flatnonzero cost more, through Python)
            try:
                self._reset_env(run.envs[i])
            except EnvError as exc:
                self.pending_error = exc
                return  # the env has no next root: nothing more is stepped before the error is raised

    def _compute_slot(self, slot: int) -> None:
        """One step of every env of this worker into slot ``slot``, settled (then the done envs reset)."""
        run = self._slot_runs[slot]
        run.restart(self, 0)
        done = self._compute(run, self.slots[slot])
        self._settle(run)
        self._reset_done(run, done)

    def _raise_pending(self) -> None:
        """Raise the error of a reset that failed in a block just delivered (see :meth:`_compute`)."""
        error, self.pending_error = self.pending_error, None
        if error is not None:
            raise error

    def _run_quota(self, out: dict[NestedKey, np.ndarray], start: int, count: int, staged: int | None) -> int | None:
        """Write up to ``count`` steps of this worker's envs into ``out[:, w, :, start:]`` (the driver's
        batch, which it does not read until this worker reports), as one run settled at its end; stop early
        when the driver cuts. Keeps ``quota_end`` at the first time index not settled yet; returns the staged
        slot left (None)."""
        end = start + count
        cut, stop = self.ctx.cut, self.ctx.stop
        by_time = {k: v[self.index].swapaxes(0, 1) for k, v in out.items()}  # [T, rows, ...]
        self.quota_end = start
        run = _Run(self, by_time, start, min(count, _SETTLE_EVERY), range(self.rows), quota=True)
        with self._settle_lock:
            self._run = run
        try:
            while run.t < end:
                if staged is not None:  # the lookahead step, computed and settled before the request: first
                    src = self.slots[staged]
                    for k, v in by_time.items():
                        v[run.t] = src[k]
                    staged = None
                    run.t0 = run.t = run.t + 1
                else:
                    self._reset_done(run, self._compute(run))
                    if run.t - run.t0 == len(run.rewards):  # the scratch rows are full: settle them
                        failure = self.settle()
                        if failure is not None:
                            raise failure
                if self.pending_error is not None or cut.is_set():
                    break
                if stop.is_set():  # the loop is closing (an error elsewhere, Ctrl-C): leave within one step
                    raise _Stopped()
        finally:
            failure = self.settle(last=True)
            self._settle_carry()  # the batch is the caller's once reported: the carrier no longer reads it
            if failure is not None:
                raise failure  # an earlier step's NaN observation: it fails first, whatever stopped the quota
        self._raise_pending()
        return staged

    def _run_quota_free(self, out: dict[NestedKey, np.ndarray], start: int, count: int,
                        staged: int | None) -> None:
        """:meth:`_run_quota` for a block whose envs step in helper threads: every env runs free.

        Each env's next step starts as soon as its last one ended and the policy answered it; the
        policy is asked once for all the envs that ended since its last call (one wake-up may report
        several). So a slow step holds back only its own env, not the block, until the quota's end,
        where every env has written ``count`` steps. Env ``j``'s step goes straight to
        ``out[:, w, j, t_j]``: the entries known before the step when it starts, the step's result when
        it ends. ``quota_end`` is the first time index some env has not written yet. When the driver
        cuts, envs stop at the time index the furthest one reaches (the others catch up: every env
        delivers the same number of steps, and no env steps beyond what is delivered). When an env
        fails (its step, its checks, or its reset after a done step), it stops there and the others
        catch up to it before the error is raised, so its complete steps are delivered, as in
        lock-step; a policy error is raised at once."""
        ctx, layout = self.ctx, self.ctx.layout
        envs = cast(EnvBlock, self.envs)  # free-running: a parallel block, an EnvBlock
        w, end, n_env = self.index, start + count, self.rows
        cut, stop = ctx.cut, ctx.stop
        t = np.full(n_env, start, dtype=np.int64)  # each env's next time index
        self.quota_end = start
        if staged is not None:  # the lookahead step computed before the request: every env's first step
            src = self.slots[staged]
            for k, v in out.items():
                v[w, :, start] = src[k]
            t += 1
            self.quota_end = start + 1
            self._raise_pending()
        target = start if cut.is_set() else end  # every env stops at this time index
        flying = np.zeros(n_env, dtype=bool)
        pre, post = self._free_cols
        park = ctx.blocks > 1  # let other blocks' requests flush while this one waits on its envs
        ready = list(range(n_env))
        while True:
            ready = [j for j in ready if t[j] < target]
            if ready:
                self._start_free(out, pre, t, ready)
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
            results = np.empty((1, m)), np.empty((1, m), dtype=bool), np.empty((1, m), dtype=bool)
            written, failure = envs.finish(ended, {k: post[nk][:m] for k, nk in layout.env_next_pairs},
                                           *(a[0] for a in results))
            if failure is not None:  # that env stops here; the others catch up to it
                self._fail_free(self._failure_error(failure), failure.cause)
                target = min(target, int(t[failure.j]))
            m, idx = len(written), np.asarray(written, dtype=np.int64)
            # the ended steps as a run of one step of envs ``written`` (row i: env written[i]), settled at once
            run = _Run(self, {k: post[k][None, :m] for k in self._settle_keys}, 0, 1, written,
                       results=tuple(a[:, :m] for a in results))  # type: ignore[arg-type]
            done = self._stepped({src: post[src][:m] for _, src in self._advance}, run, 0)
            run.t = 1
            self._settle(run)
            rows_t = t[idx]
            for k in self._post_keys:
                out[k][w, idx, rows_t] = post[k][:m]
            t[idx] += 1
            ready = written  # next: their next steps (those still short of the target)
            for i in np.flatnonzero(done):
                j = written[i]
                try:
                    self._reset_env(j)
                except EnvError as exc:  # its done step is kept: the others catch up to it
                    self._fail_free(exc, exc.__cause__)
                    target = min(target, int(t[j]))
            self.quota_end = int(t.min())
            if cut.is_set() and target == end:  # stop where the furthest env gets to
                target = int((t + flying).max())
            if stop.is_set():
                raise _Stopped()
        self._raise_pending()

    def _fail_free(self, error: CollectionError, cause: BaseException | None) -> None:
        """Keep the first error of a free-running quota, raised once every env reached the failed one."""
        if self.pending_error is None:
            if cause is not None and error.__cause__ is None:
                error.__cause__ = cause
            self.pending_error = error

    def _start_free(self, out: dict[NestedKey, np.ndarray], pre: dict[NestedKey, np.ndarray], t: np.ndarray,
                    ready: list[int]) -> None:
        """Act for envs ``ready`` and start their steps (see :meth:`_run_quota_free`); row ``j`` of
        ``pre`` is env ``j``. The policy is asked for the whole block, the rows of envs still stepping
        computed and dropped: it sees the same batch size on every call, as in lock-step (what a
        compiled or CUDA-graphed policy, or one that squeezes its batch, needs)."""
        w, random_left = self.index, self.random_left
        self._load_root(pre, slice(None), keys=list(self.cur))  # every root entry: ``cur`` is settled
        if any(random_left[j] <= 0 for j in ready):
            self._act_policy(pre, range(self.rows))
        for j in ready:
            if random_left[j] > 0:
                self._act_random(pre, j, 1, (j,))
        idx = np.asarray(ready)
        rows_t = t[idx]
        for k in self._pre_keys:
            out[k][w, idx, rows_t] = pre[k][idx]
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

    def _cut(self, staged: int | None, j: int) -> None:
        """Env ``j``'s running episode ends at its staged (undelivered) step: mark it truncated."""
        if staged is not None:
            cols = self.slots[staged]
            if not cols[_STATS][j, _S_DONE]:
                cols[_STATS][j, _S_TRUNCATED] = 1
                cols[_STATS][j, _S_DONE] = 1
                for k in self.ctx.layout.done_keys:
                    name = k[-1] if isinstance(k, tuple) else k
                    if name in ("done", "truncated"):
                        cols[next_key(k)][j] = True

    def _run_episode(self, j: int, request_index: int, staged: int | None) -> None:
        """A fresh episode on env ``j`` alone; the others of this worker wait."""
        ctx = self.ctx
        self._cut(staged, j)
        self.agent.set_rows(1)
        try:
            self._reset_env(j)
            capacity = 64
            cols = ctx.layout.allocate(capacity)
            by_time = {k: v[:, None] for k, v in cols.items()}  # [T, 1, ...]: step t is row 0 of by_time[k][t]
            t = 0
            while True:
                if t == capacity:
                    grown = ctx.layout.allocate(capacity * 2)
                    for k, v in cols.items():
                        grown[k][:capacity] = v
                    cols, capacity = grown, capacity * 2
                    by_time = {k: v[:, None] for k, v in cols.items()}
                run = _Run(self, by_time, t, 1, (j,))
                done = bool(self._compute(run)[0])
                self._settle(run)
                t += 1
                if done:
                    break
                if ctx.stop.is_set():
                    raise _Stopped()
            # With a staged step, that step (delivered later, done) ends the env's running trajectory;
            # without one, the driver starts a new trajectory for the env's next steps.
            ctx.ready.put(EpisodeReady(self.index, request_index, cols, t, staged is None))
            self._reset_env(j)
        finally:
            self.agent.set_rows(self.rows)

    def _main(self) -> None:
        ctx = self.ctx
        torch.set_num_threads(ctx.torch_threads)  # the creating thread's setting (a forward may run here)
        # Env steps and policy calls run without autograd, as in TorchRL's collector (its rollout is under
        # torch.no_grad()); set once for the thread, not around every call.
        torch.set_grad_enabled(False)
        try:
            for j in range(self.rows):
                seed = None if self._seed is None else self._seed + self.env_ids[j]
                self._reset_env(j, seed)
            slot = 0
            staged: int | None = None
            if ctx.lookahead:
                self._compute_slot(slot)
                staged = slot
            while True:
                request = self._wait_request()
                if request is None:
                    return
                if isinstance(request, StepRequest):
                    if staged is None:
                        self._compute_slot(slot)
                    ctx.ready.put(StepReady(self.index, slot))
                    self._raise_pending()
                    slot ^= 1
                    staged = None
                    if ctx.lookahead:
                        self._compute_slot(slot)
                        staged = slot
                elif isinstance(request, QuotaRequest):
                    if self._free_cols:
                        self._run_quota_free(request.out, request.start, request.count, staged)
                        staged = None
                    else:
                        staged = self._run_quota(request.out, request.start, request.count, staged)
                    ctx.ready.put(QuotaEnded(self.index, self.quota_end))
                    if ctx.lookahead and staged is None:
                        self._compute_slot(slot)
                        staged = slot
                elif isinstance(request, ResetRequest):
                    for env_id, seed in request.items:
                        j = self.env_ids.index(env_id)
                        self._cut(staged, j)
                        self._reset_env(j, seed)
                    ctx.ready.put(ResetDone(self.index, staged is None))
                else:
                    assert isinstance(request, EpisodeRequest)
                    self._run_episode(self.env_ids.index(request.env_id), request.request_index, staged)
        except _Stopped:
            return
        except BaseException as exc:  # forwarded to the driver, which re-raises it
            if not isinstance(exc, CollectionError):  # a bug of ours or a stray error: still name the envs
                j = max(self.busy_env, 0)
                wrapped = EnvError(f"{type(exc).__name__}: {exc}", env_id=self.env_ids[j],
                                   step=self.step_index(j), phase="step")
                wrapped.__cause__ = exc
                exc = wrapped
            ctx.ready.put(WorkerFailed(self.index, exc))
        finally:
            self.agent.close()
            if self.envs.owned:  # the blocks of a loop with worker processes are closed by its pool
                self.envs.close()
