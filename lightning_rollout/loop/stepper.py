"""The one stepping loop, in the collecting thread: send the idle envs a :class:`Rule` selects (actions from one
policy call), receive the rows whose step ended (``min(in flight, autobatch_size)``, or those ready within
``max_wait``) and settle them into the :class:`~.storage.Ring`, numpy over the round's rows (no loop over envs).
Per env, ``t`` is the step whose root entries are in row ``t``; steps ``consumed`` to ``t - 1`` are complete.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from torchrl.envs.utils import ExplorationType

from ..envs import EnvFailure
from ..errors import CollectionError, EnvError, PolicyError, StepTimeoutError
from ..events import Interrupter
from ..specs import NestedKey, key_parts, next_key
from .executors import POLL_S, Envs
from .storage import LENGTH, RETURN, REWARD, SEQ, TERMINATED, TRUNCATED, VERSION, Layout, Ring

__all__ = ["EnvTimeRule", "EpisodeRule", "FlatRule", "Rule", "Stepper"]

PolicyFn = Callable[[dict[NestedKey, np.ndarray], int, ExplorationType], tuple[dict[NestedKey, np.ndarray], int]]


class Cursor:
    """Where steps go: a ring, each env's next step ``t`` (its root entries are in row ``t``), the steps handed
    out (``consumed``), and the running episode's length and return."""

    def __init__(self, layout: Layout, num_envs: int) -> None:
        self.ring = Ring(layout, num_envs)
        self.t = np.zeros(num_envs, dtype=np.int64)
        self.consumed = np.zeros(num_envs, dtype=np.int64)
        self.ep_len = np.zeros(num_envs, dtype=np.int64)
        self.ep_ret = np.zeros(num_envs, dtype=np.float64)

    def available(self) -> int:
        """Complete steps not handed out yet."""
        return int((self.t - self.consumed).sum())

    def fit(self, ids: np.ndarray, ahead: int) -> None:
        """Grow the ring so each env of ``ids`` keeps its unconsumed steps and ``ahead`` rows more."""
        need = int((self.t[ids] - self.consumed[ids]).max(initial=0)) + ahead
        if need > self.ring.capacity:
            self.ring.grow(max(2 * self.ring.capacity, need), self.consumed, self.t)

    def last_done(self, envs: np.ndarray) -> np.ndarray:
        """Whether each env's last complete step ended its episode."""
        rows = (self.t[envs] - 1) % self.ring.capacity
        return self.ring.cols[TERMINATED][rows, envs] | self.ring.cols[TRUNCATED][rows, envs]


class Rule:
    """When a call is done, and which idle envs it steps next."""

    def select(self, stepper: Stepper, idle: np.ndarray) -> np.ndarray:
        """The idle envs (ascending ids) to step now."""
        raise NotImplementedError

    def done(self, stepper: Stepper) -> bool:
        raise NotImplementedError

    def settled(self, stepper: Stepper, rows: np.ndarray) -> None:
        """Rows ``rows`` were settled."""


class EnvTimeRule(Rule):
    """``steps`` more steps of every env."""

    def __init__(self, stepper: Stepper, steps: int) -> None:
        self.target = stepper.main.consumed + steps
        stepper.main.fit(np.arange(stepper.num_envs), steps + 2)

    def select(self, stepper: Stepper, idle: np.ndarray) -> np.ndarray:
        return stepper.whole_groups(idle, any_of=stepper.main.t < self.target)

    def done(self, stepper: Stepper) -> bool:
        return bool((stepper.main.t >= self.target).all())


class FlatRule(Rule):
    """``frames`` complete steps not handed out yet, from any envs; ``exact``: no step more than needed.
    ``arrived(steps, envs)`` hears of each round's steps, in arrival order."""

    def __init__(self, frames: int, *, exact: bool, arrived: Callable[[np.ndarray, np.ndarray], None]) -> None:
        self.frames, self.exact, self.arrived = frames, exact, arrived

    def select(self, stepper: Stepper, idle: np.ndarray) -> np.ndarray:
        main = stepper.main
        deficit = self.frames - main.available() - int(stepper.flying.sum())
        if deficit <= 0:
            return np.empty(0, dtype=np.int64)
        ids = stepper.whole_groups(idle)
        if not self.exact or len(ids) <= deficit:
            return ids
        first = ids[::stepper.group]  # whole groups, the least-served first, then the lowest ids
        ahead = main.t[first] - main.consumed[first]
        chosen = first[np.lexsort((first, ahead))[:-(-deficit // stepper.group)]]
        return np.sort((chosen[:, None] + np.arange(stepper.group)).reshape(-1))

    def done(self, stepper: Stepper) -> bool:
        return stepper.main.available() >= self.frames

    def settled(self, stepper: Stepper, rows: np.ndarray) -> None:
        rows = rows[~stepper.in_episode[rows]]
        self.arrived(stepper.main.t[rows] - 1, rows)


class EpisodeRule(Rule):
    """Fresh episodes on ``envs`` (request order), asked again until ``total`` were requested; each completed one
    goes to ``finished(request index, env, first, end)`` (steps ``first`` to ``end - 1`` of the episode cursor)."""

    def __init__(self, stepper: Stepper, envs: list[int], total: int,
                 finished: Callable[[int, int, int, int], None]) -> None:
        self.total, self.finished = total, finished
        self.running = np.full(stepper.num_envs, -1, dtype=np.int64)  # each env's request index, -1: none
        self.start = np.zeros(stepper.num_envs, dtype=np.int64)
        self.requested = 0
        for e in envs:
            stepper.begin_episode(e)
            self._begin(stepper, e)

    def _begin(self, stepper: Stepper, e: int) -> None:
        stepper.episodes.consumed[e] = self.start[e] = stepper.episodes.t[e]
        self.running[e] = self.requested
        self.requested += 1

    def select(self, stepper: Stepper, idle: np.ndarray) -> np.ndarray:
        return np.flatnonzero(idle & (self.running >= 0))

    def done(self, stepper: Stepper) -> bool:
        return bool((self.running < 0).all())

    def settled(self, stepper: Stepper, rows: np.ndarray) -> None:
        mine = rows[self.running[rows] >= 0]
        ended = mine[stepper.episodes.last_done(mine)]
        for e in ended.tolist():
            self.finished(int(self.running[e]), e, int(self.start[e]), int(stepper.episodes.t[e]))
            self.running[e] = -1
            if self.requested < self.total:
                self._begin(stepper, e)  # its reset after the done step is a fresh episode
            else:
                stepper.end_episodes(np.array([e]))

    def abandon(self, stepper: Stepper) -> None:
        """The call ends early: envs still in an episode go back to step mode once their step in flight lands."""
        stepper.drain(np.flatnonzero(self.running >= 0))
        stepper.end_episodes(np.flatnonzero(self.running >= 0))


class Stepper:
    """Every env's stepping state and the one loop over ``envs`` (an executor, first reset done).

    ``policy``: ``(inputs, rows, mode) -> (outputs, version)``; ``random_action``: ``rows -> outputs``.
    ``input_keys`` / ``env_inputs``: root entries the policy / the envs read. ``random_steps``: each env's first
    steps act at random (version ``-1``). ``main`` is the cursor of step calls, ``episodes`` that of
    ``run_episodes`` (envs in ``in_episode``). One thread drives it; ``stop`` (closing) may be set from any.
    """

    def __init__(self, envs: Envs, layout: Layout, *, policy: PolicyFn,
                 random_action: Callable[[int], dict[NestedKey, np.ndarray]], input_keys: list[NestedKey],
                 env_inputs: list[NestedKey], autobatch_size: int | None, max_wait: float | None,
                 step_timeout: float | None, random_steps: int, group: int, stop: threading.Event) -> None:
        self.num_envs = n = envs.num_envs
        self.envs, self.layout, self.policy, self.random_action = envs, layout, policy, random_action
        self.autobatch_size, self.step_timeout, self.stop = autobatch_size, step_timeout, stop
        self.max_wait = math.inf if max_wait is None else max_wait
        self.main = Cursor(layout, n)
        self.episodes = Cursor(layout, n)
        self.in_episode = np.zeros(n, dtype=bool)
        cols = self.main.ring.cols
        self.input_cols = [k for k in input_keys if k in cols]
        self.input_done = {k: np.zeros((n, *layout.keys.done[k].shape), bool) for k in input_keys if k not in cols}
        self.env_cols = [k for k in env_inputs if k in cols]
        self.env_done = [k for k in env_inputs if k not in cols]
        self.out_shapes = {k: layout.step_specs[k].shape for k in layout.out_keys}
        self.writes = [(k, k if k in layout.shared else next_key(k), k in layout.shared)  # (slot, column, in row t+1)
                       for k in layout.env_next if k in envs.slots.next]
        self.flying = np.zeros(n, dtype=bool)
        self.random_left = np.full(n, random_steps, dtype=np.int64)
        self.seq = 0
        self.mode = ExplorationType.RANDOM
        self.group = group if envs.unit.partial else envs.unit.rows  # envs stepped together at the least
        self._everyone, self._no_one = np.arange(n), np.empty(0, dtype=np.int64)
        self.new_trajectory: Callable[[int], None] = lambda env: None  # set by the loop
        self._write_roots(self.main, np.arange(n), envs.roots)

    def whole_groups(self, mask: np.ndarray, any_of: np.ndarray | None = None) -> np.ndarray:
        """Envs of the groups (``group`` envs stepped together) all in ``mask`` (and one in ``any_of``), ascending."""
        if self.group == 1:
            return np.flatnonzero(mask if any_of is None else mask & any_of)
        if self.group == self.num_envs:  # one group (every env in the stepping thread): all or none
            ok_all = mask.all() and (any_of is None or any_of.any())
            return self._everyone if ok_all else self._no_one
        ok = mask.reshape(-1, self.group).all(1)
        if any_of is not None:
            ok &= any_of.reshape(-1, self.group).any(1)
        ok = np.flatnonzero(ok)
        return (ok[:, None] * self.group + np.arange(self.group)).reshape(-1)

    def _split(self, ids: np.ndarray) -> list[tuple[Cursor, np.ndarray]]:
        if not self.in_episode.any():
            return [(self.main, ids)]
        mask = self.in_episode[ids]
        return [(c, part) for c, part in ((self.main, ids[~mask]), (self.episodes, ids[mask])) if len(part)]

    def run(self, rule: Rule, interrupter: Interrupter | None) -> bool:
        """Step until ``rule`` is done; ``False`` when the interrupter fired first (steps in flight stay there).
        Raises EnvError, PolicyError, StepTimeoutError (rows settled before stay), CollectionError (closed)."""
        while not rule.done(self):
            if self.stop.is_set():
                raise CollectionError("the loop was closed while collecting")
            if interrupter is not None and interrupter.should_stop():
                return False
            send = rule.select(self, ~self.flying)
            if len(send):
                try:
                    self.send(send)
                except PolicyError:  # the steps in flight elsewhere still land
                    self._salvage(self._no_one, self._no_one)
                    raise
            if not self.flying.any():
                raise CollectionError("the loop has nothing in flight and the call is not complete (a bug)")
            if (ready := self._recv(interrupter)) is None:
                return False
            self.settle(ready)
            rule.settled(self, ready)
        return True

    def _where(self, c: Cursor, ids: np.ndarray) -> tuple[Any, Any]:
        """``(rows, envs)`` indexing the ring at each env's step ``t``: a row and a slice when ``ids`` is every env at
        one step (lock-step: views, no gathers), else index arrays."""
        t = c.t[ids]
        if len(ids) == self.num_envs and (t == t[0]).all():
            return int(t[0]) % c.ring.capacity, slice(None)
        return t % c.ring.capacity, ids

    def send(self, ids: np.ndarray) -> None:
        """Act for envs ``ids`` (one policy call a cursor; random actions for those with random steps left)."""
        inputs = self.envs.slots.inputs
        for cursor, part in self._split(ids):
            cursor.fit(part, 2)
            cols = cursor.ring.cols
            rows, envs = self._where(cursor, part)
            random = self.random_left[part] > 0
            if random.any():
                at = cursor.t[part] % cursor.ring.capacity
                self._act_random(cols, part[random], at[random])
                self.random_left[part[random]] -= 1
                if not random.all():
                    self._act(cols, at[~random], part[~random], part[~random], cursor.t)
            else:
                self._act(cols, rows, envs, part, cursor.t)
            for k in self.env_cols:
                inputs[k][envs] = cols[k][rows, envs]
        for k in self.env_done:
            inputs[k][ids] = False
        self.envs.send(ids)
        self.flying[ids] = True

    def _act(self, cols: dict[NestedKey, np.ndarray], rows: Any, envs: Any, ids: np.ndarray, t: np.ndarray) -> None:
        """The policy's outputs for envs ``ids`` into ``cols[rows, envs]``."""
        n = len(ids)
        inputs = {k: cols[k][rows, envs] for k in self.input_cols}
        inputs.update({k: v[:n] for k, v in self.input_done.items()})
        try:
            outputs, version = self.policy(inputs, n, self.mode)
        except PolicyError as exc:
            raise PolicyError(exc.reason, env_ids=exc.env_ids or tuple(ids.tolist()), step=int(t[ids[0]])) from exc
        for k, shape in self.out_shapes.items():
            value = outputs.get(k)
            if value is None or value.shape[1:] != shape:
                got = "nothing" if value is None else f"shape {tuple(value.shape[1:])}"
                raise PolicyError(f"the policy returned {got} for {k!r}; it returned shape {shape} per row when "
                                  "probed at construction", env_ids=tuple(ids.tolist()), step=int(t[ids[0]]))
            cols[k][rows, envs] = value
        cols[VERSION][rows, envs] = version

    def _act_random(self, cols: dict[NestedKey, np.ndarray], ids: np.ndarray, rows: np.ndarray) -> None:
        sample = self.random_action(len(ids))
        for k in self.out_shapes:
            cols[k][rows, ids] = sample[k] if k in sample else 0
        cols[VERSION][rows, ids] = -1

    def _recv(self, interrupter: Interrupter | None) -> np.ndarray | None:
        """The recv rule: ``min(in flight, autobatch_size)`` rows, or those ready after ``max_wait``. ``None``:
        interrupted (nothing received is lost: the executor keeps it). Raises what :meth:`run` raises."""
        flying = int(self.flying.sum())
        need = flying if self.autobatch_size is None else min(flying, self.autobatch_size)
        got: list[np.ndarray] = []
        count, end = 0, math.inf  # end: max_wait after the first rows came
        while True:
            try:
                rows = self.envs.recv(need - count, max(0.0, min(POLL_S, end - time.perf_counter())))
            except EnvFailure as failure:
                if isinstance(failure.cause, KeyboardInterrupt) and failure.process is None:
                    raise failure.cause from None  # a Ctrl-C inside an env call of this process: as it is
                self._salvage(np.concatenate([*got, failure.completed]).astype(np.int64), failure.lost)
                raise self.failure_error(failure) from failure.cause
            if len(rows):
                got.append(rows)
                end = min(end, time.perf_counter() + self.max_wait)
                count += len(rows)
            if count >= need or time.perf_counter() >= end:
                return got[0] if len(got) == 1 else np.concatenate(got)
            if self.stop.is_set():
                raise CollectionError("the loop was closed while collecting")
            if interrupter is not None and interrupter.should_stop():
                return np.concatenate(got) if got else None
            if self.step_timeout is not None and (stuck := self.envs.stuck(self.step_timeout)) is not None:
                row, phase, where = stuck
                raise StepTimeoutError(f"no answer within step_timeout={self.step_timeout} s; {where!r} is stuck "
                                       f"inside the env's {phase} and is abandoned",
                                       env_id=row, step=self.steps_of(row), phase=phase)

    def _salvage(self, completed: np.ndarray, lost: np.ndarray) -> None:
        """After a failure: settle ``completed``, and the steps in flight that end within 0.5 s (not ``lost``)."""
        end = time.perf_counter() + 0.5
        while True:
            self.settle(completed)
            self.flying[lost] = False
            if not self.flying.any() or time.perf_counter() >= end:
                return
            try:
                completed, lost = self.envs.recv(int(self.flying.sum()), POLL_S), self._no_one
            except EnvFailure as other:
                completed, lost = other.completed, other.lost

    def steps_of(self, e: int) -> int:
        """Env ``e``'s steps so far (its episode cursor's while it runs an episode)."""
        return int((self.episodes if self.in_episode[e] else self.main).t[e])

    def failure_error(self, failure: EnvFailure) -> CollectionError:
        """An env call's failure as an :class:`EnvError` (env and step), or a :class:`PolicyError` (bad action)."""
        e, step = failure.row, self.steps_of(failure.row)
        if failure.kind == "action":
            return PolicyError(f"invalid action for env {e}: {failure}", env_ids=(e,), step=step)
        where = "" if failure.process is None else f" (in worker process {failure.process})"
        return EnvError(f"{failure}{where}", env_id=e, step=step, phase=failure.phase)

    def settle(self, ids: np.ndarray) -> None:
        """Write the results of envs ``ids``' steps (in the executor's slots) into their cursors' rings."""
        for cursor, part in self._split(ids):
            self._settle(cursor, part)
        self.flying[ids] = False

    def _settle(self, c: Cursor, ids: np.ndarray) -> None:
        s, cols = self.envs.slots, c.ring.cols
        rows, envs = self._where(c, ids)
        nxt = (rows + 1) % c.ring.capacity
        for k, dst, shared in self.writes:
            cols[dst][nxt if shared else rows, envs] = s.next[k][envs]
        reward, terminated, truncated = s.reward[envs], s.terminated[envs], s.truncated[envs]
        cols[REWARD][rows, envs] = reward
        cols[TERMINATED][rows, envs] = terminated
        cols[TRUNCATED][rows, envs] = truncated
        c.ep_len[envs] += 1
        c.ep_ret[envs] += reward
        cols[LENGTH][rows, envs] = c.ep_len[envs]
        cols[RETURN][rows, envs] = c.ep_ret[envs]
        cols[SEQ][rows, envs] = np.arange(self.seq, self.seq + len(ids))
        self.seq += len(ids)
        for k, src in self.layout.advance:
            cols[k][nxt, envs] = cols[src][rows, envs]
        if self.layout.loop_keys:
            cols["is_init"][nxt, envs] = False
            cols["step_count"][nxt, envs, 0] = c.ep_len[envs]
            cols["episode_reward"][nxt, envs, 0] = c.ep_ret[envs]
        c.t[envs] += 1
        done = terminated | truncated
        if done.any():
            ended = ids[done]
            self._write_roots(c, ended, {k: v[ended] for k, v in s.root.items()})

    def _write_roots(self, c: Cursor, ids: np.ndarray, roots: dict[NestedKey, np.ndarray]) -> None:
        """A new episode's root entries for envs ``ids`` at their next step (policy state zeroed, counts reset); an
        unconsumed step before keeps the observations it ended with."""
        stepped = ids[c.t[ids] > c.consumed[ids]]
        c.ring.keep_final(c.t[stepped] - 1, stepped)
        cols, rows = c.ring.cols, c.t[ids] % c.ring.capacity
        for k, v in roots.items():
            if k in cols:
                cols[k][rows, ids] = v
        for k in self.layout.policy_carried:
            cols[k][rows, ids] = 0
        if self.layout.loop_keys:
            cols["is_init"][rows, ids] = True
            cols["step_count"][rows, ids] = 0
            cols["episode_reward"][rows, ids] = 0
        c.ep_len[ids] = 0
        c.ep_ret[ids] = 0.0

    def drain(self, ids: np.ndarray) -> None:
        """Wait for the steps in flight of envs ``ids`` and settle them (every other answer is settled too)."""
        while self.flying[ids].any():
            try:
                ready = self.envs.recv(int(self.flying.sum()), POLL_S)
            except EnvFailure as failure:
                raise self.failure_error(failure) from failure.cause
            if len(ready):
                self.settle(ready)
            elif self.stop.is_set():
                raise CollectionError("the loop was closed while collecting")

    def _cut(self, e: int) -> None:
        """End env ``e``'s step-mode episode: its last unconsumed step marked truncated, else a new trajectory."""
        main = self.main
        if main.ep_len[e] == 0:
            return
        last = int(main.t[e]) - 1
        if last < main.consumed[e]:
            self.new_trajectory(e)
            return
        row, cols = last % main.ring.capacity, main.ring.cols
        cols[TRUNCATED][row, e] = True
        for k in self.layout.done_keys:
            if key_parts(k)[-1] in ("done", "truncated") and next_key(k) in cols:
                cols[next_key(k)][row, e] = True

    def _reset(self, c: Cursor, ids: np.ndarray, seeds: list[int | None]) -> None:
        try:
            self.envs.reset(ids, seeds)
        except EnvFailure as failure:
            raise self.failure_error(failure) from failure.cause
        self._write_roots(c, ids, {k: v[ids] for k, v in self.envs.slots.root.items()})

    def reset(self, ids: np.ndarray, seeds: list[int | None]) -> None:
        """Start a new step-mode episode now on envs ``ids``, reseeded where a seed is given."""
        self.drain(ids)
        for e in ids.tolist():
            self._cut(e)
        self._reset(self.main, ids, seeds)

    def begin_episode(self, e: int) -> None:
        """Env ``e`` leaves step mode for a fresh episode in the episode cursor (its step-mode episode cut)."""
        ids = np.array([e])
        self.drain(ids)
        self._cut(e)
        self.in_episode[e] = True
        self.episodes.consumed[e] = self.episodes.t[e]
        self.episodes.fit(ids, 2)
        self._reset(self.episodes, ids, [None])

    def end_episodes(self, ids: np.ndarray) -> None:
        """Envs ``ids`` (idle) back to step mode: from the fresh episode after their done step, else a new reset."""
        self.in_episode[ids] = False
        ep, main = self.episodes, self.main
        main.fit(ids, 2)
        fresh = ids[ep.ep_len[ids] == 0]
        rows = ep.t[fresh] % ep.ring.capacity
        self._write_roots(main, fresh, {k: ep.ring.cols[k][rows, fresh] for k in self.layout.keys.root
                                        if k in ep.ring.cols})
        cut = ids[ep.ep_len[ids] > 0]
        if len(cut):
            self._reset(main, cut, [None] * len(cut))
        ep.consumed[ids] = ep.t[ids]

    def finish(self, lookahead: bool) -> None:
        """The end of a call: with ``lookahead`` every env with no complete step waiting gets one in flight."""
        if lookahead:
            ids = self.whole_groups(~self.flying & (self.main.t == self.main.consumed) & ~self.in_episode)
            if len(ids):
                self.send(ids)
