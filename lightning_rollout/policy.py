"""AutobatchPolicy: many threads ask for actions, one batched forward pass answers.

Protocol (the seed's ``AsyncPolicy``, with its defects fixed):

* One **inference thread** (``lightning_rollout-<name>-inference``, a daemon)
  serves the queue: partial flushes after ``max_wait``, flushes made ready by a
  client parking, and weight updates. It is started lazily and joined by
  :meth:`AutobatchPolicy.close`. With ``flush_in_caller=True`` (default) a
  client whose request would be a whole flushable batch by itself runs that forward
  pass in its own thread instead, without queueing it (``_flushes_alone``; one wake-up
  less each way; the answer is stored for it without an ``Event``), and
  :meth:`Agent.act` returns that answer directly. Forward passes never overlap (they
  run under ``_weights_lock``).
* A client (one per env thread) is an :class:`Agent` obtained from
  :meth:`AutobatchPolicy.register`; it stands for ``rows`` observations per
  request (``envs_per_thread``). It is **active** while registered and not
  parked: a client parks (:meth:`Agent.park`) before it blocks on anything but
  the policy (waiting for the main thread) and unparks after. Counts are
  per agent and can never go negative: parking twice is a no-op, and a closed
  agent no longer counts.
* :meth:`Agent.submit` queues one request of ``rows`` observations;
  :meth:`Agent.result` waits for its answer. The oldest queued requests, up to
  ``autobatch_size`` rows (whole requests, at least one), are flushed
  as soon as ``pending_rows >= min(active_rows, autobatch_size)``
  (the seed's rule, re-checked whenever a client parks or leaves), or when the
  oldest request has waited ``max_wait`` seconds.
* A flush is **split by exploration mode**: deterministic and random requests
  never share a forward pass (seed defect 1).
* :meth:`AutobatchPolicy.update` is applied by the inference thread *between*
  flushes: requests queued before the update are answered with the old weights
  first. Every answer carries the :attr:`~AutobatchPolicy.version` of the
  weights that produced it; each update increments it by one.
* :meth:`AutobatchPolicy.updates_held` pins the weights for a span (an on-policy
  collection call): an update made meanwhile, from any thread, waits in ``_held``
  and is applied when the last hold ends, so every answer of the span has one
  version. A hold starts once every update queued before it is applied
  (``_updates`` empty, none being applied: ``_applying``).
* Module weights carry their non-persistent buffers (``register_buffer(...,
  persistent=False)``, e.g. a running normaliser's statistics), which no
  ``state_dict`` holds: :meth:`AutobatchPolicy.update` copies them from the module
  given, or from ``buffers_from`` for a ``state_dict``.
* The policy is handed its own copy of every request's entries (a forward pass
  on a batch of several requests concatenates them anyway; a pass on another
  device moves them): a policy that writes into its input in place cannot change
  the observations stored by the loops, whatever the layout.
* A forward pass that raises, returns a batch of the wrong size or no
  ``action``, or does not write an output key the probe saw it write, fails every
  request it was answering with :class:`PolicyError` naming the key (the original
  exception chained). Every wait polls a stop flag, so nothing
  blocks forever.
* An error in the inference thread's own loop (not in a forward pass) marks the
  policy **failed** (``_failure``): the thread then answers every queued, taken
  and later request, and every pending update, with :class:`PolicyError` until
  :meth:`AutobatchPolicy.close`; :meth:`Agent.result` raises it too.
* ``policy_timeout`` bounds one forward pass: the inference thread stamps
  ``_busy_since`` / ``_busy_batch`` around each pass, and every waiting client
  checks the stamp each 50 ms. The first to see a pass older than the timeout
  marks the policy failed and its inference thread abandoned
  (:func:`lightning_rollout._exit.abandon`); all clients then raise. With a
  timeout, ``flush_in_caller`` is off (a caller cannot time out its own call),
  and :meth:`AutobatchPolicy.probe` runs the probe in a helper thread it waits for.

Locks: ``_lock`` (an ``RLock``, with ``_cond``, the :class:`threading.Condition`
on it, to wait and notify) guards the queue, the agent counts and the update list;
``_weights_lock`` guards the policy's parameters (held by whichever thread runs a
forward pass or applies an update, and by :meth:`state` and :meth:`set_version`,
which poll it and raise the policy's failure rather than wait for a pass stuck past
``policy_timeout``). Order: a thread holding ``_lock`` may try-acquire
``_weights_lock`` (never blocking); no thread holding ``_weights_lock`` takes
``_lock``. Both belong to this class alone. ``_lock`` is entered as ``with
self._lock`` (a C lock's ``__enter__``, which Ctrl-C cannot split), never as ``with
self._cond``: a ``KeyboardInterrupt`` in the main thread just after the Condition's
Python ``__enter__`` acquired the lock would leave it held by nobody's ``with``.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase, is_tensor_collection
from tensordict.nn import TensorDictModule, TensorDictModuleBase
from torchrl.envs.utils import ExplorationType, set_exploration_type

from ._checks import check_device, check_seconds
from ._exit import abandon, close_at_exit
from .errors import CollectionError, PolicyError

__all__ = ["Agent", "AutobatchPolicy", "BatchedRandomPolicy", "PolicyAnswer", "as_policy_module"]

NestedKey = str | tuple[str, ...]
_POLL_S = 0.05  # how often a blocked wait re-checks its stop flag
_SAME_WEIGHTS = object()  # update() was handed the acting policy itself
_NO_CONTEXT = contextlib.nullcontext()


class _ModuleState(NamedTuple):
    """The weights of a module handed to :meth:`AutobatchPolicy.update`: its ``state_dict`` and its
    non-persistent buffers (``{qualified name: tensor}``), which no ``state_dict`` holds."""

    state_dict: Mapping[str, Any]
    buffers: dict[str, torch.Tensor]


class PolicyAnswer:
    """The answer to one request: rows ``[start, stop)`` of a flushed batch.

    Attributes:
        outputs: ``{key: np.ndarray}`` for the *whole* flush, leading dim the
            flush size; ``"action"`` is always present, plus every extra key the
            policy wrote (``action_log_prob``, ``logits``, ``state_value``...).
        start, stop: this request's rows in ``outputs``.
        version: policy version that produced the rows.
    """

    __slots__ = ("outputs", "start", "stop", "version")

    def __init__(self, outputs: dict[NestedKey, np.ndarray], start: int, stop: int, version: int) -> None:
        self.outputs = outputs
        self.start = start
        self.stop = stop
        self.version = version


class _Request:
    __slots__ = ("agent", "obs", "rows", "mode", "t0")

    def __init__(self, agent: Agent, obs: dict[NestedKey, np.ndarray], rows: int, mode: ExplorationType) -> None:
        self.agent = agent
        self.obs = obs
        self.rows = rows
        self.mode = mode
        self.t0 = time.perf_counter()


class _Stopped(Exception):
    """Raised inside a wait when its stop flag was set (internal control flow)."""


class Agent:
    """One client of an :class:`AutobatchPolicy`; owned by a single thread.

    Obtained from :meth:`AutobatchPolicy.register`. Not thread-safe by design:
    one env thread submits, waits and parks through it. Usable as a context
    manager (``with policy.register(rows=1) as agent: ...`` closes it).

    Args:
        policy: the server.
        rows: observations per request (``>= 1``).
        env_ids: the envs this agent speaks for (used in error messages).
    """

    def __init__(self, policy: AutobatchPolicy, rows: int, env_ids: tuple[int, ...]) -> None:
        self._policy = policy
        self.rows = rows
        self.env_ids = env_ids
        self._active = True
        self._closed = False
        self._done = threading.Event()
        self._answer: PolicyAnswer | None = None
        self._error: BaseException | None = None
        # True while this agent's own thread runs the forward pass of its request (caller-runs flush):
        # the answer is then stored without ``_done`` (no Event.set / wait for a thread that is already
        # awake). Written by the owning thread only (False in submit, True in _enqueue under _lock when
        # it takes its own request), so it is False whenever another thread answers and reads it.
        self._inline = False

    # -- registration -------------------------------------------------------------
    def park(self) -> None:
        """Stop counting as active (about to block on something other than the policy)."""
        self._policy._set_active(self, False)

    def unpark(self) -> None:
        """Count as active again."""
        self._policy._set_active(self, True)

    def set_rows(self, rows: int) -> None:
        """Change how many rows this agent submits per request (and counts as active)."""
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self._policy._resize(self, rows)

    def close(self) -> None:
        """Unregister; idempotent. The server stops waiting for this agent."""
        if not self._closed:
            self._policy._set_active(self, False, close=True)

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests -------------------------------------------------------------------
    def submit(self, obs: Mapping[NestedKey, np.ndarray], *, deterministic: bool = False,
               exploration_type: ExplorationType | None = None) -> None:
        """Send one request of ``self.rows`` observations; answer with :meth:`result`.

        A request that is a whole flush by itself (the caller-runs flush, :meth:`AutobatchPolicy._flushes_alone`:
        nothing else queued, no weight update waiting) is answered here, in this thread; any other is queued for
        the inference thread.

        Args:
            obs: ``{key: array of shape [rows, *obs_shape]}`` for each input key.
            deterministic: act with ``ExplorationType.DETERMINISTIC`` instead of RANDOM.
            exploration_type: overrides ``deterministic`` when given.

        Raises:
            CollectionError: the policy was closed.
        """
        mode = _mode(deterministic, exploration_type)
        self._done.clear()
        self._answer, self._error = None, None
        try:
            self._answer = self._policy._call_alone(self, obs, mode)
        except PolicyError as error:
            self._error = error
        self._inline = self._answer is not None or self._error is not None
        if not self._inline:
            self._policy._enqueue(_Request(self, dict(obs), self.rows, mode))

    def act(self, obs: Mapping[NestedKey, np.ndarray], *, deterministic: bool = False,
            exploration_type: ExplorationType | None = None, stop: threading.Event | None = None) -> PolicyAnswer:
        """:meth:`submit` then :meth:`result`: the answer to one request of ``self.rows`` observations.

        Args:
            obs, deterministic, exploration_type: as for :meth:`submit`.
            stop: as for :meth:`result`.

        Raises:
            PolicyError, CollectionError, _Stopped: as :meth:`submit` and :meth:`result`.
        """
        self.submit(obs, deterministic=deterministic, exploration_type=exploration_type)
        return self.result(stop)

    def result(self, stop: threading.Event | None = None) -> PolicyAnswer:
        """Wait for the answer of the last :meth:`submit`.

        Every 50 ms the wait checks the policy's state, so it never outlives a
        failure: a closed policy, a failed inference thread, and (with
        ``policy_timeout``) a forward pass running longer than that, which this
        client then reports (the first to notice marks the policy failed and its
        inference thread abandoned).

        Args:
            stop: a flag checked every 50 ms; when set, the wait is abandoned.

        Raises:
            PolicyError: the forward pass for this request failed; the policy's
                inference thread failed; or a forward pass ran past ``policy_timeout``
                (the message names the timeout and the stuck thread, ``env_ids``
                the envs of that call). Once raised for a failed policy, every later
                request to it fails the same way.
            CollectionError: the policy was closed while waiting.
            _Stopped: ``stop`` was set (internal; loops turn it into a return).
        """
        if self._inline:  # answered in this thread, during submit
            self._inline = False
        else:
            self._wait_answer(stop)
        if self._error is not None:
            raise self._error
        assert self._answer is not None
        return self._answer

    def _wait_answer(self, stop: threading.Event | None) -> None:
        """Block until another thread answers the last request (see :meth:`result`)."""
        done, policy = self._done, self._policy
        while not done.wait(_POLL_S):
            if policy._closed:
                raise CollectionError("the policy was closed while a request was waiting")
            if stop is not None and stop.is_set():
                raise _Stopped()
            failure = policy._failure
            since = policy._busy_since
            if failure is None and since and policy.policy_timeout is not None:
                elapsed = time.perf_counter() - since
                if elapsed > policy.policy_timeout:
                    with policy._lock:  # one client marks the hang; the others read the same failure
                        if policy._failure is None and policy._busy_since == since:
                            thread = policy._thread
                            name = thread.name if thread is not None else "?"
                            busy = policy._busy_batch
                            policy._failure = PolicyError(
                                f"no answer within policy_timeout={policy.policy_timeout} s: a forward pass "
                                f"({sum(r.rows for r in busy)} rows) has run for {elapsed:.2f} s; thread {name!r} "
                                "is stuck inside the policy's call and is abandoned (daemon)",
                                env_ids=tuple(i for r in busy for i in r.agent.env_ids))
                            policy._abandoned = True
                            if thread is not None:
                                abandon(thread)
                        failure = policy._failure
            if failure is not None and not done.is_set():
                raise _copy(failure, failure.env_ids or self.env_ids)

    def _resolve(self, answer: PolicyAnswer | None, error: BaseException | None) -> None:
        self._answer = answer
        self._error = error
        self._done.set()


class AutobatchPolicy:
    """Answer observations from many threads with one batched forward pass.

    Args:
        policy: either a ``tensordict.nn.TensorDictModuleBase`` (a TorchRL actor:
            its ``in_keys`` are read from the observations, and ``action`` plus
            every other key it writes are returned), or a plain callable
            ``obs: Tensor[B, *obs_shape] -> action: Tensor[B, *action_shape]``
            (it reads the single observation key).
        autobatch_size: flush as soon as this many rows are queued, or all
            active rows when fewer are active; a forward pass takes at most this
            many rows (whole requests, at least one). ``None`` waits for every
            active row (lock-step) and takes all. Must be ``>= 1``.
        max_wait: seconds; flush a partial batch once its oldest request has
            waited this long. ``None`` never flushes early.
        device: where the forward pass runs; default: the device of the
            policy's first parameter, else CPU. Outputs come back on CPU.
        name: used in the inference thread's name.
        seed: sample from a CPU random stream of this seed, owned by the policy (its state is
            swapped in around each forward pass), so a stochastic policy draws the same actions run to
            run whatever other threads do with torch's global generator. ``None``: the global one.
        flush_in_caller: a request that is a whole flushable batch by itself runs its
            forward pass in the submitting thread (default; saves two thread hand-offs).
            ``False``: every forward pass
            runs on the inference thread. Forced to ``False`` by ``policy_timeout``.
        policy_timeout: seconds one call of the policy (a forward pass, or the
            probe at construction) may take; ``None`` (default): no limit. A pass
            that runs longer fails the requests waiting for it, and every later
            one, with :class:`PolicyError` naming the envs of the call; the thread
            stuck in it cannot be killed and is abandoned (a daemon, see
            :mod:`lightning_rollout._exit`). Separate from the loops' ``step_timeout``,
            which bounds env calls. Time spent waiting for a batch to fill is not counted.

    Raises:
        ValueError: ``autobatch_size < 1``; ``max_wait`` or ``policy_timeout`` not a
            finite number of seconds a wait can take (``max_wait >= 0``,
            ``policy_timeout > 0``, both at most ``threading.TIMEOUT_MAX``); a
            device that is not one or is not available here (``"cuda"`` without
            CUDA); a policy that is not callable.

    Thread safety: every public method may be called from any thread.
    """

    def __init__(self, policy: Callable[..., Any], *, autobatch_size: int | None = None,
                 max_wait: float | None = None, device: torch.device | str | None = None,
                 name: str = "policy", flush_in_caller: bool = True, seed: int | None = None,
                 policy_timeout: float | None = None) -> None:
        if not callable(policy):
            raise ValueError(f"policy must be a TensorDictModule or a callable, got {type(policy).__name__}")
        if autobatch_size is not None and (not isinstance(autobatch_size, (int, np.integer))
                                           or isinstance(autobatch_size, bool) or autobatch_size < 1):
            raise ValueError(f"autobatch_size must be a positive int or None, got {autobatch_size!r}")
        max_wait = check_seconds("max_wait", max_wait, allow_zero=True)
        policy_timeout = check_seconds("policy_timeout", policy_timeout, allow_zero=False)
        check_device("device", device)
        self.policy = as_policy_module(policy)
        # Whose weights update() / state() move: the object the user gave, even when it was wrapped to be
        # called on TensorDicts (its state_dict keys stay the user's, without the wrapper's "module." prefix).
        self.weights = getattr(self.policy, "_lr_wrapped", self.policy)
        self.autobatch_size = None if autobatch_size is None else int(autobatch_size)
        self.max_wait = max_wait
        self.policy_timeout = policy_timeout
        self.name = name
        # A forward pass run by a submitting thread could not be timed out by it: with a policy_timeout,
        # every pass runs on the inference thread, watched by the clients that wait for it.
        self.flush_in_caller = bool(flush_in_caller) and policy_timeout is None
        self._direct = _direct_module(self.policy)  # an exact TensorDictModule's inner module, called on tensors
        # Its positional inputs and its outputs, read once (the flush path runs for every step of every env).
        self._direct_in: list[NestedKey] = list(self.policy.in_keys) if self._direct is not None else []
        self._direct_out: list[NestedKey] = ([_as_key(k) for k in self.policy.out_keys]
                                             if self._direct is not None else [])
        self._device = torch.device(device) if device is not None else _module_device(self.policy)
        self._on_cpu = self._device.type == "cpu"
        self.input_keys: list[NestedKey] | None = None  # set by bind(): the keys every request carries
        self.output_keys: list[NestedKey] | None = None  # set by probe(): the keys every answer carries
        self.sub_batch: dict[tuple[str, ...], tuple[int, ...]] = {}  # nested batch dims of the inputs
        # Set by the loop: the batch dims a flush of every env's rows is called with, as TorchRL's collector
        # calls the policy on the env it is given: () for one unbatched env, a batched env's batch_size.
        # None (and always for a one-argument tensor function): [rows].
        self._env_shape: tuple[int, ...] | None = None
        # A seeded policy samples from its own CPU random stream (swapped in around each forward pass,
        # which run one at a time), so its draws do not depend on who else uses torch's global generator.
        # torch.set_num_threads is per thread: the inference thread runs forward passes with the setting of the
        # thread that built the policy (an OpenMP team of torch's default size would spin on every core).
        self._torch_threads = torch.get_num_threads()
        self._rng_state: torch.Tensor | None = None
        # The contexts of a forward pass, built once and reused: passes run one at a time (under
        # _weights_lock), and each context keeps its previous state on itself only from enter to exit.
        # A pass runs without autograd: under ``_no_grad`` in a thread that has it on (the probe, a user's thread
        # calling Agent.act), as it is in the loops' env threads and the inference thread, which turn it off once.
        self._no_grad = torch.no_grad()
        self._modes: dict[ExplorationType, set_exploration_type] = {}
        if seed is not None:
            generator = torch.Generator().manual_seed(int(seed))
            self._rng_state = generator.get_state()
        self._version = 0
        self._plain_state: Any = None  # state of a callable without state_dict
        # entered as ``with self._lock``, never ``with self._cond`` (see the module docs): a loop's driver, in the
        # main thread, parks and unparks agents, and a lock left held by Ctrl-C would block every env thread
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._weights_lock = threading.Lock()
        self._pending: list[_Request] = []
        self._pending_rows = 0
        self._active_rows = 0
        self._updates: list[tuple[Any, threading.Event]] = []
        # Weight pinning (updates_held): the threads holding it (one entry per hold), the updates made
        # meanwhile (applied when the last hold ends), and whether the inference thread has taken updates
        # it has not finished applying (a hold starts only once they are applied).
        self._holders: list[int] = []
        self._held: list[tuple[Any, threading.Event]] = []
        self._applying = False
        self._closed = False
        self._thread: threading.Thread | None = None
        # Failure and hang detection (see Agent.result and _serve).
        self._failure: PolicyError | None = None  # set once: every waiting and later request fails with it
        self._busy_since = 0.0  # perf_counter() while the inference thread runs a forward pass, else 0.0
        self._busy_batch: list[_Request] = []  # the requests of that pass
        self._abandoned = False  # the inference thread is stuck in the policy's call: close() does not wait
        # Statistics, read by benchmarks and tests (written under _weights_lock by whichever thread flushes).
        self.num_flushes = 0
        self.num_rows = 0

    # -- properties --------------------------------------------------------------
    @property
    def version(self) -> int:
        """Version of the current weights: 0 at start, +1 per :meth:`update`."""
        return self._version

    @property
    def pending_updates(self) -> int:
        """Updates made and not applied yet: queued for the inference thread, or held by
        :meth:`updates_held` until the pinned span ends."""
        return len(self._updates) + len(self._held) + int(self._applying)

    @property
    def in_keys(self) -> list[NestedKey] | None:
        """Keys the policy declares it reads (``None`` for a TensorDict function without ``in_keys``:
        it is handed every root entry)."""
        keys = getattr(self.policy, "in_keys", None)
        return None if keys is None else [_as_key(k) for k in keys]

    def bind(self, available: Mapping[NestedKey, Any], *, sub_batch: Mapping[tuple[str, ...], tuple[int, ...]] = {}
             ) -> list[NestedKey]:
        """Fix the keys every request carries, from the root entries an env provides.

        An exact ``TensorDictModule`` called on its inner module gets its ``in_keys``
        only; any other policy gets every entry (as TorchRL's collector hands it
        the whole root of its carrier). Returns those keys.

        Raises:
            ValueError: the policy reads keys the env does not provide.
        """
        declared = self.in_keys
        if self._direct is not None and declared is not None:
            missing = [k for k in declared if k not in available]
            if missing:
                raise ValueError(f"the policy reads {missing}, which the env does not provide "
                                 f"(root entries: {list(available)})")
            keys = list(declared)
        else:
            keys = list(available)
        self.input_keys = keys
        self.sub_batch = dict(sub_batch)
        return keys

    @property
    def device(self) -> torch.device:
        """Where the forward pass runs (inputs are moved there; outputs come back to the CPU)."""
        return self._device

    @property
    def env_shape(self) -> tuple[int, ...] | None:
        """The batch dims the policy is called with on a flush of ``prod(env_shape)`` rows (every env's):
        ``()`` for one unbatched env, ``(5, 2)`` for a batched env of that ``batch_size``; ``None``: ``[rows]``.
        Other flushes are called with ``[rows]``. Set by the loop before its probe."""
        return self._env_shape

    @env_shape.setter
    def env_shape(self, value: Sequence[int] | None) -> None:
        batched = value is None or getattr(self.policy, "_lr_batched", False)  # a tensor function: [rows]
        self._env_shape = None if batched else tuple(int(d) for d in value)

    def _call_shape(self, rows: int) -> tuple[int, ...]:
        """The batch dims of a call on ``rows`` rows (see :attr:`env_shape`)."""
        shape = self._env_shape
        return shape if shape is not None and math.prod(shape) == rows else (rows,)

    @property
    def mean_batch_size(self) -> float:
        """Mean rows per forward pass since creation (0.0 before the first)."""
        return self.num_rows / self.num_flushes if self.num_flushes else 0.0

    # -- registration ------------------------------------------------------------
    def register(self, rows: int = 1, *, env_ids: tuple[int, ...] = ()) -> Agent:
        """Register a client that submits ``rows`` observations per request.

        The agent counts as active from now until it parks or closes.

        Raises:
            CollectionError: the policy is closed.
            ValueError: ``rows < 1``.
        """
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        agent = Agent(self, rows, env_ids)
        with self._lock:
            if self._closed:
                raise CollectionError("cannot register on a closed AutobatchPolicy")
            self._active_rows += rows
            self._ensure_started()
            self._cond.notify()
        return agent

    def _set_active(self, agent: Agent, active: bool, close: bool = False) -> None:
        # The check is made under the lock: park/unpark/close may race (a loop's driver
        # holds an agent active while its env thread parks or closes it).
        with self._lock:
            if agent._closed:
                return
            if close:
                agent._closed = True
            if agent._active != active:
                agent._active = active
                self._active_rows += agent.rows if active else -agent.rows
            if not active and self._pending:  # only fewer active rows can make queued requests flushable
                self._cond.notify()

    def _resize(self, agent: Agent, rows: int) -> None:
        with self._lock:
            if agent._active and not agent._closed:
                self._active_rows += rows - agent.rows
            agent.rows = rows
            self._cond.notify()

    def _enqueue(self, request: _Request) -> None:
        with self._lock:
            if self._closed:
                raise CollectionError("the AutobatchPolicy is closed")
            self._pending.append(request)
            self._pending_rows += request.rows
            self._cond.notify()

    def _flushes_alone(self, rows: int) -> bool:
        """Whether a request of ``rows`` rows is flushed by itself in its caller's thread (``_lock`` held).

        Caller-runs flush: a request that is a whole flushable batch by itself (one thread serves every
        active env, e.g. envs_per_thread == num_envs) runs its forward pass in its own thread, saving the
        two wake-ups of a round trip through the inference thread. With requests of several threads the
        inference thread flushes (measured: having one client answer the others serialises their wake-ups
        behind it). So: the caller-runs flush is on, nothing is queued, no update waits, and the request
        is ready by itself (all the rows the flush rule waits for, or ``max_wait == 0``). The weights lock
        is then try-acquired before the queue is released, so no update slips in before the forward pass;
        on ``True`` the caller holds it and releases it after the pass. If it is busy, the request is
        queued and the inference thread flushes it.
        """
        return (self.flush_in_caller and not self._pending and not self._updates
                and (rows >= self._threshold() or self.max_wait == 0)
                and self._weights_lock.acquire(blocking=False))

    def _call_alone(self, agent: Agent, obs: Mapping[NestedKey, np.ndarray], mode: ExplorationType
                    ) -> PolicyAnswer | None:
        """:meth:`Agent.submit`'s request answered in this thread without queueing it, when it is a whole flush
        by itself (:meth:`_flushes_alone`); ``None`` otherwise (the caller queues it).

        Raises:
            PolicyError: the forward pass failed (naming the agent's envs).
        """
        with self._lock:
            if self._closed or not self._flushes_alone(agent.rows):
                return None
        try:
            outputs, version = self._compute([_Request(agent, obs, agent.rows, mode)])
        finally:
            self._weights_lock.release()
        return PolicyAnswer(outputs, 0, agent.rows, version)

    def probe(self, obs: Mapping[NestedKey, np.ndarray], rows: int = 1
              ) -> dict[NestedKey, tuple[tuple[int, ...], np.dtype]]:
        """Run the policy once on ``obs`` (``rows`` rows) in the caller's thread; fix and return its
        outputs: ``{key: (shape without batch dim, dtype)}`` for every entry it writes (nested keys and
        ``("next", ...)`` entries included). Used to preallocate storage; later answers carry these keys.

        With ``policy_timeout`` the call runs in a helper thread
        (``lightning_rollout-<name>-probe``) that the caller waits for at most that
        long; a probe that hangs is abandoned there and fails the policy.

        Raises:
            PolicyError: the policy failed, returned a malformed output, or did not
                answer within ``policy_timeout`` (every later request fails too).
        """
        self.output_keys = None
        request = _Request(Agent(self, rows, ()), dict(obs), rows, ExplorationType.RANDOM)

        def probe() -> dict[NestedKey, np.ndarray]:
            with self._weights_lock, self._no_grad:
                return self._run_policy([request], rows)

        try:
            outputs = call_bounded(probe, self.policy_timeout, name=f"lightning_rollout-{self.name}-probe",
                                   what=f"while probing the policy with {rows} observation(s) at construction")
        except _CallTimedOut as error:  # the stuck thread holds the weights: the policy is failed
            with self._lock:
                self._failure = self._failure or error
            raise
        except PolicyError:
            raise
        except Exception as exc:
            raise PolicyError(f"{type(exc).__name__}: {exc} (while probing the policy with the envs' first "
                              "observations)") from exc
        self.output_keys = list(outputs)
        return {k: (tuple(v.shape[1:]), v.dtype) for k, v in outputs.items()}

    # -- weights -------------------------------------------------------------------
    def update(self, state: Any, *, timeout: float | None = 60.0, buffers_from: torch.nn.Module | None = None) -> int:
        """Replace the weights; requests queued before this call get the old ones.

        While the weights are pinned (:meth:`updates_held`, an on-policy collection call), the update
        waits for the pinned span to end and is applied before the next one starts. Called from the
        thread that holds the pin (an event processor run during that collection call), it is not
        waited for: it is applied when the span ends, and a rejected ``state`` is then reported as a
        ``RuntimeWarning``.

        Non-persistent buffers (``register_buffer(..., persistent=False)``) are part of the weights:
        copied from ``state`` when it is a module, from ``buffers_from`` when it is a ``state_dict``
        (which never holds them), from the TensorDict when it is one (``TensorDict.from_module``).

        Args:
            state: a ``state_dict``, an ``nn.Module`` / ``TensorDictModule`` with the
                same parameters, a ``TensorDict`` of weights, or, for a plain callable
                without ``load_state_dict``, any object (kept and returned by :meth:`state`).
            timeout: seconds to wait for the update to be applied (a pinned span included).
            buffers_from: the module whose non-persistent buffers go with a ``state_dict``
                (typically the learner's module that ``state`` was taken from); ignored for
                other kinds of ``state``.

        Returns:
            The new :attr:`version` (called from the pinning thread: the version it will
            have once applied).

        Raises:
            CollectionError: closed, or not applied within ``timeout``.
            ValueError: the policy rejected ``state`` (wrong keys or shapes, a non-persistent
                buffer of another shape); the version is unchanged and collection goes on
                with the old weights; or ``timeout`` is not a finite number of seconds.
        """
        timeout = check_seconds("timeout", timeout, allow_zero=True)
        if state is self.policy or state is self.weights:
            state = _SAME_WEIGHTS  # the acting policy itself: weights are shared, only the version moves
        elif isinstance(state, torch.nn.Module):
            state = _ModuleState(state.state_dict(), _non_persistent_buffers(state))
        elif (isinstance(buffers_from, torch.nn.Module) and buffers_from is not self.weights
              and isinstance(state, Mapping) and not isinstance(state, TensorDictBase)):
            state = _ModuleState(state, _non_persistent_buffers(buffers_from))
        done = threading.Event()
        with self._lock:
            if self._closed:
                raise CollectionError("cannot update a closed AutobatchPolicy")
            if self._holders:  # pinned: applied when the span ends
                self._held.append((state, done))
                if threading.get_ident() in self._holders:  # the pinning thread cannot wait for its own span
                    done.unwaited = True  # type: ignore[attr-defined]
                    return self._version + len(self._held)
            elif self._thread is None:  # nothing queued: apply in place
                self._apply_update(state)
                return self._version
            else:
                self._updates.append((state, done))
                self._cond.notify()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done.wait(_POLL_S):
            if self._closed:
                raise CollectionError("the AutobatchPolicy was closed before the update was applied")
            if deadline is not None and time.monotonic() > deadline:
                raise CollectionError(f"policy update not applied within {timeout} s")
        error = getattr(done, "error", None)
        if error is not None:
            raise error
        return self._version

    @contextlib.contextmanager
    def _weights_held(self, what: str) -> Iterator[None]:
        """Hold ``_weights_lock`` for ``what``, polling every 50 ms: once the policy has failed (a forward
        pass stuck past ``policy_timeout`` keeps the lock forever), raise its failure instead of waiting."""
        while not self._weights_lock.acquire(timeout=_POLL_S):
            failure = self._failure
            if failure is not None:
                error = PolicyError(f"{what}: {failure.reason}", env_ids=failure.env_ids)
                raise error from failure
        try:
            yield
        finally:
            self._weights_lock.release()

    def state(self) -> Any:
        """A copy of the current weights (``state_dict`` tensors cloned), safe to keep.

        Raises:
            PolicyError: the policy failed while a forward pass holds the weights (one stuck past
                ``policy_timeout``): they cannot be read consistently.
        """
        with self._weights_held("the weights cannot be read"):
            if hasattr(self.weights, "state_dict"):
                return {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                        for k, v in self.weights.state_dict().items()}  # type: ignore[attr-defined]
            return copy.deepcopy(self._plain_state)

    def set_version(self, version: int) -> None:
        """Set the version counter (used when resuming from a checkpoint)."""
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        with self._weights_held("the version cannot be set"):
            self._version = version

    @contextlib.contextmanager
    def updates_held(self) -> Iterator[None]:
        """Pin the weights for the ``with`` block: every answer given meanwhile has one :attr:`version`.

        On entry, waits until every update made before it is applied (the inference thread applies
        them between flushes; the wait ends early once the policy is closed or failed, or a forward
        pass runs past ``policy_timeout``: the requests of the block then fail). Updates made during
        the block, from any thread, are applied once the last hold ends, in order, before any later
        hold starts. Holds may nest and overlap (several loops sharing this policy).

        Threading: entered and left by the same thread (a loop's driver).
        """
        me = threading.get_ident()
        try:  # entered before the hold is: a Ctrl-C anywhere after the append (even the wait) ends it below
            with self._lock:
                self._holders.append(me)
                while (self._updates or self._applying) and not self._closed and self._failure is None:
                    since = self._busy_since
                    if (since and self.policy_timeout is not None
                            and time.perf_counter() - since > self.policy_timeout):
                        break  # a stuck pass: the block's own requests report it
                    self._cond.wait(_POLL_S)
            yield
        finally:
            with self._lock:
                if me in self._holders:  # always, unless a Ctrl-C landed before the append itself ran
                    self._holders.remove(me)
                if not self._holders and self._held:
                    held, self._held = self._held, []
                    if self._closed:
                        for _, done in held:
                            done.error = CollectionError(  # type: ignore[attr-defined]
                                "the AutobatchPolicy was closed before the update was applied")
                            done.set()
                    else:  # applied by the inference thread; the next hold waits for them
                        self._updates.extend(held)
                        self._ensure_started()
                        self._cond.notify_all()

    def _apply_update(self, state: Any) -> None:
        with self._weights_lock:
            try:
                if state is _SAME_WEIGHTS:
                    pass
                elif isinstance(state, TensorDictBase) and isinstance(self.weights, torch.nn.Module):
                    state.to_module(self.weights)
                elif isinstance(state, _ModuleState) and hasattr(self.weights, "load_state_dict"):
                    pairs = (_buffer_targets(self.weights, state.buffers)
                             if isinstance(self.weights, torch.nn.Module) else [])
                    self.weights.load_state_dict(state.state_dict)  # type: ignore[attr-defined]
                    with torch.no_grad():
                        for target, value in pairs:
                            target.copy_(value)
                elif hasattr(self.weights, "load_state_dict"):
                    self.weights.load_state_dict(state)  # type: ignore[attr-defined]
                else:  # a callable without load_state_dict keeps what it was given (a module's state_dict)
                    self._plain_state = state.state_dict if isinstance(state, _ModuleState) else state
            except Exception as exc:  # the version does not move; the inference thread keeps serving
                raise ValueError(f"the policy rejected the new weights ({type(exc).__name__}: {exc}); pass a "
                                 "state_dict, TensorDict or module of the same architecture") from exc
            self._version += 1

    # -- lifecycle ------------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._thread is None:
            close_at_exit(self)  # the inference thread is stopped before the interpreter finalizes
            self._thread = threading.Thread(target=self._serve, name=f"lightning_rollout-{self.name}-inference",
                                            daemon=True)
            self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the inference thread, fail queued requests, join within ``timeout`` s. Idempotent.

        An inference thread stuck in the policy's call past ``policy_timeout`` is not
        waited for; it, or one still running after ``timeout``, is abandoned (a daemon
        that cannot crash the interpreter at exit, see :mod:`lightning_rollout._exit`).

        Raises:
            ValueError: ``timeout`` is not a finite number of seconds >= 0 (a join cannot take it).
        """
        timeout = check_seconds("timeout", timeout, allow_zero=True)
        if timeout is None:
            raise ValueError("timeout must be a finite number of seconds >= 0, got None")
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending, self._pending, self._pending_rows = self._pending, [], 0
            self._cond.notify_all()
        for request in pending:
            request.agent._resolve(None, CollectionError("the AutobatchPolicy was closed"))
        if self._thread is not None and self._thread is not threading.current_thread():
            if not self._abandoned:
                self._thread.join(timeout)
            if self._thread.is_alive():
                abandon(self._thread)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    # -- the inference thread --------------------------------------------------------
    def _threshold(self) -> int:
        """Queued rows that make a flush ready (``_lock`` held): every active row, at most ``autobatch_size``."""
        return self._active_rows if self.autobatch_size is None else min(self._active_rows, self.autobatch_size)

    def _ready(self, now: float) -> bool:
        if not self._pending:
            return False
        if self._pending_rows >= self._threshold():
            return True
        return self.max_wait is not None and now - self._pending[0].t0 >= self.max_wait

    def _take_batch(self) -> list[_Request]:
        """Dequeue the next batch (``_lock`` held): the oldest requests, up to ``autobatch_size`` rows
        (at least one request; a request is never split)."""
        if self.autobatch_size is None or self._pending_rows <= self.autobatch_size:
            batch, self._pending, self._pending_rows = self._pending, [], 0
            return batch
        rows, count = 0, 0
        for request in self._pending:
            if count and rows + request.rows > self.autobatch_size:
                break
            rows += request.rows
            count += 1
        batch, self._pending = self._pending[:count], self._pending[count:]
        self._pending_rows -= rows
        return batch

    def _serve(self) -> None:
        """The inference thread: flushes, weight updates, and the failed state.

        An error in this loop itself (a forward pass's own errors are answered by
        :meth:`_forward`) must not leave anyone waiting: the policy is marked failed
        and from then on this thread answers every request queued, taken or sent
        later, and every weight update, with :class:`PolicyError`, until
        :meth:`close`.
        """
        torch.set_num_threads(self._torch_threads)  # the constructing thread's setting, not torch's default
        torch.set_grad_enabled(False)  # this thread only runs forward passes and weight updates (see _compute)
        lock, cond = self._lock, self._cond
        batches: list[list[_Request]] = []  # taken from the queue, not answered yet
        updates: list[tuple[Any, threading.Event]] = []  # taken, not applied yet
        while True:
            try:
                with lock:
                    if self._applying:  # the updates taken last round are applied: a waiting hold may start
                        self._applying = False
                        cond.notify_all()
                    while True:
                        if self._closed:
                            return
                        if self._failure is not None:  # failed: answer everything with the failure, serve nothing
                            failed, self._pending, self._pending_rows = self._pending, [], 0
                            failed_updates, self._updates = self._updates, []
                            _fail_all(failed, failed_updates, self._failure)
                            cond.wait(_POLL_S * 4)
                            continue
                        if self._updates:  # everything queued before an update is answered with the old weights
                            while self._pending:
                                batches.append(self._take_batch())
                            break
                        if self._ready(time.perf_counter()):
                            batches.append(self._take_batch())
                            break
                        timeout = _POLL_S * 4
                        if self.max_wait is not None and self._pending:
                            timeout = max(0.0, self._pending[0].t0 + self.max_wait - time.perf_counter())
                        cond.wait(timeout)
                    updates, self._updates = self._updates, []
                    self._applying = bool(updates)
                while batches:
                    with self._weights_lock:
                        self._busy_batch = batches[0]  # watched by Agent.result for policy_timeout
                        self._busy_since = time.perf_counter()
                        try:
                            self._flush_locked(batches[0])
                        finally:
                            self._busy_since = 0.0
                    batches.pop(0)
                while updates:
                    state, done = updates.pop(0)
                    try:
                        self._apply_update(state)
                    except Exception as exc:  # re-raised by update() in its caller's thread
                        done.error = exc  # type: ignore[attr-defined]
                        if getattr(done, "unwaited", False):  # nobody waits for it: say so
                            warnings.warn(f"a weight update made during an on-policy collection call was "
                                          f"rejected when applied after it: {exc}", RuntimeWarning, stacklevel=1)
                    finally:
                        done.set()
            except BaseException as exc:  # noqa: BLE001 (nothing may end this thread silently)
                error = PolicyError(f"the inference thread {threading.current_thread().name!r} failed "
                                    f"({type(exc).__name__}: {exc}); this and every later request to this policy "
                                    "fail: close it and build a new one")
                error.__cause__ = exc
                with lock:
                    if self._failure is None:
                        self._failure = error
                    self._applying = False
                    self.flush_in_caller = False  # later requests reach this thread, which fails them
                    cond.notify_all()
                _fail_all([r for batch in batches for r in batch if not r.agent._done.is_set()], updates,
                          self._failure)
                batches, updates = [], []

    def _flush_locked(self, batch: list[_Request]) -> None:
        """Answer ``batch``, one forward pass per exploration mode (``_weights_lock`` held)."""
        first_mode = batch[0].mode
        if all(r.mode is first_mode for r in batch):
            self._forward(batch)
            return
        by_mode: dict[ExplorationType, list[_Request]] = {}
        for request in batch:
            by_mode.setdefault(request.mode, []).append(request)
        for group in by_mode.values():
            self._forward(group)

    def _forward(self, batch: list[_Request]) -> None:
        """Answer every request of ``batch`` from one forward pass (``_weights_lock`` held)."""
        try:
            outputs, version = self._compute(batch)
        except PolicyError as error:  # forwarded to every waiting client
            for request in batch:
                request.agent._resolve(None, error)
            return
        start = 0
        for request in batch:
            stop = start + request.rows
            request.agent._resolve(PolicyAnswer(outputs, start, stop, version), None)
            start = stop

    def _compute(self, batch: list[_Request]) -> tuple[dict[NestedKey, np.ndarray], int]:
        """One forward pass for ``batch`` (``_weights_lock`` held): its outputs and the weights' version. Every
        forward pass but the probe's takes this route, from the inference thread or from a client's own.

        Raises:
            PolicyError: the pass failed; it names the batch's envs, the original exception chained.
        """
        rows = batch[0].rows if len(batch) == 1 else sum(r.rows for r in batch)
        try:
            if torch.is_grad_enabled():  # a user's thread (Agent.act): no graph of the pass either
                with self._no_grad:
                    outputs = self._run_policy(batch, rows)
            else:  # the loops' env threads and the inference thread run with autograd off
                outputs = self._run_policy(batch, rows)
        except BaseException as exc:  # whatever the policy raised, as a PolicyError naming the envs
            raise _named(exc, tuple(i for r in batch for i in r.agent.env_ids))  # noqa: B904 (cause set there)
        self.num_flushes += 1
        self.num_rows += rows
        return outputs, self._version

    def _explore(self, mode: ExplorationType) -> set_exploration_type:
        """The (reusable) context that sets exploration ``mode``."""
        explore = self._modes.get(mode)
        if explore is None:
            explore = self._modes[mode] = set_exploration_type(mode)
        return explore

    def _run_policy(self, batch: list[_Request], rows: int) -> dict[NestedKey, np.ndarray]:
        if len(batch) > 1:  # rows in env order, whatever the arrival order: a flush is reproducible
            batch.sort(key=_first_env)
        # A tensor module gets only the entries it reads; a TensorDict policy every entry of the requests.
        keys = (self._direct_in if self._direct is not None
                else self.input_keys if self.input_keys is not None else list(batch[0].obs))
        # The policy gets its own copy of the entries (a request's arrays are views of the loops' storage): one
        # written in place cannot change a stored observation. Several requests are concatenated, and a move to
        # another device copies, anyway; one request on the CPU is copied (measured: < 1 us for CartPole rows).
        if len(batch) > 1:
            stacked = {k: torch.from_numpy(np.concatenate([r.obs[k] for r in batch])) for k in keys}
        else:
            tensor = _own_tensor if self._on_cpu else _as_tensor
            stacked = {k: tensor(batch[0].obs[k]) for k in keys}
        if not self._on_cpu:
            stacked = {k: v.to(self.device, non_blocking=True) for k, v in stacked.items()}
        shape = self._call_shape(rows)  # one env: its unbatched row, as TorchRL calls it
        if shape != (rows,):
            stacked = {k: v.reshape((*shape, *v.shape[1:])) for k, v in stacked.items()}
        with self._explore(batch[0].mode), (self._swapped_rng() if self._rng_state is not None else _NO_CONTEXT):
            if self._direct is not None:
                outputs = self._direct_outputs(self._direct(*[stacked[k] for k in keys]))
            else:
                outputs = self._call_tensordict(stacked, shape)
        if shape != (rows,):
            outputs = {k: v.reshape(rows, *v.shape[len(shape):]) for k, v in outputs.items()}
        _check_rows(outputs, rows)
        return outputs

    def _direct_outputs(self, result: Any) -> dict[NestedKey, np.ndarray]:
        """What the inner module returned, as numpy outputs by ``out_keys``. Raises :class:`PolicyError` for
        anything but one tensor per output key."""
        out_keys = self._direct_out
        if type(result) is torch.Tensor and len(out_keys) == 1:  # one output: the common case
            outputs = {out_keys[0]: _to_numpy(result, out_keys[0])}
        else:
            if isinstance(result, dict):
                missing = [k for k in out_keys if k not in result]
                if missing:
                    raise PolicyError(f"the policy did not write {missing[0]!r}: it returned a dict with keys "
                                      f"{sorted(map(str, result))}; expected the out_keys {out_keys}")
                result = tuple(result[k] for k in out_keys)
            result = result if isinstance(result, tuple) else (result,)
            if len(result) < len(out_keys):
                missing = out_keys[len(result):]
                raise PolicyError(f"the policy did not write {missing[0]!r}: it returned {len(result)} tensor(s) for "
                                  f"out_keys {out_keys}; return one tensor per output key at every call")
            if len(result) != len(out_keys):
                raise PolicyError(f"the policy returned a tuple of {len(result)} for out_keys {out_keys}: "
                                  "return one tensor per output key (or list every output in out_keys)")
            outputs = {k: _to_numpy(v, k) for k, v in zip(out_keys, result)}
        return outputs

    def _call_tensordict(self, stacked: dict[NestedKey, torch.Tensor], shape: tuple[int, ...]
                         ) -> dict[NestedKey, np.ndarray]:
        """A TensorDict policy on a TensorDict of the stacked entries (batch dims ``shape``): the entries it wrote."""
        td = TensorDict(stacked, batch_size=shape, device=self.device)
        for prefix, dims in self.sub_batch.items():
            if prefix in td.keys(True):
                td.get(prefix).batch_size = torch.Size([*shape, *dims])
        # Before an in-place policy: at the probe every leaf; later, the output keys the input carries (a root
        # output comes back as an input at the next step), whose value must be replaced, not left as given.
        given = (dict(td.items(True, True)) if self.output_keys is None
                 else {k: td.get(k) for k in self.output_keys if k in stacked})
        out = self.policy(td)
        if out is None:
            out = td
        if not isinstance(out, TensorDictBase):
            raise PolicyError(f"the policy returned {type(out).__name__}; a TensorDict policy must return "
                              "a TensorDict (wrap a tensor function in a TensorDictModule)")
        return self._outputs(out, given)

    @contextlib.contextmanager
    def _swapped_rng(self) -> Iterator[None]:
        saved = torch.get_rng_state()
        torch.set_rng_state(self._rng_state)
        try:
            yield
        finally:
            self._rng_state = torch.get_rng_state()
            torch.set_rng_state(saved)

    def _outputs(self, out: TensorDictBase, given: dict[NestedKey, Any]) -> dict[NestedKey, np.ndarray]:
        """The entries the policy wrote (``given``: the input's leaves before the call): at probe time every
        leaf that is new or was replaced, afterwards exactly those keys, each of them written again.

        Raises:
            PolicyError: after the probe, an output key is missing, or still holds the tensor it was handed
                (carried from the previous step, or written in place into it), naming the key.
        """
        if self.output_keys is None:
            keys = [k for k, v in out.items(True, True) if given.get(k, None) is not v]
            declared = getattr(self.policy, "out_keys", None) or []
            keys += [k for k in (_as_key(k) for k in declared) if k not in keys and k in out.keys(True, True)]
            if not keys:
                raise PolicyError("the policy wrote nothing (no action)")
        else:
            keys = self.output_keys
        outputs = {}
        for k in keys:
            value = out.get(k, None)
            if value is None:
                raise PolicyError(f"the policy did not write {k!r}, which it wrote when probed at construction")
            if given and value is given.get(k, None):
                raise PolicyError(f"the policy did not write {k!r}, which it wrote when probed at construction: its "
                                  f"input carries the previous step's {k!r}, returned as it was handed (write a new "
                                  "tensor for every output key at every call, not in place)")
            outputs[k] = _to_numpy(value, k)
        return outputs


class _CallTimedOut(PolicyError):
    """A :func:`call_bounded` call that did not return in time (its thread is abandoned)."""


def call_bounded(fn: Callable[[], Any], timeout: float | None, *, name: str, what: str) -> Any:
    """``fn()``, in the caller's thread when ``timeout`` is ``None``, else in a helper thread ``name``
    (a daemon) waited for at most ``timeout`` seconds: a call that hangs is abandoned there.

    Raises:
        PolicyError: the call did not return within ``policy_timeout={timeout}`` (``what`` says when).
        Exception: whatever ``fn`` raised.
    """
    if timeout is None:
        return fn()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    helper = threading.Thread(target=target, name=name, daemon=True)
    helper.start()
    helper.join(timeout)
    if helper.is_alive():
        abandon(helper)
        raise _CallTimedOut(f"no answer within policy_timeout={timeout} s {what}; thread {helper.name!r} is "
                            "stuck inside the policy's call and is abandoned (daemon)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def as_policy_module(policy: Any, *, observation_spec: Any = None, action_keys: Sequence[NestedKey] = ("action",),
                     single_key: NestedKey | None = "observation", action_spec: Any = None,
                     policy_timeout: float | None = None, name: str = "loop") -> Any:
    """Make ``policy`` callable on a TensorDict, as TorchRL's collectors do.

    * A ``TensorDictModuleBase`` (TorchRL actors, ``TensorDictSequential``,
      exploration modules...), TorchRL's ``RandomPolicy`` and a function whose one
      parameter is named ``tensordict`` / ``td`` or annotated as a TensorDict are
      used as they are.
    * An ``nn.Module`` or function whose parameter names are keys of
      ``observation_spec`` is wrapped in a ``TensorDictModule`` reading them and
      writing ``action_keys`` (then ``output1``, ``output2``... for extra outputs),
      by the rule of TorchRL's ``_make_compatible_policy``.
    * Beyond TorchRL: a function of one required argument with any other name
      reads ``single_key`` (the env's only observation), the tensor-in /
      action-out form the seed used.

    A spec-less ``RandomPolicy()`` and exploration modules built with ``spec=None``
    get ``action_spec`` (the env's full action spec), as TorchRL's collectors fill them.
    Wrapping calls the policy once on a sample of the spec (to count its outputs); with
    ``policy_timeout`` that call runs in a helper thread ``lightning_rollout-<name>-wrap``.

    Raises:
        TypeError: TorchRL cannot wrap it (its message says why).
        PolicyError: the wrapping call did not return within ``policy_timeout``.
    """
    from torchrl.envs.utils import RandomPolicy

    if isinstance(policy, RandomPolicy):
        return BatchedRandomPolicy.for_env(policy, action_spec)
    if isinstance(policy, TensorDictModuleBase):
        if action_spec is not None and isinstance(policy, torch.nn.Module):
            from torchrl.modules.tensordict_module.exploration import set_exploration_modules_spec_from_env

            spec = action_spec[action_keys[0]] if len(action_keys) == 1 else action_spec
            set_exploration_modules_spec_from_env(policy, SimpleNamespace(action_spec=spec, action_spec_unbatched=spec))
        return policy
    if not callable(policy):
        raise TypeError(f"the policy must be a TensorDictModule or a callable, got {type(policy).__name__}")
    wrapped = _wrap(policy, observation_spec, action_keys, single_key,
                    lambda fn: call_bounded(fn, policy_timeout, name=f"lightning_rollout-{name}-wrap",
                                            what="while wrapping the policy at construction (one call on a "
                                                 "sample of the observation spec)"))
    if wrapped is not policy:
        wrapped._lr_wrapped = policy  # the user's object keeps its weights and state_dict
    return wrapped


def _wrap(policy: Any, observation_spec: Any, action_keys: Sequence[NestedKey], single_key: NestedKey | None,
          call: Callable[[Callable[[], Any]], Any]) -> Any:
    """TorchRL's auto-wrapping rule (``torchrl.envs.utils._make_compatible_policy``), with its errors: the
    parameters of ``forward`` are matched by name against the observation keys. Unlike TorchRL's, the
    probe call passes only the matched keys, so envs with more observations than the policy reads work."""
    caller = getattr(policy, "forward", policy)
    try:
        params = inspect.signature(caller).parameters
    except (TypeError, ValueError):  # builtins: no signature to match
        params = {}
    names = set(params)
    if names in ({"tensordict"}, {"td"}) or (
            len(params) == 1 and is_tensor_collection(next(iter(params.values())).annotation)):
        return policy  # a function of a TensorDict
    if hasattr(policy, "in_keys") or hasattr(policy, "out_keys"):
        raise TypeError("Received a policy that defines in_keys or out_keys and also expects multiple arguments to "
                        "policy.forward. If the policy is compatible with TensorDict, it should take a single "
                        "argument of type TensorDict to policy.forward and define both in_keys and out_keys "
                        "(inherit from tensordict.nn.TensorDictModuleBase).")
    required = {n for n, p in params.items() if p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    spec_keys = {k for k in observation_spec.keys()} if observation_spec is not None else set()
    out_keys = list(action_keys)
    if observation_spec is not None and required <= spec_keys and required:
        in_keys = [n for n in params if n in spec_keys]
        sample = {k: observation_spec[k].rand() for k in in_keys}
        device = _module_device(policy)
        output = call(lambda: policy(**{k: v.to(device) for k, v in sample.items()}))
        if isinstance(output, tuple):
            out_keys += [f"output{i + 1}" for i in range(len(output) - 1)]
        return TensorDictModule(policy, in_keys=in_keys, out_keys=out_keys)
    if len(required) == 1 and single_key is not None and len(params) >= 1:
        # Beyond TorchRL: a one-argument tensor function reads the env's only observation.
        if observation_spec is not None and single_key in spec_keys:
            try:
                output = call(lambda: policy(observation_spec[single_key].rand((1,)).to(_module_device(policy))))
            except _CallTimedOut:  # a hang: no later probe may wait for it
                raise
            except Exception:  # the real probe, with every error named, comes later
                output = None
            if isinstance(output, tuple):
                out_keys += [f"output{i + 1}" for i in range(len(output) - 1)]
        wrapped = TensorDictModule(policy, in_keys=[single_key], out_keys=out_keys)
        wrapped._lr_batched = True  # the seed's tensor form: always called with a batch dim, even for one env
        return wrapped
    raise TypeError(  # TorchRL's own message (torchrl.envs.utils._make_compatible_policy)
        "This error is raised because TorchRL tried to automatically wrap your policy in\n"
        "a TensorDictModule. If you're confident the policy can directly process environment outputs, set\n"
        "the `trust_policy` argument to `True` in the constructor.\n\n"
        "Arguments to policy.forward are incompatible with entries in\n"
        f"env.observation_spec (got incongruent signatures:\nthe function signature is {names} but the specs have "
        f"keys {spec_keys}).\nIf you want TorchRL to automatically wrap your policy with a TensorDictModule\n"
        "then the arguments to policy.forward must correspond one-to-one with entries\n"
        "in env.observation_spec.\nFor more complex behavior and more control you can consider writing your\n"
        "own TensorDictModule.")


class BatchedRandomPolicy(TensorDictModuleBase):
    """TorchRL's ``RandomPolicy`` for a stack of ``k`` envs: samples the env's action spec with the
    TensorDict's batch size (``RandomPolicy`` samples the spec's own shape, which is one env's here).

    Args:
        action_spec: the env's action spec (a composite, or the spec of ``action_key``); a spec with
            batch dims (e.g. taken from a ``SerialEnv``) is reduced to one env's.
        action_key: where a non-composite spec's sample is written.
    """

    def __init__(self, action_spec: Any, *, action_key: NestedKey = "action") -> None:
        super().__init__()
        from torchrl.data import Composite

        spec = action_spec if isinstance(action_spec, Composite) else Composite({action_key: action_spec})
        while tuple(spec.shape):  # one env's spec: the flush gives the batch size
            spec = spec[0]
        self.action_spec = spec
        self.in_keys = []
        self.out_keys = list(self.action_spec.keys(True, True))

    @classmethod
    def for_env(cls, policy: Any, env_action_spec: Any) -> BatchedRandomPolicy:
        """From TorchRL's ``RandomPolicy``: its spec reduced to one env's (a spec taken from a batched env
        has extra leading dims), or the env's own when it has none."""
        spec = policy.action_spec if policy.action_spec is not None else env_action_spec
        if spec is None:
            raise TypeError("RandomPolicy() has no action_spec and no env spec was given to fill it")
        if policy.action_spec is None:
            policy.action_spec = spec.clone()  # as TorchRL's set_action_spec_from_env does
        from torchrl.data import Composite

        if not isinstance(spec, Composite) and env_action_spec is not None:
            leaf = env_action_spec[policy.action_key]
            for _ in range(len(spec.shape) - len(leaf.shape)):
                spec = spec[0]
        return cls(spec, action_key=policy.action_key)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        from .specs import random_sample  # finite samples where a Box bound is infinite, as gymnasium's

        return tensordict.update(random_sample(self.action_spec, tensordict.batch_size))


def _mode(deterministic: bool, exploration_type: ExplorationType | None) -> ExplorationType:
    """A request's exploration mode: ``exploration_type`` when given, else from ``deterministic``."""
    if exploration_type is not None:
        return exploration_type
    return ExplorationType.DETERMINISTIC if deterministic else ExplorationType.RANDOM


def _check_rows(outputs: dict[NestedKey, np.ndarray], rows: int) -> None:
    """Every output has the batch's ``rows`` rows; :class:`PolicyError` otherwise."""
    for key, value in outputs.items():
        if value.ndim == 0 or value.shape[0] != rows:
            shape = tuple(value.shape)
            raise PolicyError(f"'{key}' has shape {shape} for a batch of {rows} observations "
                              f"(the leading dim must be the batch size {rows})")


def _named(exc: BaseException, env_ids: tuple[int, ...]) -> PolicyError:
    """``exc``, raised by a forward pass for the envs ``env_ids``, as the :class:`PolicyError` to raise: a
    PolicyError that names no env gets them; anything else is wrapped, chained as the cause."""
    if isinstance(exc, PolicyError):  # raised by our own checks, which do not know the envs
        error = exc if exc.env_ids else PolicyError(exc.reason, env_ids=env_ids)
    else:
        error = PolicyError(f"{type(exc).__name__}: {exc}", env_ids=env_ids)
    if error is not exc:
        error.__cause__ = exc
    return error


def _first_env(request: _Request) -> int:
    ids = request.agent.env_ids
    return ids[0] if ids else -1


def _copy(failure: PolicyError, env_ids: tuple[int, ...]) -> PolicyError:
    """A copy of a failed policy's ``failure`` naming ``env_ids``, with its cause."""
    error = PolicyError(failure.reason, env_ids=env_ids)
    error.__cause__ = failure.__cause__
    return error


def _fail_all(requests: list[_Request], updates: list[tuple[Any, threading.Event]], failure: PolicyError) -> None:
    """Answer ``requests`` and fail the weight ``updates`` waiting in :meth:`AutobatchPolicy.update` with a copy
    of ``failure`` (a failed policy); a request's copy names its own envs when the failure names none."""
    for request in requests:
        request.agent._resolve(None, _copy(failure, failure.env_ids or request.agent.env_ids))
    for _, done in updates:
        if not done.is_set():
            done.error = _copy(failure, failure.env_ids)  # type: ignore[attr-defined]
            done.set()


def _as_key(key: Any) -> NestedKey:
    if isinstance(key, tuple) and len(key) == 1:
        return key[0]
    return key


def _direct_module(policy: Any) -> Callable[..., Any] | None:
    """The inner module of a plain ``TensorDictModule`` (positional in_keys, no method, hooks or key remapping),
    which is called on the stacked tensors directly: TensorDict dispatch costs ~70 us a flush, more than a
    small MLP's forward. Anything else (subclasses such as ProbabilisticActor, sequences) returns None."""
    if type(policy) is not TensorDictModule or policy._forward_hooks or policy._forward_pre_hooks:
        return None
    if (policy._kwargs is not None or policy.method is not None or policy.method_kwargs or policy._get_kwargs
            or getattr(policy, "out_to_in_map", None)):
        return None
    return policy.module



def _as_tensor(value: Any) -> torch.Tensor:
    """``value`` as a tensor sharing its memory; ``torch.from_numpy`` for an array (a third of
    ``torch.as_tensor``'s cost, which is paid for every flush)."""
    return torch.from_numpy(value) if type(value) is np.ndarray else torch.as_tensor(value)


def _own_tensor(value: Any) -> torch.Tensor:
    """``value`` as a tensor of its own memory (a copy): what the policy writes into it stays there."""
    if type(value) is np.ndarray:
        return torch.from_numpy(value.copy())
    return torch.as_tensor(value).clone()


def _to_numpy(value: Any, key: NestedKey = "action") -> np.ndarray:
    if not isinstance(value, torch.Tensor):
        if isinstance(value, (tuple, list)):
            raise PolicyError(f"the policy returned a {type(value).__name__} for {key!r}; a tensor function must "
                              "return one tensor per output key (wrap it in a TensorDictModule with out_keys=[...])")
        raise PolicyError(f"the policy returned {type(value).__name__} for {key!r}, not a tensor")
    if value.requires_grad:  # not under no_grad: a tensor the policy kept (a parameter, a cached output)
        value = value.detach()
    if not value.is_cpu:
        value = value.cpu()
    return value.numpy()


def _non_persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s non-persistent buffers (``register_buffer(..., persistent=False)``), by qualified name."""
    found: dict[str, torch.Tensor] = {}
    for prefix, sub in module.named_modules():
        for name in sub._non_persistent_buffers_set:
            value = sub._buffers.get(name)
            if value is not None:
                found[f"{prefix}.{name}" if prefix else name] = value
    return found


def _buffer_targets(module: torch.nn.Module, buffers: Mapping[str, torch.Tensor]
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(target, value)`` pairs: each of ``buffers`` (qualified name: tensor) with ``module``'s non-persistent
    buffer of that name, checked before anything is copied.

    Raises:
        ValueError: ``module`` has no non-persistent buffer of a name, or one of another shape.
    """
    if not buffers:
        return []
    own = _non_persistent_buffers(module)
    pairs = []
    for name, value in buffers.items():
        target = own.get(name)
        if target is None:
            raise ValueError(f"non-persistent buffer {name!r} of the source has no counterpart in the acting policy "
                             f"(its non-persistent buffers: {sorted(own)})")
        if target.shape != value.shape:
            raise ValueError(f"non-persistent buffer {name!r} has shape {tuple(value.shape)} in the source and "
                             f"{tuple(target.shape)} in the acting policy")
        pairs.append((target, value))
    return pairs


def _module_device(policy: Any) -> torch.device:
    if isinstance(policy, torch.nn.Module):
        for p in policy.parameters():
            return p.device
    return torch.device("cpu")
