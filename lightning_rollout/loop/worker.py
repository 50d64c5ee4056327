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
calls. It answers the driver's requests (see :mod:`lightning_rollout.loop.driver`
for the messages): a step of the whole block
into a slot, a quota of steps straight into the driver's batch, a reset, or one
fresh episode of one env. Each step asks the autobatching policy for the block's
rows, steps the envs, writes the transition into its columns with one vectorised
write per key, and advances ``cur`` as TorchRL's ``step_mdp`` does. Big entries
(images: a page or more a row) are not copied back into ``cur`` after a step of the
whole block: the next step copies its root rows straight from the rows that step
wrote (``Worker._carry``), one copy a step where there were two; ``cur`` is brought
up to date before anything else reads it and before a quota's batch is reported.

With ``parallel_steps="free"`` a block stepped in helper threads runs its envs free
within a quota: each env's next step starts as soon as its last one ended and the
policy answered it, so a slow step holds back its own env only
(:meth:`Worker._run_quota_free`). Its other requests step the block in lock-step.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..envs import EnvAdapter
from ..errors import CollectionError, EnvError, PolicyError
from ..policy import Agent, _Stopped
from ..specs import ArraySpec, NestedKey, next_key
from .block import EnvBlock, EnvFailure
from .buffers import (_ENV_ID, _S_DONE, _S_LENGTH, _S_RETURN, _S_REWARD, _S_TERMINATED, _S_TRUNCATED, _STATS,
                      _TRAJ, _VERSION, check_entries)

if TYPE_CHECKING:
    from .driver import MultiEnvLoop
    from .process import RemoteEnvs, RemoteGroup

__all__ = ["Worker"]

_POLL_S = 0.05
# Carried entries of at least this many bytes a row are read from the last step's rows rather than
# copied into the carrier after each step (Pong's 100 KB frames: 0.6 ms a step of 16 envs).
_LAZY_BYTES = 4096


class Worker:
    """One env thread: ``len(envs)`` envs stepped together, autobatched with other workers."""

    def __init__(self, loop: MultiEnvLoop, index: int, env_ids: list[int], *, adapters: list[EnvAdapter] | None = None,
                 remote: RemoteEnvs | RemoteGroup | None = None) -> None:
        self.loop = loop
        self.index = index
        layout = loop._layout
        # The block's envs: in-process (stepped by this thread) or in worker processes.
        self.envs: EnvBlock | RemoteEnvs | RemoteGroup = remote if remote is not None else EnvBlock(
            adapters or [], validate=loop.validate, checked_next=layout.checked_next if loop.validate else {},
            checked_root=layout.checked_root if loop.validate else {},
            zero_done={k: layout.keys.done[k] for k in loop._env_input_done}, parallel=loop.parallel_steps,
            name=loop.name, env_ids=env_ids)
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
        if loop.free_steps and isinstance(self.envs, EnvBlock) and self.envs.parallel:
            self._free_cols = (layout.allocate(self.rows), layout.allocate(self.rows))
            post = {next_key(k) for k in layout.keys.next} - set(layout.out_keys) | {_ENV_ID, _STATS}
            self._post_keys = [k for k in layout.specs if k in post]
            self._pre_keys = [k for k in layout.specs if k not in post and k != _TRAJ]
        # Each env's current root entries (TorchRL's carrier, one row per env); root done flags are false.
        self.cur = {k: np.zeros((self.rows, *s.shape), s.dtype) for k, s in layout.carried.items()}
        # Big carried entries (an image: a page or more a row) are not copied into ``cur`` after a step of
        # the whole block: ``_carry`` then holds views of the rows that step wrote (its "next" entries)
        # and the next step's root rows are copied from there, one copy a step instead of two. While
        # ``_carry`` is set it, not ``cur``, holds those entries; ``_settle_carry`` copies it into ``cur``
        # before anything else reads or writes them, and before a batch is handed over.
        self._lazy = [(k, src) for k, src in layout.advance
                      if int(np.prod(layout.carried[k].shape)) * layout.carried[k].dtype.itemsize >= _LAZY_BYTES]
        self._eager = [pair for pair in layout.advance if pair not in self._lazy]  # copied into ``cur`` each step
        self._carry: dict[NestedKey, np.ndarray] | None = None
        self.zero_done = {k: np.zeros((self.rows, *layout.keys.done[k].shape), bool) for k in layout.done_keys}
        self.step_count = np.zeros(self.rows, dtype=np.int64)
        self.episode_reward = np.zeros(self.rows, dtype=np.float64)
        self.steps_done = np.zeros(self.rows, dtype=np.int64)  # env steps since start, per env
        self.random_left = np.full(self.rows, loop._random_steps_per_env, dtype=np.int64)
        self.requests: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.agent: Agent = loop.policy.register(self.rows, env_ids=tuple(env_ids))
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
        self.thread = threading.Thread(target=self._main, name=f"lightning_rollout-{loop.name}-env{env_ids[0]}",
                                       daemon=True)

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
        self._settle_carry()
        first = self.loop._first_roots.pop(self.env_ids[j], None)  # the construction's reset, if still valid
        if first is not None and first[0] == seed:
            root = first[1]
            self._check(j, root, self.loop._layout.checked_root)
        else:
            try:
                root = self.envs.reset(j, seed, self.loop._stop)
            except EnvFailure as failure:
                raise self._failure_error(failure) from failure.cause
        layout = self.loop._layout
        for k in layout.keys.root:
            self.cur[k][j] = root[k]
        for k in layout.policy_carried:  # recurrent state and kept outputs start from zeros, as a primer's
            self.cur[k][j] = 0
        self.step_count[j] = 0
        self.episode_reward[j] = 0.0

    def _check(self, j: int, values: dict[NestedKey, Any], specs: dict[NestedKey, ArraySpec]) -> None:
        """Every entry of ``specs`` is in ``values`` with its shape and dtype, without NaN."""
        if self.loop.validate:
            problem = check_entries(values, specs)
            if problem is not None:
                raise EnvError(problem, env_id=self.env_ids[j], step=int(self.steps_done[j]), phase="check")

    def _act(self, cols: dict[NestedKey, np.ndarray], r0: int, rows: int, envs: Sequence[int]) -> None:
        """Fill policy outputs for rows ``r0:r0+rows`` (envs ``envs``, which step together: all or none
        of them are still on random steps) of ``cols``."""
        if self.random_left[envs[0]] > 0:
            self._act_random(cols, r0, rows, envs)
        else:
            self._act_policy(cols, r0, rows, envs)

    def _act_random(self, cols: dict[NestedKey, np.ndarray], r0: int, rows: int, envs: Sequence[int]) -> None:
        """A uniformly random action for each of envs ``envs`` in rows ``r0:r0+rows`` (its other outputs
        zero, its policy version -1); counts down their random steps."""
        loop = self.loop
        for k in loop._layout.out_keys:
            cols[k][r0:r0 + rows] = 0
        for r, j in zip(range(r0, r0 + rows), envs):
            sample = self.envs.random_action(j, loop._action_columns, loop._stop)
            for k, v in sample.items():
                cols[k][r] = v
            self.random_left[j] -= 1
        cols[_VERSION][r0:r0 + rows] = -1

    def _act_policy(self, cols: dict[NestedKey, np.ndarray], r0: int, rows: int, envs: Sequence[int]) -> None:
        """The policy's outputs for rows ``r0:r0+rows`` (envs ``envs``) of ``cols``, one request."""
        loop = self.loop
        layout = loop._layout
        agent = self.agent
        whole = r0 == 0 and rows == len(cols[_VERSION])  # every row of the columns: no views of them to make
        inputs = {k: cols[k] if whole else cols[k][r0:r0 + rows] for k in loop._input_cols}
        for k in loop._input_done:  # root done flags: false (no column)
            inputs[k] = self.zero_done[k] if whole else self.zero_done[k][:rows]
        try:
            answer = agent.act(inputs, exploration_type=loop.exploration_type, stop=loop._stop)
        except PolicyError as exc:  # name this env and its step (the shared error names only the batch)
            raise PolicyError(exc.reason, env_ids=exc.env_ids or tuple(self.env_ids[j] for j in envs),
                              step=int(self.steps_done[envs[0]])) from exc
        outputs, a, b = answer.outputs, answer.start, answer.stop
        for k in layout.out_keys:
            value = outputs.get(k)
            if value is None or value.shape[1:] != cols[k].shape[1:]:
                got = "nothing" if value is None else f"shape {tuple(value.shape[1:])}"
                raise PolicyError(f"the policy returned {got} for {k!r}; it returned shape "
                                  f"{tuple(cols[k].shape[1:])} per row when probed at construction",
                                  env_ids=tuple(self.env_ids[j] for j in envs), step=int(self.steps_done[envs[0]]))
            cols[k][r0:r0 + rows] = value if a == 0 and b == len(value) else value[a:b]
        cols[_VERSION][r0:r0 + rows] = answer.version

    def _failure_error(self, failure: EnvFailure) -> CollectionError:
        """The user-facing error of a failed env call: named by the env's global id and step (and its
        worker process); an invalid action is the policy's fault."""
        j = failure.j
        env_id, step = self.env_ids[j], int(self.steps_done[j])
        if failure.kind == "action":
            return PolicyError(f"invalid action for env {env_id}: {failure}", env_ids=(env_id,), step=step)
        where = "" if failure.process is None else f" (in worker process {failure.process})"
        return EnvError(f"{failure}{where}", env_id=env_id, step=step, phase=failure.phase)

    def _step_block(self, cols: dict[NestedKey, np.ndarray], r0: int, envs: Sequence[int]) -> np.ndarray:
        """Step envs ``envs`` with the actions in rows ``r0:r0+len(envs)`` of ``cols``; write the
        transitions there (counters and flags with one vectorised write per key, not one per env).
        Leaves each env's next root entries in ``cur``; returns the rows' done flags."""
        loop = self.loop
        layout, n = loop._layout, len(envs)
        rows = slice(r0, r0 + n)
        sel: slice | list[int] = slice(None) if n == self.rows else list(envs)
        rewards = np.empty(n)
        terminated = np.empty(n, dtype=bool)
        truncated = np.empty(n, dtype=bool)
        try:
            self.envs.step({k: cols[k][rows] for k in loop._env_inputs}, envs,
                           {k: cols[nk][rows] for k, nk in layout.env_next_pairs}, rewards, terminated, truncated,
                           loop._stop)
        except EnvFailure as failure:
            raise self._failure_error(failure) from failure.cause
        return self._after_step(cols, rows, sel, rewards, terminated, truncated)

    def _after_step(self, cols: dict[NestedKey, np.ndarray], rows: slice, sel: slice | list[int],
                    rewards: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> np.ndarray:
        """The bookkeeping of a step whose env entries are in ``cols[rows]`` (envs ``sel``): counters,
        flags and statistics, and ``cur`` advanced; returns the rows' done flags."""
        layout, loop = self.loop._layout, self.loop
        whole = isinstance(sel, slice)  # every env of the block, in order: the counters need no indexing
        cols[_ENV_ID][rows] = self.env_id_array[sel]
        if whole:
            self.steps_done += 1
            self.step_count += 1
            self.episode_reward += rewards
            step_count, episode_reward = self.step_count, self.episode_reward
        else:
            self.steps_done[sel] += 1
            self.step_count[sel] += 1
            self.episode_reward[sel] += rewards
            step_count, episode_reward = self.step_count[sel], self.episode_reward[sel]
        if layout.loop_keys and loop.max_episode_steps is not None:
            truncated |= step_count >= loop.max_episode_steps
        done = terminated | truncated
        if layout.loop_keys:
            cols[("next", "reward")][rows, 0] = rewards
            cols[("next", "terminated")][rows, 0] = terminated
            cols[("next", "truncated")][rows, 0] = truncated
            cols[("next", "done")][rows, 0] = done
            cols[("next", "is_init")][rows] = False
            cols[("next", "step_count")][rows, 0] = step_count
            cols[("next", "episode_reward")][rows, 0] = episode_reward
        stats = cols[_STATS][rows]
        stats[:, _S_REWARD] = rewards
        stats[:, _S_RETURN] = episode_reward
        stats[:, _S_LENGTH] = step_count
        stats[:, _S_TERMINATED] = terminated
        stats[:, _S_TRUNCATED] = truncated
        stats[:, _S_DONE] = done
        if self._lazy and whole:  # the whole block: big entries stay where the step wrote them
            self._carry = {k: cols[src][rows] for k, src in self._lazy}
            advance = self._eager
        else:
            self._settle_carry()
            advance = layout.advance
        for k, src in advance:
            self.cur[k][sel] = cols[src][rows]
        return done

    def _settle_carry(self) -> None:
        """Copy the big carried entries still read from the last step's rows into ``cur`` (see ``_carry``)."""
        carry, self._carry = self._carry, None
        if carry is not None:
            for k, v in carry.items():
                self.cur[k][...] = v

    def _load_root(self, cols: dict[NestedKey, np.ndarray], r0: int, sel: slice | list[int] | int) -> None:
        """Write the current root entries of envs ``sel`` at rows ``r0:`` of ``cols`` (big ones from the last
        step's rows while ``_carry`` holds them: a whole block reads them there, part of one settles first)."""
        whole = isinstance(sel, slice)  # every env: ``cur`` as it is, no indexing
        n = self.rows if whole else (1 if isinstance(sel, int) else len(sel))
        rows = slice(r0, r0 + n)
        carry = self._carry
        if carry is not None and not whole:
            self._settle_carry()
            carry = None
        for k, v in self.cur.items():
            cols[k][rows] = (v if whole else v[sel]) if carry is None or k not in carry else carry[k]

    def _compute(self, cols: dict[NestedKey, np.ndarray]) -> None:
        """One step of every env of this worker, into ``cols`` (a slot, or a time step of a batch).

        A reset that fails after a done step does not lose that step: the error is kept in
        ``pending_error`` and raised by :meth:`_raise_pending` once the block is delivered."""
        self._load_root(cols, 0, slice(None))
        self._act(cols, 0, self.rows, range(self.rows))
        done = self._step_block(cols, 0, range(self.rows))
        if not done.any():
            return
        for j in np.flatnonzero(done):
            try:
                self._reset_env(int(j))
            except EnvError as exc:
                self.pending_error = exc
                return  # the env has no next root: nothing more is stepped before the error is raised

    def _raise_pending(self) -> None:
        """Raise the error of a reset that failed in a block just delivered (see :meth:`_compute`)."""
        error, self.pending_error = self.pending_error, None
        if error is not None:
            raise error

    def _run_quota(self, out: dict[NestedKey, np.ndarray], start: int, count: int, staged: int | None) -> int | None:
        """Write up to ``count`` steps of this worker's envs into ``out[:, w, :, start:]`` (the driver's
        batch, which it does not read until this worker reports); stop early when the driver cuts.
        Keeps ``quota_end`` at the first time index not written yet; returns the staged slot left (None)."""
        w, t, end = self.index, start, start + count
        cut, stop = self.loop._cut, self.loop._stop
        self.quota_end = t
        by_time = {k: v[w].swapaxes(0, 1) for k, v in out.items()}  # [T, rows, ...]: a step's rows are by_time[k][t]
        try:
            while t < end:
                dest = {k: v[t] for k, v in by_time.items()}
                if staged is not None:  # the lookahead step computed before the request: deliver it first
                    src = self.slots[staged]
                    for k, d in dest.items():
                        d[...] = src[k]
                    staged = None
                else:
                    self._compute(dest)
                t += 1
                self.quota_end = t  # read by the driver after a failure: steps before it are complete
                self._raise_pending()
                if cut.is_set():
                    break
                if stop.is_set():  # the loop is closing (an error elsewhere, Ctrl-C): leave within one step
                    raise _Stopped()
        finally:
            self._settle_carry()  # the batch is the caller's once reported: the carrier no longer reads it
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
        loop, envs, layout = self.loop, self.envs, self.loop._layout
        assert isinstance(envs, EnvBlock)
        w, end, n_env = self.index, start + count, self.rows
        cut, stop = loop._cut, loop._stop
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
        park = len(loop._workers) > 1  # let other blocks' requests flush while this one waits on its envs
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
            rewards, terminated, truncated = np.empty(m), np.empty(m, dtype=bool), np.empty(m, dtype=bool)
            written, failure = envs.finish(ended, {k: post[nk][:m] for k, nk in layout.env_next_pairs}, rewards,
                                           terminated, truncated)
            if failure is not None:  # that env stops here; the others catch up to it
                self._fail_free(self._failure_error(failure), failure.cause)
                target = min(target, int(t[failure.j]))
            m, idx = len(written), np.asarray(written, dtype=np.int64)
            done = self._after_step(post, slice(0, m), written, rewards[:m], terminated[:m], truncated[:m])
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
        self._load_root(pre, 0, slice(None))
        if any(random_left[j] <= 0 for j in ready):
            self._act_policy(pre, 0, self.rows, range(self.rows))
        for j in ready:
            if random_left[j] > 0:
                self._act_random(pre, j, 1, (j,))
        idx = np.asarray(ready)
        rows_t = t[idx]
        for k in self._pre_keys:
            out[k][w, idx, rows_t] = pre[k][idx]
        try:
            self.envs.begin({k: pre[k][idx] for k in self.loop._env_inputs}, ready)
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

    def _wait_request(self) -> tuple[Any, ...] | None:
        self._set_activity(working=False)
        try:
            while True:
                try:
                    request = self.requests.get(timeout=_POLL_S)
                except queue.Empty:
                    if self.loop._stop.is_set():
                        return None
                    continue
                return None if request[0] == "stop" else request
        finally:
            self._set_activity(working=True)

    def _cut(self, staged: int | None, j: int) -> None:
        """Env ``j``'s running episode ends at its staged (undelivered) step: mark it truncated."""
        if staged is not None:
            cols = self.slots[staged]
            if not cols[_STATS][j, _S_DONE]:
                cols[_STATS][j, _S_TRUNCATED] = 1
                cols[_STATS][j, _S_DONE] = 1
                for k in self.loop._layout.done_keys:
                    name = k[-1] if isinstance(k, tuple) else k
                    if name in ("done", "truncated"):
                        cols[next_key(k)][j] = True

    def _run_episode(self, j: int, request_index: int, staged: int | None) -> None:
        """A fresh episode on env ``j`` alone; the others of this worker wait."""
        loop = self.loop
        self._cut(staged, j)
        self.agent.set_rows(1)
        try:
            self._reset_env(j)
            capacity = 64
            cols = loop._layout.allocate(capacity)
            t = 0
            while True:
                if t == capacity:
                    grown = loop._layout.allocate(capacity * 2)
                    for k, v in cols.items():
                        grown[k][:capacity] = v
                    cols, capacity = grown, capacity * 2
                self._load_root(cols, t, [j])
                self._act(cols, t, 1, (j,))
                done = bool(self._step_block(cols, t, (j,))[0])
                t += 1
                if done:
                    break
                if loop._stop.is_set():
                    raise _Stopped()
            # With a staged step, that step (delivered later, done) ends the env's running trajectory;
            # without one, the driver starts a new trajectory for the env's next steps.
            loop._ready.put(("episode", self.index, request_index, cols, t, staged is None))
            self._reset_env(j)
        finally:
            self.agent.set_rows(self.rows)

    def _main(self) -> None:
        loop = self.loop
        torch.set_num_threads(loop._torch_threads)  # the creating thread's setting (a forward may run here)
        try:
            for j in range(self.rows):
                seed = None if loop.seed is None else loop.seed + self.env_ids[j]
                self._reset_env(j, seed)
            slot = 0
            staged: int | None = None
            if loop.lookahead:
                self._compute(self.slots[slot])
                staged = slot
            while True:
                request = self._wait_request()
                if request is None:
                    return
                if request[0] == "step":
                    if staged is None:
                        self._compute(self.slots[slot])
                    loop._ready.put(("step", self.index, slot))
                    self._raise_pending()
                    slot ^= 1
                    staged = None
                    if loop.lookahead:
                        self._compute(self.slots[slot])
                        staged = slot
                elif request[0] == "steps":
                    if self._free_cols:
                        self._run_quota_free(request[1], request[2], request[3], staged)
                        staged = None
                    else:
                        staged = self._run_quota(request[1], request[2], request[3], staged)
                    loop._ready.put(("steps", self.index, self.quota_end))
                    if loop.lookahead and staged is None:
                        self._compute(self.slots[slot])
                        staged = slot
                elif request[0] == "reset":
                    for env_id, seed in request[1]:
                        j = self.env_ids.index(env_id)
                        self._cut(staged, j)
                        self._reset_env(j, seed)
                    loop._ready.put(("reset", self.index, staged is None))
                else:
                    self._run_episode(self.env_ids.index(request[1]), request[2], staged)
        except _Stopped:
            return
        except BaseException as exc:  # forwarded to the driver, which re-raises it
            if not isinstance(exc, CollectionError):  # a bug of ours or a stray error: still name the envs
                j = max(self.busy_env, 0)
                wrapped = EnvError(f"{type(exc).__name__}: {exc}", env_id=self.env_ids[j],
                                   step=int(self.steps_done[j]), phase="step")
                wrapped.__cause__ = exc
                exc = wrapped
            loop._ready.put(("error", self.index, exc))
        finally:
            self.agent.close()
            if isinstance(self.envs, EnvBlock):  # the blocks of a loop with worker processes are closed by its pool
                self.envs.close()
