"""The end-to-end bench runner: ``python -m benchmarks.e2e [--quick] [--algo ppo|sac ...] [--seeds ...] [--out DIR]``.

Plans the runs (every contender of every algorithm and seed, the contenders' order reversed every other
seed so that a drifting machine shifts them alike; the learner-only runs with the first seed), runs each
in a fresh interpreter (``--in-process``: in this one), and rewrites ``results.json`` and ``table.md`` after
every run, so that a run cut short keeps what it measured (``--resume`` then skips the runs already there).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any

from .common import ALGOS, CONTENDERS, LEARNER_ONLY, ROOT, RunSpec

__all__ = ["BUDGETS", "main", "plan"]

# config overrides of each example, per mode. Full: budgets that fit one run of each contender in about 15 minutes
# on the 2-core machine (measured per-run times: docs/training.rst; 204,800 PPO frames and 50,000 SAC frames
# measured 13-18 and about 16 minutes); quick: a smoke run of the pipeline.
BUDGETS: dict[str, dict[str, dict[str, Any]]] = {
    "full": {
        "ppo": {"frames": 163_840, "eval_every_frames": 32_768, "eval_episodes": 4},  # 320 batches, 51,200 steps
        "sac": {"frames": 40_000, "eval_every_frames": 10_000, "eval_episodes": 4},   # 30,000 gradient steps
    },
    "quick": {
        "ppo": {"frames": 1_024, "epochs": 2, "eval_every_frames": 512, "eval_episodes": 1},
        "sac": {"frames": 1_000, "learning_starts": 500, "batch_size": 64, "eval_every_frames": 500,
                "eval_episodes": 1},
    },
}
QUICK_EVAL_MAX_STEPS = 200  # quick runs cut evaluation episodes short
PPO_FRAMES_PER_BATCH = 512  # the PPO example's num_envs * steps_per_env


def _variants(algo: str, budget: dict[str, Any], *, sac_utds: list[float],
              ppo_num_envs: list[int]) -> list[dict[str, Any]]:
    """The config overrides of each table of ``algo``: SAC one per UTD, PPO one per env count (the same
    ``steps_per_env * num_envs`` frames a batch as one env, so the same minibatches)."""
    if algo == "sac":
        return [dict(budget, utd=utd) for utd in sac_utds]
    per_batch = budget.get("steps_per_env", PPO_FRAMES_PER_BATCH) * budget.get("num_envs", 1)
    return [dict(budget, **({"num_envs": n, "steps_per_env": per_batch // n} if n != 1 else {}))
            for n in ppo_num_envs]


def plan(*, algos: list[str], seeds: list[int], contenders: list[str], learner_only: list[str],
         budgets: dict[str, dict[str, Any]], sac_utds: list[float], eval_max_steps: int | None,
         ppo_num_envs: list[int] = (1,)) -> list[RunSpec]:
    """The runs, in the order they run: per algorithm (and SAC UTD, PPO env count), per seed, every contender
    (reversed on every other seed), then, after the first seed's, the learner-only runs (one env only: with
    several the learner's work is the same). ``sb3-subproc`` runs only with several envs."""
    runs = []
    for algo in algos:
        for overrides in _variants(algo, budgets[algo], sac_utds=sac_utds, ppo_num_envs=list(ppo_num_envs)):
            several = overrides.get("num_envs", 1) > 1
            mine = [c for c in contenders if c != "sb3-subproc" or several]
            for i, seed in enumerate(seeds):
                order = mine if i % 2 == 0 else mine[::-1]
                runs += [RunSpec(algo, c, seed, overrides, eval_max_steps) for c in order]
                if i == 0 and not several:
                    runs += [RunSpec(algo, c, seed, overrides, eval_max_steps) for c in learner_only]
    return runs


def execute(spec: RunSpec, *, isolate: bool, timeout: float) -> dict[str, Any]:
    """Run ``spec`` (in a child interpreter with ``isolate``); a failure comes back as a record with ``error``."""
    failed = {"algo": spec.algo, "contender": spec.contender, "seed": spec.seed, "utd": spec.key[3],
              "num_envs": spec.key[4]}
    if not isolate:
        import tempfile

        from .contenders import run

        try:
            with tempfile.TemporaryDirectory(prefix="e2e-") as workdir:
                return run(spec, workdir=workdir)
        except Exception:  # noqa: BLE001 (a failed contender is a row of the report, not the end of the bench)
            return {**failed, "error": traceback.format_exc(limit=3)}
    try:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.e2e.contenders", spec.to_json()], cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**failed, "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {**failed, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}"}
    return json.loads(lines[-1][len("RESULT "):])


def machine() -> dict[str, Any]:
    """The shared bench's machine description, with the versions of this bench's peers."""
    from importlib.metadata import PackageNotFoundError, version

    from ..report import machine as base

    info = base()
    for name in ("lightning", "stable_baselines3", "mujoco"):
        try:
            info[name] = version(name.replace("_", "-"))
        except PackageNotFoundError:
            info[name] = None
    return info


def _overrides(items: list[str]) -> dict[str, dict[str, Any]]:
    """``ALGO.FIELD=VALUE`` items as ``{algo: {field: value}}`` (values parsed as JSON when they parse)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, _, value = item.partition("=")
        algo, _, name = key.partition(".")
        if algo not in ALGOS or not name or not value:
            raise SystemExit(f"--set {item!r}: expected ALGO.FIELD=VALUE with ALGO in {sorted(ALGOS)}")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        out.setdefault(algo, {})[name] = parsed
    return out


def _line(record: dict[str, Any], seconds: float) -> str:
    head = f"[{record['algo']}, {record.get('num_envs', 1)} env(s)] {record['contender']} seed {record['seed']}"
    if record.get("error"):
        return f"{head}: FAILED ({record['error'].strip().splitlines()[-1][:200]})"
    final = record["eval"][-1]["return"] if record.get("eval") else None
    return (f"{head}: {record['wall_s']:.1f} s without evaluation, {record['frames_per_s'] or 0:,.0f} frames/s, "
            f"{record['grad_steps']:,} gradient steps" + (f", final return {final:,.0f}" if final is not None else "")
            + f" ({seconds:.0f} s in all)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the planned runs and write the report; returns it (as written to ``results.json``)."""
    from .report import write_report

    parser = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny budgets, one seed, in this process: a smoke run")
    parser.add_argument("--algo", action="append", choices=sorted(ALGOS), help="repeatable; default: all")
    parser.add_argument("--contender", action="append", choices=CONTENDERS + LEARNER_ONLY,
                        help="repeatable; default: all (learner-only runs with the first seed only)")
    parser.add_argument("--seeds", type=int, nargs="+", help="default: 0 1 2 (0 with --quick)")
    parser.add_argument("--sac-utd", type=float, nargs="+", default=[1.0],
                        help="SAC's gradient steps per env frame, one table each (default %(default)s: RL Zoo's)")
    parser.add_argument("--ppo-num-envs", type=int, nargs="+", help="PPO's env counts, one table each, the same "
                        "frames a batch (default: 1 8; 1 with --quick)")
    parser.add_argument("--set", action="append", default=[], metavar="ALGO.FIELD=VALUE",
                        help="override a field of an example's Config, e.g. ppo.frames=10240 (repeatable)")
    parser.add_argument("--out", default="benchmarks/results/e2e", help="output folder (default %(default)s)")
    parser.add_argument("--in-process", action="store_true", help="run every contender in this interpreter "
                        "(default with --quick; otherwise each run gets a fresh one)")
    parser.add_argument("--resume", action="store_true", help="keep the records in OUT/results.json and skip "
                        "the runs they cover")
    parser.add_argument("--run-timeout", type=float, default=3600.0, help="seconds a run may take (default 3600)")
    parser.add_argument("--report-only", action="store_true", help="rewrite table.md and plot.png from "
                        "OUT/results.json, run nothing")
    args = parser.parse_args(argv)
    results = os.path.join(args.out, "results.json")
    if args.report_only:
        with open(results) as f:
            report = json.load(f)
        report.pop("tables", None)
        print("wrote " + ", ".join(write_report(report, args.out).values()))
        return report
    mode = "quick" if args.quick else "full"
    budgets = {algo: dict(BUDGETS[mode][algo]) for algo in ALGOS}
    for algo, fields in _overrides(args.set).items():
        budgets[algo].update(fields)
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    chosen = args.contender or list(CONTENDERS + LEARNER_ONLY)
    specs = plan(algos=args.algo or list(ALGOS), seeds=seeds, contenders=[c for c in CONTENDERS if c in chosen],
                 learner_only=[c for c in LEARNER_ONLY if c in chosen], budgets=budgets, sac_utds=args.sac_utd,
                 eval_max_steps=QUICK_EVAL_MAX_STEPS if args.quick else None,
                 ppo_num_envs=args.ppo_num_envs or ([1] if args.quick else [1, 8]))
    report: dict[str, Any] = {
        "mode": mode, "command": "python -m benchmarks.e2e " + " ".join(sys.argv[1:] if argv is None else argv),
        "seeds_note": f"seeds {', '.join(map(str, seeds))}; learner-only runs with seed {seeds[0]}",
        "machine": machine(), "budgets": budgets, "records": []}
    if args.resume and os.path.exists(results):
        with open(results) as f:
            before = json.load(f)
        report["records"] = [r for r in before.get("records", []) if not r.get("error")]
        if before.get("command") not in (None, report["command"]):  # the runs kept came from those commands
            report["command"] = f"{before['command']}; then {report['command']}"
    done = {(r["algo"], r["contender"], r["seed"], float(r.get("utd", 1.0)), int(r.get("num_envs", 1)))
            for r in report["records"]}
    todo = [s for s in specs if s.key not in done]
    print(f"{len(todo)} runs ({len(specs) - len(todo)} already in {results})", flush=True)
    for i, spec in enumerate(todo, 1):
        start = time.perf_counter()
        record = execute(spec, isolate=not (args.in_process or args.quick), timeout=args.run_timeout)
        report["records"].append(record)
        print(f"{i}/{len(todo)} " + _line(record, time.perf_counter() - start), flush=True)
        write_report(report, args.out, plot=False)
    paths = write_report(report, args.out)
    print("wrote " + ", ".join(paths.values()))
    return report
