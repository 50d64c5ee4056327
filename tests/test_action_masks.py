"""Action masks (``examples/ppo_masked_taxi.py``): PPO on Taxi with TorchRL's ``MaskedCategorical``.

Taxi's ``info["action_mask"]`` reaches the policy through ``info_keys``; no invalid
action is ever taken (counted from the batches, sampled and deterministic), an
unmasked policy on the same env does take them (the count is not vacuous), and the
example learns to Taxi's registered bar (slow).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torchrl.envs.utils import ExplorationType

from lightning_rollout import ThreadedCollector

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import ppo_masked_taxi  # noqa: E402
from test_examples import run_example  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def collect_taxi(actor, *, exploration_type: ExplorationType = ExplorationType.RANDOM):
    collector = ThreadedCollector("Taxi-v4", actor, frames_per_batch=8 * 64, total_frames=2 * 8 * 64, num_envs=8,
                                  envs_per_thread=8, num_workers=1, seed=0, info_keys=ppo_masked_taxi.INFO_KEYS,
                                  exploration_type=exploration_type)
    batches = list(collector)
    collector.shutdown()
    return batches


@pytest.mark.parametrize("exploration_type", [ExplorationType.RANDOM, ExplorationType.DETERMINISTIC])
def test_a_masked_policy_never_takes_an_invalid_action(exploration_type):
    torch.manual_seed(0)
    actor, _ = ppo_masked_taxi.make_networks(hidden=16, masked=True)
    batches = collect_taxi(actor, exploration_type=exploration_type)
    for batch in batches:
        assert batch["action_mask"].dtype == torch.bool and batch["action_mask"].shape == (8, 64, 6)
        assert (~batch["action_mask"]).any(), "Taxi masks some actions in most states"
        assert ppo_masked_taxi.invalid_actions(batch) == 0


def test_the_count_sees_invalid_actions_of_an_unmasked_policy():
    torch.manual_seed(0)
    actor, _ = ppo_masked_taxi.make_networks(hidden=16, masked=False)
    batch = collect_taxi(actor)[0]
    assert ppo_masked_taxi.invalid_actions(batch) > 100


def test_masked_example_trains_through_trainer_fit_without_invalid_actions(tmp_path: Path) -> None:
    result = run_example("ppo_masked_taxi.py", "--frames", "4096", "--num-envs", "4", "--steps-per-env", "64",
                         "--eval-every-frames", "2048", "--eval-episodes", "4", "--out", str(tmp_path))
    assert result["frames"] == result["frames_checked"] == 4096
    assert result["invalid_actions"] == 0 and result["masked"]
    assert len(result["eval_history"]) == 2


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masked_ppo_reaches_taxis_reward_threshold_with_zero_invalid_actions(seed: int, tmp_path: Path) -> None:
    """Mean evaluation return >= 8 (gymnasium's reward_threshold for Taxi; optimum 8.46) within 500k frames, and
    not one invalid action in any training batch of the run."""
    result = run_example("ppo_masked_taxi.py", "--frames", "500000", "--seed", str(seed), "--out", str(tmp_path),
                         timeout=3000)
    assert result["invalid_actions"] == 0 and result["frames_checked"] == result["frames"], result
    assert result["best_eval_return"] >= 8.0, result
