"""The examples run end to end (smoke runs on tiny budgets), and PPO really learns (slow).

Each example runs in its own interpreter, as a user runs it, and must exit 0,
print its ``RESULT {json}`` line and write its logs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run_example(name: str, *args: str, timeout: float = 300) -> dict | list:
    """Run ``examples/<name>`` with ``args``; return its parsed ``RESULT`` line."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"{name} printed no RESULT line:\n{proc.stdout[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_ppo_example_trains_logs_and_draws_a_learning_curve(tmp_path: Path) -> None:
    result = run_example("ppo_cartpole.py", "--demo", "--frames", "4096", "--num-envs", "4", "--envs-per-thread", "2",
                         "--steps-per-env", "64", "--eval-every-frames", "1024", "--eval-episodes", "2",
                         "--out", str(tmp_path))
    assert result["frames"] == 4096
    assert len(result["eval_history"]) >= 1
    log_dir = Path(result["log_dir"])
    assert list(log_dir.glob("events.out.tfevents.*")), "no TensorBoard event file"
    assert Path(result["learning_curve"]).stat().st_size > 0
    assert result["best_checkpoint"] and Path(result["best_checkpoint"]).exists()


def test_ppo_example_run_again_in_the_same_folder_summarizes_only_its_own_run(tmp_path: Path) -> None:
    args = ("--demo", "--frames", "2048", "--num-envs", "4", "--envs-per-thread", "4", "--steps-per-env", "64",
            "--eval-every-frames", "1024", "--eval-episodes", "1", "--out", str(tmp_path))
    first = run_example("ppo_cartpole.py", *args)
    second = run_example("ppo_cartpole.py", *args)
    assert first["log_dir"] == second["log_dir"]  # the same seed folder: the first run's event file is still there
    assert len(list(Path(second["log_dir"]).glob("events.out.tfevents.*"))) == 2
    assert [f for f, _ in second["eval_history"]] == [f for f, _ in first["eval_history"]] == [1024, 2048]


def test_dqn_example_fills_a_replay_buffer_and_learns_a_few_steps(tmp_path: Path) -> None:
    result = run_example("dqn_cartpole.py", "--frames", "2048", "--frames-per-batch", "128", "--updates-per-batch",
                         "8", "--num-envs", "4", "--envs-per-thread", "2", "--learning-starts", "512",
                         "--eval-every-frames", "1024", "--eval-episodes", "2", "--out", str(tmp_path))
    assert result["frames"] == 2048
    assert result["eval_history"], "no evaluation ran"
    assert list(Path(result["log_dir"]).glob("events.out.tfevents.*"))


def test_torchrl_swap_runs_both_collectors_in_the_same_training_loop() -> None:
    results = run_example("torchrl_swap.py", "--collector", "both", "--frames", "2048", "--frames-per-batch", "512",
                          "--num-envs", "4")
    assert [r["collector"] for r in results] == ["torchrl", "threaded"]
    assert all(r["collect_fps"] > 0 for r in results)


def test_custom_env_example_compares_threads_with_a_sequential_vector_env() -> None:
    result = run_example("custom_env.py", "--num-envs", "4", "--latency", "0.001", "--frames", "400")
    assert result["num_envs"] == 4
    assert result["threaded_fps"] > 0 and result["sync_vector_env_fps"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ppo_reaches_cartpole_solved_bar_within_300k_frames(seed: int, tmp_path: Path) -> None:
    """The issue's bar: deterministic evaluation return >= 475 within 300k frames (2 of 3 seeds are required;
    each seed is its own test, so a report shows which ones made it)."""
    result = run_example("ppo_cartpole.py", "--frames", "300000", "--seed", str(seed), "--out", str(tmp_path),
                         timeout=1800)
    assert result["best_eval_return"] >= 475, result


def _ppo_mujoco():
    sys.path.insert(0, str(EXAMPLES))
    import ppo_mujoco

    return ppo_mujoco


def test_ppo_mujoco_running_norm_merged_a_batch_at_a_time_equals_the_moments_of_all_the_data() -> None:
    import torch

    norm = _ppo_mujoco().RunningNorm((3,))
    data = torch.randn(1000, 3, dtype=torch.float64) * torch.tensor([1.0, 5.0, 0.1], dtype=torch.float64) + 2.0
    for chunk in data.split(128):
        norm.update(chunk)
    assert torch.allclose(norm.mean, data.mean(0).float(), atol=1e-3)
    assert torch.allclose(norm.var, data.var(0, unbiased=False).float(), rtol=1e-3)
    assert norm(data).dtype == torch.float32 and norm(data * 1e6).abs().max() <= 10.0  # standardised, clipped


def test_ppo_mujoco_reward_scaling_is_stable_baselines3s_step_by_step_return_recurrence() -> None:
    """Two batches of 2 envs, episodes ending mid-batch: the running return is SB3's ``ret = ret * gamma + r``,
    zeroed after a done step and carried across batches; rewards are divided by its running std."""
    import numpy as np
    import torch

    scaler = _ppo_mujoco().ReturnScaler(2, gamma=0.9)
    rng = np.random.default_rng(0)
    ret, seen = np.zeros(2), []
    for _ in range(2):
        reward, done = rng.normal(size=(2, 7)), rng.random((2, 7)) < 0.2
        scaled = scaler(torch.tensor(reward, dtype=torch.float32), torch.tensor(done))
        for t in range(7):
            ret = ret * 0.9 + reward[:, t]
            seen.append(ret.copy())
            ret[done[:, t]] = 0.0
        std = np.sqrt(np.var(np.concatenate(seen)) * len(seen) * 2 / (len(seen) * 2 + 1e-4) + 1e-8)
        assert np.allclose(scaled.numpy(), np.clip(reward / std, -10, 10), rtol=1e-3)


def test_ppo_mujoco_example_trains_on_halfcheetah_and_evaluates(tmp_path: Path) -> None:
    pytest.importorskip("mujoco", reason="the MuJoCo example needs gymnasium[mujoco] (the bench-real extra)")
    result = run_example("ppo_mujoco.py", "--frames", "2048", "--steps-per-env", "512", "--epochs", "1",
                         "--eval-every-frames", "1024", "--eval-episodes", "1", "--out", str(tmp_path))
    assert result["frames"] == 2048 and [f for f, _ in result["eval_history"]] == [1024, 2048]
