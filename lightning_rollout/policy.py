"""The policy: :func:`as_policy_module` makes anything TorchRL's collectors accept callable on a TensorDict;
:class:`PolicyCall` runs it on numpy rows in the calling thread, with versioned weights; :class:`AutobatchPolicy`,
a :class:`PolicyCall` whose rows come from many threads' :class:`Agent` s, calls it from one inference thread."""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase, is_tensor_collection
from tensordict.nn import TensorDictModule, TensorDictModuleBase
from torchrl.data import Composite
from torchrl.envs.utils import ExplorationType, RandomPolicy, set_exploration_type
from torchrl.modules.tensordict_module.exploration import set_exploration_modules_spec_from_env

from ._checks import check_device, check_int, check_seconds
from ._exit import abandon, close_at_exit
from .errors import CollectionError, PolicyError
from .specs import random_sample

__all__ = ["Agent", "AutobatchPolicy", "BatchedRandomPolicy", "PolicyAnswer", "PolicyCall", "Wrapped",
           "as_policy_module"]

NestedKey = str | tuple[str, ...]
OutputSpec = dict[NestedKey, tuple[tuple[int, ...], np.dtype]]  # {key: (shape of a row, dtype)}
_POLL_S = 0.05


# -- wrapping ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Wrapped:
    """A policy made callable on a TensorDict: ``module`` is called; ``weights`` (the object the user gave) is what
    updates and ``state`` move; ``batched``: a tensor function called with a ``[rows]`` batch even for one env."""

    module: Any
    weights: Any
    batched: bool = False


def as_policy_module(policy: Any, *, observation_spec: Any = None, action_keys: Sequence[NestedKey] = ("action",),
                     single_key: NestedKey | None = "observation", action_spec: Any = None,
                     policy_timeout: float | None = None, name: str = "loop") -> Wrapped:
    """Make ``policy`` callable on a TensorDict by TorchRL's rule (docs: TorchRL page): used as it is, or wrapped in
    a ``TensorDictModule`` reading the observations its arguments name (``single_key`` for a single other argument)
    and writing ``action_keys`` (then ``output1``, ...). Spec-less exploration modules and ``RandomPolicy()`` get
    ``action_spec``. A policy to wrap is called once on a spec sample (to count its outputs), with
    ``policy_timeout``, in a helper thread ``lightning_rollout-<name>-wrap``.

    Raises:
        TypeError: TorchRL cannot wrap it (the message says why). PolicyError: the wrapping call hung.
    """
    if isinstance(policy, RandomPolicy):
        return Wrapped(BatchedRandomPolicy.for_env(policy, action_spec), policy)
    if isinstance(policy, TensorDictModuleBase):
        if action_spec is not None and isinstance(policy, torch.nn.Module):
            spec = action_spec[action_keys[0]] if len(action_keys) == 1 else action_spec
            set_exploration_modules_spec_from_env(policy, SimpleNamespace(action_spec=spec, action_spec_unbatched=spec))
        return Wrapped(policy, policy)
    if not callable(policy):
        raise TypeError(f"the policy must be a TensorDictModule or a callable, got {type(policy).__name__}")
    bounded = _Bounded(f"lightning_rollout-{name}-wrap")
    what = "while wrapping the policy at construction (one call on a sample of the observation spec)"
    try:
        return _wrap(policy, observation_spec, action_keys, single_key, lambda fn: bounded(fn, policy_timeout, what))
    finally:
        bounded.close(policy_timeout)


_INCOMPATIBLE_SIGNATURE = (  # TorchRL's own message (torchrl.envs.utils._make_compatible_policy)
    "This error is raised because TorchRL tried to automatically wrap your policy in\n"
    "a TensorDictModule. If you're confident the policy can directly process environment outputs, set\n"
    "the `trust_policy` argument to `True` in the constructor.\n\n"
    "Arguments to policy.forward are incompatible with entries in\n"
    "env.observation_spec (got incongruent signatures:\nthe function signature is {names} but the specs have keys "
    "{spec_keys}).\nIf you want TorchRL to automatically wrap your policy with a TensorDictModule\n"
    "then the arguments to policy.forward must correspond one-to-one with entries\n"
    "in env.observation_spec.\nFor more complex behavior and more control you can consider writing your\n"
    "own TensorDictModule.")


def _wrap(policy: Any, observation_spec: Any, action_keys: Sequence[NestedKey], single_key: NestedKey | None,
          call: Callable[[Callable[[], Any]], Any]) -> Wrapped:
    """TorchRL's auto-wrapping rule (``torchrl.envs.utils._make_compatible_policy``); the probe call passes only the
    matched keys, so envs with more observations than the policy reads work."""
    caller = getattr(policy, "forward", policy)
    try:
        params = inspect.signature(caller).parameters
    except (TypeError, ValueError):  # builtins: no signature to match
        params = {}
    names = set(params)
    if names in ({"tensordict"}, {"td"}) or (
            len(params) == 1 and is_tensor_collection(next(iter(params.values())).annotation)):
        return Wrapped(policy, policy)
    if hasattr(policy, "in_keys") or hasattr(policy, "out_keys"):
        raise TypeError("Received a policy that defines in_keys or out_keys and also expects multiple arguments to "
                        "policy.forward. If the policy is compatible with TensorDict, it should take a single "
                        "argument of type TensorDict to policy.forward and define both in_keys and out_keys "
                        "(inherit from tensordict.nn.TensorDictModuleBase).")  # TorchRL's own message
    required = {n for n, p in params.items() if p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    spec_keys = set(observation_spec.keys()) if observation_spec is not None else set()
    device = _module_device(policy)
    output = None
    if observation_spec is not None and required and required <= spec_keys:
        in_keys, batched = [n for n in params if n in spec_keys], False
        sample = {k: observation_spec[k].rand().to(device) for k in in_keys}
        output = call(lambda: policy(**sample))
    elif len(required) == 1 and single_key is not None:
        in_keys, batched = [single_key], True
        if observation_spec is not None and single_key in spec_keys:
            try:
                output = call(lambda: policy(observation_spec[single_key].rand((1,)).to(device)))
            except _CallTimedOut:
                raise
            except Exception:  # the real probe, with every error named, comes later
                pass
    else:
        raise TypeError(_INCOMPATIBLE_SIGNATURE.format(names=names, spec_keys=spec_keys))
    extra = len(output) - 1 if isinstance(output, tuple) else 0  # outputs beyond the first: output1, output2...
    out_keys = [*action_keys, *(f"output{i + 1}" for i in range(extra))]
    return Wrapped(TensorDictModule(policy, in_keys=in_keys, out_keys=out_keys), policy, batched=batched)


class BatchedRandomPolicy(TensorDictModuleBase):
    """TorchRL's ``RandomPolicy`` for a stack of envs: samples one env's ``action_spec`` (batch dims dropped; a
    non-composite one written at ``action_key``) with the TensorDict's batch size, finite where a ``Box`` bound
    is infinite (as gymnasium's ``Box.sample``)."""

    def __init__(self, action_spec: Any, *, action_key: NestedKey = "action") -> None:
        super().__init__()
        spec = action_spec if isinstance(action_spec, Composite) else Composite({action_key: action_spec})
        while tuple(spec.shape):
            spec = spec[0]
        self.action_spec = spec
        self.in_keys = []
        self.out_keys = list(self.action_spec.keys(True, True))

    @classmethod
    def for_env(cls, policy: Any, env_action_spec: Any) -> BatchedRandomPolicy:
        """From TorchRL's ``RandomPolicy``: its spec reduced to one env's, or the env's own when it has none."""
        spec = policy.action_spec if policy.action_spec is not None else env_action_spec
        if spec is None:
            raise TypeError("RandomPolicy() has no action_spec and no env spec was given to fill it")
        if policy.action_spec is None:
            policy.action_spec = spec.clone()  # as TorchRL's set_action_spec_from_env does
        if not isinstance(spec, Composite) and env_action_spec is not None:
            leaf = env_action_spec[policy.action_key]
            for _ in range(len(spec.shape) - len(leaf.shape)):
                spec = spec[0]
        return cls(spec, action_key=policy.action_key)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return tensordict.update(random_sample(self.action_spec, tensordict.batch_size))


class _CallTimedOut(PolicyError):
    """A bounded call that did not return in time (its thread is abandoned)."""


class _Bounded:
    """Calls run in one daemon thread ``name``, each waited for at most ``timeout`` s (``None``: run in the caller's
    thread); one that hangs is abandoned with its thread (the next call starts another)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.thread: threading.Thread | None = None
        self.calls: queue.SimpleQueue[tuple[Callable[[], Any], futures.Future[Any]] | None] = queue.SimpleQueue()

    def _serve(self, calls: queue.SimpleQueue[Any]) -> None:
        torch.set_grad_enabled(False)
        while (call := calls.get()) is not None:
            fn, future = call
            try:
                future.set_result(fn())
            except BaseException as exc:  # re-raised in the caller's thread
                future.set_exception(exc)

    def close(self, timeout: float | None) -> None:
        """End the thread (within ``timeout`` seconds; a stuck one stays abandoned)."""
        if self.thread is not None:
            self.calls.put(None)
            self.thread.join(timeout)
            self.thread = None

    def __call__(self, fn: Callable[[], Any], timeout: float | None, what: str) -> Any:
        """``fn()``; raises :class:`PolicyError` past ``timeout``, else what ``fn`` raised."""
        if timeout is None:
            return fn()
        if self.thread is None:
            self.thread = threading.Thread(target=self._serve, args=(self.calls,), name=self.name, daemon=True)
            self.thread.start()
        future: futures.Future[Any] = futures.Future()
        self.calls.put((fn, future))
        if not futures.wait([future], timeout).done:
            abandon(self.thread)
            self.calls.put(None)  # the stuck thread ends once its call returns
            stuck, self.thread, self.calls = self.thread, None, queue.SimpleQueue()
            raise _CallTimedOut(f"no answer within policy_timeout={timeout} s {what}; thread {stuck.name!r} is "
                                "stuck inside the policy's call and is abandoned (daemon)")
        return future.result()


# -- the call -------------------------------------------------------------------------------------------
def _direct_module(policy: Any) -> Callable[..., Any] | None:
    """The inner module of a plain ``TensorDictModule`` (positional in_keys, no hooks or key remapping), called on
    the stacked tensors directly (TensorDict dispatch costs more than a small MLP's forward); else ``None``."""
    plain = (type(policy) is TensorDictModule and not (policy._forward_hooks or policy._forward_pre_hooks)
             and policy._kwargs is None and policy.method is None and not policy.method_kwargs
             and not getattr(policy, "out_to_in_map", None))
    return policy.module if plain else None


def _to_numpy(value: Any, key: NestedKey) -> np.ndarray:
    if not isinstance(value, torch.Tensor):
        raise PolicyError(f"the policy returned a {type(value).__name__} for {key!r}, not a tensor: a tensor function "
                          "must return one tensor per output key (wrap it in a TensorDictModule with out_keys=[...])")
    return value.detach().cpu().numpy()


def _as_key(key: Any) -> NestedKey:
    return key[0] if isinstance(key, tuple) and len(key) == 1 else key


def _module_device(policy: Any) -> torch.device:
    param = next(policy.parameters(), None) if isinstance(policy, torch.nn.Module) else None
    return torch.device("cpu") if param is None else param.device


def _non_persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s buffers that no ``state_dict`` holds (``register_buffer(..., persistent=False)``)."""
    saved = set(module.state_dict(keep_vars=True))
    return {name: b for name, b in module.named_buffers() if name not in saved}


class PolicyCall:
    """A policy called on the rows of some envs, in the calling thread, with versioned weights.

    Args:
        wrapped: the policy (:func:`as_policy_module`).
        device: where the call runs (inputs moved there, outputs back to the CPU); default: its parameters'.
        seed: of the policy's own CPU random stream, swapped in around each call; ``None``: torch's global one.
        policy_timeout: seconds one call may take, run in a helper thread (then abandoned, and every later call
            fails with :class:`PolicyError`); ``None``: calls run in the calling thread, unbounded.
        name: used in thread names.

    Threading: calls and updates may come from any thread; ``_weights`` serialises them.
    """

    def __init__(self, wrapped: Wrapped, *, device: torch.device | str | None = None, seed: int | None = None,
                 policy_timeout: float | None = None, name: str = "policy") -> None:
        self.policy = wrapped.module
        self.weights = wrapped.weights
        self._batched = wrapped.batched
        self.device = torch.device(device) if device is not None else _module_device(self.policy)
        self.policy_timeout = policy_timeout
        self.name = name
        self._direct = _direct_module(self.policy)
        self._direct_in = [_as_key(k) for k in self.policy.in_keys] if self._direct is not None else []
        self._direct_out = [_as_key(k) for k in self.policy.out_keys] if self._direct is not None else []
        self.input_keys: list[NestedKey] | None = None
        self.output_keys: list[NestedKey] | None = None
        self.sub_batch: dict[tuple[str, ...], tuple[int, ...]] = {}
        self.env_shape: tuple[int, ...] | None = None  # the call shape of a call on every env (TorchRL's)
        self._rng = None if seed is None else torch.Generator().manual_seed(int(seed)).get_state()
        self._modes: dict[ExplorationType, set_exploration_type] = {}
        self._no_grad = torch.no_grad()  # reused: calls run one at a time
        self.version = 0
        self._plain_state: Any = None
        self._weights = threading.Lock()
        self._pin = threading.Condition()
        self._pinned_by: list[int] = []
        self._deferred: list[Any] = []
        self._waiting = 0
        self.failure: PolicyError | None = None
        self._bounded_calls = _Bounded(f"lightning_rollout-{name}-policy")
        self.calls = 0
        self.rows = 0

    # -- calls -------------------------------------------------------------------------------------
    def bind(self, available: Mapping[NestedKey, Any], *, sub_batch: Mapping[tuple[str, ...], tuple[int, ...]] = {},
             env_shape: Sequence[int] | None = None) -> list[NestedKey]:
        """Fix and return the keys every call gets: an exact ``TensorDictModule`` its ``in_keys``, any other policy
        every root entry (as TorchRL's collector does). Raises ``ValueError`` for keys the env does not provide."""
        keys = list(self._direct_in if self._direct is not None else available)
        if missing := [k for k in keys if k not in available]:
            raise ValueError(f"the policy reads {missing}, which the env does not provide (root entries: "
                             f"{list(available)})")
        self.input_keys = keys
        self.sub_batch = dict(sub_batch)
        self.env_shape = None if env_shape is None or self._batched else tuple(int(d) for d in env_shape)
        return self.input_keys

    def probe(self, inputs: Mapping[NestedKey, np.ndarray], rows: int = 1) -> OutputSpec:
        """Call the policy once on ``inputs``; fix and return its outputs: ``{key: (shape of a row, dtype)}``.
        Raises :class:`PolicyError` when it failed, wrote nothing, or ran past ``policy_timeout``."""
        self.output_keys = None
        outputs = self._run(lambda: self._call(inputs, rows, ExplorationType.RANDOM),
                            f"while probing the policy with {rows} observation(s) at construction",
                            " (while probing the policy with the envs' first observations)")
        self.output_keys = list(outputs)
        return {k: (tuple(v.shape[1:]), v.dtype) for k, v in outputs.items()}

    def __call__(self, inputs: Mapping[NestedKey, np.ndarray], rows: int,
                 mode: ExplorationType = ExplorationType.RANDOM) -> tuple[dict[NestedKey, np.ndarray], int]:
        """The policy's outputs for ``rows`` rows of ``inputs`` (``{key: [rows, ...]}``), and the version that acted.
        Raises :class:`PolicyError` when it raised, returned a malformed output, or ran past ``policy_timeout``."""
        if self.failure is not None:
            raise PolicyError(self.failure.reason) from self.failure
        outputs = self._run(lambda: self._call(inputs, rows, mode), f"(a call on {rows} rows)")
        self.calls += 1
        self.rows += rows
        return outputs, self.version

    def _run(self, fn: Callable[[], Any], what: str, context: str = "") -> Any:
        """``fn()`` holding ``_weights``, bounded by ``policy_timeout``; what it raises as a :class:`PolicyError`
        (``context`` appended). A call past ``policy_timeout`` keeps running: every later call fails."""
        try:
            if self.policy_timeout is None and self._weights.acquire(blocking=False):  # the usual case: no wait
                try:
                    return fn()
                finally:
                    self._weights.release()
            with self._weights_held("the policy cannot be called"):
                return self._bounded_calls(fn, self.policy_timeout, what)
        except PolicyError as error:
            if isinstance(error, _CallTimedOut):
                self.failure = error
            raise
        except Exception as exc:
            raise PolicyError(f"{type(exc).__name__}: {exc}{context}") from exc

    def _call(self, inputs: Mapping[NestedKey, np.ndarray], rows: int, mode: ExplorationType
              ) -> dict[NestedKey, np.ndarray]:
        keys = self._direct_in if self._direct is not None else (self.input_keys or list(inputs))
        # The policy gets its own copy of its inputs: one written in place cannot change a stored observation.
        stacked = {k: torch.from_numpy(np.array(inputs[k])) for k in keys}
        if self.device.type != "cpu":
            stacked = {k: v.to(self.device, non_blocking=True) for k, v in stacked.items()}
        shape = self.env_shape if self.env_shape is not None and math.prod(self.env_shape) == rows else (rows,)
        if shape != (rows,):
            stacked = {k: v.reshape((*shape, *v.shape[1:])) for k, v in stacked.items()}
        explore = self._modes.get(mode) or self._modes.setdefault(mode, set_exploration_type(mode))
        saved = None
        if self._rng is not None:  # the policy's own random stream, swapped in
            saved = torch.get_rng_state()
            torch.set_rng_state(self._rng)
        try:
            with self._no_grad, explore:
                outputs = (self._direct_outputs(self._direct(*[stacked[k] for k in keys]))
                           if self._direct is not None else self._tensordict_outputs(stacked, shape))
        finally:
            if saved is not None:
                self._rng = torch.get_rng_state()
                torch.set_rng_state(saved)
        if shape != (rows,):
            outputs = {k: v.reshape(rows, *v.shape[len(shape):]) for k, v in outputs.items()}
        for key, value in outputs.items():
            if value.ndim == 0 or value.shape[0] != rows:
                raise PolicyError(f"'{key}' has shape {tuple(value.shape)} for a batch of {rows} observations "
                                  f"(the leading dim must be the batch size {rows})")
        return outputs

    def _direct_outputs(self, result: Any) -> dict[NestedKey, np.ndarray]:
        out_keys = self._direct_out
        if isinstance(result, dict):
            if missing := [k for k in out_keys if k not in result]:
                raise PolicyError(f"the policy did not write {missing[0]!r}: it returned a dict with keys "
                                  f"{sorted(map(str, result))}; expected the out_keys {out_keys}")
            result = tuple(result[k] for k in out_keys)
        result = result if isinstance(result, tuple) else (result,)
        if len(result) < len(out_keys):
            raise PolicyError(f"the policy did not write {out_keys[len(result)]!r}: it returned {len(result)} "
                              f"tensor(s) for out_keys {out_keys}; return one tensor per output key at every call")
        if len(result) != len(out_keys):
            raise PolicyError(f"the policy returned a tuple of {len(result)} for out_keys {out_keys}: return one "
                              "tensor per output key (or list every output in out_keys)")
        return {k: _to_numpy(v, k) for k, v in zip(out_keys, result)}

    def _tensordict_outputs(self, stacked: dict[NestedKey, torch.Tensor], shape: tuple[int, ...]
                            ) -> dict[NestedKey, np.ndarray]:
        """A TensorDict policy's outputs: at the probe every leaf it added or replaced, then exactly those keys,
        each written anew (an input returned as it was given, or written in place, is not an output)."""
        td = TensorDict(stacked, batch_size=shape)
        for prefix, dims in self.sub_batch.items():
            if prefix in td.keys(True):
                td.get(prefix).batch_size = torch.Size([*shape, *dims])
        given = dict(td.items(True, True))
        out = self.policy(td)
        out = td if out is None else out
        if not isinstance(out, TensorDictBase):
            raise PolicyError(f"the policy returned {type(out).__name__}; a TensorDict policy must return "
                              "a TensorDict (wrap a tensor function in a TensorDictModule)")
        keys = self.output_keys
        if keys is None:  # the probe: every leaf added or replaced, and the declared out_keys it holds
            keys = [k for k, v in out.items(True, True) if given.get(k) is not v]
            declared = getattr(self.policy, "out_keys", None) or []
            keys += [k for k in map(_as_key, declared) if k not in keys and k in out.keys(True, True)]
            if not keys:
                raise PolicyError("the policy wrote nothing (no action)")
        outputs = {}
        for k in keys:
            value = out.get(k, None)
            if value is None or (k in given and value is given[k]):
                how = "" if value is None else (f": its input carries the previous step's {k!r}, returned as it was "
                                                "handed (write a new tensor for every output key at every call, "
                                                "not in place)")
                raise PolicyError(f"the policy did not write {k!r}, which it wrote when probed at construction{how}")
            outputs[k] = _to_numpy(value, k)
        return outputs

    @property
    def mean_batch_size(self) -> float:
        """Mean rows a call since creation, ``rows / calls`` (0.0 before the first)."""
        return self.rows / self.calls if self.calls else 0.0

    # -- weights -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _weights_held(self, what: str) -> Iterator[None]:
        """Hold ``_weights``; once the policy failed (a call stuck past ``policy_timeout`` still runs), raise."""
        while self.failure is not None or not self._weights.acquire(timeout=_POLL_S):
            if self.failure is not None:
                raise PolicyError(f"{what}: {self.failure.reason}") from self.failure
        try:
            yield
        finally:
            self._weights.release()

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        """One version for the block: updates from other threads wait for it to end; those made in this thread
        (an event processor) are applied when it ends (a rejected one is reported as a ``RuntimeWarning``)."""
        me = threading.get_ident()
        try:  # registered inside the try: a Ctrl-C anywhere leaves no pin behind
            with self._pin:
                while self._waiting and not self._pinned_by:  # updates made before the span go first
                    self._pin.wait(_POLL_S)
                self._pinned_by.append(me)
            yield
        finally:
            with self._pin:
                if me in self._pinned_by:
                    self._pinned_by.remove(me)
                if not self._pinned_by:
                    deferred, self._deferred = self._deferred, []
                    for state in deferred:
                        try:
                            self._apply(state)
                        except ValueError as exc:
                            warnings.warn(f"a weight update made during an on-policy collection call was rejected "
                                          f"when applied after it: {exc}", RuntimeWarning, stacklevel=3)
                    self._pin.notify_all()

    @property
    def pending_updates(self) -> int:
        """Updates made and not applied yet (waiting for a pinned span to end)."""
        return len(self._deferred) + self._waiting

    def update(self, state: Any, *, timeout: float | None = 60.0, buffers_from: torch.nn.Module | None = None) -> int:
        """Replace the weights; returns the new :attr:`version` (+1 an update).

        ``state``: a ``state_dict``, a module of the same architecture, a ``TensorDict`` of weights, the acting
        policy itself (only the version moves), or, for a callable without ``load_state_dict``, any object (kept,
        returned by :meth:`state`). Non-persistent buffers travel with a module, a TensorDict, or ``buffers_from``.
        While pinned (:meth:`pinned`) it waits up to ``timeout`` s for the span to end; from the pinning thread it
        is applied when the span ends (the version it will then have is returned).

        Raises:
            ValueError: ``state`` rejected (the version is unchanged). CollectionError: still pinned after
                ``timeout``. PolicyError: the policy failed (a call stuck past ``policy_timeout``).
        """
        timeout = check_seconds("timeout", timeout, allow_zero=True)
        if state is self.policy or state is self.weights:
            state = None
        elif isinstance(state, torch.nn.Module):
            state = (state.state_dict(), _non_persistent_buffers(state))
        elif (isinstance(buffers_from, torch.nn.Module) and buffers_from is not self.weights
              and isinstance(state, Mapping) and not isinstance(state, TensorDictBase)):
            state = (state, _non_persistent_buffers(buffers_from))
        with self._pin:
            if threading.get_ident() in self._pinned_by:
                self._deferred.append(state)
                return self.version + len(self._deferred)
            self._waiting += 1
            try:  # the last pin to end notifies
                if not self._pin.wait_for(lambda: not self._pinned_by, timeout):
                    raise CollectionError(f"policy update not applied within {timeout} s: an on-policy "
                                          "collection call held the weights")
                self._apply(state)
            finally:
                self._waiting -= 1
                self._pin.notify_all()
            return self.version

    def _apply(self, state: Any) -> None:
        with self._weights_held("the weights cannot be updated"):
            weights = self.weights
            try:
                if state is None:
                    pass
                elif isinstance(state, TensorDictBase) and isinstance(weights, torch.nn.Module):
                    state.to_module(weights)
                elif isinstance(state, tuple) and hasattr(weights, "load_state_dict"):
                    params, buffers = state
                    own = _non_persistent_buffers(weights) if isinstance(weights, torch.nn.Module) else {}
                    for name, value in buffers.items():
                        if (acting := getattr(own.get(name), "shape", None)) != value.shape:
                            shown = "no such buffer" if acting is None else tuple(acting)
                            raise ValueError(f"non-persistent buffer {name!r} has shape {tuple(value.shape)} in the "
                                             f"source and {shown} in the acting policy")
                    weights.load_state_dict(params)
                    with torch.no_grad():
                        for name, value in buffers.items():
                            own[name].copy_(value)
                elif hasattr(weights, "load_state_dict"):
                    weights.load_state_dict(state)
                else:
                    self._plain_state = state[0] if isinstance(state, tuple) else state
            except Exception as exc:
                raise ValueError(f"the policy rejected the new weights ({type(exc).__name__}: {exc}); pass a "
                                 "state_dict, TensorDict or module of the same architecture") from exc
            self.version += 1

    def state(self) -> Any:
        """A copy of the current weights (``state_dict`` tensors cloned)."""
        with self._weights_held("the weights cannot be read"):
            if hasattr(self.weights, "state_dict"):
                return {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                        for k, v in self.weights.state_dict().items()}
            return copy.deepcopy(self._plain_state)

    def set_version(self, version: int) -> None:
        """Set the version counter (resuming from a checkpoint)."""
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        with self._weights_held("the version cannot be set"):
            self.version = version

    def close(self, timeout: float = 5.0) -> None:
        """End the helper thread of a ``policy_timeout`` (idempotent)."""
        self._bounded_calls.close(timeout)


# -- the standalone autobatching server ------------------------------------------------------------------
@dataclass(frozen=True)
class PolicyAnswer:
    """The answer to one request: rows ``[start, stop)`` of a call's ``outputs``, acted by ``version``."""

    outputs: dict[NestedKey, np.ndarray]
    start: int
    stop: int
    version: int


@dataclass(eq=False)
class _Request:
    agent: Agent
    obs: dict[NestedKey, np.ndarray]
    mode: ExplorationType
    rows: int
    t0: float = field(default_factory=time.perf_counter)
    done: futures.Future[PolicyAnswer] = field(default_factory=futures.Future)


class Agent:
    """One client of an :class:`AutobatchPolicy`, owned by one thread; ``with policy.register() as agent`` closes it.
    ``rows``: observations a request carries; ``env_ids``: the envs it speaks for (in error messages)."""

    def __init__(self, server: AutobatchPolicy, rows: int, env_ids: tuple[int, ...]) -> None:
        self.server, self.rows, self.env_ids = server, rows, env_ids
        self.active, self.closed = True, False
        self._request: _Request | None = None

    def park(self) -> None:
        """Stop counting as active (about to block on something other than the policy)."""
        self.server.set_active(self, False)

    def unpark(self) -> None:
        """Count as active again."""
        self.server.set_active(self, True)

    def set_rows(self, rows: int) -> None:
        """Change the rows of this agent's requests (and what it counts for)."""
        check_int("rows", rows, 1)
        self.server.set_active(self, self.active, rows=rows)

    def close(self) -> None:
        """Unregister; idempotent."""
        self.server.set_active(self, False, close=True)

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, obs: Mapping[NestedKey, np.ndarray], *, deterministic: bool = False,
               exploration_type: ExplorationType | None = None) -> None:
        """Send one request of ``rows`` observations (``{key: [rows, ...]}``), answered by :meth:`result`.
        Raises :class:`CollectionError` when the policy is closed."""
        mode = exploration_type or (ExplorationType.DETERMINISTIC if deterministic else ExplorationType.RANDOM)
        self._request = _Request(self, dict(obs), mode, self.rows)
        self.server.enqueue(self._request)

    def result(self, stop: threading.Event | None = None) -> PolicyAnswer:
        """Wait for the answer of the last :meth:`submit` (the policy's state checked every 50 ms). Raises
        :class:`PolicyError` when the call failed or ran past ``policy_timeout``, :class:`CollectionError` when the
        policy was closed meanwhile or ``stop`` was set."""
        request = self._request
        assert request is not None, "result() without submit()"
        while not futures.wait([request.done], _POLL_S).done:
            if self.server.closed:
                raise CollectionError("the policy was closed while a request was waiting")
            if stop is not None and stop.is_set():
                raise CollectionError("the wait for the policy's answer was stopped")
            if (failure := self.server.failure) is not None:
                raise PolicyError(failure.reason, env_ids=self.env_ids) from failure
        return request.done.result()

    def act(self, obs: Mapping[NestedKey, np.ndarray], *, deterministic: bool = False,
            exploration_type: ExplorationType | None = None, stop: threading.Event | None = None) -> PolicyAnswer:
        """:meth:`submit` then :meth:`result`."""
        self.submit(obs, deterministic=deterministic, exploration_type=exploration_type)
        return self.result(stop)


class AutobatchPolicy(PolicyCall):
    """A :class:`PolicyCall` answering observations from many threads' :class:`Agent` s with one batched call.

    A flush takes the oldest queued requests, up to ``autobatch_size`` rows (whole requests, at least one), as
    soon as ``pending_rows >= min(active_rows, autobatch_size)`` (re-checked whenever an agent parks or leaves)
    or the oldest request waited ``max_wait`` seconds; deterministic and random requests never share a call.
    An update first answers the requests queued before it (in its own thread, with the old weights).

    Args:
        policy: a ``TensorDictModuleBase`` or a tensor function ``obs[B, ...] -> action[B, ...]``.
        autobatch_size: ``>= 1``; ``None``: every active row (lock-step).
        max_wait: seconds before a partial flush; ``None``: never.
        device, seed, policy_timeout: see :class:`PolicyCall`.
        flush_in_caller: a request that is a whole flush by itself is answered in its own thread.
        name: the inference thread is ``lightning_rollout-<name>-inference``.

    Raises ``ValueError`` for a bad argument. Threading: any method from any thread; ``_lock`` guards the queue
    and the agents. An error of the inference thread itself sets :attr:`failure`, as a stuck call does.
    """

    def __init__(self, policy: Callable[..., Any], *, autobatch_size: int | None = None,
                 max_wait: float | None = None, device: torch.device | str | None = None, name: str = "policy",
                 flush_in_caller: bool = True, seed: int | None = None, policy_timeout: float | None = None) -> None:
        if not callable(policy):
            raise ValueError(f"policy must be a TensorDictModule or a callable, got {type(policy).__name__}")
        check_int("autobatch_size", autobatch_size, 1, optional=True)
        self.max_wait = check_seconds("max_wait", max_wait, allow_zero=True)
        policy_timeout = check_seconds("policy_timeout", policy_timeout, allow_zero=False)
        check_device("device", device)
        super().__init__(as_policy_module(policy), device=device, seed=seed, policy_timeout=policy_timeout, name=name)
        self.autobatch_size = None if autobatch_size is None else int(autobatch_size)
        self.flush_in_caller = flush_in_caller and policy_timeout is None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: list[_Request] = []
        self._active_rows = 0
        self.closed = False
        self._thread: threading.Thread | None = None
        self._torch_threads = torch.get_num_threads()

    def update(self, state: Any, *, timeout: float | None = 60.0, buffers_from: torch.nn.Module | None = None) -> int:
        """Replace the weights once the requests queued before this call are answered (here, with the old weights);
        returns the new version (see :meth:`PolicyCall.update`)."""
        with self._lock:
            if self.closed:
                raise CollectionError("cannot update a closed AutobatchPolicy")
            if self.failure is not None:
                raise PolicyError(self.failure.reason) from self.failure
            queued, self._pending = self._pending, []
        while queued:
            batch, queued = self._take(queued)
            self._answer(batch)
        return super().update(state, timeout=timeout, buffers_from=buffers_from)

    # -- agents -------------------------------------------------------------------------------------------
    def register(self, rows: int = 1, *, env_ids: tuple[int, ...] = ()) -> Agent:
        """A client of ``rows`` observations a request, active until it parks or closes. Raises
        :class:`CollectionError` when the policy is closed, ``ValueError`` for ``rows < 1``."""
        check_int("rows", rows, 1)
        with self._lock:
            if self.closed:
                raise CollectionError("cannot register on a closed AutobatchPolicy")
            agent = Agent(self, rows, env_ids)
            self._active_rows += rows
            if self._thread is None:
                close_at_exit(self)
                self._thread = threading.Thread(target=self._serve, name=f"lightning_rollout-{self.name}-inference",
                                                daemon=True)
                self._thread.start()
        return agent

    def set_active(self, agent: Agent, active: bool, *, rows: int | None = None, close: bool = False) -> None:
        """An agent's state changed (its own methods call this; the count of active rows never goes negative)."""
        with self._lock:
            if agent.closed:
                return
            self._active_rows -= agent.rows if agent.active else 0
            agent.rows = agent.rows if rows is None else rows
            agent.active, agent.closed = active and not close, close
            self._active_rows += agent.rows if agent.active else 0
            self._wake.notify()

    def enqueue(self, request: _Request) -> None:
        """Queue ``request``, or answer it here when it is a whole flush by itself (``flush_in_caller``)."""
        with self._lock:
            if self.closed:
                raise CollectionError("the AutobatchPolicy is closed")
            self._pending.append(request)
            if not (self.flush_in_caller and len(self._pending) == 1 and self._due()):
                self._wake.notify()
                return
            self._pending = []
        self._answer([request])

    # -- the inference thread -------------------------------------------------------------------------------
    def _take(self, requests: list[_Request]) -> tuple[list[_Request], list[_Request]]:
        """The oldest ``requests`` up to ``autobatch_size`` rows (whole requests, at least one), and the rest."""
        count, rows = 0, 0
        for request in requests:
            if count and self.autobatch_size is not None and rows + request.rows > self.autobatch_size:
                break
            count, rows = count + 1, rows + request.rows
        return requests[:count], requests[count:]

    def _due(self) -> bool:
        """Enough rows are queued for a flush, or the oldest request waited ``max_wait``; ``_lock`` held."""
        active = self._active_rows if self.autobatch_size is None else min(self._active_rows, self.autobatch_size)
        waited = time.perf_counter() - self._pending[0].t0
        return sum(r.rows for r in self._pending) >= active or (self.max_wait is not None and waited >= self.max_wait)

    def _serve(self) -> None:
        """The inference thread; an error of its own (not the policy's) fails every waiting and later request."""
        torch.set_num_threads(self._torch_threads)
        torch.set_grad_enabled(False)
        try:
            while True:
                with self._lock:
                    while not (self.closed or (self._pending and self._due())):
                        timeout = _POLL_S
                        if self.max_wait is not None and self._pending:
                            timeout = max(0.0, self._pending[0].t0 + self.max_wait - time.perf_counter())
                        self._wake.wait(timeout)
                    if self.closed:
                        return
                    batch, self._pending = self._take(self._pending)
                self._answer(batch)
        except BaseException as exc:  # noqa: BLE001 - forwarded to every caller as a PolicyError
            error = PolicyError(f"the inference thread {threading.current_thread().name!r} failed "
                                f"({type(exc).__name__}: {exc})")
            error.__cause__ = exc
            with self._lock:
                self.failure = error
                for request in self._pending:
                    request.done.set_exception(PolicyError(error.reason, env_ids=request.agent.env_ids))
                self._pending = []

    def _answer(self, batch: list[_Request]) -> None:
        """One call a mode for ``batch`` (deterministic and random requests never share one), rows in env order
        (so a flush is reproducible); each request gets its rows, or a :class:`PolicyError` of its own."""
        batch.sort(key=lambda r: r.agent.env_ids[0] if r.agent.env_ids else -1)
        for mode in dict.fromkeys(r.mode for r in batch):
            requests = [r for r in batch if r.mode == mode]
            try:
                inputs = requests[0].obs if len(requests) == 1 else {
                    k: np.concatenate([r.obs[k] for r in requests]) for k in requests[0].obs}
                outputs, version = self(inputs, sum(r.rows for r in requests), mode)
            except Exception as exc:  # the policy's error, or observations that do not stack
                ours = isinstance(exc, PolicyError)
                env_ids = tuple(i for r in requests for i in r.agent.env_ids)
                for request in requests:
                    error = PolicyError(exc.reason if ours else f"{type(exc).__name__}: {exc}", env_ids=env_ids)
                    error.__cause__ = exc.__cause__ if ours else exc
                    request.done.set_exception(error)
                continue
            start = 0
            for request in requests:
                request.done.set_result(PolicyAnswer(outputs, start, start + request.rows, version))
                start += request.rows

    def close(self, timeout: float = 5.0) -> None:
        """Stop the inference thread, fail queued requests, join within ``timeout`` s (a finite number
        of seconds >= 0, else ``ValueError``; a stuck thread is abandoned)."""
        if check_seconds("timeout", timeout, allow_zero=True) is None:
            raise ValueError("timeout must be a finite number of seconds >= 0, got None")
        with self._lock:
            if self.closed:
                return
            self.closed = True
            for request in self._pending:
                request.done.set_exception(CollectionError("the AutobatchPolicy was closed"))
            self._pending = []
            self._wake.notify_all()
        super().close(timeout)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                abandon(self._thread)
