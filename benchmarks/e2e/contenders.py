"""The contenders of the end-to-end bench, one function each.

``python -m benchmarks.e2e.contenders SPEC_JSON`` runs one (a :class:`~.common.RunSpec`) in a fresh
interpreter and prints its record as ``RESULT {json}``; :func:`run` runs one in this process.

Every contender trains with the example's ``Config`` (``examples/ppo_mujoco.py``, ``examples/sac_mujoco.py``):

* ``ours``: the example's LightningModule, ``RolloutDataModule`` and ``Trainer`` (``Trainer.fit``), its own
  evaluation turned off for the bench's (a callback after each training step);
* ``ours-loop``: the same module's learner (``learn(batch, optimizer)``) in a loop written by hand over a
  ``ThreadedCollector`` with the DataModule's collection settings: ``Trainer.fit`` against it is
  Lightning's overhead;
* ``torchrl``: the same loop over TorchRL's ``Collector`` and a ``GymEnv``: the control, our collector
  swapped out;
* ``sb3``: Stable-Baselines3's PPO / SAC with the same hyperparameters (``VecNormalize`` for PPO, as RL
  Zoo's ``normalize: true``), its envs in a ``DummyVecEnv``; ``sb3-subproc``: the same in a ``SubprocVecEnv``
  (one process an env);
* ``ours-learner`` / ``sb3-learner``: the same gradient steps with no collection (timing only).

A run's ``wall_s`` (and ``cpu_s``) runs from before the model is built to the end of training, evaluation rounds
left out.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
import tempfile
from fractions import Fraction
from typing import Any

import lightning.pytorch as pl
import torch

from .common import Evaluations, RunSpec, clock, example, example_config, record, recorded_batches, torchrl_act

__all__ = ["main", "run"]


def run(spec: RunSpec, *, workdir: str) -> dict[str, Any]:
    """Run ``spec`` in this process (logs under ``workdir``) and return its record."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    torch.set_num_threads(1)  # as the examples: every contender gets one intra-op thread
    pl.seed_everything(spec.seed, verbose=False)
    cfg = example_config(spec, out=workdir)
    runner = {"ours": _fit, "ours-loop": _loop, "torchrl": _loop, "sb3": _sb3, "sb3-subproc": _sb3,
              "ours-learner": _ours_learner, "sb3-learner": _sb3_learner}[spec.contender]
    return runner(spec, cfg)


def _model(spec: RunSpec, cfg: Any) -> Any:
    """The example's LightningModule (``PPO`` / ``SAC``) for ``cfg``."""
    ex = example(spec.algo)
    return getattr(ex, spec.algo.upper())(*ex.env_dims(cfg.env), cfg)


def _collection(spec: RunSpec, cfg: Any) -> dict[str, Any]:
    """The collection settings of the example's ``RolloutDataModule`` (what the hand-written loops and SB3 get)."""
    dm = example(spec.algo).make_datamodule(dataclasses.replace(cfg, eval_episodes=0))
    return {"frames_per_batch": dm.frames_per_batch, "total_frames": dm.total_frames, "num_envs": dm.num_envs,
            "layout": dm.layout, "on_policy": dm.on_policy,
            "init_random_frames": getattr(cfg, "learning_starts", 0)}


def _fit(spec: RunSpec, cfg: Any) -> dict[str, Any]:
    ex = example(spec.algo)
    evals = Evaluations.for_run(spec, cfg)

    class EvalAtFrames(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
            evals.maybe(trainer.datamodule.frames, lambda: torchrl_act(module.actor))

    started = clock()
    model = _model(spec, cfg)
    datamodule = ex.make_datamodule(dataclasses.replace(cfg, eval_episodes=0))  # the bench evaluates
    ex.make_trainer(cfg, name=spec.algo, callbacks=[EvalAtFrames()]).fit(model, datamodule=datamodule)
    return record(spec, cfg, started=started, frames=datamodule.frames, grad_steps=model.updates_done,
                  evaluations=evals)


def _threaded_collector(cfg: Any, actor: Any, opts: dict[str, Any]) -> Any:
    from lightning_rollout import ThreadedCollector

    return ThreadedCollector(cfg.env, actor, seed=cfg.seed, track_policy_version=True, **opts)


def _torchrl_collector(cfg: Any, actor: Any, opts: dict[str, Any]) -> Any:
    from torchrl.collectors import Collector
    from torchrl.envs import GymEnv, SerialEnv

    env = GymEnv(cfg.env) if opts["num_envs"] == 1 else SerialEnv(opts["num_envs"], lambda: GymEnv(cfg.env))
    env.set_seed(cfg.seed)
    return Collector(env, actor, frames_per_batch=opts["frames_per_batch"], total_frames=opts["total_frames"],
                     init_random_frames=opts["init_random_frames"] or None,
                     auto_register_policy_transforms=False)  # the env as built, as ThreadedCollector's default


def _loop(spec: RunSpec, cfg: Any) -> dict[str, Any]:
    """The example's learner driven by a plain loop over a collector (ours or TorchRL's: the one line that
    differs)."""
    evals = Evaluations.for_run(spec, cfg)
    started = clock()
    model = _model(spec, cfg)
    opts = _collection(spec, cfg)
    if spec.contender == "ours-loop":
        collector = _threaded_collector(cfg, model.actor, opts)
    else:
        opts = {k: opts[k] for k in ("frames_per_batch", "total_frames", "num_envs", "init_random_frames")}
        collector = _torchrl_collector(cfg, model.actor, opts)
    optimizer = model.configure_optimizers()
    frames = 0
    try:
        for batch in collector:
            model.learn(batch, optimizer)
            collector.update_policy_weights_()
            frames += batch.numel()
            evals.maybe(frames, lambda: torchrl_act(model.actor))
    finally:
        collector.shutdown()
    return record(spec, cfg, started=started, frames=frames, grad_steps=model.updates_done, evaluations=evals)


def utd_schedule(utd: float) -> tuple[int, int]:
    """SB3's ``(train_freq, gradient_steps)`` for ``utd`` gradient steps per env frame (e.g. 0.5 -> (2, 1))."""
    ratio = Fraction(utd).limit_denominator(64)
    if ratio <= 0:
        raise ValueError(f"utd must be > 0, got {utd}")
    return ratio.denominator, ratio.numerator


def _sb3_model(spec: RunSpec, cfg: Any) -> tuple[Any, Any]:
    """Stable-Baselines3's model for ``cfg`` (the example's hyperparameters) and its deterministic action of one
    observation."""
    from stable_baselines3 import PPO, SAC
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import SubprocVecEnv, VecNormalize

    env = make_vec_env(cfg.env, n_envs=cfg.num_envs, seed=cfg.seed,
                       vec_env_cls=SubprocVecEnv if spec.contender == "sb3-subproc" else None)
    if spec.algo == "ppo":
        env = VecNormalize(env, gamma=cfg.gamma)  # RL Zoo's normalize: true, with the algorithm's gamma
        policy_kwargs = dict(log_std_init=cfg.log_std_init, ortho_init=False, activation_fn=torch.nn.ReLU,
                             net_arch=dict(pi=[cfg.hidden] * 2, vf=[cfg.hidden] * 2))
        model = PPO("MlpPolicy", env, n_steps=cfg.steps_per_env, batch_size=cfg.minibatch_size, n_epochs=cfg.epochs,
                    learning_rate=cfg.lr, gamma=cfg.gamma, gae_lambda=cfg.gae_lambda, clip_range=cfg.clip,
                    ent_coef=cfg.entropy_coef, vf_coef=cfg.value_coef, max_grad_norm=cfg.max_grad_norm,
                    policy_kwargs=policy_kwargs, seed=cfg.seed, device="cpu")
        return model, lambda obs: model.predict(env.normalize_obs(obs), deterministic=True)[0]
    train_freq, gradient_steps = utd_schedule(cfg.utd)
    model = SAC("MlpPolicy", env, learning_rate=cfg.lr, buffer_size=min(cfg.buffer_size, cfg.frames),
                learning_starts=cfg.learning_starts, batch_size=cfg.batch_size, tau=cfg.tau, gamma=cfg.gamma,
                train_freq=train_freq, gradient_steps=gradient_steps, ent_coef="auto",
                policy_kwargs=dict(net_arch=[cfg.hidden] * 2), seed=cfg.seed, device="cpu")
    return model, lambda obs: model.predict(obs, deterministic=True)[0]


def _sb3_grad_steps(spec: RunSpec, model: Any, cfg: Any, updates: int) -> int:
    """Gradient steps behind SB3's ``_n_updates`` count (PPO counts epochs: each is a pass of minibatches)."""
    if spec.algo == "ppo":
        return updates * math.ceil(cfg.steps_per_env * cfg.num_envs / cfg.minibatch_size)
    return updates


def _sb3(spec: RunSpec, cfg: Any) -> dict[str, Any]:
    from stable_baselines3.common.callbacks import BaseCallback

    evals = Evaluations.for_run(spec, cfg)
    opts = _collection(spec, cfg)
    started = clock()
    model, act = _sb3_model(spec, cfg)

    class EvalAtFrames(BaseCallback):
        """After the update on the frames so far: at a rollout's start, and at the end of training."""

        def _on_step(self) -> bool:
            return True

        def _on_rollout_start(self) -> None:
            evals.maybe(self.model.num_timesteps, lambda: act)

        def _on_training_end(self) -> None:
            evals.maybe(self.model.num_timesteps, lambda: act)

    model.learn(total_timesteps=opts["total_frames"], callback=EvalAtFrames())
    model.get_env().close()  # a SubprocVecEnv's processes
    return record(spec, cfg, started=started, frames=model.num_timesteps,
                  grad_steps=_sb3_grad_steps(spec, model, cfg, model._n_updates), evaluations=evals)


def _ours_learner(spec: RunSpec, cfg: Any) -> dict[str, Any]:
    """The example's ``learn`` over as many batches as the run collects (cycled from at most 8 recorded before
    the clock starts): buffer writes and gradient steps, no collection, no Lightning."""
    model = _model(spec, cfg)
    opts = _collection(spec, cfg)
    batches_in_run = opts["total_frames"] // opts["frames_per_batch"]
    batches = recorded_batches(cfg, model.actor, frames_per_batch=opts["frames_per_batch"],
                               count=min(batches_in_run, 8), layout=opts["layout"], seed=spec.seed)
    optimizer = model.configure_optimizers()
    started = clock()
    for i in range(batches_in_run):
        model.learn(batches[i % len(batches)].clone(), optimizer)
    return record(spec, cfg, started=started, frames=batches_in_run * opts["frames_per_batch"],
                  grad_steps=model.updates_done)


def _sb3_learner(spec: RunSpec, cfg: Any) -> dict[str, Any]:
    """SB3's ``train()`` for the run's gradient steps, on a buffer filled before the clock starts."""
    model, _ = _sb3_model(spec, cfg)
    opts = _collection(spec, cfg)
    if spec.algo == "ppo":
        model.learn(total_timesteps=cfg.steps_per_env * cfg.num_envs)  # a full rollout buffer (and one update)
        before, started = model._n_updates, clock()
        for _ in range(opts["total_frames"] // opts["frames_per_batch"]):
            model.train()
    else:
        model.learn(total_timesteps=cfg.learning_starts)  # random frames, no gradient step yet
        before, started = model._n_updates, clock()
        model.train(gradient_steps=int(cfg.utd * (opts["total_frames"] - cfg.learning_starts)),
                    batch_size=cfg.batch_size)
    return record(spec, cfg, started=started, frames=opts["total_frames"],
                  grad_steps=_sb3_grad_steps(spec, model, cfg, model._n_updates - before))


def main(argv: list[str] | None = None) -> None:
    """Run the one spec given as JSON on the command line; print ``RESULT {record}``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m benchmarks.e2e.contenders SPEC_JSON")
    spec = RunSpec.from_json(args[0])
    with tempfile.TemporaryDirectory(prefix="e2e-") as workdir:
        result = run(spec, workdir=workdir)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
