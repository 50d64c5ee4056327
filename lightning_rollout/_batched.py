"""A batched env given to the collector, as the single envs it batches.

TorchRL's ``Collector`` steps a batched env (``batch_size=[B]`` or more dims) in one call and
yields ``[*batch_size, T]`` batches. ``ThreadedCollector`` steps single envs in its own threads
and processes, so a batched env whose single envs can be rebuilt is taken apart into them: one
factory per env, in the batched env's order (row-major over its batch dims), and the batch
shape its batches take again at export. The batched env itself is closed (its worker processes
end): it is never stepped.

Taken apart:

* ``SerialEnv`` / ``ParallelEnv``: their ``create_env_fn`` and ``create_env_kwargs``, one pair a
  sub-env; a sub-env that is batched itself (``SerialEnv(3, lambda: SerialEnv(2, ...))``, batch
  ``[3, 2]``) is built once to be taken apart in turn.
* ``GymEnv(name, num_envs=k)``: ``k`` copies of ``GymEnv(name)`` with the same options.
* ``TransformedEnv(batched, transform)``: each single env gets its own clone of ``transform``.
  Transforms that keep one state for the whole batch (``VecNorm``'s running statistics) then
  keep one state a single env.
* A gymnasium ``SyncVectorEnv`` / ``AsyncVectorEnv``: its ``env_fns``. Its autoreset mode does
  not matter: each single env is reset by the loop when it is done, and no reset step is counted
  as a frame.

Every rebuilt single env of a TorchRL batched env is checked against the batched env's specs
(one row of them); a mismatch is refused with a ``ValueError``. Any other batched env (envpool,
VMAS, a vector env inside vector wrappers, a natively batched ``EnvBase``) is not taken apart
(:func:`splittable` says which): the collector steps it as it is, one call for its whole batch
(:mod:`lightning_rollout.loop.native`). Nothing here holds a thread or a lock.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import torch
from torchrl.envs import EnvBase, TransformedEnv
from torchrl.envs.batched_envs import BatchedEnvBase
from torchrl.envs.libs.gym import GymEnv

from .envs import EnvFactory, close_quietly

__all__ = ["SplitEnv", "is_batched", "split_batched_env", "splittable"]


@dataclass(frozen=True)
class SplitEnv:
    """A batched env as its single envs.

    Attributes:
        factories: one factory of an unbatched env per env, row-major over ``batch_size``.
        batch_size: the batched env's batch dims (``len(factories) == batch_size.numel()``).
    """

    factories: list[EnvFactory]
    batch_size: torch.Size


def is_batched(env: Any) -> bool:
    """Whether ``env`` is a batched env instance (a TorchRL env with a batch size, a gymnasium vector env)."""
    if isinstance(env, EnvBase):
        return tuple(env.batch_size) != ()
    return isinstance(env, gym.vector.VectorEnv)


def splittable(env: Any) -> bool:
    """Whether the batched env instance ``env`` is one :func:`split_batched_env` takes apart (see the module
    docstring); any other is stepped natively, as it is."""
    if isinstance(env, TransformedEnv):
        return splittable(env.base_env)
    if isinstance(env, BatchedEnvBase):
        return True
    if type(env) is GymEnv:
        return len(env.batch_size) == 1
    return type(env) in (gym.vector.SyncVectorEnv, gym.vector.AsyncVectorEnv)


class _Transformed:
    """``TransformedEnv(factory(), transform.clone())``: a picklable factory when its parts are."""

    def __init__(self, factory: EnvFactory, transform: Any) -> None:
        self.factory, self.transform = factory, transform

    def __call__(self) -> EnvBase:
        return TransformedEnv(self.factory(), self.transform.clone())

    def __repr__(self) -> str:
        return f"_Transformed({self.factory!r}, {type(self.transform).__name__})"


def _unsplittable(env: Any, why: str) -> ValueError:
    return ValueError(
        f"got a batched env that cannot be taken apart into single envs ({type(env).__name__}: {why}); pass a "
        "factory of one env and num_envs (e.g. lambda: GymEnv(...)), or the natively batched env alone")


def _split_torchrl(env: EnvBase) -> list[EnvFactory]:
    """One factory per single env of a batched TorchRL env, row-major over its batch dims."""
    if isinstance(env, TransformedEnv):
        return [_Transformed(f, env.transform) for f in _split_torchrl(env.base_env)]
    if isinstance(env, BatchedEnvBase):
        subs = [functools.partial(fn, **kwargs) if kwargs else fn
                for fn, kwargs in zip(env.create_env_fn, env.create_env_kwargs, strict=True)]
        if len(env.batch_size) == 1:
            return subs
        out: list[EnvFactory] = []
        for make in subs:  # a batched sub-env: built once to be taken apart (it is never stepped)
            sub = make()
            try:
                out.extend(_split_torchrl(sub))
            finally:
                close_quietly([sub])
        return out
    if type(env) is GymEnv and len(env.batch_size) == 1:
        options = {k: v for k, v in env._constructor_kwargs.items() if k != "num_envs"}
        single = functools.partial(GymEnv, **options, device=env.device, frame_skip=env.frame_skip,
                                   categorical_action_encoding=env._categorical_action_encoding)
        return [single] * int(env.batch_size[0])
    raise _unsplittable(env, f"batch_size={tuple(env.batch_size)} stepped in one call")


def _leaf_layout(spec: Any) -> dict[Any, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(leaf.shape), leaf.dtype) for k, leaf in spec.items(True, True)}


def _check_row_specs(env: EnvBase, factory: EnvFactory) -> None:
    """Refuse a rebuilt single env whose entries (keys, shapes, dtypes) are not one row of the batched env's."""
    single = factory()
    try:
        index = (0,) * len(env.batch_size)
        for part in ("output_spec", "input_spec"):
            row, mine = _leaf_layout(getattr(env, part)[index]), _leaf_layout(getattr(single, part))
            if mine != row:
                raise _unsplittable(env, f"its rebuilt single env's {part} entries {mine} are not one row of "
                                         f"its own, {row}")
    finally:
        close_quietly([single])


def split_batched_env(env: Any) -> SplitEnv:
    """The single envs of the batched env instance ``env`` (see the module docstring); ``env`` is closed.

    Raises:
        ValueError: ``env`` cannot be taken apart (it is closed too, as a refused env is).
    """
    try:
        if isinstance(env, EnvBase):
            factories = _split_torchrl(env)
            _check_row_specs(env, factories[0])
            return SplitEnv(factories, torch.Size(env.batch_size))
        if type(env) in (gym.vector.SyncVectorEnv, gym.vector.AsyncVectorEnv):
            fns: Sequence[Callable[[], gym.Env]] = env.env_fns
            return SplitEnv(list(fns), torch.Size([len(fns)]))
        raise _unsplittable(env, "a vector env other than a plain SyncVectorEnv or AsyncVectorEnv")
    finally:
        if isinstance(env, EnvBase):
            close_quietly([env])
        else:
            env.close()
