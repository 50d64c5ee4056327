"""AutobatchPolicy driven directly: flush rule, registration, modes, updates, failures.

Agents are driven from helper threads synchronised with barriers; nothing here
depends on timing: a flush that must contain N rows can only happen once all N
requests are queued, because every agent stays active until it has its answer.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from tensordict.nn import TensorDictModule
from torchrl.envs.utils import ExplorationType, exploration_type

from lightning_rollout import Agent, AutobatchPolicy, CollectionError, EnvLoop, MultiEnvLoop, PolicyError
from conftest import CountingPolicy, StatefulMockPolicy, mock_envs

pytestmark = pytest.mark.timeout(30)


def obs_rows(*values: float) -> dict[str, np.ndarray]:
    """One request: one observation row ``[v, 0, 0]`` per value."""
    return {"observation": np.array([[v, 0.0, 0.0] for v in values], dtype=np.float32)}


def run_in_threads(n: int, fn) -> list:
    """Run ``fn(i)`` in ``n`` threads; return their results; re-raise the first failure."""
    results: list = [None] * n
    errors: list[BaseException] = []

    def target(i: int) -> None:
        try:
            results[i] = fn(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(i,), name=f"test-client-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
        assert not t.is_alive(), "a client thread did not finish"
    if errors:
        raise errors[0]
    return results


class EchoPolicy(CountingPolicy):
    """Answers each row with its first observation entry (so every client can check its own rows)."""

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        super().__call__(obs)
        return obs[:, 0].long()


# -- policy state ----------------------------------------------------------------------------------

def test_policy_state_of_a_loop_is_the_initial_state():
    shared = AutobatchPolicy(StatefulMockPolicy(1000), autobatch_size=1)
    try:
        with EnvLoop(mock_envs(1), shared) as loop:
            assert loop.policy_state() == {"value": 1000}
    finally:
        shared.close()  # a policy passed in is not owned (nor closed) by the loop
    with MultiEnvLoop(mock_envs(4), StatefulMockPolicy(1000), autobatch_size=4) as loop:
        assert loop.policy_state() == {"value": 1000}


@pytest.mark.parametrize("num_envs, autobatch_size", [(1, 1), (4, 4)])
def test_update_policy_round_trips_through_the_loop(num_envs, autobatch_size):
    with MultiEnvLoop(mock_envs(num_envs), StatefulMockPolicy(0), autobatch_size=autobatch_size) as loop:
        assert loop.update_policy({"value": 1}) == 1
        assert loop.policy_state() == {"value": 1}
        assert loop.policy_version == 1


def test_callable_without_state_dict_keeps_the_object_given_to_update():
    policy = AutobatchPolicy(lambda obs: obs[:, 0].long())
    try:
        assert policy.state() is None
        state = {"weights": [1, 2, 3]}
        assert policy.update(state) == 1
        got = policy.state()
        assert got == state
        got["weights"].append(4)  # a copy: mutating it does not change the policy's state
        assert policy.state() == {"weights": [1, 2, 3]}
        assert policy.update(7) == 2 and policy.state() == 7
    finally:
        policy.close()


def test_state_of_a_module_is_a_detached_copy_and_update_accepts_a_module():
    net = TensorDictModule(torch.nn.Linear(3, 2), in_keys=["observation"], out_keys=["action"])
    policy = AutobatchPolicy(net)
    try:
        state = policy.state()
        state["module.weight"].fill_(5.0)
        assert not torch.equal(net.module.weight, state["module.weight"])
        other = TensorDictModule(torch.nn.Linear(3, 2), in_keys=["observation"], out_keys=["action"])
        assert policy.update(other) == 1
        assert torch.equal(policy.state()["module.weight"], other.module.weight)
    finally:
        policy.close()


# -- flush rule ------------------------------------------------------------------------------------

@pytest.mark.parametrize("autobatch_size", [4, None])
def test_n_active_agents_with_autobatch_size_n_are_answered_in_forward_passes_of_n(autobatch_size):
    counting = EchoPolicy()
    policy = AutobatchPolicy(counting, autobatch_size=autobatch_size)
    rounds, n = 5, 4
    agents = [policy.register(1, env_ids=(i,)) for i in range(n)]
    barrier = threading.Barrier(n)

    def client(i: int) -> list[int]:
        barrier.wait()
        got = []
        for r in range(rounds):
            agents[i].submit(obs_rows(10 * i + r))
            answer = agents[i].result()
            got.append(int(answer.outputs["action"][answer.start]))
        return got

    try:
        results = run_in_threads(n, client)
    finally:
        for a in agents:
            a.close()
        policy.close()
    assert results == [[10 * i + r for r in range(rounds)] for i in range(n)]
    assert counting.batch_sizes == [n] * rounds
    assert policy.mean_batch_size == n and policy.calls == rounds


def test_agent_with_several_rows_counts_all_its_rows():
    counting = EchoPolicy()
    policy = AutobatchPolicy(counting, autobatch_size=None)
    big, small = policy.register(3), policy.register(1)
    try:
        big.submit(obs_rows(1, 2, 3))
        small.submit(obs_rows(4))
        a, b = big.result(), small.result()
        assert a.outputs["action"][a.start:a.stop].tolist() == [1, 2, 3]
        assert b.outputs["action"][b.start:b.stop].tolist() == [4]
        assert counting.batch_sizes == [4]
    finally:
        big.close(), small.close()
        policy.close()


def test_autobatch_size_caps_the_rows_of_a_forward_pass():
    started, release = threading.Event(), threading.Event()
    sizes: list[int] = []

    def policy(obs: torch.Tensor) -> torch.Tensor:
        sizes.append(int(obs.shape[0]))
        if len(sizes) == 1:  # hold the first forward pass while three more requests queue up
            started.set()
            release.wait(10)
        return obs[:, 0].long()

    server = AutobatchPolicy(policy, autobatch_size=2, flush_in_caller=False)
    agents = [server.register(1) for _ in range(5)]
    try:
        for value, agent in enumerate(agents[:2]):
            agent.submit(obs_rows(value))
        assert started.wait(10)
        for value, agent in enumerate(agents[2:], 2):
            agent.submit(obs_rows(value))
        release.set()
        answers = [agent.result() for agent in agents[:4]]
        for agent in agents[:4]:  # the last request alone waits for them to leave (2 rows > 1 active)
            agent.park()
        answers.append(agents[4].result())
        assert [a.outputs["action"][a.start] for a in answers] == [0, 1, 2, 3, 4]
        assert sizes == [2, 2, 1]
    finally:
        release.set()
        for agent in agents:
            agent.close()
        server.close()


def test_parked_agent_does_not_hold_back_a_flush():
    counting = EchoPolicy()
    policy = AutobatchPolicy(counting, autobatch_size=None)
    waiting, parked = policy.register(1), policy.register(1)
    try:
        parked.park()
        waiting.submit(obs_rows(3))
        answer = waiting.result()
        assert answer.outputs["action"][answer.start] == 3
        assert counting.batch_sizes == [1]
    finally:
        waiting.close(), parked.close()
        policy.close()


def test_agent_leaving_releases_a_partial_flush():
    counting = EchoPolicy()
    policy = AutobatchPolicy(counting, autobatch_size=None)
    waiting, leaving = policy.register(1), policy.register(1)
    try:
        waiting.submit(obs_rows(1))
        leaving.close()  # the server re-checks the rule when the count drops
        assert waiting.result().version == 0
        assert counting.batch_sizes == [1]
    finally:
        waiting.close()
        policy.close()


def test_agent_registration_cannot_go_negative():
    counting = EchoPolicy()
    policy = AutobatchPolicy(counting, autobatch_size=None)
    a, b, c = policy.register(1), policy.register(1), policy.register(1)
    for _ in range(3):
        b.park()  # parking twice is a no-op
    b.close()
    b.close()
    b.unpark()  # a closed agent never counts again
    assert policy._active_rows == 2
    barrier = threading.Barrier(2)

    def client(i: int) -> int:
        agent = (a, c)[i]
        barrier.wait()
        agent.submit(obs_rows(i))
        return int(agent.result().version)

    try:
        run_in_threads(2, client)
    finally:
        a.close(), c.close()
        policy.close()
    # both live agents were waited for: one flush of 2 (a miscount would have flushed them alone)
    assert counting.batch_sizes == [2]
    assert policy._active_rows == 0


def test_agent_context_manager_unregisters():
    policy = AutobatchPolicy(EchoPolicy())
    try:
        with policy.register(2) as agent:
            assert isinstance(agent, Agent)
            assert policy._active_rows == 2
        assert policy._active_rows == 0
    finally:
        policy.close()


# -- exploration modes -----------------------------------------------------------------------------

class ModeRecorder:
    """TensorDictModule body recording ``exploration_type()`` and the batch size of every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[ExplorationType | None, int]] = []
        self._lock = threading.Lock()

    def __call__(self, obs: torch.Tensor):
        mode = exploration_type()
        with self._lock:
            self.calls.append((mode, obs.shape[0]))
        flag = 1 if mode == ExplorationType.DETERMINISTIC else 0
        return obs[:, 0].long(), torch.full((obs.shape[0],), flag, dtype=torch.long)


def test_mixed_deterministic_and_random_requests_are_split_by_mode():
    recorder = ModeRecorder()
    module = TensorDictModule(recorder, in_keys=["observation"], out_keys=["action", "was_deterministic"])
    policy = AutobatchPolicy(module, autobatch_size=4)
    agents = [policy.register(1, env_ids=(i,)) for i in range(4)]
    barrier = threading.Barrier(4)
    deterministic = [True, False, True, False]

    def client(i: int) -> tuple[int, int]:
        barrier.wait()
        agents[i].submit(obs_rows(i), deterministic=deterministic[i])
        answer = agents[i].result()
        return int(answer.outputs["action"][answer.start]), int(answer.outputs["was_deterministic"][answer.start])

    try:
        results = run_in_threads(4, client)
    finally:
        for a in agents:
            a.close()
        policy.close()
    # every request got its own row, computed under its own mode
    assert results == [(i, int(deterministic[i])) for i in range(4)]
    # one flush of 4, answered by one forward pass per mode
    assert sorted(recorder.calls[-2:], key=str) == sorted(
        [(ExplorationType.DETERMINISTIC, 2), (ExplorationType.RANDOM, 2)], key=str)
    assert policy.calls == 2 and policy.rows == 4


def test_explicit_exploration_type_is_used_for_the_forward_pass():
    recorder = ModeRecorder()
    module = TensorDictModule(recorder, in_keys=["observation"], out_keys=["action", "was_deterministic"])
    policy = AutobatchPolicy(module, autobatch_size=1)
    try:
        with policy.register(1) as agent:
            agent.submit(obs_rows(0), exploration_type=ExplorationType.MODE)
            agent.result()
            agent.submit(obs_rows(0), deterministic=True)
            agent.result()
            agent.submit(obs_rows(0))
            agent.result()
    finally:
        policy.close()
    assert [m for m, _ in recorder.calls] == [ExplorationType.MODE, ExplorationType.DETERMINISTIC,
                                              ExplorationType.RANDOM]


def test_tensordict_module_extras_travel_with_the_answer():
    module = TensorDictModule(lambda obs: (obs[:, 0].long(), obs[:, 0] * 0.5, obs[:, :2]),
                              in_keys=["observation"], out_keys=["action", "action_log_prob", "logits"])
    policy = AutobatchPolicy(module, autobatch_size=1)
    try:
        with policy.register(2) as agent:
            agent.submit(obs_rows(2, 4))
            answer = agent.result()
    finally:
        policy.close()
    assert set(answer.outputs) == {"action", "action_log_prob", "logits"}
    assert answer.outputs["action_log_prob"].tolist() == [1.0, 2.0]
    assert answer.outputs["logits"].shape == (2, 2)


# -- updates ---------------------------------------------------------------------------------------

class ValuePolicy(StatefulMockPolicy):
    """Answers every row with its current integer state."""

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.full((obs.shape[0],), self.value, dtype=torch.long)


def test_requests_queued_before_an_update_get_the_old_weights():
    policy = AutobatchPolicy(ValuePolicy(10), autobatch_size=None)
    queued, other = policy.register(1), policy.register(1)  # `other` holds the flush back
    try:
        queued.submit(obs_rows(0))
        assert policy.update({"value": 20}) == 1  # flushes the queued request first, then swaps
        before = queued.result()
        assert (int(before.outputs["action"][before.start]), before.version) == (10, 0)
        other.park()
        queued.submit(obs_rows(0))
        after = queued.result()
        assert (int(after.outputs["action"][after.start]), after.version) == (20, 1)
        assert policy.update({"value": 30}) == 2 and policy.version == 2
    finally:
        queued.close(), other.close()
        policy.close()


def test_an_update_fails_queued_requests_that_do_not_stack_and_the_server_survives():
    """The update answers the requests queued before it in its own thread: rows of different widths fail those
    requests with a PolicyError naming their envs, instead of leaving them waiting."""
    policy = AutobatchPolicy(EchoPolicy(), autobatch_size=None)
    a, b, holding = policy.register(1, env_ids=(0,)), policy.register(1, env_ids=(1,)), policy.register(1)
    try:
        a.submit(obs_rows(1))
        b.submit({"observation": np.zeros((1, 4), np.float32)})
        assert policy.update(None) == 1
        for agent in (a, b):
            with pytest.raises(PolicyError, match="ValueError") as info:
                agent.result()
            assert info.value.env_ids == (0, 1)
        holding.close(), b.close()
        answer = a.act(obs_rows(5))
        assert (int(answer.outputs["action"][answer.start]), answer.version) == (5, 1)
    finally:
        a.close(), b.close(), holding.close()
        policy.close()


def test_update_before_the_inference_thread_starts_applies_in_place():
    policy = AutobatchPolicy(ValuePolicy(1))
    try:
        assert policy.update({"value": 2}) == 1
        assert policy.state() == {"value": 2}
    finally:
        policy.close()


# -- failures --------------------------------------------------------------------------------------

class FailingPolicy(CountingPolicy):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        super().__call__(obs)
        if self.mode == "raise":
            raise ZeroDivisionError("policy bug")
        return torch.zeros(obs.shape[0] + 1, dtype=torch.long)  # wrong batch size


@pytest.mark.parametrize("mode, message", [("raise", "ZeroDivisionError: policy bug"),
                                           ("wrong_size", "leading dim must be the batch size 2")])
def test_failing_forward_pass_fails_every_waiting_request(mode, message):
    policy = AutobatchPolicy(FailingPolicy(mode), autobatch_size=2)
    a, b = policy.register(1, env_ids=(0,)), policy.register(1, env_ids=(1,))
    try:
        a.submit(obs_rows(0))
        b.submit(obs_rows(1))
        for agent in (a, b):
            with pytest.raises(PolicyError, match=message) as info:
                agent.result()
            if mode == "raise":
                assert isinstance(info.value.__cause__, ZeroDivisionError)
                assert info.value.env_ids == (0, 1)
        # the server survives a failing flush
        a.submit(obs_rows(0))
        b.close()
        with pytest.raises(PolicyError):
            a.result()
    finally:
        a.close(), b.close()
        policy.close()


class ThreadRecorder(EchoPolicy):
    """EchoPolicy that records the name of the thread running each forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        self.threads.append(threading.current_thread().name)
        return super().__call__(obs)


def test_act_answers_a_sole_client_in_its_own_thread_without_queueing_it():
    recorder = ThreadRecorder()
    policy = AutobatchPolicy(recorder)
    agent = policy.register(2, env_ids=(4, 5))
    try:
        for step in range(3):
            answer = agent.act(obs_rows(7 + step, 9))
            assert (answer.start, answer.stop, answer.version) == (0, 2, 0)
            assert answer.outputs["action"][answer.start:answer.stop].tolist() == [7 + step, 9]
        assert recorder.threads == [threading.current_thread().name] * 3
        assert recorder.batch_sizes == [2, 2, 2] and policy.calls == 3 and policy.rows == 6
    finally:
        agent.close()
        policy.close()


def test_act_queues_a_request_that_other_agents_rows_must_join():
    """Lock-step over two agents: whichever acts first is not a whole flush by itself, so it is queued, and
    both are answered by one forward pass of both rows."""
    recorder = ThreadRecorder()
    policy = AutobatchPolicy(recorder)
    agents = [policy.register(1, env_ids=(i,)) for i in range(2)]
    barrier = threading.Barrier(2)

    def client(i: int):
        barrier.wait()
        answer = agents[i].act(obs_rows(10 + i))
        return int(answer.outputs["action"][answer.start])

    try:
        assert run_in_threads(2, client) == [10, 11]
        assert recorder.batch_sizes == [2]
    finally:
        for agent in agents:
            agent.close()
        policy.close()


def test_act_raises_the_failed_forward_pass_naming_the_agents_envs():
    failing = FailingPolicy("raise")
    policy = AutobatchPolicy(failing)
    agent = policy.register(2, env_ids=(3, 8))
    try:
        with pytest.raises(PolicyError, match="ZeroDivisionError: policy bug") as info:
            agent.act(obs_rows(0, 1))
        assert info.value.env_ids == (3, 8) and isinstance(info.value.__cause__, ZeroDivisionError)
        failing.mode = "wrong_size"  # the server survives: the next request is run, and checked
        with pytest.raises(PolicyError, match="leading dim must be the batch size 2"):
            agent.act(obs_rows(0, 1))
    finally:
        agent.close()
        policy.close()


def test_close_fails_waiting_requests_and_refuses_new_ones():
    policy = AutobatchPolicy(EchoPolicy(), autobatch_size=None)
    waiting, holding = policy.register(1), policy.register(1)
    waiting.submit(obs_rows(0))  # held back by `holding`: still queued at close
    policy.close()
    with pytest.raises(CollectionError, match="closed"):
        waiting.result()
    with pytest.raises(CollectionError):
        waiting.submit(obs_rows(0))
    with pytest.raises(CollectionError):
        policy.register(1)
    with pytest.raises(CollectionError):
        policy.update({})
    policy.close()  # idempotent
    holding.close()


def test_result_wait_is_abandoned_when_its_stop_flag_is_set():
    policy = AutobatchPolicy(EchoPolicy(), autobatch_size=None)
    waiting, holding = policy.register(1), policy.register(1)
    stop = threading.Event()
    stop.set()
    try:
        waiting.submit(obs_rows(0))
        with pytest.raises(CollectionError, match="stopped"):
            waiting.result(stop)
    finally:
        waiting.close(), holding.close()
        policy.close()


# -- configuration ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    ({"autobatch_size": 0}, r"autobatch_size must be .*(positive|>= 1)"),
    ({"autobatch_size": -3}, r"autobatch_size must be .*(positive|>= 1)"),
    ({"autobatch_size": 2.5}, r"autobatch_size must be .*(positive|>= 1)"),
    ({"max_wait": -1.0}, r"max_wait must be .*>= 0"),
])
def test_bad_policy_configuration_says_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AutobatchPolicy(EchoPolicy(), **kwargs)


def test_non_callable_policy_is_rejected():
    with pytest.raises(ValueError, match="TensorDictModule or a callable"):
        AutobatchPolicy(42)  # type: ignore[arg-type]


def test_register_rejects_zero_rows():
    policy = AutobatchPolicy(EchoPolicy())
    try:
        with pytest.raises(ValueError, match="rows must be >= 1"):
            policy.register(0)
    finally:
        policy.close()
