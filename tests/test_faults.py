"""Fault injection: every failure surfaces as a clear exception, in bounded time, nothing lost, no thread left.

Each fault test checks four promises:

1. the exception's class and message name the env id, the step and what was wrong;
2. it arrives within a bound (a watchdog thread, :func:`reliability_helpers.bounded`);
3. what was collected before the fault is on ``exc.partial`` (a TensorDict), and for the
   failing env it is exactly its steps before the fault, in order;
4. no ``lightning_rollout-*`` thread is alive afterwards.

Interruption runs real processes: a ``SIGINT`` sent to a collecting subprocess makes
``KeyboardInterrupt`` propagate out of the collection call **after the loop closed
itself** (threads joined). The subprocess here catches it and exits with code **130**
(the shell's code for SIGINT); a script that does not catch it dies by SIGINT, which
``subprocess`` reports as ``-2`` (also 130 in a shell). Both are accepted; an abort
("terminate called without an active exception", "Fatal Python error") never is.
"""

from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from conftest import CATCH_SIGINT, ArgmaxNet, CountingPolicy, MockEnv, called_from_probe, mock_envs
from lightning_rollout import (AutobatchPolicy, CollectionError, EnvError, EnvLoop, EventProcessor, MultiEnvLoop,
                               PolicyError,
                               StepTimeoutError, ThreadedCollector)
from reliability_helpers import assert_no_rollout_threads, bounded, rollout_threads

pytestmark = pytest.mark.timeout(120)

BOUND = 30.0  # seconds: generous, only to tell a hang from a slow machine
LONG = 10 ** 6  # an episode length never reached: observation t == env steps done


def long_envs(n: int, **kwargs) -> list:
    return [lambda i=i: MockEnv(i, length_fn=lambda e, k: LONG, **kwargs) for i in range(n)]


def check_prefix(partial: TensorDict, env_id: int, expected_steps: int) -> None:
    """In ``partial`` (flat or [N, T]), env ``env_id`` delivered exactly its steps 0..expected_steps-1."""
    flat = partial.reshape(-1)
    rows = flat[flat["collector", "env_id"] == env_id]
    obs = rows["observation"]
    assert obs.shape[0] == expected_steps, (obs.shape, expected_steps)
    if expected_steps:
        ts = sorted(obs[:, 2].tolist())
        assert ts == list(range(expected_steps))
        assert torch.equal(rows["next", "observation"][:, 2], rows["observation"][:, 2] + 1)


def check_stream(partial: TensorDict) -> None:
    """Each env's rows are consecutive within an episode (next obs of one row == obs of the next)."""
    flat = partial.reshape(-1)
    for env_id in flat["collector", "env_id"].unique().tolist():
        rows = flat[flat["collector", "env_id"] == env_id]
        order = torch.argsort(rows["observation"][:, 1] * LONG + rows["observation"][:, 2])
        obs, nxt = rows["observation"][order], rows["next", "observation"][order]
        done = rows["next", "done"][order].reshape(-1)
        same = obs[1:, 1] == obs[:-1, 1]  # consecutive rows of one episode
        assert torch.equal(nxt[:-1][same], obs[1:][same]), f"env {env_id}: a gap or a duplicate"
        assert not done[:-1][same].any(), f"env {env_id}: a step after done in the same episode"


# ----------------------------------------------------------------------------------------------------------
# Env faults


class BadObsEnv(MockEnv):
    """Returns a bad observation from its ``at``-th call to ``step`` (0-based)."""

    def __init__(self, env_id: int, kind: str, at: int | None) -> None:
        super().__init__(env_id, length_fn=lambda e, k: LONG)
        self.kind, self.at = kind, at

    def step(self, action):
        index = self.num_steps
        obs, reward, terminated, truncated, info = super().step(action)
        if index == self.at:
            if self.kind == "shape":
                obs = np.zeros(4, np.float32)
            elif self.kind == "dtype":
                obs = np.array(["a", "b", "c"])
            elif self.kind == "nan":
                obs = obs.copy()
                obs[1] = np.nan
        return obs, reward, terminated, truncated, info


def _collect(mode: str, factories, **kwargs):
    """Run one collection call that will meet the fault; return the raised exception."""
    loop = MultiEnvLoop(factories, CountingPolicy(), **kwargs)
    try:
        if mode == "run_steps":
            loop.run_steps(LONG)
        elif mode == "run_env_steps":
            loop.run_env_steps(LONG)
        else:
            loop.run_episodes(4 * len(factories))
    except CollectionError as exc:
        assert loop.closed
        return exc
    finally:
        loop.close()
    pytest.fail("no exception")


MODES = ["run_steps", "run_env_steps"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lookahead", [True, False])
@pytest.mark.parametrize("parallel_steps", [False, True, "free"], ids=["sequential", "parallel_steps", "free"])
def test_env_raises_at_random_step(mode, lookahead, parallel_steps):
    """``exc.partial`` keeps every step made before the fault, every step of env ``bad`` among them, flat in
    arrival order whether the call was ``run_steps`` or ``run_env_steps``."""
    rng = random.Random(f"{mode}{lookahead}")
    num_envs, bad, k = 3, rng.randrange(3), rng.randrange(1, 30)
    envs: list[MockEnv] = []
    factories = [lambda i=i: envs.append(MockEnv(i, length_fn=lambda e, kk: LONG,
                                                 raise_on_step=k if i == bad else None)) or envs[-1]
                 for i in range(num_envs)]
    layout = dict(envs_per_thread=3, parallel_steps=parallel_steps) if parallel_steps else dict(autobatch_size=2)
    exc = bounded(lambda: _collect(mode, factories, lookahead=lookahead, **layout), BOUND)
    assert isinstance(exc, EnvError) and not isinstance(exc, StepTimeoutError)
    assert (exc.env_id, exc.step, exc.phase) == (bad, k, "step")
    assert f"env {bad}" in str(exc) and f"step {k}" in str(exc) and "exploded" in str(exc)
    assert isinstance(exc.__cause__, RuntimeError)  # the original traceback is kept
    # every step env `bad` made before the fault is delivered, in arrival order ([n]), whatever the call's layout
    assert exc.partial is not None and exc.partial.batch_dims == 1
    check_prefix(exc.partial, bad, k)
    check_stream(exc.partial)
    assert_no_rollout_threads()


@pytest.mark.parametrize("reset_index", [0, 2])
@pytest.mark.parametrize("mode", ["run_steps", "run_env_steps"])
def test_env_raises_in_reset(reset_index, mode):
    # reset 0 is the first one (at construction, as TorchRL's collector resets); reset 2 follows the
    # second episode.
    factories = [lambda i=i: MockEnv(i, length_fn=lambda e, k: 3, raise_on_reset=reset_index if i == 1 else None)
                 for i in range(3)]

    layout = dict(envs_per_thread=3, parallel_steps="free") if mode == "run_env_steps" else {}

    def collect() -> BaseException:
        try:
            return _collect(mode, factories, **layout)
        except EnvError as exc:  # raised by the constructor
            return exc

    exc = bounded(collect, BOUND)
    assert isinstance(exc, EnvError)
    assert (exc.env_id, exc.phase) == (1, "reset")
    assert exc.step == 3 * reset_index  # env steps done before the failing reset
    assert "env 1" in str(exc) and "reset" in str(exc) and f"step {3 * reset_index}" in str(exc)
    if reset_index:
        check_prefix_eps = exc.partial.reshape(-1)
        rows = check_prefix_eps[check_prefix_eps["collector", "env_id"] == 1]
        # The episode's last (done) step is delivered before the failing reset is raised.
        assert rows.numel() == 3 * reset_index
        check_stream(rows)
    assert_no_rollout_threads()


def test_env_raises_during_run_episodes_keeps_finished_episodes():
    # env 0's 4th step call raises: its first episode (3 steps) is complete and must be kept.
    factories = [lambda i=i: MockEnv(i, length_fn=lambda e, k: 3, raise_on_step=3 if i == 0 else None)
                 for i in range(2)]
    loop = MultiEnvLoop(factories, CountingPolicy(), lookahead=False)
    with pytest.raises(EnvError) as info:
        bounded(lambda: loop.run_episodes(10, rng=random.Random(0)), BOUND)
    exc = info.value
    assert exc.env_id == 0 and exc.phase == "step"
    assert exc.partial is not None and exc.partial.numel() >= 3
    env0 = exc.partial[exc.partial["collector", "env_id"] == 0]
    assert env0.numel() == 3 and bool(env0["next", "done"][-1])
    assert loop.closed
    assert_no_rollout_threads()


@pytest.mark.parametrize("kind, words", [("shape", "shape (4,)"), ("dtype", "dtype <U1"), ("nan", "NaN")])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("parallel_steps", [False, True, "free"], ids=["sequential", "parallel_steps", "free"])
def test_env_bad_observation(kind, words, mode, parallel_steps):
    at = 7
    factories = [lambda i=i: BadObsEnv(i, kind, at if i == 2 else None) for i in range(4)]
    exc = bounded(lambda: _collect(mode, factories, envs_per_thread=2, parallel_steps=parallel_steps), BOUND)
    assert isinstance(exc, EnvError)
    assert (exc.env_id, exc.step, exc.phase) == (2, at, "check")
    assert words in str(exc) and "env 2" in str(exc) and f"step {at}" in str(exc)
    assert exc.partial is not None
    check_stream(exc.partial)
    check_prefix(exc.partial, 2, at)  # in arrival order, whatever the call
    assert_no_rollout_threads()


class FinitePolicy(CountingPolicy):
    """CountingPolicy that raises on an observation holding NaN (as a policy checking its inputs would)."""

    def __call__(self, obs):
        if not called_from_probe() and torch.isnan(obs).any():
            raise ValueError("the policy was given NaN")
        return super().__call__(obs)


@pytest.mark.parametrize("later", ["env", "policy"])
@pytest.mark.parametrize("parallel_steps", [False, True], ids=["sequential", "parallel_steps"])
def test_a_nan_observation_is_reported_before_a_later_error_of_the_same_quota(later, parallel_steps):
    # The block checks its observations for NaN once a quota; a failure after the NaN step (another env's
    # exception, or the policy refusing the NaN it was then given) must still give way to it.
    at = 5
    factories = [lambda i=i: BadObsEnv(i, "nan", at if i == 2 else None) for i in range(4)]
    if later == "env":
        factories[3] = lambda: MockEnv(3, length_fn=lambda e, k: LONG, raise_on_step=at + 3)
    policy = FinitePolicy() if later == "policy" else CountingPolicy()

    def collect() -> BaseException:
        loop = MultiEnvLoop(factories, policy, envs_per_thread=4, parallel_steps=parallel_steps)
        try:
            loop.run_env_steps(64)
        except CollectionError as exc:
            return exc
        finally:
            loop.close()
        pytest.fail("no exception")

    exc = bounded(collect, BOUND)
    assert isinstance(exc, EnvError) and (exc.env_id, exc.step, exc.phase) == (2, at, "check")
    assert "NaN" in str(exc)
    check_prefix(exc.partial, 2, at)
    check_stream(exc.partial)
    assert_no_rollout_threads()


# ----------------------------------------------------------------------------------------------------------
# Policy faults


class FaultyPolicy(CountingPolicy):
    """CountingPolicy whose ``k``-th forward pass (1-based, the loop's probe not counted) goes wrong."""

    def __init__(self, k: int, kind: str) -> None:
        super().__init__()
        self.k, self.kind, self.n = k, kind, 0

    def __call__(self, obs):
        if not called_from_probe():
            self.n += 1
            if self.n == self.k:
                b = obs.shape[0]
                if self.kind == "raise":
                    raise RuntimeError("policy exploded")
                if self.kind == "batch":
                    return torch.zeros(b + 1, dtype=torch.long)
                if self.kind == "row_shape":
                    return torch.zeros(b, 3, dtype=torch.long)
                if self.kind == "no_action":
                    return TensorDict({"logits": torch.zeros(b, 2)}, [b])
        return super().__call__(obs)


POLICY_FAULTS = [("raise", "policy exploded"), ("batch", "shape (2,) for a batch of 1"),
                 ("row_shape", "shape (3,)"), ("no_action", "'action'")]


@pytest.mark.parametrize("kind, words", POLICY_FAULTS)
@pytest.mark.parametrize("lookahead", [True, False])
def test_policy_fault_on_kth_call_single_env(kind, words, lookahead):
    # One env: the k-th forward pass acts the env's step k-1 exactly.
    k = 5
    loop = EnvLoop(lambda: MockEnv(0, length_fn=lambda e, kk: LONG), FaultyPolicy(k, kind), lookahead=lookahead)
    with pytest.raises(PolicyError) as info:
        bounded(lambda: loop.run_steps(LONG), BOUND)
    exc = info.value
    assert words in str(exc), str(exc)
    assert exc.env_ids == (0,) and exc.step == k - 1
    assert f"at step {k - 1}" in str(exc) and "envs [0]" in str(exc)
    if kind == "raise":
        assert isinstance(exc.__cause__, PolicyError) and isinstance(exc.__cause__.__cause__, RuntimeError)
    check_prefix(exc.partial, 0, k - 1)
    assert loop.closed
    assert_no_rollout_threads()


@pytest.mark.parametrize("kind, words", [("raise", "policy exploded"), ("batch", "leading dim must be the batch size"),
                                         ("row_shape", "shape (3,)"), ("no_action", "'action'")])
@pytest.mark.parametrize("mode", MODES)
def test_policy_fault_on_kth_call_many_envs(kind, words, mode):
    """``exc.partial`` holds every step the envs completed before the failing policy call, in arrival order."""
    envs: list[MockEnv] = []
    factories = [lambda f=f: envs.append(f()) or envs[-1] for f in long_envs(4)]
    loop = MultiEnvLoop(factories, FaultyPolicy(6, kind), autobatch_size=2, envs_per_thread=1)
    run = (lambda: loop.run_steps(LONG)) if mode == "run_steps" else (lambda: loop.run_env_steps(LONG))
    with pytest.raises(PolicyError) as info:
        bounded(run, BOUND)
    exc = info.value
    assert words in str(exc), str(exc)
    assert exc.env_ids and set(exc.env_ids) <= set(range(4)) and exc.step is not None
    assert f"at step {exc.step}" in str(exc)
    completed = [e.num_steps for e in envs]  # steps each env completed: every one is in the partial batch
    assert exc.partial is not None and exc.partial.shape[0] == sum(completed)
    check_stream(exc.partial)
    assert_no_rollout_threads()


def test_policy_fault_in_collector_shuts_it_down():
    collector = ThreadedCollector(long_envs(2), FaultyPolicy(4, "raise"), frames_per_batch=4, on_policy=False)
    with pytest.raises(PolicyError, match="policy exploded") as info:
        bounded(lambda: [None for _ in collector], BOUND)
    assert info.value.partial is not None or info.value.step is not None
    assert_no_rollout_threads()
    collector.shutdown()


def test_tensordict_policy_without_action_is_refused_at_construction():
    module = TensorDictModule(lambda x: x.sum(-1, keepdim=True), in_keys=["observation"], out_keys=["value"])
    with pytest.raises(PolicyError, match="'action'"):
        MultiEnvLoop(mock_envs(2), module)
    assert_no_rollout_threads()


def test_bad_weights_do_not_kill_the_inference_thread():
    policy = torch.nn.Sequential(torch.nn.Linear(3, 2))
    loop = MultiEnvLoop(mock_envs(2), lambda obs: policy(obs).argmax(-1), autobatch_size=2)
    module_loop = MultiEnvLoop(mock_envs(2), ArgmaxNet(), autobatch_size=2)
    try:
        module_loop.run_steps(4)
        version = module_loop.policy_version
        with pytest.raises(ValueError, match="rejected the new weights"):
            bounded(lambda: module_loop.update_policy({"foo": torch.zeros(1)}), BOUND)
        assert module_loop.policy_version == version
        batch = bounded(lambda: module_loop.run_steps(8), BOUND)  # still serving
        assert batch.numel() == 8
    finally:
        loop.close()
        module_loop.close()
    assert_no_rollout_threads()


# ----------------------------------------------------------------------------------------------------------
# Hung env


class HangingEnv(MockEnv):
    """Blocks forever (until ``release`` is set) in its ``at``-th step call."""

    def __init__(self, env_id: int, at: int | None, release: threading.Event) -> None:
        super().__init__(env_id, length_fn=lambda e, k: LONG)
        self.at, self.release = at, release

    def step(self, action):
        if self.num_steps == self.at:
            self.release.wait()
        return super().step(action)


@pytest.fixture
def release():
    """Set at teardown so an abandoned env thread leaves its blocked step and exits."""
    event = threading.Event()
    before = set(threading.enumerate())
    yield event
    event.set()
    for t in set(threading.enumerate()) - before:
        if t.name.startswith("lightning_rollout-"):
            t.join(BOUND)


@pytest.mark.parametrize("mode", MODES)
def test_step_timeout_on_hung_env(release, mode):
    factories = [lambda i=i: HangingEnv(i, 4 if i == 1 else None, release) for i in range(3)]
    loop = MultiEnvLoop(factories, CountingPolicy(), step_timeout=0.5, join_timeout=5.0)
    run = (lambda: loop.run_steps(LONG)) if mode == "run_steps" else (lambda: loop.run_env_steps(LONG))
    with pytest.warns(RuntimeWarning, match="abandoned"):
        with pytest.raises(StepTimeoutError) as info:
            bounded(run, BOUND)
    exc = info.value
    assert (exc.env_id, exc.step) == (1, 4)
    assert "step_timeout=0.5" in str(exc) and "lightning_rollout-loop-env1" in str(exc) and "env 1" in str(exc)
    assert exc.partial is not None
    check_stream(exc.partial)
    check_prefix(exc.partial, 1, 4)  # the hung env's complete steps are kept
    # the stuck thread is the only one left (a daemon); the others were shut down
    assert [t.name for t in rollout_threads()] == ["lightning_rollout-loop-env1"]
    assert all(t.daemon for t in rollout_threads())
    release.set()


def test_step_timeout_in_collector(release):
    factories = [lambda i=i: HangingEnv(i, 2 if i == 0 else None, release) for i in range(2)]
    collector = ThreadedCollector(factories, CountingPolicy(), frames_per_batch=4, step_timeout=0.5, name="hang",
                                  envs_per_thread=1, num_workers=1)
    with pytest.warns(RuntimeWarning, match="abandoned"):
        with pytest.raises(StepTimeoutError, match="env 0"):
            bounded(lambda: [None for _ in collector], BOUND)
    assert [t.name for t in rollout_threads()] == ["lightning_rollout-hang-env0"]
    collector.shutdown()


# ----------------------------------------------------------------------------------------------------------
# close() / shutdown() from another thread in the middle of a batch


class SignallingEnv(MockEnv):
    """Sets ``event`` at its ``at``-th step call (never blocks)."""

    def __init__(self, env_id: int, at: int, event: threading.Event) -> None:
        super().__init__(env_id)
        self.at, self.event = at, event

    def step(self, action):
        if self.num_steps == self.at:
            self.event.set()
        return super().step(action)


@pytest.mark.parametrize("mode", ["run_steps", "run_env_steps", "run_episodes"])
def test_close_from_another_thread_mid_batch(mode):
    midway = threading.Event()
    loop = MultiEnvLoop([lambda i=i: SignallingEnv(i, 50, midway) for i in range(3)], CountingPolicy())
    closer_done = threading.Event()

    def closer() -> None:
        midway.wait(BOUND)
        loop.close()
        closer_done.set()

    thread = threading.Thread(target=closer, name="test-closer")
    thread.start()
    run = {"run_steps": lambda: loop.run_steps(LONG), "run_env_steps": lambda: loop.run_env_steps(LONG),
           "run_episodes": lambda: loop.run_episodes(LONG)}[mode]
    try:
        bounded(run, BOUND)
    except CollectionError as exc:
        assert "closed" in str(exc)
    thread.join(BOUND)
    assert closer_done.is_set(), "close() did not return"
    assert_no_rollout_threads()


@pytest.mark.parametrize("layout", ["env_time", "flat"])
def test_collector_shutdown_from_another_thread_mid_batch(layout):
    midway = threading.Event()
    collector = ThreadedCollector([lambda i=i: SignallingEnv(i, 50, midway) for i in range(2)], CountingPolicy(),
                                  frames_per_batch=2 * LONG, layout=layout, on_policy=False)
    thread = threading.Thread(target=lambda: (midway.wait(BOUND), collector.shutdown()), name="test-closer")
    thread.start()
    try:
        bounded(lambda: next(iter(collector)), BOUND)
    except CollectionError as exc:
        assert "closed" in str(exc) or "shut down" in str(exc)
    thread.join(BOUND)
    assert not thread.is_alive()
    assert_no_rollout_threads()


@pytest.mark.parametrize("trial", range(3))
def test_collector_with_worker_processes_shut_down_from_another_thread_raises_the_documented_error(trial):
    """Issue 46 D: ``shutdown()`` from a second thread while the first iterates a collector whose envs run in
    worker processes. The iterating thread always gets :class:`CollectionError` (not ``ValueError: process
    object is closed`` from ``multiprocessing``), and nothing is left running."""
    from process_helpers import count_envs

    collector = ThreadedCollector(count_envs(4), CountingPolicy(), frames_per_batch=4 * LONG, num_envs=4,
                                  num_workers=2, envs_per_thread=2, on_policy=False)
    collecting = threading.Event()

    def closer() -> None:
        deadline = time.monotonic() + BOUND
        while not collector.loop.collecting and time.monotonic() < deadline:
            threading.Event().wait(0.005)
        threading.Event().wait(0.05 * trial)  # a little into the batch: the children are stepping
        collector.shutdown()
        collecting.set()

    thread = threading.Thread(target=closer, name="test-closer")
    thread.start()
    with pytest.raises(CollectionError, match="closed|shut down"):
        bounded(lambda: next(iter(collector)), BOUND)
    thread.join(BOUND)
    assert collecting.is_set() and not thread.is_alive()
    assert_no_rollout_threads()
    import multiprocessing

    assert not [p for p in multiprocessing.active_children() if p.name.startswith("lightning_rollout-")]


# ----------------------------------------------------------------------------------------------------------
# Interruption and interpreter exit, in real subprocesses

_PRELUDE = textwrap.dedent("""
    import sys, threading
    import gymnasium as gym, numpy as np, torch
    from lightning_rollout import MultiEnvLoop, ThreadedCollector

    class Env(gym.Env):
        def __init__(self):
            self.observation_space = gym.spaces.Box(-1e6, 1e6, (3,), np.float32)
            self.action_space = gym.spaces.Discrete(2)
            self.t = 0
        def reset(self, *, seed=None, options=None):
            self.t = 0
            return np.zeros(3, np.float32), {}
        def step(self, action):
            self.t += 1
            return np.full(3, self.t, np.float32), 1.0, self.t >= 20, False, {}

    net = torch.nn.Linear(3, 2)
    def policy(obs):
        return net(obs).argmax(-1)
    def alive():
        return [t.name for t in threading.enumerate() if t.name.startswith("lightning_rollout-")]
""")

_SCRIPTS = {
    "loop_sigint": """
        loop = MultiEnvLoop(Env, policy, num_envs=4, autobatch_size=2)
        loop.run_steps(100)
        try:
            print("READY", flush=True)
            while True:
                loop.run_steps(1000)
        except KeyboardInterrupt:
            # Almost always the signal lands inside run_steps, which closes the loop itself; the
            # few microseconds between READY and the first run_steps are covered by the close().
            loop.close()
            print("INTERRUPTED closed=%s alive=%s" % (loop.closed, alive()), flush=True)
            sys.exit(130)
    """,
    "collector_sigint": """
        collector = ThreadedCollector(Env, policy, num_envs=4, frames_per_batch=64, on_policy=False)
        for i, batch in enumerate(collector):
            if i == 1:
                print("READY", flush=True)
    """,
    "never_shut_down": """
        collector = ThreadedCollector(Env, policy, num_envs=4, frames_per_batch=64, on_policy=False)
        for i, batch in enumerate(collector):
            if i == 3:
                break
        loop = MultiEnvLoop(Env, policy, num_envs=3, envs_per_thread=3)
        loop.run_steps(30)
        print("DONE", flush=True)
    """,
}


def _spawn(name: str) -> subprocess.Popen:
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = CATCH_SIGINT + _PRELUDE + textwrap.dedent(_SCRIPTS[name])
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=root, env=env)


def _finish(proc: subprocess.Popen, timeout: float = 60.0) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the subprocess did not exit within {timeout} s\nstdout: {out}\nstderr: {err}")
    for bad in ("terminate called", "Fatal Python error", "Aborted", "Segmentation fault"):
        assert bad not in err, err
    return out, err


def _wait_ready(proc: subprocess.Popen) -> None:
    # readline blocks until the line comes or the process dies (EOF); the test timeout bounds it.
    line = proc.stdout.readline()
    if line.strip() != "READY":
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"no READY line (got {line!r}); stderr: {err}")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigint_during_loop_collection_exits_130():
    proc = _spawn("loop_sigint")
    _wait_ready(proc)
    os.kill(proc.pid, signal.SIGINT)
    out, err = _finish(proc, BOUND)
    assert proc.returncode == 130, (proc.returncode, out, err)
    assert "INTERRUPTED closed=True alive=[]" in out, out


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigint_during_collector_iteration_uncaught():
    proc = _spawn("collector_sigint")
    _wait_ready(proc)
    os.kill(proc.pid, signal.SIGINT)
    out, err = _finish(proc, BOUND)
    # uncaught KeyboardInterrupt: Python re-raises SIGINT on itself -> -2 here, 130 in a shell
    assert proc.returncode in (-signal.SIGINT, 130), (proc.returncode, err)
    assert "KeyboardInterrupt" in err


@pytest.mark.parametrize("envs_per_thread", [1, 4], ids=["a thread an env", "one thread"])
def test_ctrl_c_inside_a_lock_entry_of_the_driver_leaves_no_thread_blocked(monkeypatch, recwarn, envs_per_thread):
    """Ctrl-C can land where Python cannot guard it: inside a :class:`threading.Condition`'s ``__enter__``
    (Python code), after the lock is acquired and before the ``with`` block starts, so its ``__exit__``
    never runs. The driver parks and unparks the policy's agents on every grant; had it entered the
    policy's lock that way, the lock would stay held and every env thread would block on it (what a
    ``SIGINT`` test found, once in 150 runs under load). Here the first such entry the driver makes while
    collecting raises ``KeyboardInterrupt`` at that worst point; the loop must still close within its
    bounds, every env thread ended and no thread reported stuck."""
    loop = MultiEnvLoop(mock_envs(4), CountingPolicy(), num_envs=4, envs_per_thread=envs_per_thread,
                        autobatch_size=2, join_timeout=5.0)
    loop.run_steps(8)
    original = threading.Condition.__enter__
    driver: list[threading.Thread] = []
    fired: list[threading.Condition] = []

    def enter_then_interrupt(self: threading.Condition) -> bool:
        entered = original(self)
        if driver and threading.current_thread() is driver[0] and not fired:
            fired.append(self)
            raise KeyboardInterrupt  # the lock is held and this ``with`` never reaches its ``__exit__``
        return entered

    def collect() -> None:
        driver.append(threading.current_thread())
        monkeypatch.setattr(threading.Condition, "__enter__", enter_then_interrupt)
        try:
            for _ in range(20):
                loop.run_steps(64)
        except KeyboardInterrupt:
            assert fired  # it landed in a lock entry of the driver's own (an Event the driver sets or clears)
        finally:
            monkeypatch.undo()

    bounded(collect, BOUND, "collecting")
    bounded(loop.close, BOUND, "close")
    assert not [w for w in recwarn if "stuck" in str(w.message)], [str(w.message) for w in recwarn]
    assert_no_rollout_threads()


def test_ctrl_c_while_a_collection_call_claims_the_loop_leaves_no_claim_behind(monkeypatch):
    """A collection call claims the loop (one driver at a time). A ``KeyboardInterrupt`` landing inside the
    claim must leave the loop unclaimed (the next call runs instead of being refused as 'already collecting');
    one landing inside the call leaves it unclaimed and closed."""
    loop = MultiEnvLoop(mock_envs(2), CountingPolicy(), num_envs=2)
    me, real = threading.current_thread(), threading.current_thread
    fired: list[bool] = []

    def interrupt_the_claim_once() -> threading.Thread:
        thread = real()
        if thread is me and not fired:
            fired.append(True)
            raise KeyboardInterrupt  # inside the claim: the lock is held, the claim half made
        return thread

    try:
        monkeypatch.setattr(threading, "current_thread", interrupt_the_claim_once)
        with pytest.raises(KeyboardInterrupt):
            loop.run_steps(4)
        monkeypatch.undo()
        assert fired and not loop.collecting
        assert loop.run_steps(4).numel() == 4

        class Interrupting(EventProcessor):  # inside the call, past the claim
            wants_timesteps = True

            def on_timestep(self, step) -> None:
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            loop.run_steps(2, processor=Interrupting())
        assert not loop.collecting and loop.closed  # a call cut at an arbitrary point closes the loop
    finally:
        monkeypatch.undo()
        loop.close()


def test_a_close_cut_short_by_ctrl_c_is_finished_by_the_next_close(monkeypatch):
    """A second Ctrl-C while :meth:`close` waits (here, while it closes the policy) cuts it short; the next
    ``close()`` does the rest: the inference thread and every env thread end."""
    loop = MultiEnvLoop(mock_envs(4), CountingPolicy(), num_envs=4, autobatch_size=2)
    loop.run_steps(8)
    close_policy = loop.policy.close
    calls: list[float] = []

    def interrupted_once(timeout: float = 5.0) -> None:
        calls.append(timeout)
        if len(calls) == 1:
            raise KeyboardInterrupt
        close_policy(timeout)

    monkeypatch.setattr(loop.policy, "close", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        loop.close()
    assert loop.closed
    with pytest.raises(CollectionError, match="closed"):
        loop.run_steps(4)
    bounded(loop.close, BOUND, "the second close")
    assert len(calls) == 2
    assert_no_rollout_threads()


def test_exit_without_shutdown_is_clean():
    proc = _spawn("never_shut_down")
    out, err = _finish(proc)
    assert proc.returncode == 0, (proc.returncode, err)
    assert "DONE" in out


# ----------------------------------------------------------------------------------------------------------
# Bad configuration: every public constructor says what to change

def _env():
    return MockEnv(0)


BAD_CONFIGS = [
    # AutobatchPolicy
    ("AutobatchPolicy", lambda: AutobatchPolicy(42), "callable"),
    ("AutobatchPolicy", lambda: AutobatchPolicy(CountingPolicy(), autobatch_size=0), "autobatch_size"),
    ("AutobatchPolicy", lambda: AutobatchPolicy(CountingPolicy(), autobatch_size=2.5), "autobatch_size"),
    ("AutobatchPolicy", lambda: AutobatchPolicy(CountingPolicy(), autobatch_size=True), "autobatch_size"),
    ("AutobatchPolicy", lambda: AutobatchPolicy(CountingPolicy(), max_wait=-1.0), "max_wait"),
    ("AutobatchPolicy", lambda: AutobatchPolicy(CountingPolicy(), max_wait="1s"), "max_wait"),
    ("AutobatchPolicy", lambda: AutobatchPolicy(CountingPolicy(), max_wait=float("nan")), "max_wait"),
    ("AutobatchPolicy", lambda: AutobatchPolicy(CountingPolicy(), device="no-such-device"), "device"),
    # MultiEnvLoop
    ("MultiEnvLoop", lambda: MultiEnvLoop(_env, CountingPolicy(), num_envs=0), "num_envs"),
    ("MultiEnvLoop", lambda: MultiEnvLoop(_env, CountingPolicy(), num_envs=2.0), "num_envs"),
    ("MultiEnvLoop", lambda: MultiEnvLoop([], CountingPolicy()), "at least one"),
    ("MultiEnvLoop", lambda: MultiEnvLoop(mock_envs(3), CountingPolicy(), num_envs=2), "num_envs"),
    ("MultiEnvLoop", lambda: MultiEnvLoop(mock_envs(3), CountingPolicy(), envs_per_thread=2), "multiple"),
    ("MultiEnvLoop", lambda: MultiEnvLoop(mock_envs(3), CountingPolicy(), envs_per_thread=0), "envs_per_thread"),
    ("MultiEnvLoop", lambda: MultiEnvLoop(_env, CountingPolicy(), autobatch_size=0), "autobatch_size"),
    ("MultiEnvLoop", lambda: MultiEnvLoop(_env, CountingPolicy(), max_wait=-0.1), "max_wait"),
    ("MultiEnvLoop", lambda: MultiEnvLoop(_env, CountingPolicy(), step_timeout=0), "step_timeout"),
    ("MultiEnvLoop", lambda: MultiEnvLoop(_env, CountingPolicy(), step_timeout="5"), "step_timeout"),
    ("MultiEnvLoop", lambda: MultiEnvLoop(_env, CountingPolicy(), max_episode_steps=0), "max_episode_steps"),
    ("MultiEnvLoop", lambda: MultiEnvLoop(_env, CountingPolicy(), random_steps_per_env=-1), "random_steps_per_env"),
    ("MultiEnvLoop", lambda: MultiEnvLoop(_env, CountingPolicy(), join_timeout=-1), "join_timeout"),
    ("MultiEnvLoop", lambda: MultiEnvLoop(_env, CountingPolicy(), traj_id_start=-3), "traj_id_start"),
    ("MultiEnvLoop", lambda: MultiEnvLoop(_env, CountingPolicy(), seed=1.5), "seed"),
    ("MultiEnvLoop", lambda: MultiEnvLoop(_env, CountingPolicy(), exploration_type="random"), "exploration_type"),
    ("MultiEnvLoop", lambda: MultiEnvLoop(_env, CountingPolicy(), processor=print), "processor"),
    ("MultiEnvLoop", lambda: MultiEnvLoop(_env, CountingPolicy(), interrupter=threading.Event()), "interrupter"),
    ("MultiEnvLoop", lambda: MultiEnvLoop("NoSuchEnv-v9", CountingPolicy()), "gymnasium"),
    ("MultiEnvLoop", lambda: MultiEnvLoop(42, CountingPolicy()), "callable"),
    ("MultiEnvLoop", lambda: MultiEnvLoop(_env, AutobatchPolicy(CountingPolicy()), autobatch_size=2),
     "AutobatchPolicy you passed"),
    # EnvLoop
    ("EnvLoop", lambda: EnvLoop(_env, CountingPolicy(), num_envs=2), "exactly one env"),
    ("EnvLoop", lambda: EnvLoop(_env, CountingPolicy(), step_timeout=-1), "step_timeout"),
    # ThreadedCollector
    ("ThreadedCollector", lambda: ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch=0),
     "frames_per_batch"),
    ("ThreadedCollector", lambda: ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch="8"),
     "frames_per_batch"),
    ("ThreadedCollector", lambda: ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch=8,
                                                    total_frames=0), "total_frames"),
    ("ThreadedCollector", lambda: ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch=8,
                                                    layout="time_env"), "layout"),
    ("ThreadedCollector", lambda: ThreadedCollector(mock_envs(4), CountingPolicy(), frames_per_batch=9,
                                                    layout="flat", envs_per_thread=2), "envs_per_thread"),
    ("ThreadedCollector", lambda: ThreadedCollector(mock_envs(4), CountingPolicy(), frames_per_batch=8,
                                                    envs_per_thread=3), "multiple"),
    ("ThreadedCollector", lambda: ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch=8,
                                                    init_random_frames=-2), "init_random_frames"),
    ("ThreadedCollector", lambda: ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch=8,
                                                    split_trajs=True, replay_buffer=[]), "replay_buffer"),
    ("ThreadedCollector", lambda: ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch=8,
                                                    num_envs=3), "num_envs"),
    ("ThreadedCollector", lambda: ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch=8,
                                                    max_frames_per_traj=0), "max_frames_per_traj"),
    ("ThreadedCollector", lambda: ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch=8,
                                                    step_timeout=-2.0), "step_timeout"),
    ("ThreadedCollector", lambda: ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch=8,
                                                    autobatch_size=-1), "autobatch_size"),
    ("ThreadedCollector", lambda: ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch=8,
                                                    storing_device="nowhere"), "storing_device"),
    ("ThreadedCollector", lambda: ThreadedCollector(_env(), CountingPolicy(), frames_per_batch=8, num_envs=2),
     "env instance"),
]


@pytest.mark.parametrize("ctor, make, words", BAD_CONFIGS,
                         ids=[f"{c}-{i}-{w.split()[0]}" for i, (c, _, w) in enumerate(BAD_CONFIGS)])
def test_bad_configuration_is_refused_with_what_to_change(ctor, make, words):
    try:
        made = make()
    except ValueError as exc:
        assert words in str(exc), str(exc)
    else:
        (made.shutdown if isinstance(made, ThreadedCollector) else made.close)()
        pytest.fail(f"{ctor} accepted a bad configuration (expected a ValueError about {words!r})")
    assert_no_rollout_threads()


# ----------------------------------------------------------------------------------------------------------
# Checkpoint safety

def _collector(**kwargs) -> ThreadedCollector:
    return ThreadedCollector(mock_envs(2), ArgmaxNet(), frames_per_batch=8, seed=3, **kwargs)


def test_state_dict_round_trips_through_weights_only_load(tmp_path):
    collector = _collector()
    try:
        it = iter(collector)
        for _ in range(3):
            next(it)
        collector.update_policy_weights_()
        path = tmp_path / "collector.pt"
        torch.save(collector.state_dict(), path)
    finally:
        collector.shutdown()
    state = torch.load(path, weights_only=True)
    resumed = _collector()
    try:
        resumed.load_state_dict(state)
        assert resumed.frames == 24 and resumed.policy_version == 1
        for key, value in resumed.policy.state_dict().items():
            del key, value  # the caller's policy is untouched; the acting copy got the weights
        got = resumed.autobatch_policy.state()
        for key, value in state["policy_state_dict"].items():
            assert torch.equal(got[key], value)
        batch = bounded(lambda: next(iter(resumed)), BOUND)
        assert int(batch["collector", "traj_ids"].min()) >= int(state["next_traj_id"])
    finally:
        resumed.shutdown()


def test_truncated_checkpoint_file_gives_a_clear_error(tmp_path):
    collector = _collector()
    try:
        next(iter(collector))
        path = tmp_path / "collector.pt"
        torch.save(collector.state_dict(), path)
    finally:
        collector.shutdown()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises((RuntimeError, EOFError, ValueError)) as info:
        torch.load(path, weights_only=True)
    assert str(info.value)


@pytest.mark.parametrize("foreign, words", [
    ({"state": {}, "param_groups": []}, "missing"),  # an optimizer's state_dict
    ({"lin.weight": torch.zeros(2, 3)}, "missing"),  # a model's
    (torch.zeros(3), "expected a dict"),
    ({"frames": 8, "batches": 1, "next_traj_id": 2, "policy_version": 1, "seed": 3,
      "policy_state_dict": {"other.weight": torch.zeros(1)}}, "rejected the new weights"),
])
def test_foreign_checkpoint_gives_a_clear_error(foreign, words):
    collector = _collector()
    try:
        with pytest.raises(ValueError, match=words):
            collector.load_state_dict(foreign)
    finally:
        collector.shutdown()


def test_truncated_state_dict_names_missing_keys():
    collector = _collector()
    try:
        state = collector.state_dict()
        del state["next_traj_id"], state["policy_version"]
        with pytest.raises(ValueError, match=r"missing \['next_traj_id', 'policy_version'\]"):
            collector.load_state_dict(state)
    finally:
        collector.shutdown()
