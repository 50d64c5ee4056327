"""One small function per contender: build it for a :class:`Workload`, return a :class:`Session`.

Every contender gets the same env, env count, policy weights and frame count.
A :class:`Session` is built once (setup is not timed), warmed up, then asked
``run(frames)`` once per repetition; it steps until at least ``frames``
transitions were delivered and returns how many were.

Policy: :func:`make_mlp` builds the MLP (``4-64-64-2`` or wider) once per
workload, on the workload's ``policy_device`` (the CPU unless
``--policy-device``). TorchRL-protocol contenders (ours included) get it as a
``TensorDictModule`` actor writing a one-hot greedy ``action`` (torchrl's
CartPole action format); the gymnasium loops call the same weights as a plain
batched callable returning action indices. The ``one_env`` scenario's two collectors get TorchRL's PPO
actor instead (:func:`ppo_actor`: a ``ProbabilisticActor`` sampling a ``TanhNormal`` from the same MLP) over one
TorchRL env with PPO's transforms (:func:`ppo_env`).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
from gymnasium.vector import AutoresetMode
import numpy as np
import torch
from tensordict.nn import TensorDictModule

from . import envs as bench_envs

__all__ = ["GreedyActor", "Session", "Workload", "make_mlp"]


def make_mlp(hidden: tuple[int, ...] = (64, 64), obs_dim: int = 4, n_actions: int = 2, seed: int = 0) -> torch.nn.Module:
    """``obs_dim - hidden... - n_actions`` with tanh, deterministic weights."""
    torch.manual_seed(seed)
    sizes = (obs_dim, *hidden)
    layers: list[torch.nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(sizes[-1], n_actions))
    return torch.nn.Sequential(*layers)


class GreedyActor(torch.nn.Module):
    """``obs -> argmax(net(obs))``, as an index or one-hot; ``tanh(net(obs))`` for a continuous action space.
    Pixel observations are reduced to two features (mean and std of a pixel sample) first, whatever their layout
    (HWC from gymnasium, CHW from envpool). Module-level: picklable for worker processes."""

    def __init__(self, net: torch.nn.Module, one_hot: bool, continuous: bool = False, pixels: bool = False) -> None:
        super().__init__()
        self.net = net
        self.one_hot = one_hot
        self.continuous = continuous
        self.pixels = pixels

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        if self.pixels:  # every 97th pixel: a cheap featurisation (the full frame would cost ms a flush)
            flat = obs.reshape(obs.shape[0], -1)[:, ::97].float() / 255.0
            obs = torch.stack([flat.mean(-1), flat.std(-1)], -1)
        out = self.net(obs.float())
        if self.continuous:
            return torch.tanh(out)
        index = out.argmax(-1)
        if self.one_hot:  # a scatter: F.one_hot checks its indices with two reductions (~30 us a CartPole flush)
            return torch.zeros_like(out, dtype=torch.int64).scatter_(-1, index.unsqueeze(-1), 1)
        return index


@functools.lru_cache(maxsize=None)
def env_shape(env_id: str) -> tuple[int, int, bool, bool]:
    """``(policy input dim, action dim, continuous, pixels)`` of an env, read once from its spaces."""
    env = bench_envs.gym_factory(env_id)()
    obs_space, act_space = env.observation_space, env.action_space
    env.close()
    pixels = len(obs_space.shape) == 3
    continuous = isinstance(act_space, gym.spaces.Box)
    n_actions = int(act_space.shape[0]) if continuous else int(act_space.n)
    return (2 if pixels else int(np.prod(obs_space.shape))), n_actions, continuous, pixels


@dataclass
class Workload:
    """What every contender of one scenario runs."""

    env_id: str
    num_envs: int
    frames_per_batch: int
    hidden: tuple[int, ...] = (64, 64)
    policy_device: str = "cpu"  # where every contender's policy runs ("cuda": ``--policy-device cuda``)
    net: torch.nn.Module = field(init=False)

    def __post_init__(self) -> None:
        obs_dim, n_actions, self.continuous, self.pixels = env_shape(self.env_id)
        self.net = make_mlp(self.hidden, obs_dim=obs_dim, n_actions=n_actions).to(self.policy_device)

    def actor(self, *, torchrl_env: bool = False) -> TensorDictModule:
        """The TorchRL actor (one-hot ``action``, or a continuous one). It reads ``"observation"``, or
        ``"pixels"`` for a pixel env stepped through TorchRL's ``GymEnv`` (which names it so)."""
        key = "pixels" if torchrl_env and self.pixels else "observation"
        return TensorDictModule(GreedyActor(self.net, one_hot=True, continuous=self.continuous, pixels=self.pixels),
                                in_keys=[key], out_keys=["action"])

    def callable_policy(self) -> Callable[[np.ndarray], np.ndarray]:
        """The same weights as a plain batched callable ``obs[N, ...] -> actions[N, ...]`` (indices if discrete)."""
        actor = GreedyActor(self.net, one_hot=False, continuous=self.continuous, pixels=self.pixels)
        device = torch.device(self.policy_device)

        def act(obs: np.ndarray) -> np.ndarray:
            with torch.no_grad():
                return actor(torch.from_numpy(np.asarray(obs))).numpy()

        def act_on_device(obs: np.ndarray) -> np.ndarray:  # observations in, actions back: every step, as ours
            with torch.no_grad():
                return actor(torch.from_numpy(np.asarray(obs)).to(device)).cpu().numpy()

        return act if device.type == "cpu" else act_on_device

    def gym_envs(self) -> list[Callable[[], gym.Env]]:
        return [bench_envs.gym_factory(self.env_id)] * self.num_envs

    def torchrl_envs(self, n: int | None = None) -> list[Callable[[], Any]]:
        return [bench_envs.torchrl_factory(self.env_id)] * (self.num_envs if n is None else n)


@dataclass
class Session:
    """A built contender: ``run(frames) -> frames delivered``; ``stats()`` after runs; ``close()``."""

    run: Callable[[int], int]
    close: Callable[[], None]
    stats: Callable[[], dict[str, float]] = dict


def _collector_session(collector: Any, stats: Callable[[], dict[str, float]] = dict) -> Session:
    """Drive any TorchRL-style iterable collector (endless, ``total_frames=-1``)."""
    batches: Iterator[Any] = iter(collector)

    def run(frames: int) -> int:
        got = 0
        while got < frames:
            got += next(batches).numel()
        return got

    return Session(run, collector.shutdown, stats)


# -- ours ---------------------------------------------------------------------------------------------------
def threaded(w: Workload, *, layout: str = "env_time", envs_per_thread: int | str = 1, num_workers: int | str = 1,
             autobatch_size: int | None = None, max_wait: float | None = None, on_policy: bool = True,
             parallel_steps: bool | str = "auto") -> Session:
    """``lightning_rollout.ThreadedCollector`` over gymnasium envs (``"auto"`` for its default layout)."""
    from lightning_rollout import ThreadedCollector

    collector = ThreadedCollector(w.gym_envs(), w.actor(), frames_per_batch=w.frames_per_batch, total_frames=-1,
                                  envs_per_thread=envs_per_thread, num_workers=num_workers,
                                  parallel_steps=parallel_steps,
                                  autobatch_size=autobatch_size, max_wait=max_wait, layout=layout,
                                  on_policy=on_policy, name="bench")
    policy, loop = collector.autobatch_policy, collector.loop
    return _collector_session(collector, lambda: {"mean_flush_batch": policy.mean_batch_size,
                                                  "num_workers": loop.num_workers,
                                                  "envs_per_thread": loop.envs_per_thread})


# -- torchrl --------------------------------------------------------------------------------------------------
def _devices(w: Workload) -> dict[str, str]:
    """``policy_device`` for TorchRL's collectors when the policy is off the CPU (they cast each step's data to
    it). With a CUDA policy, ``Collector(SerialEnv)`` failed on a device mismatch in the recorded GPU run
    (``docs/performance.rst``, "A GPU and sixteen cores")."""
    return {} if w.policy_device == "cpu" else {"policy_device": w.policy_device}


def torchrl_serial(w: Workload) -> Session:
    """torchrl ``Collector(SerialEnv(num_envs))``."""
    from torchrl.collectors import Collector
    from torchrl.envs import SerialEnv

    env = SerialEnv(w.num_envs, w.torchrl_envs(1)[0])
    return _collector_session(Collector(env, w.actor(torchrl_env=True), frames_per_batch=w.frames_per_batch,
                                        total_frames=-1, **_devices(w)))


def torchrl_parallel(w: Workload) -> Session:
    """torchrl ``Collector(ParallelEnv(num_envs))``: one process per env."""
    from torchrl.collectors import Collector
    from torchrl.envs import ParallelEnv

    env = ParallelEnv(w.num_envs, w.torchrl_envs(1)[0])
    return _collector_session(Collector(env, w.actor(torchrl_env=True), frames_per_batch=w.frames_per_batch,
                                        total_frames=-1, **_devices(w)))


def torchrl_multisync(w: Workload) -> Session:
    """torchrl ``MultiSyncCollector``: one worker process per core, each over a ``SerialEnv`` of its share."""
    from torchrl.collectors import MultiSyncCollector

    workers = max(1, min(w.num_envs, _cores()))
    while w.num_envs % workers:
        workers -= 1
    make = [_SerialFactory(w.num_envs // workers, w.env_id)] * workers
    collector = MultiSyncCollector(make, w.actor(torchrl_env=True), frames_per_batch=w.frames_per_batch,
                                   total_frames=-1, **_devices(w))
    return _collector_session(collector)


class _SerialFactory:
    """Picklable ``SerialEnv(n, env)`` factory for collector worker processes."""

    def __init__(self, n: int, env_id: str) -> None:
        self.n, self.env_id = n, env_id

    def __call__(self) -> Any:
        from torchrl.envs import SerialEnv

        return SerialEnv(self.n, bench_envs.torchrl_factory(self.env_id))


def torchrl_async_batched(w: Workload) -> Session:
    """torchrl ``AsyncBatchedCollector(backend="threading")``: its own threaded autobatcher."""
    from torchrl.collectors import AsyncBatchedCollector

    collector = AsyncBatchedCollector(w.torchrl_envs(), policy=w.actor(torchrl_env=True), frames_per_batch=w.frames_per_batch,
                                      total_frames=-1, max_batch_size=w.num_envs, backend="threading")
    return _collector_session(collector)


# -- envpool (C++ thread pool, same policy in a plain loop) ------------------------------------------------------
def envpool_sync(w: Workload) -> Session:
    """``envpool`` in sync mode (every env each step) + the batched policy in a plain loop."""
    env = bench_envs.envpool_make(w.env_id, w.num_envs)
    return _vector_loop(env, w.callable_policy(), seed=False)


def envpool_async(w: Workload, batch: int | None = None) -> Session:
    """``envpool`` in async mode: act on the first ``batch`` envs done (default half), ``send`` / ``recv``."""
    batch = batch or max(1, w.num_envs // 2)
    env = bench_envs.envpool_make(w.env_id, w.num_envs, batch_size=batch)
    policy = w.callable_policy()
    env.async_reset()

    def run(frames: int) -> int:
        done = 0
        while done < frames:
            obs, _, _, _, info = env.recv()
            env.send(policy(obs), info["env_id"])
            done += len(info["env_id"])
        return done

    return Session(run, env.close)


def threaded_envpool(w: Workload, *, per_env: int = 8) -> Session:
    """``lightning_rollout.ThreadedCollector`` over envpool envs of ``per_env`` envs each, one env thread
    driving each (natively batched blocks): the policy of one batch runs while the other batches step."""
    from lightning_rollout import ThreadedCollector

    factory = functools.partial(bench_envs.envpool_make, w.env_id, per_env)
    collector = ThreadedCollector(factory, w.actor(), num_envs=w.num_envs, frames_per_batch=w.frames_per_batch,
                                  total_frames=-1, name="bench")
    policy, loop = collector.autobatch_policy, collector.loop
    return _collector_session(collector, lambda: {"mean_flush_batch": policy.mean_batch_size,
                                                  "num_workers": loop.num_workers,
                                                  "envs_per_thread": loop.envs_per_thread})


# -- gymnasium + plain loop (the no-collector limit) ------------------------------------------------------------
def _vector_loop(vec: Any, policy: Callable[[np.ndarray], np.ndarray], seed: bool = True) -> Session:
    obs, _ = vec.reset(seed=0) if seed else vec.reset()
    state = {"obs": obs}
    n = getattr(vec, "num_envs", None) or len(obs)

    def run(frames: int) -> int:
        o = state["obs"]
        steps = math.ceil(frames / n)
        for _ in range(steps):
            o, _, _, _, _ = vec.step(policy(o))
        state["obs"] = o
        return steps * n

    return Session(run, vec.close)


def helper_threads(w: Workload, *, free: bool, gather_s: float = 0.0005) -> Session:
    """One helper thread per env and the batched policy in the calling thread, no collector: the ceiling of
    threads for GIL-releasing envs (:class:`benchmarks.helper_threads.HelperThreads`)."""
    from .helper_threads import HelperThreads

    session = HelperThreads([factory() for factory in w.gym_envs()], w.callable_policy(), free=free,
                            gather_s=gather_s)
    return Session(session.run, session.close)


# Every frame a contender reports is a transition. gymnasium's default NEXT_STEP autoreset spends the
# step after each episode's end on the reset, returning no transition (reward 0, the first observation),
# so its loop would count those reset steps as frames (about 1 in 10 with CartPole's short greedy episodes).
# SAME_STEP resets in the step that ends the episode, as our loop and TorchRL's collectors do: the same work
# per frame. The NEXT_STEP loop stays as a contender of its own, so earlier recorded runs can be compared.
def gym_sync(w: Workload) -> Session:
    """gymnasium ``SyncVectorEnv`` (``SAME_STEP`` autoreset: every frame a transition) + the batched policy
    in a plain loop."""
    return _vector_loop(gym.vector.SyncVectorEnv(w.gym_envs(), autoreset_mode=AutoresetMode.SAME_STEP),
                        w.callable_policy())


def gym_sync_next_step(w: Workload) -> Session:
    """gymnasium ``SyncVectorEnv`` with its default ``NEXT_STEP`` autoreset (reset steps counted as frames)."""
    return _vector_loop(gym.vector.SyncVectorEnv(w.gym_envs()), w.callable_policy())


def gym_async(w: Workload) -> Session:
    """gymnasium ``AsyncVectorEnv`` (one process per env, ``SAME_STEP`` autoreset) + the batched policy in a
    plain loop."""
    return _vector_loop(gym.vector.AsyncVectorEnv(w.gym_envs(), autoreset_mode=AutoresetMode.SAME_STEP),
                        w.callable_policy())


# -- one TorchRL env with PPO's transforms, a ProbabilisticActor (TorchRL's sota PPO MuJoCo collection) ----------
def ppo_env(env_id: str) -> Any:
    """TorchRL's ``GymEnv(env_id)`` with the transforms of TorchRL's sota PPO MuJoCo script
    (``sota-implementations/ppo/utils_mujoco.py``, ``make_env``): ``VecNorm`` of the observation, a clip to
    [-10, 10], ``RewardSum``, ``StepCounter``, and ``DoubleToFloat`` when the observation is float64."""
    from torchrl.envs import ClipTransform, DoubleToFloat, GymEnv, RewardSum, StepCounter, TransformedEnv, VecNorm

    env = TransformedEnv(GymEnv(env_id, device="cpu"))
    env.append_transform(VecNorm(in_keys=["observation"], decay=0.99999, eps=1e-2))
    env.append_transform(ClipTransform(in_keys=["observation"], low=-10, high=10))
    env.append_transform(RewardSum())
    env.append_transform(StepCounter())
    if env.observation_spec["observation"].dtype is torch.float64:
        env.append_transform(DoubleToFloat(in_keys=["observation"]))
    return env


def ppo_actor(w: Workload, env: Any) -> Any:
    """The sota script's actor on the workload's MLP: ``loc`` from the MLP, a state-independent ``scale``, a
    ``TanhNormal`` over the env's action bounds, the sample and its log-probability written."""
    from tensordict.nn import AddStateIndependentNormalScale
    from torchrl.envs import ExplorationType
    from torchrl.modules import ProbabilisticActor, TanhNormal

    spec = env.full_action_spec_unbatched
    action = env.action_spec_unbatched
    module = torch.nn.Sequential(w.net, AddStateIndependentNormalScale(action.shape[-1], scale_lb=1e-8))
    return ProbabilisticActor(TensorDictModule(module, in_keys=["observation"], out_keys=["loc", "scale"]),
                              in_keys=["loc", "scale"], spec=spec, distribution_class=TanhNormal,
                              distribution_kwargs={"low": action.space.low, "high": action.space.high,
                                                   "tanh_loc": False},
                              return_log_prob=True, default_interaction_type=ExplorationType.RANDOM)


# The sota script's collector options, given to both collectors (ours takes TorchRL's arguments).
_PPO_COLLECTOR = {"device": "cpu", "max_frames_per_traj": -1, "compile_policy": False, "cudagraph_policy": False}


def torchrl_one_env(w: Workload) -> Session:
    """torchrl ``Collector`` over one :func:`ppo_env` instance with :func:`ppo_actor`, as the sota PPO MuJoCo
    script builds it."""
    from torchrl.collectors import Collector

    if w.num_envs != 1:
        raise ValueError(f"torchrl_one_env steps one env, the workload has {w.num_envs}")
    env = ppo_env(w.env_id)
    return _collector_session(Collector(create_env_fn=env, policy=ppo_actor(w, env),
                                        frames_per_batch=w.frames_per_batch, total_frames=-1, **_PPO_COLLECTOR))


def threaded_one_env(w: Workload) -> Session:
    """``lightning_rollout.ThreadedCollector`` with its defaults, given what :func:`torchrl_one_env` gives
    TorchRL's ``Collector``: the same env instance kind, actor and options."""
    from lightning_rollout import ThreadedCollector

    if w.num_envs != 1:
        raise ValueError(f"threaded_one_env steps one env, the workload has {w.num_envs}")
    env = ppo_env(w.env_id)
    collector = ThreadedCollector(env, ppo_actor(w, env), frames_per_batch=w.frames_per_batch, total_frames=-1,
                                  name="bench", **_PPO_COLLECTOR)
    policy, loop = collector.autobatch_policy, collector.loop
    return _collector_session(collector, lambda: {"mean_flush_batch": policy.mean_batch_size,
                                                  "num_workers": loop.num_workers,
                                                  "envs_per_thread": loop.envs_per_thread})


# -- Lightning overhead: the same training step under Trainer.fit and in a plain loop -----------------------------
def _loss(actor: TensorDictModule, batch: Any) -> torch.Tensor:
    """Behaviour cloning of the collected actions: cheap, and touches every observation."""
    logits = actor.module.net(batch["observation"].reshape(-1, batch["observation"].shape[-1]))
    return torch.nn.functional.cross_entropy(logits, batch["action"].reshape(-1, logits.shape[-1]).argmax(-1))


def plain_training_loop(w: Workload) -> Session:
    """A fresh ``ThreadedCollector`` per run; per batch: push weights, one Adam step."""
    from lightning_rollout import ThreadedCollector

    actor = w.actor()
    optimizer = torch.optim.Adam(actor.parameters(), lr=1e-4)

    def run(frames: int) -> int:
        collector = ThreadedCollector(w.gym_envs(), actor, frames_per_batch=w.frames_per_batch, total_frames=frames,
                                      name="bench-plain")
        try:
            for batch in collector:
                loss = _loss(actor, batch)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                collector.update_policy_weights_(actor)
        finally:
            collector.shutdown()
        return collector.frames

    return Session(run, lambda: None)


def lightning_fit(w: Workload) -> Session:
    """``Trainer.fit`` with ``RolloutDataModule`` (fresh per run), the same step under automatic optimisation."""
    import lightning.pytorch as pl
    from lightning_rollout.lightning import RolloutDataModule

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no banner per Trainer

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.actor = w.actor()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return _loss(self.actor, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.actor.parameters(), lr=1e-4)

    module = Module()

    def run(frames: int) -> int:
        dm = RolloutDataModule(bench_envs.gym_factory(w.env_id), num_envs=w.num_envs,
                               frames_per_batch=w.frames_per_batch, total_frames=frames, log_stats=False)
        trainer = pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, accelerator="cpu", devices=1)
        trainer.fit(module, datamodule=dm)
        return dm.collector.frames

    return Session(run, lambda: None)


def _cores() -> int:
    return len(os.sched_getaffinity(0))
