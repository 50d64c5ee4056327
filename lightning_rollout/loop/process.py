"""Worker processes: env blocks stepped in child processes, crossing in shared memory.

With ``num_workers > 1`` a :class:`~lightning_rollout.MultiEnvLoop` splits its envs
across that many processes. With one env thread (``envs_per_thread=num_envs``, what
the ``"auto"`` layout picks) they are the main process (process 0) and
``num_workers - 1`` child processes (worker processes 1, 2, ...); with several env
threads, ``num_workers`` child processes (0, 1, ...), since an env thread stepping
envs that hold the GIL in the main process would starve the other env threads of
it. Everything but the env calls of the children's envs stays in the main
process: the env threads (one per block of ``envs_per_thread`` envs), their
bookkeeping and double batching, the one :class:`~lightning_rollout.AutobatchPolicy`,
events and errors. An env thread hands its block's step to the block's server
thread in a child and waits for it without holding the GIL, so envs whose step
holds the GIL (pure Python, ALE) run on every core. The main process's share
(:class:`LocalEnvs`) is stepped by the env thread itself, after every child was
sent its part of the step and before their replies are gathered, so the main
process steps envs while the children do instead of sleeping.

Protocol: one duplex ``Pipe`` per block part; a block server thread in the child owns the child end, the env
thread in the parent the other. The messages and their order are the typed records and the table of
:mod:`lightning_rollout.loop.messages`. The child reports :class:`~.messages.ChildStarted` before it
unpickles its env factories, so a child that dies while starting is told from one that dies while building
its envs. The ready message is pickled with plain :mod:`pickle`: its spec tensors are copied, not moved to
shared memory (which would start a ``multiprocessing`` listener, and its ``pymp-*`` temp folder, in the
child). Whatever an env call raises in the child, ``KeyboardInterrupt`` and ``SystemExit`` included, is
answered with :class:`~.messages.ChildFailed`, naming the env of the block whose call raised.

Shared buffers are torch tensors in shared memory (``share_memory_()``), viewed as
numpy on both sides and written once per step by one side. For a step of ``n`` envs
row ``i`` is the ``i``-th env of the request: ``inputs[key][:n]`` (what the adapter
reads: the action, or every root entry of a TorchRL env) by the parent;
``next[key][:n]`` (what the adapter returns) and ``stats`` (reward, terminated,
truncated) by the child; a reset's root entries go to ``root[key][0]``. The child
steps its block with the same :class:`~lightning_rollout.loop.block.EnvBlock` an
in-process env thread uses. A message orders every write before the other side
reads.

Waiting: a child that serves one part, on a machine with a core for each process
that steps envs (the main process counted), polls its pipe for up to ``_SPIN_S``
(2 ms) before it blocks on it, so the next step's request finds it running. Each
step's request is on the critical path of the round, and waking a blocked child
costs more than the poll (on a virtual machine an idle vCPU halts and is woken
through the hypervisor). The poll releases the GIL at each call, the spin is
bounded, and with fewer cores than busy
processes, or several parts (server threads) in one child, nobody spins: a spinning
thread would take the core or the GIL another needs. Every other wait blocks (a
spin in the parent while it waits for a reply measured within noise).

Lifetime: children start with the ``spawn`` method (safe with CUDA in the parent) and
are not daemonic, so an env may start processes of its own. A child is started with
SIGINT blocked (the parent blocks it in the starting thread, and a blocked signal
stays blocked across ``exec``), so a Ctrl-C reaching the process group while the
child imports is not delivered to it; the child's first step then ignores SIGINT for
good (Ctrl-C is the parent's to handle). Children run torch with one thread, and
exit when the parent closes their blocks or when the parent dies (a watchdog thread
waits on the parent's sentinel); they end with ``os._exit`` after closing their envs
and removing ``multiprocessing``'s temp folder if they made one. A child that dies
without reporting an error is described by when it died (while starting, while
building its envs, or later) and by its exit code or the signal that killed it.
:meth:`WorkerProcesses.close` asks every block whose child is listening to close
(its envs are closed), terminates at once a child still starting or building its
envs, joins each process within a bound, then terminates and kills; then it closes
the pipes, drops the shared tensors and closes the ``Process`` objects, so every file
descriptor is released at once, whatever the garbage collector does. Every
parent-side wait polls the loop's stop flag and the child's liveness. A daemonic
process (a ``DataLoader`` worker) cannot have children: worker processes are refused
there with a :class:`~lightning_rollout.errors.CollectionError`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import select
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from .._exit import close_at_exit, exempt_at_exit
from ..envs import ActionError, EnvAdapter, EnvFactory, InfoKeys, make_adapter
from ..errors import CollectionError
from ..specs import ArraySpec, NestedKey
from .block import EnvBlock, EnvFailure, RemoteTraceback, close_quietly
from .messages import (AttachBuffers, ChildFailed, ChildOk, ChildReady, ChildReply, ChildStarted, CloseEnvs,
                       ParentCommand, RandomAction, ResetEnv, StepEnvs)

__all__ = ["EnvFailure", "LocalEnvs", "RemoteEnvs", "RemoteTraceback", "WorkerDied", "WorkerProcesses",
           "build_adapter", "spin_seconds", "steps_in_main_process"]

_POLL_S = 0.05
_POLL_MS = int(_POLL_S * 1000)
_SPIN_S = 0.002  # how long a child polls its pipe before it blocks on it (see "Waiting" above)
# The two messages of every step, pickled once (what Connection.send would send).
_STEP_ALL = pickle.dumps(StepEnvs(None))
_OK = pickle.dumps(ChildOk())
_STARTED = pickle.dumps(ChildStarted())


@dataclass(frozen=True)
class _BlockPlan:
    """A part: envs ``env_ids`` of block ``block`` (its envs from ``offset`` on), stepped by process ``process``."""

    env_ids: tuple[int, ...]
    factories: tuple[EnvFactory | bytes, ...]  # a child's: each pickled (unpickled there, where a failure is reported)
    seeds: tuple[int | None, ...]
    process: int
    block: int
    offset: int


class _Explained(Exception):
    """An error whose message says everything (replies and errors show it without its type name)."""


def _to_shared(spec: ArraySpec, rows: int) -> torch.Tensor:
    dtype = torch.from_numpy(np.empty(0, dtype=spec.dtype)).dtype
    return torch.zeros((rows, *spec.shape), dtype=dtype).share_memory_()


def _views(buffers: AttachBuffers) -> tuple[dict[NestedKey, np.ndarray], dict[NestedKey, np.ndarray],
                                            dict[NestedKey, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """The shared buffers as numpy arrays, on either side: ``(inputs, next, root, reward, terminated, truncated)``.
    The arrays keep the shared tensors (and their file descriptors) alive."""
    inputs, nxt, root = ({k: t.numpy() for k, t in d.items()} for d in (buffers.inputs, buffers.next, buffers.root))
    return (inputs, nxt, root, *(t.numpy() for t in buffers.stats))


def _out_of_fds(text: str) -> bool:
    """Whether an error's text says a process ran out of file descriptors: ``EMFILE`` / ``ENFILE``, or
    file descriptors sent over a pipe that did not arrive (the kernel drops those a receiver at its limit
    cannot take: ``multiprocessing`` says it "received 0 items of ancdata")."""
    return any(words in text for words in ("Too many open files", "EMFILE", "ENFILE", "items of ancdata"))


_FDS_HINT = ("; a process ran out of file descriptors: every env in a worker process holds a few in both processes "
             "(its pipe and its shared buffers). Raise the limit (`ulimit -n`, or resource.setrlimit(RLIMIT_NOFILE) "
             "before building the loop), or run fewer envs per worker process (fewer env threads: a larger "
             "envs_per_thread)")


def build_adapter(factory: EnvFactory, *, max_episode_steps: int | None, validate: bool,
                  info_keys: InfoKeys | None) -> EnvAdapter:
    """``make_adapter(factory(), ...)``; an env that the adapter refuses (a bad space, a bad argument) is
    closed before the error propagates, so a refused construction leaves no env open."""
    env = factory()
    try:
        return make_adapter(env, max_episode_steps=max_episode_steps, validate=validate, info_keys=info_keys)
    except BaseException:
        closer = getattr(env, "close", None)
        if callable(closer):
            try:
                closer()
            except Exception:  # closing must not hide the refusal
                pass
        raise


# -- child side ------------------------------------------------------------------------------------
def _error_reply(j: int, phase: str, exc: BaseException, kind: str | None = None) -> ChildFailed:
    """The :class:`~.messages.ChildFailed` reply for ``exc`` raised by env ``j`` in ``phase``, with its traceback."""
    kind = kind or ("action" if isinstance(exc, ActionError) else "env")
    message = str(exc) if isinstance(exc, _Explained) else f"{type(exc).__name__}: {exc}"
    return ChildFailed(j, phase, kind, message, "".join(traceback.format_exception(exc)))


def _send(conn: Any, message: ParentCommand | ChildReply) -> None:
    """Send ``message`` to the parent; a pipe already gone (the parent closed it or died) is ignored."""
    try:
        conn.send(message)
    except (OSError, ValueError):
        pass


def _pipe_poller(conn: Any) -> Any:
    """A ``select.poll`` object watching ``conn`` for input, made once per pipe (``Connection.poll``
    builds a selector on every call); ``None`` where ``select.poll`` is missing (Windows)."""
    if not hasattr(select, "poll"):
        return None
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    return poller


def spin_seconds(parts: int, children: int, cores: int) -> float:
    """How long a child serving ``parts`` parts spins for its next request (see "Waiting" in the module
    docs): ``_SPIN_S`` when it serves one part and the ``children`` worker processes and the main
    process have a core each, else 0 (it blocks at once)."""
    return _SPIN_S if parts == 1 and children + 1 <= cores else 0.0


def steps_in_main_process(num_envs: int, envs_per_thread: int) -> bool:
    """Whether the main process steps a share of the envs of a loop with worker processes: only with one
    env thread (one block, split over the processes). With several, an env thread stepping envs that hold
    the GIL here would starve the others of it, so the worker processes step every env."""
    return num_envs // envs_per_thread == 1


def _plan_parts(factories: Sequence[EnvFactory], blobs: Sequence[bytes], seeds: Sequence[int | None], *,
                num_workers: int, envs_per_thread: int, local: bool) -> list[_BlockPlan]:
    """Every part (a block's envs within one process) in env order. Envs are split evenly between the
    processes: whole blocks when there are at least ``num_workers`` of them, else every block split over the
    processes (splitting when there are blocks enough was measured slower on 2 cores: more hand-offs for the
    same parallelism). With ``local``, process 0 is the main process: its part keeps the factories, a child's
    get their pickles (``blobs``)."""
    g, num_envs = envs_per_thread, len(factories)
    num_blocks = num_envs // g
    if num_blocks >= num_workers:
        bounds = np.linspace(0, num_blocks, num_workers + 1).round().astype(int) * g
    else:
        bounds = np.linspace(0, num_envs, num_workers + 1).round().astype(int)
    plans: list[_BlockPlan] = []
    for p in range(num_workers):
        lo, hi = int(bounds[p]), int(bounds[p + 1])
        for b in range(lo // g, -(-hi // g)):
            start, stop = max(lo, b * g), min(hi, (b + 1) * g)
            own = factories[start:stop] if local and p == 0 else blobs[start:stop]
            plans.append(_BlockPlan(tuple(range(start, stop)), tuple(own), tuple(seeds[start:stop]), process=p,
                                    block=b, offset=start - b * g))
    return plans


def _build_envs(plan: _BlockPlan, adapters: list[EnvAdapter], *, max_episode_steps: int | None, validate: bool,
                info_keys: InfoKeys | None) -> ChildReady:
    """Build ``plan``'s envs into ``adapters`` and reset each with its seed; return the
    :class:`~.messages.ChildReady` message of the block (see the module docs), in a child or for the main
    process's share. A pickled factory (a child's) is unpickled first.

    Raises:
        EnvFailure: for the first env whose factory could not be unpickled, or that failed to build
            (``"create"``) or to reset (``"reset"``), whatever it raised as the cause; ``adapters`` then
            holds the envs built so far (the caller closes them).
    """
    for j, factory in enumerate(plan.factories):
        if isinstance(factory, bytes):
            try:
                factory = pickle.loads(factory)
            except BaseException as exc:
                explained = _Explained(
                    f"the env factory could not be unpickled in the worker process ({type(exc).__name__}: {exc}); "
                    "it must be importable there: define it in a module, or at the top level of a script run as a "
                    "file (python script.py), not in an interactive session or `python -c`")
                explained.__cause__ = exc
                raise EnvFailure(j, "create", "env", explained) from exc
        try:
            adapters.append(build_adapter(factory, max_episode_steps=max_episode_steps, validate=validate,
                                          info_keys=info_keys))
            if adapters[-1].batched:
                raise _Explained(f"the env factory makes a natively batched env of {adapters[-1].rows} envs, which "
                                 "steps its batch in one call in the main process: pass num_workers=1 (each env thread "
                                 "steps one batched env)")
        except BaseException as exc:
            raise EnvFailure(j, "create", "env", exc) from exc
    roots = []
    for j, (adapter, seed) in enumerate(zip(adapters, plan.seeds)):
        try:
            roots.append({k: np.asarray(v) for k, v in adapter.reset(seed).items()})
        except BaseException as exc:
            raise EnvFailure(j, "reset", "env", exc) from exc
    first = adapters[0]
    return ChildReady(first.keys, first.observation_spec, first.action_spec, first.loop_keys, roots)


class _BlockServer:
    """Serves one block's commands in the child (its own thread once attached).

    Built in the child's main thread: builds and resets the block's envs and sends
    :class:`~.messages.ChildReady`, or sends :class:`~.messages.ChildFailed`, closes the envs built and raises
    :class:`EnvFailure`.
    """

    def __init__(self, plan: _BlockPlan, conn: Any, max_episode_steps: int | None, validate: bool,
                 info_keys: InfoKeys | None = None, spin: float = 0.0) -> None:
        self.plan, self.conn, self.validate, self.spin = plan, conn, validate, spin
        self.adapters: list[EnvAdapter] = []
        self.block: EnvBlock  # from attach()
        try:
            ready = _build_envs(plan, self.adapters, max_episode_steps=max_episode_steps, validate=validate,
                                info_keys=info_keys)
            # Plain pickle: the spec tensors are copied (ForkingPickler would share them through a listener).
            conn.send_bytes(pickle.dumps(ready))
        except EnvFailure as failure:
            self.close()
            _send(conn, _error_reply(failure.j, failure.phase, failure.cause))
            raise
        except BaseException as exc:  # the ready message could not be pickled or sent
            self.close()
            _send(conn, _error_reply(0, "create", exc, "env"))
            raise EnvFailure(0, "create", "env", exc) from exc

    def attach(self) -> bool:
        """Receive the block's shared buffers (:class:`~.messages.AttachBuffers`) and answer
        :class:`~.messages.ChildOk`; False when the parent sent :class:`~.messages.CloseEnvs` instead (it gave
        the construction up). A failure (receiving the buffers' file descriptors, say) is answered with
        :class:`~.messages.ChildFailed` and raised."""
        try:
            message = self.conn.recv()
            if isinstance(message, CloseEnvs):
                return False
            assert isinstance(message, AttachBuffers), message
            self.inputs, self.next, self.root, self.reward, self.terminated, self.truncated = _views(message)
            self.block = EnvBlock(self.adapters, validate=self.validate, checked_next=message.checked_next,
                                  checked_root=message.checked_root, zero_done=message.zero_done,
                                  watched=False)  # the parent's RemoteEnvs notes each call for step_timeout
        except BaseException as exc:
            explained = _Explained(f"worker process could not attach the shared buffers of envs "
                                   f"{list(self.plan.env_ids)} ({type(exc).__name__}: {exc})")
            explained.__cause__ = exc  # its traceback goes with the reply
            _send(self.conn, _error_reply(0, "attach", explained, "env"))
            raise
        self.conn.send_bytes(_OK)
        return True

    def serve(self) -> None:
        """Answer the parent's commands until :class:`~.messages.CloseEnvs` (the envs are closed) or until the
        pipe is gone (the parent closed it or died)."""
        conn, spin = self.conn, self.spin
        poller = _pipe_poller(conn) if spin else None
        try:
            while True:
                if poller is not None:  # poll for the next request a little before blocking on it (module docs)
                    deadline = time.perf_counter() + spin
                    while not poller.poll(0) and time.perf_counter() < deadline:
                        pass
                message: ParentCommand = conn.recv()
                if isinstance(message, CloseEnvs):
                    self.close()
                    conn.send_bytes(_OK)
                    return
                reply: ChildReply
                try:
                    if isinstance(message, StepEnvs):
                        self._step(message.envs)
                        conn.send_bytes(_OK)
                        continue
                    if isinstance(message, ResetEnv):
                        reply = self._reset(message.j, message.seed)
                    else:
                        assert isinstance(message, RandomAction), message
                        reply = self._random(message.j, message.columns)
                except EnvFailure as failure:
                    reply = (ChildFailed(failure.j, "check", "env", str(failure), "") if failure.phase == "check"
                             else _error_reply(failure.j, failure.phase, failure.cause, failure.kind))
                except BaseException as exc:  # SystemExit, KeyboardInterrupt or an error the block does not wrap
                    j = self.block.busy_env  # the env whose call raised
                    reply = _error_reply(max(j, 0), "reset" if isinstance(message, ResetEnv) else "step", exc)
                conn.send(reply)
        except (EOFError, OSError):  # the parent closed the pipe or died: nobody to answer
            return

    def close(self) -> None:
        """Close the block's envs (idempotent; errors are swallowed, as :meth:`EnvBlock.close`)."""
        adapters, self.adapters = self.adapters, []
        close_quietly(adapters)

    def _step(self, envs: Sequence[int] | None) -> None:
        """Step ``envs`` (``None``: the whole block): rows ``0:n`` of the shared buffers are theirs."""
        n = len(self.block.adapters) if envs is None else len(envs)
        self.block.step({k: v[:n] for k, v in self.inputs.items()}, range(n) if envs is None else envs,
                        {k: v[:n] for k, v in self.next.items()}, self.reward[:n], self.terminated[:n],
                        self.truncated[:n])

    def _reset(self, j: int, seed: int | None) -> ChildOk:
        root = self.block.reset(j, seed)
        for k, buf in self.root.items():
            buf[0] = root[k]
        return ChildOk()

    def _random(self, j: int, columns: dict[NestedKey, ArraySpec]) -> ChildOk:
        return ChildOk(self.block.random_action(j, columns))


def _watch_parent() -> None:
    """Exit this process as soon as the parent dies (no orphans)."""
    parent = mp.parent_process()
    if parent is None:
        return
    from multiprocessing.connection import wait

    wait([parent.sentinel])
    os._exit(0)


def _mp_temp_dir() -> str | None:
    """``multiprocessing``'s ``pymp-*`` folder of this process, ``None`` before one is made. A child inherits
    its parent's (a ``Process`` copies its creator's config), which is the parent's to remove."""
    return mp.current_process()._config.get("tempdir")  # type: ignore[attr-defined]


def _remove_mp_temp_dir(inherited: str | None) -> None:
    """Remove the ``pymp-*`` folder ``multiprocessing`` made in this process, if it made one rather than
    ``inherited`` (its own removal runs at a normal interpreter exit, which ``os._exit`` skips)."""
    tempdir = _mp_temp_dir()
    if tempdir and tempdir != inherited:
        shutil.rmtree(tempdir, ignore_errors=True)


def _child_main(plans: list[_BlockPlan], conns: list[Any], max_episode_steps: int | None, validate: bool,
                info_keys: InfoKeys | None = None, spin: float = 0.0) -> None:
    """A worker process: build each plan's block, attach its buffers, serve it; then end the process
    (``os._exit``) with every env closed, whatever happened (an error is reported on the block's pipe)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it closes us
    if hasattr(signal, "pthread_sigmask"):  # started with SIGINT blocked (WorkerProcesses._start)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    torch.set_num_threads(1)
    inherited_temp_dir = _mp_temp_dir()
    watchdog = threading.Thread(target=_watch_parent, name="lightning_rollout-worker-watchdog", daemon=True)
    exempt_at_exit(watchdog)  # it only waits: never a reason to delay this process's exit
    watchdog.start()
    servers: list[_BlockServer] = []
    code = 0
    try:
        for conn in conns:
            conn.send_bytes(_STARTED)
        for plan, conn in zip(plans, conns):
            servers.append(_BlockServer(plan, conn, max_episode_steps, validate, info_keys, spin))
        if all(server.attach() for server in servers):  # else the parent gave the construction up
            threads = [threading.Thread(target=s.serve, name=f"lightning_rollout-block{s.plan.env_ids[0]}",
                                        daemon=True) for s in servers]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    except BaseException:  # reported to the parent on the block's pipe (or the pipe is gone)
        code = 1
    for server in servers:
        server.close()
    _remove_mp_temp_dir(inherited_temp_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the parent owns every resource; skip finalization (the watchdog thread is still waiting)


# -- parent side -------------------------------------------------------------------------------------
def check_picklable(factories: Sequence[EnvFactory]) -> list[bytes]:
    """Each env factory pickled (what a worker process is sent); a ``ValueError`` saying what to do when
    one cannot be."""
    blobs: dict[int, bytes] = {}  # by id: a factory given for many envs is pickled once
    out = []
    for i, factory in enumerate(factories):
        blob = blobs.get(id(factory))
        if blob is None:
            try:
                blob = blobs[id(factory)] = pickle.dumps(factory)
            except Exception as exc:
                raise ValueError(
                    f"num_workers > 1 runs envs in worker processes, which need the env factory to be picklable; "
                    f"env {i}'s factory {factory!r} is not ({type(exc).__name__}: {exc}). Define it at module level "
                    "(not a lambda or a local function), or pass a gymnasium id or a functools.partial of a "
                    "module-level function") from exc
        out.append(blob)
    return out


def _exit_status(process: Any) -> str:
    """How ``process`` ended, in words: its exit code, or the signal that killed it (waits up to 1 s for
    it to be reaped: its pipe closes a little before it exits)."""
    process.join(1.0)
    code = process.exitcode
    if code is None:
        return "closed its pipe but is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        oom = " (the kernel's out-of-memory killer sends SIGKILL)" if -code == getattr(signal, "SIGKILL", 9) else ""
        return f"was killed by {name} (exit code {code}){oom}"
    return f"exited with code {code}"


class WorkerDied(RuntimeError):
    """A worker process ended without reporting an error (chained as the cause of the loop's error)."""


def _death(block: RemoteEnvs) -> EnvFailure:
    """The failure of ``block`` whose process ended without a word: said by when it ended (while
    starting, while building its envs, after) and how (exit code or signal)."""
    name, status = block.process.name, _exit_status(block.process)
    if not block.started:
        text = (f"worker process {name!r} {status} while starting, before it ran lightning_rollout's code: 'spawn' "
                "starts a worker by importing the main module again and unpickling what it is sent, and that failed "
                "(the worker's traceback is on stderr)")
        if block.process.exitcode == 1:
            text += (". A script that builds the loop at its top level must guard it with "
                     "`if __name__ == \"__main__\":`; or pass num_workers=1 to keep the envs in threads")
    elif not block.ready:
        text = (f"worker process {name!r} {status} while building its envs, without reporting an error (a crash "
                "in native code, os._exit in an env, or the process was killed)")
    else:
        text = f"worker process {name!r} {status}"
    failure = EnvFailure(0, "create" if not block.ready else "step", "env", WorkerDied(text))
    failure.process = block.index
    return failure


def _receive(block: RemoteEnvs) -> ChildReply:
    """The next message from ``block``'s child; a closed pipe (the child died) becomes its :func:`_death`."""
    try:
        return block.conn.recv()
    except (EOFError, OSError) as exc:
        raise _death(block) from exc


def _payload(reply: ChildReply) -> Any:
    """A child's reply: its payload (``None`` but a random action's), or its error raised as an
    :class:`EnvFailure` with the child's traceback."""
    if isinstance(reply, ChildFailed):
        raise EnvFailure(reply.j, reply.phase, reply.kind,
                         RemoteTraceback(f"{reply.message}\n\n{reply.traceback}".rstrip()))
    return reply.payload if isinstance(reply, ChildOk) else None


class _Elsewhere:
    """What :class:`RemoteEnvs` and :class:`RemoteGroup` share as a :class:`~lightning_rollout.loop.block.Block`:
    stepped one process round at a time (never by helper threads), closed by the pool, and free to step some of
    their envs; ``busy_*`` as :class:`~lightning_rollout.loop.block.EnvBlock`'s, read by the driver's
    ``step_timeout`` check."""

    parallel = owned = False
    partial = True
    busy_env = -1
    busy_phase = "step"
    busy_since = 0.0
    reset: Callable[[int, int | None, threading.Event], dict[NestedKey, np.ndarray]]  # each subclass's own

    def reset_many(self, envs: Sequence[int], stop: threading.Event) -> list[dict[NestedKey, np.ndarray]]:
        return [self.reset(j, None, stop) for j in envs]


class RemoteEnvs(_Elsewhere):
    """A block of envs (``env_ids``, named in errors) in a worker process, as its env thread in the parent sees it.

    Not thread-safe: owned by one env thread (and by :meth:`WorkerProcesses.close` once that thread ended).
    """

    def __init__(self, process: Any, conn: Any, env_ids: Sequence[int], index: int) -> None:
        self.process, self.conn, self.env_ids, self.rows = process, conn, tuple(env_ids), len(env_ids)
        self.index = index  # the worker process's index, named in errors
        self.started = False  # the child runs our code (its ChildStarted arrived)
        self.ready: ChildReady | None = None  # its envs are built: it reads its pipe from now on
        self._poller = _pipe_poller(conn)
        self.inputs: dict[NestedKey, np.ndarray] = {}
        self.next: dict[NestedKey, np.ndarray] = {}
        self.root: dict[NestedKey, np.ndarray] = {}
        self.reward = self.terminated = self.truncated = np.empty(0)
        self._begun: Sequence[int] = ()  # the envs of the step in progress

    def release(self) -> None:
        """Close the pipe and drop the shared buffers (their file descriptors are closed now)."""
        self.conn.close()
        self._poller = None
        self.inputs, self.next, self.root = {}, {}, {}
        self.reward = self.terminated = self.truncated = np.empty(0)

    def _call(self, message: ParentCommand, stop: threading.Event | None) -> Any:
        self.conn.send(message)
        return self._reply(stop)

    def _reply(self, stop: threading.Event | None) -> Any:
        from ..policy import _Stopped

        conn, poller = self.conn, self._poller
        while not (poller.poll(_POLL_MS) if poller is not None else conn.poll(_POLL_S)):
            if stop is not None and stop.is_set():
                raise _Stopped()
            if not self.process.is_alive():
                if conn.poll(0):  # its last words arrived before it ended
                    break
                raise _death(self)
        try:
            return _payload(_receive(self))
        except EnvFailure as failure:
            failure.process = self.index
            raise

    # A step (the Block protocol, :class:`~lightning_rollout.loop.block.Block`): one round trip for the block,
    # rows ``0:n`` of the shared buffers carrying the ``n`` envs' inputs and results. The worker process
    # checks every step's observations itself.
    def begin(self, inputs: Mapping[NestedKey, np.ndarray], envs: Sequence[int]) -> None:
        """Write the ``n`` envs' inputs to rows ``0:n`` and send the request: the child steps them now."""
        self.busy_env, self.busy_phase, self.busy_since = envs[0], "step", time.perf_counter()
        n = len(envs)
        for k, buf in self.inputs.items():
            buf[:n] = inputs[k]
        if n == self.rows:
            self.conn.send_bytes(_STEP_ALL)
        else:
            self.conn.send(StepEnvs(tuple(envs)))
        self._begun = envs

    def ended(self, stop: threading.Event | None = None, *, every: bool = False) -> Sequence[int]:
        """Wait for the child's reply (polling ``stop``): every env begun ended. Raises :class:`EnvFailure`."""
        try:
            self._reply(stop)
        except BaseException:
            self.busy_since = 0.0
            raise
        return self._begun

    def finish(self, envs: Sequence[int], out: Mapping[NestedKey, np.ndarray], rewards: np.ndarray,
               terminated: np.ndarray, truncated: np.ndarray) -> tuple[Sequence[int], EnvFailure | None]:
        """Copy rows ``0:n`` of the results out."""
        n = len(envs)
        for k, buf in out.items():
            buf[...] = self.next[k][:n]
        rewards[:] = self.reward[:n]
        terminated[:] = self.terminated[:n]
        truncated[:] = self.truncated[:n]
        self.busy_since = 0.0
        return envs, None

    def reset(self, j: int, seed: int | None, stop: threading.Event) -> dict[NestedKey, np.ndarray]:
        self.busy_env, self.busy_phase, self.busy_since = j, "reset", time.perf_counter()
        try:
            self._call(ResetEnv(j, seed), stop)
        finally:
            self.busy_since = 0.0
        return {k: v[0].copy() for k, v in self.root.items()}

    def random_action(self, j: int, columns: dict[NestedKey, ArraySpec], stop: threading.Event) -> dict:
        return self._call(RandomAction(j, columns), stop)


class LocalEnvs:
    """The main process's share of the envs of a loop with worker processes (process 0).

    Built in the main process like a worker's block (envs created and first reset at
    construction, an :class:`~lightning_rollout.loop.block.EnvBlock` once the loop's column
    layout is known, :meth:`attach`), and used like a :class:`RemoteEnvs` part: it is the first
    part of the loop's one :class:`RemoteGroup`, where :meth:`begin` only keeps the request
    and :meth:`finish` steps the envs, so they step while the children step theirs.
    Errors are :class:`EnvFailure` without a process index.

    Not thread-safe: owned by one env thread (and by :meth:`WorkerProcesses.close` once that thread ended).

    Raises:
        EnvFailure: an env failed to build (``"create"``) or to reset (``"reset"``).
    """

    def __init__(self, plan: _BlockPlan, *, max_episode_steps: int | None, validate: bool,
                 info_keys: InfoKeys | None) -> None:
        self.validate = validate
        self.adapters: list[EnvAdapter] = []
        self.block: EnvBlock  # from attach()
        try:
            self.ready = _build_envs(plan, self.adapters, max_episode_steps=max_episode_steps, validate=validate,
                                     info_keys=info_keys)
        except BaseException as exc:
            self.close()
            if isinstance(exc, EnvFailure) and not isinstance(exc.cause, Exception):
                raise exc.cause  # KeyboardInterrupt, SystemExit: not an env's failure in this process
            raise
        self.rows = len(self.adapters)

    def attach(self, checked_next: dict[NestedKey, ArraySpec], checked_root: dict[NestedKey, ArraySpec],
               zero_done: dict[NestedKey, ArraySpec]) -> None:
        self.block = EnvBlock(self.adapters, validate=self.validate, checked_next=checked_next,
                              checked_root=checked_root, zero_done=zero_done,
                              watched=False)  # its group (RemoteGroup) notes each step for step_timeout

    def begin(self, inputs: Mapping[NestedKey, np.ndarray], envs: Sequence[int]) -> None:
        """Keep the request: the envs step in :meth:`finish`, once the children were sent theirs."""
        self.block.begin(inputs, envs)

    def ended(self, stop: threading.Event | None = None, *, every: bool = False) -> Sequence[int]:
        return self.block.ended(stop, every=every)

    def finish(self, envs: Sequence[int], out: Mapping[NestedKey, np.ndarray], rewards: np.ndarray,
               terminated: np.ndarray, truncated: np.ndarray) -> tuple[Sequence[int], EnvFailure | None]:
        """Step the envs kept by :meth:`begin`, in this thread (raises :class:`EnvFailure`)."""
        return self.block.finish(envs, out, rewards, terminated, truncated)

    def reset(self, j: int, seed: int | None, stop: threading.Event) -> dict[NestedKey, np.ndarray]:
        return self.block.reset(j, seed, stop)

    def random_action(self, j: int, columns: dict[NestedKey, ArraySpec], stop: threading.Event) -> dict:
        return self.block.random_action(j, columns, stop)

    def close(self) -> None:
        """Close the envs (idempotent); errors are swallowed (as :meth:`EnvBlock.close`)."""
        adapters, self.adapters = self.adapters, []
        close_quietly(adapters)


class RemoteGroup(_Elsewhere):
    """One env thread's block of envs spread over several processes.

    A step sends every child's part its share at once, steps the main process's part
    (:class:`LocalEnvs`, the first part when there is one) in this thread, then gathers
    every reply, so the processes step their envs in parallel (one wake-up of the
    thread for the whole block, as envpool's or Sample Factory's batched workers).
    Same interface as :class:`RemoteEnvs`; the envs of a call must be in ascending order.

    Args:
        parts: ``(offset, part)`` pairs in env order: ``part`` holds the block's envs
            ``offset`` to ``offset + part.rows - 1``.
    """

    def __init__(self, parts: Sequence[tuple[int, RemoteEnvs | LocalEnvs]]) -> None:
        self.parts = list(parts)
        self.rows = sum(part.rows for _, part in self.parts)
        self._shares: list[tuple[int, RemoteEnvs | LocalEnvs, slice]] = []  # the step in progress
        self._begun: Sequence[int] = ()
        self._stop: threading.Event | None = None

    def _on_part(self, j: int, call: Callable[[RemoteEnvs | LocalEnvs, int], Any]) -> Any:
        """``call(part, index in part)`` for the part holding env ``j``; its :class:`EnvFailure` renumbered."""
        for offset, part in reversed(self.parts):
            if j >= offset:
                try:
                    return call(part, j - offset)
                except EnvFailure as exc:
                    raise self._shifted(exc, offset) from exc.cause
        raise IndexError(j)

    @staticmethod
    def _shifted(failure: EnvFailure, offset: int) -> EnvFailure:
        """``failure`` of a part, renumbered to the env's index in the whole block."""
        shifted = EnvFailure(failure.j + offset, failure.phase, failure.kind, failure.cause)
        shifted.process = failure.process
        return shifted

    # A step of ``envs`` (ascending; the Block protocol): every part is sent its share in :meth:`begin`, the
    # main process's part steps in :meth:`finish`, then every reply is read (pipes stay in step); each part
    # checks its observations each step.
    def begin(self, inputs: Mapping[NestedKey, np.ndarray], envs: Sequence[int]) -> None:
        shares = []  # (offset, part, rows of this call it takes)
        i = 0
        for offset, part in self.parts:
            start = i
            while i < len(envs) and envs[i] < offset + part.rows:
                i += 1
            if i > start:
                shares.append((offset, part, slice(start, i)))
        self.busy_env, self.busy_phase, self.busy_since = envs[0], "step", time.perf_counter()
        self._shares, self._begun = shares, envs
        for offset, part, rows in shares:
            part.begin({k: v[rows] for k, v in inputs.items()}, [j - offset for j in envs[rows]])

    def ended(self, stop: threading.Event | None = None, *, every: bool = False) -> Sequence[int]:
        """Every env begun (they end in :meth:`finish`, which waits for the parts polling ``stop``)."""
        self._stop = stop
        return self._begun

    def finish(self, envs: Sequence[int], out: Mapping[NestedKey, np.ndarray], rewards: np.ndarray,
               terminated: np.ndarray, truncated: np.ndarray) -> tuple[Sequence[int], EnvFailure | None]:
        """Step the main process's part here, then gather every part's results (raises :class:`EnvFailure`,
        renumbered to the block, for the first part that failed)."""
        failure: EnvFailure | None = None
        try:
            for offset, part, rows in self._shares:
                try:
                    part_envs = part.ended(self._stop, every=True)
                    part.finish(part_envs, {k: v[rows] for k, v in out.items()}, rewards[rows], terminated[rows],
                                truncated[rows])
                except EnvFailure as exc:
                    failure = failure or self._shifted(exc, offset)
        finally:
            self.busy_since = 0.0
        if failure is not None:
            raise failure
        return envs, None

    def reset(self, j: int, seed: int | None, stop: threading.Event) -> dict[NestedKey, np.ndarray]:
        self.busy_env, self.busy_phase, self.busy_since = j, "reset", time.perf_counter()
        try:
            return self._on_part(j, lambda part, i: part.reset(i, seed, stop))
        finally:
            self.busy_since = 0.0

    def random_action(self, j: int, columns: dict[NestedKey, ArraySpec], stop: threading.Event) -> dict:
        return self._on_part(j, lambda part, i: part.random_action(i, columns, stop))


class WorkerProcesses:
    """The processes of one loop's envs: build them, attach their shared buffers, close them.

    Args:
        factories: one env factory per env (picklable).
        num_workers: processes stepping envs (``2 <= num_workers <= len(factories)``). With one block
            (``envs_per_thread == len(factories)``) the main process is one of them: process 0
            (:class:`LocalEnvs`) takes the first share of the envs and ``num_workers - 1`` child
            processes the others. With several blocks, ``num_workers`` child processes (0 to
            ``num_workers - 1``) run them all.
        envs_per_thread: envs per block, stepped by one env thread in the parent. With at least
            ``num_workers`` blocks each process runs whole blocks; with fewer, a block is split
            over processes and its thread steps the parts concurrently (:class:`RemoteGroup`).
            Each part of a child is served by one thread in its process.
        seeds: the seed of each env's first reset (``None``: unseeded).
        max_episode_steps, validate, info_keys: as the loop's.
        name: used in process names.
        start_method: ``"spawn"`` (default) or ``"forkserver"``; both are safe with CUDA. Only a
            ``"spawn"`` child is started with SIGINT blocked (a ``"forkserver"`` child is forked from the
            server, with the server's signal handlers).
        timeout: seconds to wait for the processes to build and reset their envs.
        on_error: ``(env id, phase, failure, worker process or None) -> exception`` raised for an env that
            failed to build or reset, or a worker process that failed or died before it was attached.

    If the construction fails (or is interrupted), every env built is closed and every process ended
    before the exception propagates; see :meth:`close`.

    Raises:
        ValueError: an unpicklable factory, or envs whose specs differ.
        CollectionError: this process is daemonic (a ``DataLoader`` worker), so it cannot start processes;
            or it ran out of file descriptors starting them.
        EnvError: (from ``on_error``) an env failed to build or reset, or a worker process failed or died
            while starting (named by the env's global id and the process, the cause chained).
    """

    def __init__(self, factories: Sequence[EnvFactory], num_workers: int, envs_per_thread: int, *,
                 seeds: Sequence[int | None], max_episode_steps: int | None, validate: bool, name: str,
                 info_keys: InfoKeys | None = None,
                 start_method: str = "spawn", timeout: float = 120.0,
                 on_error: Callable[[int, str, EnvFailure, int | None], BaseException]) -> None:
        blobs = check_picklable(factories)
        if mp.current_process().daemon:
            raise CollectionError(
                f"num_workers={num_workers} runs envs in worker processes, and this process cannot start any: it "
                f"is daemonic ({mp.current_process().name!r}: a torch DataLoader worker, a multiprocessing Pool "
                "worker), and daemonic processes are not allowed to have children. Build the loop or collector in "
                "the main process, or pass num_workers=1 to keep its envs in threads")
        ctx = torch.multiprocessing.get_context(start_method)
        self._on_error = on_error
        num_blocks = len(factories) // envs_per_thread
        # Parts: a block's envs within one process, one pipe and one server thread each (see _plan_parts).
        # With one block (one env thread drives every process), the main process is process 0 and its env
        # thread steps that share (a LocalEnvs) while the children step theirs; with several env threads the
        # processes are all children: a thread stepping envs that hold the GIL here would starve the others
        # of it for the interpreter's switch interval (5 ms) at a time (measured: 5.7k against 8.2k steps/s
        # on the GIL-bound env, two blocks of 8).
        local = steps_in_main_process(len(factories), envs_per_thread)
        plans = _plan_parts(factories, blobs, seeds, num_workers=num_workers, envs_per_thread=envs_per_thread,
                            local=local)
        self.blocks: list[RemoteEnvs | LocalEnvs] = []  # every part, in env order (the main process's first)
        self.processes: list[Any] = []  # the children (worker processes 1 to num_workers - 1 when local)
        self.groups: list[RemoteEnvs | RemoteGroup] = []
        self._closed = False
        self._remote: list[RemoteEnvs] = []  # the children's parts (closed by close() even if construction fails)
        from .auto import usable_cores  # here: auto imports this module

        children = num_workers - 1 if local else num_workers
        cores = usable_cores()
        self.spins: list[float] = []  # each child's spin before it blocks on its pipe (seconds; "Waiting" above)
        close_at_exit(self)  # non-daemonic children: ended before multiprocessing's exit hook joins them
        try:
            for p in range(1 if local else 0, num_workers):  # children first: they build while we do
                mine = [plan for plan in plans if plan.process == p]
                self.spins.append(spin_seconds(len(mine), children, cores))
                try:
                    pairs = [ctx.Pipe(duplex=True) for _ in mine]
                    process = ctx.Process(target=_child_main, args=(mine, [c for _, c in pairs], max_episode_steps,
                                                                     validate, info_keys, self.spins[-1]),
                                          name=f"lightning_rollout-{name}-worker{p}", daemon=False)
                    self._start(process)
                except OSError as exc:  # out of file descriptors, or of processes
                    hint = _FDS_HINT if _out_of_fds(str(exc)) else ""
                    raise CollectionError(f"could not start worker process {p} ({type(exc).__name__}: {exc})"
                                          f"{hint}") from exc
                self.processes.append(process)
                for (parent_end, child_end), plan in zip(pairs, mine):
                    child_end.close()
                    self._remote.append(RemoteEnvs(process, parent_end, plan.env_ids, p))
            if local:  # process 0's one part: the first
                try:
                    self.blocks.append(LocalEnvs(plans[0], max_episode_steps=max_episode_steps, validate=validate,
                                                 info_keys=info_keys))
                except EnvFailure as failure:
                    raise on_error(plans[0].env_ids[failure.j], failure.phase, failure.cause, None) from failure.cause
            self.blocks += self._remote
            # What each env thread steps: its block's one part, or a group of parts in several processes.
            grouped: list[list[tuple[int, RemoteEnvs | LocalEnvs]]] = [[] for _ in range(num_blocks)]
            for plan, part in zip(plans, self.blocks):
                grouped[plan.block].append((plan.offset, part))
            self.groups = [  # a LocalEnvs is always in a group
                parts[0][1] if len(parts) == 1 else RemoteGroup(parts) for parts in grouped]
            for block in self._remote:
                try:
                    self._wait_ready(block, timeout)
                except EnvFailure as failure:
                    raise self._error(block, failure) from failure.cause
            ready = [cast(ChildReady, block.ready) for block in self.blocks]
            self.first = ready[0]  # the block of env 0's ready message: the loop's keys and specs
            self.first_roots: list[dict[NestedKey, np.ndarray]] = [root for r in ready for root in r.roots]
            for b, reply in enumerate(ready[1:], 1):
                if not reply.keys.same_layout(self.first.keys):
                    raise ValueError(f"the envs of block {b} have specs {reply.keys}, env 0 has {self.first.keys}; "
                                     "all envs of a loop must share their keys, shapes and dtypes")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _start(process: Any) -> None:
        """Start ``process`` with SIGINT blocked in this thread, so that the child starts with it blocked (the
        mask is kept across ``exec``): a Ctrl-C while it imports is not delivered to it. A SIGINT arriving
        meanwhile goes to another thread of this process, or waits until the mask is restored: none is lost."""
        if not hasattr(signal, "pthread_sigmask"):
            process.start()
            return
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()  # it unblocks SIGINT in the thread that starts it: before the mask
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def _error(self, block: RemoteEnvs, failure: EnvFailure) -> BaseException:
        """The constructor's error for ``block``'s ``failure`` (``on_error``, with the env's global id)."""
        if _out_of_fds(str(failure)):
            failure = EnvFailure(failure.j, failure.phase, failure.kind, failure.cause)
            failure.args = (f"{failure.args[0]}{_FDS_HINT}",)
        failure.process = block.index
        return self._on_error(block.env_ids[failure.j], failure.phase, failure, block.index)

    @staticmethod
    def _wait_ready(block: RemoteEnvs, timeout: float) -> None:
        """Wait for ``block``'s :class:`~.messages.ChildReady` (after its :class:`~.messages.ChildStarted`)
        and keep it as ``block.ready``. Raises :class:`EnvFailure`: the child's error, its death
        (:func:`_death`), or ``timeout`` s passed."""
        deadline = time.monotonic() + timeout
        while True:
            while not block.conn.poll(_POLL_S):
                if not block.process.is_alive() and not block.conn.poll(0):
                    raise _death(block)
                if time.monotonic() > deadline:
                    raise EnvFailure(0, "create", "env", TimeoutError(
                        f"worker process {block.process.name!r} did not build its envs within {timeout} s"))
            reply = _receive(block)
            if not isinstance(reply, ChildStarted):
                break
            block.started = True
        _payload(reply)  # raises the child's error
        assert isinstance(reply, ChildReady), reply
        block.ready = reply

    def attach(self, specs: dict[NestedKey, ArraySpec], *, inputs: Sequence[NestedKey], nxt: Sequence[NestedKey],
               checked_next: dict[NestedKey, ArraySpec], checked_root: dict[NestedKey, ArraySpec],
               zero_done: dict[NestedKey, ArraySpec]) -> None:
        """Allocate each block's shared buffers from the loop's column layout, hand them to its child and wait
        until every child attached them.

        Raises:
            CollectionError: this process ran out of file descriptors allocating or sending them.
            EnvError: (from ``on_error``) a child could not attach them, or died.
        """
        keys = self.first.keys
        for block in self.blocks:
            if isinstance(block, LocalEnvs):
                block.attach(checked_next, checked_root, zero_done)
                continue
            g = block.rows
            try:
                message = AttachBuffers({k: _to_shared(specs[k], g) for k in inputs},
                                        {k: _to_shared(keys.next[k], g) for k in nxt},
                                        {k: _to_shared(keys.root[k], g) for k in keys.root},
                                        tuple(torch.zeros(g, dtype=t).share_memory_()
                                              for t in (torch.float64, torch.bool, torch.bool)),
                                        checked_next, checked_root, zero_done)
                block.conn.send(message)
            except (OSError, RuntimeError) as exc:  # shm_open / dup refused: out of file descriptors, of memory
                hint = _FDS_HINT if _out_of_fds(str(exc)) else ""
                raise CollectionError(f"could not share the buffers of envs {list(block.env_ids)} with "
                                      f"worker process {block.index} ({type(exc).__name__}: {exc}){hint}") from exc
            block.inputs, block.next, block.root, block.reward, block.terminated, block.truncated = _views(message)
        for block in self._remote:  # every child attaches at once; each answers
            try:
                block._reply(None)
            except EnvFailure as failure:
                raise self._error(block, failure) from failure.cause

    def close(self, timeout: float = 5.0) -> None:
        """Close every block (the main process's envs too) and end every child, then release every resource
        at once: pipes, shared tensors and ``Process`` objects (no file descriptor waits for the garbage
        collector). Idempotent.

        A child whose blocks are all built is asked to close them (its envs are closed) and joined within
        ``timeout`` s in all, then terminated and killed; a child still starting or building its envs
        (construction given up: an error elsewhere, Ctrl-C) cannot read the request before it is done, so
        it is terminated at once.

        A close cut short (a second Ctrl-C during its joins) is finished by the next call: each of its
        steps can be made again.
        """
        if self._closed:
            return
        for block in self.blocks:
            if isinstance(block, LocalEnvs):
                block.close()
        listening = {id(p): all(part.ready for part in self._remote if part.process is p) for p in self.processes}
        for block in self._remote:
            if listening.get(id(block.process)) and block.process.is_alive():  # (not one closed by a close cut short)
                _send(block.conn, CloseEnvs())
        for process in self.processes:
            if not listening[id(process)] and process.is_alive():
                process.terminate()
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()
                process.join(1.0)
            if process.is_alive():
                process.kill()
                process.join(1.0)
        for block in self._remote:
            block.release()
        while self.processes:
            process = self.processes.pop()  # a closed Process cannot be joined again
            try:
                process.close()  # its sentinel's file descriptor
            except ValueError:  # still running after kill (not reaped yet): left to multiprocessing
                pass
        self.blocks, self._remote, self.processes, self.groups = [], [], [], []
        self._closed = True
