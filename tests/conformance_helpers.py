"""Helpers for tests/test_torchrl_conformance.py: one builder for both collectors.

TorchRL's collector tests hand ``Collector`` a *batched* env (``SerialEnv(n, fn)``,
``ParallelEnv(n, fn)`` or a mock built with ``batch_size=(n,)``). ``ThreadedCollector``
parallelises itself and refuses batched envs: it takes the ``n`` env factories instead.
:class:`EnvBatch` describes such a batch once and gives each collector its form;
:func:`build_collector` builds either collector from it. The policies, envs and
factories below are copied from TorchRL's ``test/test_collectors.py`` (0.14.0).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torchrl.collectors import BaseCollector
from torchrl.data import Composite, Unbounded
from torchrl.envs import Compose, EnvBase, InitTracker, SerialEnv, StepCounter, TransformedEnv
from torchrl.envs.libs.gym import GymEnv
from torchrl.modules import RandomPolicy
from torchrl.testing import CARTPOLE_VERSIONED, PENDULUM_VERSIONED
from torchrl.testing.mocking_classes import (
    CountingEnv,
    DiscreteActionConvMockEnv,
    DiscreteActionConvPolicy,
    DiscreteActionVecMockEnv,
    DiscreteActionVecPolicy,
)

from lightning_rollout import ThreadedCollector

EnvFactory = Callable[[], EnvBase]


def is_threaded(collector_cls: type[BaseCollector]) -> bool:
    return issubclass(collector_cls, ThreadedCollector)


@dataclass
class EnvBatch:
    """``len(factories)`` unbatched envs side by side: the port of one batched env.

    * TorchRL's ``Collector`` gets one batched env, built once by :meth:`batched_env`:
      ``batched()`` when given (a mock natively built with ``batch_size=(n, ...)``),
      else ``SerialEnv(n, factories, **serial_kwargs)``.
    * ``ThreadedCollector`` gets a batched env too, the same way a user swapping the collector
      line passes it: a ``SerialEnv`` of the factories, nested to ``batch_size`` (the
      ``SerialEnv`` form of a natively batched mock); it takes it apart into its single envs.

    Args:
        factories: one factory of an unbatched env per env, row-major over ``batch_size``.
        batched: builds the batched env for ``Collector`` (default: a ``SerialEnv``).
        serial_kwargs: extra ``SerialEnv`` arguments (``device``, ``share_individual_td``...).
        seed: the original's ``env.set_seed(seed)`` before the collector is built: applied
            to the batched env for ``Collector``, passed as ``seed=`` to ``ThreadedCollector``.
        batch_size: the batched env's batch dims (default ``(len(factories),)``).
    """

    factories: Sequence[EnvFactory]
    batched: EnvFactory | None = None
    serial_kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    batch_size: tuple[int, ...] | None = None
    _batched_env: EnvBase | None = field(default=None, init=False, repr=False)

    @classmethod
    def serial(cls, n: int, factory: EnvFactory, **kwargs: Any) -> EnvBatch:
        """``n`` copies of ``factory`` (the port of ``SerialEnv(n, factory)``)."""
        return cls([factory] * n, **kwargs)

    def _serial(self, factories: Sequence[EnvFactory], dims: Sequence[int]) -> EnvBase:
        """``SerialEnv`` of ``factories`` nested to ``dims`` (``SerialEnv(5, [SerialEnv(2, ...), ...])``)."""
        if len(dims) > 1:
            width = len(factories) // dims[0]
            factories = [functools.partial(self._serial, factories[i * width:(i + 1) * width], dims[1:])
                         for i in range(dims[0])]
        first = factories[0]
        same = all(f is first for f in factories)
        return SerialEnv(len(factories), first if same else list(factories), **self.serial_kwargs)

    def batched_env(self) -> EnvBase:
        """The batched env TorchRL's Collector steps (built once, seeded with ``seed``)."""
        if self._batched_env is None:
            env = self.batched() if self.batched is not None else self._serial_form()
            if self.seed is not None:
                env.set_seed(self.seed)
            self._batched_env = env
        return self._batched_env

    def _serial_form(self) -> EnvBase:
        return self._serial(self.factories, self.batch_size or (len(self.factories),))

    def spec_env(self, collector_cls: type[BaseCollector]) -> EnvBase:
        """The env a policy is built from (``RandomPolicy(env.action_spec)``...): the batched env, for
        both collectors. ThreadedCollector calls the policy with the rows of every env at once in its
        default on-policy mode (and probes it that way), so a policy shaped for the batched env works."""
        return self.batched_env()

    def collector_args(self, collector_cls: type[BaseCollector]) -> tuple[EnvBase, dict[str, Any]]:
        """``(create_env_fn, extra kwargs)`` for ``collector_cls``."""
        if is_threaded(collector_cls):
            return self._serial_form(), ({} if self.seed is None else {"seed": self.seed})
        return self.batched_env(), {}


EnvArg = EnvBase | EnvFactory | EnvBatch  # what a test hands to ``make_collector``


def mock_env(mock: Callable[..., EnvBase], batch_size: Sequence[int], **kwargs: Any) -> EnvBase | EnvBatch:
    """A mock env of ``batch_size`` in both collectors' forms.

    ``()``: one unbatched instance (both collectors step it alone). Otherwise an :class:`EnvBatch`:
    the Collector gets ``mock(batch_size=batch_size)``, ThreadedCollector ``prod(batch_size)``
    factories of the unbatched mock.
    """
    if not tuple(batch_size):
        return mock(**kwargs)
    n = int(torch.Size(batch_size).numel())
    return EnvBatch([functools.partial(mock, **kwargs)] * n,
                    batched=functools.partial(mock, batch_size=tuple(batch_size), **kwargs),
                    batch_size=tuple(batch_size))


def spec_env(env: EnvBase | EnvBatch, collector_cls: type[BaseCollector]) -> EnvBase:
    """The env whose specs build a policy for ``collector_cls`` (an unbatched env is its own)."""
    return env.spec_env(collector_cls) if isinstance(env, EnvBatch) else env


# Collector keywords ThreadedCollector deliberately does not take (docs/torchrl.rst, "Deliberate differences")
# and that the ported tests pass only as a tuning knob of TorchRL's buffers: not passed to ThreadedCollector.
TORCHRL_TUNING_KWARGS = frozenset({"use_buffers"})


def build_collector(collector_cls: type[BaseCollector], create_env_fn: EnvArg, policy: Any = None,
                    **kwargs: Any) -> BaseCollector:
    """``collector_cls(create_env_fn, policy, **kwargs)``, an :class:`EnvBatch` given in each class's form
    (and, for ThreadedCollector, without :data:`TORCHRL_TUNING_KWARGS`)."""
    if isinstance(create_env_fn, EnvBatch):
        create_env_fn, extra = create_env_fn.collector_args(collector_cls)
        kwargs = {**extra, **kwargs}
    if is_threaded(collector_cls):
        kwargs = {k: v for k, v in kwargs.items() if k not in TORCHRL_TUNING_KWARGS}
    return collector_cls(create_env_fn, policy, **kwargs)


def mark_deliberate_difference(request: pytest.FixtureRequest, collector_cls: type[BaseCollector], reason: str,
                               *, skip: bool = False, raises: type[BaseException] | None = None) -> None:
    """For ThreadedCollector only: expect the test to fail (strict xfail, with ``raises`` if given:
    another exception is a real failure), or skip it when it cannot be expressed."""
    if not is_threaded(collector_cls):
        return
    if skip:
        pytest.skip(f"deliberate difference: {reason}")
    request.applymarker(pytest.mark.xfail(reason=f"deliberate difference: {reason}", strict=True, raises=raises))


# -- copied from TorchRL's test/test_collectors.py ----------------------------------------------------------------

def make_make_env(env_name: str = "conv") -> Callable[..., EnvBase]:
    def make_transformed_env(seed: int | None = None) -> EnvBase:
        env = DiscreteActionConvMockEnv() if env_name == "conv" else DiscreteActionVecMockEnv()
        if seed is not None:
            env.set_seed(seed)
        return env

    return make_transformed_env


def make_policy(env: str) -> DiscreteActionVecPolicy:
    if env == "conv":
        return DiscreteActionConvPolicy()
    if env == "vec":
        return DiscreteActionVecPolicy()
    raise NotImplementedError(env)


def pendulum_env_maker() -> GymEnv:
    return GymEnv(PENDULUM_VERSIONED())


def make_cartpole(cp: str = CARTPOLE_VERSIONED()) -> GymEnv:
    return GymEnv(cp)


def make_counting_env_fn(max_steps: int = 4) -> EnvFactory:
    """``TestTrajsPerBatch``'s env: ``CountingEnv`` with a ``StepCounter(max_steps)``."""
    return lambda: TransformedEnv(CountingEnv(max_steps=max_steps), StepCounter(max_steps))


def make_counting_init_env_fn(max_steps: int = 4) -> EnvFactory:
    """``TestTrajsPerBatchReplayBuffer``'s batched-env rows: ``CountingEnv`` + ``StepCounter`` + ``InitTracker``."""
    return lambda: TransformedEnv(CountingEnv(max_steps=max_steps), Compose(StepCounter(max_steps), InitTracker()))


def random_policy_for(env_fn: EnvFactory) -> RandomPolicy:
    probe_env = env_fn()
    try:
        return RandomPolicy(probe_env.action_spec)
    finally:
        probe_env.close(raise_if_closed=False)


def clear_tensordict_device(tensordict: TensorDictBase) -> TensorDictBase:
    return tensordict.clear_device_()


def zero_postproc(td: TensorDictBase) -> TensorDictBase:
    return torch.zeros_like(td)


def deepcopy_error(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("deepcopy not allowed")


class WrappablePolicy(nn.Module):
    def __init__(self, out_features: int, multiple_outputs: bool = False) -> None:
        super().__init__()
        self.multiple_outputs = multiple_outputs
        self.linear = nn.LazyLinear(out_features)

    def forward(self, observation: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        output = self.linear(observation)
        if self.multiple_outputs:
            return output, output.sum(), output.min(), output.max()
        return output


class UnwrappablePolicy(nn.Module):
    def __init__(self, out_features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(2, out_features)

    def forward(self, observation: torch.Tensor, other_stuff: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(observation), other_stuff.sum()


class UnbatchedDoneEnv(EnvBase):
    """Unbatched environment that returns done=True after N steps (TorchRL issue #3137)."""

    def __init__(self, done_after_n_steps: int = 6) -> None:
        super().__init__(batch_size=torch.Size([]))
        self.done_after_n_steps = done_after_n_steps
        self._step_count = 0
        self.observation_spec = Composite(observation=Unbounded(shape=(3,)))
        self.action_spec = Composite(action=Unbounded(shape=(1,)))
        self.reward_spec = Composite(reward=Unbounded(shape=(1,)))
        self.full_done_spec = Composite(
            done=Unbounded(shape=(1,), dtype=torch.bool),
            terminated=Unbounded(shape=(1,), dtype=torch.bool),
            truncated=Unbounded(shape=(1,), dtype=torch.bool),
        )

    def _reset(self, tensordict: TensorDict | None = None) -> TensorDict:
        self._step_count = 0
        return TensorDict(
            {"observation": torch.rand(3), "done": torch.tensor([False]), "terminated": torch.tensor([False]),
             "truncated": torch.tensor([False])},
            batch_size=self.batch_size,
        )

    def _step(self, tensordict: TensorDict) -> TensorDict:
        self._step_count += 1
        done = self._step_count >= self.done_after_n_steps
        return TensorDict(
            {"observation": torch.rand(3), "reward": torch.tensor([1.0]), "done": torch.tensor([done]),
             "terminated": torch.tensor([done]), "truncated": torch.tensor([False])},
            batch_size=self.batch_size,
        )

    def _set_seed(self, seed: int | None) -> None:
        torch.manual_seed(seed)


class PolicyVersionEnv(EnvBase):
    """``TestPolicyVersion._Env``: zeros everywhere, never done."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__(batch_size=(), device=device)
        self.observation_spec = Composite(observation=Unbounded(shape=(2,), device=device))
        self.action_spec = Unbounded(shape=(2,), device=device)
        self.reward_spec = Unbounded(shape=(1,), device=device)

    def _step(self, td: TensorDict) -> TensorDict:
        return TensorDict(
            {"observation": torch.zeros(2, device=self.device), "reward": torch.zeros(1, device=self.device),
             **self.full_done_spec.zero()},
            (), device=self.device,
        )

    def _reset(self, td: TensorDict | None = None) -> TensorDict:
        return TensorDict({"observation": torch.zeros(2, device=self.device)}, (), device=self.device)

    def _set_seed(self, seed: int | None) -> None:
        ...
