"""A batched env instance given to the collector: taken apart into single envs, or stepped as it is.

``ThreadedCollector`` steps a batched env as TorchRL's ``Collector`` does (one ``env.step_and_maybe_reset`` a batch:
:class:`~lightning_rollout.envs.TorchRLUnit`), except where taking it apart provably gives the same data
(:func:`takes_apart`): a ``SerialEnv`` or ``ParallelEnv`` of unbatched envs (one factory per ``create_env_fn`` with
its ``create_env_kwargs``), maybe inside a ``TransformedEnv`` whose transforms are all :data:`ROW_TRANSFORMS` (each
single env gets its own clone). Anything else is stepped as it is: ``GymEnv(name, num_envs=k)``, transforms with
state or parameters (``CatFrames``, ``VecNorm``...), a gymnasium vector env, envpool, VMAS, a heterogeneous stack...
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import torch
from torchrl.envs import (Compose, DoubleToFloat, EnvBase, InitTracker, ParallelEnv, RewardSum, SerialEnv,
                          StepCounter, Transform, TransformedEnv)

from .envs import EnvFactory, close_quietly

__all__ = ["ROW_TRANSFORMS", "BatchedEnv", "batched_env", "is_batched", "takes_apart"]

ROW_TRANSFORMS: tuple[type[Transform], ...] = (InitTracker, StepCounter, RewardSum, DoubleToFloat)
"""The transforms around a ``SerialEnv`` / ``ParallelEnv`` that still let it be taken apart (those classes, not
subclasses): they keep no state or per-row parameter (what they count or sum is an entry, one per row)."""

_GYM_WRAPPER_MODES = (gym.vector.AutoresetMode.SAME_STEP, gym.vector.AutoresetMode.DISABLED)


@dataclass(frozen=True)
class BatchedEnv:
    """A batched env instance as the collector's envs: ``factories``, one per env, row-major over ``batch_size`` (of a
    single env when taken apart, else each returns the batched env itself); ``native``: stepped as it is."""

    factories: list[EnvFactory]
    batch_size: torch.Size
    native: bool


def is_batched(env: Any) -> bool:
    """Whether ``env`` is a batched env instance (a TorchRL env with a batch size, a gymnasium vector env)."""
    return len(env.batch_size) > 0 if isinstance(env, EnvBase) else isinstance(env, gym.vector.VectorEnv)


def _transforms(transform: Transform) -> list[Transform]:
    if type(transform) is Compose:
        return [t for part in transform.transforms for t in _transforms(part)]
    return [transform]


def takes_apart(env: Any) -> bool:
    """Whether the batched env instance ``env`` is taken apart into its single envs (see the module docstring)."""
    if type(env) is TransformedEnv:
        return (all(type(t) in ROW_TRANSFORMS for t in _transforms(env.transform))
                and takes_apart(env.base_env))
    return type(env) in (SerialEnv, ParallelEnv) and len(env.batch_size) == 1


class _Transformed:
    """``TransformedEnv(factory(), transform.clone())``: a picklable factory when its parts are."""

    def __init__(self, factory: EnvFactory, transform: Transform) -> None:
        self.factory, self.transform = factory, transform

    def __call__(self) -> EnvBase:
        return TransformedEnv(self.factory(), self.transform.clone())

    def __repr__(self) -> str:
        return f"_Transformed({self.factory!r}, {type(self.transform).__name__})"


def _singles(env: EnvBase) -> list[EnvFactory]:
    """One factory per single env of ``env`` (one :func:`takes_apart` takes apart), in its order."""
    if isinstance(env, TransformedEnv):
        return [_Transformed(f, env.transform) for f in _singles(env.base_env)]
    return [functools.partial(fn, **kwargs) if kwargs else fn
            for fn, kwargs in zip(env.create_env_fn, env.create_env_kwargs, strict=True)]


def _leaf_layout(spec: Any) -> dict[Any, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(leaf.shape), leaf.dtype) for k, leaf in spec.items(True, True)}


def _rows_match(env: EnvBase, factory: EnvFactory) -> bool:
    """Whether a rebuilt single env's entries (keys, shapes, dtypes) are one row of the batched env's (a
    heterogeneous stack, whose rows cannot be read alone, is not shown to match)."""
    single = factory()
    try:
        return all(_leaf_layout(getattr(env, part)[0]) == _leaf_layout(getattr(single, part))
                   for part in ("output_spec", "input_spec"))
    except (IndexError, RuntimeError, ValueError):
        return False
    finally:
        close_quietly([single])


def batched_env(env: Any, *, num_workers: int | str) -> BatchedEnv:
    """The envs of the batched env instance ``env`` (:func:`is_batched`): its single envs when
    :func:`takes_apart` (``env`` is then closed), else ``env`` itself, stepped as it is.

    Raises:
        ValueError: (``env`` closed) a natively stepped env with ``num_workers`` above 1 (it is stepped in this
            process); a gymnasium vector env in an autoreset mode TorchRL's ``GymWrapper`` does not take.
    """
    try:
        factories = _singles(env) if takes_apart(env) else None
        if factories is not None and _rows_match(env, factories[0]):  # else stepped as it is, as Collector does
            close_quietly([env])
            return BatchedEnv(factories, torch.Size(env.batch_size), native=False)
        batch = torch.Size(env.batch_size if isinstance(env, EnvBase) else (env.num_envs,))
        if isinstance(num_workers, int) and num_workers > 1:
            raise ValueError(
                f"num_workers={num_workers} with a batched env instance ({type(env).__name__}, batch_size="
                f"{tuple(batch)}) that is stepped as it is, in this process; pass num_workers=1, or a factory of it "
                f"with num_envs a multiple of {batch.numel()} (each worker process then builds and steps its own)")
        mode = (getattr(env, "autoreset_mode", None) or env.metadata.get("autoreset_mode")) if isinstance(
            env, gym.vector.VectorEnv) else None
        if mode is not None and mode not in _GYM_WRAPPER_MODES:
            raise ValueError(f"a gymnasium {type(env).__name__} with autoreset_mode={getattr(mode, 'name', mode)}: it "
                             "is stepped as TorchRL's GymWrapper steps a vector env, which takes SAME_STEP or "
                             "DISABLED only; pass gym.make_vec(..., vectorization_mode='sync', "
                             "vector_kwargs={'autoreset_mode': gym.vector.AutoresetMode.SAME_STEP}) (or "
                             "SyncVectorEnv(..., autoreset_mode=...)), or a factory of one env and num_envs")
        return BatchedEnv([lambda: env] * batch.numel(), batch, native=True)
    except BaseException:
        close_quietly([env])
        raise
