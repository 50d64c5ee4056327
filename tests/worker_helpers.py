"""Module-level envs and factories for the worker-failure tests (a spawned child imports them by name).

Each is a :class:`~process_helpers.CountEnv` (observation ``[env_id, episode, t]``) that misbehaves in one
way, in the process that runs it:

* :class:`RaisingEnv`: step ``at`` of env ``bad`` raises an exception of a given type (``SystemExit``,
  ``KeyboardInterrupt``: not ``Exception`` subclasses).
* :class:`KilledEnv`: env ``bad`` sends itself a signal while being built or at step ``at``.
* :class:`ClosingEnv`: every ``close()`` leaves a file ``closed-<env_id>-<pid>`` in a folder (counted
  across processes); env ``bad`` has a space the loop cannot store.
* :class:`WrongShapeEnv`: env ``bad`` returns an observation of the wrong shape from step ``at`` on.
* :class:`ForkingEnv`: starts (and joins) a process of its own when built.
* :class:`FdStarvedEnv`: lowers its process's file-descriptor limit to the descriptors open, so that the
  worker process cannot receive its shared buffers.
* :class:`SlowBuildEnv`: leaves a file ``building-<env_id>`` in a folder, then takes ``seconds`` to build.
* :func:`unpicklable_in_child`: a factory that pickles and whose unpickling raises (in a worker process).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import resource
import signal
import time
from pathlib import Path

import gymnasium as gym
import numpy as np

from process_helpers import CountEnv


class RaisingEnv(CountEnv):
    def __init__(self, env_id: int = 0, *, bad: int = 1, at: int = 3, kind: type[BaseException] = SystemExit) -> None:
        super().__init__(env_id)
        self.bad, self.at, self.kind = bad, at, kind

    def step(self, action):
        if self.env_id == self.bad and self.steps == self.at:
            raise self.kind(f"env {self.env_id} raised {self.kind.__name__} at step {self.steps}")
        return super().step(action)


class KilledEnv(CountEnv):
    def __init__(self, env_id: int = 0, *, bad: int = 1, at: int | None = 3, sig: int = signal.SIGKILL) -> None:
        super().__init__(env_id)
        self.bad, self.at, self.sig = bad, at, sig
        if env_id == bad and at is None:  # killed while being built
            os.kill(os.getpid(), sig)

    def step(self, action):
        if self.env_id == self.bad and self.steps == self.at:
            os.kill(os.getpid(), self.sig)
        return super().step(action)


class ClosingEnv(CountEnv):
    def __init__(self, env_id: int = 0, *, marks: str, bad: int | None = None) -> None:
        super().__init__(env_id)
        self.marks = marks
        if env_id == bad:
            self.observation_space = gym.spaces.Text(5)  # the loop cannot store it: the env is refused

    def close(self) -> None:
        Path(self.marks, f"closed-{self.env_id}-{os.getpid()}").touch()


def closed_envs(marks: str) -> list[int]:
    """The env ids closed so far (once each: a second close leaves the same file), in order."""
    return sorted(int(name.split("-")[1]) for name in os.listdir(marks) if name.startswith("closed-"))


class WrongShapeEnv(CountEnv):
    def __init__(self, env_id: int = 0, *, bad: int = 1, at: int = 2) -> None:
        super().__init__(env_id, length=100)
        self.bad, self.at = bad, at

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        if self.env_id == self.bad and self.steps > self.at:
            obs = np.zeros(5, np.float32)  # the space says (3,)
        return obs, reward, terminated, truncated, info


def _nothing() -> None:
    pass


class ForkingEnv(CountEnv):
    def __init__(self, env_id: int = 0) -> None:
        super().__init__(env_id)
        child = multiprocessing.get_context("fork").Process(target=_nothing)
        child.start()
        child.join(30)
        self.child_exitcode = child.exitcode


class FdStarvedEnv(CountEnv):
    """Leaves its process no free file descriptor: the limit lowered to the highest open one, and every
    free number below it (a closed descriptor's) taken by ``/dev/null``, held as long as the env."""

    def __init__(self, env_id: int = 0) -> None:
        super().__init__(env_id)
        highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        self.held: list[int] = []
        while True:
            try:
                self.held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:  # EMFILE: none left
                break


class SlowBuildEnv(CountEnv):
    def __init__(self, env_id: int = 0, *, marks: str, seconds: float = 60.0) -> None:
        super().__init__(env_id)
        Path(marks, f"building-{env_id}").touch()
        time.sleep(seconds)


def _refuse_to_unpickle(reason: str):
    raise RuntimeError(reason)


class _UnpicklableInChild:
    """Pickles (as a call of :func:`_refuse_to_unpickle`), so unpickling it raises, in whatever process."""

    def __call__(self) -> CountEnv:
        return CountEnv()

    def __reduce__(self):
        return (_refuse_to_unpickle, ("this factory cannot be rebuilt in another process",))


def unpicklable_in_child():
    """A factory that pickles, and whose unpickling raises ``RuntimeError``."""
    return _UnpicklableInChild()


def factories(cls: type, n: int, **kwargs) -> list:
    """``n`` picklable factories of ``cls`` (env ``i`` gets ``env_id=i``)."""
    return [functools.partial(cls, i, **kwargs) for i in range(n)]
