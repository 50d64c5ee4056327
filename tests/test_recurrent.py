"""Recurrent PPO (``examples/ppo_lstm_cartpole.py``): an LSTM policy on CartPole with the velocities hidden.

The collector carries the LSTM's state (what the policy writes under ``"next"`` comes back
at the env's next step, zero at each episode start), so replaying a ``[num_envs, T]``
batch in TorchRL's recurrent mode reproduces, row by row, the log-probabilities the
policy had when it acted, across episode boundaries and from one batch to the next. The
example runs end to end (smoke), reaches CartPole's 475 bar within 500k frames (slow),
and the same network without the LSTM does not (slow, the control).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torchrl.envs.utils import ExplorationType
from torchrl.modules import set_recurrent_mode

from lightning_rollout import ThreadedCollector

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import ppo_lstm_cartpole  # noqa: E402
from test_examples import run_example  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_the_env_hides_the_velocities():
    env = ppo_lstm_cartpole.make_env()
    observation, _ = env.reset(seed=0)
    full = env.unwrapped.state
    assert observation.shape == (2,) and env.observation_space.shape == (2,)
    torch.testing.assert_close(torch.as_tensor(observation), torch.as_tensor(full[[0, 2]] / env.SCALE).float())
    env.close()


def test_replaying_batches_in_recurrent_mode_gives_the_log_probs_the_policy_acted_with():
    torch.manual_seed(0)
    actor, critic = ppo_lstm_cartpole.make_networks(obs_dim=2, n_actions=2, hidden=16, memory="lstm")
    collector = ThreadedCollector(ppo_lstm_cartpole.make_env, actor, frames_per_batch=4 * 48, total_frames=2 * 4 * 48,
                                  num_envs=4, envs_per_thread=2, num_workers=1, seed=0)
    batches = list(collector)
    collector.shutdown()
    for batch in batches:
        h, next_h = batch["recurrent_state_h"], batch["next", "recurrent_state_h"]
        init, done = batch["is_init"].squeeze(-1), batch["next", "done"].squeeze(-1)
        assert done.sum() >= 4, "episodes must end inside the batch"
        assert (h[init] == 0).all(), "the state is zero at each episode start"
        assert torch.equal(next_h[:, :-1][~done[:, :-1]], h[:, 1:][~done[:, :-1]]), "carried from step to step"
        with set_recurrent_mode(True), torch.no_grad():
            log_prob = actor.get_dist(batch.clone()).log_prob(batch["action"])
            critic(batch.clone())  # the critic replays the rows too (shared LSTM)
        torch.testing.assert_close(log_prob, batch["action_log_prob"], atol=1e-5, rtol=0)
    assert not (batches[1]["recurrent_state_h"][:, 0] == 0).all(), "the state carries over into the next batch"


def test_the_memoryless_control_is_the_same_network_without_the_lstm():
    lstm_actor, _ = ppo_lstm_cartpole.make_networks(obs_dim=2, n_actions=2, hidden=16, memory="lstm")
    mlp_actor, _ = ppo_lstm_cartpole.make_networks(obs_dim=2, n_actions=2, hidden=16, memory="none")
    assert "recurrent_state_h" in lstm_actor.in_keys and mlp_actor.in_keys == ["observation"]
    collector = ThreadedCollector(ppo_lstm_cartpole.make_env, mlp_actor, frames_per_batch=32, total_frames=32,
                                  num_envs=2, envs_per_thread=2, num_workers=1, seed=0,
                                  exploration_type=ExplorationType.DETERMINISTIC)
    batch = next(iter(collector))
    collector.shutdown()
    assert "recurrent_state_h" not in batch.keys() and batch["observation"].shape == (2, 16, 2)


def test_lstm_example_trains_through_trainer_fit(tmp_path: Path) -> None:
    result = run_example("ppo_lstm_cartpole.py", "--frames", "2048", "--num-envs", "4", "--steps-per-env", "16",
                         "--epochs", "2", "--eval-every-frames", "1024", "--eval-episodes", "2", "--out", str(tmp_path))
    assert result["frames"] == 2048 and result["memory"] == "lstm"
    assert len(result["eval_history"]) == 2
    assert list(Path(result["log_dir"]).glob("events.out.tfevents.*"))


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lstm_ppo_reaches_the_475_bar_on_partially_observed_cartpole_within_500k_frames(seed: int,
                                                                                       tmp_path: Path) -> None:
    """The issue's bar: evaluation return >= 475 within 500k frames (2 of 3 seeds required; one test per seed)."""
    result = run_example("ppo_lstm_cartpole.py", "--frames", "500000", "--seed", str(seed), "--out", str(tmp_path),
                         timeout=3000)
    assert result["best_eval_return"] >= 475, result


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_memoryless_control_stays_below_the_bar(tmp_path: Path) -> None:
    """Without the LSTM, the same network, budget and hyperparameters never reach 475 (seed 0)."""
    result = run_example("ppo_lstm_cartpole.py", "--memory", "none", "--frames", "500000", "--seed", "0",
                         "--out", str(tmp_path), timeout=3000)
    assert result["frames"] >= 499_000 and result["best_eval_return"] < 475, result
