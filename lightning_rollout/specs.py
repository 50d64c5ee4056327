"""TorchRL specs -> the column layout of a transition: :class:`EnvKeys` lists an env's spec leaves (observations,
state, rewards, done flags, actions) with their per-env shape and numpy dtype (:class:`ArraySpec`), so a batch is laid
out as TorchRL's collector lays it out. Columns hold fixed-shape tensors: dynamic shapes, lazily stacked heterogeneous
specs and non-tensor entries are refused with a :class:`ValueError` that says what to do."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase
from torchrl.data import Bounded, Composite, TensorSpec

__all__ = ["LOOP_ROOT_KEYS", "TORCHRL_ROOT_KEYS", "ArraySpec", "EnvKeys", "NestedKey", "columns_of", "key_parts",
           "next_key", "random_sample", "reserved_key_problem"]

NestedKey = str | tuple[str, ...]

#: Root keys with a meaning of their own in every transition (an entry of that name would be overwritten), and
#: what writes them.
TORCHRL_ROOT_KEYS: dict[str, str] = {
    "action": "TorchRL's action key (the policy writes it)",
    "reward": "TorchRL's reward key (written under 'next' from the env's reward)",
    "done": "TorchRL's done flag", "terminated": "TorchRL's terminated flag", "truncated": "TorchRL's truncated flag",
    "next": "TorchRL's sub-tensordict of the next step",
    "is_init": "the is_init entry the loop writes (TorchRL's InitTracker)",
    "step_count": "the step_count entry the loop writes (TorchRL's StepCounter)",
    "episode_reward": "the episode_reward entry the loop writes (TorchRL's RewardSum)",
}
#: Root keys the loop writes beside every env's entries (its bookkeeping), and what they hold.
LOOP_ROOT_KEYS: dict[str, str] = {
    "collector": "the collector's ('collector', 'traj_ids') / ('collector', 'env_id') entries",
    "policy_version": "the policy_version entry of the weights that acted",
    "_loop": "the loop's private per-step bookkeeping (reward, flags, episode return and length)",
}


@dataclass(frozen=True, slots=True)
class ArraySpec:
    """Shape (without batch dims) and numpy dtype of one stored entry."""

    shape: tuple[int, ...]
    dtype: np.dtype


@dataclass(frozen=True)
class EnvKeys:
    """What one env reads and writes, leaf by leaf, from its TorchRL specs.

    Attributes:
        observation: root entries the env fills on reset and again under ``"next"`` after each step.
        state: entries of ``full_state_spec`` that are not observations (read at the root, written by reset).
        reward: entries found under ``"next"`` only.
        done: done flags (``done``, ``terminated``, ``truncated``, nested ones too), at the root and under ``"next"``.
        action: entries the env reads from the policy.
        sub_batch: shapes of nested sub-tensordicts beyond the env's batch (``{("agents",): (3,)}``).
    """

    observation: dict[NestedKey, ArraySpec]
    state: dict[NestedKey, ArraySpec]
    reward: dict[NestedKey, ArraySpec]
    done: dict[NestedKey, ArraySpec]
    action: dict[NestedKey, ArraySpec]
    sub_batch: dict[tuple[str, ...], tuple[int, ...]] = field(default_factory=dict)

    @property
    def root(self) -> dict[NestedKey, ArraySpec]:
        """Entries the env provides at the root (observations and state; not done flags)."""
        return {**self.observation, **self.state}

    @property
    def next(self) -> dict[NestedKey, ArraySpec]:
        """Entries the env writes under ``"next"`` (keys without the ``"next"`` prefix)."""
        return {**self.observation, **self.reward, **self.done}

    def check_same(self, first: EnvKeys, row: int) -> None:
        """``ValueError`` unless env ``row`` (these keys) can share columns with env 0 (``first``): the same keys,
        shapes and dtypes (the dataclass equality)."""
        if self != first:
            raise ValueError(f"env {row} has specs {self}, env 0 has {first}; all envs of a loop must share their "
                             "keys, shapes and dtypes")

    @classmethod
    def from_specs(cls, *, observation: Composite, state: Composite, reward: Composite, done: Composite,
                   action: Composite, where: str) -> EnvKeys:
        """Build from an unbatched env's ``full_*_spec`` composites; ``ValueError``: a spec that cannot live in a
        fixed-shape column (named, with what to do)."""
        obs_cols = columns_of(observation, where=f"{where} observation spec")
        state_cols = {k: v for k, v in columns_of(state, where=f"{where} state spec").items() if k not in obs_cols}
        sub = {key_parts(k): tuple(int(d) for d in v.shape) for spec in (observation, state, reward, done, action)
               for k, v in spec.items(True, False) if isinstance(v, Composite) and tuple(v.shape)}  # nested batch dims
        return cls(observation=obs_cols, state=state_cols,
                   reward=columns_of(reward, where=f"{where} reward spec"),
                   done=columns_of(done, where=f"{where} done spec"),
                   action=columns_of(action, where=f"{where} action spec"), sub_batch=sub)


def reserved_key_problem(keys: Iterable[NestedKey], reserved: dict[str, str], *, where: str, fix: str) -> str | None:
    """The message refusing the first of ``keys`` whose top-level name is in ``reserved`` (root name -> what it holds),
    or ``None``; ``where`` (what the keys are) and ``fix`` (what to do) go into the message."""
    for key in keys:
        root = key[0] if isinstance(key, tuple) else key
        if root in reserved:
            named = "" if key == root else f" (under {root!r})"
            return (f"entry {key!r} of the {where}{named} collides with {reserved[root]}: its values would be "
                    f"overwritten or read as that entry; {fix}")
    return None


def random_sample(spec: TensorSpec, shape: Sequence[int] = ()) -> Any:
    """``spec.rand(shape)`` (a tensor, or a TensorDict for a ``Composite``; ``shape``: leading batch dims), where a
    float ``Bounded`` leaf's dims with an infinite bound are drawn as gymnasium's ``Box.sample`` draws them (TorchRL's
    uniform draw gives ``inf`` / ``NaN`` there). Draws from torch's default CPU generator."""
    sample = spec.rand(shape)
    if not isinstance(spec, Composite):
        return _finite_sample(spec, tuple(shape), sample)
    for key, leaf in spec.items(True, True):
        sample.set(key, _finite_sample(leaf, tuple(shape), sample.get(key)))
    return sample


def _finite_sample(leaf: TensorSpec, shape: tuple[int, ...], drawn: torch.Tensor) -> torch.Tensor:
    """``drawn`` (TorchRL's uniform sample of ``leaf``) where a float ``Bounded`` leaf has an infinite bound drawn as
    gymnasium's ``Box.sample`` draws it: unbounded from a normal, half-bounded as the bound +/- Exponential(1)."""
    if not isinstance(leaf, Bounded) or not leaf.dtype.is_floating_point:
        return drawn
    low, high = leaf.space.low, leaf.space.high
    low_finite, high_finite = torch.isfinite(low), torch.isfinite(high)
    if bool(low_finite.all()) and bool(high_finite.all()):
        return drawn
    full = (*shape, *leaf.shape)
    exponential = torch.empty(full, dtype=leaf.dtype).exponential_().to(drawn.device)
    normal = torch.randn(full, dtype=leaf.dtype).to(drawn.device)
    out = torch.where(low_finite & high_finite, drawn, normal)
    out = torch.where(low_finite & ~high_finite, low + exponential, out)
    return torch.where(~low_finite & high_finite, high - exponential, out)


def key_parts(key: NestedKey) -> tuple[str, ...]:
    """``key`` as a tuple of its parts: ``"a"`` is ``("a",)``."""
    return key if isinstance(key, tuple) else (key,)


def next_key(key: NestedKey) -> tuple[str, ...]:
    """``key`` under ``"next"``."""
    return ("next", *key_parts(key))


def columns_of(spec: Composite, *, where: str) -> dict[NestedKey, ArraySpec]:
    """``{leaf key: ArraySpec}`` of an unbatched composite spec (nested keys as tuples); ``ValueError``: a leaf that
    cannot be a fixed-shape column."""
    if type(spec).__name__.startswith("Stacked") or getattr(spec, "_td_dim", None) is not None:
        raise ValueError(f"the {where} is a lazily stacked (heterogeneous) spec; ThreadedCollector stores "
                         "fixed-shape columns: give every entry one shape (pad), or use torchrl's Collector")
    out: dict[NestedKey, ArraySpec] = {}
    for key, leaf in spec.items(True, True):
        non_tensor = type(leaf).__name__.startswith("NonTensor")
        if non_tensor or any(d < 0 for d in leaf.shape):
            problem = "is a non-tensor entry" if non_tensor else f"has a dynamic shape {tuple(leaf.shape)}"
            raise ValueError(f"entry {key!r} of the {where} {problem}; ThreadedCollector stores fixed-shape "
                             f"tensors: drop it with ExcludeTransform({key!r}) or use torchrl's Collector")
        out[key] = ArraySpec(tuple(int(d) for d in leaf.shape), torch.empty((), dtype=leaf.dtype).numpy().dtype)
    return out


def leaves(td: TensorDictBase, keys: Iterable[NestedKey]) -> dict[NestedKey, np.ndarray]:
    """``{key: numpy view}`` of ``keys`` in a CPU tensordict (missing keys are skipped)."""
    return {k: value.detach().cpu().numpy() for k in keys if (value := td.get(k, None)) is not None}
