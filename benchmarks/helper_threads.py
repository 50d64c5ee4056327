"""The ceiling of helper threads on two cores: 16 GIL-releasing envs, one helper thread each, no collector.

``python -m benchmarks.helper_threads [--env sleep|stragglers] [--policy]``

Each helper steps its env when its lock is released and reports on a queue; the owner either releases all
and waits for all (``lock-step``), or gives each env its next step as soon as its last one ended (``free``,
gathering the envs that ended together). With ``--policy`` the owner runs the benchmarks' small MLP on the
envs it answers, as the collector's block thread does. What is left between these figures and the ideal
``num_envs / step_time`` is the GIL hand-offs of the helpers (gymnasium's wrappers run in Python before and
after each wait) and of the policy's forward pass (each torch op releases the GIL, and a helper waking
meanwhile takes it). ``docs/performance.rst`` compares them with the collector's.
"""

from __future__ import annotations

import argparse
import queue
import threading
import time

import gymnasium as gym
import numpy as np
import torch

from .contenders import GreedyActor, make_mlp
from .envs import SLEEP, STRAGGLER, measure_step_time


def run(env_id: str, *, free: bool, policy: bool, num_envs: int = 16, steps: int = 6400) -> float:
    """Steps per second of ``num_envs`` envs of ``env_id`` stepped by helper threads."""
    envs = [gym.make(env_id) for _ in range(num_envs)]
    obs = np.stack([env.reset(seed=i)[0] for i, env in enumerate(envs)])
    actor = GreedyActor(make_mlp((64, 64), obs_dim=obs.shape[1], n_actions=2), one_hot=False)
    go = [threading.Lock() for _ in envs]
    for lock in go:
        lock.acquire()
    actions, results = [0] * num_envs, [None] * num_envs
    done: queue.SimpleQueue[int] = queue.SimpleQueue()
    closing = False

    def serve(j: int) -> None:
        while True:
            go[j].acquire()
            if closing:
                return
            results[j] = envs[j].step(actions[j])
            done.put(j)

    helpers = [threading.Thread(target=serve, args=(j,), name=f"helper{j}", daemon=True) for j in range(num_envs)]
    for helper in helpers:
        helper.start()

    def answer(ready: list[int]) -> None:
        for j in ready:
            obs[j] = results[j][0]
        if policy:
            with torch.no_grad():
                chosen = actor(torch.from_numpy(obs)).numpy()
            for j in ready:
                actions[j] = int(chosen[j])
        for j in ready:
            go[j].release()

    start, taken = time.perf_counter(), 0
    if free:
        answer([])
        for lock in go:
            lock.release()
        while taken < steps:
            ready = [done.get()]
            deadline = time.perf_counter() + 0.0005  # gather the envs that end close together
            while len(ready) < num_envs // 2:
                try:
                    ready.append(done.get(timeout=max(0.0, deadline - time.perf_counter())))
                except queue.Empty:
                    break
            taken += len(ready)
            answer(ready)
    else:
        for lock in go:
            lock.release()
        while taken < steps:
            ready = [done.get() for _ in range(num_envs)]
            taken += num_envs
            answer(ready)
    rate = taken / (time.perf_counter() - start)
    for _ in range(num_envs):  # every helper finishes the step it was given, then leaves
        done.get()
    closing = True
    for lock in go:
        lock.release()
    for helper in helpers:
        helper.join(1.0)
    return rate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", choices=["sleep", "stragglers"], default="sleep")
    parser.add_argument("--policy", action="store_true", help="run the small MLP on the envs answered")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    env_id = SLEEP if args.env == "sleep" else STRAGGLER
    ideal = 16 / measure_step_time(env_id, 500)
    for free in (False, True):
        rate = run(env_id, free=free, policy=args.policy)
        print(f"{args.env} {'free' if free else 'lock-step'}{' + policy' if args.policy else ''}: "
              f"{rate:,.0f} steps/s, {rate / ideal:.2f} of the ideal {ideal:,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
