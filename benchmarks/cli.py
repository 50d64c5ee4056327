"""The benchmark runner; command line: ``python -m benchmarks [--quick] [--scenario NAME ...] [--out DIR] [--repeats K]``."""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["main", "run_scenario"]


def run_scenario(scenario: Any, *, quick: bool, repeats: int, contenders: list[str] | None = None,
                 processes: bool = True, frames_scale: float = 1.0, policy_device: str = "cpu",
                 interleave: bool = False, log: Any = print,
                 on_result: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run every contender of ``scenario`` (filtered by glob patterns ``contenders``) in this process tree,
    every policy on ``policy_device``. ``on_result(entry)`` is called after each contender with the
    scenario's entry so far (its targets evaluated on what ran), so a run cut short keeps what it measured.

    ``interleave``: the repetitions run in rounds, each building, warming up and timing every contender once
    (in the reverse order every other round), so that a machine whose speed drifts over minutes shifts every
    contender alike instead of the ones timed last; otherwise a contender's repetitions run back to back."""
    from .harness import measure, merge
    from .report import evaluate_targets
    from .scenarios import PROCESS_CONTENDERS

    workload = scenario.workload(quick, policy_device=policy_device)
    frames = scenario.frame_count(workload, quick)
    if not quick and frames_scale != 1.0:
        frames = max(workload.frames_per_batch, round(frames * frames_scale / workload.frames_per_batch)
                     * workload.frames_per_batch)
    entry: dict[str, Any] = {
        "name": scenario.name, "title": scenario.title, "env_id": scenario.env_id, "num_envs": scenario.num_envs,
        "hidden": list(scenario.hidden), "frames": frames, "frames_per_batch": workload.frames_per_batch,
        "repeats": repeats, "policy_device": policy_device, "track_memory": scenario.track_memory,
        "note": scenario.note,
        "targets": [dataclasses.asdict(t) for t in scenario.targets], "extras": {}, "results": {}}
    reason = scenario.requires()
    if reason:
        log(f"[{scenario.name}] skipped: {reason}")
        entry.update(skipped=reason, target_results=[])
        return entry
    entry["extras"] = scenario.extras(quick)
    entry["interleaved"] = interleave
    selected = [(name, build) for name, build in scenario.contenders.items()
                if (not contenders or any(fnmatch.fnmatch(name, p) for p in contenders))
                and (processes or name not in PROCESS_CONTENDERS)]
    rounds = repeats if interleave else 1
    for r in range(rounds):
        for name, build in (selected if r % 2 == 0 else selected[::-1]):
            t0 = time.perf_counter()
            result = measure(lambda: build(workload), frames, 1 if interleave else repeats,
                             warmup_frames=workload.frames_per_batch, track_memory=scenario.track_memory)
            result = merge(entry["results"].get(name), result)
            entry["results"][name] = result
            figure = f"{result['median']:,.0f} steps/s" if result.get("median") else f"FAILED {result['error']}"
            where = f"round {r + 1}/{rounds}, " if interleave else ""
            log(f"[{scenario.name}] {name}: {figure} ({where}{time.perf_counter() - t0:.1f} s)")
            if on_result is not None:
                entry["target_results"] = evaluate_targets(entry)
                on_result(entry)
    entry["target_results"] = evaluate_targets(entry)
    return entry


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the scenarios, write the report, return it (as written to ``results.json``)."""
    from .report import machine, write_all
    from .scenarios import SCENARIOS

    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny frame counts: a smoke run of seconds per scenario")
    parser.add_argument("--group", choices=("core", "real", "scaling", "all"), default="core",
                        help="which scenarios run by default: core (synthetic envs, CartPole; default), real "
                             "(MuJoCo, ALE, envpool: the bench-real extra), scaling (1-16 worker processes: a "
                             "machine with 16 cores) or all")
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), metavar="NAME",
                        help=f"run only these (repeatable; default all: {', '.join(SCENARIOS)})")
    parser.add_argument("--contender", action="append", metavar="GLOB",
                        help="run only contenders whose name matches (repeatable), e.g. 'threaded*'")
    parser.add_argument("--no-processes", action="store_true",
                        help="leave out peers that start worker processes (ParallelEnv, MultiSync, AsyncVectorEnv)")
    parser.add_argument("--frames-scale", type=float, default=1.0,
                        help="multiply every full-run frame count (e.g. 0.2 for a shorter run; ignored with --quick)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch intra-op threads in this process (default %(default)s: the small policies lose "
                             "far more to thread wake-ups than they gain, and every contender gets the same)")
    parser.add_argument("--policy-device", default="cpu",
                        help="where every contender's policy runs, e.g. cuda (default %(default)s); the envs stay "
                             "on the CPU and each step's observations and actions cross to and from that device")
    parser.add_argument("--out", default="benchmarks/results", help="output folder (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repetitions (default 3; 2 with --quick)")
    parser.add_argument("--interleave", action="store_true",
                        help="time the repetitions in rounds over every contender of a scenario (each built, warmed "
                             "up and timed once a round), so the machine's drift shifts them alike")
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.policy_device)
    except RuntimeError as exc:
        parser.error(f"--policy-device {args.policy_device!r}: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--policy-device {args.policy_device}: this torch ({torch.__version__}) sees no CUDA device")
    repeats = args.repeats or (2 if args.quick else 3)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(args.torch_threads)
    names = args.scenario or [n for n, s in SCENARIOS.items() if args.group in ("all", s.group)]
    report: dict[str, Any] = {"command": "python -m benchmarks " + " ".join(argv if argv is not None else sys.argv[1:]),
                              "quick": args.quick, "machine": machine(), "scenarios": []}
    def write_so_far(entry: dict[str, Any]) -> None:  # the report and table after every contender; no plot
        write_all({**report, "scenarios": [*report["scenarios"], entry]}, args.out, plot=False)

    for name in names:
        report["scenarios"].append(run_scenario(SCENARIOS[name], quick=args.quick, repeats=repeats,
                                                contenders=args.contender, processes=not args.no_processes,
                                                frames_scale=args.frames_scale, interleave=args.interleave,
                                                policy_device=args.policy_device, on_result=write_so_far))
    paths = write_all(report, args.out)
    print("wrote " + ", ".join(paths.values()))
    return report


