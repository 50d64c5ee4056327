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


def _ppo_batch(model, n: int = 32):  # noqa: ANN001, ANN202
    """``n`` steps of one env acted by ``model.actor``, observations far from the normaliser's initial mean 0 and
    variance 1."""
    import torch
    from tensordict import TensorDict

    obs = torch.randn(n + 1, 3) * 3.0 + 5.0
    with torch.no_grad():
        batch = model.actor(TensorDict({"observation": obs[:-1]}, [n]))
    batch["next"] = TensorDict({"observation": obs[1:], "reward": torch.randn(n, 1),
                                "done": torch.zeros(n, 1, dtype=torch.bool),
                                "terminated": torch.zeros(n, 1, dtype=torch.bool)}, [n])
    return batch


@pytest.mark.parametrize("learner", ["plain", "torchrl"])
def test_ppo_mujoco_first_minibatch_sees_the_observations_normalised_as_the_actor_saw_them(learner: str) -> None:
    """The PPO ratio starts at exactly 1: the learner's first minibatch reads each observation through the
    normaliser as it was when the actor acted. With one minibatch of the whole batch, a ratio of 1 makes the
    clipped objective minus the mean of the standardised advantages: 0. The normaliser moves after the epochs,
    so the next batch is acted, and learned from, with the new statistics."""
    import torch

    ppo_mujoco = _ppo_mujoco()
    torch.manual_seed(0)
    cfg = ppo_mujoco.Config(steps_per_env=32, minibatch_size=32, epochs=1, hidden=16, learner=learner)
    model = ppo_mujoco.PPO(3, 2, cfg)
    batch = _ppo_batch(model)
    losses = model.learn(batch, model.configure_optimizers())
    assert abs(losses["loss_objective"].item()) < 1e-6
    assert torch.allclose(model.obs_norm.mean, batch["observation"].mean(0), atol=1e-2)  # moved after the update
    assert model.updates_done == 1


def test_ppo_mujoco_plain_learners_losses_are_torchrls_clip_ppo_loss_on_the_same_minibatch() -> None:
    """The plain update is TorchRL's algorithm: on one minibatch, with the same weights and a behaviour policy away
    from the current one (some ratios clipped), its clipped objective and value loss are ``ClipPPOLoss``'s."""
    import torch

    ppo_mujoco = _ppo_mujoco()
    torch.manual_seed(0)
    cfg = ppo_mujoco.Config(hidden=16, learner="torchrl")
    model = ppo_mujoco.PPO(3, 2, cfg)
    data = _ppo_batch(model, n=64)
    data["action_log_prob"] = data["action_log_prob"] + 0.3 * torch.randn(64)  # ratios away from 1
    data["advantage"], data["value_target"] = torch.randn(64, 1), torch.randn(64, 1)
    theirs = model.learner.loss(data)
    plain = ppo_mujoco.PlainPPO(model.policy, model.value, cfg)
    ours = plain.loss(model.obs_norm(data["observation"]), data["action"], data["action_log_prob"],
                      data["advantage"].squeeze(-1), data["value_target"].squeeze(-1))
    assert torch.allclose(ours["loss_objective"], theirs["loss_objective"], rtol=1e-4, atol=1e-6)
    assert torch.allclose(cfg.value_coef * ours["loss_critic"], theirs["loss_critic"], rtol=1e-4)


def test_ppo_mujoco_actor_samples_squashed_gaussian_actions_and_acts_by_the_mean_when_deterministic() -> None:
    """The collector's actor: random actions inside (-1, 1) whose ``action_log_prob`` is TorchRL's ``TanhNormal``
    log-density of them; under TorchRL's deterministic exploration type (evaluation), ``tanh`` of the mean."""
    import torch
    from tensordict import TensorDict
    from torchrl.envs.utils import ExplorationType, set_exploration_type
    from torchrl.modules import TanhNormal

    ppo_mujoco = _ppo_mujoco()
    torch.manual_seed(0)
    model = ppo_mujoco.PPO(3, 2, ppo_mujoco.Config(hidden=16, log_std_init=0.0))
    obs = TensorDict({"observation": torch.randn(1000, 3, dtype=torch.float64)}, [1000])
    with torch.no_grad():
        out = model.actor(obs.clone())
        loc = model.policy(obs["observation"])
        expected = TanhNormal(loc, model.policy.log_std.exp().expand_as(loc)).log_prob(out["action"])
        with set_exploration_type(ExplorationType.DETERMINISTIC):
            deterministic = model.actor(obs.clone())["action"]
    assert out["action"].abs().max() < 1 and out["action"].std() > 0.3
    assert torch.allclose(out["action_log_prob"], expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(deterministic, loc.tanh().clamp(-1 + 1e-6, 1 - 1e-6))


@pytest.mark.parametrize("learner", ["plain", "torchrl"])
def test_ppo_mujoco_example_trains_on_halfcheetah_and_evaluates(learner: str, tmp_path: Path) -> None:
    pytest.importorskip("mujoco", reason="the MuJoCo example needs gymnasium[mujoco] (the e2e extra)")
    result = run_example("ppo_mujoco.py", "--frames", "2048", "--steps-per-env", "512", "--epochs", "1",
                         "--learner", learner, "--eval-every-frames", "1024", "--eval-episodes", "1",
                         "--out", str(tmp_path))
    assert result["frames"] == 2048 and [f for f, _ in result["eval_history"]] == [1024, 2048]


def test_sac_mujoco_example_fills_its_replay_buffer_and_takes_the_gradient_steps_due(tmp_path: Path) -> None:
    """Off-policy on HalfCheetah: 500 random frames, then one gradient step a frame (UTD 1), evaluated twice."""
    pytest.importorskip("mujoco", reason="the MuJoCo example needs gymnasium[mujoco] (the e2e extra)")
    result = run_example("sac_mujoco.py", "--frames", "1000", "--frames-per-batch", "250", "--learning-starts", "500",
                         "--batch-size", "32", "--eval-every-frames", "500", "--eval-episodes", "1",
                         "--out", str(tmp_path))
    assert result["frames"] == 1000 and [f for f, _ in result["eval_history"]] == [500, 1000]
    assert list(Path(result["log_dir"]).glob("events.out.tfevents.*"))


def _sac_mujoco():
    sys.path.insert(0, str(EXAMPLES))
    import sac_mujoco

    return sac_mujoco


@pytest.mark.parametrize("learner", ["plain", "torchrl"])
def test_sac_mujoco_learner_takes_utd_times_the_frames_past_learning_starts_in_gradient_steps(learner: str) -> None:
    """The UTD bookkeeping, without an env: batches of 100 frames, 250 random frames, UTD 0.5."""
    import torch
    from tensordict import TensorDict

    sac_mujoco = _sac_mujoco()
    cfg = sac_mujoco.Config(frames=1000, utd=0.5, learning_starts=250, batch_size=8, hidden=16, learner=learner)
    model = sac_mujoco.SAC(3, 2, cfg)
    optimizer = model.configure_optimizers()
    steps, n = [], 100
    for _ in range(5):
        batch = TensorDict({"observation": torch.randn(n, 3, dtype=torch.float64), "action": torch.rand(n, 2) * 2 - 1,
                            "extra": torch.zeros(n),
                            "next": {"observation": torch.randn(n, 3, dtype=torch.float64),
                                     "reward": torch.randn(n, 1), "done": torch.zeros(n, 1, dtype=torch.bool),
                                     "terminated": torch.zeros(n, 1, dtype=torch.bool)}}, [n])
        losses = model.learn(batch, optimizer)
        steps.append(model.updates_done)
        assert (losses is None) == (model.updates_done == 0)
    assert steps == [0, 0, 25, 75, 125]  # 0.5 * (frames - 250) after 100, 200, ..., 500 frames
    assert len(model.buffer) == 500 and "extra" not in model.buffer[:1].keys()  # only what the loss reads


def test_sac_mujoco_plain_step_trains_critics_on_the_td_target_and_the_actor_through_fixed_critics() -> None:
    """One backward of the summed losses is SAC's three updates: the critics' loss reaches the critics only
    (the target is computed without gradient), the actor's the policy only (the critics read detached), the
    entropy coefficient's ``log_alpha`` only; the targets move by ``tau`` towards the critics after the step."""
    import torch

    sac_mujoco = _sac_mujoco()
    torch.manual_seed(0)
    cfg = sac_mujoco.Config(hidden=16, tau=0.5)
    model = sac_mujoco.SAC(3, 2, cfg)
    learner, n = model.learner, 8
    obs, next_obs = torch.randn(n, 3, dtype=torch.float64), torch.randn(n, 3, dtype=torch.float64)
    losses = learner.loss(obs, torch.rand(n, 2) * 2 - 1, torch.randn(n), next_obs, torch.zeros(n, dtype=torch.bool))
    grads = {}
    for name in ("loss_qvalue", "loss_actor"):
        model.zero_grad()
        losses[name].backward(retain_graph=True)
        grads[name] = {part: any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters())
                       for part, module in (("policy", model.policy), ("critics", learner.critics))}
    assert grads == {"loss_qvalue": {"policy": False, "critics": True},
                     "loss_actor": {"policy": True, "critics": False}}
    before = [p.clone() for p in learner.target_critics.parameters()]
    learner.step(_sac_minibatch(n), model.configure_optimizers(), torch.Tensor.backward)
    for old, target, online in zip(before, learner.target_critics.parameters(), learner.critics.parameters()):
        assert torch.allclose(target, old + 0.5 * (online - old))


def _sac_minibatch(n: int):  # noqa: ANN202
    import torch
    from tensordict import TensorDict

    return TensorDict({"observation": torch.randn(n, 3, dtype=torch.float64), "action": torch.rand(n, 2) * 2 - 1,
                       "next": {"observation": torch.randn(n, 3, dtype=torch.float64), "reward": torch.randn(n, 1),
                                "terminated": torch.zeros(n, 1, dtype=torch.bool)}}, [n])


def test_sac_mujoco_policy_samples_score_as_torchrls_tanh_normal() -> None:
    """The plain learner's log-density of its own squashed samples is ``TanhNormal``'s of the same actions."""
    import torch
    from torchrl.modules import TanhNormal

    sac_mujoco = _sac_mujoco()
    torch.manual_seed(0)
    policy = sac_mujoco.GaussianPolicy(3, 2, 16)
    obs = torch.randn(1000, 3)
    with torch.no_grad():
        action, log_prob = policy.sample(obs)
        loc, log_std = policy(obs)
        expected = TanhNormal(loc, log_std.exp()).log_prob(action)
    assert torch.allclose(log_prob, expected, rtol=1e-3, atol=1e-3)


# The MuJoCo bars (make test-slow where MuJoCo is installed): a deterministic evaluation return reached within a
# budget, for 2 of 3 seeds, each run stopping at its bar. Picked from one measured seed: PPO's seed 0 evaluated 1,497
# at 40,960 frames, 1,625 at 51,200 and 2,666 at 102,400 (565 s for the 102,400); SAC's seed 0 -229 at 20,000 frames,
# 1,266 at 25,000 and 2,377 at 30,000 (539 s). About 10-15 minutes for PPO's test, 20-35 for SAC's.
PPO_MUJOCO_BAR, PPO_MUJOCO_FRAMES = 1500.0, 102_400
SAC_MUJOCO_BAR, SAC_MUJOCO_FRAMES = 1500.0, 40_000


def _runs_to_bar(example: str, *, bar: float, frames: int, eval_every: int, tmp_path: Path,
                 timeout: float) -> list[dict]:
    """Seeds 0, 1, 2 of ``example`` (stopping at the first evaluation above ``bar``) until two reach it or all ran."""
    results: list[dict] = []
    for seed in (0, 1, 2):
        results.append(run_example(example, "--frames", str(frames), "--eval-every-frames", str(eval_every),
                                   "--target-return", str(bar), "--seed", str(seed),
                                   "--out", str(tmp_path / f"seed{seed}"), timeout=timeout))
        if sum(r["best_eval_return"] >= bar for r in results) >= 2:
            break
    return results


@pytest.mark.slow
def test_ppo_mujoco_reaches_its_bar_for_two_of_three_seeds(tmp_path: Path) -> None:
    """PPO on HalfCheetah-v5 (RL Zoo's hyperparameters): deterministic evaluation return >= PPO_MUJOCO_BAR within
    PPO_MUJOCO_FRAMES frames, for 2 of seeds 0, 1, 2."""
    pytest.importorskip("mujoco", reason="the MuJoCo example needs gymnasium[mujoco] (the e2e extra)")
    results = _runs_to_bar("ppo_mujoco.py", bar=PPO_MUJOCO_BAR, frames=PPO_MUJOCO_FRAMES, eval_every=10_240,
                           tmp_path=tmp_path, timeout=3600)
    assert sum(r["best_eval_return"] >= PPO_MUJOCO_BAR for r in results) >= 2, [r["eval_history"] for r in results]


@pytest.mark.slow
def test_sac_mujoco_reaches_its_bar_for_two_of_three_seeds(tmp_path: Path) -> None:
    """SAC on HalfCheetah-v5 (RL Zoo's hyperparameters, UTD 1): deterministic evaluation return >= SAC_MUJOCO_BAR
    within SAC_MUJOCO_FRAMES frames, for 2 of seeds 0, 1, 2."""
    pytest.importorskip("mujoco", reason="the MuJoCo example needs gymnasium[mujoco] (the e2e extra)")
    results = _runs_to_bar("sac_mujoco.py", bar=SAC_MUJOCO_BAR, frames=SAC_MUJOCO_FRAMES, eval_every=5_000,
                           tmp_path=tmp_path, timeout=3600)
    assert sum(r["best_eval_return"] >= SAC_MUJOCO_BAR for r in results) >= 2, [r["eval_history"] for r in results]
