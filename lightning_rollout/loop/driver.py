"""The env loops :class:`MultiEnvLoop` and :class:`EnvLoop`: collection on request (``T`` steps of every env,
``n`` frames in arrival order, ``k`` fresh episodes), each call running the stepping loop in the calling thread.

One call at a time (a second thread's, or one from inside a call, is refused). An env or policy error closes
the loop and is raised naming env and step, the steps before it on ``exc.partial``; ``close`` from another
thread ends a running call with :class:`~lightning_rollout.errors.CollectionError`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch
from tensordict import TensorDict
from torchrl.envs.utils import ExplorationType, RandomPolicy
from torchrl.envs.utils import exploration_type as current_exploration_type

from .._checks import check_device, check_int, check_seconds, warn_user
from .._exit import close_at_exit
from .._threads import torch_threads, torch_threads_set
from ..envs import EnvFactory, EnvFailure, InfoKeys, env_factories, info_key_list
from ..errors import CollectionError, EnvError, PolicyError
from ..events import EventProcessor, Interrupter
from ..policy import AutobatchPolicy, BatchedRandomPolicy, PolicyCall, as_policy_module
from ..specs import ArraySpec, EnvKeys, NestedKey
from .auto import check_knobs, resolve_layout
from .delivery import Delivery
from .executors import Envs, SerialEnvs, ThreadEnvs, build_units
from .processes import ProcessEnvs
from .stepper import EnvTimeRule, EpisodeRule, FlatRule, Stepper
from .storage import GYM_LOOP_KEYS, Layout

__all__ = ["EnvLoop", "MultiEnvLoop"]


def _collecting(method: Callable[..., Any]) -> Callable[..., Any]:
    """A collection call: one at a time (a second is refused at once); on-policy, the weights pinned for it
    (:meth:`~lightning_rollout.policy.PolicyCall.pinned`); whatever it raises closes the loop."""

    @functools.wraps(method)
    def wrapper(self: MultiEnvLoop, *args: Any, **kwargs: Any) -> Any:
        with self._claim:  # a C lock a Ctrl-C cannot split: the claim is taken whole or not at all
            if (owner := self._driver) is not None:
                raise CollectionError(f"{method.__name__}: the loop {self.name!r} is already collecting in thread "
                                      f"{owner.name!r} (or this is a call from inside its own collection, e.g. an "
                                      "event processor); a loop has one driver: call it from one thread at a time")
            self._driver = threading.current_thread()
            self.collecting = True
        delivery = self._delivery  # counts set from outside between calls (a resume) are the ones to continue
        delivery.frames, delivery.episodes = self.frames, self.episodes
        try:
            self.start()  # refuses a closed loop
            if self._agent is not None:
                self._agent.unpark()
            pin = self.policy.pinned() if not self.lookahead and self._agent is None else contextlib.nullcontext()
            with pin, torch_threads_set(self._torch_threads):
                return method(self, *args, **kwargs)
        except CollectionError:
            raise
        except KeyboardInterrupt:  # reaches the caller at once; the envs are released by close() (or at exit)
            self.closed = True
            self._stop.set()
            raise
        except BaseException as exc:  # a processor's error, or what a close from another thread broke
            self.close()
            if self._closed_by_other:
                raise CollectionError(f"the loop {self.name!r} was closed while collecting") from exc
            raise
        finally:
            if self._agent is not None:
                self._agent.park()
            self.frames, self.episodes, self.next_traj_id = delivery.frames, delivery.episodes, delivery.next_traj
            self._driver = None
            self.collecting = False

    return wrapper


class MultiEnvLoop:
    """``num_envs`` envs, one batched policy call a step, request-driven collection (see the module docstring).

    Args:
        env: a gymnasium id, a factory returning a ``gymnasium.Env`` or a TorchRL ``EnvBase`` (batched ones
            included: ``SerialEnv``, VMAS, a gymnasium vector env), or a list of ``num_envs`` such factories.
        policy: anything TorchRL's collectors accept (a ``TensorDictModule``, a function of a TensorDict, an
            ``nn.Module`` or function with arguments named after observation keys, a one-argument tensor function,
            ``None`` for ``RandomPolicy``), called on a TensorDict ``[k]`` of every root entry of ``k`` envs; or a
            shared :class:`~lightning_rollout.AutobatchPolicy` (owning ``autobatch_size``, ``max_wait``, ``device``
            and ``policy_timeout``).

    Keyword Args:
        num_envs: envs (``>= 1``); inferred from a list of factories.
        envs_per_thread: envs a unit steps in one call: ``num_envs`` steps all in the calling thread, fewer gives
            each group a pool thread (for steps releasing the GIL); a natively batched env's batch is its own.
            ``"auto"``: chosen with ``num_workers`` from a few timed steps of one env (``layout_choice``).
        num_workers: processes stepping envs, this one counted (``n - 1`` worker processes; picklable factories).
        parallel_steps: a pool thread per env (True, or ``"free"``: the recv rule then takes whichever envs are
            ready, for uneven step times); ``"auto"``: what ``"auto"`` chose.
        autobatch_size: a round acts on at least ``min(in flight, autobatch_size)`` envs; ``None``: all in flight
            (lock-step: reproducible). max_wait: seconds a partial round waits for stragglers.
        device: where the policy runs. exploration_type: of every policy call (``None``: the one set by
            ``set_exploration_type`` around the call, else random).
        lookahead: True: each env keeps a step in flight between calls (double batching; one step of policy lag
            after an update). False: on-policy, nothing runs between calls.
        eval: an evaluation loop (events go to ``on_eval_*``). max_episode_steps: truncate episodes there.
        seed: env ``i`` is first reset with ``seed + i`` (or ``seed[i]`` for a list), and the policy samples
            from its own stream seeded with ``seed``. random_steps_per_env: each env's first steps act at random.
        step_timeout, policy_timeout: seconds an env call or a policy call may take (then
            :class:`~lightning_rollout.errors.StepTimeoutError` / :class:`~lightning_rollout.errors.PolicyError`).
        validate: check every observation's shape, dtype and NaNs, and every action. info_keys: entries of a
            gymnasium env's ``info`` read as observations (a list, or ``{key: spec}``).
        processor, interrupter: defaults of every call. traj_id_start: the first trajectory id.
        env_shape: the batch dims of the batched env the envs were taken from: a call on every env gets them.
        name: used in thread names. join_timeout: seconds :meth:`close` waits for each thread or process.
        start: ``False`` defers resetting with a changed ``seed`` to :meth:`start` or the first call.

    Attributes:
        policy: what acts: the loop's :class:`~lightning_rollout.policy.PolicyCall`, or the shared ``AutobatchPolicy``.
        layout: the columns of a transition (what a batch holds: ``layout.specs``, ``layout.to_tensordict``).

    Raises:
        ValueError: bad configuration, with what to change.
    """

    def __init__(self, env: str | EnvFactory | Sequence[EnvFactory],
                 policy: AutobatchPolicy | Callable[..., Any] | None, *, num_envs: int | None = None,
                 envs_per_thread: int | str = 1, num_workers: int | str = 1,
                 parallel_steps: bool | Literal["auto", "free"] = "auto", autobatch_size: int | None = None,
                 max_wait: float | None = None, device: torch.device | str | None = None,
                 exploration_type: ExplorationType | None = None, lookahead: bool = True,
                 eval: bool = False, max_episode_steps: int | None = None, seed: int | Sequence[int] | None = None,
                 random_steps_per_env: int = 0, step_timeout: float | None = None,
                 policy_timeout: float | None = None, validate: bool = True, info_keys: InfoKeys | None = None,
                 processor: EventProcessor | None = None, interrupter: Interrupter | None = None,
                 traj_id_start: int = 0, env_shape: Sequence[int] | None = None, name: str = "loop",
                 join_timeout: float = 5.0, start: bool = True) -> None:
        factories = env_factories(env, num_envs)
        n = len(factories)
        check_knobs(envs_per_thread=envs_per_thread, num_workers=num_workers, parallel_steps=parallel_steps, num_envs=n)
        self.join_timeout = _check_arguments(
            num_envs=n, max_episode_steps=max_episode_steps, random_steps_per_env=random_steps_per_env,
            step_timeout=step_timeout, join_timeout=join_timeout, max_wait=max_wait, policy_timeout=policy_timeout,
            device=device, traj_id_start=traj_id_start, env_shape=env_shape, seed=seed,
            exploration_type=exploration_type, processor=processor, interrupter=interrupter, policy=policy,
            autobatch_size=autobatch_size)
        self.layout_choice, num_workers, envs_per_thread, parallel_steps = resolve_layout(
            factories[0], n, num_workers=num_workers, envs_per_thread=envs_per_thread, parallel_steps=parallel_steps,
            step_timeout=step_timeout, name=name)
        if parallel_steps and num_workers > 1:
            raise ValueError(f"parallel_steps={parallel_steps!r} steps envs in pool threads of this process; worker "
                             "processes (num_workers > 1) step theirs one after the other: pass one or the other")
        self.num_envs, self.num_workers, self.name = n, int(num_workers), name
        self.envs_per_thread = 1 if parallel_steps else int(envs_per_thread)
        self.parallel_steps: bool | str = parallel_steps
        self.exploration_type, self.lookahead, self.eval = exploration_type, lookahead, eval
        self.max_episode_steps, self.validate, self.step_timeout = max_episode_steps, validate, step_timeout
        self.info_keys = info_key_list(info_keys)
        self.processor, self.interrupter, self.seed = processor, interrupter, seed
        self._claim, self._stop, self._shutdown_lock = threading.Lock(), threading.Event(), threading.Lock()
        self._driver: threading.Thread | None = None
        self.collecting = False  # a collection call runs, in some thread
        self.frames = self.episodes = 0  # transitions and episodes delivered by training calls
        self.next_traj_id = traj_id_start  # the id the next new trajectory will get
        self.closed = self._shut = self._closed_by_other = False
        self._agent = None
        self._envs: Envs | None = None
        try:  # worker processes; else pool threads (several units, parallel_steps, a step_timeout to watch) or none
            seeds, watched = _seeds(seed, n), step_timeout is not None
            options = {"max_episode_steps": max_episode_steps, "validate": validate, "info_keys": info_keys}
            if self.num_workers > 1:
                self._envs = ProcessEnvs(factories, seeds, num_workers=self.num_workers, group=self.envs_per_thread,
                                         name=name, threads=watched, **options)
            else:
                units = build_units(factories, group=self.envs_per_thread, parallel=bool(parallel_steps), **options)
                threaded = len(units) > 1 or bool(parallel_steps) or watched
                self._envs = ThreadEnvs(units, seeds, name=name) if threaded else SerialEnvs(units, seeds)
            self._seeded = seed
            self._setup(self._envs, policy, autobatch_size=1 if parallel_steps == "free" else autobatch_size,
                        max_wait=max_wait, device=device, policy_timeout=policy_timeout, env_shape=env_shape,
                        random_steps=random_steps_per_env, traj_id_start=traj_id_start)
        except BaseException as failure:
            self._shutdown()
            if not isinstance(failure, EnvFailure):
                raise
            if isinstance(failure.cause, KeyboardInterrupt) and failure.process is None:
                raise failure.cause from None
            phase = "check" if failure.phase == "check" else "reset"
            where = "" if failure.process is None else f" (in worker process {failure.process})"
            raise EnvError(f"{failure}{where}", env_id=failure.row, step=0, phase=phase) from failure.cause
        close_at_exit(self)
        self.started = False
        if start:
            self.start()

    def _setup(self, envs: Envs, policy: Any, *, autobatch_size: int | None, max_wait: float | None, device: Any,
               policy_timeout: float | None, env_shape: Sequence[int] | None, random_steps: int,
               traj_id_start: int) -> None:
        """The policy probed on every env's first root entries, the columns laid out from what it writes."""
        unit, keys = envs.unit, envs.unit.keys
        if isinstance(policy, AutobatchPolicy):
            self.policy = policy
            self._agent = policy.register(self.num_envs)
            self._agent.park()
        else:
            data = [k for k in keys.observation if k not in GYM_LOOP_KEYS and k not in self.info_keys]
            wrapped = as_policy_module(policy if policy is not None else RandomPolicy(),
                                       observation_spec=unit.observation_spec, action_keys=list(keys.action),
                                       single_key=data[0] if len(data) == 1 else None, action_spec=unit.action_spec,
                                       policy_timeout=policy_timeout, name=self.name)
            self.policy = PolicyCall(wrapped, device=device, seed=_seeds(self.seed, self.num_envs)[0],
                                     policy_timeout=policy_timeout, name=self.name)
        # torch's intra-op threads (process-wide) for the probe and every call: capped at the cores left by the
        # pool threads or the worker processes stepping meanwhile
        overlap = self.lookahead or autobatch_size is not None
        busy = len(getattr(envs, "pool", ())) or ((self.num_workers - 1) if overlap else 0)
        self._torch_threads = torch_threads(runs_policy=True, busy=busy)
        shape = tuple(env_shape) if env_shape is not None else (() if self.num_envs == 1 else None)
        probe = {k: envs.roots[k] for k in keys.root}
        probe.update({k: np.zeros((self.num_envs, *s.shape), s.dtype) for k, s in keys.done.items()})
        self.policy.bind(probe, sub_batch=keys.sub_batch, env_shape=shape)
        with torch_threads_set(self._torch_threads):
            probed = self.policy.probe(probe, self.num_envs)
        outputs = {k: ArraySpec(s, np.dtype(d)) for k, (s, d) in probed.items()}
        if missing := [k for k in keys.action if k not in outputs]:
            raise PolicyError(f"the policy wrote no {missing[0]!r} (the env's action key"
                              f"{'s' if len(keys.action) > 1 else ''}: {list(keys.action)}); it wrote {list(outputs)}")
        layout = self.layout = Layout(keys, outputs, loop_keys=unit.loop_keys)
        available = {**layout.carried, **{k: keys.done[k] for k in layout.done_keys}}
        self._input_keys = self.policy.bind(available, sub_batch=keys.sub_batch, env_shape=shape)
        env_inputs = layout.action_keys if unit.loop_keys else list(dict.fromkeys([*layout.root_inputs,
                                                                                   *layout.out_keys]))
        envs.attach({k: layout.specs.get(k) or keys.done[k] for k in env_inputs})
        random_action = _random_actions(unit.action_spec, {k: layout.specs[k] for k in keys.action})
        self._stepper = Stepper(
            envs, layout, policy=self._act, random_action=random_action,
            input_keys=self._input_keys, env_inputs=env_inputs, autobatch_size=autobatch_size,
            max_wait=None if self._agent is not None else max_wait, step_timeout=self.step_timeout,
            random_steps=random_steps, group=self.envs_per_thread, stop=self._stop)
        self._delivery = Delivery(layout, self.num_envs, traj_id_start=traj_id_start, info_keys=self.info_keys,
                                  eval=self.eval)
        self._stepper.new_trajectory = self._delivery.new_trajectory

    def _act(self, inputs: dict[NestedKey, np.ndarray], rows: int, mode: ExplorationType
             ) -> tuple[dict[NestedKey, np.ndarray], int]:
        if self._agent is None:
            return self.policy(inputs, rows, mode)
        self._agent.set_rows(rows)
        answer = self._agent.act(inputs, exploration_type=mode, stop=self._stop)
        return {k: v[answer.start:answer.stop] for k, v in answer.outputs.items()}, answer.version

    def start(self) -> None:
        """Reset every env with the current ``seed`` if it changed since construction. Idempotent."""
        if self.closed:
            raise CollectionError(f"the loop {self.name!r} is closed")
        if not self.started:
            self.started = True
            if self.seed != self._seeded:
                self._stepper.reset(np.arange(self.num_envs), _seeds(self.seed, self.num_envs))

    def _run(self, rule: Any, interrupter: Interrupter | None, partial: Callable[[], TensorDict | None]) -> bool | None:
        """Run the stepper (``None``: the loop's interrupter): ``True`` when ``rule`` is done, ``False`` when
        interrupted, ``None`` when before the start. A failure, ``partial()`` on ``exc.partial``, closes the loop."""
        interrupter = interrupter if interrupter is not None else self.interrupter
        if interrupter is not None and interrupter.should_stop():
            return None
        self._stepper.mode = self.exploration_type or current_exploration_type() or ExplorationType.RANDOM
        try:
            return self._stepper.run(rule, interrupter)
        except CollectionError as exc:
            with contextlib.suppress(Exception):  # the failure is what the caller needs; the partial is a bonus
                kept = partial()
                exc.partial = kept if kept is not None and kept.batch_size.numel() else None
            self.close()
            raise

    @_collecting
    def run_steps(self, n: int, *, processor: EventProcessor | None = None,
                  interrupter: Interrupter | None = None) -> TensorDict:
        """Exactly ``n`` transitions (fewer only if interrupted), in arrival order: batch ``[n]``, TorchRL's layout.

        Each env's steps keep their order. With ``lookahead=False`` at most ``n`` steps are taken, rounded up to
        whole units of ``envs_per_thread`` envs (the extra ones come first in the next call). Steps in flight when
        interrupted are delivered by the next call.

        Raises:
            EnvError, PolicyError: an env or the policy failed (``exc.partial``: what was collected; the loop is
                closed). StepTimeoutError: an env call exceeded ``step_timeout``. CollectionError: the loop was
                closed. KeyboardInterrupt: re-raised at once; the loop takes no further call, and close() (or exit)
                releases its envs.
        """
        check_int("n", n, 0)
        processor = processor if processor is not None else self.processor
        main, delivery = self._stepper.main, self._delivery
        emitted = 0

        def arrived(steps: np.ndarray, envs: np.ndarray) -> None:  # events as steps arrive, up to n
            nonlocal emitted
            k = max(0, min(len(envs), n - emitted))
            delivery.announce(main, steps[:k], envs[:k], processor)
            emitted += k

        arrived(*delivery.pending(main))
        done = self._run(FlatRule(n, exact=not self.lookahead, arrived=arrived), interrupter,
                         lambda: delivery.flat(main, main.available()))
        batch = delivery.flat(main, min(n, main.available()))
        if done:
            self._stepper.finish(self.lookahead)
        return batch

    @_collecting
    def run_env_steps(self, steps_per_env: int, *, processor: EventProcessor | None = None,
                      interrupter: Interrupter | None = None) -> TensorDict:
        """``steps_per_env`` consecutive steps of every env: ``[num_envs, steps_per_env]``, names ``[None, "time"]``
        (if interrupted, cut to the steps every env delivered; the rest wait for the next call). Raises: see
        :meth:`run_steps`."""
        check_int("steps_per_env", steps_per_env, 0)
        processor = processor if processor is not None else self.processor
        main = self._stepper.main
        done = self._run(EnvTimeRule(self._stepper, steps_per_env), interrupter,
                         lambda: self._delivery.flat(main, main.available()))
        common = 0 if done is None else min(steps_per_env, int((main.t - main.consumed).min()))
        batch = self._delivery.env_time(main, common, processor)
        if done:
            self._stepper.finish(self.lookahead)
        return batch

    @_collecting
    def run_episodes(self, k: int, *, processor: EventProcessor | None = None,
                     interrupter: Interrupter | None = None, rng: random.Random | None = None) -> list[TensorDict]:
        """Exactly ``k`` complete, fresh episodes (fewer only if interrupted), in request order.

        Each asked env starts a fresh episode (its running one cut: its last unconsumed step marked ``truncated``)
        and is asked again until ``k`` were requested; a random subset of envs when ``k < num_envs``.

        Raises:
            See :meth:`run_steps`; ``exc.partial`` holds the episodes completed before the failure.
            CollectionError: a natively batched env, which cannot run one env alone.
        """
        check_int("k", k, 0)
        if not self._envs.unit.partial:
            raise CollectionError("run_episodes runs one env alone, and a natively batched env steps all its envs "
                                  "at once: evaluate with env.rollout() on the batched env, or with a loop of single "
                                  "envs")
        processor = processor if processor is not None else self.processor
        envs = list(range(self.num_envs))
        envs = (rng or random.Random()).sample(envs, k) if k < self.num_envs else envs
        results: dict[int, TensorDict] = {}

        def finished(request: int, env: int, first: int, end: int) -> None:
            results[request] = self._delivery.episode(self._stepper.episodes, env, first, end, processor, k,
                                                      len(results) + 1)

        def partial() -> TensorDict | None:
            return torch.cat([results[i] for i in sorted(results)]) if results else None

        rule = EpisodeRule(self._stepper, envs if k else [], k, finished)
        if not self._run(rule, interrupter, partial):
            rule.abandon(self._stepper)
        return [results[i] for i in sorted(results)]

    @_collecting
    def reset_envs(self, env_ids: Sequence[int] | None = None, *, seeds: Sequence[int | None] | None = None) -> None:
        """Start a new episode now on the given envs (all by default), reseeded where seeds are given; an env's last
        unconsumed step is delivered by the next call, marked ``truncated``. Raises ValueError (bad ids or seeds),
        EnvError (a reset failed)."""
        ids = list(range(self.num_envs)) if env_ids is None else [int(i) for i in env_ids]
        for i in ids:
            if not 0 <= i < self.num_envs:
                raise ValueError(f"env id {i} out of range: the loop has {self.num_envs} envs")
        if seeds is not None and len(seeds) != len(ids):
            raise ValueError(f"got {len(seeds)} seeds for {len(ids)} envs")
        self._stepper.reset(np.asarray(ids, dtype=np.int64), list(seeds) if seeds is not None else [None] * len(ids))

    def update_policy(self, state: Any) -> int:
        """Load new weights (a state_dict, a module or a TensorDict); returns the new policy version."""
        return self.policy.update(state)

    def policy_state(self) -> Any:
        """A copy of the current weights."""
        return self.policy.state()

    @property
    def policy_version(self) -> int:
        """Version of the weights the next policy call will use."""
        return self.policy.version

    @property
    def env_keys(self) -> EnvKeys:
        """Every leaf the envs read and write, from their TorchRL specs."""
        return self.layout.keys

    @property
    def input_keys(self) -> list[NestedKey]:
        """The root entries handed to the policy at each step."""
        return list(self._input_keys)

    def set_traj_id_start(self, value: int) -> None:
        """Number trajectories from ``value`` (before the first call, e.g. on resume)."""
        if self._delivery.frames or self.started:
            raise CollectionError("set_traj_id_start must be called before the loop collects")
        check_int("traj_id_start", value, 0)
        self._delivery.start_ids(value)  # the envs' running trajectories take the first num_envs ids
        self.next_traj_id = self._delivery.next_traj

    def threads(self) -> Iterator[threading.Thread]:
        """The loop's pool threads (for monitoring)."""
        return iter(getattr(self._envs, "pool", ()))

    def close(self) -> None:
        """Stop and release everything (each thread and process within ``join_timeout``); idempotent, any thread.
        From another thread while a call runs, that call ends with :class:`CollectionError` first."""
        self.closed = True
        self._stop.set()
        driver = self._driver
        if driver is not None and driver is not threading.current_thread():
            self._closed_by_other = True
            deadline = time.monotonic() + self.join_timeout
            while self._driver is not None and time.monotonic() < deadline:  # the call sees the flag and ends
                time.sleep(0.005)
        self._shutdown()

    def _shutdown(self) -> None:
        with self._shutdown_lock:
            if self._shut:
                return
            self.closed = True
            self._stop.set()
            stuck = self._envs.close(self.join_timeout) if self._envs is not None else []
            if self._agent is not None:
                self._agent.close()
            elif getattr(self, "policy", None) is not None:
                self.policy.close(self.join_timeout)
            if (delivery := getattr(self, "_delivery", None)) is not None:
                delivery.pool.clear()
            self._shut = True  # only now: a close cut short (Ctrl-C) is finished by the next one
        if stuck:
            warn_user(f"threads {stuck} are stuck in an env call (past step_timeout, or still running after "
                      f"join_timeout={self.join_timeout} s); they are daemons and are abandoned", RuntimeWarning)

    def __enter__(self) -> MultiEnvLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._shutdown()
        except Exception:  # noqa: S110 - nothing to report at garbage collection
            pass


class EnvLoop(MultiEnvLoop):
    """One env: the seed's ``AgentEnvAsyncLoop``, a :class:`MultiEnvLoop` with ``num_envs=1``."""

    def __init__(self, env: str | EnvFactory, policy: AutobatchPolicy | Callable[..., Any], **kwargs: Any) -> None:
        if kwargs.setdefault("num_envs", 1) != 1:
            raise ValueError("EnvLoop runs exactly one env; use MultiEnvLoop for num_envs > 1")
        super().__init__(env, policy, **kwargs)


def _seeds(seed: int | Sequence[int] | None, num_envs: int) -> list[int | None]:
    """Each env's first seed: ``seed + i``, or ``seed[i]`` for a list."""
    if seed is None or isinstance(seed, (int, np.integer)):
        return [None if seed is None else int(seed) + i for i in range(num_envs)]
    if len(seed) != num_envs:
        raise ValueError(f"seed has {len(seed)} entries for {num_envs} envs; pass one seed or one per env")
    return [int(s) for s in seed]


def _random_actions(spec: Any, columns: dict[NestedKey, ArraySpec]) -> Callable[[int], dict[NestedKey, np.ndarray]]:
    """Uniform random actions of ``rows`` envs in the policy's action columns (an index where the spec is one-hot)."""
    policy = BatchedRandomPolicy(spec)

    def draw(rows: int) -> dict[NestedKey, np.ndarray]:
        td = policy(TensorDict({}, batch_size=[rows]))
        out = {}
        for k, column in columns.items():
            value = td.get(k).numpy()
            if value.shape[1:] != column.shape:  # one-hot sampled, index stored
                sizes = getattr(policy.action_spec[k], "nvec", None)
                parts = np.split(value, np.cumsum(sizes)[:-1], axis=-1) if sizes is not None else [value]
                value = np.stack([p.argmax(-1) for p in parts], -1).reshape(rows, *column.shape)
            out[k] = value.astype(column.dtype, copy=False)
        return out

    return draw


def _check_arguments(*, num_envs: int, max_episode_steps: int | None, random_steps_per_env: int,
                     step_timeout: float | None, join_timeout: float, max_wait: float | None,
                     policy_timeout: float | None, device: Any, traj_id_start: int, env_shape: Sequence[int] | None,
                     seed: Any, exploration_type: Any, processor: Any, interrupter: Any, policy: Any,
                     autobatch_size: int | None) -> float:
    """Refuse the first bad argument (ValueError: what to change) before any env is built; returns ``join_timeout``."""
    check_int("max_episode_steps", max_episode_steps, 1, optional=True)
    check_int("random_steps_per_env", random_steps_per_env, 0)
    check_seconds("step_timeout", step_timeout, allow_zero=False)
    if (checked_join := check_seconds("join_timeout", join_timeout, allow_zero=True)) is None:
        raise ValueError("join_timeout must be a finite number of seconds >= 0, got None")
    check_seconds("max_wait", max_wait, allow_zero=True)
    check_seconds("policy_timeout", policy_timeout, allow_zero=False)
    check_device("device", device)
    check_int("traj_id_start", traj_id_start, 0)
    if env_shape is not None and math.prod(env_shape) != num_envs:
        raise ValueError(f"env_shape {tuple(env_shape)} does not hold num_envs={num_envs} envs")
    many = isinstance(seed, (list, tuple))  # one seed an env: each must be given
    for s in seed if many else [seed]:
        check_int("seed", s, 0, optional=not many)
    if exploration_type is not None and not isinstance(exploration_type, ExplorationType):
        raise ValueError(f"exploration_type must be a torchrl ExplorationType (e.g. ExplorationType.RANDOM) or None, "
                         f"got {exploration_type!r}")
    if processor is not None and not all(callable(getattr(processor, m, None)) for m in (
            "on_timestep", "on_episode_end", "on_eval_timestep", "on_eval_episode_end")):
        raise ValueError(f"processor must be an EventProcessor (subclass it), got {type(processor).__name__}")
    if interrupter is not None and not callable(getattr(interrupter, "should_stop", None)):
        raise ValueError(f"interrupter must be a lightning_rollout.Interrupter, got {type(interrupter).__name__}")
    check_int("autobatch_size", autobatch_size, 1, optional=True)
    shared = (autobatch_size, max_wait, device, policy_timeout)  # what an AutobatchPolicy owns
    if isinstance(policy, AutobatchPolicy) and any(x is not None for x in shared):
        raise ValueError("autobatch_size, max_wait, device and policy_timeout belong to the AutobatchPolicy you "
                         "passed; set them there, not on the loop")
    return checked_join
