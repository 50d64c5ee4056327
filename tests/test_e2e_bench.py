"""The end-to-end bench (``benchmarks/e2e``): its pure parts (run plan, tables, ratios, targets, evaluation
schedule) without MuJoCo or Stable-Baselines3, and a smoke run of the whole pipeline where both are installed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.e2e.cli import BUDGETS, plan
from benchmarks.e2e.common import CONTENDERS, LEARNER_ONLY, Evaluations, RunSpec
from benchmarks.e2e.contenders import utd_schedule
from benchmarks.e2e.report import compare, evaluate_targets, markdown, stats, summarize, write_report

ROOT = Path(__file__).resolve().parent.parent


def rec(algo: str, contender: str, seed: int, *, wall: float, grad_steps: int = 1000,
        returns: tuple[float, ...] = (), utd: float = 1.0, num_envs: int = 1) -> dict:
    """A run record as ``benchmarks.e2e.common.record`` writes it (evaluations every 100 frames)."""
    frames = 100 * max(len(returns), 1)
    return {"algo": algo, "contender": contender, "seed": seed, "utd": utd, "num_envs": num_envs, "frames": frames,
            "grad_steps": grad_steps, "wall_s": wall, "frames_per_s": frames / wall,
            "grad_steps_per_s": grad_steps / wall, "eval_s": 1.0,
            "eval": [{"frames": 100 * (i + 1), "at_frames": 100 * (i + 1), "return": r, "returns": [r]}
                     for i, r in enumerate(returns)],
            "config": {"env": "HalfCheetah-v5", "eval_every_frames": 100, "eval_episodes": 1}}


def sac_records() -> list[dict]:
    """Two seeds of every SAC contender, the learner-only runs with seed 0, and one failed run."""
    out = []
    for seed, (fit, loop) in enumerate([(108.0, 100.0), (129.6, 120.0)]):
        out += [rec("sac", "ours", seed, wall=fit, returns=(1.0, 10.0 + seed)),
                rec("sac", "ours-loop", seed, wall=loop, returns=(1.0, 12.0)),
                rec("sac", "torchrl", seed, wall=150.0, returns=(2.0, 9.0)),
                rec("sac", "sb3", seed, wall=200.0 + 40 * seed, returns=(1.0, 9.0 + 4 * seed))]
    out += [rec("sac", "ours-learner", 0, wall=100.0), rec("sac", "sb3-learner", 0, wall=150.0),
            {"algo": "sac", "contender": "torchrl", "seed": 2, "utd": 1.0, "error": "exit 1: boom"}]
    return out


def test_stats_are_mean_min_max_of_the_values_present() -> None:
    assert stats([1.0, None, 3.0]) == {"mean": 2.0, "min": 1.0, "max": 3.0, "n": 2}
    assert stats([None]) is None


def test_summarize_groups_runs_by_algorithm_and_utd_with_spreads_over_seeds() -> None:
    records = sac_records() + [rec("sac", "ours", 0, wall=55.0, returns=(3.0,), utd=0.5)]
    tables = summarize(records)
    assert [(t["algo"], t["utd"]) for t in tables] == [("sac", 1.0), ("sac", 0.5)]
    rows = {r["contender"]: r for r in tables[0]["rows"]}
    assert list(rows) == [c for c in CONTENDERS + LEARNER_ONLY if c != "sb3-subproc"]  # the report's order
    assert rows["ours"]["seeds"] == [0, 1]
    assert rows["ours"]["wall_s"] == {"mean": pytest.approx(118.8), "min": 108.0, "max": 129.6, "n": 2}
    assert rows["ours"]["returns"][200] == {"mean": 10.5, "min": 10.0, "max": 11.0, "n": 2}
    assert rows["sb3"]["final_return"]["min"] == 9.0 and rows["sb3"]["final_return"]["max"] == 13.0
    assert rows["torchrl"]["seeds"] == [0, 1] and rows["torchrl"]["errors"] == ["seed 2: exit 1: boom"]
    assert rows["ours-learner"]["returns"] == {} and rows["ours-learner"]["final_return"] is None


def test_compare_pairs_seeds_for_lightning_overhead_and_divides_mean_wall_times_over_the_seeds_both_ran() -> None:
    records = sac_records() + [rec("sac", "sb3", 3, wall=999.0)]  # ours has no seed 3: left out of the ratio
    ratios = compare(summarize(records)[0], records)
    assert ratios["lightning_overhead"] == pytest.approx(0.08)  # 108/100 and 129.6/120: both +8%
    assert ratios["lightning_us_per_step"] == pytest.approx((8.0 + 9.6) / 2 / 1000 * 1e6)
    assert ratios["speedup_vs_sb3"] == pytest.approx(220.0 / 118.8)
    assert ratios["speedup_vs_torchrl"] == pytest.approx(150.0 / 118.8)
    assert ratios["overlap"] == pytest.approx(1.08) and ratios["overlap_loop"] == pytest.approx(1.0)  # seed 0's
    assert ratios["learner_speedup_vs_sb3"] == pytest.approx(1.5)
    assert ratios["learning"] == {"ours_mean": 10.5, "sb3_min": 9.0, "sb3_max": 13.0, "sb3_mean": 11.0,
                                  "below": []}



def test_targets_pass_and_miss_on_the_issues_thresholds() -> None:
    records = sac_records()
    next(r for r in records if r["contender"] == "ours-learner")["wall_s"] = 90.0
    verdicts = {t["label"]: t["passed"] for t in evaluate_targets("sac", compare(summarize(records)[0], records))}
    assert verdicts == {
        "learning: ours' mean return within or above SB3's seed range at every evaluation": True,  # 10.5 >= 9
        "wall time: Stable-Baselines3 / ours": True,                                  # 1.85 >= 1.0
        "learner alone: Stable-Baselines3 / ours": True,                              # 150 / 90 >= 1.0
        "whole run / learner only (ours)": False,                                     # seed 0: 108 / 90 = 1.2 > 1.15
        "Lightning's overhead: `Trainer.fit` / the loop by hand - 1": True,           # 8% <= 10%
    }
    ppo = [rec("ppo", "ours", 0, wall=100.0, returns=(3.0, 5.0)), rec("ppo", "sb3", 0, wall=90.0, returns=(4.0, 4.0))]
    ratios = compare(summarize(ppo)[0], ppo)
    assert ratios["learning"]["below"] == [100]  # 3 < SB3's 4 at the first evaluation, above it at the last
    by_label = {t["label"]: t for t in evaluate_targets("ppo", ratios)}
    assert by_label["wall time: Stable-Baselines3 / ours"]["passed"] is False  # 0.9 < 1.0
    learning = "learning: ours' mean return within or above SB3's seed range at every evaluation"
    assert by_label[learning]["passed"] is False
    assert by_label["wall time: the TorchRL `Collector` control / ours"]["passed"] is None  # not run
    assert by_label["Lightning's overhead: `Trainer.fit` / the loop by hand - 1"]["value"] is None


def test_several_envs_get_their_own_table_and_are_measured_against_sb3s_faster_vec_env() -> None:
    """PPO with 8 envs: its own table (not merged with 1 env's), and the target is 1.3x the faster of SB3's
    DummyVecEnv and SubprocVecEnv: here 1.2x (SubprocVecEnv), a miss though DummyVecEnv's 1.4x would pass."""
    records = [rec("ppo", "ours", 0, wall=50.0, returns=(5.0,)), rec("ppo", "sb3", 0, wall=60.0, returns=(5.0,)),
               rec("ppo", "ours", 0, wall=100.0, returns=(5.0,), num_envs=8),
               rec("ppo", "sb3", 0, wall=140.0, returns=(5.0,), num_envs=8),
               rec("ppo", "sb3-subproc", 0, wall=120.0, returns=(5.0,), num_envs=8)]
    tables = summarize(records)
    assert [(t["algo"], t["num_envs"]) for t in tables] == [("ppo", 1), ("ppo", 8)]
    ratios = compare(tables[1], records)
    assert ratios["speedup_vs_sb3"] == pytest.approx(1.2) and ratios["speedup_vs_sb3_subproc"] == pytest.approx(1.2)
    target = next(t for t in evaluate_targets("ppo", ratios, num_envs=8) if t["label"].startswith("wall time: Stable"))
    assert target["goal"] == "≥ 1.3x" and target["passed"] is False
    assert compare(tables[0], records)["speedup_vs_sb3"] == pytest.approx(1.2)  # 1 env: 60 / 50, its own runs
    assert "## PPO on HalfCheetah-v5, 8 envs" in markdown({"records": records})


def test_markdown_has_one_parseable_table_per_section_and_flags_quick_runs(tmp_path: Path) -> None:
    report = {"mode": "quick", "command": "python -m benchmarks.e2e --quick", "machine": {"cores": 2},
              "records": sac_records()}
    text = markdown(report)
    assert "**Quick run**" in text and "## SAC on HalfCheetah-v5, 1 env, UTD 1" in text
    assert "| lightning_rollout: `Trainer.fit` + `RolloutDataModule` (the example) | 0,1 | 1 | 10 (10 to 11) |" in text
    assert "Failed runs: torchrl seed 2: exit 1: boom" in text
    for block in text.split("\n\n"):  # every table: a header, a rule, rows of the header's width
        rows = [ln for ln in block.splitlines() if ln.startswith("|")]
        if rows:
            assert len({ln.count(" | ") for ln in rows}) == 1, block
    paths = write_report(report, str(tmp_path), plot=False)
    written = json.loads(Path(paths["json"]).read_text())
    assert written["records"] == report["records"] and written["tables"][0]["targets"]
    assert Path(paths["table"]).read_text() == text


def test_plan_interleaves_contenders_and_runs_learner_only_once() -> None:
    specs = plan(algos=["ppo", "sac"], seeds=[0, 1], contenders=list(CONTENDERS), learner_only=list(LEARNER_ONLY),
                 budgets=BUDGETS["full"], sac_utds=[1.0, 0.5], eval_max_steps=None, ppo_num_envs=[1, 8])
    one_env = [c for c in CONTENDERS if c != "sb3-subproc"]  # SubprocVecEnv only with several envs
    ppo = [(s.contender, s.seed) for s in specs if s.algo == "ppo" and s.key[4] == 1]
    assert ppo == ([(c, 0) for c in one_env] + [(c, 0) for c in LEARNER_ONLY]
                   + [(c, 1) for c in reversed(one_env)])
    eight = [s for s in specs if s.algo == "ppo" and s.key[4] == 8]
    assert [(s.contender, s.seed) for s in eight] == [(c, 0) for c in CONTENDERS] + [(c, 1) for c in CONTENDERS[::-1]]
    assert {(s.overrides["num_envs"], s.overrides["steps_per_env"]) for s in eight} == {(8, 64)}  # 512 a batch
    assert sorted({s.key[3] for s in specs if s.algo == "sac"}) == [0.5, 1.0]
    assert len({s.key for s in specs}) == len(specs)
    assert RunSpec.from_json(specs[-1].to_json()) == specs[-1]
    with pytest.raises(ValueError, match="contender"):
        RunSpec("ppo", "cleanrl", 0)


def test_full_budgets_evaluate_at_whole_batches_of_the_examples() -> None:
    """Each evaluation point is a whole number of batches (PPO: 512 frames, SAC: 250), so every contender
    evaluates after the same frames."""
    for algo, batch in (("ppo", 512), ("sac", 250)):
        budget = BUDGETS["full"][algo]
        assert budget["eval_every_frames"] % batch == 0 and budget["frames"] % budget["eval_every_frames"] == 0


def test_utd_schedule_is_stable_baselines3s_train_freq_and_gradient_steps() -> None:
    assert utd_schedule(1.0) == (1, 1)
    assert utd_schedule(0.5) == (2, 1)
    assert utd_schedule(2.0) == (1, 2)
    with pytest.raises(ValueError):
        utd_schedule(0.0)


def test_evaluations_run_once_per_point_reached_and_keep_their_time_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_episodes(act, *, env_id, episodes, seed, max_steps):  # noqa: ANN001, ANN202
        calls.append((env_id, episodes, seed, max_steps))
        return [float(act(np.zeros(1))), 2.0]

    monkeypatch.setattr("benchmarks.e2e.common.run_episodes", fake_episodes)
    evals = Evaluations(env_id="X-v0", frames=1000, every=250, episodes=2, seed=3, max_steps=7)
    for frames in range(100, 1001, 100):
        evals.maybe(frames, lambda: (lambda obs: 4.0))
    assert [e["frames"] for e in evals.history] == [250, 500, 750, 1000]
    assert [e["at_frames"] for e in evals.history] == [300, 500, 800, 1000]
    assert evals.history[0]["return"] == 3.0 and evals.seconds >= 0.0
    assert calls == [("X-v0", 2, 1_003_000, 7)] * 4  # the same episodes (seeds) at every point


def test_quick_bench_runs_the_whole_pipeline(tmp_path: Path) -> None:
    pytest.importorskip("mujoco", reason="the end-to-end bench needs the e2e extra (gymnasium[mujoco])")
    pytest.importorskip("stable_baselines3", reason="the end-to-end bench needs the e2e extra (stable-baselines3)")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.e2e", "--quick", "--algo", "sac", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    assert {r["contender"] for r in report["records"]} == set(CONTENDERS + LEARNER_ONLY) - {"sb3-subproc"}  # 1 env
    assert all(r["cpu_s"] > 0 for r in report["records"])
    assert not [r for r in report["records"] if r.get("error")]
    assert all(len(r["eval"]) == 2 for r in report["records"] if r["contender"] in CONTENDERS)
    assert "## SAC on HalfCheetah-v5" in (tmp_path / "table.md").read_text()


@pytest.mark.parametrize("algo, overrides", [("ppo", {"steps_per_env": 64, "epochs": 1}),
                                              ("sac", {"frames_per_batch": 32, "batch_size": 16})])
def test_lightning_step_times_both_ways_of_stepping_on_every_round_after_the_warm_up(algo: str, overrides: dict
                                                                                    ) -> None:
    import logging

    from benchmarks.e2e.lightning_step import measure

    level = logging.getLogger("lightning.pytorch").level
    result = measure(algo, rounds=2, overrides={"env": "Pendulum-v1", **overrides})
    assert logging.getLogger("lightning.pytorch").level == level  # this process's logging is left as it was
    assert result["rounds"] == 2
    assert all(len(result["times"][way]) == 2 and min(result["times"][way]) > 0 for way in ("lightning", "plain"))
    ratios = sorted(a / b - 1 for a, b in zip(result["times"]["lightning"], result["times"]["plain"]))
    assert result["overhead"] == pytest.approx(sum(ratios) / 2)  # the median of two rounds


def test_a_resumed_run_keeps_the_command_that_made_the_runs_it_keeps(tmp_path: Path) -> None:
    from benchmarks.e2e.cli import main

    first = "python -m benchmarks.e2e --algo ppo --ppo-num-envs 8 --seeds 0 --contender ours"
    (tmp_path / "results.json").write_text(json.dumps({"command": first, "records": [rec("ppo", "ours", 0, wall=9.0)]}))
    argv = ["--algo", "ppo", "--ppo-num-envs", "1", "--seeds", "0", "--contender", "ours", "--out", str(tmp_path),
            "--resume"]
    report = main(argv)  # the one run planned is in the file already: nothing runs
    assert report["command"] == f"{first}; then python -m benchmarks.e2e {' '.join(argv)}"
    assert json.loads((tmp_path / "results.json").read_text())["command"] == report["command"]
    assert [r["wall_s"] for r in report["records"]] == [9.0]
