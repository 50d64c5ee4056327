"""Storage: the column layout of a transition, each env group's time-major storage, and recycled batches.

One column (a preallocated numpy array) per leaf of the env's TorchRL specs, of the policy's
outputs, and of the loop's own bookkeeping. An env thread writes its group's steps into a
:class:`Steps` storage, time-major (``cols[key][t]`` is step ``t`` of every env of the
group, one row per env), and the driver copies the steps it hands out from there into a
batch, once. A step's row holds everything TorchRL's collector puts in a transition:

* the root entries the policy and the env read (written when the step before ended: carried
  from that step's ``"next"`` entries, or a reset's for an env that was done);
* the policy's outputs and ``policy_version``;
* the env's ``"next"`` entries, except its observations: step ``t``'s ``("next", key)`` of an
  observation is the root ``key`` of row ``t + 1``, written there once by the env (as
  TorchRL's ``step_mdp`` carries it). An env reset after step ``t`` (done, or reset by
  the driver) overwrites its root in row ``t + 1``: its final observations are kept
  first in a small side table (:meth:`Steps.keep_final`), as gymnasium keeps
  ``final_obs``, and the copy out of the storage reads them from there;
* the loop's private bookkeeping under ``"_loop"``: the step's reward (summed over reward
  leaves), terminated, truncated, and the episode's return and length so far (events and
  counts read them; a batch handed to a user leaves them out).

A batch adds ``("collector", "traj_ids")`` and ``("collector", "env_id")``, written by the
driver when it copies the steps out. A TensorDict is built over a batch's columns once, never
per step. Nothing here holds threads; :class:`BatchPool` keeps the columns of recent batches
to hand them out again once nothing references them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from ..specs import ArraySpec, EnvKeys, NestedKey, key_parts, next_key

__all__ = ["BatchPool", "Layout", "Steps", "check_entries"]


# Entries the driver writes into a batch beside the env's and the policy's.
_TRAJ = ("collector", "traj_ids")
_ENV_ID = ("collector", "env_id")
_VERSION = "policy_version"
# The loop's private bookkeeping of each step (never part of a batch handed to a user).
_REWARD = ("_loop", "reward")  # float64: the step's reward, summed over the env's reward leaves
_TERMINATED = ("_loop", "terminated")  # bool
_TRUNCATED = ("_loop", "truncated")  # bool
_RETURN = ("_loop", "return")  # float64: the episode's return up to and including this step (settled)
_LENGTH = ("_loop", "length")  # int64: the episode's length up to and including this step (settled)
_PRIVATE = "_loop"
# Entries a gymnasium env gets from the loop itself (TorchRL's StepCounter, RewardSum, InitTracker and
# its done flags), written one vectorised assignment per run of steps rather than per env.
_GYM_LOOP_KEYS = ("is_init", "step_count", "episode_reward")


class Layout:
    """Per-transition columns: one per leaf of the env's specs, of the policy's outputs, and of the loop's
    bookkeeping.

    Attributes:
        carried: root entries each env keeps between steps (``{key: ArraySpec}``): the env's
            observations and state, what the policy wrote under ``"next"`` that the env does not
            provide (recurrent state), and what it wrote at the root besides the action (kept as
            TorchRL's ``step_mdp(keep_other=True)`` keeps it).
        done_keys: done flags; all-false at the root (an env is reset as soon as it is done), so
            they are no root columns: zeros are added when a batch is built.
        advance: ``(root key, column)`` pairs: where each carried entry comes from after a step (the
            shared observations aside: they need no copy).
        env_next: entries the env adapter returns under ``"next"`` and the loop stores.
        shared: the env's observations (those the policy does not write under ``"next"`` as well): step
            ``t``'s ``("next", key)`` is stored as the root ``key`` of row ``t + 1`` (no ``"next"`` column);
            ``shared_next`` maps each ``("next", key)`` to ``key``.
        next_columns: ``(key, column)`` for each of ``env_next``: the step column it is written to (its
            ``"next"`` one, or for a shared observation the root column, one row later).
        step_specs: the columns of a step's row (what an env thread writes).
        specs: the columns of a batch: ``step_specs`` and the driver's trajectory and env ids.
    """

    def __init__(self, keys: EnvKeys, outputs: dict[NestedKey, ArraySpec], *, loop_keys: bool) -> None:
        env_root = keys.root
        self.keys = keys
        self.loop_keys = loop_keys
        self.out_keys = list(outputs)
        self.action_keys = [k for k in keys.action if k in outputs]
        policy_next = {k[1:] if len(k) > 2 else k[1]: spec for k, spec in outputs.items()
                       if isinstance(k, tuple) and k[0] == "next"}
        fed_back = {k: spec for k, spec in policy_next.items() if k not in env_root and k not in keys.next}
        kept = {k: spec for k, spec in outputs.items() if not (isinstance(k, tuple) and k[0] == "next")
                and k not in keys.action and k not in env_root and k not in fed_back}
        self.carried = {**env_root, **fed_back, **kept}
        self.policy_carried = [*fed_back, *kept]  # zeroed at each reset (the env does not provide them)
        self.done_keys = list(keys.done)
        skip = set(_GYM_LOOP_KEYS) | set(keys.done) | set(keys.reward) if loop_keys else set()
        self.env_next = [k for k in keys.next if k not in skip]
        self.shared = [k for k in keys.observation if k in self.env_next and next_key(k) not in outputs]
        self.shared_next = {next_key(k): k for k in self.shared}
        self.next_columns = [(k, k if k in self.shared else next_key(k)) for k in self.env_next]
        self.advance = ([(k, next_key(k)) for k in keys.observation if k not in self.shared]
                        + [(k, next_key(k)) for k in fed_back] + [(k, k) for k in kept])
        self.checked_next = {k: keys.observation[k] for k in self.env_next if k in keys.observation}
        self.checked_root = {k: v for k, v in keys.root.items() if not (loop_keys and k in _GYM_LOOP_KEYS)}
        self.root_inputs = [*self.carried, *self.done_keys]  # what a policy may read
        scalar_i, scalar_f, flag = ArraySpec((), np.dtype(np.int64)), ArraySpec((), np.dtype(np.float64)), \
            ArraySpec((), np.dtype(bool))
        row: dict[NestedKey, ArraySpec] = {**self.carried, **outputs}
        row.update({next_key(k): v for k, v in keys.next.items()})
        row.update({_VERSION: scalar_i, _REWARD: scalar_f, _TERMINATED: flag, _TRUNCATED: flag,
                    _RETURN: scalar_f, _LENGTH: scalar_i})
        self.step_specs = {k: v for k, v in row.items() if k not in self.shared_next}
        self.specs: dict[NestedKey, ArraySpec] = {**row, _TRAJ: scalar_i, _ENV_ID: scalar_i}

    def allocate(self, rows: int | tuple[int, ...], *, steps: bool = False) -> dict[NestedKey, np.ndarray]:
        """Fresh (uninitialised) columns with leading dims ``rows``: a batch's, or with ``steps`` a step row's."""
        lead = (rows,) if isinstance(rows, int) else rows
        specs = self.step_specs if steps else self.specs
        return {k: np.empty(lead + s.shape, dtype=s.dtype) for k, s in specs.items()}

    def to_tensordict(self, columns: dict[NestedKey, np.ndarray], batch_size: Sequence[int],
                      names: Sequence[str | None] | None = None) -> TensorDict:
        """One TensorDict over numpy storage (zero-copy), in TorchRL's layout; the private bookkeeping
        left out."""
        lead = list(batch_size)
        tree: dict[str, Any] = {}  # nested dicts of tensors, built into one TensorDict at once (not set key by key)
        leaves = [(key, torch.from_numpy(value)) for key, value in columns.items()
                  if not (isinstance(key, tuple) and key[0] == _PRIVATE)]
        leaves += [(key, torch.zeros((*lead, *self.keys.done[key].shape), dtype=torch.bool))  # root done flags:
                   for key in self.done_keys]  # false, as TorchRL's collector writes them
        for key, tensor in leaves:
            *path, leaf = key_parts(key)
            node = tree
            for part in path:
                node = node.setdefault(part, {})
            node[leaf] = tensor
        td = TensorDict(tree, batch_size=lead)
        for prefix, dims in self.keys.sub_batch.items():
            for root in (prefix, ("next", *prefix)):
                sub = td.get(root, None)
                if sub is not None:
                    sub.batch_size = torch.Size([*lead, *dims])
        if names is not None:
            td.refine_names(*names)
        return td


class Steps:
    """The steps of one env group, time-major: ``cols[key][t % capacity]`` is step ``t``'s row, one row per env
    of the group (``[rows, *shape]``).

    Steps are numbered from 0 for ever; the storage keeps the last ``capacity`` of them (a ring), or, with
    ``grow=True``, every one of them (an episode's: the capacity doubles when a step needs a row past it).
    A row's views are made once per physical row and reused (:meth:`row`).

    Step ``t``'s shared observations (:attr:`Layout.shared`) are row ``t + 1``'s root entries, or, for an
    env given a new root there (a reset), its entry in :attr:`final` (:meth:`keep_final`).

    Threading: the env thread that owns the group writes rows and :attr:`final`; the driver reads the rows
    and final observations of steps the thread published (see :mod:`lightning_rollout.loop.worker`), which
    the thread writes again only once the driver says it copied them out. :meth:`resize` replaces the
    arrays and runs in the owning thread while the driver reads nothing. :attr:`final` is read with
    ``dict.get`` only (no iteration across threads).

    Args:
        layout: the columns.
        rows: envs in the group.
        capacity: rows kept (``>= 2``: a step and the root entries of the next).
        grow: keep every step (an episode), doubling the capacity as needed.
    """

    def __init__(self, layout: Layout, rows: int, capacity: int, *, grow: bool = False) -> None:
        self.layout = layout
        self.rows = rows
        self.grow = grow
        self.capacity = 0
        self.cols: dict[NestedKey, np.ndarray] = {}
        # step -> {column: {("next", key): value}}: the shared observations a step ended with, for the envs
        # whose root in the row after it a reset replaced
        self.final: dict[int, dict[int, dict[NestedKey, np.ndarray]]] = {}
        self._views: list[dict[NestedKey, np.ndarray] | None] = []
        self.resize(max(2, capacity), 0, 0)

    def resize(self, capacity: int, first: int, end: int) -> None:
        """Hold ``capacity`` rows, keeping steps ``first`` to ``end - 1`` (each at its row of the new ring)."""
        old, old_capacity = self.cols, self.capacity
        self.cols = self.layout.allocate((capacity, self.rows), steps=True)
        self.capacity = capacity
        self._views = [None] * capacity
        for t in range(first, end):
            src, dst = t % old_capacity, t % capacity
            for k, v in self.cols.items():
                v[dst] = old[k][src]

    def ensure(self, t: int) -> None:
        """A growing storage makes room for step ``t`` (and the root entries of step ``t + 1``)."""
        if self.grow and t + 1 >= self.capacity:
            self.resize(2 * (t + 2), 0, t + 1)

    def row(self, t: int) -> dict[NestedKey, np.ndarray]:
        """Views of step ``t``'s row of every column (``[rows, *shape]`` each)."""
        r = t % self.capacity
        views = self._views[r]
        if views is None:
            views = self._views[r] = {k: v[r] for k, v in self.cols.items()}
        return views

    def spans(self, first: int, end: int) -> list[tuple[int, int]]:
        """Steps ``first`` to ``end - 1`` as at most two runs of consecutive rows: ``(row, row_end)`` pairs."""
        if end <= first:
            return []
        a, c = first % self.capacity, self.capacity
        n = end - first
        return [(a, a + n)] if a + n <= c else [(a, c), (0, a + n - c)]

    def keep_final(self, t: int, cols: Sequence[int]) -> None:
        """Keep the shared observations step ``t`` ended with for columns ``cols``, whose root entries in row
        ``t + 1`` are about to be replaced (a reset); the first kept value of a column stays."""
        if not self.layout.shared:
            return
        nxt = self.row(t + 1)
        kept = self.final.setdefault(t, {})
        for c in cols:
            if c not in kept:
                kept[c] = {nk: nxt[k][c].copy() for nk, k in self.layout.shared_next.items()}

    def drop_final(self, before: int) -> None:
        """Forget the final observations of steps before ``before`` (copied out)."""
        for t in [t for t in self.final if t < before]:  # (this thread alone writes the table)
            del self.final[t]

    def _copy(self, src: np.ndarray, first: int, end: int, dst: np.ndarray, env_major: bool, offset: int) -> None:
        """Rows ``first`` to ``end - 1`` of ``src`` (a column) into ``dst``, as :meth:`copy_out` places them."""
        i = 0
        for a, b in self.spans(first, end):
            n = b - a
            if env_major:
                dst[:, offset + i:offset + i + n] = src[a:b].swapaxes(0, 1)
            else:
                r0 = offset + i * self.rows
                dst[r0:r0 + n * self.rows] = src[a:b].reshape(n * self.rows, *src.shape[2:])
            i += n

    def copy_out(self, first: int, end: int, out: dict[NestedKey, np.ndarray], *, env_major: bool,
                 offset: int = 0) -> None:
        """Copy steps ``first`` to ``end - 1`` into the batch columns ``out`` (keys of ``out`` only): with
        ``env_major``, to ``out[k][env, offset + i]`` (``[envs, T, ...]`` views); else flat in time order,
        env by env within a step, from row ``offset``."""
        shared_next = self.layout.shared_next
        for k, dst in out.items():
            root = shared_next.get(k)
            if root is not None:  # step t's ("next", key) is row t + 1's root key
                self._copy(self.cols[root], first + 1, end + 1, dst, env_major, offset)
            elif (src := self.cols.get(k)) is not None:
                self._copy(src, first, end, dst, env_major, offset)
        if self.final:  # envs reset after a step: their final observations
            for t in range(first, end):
                for c, nk, value in self._finals(t, out):
                    out[nk][(c, offset + t - first) if env_major else offset + (t - first) * self.rows + c] = value

    def copy_rows(self, t: int, r0: int, r1: int, out: dict[NestedKey, np.ndarray], at: int) -> None:
        """Copy rows ``r0`` to ``r1 - 1`` of step ``t`` into ``out[at:]`` (keys of ``out`` only)."""
        row, shared_next, n = self.row(t), self.layout.shared_next, r1 - r0
        for k, dst in out.items():
            root = shared_next.get(k)
            src = self.row(t + 1)[root] if root is not None else row.get(k)
            if src is not None:
                dst[at:at + n] = src[r0:r1]
        if self.final:
            for c, nk, value in self._finals(t, out):
                if r0 <= c < r1:
                    out[nk][at + c - r0] = value

    def _finals(self, t: int, out: dict[NestedKey, np.ndarray]) -> list[tuple[int, NestedKey, np.ndarray]]:
        """``(column, "next" key, value)`` of each final observation kept for step ``t`` whose key is in ``out``.
        Read with ``dict.get`` and a copy of the step's entry: the worker may keep another meanwhile."""
        kept = self.final.get(t)
        if not kept:
            return []
        return [(c, nk, value) for c, values in kept.copy().items() for nk, value in values.items() if nk in out]

    def episode(self, length: int) -> dict[NestedKey, np.ndarray]:
        """Steps ``0`` to ``length - 1`` of a one-env storage that no reset wrote into after its first step (an
        episode's): ``[length, ...]`` columns in the batch's key order (views, the shared observations' "next"
        entries copied, so that no two entries share memory)."""
        shared_next = self.layout.shared_next
        return {k: self.cols[shared_next[k]][1:length + 1, 0].copy() if k in shared_next else self.cols[k][:length, 0]
                for k in self.layout.specs if k in self.cols or k in shared_next}


def _max_refcount(columns: dict[NestedKey, np.ndarray]) -> int:
    """The highest reference count among ``columns``' arrays (as this function sees it)."""
    return max(sys.getrefcount(a) for a in columns.values())


# What _max_refcount reports for arrays held by one dict and nothing else.
_UNREFERENCED = _max_refcount({"probe": np.empty(0)})


class BatchPool:
    """The columns of a loop's recent batches, handed out again once nothing references them.

    A batch is built over fresh arrays (``np.empty``); big ones are fresh pages the kernel
    maps and zeroes on the first write, one fault a page: 7-15 ms to write 51 MB of 100 KB
    Atari frames for the first time, against 3 ms into memory already mapped. So :meth:`allocate`
    first looks among the columns of the last ``keep`` batches for one nothing else
    references any more, by CPython's reference counts: the batch's TensorDict, its
    tensors (``torch.from_numpy`` holds its array), any view, slice, ``.numpy()`` or
    exception ``partial`` of it hold one. A batch still referenced anywhere is never
    written again, so recycling changes no value a caller can see: a training loop that
    drops each batch before asking for the next (``for batch in collector``: the batch
    before the current one) gets its memory back, and one that keeps batches (a list, a
    replay buffer's own storage copies them anyway) gets fresh arrays.

    The recycled arrays hold the old batch's values; every column of a batch is written in
    full before it is read, as with ``np.empty``. Holds up to ``keep`` batches' columns
    after the caller dropped them (memory the kernel would otherwise take back).

    :meth:`allocate` is not thread-safe: one driver call at a time uses it. :meth:`clear` may run
    in any thread meanwhile (``MultiEnvLoop.close``): it swaps the list, never mutates it.

    Args:
        layout: the columns.
        keep: how many batches' columns to keep (``>= 0``; 0 allocates every batch afresh).
    """

    def __init__(self, layout: Layout, *, keep: int = 2) -> None:
        self.layout = layout
        self.keep = keep
        self._kept: list[tuple[tuple[int, ...], dict[NestedKey, np.ndarray]]] = []  # oldest first
        self.reused = 0  # batches whose columns were recycled (tests, benchmarks)

    def allocate(self, rows: int | tuple[int, ...]) -> dict[NestedKey, np.ndarray]:
        """Columns with leading dims ``rows``: recycled ones nothing references, else fresh ones."""
        lead = (rows,) if isinstance(rows, int) else tuple(rows)
        kept = self._kept
        for i, (shape, columns) in enumerate(kept):
            if shape == lead and _max_refcount(columns) <= _UNREFERENCED:
                del kept[i]
                kept.append((lead, columns))
                self.reused += 1
                return columns
        columns = self.layout.allocate(lead)
        if self.keep:
            kept.append((lead, columns))
            del kept[:-self.keep]
        return columns

    def clear(self) -> None:
        """Drop every kept batch's columns (the loop is closing)."""
        self._kept = []


def check_entries(values: dict[NestedKey, Any], specs: dict[NestedKey, ArraySpec]) -> str | None:
    """The first problem of ``values`` against ``specs`` (missing entry, shape, dtype, NaN), or ``None``.

    Python scalars (the adapter's own counters) pass unchecked.
    """
    for k, spec in specs.items():
        v = values.get(k)
        if v is None:
            return f"entry {k!r} is missing"
        if not isinstance(v, np.ndarray):
            continue
        if v.shape != spec.shape:
            return f"entry {k!r} has shape {v.shape}, expected {spec.shape}"
        if v.dtype != spec.dtype and not np.can_cast(v.dtype, spec.dtype, "same_kind"):
            return f"entry {k!r} has dtype {v.dtype}, expected {spec.dtype}"
        if v.dtype.kind == "f":
            total = v.sum()  # one sum finds any NaN (inf - inf too, which isnan then clears)
            if total != total and np.isnan(v).any():
                return f"entry {k!r} contains NaN"
    return None
