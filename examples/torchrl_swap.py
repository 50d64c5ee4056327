"""A plain TorchRL PPO loop (no Lightning) where only the collector line changes.

Written the way TorchRL's PPO tutorial writes it: env with transforms, a
`ProbabilisticActor` and a `ValueOperator`, `GAE`, `ClipPPOLoss`, a replay
buffer of the current batch for minibatches, `collector.update_policy_weights_()`
after each update. The single difference between the two runs is the line that
builds the collector:

    collector = Collector(make_env(), actor, frames_per_batch=..., total_frames=...)
    collector = ThreadedCollector(make_env, actor, frames_per_batch=..., total_frames=..., num_envs=8)

    python examples/torchrl_swap.py --collector both --frames 50000
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.data.replay_buffers.samplers import SamplerWithoutReplacement
from torchrl.envs import GymEnv, RewardSum, StepCounter, TransformedEnv
from torchrl.modules import ProbabilisticActor, ValueOperator
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

from lightning_rollout import ThreadedCollector


def make_env() -> TransformedEnv:
    env = TransformedEnv(GymEnv("CartPole-v1"), StepCounter())
    env.append_transform(RewardSum())
    return env


def train(which: str, *, frames: int, frames_per_batch: int, num_envs: int, seed: int) -> dict:
    torch.manual_seed(seed)
    env = make_env()
    hidden = 64
    actor = ProbabilisticActor(
        TensorDictModule(nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 2)),
                         in_keys=["observation"], out_keys=["logits"]),
        in_keys=["logits"], distribution_class=torch.distributions.OneHotCategorical, return_log_prob=True,
        spec=env.action_spec)
    critic = ValueOperator(nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1)),
                           in_keys=["observation"])

    # ---------------------------------------------------------------- the one line that differs
    if which == "torchrl":
        collector = Collector(env, actor, frames_per_batch=frames_per_batch, total_frames=frames)
    else:
        collector = ThreadedCollector(make_env, actor, frames_per_batch=frames_per_batch, total_frames=frames,
                                      num_envs=num_envs, seed=seed)
    # ----------------------------------------------------------------------------------------------

    advantage = GAE(gamma=0.99, lmbda=0.95, value_network=critic, average_gae=True)
    loss_module = ClipPPOLoss(actor, critic, clip_epsilon=0.2, entropy_coeff=0.01, critic_coeff=0.5,
                              loss_critic_type="l2")
    optimizer = torch.optim.Adam(loss_module.parameters(), lr=3e-4)
    buffer = ReplayBuffer(storage=LazyTensorStorage(frames_per_batch), sampler=SamplerWithoutReplacement(),
                          batch_size=frames_per_batch // 4)

    collect_seconds, start, returns = 0.0, time.perf_counter(), []
    t0 = time.perf_counter()
    for data in collector:
        collect_seconds += time.perf_counter() - t0
        done = data["next", "done"]
        if done.any():
            returns.append(data["next", "episode_reward"][done].float().mean().item())
        for _ in range(4):  # PPO epochs
            with torch.no_grad():
                advantage(data)
            buffer.extend(data.reshape(-1))
            for _ in range(4):
                losses = loss_module(buffer.sample())
                loss = losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"]
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(loss_module.parameters(), 1.0)
                optimizer.step()
        collector.update_policy_weights_()
        t0 = time.perf_counter()
    collector.shutdown()
    return {"collector": which, "frames": frames, "collect_fps": round(frames / collect_seconds),
            "total_seconds": round(time.perf_counter() - start, 1),
            "last_train_return": round(returns[-1], 1) if returns else None}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collector", choices=["torchrl", "threaded", "both"], default="both")
    parser.add_argument("--frames", type=int, default=50_000)
    parser.add_argument("--frames-per-batch", type=int, default=1_024)
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    which = ["torchrl", "threaded"] if args.collector == "both" else [args.collector]
    results = [train(w, frames=args.frames, frames_per_batch=args.frames_per_batch, num_envs=args.num_envs,
                     seed=args.seed) for w in which]
    for r in results:
        print(f"{r['collector']:>9}: {r['collect_fps']:>7} frames/s collecting, {r['total_seconds']} s in all, "
              f"last training return {r['last_train_return']}")
    if len(results) == 2:
        print(f"ThreadedCollector / Collector collection speed: {results[1]['collect_fps'] / results[0]['collect_fps']:.1f}x")
    print("RESULT " + json.dumps(results))
    return results


if __name__ == "__main__":
    main()
