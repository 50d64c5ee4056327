"""What TorchRL clients broke (issue 46, C1-C4), through ``ThreadedCollector``'s public API.

* C1: a multi-collector line (``MultiSyncCollector(...)`` / ``MultiAsyncCollector(...)``, TorchRL's IMPALA
  script) swapped for ``ThreadedCollector(...)`` is taken: its keywords through the same table as
  ``Collector``'s, a list of env instances one env each.
* C2: a seeded ``SerialEnv`` gives ``Collector``'s data (TorchRL's seed chain), a started one is warned about.
* C3: the collection's threads keep torch's OpenMP teams within the cores, whatever the user's setting.
* C4: TorchRL's ``FutureWarning`` about transforms the policy needs reaches the user, as ``Collector`` gives it.
"""

from __future__ import annotations

import inspect
import threading
import warnings
from typing import Any

import pytest
import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictModuleBase
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
from torchrl.envs import Compose, DoubleToFloat, GymEnv, RewardSum, SerialEnv, StepCounter, Transform, TransformedEnv

from conftest import ArgmaxNet, assert_batches_equal, mock_envs
from lightning_rollout import ThreadedCollector
from lightning_rollout._threads import torch_threads
from reliability_helpers import bounded

pytestmark = pytest.mark.timeout(120)

BOUND = 60.0  # seconds any single collection here may take before the test fails as a hang
FAST = {"envs_per_thread": 1, "num_workers": 1}


def make_env() -> TransformedEnv:
    """IMPALA's ``make_env`` shape (``utils.py`` of TorchRL's sota-implementations), on CartPole."""
    return TransformedEnv(GymEnv("CartPole-v1"), Compose(RewardSum(), StepCounter(max_steps=4500), DoubleToFloat()))


class CartPoleNet(torch.nn.Module):
    """A module policy for CartPole: a one-hot action from a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(self.lin(observation).argmax(-1), 2)


def actor() -> TensorDictModule:
    return TensorDictModule(CartPoleNet(), in_keys=["observation"], out_keys=["action"])


def index_actor() -> TensorDictModule:
    """A deterministic CartPole policy writing a one-hot action, as TorchRL's ``GymEnv`` expects it."""
    def act(observation: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot((observation[..., 2] > 0).long(), 2)

    return TensorDictModule(act, in_keys=["observation"], out_keys=["action"])


def collect(collector, batches: int = 1) -> list[TensorDictBase]:
    try:
        def run() -> list[TensorDictBase]:
            out = []
            for batch in collector:
                out.append(batch.clone())
                if len(out) == batches:
                    break
            return out

        return bounded(run, BOUND)
    finally:
        collector.shutdown()


# ----------------------------------------------------------------------------------------------------------
# C1: TorchRL's multi-collectors


def test_every_keyword_of_torchrls_multi_collectors_is_a_parameter_with_torchrls_default():
    ours = inspect.signature(ThreadedCollector.__init__).parameters
    for cls in (MultiSyncCollector, MultiAsyncCollector):
        theirs = inspect.signature(cls.__init__).parameters
        theirs = theirs if "frames_per_batch" in theirs else inspect.signature(MultiSyncCollector.__init__).parameters
        for name, p in theirs.items():
            if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) or name in ("self", "create_env_fn", "policy"):
                continue
            assert name in ours, f"ThreadedCollector does not take {cls.__name__}'s {name}"
            if name != "num_workers":  # ours: worker processes ("auto"); theirs: one env a worker (None)
                assert ours[name].default == p.default, name


def test_impalas_multi_async_collector_line_swapped_literally_collects_and_pulls_weights_each_batch():
    # sota-implementations/impala/impala_single_node.py (torchrl before 0.14.1), MultiAsyncCollector -> ours:
    # one env instance listed once per worker, update_at_each_batch=True
    num_workers, device = 3, torch.device("cpu")
    collector = ThreadedCollector(
        create_env_fn=[make_env()] * num_workers,
        policy=actor(),
        frames_per_batch=30,
        total_frames=90,
        device=device,
        storing_device=device,
        max_frames_per_traj=-1,
        update_at_each_batch=True,
        track_policy_version=True,
    )
    batches = collect(collector, 3)
    assert [b.batch_size for b in batches] == [torch.Size([3, 10])] * 3
    assert [b["policy_version"].unique().tolist() for b in batches] == [[1], [2], [3]]  # pulled before each
    assert all(b.device == device for b in batches)


def test_an_env_instance_listed_twice_is_copied_into_envs_of_their_own():
    seeded = dict(frames_per_batch=40, total_frames=40, seed=3, **FAST)
    listed = collect(ThreadedCollector([make_env()] * 2, index_actor(), **seeded))
    made = collect(ThreadedCollector([make_env, make_env], index_actor(), **seeded))
    assert_batches_equal(listed, made)  # one instance stepped by both env slots would interleave one episode


def test_impalas_collector_line_of_torchrl_0_14_1_is_refused_once_naming_every_option_to_change():
    # the same script on torchrl 0.14.1: Collector(..., backend="process", num_collectors=..., sync=False)
    with pytest.raises(ValueError) as info:
        ThreadedCollector(create_env_fn=make_env, backend="process", num_collectors=12, sync=False, policy=actor(),
                          frames_per_batch=80, total_frames=160, max_frames_per_traj=-1, update_at_each_batch=True)
    message = str(info.value)
    assert "backend='process'" in message and "num_collectors=12" in message and "sync=False" in message
    assert "num_envs=" in message and "on_policy" in message


MULTI_REFUSED = [
    ("preemptive_threshold", 0.7, r"preemptive_threshold=0.7.*layout='flat'"),
    ("num_sub_threads", 2, r"num_sub_threads=2.*one thread"),
    ("cat_results", -1, r"cat_results=-1.*reshape\(-1\)"),
    ("collector_class", MultiSyncCollector, r"collector_class=.*no sub-collector class"),
    ("init_fn", print, r"init_fn=.*env factory"),
    ("frames_per_batch", [10, 10], r"frames_per_batch=\[10, 10\].*one frames_per_batch"),
]


@pytest.mark.parametrize("name, value, message", MULTI_REFUSED, ids=[n for n, _, _ in MULTI_REFUSED])
def test_a_multi_collector_option_that_cannot_be_honoured_is_refused_with_what_to_do(name, value, message):
    with pytest.raises(ValueError, match=message):
        ThreadedCollector(mock_envs(2), ArgmaxNet(), **{"frames_per_batch": 4, **FAST, name: value})


def test_multi_collector_values_that_change_nothing_are_taken():
    collector = ThreadedCollector(mock_envs(2), ArgmaxNet(), frames_per_batch=4, total_frames=4, cat_results="stack",
                                  num_sub_threads=1, collector_class=Collector, device=["cpu", "cpu"],
                                  create_env_kwargs=[{}, {}], **FAST)
    assert collect(collector)[0].batch_size == (2, 2)


def test_torchrls_one_env_a_worker_num_workers_is_refused_naming_num_envs():
    with pytest.raises(ValueError, match=r"num_workers=2 with one env.*pass num_envs=2"):
        ThreadedCollector(mock_envs(1)[0], ArgmaxNet(), frames_per_batch=4, num_workers=2)


# ----------------------------------------------------------------------------------------------------------
# C2: a seeded SerialEnv


def test_a_seeded_serial_env_gives_collectors_data_leaf_by_leaf():
    def serial() -> SerialEnv:
        return SerialEnv(3, lambda: GymEnv("CartPole-v1"))

    reference_env = serial()
    reference_env.set_seed(7)
    reference = collect(Collector(reference_env, index_actor(), frames_per_batch=60, total_frames=60))
    ours = collect(ThreadedCollector(serial(), index_actor(), frames_per_batch=60, total_frames=60, seed=7, **FAST))
    for key in [("next", "observation"), ("next", "done"), ("next", "reward"), "action", ("collector", "traj_ids")]:
        assert torch.equal(ours[0][key], reference[0][key]), key
    late = ThreadedCollector(serial(), index_actor(), frames_per_batch=60, total_frames=60, **FAST)
    assert late.set_seed(7) == serial().set_seed(7)  # TorchRL's next seed of the chain
    assert torch.equal(collect(late)[0][("next", "observation")], reference[0][("next", "observation")])


def started_serial_env() -> SerialEnv:
    env = SerialEnv(2, lambda: GymEnv("CartPole-v1"))
    env.set_seed(1)  # starts it: its envs are built and seeded, and ours are rebuilt from create_env_fn
    return env


def test_a_started_serial_env_is_warned_about_at_the_first_batch_unless_seeded_since():
    with pytest.warns(UserWarning, match=r"SerialEnv given was started.*pass seed="):
        collect(ThreadedCollector(started_serial_env(), index_actor(), frames_per_batch=4, total_frames=4, **FAST))
    for seeded in ({"seed": 1}, {}):
        collector = ThreadedCollector(started_serial_env(), index_actor(), frames_per_batch=4, total_frames=4,
                                      **seeded, **FAST)
        if not seeded:
            collector.set_seed(1)  # as TorchRL's sota scripts do after building the collector
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            collect(collector)
        assert not [w for w in caught if "was started" in str(w.message)]


# ----------------------------------------------------------------------------------------------------------
# C3: threads and cores


class _RecordThreads(Transform):
    """Records ``torch.get_num_threads()`` in the thread that steps (or resets) the env."""

    def __init__(self, seen: dict[str, set[int]]) -> None:
        super().__init__()
        self.seen = seen

    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        self.seen.setdefault(threading.current_thread().name, set()).add(torch.get_num_threads())
        return next_tensordict

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        return self._call(tensordict_reset)


@pytest.mark.parametrize("layout", [dict(num_envs=4, envs_per_thread=1), dict(num_envs=4, envs_per_thread=4)],
                         ids=["four-env-threads", "one-env-thread"])
def test_env_stepping_threads_run_torch_with_one_thread_and_the_policy_within_the_cores(layout):
    stepping: dict[str, set[int]] = {}
    acting: dict[str, set[int]] = {}

    def policy(td: TensorDictBase) -> TensorDictBase:
        acting.setdefault(threading.current_thread().name, set()).add(torch.get_num_threads())
        return td.set("action", torch.zeros(*td.shape, 2, dtype=torch.long).index_fill_(-1, torch.tensor(0), 1))

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the user's setting, whatever the machine
    try:
        collect(ThreadedCollector(lambda: TransformedEnv(GymEnv("CartPole-v1"), _RecordThreads(stepping)), policy,
                                  frames_per_batch=16, total_frames=16, num_workers=1, **layout))
    finally:
        torch.set_num_threads(before)
    pool = {name: n for name, n in stepping.items() if name.startswith("lightning_rollout-")}
    threads = layout["num_envs"] // layout["envs_per_thread"]
    # torch's thread count is process-wide: during a call it keeps every busy thread within the cores
    allowed = torch_threads(runs_policy=True, busy=threads if threads > 1 else 0, requested=2)
    if threads > 1:  # each group in a pool thread, stepping side by side
        assert len(pool) == threads and all(max(n) <= allowed for n in pool.values()), stepping
    else:  # every env steps in the collecting thread, between the policy's passes
        assert not pool, stepping
    assert acting and all(max(n) <= allowed for n in acting.values()), acting  # the policy, in the collecting thread


def test_torchrls_num_threads_sets_the_policys_thread_count():
    acting: set[int] = set()

    def policy(td: TensorDictBase) -> TensorDictBase:
        acting.add(torch.get_num_threads())  # in the collecting thread
        return td.set("action", torch.ones(*td.shape, dtype=torch.long))

    collect(ThreadedCollector(mock_envs(2), policy, frames_per_batch=4, total_frames=4, envs_per_thread=2,
                              num_workers=1, num_threads=1))
    assert acting == {1}


def test_the_thread_rule_keeps_every_busy_thread_within_the_cores():
    assert torch_threads(runs_policy=False) == 1
    assert torch_threads(runs_policy=True, busy=0, requested=8, cores=4) == 4
    assert torch_threads(runs_policy=True, busy=3, requested=8, cores=4) == 1
    assert torch_threads(runs_policy=True, busy=15, requested=8, cores=4) == 1
    assert torch_threads(runs_policy=True, busy=2, requested=3, cores=16) == 3


# ----------------------------------------------------------------------------------------------------------
# C4: the user's warnings


@pytest.mark.parametrize("cls", [Collector, ThreadedCollector])
def test_torchrls_warning_about_transforms_the_policy_needs_reaches_the_user(cls):
    # TorchRL's sota scripts: an nn.Module policy on an env without InitTracker (TorchRL appends one from v0.15)
    with pytest.warns(FutureWarning, match=r"missing transforms required by the policy \(InitTracker\)") as seen:
        collector = cls(lambda: GymEnv("CartPole-v1"), actor(), frames_per_batch=4, total_frames=4)
    collector.shutdown()
    assert len([w for w in seen if "missing transforms" in str(w.message)]) == 1  # once a collector, as TorchRL


def test_the_transforms_warning_is_given_once_for_all_the_envs():
    with pytest.warns(FutureWarning, match="missing transforms") as seen:
        collector = ThreadedCollector(lambda: GymEnv("CartPole-v1"), actor(), frames_per_batch=8, total_frames=8,
                                      num_envs=4)
    collector.shutdown()
    assert len([w for w in seen if "missing transforms" in str(w.message)]) == 1


@pytest.mark.parametrize("register", [True, False])
def test_no_such_warning_once_the_user_chose(register):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        collector = ThreadedCollector(lambda: GymEnv("CartPole-v1"), actor(), frames_per_batch=4, total_frames=4,
                                      auto_register_policy_transforms=register, **FAST)
    assert ("is_init" in collect(collector)[0].keys()) == register  # True: TorchRL's InitTracker appended


# ----------------------------------------------------------------------------------------------------------
# C2: the policy's input has TorchRL's device; a policy_version the policy writes is kept


class _DeviceLessPolicy(TensorDictModuleBase):
    """TorchRL's ``TestCollectorDevices.DeviceLessPolicy``: no device given, so its input has none."""

    in_keys, out_keys = ["observation"], ["action"]

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        assert tensordict.device is None, tensordict.device
        return tensordict.set("action", torch.nn.functional.one_hot(torch.zeros(tensordict.shape, dtype=torch.long), 2))


@pytest.mark.parametrize("cls", [Collector, ThreadedCollector])
def test_the_policys_input_has_no_device_when_no_policy_device_is_given(cls):
    collect(cls(lambda: GymEnv("CartPole-v1"), _DeviceLessPolicy(), frames_per_batch=4, total_frames=4))


class _VersionStamp(torch.nn.Module):
    """TorchRL's ``_VersionStampModule``: a constant action, and the module's own ``policy_version``."""

    def __init__(self) -> None:
        super().__init__()
        self.version = 5

    def forward(self, observation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        action = torch.nn.functional.one_hot(torch.zeros(observation.shape[:-1], dtype=torch.long), 2)
        return action, torch.full(observation.shape[:-1], self.version)


@pytest.mark.parametrize("cls", [Collector, ThreadedCollector])
def test_a_policy_version_the_policy_writes_itself_is_kept(cls):
    policy = TensorDictModule(_VersionStamp(), in_keys=["observation"], out_keys=["action", "policy_version"])
    batch = collect(cls(lambda: GymEnv("CartPole-v1"), policy, frames_per_batch=4, total_frames=4))[0]
    assert (batch["policy_version"] == 5).all()
