"""Before/after: the same benchmark contenders, at a git revision and in the working tree, in interleaved rounds.

``python -m benchmarks.ab --before da49b52 --scenario cheap --contender "threaded env_time*" --rounds 3``

Each round runs ``python -m benchmarks`` once in a checkout of ``--before`` (a temporary ``git worktree``)
and once in this tree, alternating which goes first, so drift of a noisy machine hits both sides alike.
Every run measures itself with its own harness; the table gives, per contender, the median steps/s of
each side over the rounds, their ratio (after / before), and the range of one round's ratio, which shows how
far the machine moved the figure between rounds. A scenario the revision does not define is left out, with a
line on stderr. Nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(root: Path, args: list[str], out: Path) -> dict[str, dict[str, float]]:
    """One ``python -m benchmarks`` run in ``root``; ``{scenario: {contender: median steps/s}}``."""
    env = dict(os.environ, PYTHONPATH=str(root))
    subprocess.run([sys.executable, "-m", "benchmarks", *args, "--repeats", "1", "--out", str(out)], cwd=root,
                   env=env, check=True, stdout=subprocess.DEVNULL)
    data = json.loads((out / "results.json").read_text())
    return {s["name"]: {name: statistics.median(r["steps_per_s"]) for name, r in s["results"].items()
                        if r.get("steps_per_s")} for s in data["scenarios"]}


def scenario_names(root: Path) -> set[str] | None:
    """The scenarios the benchmark suite of the tree at ``root`` defines (a revision may predate some), or
    ``None`` when that tree does not say (no ``benchmarks.scenarios.SCENARIOS``)."""
    env = dict(os.environ, PYTHONPATH=str(root))
    code = "from benchmarks.scenarios import SCENARIOS; print(' '.join(SCENARIOS))"
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    return set(out.stdout.split()) if out.returncode == 0 else None


def ab_table(runs: dict[str, list[dict[str, dict[str, float]]]], scenarios: list[str], *, before: str
             ) -> tuple[dict[str, dict[str, float]], list[str]]:
    """The before/after table of ``runs`` (``{"before": [round, ...], "after": [...]}``, each round
    ``{scenario: {contender: steps/s}}``): per contender the median of each side over the rounds, their ratio,
    and the lowest and highest ratio of one round's pair (how far this machine moved the figure between
    rounds). Contenders the before revision lacks are left out. Returns ``(table, markdown rows)``."""
    rounds = len(runs["after"])
    table: dict[str, dict[str, float]] = {}
    rows = [f"## Before ({before}) / after (working tree), {rounds} interleaved rounds, medians", "",
            "| scenario | contender | before (steps/s) | after (steps/s) | after / before | one round's pair |",
            "| --- | --- | --- | --- | --- | --- |"]
    for scenario in scenarios:
        for name in sorted(runs["after"][0].get(scenario, {})):
            pairs = [(old[scenario][name], new[scenario][name]) for old, new in zip(runs["before"], runs["after"])
                     if name in old.get(scenario, {}) and name in new.get(scenario, {})]
            if not pairs:  # a contender the before revision does not have
                continue
            b = statistics.median(p[0] for p in pairs)
            a = statistics.median(p[1] for p in pairs)
            each = [new / old for old, new in pairs]
            table[f"{scenario} / {name}"] = {"before": b, "after": a, "ratio": a / b, "round_min": min(each),
                                             "round_max": max(each)}
            rows.append(f"| {scenario} | {name} | {b:,.0f} | {a:,.0f} | {a / b:.2f}x | "
                        f"{min(each):.2f}x-{max(each):.2f}x |")
    return table, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision measured as 'before'")
    parser.add_argument("--scenario", action="append", required=True)
    parser.add_argument("--contender", action="append", default=[])
    parser.add_argument("--frames-scale", default="0.3")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/ab", help="folder for ab.json and table.md")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, dict[str, float]]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="lr-ab-") as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(before), args.before], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            known = scenario_names(before)
            scenarios = [s for s in args.scenario if known is None or s in known]
            for name in sorted(set(args.scenario) - set(scenarios)):
                print(f"{name}: not a scenario at {args.before}; left out", file=sys.stderr)
            if not scenarios:
                raise SystemExit(f"none of the scenarios exists at {args.before}")
            bench_args = [a for s in scenarios for a in ("--scenario", s)]
            bench_args += [a for c in args.contender for a in ("--contender", c)]
            bench_args += ["--frames-scale", args.frames_scale]
            for i in range(args.rounds):
                order = [("before", before), ("after", ROOT)]
                for side, root in (order if i % 2 == 0 else order[::-1]):
                    runs[side].append(_run(root, bench_args, Path(tmp) / f"{side}{i}"))
                    print(f"round {i + 1}/{args.rounds}: {side} done", file=sys.stderr)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, check=False)
    table, rows = ab_table(runs, scenarios, before=args.before)
    print("\n".join(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab.json").write_text(json.dumps({"before": args.before, "rounds": args.rounds, "runs": runs,
                                             "table": table}, indent=1))
    (out / "table.md").write_text("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
