"""Shared fixtures and mocks for the lightning_rollout test suite.

* :class:`MockEnv`: a tiny deterministic gymnasium env. Its observation is
  ``[env_id, episode, t]`` (float32), so every transition says where it came
  from and stream continuity is checkable row by row. Episode ``e`` of env
  ``i`` lasts ``length_fn(i, e)`` steps and terminates, unless ``truncate_at``
  cuts it first (then it ends *truncated*). The reward of step ``t`` is
  ``reward_fn(i, e, t)``. It can be told to raise on its ``k``-th step.
* :class:`CountingPolicy`: a plain callable ``obs -> action`` that records the
  batch size of every forward pass run by the inference thread (the probe at
  construction, run in the caller's thread, is not counted).
* ``no_thread_leak`` (autouse): fails a test that leaves a ``lightning_rollout-*``
  thread alive.
* ``serial`` tests (they time steps to choose a layout) run alone under pytest-xdist
  (``make test`` runs ``-n auto``): see :func:`pytest_runtest_protocol`.
"""

from __future__ import annotations

import contextlib
import fcntl
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

THREAD_PREFIX = "lightning_rollout-"
# The first line of a script that a test interrupts with SIGINT: a shell starts background jobs with SIGINT
# ignored, their children inherit that, and Python then raises no KeyboardInterrupt; this restores it.
CATCH_SIGINT = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"


@contextlib.contextmanager
def _turn(item: pytest.Item) -> Iterator[None]:
    """Under pytest-xdist, a ``serial`` test runs while no other worker runs a test, and the others wait for it: a
    readers-writer lock of two ``flock`` files shared by the run's workers (the turnstile first, so a waiting
    ``serial`` test is not starved by the others' back-to-back shared holds)."""
    if not hasattr(item.config, "workerinput"):  # not an xdist worker: tests run one at a time anyway
        yield
        return
    alone = item.get_closest_marker("serial") is not None
    run = Path(item.config.option.basetemp).parent  # the run's temp folder, the workers' basetemps inside it
    with open(run / "serial.turnstile", "a") as turnstile, open(run / "serial.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Each test's setup, call and teardown (a module fixture's included) inside :func:`_turn`."""
    with _turn(item):
        yield


def _rollout_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX) and t.is_alive()}


@pytest.fixture(autouse=True)
def no_thread_leak():
    """No thread named ``lightning_rollout-*`` started by a test may outlive it."""
    before = _rollout_threads()
    yield
    leaked = sorted(t.name for t in _rollout_threads() - before)
    assert not leaked, f"threads left alive by the test: {leaked}"


def default_length(env_id: int, episode: int) -> int:
    """Episode lengths 3..6 that differ between envs and between episodes."""
    return 3 + (env_id + episode) % 4


def default_reward(env_id: int, episode: int, t: int) -> float:
    return 1.0 + 0.5 * t + 0.25 * env_id


class MockEnv(gym.Env):
    """Deterministic env whose observation ``[env_id, episode, t]`` encodes its position.

    Args:
        env_id: written into every observation.
        length_fn: ``(env_id, episode) -> steps`` until the episode terminates.
        reward_fn: ``(env_id, episode, t) -> reward`` of the ``t``-th step (0-based).
        truncate_at: if set, an episode still running after this many steps ends truncated.
        raise_on_step: if set, the ``k``-th call to ``step`` (0-based, counted over the env's
            whole life) raises ``RuntimeError``.
        raise_on_reset: if set, the ``k``-th call to ``reset`` (0-based) raises.
    """

    metadata: dict = {"render_modes": []}

    def __init__(self, env_id: int = 0, *, length_fn: Callable[[int, int], int] = default_length,
                 reward_fn: Callable[[int, int, int], float] = default_reward, truncate_at: int | None = None,
                 raise_on_step: int | None = None, raise_on_reset: int | None = None) -> None:
        self.env_id = env_id
        self.length_fn = length_fn
        self.reward_fn = reward_fn
        self.truncate_at = truncate_at
        self.raise_on_step = raise_on_step
        self.raise_on_reset = raise_on_reset
        self.observation_space = gym.spaces.Box(-1e6, 1e6, shape=(3,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.episode = -1
        self.t = 0
        self.num_steps = 0
        self.num_resets = 0
        self.actions: list[int] = []

    def _obs(self) -> np.ndarray:
        return np.array([self.env_id, self.episode, self.t], dtype=np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if self.raise_on_reset is not None and self.num_resets == self.raise_on_reset:
            raise RuntimeError(f"mock env {self.env_id} exploded on reset {self.num_resets}")
        self.num_resets += 1
        self.episode += 1
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        if self.raise_on_step is not None and self.num_steps == self.raise_on_step:
            raise RuntimeError(f"mock env {self.env_id} exploded on step {self.num_steps}")
        self.actions.append(int(action))
        reward = self.reward_fn(self.env_id, self.episode, self.t)
        self.t += 1
        self.num_steps += 1
        terminated = self.t >= self.length_fn(self.env_id, self.episode)
        truncated = (not terminated and self.truncate_at is not None and self.t >= self.truncate_at)
        return self._obs(), reward, terminated, truncated, {}


def assert_batches_equal(ours: Sequence, reference: Sequence) -> None:
    """As many batches, each with the reference's keys and every entry equal value for value (``ours`` may
    live on another device: compared on the CPU)."""
    assert len(ours) == len(reference)
    for a, b in zip(ours, reference):
        assert set(a.keys(True, True)) == set(b.keys(True, True))
        for key in b.keys(True, True):
            assert torch.equal(a[key].cpu(), b[key]), key


def mock_envs(n: int, **kwargs) -> list[Callable[[], MockEnv]]:
    """``n`` factories; factory ``i`` builds a :class:`MockEnv` with ``env_id=i``."""
    return [lambda i=i: MockEnv(i, **kwargs) for i in range(n)]


def called_from_probe() -> bool:
    """True inside the calls a loop makes at construction: ``AutobatchPolicy.probe`` (shape discovery)
    and ``policy._wrap`` (counting a tensor function's outputs, as TorchRL's auto-wrapping does)."""
    frame = sys._getframe(1)
    while frame is not None:
        # a call bounded by policy_timeout runs in a helper thread: its lambda's qualified name still names the method
        parts = frame.f_code.co_qualname.split(".")
        if {"probe", "_wrap"} & set(parts) and frame.f_code.co_filename.endswith("policy.py"):
            return True
        frame = frame.f_back
    return False


class CountingPolicy:
    """Plain callable policy ``obs[B, 3] -> action[B]`` that counts its forward passes.

    The action is ``(episode + t) % 2`` of the observation (deterministic). Every forward pass
    is recorded (whichever thread runs it) except the loop's one-row probe at construction
    (``AutobatchPolicy.probe``), so batch sizes are those of real flushes.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.batch_sizes: list[int] = []

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        if not called_from_probe():
            with self._lock:
                self.batch_sizes.append(int(obs.shape[0]))
        return (obs[:, 1] + obs[:, 2]).long() % 2

    @property
    def calls(self) -> int:
        return len(self.batch_sizes)

    @property
    def mean_batch_size(self) -> float:
        return sum(self.batch_sizes) / len(self.batch_sizes) if self.batch_sizes else 0.0


class ArgmaxNet(torch.nn.Module):
    """A module policy (it has a ``state_dict``): ``obs[B, 3] -> argmax of a linear layer``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.lin(obs).argmax(-1)


class StatefulMockPolicy:
    """The seed's ``MockPolicy(state)``: an integer state behind ``state_dict`` / ``load_state_dict``."""

    def __init__(self, state: int) -> None:
        self.value = state

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.zeros(obs.shape[0], dtype=torch.long)

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = int(state["value"])


@pytest.fixture
def counting_policy() -> CountingPolicy:
    return CountingPolicy()


class Watchdog:
    """Runs ``fn`` in a helper thread and fails the test if it takes more than ``timeout`` seconds.

    Used to prove a call returns (or raises) in bounded time without any sleep: the
    helper's result or exception is handed back to the test's thread.
    """

    def __init__(self, timeout: float = 20.0) -> None:
        self.timeout = timeout

    def __call__(self, fn: Callable[[], object]) -> object:
        box: dict[str, object] = {}
        finished = threading.Event()

        def target() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed back to the caller
                box["error"] = exc
            finally:
                finished.set()

        thread = threading.Thread(target=target, name="test-watchdog", daemon=True)
        thread.start()
        assert finished.wait(self.timeout), f"call did not return within {self.timeout} s"
        thread.join()
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box.get("value")


@pytest.fixture
def within() -> Watchdog:
    """``within(fn)`` runs ``fn`` and fails the test if it has not returned or raised within 20 s."""
    return Watchdog(20.0)


@pytest.fixture
def loaded_cores():
    """A process spinning in Python on every core this process may use, for the test's duration: measures that
    decide a layout must read the same on a busy machine."""
    from lightning_rollout.loop.auto import usable_cores

    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(usable_cores())]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait(10)


def steps_per_env(td) -> dict[int, int]:
    """How many steps of each env a batch holds (any layout): ``{env_id: count}``."""
    from collections import Counter

    return dict(Counter(td.reshape(-1)["collector", "env_id"].tolist()))
