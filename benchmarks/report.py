"""Writing the results: ``results.json``, ``table.md`` and ``plot.png``.

The JSON holds everything (per-repetition figures, setup times, errors); the
table shows, per scenario, median steps/s with min-max, mean flush batch and
peak RSS where they apply, the ratio of each of our contenders against each
peer from the same run, and each scenario's targets with PASS/MISS.
"""

from __future__ import annotations

import json
import math
import os
import platform
from typing import Any

__all__ = ["evaluate_targets", "machine", "write_all"]


def machine() -> dict[str, Any]:
    """Cores, CPU model and library versions, for the report header."""
    import gymnasium
    import tensordict
    import torch
    import torchrl

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "torch": torch.__version__, "torchrl": torchrl.__version__, "tensordict": tensordict.__version__,
            "gymnasium": gymnasium.__version__, "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _is_ours(name: str) -> bool:
    return name.startswith("threaded")


def _value(scenario: dict[str, Any], name: str, metric: str) -> float | None:
    if name == "ideal":
        return scenario["extras"].get("ideal_steps_per_s")
    if name == "num_envs":
        return float(scenario["num_envs"])
    result = scenario["results"].get(name, {})
    value = result.get("stats", {}).get(metric) if metric != "median" else result.get("median")
    return value


def evaluate_targets(scenario: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target with the best of our contenders, the ratio and PASS / MISS (None: not measured)."""
    rows = []
    for target in scenario["targets"]:
        peer = _value(scenario, target["peer"], target["metric"])
        candidates = [(v, n) for n in target["ours"] if (v := _value(scenario, n, target["metric"])) is not None]
        ratio, best = None, None
        if candidates and peer:
            value, best = max(candidates)
            ratio = value / peer
        rows.append({**target, "best": best, "ratio": ratio,
                     "passed": None if ratio is None else ratio >= target["minimum"]})
    return rows


def _fmt(x: float | None, digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


def _scenario_table(s: dict[str, Any]) -> list[str]:
    lines = [f"## {s['title']}", ""]
    if s.get("skipped"):
        return lines + [f"Skipped: {s['skipped']}", ""]
    lines.append(f"{s['num_envs']} envs, {s['frames']:,} frames per repetition, "
                 f"{s['frames_per_batch']:,} frames per batch, {s['repeats']} repetitions (median, min-max)"
                 + (", in interleaved rounds (every contender built, warmed up and timed once a round)."
                    if s.get("interleaved") else "."))
    extras = s["extras"]
    if "ideal_steps_per_s" in extras:
        lines.append(f"Measured step time {extras['step_time_s'] * 1e3:.3f} ms: ideal "
                     f"num_envs / step_time = {extras['ideal_steps_per_s']:,.0f} steps/s.")
    if s.get("policy_device", "cpu") != "cpu":
        lines.append(f"Every contender's policy runs on `{s['policy_device']}`; the envs run on the CPU.")
    if s.get("note"):
        lines.append(s["note"])
    lines.append("")
    results = s["results"]
    ideal = extras.get("ideal_steps_per_s")
    header = "| contender | median steps/s | min-max | mean flush batch |"
    rule = "| --- | ---: | ---: | ---: |"
    if ideal:
        header, rule = header + " of ideal |", rule + " ---: |"
    if s["track_memory"]:
        header, rule = header + " peak RSS MB |", rule + " ---: |"
    lines += [header, rule]
    for name, r in results.items():
        if r.get("error"):
            lines.append(f"| {name} | failed: {r['error'].splitlines()[0][:120]} | | |" + (" |" if ideal else "")
                         + (" |" if s["track_memory"] else ""))
            continue
        row = (f"| {name} | {_fmt(r.get('median'))} | {_fmt(r.get('min'))}-{_fmt(r.get('max'))} | "
               f"{_fmt(r['stats'].get('mean_flush_batch'), 1)} |")
        if ideal:
            row += f" {_fmt(r['median'] / ideal if r.get('median') else None, 2)} |"
        if s["track_memory"]:
            row += f" {_fmt(r.get('peak_rss_mb'))} |"
        lines.append(row)
    ours = [n for n in results if _is_ours(n) and results[n].get("median")]
    peers = [n for n in results if not _is_ours(n) and results[n].get("median")]
    if ours and peers:
        lines += ["", "Ratios (ours / peer, medians of this run):", "",
                  "| ours \\ peer | " + " | ".join(peers) + " |", "| --- |" + " ---: |" * len(peers)]
        for n in ours:
            cells = " | ".join(f"{results[n]['median'] / results[p]['median']:.2f}x" for p in peers)
            lines.append(f"| {n} | {cells} |")
    if s["targets"]:
        lines += ["", "| target | best of ours | ratio | result |", "| --- | --- | ---: | --- |"]
        for t in s["target_results"]:
            verdict = {True: "PASS", False: "MISS", None: "not measured"}[t["passed"]]
            lines.append(f"| {t['label']} | {t['best'] or '-'} | {_fmt(t['ratio'], 2)} | {verdict} |")
    return lines + [""]


def write_table(report: dict[str, Any], path: str) -> None:
    m = report["machine"]
    lines = ["# lightning_rollout benchmarks", "",
             f"Machine: {m['cpu']}, {m['cores']} cores; Python {m['python']}, torch {m['torch']} "
             f"({m['torch_threads']} intra-op threads), torchrl {m['torchrl']}, tensordict {m['tensordict']}, "
             f"gymnasium {m['gymnasium']}." + (f" GPU: {m['gpu']}." if m.get("gpu") else ""),
             f"Command: `{report['command']}`"
             + (" (quick: tiny frame counts, figures are not meaningful)" if report["quick"] else ""), ""]
    for s in report["scenarios"]:
        lines += _scenario_table(s)
    with open(path, "w") as f:
        f.write("\n".join(lines))


def write_plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [s for s in report["scenarios"] if not s.get("skipped") and any(r.get("median") for r in s["results"].values())]
    fig, axes = plt.subplots(len(shown) or 1, 1, figsize=(9, 2.2 + 0.38 * max((len(s["results"]) for s in shown),
                                                                                default=1) * max(len(shown), 1)),
                             squeeze=False)
    for ax, s in zip(axes[:, 0], shown):
        names = [n for n, r in s["results"].items() if r.get("median")]
        med = [s["results"][n]["median"] for n in names]
        lo = [m - s["results"][n]["min"] for n, m in zip(names, med)]
        hi = [s["results"][n]["max"] - m for n, m in zip(names, med)]
        colors = ["tab:blue" if _is_ours(n) else "tab:gray" for n in names]
        ax.barh(names, med, xerr=[lo, hi], color=colors, capsize=3)
        ideal = s["extras"].get("ideal_steps_per_s")
        if ideal:
            ax.axvline(ideal, color="tab:red", linestyle="--", label="ideal")
            ax.legend(loc="lower right", fontsize=7)
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.tick_params(labelsize=7)
        ax.set_title(s["title"], fontsize=9)
        ax.set_xlabel("steps/s (median, min-max; blue: lightning_rollout)", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(report: dict[str, Any], out_dir: str, *, plot: bool = True) -> dict[str, str]:
    """Write ``results.json``, ``table.md`` and (with ``plot``) ``plot.png``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f) for k, f in
             (("json", "results.json"), ("table", "table.md"), ("plot", "plot.png"))}
    with open(paths["json"], "w") as f:
        json.dump(report, f, indent=2, default=str)
    write_table(report, paths["table"])
    if plot:
        write_plot(report, paths["plot"])
    else:
        del paths["plot"]
    return paths
