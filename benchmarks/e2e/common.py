"""What every contender of the end-to-end bench shares.

* :class:`RunSpec`: one run (algorithm, contender, seed, the example's config overrides), as JSON for a
  child process;
* :func:`example` / :func:`example_config`: the example a run trains (``examples/ppo_mujoco.py``,
  ``examples/sac_mujoco.py``) and its ``Config`` for the run, so every contender reads the same
  hyperparameters;
* :class:`Evaluations`: deterministic evaluation episodes at fixed frame counts (the same episodes, env
  seeds included, for every contender of a seed), the seconds they take kept apart from the run's time;
* :func:`torchrl_act` / :func:`recorded_batches`: acting with the examples' TorchRL actors, and batches
  recorded with them for the learner-only runs;
* :func:`record`: a run's result record (what :mod:`.report` reads).

Units: frames are env steps; times are seconds: wall-clock from ``time.perf_counter``, CPU from ``os.times`` (every
thread of the process, and its children once they exited: SB3's ``SubprocVecEnv``).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["ALGOS", "CONTENDERS", "LEARNER_ONLY", "ROOT", "Evaluations", "RunSpec", "clock", "example",
           "example_config", "record", "recorded_batches", "run_episodes", "torchrl_act"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")

ALGOS = {"ppo": "ppo_mujoco", "sac": "sac_mujoco"}  # algorithm -> the example module that trains it
# full runs, learning curves included: ours through Trainer.fit, the same learner in a loop written by hand over
# ThreadedCollector, the same loop over TorchRL's Collector (the control), Stable-Baselines3 (its DummyVecEnv, and
# with several envs its SubprocVecEnv)
CONTENDERS = ("ours", "ours-loop", "torchrl", "sb3", "sb3-subproc")
# the same gradient steps with no collection (timing only): ours (the example's learner), SB3's own learner
LEARNER_ONLY = ("ours-learner", "sb3-learner")
_EVAL_SEED = 1_000_000  # evaluation episode i after training seed s: env seed _EVAL_SEED + 1000 * s + i


@dataclass(frozen=True)
class RunSpec:
    """One run: ``contender`` trains ``algo`` with seed ``seed``; ``overrides`` replace fields of the example's
    ``Config`` (``frames``, ``eval_every_frames``, ``eval_episodes``, ``utd``...); ``eval_max_steps`` caps
    evaluation episodes (``None``: the env's own limit, 1000 steps for HalfCheetah)."""

    algo: str
    contender: str
    seed: int
    overrides: dict[str, Any] = field(default_factory=dict)
    eval_max_steps: int | None = None

    def __post_init__(self) -> None:
        if self.algo not in ALGOS:
            raise ValueError(f"algo must be one of {sorted(ALGOS)}, got {self.algo!r}")
        if self.contender not in CONTENDERS + LEARNER_ONLY:
            raise ValueError(f"contender must be one of {CONTENDERS + LEARNER_ONLY}, got {self.contender!r}")

    @property
    def key(self) -> tuple[str, str, int, float, int]:
        """What identifies a run in a results file: algorithm, contender, seed, UTD (1.0 for PPO), envs."""
        return (self.algo, self.contender, self.seed, float(self.overrides.get("utd", 1.0)),
                int(self.overrides.get("num_envs", 1)))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        return cls(**json.loads(text))


def example(algo: str) -> ModuleType:
    """The example module that trains ``algo`` (imported from ``examples/``)."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    return importlib.import_module(ALGOS[algo])


def example_config(spec: RunSpec, *, out: str) -> Any:
    """The example's ``Config`` for ``spec``: its defaults, the overrides, the seed, logs under ``out``."""
    config_cls = example(spec.algo).Config
    unknown = set(spec.overrides) - {f.name for f in dataclasses.fields(config_cls)}
    if unknown:
        raise ValueError(f"{spec.algo} has no config field {sorted(unknown)}")
    return dataclasses.replace(config_cls(), **spec.overrides, seed=spec.seed, out=out)


def run_episodes(act: Callable[[np.ndarray], np.ndarray], *, env_id: str, episodes: int, seed: int,
                 max_steps: int | None = None) -> list[float]:
    """Returns of ``episodes`` fresh episodes of ``env_id`` (episode ``i`` reset with seed ``seed + i``), acting
    with ``act`` (one observation ``[obs_dim]`` -> one action ``[act_dim]``), each cut at ``max_steps``."""
    import gymnasium as gym

    env = gym.make(env_id)
    returns = []
    try:
        for i in range(episodes):
            obs, _ = env.reset(seed=seed + i)
            total, steps, done = 0.0, 0, False
            while not done and (max_steps is None or steps < max_steps):
                obs, reward, terminated, truncated, _ = env.step(act(obs))
                total, steps, done = total + float(reward), steps + 1, terminated or truncated
            returns.append(total)
    finally:
        env.close()
    return returns


def torchrl_act(actor: Any) -> Callable[[np.ndarray], np.ndarray]:
    """The deterministic action of a TorchRL actor (``"observation"`` in, ``"action"`` out) for one
    observation: ``tanh(loc)`` for the examples' ``TanhNormal`` actors."""
    import torch
    from tensordict import TensorDict
    from torchrl.envs.utils import ExplorationType, set_exploration_type

    def act(obs: np.ndarray) -> np.ndarray:
        with torch.no_grad(), set_exploration_type(ExplorationType.DETERMINISTIC):
            out = actor(TensorDict(observation=torch.as_tensor(obs).unsqueeze(0), batch_size=[1]))
        return out["action"][0].numpy()

    return act


class Evaluations:
    """Evaluation rounds at ``every``, ``2 * every``, ... frames (up to ``frames``): ``maybe(frames, act)``
    after each update runs a round once the frames collected reach the next point.

    ``history`` is ``[{"frames": point, "at_frames": frames collected, "return": mean, "returns": [...]}]``;
    ``seconds`` the wall time spent evaluating (a run's own time leaves it out).
    """

    def __init__(self, *, env_id: str, frames: int, every: int, episodes: int, seed: int,
                 max_steps: int | None = None) -> None:
        if every < 1 or episodes < 1:
            raise ValueError(f"every ({every}) and episodes ({episodes}) must be >= 1")
        self.env_id, self.episodes, self.max_steps = env_id, episodes, max_steps
        self.seed = _EVAL_SEED + 1000 * seed
        self.points = list(range(every, frames + 1, every))
        self.history: list[dict[str, Any]] = []
        self.seconds = self.cpu_seconds = 0.0

    def maybe(self, frames: int, act: Callable[[], Callable[[np.ndarray], np.ndarray]]) -> None:
        """Evaluate if ``frames`` reached the next point; ``act()`` builds the acting function (only then)."""
        due = [p for p in self.points[len(self.history):] if p <= frames]
        if not due:
            return
        start = clock()
        returns = run_episodes(act(), env_id=self.env_id, episodes=self.episodes, seed=self.seed,
                               max_steps=self.max_steps)
        for point in due:  # a batch that crosses two points (it should not) evaluates once for both
            self.history.append({"frames": point, "at_frames": int(frames), "return": float(np.mean(returns)),
                                 "returns": returns})
        now = clock()
        self.seconds += now[0] - start[0]
        self.cpu_seconds += now[1] - start[1]

    @classmethod
    def for_run(cls, spec: RunSpec, cfg: Any) -> Evaluations:
        """The rounds of ``spec``: the example config's ``eval_every_frames`` and ``eval_episodes``."""
        return cls(env_id=cfg.env, frames=cfg.frames, every=cfg.eval_every_frames, episodes=cfg.eval_episodes,
                   seed=spec.seed, max_steps=spec.eval_max_steps)


def recorded_batches(cfg: Any, actor: Any, *, frames_per_batch: int, count: int, layout: str,
                   seed: int) -> list[Any]:
    """``count`` batches collected with ``actor`` (untrained) by a ``ThreadedCollector`` with the example's
    layout: the data a learner-only run learns on, recorded before its clock starts."""
    from lightning_rollout import ThreadedCollector

    collector = ThreadedCollector(cfg.env, actor, frames_per_batch=frames_per_batch,
                                  total_frames=frames_per_batch * count, num_envs=cfg.num_envs, layout=layout,
                                  seed=seed)
    try:
        return [batch.clone() for batch in collector]
    finally:
        collector.shutdown()


def clock() -> tuple[float, float]:
    """Now, as (wall-clock seconds, CPU seconds of this process and of its children that exited)."""
    t = os.times()
    return time.perf_counter(), t.user + t.system + t.children_user + t.children_system


def record(spec: RunSpec, cfg: Any, *, started: tuple[float, float], frames: int, grad_steps: int,
           evaluations: Evaluations | None = None, **extra: Any) -> dict[str, Any]:
    """A run's result: what ran, its frames and gradient steps, its wall and CPU time since ``started`` (a
    :func:`clock`) without evaluation, frames/s, the evaluation history."""
    now = clock()
    wall_s = now[0] - started[0] - (evaluations.seconds if evaluations is not None else 0.0)
    cpu_s = now[1] - started[1] - (evaluations.cpu_seconds if evaluations is not None else 0.0)
    out = {"algo": spec.algo, "contender": spec.contender, "seed": spec.seed,
           "utd": float(spec.overrides.get("utd", 1.0)), "num_envs": int(cfg.num_envs), "frames": int(frames),
           "grad_steps": int(grad_steps),
           "wall_s": round(wall_s, 3), "cpu_s": round(cpu_s, 3),
           "frames_per_s": round(frames / wall_s, 1) if wall_s > 0 else None,
           "grad_steps_per_s": round(grad_steps / wall_s, 1) if wall_s > 0 else None,
           "eval_s": round(evaluations.seconds, 3) if evaluations is not None else 0.0,
           "eval": evaluations.history if evaluations is not None else [],
           "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "out"}}
    out.update(extra)
    return out
