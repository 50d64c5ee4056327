"""Worker processes: ``num_workers`` contiguous shards of whole units; the stepping thread steps shard 0 itself,
child processes the others (a :class:`SerialEnvs` each), one message a shard a step, over
:class:`~lightning_rollout.envs.Slots` in shared memory (a message orders every write before the other side reads).
The parent sends ``("build", pickled_factories, environ)``, ``("attach", slots)``, ``("step", rows)``,
``("reset", rows, seeds)``, ``("close",)``; a child answers ``("started",)``, ``("ready", keys, roots)``,
``("ok", kind, rows)`` or ``("failed", row, phase, kind, text, completed, lost)``. Children are forked by
multiprocessing's fork server, which imports this module once a process (``spawn`` where there is none); each imports
the main module again and takes the parent's environment variables of the moment, as with ``spawn``. Not daemonic
(an env may start processes), SIGINT ignored, torch on one thread, and end with the parent (a watchdog).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import wait as wait_for
from typing import Any

import numpy as np
import torch

from .._exit import exempt_at_exit, sigint_blocked
from ..envs import EnvFactory, EnvFailure, Explained, InfoKeys, RemoteTraceback, Slots
from ..errors import CollectionError
from ..specs import ArraySpec, NestedKey
from .executors import Envs, POLL_S, SerialEnvs, ThreadEnvs, build_units, merged_rows, split_rows

__all__ = ["ProcessEnvs", "WorkerDied", "check_picklable"]

_BUILD_TIMEOUT_S = 120.0  # seconds a child may take to build and reset its envs
_FDS = ("; if this process ran out of file descriptors, raise the open-files limit (ulimit -n) or use fewer worker "
        "processes")


class WorkerDied(RuntimeError):
    """A worker process ended without reporting an error (chained as the cause of the loop's error)."""


def check_picklable(factories: Sequence[EnvFactory]) -> list[bytes]:
    """Each env factory pickled (what a worker process is sent), or a ``ValueError`` saying what to do."""
    blobs: dict[int, bytes] = {}
    for i, factory in enumerate(factories):
        if id(factory) not in blobs:
            try:
                blobs[id(factory)] = pickle.dumps(factory)
            except Exception as exc:
                raise ValueError(
                    f"num_workers > 1 runs envs in worker processes, which need the env factory to be picklable; "
                    f"env {i}'s factory {factory!r} is not ({type(exc).__name__}: {exc}). Define it at module level "
                    "(not a lambda or a local function), or pass a gymnasium id or a functools.partial of a "
                    "module-level function") from exc
    return [blobs[id(factory)] for factory in factories]


def _shared_zeros(shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """A torch tensor of zeros in shared memory (slots of these are sent to a child: :func:`_numpy` reads them)."""
    return torch.zeros(shape, dtype=torch.from_numpy(np.empty(0, dtype)).dtype).share_memory_()


def _numpy(tensors: Slots) -> Slots:
    """``tensors`` as numpy arrays over the same memory."""
    return Slots(*({k: v.numpy() for k, v in f.items()} if isinstance(f, dict) else f.numpy()
                   for f in vars(tensors).values()))


def _context() -> Any:
    """The workers' multiprocessing context: its fork server, which imports this module once a process, or ``spawn``
    where there is none."""
    if "forkserver" not in mp.get_all_start_methods():
        return torch.multiprocessing.get_context("spawn")
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def _watch_parent() -> None:
    """End this process as soon as the parent dies (no orphans)."""
    if (parent := mp.parent_process()) is not None:
        wait_for([parent.sentinel])
        os._exit(0)


def _explained(text: str, cause: BaseException) -> Explained:
    """An :class:`Explained` error chained to ``cause`` (so its traceback travels to the parent)."""
    error = Explained(text)
    error.__cause__ = cause
    return error


def _send(conn: Any, message: tuple[Any, ...]) -> None:
    conn.send_bytes(pickle.dumps(message))


def _factory(i: int, blob: bytes) -> EnvFactory:
    try:
        return pickle.loads(blob)
    except BaseException as exc:  # noqa: BLE001 - named, then reported
        raise EnvFailure(i, "reset", "env", _explained(
            f"the env factory could not be unpickled in the worker process ({type(exc).__name__}: {exc}); "
            "it must be importable in a fresh process (a module's function or class)", exc)) from exc


def _child_main(conn: Any, seeds: list[int | None], a: int, group: int, options: dict[str, Any]) -> None:
    """A worker process: build its shard (its pickled env factories arrive after ``("started",)``), serve its
    steps, then end (``os._exit``) with every env closed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it closes us
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    watchdog = threading.Thread(target=_watch_parent, name="lightning_rollout-worker-watchdog", daemon=True)
    exempt_at_exit(watchdog)
    watchdog.start()
    envs: SerialEnvs | None = None
    try:
        _send(conn, ("started",))
        _, blobs, environ = conn.recv()
        os.environ.clear()  # the parent's of now, not the fork server's of its start (an env may read them)
        os.environ.update(environ)
        envs = SerialEnvs(build_units([_factory(i, b) for i, b in enumerate(blobs)], group=group, **options), seeds)
        _send(conn, ("ready", envs.unit.keys, envs.roots))
        try:
            message = conn.recv()  # the shared buffers: their file descriptors arrive with it
            envs.use(_numpy(message[1]).rows(a, a + envs.num_envs))
        except Exception as exc:
            raise EnvFailure(0, "reset", "env", _explained(
                f"could not attach the shared buffers of envs {list(range(a, a + envs.num_envs))} "
                f"({type(exc).__name__}: {exc}){_FDS}", exc)) from exc
        _send(conn, ("ok", "attach", None))
        while (message := conn.recv())[0] != "close":
            kind, rows = message[0], message[1]
            if kind == "step":
                envs.send(np.arange(envs.num_envs) if rows is None else rows)
                envs.recv(0, 0.0)
            else:
                envs.reset(rows, message[2])
            _send(conn, ("ok", kind, rows))
    except EnvFailure as failure:
        _send(conn, ("failed", failure.row, failure.phase, failure.kind,
                     f"{failure}\n\n{''.join(traceback.format_exception(failure.cause))}".rstrip(),
                     failure.completed, failure.lost))
    except BaseException as exc:  # noqa: BLE001 - reported, then the process ends
        with contextlib.suppress(Exception):  # the pipe is gone: the parent sees the death
            _send(conn, ("failed", 0, "step", "env", f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}",
                         np.empty(0, np.int64), np.arange(envs.num_envs if envs else 0)))
    if envs is not None:
        envs.close(0.0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_status(process: Any) -> str:
    """How ``process`` ended, in words (waits up to 1 s for it to be reaped)."""
    process.join(1.0)
    if (code := process.exitcode) is None:
        return "closed its pipe but is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        oom = " (the kernel's out-of-memory killer sends SIGKILL)" if -code == getattr(signal, "SIGKILL", 9) else ""
        return f"was killed by {name} (exit code {code}){oom}"
    return f"exited with code {code}"


class _Child:
    """The parent's end of one worker process: its process, pipe, first row and state."""

    def __init__(self, index: int, process: Any, conn: Any, a: int, b: int) -> None:
        self.index, self.process, self.conn, self.a, self.b = index, process, conn, a, b
        self.started = self.ready = False
        self.roots: dict[NestedKey, np.ndarray] = {}  # its envs' root entries after their first reset
        self.calls = 0  # calls sent and not answered
        self.since = 0.0  # perf_counter() when the last call was sent
        self.phase = "step"

    def death(self) -> EnvFailure:
        """The failure of a child that ended without a word: when (starting, building its envs, later) and how."""
        name, status = self.process.name, _exit_status(self.process)
        if not self.started:
            text = (f"worker process {name!r} {status} while starting, before it ran lightning_rollout's code: "
                    "a worker starts by importing the main module again and unpickling what it is sent, and that "
                    "failed (the worker's traceback is on stderr)")
            if self.process.exitcode == 1:
                text += (". A script that builds the loop at its top level must guard it with "
                         "`if __name__ == \"__main__\":`; or pass num_workers=1 to keep the envs in threads")
        elif not self.ready:
            text = (f"worker process {name!r} {status} while building its envs, without reporting an error (a crash "
                    "in native code, os._exit in an env, or the process was killed)")
        else:
            text = f"worker process {name!r} {status}"
        return EnvFailure(self.a, "reset" if not self.ready else self.phase, "env", WorkerDied(text), self.index)

    def receive(self) -> tuple[Any, ...]:
        """The next message (a child's failure raised as an :class:`EnvFailure` of its env's row)."""
        try:
            message = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise self.death() from exc
        if message[0] == "failed":
            _, row, phase, kind, text, completed, lost = message
            failure = EnvFailure(self.a + row, phase, kind, RemoteTraceback(text), self.index)
            failure.completed, failure.lost = np.asarray(completed) + self.a, np.asarray(lost) + self.a
            raise failure
        return message


class ProcessEnvs(Envs):
    """Envs in this process (shard 0; in pool threads with ``threads``) and in ``num_workers - 1`` worker processes.
    Raises ValueError (an unpicklable factory, specs that differ), CollectionError (a daemonic process, no
    process started), EnvFailure (an env failed to build or reset, named by its row)."""

    def __init__(self, factories: Sequence[EnvFactory], seeds: Sequence[int | None], *, num_workers: int, group: int,
                 max_episode_steps: int | None, validate: bool, info_keys: InfoKeys | None, name: str,
                 threads: bool = False) -> None:
        blobs = check_picklable(factories)
        if mp.current_process().daemon:
            raise CollectionError(
                f"num_workers={num_workers} runs envs in worker processes, and this process cannot start any: it "
                f"is daemonic ({mp.current_process().name!r}: a torch DataLoader worker, a multiprocessing Pool "
                "worker), and daemonic processes are not allowed to have children. Build the loop or collector in "
                "the main process, or pass num_workers=1 to keep its envs in threads")
        self.num_envs = n = len(factories)
        options = {"max_episode_steps": max_episode_steps, "validate": validate, "info_keys": info_keys}
        cuts = [round(i * (n // group) / num_workers) * group for i in range(num_workers + 1)]
        self.children: list[_Child] = []
        self._closed = False
        self._local_left = 0  # rows of shard 0 in flight
        self._stash: list[np.ndarray] = []
        ctx = _context()
        try:
            for i in range(1, num_workers):  # children first: they build while this process builds shard 0
                a, b = cuts[i], cuts[i + 1]
                parent_end, child_end = ctx.Pipe(duplex=True)
                process = ctx.Process(target=_child_main, name=f"lightning_rollout-{name}-worker{i}", daemon=False,
                                      args=(child_end, list(seeds[a:b]), a, group, options))
                try:
                    with sigint_blocked():  # the child starts with it blocked: Ctrl-C is ours
                        process.start()
                except (OSError, EOFError) as exc:  # EOFError: the fork server ended (it ran out, too)
                    raise CollectionError(f"could not start worker process {i} ({type(exc).__name__}: {exc}){_FDS}"
                                          ) from exc
                child_end.close()
                self.children.append(_Child(i, process, parent_end, a, b))
            for child in self.children:  # its env factories go once it runs our code, not as start's arguments:
                self._wait(child, "started")  # start's write of those blocks for good if the child dies reading them
                try:
                    _send(child.conn, ("build", blobs[child.a:child.b], dict(os.environ)))
                except OSError as exc:
                    raise child.death() from exc
            units = build_units(list(factories[:cuts[1]]), group=group, **options)
            self.local: Envs = (ThreadEnvs(units, seeds[:cuts[1]], name=name) if threads
                                else SerialEnvs(units, seeds[:cuts[1]]))
            self.unit = self.local.unit
            for child in self.children:
                self._wait(child, "ready")
            self.roots = {k: np.concatenate([v, *(c.roots[k] for c in self.children)])
                          for k, v in self.local.roots.items()}
            self.bounds = np.array(cuts)
        except BaseException:
            self.close(1.0)
            raise

    def _wait(self, child: _Child, until: str) -> None:
        """Handle ``child``'s messages until it has ``"started"`` or is ``"ready"`` (its envs built)."""
        deadline = time.monotonic() + _BUILD_TIMEOUT_S
        while not getattr(child, until):
            while not child.conn.poll(POLL_S):
                if not child.process.is_alive() and not child.conn.poll(0):
                    raise child.death()
                if time.monotonic() > deadline:
                    raise EnvFailure(child.a, "reset", "env", TimeoutError(
                        f"worker process {child.process.name!r} was not {until} within {_BUILD_TIMEOUT_S} s"),
                        child.index)
            message = child.receive()
            child.started = True
            if message[0] == "ready":
                message[1].check_same(self.unit.keys, child.a)
                child.roots, child.ready = message[2], True

    def attach(self, inputs: dict[NestedKey, ArraySpec]) -> None:
        try:
            tensors = Slots.allocate(self.num_envs, inputs=inputs, next=self.unit.writes, root=self.unit.keys.root,
                                     make=_shared_zeros)
            for child in self.children:
                child.conn.send(("attach", tensors))
        except (OSError, RuntimeError) as exc:
            raise CollectionError(f"could not share the envs' buffers with the worker processes "
                                  f"({type(exc).__name__}: {exc}){_FDS}") from exc
        self.slots = _numpy(tensors)
        self.local.use(self.slots.rows(0, int(self.bounds[1])))
        for child in self.children:
            child.receive()

    def _split(self, rows: np.ndarray) -> list[tuple[_Child | None, np.ndarray]]:
        return [(self.children[s - 1] if s else None, local) for s, local in split_rows(self.bounds, rows)]

    def _call(self, child: _Child, message: tuple[Any, ...]) -> None:
        child.calls += 1
        child.since, child.phase = time.perf_counter(), message[0]
        _send(child.conn, message)

    def _answer(self, child: _Child) -> tuple[str, np.ndarray]:
        """``child``'s next answer: its kind and rows (in this executor's numbering)."""
        _, kind, rows = child.receive()
        child.calls -= 1
        return kind, (np.arange(child.a, child.b) if rows is None else np.asarray(rows) + child.a)

    def reset(self, rows: np.ndarray, seeds: Sequence[int | None]) -> None:
        seed_of = dict(zip(np.asarray(rows).tolist(), seeds))
        waiting = []
        for child, local in self._split(rows):
            a = child.a if child else 0
            mine = [seed_of[r + a] for r in local.tolist()]
            if child is None:
                self.local.reset(local, mine)
            else:
                self._call(child, ("reset", local.tolist(), mine))
                waiting.append(child)
        for child in waiting:  # a step of its other rows may answer first: kept for recv
            while (answer := self._answer(child))[0] != "reset":
                self._stash.append(answer[1])

    def send(self, rows: np.ndarray) -> None:
        for child, local in self._split(rows):
            if child is None:
                self._local_left += len(local)
                self.local.send(local)
            else:
                self._call(child, ("step", None if len(local) == child.b - child.a else local))

    def recv(self, min_rows: int, wait: float) -> np.ndarray:
        ready, self._stash = self._stash, []
        count = sum(len(r) for r in ready)
        deadline = time.perf_counter() + wait
        busy = {child.conn: child for child in self.children if child.calls}
        try:
            while busy or self._local_left:
                if self._local_left:  # shard 0: stepped now (SerialEnvs), or answered by its pool threads
                    got = self.local.recv(self._local_left, 0.0 if busy else min(POLL_S, wait))
                    if len(got):
                        ready.append(got)
                        count += len(got)
                        self._local_left -= len(got)
                timeout = 0.0 if count >= min_rows else max(0.0, min(POLL_S, deadline - time.perf_counter()))
                answered = wait_for(list(busy), timeout) if busy else []
                for conn in answered:
                    child = busy[conn]
                    got = self._answer(child)[1]
                    if not child.calls:
                        del busy[conn]
                    ready.append(got)
                    count += len(got)
                if not answered and (count >= min_rows or time.perf_counter() >= deadline):
                    break
        except EnvFailure as failure:
            if failure.process is None:  # shard 0's rows of that call answered or lost
                self._local_left -= len(failure.completed) + len(failure.lost)
            failure.completed = np.concatenate([*ready, failure.completed])  # answers before it stay
            raise
        return merged_rows(ready)

    def stuck(self, timeout: float) -> tuple[int, str, str] | None:
        now = time.perf_counter()
        return self.local.stuck(timeout) or next(((c.a, c.phase, c.process.name) for c in self.children
                                                  if c.calls and now - c.since > timeout), None)

    def close(self, timeout: float) -> list[str]:
        """Close every env and end every child; a close cut short (a second Ctrl-C) is finished by the next."""
        local = getattr(self, "local", None)
        stuck = local.close(timeout) if local is not None and not self._closed else []
        self._closed = True
        for child in self.children:
            if child.ready and child.process.is_alive():
                with contextlib.suppress(OSError):
                    _send(child.conn, ("close",))
            elif child.process.is_alive():  # still building: it cannot read the request
                child.process.terminate()
        deadline = time.monotonic() + timeout
        while self.children:
            child, process = self.children[0], self.children[0].process
            process.join(max(0.0, deadline - time.monotonic()))
            for end in (process.terminate, process.kill):
                if process.is_alive():
                    end()
                    process.join(1.0)
            child.conn.close()
            with contextlib.suppress(ValueError):  # still running after kill (not reaped yet): left to multiprocessing
                process.close()
            self.children.pop(0)
        if local is not None:
            local.release()
        self.slots = None  # type: ignore[assignment]
        return stuck
