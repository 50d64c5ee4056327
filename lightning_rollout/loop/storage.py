"""Storage: the columns of a transition (:class:`Layout`: one numpy column per leaf of the env's specs, the
policy's outputs and the loop's bookkeeping), the time-major :class:`Ring` of recent steps, recycled batch columns
(:class:`BatchPool`). Observations are stored once a step: step ``t``'s ``("next", key)`` is row ``t + 1``'s
``key`` (a reset's final observations kept aside). No threads; the ring and the pool belong to the stepping thread.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch
from tensordict import TensorDict

from ..specs import ArraySpec, EnvKeys, NestedKey, next_key

__all__ = ["BatchPool", "Layout", "Ring"]

TRAJ = ("collector", "traj_ids")
ENV_ID = ("collector", "env_id")
VERSION = ("_loop", "version")  # int64: the policy version that acted (a batch's "policy_version")
# The loop's private bookkeeping of each step (never part of a batch handed to a user).
REWARD = ("_loop", "reward")  # float64: the step's reward, summed over the env's reward leaves
TERMINATED = ("_loop", "terminated")
TRUNCATED = ("_loop", "truncated")
RETURN = ("_loop", "return")  # float64: the episode's return up to and including this step
LENGTH = ("_loop", "length")  # int64: the episode's length up to and including this step
SEQ = ("_loop", "seq")  # int64: the order the step arrived in (flat batches are in arrival order)
PRIVATE = "_loop"
# Entries a gymnasium env gets from the loop (TorchRL's InitTracker, StepCounter and RewardSum).
GYM_LOOP_KEYS = ("is_init", "step_count", "episode_reward")


class Layout:
    """The columns of a transition.

    Attributes:
        carried: root entries each env keeps between steps: its observations and state, what the policy wrote
            under ``"next"`` the env does not provide (recurrent state, zeroed at a reset), and what it wrote at
            the root besides the action (as ``step_mdp(keep_other=True)`` keeps it).
        done_keys: done flags (no root columns: false at the root, an env being reset once done).
        env_next: entries a step writes (``Slots.next``) that the loop stores.
        shared: the observations stored once: step ``t``'s ``("next", key)`` is row ``t + 1``'s ``key``.
        advance: ``(root key, column)``: where each other carried entry comes from after a step; ``policy_carried``:
            the carried entries the env does not provide (zeroed at a reset).
        step_specs: the columns of the ring; ``specs``: those of a batch.
    """

    def __init__(self, keys: EnvKeys, outputs: dict[NestedKey, ArraySpec], *, loop_keys: bool) -> None:
        self.keys, self.loop_keys = keys, loop_keys
        self.out_keys = list(outputs)
        self.action_keys = [k for k in keys.action if k in outputs]
        policy_next = {k[1:] if len(k) > 2 else k[1]: spec for k, spec in outputs.items()
                       if isinstance(k, tuple) and k[0] == "next"}
        fed_back = {k: spec for k, spec in policy_next.items() if k not in keys.root and k not in keys.next}
        kept = {k: spec for k, spec in outputs.items() if not (isinstance(k, tuple) and k[0] == "next")
                and k not in keys.action and k not in keys.root and k not in fed_back}
        self.carried = {**keys.root, **fed_back, **kept}
        self.policy_carried = [*fed_back, *kept]
        self.done_keys = list(keys.done)
        skip = set(GYM_LOOP_KEYS) | set(keys.done) | set(keys.reward) if loop_keys else set()
        self.env_next = [k for k in keys.next if k not in skip]
        self.shared = [k for k in keys.observation if k in self.env_next and next_key(k) not in outputs]
        self.shared_next = {next_key(k): k for k in self.shared}
        self.advance = ([(k, next_key(k)) for k in keys.observation if k not in self.shared and k in self.env_next]
                        + [(k, next_key(k)) for k in fed_back] + [(k, k) for k in kept])
        self.root_inputs = [*self.carried, *self.done_keys]  # what a policy may read
        scalar_i, scalar_f, flag = (ArraySpec((), np.dtype(np.int64)), ArraySpec((), np.dtype(np.float64)),
                                    ArraySpec((), np.dtype(bool)))
        row: dict[NestedKey, ArraySpec] = {**self.carried, **outputs}
        row.update({next_key(k): v for k, v in keys.next.items()})
        row.update({VERSION: scalar_i, REWARD: scalar_f, TERMINATED: flag, TRUNCATED: flag, RETURN: scalar_f,
                    LENGTH: scalar_i, SEQ: scalar_i})
        # a gymnasium env's "next" flags and counters are derived from the bookkeeping when a batch is made
        derived = [next_key(k) for k in (*keys.reward, *keys.done, *GYM_LOOP_KEYS)] if loop_keys else []
        self.step_specs = {k: v for k, v in row.items() if k not in self.shared_next and k not in derived}
        self.specs: dict[NestedKey, ArraySpec] = {**{k: v for k, v in row.items() if k != SEQ},
                                                  TRAJ: scalar_i, ENV_ID: scalar_i}

    def allocate(self, lead: tuple[int, ...], *, ring: bool = False) -> dict[NestedKey, np.ndarray]:
        """Fresh (uninitialised) columns with leading dims ``lead``: a batch's, or with ``ring`` the ring's."""
        specs = self.step_specs if ring else self.specs
        return {k: np.empty(lead + s.shape, dtype=s.dtype) for k, s in specs.items()}

    def to_tensordict(self, columns: dict[NestedKey, np.ndarray], batch_size: Sequence[int],
                      names: Sequence[str | None] | None = None) -> TensorDict:
        """One TensorDict over numpy storage (zero-copy), in TorchRL's layout, the private bookkeeping left out."""
        lead = list(batch_size)
        entries = {key: torch.from_numpy(value) for key, value in columns.items()
                   if not (isinstance(key, tuple) and key[0] == PRIVATE)}
        entries.update({key: torch.zeros((*lead, *self.keys.done[key].shape), dtype=torch.bool)
                        for key in self.done_keys})
        if "policy_version" not in self.out_keys and VERSION in columns:  # else the policy's own entry
            entries["policy_version"] = torch.from_numpy(columns[VERSION])
        td = TensorDict(entries, batch_size=lead)  # nested keys make nested TensorDicts
        for prefix, dims in self.keys.sub_batch.items():
            for root in (prefix, ("next", *prefix)):
                if (sub := td.get(root, None)) is not None:
                    sub.batch_size = torch.Size([*lead, *dims])
        if names is not None:
            td.refine_names(*names)
        return td


class Ring:
    """Every env's recent steps, time-major: ``cols[key][t % capacity, env]`` is step ``t`` of ``env``; step ``t``'s
    shared observations are row ``t + 1``'s root entries, or, after a reset, ``final[(t, env)][("next", key)]``."""

    def __init__(self, layout: Layout, num_envs: int, capacity: int = 4) -> None:
        self.layout, self.num_envs, self.capacity = layout, num_envs, capacity
        self.cols = layout.allocate((capacity, num_envs), ring=True)
        self.final: dict[tuple[int, int], dict[NestedKey, np.ndarray]] = {}

    def grow(self, capacity: int, first: np.ndarray, end: np.ndarray) -> None:
        """Hold ``capacity`` rows, keeping each env's steps ``first[env]`` to ``end[env]`` (its next root)."""
        old, old_capacity = self.cols, self.capacity
        self.cols = self.layout.allocate((capacity, self.num_envs), ring=True)
        self.capacity = capacity
        for t in range(int(first.min()), int(end.max()) + 1):
            envs = np.flatnonzero((first <= t) & (t <= end))
            for k, v in self.cols.items():
                v[t % capacity, envs] = old[k][t % old_capacity, envs]

    def keep_final(self, steps: np.ndarray, envs: np.ndarray) -> None:
        """Keep the shared observations step ``steps[i]`` of ``envs[i]`` ended with, its next root about to be
        replaced by a reset's (the first value kept stays)."""
        rows = (steps + 1) % self.capacity
        for nk, k in self.layout.shared_next.items():
            values = self.cols[k][rows, envs]
            for i, (t, e) in enumerate(zip(steps.tolist(), envs.tolist())):
                self.final.setdefault((t, e), {}).setdefault(nk, values[i])

    def gather(self, steps: np.ndarray, envs: np.ndarray, out: dict[NestedKey, np.ndarray]) -> None:
        """Copy step ``steps[...]`` of ``envs[...]`` (index arrays of ``out``'s leading shape) into ``out``."""
        rows, nxt = steps % self.capacity, (steps + 1) % self.capacity
        for k, dst in out.items():
            if (root := self.layout.shared_next.get(k)) is not None:
                dst[...] = self.cols[root][nxt, envs]
            elif k in self.cols:
                dst[...] = self.cols[k][rows, envs]
        if self.final:
            codes = (steps * self.num_envs + envs).reshape(-1)
            kept = np.fromiter((t * self.num_envs + e for t, e in self.final), np.int64, len(self.final))
            for i in np.flatnonzero(np.isin(codes, kept)).tolist():
                t, e = divmod(int(codes[i]), self.num_envs)
                index = np.unravel_index(i, steps.shape)
                for nk, value in self.final[(t, e)].items():
                    if nk in out:
                        out[nk][index] = value

    def forget(self, consumed: np.ndarray) -> None:
        """Drop final observations of steps handed out (``step < consumed[env]``)."""
        if self.final:
            self.final = {key: v for key, v in self.final.items() if key[0] >= consumed[key[1]]}


def _max_refcount(columns: dict[NestedKey, np.ndarray]) -> int:
    return max(sys.getrefcount(a) for a in columns.values())


_UNREFERENCED = _max_refcount({"probe": np.empty(0)})  # what _max_refcount reports for arrays held by one dict


class BatchPool:
    """The columns of a loop's last two batches, handed out again once nothing references them (their memory is
    already mapped): only when CPython's reference counts show no TensorDict, tensor, view or slice of them left;
    every column is written in full before it is read. The stepping thread uses it; :meth:`clear` may run in any.
    """

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._kept: list[tuple[tuple[int, ...], dict[NestedKey, np.ndarray]]] = []

    def allocate(self, lead: tuple[int, ...]) -> dict[NestedKey, np.ndarray]:
        """Columns with leading dims ``lead``: recycled ones nothing references, else fresh ones."""
        for i, (shape, columns) in enumerate(self._kept):
            if shape == lead and _max_refcount(columns) <= _UNREFERENCED:
                del self._kept[i]
                break
        else:
            columns = self.layout.allocate(lead)
        self._kept = [*self._kept[-1:], (lead, columns)]
        return columns

    def clear(self) -> None:
        """Drop every kept batch's columns (the loop is closing)."""
        self._kept = []
