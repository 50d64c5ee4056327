"""A policy on a CUDA device: the same batches as on the CPU, batches stored on the GPU where asked (or
where TorchRL would leave them), weights pushed from a GPU learner, and worker processes stepping envs for
a GPU policy in the main process. ``test_lightning.py`` runs ``Trainer.fit`` on a GPU.

Every test here needs a CUDA device and is skipped without one (``pytest -m cuda`` selects them). The
policies are exact on either device (integer arithmetic on small floats), so a GPU run is compared with
a CPU run value for value.
"""

from __future__ import annotations

import pytest
import torch
from tensordict.nn import TensorDictModule

from conftest import assert_batches_equal, mock_envs
from lightning_rollout import MultiEnvLoop, ThreadedCollector
from process_helpers import count_envs

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(240),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class ParityNet(torch.nn.Module):
    """``obs[B, 3] -> (obs[:, 1] + obs[:, 2]) * scale % 2`` as an index; ``scale`` (1 or 0) is the weight a
    learner changes, and the arithmetic is exact on any device."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return ((obs[:, 1] + obs[:, 2]) * self.scale).round().long() % 2


def _actor() -> TensorDictModule:
    return TensorDictModule(ParityNet(), in_keys=["observation"], out_keys=["action"])


def _collect(n_batches: int = 3, **kwargs) -> list:
    collector = ThreadedCollector(mock_envs(4), _actor(), frames_per_batch=24, total_frames=24 * n_batches, **kwargs)
    try:
        return [batch.clone() for batch in collector]
    finally:
        collector.shutdown()


@pytest.mark.parametrize("on_policy", [True, False], ids=["on-policy", "off-policy copy"])
def test_a_policy_on_the_gpu_gives_the_cpu_policys_batches_on_the_cpu(on_policy):
    reference = _collect(on_policy=on_policy)
    collector_batches = _collect(policy_device="cuda", on_policy=on_policy)
    # storing_device defaults to the CPU
    assert all(not t.is_cuda for b in collector_batches for t in b.values(True, True))
    assert_batches_equal(collector_batches, reference)


def test_a_policy_whose_weights_live_on_the_gpu_acts_there_without_policy_device():
    actor = _actor().cuda()
    collector = ThreadedCollector(mock_envs(4), actor, frames_per_batch=24, total_frames=48)
    try:
        assert collector.policy_device.type == "cuda"
        batches = [batch.clone() for batch in collector]
    finally:
        collector.shutdown()
    assert_batches_equal(batches, _collect(n_batches=2))


def test_storing_device_cuda_delivers_every_batch_on_the_gpu():
    batches = _collect(policy_device="cuda", storing_device="cuda")
    assert all(b.device.type == "cuda" and b["next", "observation"].is_cuda for b in batches)
    assert_batches_equal(batches, _collect())


def test_weights_pushed_from_a_gpu_learner_reach_the_acting_copy_with_a_new_version():
    learner = _actor().cuda()
    collector = ThreadedCollector(mock_envs(4), learner, frames_per_batch=24, total_frames=-1, on_policy=False,
                                  track_policy_version=True)
    try:
        batches = iter(collector)
        first = next(batches)
        assert first["action"].any()  # scale 1: the parity of episode + t, both actions occur
        with torch.no_grad():
            learner.module.scale.zero_()  # scale 0: action 0 for every observation
        version = collector.policy_version
        collector.update_policy_weights_(learner)
        assert collector.policy_version == version + 1
        later = next(batches)
        fresh = later["policy_version"] == collector.policy_version
        assert fresh.any() and not later["action"][fresh].any()
    finally:
        collector.shutdown()


def test_worker_processes_step_envs_for_a_gpu_policy_in_the_main_process():
    kwargs = dict(num_envs=4, envs_per_thread=2, seed=3, lookahead=False)
    with MultiEnvLoop(count_envs(4), _actor().cuda(), num_workers=2, **kwargs) as remote:
        assert remote.num_workers == 2
        ours = [remote.run_env_steps(12), remote.run_env_steps(12)]
    with MultiEnvLoop(count_envs(4), _actor(), **kwargs) as local:
        reference = [local.run_env_steps(12), local.run_env_steps(12)]
    assert_batches_equal(ours, reference)


def test_env_device_cuda_without_storing_device_delivers_batches_there_as_torchrl_does():
    batches = _collect(env_device="cuda")  # TorchRL's collectors leave the data on the env's device, device None
    assert all(b.device is None and all(t.is_cuda for t in b.values(True, True)) for b in batches)
    assert_batches_equal(batches, _collect())
