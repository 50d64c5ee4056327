"""Lightning's overhead per optimiser step, measured inside one ``Trainer.fit``.

``python -m benchmarks.e2e.lightning_step --algo ppo [--rounds 12] [--env HalfCheetah-v5]``: the example's
LightningModule learns on batches recorded before the clock starts (``recorded_batches``); each training step
after a warm-up one runs the example's ``learn`` twice on the same batch, once as ``training_step`` does
(Lightning's ``LightningOptimizer`` and ``manual_backward``) and once as a loop by hand does (the optimizer it
wraps and ``Tensor.backward``), the order alternating every round. Both run in the same process, Trainer and
moment, so what differs is only what Lightning adds to each optimiser step; a full garbage collection before each
round, outside the timing, keeps Python's collector (a full pass over this process's objects takes about 0.3 s)
from landing in one way's timing at random. Reported: the median seconds an optimiser step each way, and the
median over the rounds of Lightning's step over the plain one, less 1 (the issue's target: at most 10%).

Where ``benchmarks.e2e`` times a whole ``Trainer.fit`` against a whole loop by hand (two processes, collection
included), this isolates the per-step cost; the two differ by what the processes do besides (see
``docs/training.rst``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import statistics
import tempfile
import time
from typing import Any

import lightning.pytorch as pl
import torch

from .common import ALGOS, RunSpec, example, example_config, recorded_batches

__all__ = ["main", "measure"]


def measure(algo: str, *, rounds: int = 12, seed: int = 0, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Seconds an optimiser step of ``algo``'s example learner through Lightning and by hand, ``rounds`` interleaved
    rounds in one ``Trainer.fit`` (with the caller's torch threads; the command line sets one, as the examples);
    returns their medians, and ``overhead``: the median over the rounds of the Lightning step over the plain one,
    less 1."""
    if rounds < 2:
        raise ValueError(f"rounds must be >= 2 (one of each order), got {rounds}")
    pl.seed_everything(seed, verbose=False)
    ex = example(algo)
    with tempfile.TemporaryDirectory(prefix="lightning-step-") as out:
        cfg = example_config(RunSpec(algo, "ours", seed, dict(overrides or {})), out=out)
        if algo == "sac":  # every batch after the warm-up round's first is due its gradient steps
            cfg = dataclasses.replace(cfg, learning_starts=cfg.frames_per_batch)
        model = getattr(ex, algo.upper())(*ex.env_dims(cfg.env), cfg)
        batches = recorded_batches(cfg, model.actor, frames_per_batch=cfg.frames_per_batch, count=4,
                                   layout=ex.make_datamodule(cfg).layout, seed=seed)
        times: dict[str, list[float]] = {"lightning": [], "plain": []}

        def training_step(module: Any, batch: Any, batch_idx: int) -> None:
            ways = {"lightning": (module.optimizers(), module.manual_backward),
                    "plain": (module.optimizers().optimizer, torch.Tensor.backward)}
            gc.collect()
            for way in sorted(ways, reverse=batch_idx % 2 == 1):
                before, started = module.updates_done, time.perf_counter()
                module.learn(batch.clone(), *ways[way])
                if batch_idx > 0:  # the first round warms up (and fills SAC's buffer past learning_starts)
                    times[way].append((time.perf_counter() - started) / (module.updates_done - before))

        measured = type(f"Measured{algo.upper()}", (type(model),), {"training_step": training_step})
        model.__class__ = measured
        loader = _Batches([batches[i % len(batches)] for i in range(rounds + 1)])
        pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, accelerator="cpu").fit(model, train_dataloaders=loader)
    lightning, plain = statistics.median(times["lightning"]), statistics.median(times["plain"])
    overhead = statistics.median(a / b - 1.0 for a, b in zip(times["lightning"], times["plain"]))
    return {"algo": algo, "env": cfg.env, "rounds": len(times["plain"]), "lightning_step_s": lightning,
            "plain_step_s": plain, "overhead": overhead, "overhead_per_step_s": overhead * plain, "times": times}


class _Batches:
    """The batches as one loader (Lightning reads a plain list as a list of loaders)."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __iter__(self) -> Any:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.e2e.lightning_step", description=__doc__.split("\n")[0])
    parser.add_argument("--algo", choices=sorted(ALGOS), default="ppo")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--env", default=None, help="the example's env by default (HalfCheetah-v5)")
    parser.add_argument("--json", action="store_true", help="print the record as JSON")
    args = parser.parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    result = measure(args.algo, rounds=args.rounds, seed=args.seed,
                     overrides={"env": args.env} if args.env else None)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.algo} on {result['env']}, {result['rounds']} rounds: an optimiser step "
          f"{result['lightning_step_s'] * 1e6:,.0f} us through Lightning, {result['plain_step_s'] * 1e6:,.0f} us "
          f"by hand (medians); Lightning's overhead, paired by round: {result['overhead']:+.1%} "
          f"({result['overhead_per_step_s'] * 1e6:+,.0f} us a step)")


if __name__ == "__main__":
    main()
