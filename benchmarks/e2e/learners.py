"""The learners alone, interleaved: ``python -m benchmarks.e2e.learners [--algo ppo|sac] [--rounds N] [--out DIR]``.

Every learner of an example (``--learner plain`` and ``torchrl``, each eager and through ``torch.compile``) and
Stable-Baselines3's ``train()`` take the same gradient steps on data recorded before any clock starts: PPO one
batch of the example's size (``num_envs * steps_per_env`` frames, collected with the untrained actor), each
learner updating on it (``epochs`` passes of ``minibatch_size``) once a round; SAC ``--sac-steps`` gradient steps a
round on minibatches drawn from ``--sac-frames`` recorded frames. Stable-Baselines3 learns on its own buffer of the
same size (its ``learn`` fills it first), so its minibatches have the same shapes, not the same values.

Rounds interleave the contenders (the order rotated every round), so that a machine shared with other jobs slows
them alike; each round's time over Stable-Baselines3's in the same round is a ratio, and the report gives the
median of the rounds and their range, in wall time and in the process's CPU time (one intra-op thread: CPU time
counts only this process's work, which another job on the machine changes less). A learner's first call
(``torch.compile``'s compilation included) is timed apart as its warm-up.

Writes ``results.json`` and ``table.md`` in ``--out`` (``docs/bench/e2e/learners`` holds a recorded run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from .common import RunSpec, example, example_config, recorded_batches

__all__ = ["VARIANTS", "main", "measure", "markdown"]

# learner variants of the examples: name -> the Config fields it sets
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {"learner": "plain", "compile": False},
    "plain-compiled": {"learner": "plain", "compile": True},
    "torchrl": {"learner": "torchrl", "compile": False},
    "torchrl-compiled": {"learner": "torchrl", "compile": True},
}
SB3 = "sb3"


def _ppo_contenders(cfg: Any, variants: list[str]) -> tuple[dict[str, Callable[[], None]], int]:
    """``{name: one round's work}`` for PPO, and the gradient steps a round takes."""
    ex = example("ppo")
    dims = ex.env_dims(cfg.env)
    probe = ex.PPO(*dims, cfg)
    batch = recorded_batches(cfg, probe.actor, frames_per_batch=cfg.frames_per_batch, count=1, layout="env_time",
                             seed=cfg.seed)[0]
    work: dict[str, Callable[[], None]] = {}
    for name in variants:
        torch.manual_seed(cfg.seed)
        model = ex.PPO(*dims, dataclasses.replace(cfg, **VARIANTS[name]))
        model.load_state_dict(probe.state_dict(), strict=False)  # the weights that acted: the ratio starts at 1
        optimizer = model.configure_optimizers()
        work[name] = lambda model=model, optimizer=optimizer: model.learn(batch.clone(), optimizer)
    model = _sb3_ppo(cfg)
    model.learn(total_timesteps=cfg.frames_per_batch)  # fills the rollout buffer (and trains once)
    work[SB3] = model.train
    steps = cfg.epochs * -(-cfg.frames_per_batch // cfg.minibatch_size)
    return work, steps


def _sb3_ppo(cfg: Any) -> Any:
    from .contenders import _sb3_model

    return _sb3_model(RunSpec("ppo", "sb3", cfg.seed), cfg)[0]


def _sac_contenders(cfg: Any, variants: list[str], *, frames: int, steps: int) -> dict[str, Callable[[], None]]:
    """``{name: one round's work}`` for SAC: ``steps`` gradient steps on ``frames`` recorded frames."""
    from .contenders import _sb3_model

    ex = example("sac")
    dims = ex.env_dims(cfg.env)
    cfg = dataclasses.replace(cfg, frames=frames, learning_starts=frames)
    probe = ex.SAC(*dims, cfg)
    data = recorded_batches(cfg, probe.actor, frames_per_batch=frames, count=1, layout="flat", seed=cfg.seed)[0]
    work: dict[str, Callable[[], None]] = {}
    for name in variants:
        torch.manual_seed(cfg.seed)
        model = ex.SAC(*dims, dataclasses.replace(cfg, **VARIANTS[name]))
        model.learn(data, optimizer := model.configure_optimizers())  # fills the buffer, no step due yet

        def run(model: Any = model, optimizer: Any = optimizer) -> None:
            for _ in range(steps):
                model.learner.step(model.buffer.sample(), optimizer, torch.Tensor.backward)

        work[name] = run
    model = _sb3_model(RunSpec("sac", "sb3", cfg.seed), cfg)[0]
    model.learn(total_timesteps=frames)  # random frames into its buffer, no gradient step yet
    work[SB3] = lambda: model.train(gradient_steps=steps, batch_size=cfg.batch_size)
    return work


def measure(work: dict[str, Callable[[], None]], *, steps: int, rounds: int) -> dict[str, Any]:
    """Warm each contender up once, then ``rounds`` interleaved rounds (order rotated each round); per
    contender: warm-up seconds, ms per gradient step (wall and CPU) of each round, and each round's ratio to
    Stable-Baselines3 (its time over theirs: below 1 is faster)."""
    names = list(work)
    out: dict[str, Any] = {n: {"warmup_s": 0.0, "wall_ms": [], "cpu_ms": []} for n in names}
    for n in names:
        start = time.perf_counter()
        work[n]()
        out[n]["warmup_s"] = round(time.perf_counter() - start, 2)
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            wall, cpu = time.perf_counter(), time.process_time()
            work[n]()
            out[n]["wall_ms"].append((time.perf_counter() - wall) / steps * 1e3)
            out[n]["cpu_ms"].append((time.process_time() - cpu) / steps * 1e3)
    for n in names:
        for clock in ("wall", "cpu"):
            mine, theirs = out[n][f"{clock}_ms"], out[SB3][f"{clock}_ms"]
            ratios = [a / b for a, b in zip(mine, theirs)]
            out[n][f"{clock}_median_ms"] = statistics.median(mine)
            out[n][f"{clock}_ratio"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def markdown(report: dict[str, Any]) -> str:
    """``table.md``: a table per algorithm (ms per gradient step, ratios to Stable-Baselines3)."""
    m = report["machine"]
    lines = ["# The learners alone, interleaved", "",
             f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, shared with other jobs; torch "
             f"{m.get('torch', '?')}, one intra-op thread; torchrl {m.get('torchrl', '?')}, stable-baselines3 "
             f"{m.get('stable_baselines3', '?')}.", f"Command: `{report['command']}`", ""]
    for algo, res in report["results"].items():
        lines += [f"## {algo.upper()}: {res['what']}", "",
                  "| learner | warm-up (s) | ms/step, wall (median) | / SB3, wall: median (range) "
                  "| ms/step, CPU (median) | / SB3, CPU: median (range) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for name, r in res["learners"].items():
            cells = [name, f"{r['warmup_s']:.1f}"]
            for clock in ("wall", "cpu"):
                q = r[f"{clock}_ratio"]
                cells += [f"{r[f'{clock}_median_ms']:.2f}",
                          f"{q['median']:.2f} ({q['min']:.2f} to {q['max']:.2f})"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from .cli import machine

    parser = argparse.ArgumentParser(prog="python -m benchmarks.e2e.learners", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algo", action="append", choices=["ppo", "sac"], help="repeatable; default: both")
    parser.add_argument("--learner", action="append", choices=list(VARIANTS), help="repeatable; default: all")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ppo-num-envs", type=int, default=1, help="PPO's envs (steps per env: 512 / envs)")
    parser.add_argument("--sac-frames", type=int, default=10_000, help="recorded frames SAC samples from")
    parser.add_argument("--sac-steps", type=int, default=250, help="SAC's gradient steps a round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/e2e/learners", help="output folder (default %(default)s)")
    args = parser.parse_args(argv)
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    variants = args.learner or list(VARIANTS)
    results: dict[str, Any] = {}
    for algo in args.algo or ["ppo", "sac"]:
        overrides = {"num_envs": args.ppo_num_envs, "steps_per_env": 512 // args.ppo_num_envs} if algo == "ppo" else {}
        cfg = example_config(RunSpec(algo, "ours", args.seed, overrides), out="/tmp")
        if algo == "ppo":
            work, steps = _ppo_contenders(cfg, variants)
            what = (f"one batch of {cfg.frames_per_batch} frames ({cfg.num_envs} env(s)), {cfg.epochs} epochs of "
                    f"minibatches of {cfg.minibatch_size}: {steps} gradient steps a round")
        else:
            steps = args.sac_steps
            work = _sac_contenders(cfg, variants, frames=args.sac_frames, steps=steps)
            what = f"{steps} gradient steps a round, minibatches of {cfg.batch_size} from {args.sac_frames} frames"
        torch.set_num_threads(1)  # Stable-Baselines3's constructor may have changed it
        results[algo] = {"what": what, "steps": steps, "learners": measure(work, steps=steps, rounds=args.rounds)}
        print(f"[{algo}] " + ", ".join(f"{n} {r['cpu_median_ms']:.2f} ms CPU/step ({r['cpu_ratio']['median']:.2f}x SB3)"
                                       for n, r in results[algo]["learners"].items()), flush=True)
    report = {"command": "python -m benchmarks.e2e.learners " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": machine(), "results": results}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(markdown(report))
    return report


if __name__ == "__main__":
    main()
