"""ThreadedCollector: a drop-in ``torchrl.collectors.BaseCollector`` over :class:`MultiEnvLoop`.

A TorchRL user replaces ``Collector(env_fn, policy, frames_per_batch=..., total_frames=...)``
with ``ThreadedCollector(env_fn, policy, frames_per_batch=..., total_frames=..., num_envs=8)``
and keeps the rest of the script: batches come in TorchRL's layout (see
:mod:`lightning_rollout.loop` and the TorchRL guide), weights are pushed with
``update_policy_weights_()``, batches go to a ``replay_buffer=`` when given.

Policy sharing and versions
---------------------------
* ``on_policy=True`` (default): env threads wait for each batch's requests
  before acting, so nothing runs between batches and the policy object you
  passed is used directly, as TorchRL's ``Collector`` does on one device:
  every batch is acted by the weights as they are when the batch starts, and
  all its transitions carry one ``policy_version``.
* ``on_policy=False``: envs run one step ahead (double batching) while you
  train, so the collector acts with its **own copy** of the policy, refreshed
  by ``update_policy_weights_()``. Lag bound: after an update, each env delivers
  at most one step (``envs_per_thread`` rows per thread, plus a block left half
  consumed by the previous batch) acted by the previous version.

``policy_version`` starts at 0 and grows by one per ``update_policy_weights_()``.

Threading: iterate from one thread. ``start()`` runs the iteration in a
background thread (``lightning_rollout-<name>-background``) that writes into the
replay buffer; ``async_shutdown()`` / ``shutdown()`` stop and join it.
"""

from __future__ import annotations

import contextlib
import copy
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torchrl.collectors import BaseCollector
from torchrl.collectors.utils import split_trajectories
from torchrl.envs import EnvBase
from torchrl.envs.utils import ExplorationType

from ._checks import check_device, check_int, check_seconds, warn_user
from ._batched import BatchedEnv, batched_env, is_batched
from .envs import EnvFactory, InfoKeys, resolve_env_factory
from .errors import CollectionError, LayoutWarning, PolicyError
from .events import EventProcessor, Interrupter
from .loop import MultiEnvLoop
from .loop.auto import (LayoutChoice, apply_choice, check_knobs, is_auto, one_env_threads_warning,
                        resolve_layout)
from .specs import key_parts

__all__ = ["ThreadedCollector"]

Layout = Literal["env_time", "flat"]


class _TorchRLInterruptor(Interrupter):
    """A TorchRL ``interruptor`` (``collection_stopped()``) seen as our :class:`Interrupter`."""

    def __init__(self, interruptor: Any) -> None:
        super().__init__()
        self._interruptor = interruptor

    def should_stop(self) -> bool:
        return super().should_stop() or bool(self._interruptor.collection_stopped())


class _with_kwargs:
    """A picklable factory calling ``factory(**kwargs)`` (TorchRL's ``create_env_kwargs``)."""

    def __init__(self, factory: Any, kwargs: dict[str, Any]) -> None:
        self.factory = factory
        self.kwargs = dict(kwargs)

    def __call__(self) -> Any:
        return self.factory(**self.kwargs)


class _WithPolicyTransforms:
    """A picklable factory appending the transforms a policy needs (``auto_register_policy_transforms=True``).

    A TorchRL env gets the ``InitTracker`` and ``TensorDictPrimer`` its specs lack, by TorchRL's own rule
    (what ``Collector`` appends); a gymnasium env is returned as it is: the loop writes its ``is_init`` and
    carries the recurrent state itself.
    """

    def __init__(self, factory: Any, policy: torch.nn.Module) -> None:
        self.factory = factory
        self.policy = policy

    def __call__(self) -> Any:
        env = self.factory()
        if isinstance(env, EnvBase):
            from torchrl.modules.utils.utils import _maybe_append_env_transforms_from_module

            env = _maybe_append_env_transforms_from_module(env, self.policy)
        return env


def _storing_device(*, device: Any, storing_device: Any, policy_device: Any, env_device: Any) -> torch.device | None:
    """The device TorchRL's ``Collector`` stores batches on (and sets as their ``device``) for these arguments.

    ``storing_device``, else ``device``, else ``env_device`` when it equals ``policy_device`` (each of those
    two defaulting to ``device``); ``None`` otherwise, the batch then having no device. Only the arguments
    count, not where the env or the policy's weights are.
    """
    def as_dev(d: Any) -> torch.device | None:  # TorchRL's ordinal form: "cuda" is the current CUDA device
        d = None if d is None else torch.device(d)
        if d is not None and d.type == "cuda" and d.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return d

    policy_, env_ = as_dev(policy_device or device), as_dev(env_device or device)
    stored = as_dev(storing_device or device)
    return env_ if stored is None and env_ == policy_ else stored


def _check_torchrl_options(*, backend: Any, backend_options: Any, num_collectors: Any, sync: Any,
                           return_same_td: Any, use_buffers: Any, replay_buffer: Any, cudagraph_policy: Any,
                           weight_updater: Any, weight_sync_schemes: Any, weight_recv_schemes: Any) -> None:
    """Refuse the values of TorchRL ``Collector`` options that would change something ThreadedCollector cannot
    do; the values that change nothing here (TorchRL's defaults, empty mappings, ``False``) pass.

    Raises:
        ValueError: an option with another value, naming it and what to do instead.
        TypeError: ``use_buffers=True`` with a ``replay_buffer`` (as TorchRL's ``Collector`` raises).
    """
    if backend not in (None, "direct"):
        raise ValueError(f"backend={backend!r}: ThreadedCollector collects in this process (backend='direct'): envs "
                         "in threads, or in worker processes with num_workers=n; drop backend, or use torchrl's "
                         f"Collector(backend={backend!r}) for that kind of collection")
    if backend_options:
        raise ValueError(f"backend_options={backend_options!r}: ThreadedCollector has no backend to configure; "
                         "pass its options as keyword arguments (num_envs=, num_workers=, envs_per_thread=...)")
    if num_collectors is not None:
        raise ValueError(f"num_collectors={num_collectors!r}: ThreadedCollector is one collector; set num_envs= "
                         "(envs stepped in threads) and num_workers= (worker processes) instead")
    if sync is not None:
        raise ValueError(f"sync={sync!r} applies to TorchRL's multi-collector backends; ThreadedCollector is one "
                         "collector: drop sync (on_policy=True, the default, never overlaps a batch with "
                         "training; on_policy=False does)")
    if return_same_td:
        raise ValueError("return_same_td=True is not supported: each batch is a new TensorDict, whose memory is "
                         "recycled once nothing references it; drop return_same_td, or copy each batch into a "
                         "TensorDict of your own with buffer.update_(batch)")
    if use_buffers and replay_buffer is not None:
        raise TypeError("replay_buffer is exclusive with use_buffers: drop use_buffers (it does not change "
                        "ThreadedCollector's batches)")
    if cudagraph_policy not in (None, False):
        raise ValueError(f"cudagraph_policy={cudagraph_policy!r} is not supported: a CUDA graph needs one input "
                         "shape, and the policy is called on the rows of 1 to num_envs envs; pass "
                         "cudagraph_policy=False, or compile_policy={'mode': 'reduce-overhead'} (CUDA graphs per "
                         "batch size, by torch.compile)")
    if weight_updater is not None:
        raise ValueError("weight_updater is not supported: ThreadedCollector's envs share this process's policy; "
                         "push weights with collector.update_policy_weights_(module, state_dict or TensorDict)")
    for name, schemes in (("weight_sync_schemes", weight_sync_schemes), ("weight_recv_schemes", weight_recv_schemes)):
        if schemes:
            raise ValueError(f"{name} is not supported: ThreadedCollector has no remote workers to send weights to "
                             "or parent collector to receive them from; push weights with "
                             "collector.update_policy_weights_(...)")


def _check_options(*, worker_idx: Any, auto_register_policy_transforms: Any, devices: Mapping[str, Any], layout: Any,
                   reset_when_done: bool, split_trajs: Any, replay_buffer: Any, trajs_per_batch: Any) -> None:
    """Refuse, with what to change, the options :class:`ThreadedCollector` checks before it builds anything."""
    check_int("worker_idx", worker_idx, 0, optional=True)
    if auto_register_policy_transforms not in (None, True, False):
        raise ValueError(f"auto_register_policy_transforms must be True, False or None, got "
                         f"{auto_register_policy_transforms!r}")
    for label, dev in devices.items():
        check_device(label, dev)  # "cuda" without CUDA is refused here, not deep in the first forward pass
    if layout not in ("env_time", "flat"):
        raise ValueError(f"layout must be 'env_time' or 'flat', got {layout!r}")
    if not reset_when_done:
        raise ValueError("reset_when_done=False is not supported: an env is reset as soon as it is done "
                         "(use torchrl's Collector to keep stepping done envs)")
    if split_trajs and replay_buffer is not None:
        raise ValueError("split_trajs=True pads trajectories; it cannot be combined with replay_buffer")
    check_int("trajs_per_batch", trajs_per_batch, 1, optional=True)


def _frame_budget(*, frames_per_batch: Any, total_frames: Any, init_random_frames: Any, max_frames_per_traj: Any,
                  num_envs: int, layout: str) -> tuple[int, int, int, int | None]:
    """``(frames_per_batch, total_frames, init_random_frames, max_frames_per_traj)`` checked and rounded as TorchRL's
    collector rounds them: whole time steps of every env a batch (``env_time``), whole batches in all (``-1``:
    endless), each rounding with a warning; ``None`` / ``-1`` mean none (``0`` random frames, no cap)."""
    check_int("frames_per_batch", frames_per_batch, 1)
    if total_frames is None or (isinstance(total_frames, (float, np.floating)) and math.isinf(total_frames)):
        total_frames = -1
    if not isinstance(total_frames, (int, np.integer)) or isinstance(total_frames, bool) or (
            total_frames < 1 and total_frames != -1):
        raise ValueError(f"total_frames must be a positive int or -1 (endless), got {total_frames!r}")
    if init_random_frames in (None, -1):
        init_random_frames = 0
    check_int("init_random_frames", init_random_frames, 0)
    if max_frames_per_traj is not None and max_frames_per_traj != -1:
        check_int("max_frames_per_traj", max_frames_per_traj, 1)
    else:
        max_frames_per_traj = None
    steps = -(-frames_per_batch // num_envs)
    if steps * num_envs != frames_per_batch and layout == "env_time":
        warn_user(f"frames_per_batch ({frames_per_batch}) is not exactly divisible by the number of envs "
                  f"({num_envs}); each batch will have {steps * num_envs} frames")
        frames_per_batch = steps * num_envs
    if total_frames > 0 and total_frames % frames_per_batch:
        warn_user(f"total_frames ({total_frames}) is not exactly divisible by frames_per_batch "
                  f"({frames_per_batch}); {frames_per_batch - total_frames % frames_per_batch} additional "
                  "frames will be collected")
        total_frames = -(-total_frames // frames_per_batch) * frames_per_batch
    if init_random_frames and init_random_frames % frames_per_batch:
        warn_user(f"init_random_frames ({init_random_frames}) is not exactly a multiple of frames_per_batch "
                  f"({frames_per_batch}); {-(-init_random_frames // frames_per_batch) * frames_per_batch} "
                  "random frames will be collected")
    return int(frames_per_batch), int(total_frames), int(init_random_frames), max_frames_per_traj


def _interrupter(interruptor: Any) -> Interrupter | None:
    """What the loop polls for ``interruptor``: ours as it is, TorchRL's (``collection_stopped()``) adapted."""
    if isinstance(interruptor, Interrupter) or interruptor is None:
        return interruptor
    if callable(getattr(interruptor, "collection_stopped", None)):
        return _TorchRLInterruptor(interruptor)
    raise ValueError(f"interruptor must be TorchRL's interruptor (collection_stopped()) or a "
                     f"lightning_rollout.Interrupter, got {type(interruptor).__name__}")


def _acting_policy(policy: Any, *, on_policy: bool, policy_device: Any, compile_policy: Any) -> tuple[Any, torch.device]:
    """The policy the env threads call, and its device. A module is copied when the learner's must not be the one
    acting (``on_policy=False``: weights change only at ``update_policy_weights_``) or when it acts on another
    device; then moved to ``policy_device`` and compiled as asked."""
    own_device = _param_device(policy)
    needs_copy = (not on_policy) or (policy_device is not None and torch.device(policy_device) != own_device)
    acting = copy.deepcopy(policy) if needs_copy and isinstance(policy, torch.nn.Module) else policy
    if policy_device is not None and isinstance(acting, torch.nn.Module):
        acting = acting.to(policy_device)
    if compile_policy:
        acting = torch.compile(acting, **(compile_policy if isinstance(compile_policy, dict) else {}))
    return acting, torch.device(policy_device) if policy_device is not None else own_device


def _layout(factory: EnvFactory, num_envs: int, *, num_workers: int | str, envs_per_thread: int | str,
            parallel_steps: bool | str, native: bool, whole_blocks: bool, frames_per_batch: int, total_frames: int,
            max_frames_per_traj: int | None, step_timeout: float | None, name: str
            ) -> tuple[LayoutChoice | None, int, int, bool | str]:
    """``(layout_choice, num_workers, envs_per_thread, parallel_steps)`` for the loop: the knobs checked, the
    ``"auto"`` ones resolved (one env thread and this process for ``native``, one natively batched env; else the
    measure of :mod:`lightning_rollout.loop.auto`), and a layout likely to run well below ``"auto"`` warned about
    (:class:`~lightning_rollout.LayoutWarning`, once: not here when the loop will warn about it). ``whole_blocks``
    (``layout="flat"``, on-policy): a chosen ``envs_per_thread`` becomes a divisor of ``frames_per_batch``, so
    that no batch mixes policy versions.

    Raises:
        ValueError: a knob that is neither ``"auto"`` nor an int ``>= 1``; ``whole_blocks`` with a given
            ``envs_per_thread`` that does not divide ``frames_per_batch``.
    """
    check_knobs(envs_per_thread=envs_per_thread, num_workers=num_workers)
    if native:
        envs_per_thread = num_envs if is_auto(envs_per_thread) else envs_per_thread
        num_workers = 1 if is_auto(num_workers) else num_workers
    chosen_ept = is_auto(envs_per_thread)
    choice = resolve_layout(factory, num_envs, num_workers=num_workers, envs_per_thread=envs_per_thread,
                            max_episode_steps=max_frames_per_traj,
                            expected_frames=total_frames if total_frames > 0 else None, step_timeout=step_timeout,
                            name=name)
    num_workers, envs_per_thread, parallel_steps = apply_choice(
        choice, num_workers=num_workers, envs_per_thread=envs_per_thread, parallel_steps=parallel_steps)
    slow = (choice.warning if choice is not None else None) or (
        None if chosen_ept or native
        else one_env_threads_warning(num_envs, envs_per_thread))  # (the loop's own warning says it then)
    if slow is not None:
        warn_user(LayoutWarning(f"{name}: {slow}"))
    if chosen_ept and whole_blocks and frames_per_batch % envs_per_thread:
        envs_per_thread = math.gcd(envs_per_thread, frames_per_batch)  # a divisor of both: whole blocks
    if whole_blocks and frames_per_batch % envs_per_thread:
        raise ValueError(f"with layout='flat' and on_policy=True, frames_per_batch ({frames_per_batch}) must be a "
                         f"multiple of envs_per_thread ({envs_per_thread}) so no batch mixes policy versions")
    return choice, int(num_workers), int(envs_per_thread), parallel_steps


class ThreadedCollector(BaseCollector):
    """TorchRL collector whose envs run in threads behind one autobatched policy.

    Takes every keyword argument of torchrl 0.14's ``Collector``, with the same
    defaults and rounding rules (refusing, with what to do instead, the values
    of those whose meaning does not carry over), and
    yields batches in its layout: ``[num_envs, T]`` with dim names
    ``[None, "time"]`` (``[T]`` for one env, ``[*batch_size, T]`` for a batched
    env), TorchRL's keys, dtypes and
    trajectory ids, ``"_"``-prefixed entries left out. The deliberate
    differences are listed in the TorchRL guide (``docs/torchrl.rst``).

    Args:
        create_env_fn: a gymnasium id, a factory returning a ``gymnasium.Env`` or
            a torchrl ``EnvBase`` (transforms included), a list of such factories
            (one per env), an unbatched env instance (then ``num_envs`` must be 1),
            or a batched env instance (``SerialEnv``, ``ParallelEnv``,
            ``GymEnv(num_envs=k)``, a ``TransformedEnv`` of one, a gymnasium
            vector env), stepped as it is, as ``Collector`` steps it, or taken apart into
            its single envs and closed where that gives the same data (``docs/torchrl.rst``,
            "Batched envs"). Without ``num_envs``, a lone factory is called once here
            and its env is taken as that instance would be, as TorchRL's ``Collector``
            calls it. The collector owns its envs, as TorchRL's ``Collector`` does:
            a refused env is closed first (its worker processes end).
        policy: what TorchRL's collectors accept: a ``TensorDictModule`` (an
            actor, a ``TensorDictSequential`` with exploration modules, an
            ``LSTMModule`` policy...), a function of a TensorDict, an
            ``nn.Module`` / function whose arguments are named after observation
            keys, a one-argument tensor function (reads the only observation),
            or ``None`` for TorchRL's ``RandomPolicy`` over the env's action
            spec. It is called with a TensorDict of batch ``[k]`` (``k`` envs)
            holding every root entry of those envs, and what it writes under
            ``"next"`` (recurrent state) is fed back into each env's next step.

    Keyword Args:
        policy_factory: builds the policy (instead of ``policy``).
        frames_per_batch: frames per batch; rounded up to a multiple of
            ``num_envs`` (with a warning) in the ``env_time`` layout.
        total_frames: stop after this many frames, rounded up to whole batches
            (with a warning); ``-1`` is endless.
        num_envs: number of envs (default: the length of a list of factories, else the
            batch size of the env given or made by a lone factory, 1 for an unbatched one).
        envs_per_thread: envs stepped together by one thread (see :class:`MultiEnvLoop`);
            ``"auto"`` (default): chosen with ``num_workers`` from a few timed steps of one
            env (``docs/tuning.rst``; the choice is logged at INFO and kept in ``layout_choice``).
        num_workers: processes stepping the envs (1: threads of this process; ``n``: with one env
            thread, this process and ``n - 1`` worker processes, see :class:`MultiEnvLoop`);
            ``"auto"`` (default): more than one only when the env time of a step of all envs is
            worth spreading over the cores and the step does not release the GIL for long.
        parallel_steps: step each env of a thread's block in its own helper thread (see
            :class:`MultiEnvLoop`); ``"free"``: also let each env run at its own pace within a
            batch (``layout="env_time"``, or ``"flat"`` with one env thread; for uneven step
            times, not reproducible with a stochastic policy); ``"auto"`` (default): what the
            ``"auto"`` layout chose (True for envs whose step releases the GIL), False when
            the layout is given.
        autobatch_size, max_wait: the policy's flush rule (see :class:`AutobatchPolicy`).
        layout: ``"env_time"``: batch size ``[num_envs, frames_per_batch // num_envs]``,
            names ``[None, "time"]``, each row one env's consecutive steps (for
            GAE / on-policy losses). ``"flat"``: ``[frames_per_batch]`` in arrival
            order (for replay buffers).
        device: default for ``policy_device``, ``storing_device`` and ``env_device``.
        storing_device: where batches are delivered, and their ``device`` (default:
            ``device``, else ``env_device`` when ``policy_device`` is the same device).
            Otherwise the batches have ``device=None``, their tensors on ``env_device``,
            else the CPU: TorchRL's ``Collector`` rule, read from these arguments only
            (``collector.storing_device`` is that device, or ``None``).
        policy_device: where the policy runs (default: where its parameters are).
            A device other than the policy's own makes the collector act with a copy.
        env_device: accepted for TorchRL compatibility: envs run on the CPU in their
            threads, and batches are delivered there when ``storing_device`` and
            ``device`` are unset (TorchRL's collectors leave them on the env's device).
        create_env_kwargs: keyword arguments for ``create_env_fn``.
        max_frames_per_traj: truncate episodes at this length (TorchRL's ``StepCounter``
            for a TorchRL env).
        init_random_frames: the first frames (per env: rounded up to a multiple of
            ``num_envs``) are acted by uniformly random actions, ``policy_version == -1``.
        reset_at_each_iter: reset every env before each batch.
        postproc: applied to every batch before it is yielded or stored.
        split_trajs: split each batch by trajectory with TorchRL's ``split_trajectories``.
        track_traj_ids: write ``("collector", "traj_ids")`` (default ``True``).
        exploration_type: the exploration mode of every policy call.
        reset_when_done: must be ``True`` (an env is reset as soon as it is done).
        interruptor: ends the current batch early when it fires: TorchRL's interruptor
            (``collection_stopped()``) or an :class:`Interrupter` (``stop()``, ``reset()``).
        set_truncated: mark the last step of each env in a batch truncated (and done).
        replay_buffer: batches are written to it and iteration yields ``None``.
        extend_buffer: ``False`` writes frames one by one (``add``) in time order.
        trust_policy, compile_policy: as TorchRL's (``compile_policy`` runs
            ``torch.compile`` on the acting policy, with the dict as its options).
        track_policy_version: write ``policy_version`` (the version of the weights
            that acted) at the root and under ``"next"``; ``-1`` for random frames.
        trajs_per_batch, trajs_per_write, traj_format: yield (or write) whole
            trajectories, as TorchRL's ``BaseCollector`` does.
        pre_collect_hook, post_collect_hook: called before each batch is collected,
            and with each batch before it is yielded.
        on_policy: see the module docs.
        seed: env ``i`` is seeded with ``seed + i`` (same as :meth:`set_seed` before iterating).
        step_timeout: seconds before a hung env step raises ``StepTimeoutError``.
        policy_timeout: seconds one policy call may take before it raises ``PolicyError``
            (``None``: no limit; see :class:`AutobatchPolicy`).
        info_keys: entries of a gymnasium env's ``info`` dict read into every batch as
            observation entries (root and ``("next", ...)``): a list of keys, their specs
            inferred from the first reset's ``info``, or ``{key: TorchRL spec}``; also in
            each ``EpisodeEnd.info`` (see :class:`MultiEnvLoop`). A TorchRL env reads its
            info with ``env.set_info_dict_reader``; a list then names those entries.
        processor: an :class:`EventProcessor` receiving timestep / episode events.
        name: used in thread names.
        compact_obs: leave the observation and state entries out of ``"next"`` (they are
            the next row's root entries), as TorchRL's ``compact_obs`` does.
        auto_register_policy_transforms: ``True``: append to each TorchRL env the
            ``InitTracker`` / ``TensorDictPrimer`` an ``nn.Module`` policy needs and the
            env lacks (TorchRL's rule); ``None`` / ``False``: envs as built.
        worker_idx: kept as ``collector.worker_idx``, as TorchRL keeps it.
        use_buffers, no_cuda_sync: accepted, with no effect (batches are always written
            into preallocated columns; no explicit CUDA synchronisation is made: copies to
            ``storing_device`` are blocking). ``use_buffers=True`` with a ``replay_buffer``
            raises ``TypeError``, as in TorchRL.
        backend, backend_options, num_collectors, sync, return_same_td, cudagraph_policy,
            weight_updater, weight_sync_schemes, weight_recv_schemes: TorchRL's defaults
            (and ``backend="direct"``, ``False``, empty mappings) are accepted; other values
            are refused with what to use instead (``docs/torchrl.rst``).

    Raises:
        ValueError: inconsistent options, or a TorchRL option value this collector cannot
            honour, with what to change.
        TypeError: a policy TorchRL could not call either; ``use_buffers=True`` with a
            ``replay_buffer``.

    Warns:
        LayoutWarning: a layout likely to run well below the ``"auto"`` layout, with why and what to pass:
            ``num_workers`` worker processes driven by several env threads, ``envs_per_thread=1`` with
            several envs (one thread an env), or ``num_workers=1`` with ``envs_per_thread="auto"`` for an env
            whose measure says that worker processes would pay (setting both knobs skips the measure).
    """

    def __init__(
        self,
        create_env_fn: str | EnvFactory | Sequence[EnvFactory] | EnvBase | gym.Env,
        policy: TensorDictModuleBase | Callable[..., Any] | None = None,
        *,
        policy_factory: Callable[[], Callable[..., Any]] | None = None,
        backend: str | None = None,
        backend_options: Mapping[str, Any] | None = None,
        num_collectors: int | None = None,
        sync: bool | None = None,
        frames_per_batch: int,
        total_frames: int = -1,
        num_envs: int | None = None,
        envs_per_thread: int | str = "auto",
        num_workers: int | str = "auto",
        parallel_steps: bool | Literal["auto", "free"] = "auto",
        autobatch_size: int | None = None,
        max_wait: float | None = None,
        layout: Layout = "env_time",
        device: torch.device | str | None = None,
        storing_device: torch.device | str | None = None,
        policy_device: torch.device | str | None = None,
        env_device: torch.device | str | None = None,
        create_env_kwargs: dict[str, Any] | None = None,
        max_frames_per_traj: int | None = None,
        init_random_frames: int | None = None,
        reset_at_each_iter: bool = False,
        postproc: Callable[[TensorDictBase], TensorDictBase] | None = None,
        split_trajs: bool | None = None,
        track_traj_ids: bool = True,
        exploration_type: ExplorationType = ExplorationType.RANDOM,
        return_same_td: bool = False,
        reset_when_done: bool = True,
        interruptor: Any = None,
        set_truncated: bool = False,
        use_buffers: bool | None = None,
        replay_buffer: Any = None,
        extend_buffer: bool = True,
        trust_policy: bool | None = None,
        compile_policy: bool | dict[str, Any] | None = None,
        cudagraph_policy: bool | dict[str, Any] | None = None,
        no_cuda_sync: bool = False,
        weight_updater: Any = None,
        weight_sync_schemes: Mapping[str, Any] | None = None,
        weight_recv_schemes: Mapping[str, Any] | None = None,
        track_policy_version: bool = False,
        worker_idx: int | None = None,
        trajs_per_batch: int | None = None,
        trajs_per_write: int | None = None,
        traj_format: Literal["padded", "cat"] | None = None,
        auto_register_policy_transforms: bool | None = None,
        pre_collect_hook: Callable[[], None] | None = None,
        post_collect_hook: Callable[[TensorDictBase], None] | None = None,
        compact_obs: bool = False,
        on_policy: bool = True,
        seed: int | None = None,
        step_timeout: float | None = None,
        policy_timeout: float | None = None,
        info_keys: InfoKeys | None = None,
        processor: EventProcessor | None = None,
        name: str = "collector",
    ) -> None:
        super().__init__(pre_collect_hook=pre_collect_hook, post_collect_hook=post_collect_hook)
        if policy_factory is not None:
            if policy is not None:
                raise TypeError("policy_factory cannot be used with policy argument.")
            policy = policy_factory()
        _check_torchrl_options(
            backend=backend, backend_options=backend_options, num_collectors=num_collectors, sync=sync,
            return_same_td=return_same_td, use_buffers=use_buffers, replay_buffer=replay_buffer,
            cudagraph_policy=cudagraph_policy, weight_updater=weight_updater,
            weight_sync_schemes=weight_sync_schemes, weight_recv_schemes=weight_recv_schemes)
        _check_options(worker_idx=worker_idx, auto_register_policy_transforms=auto_register_policy_transforms,
                       devices={"device": device, "storing_device": storing_device, "policy_device": policy_device,
                                "env_device": env_device},
                       layout=layout, reset_when_done=reset_when_done, split_trajs=split_trajs,
                       replay_buffer=replay_buffer, trajs_per_batch=trajs_per_batch)
        if create_env_kwargs:
            create_env_fn = _with_kwargs(create_env_fn, create_env_kwargs)
        if num_envs is None and callable(create_env_fn) and not isinstance(create_env_fn, (EnvBase, gym.Env)):
            made = create_env_fn()  # as TorchRL's Collector: a lone factory's env is taken as that instance would be
            # (what is no env goes back behind a factory, for the loop to refuse by name as it refuses any factory's)
            create_env_fn = made if isinstance(made, (EnvBase, gym.Env, gym.vector.VectorEnv)) else lambda: made
        batched = batched_env(create_env_fn, num_workers=num_workers) if is_batched(create_env_fn) else None
        native = batched is not None and batched.native  # one env thread steps it
        factories, self.env_batch_size = self._factories(create_env_fn, num_envs, batched)
        num_envs = len(factories)
        if auto_register_policy_transforms and isinstance(policy, torch.nn.Module):
            factories = [_WithPolicyTransforms(f, policy) for f in factories]
        frames_per_batch, total_frames, init_random_frames, max_frames_per_traj = _frame_budget(
            frames_per_batch=frames_per_batch, total_frames=total_frames, init_random_frames=init_random_frames,
            max_frames_per_traj=max_frames_per_traj, num_envs=num_envs, layout=layout)
        from torchrl.collectors.utils import _validate_traj_format

        self.traj_format = _validate_traj_format(traj_format, trajs_per_batch,
                                                 has_replay_buffer=replay_buffer is not None)
        self.trajs_per_batch = trajs_per_batch  # BaseCollector.__iter__ then yields whole trajectories
        self.trajs_per_write = trajs_per_write
        self._ignore_rb = False  # set by BaseCollector while it writes whole trajectories itself
        step_timeout = check_seconds("step_timeout", step_timeout, allow_zero=False)  # before the auto measure uses it
        self.layout_choice, num_workers, envs_per_thread, parallel_steps = _layout(
            factories[0], num_envs, num_workers=num_workers, envs_per_thread=envs_per_thread,
            parallel_steps=parallel_steps, native=native, whole_blocks=layout == "flat" and on_policy,
            frames_per_batch=frames_per_batch, total_frames=total_frames, max_frames_per_traj=max_frames_per_traj,
            step_timeout=step_timeout, name=name)
        interrupter = _interrupter(interruptor)

        self.num_envs = num_envs
        self.frames_per_batch = frames_per_batch
        self.requested_frames_per_batch = frames_per_batch
        self.total_frames = int(total_frames)
        self.init_random_frames = int(init_random_frames)
        self.layout = layout
        self.reset_at_each_iter = reset_at_each_iter
        self.reset_when_done = True
        self.split_trajs = bool(split_trajs)
        self.track_traj_ids = track_traj_ids
        self.track_policy_version = track_policy_version
        self.set_truncated = set_truncated
        self.exploration_type = exploration_type
        self.replay_buffer = replay_buffer
        self.extend_buffer = extend_buffer
        self.postproc = postproc
        self.on_policy = on_policy
        self.max_frames_per_traj = max_frames_per_traj
        # TorchRL's device rule (``Collector._get_devices``): the batch's ``device`` is ``storing_device``, else
        # ``device``, else the env's device when it is the policy's (both given); otherwise ``None`` and the
        # tensors stay where the env left them (``env_device``, here the CPU when unset).
        self.storing_device = _storing_device(device=device, storing_device=storing_device,
                                              policy_device=policy_device, env_device=env_device)
        self._delivery_device = torch.device(self.storing_device or env_device or "cpu")
        self.env_device = torch.device(env_device) if env_device is not None else None
        self.device = torch.device(device) if device is not None else None
        self.return_same_td = False
        self.no_cuda_sync = bool(no_cuda_sync)
        self.compact_obs = bool(compact_obs)
        self.worker_idx = None if worker_idx is None else int(worker_idx)
        self.processor = processor
        self.interruptor = interruptor
        self._interrupter = interrupter  # what the loop polls (start() makes one when none was given)
        self.name = name
        self.trust_policy = bool(trust_policy)
        self.compiled_policy = bool(compile_policy)
        self.cudagraphed_policy = False
        self._frames = 0
        self._iter = -1
        self._seed = seed
        self._shut = False
        self._background: threading.Thread | None = None
        self._background_stop = threading.Event()
        self._background_error: BaseException | None = None
        self._iterating = False

        self.policy = policy  # None: TorchRL's RandomPolicy over the env's action spec, made by the loop
        self._acting_policy, self.policy_device = _acting_policy(
            policy, on_policy=on_policy, policy_device=policy_device or device, compile_policy=compile_policy)
        try:
            self._loop = MultiEnvLoop(
                factories, self._acting_policy, envs_per_thread=envs_per_thread, num_workers=num_workers,
                parallel_steps=parallel_steps, autobatch_size=autobatch_size,
                max_wait=max_wait, device=self.policy_device, exploration_type=exploration_type,
                lookahead=not on_policy, max_episode_steps=max_frames_per_traj, seed=seed,
                random_steps_per_env=-(-self.init_random_frames // num_envs), step_timeout=step_timeout,
                policy_timeout=policy_timeout, info_keys=info_keys, processor=processor, interrupter=interrupter,
                env_shape=self.env_batch_size, name=name, start=False)
        except PolicyError as exc:
            if isinstance(exc.__cause__, TypeError):  # TorchRL raises TypeError for a policy it cannot call
                raise exc.__cause__ from exc
            raise
        self._autobatch = self._loop.policy
        self._wrapped_policy = self._autobatch.policy
        if self.policy is None:
            self.policy = self._acting_policy = self._wrapped_policy
        keys = self._loop.env_keys  # compact_obs: what the env writes under "next" again at the next step's root
        self._compact_next_keys: list[tuple[str, ...]] = (
            [("next", *key_parts(k)) for k in {**keys.observation, **keys.state}] if self.compact_obs else [])

    # -- construction ------------------------------------------------------------------------
    @staticmethod
    def _factories(create_env_fn: Any, num_envs: int | None,
                   batched: BatchedEnv | None) -> tuple[list[EnvFactory], torch.Size | None]:
        """The factory of each env, and the batch dims of a batched env given as an instance (``batched``, else
        ``None``)."""
        if batched is not None:
            if num_envs not in (None, len(batched.factories)):
                raise ValueError(f"num_envs={num_envs} but the batched env holds {len(batched.factories)} envs "
                                 f"(batch_size={tuple(batched.batch_size)}); leave num_envs out")
            return batched.factories, batched.batch_size
        if isinstance(create_env_fn, (EnvBase, gym.Env)):
            if num_envs not in (None, 1):
                raise ValueError("an env instance can only serve num_envs=1; pass a factory for more envs")
            instance = create_env_fn
            return [lambda: instance], None
        if isinstance(create_env_fn, (list, tuple)):
            if not create_env_fn:
                raise ValueError("create_env_fn is an empty list; pass at least one factory")
            if num_envs is not None and num_envs != len(create_env_fn):
                raise ValueError(f"num_envs={num_envs} but {len(create_env_fn)} env factories were given")
            return [resolve_env_factory(f) for f in create_env_fn], None
        n = 1 if num_envs is None else num_envs
        check_int("num_envs", n, 1)
        return [resolve_env_factory(create_env_fn)] * n, None

    # -- properties TorchRL code reads ------------------------------------------------------------
    @property
    def frames(self) -> int:
        """Frames delivered so far (batches yielded or written to the buffer)."""
        return self._frames

    @property
    def policy_version(self) -> int:
        """Version of the weights the next request will use (+1 per ``update_policy_weights_``)."""
        return self._autobatch.version

    @property
    def is_shut_down(self) -> bool:
        """True once :meth:`shutdown` was called (iterating then raises ``CollectionError``)."""
        return self._shut

    @property
    def loop(self) -> MultiEnvLoop:
        """The underlying :class:`MultiEnvLoop` (for events and statistics)."""
        return self._loop

    @property
    def autobatch_policy(self) -> Any:
        """The :class:`~lightning_rollout.AutobatchPolicy` answering the env threads (``mean_batch_size`` etc.)."""
        return self._autobatch

    def __len__(self) -> int:
        """Number of batches of a finite collector.

        Raises:
            TypeError: the collector is endless (``total_frames=-1``); Lightning and
                ``len()`` users treat ``TypeError`` as "no length".
        """
        if self.total_frames > 0:
            return -(-self.total_frames // self.frames_per_batch)
        raise TypeError("an endless ThreadedCollector (total_frames=-1) has no length")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_envs={self.num_envs}, frames_per_batch={self.frames_per_batch}, "
                f"total_frames={self.total_frames}, layout={self.layout!r}, on_policy={self.on_policy})")

    # -- iteration ---------------------------------------------------------------------------------
    # Which thread iterates each collector: one at a time (a loop has one driver). Class-level lock, held
    # for a few instructions per iterator start and end; the owner and depth are per instance.
    _ITERATION_LOCK = threading.Lock()
    _iteration_owner: threading.Thread | None = None
    _iteration_depth = 0

    @contextlib.contextmanager
    def _iteration_claim(self) -> Iterator[None]:
        """Hold this collector for iteration by the current thread (re-entrant in that thread).

        Raises:
            CollectionError: another live thread holds it (an iterator of its own started
                and neither exhausted nor closed). Nothing waits: the caller is refused at once.
        """
        lock = type(self)._ITERATION_LOCK  # held here: at interpreter exit the class may be gone before ``finally``
        me = threading.current_thread()
        with lock:
            owner = self._iteration_owner
            if owner is not None and owner is not me and owner.is_alive():
                raise CollectionError(
                    f"this ThreadedCollector is already being iterated in thread {owner.name!r}; a collector has "
                    f"one driver: iterate it from one thread at a time (exhaust or close() that iterator first), "
                    f"or give each thread its own collector")
            if owner is not me:  # free, or its owner thread has ended
                self._iteration_owner, self._iteration_depth = me, 0
            self._iteration_depth += 1
        try:
            yield
        finally:
            with lock:
                if self._iteration_owner is me:
                    self._iteration_depth -= 1
                    if self._iteration_depth == 0:
                        self._iteration_owner = None

    def __iter__(self) -> Iterator[TensorDictBase | None]:
        """Iterate batches (TorchRL's ``BaseCollector.__iter__``) from one thread at a time.

        Raises:
            CollectionError: at the first ``next()``, when another thread is iterating
                this collector (refused at once; that iteration goes on undisturbed);
                or the collector was shut down.
            EnvError, PolicyError: a worker failed; the collector is shut down.
        """
        with self._iteration_claim():  # refused before BaseCollector's handler, which would shut down
            yield from super().__iter__()

    def iterator(self) -> Iterator[TensorDictBase | None]:
        """Yield batches until ``total_frames`` (forever when -1); ``None`` per batch with a replay buffer.

        Raises:
            EnvError, PolicyError: a worker failed; the collector is shut down.
            CollectionError: the collector was shut down, or another thread is iterating it.
        """
        with self._iteration_claim():
            while self.total_frames < 0 or self._frames < self.total_frames:
                batch = self.collect_batch()
                if batch is None:
                    return
                if self.replay_buffer is not None and not self._ignore_rb:
                    self._extend(batch)
                    yield None
                else:
                    yield batch

    def collect_batch(self) -> TensorDictBase | None:
        """Collect one batch of ``frames_per_batch`` frames, post-processed (TorchRL's ``rollout`` + ``_postproc``).

        Returns ``None`` when the interruptor stopped collection before any frame.

        Raises:
            CollectionError: the collector is shut down, or another thread is iterating it or
                collecting a batch (refused at once, as :meth:`__iter__` refuses a second thread).
        """
        with self._iteration_claim():
            return self._collect_batch()

    def _collect_batch(self) -> TensorDictBase | None:
        if self._shut:
            raise CollectionError("the collector is shut down")
        if self.pre_collect_hook is not None:
            self.pre_collect_hook()
        try:
            if self.reset_at_each_iter and self._iter >= 0:
                self._loop.reset_envs()
            if self.layout == "env_time":
                batch = self._loop.run_env_steps(self.frames_per_batch // self.num_envs)
            else:
                batch = self._loop.run_steps(self.frames_per_batch)
        except BaseException:  # the loop closed itself; stop the inference thread too (safe from any thread)
            raise
        frames = batch.batch_size.numel()  # not batch.numel(): TensorDict lower-bounds it to 1 when empty
        if frames == 0:
            return None
        self._frames += frames
        self._iter += 1
        batch = self._place(self._export(batch))
        if self.split_trajs:
            if self.layout == "flat":  # arrival order interleaves envs; split_trajectories needs them contiguous
                batch = batch[torch.sort(batch.get(("collector", "traj_ids")), stable=True).indices]
            batch = split_trajectories(batch, prefix="collector")
        if self.postproc is not None:
            batch = self.postproc(batch)
        batch = _drop_private(batch, inplace=True)
        if self.post_collect_hook is not None:
            self.post_collect_hook(batch)
        return batch

    def _place(self, batch: TensorDictBase) -> TensorDictBase:
        """Move a CPU batch to ``storing_device`` (else ``env_device``) and give it TorchRL's ``device``:
        ``storing_device`` as resolved at construction, ``None`` when that is ``None``."""
        if self._delivery_device.type != "cpu" or self.storing_device is not None:
            batch = batch.to(self._delivery_device)  # tensors already on that device are not copied
        if self.storing_device is None and batch.device is not None:
            batch.clear_device_()
        return batch

    def _export(self, batch: TensorDictBase) -> TensorDictBase:
        """The loop's batch in TorchRL's layout: one env gives ``[T]``; entries TorchRL would not write
        are left out (``("collector", "env_id")``; ``policy_version`` unless ``track_policy_version``;
        the observations and state under ``"next"`` with ``compact_obs``)."""
        if self.layout == "env_time":
            batch = self._env_shaped(batch)
        drop: list[Any] = [("collector", "env_id"), *self._compact_next_keys]
        if self.track_policy_version:
            batch.set(("next", "policy_version"), batch.get("policy_version").clone())
        else:
            drop.append("policy_version")
        if not self.track_traj_ids:
            drop.append(("collector", "traj_ids"))
        batch = batch.exclude(*drop)
        if not self.track_traj_ids and not batch.get("collector").keys():
            batch = batch.exclude("collector")
        if self.set_truncated and batch.numel():
            self._truncate_last(batch)
        return batch

    def _env_shaped(self, batch: TensorDictBase) -> TensorDictBase:
        """``[num_envs, T]`` as TorchRL shapes it for the env given: ``[T]`` for one unbatched env,
        ``[*env_batch_size, T]`` for a batched env (``[1, T]`` for a batch of one)."""
        if self.env_batch_size is None:
            return batch[0] if self.num_envs == 1 else batch
        if len(self.env_batch_size) == 1:
            return batch
        batch = batch.reshape(*self.env_batch_size, batch.shape[-1])
        batch.names = [None] * len(self.env_batch_size) + ["time"]
        return batch

    def fake_tensordict(self) -> TensorDictBase:
        """A zero-filled batch with the layout of the batches this collector yields (shape, dim names, keys,
        dtypes), built without collecting: TorchRL's ``Collector.fake_tensordict``."""
        layout = self._loop.layout
        if self.layout == "env_time":
            shape, names = [self.num_envs, self.frames_per_batch // self.num_envs], [None, "time"]
        else:
            shape, names = [self.frames_per_batch], None
        columns = {k: np.zeros((*shape, *spec.shape), spec.dtype) for k, spec in layout.specs.items()}
        return _drop_private(self._place(self._export(layout.to_tensordict(columns, shape, names=names))))

    def _truncate_last(self, batch: TensorDictBase) -> None:
        """``set_truncated``: the last step of each env in the batch (of each trajectory, in the flat
        layout) is marked truncated (and done)."""
        nxt = batch.get("next")
        flags = [k for k in nxt.keys(True, True) if key_parts(k)[-1] in ("truncated", "done")]
        if not any(key_parts(k)[-1] == "truncated" for k in flags):
            raise RuntimeError("set_truncated=True needs a 'truncated' entry in the env's done spec")
        if self.layout == "flat":
            traj = batch.get(("collector", "traj_ids")).numpy()
            last = [int(np.flatnonzero(traj == e)[-1]) for e in np.unique(traj)]
            index: Any = torch.as_tensor(last)
        else:
            index = (..., -1)
        for k in flags:
            value = nxt.get(k)
            value[index] = True

    def _extend(self, batch: TensorDictBase) -> None:
        """Write a batch to the replay buffer: ``extend`` at once, or frame by frame in time order
        (``add``) when ``extend_buffer=False``, as TorchRL does."""
        storage = getattr(self.replay_buffer, "_storage", None)
        if not self.extend_buffer:
            frames = batch.transpose(0, 1).reshape(-1) if batch.ndim > 1 else batch
            for i in range(frames.shape[0]):
                self.replay_buffer.add(frames[i])
            return
        if batch.ndim > 1 and getattr(storage, "ndim", 1) == 1:
            batch = batch.reshape(-1)
        self.replay_buffer.extend(batch)

    def getattr_rb(self, attr: str) -> Any:
        """An attribute of the replay buffer (TorchRL's trainers read ``write_count``)."""
        return getattr(self.replay_buffer, attr)

    # -- background collection -------------------------------------------------------------------------
    def start(self) -> None:
        """Collect in a background thread into ``replay_buffer`` until ``total_frames`` or shutdown.

        Raises:
            RuntimeError: no replay buffer, or already started.
        """
        if self.replay_buffer is None:
            raise RuntimeError("start() needs a replay_buffer: collected batches are written there")
        if self._background is not None:
            raise RuntimeError("the collector is already running in the background")
        self._background_stop.clear()
        if self._interrupter is None:
            self._interrupter = Interrupter()
            self._loop.interrupter = self._interrupter
        self._background = threading.Thread(target=self._run_background,
                                             name=f"lightning_rollout-{self.name}-background", daemon=True)
        self._background.start()

    def is_running(self) -> bool:
        """Whether background collection (:meth:`start`) is running (TorchRL's ``is_running``)."""
        thread = self._background
        return thread is not None and thread.is_alive()

    def _run_background(self) -> None:
        # BaseCollector.__iter__'s choice, without its shutdown-on-error (this thread cannot join itself):
        # with trajs_per_batch only complete trajectories reach the buffer, as TorchRL's start() writes them
        batches = self.iterator() if self.trajs_per_batch is None else self._iter_by_trajectories()
        try:
            for _ in batches:
                if self._background_stop.is_set():
                    return
        except BaseException as exc:  # re-raised by async_shutdown / shutdown
            self._background_error = exc

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Pause background collection inside the ``with`` block."""
        running = self._background is not None
        if running:
            self._stop_background()
        try:
            yield
        finally:
            if running and not self._shut:
                self.start()

    def _stop_background(self, timeout: float | None = None) -> None:
        thread = self._background
        if thread is None:
            return
        self._background_stop.set()
        assert self._interrupter is not None
        self._interrupter.stop()
        thread.join(timeout if timeout is not None else 10.0)
        self._interrupter.reset()
        self._background = None

    def async_shutdown(self, timeout: float | None = None, close_env: bool = True) -> None:
        """Stop background collection and shut down (re-raises a background error)."""
        self.shutdown(timeout=timeout, close_env=close_env)

    def shutdown(self, timeout: float | None = None, close_env: bool = True, raise_on_error: bool = True) -> None:
        """Stop every thread and close the envs; idempotent, safe from ``__del__`` or after an error.

        Raises:
            Exception: the error that ended background collection, if any and ``raise_on_error``.
            ValueError: ``timeout`` is not a finite number of seconds (or ``None``).
        """
        timeout = check_seconds("timeout", timeout, allow_zero=True)
        if self._shut:
            return
        self._shut = True
        self._stop_background(timeout)
        self._loop.close()
        error, self._background_error = self._background_error, None
        if error is not None and raise_on_error:
            raise error

    def __del__(self) -> None:
        try:
            self.shutdown(raise_on_error=False)
        except Exception:  # never raise from a finalizer (modules may be gone at exit)
            pass

    # -- weights -------------------------------------------------------------------------------------------
    def update_policy_weights_(
        self,
        policy_or_weights: TensorDictBase | TensorDictModuleBase | torch.nn.Module | dict | None = None,
        *,
        weights: TensorDictBase | dict | None = None,
        policy: TensorDictModuleBase | torch.nn.Module | None = None,
        worker_ids: Any = None,
        model_id: str | None = None,
        weights_dict: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Push new weights to the acting policy and bump ``policy_version`` (TorchRL's signature).

        With no argument the weights are pulled from the policy given at
        construction. Otherwise pass a module, a ``state_dict`` or a
        ``TensorDict`` of weights (``TensorDict.from_module(policy)``).
        Requests already queued are answered with the old weights. With
        ``on_policy=True`` an update made while a batch is collected (from any
        thread) applies from the next batch. Non-persistent buffers go with the
        weights: a ``state_dict`` (which lacks them) takes them from the policy
        given at construction.

        Raises:
            ValueError: more than one source of weights, or an unknown ``model_id``.
        """
        sources = [x for x in (policy_or_weights, weights, policy) if x is not None]
        if len(sources) > 1:
            raise ValueError("pass the new weights once: positional, weights= or policy=")
        if weights_dict is not None:
            if set(weights_dict) - {"policy"}:
                raise ValueError(f"only model_id 'policy' exists here, got {sorted(weights_dict)}")
            sources = [weights_dict["policy"]]
        if model_id not in (None, "policy"):
            raise ValueError(f"only model_id 'policy' exists here, got {model_id!r}")
        source = sources[0] if sources else self.policy
        self._autobatch.update(source, buffers_from=self.policy if isinstance(self.policy, torch.nn.Module) else None)

    # -- seeds, reset, state --------------------------------------------------------------------------------
    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Seed env ``i`` with ``seed + i``; returns the next unused seed (``seed + num_envs``).

        Before iteration starts this only records the seeds; afterwards every env
        is reset with its new seed (a running episode is cut, marked truncated).
        ``static_seed`` is accepted for TorchRL compatibility (seeds are always per env).
        """
        check_int("seed", seed, 0)
        self._seed = seed
        if self._loop.started:
            self._loop.reset_envs(seeds=[seed + i for i in range(self.num_envs)])
        else:
            self._loop.seed = seed
        return seed + self.num_envs

    def reset(self, index: int | Sequence[int] | None = None, **kwargs: Any) -> None:
        """Start new episodes on the given envs (all by default)."""
        ids = None if index is None else ([index] if isinstance(index, int) else list(index))
        self._loop.reset_envs(ids)

    def state_dict(self, *, with_policy: bool = True) -> OrderedDict:
        """Counters, seed, policy version and acting weights (``torch.load(weights_only=True)``-safe).

        Args:
            with_policy: include the acting weights (``False`` when they are saved
                elsewhere, e.g. in a LightningModule checkpoint).
        """
        return OrderedDict(
            frames=self._frames,
            batches=self._iter + 1,
            next_traj_id=self._loop.next_traj_id,
            policy_version=self._autobatch.version,
            seed=-1 if self._seed is None else self._seed,
            policy_state_dict=(self._autobatch.state()
                               if with_policy and isinstance(self._acting_policy, torch.nn.Module) else {}),
            traj_pool={"traj_id": torch.tensor(self._loop.next_traj_id)},  # TorchRL's entry for the same counter
        )

    def load_state_dict(self, state_dict: OrderedDict | dict) -> None:
        """Restore what :meth:`state_dict` saved, so a resumed run continues the counts.

        Applied whole or not at all: everything is checked before anything changes.
        ``frames``, ``batches``, ``next_traj_id`` and ``policy_version`` must be ints ``>= 0``
        and ``seed`` an int ``>= -1`` (``-1``: unseeded); numpy ints are accepted, bools,
        floats (``1e9`` included), strings and ``None`` are not. ``policy_state_dict`` must
        be a mapping (a ``state_dict``; empty when no weights were saved) with the acting
        policy's keys and shapes. The state is applied by the thread that iterates the
        collector (between batches), or by any thread while none iterates it.

        Raises:
            ValueError: a foreign or truncated state (missing keys), a field of the wrong
                type or range, or weights of another architecture; the message names the
                field and what it got.
            CollectionError: another thread is iterating the collector (mid-batch or between
                two of its batches; ``pause()`` a background collection first), a collection
                call of this thread is running (an event processor calling it), or the
                collector is shut down.
        """
        if not isinstance(state_dict, Mapping):
            raise ValueError(f"not a ThreadedCollector state: expected a dict from state_dict(), got "
                             f"{type(state_dict).__name__}")
        required = {"frames", "batches", "next_traj_id", "policy_version", "seed", "policy_state_dict"}
        missing = required - set(state_dict)
        if missing:
            raise ValueError(f"not a ThreadedCollector state: missing {sorted(missing)}")
        fields: dict[str, int] = {}
        for field, minimum in (("frames", 0), ("batches", 0), ("next_traj_id", 0), ("policy_version", 0),
                               ("seed", -1)):
            value = state_dict[field]
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
                raise ValueError(f"ThreadedCollector state: {field!r} must be an int >= {minimum}, got {value!r} "
                                 f"({type(value).__name__})")
            fields[field] = int(value)
        weights = state_dict["policy_state_dict"]
        if not isinstance(weights, Mapping):
            raise ValueError(f"ThreadedCollector state: 'policy_state_dict' must be a mapping (a state_dict, empty "
                             f"when no weights were saved), got {type(weights).__name__}")
        has_weights = next(iter(weights.keys()), None) is not None
        with self._iteration_claim():  # refused at once while another thread iterates: nothing changed yet
            if self._shut:
                raise CollectionError("load_state_dict: the collector is shut down; load the state into a new one")
            if self._loop.collecting:
                raise CollectionError("load_state_dict: called while this collector is collecting a batch (from an "
                                      "event processor or policy?); call it between batches")
            if has_weights:
                self._check_weights(weights)
                self._autobatch.update(weights)  # checked: only an env or policy fault can fail it now
            seed = fields["seed"]
            if self._loop.started and seed >= 0:
                self._loop.reset_envs(seeds=[seed + fields["frames"] + i for i in range(self.num_envs)])
            self._frames = fields["frames"]
            self._iter = fields["batches"] - 1
            self._autobatch.set_version(fields["policy_version"])
            if not self._loop.started:
                self._loop.set_traj_id_start(fields["next_traj_id"])
                if seed >= 0:
                    self._loop.seed = seed + self._frames  # fresh but reproducible streams on resume
            if seed >= 0:
                self._seed = seed + self._frames

    def _check_weights(self, weights: Mapping[str, Any]) -> None:
        """Refuse a ``state_dict`` the acting policy would take only in part (``load_state_dict`` copies the
        entries that fit before it raises about the others): same keys, same shapes.

        Raises:
            ValueError: a missing or unexpected key, or a shape that differs, named.
        """
        if not isinstance(self._autobatch.weights, torch.nn.Module):
            return  # a plain callable keeps whatever it is given
        current = self._autobatch.weights.state_dict()
        unexpected, absent = sorted(set(weights) - set(current)), sorted(set(current) - set(weights))
        if unexpected or absent:
            raise ValueError(f"ThreadedCollector state: the policy rejected the new weights (missing keys {absent}, "
                             f"unexpected keys {unexpected}); load a state saved from a policy of the same "
                             "architecture")
        for key, value in weights.items():
            have = current[key]
            if isinstance(have, torch.Tensor) and (not isinstance(value, torch.Tensor) or value.shape != have.shape):
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"ThreadedCollector state: the policy rejected the new weights ({key!r} has shape "
                                 f"{tuple(have.shape)} in the policy, {got} in the state); load a state saved from "
                                 "a policy of the same architecture")


def _drop_private(batch: TensorDictBase, inplace: bool = False) -> TensorDictBase:
    """``batch`` without its ``"_"``-prefixed entries (at any depth)."""
    private = [k for k in batch.keys(True) if any(part.startswith("_") for part in key_parts(k))]
    return batch.exclude(*private, inplace=inplace) if private else batch


def _param_device(policy: Any) -> torch.device:
    if isinstance(policy, torch.nn.Module):
        for p in policy.parameters():
            return p.device
    return torch.device("cpu")
