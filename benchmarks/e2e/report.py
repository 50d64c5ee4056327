"""The end-to-end bench's outputs, from its run records: ``results.json``, ``table.md`` and ``plot.png``.

Pure functions over the records that :func:`benchmarks.e2e.common.record` writes (no MuJoCo, no SB3, no
torch needed): :func:`summarize` groups them into one table per algorithm and UTD (mean and min-max over
seeds), :func:`compare` computes the ratios the targets are about, :func:`evaluate_targets` says PASS / MISS,
:func:`markdown` writes the tables. ``python -m benchmarks.e2e --report-only --out DIR`` rebuilds
``table.md`` and ``plot.png`` from ``DIR/results.json``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from typing import Any

from .common import LEARNER_ONLY

__all__ = ["LABELS", "compare", "evaluate_targets", "markdown", "stats", "summarize", "write_report"]

LABELS = {
    "ours": "lightning_rollout: `Trainer.fit` + `RolloutDataModule` (the example)",
    "ours-loop": "lightning_rollout: the same learner, a loop by hand over `ThreadedCollector`",
    "torchrl": "control: the same loop over TorchRL's `Collector`",
    "sb3": "Stable-Baselines3",
    "sb3-subproc": "Stable-Baselines3, `SubprocVecEnv`",
    "ours-learner": "learner only: the example's `learn`, no collection",
    "sb3-learner": "learner only: Stable-Baselines3's `train()`, no collection",
}
ALGO_TITLES = {"ppo": "PPO", "sac": "SAC"}
MAX_OVERHEAD = 0.10  # Lightning's overhead: Trainer.fit at most 10% slower than the loop by hand
# wall time of the peer / ours, with one env and with several (SB3: its faster vec env)
SPEEDUP_GOALS = {("ppo", False): {"sb3": 1.0, "torchrl": 1.2}, ("ppo", True): {"sb3": 1.3},
                 ("sac", False): {"sb3": 1.0}}
LEARNER_GOAL = 1.0  # learner alone: SB3's time / ours
MAX_OVERLAP = {"sac": 1.15}  # whole run / learner only


def stats(values: Iterable[float | None]) -> dict[str, float] | None:
    """Mean, min, max and count of the values that are not ``None`` (``None`` when there are none)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return None
    return {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _ok(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if not r.get("error")]


def _table_key(record: dict[str, Any]) -> tuple[str, float, int]:
    return record["algo"], float(record.get("utd", 1.0)), int(record.get("num_envs", 1))


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One table per ``(algo, utd, num_envs)``, in order of first appearance: ``{"algo", "utd", "num_envs",
    "rows": [...]}``.

    A row per contender (in :data:`LABELS` order): its seeds, frames, mean gradient steps, and ``stats`` of
    wall time, frames/s, gradient steps/s, the return at each evaluation point (``returns``:
    ``{frames: stats}``) and the last evaluation's return (``final_return``); failed runs in ``errors``.
    """
    tables: dict[tuple[str, float, int], dict[str, list[dict[str, Any]]]] = {}
    for r in records:
        tables.setdefault(_table_key(r), {}).setdefault(r["contender"], []).append(r)
    out = []
    for (algo, utd, num_envs), by_contender in tables.items():
        rows = []
        for contender in sorted(by_contender, key=lambda c: list(LABELS).index(c) if c in LABELS else len(LABELS)):
            runs, ok = by_contender[contender], _ok(by_contender[contender])
            points = sorted({e["frames"] for r in ok for e in r.get("eval", [])})
            rows.append({
                "contender": contender, "label": LABELS.get(contender, contender),
                "seeds": sorted(r["seed"] for r in ok),
                "frames": max((r["frames"] for r in ok), default=None),
                "grad_steps": (stats(r["grad_steps"] for r in ok) or {}).get("mean"),
                "wall_s": stats(r["wall_s"] for r in ok),
                "cpu_s": stats(r.get("cpu_s") for r in ok),
                "frames_per_s": stats(r.get("frames_per_s") for r in ok),
                "grad_steps_per_s": stats(r.get("grad_steps_per_s") for r in ok),
                "returns": {p: stats(e["return"] for r in ok for e in r.get("eval", []) if e["frames"] == p)
                            for p in points},
                "final_return": stats(r["eval"][-1]["return"] for r in ok if r.get("eval")),
                "errors": [f"seed {r['seed']}: {r['error']}" for r in runs if r.get("error")],
            })
        out.append({"algo": algo, "utd": utd, "num_envs": num_envs, "rows": rows})
    return out


def _row(table: dict[str, Any], contender: str) -> dict[str, Any] | None:
    return next((r for r in table["rows"] if r["contender"] == contender and r["wall_s"]), None)


def _wall_ratio(walls: dict[str, dict[int, float]], numerator: str, denominator: str) -> float | None:
    """Mean wall time of ``numerator`` over that of ``denominator``, both over the seeds both ran (the runs of
    a seed follow one another, so a drifting machine shifts them alike); ``None`` without a common seed."""
    a, b = walls.get(numerator, {}), walls.get(denominator, {})
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    return sum(a[s] for s in seeds) / sum(b[s] for s in seeds)


def compare(table: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """The ratios of one table (``None`` where a contender did not run):

    * ``speedup_vs_sb3``, ``speedup_vs_torchrl``: the peer's mean wall time over ours (``Trainer.fit``),
      each ratio over the seeds both of its contenders ran; for SB3 the smaller of its ``DummyVecEnv`` and
      ``SubprocVecEnv`` runs' (``speedup_vs_sb3_subproc``: the latter's alone);
    * ``lightning_overhead``: mean over the seeds both ran of ``ours / ours-loop - 1`` (wall times), and
      ``lightning_us_per_step``: the same difference per optimiser step, in microseconds;
    * ``overlap``: ours over the learner alone (``ours-learner``); ``overlap_loop`` the loop by hand's;
      ``sb3_overlap``: SB3 over its own learner; ``learner_speedup_vs_sb3``: SB3's learner over ours;
    * ``learning``: ours' mean final return against SB3's seed range (of its ``DummyVecEnv`` runs), and
      ``below``: the frame counts where ours' mean return is below SB3's lowest seed.
    """
    key = (table["algo"], table["utd"], table.get("num_envs", 1))
    mine = [r for r in _ok(records) if _table_key(r) == key]
    walls: dict[str, dict[int, float]] = {}
    cpus: dict[str, dict[int, float]] = {}
    for r in mine:
        walls.setdefault(r["contender"], {})[r["seed"]] = r["wall_s"]
        if r.get("cpu_s") is not None:
            cpus.setdefault(r["contender"], {})[r["seed"]] = r["cpu_s"]
    fit = {r["seed"]: r for r in mine if r["contender"] == "ours"}
    loop = {r["seed"]: r for r in mine if r["contender"] == "ours-loop"}
    paired = sorted(set(fit) & set(loop))
    overhead = stats(fit[s]["wall_s"] / loop[s]["wall_s"] - 1 for s in paired)
    per_step = stats((fit[s]["wall_s"] - loop[s]["wall_s"]) / fit[s]["grad_steps"] * 1e6
                     for s in paired if fit[s]["grad_steps"])
    ours, sb3 = _row(table, "ours"), _row(table, "sb3")
    learning = None
    if ours and sb3 and ours["final_return"] and sb3["final_return"]:
        below = [p for p, s in sorted(ours["returns"].items())
                 if s and sb3["returns"].get(p) and s["mean"] < sb3["returns"][p]["min"]]
        learning = {"ours_mean": ours["final_return"]["mean"], "sb3_min": sb3["final_return"]["min"],
                    "sb3_max": sb3["final_return"]["max"], "sb3_mean": sb3["final_return"]["mean"], "below": below}
    sb3_ratios = [x for x in (_wall_ratio(walls, c, "ours") for c in ("sb3", "sb3-subproc")) if x is not None]
    return {
        "speedup_vs_sb3": min(sb3_ratios, default=None),
        "speedup_vs_sb3_subproc": _wall_ratio(walls, "sb3-subproc", "ours"),
        "cpu_speedup_vs_sb3": _wall_ratio(cpus, "sb3", "ours"),
        "speedup_vs_torchrl": _wall_ratio(walls, "torchrl", "ours"),
        "loop_speedup_vs_torchrl": _wall_ratio(walls, "torchrl", "ours-loop"),
        "lightning_overhead": overhead["mean"] if overhead else None,
        "lightning_us_per_step": per_step["mean"] if per_step else None,
        "overlap": _wall_ratio(walls, "ours", "ours-learner"),
        "overlap_loop": _wall_ratio(walls, "ours-loop", "ours-learner"),
        "sb3_overlap": _wall_ratio(walls, "sb3", "sb3-learner"),
        "learner_speedup_vs_sb3": _wall_ratio(walls, "sb3-learner", "ours-learner"),
        "learning": learning,
    }


def _target(label: str, value: float | None, goal: str, passed: bool | None, *, unit: str = "x") -> dict[str, Any]:
    """A target's row; ``unit``: how its value reads (``"x"`` a ratio, ``"%"`` a fraction, ``"return"``)."""
    return {"label": label, "value": value, "goal": goal, "unit": unit,
            "passed": None if value is None else passed}


def evaluate_targets(algo: str, ratios: dict[str, Any], *, num_envs: int = 1) -> list[dict[str, Any]]:
    """The issue's targets for ``algo`` with ``num_envs`` envs on ``ratios`` (from :func:`compare`): label,
    measured value, goal, ``passed`` (``None``: not measured)."""
    learning = ratios["learning"]
    out = [_target("learning: ours' mean return within or above SB3's seed range at every evaluation",
                   learning and learning["ours_mean"], "≥ SB3's lowest seed",
                   bool(learning) and not learning.get("below") and learning["ours_mean"] >= learning["sb3_min"],
                   unit="return")]
    for peer, goal in SPEEDUP_GOALS.get((algo, num_envs > 1), {}).items():
        value = ratios[f"speedup_vs_{peer}"]
        name = "Stable-Baselines3" if peer == "sb3" else "the TorchRL `Collector` control"
        out.append(_target(f"wall time: {name} / ours", value, f"≥ {goal}x", value is not None and value >= goal))
    if num_envs == 1:
        value = ratios["learner_speedup_vs_sb3"]
        out.append(_target("learner alone: Stable-Baselines3 / ours", value, f"≥ {LEARNER_GOAL}x",
                           value is not None and value >= LEARNER_GOAL))
    if algo in MAX_OVERLAP:
        value, goal = ratios["overlap"], MAX_OVERLAP[algo]
        out.append(_target("whole run / learner only (ours)", value, f"≤ {goal}", value is not None and value <= goal))
    value = ratios["lightning_overhead"]
    out.append(_target("Lightning's overhead: `Trainer.fit` / the loop by hand - 1", value,
                       f"≤ {MAX_OVERHEAD:.0%}", value is not None and value <= MAX_OVERHEAD, unit="%"))
    return out


def _fmt(x: float | None, digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


def _spread(s: dict[str, float] | None, digits: int = 0) -> str:
    """``mean (min to max)``, or the value alone for one seed (or seeds that agree)."""
    if not s:
        return "-"
    if s["n"] == 1 or s["min"] == s["max"]:
        return _fmt(s["mean"], digits)
    return f"{_fmt(s['mean'], digits)} ({_fmt(s['min'], digits)} to {_fmt(s['max'], digits)})"


def _ratio_text(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "lightning_overhead":
        return f"{value:+.1%}"
    if key == "lightning_us_per_step":
        return f"{value:,.0f} us"
    return f"{value:.2f}x"


_RATIO_LABELS = {
    "speedup_vs_sb3": "Stable-Baselines3's wall time / ours (`Trainer.fit`; SB3's faster vec env)",
    "speedup_vs_sb3_subproc": "Stable-Baselines3 with `SubprocVecEnv` / ours (`Trainer.fit`)",
    "cpu_speedup_vs_sb3": "CPU time: Stable-Baselines3 (`DummyVecEnv`) / ours (`Trainer.fit`)",
    "speedup_vs_torchrl": "the TorchRL `Collector` control's wall time / ours (`Trainer.fit`)",
    "loop_speedup_vs_torchrl": "the TorchRL `Collector` control / ours (the same loop by hand)",
    "lightning_overhead": "`Trainer.fit` / the loop by hand - 1 (seeds paired)",
    "lightning_us_per_step": "the same, per optimiser step",
    "overlap": "whole run / learner only: ours (`Trainer.fit`)",
    "overlap_loop": "whole run / learner only: ours (the loop by hand)",
    "sb3_overlap": "whole run / learner only: Stable-Baselines3 (its own learner)",
    "learner_speedup_vs_sb3": "learner only: Stable-Baselines3's time / ours",
}


def _results_table(rows: list[dict[str, Any]]) -> list[str]:
    """A row per contender: seeds, return at each evaluation point, wall time, frames/s, gradient steps/s."""
    points = sorted({p for r in rows for p in r["returns"]})
    header = (["contender", "seeds"] + [f"return at {p:,}" for p in points]
              + ["wall time (s)", "CPU time (s)", "frames/s", "gradient steps/s"])
    lines = ["| " + " | ".join(header) + " |", "| --- | --- |" + " ---: |" * (len(header) - 2)]
    for r in rows:
        cells = ([r["label"], ",".join(map(str, r["seeds"])) or "-"]
                 + [_spread(r["returns"].get(p)) for p in points]
                 + [_spread(r["wall_s"], 1), _spread(r["cpu_s"], 1),
                    "-" if r["contender"] in LEARNER_ONLY else _spread(r["frames_per_s"]),
                    _spread(r["grad_steps_per_s"])])
        lines.append("| " + " | ".join(cells) + " |")
    errors = [f"{r['contender']} {e}" for r in rows for e in r["errors"]]
    if errors:
        lines += ["", "Failed runs: " + "; ".join(e.splitlines()[0][:200] for e in errors)]
    return lines


def _ratios_table(ratios: dict[str, Any]) -> list[str]:
    shown = [(k, v) for k, v in ratios.items() if k in _RATIO_LABELS and v is not None]
    if not shown:
        return []
    return (["| ratio (means over the seeds both contenders ran) | value |", "| --- | ---: |"]
            + [f"| {_RATIO_LABELS[k]} | {_ratio_text(k, v)} |" for k, v in shown])


def _targets_table(targets: list[dict[str, Any]]) -> list[str]:
    lines = ["| target | measured | goal | result |", "| --- | ---: | --- | --- |"]
    for t in targets:
        value = t["value"]
        text = ("-" if value is None else f"{value:+.1%}" if t["unit"] == "%"
                else f"{value:,.0f}" if t["unit"] == "return" else f"{value:.2f}x")
        verdict = {True: "PASS", False: "MISS", None: "not measured"}[t["passed"]]
        lines.append(f"| {t['label']} | {text} | {t['goal']} | {verdict} |")
    return lines


def _section(table: dict[str, Any], records: list[dict[str, Any]]) -> list[str]:
    """One algorithm (and UTD): a line on the budget, then the results, ratios and targets tables."""
    algo, rows, num_envs = table["algo"], table["rows"], table.get("num_envs", 1)
    key = (algo, table["utd"], num_envs)
    cfg = next((r["config"] for r in records if _table_key(r) == key and not r.get("error")), {})
    title = f"## {ALGO_TITLES.get(algo, algo)} on {cfg.get('env', '?')}, {num_envs} env{'s' * (num_envs > 1)}"
    if algo == "sac":
        title += f", UTD {table['utd']:g} (gradient steps per env frame)"
    lines = [title, ""]
    full = next((r for r in rows if r["contender"] in ("ours", "sb3") and r["frames"]), None)
    if full:
        lines += [f"{full['frames']:,} env frames and {_fmt(full['grad_steps'])} gradient steps a run; return: mean "
                  f"of {cfg.get('eval_episodes', '?')} deterministic episodes every {cfg.get('eval_every_frames', 0):,} "
                  "frames, then mean (min to max) over seeds; wall time without the evaluation rounds. "
                  "Hyperparameters: the example's `Config` (`results.json`).", ""]
    ratios = compare(table, records)
    lines += _results_table(rows) + [""]
    ratio_lines = _ratios_table(ratios)
    lines += ratio_lines + ([""] if ratio_lines else [])
    return lines + _targets_table(evaluate_targets(algo, ratios, num_envs=num_envs)) + [""]


def markdown(report: dict[str, Any]) -> str:
    """``table.md``: the run's header (mode, machine, command), then one section per table."""
    m = report.get("machine", {})
    quick = report.get("mode") == "quick"
    lines = ["# End-to-end training against the peers", "",
             ("**Quick run**: tiny budgets and one seed, a smoke test of the pipeline; the figures are not "
              "meaningful." if quick else f"Full run: {report.get('seeds_note', 'every seed as listed')}."),
             f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores; torch {m.get('torch', '?')} "
             f"(one intra-op thread per run), torchrl {m.get('torchrl', '?')}, lightning {m.get('lightning', '?')}, "
             f"stable-baselines3 {m.get('stable_baselines3', '?')}, mujoco {m.get('mujoco', '?')}.",
             f"Command: `{report.get('command', '?')}`", ""]
    for table in summarize(report.get("records", [])):
        lines += _section(table, report["records"])
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: str) -> str | None:
    """Return against frames, one panel per table, a line per contender (mean, min-max band); ``None`` when
    there is nothing to draw."""
    tables = [t for t in summarize(report.get("records", [])) if any(r["returns"] for r in t["rows"])]
    if not tables:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tables), figsize=(5.5 * len(tables), 3.8), squeeze=False)
    for ax, table in zip(axes[0], tables):
        for row in table["rows"]:
            points = sorted(row["returns"])
            if not points:
                continue
            mean = [row["returns"][p]["mean"] for p in points]
            ax.plot(points, mean, "o-", label=row["contender"])
            ax.fill_between(points, [row["returns"][p]["min"] for p in points],
                            [row["returns"][p]["max"] for p in points], alpha=0.15)
        ax.set_title(f"{ALGO_TITLES.get(table['algo'], table['algo'])}, {table['num_envs']} env(s)"
                     + (f", UTD {table['utd']:g}" if table["algo"] == "sac" else ""), fontsize=10)
        ax.set_xlabel("env frames")
        ax.set_ylabel("deterministic evaluation return")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(report: dict[str, Any], out_dir: str, *, plot: bool = True) -> dict[str, str]:
    """Write ``results.json`` (the records, with each table's summary, ratios and targets), ``table.md`` and,
    with ``plot``, ``plot.png`` into ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    records = report.get("records", [])
    tables = summarize(records)
    for table in tables:
        table["ratios"] = compare(table, records)
        table["targets"] = evaluate_targets(table["algo"], table["ratios"], num_envs=table["num_envs"])
    paths = {"json": os.path.join(out_dir, "results.json"), "table": os.path.join(out_dir, "table.md")}
    with open(paths["json"], "w") as f:
        json.dump({**report, "tables": tables}, f, indent=2, default=str)
    with open(paths["table"], "w") as f:
        f.write(markdown(report))
    if plot:
        drawn = write_plot(report, os.path.join(out_dir, "plot.png"))
        if drawn:
            paths["plot"] = drawn
    return paths
