"""What the acting policy is promised and held to, through ThreadedCollector and AutobatchPolicy.

* On-policy batches have one ``policy_version`` whoever updates the weights, and when:
  an update made during a batch (from another thread, or from an event processor in the
  driving thread) applies from the next batch.
* A policy must write, at every call, every output key the probe saw it write:
  otherwise :class:`PolicyError` names the key (batched path and single-agent fast path).
* A policy that writes into its input in place cannot change the stored observations,
  whatever the layout.
* Non-persistent buffers (``register_buffer(..., persistent=False)``) reach the acting
  copy of the policy by every way of calling ``update_policy_weights_``.

Synchronisation is by events and bounded waits on observable state (``wait_for``), never by
sleeping to win a race.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule

from collector_helpers import stream_policy, wait_for
from conftest import MockEnv, mock_envs
from lightning_rollout import AutobatchPolicy, EventProcessor, PolicyError, ThreadedCollector

pytestmark = pytest.mark.timeout(60)

T = 4  # steps per env and batch


# -- on-policy batches have one policy version -------------------------------------------------------

class _MidBatchGate:
    """Env 0's step ``1`` of every batch of ``T`` steps signals ``mid`` and waits (bounded) until the
    update that signal triggers has reached the policy: applied, or waiting to be."""

    def __init__(self) -> None:
        self.mid = threading.Event()
        self.policy: AutobatchPolicy | None = None

    def __call__(self) -> None:
        policy = self.policy
        assert policy is not None
        before = policy.version
        self.mid.set()
        wait_for(lambda: policy.version > before or getattr(policy, "pending_updates", 0) > 0, timeout=10.0,
                 what="the mid-batch update reaching the policy")


class _GatedEnv(MockEnv):
    def __init__(self, env_id: int, gate: _MidBatchGate) -> None:
        super().__init__(env_id, length_fn=lambda env_id, episode: 3)
        self.gate = gate

    def step(self, action):
        if self.env_id == 0 and self.num_steps % T == 1:
            self.gate()
        return super().step(action)


def _versions(batches: list[TensorDictBase]) -> list[list[int]]:
    return [sorted(set(b["policy_version"].flatten().tolist())) for b in batches]


@pytest.mark.parametrize("layout, envs_per_thread", [("env_time", 1), ("env_time", 2), ("flat", 2)])
def test_on_policy_update_from_another_thread_mid_batch_applies_from_the_next_batch(layout, envs_per_thread):
    gate = _MidBatchGate()
    n_batches = 5
    collector = ThreadedCollector([lambda i=i: _GatedEnv(i, gate) for i in range(2)], stream_policy,
                                  frames_per_batch=2 * T, total_frames=2 * T * n_batches, layout=layout,
                                  envs_per_thread=envs_per_thread, on_policy=True, track_policy_version=True)
    gate.policy = collector.loop.policy
    stop = threading.Event()
    errors: list[BaseException] = []

    def updater() -> None:
        try:
            while not stop.is_set():
                if gate.mid.wait(0.05):
                    gate.mid.clear()
                    collector.update_policy_weights_()
        except BaseException as exc:  # handed to the test's thread
            errors.append(exc)

    thread = threading.Thread(target=updater, name="test-updater")
    thread.start()
    try:
        batches = [batch.clone() for batch in collector]
    finally:
        stop.set()
        thread.join(20)
        collector.shutdown()
    assert not thread.is_alive() and not errors, errors
    assert len(batches) == n_batches
    # one version per batch, one update landing in each: batch b was acted by version b
    assert _versions(batches) == [[b] for b in range(n_batches)]
    assert collector.policy_version == n_batches


class _UpdatingProcessor(EventProcessor):
    """Calls ``update_policy_weights_()`` at every training step event (run in the driving thread)."""

    wants_timesteps = True

    def __init__(self) -> None:
        super().__init__()
        self.collector: ThreadedCollector | None = None
        self.calls = 0

    def on_timestep(self, step) -> None:
        assert self.collector is not None
        self.collector.update_policy_weights_()
        self.calls += 1


def test_on_policy_update_from_an_event_processor_applies_from_the_next_batch(within):
    processor = _UpdatingProcessor()
    frames = 2 * T
    collector = ThreadedCollector(mock_envs(2), stream_policy, frames_per_batch=frames, total_frames=3 * frames,
                                  layout="flat", envs_per_thread=1, on_policy=True, track_policy_version=True,
                                  processor=processor)
    processor.collector = collector
    try:
        batches = within(lambda: [batch.clone() for batch in collector])
        # the last batch's updates are applied after it, by the inference thread
        wait_for(lambda: collector.loop.policy.pending_updates == 0, timeout=20.0, what="the last updates applied")
        assert collector.policy_version == 3 * frames
    finally:
        collector.shutdown()
    assert processor.calls == 3 * frames
    # the frames updates made while batch b was collected apply together before batch b + 1
    assert _versions(batches) == [[0], [frames], [2 * frames]]


def test_update_made_while_the_weights_are_pinned_waits_for_the_pin_to_end():
    policy = AutobatchPolicy(stream_policy)
    pinned, leave = threading.Event(), threading.Event()
    hold = policy.pinned()

    def holder() -> None:
        with hold:
            pinned.set()
            leave.wait(20)

    thread = threading.Thread(target=holder, name="test-holder")
    result: list[int] = []
    updater = threading.Thread(target=lambda: result.append(policy.update(None)), name="test-updater")
    try:
        thread.start()
        assert pinned.wait(20)
        updater.start()
        wait_for(lambda: policy.pending_updates == 1, timeout=20.0, what="the update held")
        assert policy.version == 0 and not result  # not applied while pinned
        leave.set()
        thread.join(20)
        updater.join(20)
        assert result == [1] and policy.version == 1 and policy.pending_updates == 0
    finally:
        leave.set()
        policy.close()


# -- a policy must write every output the probe saw ---------------------------------------------------

class _Dropper:
    """Writes ``action`` and, for its first ``keep`` calls (the probe included), ``extra`` too."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.calls = 0

    def tensordict(self, td: TensorDictBase) -> TensorDictBase:
        self.calls += 1
        td["action"] = torch.zeros(td.batch_size, dtype=torch.long)
        if self.calls <= self.keep:
            td["extra"] = td["observation"][..., 0].clone()
        return td

    def tensors(self, obs: torch.Tensor):
        self.calls += 1
        action = torch.zeros(obs.shape[:-1], dtype=torch.long)
        return (action, obs[..., 0].clone()) if self.calls <= self.keep else action


def _collect_until_error(collector: ThreadedCollector) -> PolicyError:
    with pytest.raises(PolicyError, match="did not write 'extra'") as info:
        for _ in collector:
            pass
    assert collector.is_shut_down or collector.loop.closed
    return info.value


@pytest.mark.parametrize("num_envs, envs_per_thread", [(2, 1), (2, 2), (1, 1)],
                         ids=["batched", "one-thread", "one-env"])
def test_tensordict_policy_that_stops_writing_a_probed_output_raises_policy_error_naming_it(
        within, num_envs, envs_per_thread):
    dropper = _Dropper(keep=3)
    collector = ThreadedCollector(mock_envs(num_envs), dropper.tensordict, frames_per_batch=num_envs,
                                  total_frames=20 * num_envs, num_envs=num_envs, envs_per_thread=envs_per_thread)
    try:
        error = within(lambda: _collect_until_error(collector))
    finally:
        collector.shutdown(raise_on_error=False)
    assert dropper.calls == 4  # the probe, two steps, and the failing one
    assert error.env_ids == tuple(range(num_envs))


@pytest.mark.parametrize("num_envs, envs_per_thread", [(2, 1), (2, 2), (1, 1)],
                         ids=["batched", "caller-runs-fast-path", "one-env"])
def test_module_policy_that_stops_returning_a_probed_output_raises_policy_error_naming_it(
        within, num_envs, envs_per_thread):
    dropper = _Dropper(keep=3)
    module = TensorDictModule(dropper.tensors, in_keys=["observation"], out_keys=["action", "extra"])
    collector = ThreadedCollector(mock_envs(num_envs), module, frames_per_batch=num_envs * T,
                                  total_frames=20 * num_envs, num_envs=num_envs, envs_per_thread=envs_per_thread)
    try:
        error = within(lambda: _collect_until_error(collector))
    finally:
        collector.shutdown(raise_on_error=False)
    # the steps acted before the failure are kept on the error
    assert error.partial is not None and error.partial.batch_size.numel() == 2 * num_envs
    assert (error.partial["extra"] == error.partial["observation"][..., 0]).all()


def test_autobatch_policy_answers_a_dropped_output_with_policy_error_naming_it():
    dropper = _Dropper(keep=1)
    policy = AutobatchPolicy(dropper.tensordict, autobatch_size=1)
    obs = {"observation": np.zeros((2, 3), np.float32), "extra": np.zeros(2, np.float32)}
    try:
        assert set(policy.probe({"observation": obs["observation"]}, rows=2)) == {"action", "extra"}
        with policy.register(2, env_ids=(0, 1)) as agent:
            with pytest.raises(PolicyError, match="did not write 'extra'") as info:
                agent.act(obs)
    finally:
        policy.close()
    assert info.value.env_ids == (0, 1)


# -- in-place writes into the input do not reach the stored observations ---------------------------------

def _adds_in_place_td(td: TensorDictBase) -> TensorDictBase:
    seen = td["observation"][..., 2].clone()
    td["observation"].add_(1000.0)
    td["action"] = (seen.long() % 2)
    return td


class _AddsInPlace(torch.nn.Module):
    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        seen = obs[..., 2].clone()
        obs.add_(1000.0)
        return seen.long() % 2


LAYOUTS = {
    "one-env-per-thread": dict(envs_per_thread=1),
    "four-envs-per-thread": dict(envs_per_thread=4),
    "parallel-steps": dict(envs_per_thread=4, parallel_steps=True),
    "process-one-env-per-thread": dict(envs_per_thread=1, num_workers=1),
    "process-four-envs-per-thread": dict(envs_per_thread=4, num_workers=1),
    "one-env": dict(num_envs=1),
}


@pytest.mark.parametrize("kind", ["tensordict", "module"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_policy_writing_into_its_input_leaves_the_stored_observations_as_the_env_returned_them(layout, kind):
    options = dict(LAYOUTS[layout])
    num_envs = options.pop("num_envs", 4)
    policy = (_adds_in_place_td if kind == "tensordict"
              else TensorDictModule(_AddsInPlace(), in_keys=["observation"], out_keys=["action"]))
    collector = ThreadedCollector(mock_envs(num_envs), policy, frames_per_batch=num_envs * T,
                                  total_frames=3 * num_envs * T, num_envs=num_envs, seed=0, **options)
    try:
        batches = [batch.clone() for batch in collector]
    finally:
        collector.shutdown()
    batch = torch.cat([b if num_envs > 1 else b[None] for b in batches], dim=1)  # [num_envs, time]
    obs, nxt = batch["observation"], batch["next", "observation"]
    # MockEnv's observation is [env_id, episode, t]: exactly what is stored, at every row
    env_ids = torch.arange(num_envs, dtype=obs.dtype)[:, None].expand(obs.shape[:2])
    assert torch.equal(obs[..., 0], env_ids) and torch.equal(nxt[..., 0], env_ids)
    assert torch.equal(obs[..., 2], batch["step_count"].squeeze(-1).to(obs.dtype))
    assert torch.equal(nxt[..., 2], obs[..., 2] + 1)
    not_done = ~batch["next", "done"].squeeze(-1)[:, :-1]
    assert torch.equal(obs[:, 1:][not_done], nxt[:, :-1][not_done])
    # and the policy saw them as the env returned them
    assert torch.equal(batch["action"], obs[..., 2].long() % 2)


# -- non-persistent buffers reach the acting copy --------------------------------------------------------

class _OffsetNet(torch.nn.Module):
    """Acts with a non-persistent buffer: ``action = offset`` for every row (a running statistic's stand-in)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)
        self.register_buffer("offset", torch.zeros(()), persistent=False)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return (self.lin(obs)[..., 0] * 0 + self.offset).long()


WAYS = {
    "nothing": lambda learner: {},
    "module": lambda learner: {"policy_or_weights": learner},
    "state_dict": lambda learner: {"policy_or_weights": learner.state_dict()},
    "tensordict": lambda learner: {"policy_or_weights": TensorDict.from_module(learner)},
}


@pytest.mark.parametrize("way", list(WAYS))
def test_off_policy_update_carries_non_persistent_buffers_to_the_acting_copy(way):
    learner = TensorDictModule(_OffsetNet(), in_keys=["observation"], out_keys=["action"])
    collector = ThreadedCollector(mock_envs(2), learner, frames_per_batch=2 * T, total_frames=-1,
                                  envs_per_thread=1, on_policy=False, track_policy_version=True)
    try:
        batches = iter(collector)
        first = next(batches)
        assert (first["action"] == 0).all()
        learner.module.offset.fill_(1.0)  # the learner's running statistic moves
        kwargs = WAYS[way](learner)
        collector.update_policy_weights_(**kwargs)
        acted = [next(batches) for _ in range(2)]
    finally:
        collector.shutdown()
    new = torch.cat([b["action"][b["policy_version"] == 1] for b in acted])
    assert new.numel() > 0 and (new == 1).all(), new
    old = torch.cat([b["action"][b["policy_version"] == 0] for b in acted])
    assert (old == 0).all()


def test_update_rejects_a_non_persistent_buffer_of_another_shape_and_keeps_the_version():
    acting, source = _OffsetNet(), _OffsetNet()
    source.offset = torch.zeros(2)  # still non-persistent, another shape
    before = acting.lin.weight.detach().clone()
    policy = AutobatchPolicy(acting)
    try:
        with pytest.raises(ValueError, match="non-persistent buffer 'offset' has shape"):
            policy.update(source)
        assert policy.version == 0
        assert torch.equal(acting.lin.weight, before)  # nothing of the rejected weights was loaded
    finally:
        policy.close()
