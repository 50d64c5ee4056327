"""The TorchRL facade's arguments: every keyword of TorchRL's collectors taken into :class:`Options` or refused by
:data:`TORCHRL_ONLY` (:func:`options`; :func:`signature` makes the collector's signature from both), and the env,
seed, interruptor, devices and policy read as TorchRL reads them."""

from __future__ import annotations

import copy
import functools
import inspect
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDictBase
from torchrl._utils import seed_generator
from torchrl.envs import EnvBase, TransformedEnv
from torchrl.envs.batched_envs import BatchedEnvBase
from torchrl.envs.utils import ExplorationType

from ._checks import check_device, check_int, check_seconds, warn_user
from .envs import EnvFactory, InfoKeys
from .events import EventProcessor, Interrupter

Device = torch.device | str | None
_DEVICES = ("device", "storing_device", "policy_device", "env_device")


@dataclass(kw_only=True)
class Options:
    """Every keyword :class:`ThreadedCollector` takes but :data:`TORCHRL_ONLY`'s, with TorchRL's default if any."""

    policy_factory: Callable[[], Callable[..., Any]] | None = None
    frames_per_batch: int
    total_frames: int = -1
    device: Device = None
    storing_device: Device = None
    policy_device: Device = None
    env_device: Device = None
    create_env_kwargs: dict[str, Any] | Sequence[dict[str, Any]] | None = None
    max_frames_per_traj: int | None = None
    init_random_frames: int | None = None
    reset_at_each_iter: bool = False
    postproc: Callable[[TensorDictBase], TensorDictBase] | None = None
    split_trajs: bool | None = None
    track_traj_ids: bool = True
    exploration_type: ExplorationType = ExplorationType.RANDOM
    interruptor: Any = None
    set_truncated: bool = False
    use_buffers: bool | None = None
    replay_buffer: Any = None
    extend_buffer: bool = True
    trust_policy: bool | None = None
    compile_policy: bool | dict[str, Any] | None = None
    no_cuda_sync: bool = False
    track_policy_version: bool = False
    worker_idx: int | None = None
    trajs_per_batch: int | None = None
    trajs_per_write: int | None = None
    traj_format: Literal["padded", "cat"] | None = None
    auto_register_policy_transforms: bool | None = None
    pre_collect_hook: Callable[[], None] | None = None
    post_collect_hook: Callable[[TensorDictBase], None] | None = None
    compact_obs: bool = False
    # TorchRL's multi-collectors
    update_at_each_batch: bool = False
    num_threads: int | None = None
    # ThreadedCollector's own
    num_envs: int | None = None
    envs_per_thread: int | str = "auto"
    num_workers: int | str = "auto"
    parallel_steps: bool | Literal["auto", "free"] = "auto"
    autobatch_size: int | None = None
    max_wait: float | None = None
    layout: Literal["env_time", "flat"] = "env_time"
    on_policy: bool = True
    seed: int | None = None
    step_timeout: float | None = None
    policy_timeout: float | None = None
    info_keys: InfoKeys | None = None
    processor: EventProcessor | None = None
    name: str = "collector"


def _is(*accepted: Any) -> Callable[[Any], bool]:
    return lambda value: any(value is a or (type(value) is type(a) and value == a) for a in accepted)


#: TorchRL keywords whose meaning does not carry over: ``name: (TorchRL's default, the values that change nothing
#: here, what to do instead)``; any other value is refused, every refused one named in one ``ValueError``.
TORCHRL_ONLY: dict[str, tuple[Any, Callable[[Any], bool], str]] = {
    "backend": (None, _is(None, "direct"), "ThreadedCollector collects in this process (backend='direct'): envs in "
                "threads, or in worker processes with num_workers=n; drop backend, or use torchrl's "
                "Collector(backend={value}) for that kind of collection"),
    "backend_options": (None, operator.not_, "ThreadedCollector has no backend to configure; pass its options as "
                        "keyword arguments (num_envs=, num_workers=, envs_per_thread=...)"),
    "num_collectors": (None, _is(None), "ThreadedCollector is one collector; set num_envs= (envs stepped in "
                       "threads) and num_workers= (worker processes) instead"),
    "sync": (None, _is(None), "it applies to TorchRL's multi-collector backends; ThreadedCollector is one collector: "
             "drop sync (on_policy=True, the default, never overlaps a batch with training; on_policy=False does)"),
    "return_same_td": (False, _is(False), "each batch is a new TensorDict, whose memory is recycled once nothing "
                       "references it; drop return_same_td, or copy each batch into a TensorDict of your own with "
                       "buffer.update_(batch)"),
    "reset_when_done": (True, _is(True), "an env is reset as soon as it is done (use torchrl's Collector to keep "
                        "stepping done envs)"),
    "cudagraph_policy": (None, _is(None, False), "a CUDA graph needs one input shape, and the policy is called on "
                         "the rows of 1 to num_envs envs; pass cudagraph_policy=False, or compile_policy={'mode': "
                         "'reduce-overhead'} (CUDA graphs per batch size, by torch.compile)"),
    "weight_updater": (None, _is(None), "ThreadedCollector's envs share this process's policy; push weights with "
                       "collector.update_policy_weights_(module, state_dict or TensorDict)"),
    "weight_sync_schemes": (None, operator.not_, "ThreadedCollector has no remote workers to send weights to; push "
                            "weights with collector.update_policy_weights_(...)"),
    "weight_recv_schemes": (None, operator.not_, "ThreadedCollector has no parent collector to receive weights "
                            "from; push weights with collector.update_policy_weights_(...)"),
    # TorchRL's multi-collectors (MultiSyncCollector, MultiAsyncCollector)
    "collector_class": (None, lambda v: v is None or getattr(v, "__name__", None) == "Collector", "the envs are "
                        "stepped by ThreadedCollector itself: there is no sub-collector class to choose"),
    "preemptive_threshold": (None, _is(None), "a batch holds every env's steps; for batches that do not wait for "
                             "slow envs use layout='flat' with on_policy=False (frames in arrival order)"),
    "num_sub_threads": (1, _is(1), "worker processes run torch with one thread each (they step envs; the policy "
                        "runs in this process)"),
    "cat_results": (None, _is(None, "stack"), "batches stack the envs ([num_envs, T], TorchRL's 'stack'); "
                    "concatenate with batch.reshape(-1), or use layout='flat'"),
    "init_fn": (None, _is(None), "no worker process runs code of yours at start; do the set-up in the env factory"),
}


def options(keywords: dict[str, Any]) -> Options:
    """The keywords given as checked :class:`Options`. ``ValueError``: refused values (all named in one error, with
    what to do), a per-worker list of unequal values; ``TypeError``: an unknown keyword, no ``frames_per_batch``."""
    refused = [f"{name}={value!r}: " + instead.replace("{value}", repr(value))
               for name, (_, accepts, instead) in TORCHRL_ONLY.items()
               if name in keywords and not accepts(value := keywords[name])]
    if refused:
        raise ValueError("ThreadedCollector cannot honour " + "; ".join(refused))
    taken = {k: v for k, v in keywords.items() if k not in TORCHRL_ONLY}
    for name in ("frames_per_batch", *_DEVICES, "policy_factory"):
        value = taken.get(name)  # a multi-collector's value per worker: one value for every env here
        if isinstance(value, (list, tuple)):
            if len(set(map(str, value))) != 1 or name == "frames_per_batch":
                raise ValueError(f"{name}={value!r}: TorchRL's multi-collectors take one value per worker; "
                                 f"ThreadedCollector takes one {name} for all its envs")
            taken[name] = value[0]
    try:
        o = Options(**taken)
    except TypeError as exc:
        raise TypeError(str(exc).replace("Options.__init__()", "ThreadedCollector()")) from None
    _check(o)
    return o


def signature() -> inspect.Signature:
    """``ThreadedCollector.__init__``'s signature: TorchRL's positional arguments, then every field of
    :class:`Options` and key of :data:`TORCHRL_ONLY`, keyword-only, with its default."""
    positional, kw = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("self", positional), inspect.Parameter("create_env_fn", positional),
              inspect.Parameter("policy", positional, default=None), *inspect.signature(Options).parameters.values()]
    params += [inspect.Parameter(name, kw, default=default) for name, (default, _, _) in TORCHRL_ONLY.items()]
    return inspect.Signature(params, return_annotation=None)


def _check(o: Options) -> None:
    """Refuse options before anything is built (``TypeError``: ``use_buffers=True`` with a ``replay_buffer``, as
    TorchRL raises; else ``ValueError``); ``None`` / ``-1`` frame counts: endless, no random frames, no cap."""
    check_int("frames_per_batch", o.frames_per_batch, 1)
    total = o.total_frames
    if total is None or (isinstance(total, (float, np.floating)) and math.isinf(total)):
        total = -1
    if not isinstance(total, (int, np.integer)) or isinstance(total, bool) or (total < 1 and total != -1):
        raise ValueError(f"total_frames must be a positive int or -1 (endless), got {total!r}")
    o.total_frames = int(total)
    o.init_random_frames = 0 if o.init_random_frames in (None, -1) else o.init_random_frames
    check_int("init_random_frames", o.init_random_frames, 0)
    o.max_frames_per_traj = None if o.max_frames_per_traj in (None, -1) else o.max_frames_per_traj
    check_int("max_frames_per_traj", o.max_frames_per_traj, 1, optional=True)
    check_int("worker_idx", o.worker_idx, 0, optional=True)
    check_int("num_threads", o.num_threads, 1, optional=True)
    if o.auto_register_policy_transforms not in (None, True, False):
        raise ValueError(f"auto_register_policy_transforms must be True, False or None, got "
                         f"{o.auto_register_policy_transforms!r}")
    for label in _DEVICES:  # "cuda" without CUDA is refused here, not in the first forward
        setattr(o, label, check_device(label, getattr(o, label)))
    if o.layout not in ("env_time", "flat"):
        raise ValueError(f"layout must be 'env_time' or 'flat', got {o.layout!r}")
    if o.split_trajs and o.replay_buffer is not None:
        raise ValueError("split_trajs=True pads trajectories; it cannot be combined with replay_buffer")
    if o.use_buffers and o.replay_buffer is not None:
        raise TypeError("replay_buffer is exclusive with use_buffers: drop use_buffers (it does not change "
                        "ThreadedCollector's batches)")
    check_int("trajs_per_batch", o.trajs_per_batch, 1, optional=True)
    o.step_timeout = check_seconds("step_timeout", o.step_timeout, allow_zero=False)  # before the auto measure


def frame_budget(o: Options, num_envs: int) -> None:
    """Round ``o``'s frame counts as TorchRL does, warning: whole time steps of every env a batch (``env_time``),
    whole batches in all."""
    frames_per_batch, total, random_frames = o.frames_per_batch, o.total_frames, o.init_random_frames
    steps = -(-frames_per_batch // num_envs)
    if steps * num_envs != frames_per_batch and o.layout == "env_time":
        warn_user(f"frames_per_batch ({frames_per_batch}) is not exactly divisible by the number of envs "
                  f"({num_envs}); each batch will have {steps * num_envs} frames")
        frames_per_batch = steps * num_envs
    if total > 0 and total % frames_per_batch:
        warn_user(f"total_frames ({total}) is not exactly divisible by frames_per_batch ({frames_per_batch}); "
                  f"{frames_per_batch - total % frames_per_batch} additional frames will be collected")
        total = -(-total // frames_per_batch) * frames_per_batch
    if random_frames and random_frames % frames_per_batch:
        warn_user(f"init_random_frames ({random_frames}) is not exactly a multiple of frames_per_batch "
                  f"({frames_per_batch}); {-(-random_frames // frames_per_batch) * frames_per_batch} "
                  "random frames will be collected")
    o.frames_per_batch, o.total_frames, o.init_random_frames = int(frames_per_batch), int(total), int(random_frames)


def storing_device(o: Options) -> torch.device | None:
    """TorchRL ``Collector``'s batch device for ``o``'s checked devices (``docs/torchrl.rst``, "Devices of a batch")."""
    def as_dev(d: torch.device | None) -> torch.device | None:  # TorchRL's ordinal form: "cuda" is the current one
        return torch.device("cuda", torch.cuda.current_device()) if d == torch.device("cuda") else d

    policy_, env_, stored = (as_dev(d or o.device) for d in (o.policy_device, o.env_device, o.storing_device))
    return env_ if stored is None and env_ == policy_ else stored


def env_source(create_env_fn: Any, o: Options) -> Any:
    """``create_env_fn`` with ``create_env_kwargs`` applied, a list's env instances as factories (one listed twice:
    a copy), a lone factory without ``num_envs`` called once, as TorchRL's ``Collector`` does. ``ValueError``:
    ``create_env_kwargs`` not one per env, an instance listed twice that cannot be copied."""
    kwargs, listed = o.create_env_kwargs, isinstance(create_env_fn, (list, tuple))
    if listed:
        seen: set[int] = set()
        create_env_fn = [_instance(env, seen) if isinstance(env, (EnvBase, gym.Env)) else env for env in create_env_fn]
    if isinstance(kwargs, (list, tuple)):
        fns = create_env_fn if listed else [create_env_fn] * len(kwargs)
        if len(fns) != len(kwargs):
            raise ValueError(f"create_env_kwargs holds {len(kwargs)} dicts for {len(fns)} envs; pass one per env")
        return [functools.partial(f, **k) for f, k in zip(fns, kwargs)]
    if kwargs:
        create_env_fn = ([functools.partial(f, **kwargs) for f in create_env_fn] if listed
                         else functools.partial(create_env_fn, **kwargs))
    if o.num_envs is None and callable(create_env_fn) and not isinstance(create_env_fn, (EnvBase, gym.Env)):
        made = create_env_fn()
        # (what is no env goes back behind a factory, for the loop to refuse by name as it refuses any factory's)
        create_env_fn = made if isinstance(made, (EnvBase, gym.Env, gym.vector.VectorEnv)) else lambda: made
    return create_env_fn


def _instance(env: Any, seen: set[int]) -> EnvFactory:
    """A factory of the env instance ``env`` of a list: a copy of it when listed before."""
    if id(env) in seen:
        try:
            env = copy.deepcopy(env)
        except Exception as exc:
            raise ValueError(f"create_env_fn lists one {type(env).__name__} instance more than once and it cannot "
                             f"be copied ({type(exc).__name__}: {exc}); each env needs its own: pass a factory per "
                             "env (e.g. [make_env] * n), or one factory with num_envs=n") from exc
    seen.add(id(env))
    return lambda: env


class PolicyPrimers(torch.nn.Module):
    """TorchRL's rule for the env transforms a policy needs, over what the rule reads of the policy: its primers
    (found once, here; a worker process is sent these, not the weights). :meth:`transform` appends to a TorchRL env
    those it lacks (``append``), or warns of them once (TorchRL's ``FutureWarning``). A pickled copy (a worker
    process's) never warns: the collector's process does, where the user's warning filters apply."""

    def __init__(self, policy: torch.nn.Module, *, append: bool) -> None:
        super().__init__()
        from torchrl.modules.utils.utils import get_primers_from_module

        self.primer = get_primers_from_module(policy, warn=False, strict=False)
        self.append, self.checked = append, False

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "checked": True}

    def make_tensordict_primer(self) -> Any:
        """A fresh copy of the policy's primers (a transform belongs to one env), or ``None``."""
        return copy.deepcopy(self.primer)

    def transform(self, env: Any) -> Any:
        """``env`` with the transforms appended (``append``), else as it is (warned of once)."""
        if not isinstance(env, EnvBase):
            return env
        from torchrl.modules.utils.utils import (_compute_missing_env_transforms,
                                                 _maybe_append_env_transforms_from_module)

        if self.append:
            return _maybe_append_env_transforms_from_module(env, self)
        missing = [] if self.checked else _compute_missing_env_transforms(env, self)
        self.checked = True
        if missing:
            warn_user(f"The env passed to ThreadedCollector is missing transforms required by the policy "
                      f"({', '.join(type(t).__name__ for t in missing)}). From torchrl v0.15 the collector will "
                      "append them automatically. To enable that behavior now (and silence this warning), pass "
                      "`auto_register_policy_transforms=True`. To opt out permanently, pass "
                      "`auto_register_policy_transforms=False`.", FutureWarning)
        return env


class PolicyTransforms:
    """A picklable env factory: ``factory``'s env through :meth:`PolicyPrimers.transform` (one ``primers`` a
    collector's factories share)."""

    def __init__(self, factory: Any, primers: PolicyPrimers) -> None:
        self.factory, self.primers = factory, primers

    def __call__(self) -> Any:
        return self.primers.transform(self.factory())


def chained_seeds(env: Any) -> bool:
    """Whether ``env`` seeds its envs by TorchRL's ``seed_generator`` chain (``SerialEnv`` / ``ParallelEnv``)."""
    while isinstance(env, TransformedEnv):
        env = env.base_env
    return isinstance(env, BatchedEnvBase)


def env_seeds(seed: int, num_envs: int, chained: bool) -> list[int]:
    """Each env's seed for ``seed``, as the env given seeds its single envs (see :func:`chained_seeds`)."""
    seeds = [seed]
    for i in range(1, num_envs):
        seeds.append(seed_generator(seeds[-1]) if chained else seed + i)
    return seeds


class _TorchRLInterruptor(Interrupter):
    """A TorchRL ``interruptor`` (``collection_stopped()``) seen as our :class:`Interrupter`."""

    def __init__(self, interruptor: Any) -> None:
        super().__init__()
        self._interruptor = interruptor

    def should_stop(self) -> bool:
        return super().should_stop() or bool(self._interruptor.collection_stopped())


def interrupter(interruptor: Any) -> Interrupter | None:
    """What the loop polls for ``interruptor`` (ours, or TorchRL's adapted); ``ValueError`` for anything else."""
    if isinstance(interruptor, Interrupter) or interruptor is None:
        return interruptor
    if callable(getattr(interruptor, "collection_stopped", None)):
        return _TorchRLInterruptor(interruptor)
    raise ValueError(f"interruptor must be TorchRL's interruptor (collection_stopped()) or a "
                     f"lightning_rollout.Interrupter, got {type(interruptor).__name__}")


def acting_policy(policy: Any, o: Options) -> tuple[Any, torch.device]:
    """The policy the env threads call, and its device: a module copied when the learner's must not act
    (``on_policy=False``) or it acts on another device, moved to ``policy_device`` and compiled as asked."""
    module = isinstance(policy, torch.nn.Module)
    own_device = next((p.device for p in policy.parameters()), torch.device("cpu")) if module else torch.device("cpu")
    policy_device = o.policy_device or o.device
    needs_copy = (not o.on_policy) or (policy_device is not None and policy_device != own_device)
    acting = copy.deepcopy(policy) if needs_copy and module else policy
    if policy_device is not None and isinstance(acting, torch.nn.Module):
        acting = acting.to(policy_device)
    if o.compile_policy:
        acting = torch.compile(acting, **(o.compile_policy if isinstance(o.compile_policy, dict) else {}))
    return acting, policy_device or own_device
