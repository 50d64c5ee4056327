"""The driver: :class:`MultiEnvLoop`, the request-driven env loop with double batching (the seed's runner).

Threads and what they own
-------------------------
* The **driver** (the thread that calls :meth:`MultiEnvLoop.run_steps`,
  :meth:`~MultiEnvLoop.run_env_steps` or :meth:`~MultiEnvLoop.run_episodes`)
  owns every piece of bookkeeping in :class:`MultiEnvLoop`: grants in flight, how far
  each worker's steps were handed out, counters. Only one thread may drive a loop at a time.
* Each **env thread** (``lightning_rollout-<name>-env<i>``, a daemon) runs a
  :class:`~lightning_rollout.loop.worker.Worker` that owns a block of ``envs_per_thread``
  envs (a :class:`~lightning_rollout.loop.block.Block`, built here), their running
  counters and the storage its steps are written to, time-major
  (:class:`~lightning_rollout.loop.buffers.Steps`).
* The policy's inference thread (see :mod:`lightning_rollout.policy`).

Messages (only small records cross threads; steps stay in the workers' storage)
-------------------------------------------------------------------------------
The typed requests and replies of :mod:`lightning_rollout.loop.messages`. The driver
sends a worker a :class:`~.messages.Grant` (it may take the worker's steps up to
``end``), an :class:`~.messages.EpisodeRequest`, a :class:`~.messages.ResetRequest` or
a :class:`~.messages.StopRequest` on the worker's ``SimpleQueue``; each worker answers
on the loop's shared ``SimpleQueue`` with :class:`~.messages.Published`,
:class:`~.messages.EpisodeReady`, :class:`~.messages.ResetDone`, or
:class:`~.messages.WorkerFailed` when it failed. Every request says how far the driver
has copied the worker's steps out, so the worker knows which rows are free again.

One data path: a worker writes its steps into its own storage; the driver grants
steps, and copies the published ones out into the batch it returns, once:
:meth:`MultiEnvLoop.run_env_steps` grants every worker ``T`` steps and copies them
env-major; :meth:`MultiEnvLoop.run_steps` with one env thread grants its whole rounds
at once and copies them in time order; with several, it grants a step at a time to
each and copies each as it arrives (arrival order). Steps published and not handed
out (a step copied in part, or the steps past what every env delivered in an
interrupted call) stay in the worker's storage for the next call.

Double batching
---------------
In the default *lookahead* mode a worker writes its next step (policy call, then
env step) **before** it is granted, then parks until a grant arrives and publishes
it at once. At every moment each env has one finished step waiting or one grant in
flight, so inference and env work for the next batch overlap the driver's
consumption of this one. With ``lookahead=False`` (on-policy) a worker waits for
the grant *before* acting, so no step is ever acted with weights older than the
request.

Waits and shutdown
------------------
Every blocking wait polls a stop flag (and the driver's :class:`Interrupter`)
every 50 ms. :meth:`MultiEnvLoop.close` sets the flag, wakes every worker,
closes the policy it created and joins every thread within ``join_timeout``.
A close cut short (a second Ctrl-C during its joins) is finished by the next
:meth:`~MultiEnvLoop.close`: each of its steps can be made again.
One collection call runs at a time: it claims the loop (:attr:`MultiEnvLoop.collecting`)
under a lock only the claim takes, so a call from a second thread, or from inside the
call (an event processor), is refused at once; a Ctrl-C anywhere leaves no claim behind.
An exception in a worker (env ``reset``/``step``, a bad observation, the policy)
is sent to the driver, which shuts everything down and raises it as
:class:`~lightning_rollout.errors.EnvError` / :class:`~lightning_rollout.errors.PolicyError`
naming the env and step, with the original exception chained and the
transitions collected so far attached as ``exc.partial``.
"""

from __future__ import annotations

import functools
import math
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, cast

import numpy as np
import torch
from tensordict import TensorDict
from torchrl.envs.utils import ExplorationType

from .._checks import check_device, check_int, check_seconds, warn_user
from .._exit import abandon, close_at_exit
from ..envs import BatchedTorchRLEnv, EnvAdapter, EnvFactory, InfoKeys, info_key_list, resolve_env_factory
from ..errors import CollectionError, EnvError, LayoutWarning, PolicyError, StepTimeoutError
from ..events import EpisodeEnd, EventProcessor, Interrupter, Progress, TimeStep
from ..policy import AutobatchPolicy, as_policy_module
from ..specs import ArraySpec, EnvKeys, NestedKey, next_key
from .auto import LayoutChoice, apply_choice, check_knobs, is_auto, layout_warning, resolve_layout
from .block import Block, EnvBlock
from .native import NativeBlock
from .buffers import (_ENV_ID, _GYM_LOOP_KEYS, _LENGTH, _RETURN, _REWARD, _TERMINATED, _TRAJ, _TRUNCATED, _VERSION,
                      BatchPool, Layout)
from .messages import (STOP, ChildReady, EpisodeReady, EpisodeRequest, Grant, Published, Reply, ResetDone,
                       ResetRequest, WorkerFailed)
from .process import WorkerProcesses, build_adapter
from .worker import Worker, WorkerContext

__all__ = ["EnvLoop", "MultiEnvLoop"]

_POLL_S = 0.05


def _driver_call(method: Callable[..., Any]) -> Callable[..., Any]:
    """A public collection call: one at a time (a second thread calling while one runs is refused at
    once with :class:`CollectionError`, nobody waits); whatever way it ends, the driver stops holding
    workers active. With ``lookahead=False`` the call pins the policy's weights
    (:meth:`AutobatchPolicy.updates_held`): a weight update made meanwhile, from any thread, applies after it."""

    @functools.wraps(method)
    def wrapper(self: MultiEnvLoop, *args: Any, **kwargs: Any) -> Any:
        claimed = False
        try:
            # The claim is _driver_thread, set under a C lock that a ``with`` enters and leaves whatever is
            # raised, and ``claimed`` is stored right after it with no signal check between the two stores:
            # a Ctrl-C at any point leaves neither the lock held nor the claim behind.
            with self._driver_lock:
                owner = self._driver_thread
                if owner is not None:
                    raise CollectionError(
                        f"{method.__name__}: the loop {self.name!r} is already collecting in thread {owner.name!r} "
                        "(or this is a call from inside its own collection, e.g. an event processor); a loop has "
                        "one driver: call it from one thread at a time")
                self._driver_thread = threading.current_thread()
                claimed = True
            if self.lookahead:
                return method(self, *args, **kwargs)
            with self.policy.updates_held():  # on-policy: an update made during the call applies after it
                return method(self, *args, **kwargs)
        finally:
            if claimed:
                try:
                    self._release_all_holds()
                finally:
                    self._driver_thread = None

    return wrapper


class MultiEnvLoop:
    """N envs in threads, one autobatched policy, request-driven collection.

    The seed's ``MultiAgentEnvLoop``. Envs are created in the constructor (so a
    bad id or space fails here), then each env thread resets its envs and, in
    lookahead mode, computes its first step right away.

    Args:
        env: a gymnasium id, a factory returning a ``gymnasium.Env`` or a torchrl
            ``EnvBase``, or a list of ``num_envs`` such factories.
        policy: an :class:`AutobatchPolicy` (shared; then ``autobatch_size``,
            ``max_wait``, ``device`` and ``policy_timeout`` must be left unset), or anything TorchRL's
            collectors accept: a ``TensorDictModule``, a function of a TensorDict,
            an ``nn.Module`` / function whose arguments are named after observation
            keys (see :func:`~lightning_rollout.policy.as_policy_module`), or
            ``None`` for TorchRL's ``RandomPolicy`` over the env's action spec. It
            is wrapped in an ``AutobatchPolicy`` owned and closed by this loop.
            Each step it gets a TensorDict of batch ``[k]`` (``k`` envs) holding
            every root entry of those envs, including what it wrote under
            ``"next"`` at their previous step (recurrent state, zero at each
            episode start) and what it wrote at the root besides the action.

    Keyword Args:
        num_envs: number of envs (``>= 1``); inferred from a list of factories.
        envs_per_thread: envs stepped together by one thread (divides ``num_envs``).
            1 is the seed's design; more threads only pay when env steps release
            the GIL, so cheap Python envs run faster with several envs a thread.
            ``"auto"``: chosen with ``num_workers`` from a few timed steps of one
            env (:mod:`lightning_rollout.loop.auto`; logged at INFO, kept in
            ``layout_choice``).
        num_workers: processes stepping the envs (:mod:`lightning_rollout.loop.process`). With
            one env thread (``envs_per_thread=num_envs``) this process is one of them: the thread
            sends ``num_workers - 1`` worker processes their share of each step, steps the first
            share itself, and gathers their replies. With several env threads, ``num_workers``
            worker processes run every env: each its share of whole blocks of ``envs_per_thread``
            envs, or, with fewer blocks than processes, a part of every block, stepped in
            parallel. 1: every env in threads of this process. Needs picklable env factories.
            ``"auto"``: see ``envs_per_thread``.
        parallel_steps: True: the envs of each thread's block step concurrently, each
            ``env.step`` in its own helper thread (``lightning_rollout-<name>-env<i>-step``),
            while the block's bookkeeping and policy call stay once per step in its
            thread: for envs whose step releases the GIL (C simulators, sleeps, I/O).
            Resets run in the block's thread. Not with worker processes. ``"free"``: the
            same, and within a grant (:meth:`run_env_steps`, and :meth:`run_steps` with one
            env thread) each env runs at its own pace (its next step starts as soon as its
            last one ended and the policy answered it; the
            policy is still called on the whole block), for envs whose step times vary
            (stragglers); how many policy calls a batch takes then depends on timing, so
            a stochastic policy's draws are not reproducible from run to run. ``"auto"``
            (default): what the ``"auto"`` layout chose (True for GIL-releasing envs),
            False when the layout is given. Helpers whose first 64 steps spend less than
            half their time on a CPU (waits) are placed: on one core, with the block's
            thread when its torch runs one intra-op thread, if they need less than a core
            in all; else off the highest core this process may use, left to the block's
            thread (logged at INFO; see :mod:`lightning_rollout.loop.block`).
        autobatch_size, max_wait, device: see :class:`AutobatchPolicy`.
        exploration_type: exploration mode of every request (``DETERMINISTIC``
            for evaluation loops).
        lookahead: True (default): envs stay one step ahead (double batching);
            after a weight update each env may deliver one step acted with the
            previous weights. False: on-policy, every step waits for its request.
        eval: an evaluation loop: events go to the ``on_eval_*`` methods.
        max_episode_steps: truncate episodes at this length (``None``: the env's own limit).
        seed: env ``i`` is seeded with ``seed + i`` on its first reset, and the policy this loop
            wraps samples from its own random stream seeded with ``seed``; ``None``: unseeded. A
            sequence: env ``i``'s own seed (the policy's stream seeded with the first).
        random_steps_per_env: the first steps of each env are acted by a random
            policy (the env's action space), with ``policy_version == -1``.
        step_timeout: seconds; an env ``reset``/``step`` that takes longer raises
            :class:`~lightning_rollout.errors.StepTimeoutError`. ``None``: no limit.
        policy_timeout: seconds one call of the policy (a batched forward pass, or
            the probe at construction) may take; a call that takes longer raises
            :class:`~lightning_rollout.errors.PolicyError` naming its envs and the
            step, and the inference thread stuck in it is abandoned. ``None``
            (default): no limit. See :class:`AutobatchPolicy`.
        validate: check every observation's shape, dtype and NaNs (about 0.1 us a step on CartPole, 2.6 us a
            reset; ``docs/tuning.rst``).
        info_keys: entries of a gymnasium env's ``info`` read into batches as observation
            entries (root and ``("next", ...)``): a list of keys (specs inferred from the first
            reset's ``info``) or ``{key: TorchRL spec}``; see :class:`~lightning_rollout.envs.GymAdapter`.
            A TorchRL env reads its info with its own ``set_info_dict_reader``; a list names
            those entries. Each :class:`~lightning_rollout.events.EpisodeEnd` carries their
            values at the episode's last step in ``info``.
        processor: default :class:`EventProcessor` for every call.
        interrupter: default :class:`Interrupter` for every call.
        traj_id_start: first trajectory id (to continue counts after a resume).
        env_shape: the batch dims of the batched env the envs were taken from (their product is
            ``num_envs``): the policy is called in that shape on a flush of every env's rows, as
            TorchRL's collector calls it on that env. Default: unbatched for one env, ``[rows]``.
        name: used in thread names.
        join_timeout: seconds :meth:`close` waits for each thread (finite).
        start: start the env threads now; ``False`` defers it to :meth:`start` or
            the first ``run_*`` call (so ``seed`` and ``traj_id_start`` can still change).

    Raises:
        ValueError: bad configuration, with what to change.

    Warns:
        LayoutWarning: worker processes driven by several env threads, a layout likely to run well
            below ``"auto"`` (:func:`~lightning_rollout.loop.auto.layout_warning` says why and what to pass).

    Threading: one driver thread at a time; :meth:`close` may be called from
    any thread (it only sets flags and joins).
    """

    def __init__(
        self,
        env: str | EnvFactory | Sequence[EnvFactory],
        policy: AutobatchPolicy | Callable[..., Any] | None,
        *,
        num_envs: int | None = None,
        envs_per_thread: int | str = 1,
        num_workers: int | str = 1,
        parallel_steps: bool | Literal["auto", "free"] = "auto",
        autobatch_size: int | None = None,
        max_wait: float | None = None,
        device: torch.device | str | None = None,
        exploration_type: ExplorationType = ExplorationType.RANDOM,
        lookahead: bool = True,
        eval: bool = False,
        max_episode_steps: int | None = None,
        seed: int | Sequence[int] | None = None,
        random_steps_per_env: int = 0,
        step_timeout: float | None = None,
        policy_timeout: float | None = None,
        validate: bool = True,
        info_keys: InfoKeys | None = None,
        processor: EventProcessor | None = None,
        interrupter: Interrupter | None = None,
        traj_id_start: int = 0,
        env_shape: Sequence[int] | None = None,
        name: str = "loop",
        join_timeout: float = 5.0,
        start: bool = True,
    ) -> None:
        factories = self._factories(env, num_envs)
        num_envs = len(factories)
        join_timeout = _check_loop_arguments(
            num_envs=num_envs, envs_per_thread=envs_per_thread, num_workers=num_workers,
            max_episode_steps=max_episode_steps, random_steps_per_env=random_steps_per_env, step_timeout=step_timeout,
            join_timeout=join_timeout, max_wait=max_wait, policy_timeout=policy_timeout, device=device,
            traj_id_start=traj_id_start, env_shape=env_shape, seed=seed, exploration_type=exploration_type,
            processor=processor, interrupter=interrupter, policy=policy, autobatch_size=autobatch_size)
        self._env_shape = tuple(env_shape) if env_shape is not None else (() if num_envs == 1 else None)
        self.layout_choice: LayoutChoice | None = resolve_layout(
            factories[0], num_envs, num_workers=num_workers, envs_per_thread=envs_per_thread,
            max_episode_steps=max_episode_steps, step_timeout=step_timeout, name=name)
        num_workers, envs_per_thread, parallel_steps = apply_choice(
            self.layout_choice, num_workers=num_workers, envs_per_thread=envs_per_thread, parallel_steps=parallel_steps)
        if not (isinstance(parallel_steps, bool) or parallel_steps == "free"):
            raise ValueError(f"parallel_steps must be True, False, 'free' or 'auto', got {parallel_steps!r}")
        if parallel_steps and num_workers > 1:
            raise ValueError(f"parallel_steps={parallel_steps!r} steps envs in helper threads of this process; worker "
                             "processes (num_workers > 1) step theirs one after the other: pass one or the other")
        slow = layout_warning(num_envs, envs_per_thread, num_workers)
        if slow is not None:
            warn_user(LayoutWarning(f"{name}: {slow}"))
        self.parallel_steps: bool = bool(parallel_steps)
        self.free_steps: bool = parallel_steps == "free"  # envs of a block run free within a grant
        self.num_envs = num_envs
        self.envs_per_thread = envs_per_thread
        self.num_workers = num_workers
        self._torch_threads = torch.get_num_threads()  # carried into every thread that may run the policy
        self.exploration_type = exploration_type
        self.lookahead = lookahead
        self.eval = eval
        self.max_episode_steps = max_episode_steps
        self.seed = seed
        self.step_timeout = step_timeout
        self.validate = validate
        self.info_keys = info_key_list(info_keys)
        self._info_next = {next_key(k) for k in self.info_keys}  # columns EpisodeEnd.info is read from
        self.processor = processor
        self.interrupter = interrupter
        self.name = name
        self.join_timeout = join_timeout
        self._random_steps_per_env = random_steps_per_env
        # Trajectory ids are assigned by the driver, in delivery order: env i starts with traj_id_start + i.
        self._cur_traj = np.arange(traj_id_start, traj_id_start + num_envs, dtype=np.int64)
        self._next_traj = traj_id_start + num_envs
        self._stop = threading.Event()
        self._driver_lock = threading.Lock()  # guards the claim of _driver_thread (see _driver_call)
        self._driver_thread: threading.Thread | None = None  # the thread inside a run_* / reset_envs call
        self._cut = threading.Event()  # set by the driver: workers end their grant after the current step
        self._closed = False  # close() was called: no collection call starts
        self._shut = False  # close() ran to its end: a later call has nothing left to do
        self._ready: queue.SimpleQueue[Reply] = queue.SimpleQueue()
        self.frames = 0
        self.episodes = 0

        adapters: list[EnvAdapter] = []
        self._pool: WorkerProcesses | None = None
        self._owns_policy = False
        first_roots: dict[int, tuple[int | None, dict[NestedKey, Any]]] = {}  # env -> (seed, root) of the probe
        seeds = list(seed) if isinstance(seed, Sequence) else [None if seed is None else seed + i
                                                                for i in range(num_envs)]
        try:
            if num_workers > 1:  # envs in worker processes: they build, reset and describe them
                self._pool = WorkerProcesses(
                    factories, num_workers, envs_per_thread, seeds=seeds, max_episode_steps=max_episode_steps,
                    validate=validate, info_keys=info_keys, name=name, on_error=_creation_error)
                first: ChildReady | EnvAdapter = self._pool.first
                roots = self._pool.first_roots
            else:
                self._build_envs(factories, adapters, max_episode_steps=max_episode_steps, info_keys=info_keys)
                first, roots = adapters[0], self._first_resets(adapters, seeds)
            keys, observation_spec, action_spec, loop_keys = (first.keys, first.observation_spec, first.action_spec,
                                                              first.loop_keys)
            for i, root in enumerate(roots):
                first_roots[i] = (seeds[i], root)
            if isinstance(policy, AutobatchPolicy):
                self.policy = policy
            else:
                self.policy = self._serve_policy(policy, keys, observation_spec, action_spec,
                                                 autobatch_size=autobatch_size, max_wait=max_wait, device=device,
                                                 policy_timeout=policy_timeout)
                self._owns_policy = True
            self._layout = self._probe_layout(keys, roots, loop_keys)
            self._batches = BatchPool(self._layout)  # the driver's calls' batch columns, recycled
            g = envs_per_thread
            context = self._worker_context(num_envs // g)
            ids = [list(range(w * g, (w + 1) * g)) for w in range(num_envs // g)]
            firsts = [{i: first_roots[i] for i in env_ids if i in first_roots} for env_ids in ids]
            blocks = self._blocks(adapters, ids)
            self._workers = [Worker(context, w, ids[w], block=block, first_roots=firsts[w])
                             for w, block in enumerate(blocks)]
        except BaseException:
            for a in adapters:
                a.close()
            if self._pool is not None:
                self._pool.close(self.join_timeout)
            if self._owns_policy:
                self.policy.close()
            raise
        # Driver-side bookkeeping (driver thread only), per worker: its steps 0 to consumed - 1 and ``taken`` rows
        # of step ``consumed`` were copied out, 0 to published - 1 are in its storage, granted up to ``granted``;
        # ``outstanding`` grants await their answer.
        W = len(self._workers)
        self._consumed, self._taken, self._published, self._granted = [0] * W, [0] * W, [0] * W, [0] * W
        self._outstanding = [0] * W
        self._env_ids = [np.asarray(w.env_ids, dtype=np.int64) for w in self._workers]
        self._env_id_column = np.arange(num_envs, dtype=np.int64)[:, None]  # an env_time batch's env ids
        self._idle: deque[int] = deque(range(W))
        self._deferred: list[tuple[int, Grant]] | None = None
        self._episode_requests = 0  # episode requests sent, over the loop's life: the next one's index
        self._stale_episodes = 0  # episodes of requests numbered below it answer a call that has returned
        self._answered_since_wait: list[int] = []  # answered workers not yet released (driver only)
        self._started = False
        if start:
            self.start()

    def _build_envs(self, factories: Sequence[EnvFactory], adapters: list[EnvAdapter], *,
                    max_episode_steps: int | None, info_keys: InfoKeys | None) -> None:
        """Build the envs of this process into ``adapters`` (a refused env is closed; those built before it are
        the caller's to close): one adapter an env, or, when the factory makes a natively batched env of ``B``
        envs, one batched env for every ``B`` envs (each an env thread's block).

        Raises:
            ValueError: envs whose keys, shapes, dtypes or batch size differ from the first's; a batched env whose
                batch does not fit the layout (``num_envs`` a multiple of it, ``envs_per_thread`` equal to it).
        """
        build = functools.partial(build_adapter, max_episode_steps=max_episode_steps, validate=self.validate,
                                  info_keys=info_keys)
        adapters.append(build(factories[0]))
        batch = adapters[0].rows
        if adapters[0].batched:
            if self.num_envs % batch or self.envs_per_thread != batch:
                raise ValueError(
                    f"the env factory makes a natively batched env of {batch} envs, stepped in one call by one env "
                    f"thread: num_envs ({self.num_envs}) must be a multiple of {batch} and envs_per_thread "
                    f"({self.envs_per_thread}) equal to it; pass envs_per_thread={batch}")
            if self.parallel_steps:
                raise ValueError(f"parallel_steps={self.parallel_steps!r} steps each env in a helper thread; a natively "
                                 "batched env steps its envs in one call: leave parallel_steps out")
        for factory in factories[batch::batch]:
            adapters.append(build(factory))
        keys = adapters[0].keys
        for i, a in enumerate(adapters[1:], 1):
            if not a.keys.same_layout(keys) or a.rows != batch:
                raise ValueError(f"env {i * batch} has specs {a.keys} (a batch of {a.rows}), env 0 has {keys} (a batch "
                                 f"of {batch}); all envs of a loop must share their keys, shapes and dtypes")

    def _serve_policy(self, policy: Callable[..., Any] | None, keys: EnvKeys, observation_spec: Any, action_spec: Any,
                      *, autobatch_size: int | None, max_wait: float | None, device: torch.device | str | None,
                      policy_timeout: float | None) -> AutobatchPolicy:
        """The loop's own :class:`AutobatchPolicy` serving ``policy`` (``None``: TorchRL's ``RandomPolicy``,
        uniformly random valid actions), wrapped as a TensorDict module for the env's keys."""
        if policy is None:
            from torchrl.envs.utils import RandomPolicy

            policy = RandomPolicy()
        data_keys = [k for k in keys.observation if k not in _GYM_LOOP_KEYS and k not in self.info_keys]
        module = as_policy_module(policy, observation_spec=observation_spec, action_keys=list(keys.action),
                                  policy_timeout=policy_timeout, name=self.name, action_spec=action_spec,
                                  single_key=data_keys[0] if len(data_keys) == 1 else None)
        return AutobatchPolicy(module, autobatch_size=autobatch_size, max_wait=max_wait, device=device,
                               name=self.name, seed=self.seed[0] if isinstance(self.seed, Sequence) else self.seed,
                               policy_timeout=policy_timeout)

    @staticmethod
    def _first_resets(adapters: Sequence[EnvAdapter | BatchedTorchRLEnv], seeds: Sequence[int | None]
                      ) -> list[dict[NestedKey, Any]]:
        """Every env's first root entries (reset with its seed; a batched env with its first env's)."""
        roots: list[dict[NestedKey, Any]] = []
        for adapter in adapters:
            i = len(roots)
            try:
                if adapter.batched:
                    batch = cast(BatchedTorchRLEnv, adapter).reset_all(seeds[i])
                    roots += [{k: v[r] for k, v in batch.items()} for r in range(adapter.rows)]
                else:
                    roots.append(adapter.reset(seeds[i]))
            except Exception as exc:
                raise _creation_error(i, "reset", exc) from exc
        return roots

    def _probe_layout(self, keys: EnvKeys, roots: list[dict[NestedKey, Any]], loop_keys: bool) -> Layout:
        """Run the policy once on every env's first root entries (the envs were reset at construction, as
        TorchRL's collector resets them), all envs in one batch; lay out the columns from what it writes. The
        resets are kept: each env thread starts from its env's, unless the env is reseeded before it starts."""
        probe = {k: np.stack([np.asarray(r[k], dtype=spec.dtype).reshape(spec.shape) for r in roots])
                 for k, spec in keys.root.items()}
        probe.update({k: np.zeros((len(roots), *spec.shape), spec.dtype) for k, spec in keys.done.items()})
        if self._owns_policy:
            self.policy.env_shape = self._env_shape
        out = self.policy.probe(probe, rows=len(roots))
        outputs = {k: ArraySpec(shape, np.dtype(dtype)) for k, (shape, dtype) in out.items()}
        missing = [k for k in keys.action if k not in outputs]
        if missing:
            raise PolicyError(f"the policy wrote no {missing[0]!r} (the env's action key{'s' if len(keys.action) > 1 else ''}"
                              f": {list(keys.action)}); it wrote {list(outputs)}")
        layout = Layout(keys, outputs, loop_keys=loop_keys)
        self._input_keys = self.policy.bind(layout.carried | {k: keys.done[k] for k in layout.done_keys},
                                            sub_batch=keys.sub_batch)
        self._input_cols = [k for k in self._input_keys if k in layout.specs]
        self._input_done = [k for k in self._input_keys if k not in layout.specs]  # root done flags
        self._action_columns = {k: layout.specs[k] for k in keys.action}
        env_inputs = (layout.action_keys if loop_keys else list(dict.fromkeys([*layout.root_inputs, *layout.out_keys])))
        self._env_inputs = [k for k in env_inputs if k in layout.specs]
        self._env_input_done = [k for k in env_inputs if k not in layout.specs]
        return layout

    def _worker_context(self, blocks: int) -> WorkerContext:
        """What each env thread reads from this loop (fixed from here on)."""
        return WorkerContext(
            name=self.name, layout=self._layout, policy=self.policy, ready=self._ready, stop=self._stop, cut=self._cut,
            input_cols=tuple(self._input_cols), input_done=tuple(self._input_done),
            env_inputs=tuple(self._env_inputs),
            action_columns=self._action_columns, exploration_type=self.exploration_type, lookahead=self.lookahead,
            validate=self.validate, free_steps=self.free_steps, max_episode_steps=self.max_episode_steps,
            random_steps_per_env=self._random_steps_per_env, torch_threads=self._torch_threads, blocks=blocks)

    def _blocks(self, adapters: list[EnvAdapter], ids: list[list[int]]) -> list[Block]:
        """Each env thread's block: its envs in this process (an :class:`EnvBlock`, stepped in the thread or its
        helper threads; a :class:`NativeBlock` for a natively batched env), or in the worker processes (their
        shared buffers attached here). The one place that knows the kinds of block."""
        layout, validate = self._layout, self.validate
        checked_next = layout.checked_next if validate else {}
        checked_root = layout.checked_root if validate else {}
        zero_done = {k: layout.keys.done[k] for k in self._env_input_done}
        if self._pool is not None:
            self._pool.attach(layout.specs, inputs=self._env_inputs, nxt=layout.env_next, checked_next=checked_next,
                              checked_root=checked_root, zero_done=zero_done)
            return list(self._pool.groups)
        if adapters[0].batched:  # natively batched envs: one a block
            return [NativeBlock(cast(BatchedTorchRLEnv, env), validate=validate, checked_next=checked_next,
                                checked_root=checked_root, watched=self.step_timeout is not None) for env in adapters]
        g = self.envs_per_thread
        return [EnvBlock(adapters[w * g:(w + 1) * g], validate=validate, checked_next=checked_next,
                         checked_root=checked_root, zero_done=zero_done, parallel=self.parallel_steps, name=self.name,
                         env_ids=env_ids, watched=self.step_timeout is not None)
                for w, env_ids in enumerate(ids)]

    def start(self) -> None:
        """Start the env threads (done by the first ``run_*`` call when ``start=False``). Idempotent."""
        if self._closed:
            raise CollectionError(f"the loop {self.name!r} is closed")
        if not self._started:
            self._started = True
            close_at_exit(self)  # threads stopped and joined before the interpreter finalizes
            for worker in self._workers:
                worker.start(_EnvSeeds(self.seed) if isinstance(self.seed, Sequence) else self.seed)

    # -- construction helpers ------------------------------------------------------------
    @staticmethod
    def _factories(env: Any, num_envs: int | None) -> list[EnvFactory]:
        if isinstance(env, (list, tuple)):
            if not env:
                raise ValueError("the list of env factories is empty; pass at least one")
            if num_envs is not None and num_envs != len(env):
                raise ValueError(f"num_envs={num_envs} but {len(env)} env factories were given; drop num_envs")
            return [resolve_env_factory(e) for e in env]
        n = 1 if num_envs is None else num_envs
        check_int("num_envs", n, 1)
        factory = resolve_env_factory(env)
        return [factory] * n

    # -- public properties -----------------------------------------------------------------
    @property
    def env_keys(self) -> EnvKeys:
        """Every leaf the envs read and write, from their TorchRL specs."""
        return self._layout.keys

    @property
    def observation_keys(self) -> list[NestedKey]:
        """The observation entries each env fills (``["observation", "is_init", ...]`` for most gymnasium envs)."""
        return list(self._layout.keys.observation)

    @property
    def input_keys(self) -> list[NestedKey]:
        """The root entries handed to the policy at each step."""
        return list(self._input_keys)

    @property
    def action_spec(self) -> ArraySpec:
        """Shape and dtype of one row of the policy's first action entry (as stored)."""
        return next(iter(self._action_columns.values()))

    @property
    def collecting(self) -> bool:
        """Whether a collection call (``run_*``, ``reset_envs``) is running, in any thread."""
        return self._driver_thread is not None

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called (or a worker failure closed the loop)."""
        return self._closed

    @property
    def next_traj_id(self) -> int:
        """The id the next new trajectory will get."""
        return self._next_traj

    # -- policy ------------------------------------------------------------------------------
    def update_policy(self, state: Any) -> int:
        """Load new weights (a state_dict or a module); returns the new policy version."""
        return self.policy.update(state)

    def policy_state(self) -> Any:
        """A copy of the current weights."""
        return self.policy.state()

    @property
    def policy_version(self) -> int:
        """Version of the weights the next policy call will use."""
        return self.policy.version

    # -- driver side -----------------------------------------------------------------------------
    def set_traj_id_start(self, value: int) -> None:
        """Continue trajectory ids from ``value`` (before the threads start, e.g. on resume)."""
        if self._started:
            raise CollectionError("set_traj_id_start must be called before the loop starts")
        check_int("traj_id_start", value, 0)
        self._cur_traj = np.arange(value, value + self.num_envs, dtype=np.int64)
        self._next_traj = value + self.num_envs

    def _assign_traj(self, env_ids: np.ndarray, done: np.ndarray) -> np.ndarray:
        """Trajectory ids of rows delivered in this order (driver only), as TorchRL's collector assigns
        them: an env keeps its id until a done row; ids of new trajectories are handed out in delivery
        order (time, then env), so they do not depend on thread timing. Vectorised over the rows (a
        loop over envs cost ~8 us an env a batch)."""
        n = len(env_ids)
        if n == 0:
            return np.empty(0, dtype=np.int64)
        done = done.astype(np.int64)
        new_ids = np.empty(n, dtype=np.int64)  # per done row (by delivery position): its new trajectory's id
        new_ids[done > 0] = self._next_traj + np.arange(int(done.sum()), dtype=np.int64)
        order = np.argsort(env_ids, kind="stable")  # rows env by env, each env's in delivery order
        env, d = env_ids[order], done[order]
        starts = np.flatnonzero(np.r_[True, env[1:] != env[:-1]])  # first sorted row of each env
        group = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, n]))
        before = np.cumsum(d) - d  # done rows before each sorted row
        k = before - before[starts][group]  # ... of the same env: the row is in its env's k-th new trajectory
        done_pos = np.flatnonzero(d)  # sorted positions of the done rows
        traj_sorted = self._cur_traj[env]
        later = k > 0
        traj_sorted[later] = new_ids[order[done_pos[before[later] - 1]]]
        traj = np.empty(n, dtype=np.int64)
        traj[order] = traj_sorted
        # An env whose rows include a done one continues in the trajectory its last done row started.
        last = np.r_[starts[1:], n] - 1
        total = k[last] + d[last]
        ended = total > 0
        self._cur_traj[env[starts][ended]] = new_ids[order[done_pos[before[last][ended] + d[last][ended] - 1]]]
        self._next_traj += int(done.sum())
        return traj

    def _assign_traj_env_time(self, done: np.ndarray) -> np.ndarray:
        """:meth:`_assign_traj` for a batch of every env's next ``T`` steps (``done``: ``[num_envs, T]``, env
        ``i``'s steps in row ``i``) delivered in time order, env by env within a step: the done steps' new ids
        are handed out in that order, and a step is in the trajectory its env's last done step before it
        started, else in the env's current one (ids grow with time: a running maximum finds the last).
        Returns the ``[num_envs, T]`` ids."""
        by_time = done.T  # [T, num_envs], delivery order
        if not len(by_time):
            return np.empty(done.shape, dtype=np.int64)
        count = int(np.count_nonzero(by_time))
        new = np.full(by_time.shape, -1, dtype=np.int64)  # the id of the trajectory each done step starts
        new[by_time] = self._next_traj + np.arange(count, dtype=np.int64)
        traj = np.empty(by_time.shape, dtype=np.int64)
        traj[0] = self._cur_traj
        started = np.maximum.accumulate(new[:-1], axis=0)  # the id the last done step before each step started
        traj[1:] = np.where(started >= 0, started, self._cur_traj)
        last = np.maximum.reduce(new, axis=0)
        self._cur_traj = np.where(last >= 0, last, self._cur_traj)
        self._next_traj += count
        return traj.T

    def _new_trajectory(self, env_id: int) -> int:
        """Env ``env_id`` starts a new trajectory now (an explicit reset); returns its id."""
        self._cur_traj[env_id] = self._next_traj
        self._next_traj += 1
        return int(self._cur_traj[env_id])

    @_driver_call
    def reset_envs(self, env_ids: Sequence[int] | None = None, *, seeds: Sequence[int | None] | None = None) -> None:
        """Start a new episode now on the given envs (all by default), optionally reseeding them.

        An env's last step not handed out yet (the step written ahead, or one left by an interrupted
        call) is kept and delivered by the next call, marked ``truncated`` (its episode was cut here).
        Blocks until every asked env was reset.

        Raises:
            ValueError: an env id out of range, or ``seeds`` of the wrong length.
            EnvError: a reset failed (the loop is closed).
        """
        self.start()
        ids = list(range(self.num_envs)) if env_ids is None else [int(i) for i in env_ids]
        for i in ids:
            if not 0 <= i < self.num_envs:
                raise ValueError(f"env id {i} out of range: the loop has {self.num_envs} envs")
        if seeds is not None and len(seeds) != len(ids):
            raise ValueError(f"got {len(seeds)} seeds for {len(ids)} envs")
        per_worker: dict[int, list[tuple[int, int | None]]] = {}
        for n, i in enumerate(ids):
            per_worker.setdefault(i // self.envs_per_thread, []).append((i, None if seeds is None else seeds[n]))
        for w, items in per_worker.items():
            self._workers[w].requests.put(ResetRequest(items, self._consumed[w], self._taken[w]))
        waiting = set(per_worker)
        fresh: set[int] = set()  # envs with no undelivered step to end their trajectory: new id now
        try:
            while waiting:
                msg = self._wait(None)
                assert msg is not None
                if isinstance(msg, ResetDone):
                    waiting.discard(msg.worker)
                    fresh.update(msg.fresh)
        except CollectionError as exc:
            self._fail(exc, None)
        except BaseException:  # KeyboardInterrupt, a processor's error: the call cannot be resumed
            self.close()
            raise
        for i in sorted(fresh):
            self._new_trajectory(i)

    # -- requests and replies ------------------------------------------------------------------------
    def _grant(self, w: int, end: int) -> None:
        """Let worker ``w`` hand out its steps up to ``end``, holding it active until it answers."""
        worker = self._workers[w]
        capacity = max(worker.steps.capacity, end + 2 - self._consumed[w])  # the steps and the next root entries
        if w in self._idle:
            self._idle.remove(w)
        self._outstanding[w] += 1
        self._granted[w] = max(self._granted[w], end)
        worker.set_held(True)
        message = Grant(end, self._consumed[w], self._taken[w], capacity)
        if self._deferred is not None:  # a burst: every worker is held before any is woken
            self._deferred.append((w, message))
        else:
            worker.requests.put(message)

    def _send_deferred(self) -> None:
        deferred, self._deferred = self._deferred or [], None
        for w, message in deferred:
            self._workers[w].requests.put(message)

    def _release_holds(self) -> None:
        """Stop holding workers whose answer was consumed and that were not granted again."""
        answered, self._answered_since_wait = self._answered_since_wait, []
        for w in answered:
            worker = self._workers[w]
            if worker.held and not self._outstanding[w]:
                worker.set_held(False)

    def _release_all_holds(self) -> None:
        """The driver leaves: hold nobody (a worker still granted counts itself while it works)."""
        self._deferred = None
        self._answered_since_wait = []
        for worker in self._workers:
            if worker.held:
                worker.set_held(False)

    def _wait(self, interrupter: Interrupter | None) -> Reply | None:
        """Next message from a worker (a :class:`~.messages.Published` booked already); None when interrupted.
        Raises worker errors."""
        self._release_holds()
        while True:
            try:
                msg = self._ready.get(timeout=_POLL_S)
            except queue.Empty:
                if interrupter is not None and interrupter.should_stop():
                    return None
                if self._stop.is_set():
                    raise CollectionError(f"the loop {self.name!r} was closed while collecting")
                self._check_timeouts()
                continue
            if isinstance(msg, WorkerFailed):
                raise msg.error
            if isinstance(msg, EpisodeReady) and msg.request_index < self._stale_episodes:
                # An interrupted run_episodes' episode, which nobody waits for: dropped, but as when it is
                # delivered, an env whose running trajectory no undelivered step ended starts a new one.
                if msg.fresh:
                    self._new_trajectory(msg.env_id)
                continue
            if interrupter is not None and interrupter.should_stop():
                self._ready.put(msg)  # keep it for the next call
                return None
            if isinstance(msg, Published):  # answered: released at the next wait unless granted again
                w = msg.worker
                self._published[w] = max(self._published[w], msg.end)
                self._outstanding[w] -= 1
                self._answered_since_wait.append(w)
            return msg

    def _check_timeouts(self) -> None:
        if self.step_timeout is None:
            return
        now = time.perf_counter()
        for worker in self._workers:
            since = worker.envs.busy_since
            if since and now - since > self.step_timeout:
                j, phase = worker.envs.busy_env, worker.envs.busy_phase
                worker.abandoned = True  # close() does not wait for it
                raise StepTimeoutError(
                    f"no answer within step_timeout={self.step_timeout} s; thread {worker.thread.name!r} is "
                    f"stuck inside the env's {phase} and is abandoned (daemon)",
                    env_id=worker.env_ids[j], step=worker.step_index(j), phase=phase)

    def _fail(self, exc: BaseException, partial: TensorDict | None) -> None:
        if isinstance(exc, CollectionError) and partial is not None and partial.batch_size.numel():
            exc.partial = partial
        self.close()
        raise exc

    def _keep_settled(self) -> None:
        """After a failure (the loop closed): every worker's settled, granted steps count as published, those of
        a worker still answering a grant settled by this thread (``Worker.settle``: a hung one, or one that
        the failure stopped before it read its grant)."""
        for w, worker in enumerate(self._workers):
            if self._outstanding[w]:
                worker.settle(self._granted[w])
            self._published[w] = max(self._published[w], worker.published)

    # -- copying steps out ---------------------------------------------------------------------------
    def _take(self, out: dict[NestedKey, np.ndarray], filled: int, n: int, w: int,
              processor: EventProcessor | None) -> int:
        """Copy worker ``w``'s published steps not handed out yet into ``out[filled:]`` (flat, in time order,
        env by env within a step), up to ``n`` rows; a step copied in part is finished by the next take. The rows
        copied are counted and their training events go to ``processor`` (:meth:`_count`)."""
        steps, g = self._workers[w].steps, self.envs_per_thread
        env_ids, first = self._env_ids[w], filled
        while filled < n and self._consumed[w] < self._published[w]:
            t, r0 = self._consumed[w], self._taken[w]
            k = min(g - r0, n - filled)
            steps.copy_rows(t, r0, r0 + k, out, filled)
            out[_ENV_ID][filled:filled + k] = env_ids[r0:r0 + k]
            filled += k
            if r0 + k == g:
                self._consumed[w], self._taken[w] = t + 1, 0
            else:
                self._taken[w] = r0 + k
        self._count(out, range(first, filled), processor)
        return filled

    def _take_rounds(self, out: dict[NestedKey, np.ndarray], filled: int, w: int, steps_: int,
                     processor: EventProcessor | None) -> int:
        """Copy worker ``w``'s next ``steps_`` published steps (whole ones) into ``out[filled:]``, flat, counted
        as :meth:`_take` counts them."""
        g, steps = self.envs_per_thread, self._workers[w].steps
        t = self._consumed[w]
        rows = {k: v for k, v in out.items() if k != _ENV_ID and k != _TRAJ}
        steps.copy_out(t, t + steps_, rows, env_major=False, offset=filled)
        end = filled + steps_ * g
        out[_ENV_ID][filled:end] = np.tile(self._env_ids[w], steps_)
        self._consumed[w] = t + steps_
        self._count(out, range(filled, end), processor)
        return end

    def _count(self, cols: dict[NestedKey, np.ndarray], rows: range, processor: EventProcessor | None = None
               ) -> None:
        """Count delivered frames and episodes of ``rows`` (their training events went to ``processor``)."""
        if not len(rows):
            return
        first_frame = self.frames + 1
        self.frames += len(rows)
        if processor is not None:
            self._emit(cols, rows, processor, self.eval, -1, first_frame)
        self.episodes += int(np.count_nonzero(cols[_TERMINATED][rows] | cols[_TRUNCATED][rows]))

    def _emit(self, cols: dict[NestedKey, np.ndarray], rows: range, processor: EventProcessor,
              eval_: bool, total: int, first_frame: int) -> None:
        """Events for rows ``rows`` of ``cols`` (driver thread); row ``rows[i]`` is frame ``first_frame + i``."""
        wants_steps = processor.wants_timesteps
        terminated, truncated = cols[_TERMINATED][rows], cols[_TRUNCATED][rows]
        done = terminated | truncated
        if not wants_steps and not done.any():
            return
        on_step = processor.on_eval_timestep if eval_ else processor.on_timestep
        on_end = processor.on_eval_episode_end if eval_ else processor.on_episode_end
        extras = [k for k in self._layout.out_keys if k != "action"]
        positions = range(len(rows)) if wants_steps else np.flatnonzero(done)
        env_id, version, length, ret = cols[_ENV_ID], cols[_VERSION], cols[_LENGTH], cols[_RETURN]
        for i in positions:
            i = int(i)
            r = rows[i]
            progress = Progress(first_frame + i, total)
            if wants_steps:
                on_step(TimeStep(env_id=int(env_id[r]), reward=float(cols[_REWARD][r]), step_count=int(length[r]),
                                 episode_reward=float(ret[r]), terminated=bool(terminated[i]),
                                 truncated=bool(truncated[i]), policy_version=int(version[r]), progress=progress,
                                 context={k: cols[k][r] for k in extras}, eval=eval_))
            if done[i]:
                on_end(EpisodeEnd(env_id=int(env_id[r]), length=int(length[r]), reward=float(ret[r]),
                                  terminated=bool(terminated[i]), truncated=bool(truncated[i]),
                                  policy_version=int(version[r]), progress=progress, eval=eval_,
                                  info={k: np.array(cols[next_key(k)][r]) for k in self.info_keys}))

    def _finish_flat(self, out: dict[NestedKey, np.ndarray], filled: int) -> TensorDict:
        if filled < len(out[_VERSION]):
            out = {k: v[:filled] for k, v in out.items()}
        out[_TRAJ][:] = self._assign_traj(out[_ENV_ID], out[_TERMINATED] | out[_TRUNCATED])
        return self._layout.to_tensordict(out, [filled])

    # -- collection calls ----------------------------------------------------------------------------
    @_driver_call
    def run_steps(self, n: int, *, processor: EventProcessor | None = None,
                  interrupter: Interrupter | None = None) -> TensorDict:
        """Collect exactly ``n`` transitions (fewer only if interrupted), in arrival order.

        Each env's own transitions keep their order; envs are served fairly. With one
        env thread (``envs_per_thread == num_envs``, what the ``"auto"`` layouts
        choose) arrival order is time order, env by env within a step, and the
        thread is granted the call's whole rounds at once (as :meth:`run_env_steps`
        does), with no hand-off to this thread per step; the rows of a last, partial
        round come as below. With several env threads, each is granted one step at a
        time and its steps are copied out as they arrive, so faster blocks deliver
        more rows.

        Args:
            n: number of transitions (``>= 0``).
            processor: events for this call (default: the loop's).
            interrupter: checked while waiting (default: the loop's); when it
                fires, the call returns what it has. Steps already granted are
                delivered by the next call, never lost.

        Returns:
            A TensorDict of batch size ``[n]`` in TorchRL's layout (see the module docs).

        Raises:
            EnvError, PolicyError: a worker failed; ``exc.partial`` holds what was
                collected; the loop is closed.
            StepTimeoutError: an env call exceeded ``step_timeout``; its thread is
                abandoned (not joined), the others are closed.
            CollectionError: the loop is closed (e.g. :meth:`close` from another thread).
            KeyboardInterrupt: (or an exception from the processor) re-raised after
                closing the loop: a call cut at an arbitrary point cannot be resumed.
                Use an :class:`Interrupter` to stop early and keep the loop usable.
        """
        check_int("n", n, 0)
        self.start()
        processor = processor if processor is not None else self.processor
        interrupter = interrupter if interrupter is not None else self.interrupter
        g, W = self.envs_per_thread, len(self._workers)
        out = self._batches.allocate(n)
        filled = 0
        try:
            # 1. steps published and not handed out yet (a step copied in part, an interrupted call's)
            filled = self._take_published(out, filled, n, processor)
            # 2. one env thread: its whole rounds in one grant, copied out in time order (the order the steps below
            # would deliver them in), with no hand-off per step
            if W == 1 and n - filled >= g:
                if interrupter is not None and interrupter.should_stop():
                    return self._finish_flat(out, filled)  # stopped first: nothing is asked, nothing is lost
                T = (n - filled) // g
                done, error = self._run_grants(self._consumed[0] + T, interrupter)
                k = min(done, T)
                filled = self._take_rounds(out, filled, 0, k, processor)
                if error is not None:
                    raise error
                if k < T:  # interrupted
                    return self._finish_flat(out, filled)
            # 3. grant idle workers a step each, oldest idle first
            self._refresh_idle()
            in_flight_rows = g * sum(1 for w in range(W) if self._outstanding[w])
            self._deferred = []
            while self._idle and filled + in_flight_rows < n:
                w = self._idle.popleft()
                self._grant(w, self._consumed[w] + 1)
                in_flight_rows += g
            self._send_deferred()
            # 4. copy arrivals out, granting again while more is needed
            while filled < n:
                msg = self._wait(interrupter)
                if msg is None:
                    break
                if not isinstance(msg, Published):
                    continue
                w = msg.worker
                in_flight_rows -= g
                filled = self._take(out, filled, n, w, processor)
                if self._consumed[w] == self._published[w] and not self._outstanding[w]:
                    if filled + in_flight_rows < n:
                        self._grant(w, self._consumed[w] + 1)
                        in_flight_rows += g
                    else:
                        self._idle.append(w)
        except CollectionError as exc:
            self.close()
            self._keep_settled()
            filled = self._take_published(out, filled, n, processor)  # every step settled before the failure
            self._fail(exc, self._finish_flat(out, filled))
        except BaseException:  # KeyboardInterrupt, a processor's error: the call cannot be resumed
            self.close()
            raise
        return self._finish_flat(out, filled)

    def _take_published(self, out: dict[NestedKey, np.ndarray], filled: int, n: int,
                        processor: EventProcessor | None) -> int:
        """:meth:`_take` every worker's published steps (a step copied in part first), counted, events emitted."""
        order = sorted(range(len(self._workers)), key=lambda w: (self._taken[w] == 0, w))
        for w in order:
            filled = self._take(out, filled, n, w, processor)
        return filled

    def _run_grants(self, end: int | list[int], interrupter: Interrupter | None) -> tuple[int, CollectionError | None]:
        """Grant every worker its steps up to ``end`` (one end, or one a worker) and wait until each published
        them, or until the interrupter fires: then the grants are cut (each worker stops after its current step)
        and every answer is awaited. Returns the steps every worker published past what was handed out, and the
        error that cut the call (the loop is then closed; each worker's settled steps count)."""
        W = len(self._workers)
        ends = [end] * W if isinstance(end, int) else end
        interrupted, error = False, None
        try:
            self._deferred = []
            for w in range(W):
                if self._published[w] < ends[w]:
                    self._grant(w, ends[w])
            self._send_deferred()
            while any(self._outstanding):
                msg = self._wait(None if interrupted else interrupter)
                if msg is None:  # interrupted: every worker stops after its current step and answers
                    interrupted = True
                    self._cut.set()
                    continue
        except CollectionError as exc:
            self.close()  # workers stopped (a hung one only ever writes steps it has not published)
            self._keep_settled()
            error = exc
        except BaseException:  # KeyboardInterrupt, a processor's error: the call cannot be resumed
            self.close()
            raise
        finally:
            self._cut.clear()
        return min((p - c for p, c in zip(self._published, self._consumed)), default=0), error

    def _refresh_idle(self) -> None:
        """Queue up workers with no grant outstanding and nothing left to hand out (after the idle ones already
        queued)."""
        for w in range(len(self._workers)):
            if not self._outstanding[w] and self._consumed[w] == self._published[w] and w not in self._idle:
                self._idle.append(w)

    @_driver_call
    def run_env_steps(self, steps_per_env: int, *, processor: EventProcessor | None = None,
                      interrupter: Interrupter | None = None) -> TensorDict:
        """Collect exactly ``steps_per_env`` consecutive steps from every env.

        TorchRL's batched layout: batch size ``[num_envs, steps_per_env]``, time
        last, dim names ``[None, "time"]``; row ``i`` is env ``i``'s steps in order.

        Returns:
            The batch; if interrupted, the time dim is cut to the steps every env
            delivered (steps beyond that are kept for the next call).

        Raises:
            See :meth:`run_steps`.
        """
        check_int("steps_per_env", steps_per_env, 0)
        self.start()
        if any(self._taken):
            raise CollectionError("run_env_steps cannot follow a run_steps call that left a block of "
                                  f"envs_per_thread={self.envs_per_thread} rows half consumed; ask run_steps for "
                                  "multiples of envs_per_thread")
        processor = processor if processor is not None else self.processor
        interrupter = interrupter if interrupter is not None else self.interrupter
        T = steps_per_env
        if interrupter is not None and interrupter.should_stop():
            T = 0  # stopped before the call: nothing is asked, nothing is lost
        out = self._batches.allocate((self.num_envs, T))
        done, error = self._run_grants([c + T for c in self._consumed], interrupter)
        result = self._finish_env_time(out, min(done, T), processor)
        if error is not None:
            self._fail(error, result)
        return result

    def _finish_env_time(self, out: dict[NestedKey, np.ndarray], T: int, processor: EventProcessor | None
                         ) -> TensorDict:
        """Copy every worker's next ``T`` steps into ``out`` (``[num_envs, >= T]``), env-major; ids, events."""
        g = self.envs_per_thread
        cols = {k: v[:, :T] for k, v in out.items()}
        steps_cols = {k: v for k, v in cols.items() if k != _ENV_ID and k != _TRAJ}
        for w, worker in enumerate(self._workers):
            rows = slice(w * g, (w + 1) * g)
            worker.steps.copy_out(self._consumed[w], self._consumed[w] + T, {k: v[rows] for k, v in steps_cols.items()},
                                  env_major=True)
            self._consumed[w] += T
        cols[_ENV_ID][...] = self._env_id_column
        done = cols[_TERMINATED] | cols[_TRUNCATED]
        cols[_TRAJ][...] = self._assign_traj_env_time(done)
        if processor is None:
            self.frames += done.size
            self.episodes += int(np.count_nonzero(done))
        else:  # events in time order, env by env within a time step
            by_time = {k: np.ascontiguousarray(v.swapaxes(0, 1)).reshape(-1, *v.shape[2:]) for k, v in cols.items()
                       if isinstance(k, tuple) and k[0] == "_loop" or k in (_ENV_ID, _VERSION)
                       or k in self._info_next or processor.wants_timesteps}
            self._count(by_time, range(done.size), processor)
        return self._layout.to_tensordict(cols, [self.num_envs, T], names=[None, "time"])

    @_driver_call
    def run_episodes(self, k: int, *, processor: EventProcessor | None = None,
                     interrupter: Interrupter | None = None, rng: random.Random | None = None) -> list[TensorDict]:
        """Run exactly ``k`` complete, fresh episodes (fewer only if interrupted).

        Each asked env is reset first (a running step-mode episode is cut: its
        last step not handed out yet is marked ``truncated``), runs one episode, and is
        asked again until ``k`` requests were sent in total. With ``lookahead=False``
        no step is written ahead, so the cut falls after a step already delivered
        without a done flag: do not mix ``run_episodes`` into an on-policy step
        stream whose value targets cross time (use a separate evaluation loop,
        as :class:`~lightning_rollout.lightning.RolloutDataModule` does). When ``k < num_envs`` a
        random subset of envs is asked.

        Returns:
            ``k`` TensorDicts of batch size ``[T_i]``, in request order (not
            completion order, so short episodes are not favoured). Interrupted, the
            episodes complete by then: the others still run to their end in their env
            threads, and are dropped (a later call never returns them).

        Raises:
            See :meth:`run_steps`; here ``exc.partial`` holds the episodes completed
            before the failure, concatenated in request order (batch size
            ``[sum of their lengths]``; ``None`` when none was complete).
        """
        check_int("k", k, 0)
        self.start()
        if not self._workers[0].envs.partial:
            raise CollectionError("run_episodes runs one env alone, and a natively batched env steps all its envs "
                                  "at once: evaluate with env.rollout() on the batched env, or with a loop of single "
                                  "envs")
        processor = processor if processor is not None else self.processor
        interrupter = interrupter if interrupter is not None else self.interrupter
        rng = rng or random.Random()
        results: dict[int, TensorDict] = {}
        envs = list(range(self.num_envs))
        if k < self.num_envs:
            envs = rng.sample(envs, k)
        first = self._stale_episodes = self._episode_requests  # this call's requests are numbered from here
        try:
            for env_id in envs:
                self._request_episode(env_id)
            while len(results) < self._episode_requests - first:
                msg = self._wait(interrupter)
                if msg is None:
                    break
                if not isinstance(msg, EpisodeReady):
                    continue
                env_id, length = msg.env_id, msg.length
                trajectory = msg.steps.episode(length)
                trajectory[_ENV_ID] = np.full(length, env_id, dtype=np.int64)
                trajectory[_TRAJ] = np.full(length, self._next_traj, dtype=np.int64)
                self._next_traj += 1
                if processor is not None:
                    self._emit(trajectory, range(length), processor, self.eval, k, 1)
                if not self.eval:
                    self.episodes += 1
                if msg.fresh:  # no undelivered step ends the env's running trajectory: its next steps start a new one
                    self._new_trajectory(env_id)
                results[msg.request_index - first] = self._layout.to_tensordict(trajectory, [length])
                if self._episode_requests - first < k:
                    self._request_episode(env_id)
        except CollectionError as exc:
            done = [results[i] for i in sorted(results)]
            self._fail(exc, torch.cat(done) if done else None)
        except BaseException:  # KeyboardInterrupt, a processor's error: the call cannot be resumed
            self.close()
            raise
        finally:
            self._stale_episodes = self._episode_requests  # episodes still running answer nobody now
        return [results[i] for i in sorted(results)]

    def _request_episode(self, env_id: int) -> None:
        w = env_id // self.envs_per_thread
        index, self._episode_requests = self._episode_requests, self._episode_requests + 1
        self._workers[w].requests.put(EpisodeRequest(env_id, index, self._consumed[w], self._taken[w]))

    # -- shutdown ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop and join every thread (each within ``join_timeout``); idempotent, any thread. A call cut short
        by an exception (Ctrl-C during a join) leaves the rest to the next call."""
        if self._shut:
            return
        self._closed = True
        if not self._stop.is_set():  # set once: a set() cut short by Ctrl-C may have left the Event's lock held
            self._stop.set()
        for worker in self._workers if hasattr(self, "_workers") else ():
            worker.requests.put(STOP)
        if self._owns_policy:
            self.policy.close(self.join_timeout)
        stuck = []
        for worker in getattr(self, "_workers", ()):
            if not worker.thread.ident:  # never started: its envs were never handed over
                worker.agent.close()
                if worker.envs.owned:  # a worker process's envs are closed by its pool
                    worker.envs.close()
                continue
            if worker.thread is threading.current_thread():
                continue
            if worker.abandoned and worker.thread.is_alive():  # stuck past step_timeout: not waited for
                stuck.append(worker.thread.name)
                abandon(worker.thread)  # at interpreter exit it cannot abort the process (see _exit)
                continue
            worker.thread.join(self.join_timeout)
            if worker.thread.is_alive():
                stuck.append(worker.thread.name)
                abandon(worker.thread)
        pool = getattr(self, "_pool", None)
        if pool is not None:  # after the env threads: none is still talking to a worker process
            pool.close(self.join_timeout)
        if hasattr(self, "_batches"):
            self._batches.clear()
        self._shut = True
        if stuck:
            warn_user(f"threads {stuck} are stuck in an env call (past step_timeout, or still running after "
                      f"join_timeout={self.join_timeout} s); they are daemons and are abandoned", RuntimeWarning)

    def __enter__(self) -> MultiEnvLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def threads(self) -> Iterator[threading.Thread]:
        """The env threads (for monitoring)."""
        return (w.thread for w in self._workers)


class _EnvSeeds(tuple):
    """Per-env seeds, read by an env thread as ``seed + env_id`` (its envs' first resets)."""

    def __add__(self, env_id: int) -> int:  # type: ignore[override]
        return self[env_id]


def _check_loop_arguments(*, num_envs: int, envs_per_thread: int | str, num_workers: int | str,
                          max_episode_steps: int | None, random_steps_per_env: int, step_timeout: float | None,
                          join_timeout: float, max_wait: float | None, policy_timeout: float | None, device: Any,
                          traj_id_start: int, env_shape: Sequence[int] | None, seed: int | Sequence[int] | None,
                          exploration_type: Any, processor: Any, interrupter: Any, policy: Any,
                          autobatch_size: int | None) -> float:
    """Refuse a bad :class:`MultiEnvLoop` argument with what to change, before any env is built; returns
    ``join_timeout`` as checked (a float number of seconds).

    Raises:
        ValueError: the first bad argument, named.
    """
    check_knobs(envs_per_thread=envs_per_thread, num_workers=num_workers)
    if not is_auto(envs_per_thread) and num_envs % envs_per_thread:
        raise ValueError(f"num_envs ({num_envs}) must be a multiple of envs_per_thread ({envs_per_thread})")
    if not is_auto(num_workers) and num_workers > num_envs:
        raise ValueError(f"num_workers ({num_workers}) must be at most num_envs ({num_envs}): each process "
                         "runs at least one env")
    check_int("max_episode_steps", max_episode_steps, 1, optional=True)
    check_int("random_steps_per_env", random_steps_per_env, 0)
    check_seconds("step_timeout", step_timeout, allow_zero=False)
    checked_join = check_seconds("join_timeout", join_timeout, allow_zero=True)  # a join cannot take inf
    if checked_join is None:
        raise ValueError("join_timeout must be a finite number of seconds >= 0, got None")
    check_seconds("max_wait", max_wait, allow_zero=True)  # refused before any env is built
    check_seconds("policy_timeout", policy_timeout, allow_zero=False)
    check_device("device", device)
    check_int("traj_id_start", traj_id_start, 0)
    if env_shape is not None and math.prod(env_shape) != num_envs:
        raise ValueError(f"env_shape {tuple(env_shape)} does not hold num_envs={num_envs} envs")
    for one_seed in seed if isinstance(seed, Sequence) else [seed]:
        check_int("seed", one_seed, 0, optional=True)
    if isinstance(seed, Sequence) and len(seed) != num_envs:
        raise ValueError(f"got {len(seed)} seeds for {num_envs} envs; pass one seed, or one per env")
    if not isinstance(exploration_type, ExplorationType):
        raise ValueError(f"exploration_type must be a torchrl ExplorationType (e.g. ExplorationType.RANDOM), "
                         f"got {exploration_type!r}")
    if processor is not None and not all(callable(getattr(processor, m, None)) for m in (
            "on_timestep", "on_episode_end", "on_eval_timestep", "on_eval_episode_end")):
        raise ValueError(f"processor must be an EventProcessor (subclass it), got {type(processor).__name__}")
    if interrupter is not None and not callable(getattr(interrupter, "should_stop", None)):
        raise ValueError(f"interrupter must be a lightning_rollout.Interrupter, got {type(interrupter).__name__}")
    if isinstance(policy, AutobatchPolicy):
        if any(x is not None for x in (autobatch_size, max_wait, device, policy_timeout)):
            raise ValueError("autobatch_size, max_wait, device and policy_timeout belong to the AutobatchPolicy "
                             "you passed; set them there, not on the loop")
    else:
        check_int("autobatch_size", autobatch_size, 1, optional=True)
    return checked_join


def _creation_error(env_id: int, phase: str, exc: BaseException, process: int | None = None) -> EnvError:
    """An env that failed while being built or first reset (in this process, or in worker process ``process``)."""
    where = "" if process is None else f" (in worker process {process})"
    message = str(exc) if process is not None else f"{type(exc).__name__}: {exc}"
    return EnvError(message + where, env_id=env_id, step=0, phase="check" if phase == "check" else "reset")


class EnvLoop(MultiEnvLoop):
    """One env in one thread: the seed's ``AgentEnvAsyncLoop``.

    A :class:`MultiEnvLoop` with ``num_envs=1``. It registers itself with the
    policy (the seed's standalone loop did not), so several loops can share one
    :class:`AutobatchPolicy` without deadlock. Takes the same keyword arguments.
    """

    def __init__(self, env: str | EnvFactory, policy: AutobatchPolicy | Callable[..., Any], **kwargs: Any) -> None:
        if kwargs.get("num_envs", 1) != 1:
            raise ValueError("EnvLoop runs exactly one env; use MultiEnvLoop for num_envs > 1")
        kwargs["num_envs"] = 1
        super().__init__(env, policy, **kwargs)
