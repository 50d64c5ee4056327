"""The benchmark harness itself: a ``--quick`` run of every scenario completes and writes a
well-formed ``results.json``, ``table.md`` and ``plot.png``. No timing assertions.

Peers that start worker processes (``ParallelEnv``, ``MultiSyncCollector``,
``AsyncVectorEnv``) take seconds each just to start on 2 cores; the main test
leaves them out (``--no-processes``) and a slow test covers them on one scenario.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(out: str, *args: str, timeout: float) -> dict:
    # A subprocess: the benchmark's threads and worker processes cannot leak into the test session.
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--repeats", "1", "--out", out, *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)


def _check_report(report: dict, out: str, scenarios: list[str]) -> None:
    assert [s["name"] for s in report["scenarios"]] == scenarios
    assert report["machine"]["cores"] >= 1
    table = open(os.path.join(out, "table.md")).read()
    assert table.startswith("# lightning_rollout benchmarks")
    with open(os.path.join(out, "plot.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    for s in report["scenarios"]:
        assert f"## {s['title']}" in table
        if s.get("skipped"):
            assert "Skipped:" in table
            continue
        assert s["results"], s["name"]
        for name, r in s["results"].items():
            assert r["error"] is None, (s["name"], name, r.get("traceback"))
            assert len(r["steps_per_s"]) == 1 and r["median"] > 0
            assert sum(r["frames"]) >= s["frames"]
            assert f"| {name} |" in table
            if name.startswith("threaded") and s["name"] != "lightning":
                assert 1 <= r["stats"]["mean_flush_batch"] <= s["num_envs"]
            if s["track_memory"]:
                assert r["peak_rss_mb"] > 0
        for t in s["target_results"]:  # a target whose side was left out is "not measured"
            ours_measured = any(name in s["results"] for name in t["ours"])
            if ours_measured and (t["peer"] in s["results"] or t["peer"] in ("ideal", "num_envs")):
                assert t["passed"] in (True, False) and t["ratio"] > 0, t
            else:
                assert t["passed"] is None


def test_quick_run_of_every_scenario(tmp_path):
    """Every scenario of the default group (``make bench``); the real-env group needs the bench-real extra."""
    from benchmarks.scenarios import SCENARIOS

    out = str(tmp_path / "quick")
    report = _run(out, "--no-processes", timeout=180)
    _check_report(report, out, [name for name, s in SCENARIOS.items() if s.group == "core"])


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_policy_device_runs_every_contenders_policy_there_and_the_report_says_so(tmp_path, device):
    out = str(tmp_path / "quick")
    report = _run(out, "--scenario", "heavy_policy", "--contender", "threaded env_time",
                  "--contender", "gym SyncVectorEnv loop", "--policy-device", device, timeout=180)
    _check_report(report, out, ["heavy_policy"])
    assert report["scenarios"][0]["policy_device"] == device
    assert set(report["scenarios"][0]["results"]) == {"threaded env_time", "gym SyncVectorEnv loop"}
    table = open(os.path.join(out, "table.md")).read()
    assert (f"policy runs on `{device}`" in table) == (device != "cpu")


@pytest.mark.parametrize("device, message", [
    ("gpu0", "--policy-device 'gpu0'"),
    pytest.param("cuda", "sees no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA"))])
def test_a_policy_device_that_is_not_one_or_not_here_is_refused_before_anything_runs(tmp_path, capsys, device,
                                                                                     message):
    from benchmarks.cli import main

    threads = torch.get_num_threads()
    with pytest.raises(SystemExit) as exit_:
        main(["--quick", "--out", str(tmp_path / "no"), "--policy-device", device])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "no").exists() and torch.get_num_threads() == threads


def test_each_contender_is_reported_as_it_finishes_so_a_run_cut_short_keeps_what_it_measured(tmp_path):
    from benchmarks.cli import run_scenario
    from benchmarks.report import machine, write_all
    from benchmarks.scenarios import SCENARIOS

    seen: list[list[str]] = []

    def on_result(entry: dict) -> None:
        seen.append(list(entry["results"]))
        report = {"command": "test", "quick": True, "machine": machine(), "scenarios": [entry]}
        paths = write_all(report, str(tmp_path), plot=False)
        assert set(paths) == {"json", "table"}
        assert all(f"| {name} |" in open(paths["table"]).read() for name in entry["results"])

    entry = run_scenario(SCENARIOS["cheap"], quick=True, repeats=1, log=lambda *_: None, on_result=on_result,
                         contenders=["threaded env_time", "gym SyncVectorEnv loop"])
    assert seen == [["threaded env_time"], ["threaded env_time", "gym SyncVectorEnv loop"]]
    assert [t["passed"] for t in entry["target_results"]].count(None) < len(entry["target_results"])
    assert not (tmp_path / "plot.png").exists()


def test_interleaved_rounds_time_every_contender_once_a_round_alternating_the_order(monkeypatch):
    import benchmarks.harness as harness
    from benchmarks.cli import run_scenario
    from benchmarks.scenarios import SCENARIOS

    real_measure, timed = harness.measure, []

    def one_repetition(build, frames, repeats, **kwargs):
        timed.append(repeats)
        return real_measure(build, frames, repeats, **kwargs)

    monkeypatch.setattr(harness, "measure", one_repetition)
    names = ["threaded env_time", "gym SyncVectorEnv loop"]
    logged: list[str] = []
    entry = run_scenario(SCENARIOS["cheap"], quick=True, repeats=3, contenders=names, interleave=True,
                         log=logged.append)
    assert entry["interleaved"] and timed == [1] * 6  # one timed repetition per contender and round
    assert [line.split("] ")[1].split(":")[0] for line in logged] == [*names, *names[::-1], *names]
    for name in names:
        result = entry["results"][name]
        assert len(result["steps_per_s"]) == 3 and len(result["frames"]) == 3 and result["error"] is None
        assert result["min"] <= result["median"] <= result["max"]


def test_scaling_group_runs_its_scenarios_only(tmp_path):
    out = str(tmp_path / "quick")
    report = _run(out, "--group", "scaling", "--no-processes", timeout=240)  # 1 process, and the defaults
    _check_report(report, out, ["scaling", "scaling64"])
    for s in report["scenarios"]:
        assert set(s["results"]) == {"threaded auto (defaults)", "threaded num_workers=1"}


@pytest.mark.slow
def test_quick_run_with_process_peers(tmp_path):
    out = str(tmp_path / "quick")
    report = _run(out, "--scenario", "cheap", timeout=600)
    _check_report(report, out, ["cheap"])
    assert "torchrl Collector(ParallelEnv)" in report["scenarios"][0]["results"]


@pytest.mark.parametrize("free", [False, True], ids=["lock-step", "free"])
def test_helper_thread_ceiling_steps_every_env_and_joins_its_threads(free):
    """``python -m benchmarks.helper_threads`` (the ceiling quoted in docs/performance.rst), at a tiny size."""
    import threading

    from benchmarks.envs import SLEEP
    from benchmarks.helper_threads import run

    before = set(threading.enumerate())
    assert run(SLEEP, free=free, policy=True, num_envs=4, steps=16) > 0
    assert not [t.name for t in set(threading.enumerate()) - before if t.is_alive()]


@pytest.mark.parametrize("free", [False, True], ids=["lock-step", "free"])
def test_helper_thread_contender_counts_every_step_it_started_and_none_runs_between_runs(free):
    """The no-collector ceiling the GIL-releasing scenarios run as contenders: each run returns at least the
    frames asked, every step it started has ended and is counted when it returns (episodes end and reset
    every 2 steps here), the policy sees every env's row on each call, and the helpers run on one core (the
    owner too, during a run only)."""
    import threading

    from benchmarks.helper_threads import HelperThreads
    from process_helpers import CountEnv

    envs = [CountEnv(i, length=2) for i in range(4)]
    shapes, owners = [], []

    def policy(obs):
        shapes.append(obs.shape)
        owners.append(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set())
        return np.ones(len(obs), dtype=np.int64)

    before = set(threading.enumerate())
    session = HelperThreads(envs, policy, free=free)
    try:
        total = 0
        for frames in (10, 7):
            got = session.run(frames)
            total += got
            assert got >= frames
            if not free:
                assert got % len(envs) == 0
            assert sum(env.steps for env in envs) == total
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_setaffinity") else set()
        if len(allowed) >= 2:  # one core for the helpers and, while it runs, this thread: as the collector's
            helpers = [t for t in threading.enumerate() if t.name.startswith("bench-helper-env")]
            assert len(helpers) == 4
            assert all(os.sched_getaffinity(t.native_id) == {min(allowed)} for t in helpers)
            assert {os.sched_getscheduler(t.native_id) for t in helpers} == {os.SCHED_BATCH}
            assert set(map(frozenset, owners)) == {frozenset({min(allowed)})}
            assert os.sched_getaffinity(0) == allowed
    finally:
        session.close()
    assert set(shapes) == {(4, 3)}
    assert not [t.name for t in set(threading.enumerate()) - before if t.is_alive()]


def test_ab_table_gives_each_sides_median_their_ratio_and_the_spread_of_one_rounds_ratio():
    from benchmarks.ab import ab_table

    def round_(old: float, new_: float | None) -> dict:
        return {"cheap": {"ours": old, **({"new only": new_} if new_ is not None else {})}}

    runs = {"before": [round_(100.0, None), round_(200.0, None), round_(150.0, None)],
            "after": [round_(110.0, 5.0), round_(180.0, 6.0), round_(150.0, 7.0)]}
    table, rows = ab_table(runs, ["cheap"], before="abc123")
    assert list(table) == ["cheap / ours"]  # a contender the before revision lacks is left out
    row = table["cheap / ours"]
    assert (row["before"], row["after"]) == (150.0, 150.0)  # medians of each side over the rounds
    assert row["ratio"] == pytest.approx(1.0)
    assert (row["round_min"], row["round_max"]) == pytest.approx((0.9, 1.1))  # 180 / 200 and 110 / 100
    assert rows[0] == "## Before (abc123) / after (working tree), 3 interleaved rounds, medians"
    assert rows[-1] == "| cheap | ours | 150 | 150 | 1.00x | 0.90x-1.10x |"


def test_ab_reads_the_scenarios_a_tree_defines_and_none_for_a_tree_without_the_suite(tmp_path):
    from pathlib import Path

    from benchmarks.ab import scenario_names
    from benchmarks.scenarios import SCENARIOS

    assert scenario_names(Path(ROOT)) == set(SCENARIOS)
    assert scenario_names(tmp_path) is None  # e.g. a revision older than benchmarks/scenarios.py


def test_every_layout_of_ours_in_a_scenario_is_one_the_knobs_allow():
    """The quick run leaves worker processes out (``--no-processes``); a process contender asking for what the
    knobs refuse (``num_workers=2, envs_per_thread=16`` over 16 envs) only failed in the recorded run."""
    from benchmarks import contenders
    from benchmarks.scenarios import SCENARIOS
    from lightning_rollout.loop.auto import check_knobs

    checked = 0
    for scenario in SCENARIOS.values():
        for build in scenario.contenders.values():
            if getattr(build, "func", None) is contenders.threaded:
                knobs = {"envs_per_thread": 1, "num_workers": 1, "parallel_steps": "auto", **build.keywords}
                check_knobs(envs_per_thread=knobs["envs_per_thread"], num_workers=knobs["num_workers"],
                            parallel_steps=knobs["parallel_steps"], num_envs=scenario.num_envs)
                checked += 1
    assert checked >= 20


def test_startup_times_each_construction_of_a_loop_with_worker_processes_in_order():
    """``python -m benchmarks.startup`` (the start-up figures of docs/performance.rst), at a tiny size."""
    from benchmarks.startup import measure

    times = measure(num_workers=2, repeats=2)
    assert len(times) == 2 and all(0 < t["build"] <= t["total"] for t in times), times
    with pytest.raises(ValueError, match="num_workers >= 2"):
        measure(num_workers=1)
