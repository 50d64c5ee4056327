"""Soak test: does memory stay flat over a long collection?

Collects ``--frames`` frames of ``CartPole-v1`` with ``--envs`` envs through a
:class:`~lightning_rollout.ThreadedCollector` (double batching, a small MLP, a
weight update every ``--update-every`` batches), samples the process's resident
set size (RSS, ``psutil``) every ``--every`` frames after a ``gc.collect()``, prints
a table and writes a JSON report. The figure of merit is the RSS growth between the
end of the warm-up (``--warmup`` frames, by default two samples) and the end of the
run, in percent of the warm-up RSS; the target is below 5 %.

Usage::

    python -m benchmarks.soak --frames 2000000 --envs 16
    python benchmarks/soak.py --frames 60000 --envs 16 --every 10000 --json /tmp/soak.json

Only ``lightning_rollout``, gymnasium, torch and psutil are used; nothing from the
rest of ``benchmarks/``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil
import torch

from lightning_rollout import ThreadedCollector

TARGET_GROWTH_PCT = 5.0


class _Policy(torch.nn.Module):
    """A small MLP acting greedily: ``obs[B, 4] -> action[B]``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs).argmax(-1)


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def run_soak(frames: int = 2_000_000, envs: int = 16, every: int = 100_000, warmup: int | None = None,
             envs_per_thread: int = 4, frames_per_batch: int | None = None, update_every: int = 10,
             env: str = "CartPole-v1", verbose: bool = True) -> dict[str, Any]:
    """Run the soak and return the report (see the module docs)."""
    if frames < every or every <= 0:
        raise ValueError(f"frames ({frames}) must be >= every ({every}) > 0")
    if envs % envs_per_thread:
        envs_per_thread = 1
    frames_per_batch = frames_per_batch or envs * max(1, min(100, every // envs))
    warmup = 2 * every if warmup is None else warmup
    torch.set_num_threads(1)  # one inference stream; env threads take the other cores
    policy = _Policy()
    collector = ThreadedCollector(env, policy, num_envs=envs, envs_per_thread=envs_per_thread,
                                  frames_per_batch=frames_per_batch, total_frames=-1, on_policy=False,
                                  seed=0, name="soak")
    samples: list[dict[str, float]] = [{"frames": 0, "rss": _rss(), "seconds": 0.0}]
    next_sample = every
    t0 = time.perf_counter()
    collected = 0
    batches = 0
    try:
        for batch in collector:
            collected += batch.numel()
            batches += 1
            del batch
            if update_every and batches % update_every == 0:
                with torch.no_grad():
                    policy.net[0].weight.mul_(0.999)
                collector.update_policy_weights_()
            if collected >= next_sample:
                samples.append({"frames": collected, "rss": _rss(), "seconds": time.perf_counter() - t0})
                if verbose:
                    s = samples[-1]
                    print(f"  {s['frames']:>10,d} frames  {s['rss'] / 2**20:8.1f} MiB  "
                          f"{s['frames'] / max(s['seconds'], 1e-9):8.0f} frames/s", flush=True)
                next_sample += every
            if collected >= frames:
                break
    finally:
        collector.shutdown()
    elapsed = time.perf_counter() - t0

    base = next((s for s in samples if s["frames"] >= warmup), samples[-1])
    after = [s for s in samples if s["frames"] >= base["frames"]]
    final = samples[-1]
    growth = 100.0 * (final["rss"] - base["rss"]) / base["rss"]
    peak_growth = 100.0 * (max(s["rss"] for s in after) - base["rss"]) / base["rss"]
    return {
        "frames": collected,
        "envs": envs,
        "envs_per_thread": envs_per_thread,
        "frames_per_batch": frames_per_batch,
        "env": env,
        "every": every,
        "warmup_frames": base["frames"],
        "seconds": elapsed,
        "frames_per_second": collected / elapsed if elapsed else 0.0,
        "rss_warmup_mib": base["rss"] / 2**20,
        "rss_final_mib": final["rss"] / 2**20,
        "rss_growth_pct": growth,
        "rss_peak_growth_pct": peak_growth,
        "target_growth_pct": TARGET_GROWTH_PCT,
        "passed": growth < TARGET_GROWTH_PCT,
        "samples": [{"frames": s["frames"], "rss_mib": s["rss"] / 2**20, "seconds": s["seconds"]} for s in samples],
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                    "platform": platform.platform()},
    }


def format_table(report: dict[str, Any]) -> str:
    base = report["rss_warmup_mib"]
    lines = [f"{'frames':>12} {'RSS MiB':>10} {'vs warm-up':>11} {'frames/s':>10}"]
    for s in report["samples"]:
        rate = s["frames"] / s["seconds"] if s["seconds"] else 0.0
        delta = 100.0 * (s["rss_mib"] - base) / base if s["frames"] >= report["warmup_frames"] else float("nan")
        lines.append(f"{s['frames']:>12,d} {s['rss_mib']:>10.1f} {delta:>10.2f}% {rate:>10.0f}")
    lines.append(f"RSS growth after warm-up ({report['warmup_frames']:,d} frames): {report['rss_growth_pct']:+.2f}% "
                 f"(peak {report['rss_peak_growth_pct']:+.2f}%), target < {report['target_growth_pct']:.0f}% -> "
                 f"{'PASS' if report['passed'] else 'FAIL'}; {report['frames_per_second']:.0f} frames/s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=2_000_000)
    parser.add_argument("--envs", type=int, default=16)
    parser.add_argument("--every", type=int, default=100_000, help="sample RSS every this many frames")
    parser.add_argument("--warmup", type=int, default=None, help="frames before the baseline (default: 2 samples)")
    parser.add_argument("--envs-per-thread", type=int, default=4)
    parser.add_argument("--frames-per-batch", type=int, default=None)
    parser.add_argument("--update-every", type=int, default=10, help="batches between weight updates (0: never)")
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--json", default="soak.json", help="where to write the report")
    args = parser.parse_args(argv)
    report = run_soak(args.frames, args.envs, args.every, args.warmup, args.envs_per_thread, args.frames_per_batch,
                      args.update_every, args.env)
    print(format_table(report))
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    print(f"report written to {args.json}")
    return report


if __name__ == "__main__":
    main()
