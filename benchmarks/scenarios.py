"""The benchmark scenarios: workload, contenders, frame counts and the targets to reach.

Contender names starting with ``threaded`` are ours (``lightning_rollout``);
the others are the peers. Frame counts are the full run's; ``--quick`` uses
``quick_batches`` small batches instead, so every scenario takes seconds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import contenders as c
from .envs import CARTPOLE, GIL_BOUND, SLEEP, STRAGGLER, measure_step_time

__all__ = ["SCENARIOS", "Scenario", "Target", "lightning_available"]

Builder = Callable[[c.Workload], c.Session]



def _threaded(**kwargs: Any) -> Builder:
    return functools.partial(c.threaded, **kwargs)


PEERS: dict[str, Builder] = {
    "torchrl Collector(SerialEnv)": c.torchrl_serial,
    "torchrl Collector(ParallelEnv)": c.torchrl_parallel,
    "torchrl MultiSyncCollector": c.torchrl_multisync,
    "torchrl AsyncBatchedCollector(threading)": c.torchrl_async_batched,
    "gym SyncVectorEnv loop": c.gym_sync,
    "gym AsyncVectorEnv loop": c.gym_async,
}
NEXT_STEP = "gym SyncVectorEnv loop (NEXT_STEP autoreset)"  # reset steps counted as frames: see contenders.gym_sync
# Peers that start worker processes (slow to start; ``--no-processes`` leaves them out).
PROCESS_CONTENDERS = {"torchrl Collector(ParallelEnv)", "torchrl MultiSyncCollector", "gym AsyncVectorEnv loop",
                      "threaded num_workers=2 ept=8", *(f"threaded num_workers={w}" for w in (2, 4, 8, 16))}
# No collector: a helper thread per env and the batched policy in one loop (benchmarks/helper_threads.py). The
# GIL-releasing scenarios run them so that their ideal-based targets are read against what threads reach on the
# same machine in the same run (docs/performance.rst).
# Free-running, the gather that suits each env best: 50 us on the stragglers, none on the 2 ms env.
HELPER_CEILING: dict[str, Builder] = {
    "helper threads lock-step (no collector)": functools.partial(c.helper_threads, free=False),
    "helper threads free, 50 us gather (no collector)": functools.partial(c.helper_threads, free=True, gather_s=50e-6),
    "helper threads free, no gather (no collector)": functools.partial(c.helper_threads, free=True, gather_s=0.0),
}
LOCK_STEP = ["gym SyncVectorEnv loop", "torchrl Collector(SerialEnv)", "torchrl Collector(ParallelEnv)"]


@dataclass(frozen=True)
class Target:
    """``value(ours) / value(peer) >= minimum``; ``ours`` may list several (the best counts).

    ``peer`` is a contender name, or ``"ideal"`` (the scenario's ``ideal_steps_per_s``).
    ``metric`` is ``"median"`` or ``"mean_flush_batch"`` (then ``peer`` is ``"num_envs"``).
    """

    label: str
    ours: tuple[str, ...]
    peer: str
    minimum: float
    metric: str = "median"


@dataclass
class Scenario:
    name: str
    title: str
    env_id: str
    num_envs: int
    frames: int
    steps_per_env_per_batch: int
    contenders: dict[str, Builder]
    targets: list[Target] = field(default_factory=list)
    hidden: tuple[int, ...] = (64, 64)
    track_memory: bool = False
    quick_batches: int = 2
    ideal_from_step_time: bool = False
    requires: Callable[[], str | None] = lambda: None  # a reason to skip, or None
    note: str = ""
    group: str = "core"  # "core": `make bench`; "real": `make bench-real` (the bench-real extra); "scaling"

    def workload(self, quick: bool, policy_device: str = "cpu") -> c.Workload:
        per_env = 2 if quick else self.steps_per_env_per_batch
        return c.Workload(self.env_id, self.num_envs, self.num_envs * per_env, hidden=self.hidden,
                          policy_device=policy_device)

    def frame_count(self, workload: c.Workload, quick: bool) -> int:
        return workload.frames_per_batch * self.quick_batches if quick else self.frames

    def extras(self, quick: bool) -> dict[str, float]:
        """Scenario-level figures measured before the contenders (the ideal of a GIL-releasing env)."""
        if not self.ideal_from_step_time:
            return {}
        step_time = measure_step_time(self.env_id, steps=20 if quick else 300)
        return {"step_time_s": step_time, "ideal_steps_per_s": self.num_envs / step_time}


def lightning_available() -> str | None:
    """None when ``lightning_rollout.lightning.RolloutDataModule`` imports, else why not."""
    try:
        from lightning_rollout import lightning as lr_lightning
    except Exception as exc:  # the package is missing or broken
        return f"lightning_rollout.lightning cannot be imported ({type(exc).__name__}: {exc})"
    if not hasattr(lr_lightning, "RolloutDataModule"):
        return "lightning_rollout.lightning has no RolloutDataModule yet"
    return None


def real_envs_available() -> str | None:
    """None when the bench-real extra (MuJoCo, ALE, envpool) is installed, else what is missing."""
    missing = []
    for module in ("mujoco", "ale_py", "envpool"):
        try:
            __import__(module)
        except Exception:
            missing.append(module)
    return f"not installed: {', '.join(missing)} (pip install -e '.[bench-real]')" if missing else None


AUTO = "threaded auto (defaults)"
_ALL_OURS_CHEAP = {
    AUTO: _threaded(envs_per_thread="auto", num_workers="auto"),
    "threaded env_time": _threaded(),
    "threaded flat": _threaded(layout="flat"),
    "threaded env_time ept=4": _threaded(envs_per_thread=4),
    "threaded env_time ept=8": _threaded(envs_per_thread=8),
    "threaded flat ept=8 off-policy": _threaded(layout="flat", envs_per_thread=8, on_policy=False),
}
_REAL_OURS = (AUTO, "threaded ept=16", "threaded ept=1", "threaded num_workers=2", "threaded num_workers=2 ept=8")
_OURS_GIL = {
    AUTO: _threaded(envs_per_thread="auto", num_workers="auto"),
    "threaded env_time": _threaded(),
    "threaded flat": _threaded(layout="flat"),
    "threaded flat max_wait=0.5ms": _threaded(layout="flat", max_wait=0.0005),
    "threaded flat autobatch=4 off-policy": _threaded(layout="flat", autobatch_size=4, on_policy=False),
    "threaded free ept=16": _threaded(envs_per_thread=16, parallel_steps="free"),
}


SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario(
        "cheap", "Cheap env: CartPole, MLP 4-64-64-2, 8 envs", CARTPOLE, 8, 100_000, 128,
        {**_ALL_OURS_CHEAP, **PEERS, NEXT_STEP: c.gym_sync_next_step},
        [Target(">= 10x AsyncBatchedCollector(threading)", tuple(_ALL_OURS_CHEAP),
                "torchrl AsyncBatchedCollector(threading)", 10.0),
         Target(">= 5x Collector(SerialEnv)", tuple(_ALL_OURS_CHEAP), "torchrl Collector(SerialEnv)", 5.0),
         Target(">= 0.5x SyncVectorEnv loop (aim 0.8x)", tuple(_ALL_OURS_CHEAP), "gym SyncVectorEnv loop", 0.5),
         Target("defaults >= 0.8x SyncVectorEnv loop", (AUTO,), "gym SyncVectorEnv loop", 0.8)]),
    Scenario(
        "gil", "GIL-releasing env: step sleeps 2 ms, 16 envs", SLEEP, 16, 16_000, 64,
        {**_OURS_GIL, **PEERS, **HELPER_CEILING},
        [Target(">= 0.85x ideal num_envs / step_time", tuple(_OURS_GIL), "ideal", 0.85),
         Target("ahead of AsyncVectorEnv", tuple(_OURS_GIL), "gym AsyncVectorEnv loop", 1.0)],
        ideal_from_step_time=True),
    Scenario(
        "stragglers", "Stragglers: Pareto(2) step time, mean 1 ms, 16 envs", STRAGGLER, 16, 16_000, 64,
        {**_OURS_GIL, **{k: PEERS[k] for k in (*LOCK_STEP, "gym AsyncVectorEnv loop")}, **HELPER_CEILING},
        [*(Target(f">= 2x {peer}", tuple(_OURS_GIL), peer, 2.0) for peer in LOCK_STEP),
         Target(">= 0.6x ideal num_envs / step_time", tuple(_OURS_GIL), "ideal", 0.6)],
        ideal_from_step_time=True),
    Scenario(
        "heavy_policy", "Heavy policy: MLP 4-1024-1024-1024-2, CartPole, 32 envs", CARTPOLE, 32, 16_384, 32,
        {AUTO: _threaded(envs_per_thread="auto", num_workers="auto"),
         "threaded env_time": _threaded(),
         "threaded env_time autobatch=1": _threaded(autobatch_size=1),
         "threaded flat ept=8 off-policy": _threaded(layout="flat", envs_per_thread=8, on_policy=False),
         "gym SyncVectorEnv loop": c.gym_sync,
         NEXT_STEP: c.gym_sync_next_step,
         "torchrl Collector(SerialEnv)": c.torchrl_serial},
        [Target(">= 4x autobatch_size=1", ("threaded env_time",), "threaded env_time autobatch=1", 4.0),
         Target(">= 0.9x SyncVectorEnv loop", (AUTO, "threaded env_time", "threaded flat ept=8 off-policy"),
                "gym SyncVectorEnv loop", 0.9),
         Target("mean flush batch >= 0.8 x num_envs", ("threaded env_time",), "num_envs", 0.8,
                metric="mean_flush_batch")],
        hidden=(1024, 1024, 1024)),
    Scenario(
        "gil_bound", "GIL-bound env: each step runs 100 us of pure Python, 16 envs", GIL_BOUND, 16, 16_000, 32,
        {AUTO: _threaded(envs_per_thread="auto", num_workers="auto"),
         "threaded ept=16": _threaded(envs_per_thread=16),
         "threaded num_workers=2": _threaded(num_workers=2, envs_per_thread="auto"),
         "threaded num_workers=2 ept=8": _threaded(num_workers=2, envs_per_thread=8),
         **{k: PEERS[k] for k in ("gym SyncVectorEnv loop", "gym AsyncVectorEnv loop", "torchrl MultiSyncCollector")}},
        [Target(">= 1.6x one process (best threads config)", ("threaded num_workers=2", "threaded num_workers=2 ept=8"),
                "threaded ept=16", 1.6),
         Target(">= 1.5x AsyncVectorEnv loop", ("threaded num_workers=2", "threaded num_workers=2 ept=8"),
                "gym AsyncVectorEnv loop", 1.5),
         Target("defaults >= 0.9x best", (AUTO,), "threaded num_workers=2", 0.9)]),
    *[Scenario(
        name, f"{env_id}, 16 envs, small MLP (real env; bench-real extra)", env_id, 16, frames, 32,
        {AUTO: _threaded(envs_per_thread="auto", num_workers="auto"),
         "threaded ept=16": _threaded(envs_per_thread=16),
         "threaded ept=1": _threaded(envs_per_thread=1),
         "threaded num_workers=2": _threaded(num_workers=2, envs_per_thread="auto"),
         "threaded num_workers=2 ept=8": _threaded(num_workers=2, envs_per_thread=8),
         "threaded envpool 2x8": c.threaded_envpool,
         "envpool sync": c.envpool_sync,
         "envpool async (batch 8)": c.envpool_async,
         **{k: PEERS[k] for k in ("gym SyncVectorEnv loop", "gym AsyncVectorEnv loop", "torchrl MultiSyncCollector")}},
        [Target(f">= {a:g}x envpool async", tuple(_REAL_OURS), "envpool async (batch 8)", a),
         Target(f">= {b:g}x SyncVectorEnv loop", tuple(_REAL_OURS), "gym SyncVectorEnv loop", b),
         Target("defaults >= 0.9x our best", (AUTO,), "threaded num_workers=2", 0.9)],
        requires=real_envs_available, group="real")
      for name, env_id, frames, a, b in (("halfcheetah", "HalfCheetah-v5", 32_000, 0.8, 1.2),
                                         ("pong", "ALE/Pong-v5", 16_000, 1.0, 1.3))],
    *[Scenario(
        name, f"Scaling: GIL-bound env (100 us of pure Python a step), {n} envs, over 1-16 processes",
        GIL_BOUND, n, frames, per_env,
        {AUTO: _threaded(envs_per_thread="auto", num_workers="auto"),
         **{f"threaded num_workers={w}": _threaded(num_workers=w, envs_per_thread=n // w)
            for w in (1, 2, 4, 8, 16)},
         **{k: PEERS[k] for k in ("gym AsyncVectorEnv loop", "torchrl MultiSyncCollector")}},
        group="scaling",
        note="Checks the projection in docs/performance.rst (a step costs about env / w + the main process's "
             "serial part): run it on a machine with 16 or more cores (`python -m benchmarks --group scaling`).")
      for name, n, frames, per_env in (("scaling", 16, 32_000, 32), ("scaling64", 64, 64_000, 16))],
    Scenario(
        "lightning", "Lightning overhead: Trainer.fit + RolloutDataModule vs plain loop, CartPole, 8 envs",
        CARTPOLE, 8, 51_200, 128,
        {"threaded Trainer.fit(RolloutDataModule)": c.lightning_fit,
         "plain loop over ThreadedCollector": c.plain_training_loop},
        [Target("at most 10% slower than the plain loop", ("threaded Trainer.fit(RolloutDataModule)",),
                "plain loop over ThreadedCollector", 0.9)],
        requires=lightning_available,
        note="each run builds its collector (and Trainer) afresh: setup is part of the figure for both"),
    Scenario(
        "one_env", "One TorchRL env: Pendulum with PPO's transforms, TanhNormal actor on MLP 3-64-64-1",
        "Pendulum-v1", 1, 6_144, 2048,
        {AUTO: c.threaded_one_env, "torchrl Collector": c.torchrl_one_env},
        [Target(">= 1.0x Collector", (AUTO,), "torchrl Collector", 1.0)],
        note="TorchRL's sota PPO MuJoCo collection (one GymEnv with VecNorm, ClipTransform, RewardSum, "
             "StepCounter; a ProbabilisticActor; 2,048 frames a batch) on an env of the base install; both "
             "collectors get the env instance, the actor and the script's options"),
    Scenario(
        "scale", "Scale: 128 CartPole envs in threads (peak RSS of the process tree)", CARTPOLE, 128, 65_536, 16,
        {"threaded env_time": _threaded(),
         "threaded env_time ept=16": _threaded(envs_per_thread=16),
         "torchrl AsyncBatchedCollector(threading)": c.torchrl_async_batched,
         "gym SyncVectorEnv loop": c.gym_sync},
        track_memory=True),
]}
