"""TorchRL's ``Collector`` keywords on ``ThreadedCollector``: every one is taken, with TorchRL's default;
those whose meaning carries over are honoured, the values of the others that would change something are
refused with what to do instead (``docs/torchrl.rst``, "Keyword arguments of TorchRL's Collector").

Also here: a refused batched env leaves no process running, batches carry the ``device`` TorchRL's
``Collector`` gives them for the same arguments, and ``load_state_dict`` is applied whole or not at all.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
import warnings

import psutil
import pytest
import torch
from tensordict.nn import TensorDictModule, TensorDictSequential
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs import GymEnv, ParallelEnv
from torchrl.modules import LSTMModule

from collector_helpers import leaf_keys
from conftest import ArgmaxNet, CountingPolicy, assert_batches_equal, called_from_probe, mock_envs
from lightning_rollout import CollectionError, ThreadedCollector
from process_helpers import worker_pids
from reliability_helpers import InThread, bounded

pytestmark = pytest.mark.timeout(120)

BOUND = 30.0  # seconds any single call here may take before the test fails as a hang
FAST = {"envs_per_thread": 1, "num_workers": 1}  # no timed "auto" probe of the env


def _collect(**kwargs) -> list:
    """Two batches of 2 mock envs x 4 steps, seeded, with ``kwargs`` added."""
    collector = ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch=8, total_frames=16, seed=1,
                                  **FAST, **kwargs)
    try:
        return [batch.clone() for batch in bounded(lambda: list(collector), BOUND)]
    finally:
        collector.shutdown()


# ----------------------------------------------------------------------------------------------------------
# Every keyword of TorchRL's Collector


def _parameters(cls: type) -> dict[str, inspect.Parameter]:
    return {name: p for name, p in inspect.signature(cls.__init__).parameters.items() if name != "self"}


def test_every_keyword_of_torchrls_collector_is_a_parameter_with_torchrls_default():
    ours = _parameters(ThreadedCollector)
    theirs = {n: p for n, p in _parameters(Collector).items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"ThreadedCollector does not take {missing}"
    for name, p in theirs.items():
        assert ours[name].kind is p.kind, name  # create_env_fn, policy positional; the rest keyword-only
        if p.default is inspect.Parameter.empty:
            assert ours[name].default is inspect.Parameter.empty, name
        else:
            assert ours[name].default == p.default, f"{name}: {ours[name].default!r} != {p.default!r}"
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ours.values())  # no catch-all


def test_the_values_of_torchrl_options_that_change_nothing_here_are_accepted_and_change_nothing():
    neutral = dict(backend="direct", backend_options={}, num_collectors=None, sync=None, return_same_td=False,
                   use_buffers=True, cudagraph_policy=False, no_cuda_sync=True, weight_updater=None,
                   weight_sync_schemes={}, weight_recv_schemes={}, worker_idx=3,
                   auto_register_policy_transforms=False, compact_obs=False)
    assert_batches_equal(_collect(**neutral), _collect())
    assert_batches_equal(_collect(use_buffers=False, cudagraph_policy=None, no_cuda_sync=False), _collect())


def test_worker_idx_is_kept_as_torchrl_keeps_it():
    collector = ThreadedCollector(mock_envs(1), CountingPolicy(), frames_per_batch=2, worker_idx=2, **FAST)
    try:
        assert collector.worker_idx == 2
    finally:
        collector.shutdown()


REFUSED = [
    ("backend", "process", ValueError, r"backend='process'.*num_workers"),
    ("backend", "ray", ValueError, r"backend='ray'.*Collector\(backend='ray'\)"),
    ("backend_options", {"num_workers": 2}, ValueError, r"backend_options.*keyword arguments"),
    ("num_collectors", 2, ValueError, r"num_collectors=2.*num_envs="),
    ("sync", True, ValueError, r"sync=True.*on_policy"),
    ("return_same_td", True, ValueError, r"return_same_td=True.*update_"),
    ("cudagraph_policy", True, ValueError, r"cudagraph_policy=True.*compile_policy"),
    ("cudagraph_policy", {"warmup": 10}, ValueError, r"cudagraph_policy=\{'warmup': 10\}.*reduce-overhead"),
    ("weight_updater", object(), ValueError, r"weight_updater.*update_policy_weights_"),
    ("weight_sync_schemes", {"policy": object()}, ValueError, r"weight_sync_schemes.*update_policy_weights_"),
    ("weight_recv_schemes", {"policy": object()}, ValueError, r"weight_recv_schemes.*update_policy_weights_"),
    ("worker_idx", -1, ValueError, r"worker_idx"),
    ("auto_register_policy_transforms", "yes", ValueError, r"auto_register_policy_transforms"),
]


@pytest.mark.parametrize("name, value, error, message", REFUSED,
                         ids=[f"{n}={v!r}" if "object at" not in repr(v) else n for n, v, _, _ in REFUSED])
def test_a_torchrl_option_value_that_cannot_be_honoured_is_refused_before_any_env_is_built(name, value, error,
                                                                                            message):
    built = []

    def factory():
        built.append(1)
        return mock_envs(1)[0]()

    with pytest.raises(error, match=message):
        ThreadedCollector(factory, CountingPolicy(), frames_per_batch=4, **FAST, **{name: value})
    assert not built


def test_use_buffers_with_a_replay_buffer_raises_torchrls_type_error():
    rb = ReplayBuffer(storage=LazyTensorStorage(16))
    with pytest.raises(TypeError, match="replay_buffer is exclusive with use_buffers"):
        ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch=4, replay_buffer=rb, use_buffers=True,
                          **FAST)


def test_compact_obs_leaves_out_the_next_observations_that_the_next_row_holds_at_its_root():
    full, compact = _collect(), _collect(compact_obs=True)
    observations = {"observation", "is_init", "step_count", "episode_reward"}  # the gymnasium env's observation keys
    dropped = {("next", k) for k in observations}
    for f, c in zip(full, compact):
        assert dropped <= leaf_keys(f)
        assert leaf_keys(c) == leaf_keys(f) - dropped
        assert observations <= leaf_keys(c) and {("next", "reward"), ("next", "done")} <= leaf_keys(c)
        assert_batches_equal([c], [f.exclude(*dropped)])
        # what was dropped is the next row's root, within each env's episode
        same_episode = ~f["next", "done"][:, :-1, 0]
        assert torch.equal(f["next", "observation"][:, :-1][same_episode], f["observation"][:, 1:][same_episode])


def _recurrent_policy() -> TensorDictSequential:
    torch.manual_seed(0)
    lstm = LSTMModule(input_size=4, hidden_size=8, in_key="observation", out_key="embed")
    return TensorDictSequential(
        lstm, TensorDictModule(torch.nn.Linear(8, 2), in_keys=["embed"], out_keys=["logits"]),
        TensorDictModule(lambda logits: logits.argmax(-1), in_keys=["logits"], out_keys=["action"]))


def _bare_cartpole() -> GymEnv:
    return GymEnv("CartPole-v1", categorical_action_encoding=True)  # no InitTracker, no primer


def test_auto_register_policy_transforms_appends_what_a_recurrent_policy_needs_as_torchrl_does():
    reference = Collector(_bare_cartpole, _recurrent_policy(), frames_per_batch=8, total_frames=8,
                          auto_register_policy_transforms=True)
    try:
        expected = leaf_keys(next(iter(reference)))
    finally:
        reference.shutdown()
    collector = ThreadedCollector(_bare_cartpole, _recurrent_policy(), frames_per_batch=8, total_frames=8,
                                  auto_register_policy_transforms=True, **FAST)
    try:
        batch = bounded(lambda: next(iter(collector)), BOUND)
    finally:
        collector.shutdown()
    assert {"is_init", "recurrent_state_h", ("next", "recurrent_state_h")} <= expected
    assert leaf_keys(batch) == expected


def test_worker_processes_append_a_recurrent_policys_transforms_without_being_sent_the_policy():
    """The same over a worker process: it appends the transforms from the policy's primers, the one thing of the
    policy it is sent (this policy holds a lock, so it cannot be pickled; nor need its weights travel)."""
    policy = _recurrent_policy()
    policy.lock = threading.Lock()
    collector = ThreadedCollector(_bare_cartpole, policy, num_envs=4, frames_per_batch=16,
                                  total_frames=16, auto_register_policy_transforms=True, num_workers=2,
                                  envs_per_thread=2)
    try:
        batch = bounded(lambda: next(iter(collector)), BOUND)
    finally:
        collector.shutdown()
    assert {"is_init", "recurrent_state_h", ("next", "recurrent_state_h")} <= leaf_keys(batch)
    assert batch["is_init"][:, 0].all() and not batch["is_init"][:, 1].any()


def test_torchrls_transforms_warning_is_given_once_with_worker_processes_and_by_none_of_them(capfd):
    """Without ``auto_register_policy_transforms``, TorchRL's ``FutureWarning`` reaches the user once, from this
    process (whose filters apply), not again on a worker process's stderr for each of its envs."""
    policy = TensorDictSequential(  # an nn.Module: TorchRL's rule asks for an InitTracker
        TensorDictModule(torch.nn.Linear(4, 2), in_keys=["observation"], out_keys=["logits"]),
        TensorDictModule(lambda logits: logits.argmax(-1), in_keys=["logits"], out_keys=["action"]))
    with pytest.warns(FutureWarning, match=r"missing transforms required by the policy \(InitTracker\)") as seen:
        collector = ThreadedCollector(_bare_cartpole, policy, num_envs=4, frames_per_batch=16, total_frames=16,
                                      num_workers=2, envs_per_thread=2)
    try:
        bounded(lambda: next(iter(collector)), BOUND)
    finally:
        collector.shutdown()
    assert len([w for w in seen if "missing transforms" in str(w.message)]) == 1
    assert "missing transforms" not in capfd.readouterr().err


# ----------------------------------------------------------------------------------------------------------
# A refused batched env leaves nothing running


def _new_children(before: set[int]) -> list[psutil.Process]:
    """Live processes started under this one since ``before``, less multiprocessing's helpers
    (:func:`process_helpers.worker_pids`)."""
    found = []
    for pid in worker_pids() - before:
        try:
            found.append(psutil.Process(pid))
        except psutil.NoSuchProcess:  # it ended meanwhile
            continue
    return found


def _wait_for_no_new_children(before: set[int], timeout: float = 10.0) -> list[psutil.Process]:
    """The new children still alive after up to ``timeout`` s (a closed env's workers may take a moment to
    exit: bounded polling, not a race-winning sleep)."""
    deadline = time.monotonic() + timeout
    while (left := _new_children(before)) and time.monotonic() < deadline:
        psutil.wait_procs(left, timeout=0.1)
    return left


def test_a_factory_of_a_batched_env_is_stepped_as_it_is_and_leaves_no_process_running():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        collector = ThreadedCollector(functools.partial(GymEnv, "CartPole-v1", num_envs=2), None, frames_per_batch=4,
                                      total_frames=4, num_envs=2, envs_per_thread=2, num_workers=1)
        try:
            assert len(_new_children(before)) == 2  # the batched env's own two worker processes step it
            batch = next(iter(collector))
        finally:
            collector.shutdown()
    assert batch.batch_size == (2, 2)
    left = _wait_for_no_new_children(before)
    assert not left, f"processes left running: {[(p.pid, p.cmdline()) for p in left]}"


def test_a_batched_env_instance_is_taken_apart_and_its_own_processes_end():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        env = ParallelEnv(2, functools.partial(GymEnv, "CartPole-v1"))
        env.start()
        assert len(_new_children(before)) == 2  # the ParallelEnv's two worker processes
        collector = ThreadedCollector(env, None, frames_per_batch=4, total_frames=4, **FAST)
    try:
        assert env.is_closed
        assert not _wait_for_no_new_children(before)  # the collector steps its own envs, in threads
        batch = next(iter(collector))
        assert batch.batch_size == (2, 2) and batch.names == [None, "time"]
    finally:
        collector.shutdown()


# ----------------------------------------------------------------------------------------------------------
# Batch device: TorchRL's for the same arguments


DEVICE_KWARGS = [{}, {"device": "cpu"}, {"storing_device": "cpu"}, {"env_device": "cpu"}, {"policy_device": "cpu"},
                 {"env_device": "cpu", "policy_device": "cpu"}, {"device": "cpu", "storing_device": "cpu"}]


@pytest.mark.parametrize("kwargs", DEVICE_KWARGS, ids=[",".join(k) or "defaults" for k in DEVICE_KWARGS])
@pytest.mark.parametrize("policy", ["random", "module"])
def test_batches_have_the_device_torchrls_collector_gives_them_for_the_same_arguments(kwargs, policy):
    def make_policy():
        if policy == "random":
            return None
        return TensorDictModule(torch.nn.Linear(4, 2), in_keys=["observation"], out_keys=["action"])

    make_env = functools.partial(GymEnv, "CartPole-v1")
    reference = Collector(make_env, make_policy(), frames_per_batch=4, total_frames=4,
                          auto_register_policy_transforms=False, **kwargs)  # False: no FutureWarning about InitTracker
    try:
        expected = next(iter(reference))
        expected_storing = reference.storing_device
    finally:
        reference.shutdown()
    collector = ThreadedCollector(make_env, make_policy(), frames_per_batch=4, total_frames=4, **FAST, **kwargs)
    try:
        batch = bounded(lambda: next(iter(collector)), BOUND)
        fake = collector.fake_tensordict()
    finally:
        collector.shutdown()
    assert (batch.device, batch["next"].device) == (expected.device, expected["next"].device)
    assert collector.storing_device == expected_storing
    assert fake.device == expected.device
    assert all(t.device.type == "cpu" for t in batch.values(True, True))


# ----------------------------------------------------------------------------------------------------------
# load_state_dict: whole or nothing


class BlockingPolicy(CountingPolicy):
    """:class:`CountingPolicy` whose first forward pass (not the construction probe) sets ``entered`` and
    waits for ``release`` (at most ``BOUND`` s): the collector is then mid-batch until the test says."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        if not called_from_probe() and not self.entered.is_set():
            self.entered.set()
            self.release.wait(BOUND)
        return super().__call__(obs)


def test_load_state_dict_from_a_second_thread_mid_batch_is_refused_whole_and_changes_nothing():
    policy = BlockingPolicy()
    collector = ThreadedCollector(mock_envs(2), policy, frames_per_batch=4, total_frames=-1, seed=5, **FAST)
    try:
        before = collector.state_dict()
        loaded = {**before, "frames": 400, "batches": 100, "next_traj_id": 50, "policy_version": 7, "seed": 9}

        def load_mid_batch():
            assert policy.entered.wait(BOUND), "the batch never reached the policy"
            try:
                collector.load_state_dict(loaded)
            finally:
                policy.release.set()

        loader = InThread(load_mid_batch, name="test-loader", daemon=True)
        it = iter(collector)
        batch = bounded(lambda: next(it), 2 * BOUND, "the batch")
        with pytest.raises(CollectionError, match="iterated in thread"):
            loader.result(BOUND, "load_state_dict")
        after = collector.state_dict()
        assert (after["frames"], after["batches"], after["policy_version"], after["seed"]) == (4, 1, 0, 5)
        assert not batch["next", "truncated"].any()  # no env was reset by the refused load
        assert bounded(lambda: next(it), BOUND)["collector", "traj_ids"].min() < loaded["next_traj_id"]
        it.close()
    finally:
        collector.shutdown()


def test_load_state_dict_with_weights_that_fit_only_in_part_changes_no_weight():
    net = ArgmaxNet()
    collector = ThreadedCollector(mock_envs(2), net, frames_per_batch=4, total_frames=8, **FAST)
    try:
        weights = {k: v.clone() for k, v in net.state_dict().items()}
        state = {**collector.state_dict(), "frames": 4, "batches": 1,
                 "policy_state_dict": {"lin.weight": torch.full_like(weights["lin.weight"], 7.0),
                                       "lin.bias": torch.zeros(5)}}  # weight fits, bias does not
        with pytest.raises(ValueError, match="'lin.bias' has shape"):
            collector.load_state_dict(state)
        for key, value in net.state_dict().items():
            assert torch.equal(value, weights[key]), key
        assert (collector.frames, collector.policy_version) == (0, 0)
    finally:
        collector.shutdown()


def test_load_state_dict_between_batches_in_the_iterating_thread_is_applied():
    collector = ThreadedCollector(mock_envs(2), CountingPolicy(), frames_per_batch=4, total_frames=-1, seed=5,
                                  **FAST)
    try:
        it = iter(collector)
        bounded(lambda: next(it), BOUND)
        collector.load_state_dict({**collector.state_dict(), "frames": 40, "batches": 10, "policy_version": 3})
        assert (collector.frames, collector.policy_version, collector.state_dict()["batches"]) == (40, 3, 10)
        assert bounded(lambda: next(it), BOUND)["is_init"][:, 0].all()  # envs reseeded: new episodes
        it.close()
    finally:
        collector.shutdown()
