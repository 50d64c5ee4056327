"""Delivery: a call's steps copied out of the ring once into recycled columns (:class:`~.storage.BatchPool`) and
wrapped in one TensorDict; trajectory ids as TorchRL's collector assigns them (an env keeps its id until a done
step; new ids in delivery order, time then env, independent of timing); counts; events, in the calling thread
(``run_steps`` announces steps as they arrive, the other calls when their batch or episode is complete).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from tensordict import TensorDict

from ..events import EpisodeEnd, EventProcessor, Progress, TimeStep
from ..specs import NestedKey, next_key
from .stepper import Cursor
from .storage import ENV_ID, LENGTH, RETURN, REWARD, SEQ, TERMINATED, TRAJ, TRUNCATED, VERSION, BatchPool, Layout

__all__ = ["Delivery"]


class Delivery:
    """Copies steps out into batches, numbers trajectories and emits events (the collecting thread only).
    ``frames``, ``episodes``: those delivered by training calls; ``next_traj``: the next new trajectory's id."""

    def __init__(self, layout: Layout, num_envs: int, *, traj_id_start: int, info_keys: Sequence[NestedKey],
                 eval: bool) -> None:
        self.layout, self.num_envs, self.eval = layout, num_envs, eval
        self.info_next = [next_key(k) for k in info_keys]
        self.info_keys = list(info_keys)
        self.pool = BatchPool(layout)
        self.frames = self.episodes = 0
        self.announced = 0  # events sent for steps the running flat call will deliver
        self.start_ids(traj_id_start)

    def start_ids(self, first: int) -> None:
        """Env ``i``'s trajectory is ``first + i``; new ones follow."""
        self.cur_traj = np.arange(first, first + self.num_envs, dtype=np.int64)
        self.next_traj = first + self.num_envs

    def new_trajectory(self, env: int) -> None:
        """Env ``env`` starts a new trajectory now (an explicit reset with no step left to end its last one)."""
        self.cur_traj[env] = self.next_traj
        self.next_traj += 1

    def _gather(self, cursor: Cursor, steps: np.ndarray, envs: np.ndarray) -> dict[NestedKey, np.ndarray]:
        out = self.pool.allocate(steps.shape)
        cursor.ring.gather(steps, envs, out)
        if self.layout.loop_keys:  # a gymnasium env's "next" flags and counters, from the bookkeeping
            for key, col in (("reward", REWARD), ("terminated", TERMINATED), ("truncated", TRUNCATED),
                             ("step_count", LENGTH), ("episode_reward", RETURN)):
                out["next", key][..., 0] = out[col]
            out["next", "done"][..., 0] = out[TERMINATED] | out[TRUNCATED]
            out["next", "is_init"][...] = False
        out[ENV_ID][...] = envs
        return out

    def env_time(self, cursor: Cursor, steps: int, processor: EventProcessor | None) -> TensorDict:
        """Every env's next ``steps`` complete steps: ``[num_envs, steps]``, names ``[None, "time"]``."""
        n = self.num_envs
        index = cursor.consumed[:, None] + np.arange(steps)
        envs = np.broadcast_to(np.arange(n)[:, None], index.shape)
        out = self._gather(cursor, index, envs)
        cursor.consumed += steps
        cursor.ring.forget(cursor.consumed)
        done = out[TERMINATED] | out[TRUNCATED]
        by_env = np.arange(done.size).reshape(steps, n).T.reshape(-1)  # the time-major rows, env by env
        traj = self._traj_flat(np.tile(np.arange(n), steps), done.T.reshape(-1), by_env)  # delivered time-major
        out[TRAJ][...] = traj.reshape(steps, n).T
        first = self.frames + 1
        self.frames += done.size
        if processor is not None and done.size:  # events in time order, env by env within a step
            by_time = {k: np.ascontiguousarray(v.swapaxes(0, 1)).reshape(-1, *v.shape[2:]) for k, v in out.items()
                       if (isinstance(k, tuple) and k[0] == "_loop") or k in (ENV_ID, VERSION)
                       or k in self.info_next or processor.wants_timesteps}
            self._emit(by_time, processor, -1, first)
        self.episodes += int(np.count_nonzero(done))
        return self.layout.to_tensordict(out, [n, steps], names=[None, "time"])

    def pending(self, cursor: Cursor) -> tuple[np.ndarray, np.ndarray]:
        """The complete steps not handed out yet, in arrival order: ``(steps, envs)``."""
        ahead = cursor.t - cursor.consumed
        envs = np.repeat(np.arange(self.num_envs), ahead)
        steps = np.repeat(cursor.consumed - np.cumsum(ahead) + ahead, ahead) + np.arange(len(envs))
        order = np.argsort(cursor.ring.cols[SEQ][steps % cursor.ring.capacity, envs], kind="stable")
        return steps[order], envs[order]

    def announce(self, cursor: Cursor, steps: np.ndarray, envs: np.ndarray, processor: EventProcessor | None) -> None:
        """Events for steps about to be delivered by the flat call running (frames after those announced)."""
        if processor is None or not len(envs):
            return
        keys = [REWARD, TERMINATED, TRUNCATED, LENGTH, RETURN, VERSION, *self.info_next,
                *(k for k in self.layout.out_keys if processor.wants_timesteps and k != "action")]
        cols = {k: np.empty((len(envs), *self.layout.specs[k].shape), self.layout.specs[k].dtype) for k in keys}
        cursor.ring.gather(steps, envs, cols)
        cols[ENV_ID] = envs
        self._emit(cols, processor, -1, self.frames + self.announced + 1)
        self.announced += len(envs)

    def flat(self, cursor: Cursor, frames: int) -> TensorDict:
        """The first ``frames`` complete steps not handed out, in arrival order (events went out: :meth:`announce`)."""
        steps, envs = self.pending(cursor)
        steps, envs = steps[:frames], envs[:frames]
        out = self._gather(cursor, steps, envs)
        cursor.consumed += np.bincount(envs, minlength=self.num_envs)
        cursor.ring.forget(cursor.consumed)
        done = out[TERMINATED] | out[TRUNCATED]
        self.frames += len(envs)
        self.episodes += int(np.count_nonzero(done))
        self.announced = 0
        out[TRAJ][...] = self._traj_flat(envs, done)
        return self.layout.to_tensordict(out, [len(envs)])

    def episode(self, cursor: Cursor, env: int, first: int, end: int, processor: EventProcessor | None,
                total: int, finished: int) -> TensorDict:
        """Env ``env``'s steps ``first`` to ``end - 1`` of ``cursor``: one episode, a new trajectory."""
        steps = np.arange(first, end)
        out = {k: v.copy() for k, v in self._gather(cursor, steps, np.full(len(steps), env)).items()}
        out[TRAJ][...] = self.next_traj
        self.next_traj += 1
        if processor is not None:
            self._emit(out, processor, total, finished)
        if not self.eval:
            self.episodes += 1
        return self.layout.to_tensordict(out, [len(steps)])

    def _traj_flat(self, env_ids: np.ndarray, done: np.ndarray, order: np.ndarray | None = None) -> np.ndarray:
        """Ids of rows delivered in this order: each env keeps its id until a done row, new ids in delivery order
        (``order``: the rows env by env, if known)."""
        n = len(env_ids)
        if n == 0:
            return np.empty(0, dtype=np.int64)
        done = done.astype(np.int64)
        new_ids = np.empty(n, dtype=np.int64)
        new_ids[done > 0] = self.next_traj + np.arange(int(done.sum()), dtype=np.int64)
        order = np.argsort(env_ids, kind="stable") if order is None else order
        env, d = env_ids[order], done[order]
        starts = np.flatnonzero(np.r_[True, env[1:] != env[:-1]])
        group = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, n]))
        before = np.cumsum(d) - d
        k = before - before[starts][group]  # the row is in its env's k-th new trajectory of the batch
        done_pos = np.flatnonzero(d)
        traj_sorted = self.cur_traj[env]
        later = k > 0
        traj_sorted[later] = new_ids[order[done_pos[before[later] - 1]]]
        traj = np.empty(n, dtype=np.int64)
        traj[order] = traj_sorted
        last = np.r_[starts[1:], n] - 1
        ended = (k[last] + d[last]) > 0
        self.cur_traj[env[starts][ended]] = new_ids[order[done_pos[before[last][ended] + d[last][ended] - 1]]]
        self.next_traj += int(done.sum())
        return traj

    def _emit(self, cols: dict[NestedKey, np.ndarray], processor: EventProcessor, total: int, first: int) -> None:
        """Events for the rows of ``cols``; row ``i`` is frame (or finished episode) ``first + i``."""
        wants_steps = processor.wants_timesteps
        terminated, truncated = cols[TERMINATED], cols[TRUNCATED]
        done = terminated | truncated
        if not wants_steps and not done.any():
            return
        on_step = processor.on_eval_timestep if self.eval else processor.on_timestep
        on_end = processor.on_eval_episode_end if self.eval else processor.on_episode_end
        extras = [k for k in self.layout.out_keys if k != "action"]
        env_id, version, length, ret = cols[ENV_ID], cols[VERSION], cols[LENGTH], cols[RETURN]
        for r in (range(len(done)) if wants_steps else np.flatnonzero(done).tolist()):
            progress = Progress(first + (r if total < 0 else 0), total)
            if wants_steps:
                on_step(TimeStep(env_id=int(env_id[r]), reward=float(cols[REWARD][r]), step_count=int(length[r]),
                                 episode_reward=float(ret[r]), terminated=bool(terminated[r]),
                                 truncated=bool(truncated[r]), policy_version=int(version[r]), progress=progress,
                                 context={k: cols[k][r] for k in extras}, eval=self.eval))
            if done[r]:
                on_end(EpisodeEnd(env_id=int(env_id[r]), length=int(length[r]), reward=float(ret[r]),
                                  terminated=bool(terminated[r]), truncated=bool(truncated[r]),
                                  policy_version=int(version[r]), progress=progress, eval=self.eval,
                                  info={k: np.array(cols[next_key(k)][r]) for k in self.info_keys}))
