"""ThreadedCollector: a drop-in ``torchrl.collectors.BaseCollector`` over :class:`MultiEnvLoop` for ``Collector``,
``MultiSyncCollector`` and ``MultiAsyncCollector`` (their keywords: :mod:`lightning_rollout._keywords`; the guide:
``docs/torchrl.rst``). Iterate from one thread; ``start()`` collects into the replay buffer in a background thread
(``lightning_rollout-<name>-background``), which ``shutdown()`` stops and joins.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torchrl._utils import seed_generator
from torchrl.collectors import BaseCollector
from torchrl.collectors.utils import _validate_traj_format, split_trajectories
from torchrl.envs import EnvBase

from ._batched import batched_env, is_batched, takes_apart
from ._checks import check_int, check_seconds, warn_user
from ._keywords import (Options, PolicyPrimers, PolicyTransforms, acting_policy, chained_seeds, env_seeds, env_source,
                        frame_budget, interrupter, options, signature, storing_device)
from ._threads import torch_threads_set
from .envs import EnvFactory, env_factories
from .errors import CollectionError, LayoutWarning, PolicyError
from .events import Interrupter
from .loop import MultiEnvLoop
from .loop.auto import LayoutChoice, check_knobs, is_auto, one_env_threads_warning, resolve_layout
from .specs import key_parts

__all__ = ["ThreadedCollector"]

_CLAIM_LOCK = threading.Lock()  # guards every collector's claim (owner, depth); held a few instructions a claim
_COPIED = ("frames_per_batch", "total_frames", "init_random_frames", "max_frames_per_traj", "trajs_per_batch",
           "trajs_per_write", "layout", "reset_at_each_iter", "track_traj_ids", "postproc", "track_policy_version",
           "set_truncated", "exploration_type", "replay_buffer", "extend_buffer", "on_policy", "processor",
           "interruptor", "name", "worker_idx", "update_at_each_batch", "compact_obs", "no_cuda_sync", "env_device",
           "device")


def _env_factories(create_env_fn: Any, policy: Any, o: Options) -> tuple[list[EnvFactory], torch.Size | None, bool]:
    """``(factories, batch dims of a batched env given or None, whether it is stepped as it is)``; ``ValueError``
    for a ``num_envs`` the envs given do not match, or an empty list."""
    num_envs, batched = o.num_envs, None
    if is_batched(create_env_fn):
        batched = batched_env(create_env_fn, num_workers=o.num_workers)
        if num_envs not in (None, len(batched.factories)):
            raise ValueError(f"num_envs={num_envs} but the batched env holds {len(batched.factories)} envs "
                             f"(batch_size={tuple(batched.batch_size)}); leave num_envs out")
        factories = batched.factories
    elif isinstance(create_env_fn, (EnvBase, gym.Env)):
        if num_envs not in (None, 1):
            raise ValueError("an env instance can only serve num_envs=1; pass a factory for more envs")
        factories = [lambda: create_env_fn]
    else:
        factories = env_factories(create_env_fn, num_envs)
    if isinstance(policy, torch.nn.Module) and o.auto_register_policy_transforms is not False:
        primers = PolicyPrimers(policy, append=bool(o.auto_register_policy_transforms))
        factories = [PolicyTransforms(f, primers) for f in factories]
    return factories, (None if batched is None else batched.batch_size), batched is not None and batched.native


def _layout(factory: EnvFactory, num_envs: int, o: Options,
            native: bool) -> tuple[LayoutChoice | None, int, int, bool | str]:
    """``(layout_choice, num_workers, envs_per_thread, parallel_steps)`` with ``"auto"`` resolved (one thread for a
    ``native`` batched env), a slow layout warned about (``LayoutWarning``); ``ValueError`` for a bad knob."""
    envs_per_thread, num_workers, parallel_steps = o.envs_per_thread, o.num_workers, o.parallel_steps
    check_knobs(envs_per_thread=envs_per_thread, num_workers=num_workers, parallel_steps=parallel_steps)
    if num_envs == 1 and not is_auto(num_workers) and num_workers > 1:
        raise ValueError(f"num_workers={num_workers} with one env: ThreadedCollector's num_workers are worker "
                         "processes stepping its num_envs envs (in TorchRL's multi-collectors, one env a worker); "
                         f"pass num_envs={num_workers} (and num_workers='auto')")
    if native:
        envs_per_thread = num_envs if is_auto(envs_per_thread) else envs_per_thread
        num_workers = 1 if is_auto(num_workers) else num_workers
    chosen_ept = is_auto(envs_per_thread)
    choice, num_workers, envs_per_thread, parallel_steps = resolve_layout(
        factory, num_envs, num_workers=num_workers, envs_per_thread=envs_per_thread, parallel_steps=parallel_steps,
        expected_frames=o.total_frames if o.total_frames > 0 else None, step_timeout=o.step_timeout, name=o.name)
    slow = (choice.warning if choice is not None else None) or (
        None if chosen_ept or native or int(num_workers) > 1 else one_env_threads_warning(num_envs, envs_per_thread))
    if slow is not None:
        warn_user(LayoutWarning(f"{o.name}: {slow}"))
    whole_blocks, frames_per_batch = o.layout == "flat" and o.on_policy, o.frames_per_batch
    if chosen_ept and whole_blocks and frames_per_batch % envs_per_thread:
        envs_per_thread = math.gcd(envs_per_thread, frames_per_batch)  # a divisor of both: whole blocks
    if whole_blocks and frames_per_batch % envs_per_thread:
        raise ValueError(f"with layout='flat' and on_policy=True, frames_per_batch ({frames_per_batch}) must be a "
                         f"multiple of envs_per_thread ({envs_per_thread}) so no batch mixes policy versions")
    return choice, int(num_workers), int(envs_per_thread), parallel_steps


class _Claim:
    """Which thread iterates a collector: one at a time (a loop has one driver), re-entrant in that thread."""

    def __init__(self) -> None:
        self.owner: threading.Thread | None = None
        self.depth = 0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        """Hold the collector for this thread; ``CollectionError`` at once while another live thread holds it."""
        lock, me = _CLAIM_LOCK, threading.current_thread()  # local: at exit the module may be gone before finally
        with lock:
            owner = self.owner
            if owner is not None and owner is not me and owner.is_alive():
                raise CollectionError(f"this ThreadedCollector is already being iterated in thread {owner.name!r}; a "
                                      "collector has one driver: iterate it from one thread at a time (exhaust or "
                                      "close() that iterator first), or give each thread its own collector")
            self.owner, self.depth = me, (self.depth if owner is me else 0) + 1  # else free, or its owner ended
        try:
            yield
        finally:
            with lock:
                if self.owner is me:
                    self.depth -= 1
                    self.owner = me if self.depth else None


class ThreadedCollector(BaseCollector):
    """TorchRL collector whose envs run in threads (or worker processes) behind one autobatched policy: every
    keyword of torchrl 0.14's ``Collector`` and multi-collectors, with TorchRL's defaults (the values whose meaning
    does not carry over refused with what to do, ``docs/torchrl.rst``), and ``Collector``'s batches.

    Args:
        create_env_fn: a gymnasium id; a factory of one env (alone and without ``num_envs``: called once, as
            TorchRL does); a list of factories or env instances; an env instance; or a batched env.
        policy: what TorchRL's collectors accept (``None``: ``RandomPolicy``), or a one-argument tensor function
            of the only observation; called on a TensorDict of ``k`` envs' rows.

    Keyword Args:
        num_envs: number of envs (default: a list's length, else the env's batch size, 1 if unbatched).
        envs_per_thread, num_workers, parallel_steps: the layout (:class:`MultiEnvLoop`; ``num_workers``:
            processes stepping the envs); ``"auto"`` (default): chosen from a few timed steps of one env.
        autobatch_size, max_wait: the policy's flush rule (see :class:`AutobatchPolicy`).
        layout: ``"env_time"`` (``[num_envs, T]`` named ``[None, "time"]``; ``[T]`` for one env, ``[*batch_size, T]``
            for a batched env) or ``"flat"`` (``[frames_per_batch]`` in arrival order).
        on_policy: ``True``: nothing runs between batches, each acted by one ``policy_version`` of the policy
            passed; ``False``: envs run one step ahead with a copy refreshed by ``update_policy_weights_()``.
        seed: seeds the envs as ``env.set_seed(seed)`` seeds the env given, and the policy's own stream.
        step_timeout, policy_timeout: seconds before a hung call raises. num_threads: the policy's torch threads.
        info_keys, processor, name: see :class:`MultiEnvLoop`. The others: TorchRL's.

    Raises:
        ValueError: inconsistent options, or TorchRL values this collector cannot honour (each named).
        TypeError: an unknown keyword; a policy TorchRL could not call; ``use_buffers=True`` with ``replay_buffer``.

    Warns:
        LayoutWarning: a layout likely to run well below ``"auto"``; UserWarning: a started ``SerialEnv`` not
        seeded; FutureWarning: TorchRL's, for transforms the policy needs.
    """

    def __init__(self, create_env_fn: Any, policy: Any = None, **keywords: Any) -> None:
        o = options(keywords)
        super().__init__(pre_collect_hook=o.pre_collect_hook, post_collect_hook=o.post_collect_hook)
        if o.policy_factory is not None:
            if policy is not None:
                raise TypeError("policy_factory cannot be used with policy argument.")
            policy = o.policy_factory()
        create_env_fn = env_source(create_env_fn, o)
        self._chained_seeds = chained_seeds(create_env_fn) and takes_apart(create_env_fn)
        # warned at the first batch unless seeded by then: its envs are rebuilt, a seed set on it is lost
        self._started_env = (None if not self._chained_seeds or create_env_fn.is_closed or o.seed is not None
                             else type(create_env_fn).__name__)
        factories, self.env_batch_size, native = _env_factories(create_env_fn, policy, o)
        self.num_envs = num_envs = len(factories)
        frame_budget(o, num_envs)
        for name in _COPIED:  # what TorchRL's code reads, the frame budget as TorchRL rounds it
            setattr(self, name, getattr(o, name))
        self.requested_frames_per_batch = self.frames_per_batch
        self.traj_format = _validate_traj_format(o.traj_format, o.trajs_per_batch,
                                                 has_replay_buffer=o.replay_buffer is not None)
        self.split_trajs, self.trust_policy, self.compiled_policy = (
            bool(o.split_trajs), bool(o.trust_policy), bool(o.compile_policy))
        self.reset_when_done, self.return_same_td, self.cudagraphed_policy = True, False, False
        self._ignore_rb = False  # set by BaseCollector while it writes whole trajectories itself
        self.storing_device = storing_device(o)
        self._interrupter = interrupter(o.interruptor)  # what the loop polls (start() makes one if none given)
        self._frames, self._iter, self._seed, self.is_shut_down = 0, -1, o.seed, False
        self._claim, self._stopping = _Claim(), threading.Event()
        self._background: threading.Thread | None = None  # start()'s thread
        self._background_error: BaseException | None = None  # what ended it, raised by shutdown()
        self.layout_choice, num_workers, envs_per_thread, parallel_steps = _layout(factories[0], num_envs, o, native)
        self.policy = policy
        self._acting_policy, self.policy_device = acting_policy(policy, o)
        seeds = None if o.seed is None else env_seeds(o.seed, num_envs, self._chained_seeds)  # each env's
        try:
            with torch_threads_set(o.num_threads or torch.get_num_threads()):  # what the loop's policy thread asks
                #: The underlying :class:`MultiEnvLoop` (for events and statistics).
                self.loop = MultiEnvLoop(
                    factories, self._acting_policy, envs_per_thread=envs_per_thread, num_workers=num_workers,
                    parallel_steps=parallel_steps, autobatch_size=o.autobatch_size, max_wait=o.max_wait,
                    device=self.policy_device, exploration_type=o.exploration_type, lookahead=not o.on_policy,
                    max_episode_steps=self.max_frames_per_traj, seed=seeds,
                    random_steps_per_env=-(-self.init_random_frames // num_envs), step_timeout=o.step_timeout,
                    policy_timeout=o.policy_timeout, info_keys=o.info_keys, processor=o.processor,
                    interrupter=self._interrupter, env_shape=self.env_batch_size, name=o.name, start=False)
        except PolicyError as exc:
            if isinstance(exc.__cause__, TypeError):  # TorchRL raises TypeError for a policy it cannot call
                raise exc.__cause__ from exc
            raise
        #: What acts: the loop's :class:`~lightning_rollout.policy.PolicyCall` (``mean_batch_size``, ``calls``...).
        self.autobatch_policy = self.loop.policy
        if self.policy is None:  # TorchRL's RandomPolicy, made by the loop
            self.policy = self._acting_policy = self.autobatch_policy.policy
        keys = self.loop.env_keys  # compact_obs: what the env writes under "next" again at the next step's root
        self._compact_next_keys: list[tuple[str, ...]] = (
            [("next", *key_parts(k)) for k in {**keys.observation, **keys.state}] if self.compact_obs else [])

    __init__.__signature__ = signature()  # type: ignore[attr-defined]

    @property
    def frames(self) -> int:
        """Frames delivered so far (batches yielded or written to the buffer)."""
        return self._frames

    @property
    def policy_version(self) -> int:
        """Version of the weights the next request will use (+1 per ``update_policy_weights_``)."""
        return self.autobatch_policy.version

    def __len__(self) -> int:
        """Number of batches; ``TypeError`` ("no length" to Lightning) for an endless one (``total_frames=-1``)."""
        if self.total_frames > 0:
            return -(-self.total_frames // self.frames_per_batch)
        raise TypeError("an endless ThreadedCollector (total_frames=-1) has no length")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_envs={self.num_envs}, frames_per_batch={self.frames_per_batch}, "
                f"total_frames={self.total_frames}, layout={self.layout!r}, on_policy={self.on_policy})")

    def __iter__(self) -> Iterator[TensorDictBase | None]:
        """Iterate batches from one thread at a time: ``CollectionError`` while another thread iterates or once shut
        down; ``EnvError`` / ``PolicyError`` when a worker failed (the collector is then shut down)."""
        with self._claim():  # refused before BaseCollector's handler, which would shut down
            yield from super().__iter__()

    def iterator(self) -> Iterator[TensorDictBase | None]:
        """Yield batches until ``total_frames`` (forever when -1); with a replay buffer, write each there (``add``
        frame by frame in time order when ``extend_buffer=False``) and yield ``None``. Raises as :meth:`__iter__`."""
        with self._claim():
            while self.total_frames < 0 or self._frames < self.total_frames:
                if (batch := self.collect_batch()) is None:
                    return
                if self.replay_buffer is None or self._ignore_rb:
                    yield batch
                    continue
                if not self.extend_buffer:
                    for frame in batch.transpose(0, 1).reshape(-1) if batch.ndim > 1 else batch:
                        self.replay_buffer.add(frame)
                else:
                    storage = getattr(self.replay_buffer, "_storage", None)
                    self.replay_buffer.extend(batch.reshape(-1) if batch.ndim > 1 and getattr(storage, "ndim", 1) == 1
                                              else batch)
                yield None

    def collect_batch(self) -> TensorDictBase | None:
        """One post-processed batch of ``frames_per_batch`` frames (TorchRL's ``rollout`` + ``_postproc``); ``None``
        when the interruptor stopped collection before any frame. Raises as :meth:`__iter__`."""
        with self._claim():
            if self.is_shut_down:
                raise CollectionError("the collector is shut down")
            if self.pre_collect_hook is not None:
                self.pre_collect_hook()
            if self.update_at_each_batch:
                self.update_policy_weights_()
            if self._started_env is not None:
                warn_user(f"the {self._started_env} given was started (seeded, reset or stepped): ThreadedCollector "
                          "rebuilds its envs from their create_env_fn, so their state, a seed set with "
                          "env.set_seed(...) included, is not carried over; pass seed= or call "
                          "collector.set_seed(...) (they seed the envs as env.set_seed(seed) would)")
                self._started_env = None
            if self.reset_at_each_iter and self._iter >= 0:
                self.loop.reset_envs()
            batch = (self.loop.run_env_steps(self.frames_per_batch // self.num_envs) if self.layout == "env_time"
                     else self.loop.run_steps(self.frames_per_batch))
            frames = batch.batch_size.numel()  # not batch.numel(): TensorDict lower-bounds it to 1 when empty
            if frames == 0:
                return None
            self._frames, self._iter = self._frames + frames, self._iter + 1
            batch = self._export(batch)
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

    def _export(self, batch: TensorDictBase) -> TensorDictBase:
        """The loop's CPU batch as TorchRL delivers it (shape, entries, ``set_truncated``, device), private keys in."""
        shape = self.env_batch_size
        if self.layout == "env_time" and shape is None and self.num_envs == 1:
            batch = batch[0]
        elif self.layout == "env_time" and shape is not None and len(shape) > 1:
            batch = batch.reshape(*shape, batch.shape[-1])
            batch.names = [None] * len(shape) + ["time"]
        drop: list[Any] = [("collector", "env_id"), *self._compact_next_keys]
        if self.track_policy_version:
            batch.set(("next", "policy_version"), batch.get("policy_version").clone())
        elif "policy_version" not in self.loop.layout.out_keys:  # the policy's own entry stays, as in TorchRL
            drop.append("policy_version")
        if not self.track_traj_ids:
            drop.append(("collector", "traj_ids"))
        batch = batch.exclude(*drop)
        if not self.track_traj_ids and not batch.get("collector").keys():
            batch = batch.exclude("collector")
        if self.set_truncated and batch.numel():
            _truncate_last(batch, flat=self.layout == "flat")
        if self.storing_device is not None or self.env_device is not None and self.env_device.type != "cpu":
            batch = batch.to(self.storing_device or self.env_device)  # tensors already there are not copied
        if self.storing_device is None and batch.device is not None:
            batch.clear_device_()
        return batch

    def fake_tensordict(self) -> TensorDictBase:
        """A zero-filled batch of this collector's layout, built without collecting (TorchRL's ``fake_tensordict``)."""
        layout, env_time = self.loop.layout, self.layout == "env_time"
        shape = [self.num_envs, self.frames_per_batch // self.num_envs] if env_time else [self.frames_per_batch]
        names = [None, "time"] if env_time else None
        columns = {k: np.zeros((*shape, *spec.shape), spec.dtype) for k, spec in layout.specs.items()}
        return _drop_private(self._export(layout.to_tensordict(columns, shape, names=names)))

    def getattr_rb(self, attr: str) -> Any:
        """An attribute of the replay buffer (TorchRL's trainers read ``write_count``)."""
        return getattr(self.replay_buffer, attr)

    def start(self) -> None:
        """Collect in a background thread into ``replay_buffer`` until ``total_frames`` or shutdown;
        ``RuntimeError`` without a replay buffer or when already started."""
        if self.replay_buffer is None:
            raise RuntimeError("start() needs a replay_buffer: collected batches are written there")
        if self._background is not None:
            raise RuntimeError("the collector is already running in the background")
        if self._interrupter is None:
            self._interrupter = self.loop.interrupter = Interrupter()
        # BaseCollector.__iter__'s choice, without its shutdown-on-error (that thread cannot join itself): with
        # trajs_per_batch only complete trajectories reach the buffer, as TorchRL's start() writes them
        batches = self.iterator if self.trajs_per_batch is None else self._iter_by_trajectories

        def run() -> None:
            try:
                for _ in batches():
                    if self._stopping.is_set():
                        return
            except BaseException as exc:  # re-raised by shutdown
                self._background_error = exc

        self._stopping.clear()
        self._background = threading.Thread(target=run, name=f"lightning_rollout-{self.name}-background", daemon=True)
        self._background.start()

    def _stop_background(self, timeout: float | None = None) -> None:
        """Stop :meth:`start`'s collection through the interrupter and join its thread (seconds, default 10)."""
        if self._background is not None:
            self._stopping.set()
            self._interrupter.stop()
            self._background.join(timeout if timeout is not None else 10.0)
            self._interrupter.reset()
            self._background = None

    def is_running(self) -> bool:
        """Whether background collection (:meth:`start`) is running (TorchRL's ``is_running``)."""
        return self._background is not None and self._background.is_alive()

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Pause background collection inside the ``with`` block."""
        running = self._background is not None
        self._stop_background()
        try:
            yield
        finally:
            if running and not self.is_shut_down:
                self.start()

    def shutdown(self, timeout: float | None = None, close_env: bool = True, raise_on_error: bool = True) -> None:
        """Stop every thread and close the envs (``async_shutdown`` too); idempotent. Raises the error that ended
        background collection (if ``raise_on_error``), ``ValueError`` for a ``timeout`` neither finite nor ``None``."""
        timeout = check_seconds("timeout", timeout, allow_zero=True)
        if self.is_shut_down:
            return
        self.is_shut_down = True
        self._stop_background(timeout)
        self.loop.close()
        error, self._background_error = self._background_error, None
        if error is not None and raise_on_error:
            raise error

    def __del__(self) -> None:
        try:
            self.shutdown(raise_on_error=False)
        except Exception:  # never raise from a finalizer (modules may be gone at exit)
            pass

    def update_policy_weights_(
            self, policy_or_weights: TensorDictBase | TensorDictModuleBase | torch.nn.Module | dict | None = None, *,
            weights: TensorDictBase | dict | None = None, policy: TensorDictModuleBase | torch.nn.Module | None = None,
            worker_ids: Any = None, model_id: str | None = None, weights_dict: dict[str, Any] | None = None,
            **kwargs: Any) -> None:
        """Push new weights to the acting policy and bump ``policy_version``: none given pulls them from the policy
        passed; else a module, a ``state_dict`` (non-persistent buffers from that policy) or a ``TensorDict``, applied
        from the next request (on-policy: the next batch). ``ValueError``: several sources, an unknown ``model_id``."""
        sources = [x for x in (policy_or_weights, weights, policy) if x is not None]
        if len(sources) > 1:
            raise ValueError("pass the new weights once: positional, weights= or policy=")
        if unknown := {model_id, *(weights_dict or ())} - {None, "policy"}:
            raise ValueError(f"only model_id 'policy' exists here, got {', '.join(sorted(map(repr, unknown)))}")
        if weights_dict is not None:
            sources = [weights_dict["policy"]]
        buffers_from = self.policy if isinstance(self.policy, torch.nn.Module) else None
        self.autobatch_policy.update(sources[0] if sources else self.policy, buffers_from=buffers_from)

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Seed the envs as ``env.set_seed(seed)`` seeds the env given (TorchRL's chain for a ``SerialEnv`` /
        ``ParallelEnv``, else ``seed + i``) and return TorchRL's next seed; once iterating, every env is reset with
        its new seed (a running episode cut, marked truncated). ``static_seed`` has no effect."""
        check_int("seed", seed, 0)
        self._seed, self._started_env = seed, None
        seeds = env_seeds(seed, self.num_envs, self._chained_seeds)  # what the loop is seeded with: each env's
        if self.loop.started:
            self.loop.reset_envs(seeds=seeds)
        else:
            self.loop.seed = seeds
        return seed_generator(seeds[-1]) if self._chained_seeds else seed + self.num_envs

    def reset(self, index: int | Sequence[int] | None = None, **kwargs: Any) -> None:
        """Start new episodes on the given envs (all by default)."""
        self.loop.reset_envs(None if index is None else ([index] if isinstance(index, int) else list(index)))

    def state_dict(self, *, with_policy: bool = True) -> OrderedDict:
        """Counters, seed, policy version and (``with_policy``) the acting weights; loads with ``weights_only=True``."""
        module = isinstance(self._acting_policy, torch.nn.Module)
        weights = self.autobatch_policy.state() if with_policy and module else {}
        return OrderedDict(frames=self._frames, batches=self._iter + 1, next_traj_id=self.loop.next_traj_id,
                           policy_version=self.policy_version, seed=-1 if self._seed is None else self._seed,
                           policy_state_dict=weights,
                           traj_pool={"traj_id": torch.tensor(self.loop.next_traj_id)})  # TorchRL's, same counter

    def load_state_dict(self, state_dict: OrderedDict | dict) -> None:
        """Restore what :meth:`state_dict` saved, whole or not at all, so a resumed run continues the counts.
        ``ValueError``: a foreign or truncated state, a field of the wrong type or range, weights of another
        architecture. ``CollectionError``: another thread iterates (``pause()`` a background collection first), a
        collection call of this thread is running, or the collector is shut down."""
        ints = {"frames": 0, "batches": 0, "next_traj_id": 0, "policy_version": 0, "seed": -1}  # name: minimum
        missing = {*ints, "policy_state_dict"} - set(state_dict) if isinstance(state_dict, Mapping) else None
        if missing is None or missing:
            got = f"missing {sorted(missing)}" if missing else f"expected a dict from state_dict(), got {state_dict!r}"
            raise ValueError(f"not a ThreadedCollector state: {got}")
        for field, minimum in ints.items():
            value = state_dict[field]
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
                raise ValueError(f"ThreadedCollector state: {field!r} must be an int >= {minimum}, got {value!r} "
                                 f"({type(value).__name__})")
        weights = state_dict["policy_state_dict"]
        if not isinstance(weights, Mapping):
            raise ValueError(f"ThreadedCollector state: 'policy_state_dict' must be a mapping (a state_dict, empty "
                             f"when no weights were saved), got {type(weights).__name__}")
        frames, seed = int(state_dict["frames"]), int(state_dict["seed"])
        with self._claim():  # refused at once while another thread iterates: nothing changed yet
            if self.is_shut_down:
                raise CollectionError("load_state_dict: the collector is shut down; load the state into a new one")
            if self.loop.collecting:
                raise CollectionError("load_state_dict: called while this collector is collecting a batch (from an "
                                      "event processor or policy?); call it between batches")
            if next(iter(weights.keys()), None) is not None:
                _check_weights(self.autobatch_policy.weights, weights)
                self.autobatch_policy.update(weights)  # checked: only an env or policy fault can fail it now
            if seed >= 0:  # fresh, reproducible streams on resume
                self.set_seed(seed + frames)
            self._frames, self._iter = frames, int(state_dict["batches"]) - 1
            self.autobatch_policy.set_version(int(state_dict["policy_version"]))
            if not self.loop.started:
                self.loop.set_traj_id_start(int(state_dict["next_traj_id"]))


def _check_weights(acting: Any, weights: Mapping[str, Any]) -> None:
    """Refuse (``ValueError``) a key or shape the acting module would take only in part (its ``load_state_dict``
    copies the entries that fit before it raises about the others)."""
    if not isinstance(acting, torch.nn.Module):
        return  # a plain callable keeps whatever it is given
    current = acting.state_dict()
    unexpected, absent = sorted(set(weights) - set(current)), sorted(set(current) - set(weights))
    if unexpected or absent:
        raise ValueError(f"ThreadedCollector state: the policy rejected the new weights (missing keys {absent}, "
                         f"unexpected keys {unexpected}); load a state saved from a policy of the same architecture")
    for key, value in weights.items():
        have = current[key]
        if isinstance(have, torch.Tensor) and (not isinstance(value, torch.Tensor) or value.shape != have.shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"ThreadedCollector state: the policy rejected the new weights ({key!r} has shape "
                             f"{tuple(have.shape)} in the policy, {got} in the state); load a state saved from "
                             "a policy of the same architecture")


def _truncate_last(batch: TensorDictBase, *, flat: bool) -> None:
    """``set_truncated``: mark the last step of each env in the batch (of each trajectory when ``flat``) truncated
    and done; ``RuntimeError`` when the env's done spec has no ``"truncated"`` entry."""
    nxt = batch.get("next")
    flags = [k for k in nxt.keys(True, True) if key_parts(k)[-1] in ("truncated", "done")]
    if not any(key_parts(k)[-1] == "truncated" for k in flags):
        raise RuntimeError("set_truncated=True needs a 'truncated' entry in the env's done spec")
    if flat:
        traj = batch.get(("collector", "traj_ids")).numpy()
        index: Any = torch.as_tensor([int(np.flatnonzero(traj == e)[-1]) for e in np.unique(traj)])
    else:
        index = (..., -1)
    for k in flags:
        nxt.get(k)[index] = True


def _drop_private(batch: TensorDictBase, inplace: bool = False) -> TensorDictBase:
    """``batch`` without its ``"_"``-prefixed entries (at any depth)."""
    private = [k for k in batch.keys(True) if any(part.startswith("_") for part in key_parts(k))]
    return batch.exclude(*private, inplace=inplace) if private else batch
