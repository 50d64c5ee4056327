"""One block of envs, stepped together by one thread, writing into caller-owned arrays.

An :class:`EnvBlock` is what an env thread steps in-process and what a block server
steps in a worker process (:mod:`lightning_rollout.loop.process`): the same code on
both sides. A step takes the block's inputs for ``n`` of its envs (row ``i`` is env
``envs[i]``) and writes each env's ``"next"`` entries, reward and flags into row
``i`` of the arrays it is given: no per-env dictionaries on the way out, and for
gymnasium envs with one array observation none on the way in either (actions are
converted and validated once for the block, observations are checked once for the
block). Errors come out as :class:`EnvFailure`, naming the env's index in the block
and the phase, which the caller turns into the user-facing error.

Threading: a block is owned by one thread. ``busy_env``, ``busy_phase`` and
``busy_since`` are plain attributes written by that thread around each env call and
read, without a lock, by the driver's ``step_timeout`` check (a stale read costs at
most one check period).

With ``parallel=True`` the block's envs step concurrently, each in its own helper
thread (``lightning_rollout-<name>-env<i>-step``, a daemon), for envs whose step
releases the GIL (C simulators, sleeps, I/O). Protocol (:class:`_StepThreads`): the
owner writes env ``j``'s call into ``calls[j]`` and releases ``go[j]`` (a lock held
while there is nothing to do); helper ``j`` acquires it, runs the call, stores the
result or the exception in ``results[j]`` and puts ``j`` on the ``done`` queue; the
owner waits for every ``j`` of the step (polling its stop flag every 50 ms), then
checks and writes the results in env order, so errors are raised as in a sequential
step (the lowest env index first) and no helper is left running a call. Resets,
random actions and all bookkeeping stay in the owner thread. Helpers poll their lock
every 50 ms and exit once the block is closed; one stuck inside an env call is
abandoned (daemon).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .._exit import abandon
from ..envs import ActionError, EnvAdapter, GymAdapter
from ..specs import ArraySpec, NestedKey
from .buffers import check_entries

__all__ = ["EnvBlock", "EnvFailure", "RemoteTraceback"]


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process (chained as the cause of the error)."""


class EnvFailure(Exception):
    """An env call of a block failed (internal: the env thread names the env and step).

    Attributes:
        j: the env's index in its block.
        phase: ``"reset"``, ``"step"``, ``"check"`` or ``"create"``.
        kind: ``"env"``, or ``"action"`` when the policy's action was invalid.
        cause: the exception (or its remote traceback).
        process: the index of the worker process the env runs in (``None``: in-process).
    """

    process: int | None = None

    def __init__(self, j: int, phase: str, kind: str, cause: BaseException) -> None:
        remote = isinstance(cause, RemoteTraceback)  # its text starts with the remote "Type: message" line
        if remote:
            text = str(cause).split("\n", 1)[0]
        elif kind == "action" or phase == "check":  # our own messages: no exception type in front
            text = str(cause)
        else:
            text = f"{type(cause).__name__}: {cause}"
        super().__init__(text)
        self.j, self.phase, self.kind, self.cause = j, phase, kind, cause


class _CheckFailed(Exception):
    """What an env returned does not match its spec (the message of :func:`check_entries`)."""


_POLL_S = 0.05


class _StepThreads:
    """One helper thread per env of a block; :meth:`run` hands each env its call and waits for all."""

    def __init__(self, n: int, *, name: str, env_ids: Sequence[int]) -> None:
        self._go = [threading.Lock() for _ in range(n)]
        for go in self._go:
            go.acquire()  # held: nothing to do
        self._calls: list[tuple[Callable[[Any], Any], Any] | None] = [None] * n
        self.results: list[tuple[bool, Any] | None] = [None] * n  # (ok, value or exception)
        self._done: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._closed = False
        self.threads = [threading.Thread(target=self._serve, args=(j,), daemon=True,
                                         name=f"lightning_rollout-{name}-env{env_ids[j]}-step") for j in range(n)]
        for thread in self.threads:
            thread.start()

    def _serve(self, j: int) -> None:
        go = self._go[j]
        while True:
            if not go.acquire(timeout=_POLL_S):
                if self._closed:
                    return
                continue
            if self._closed:
                return
            call = self._calls[j]
            assert call is not None
            try:
                self.results[j] = (True, call[0](call[1]))
            except BaseException as exc:  # re-raised by the owner, in env order
                self.results[j] = (False, exc)
            self._calls[j] = None
            self._done.put(j)

    def run(self, calls: Sequence[tuple[int, Callable[[Any], Any], Any]], owner: EnvBlock,
            stop: threading.Event | None) -> None:
        """Run ``fn(arg)`` for each ``(j, fn, arg)`` in helper ``j``; return once every one ended
        (results in :attr:`results`). Keeps ``owner.busy_env`` at the lowest env still stepping.

        Raises:
            _Stopped: ``stop`` was set while waiting (the loop is closing).
        """
        from ..policy import _Stopped

        pending = set()
        for j, fn, arg in calls:
            self._calls[j] = (fn, arg)
            pending.add(j)
            self._go[j].release()
        while pending:
            owner.busy_env = min(pending)
            try:
                pending.discard(self._done.get(timeout=_POLL_S))
            except queue.Empty:
                if stop is not None and stop.is_set():
                    raise _Stopped() from None

    def close(self, timeout: float = 1.0) -> None:
        """Let every helper exit; one still inside an env call after ``timeout`` s is abandoned."""
        self._closed = True
        for go in self._go:
            try:
                go.release()
            except RuntimeError:  # not held: that helper is busy and will see the flag
                pass
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
                if thread.is_alive():
                    abandon(thread)


class EnvBlock:
    """The envs of one block: reset, step and sample random actions, writing into given arrays.

    Args:
        adapters: the block's envs (index ``j`` in the block).
        validate: check each observation against ``checked_next`` / ``checked_root``
            (shape, dtype, NaN) and each action against the action space.
        checked_next: the ``"next"`` entries to check after a step (``{key: ArraySpec}``).
        checked_root: the root entries to check after a reset.
        zero_done: root done flags a TorchRL env reads at the root: passed as zeros.
        parallel: step the envs concurrently, one helper thread each (see the module docs);
            ignored for a block of one env.
        name, env_ids: name the helper threads (``lightning_rollout-<name>-env<id>-step``).
    """

    def __init__(self, adapters: Sequence[EnvAdapter], *, validate: bool,
                 checked_next: Mapping[NestedKey, ArraySpec], checked_root: Mapping[NestedKey, ArraySpec],
                 zero_done: Mapping[NestedKey, ArraySpec], parallel: bool = False, name: str = "loop",
                 env_ids: Sequence[int] | None = None) -> None:
        self.adapters = list(adapters)
        self._threads = (_StepThreads(len(self.adapters), name=name,
                                      env_ids=env_ids if env_ids is not None else range(len(self.adapters)))
                         if parallel and len(self.adapters) > 1 else None)
        self.validate = validate
        self.checked_next = dict(checked_next)
        self.checked_root = dict(checked_root)
        self.zero_done = {k: np.zeros(spec.shape, bool) for k, spec in zero_done.items()}
        self.busy_env = -1
        self.busy_phase = "step"
        self.busy_since = 0.0  # perf_counter() while inside an env call, else 0.0
        first = self.adapters[0]
        # The fast path: gymnasium envs with one array observation and no info entries, one action space.
        self._gym = (all(isinstance(a, GymAdapter) and a.plain_observation for a in self.adapters)
                     and all(a.action_space == first.action_space for a in self.adapters[1:]))
        spec = self.checked_next.get("observation")
        self._obs_spec = (spec.shape, spec.dtype) if spec is not None else None
        self._accepted_dtypes: set[np.dtype] = set()  # observation dtypes seen to cast safely to the column's

    # -- calls ------------------------------------------------------------------------
    # ``stop`` keeps the signatures of RemoteEnvs (whose calls wait on another process); here only a
    # parallel step waits on something (its helper threads) and polls it.
    def reset(self, j: int, seed: int | None, stop: threading.Event | None = None) -> dict[NestedKey, Any]:
        """Reset env ``j``; its root entries, checked. Raises :class:`EnvFailure`."""
        self.busy_env, self.busy_phase, self.busy_since = j, "reset", time.perf_counter()
        try:
            root = self.adapters[j].reset(seed)
        except Exception as exc:
            raise EnvFailure(j, "reset", "env", exc) from exc
        finally:
            self.busy_since = 0.0
        if self.validate:
            problem = check_entries(root, self.checked_root)
            if problem is not None:
                raise EnvFailure(j, "check", "env", _CheckFailed(problem))
        return root

    def random_action(self, j: int, columns: Mapping[NestedKey, ArraySpec],
                      stop: threading.Event | None = None) -> dict[NestedKey, np.ndarray]:
        """A uniformly random valid action of env ``j``, laid out as ``columns``."""
        return self.adapters[j].random_action(columns)

    def step(self, inputs: Mapping[NestedKey, np.ndarray], envs: Sequence[int], out: Mapping[NestedKey, np.ndarray],
             rewards: np.ndarray, terminated: np.ndarray, truncated: np.ndarray,
             stop: threading.Event | None = None) -> None:
        """Step envs ``envs`` with row ``i`` of ``inputs`` for env ``envs[i]``; write its ``"next"``
        entries to row ``i`` of ``out`` (keyed by the env's key, without ``"next"``), its reward and
        flags to ``rewards[i]``, ``terminated[i]``, ``truncated[i]``. Raises :class:`EnvFailure`."""
        if self._gym:
            self._step_gym(inputs["action"], envs, out, rewards, terminated, truncated, stop)
            return
        adapters, zero_done, validate, checked = self.adapters, self.zero_done, self.validate, self.checked_next
        rows = []
        for i in range(len(envs)):
            row = {k: v[i] for k, v in inputs.items()}
            row.update(zero_done)
            rows.append(row)
        parallel = self._threads is not None and len(envs) > 1
        if parallel:
            self._run_parallel([(j, adapters[j].step, row) for j, row in zip(envs, rows)], stop)
        for i, j in enumerate(envs):
            if parallel:
                result = self._parallel_result(j)
            else:
                self.busy_env, self.busy_since = j, time.perf_counter()
                try:
                    result = adapters[j].step(rows[i])
                except ActionError as exc:  # the policy's fault, not the env's
                    raise EnvFailure(j, "step", "action", exc) from exc
                except Exception as exc:
                    raise EnvFailure(j, "step", "env", exc) from exc
                finally:
                    self.busy_since = 0.0
            nxt, rewards[i], terminated[i], truncated[i] = result
            if validate:
                problem = check_entries(nxt, checked)
                if problem is not None:
                    raise EnvFailure(j, "check", "env", _CheckFailed(problem))
            for k, buf in out.items():
                buf[i] = nxt[k]

    def _run_parallel(self, calls: Sequence[tuple[int, Callable[[Any], Any], Any]],
                      stop: threading.Event | None) -> None:
        assert self._threads is not None
        self.busy_env, self.busy_since = calls[0][0], time.perf_counter()
        try:
            self._threads.run(calls, self, stop)
        finally:
            self.busy_since = 0.0

    def _parallel_result(self, j: int) -> Any:
        """Env ``j``'s result of the parallel step just run; its exception as an :class:`EnvFailure`."""
        assert self._threads is not None
        ok, value = self._threads.results[j]  # type: ignore[misc]
        self._threads.results[j] = None
        if ok:
            return value
        kind = "action" if isinstance(value, ActionError) else "env"
        if not isinstance(value, Exception):  # KeyboardInterrupt, SystemExit in a helper: not an env error
            raise value
        raise EnvFailure(j, "step", kind, value) from value

    def _step_gym(self, actions: np.ndarray, envs: Sequence[int], out: Mapping[NestedKey, np.ndarray],
                  rewards: np.ndarray, terminated: np.ndarray, truncated: np.ndarray,
                  stop: threading.Event | None = None) -> None:
        """Gymnasium envs with one array observation: actions converted for the block at once, each
        ``env.step`` result written straight to its row, observations checked for the block."""
        adapters = self.adapters
        try:
            env_actions = adapters[0].actions(actions)
        except ActionError:  # find the env whose action is invalid, for the message
            for i, j in enumerate(envs):
                try:
                    adapters[j].actions(actions[i:i + 1])
                except ActionError as exc:
                    raise EnvFailure(j, "step", "action", exc) from exc
            raise
        obs_out = out["observation"]
        expected = self._obs_spec if self.validate else None
        parallel = self._threads is not None and len(envs) > 1
        if parallel:
            self._run_parallel([(j, adapters[j].env.step, a) for j, a in zip(envs, env_actions)], stop)
        for i, j in enumerate(envs):
            if parallel:
                obs, rewards[i], terminated[i], truncated[i], _ = self._parallel_result(j)
            else:
                self.busy_env, self.busy_since = j, time.perf_counter()
                try:
                    obs, rewards[i], terminated[i], truncated[i], _ = adapters[j].env.step(env_actions[i])
                except Exception as exc:
                    raise EnvFailure(j, "step", "env", exc) from exc
                finally:
                    self.busy_since = 0.0
            if expected is not None and (getattr(obs, "shape", None) != expected[0] or (
                    getattr(obs, "dtype", None) != expected[1]
                    and getattr(obs, "dtype", None) not in self._accepted_dtypes)):
                obs = np.asarray(obs)
                problem = check_entries({"observation": obs}, self.checked_next)
                if problem is not None:
                    raise EnvFailure(j, "check", "env", _CheckFailed(problem))
                if type(obs) is np.ndarray and obs.shape == expected[0]:
                    self._accepted_dtypes.add(obs.dtype)  # e.g. float64 observations of a float32 space
            obs_out[i] = obs
        if expected is not None and obs_out.dtype.kind == "f":
            n = len(envs)
            bad = np.isnan(obs_out[:n].reshape(n, -1)).any(axis=1)
            if bad.any():
                i = int(bad.argmax())
                raise EnvFailure(envs[i], "check", "env", _CheckFailed("entry 'observation' contains NaN"))

    def close(self) -> None:
        """Stop the helper threads, close every env; errors are swallowed (closing must not hide the
        error being raised)."""
        if self._threads is not None:
            self._threads.close()
        for adapter in self.adapters:
            try:
                adapter.close()
            except Exception:
                pass
