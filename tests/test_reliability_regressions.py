"""Regression tests for issue 11: the hangs, the abort at exit and the unchecked inputs found by adversarial use.

One test (or one parametrized group) per item, each failing before its fix and each bounded in time
(``pytest.mark.timeout`` for the whole test, :func:`reliability_helpers.bounded` around every call that
used to hang, ``timeout=`` on every subprocess). No test sleeps to win a race: threads are ordered with
``threading.Event``, and every event wait has its own bound.

* item 1: a thread abandoned past ``step_timeout`` while inside torch ops never aborts the interpreter
  at exit, and the exit code is the script's (real subprocesses);
* item 2: timeouts that cannot work are refused, and any error in the inference thread's loop fails
  every waiting and every later request with ``PolicyError``;
* item 6: a second thread iterating a collector is refused at once, and nobody blocks;
* item 8: ``policy_timeout`` bounds a forward pass (and the construction probe), naming the call;
* item 9: ``ThreadedCollector.load_state_dict`` validates each field, naming it;
* item 10 (two of its cases): ``policy_device="cuda"`` without CUDA, numpy ``autobatch_size``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import CountingPolicy, MockEnv, called_from_probe, mock_envs
from lightning_rollout import (AutobatchPolicy, CollectionError, MultiEnvLoop, PolicyError, ThreadedCollector)
from reliability_helpers import InThread, bounded, rollout_threads

BOUND = 20.0  # seconds: generous, only to tell a hang from a slow machine
ROOT = Path(__file__).resolve().parents[1]
OBS = {"observation": np.zeros((1, 3), np.float32)}


def join_rollout_threads(timeout: float = BOUND) -> None:
    """Join every ``lightning_rollout-*`` thread still alive (abandoned ones, once released)."""
    for thread in rollout_threads():
        thread.join(timeout)


# ----------------------------------------------------------------------------------------------------------
# Item 1: an abandoned thread inside torch ops at interpreter exit

_STUCK_AT_EXIT = textwrap.dedent("""
    import sys
    import gymnasium as gym, numpy as np, torch
    from lightning_rollout import StepTimeoutError, ThreadedCollector

    torch.set_num_threads(1)

    class TorchBound(gym.Wrapper):
        # Every step spends its time inside torch ops (which release the GIL), and never ends: the
        # issue's wrapper ran torch.tanh(x @ x) 300 times; a loop without end does not depend on speed.
        def step(self, action):
            x = torch.rand(1000, 1000)
            while True:
                x = torch.tanh(x @ x)

    collector = ThreadedCollector(lambda: TorchBound(gym.make("CartPole-v1")), None, frames_per_batch=4,
                                  step_timeout=0.5)
    try:
        for batch in collector:
            pass
    except StepTimeoutError as exc:
        print("TIMEOUT", exc.env_id)
    collector.shutdown()
    print("END")  # not flushed on purpose: the exit must flush stdio
    {ending}
""")

_ENDINGS = {"normal": ("pass", 0), "sys.exit(3)": ("sys.exit(3)", 3),
            "uncaught": ("raise RuntimeError('the script failed')", 1)}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("ending", list(_ENDINGS))
def test_abandoned_thread_inside_torch_ops_does_not_abort_at_exit(ending):
    code, expected_rc = _ENDINGS[ending]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        proc = subprocess.run([sys.executable, "-W", "ignore::RuntimeWarning", "-c",
                               _STUCK_AT_EXIT.format(ending=code)],
                              capture_output=True, text=True, cwd=ROOT, env=env, timeout=150)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the script did not exit within 150 s\nstdout: {exc.stdout}\nstderr: {exc.stderr}")
    for bad in ("terminate called", "Fatal Python error", "Aborted", "Segmentation fault"):
        assert bad not in proc.stderr, proc.stderr
    assert proc.returncode == expected_rc, (proc.returncode, proc.stderr)
    assert "TIMEOUT 0" in proc.stdout and "END" in proc.stdout, (proc.stdout, proc.stderr)
    if ending == "uncaught":
        assert "the script failed" in proc.stderr  # the traceback is still printed


# ----------------------------------------------------------------------------------------------------------
# Item 2: timeouts that cannot work; errors in the inference thread's own loop

INF = float("inf")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make, words", [
    (lambda: AutobatchPolicy(CountingPolicy(), max_wait=INF), "max_wait"),
    (lambda: AutobatchPolicy(CountingPolicy(), max_wait=1e300), "max_wait"),  # finite, but past any wait
    (lambda: MultiEnvLoop(mock_envs(2), CountingPolicy(), max_wait=INF), "max_wait"),
    (lambda: MultiEnvLoop(mock_envs(2), CountingPolicy(), join_timeout=INF), "join_timeout"),
    (lambda: ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch=4, max_wait=INF), "max_wait"),
    (lambda: AutobatchPolicy(CountingPolicy(), policy_timeout=INF), "policy_timeout"),
    (lambda: AutobatchPolicy(CountingPolicy(), policy_timeout=float("nan")), "policy_timeout"),
    (lambda: AutobatchPolicy(CountingPolicy(), policy_timeout=0), "policy_timeout"),
    (lambda: AutobatchPolicy(CountingPolicy(), policy_timeout="1"), "policy_timeout"),
    (lambda: MultiEnvLoop(mock_envs(2), CountingPolicy(), policy_timeout=-1.0), "policy_timeout"),
    (lambda: ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch=4, policy_timeout=INF),
     "policy_timeout"),
], ids=["policy-inf", "policy-1e300", "loop-inf", "loop-join-inf", "collector-inf", "pt-inf", "pt-nan", "pt-0",
        "pt-str", "loop-pt-neg", "collector-pt-inf"])
def test_timeouts_that_cannot_work_are_refused(make, words):
    # Before the fix max_wait=inf passed, and list(collector) then hung for ever.
    with pytest.raises(ValueError, match=words):
        bounded(make, BOUND)


def _serve_fault(policy: AutobatchPolicy, where: str) -> None:
    """Make the inference thread's own loop (not the forward pass) fail at ``where``."""
    if where == "wait":  # the case: a max_wait the wait cannot take, set past validation
        policy.max_wait = INF
    else:  # an error while taking a batch (queue lock held), or after taking it (requests dequeued)
        def boom(*args, **kwargs):
            raise RuntimeError(f"injected fault in {where}")
        setattr(policy, where, boom)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["wait", "_take", "_answer"])
def test_inference_thread_error_fails_waiting_and_later_requests(where):
    policy = AutobatchPolicy(CountingPolicy(), autobatch_size=2, flush_in_caller=False)
    _serve_fault(policy, where)
    first, second = policy.register(1, env_ids=(0,)), policy.register(1, env_ids=(1,))
    try:
        if where != "wait":
            first.park()  # one active row: the first request alone is a flushable batch
        first.submit(OBS)
        with pytest.raises(PolicyError, match="inference thread") as info:
            bounded(first.result, BOUND, "a waiting request")
        assert info.value.env_ids == (0,)
        second.submit(OBS)  # a later request, after the failure
        with pytest.raises(PolicyError, match="inference thread"):
            bounded(second.result, BOUND, "a later request")
        with pytest.raises(PolicyError, match="inference thread"):
            bounded(lambda: policy.update({"w": 1}, timeout=BOUND), BOUND, "a weight update")
    finally:
        first.close()
        second.close()
        policy.close()


# ----------------------------------------------------------------------------------------------------------
# Item 6: two threads iterating one collector


@pytest.mark.timeout(60)
@pytest.mark.parametrize("second", ["iterator", "collect_batch"])
def test_second_thread_driving_a_suspended_collector_is_refused(second):
    collector = ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch=4, total_frames=40)
    drive = (lambda: next(iter(collector))) if second == "iterator" else collector.collect_batch
    try:
        mine = iter(collector)
        assert next(mine).batch_size.numel() == 4
        # Before the fix the other thread silently drove the same loop (and one of them got a StopIteration);
        # collect_batch() from another thread drove it between the owner's batches.
        with pytest.raises(CollectionError, match="already being iterated"):
            bounded(drive, BOUND, f"a second thread's {second}")
        assert next(mine).batch_size.numel() == 4  # the owner is not disturbed
        assert collector.collect_batch().batch_size.numel() == 4  # the owner's own thread may call it
        mine.close()  # the iteration ends: another thread may now drive it
        assert bounded(drive, BOUND).batch_size.numel() == 4
        assert drive().batch_size.numel() == 4  # this thread again, after the others ended
    finally:
        collector.shutdown()


class GateEnv(MockEnv):
    """Sets ``inside`` and waits (bounded) for ``go`` at its ``at``-th step: a batch is in flight."""

    def __init__(self, env_id: int, at: int, inside: threading.Event, go: threading.Event) -> None:
        super().__init__(env_id)
        self.at, self.inside, self.go = at, inside, go

    def step(self, action):
        if self.num_steps == self.at:
            self.inside.set()
            self.go.wait(BOUND)
        return super().step(action)


@pytest.mark.timeout(60)
def test_second_thread_iterating_during_a_batch_is_refused_and_nobody_blocks():
    inside, go = threading.Event(), threading.Event()
    factories = [lambda i=i: GateEnv(i, 2 if i == 0 else -1, inside, go) for i in range(2)]
    # an explicit layout: "auto" would time a few steps of a GateEnv of its own, which the gate holds
    collector = ThreadedCollector(factories, CountingPolicy(), frames_per_batch=4, total_frames=12,
                                  envs_per_thread=2, num_workers=1)
    owner = InThread(lambda: sum(b.batch_size.numel() for b in collector), name="test-owner")
    try:
        assert inside.wait(BOUND), "the owner's batch never reached the gate"
        with pytest.raises(CollectionError, match="already being iterated"):
            bounded(lambda: next(iter(collector)), BOUND, "a second iterator")
    finally:
        go.set()
    assert owner.result(BOUND, "the owner's iteration") == 12  # the owner got every batch, without an error
    collector.shutdown()


@pytest.mark.timeout(60)
def test_second_thread_calling_a_loop_during_a_run_is_refused_and_the_run_completes():
    inside, go = threading.Event(), threading.Event()
    factories = [lambda i=i: GateEnv(i, 1 if i == 0 else -1, inside, go) for i in range(2)]
    loop = MultiEnvLoop(factories, CountingPolicy(), envs_per_thread=2, lookahead=False)
    owner = InThread(lambda: tuple(loop.run_env_steps(3).shape), name="test-owner")
    try:
        assert inside.wait(BOUND), "the owner's run never reached the gate"
        for call in (lambda: loop.run_env_steps(1), lambda: loop.run_steps(2), lambda: loop.run_episodes(1),
                     loop.reset_envs):
            with pytest.raises(CollectionError, match="already collecting in thread 'test-owner'"):
                bounded(call, BOUND, "a second driver")
    finally:
        go.set()
    try:
        assert owner.result(BOUND, "the owner's run") == (2, 3)  # completed, without an error
        assert tuple(loop.run_env_steps(2).shape) == (2, 2)  # free again once the run ended
    finally:
        loop.close()


# ----------------------------------------------------------------------------------------------------------
# Item 8: a policy that hangs


def in_autobatch_probe() -> bool:
    """True inside ``AutobatchPolicy.probe`` (the shape probe a loop runs at construction)."""
    frame = sys._getframe(1)
    while frame is not None:
        if "probe" in frame.f_code.co_qualname.split(".") and frame.f_code.co_filename.endswith("policy.py"):
            return True
        frame = frame.f_back
    return False


class HangingPolicy(CountingPolicy):
    """Blocks (until ``release``, bounded) in its ``at``-th forward pass; ``at=0``: in ``AutobatchPolicy.probe``."""

    def __init__(self, at: int, release: threading.Event) -> None:
        super().__init__()
        self.at, self.release = at, release
        self.entered = threading.Event()

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        if (self.at == 0 and in_autobatch_probe()) or (self.at > 0 and not called_from_probe()
                                                       and self.calls == self.at - 1):
            self.entered.set()
            self.release.wait(60)
        return super().__call__(obs)


@pytest.fixture
def release():
    """Set at teardown; the abandoned inference thread then leaves the policy and exits."""
    event = threading.Event()
    yield event
    event.set()
    join_rollout_threads()


@pytest.mark.timeout(60)
def test_hanging_policy_in_collector_raises_policy_error(release):
    policy = HangingPolicy(10, release)
    collector = ThreadedCollector(mock_envs(2), policy, frames_per_batch=4, policy_timeout=0.5, name="hangpol")
    with pytest.raises(PolicyError, match="policy_timeout=0.5") as info:
        bounded(lambda: [None for _ in collector], BOUND, "collection with a hung policy")
    exc = info.value
    assert set(exc.env_ids) <= {0, 1} and exc.env_ids and exc.step is not None
    assert "lightning_rollout-hangpol-policy" in str(exc) and "abandoned" in str(exc)
    bounded(collector.shutdown, BOUND, "shutdown after a hung policy")  # does not wait for the stuck thread
    assert [t.name for t in rollout_threads()] == ["lightning_rollout-hangpol-policy"]


@pytest.mark.timeout(60)
def test_reading_the_weights_after_a_hung_policy_raises_instead_of_blocking(release):
    """Before: ``state()`` (what a checkpoint of an ``nn.Module`` policy reads) waited forever for the
    weights lock the stuck forward pass holds."""
    policy = HangingPolicy(3, release)
    collector = ThreadedCollector(mock_envs(2), policy, frames_per_batch=4, policy_timeout=0.5, name="hangckpt")
    try:
        with pytest.raises(PolicyError, match="policy_timeout=0.5"):
            bounded(lambda: [None for _ in collector], BOUND, "collection with a hung policy")
        with pytest.raises(PolicyError, match="the weights cannot be read: no answer within policy_timeout=0.5"):
            bounded(collector.autobatch_policy.state, BOUND, "state() after a hung policy")
        with pytest.raises(PolicyError, match="the version cannot be set"):
            bounded(lambda: collector.autobatch_policy.set_version(3), BOUND, "set_version after a hung policy")
    finally:
        bounded(collector.shutdown, BOUND, "shutdown after a hung policy")


@pytest.mark.timeout(60)
def test_policy_hanging_while_torchrl_wraps_it_raises_policy_error(release):
    """TorchRL's wrapping rule calls a keyword policy once on a sample of the spec; before, that call had no
    time limit and a hang there blocked the constructor for good."""
    entered = threading.Event()

    def policy(observation):  # matched by name: wrapped in a TensorDictModule after one call
        entered.set()
        release.wait(60)
        return torch.zeros(observation.shape[:-1], dtype=torch.long)

    with pytest.raises(PolicyError, match="policy_timeout=0.5 s while wrapping the policy") as info:
        bounded(lambda: MultiEnvLoop(mock_envs(2), policy, policy_timeout=0.5, name="wrap"), BOUND, "construction")
    assert entered.is_set() and "lightning_rollout-wrap-wrap" in str(info.value)


@pytest.mark.timeout(60)
def test_hanging_policy_in_loop_raises_policy_error(release):
    policy = HangingPolicy(5, release)
    loop = MultiEnvLoop(mock_envs(3), policy, policy_timeout=0.5)
    with pytest.raises(PolicyError, match="policy_timeout=0.5") as info:
        bounded(lambda: loop.run_steps(10 ** 6), BOUND, "run_steps with a hung policy")
    assert info.value.env_ids and info.value.step is not None
    assert loop.closed


@pytest.mark.timeout(60)
def test_hanging_forward_fails_waiting_and_later_requests(release):
    policy = AutobatchPolicy(HangingPolicy(1, release), autobatch_size=1, policy_timeout=0.5, name="hp")
    first, second = policy.register(1, env_ids=(3,)), policy.register(1, env_ids=(4,))
    try:
        first.submit(OBS)
        with pytest.raises(PolicyError, match="policy_timeout=0.5") as info:
            bounded(first.result, BOUND, "the request in the hung forward pass")
        assert info.value.env_ids == (3,)  # the envs of the hung call
        second.submit(OBS)  # queued behind the hung pass: fails too, without waiting policy_timeout again
        with pytest.raises(PolicyError, match="policy_timeout=0.5"):
            bounded(second.result, BOUND, "a later request")
    finally:
        first.close()
        second.close()
        bounded(policy.close, BOUND, "close with a stuck inference thread")
    assert [t.name for t in rollout_threads()] == ["lightning_rollout-hp-policy"]  # the stuck call's, abandoned


@pytest.mark.timeout(60)
def test_hanging_probe_raises_policy_error(release):
    policy = HangingPolicy(0, release)
    with pytest.raises(PolicyError, match="probing") as info:
        bounded(lambda: MultiEnvLoop(mock_envs(2), policy, policy_timeout=0.5), BOUND, "construction")
    assert "policy_timeout=0.5" in str(info.value) and "lightning_rollout-loop-policy" in str(info.value)
    assert policy.entered.is_set()


@pytest.mark.timeout(60)
def test_hanging_probe_of_a_policy_fails_later_requests(release):
    policy = AutobatchPolicy(HangingPolicy(0, release), policy_timeout=0.5, name="pp")
    with pytest.raises(PolicyError, match="probing"):
        bounded(lambda: policy.probe(OBS), BOUND, "probe")
    agent = policy.register(1, env_ids=(2,))
    try:
        agent.submit(OBS)
        with pytest.raises(PolicyError, match="policy_timeout=0.5"):
            bounded(agent.result, BOUND, "a request after the hung probe")
    finally:
        agent.close()
        bounded(policy.close, BOUND, "close")


@pytest.mark.timeout(60)
def test_policy_timeout_does_not_fire_on_a_healthy_policy():
    collector = ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch=4, total_frames=40,
                                  policy_timeout=30.0)
    try:
        assert sum(b.batch_size.numel() for b in bounded(lambda: list(collector), BOUND)) == 40
    finally:
        collector.shutdown()


# ----------------------------------------------------------------------------------------------------------
# Item 9: checkpoint state validated on load


def _state(**changes):
    state = {"frames": 8, "batches": 2, "next_traj_id": 5, "policy_version": 1, "seed": 3, "policy_state_dict": {}}
    state.update(changes)
    return state


BAD_STATES = [
    ("frames", -500), ("frames", "abc"), ("frames", None), ("frames", 1e9), ("frames", 8.0), ("frames", True),
    ("batches", -1), ("batches", "2"), ("next_traj_id", -1), ("next_traj_id", None), ("next_traj_id", 1.5),
    ("policy_version", -2), ("policy_version", "1"), ("policy_version", 1.0),
    ("seed", -2), ("seed", "3"), ("seed", 2.5), ("seed", None),
    ("policy_state_dict", None), ("policy_state_dict", [1, 2]), ("policy_state_dict", "weights"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field, value", BAD_STATES, ids=[f"{f}={v!r}" for f, v in BAD_STATES])
def test_load_state_dict_validates_each_field(field, value):
    collector = ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch=4, total_frames=40)
    try:
        before = collector.state_dict()
        with pytest.raises(ValueError, match=f"'{field}'"):
            collector.load_state_dict(_state(**{field: value}))
        assert collector.state_dict() == before  # nothing was applied
    finally:
        collector.shutdown()


@pytest.mark.timeout(60)
def test_load_state_dict_accepts_numpy_ints():
    collector = ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch=4, total_frames=40)
    try:
        collector.load_state_dict(_state(frames=np.int64(8), batches=np.int32(2), next_traj_id=np.int64(5),
                                         policy_version=np.int64(1), seed=np.int64(-1)))
        assert (collector.frames, collector.policy_version) == (8, 1)
        assert collector.loop.next_traj_id == 5 + 2  # ids 5 and 6 go to the two envs' running episodes
        assert bounded(lambda: list(collector), BOUND)[0].batch_size.numel() == 4
    finally:
        collector.shutdown()


# ----------------------------------------------------------------------------------------------------------
# Item 10: policy_device="cuda" without CUDA; numpy autobatch_size


@pytest.mark.timeout(60)
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("make", [
    lambda: ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch=4, policy_device="cuda"),
    lambda: ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch=4, device="cuda:0"),
    lambda: ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch=4, storing_device="cuda"),
    lambda: MultiEnvLoop(mock_envs(2), CountingPolicy(), device="cuda"),
    lambda: AutobatchPolicy(CountingPolicy(), device="cuda"),
], ids=["collector-policy_device", "collector-device", "collector-storing_device", "loop", "policy"])
def test_cuda_device_without_cuda_is_a_clear_value_error(make):
    with pytest.raises(ValueError, match="CUDA is not available"):
        make()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [np.int64(2), np.int32(1)])
def test_numpy_autobatch_size_is_accepted(size):
    policy = AutobatchPolicy(CountingPolicy(), autobatch_size=size)
    assert policy.autobatch_size == int(size) and type(policy.autobatch_size) is int
    policy.close()
    with MultiEnvLoop(mock_envs(2), CountingPolicy(), autobatch_size=size) as loop:
        assert bounded(lambda: loop.run_steps(8), BOUND).batch_size.numel() == 8
    collector = ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch=4, total_frames=8,
                                  autobatch_size=size)
    try:
        assert sum(b.batch_size.numel() for b in bounded(lambda: list(collector), BOUND)) == 8
    finally:
        collector.shutdown()
