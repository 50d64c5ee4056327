"""Start-up of worker processes: seconds to build a loop whose envs run in ``num_workers`` processes.

``python -m benchmarks.startup [--num-workers 4] [--repeats 4] [--env CartPole-v1]``

Builds a :class:`~lightning_rollout.MultiEnvLoop` over ``num_workers`` envs, one a process (this process steps the
first), ``repeats`` times in one process, each time timing the construction (the workers started, their envs built
and reset) and a 10-step run, then closes it. The first construction in a process also starts what
multiprocessing keeps for the process's life; the later ones are what a program pays for each loop or collector it
builds after the first (an evaluation collector built on a schedule, a sweep). ``docs/performance.rst`` gives the
figures.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from lightning_rollout import MultiEnvLoop
from lightning_rollout.envs import GymMaker

__all__ = ["main", "measure"]


def _first_action(obs: torch.Tensor) -> torch.Tensor:
    return torch.zeros(obs.shape[0], dtype=torch.int64)


def measure(*, num_workers: int = 4, repeats: int = 4, env: str = "CartPole-v1") -> list[dict[str, float]]:
    """Seconds of each of ``repeats`` constructions of a loop over ``num_workers`` envs in ``num_workers`` processes
    (``"build"``) and of the construction, a 10-step run and the close (``"total"``), in order."""
    if num_workers < 2 or repeats < 1:
        raise ValueError(f"need num_workers >= 2 and repeats >= 1, got {num_workers} and {repeats}")
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        with MultiEnvLoop([GymMaker(env)] * num_workers, _first_action, num_workers=num_workers,
                          envs_per_thread=1) as loop:
            built = time.perf_counter() - started
            loop.run_env_steps(10)
        times.append({"build": built, "total": time.perf_counter() - started})
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__.split("\n")[0])
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--json", action="store_true", help="print the record as JSON")
    args = parser.parse_args(argv)
    times = measure(num_workers=args.num_workers, repeats=args.repeats, env=args.env)
    if args.json:
        print(json.dumps(times))
        return
    print(f"{args.num_workers} worker processes, {args.env}: construction " +
          ", ".join(f"{t['build']:.2f} s" for t in times) + " (in order)")


if __name__ == "__main__":
    main()
