"""Lightning layer: RolloutDataModule, RolloutCallback and the built-in callbacks, end to end.

Every test runs a real ``Trainer.fit`` on CPU, kept tiny (a few steps, 32-64
frames per batch, 2-4 envs) so the file stays fast on a 2-core machine. The
autouse ``no_thread_leak`` fixture (conftest) fails any test that leaves a
``lightning_rollout-*`` thread alive.
"""

from __future__ import annotations

import copy
import glob
import json
import math
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from tensordict.nn import TensorDictModule
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import MLP, OneHotCategorical, ProbabilisticActor

from conftest import THREAD_PREFIX, MockEnv
from lightning_rollout import EnvError, RolloutCallback, RolloutDataModule

REPO = Path(__file__).resolve().parents[1]


# -- helpers -----------------------------------------------------------------------------------------------------

def make_actor(obs_dim: int = 4, num_actions: int = 2) -> ProbabilisticActor:
    net = TensorDictModule(MLP(in_features=obs_dim, out_features=num_actions, num_cells=[16]),
                           in_keys=["observation"], out_keys=["logits"])
    return ProbabilisticActor(net, in_keys=["logits"], distribution_class=OneHotCategorical, return_log_prob=True)


class Agent(pl.LightningModule):
    """Small MLP policy in ``self.actor``; records what every ``training_step`` saw."""

    def __init__(self, obs_dim: int = 4, lr: float = 1e-2) -> None:
        super().__init__()
        self.actor = make_actor(obs_dim)
        self.lr = lr
        self.steps = 0
        self.versions: list[list[int]] = []
        self.first_weights: dict[str, torch.Tensor] | None = None

    def training_step(self, batch, batch_idx):
        if self.first_weights is None:
            self.first_weights = {k: v.detach().clone() for k, v in self.actor.state_dict().items()}
        self.steps += 1
        self.versions.append(batch["policy_version"].unique().tolist())
        logits = self.actor(batch.select("observation").clone())["logits"]
        return -logits.log_softmax(-1).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def make_trainer(**kwargs) -> pl.Trainer:
    options = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                   enable_model_summary=False, enable_progress_bar=False, log_every_n_steps=1)
    options.update(kwargs)
    return pl.Trainer(**options)


def rollout_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX) and t.is_alive()]


class EventCounter(RolloutCallback):
    """Counts every collection event it receives (overrides ``on_rollout_step``)."""

    def __init__(self) -> None:
        self.steps = 0
        self.step_dones = 0
        self.step_evals = 0
        self.episodes = 0
        self.episode_frames = 0
        self.eval_episodes = 0
        self.eval_rounds: list[int] = []
        self.batches = 0

    def on_rollout_step(self, trainer, pl_module, step) -> None:
        self.steps += 1
        self.step_dones += int(step.done)
        self.step_evals += int(step.eval)

    def on_episode_end(self, trainer, pl_module, episode) -> None:
        assert not episode.eval
        self.episodes += 1
        self.episode_frames += episode.length

    def on_eval_episode_end(self, trainer, pl_module, episode) -> None:
        assert episode.eval
        self.eval_episodes += 1

    def on_eval_end(self, trainer, pl_module, episodes) -> None:
        self.eval_rounds.append(len(episodes))

    def on_rollout_batch(self, trainer, pl_module, batch) -> None:
        self.batches += 1


# -- logging -----------------------------------------------------------------------------------------------------

def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the single TensorBoard event file under ``log_dir``: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = glob.glob(str(log_dir / "**" / "events.out.tfevents.*"), recursive=True)
    assert len(files) == 1, files
    acc = EventAccumulator(files[0])
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


class EpisodesPerBatch(RolloutCallback):
    """Returns and lengths of the episodes each batch finished; means of each evaluation round."""

    def __init__(self) -> None:
        self.pending: list[tuple[float, int]] = []
        self.per_batch: list[list[tuple[float, int]]] = []
        self.eval_means: list[float] = []

    def on_episode_end(self, trainer, pl_module, episode) -> None:
        self.pending.append((episode.reward, episode.length))

    def on_rollout_batch(self, trainer, pl_module, batch) -> None:
        self.per_batch.append(self.pending)
        self.pending = []

    def on_eval_end(self, trainer, pl_module, episodes) -> None:
        self.eval_means.append(sum(e.reward for e in episodes) / len(episodes))


def test_fit_writes_rollout_and_eval_metrics_to_tensorboard_at_increasing_steps(tmp_path):
    recorder = EpisodesPerBatch()
    dm = RolloutDataModule("CartPole-v1", num_envs=4, frames_per_batch=64, eval_every_n_steps=2, eval_episodes=2,
                           eval_max_episode_steps=50)
    trainer = make_trainer(max_steps=4, logger=TensorBoardLogger(str(tmp_path), name="tb"), callbacks=[recorder])
    trainer.fit(Agent(), datamodule=dm)

    scalars = read_scalars(tmp_path / "tb")
    for tag in ("rollout/episode_reward", "rollout/episode_length", "eval/episode_reward"):
        assert tag in scalars, f"{tag} not written; got {sorted(scalars)}"
        steps = [s for s, _ in scalars[tag]]
        assert len(steps) >= 2, f"{tag} written at steps {steps}"
        assert steps == sorted(set(steps)), f"{tag} steps not strictly increasing: {steps}"
        assert all(math.isfinite(v) and v > 0 for _, v in scalars[tag])
    # one rollout/frames point per training step, with the running total
    assert [v for _, v in scalars["rollout/frames"]] == [64.0, 128.0, 192.0, 256.0]
    assert scalars["rollout/episodes"][-1][1] == dm.collector.loop.episodes
    # evaluated after training steps 2 and 4, each value written once, at the step of that training step
    step_of = [s for s, _ in scalars["rollout/frames"]]  # the logger step of training step 1, 2, 3, 4
    assert [s for s, _ in scalars["eval/episode_reward"]] == [step_of[1], step_of[3]]
    assert [v for _, v in scalars["eval/episode_reward"]] == pytest.approx(recorder.eval_means)
    assert all(v <= 50 for _, v in scalars["eval/episode_length"])  # eval_max_episode_steps caps the episodes


@pytest.mark.parametrize("log_every_n_steps", [1, 3])
def test_episode_metrics_are_written_once_covering_every_episode_since_the_previous_write(tmp_path,
                                                                                          log_every_n_steps):
    # episodes of 10, 13 or 16 steps and 8 steps per env per batch: some batches finish no episode
    ids = iter(range(100))
    dm = RolloutDataModule(lambda: MockEnv(next(ids), length_fn=lambda i, e: 10 + 3 * ((i + e) % 3)),
                           num_envs=2, frames_per_batch=16)
    recorder = EpisodesPerBatch()
    trainer = make_trainer(max_steps=7, logger=TensorBoardLogger(str(tmp_path), name="tb"), callbacks=[recorder],
                           log_every_n_steps=log_every_n_steps)
    trainer.fit(Agent(obs_dim=3), datamodule=dm)
    scalars = read_scalars(tmp_path / "tb")

    assert any(not episodes for episodes in recorder.per_batch)
    expected_steps, expected_rewards, expected_lengths, unwritten = [], [], [], []
    for step, episodes in enumerate(recorder.per_batch):  # batch b is training step b + 1, logger step b
        unwritten += episodes
        if (step + 1) % log_every_n_steps == 0 and unwritten:
            expected_steps.append(step)
            expected_rewards.append(sum(r for r, _ in unwritten) / len(unwritten))
            expected_lengths.append(sum(n for _, n in unwritten) / len(unwritten))
            unwritten = []
    assert expected_steps
    assert [s for s, _ in scalars["rollout/episode_reward"]] == expected_steps  # never a stale repeat
    assert [v for _, v in scalars["rollout/episode_reward"]] == pytest.approx(expected_rewards)
    assert [v for _, v in scalars["rollout/episode_length"]] == pytest.approx(expected_lengths)
    assert [s for s, _ in scalars["rollout/frames"]] == [s for s in range(7) if (s + 1) % log_every_n_steps == 0]


# -- events ------------------------------------------------------------------------------------------------------

def test_rollout_callback_receives_every_step_and_every_episode_end():
    counter = EventCounter()
    dm = RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=64, eval_every_n_steps=2, eval_episodes=2,
                           eval_max_episode_steps=30)
    trainer = make_trainer(max_steps=3, callbacks=[counter])
    trainer.fit(Agent(), datamodule=dm)

    assert dm.collector.frames == 3 * 64
    assert counter.batches == 3
    assert counter.steps == dm.collector.frames  # every training transition, no evaluation one
    assert counter.step_evals == 0
    assert dm.collector.loop.episodes > 0
    assert counter.episodes == dm.collector.loop.episodes
    assert counter.step_dones == counter.episodes
    # evaluation episodes go to on_eval_episode_end only: one round at step 2, one at train end (step 3)
    assert counter.eval_rounds == [2, 2]
    assert counter.eval_episodes == 4


def test_per_step_events_are_not_built_when_no_callback_overrides_on_rollout_step():
    class EpisodesOnly(RolloutCallback):
        episodes = 0

        def on_episode_end(self, trainer, pl_module, episode) -> None:
            self.episodes += 1

    cb = EpisodesOnly()
    dm = RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=64)
    trainer = make_trainer(max_steps=2, callbacks=[cb])
    trainer.fit(Agent(), datamodule=dm)
    assert dm._dispatcher is not None and not dm._dispatcher.wants_timesteps
    assert cb.episodes == dm.collector.loop.episodes > 0


# -- on-policy ---------------------------------------------------------------------------------------------------

class FlippingAgent(pl.LightningModule):
    """Deterministic actor whose every optimizer step flips its greedy action for every observation.

    Only the output bias is trained. It starts at a gap ``bias[0] - bias[1] = +10``
    and step ``k`` moves the gap by ``-/+ 20 (k + 1)`` alternately, so the gap goes
    +10, -10, +30, -30, ..., which dwarfs the observation-dependent part: an action
    acted by the weights of one step earlier is therefore always the other action.
    """

    def __init__(self) -> None:
        super().__init__()
        self.actor = make_actor(4)
        self.bias = [m for m in self.actor.modules() if isinstance(m, torch.nn.Linear)][-1].bias
        with torch.no_grad():
            self.bias.copy_(torch.tensor([10.0, 0.0]))
        self.records: list[dict] = []
        self._previous: ProbabilisticActor | None = None  # weights before the last optimizer step (not a submodule)

    def training_step(self, batch, batch_idx):
        obs = batch.select("observation").clone()
        with torch.no_grad(), set_exploration_type(ExplorationType.DETERMINISTIC):
            now = self.actor(obs.clone())["action"]
            stale = self._previous(obs.clone())["action"] if self._previous is not None else None
        self.records.append(dict(
            versions=batch["policy_version"].unique().tolist(),
            acted_by_current=bool((now == batch["action"]).all()),
            acted_by_previous=None if stale is None else bool((stale == batch["action"]).all()),
        ))
        self._previous = copy.deepcopy(self.actor)
        k = self.global_step
        logits = self.actor(obs)["logits"]
        return (-1) ** k * (k + 1) * (logits[..., 0] - logits[..., 1]).mean()

    def configure_optimizers(self):
        return torch.optim.SGD([self.bias], lr=10.0)


def test_on_policy_batches_are_acted_by_the_weights_of_the_latest_optimizer_step():
    dm = RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=32,
                           exploration_type=ExplorationType.DETERMINISTIC)
    model = FlippingAgent()
    make_trainer(max_steps=4).fit(model, datamodule=dm)

    records = model.records
    assert len(records) == 4
    assert all(len(r["versions"]) == 1 for r in records), [r["versions"] for r in records]
    versions = [r["versions"][0] for r in records]
    assert versions == list(range(versions[0], versions[0] + 4)), versions
    # the actions in each batch are exactly what the module's weights at training_step time choose...
    assert all(r["acted_by_current"] for r in records)
    # ...and not what the weights of one optimizer step earlier would have chosen (one batch of lag)
    assert [r["acted_by_previous"] for r in records[1:]] == [False, False, False]
    assert dm.collector.policy_version == versions[-1]


# -- stop --------------------------------------------------------------------------------------------------------

def test_env_error_mid_fit_fails_fit_with_the_env_id_and_joins_every_thread():
    dm = RolloutDataModule(lambda: MockEnv(0, raise_on_step=20), num_envs=2, frames_per_batch=16)
    model = Agent(obs_dim=3)
    with pytest.raises(EnvError) as info:
        make_trainer(max_steps=10).fit(model, datamodule=dm)
    err = info.value
    assert err.env_id in (0, 1) and err.phase == "step" and err.step == 20
    assert f"env {err.env_id}" in str(err)
    assert "exploded on step 20" in str(err.__cause__)
    assert model.steps == 2  # each env steps 8 times per batch: its 21st step is in the third batch
    assert rollout_threads() == []


def test_max_steps_stops_after_exactly_that_many_training_steps_without_collecting_ahead():
    dm = RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=32)
    model = Agent()
    trainer = make_trainer(max_steps=3)
    trainer.fit(model, datamodule=dm)
    assert model.steps == 3 and trainer.global_step == 3
    assert dm.collector.frames == 3 * 32  # no batch collected ahead of training
    assert rollout_threads() == []


def test_should_stop_set_by_a_callback_ends_fit_after_that_batch():
    class StopAfterTwo(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == 1:
                trainer.should_stop = True

    dm = RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=32)
    model = Agent()
    make_trainer(max_steps=50, callbacks=[StopAfterTwo()]).fit(model, datamodule=dm)
    assert model.steps == 2
    assert dm.collector.frames == 2 * 32
    assert rollout_threads() == []


def test_finite_total_frames_ends_fit_when_the_collector_is_exhausted():
    dm = RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=32, total_frames=96,
                           policy=lambda module: module.actor)
    model = Agent()
    trainer = make_trainer(max_epochs=20)
    trainer.fit(model, datamodule=dm)
    assert model.steps == 3
    assert dm.collector.frames == 96
    assert trainer.current_epoch <= 1  # ended by the collector, not by max_epochs
    assert rollout_threads() == []


def test_keyboard_interrupt_during_collection_joins_every_thread():
    class Interrupt(RolloutCallback):
        def on_rollout_batch(self, trainer, pl_module, batch) -> None:
            if trainer.global_step == 1:
                raise KeyboardInterrupt

    dm = RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=32)
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):  # Lightning turns KeyboardInterrupt into sys.exit(1)
            make_trainer(max_steps=10, callbacks=[Interrupt()]).fit(Agent(), datamodule=dm)
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT after an interrupt
    assert dm.collector is not None and dm.collector.frames == 2 * 32
    assert rollout_threads() == []


# -- checkpoints -------------------------------------------------------------------------------------------------

def _paths_with_keys(obj, keys: set[str], path: str = "") -> list[str]:
    """Every path in a nested dict/list at which one of ``keys`` appears as a dict key."""
    found = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            p = f"{path}/{k}"
            if k in keys:
                found.append(p)
            found += _paths_with_keys(v, keys, p)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found += _paths_with_keys(v, keys, f"{path}[{i}]")
    return found


def test_checkpoint_saved_after_fit_holds_collector_state_once_and_resume_continues_counts(tmp_path):
    dm = RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=32, seed=3)
    model = Agent()
    trainer = make_trainer(max_steps=2)
    trainer.fit(model, datamodule=dm)
    episodes_before = dm.collector.loop.episodes
    next_traj_id = dm.collector.loop.next_traj_id
    version_before = dm.collector.policy_version
    ckpt = str(tmp_path / "after_fit.ckpt")
    trainer.save_checkpoint(ckpt)  # after teardown: every env thread is already joined

    saved = torch.load(ckpt, weights_only=True)
    state = saved["RolloutDataModule"]
    assert state["collector"]["frames"] == 64
    assert state["collector"]["next_traj_id"] == next_traj_id
    assert state["episodes"] == episodes_before
    assert state["collector"]["policy_state_dict"] == {}  # the weights live in the module's state_dict only
    # the collector state appears once: under "RolloutDataModule", nowhere under "loops" or elsewhere
    assert _paths_with_keys(saved, {"collector", "next_traj_id", "policy_state_dict"}) == [
        "/RolloutDataModule/collector", "/RolloutDataModule/collector/next_traj_id",
        "/RolloutDataModule/collector/policy_state_dict"]
    assert _paths_with_keys(saved["loops"], {"combined_loader"}) in ([], ["/fit_loop/state_dict/combined_loader"])
    assert not saved["loops"]["fit_loop"]["state_dict"].get("combined_loader")

    dm2 = RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=32, seed=3)
    counter = EventCounter()
    model2 = Agent()
    trainer2 = make_trainer(max_steps=4, callbacks=[counter])
    trainer2.fit(model2, datamodule=dm2, ckpt_path=ckpt)
    assert model2.steps == 2 and trainer2.global_step == 4
    assert dm2.collector.frames == 4 * 32
    assert dm2.collector.loop.episodes == episodes_before + counter.episodes
    assert model2.versions[0] == [version_before + 1]  # policy versions continue too
    assert dm2.collector.loop.next_traj_id > next_traj_id
    final = model.actor.state_dict()  # the weights were restored before the first resumed batch
    assert model2.first_weights is not None and final.keys() == model2.first_weights.keys()
    assert all(torch.equal(final[k], model2.first_weights[k]) for k in final)
    # logged totals continue across the resume
    assert trainer2.callback_metrics["rollout/frames"].item() == 4 * 32
    assert trainer2.callback_metrics["rollout/episodes"].item() == dm2.collector.loop.episodes
    trainer2.save_checkpoint(str(tmp_path / "resumed.ckpt"))
    resumed = torch.load(str(tmp_path / "resumed.ckpt"), weights_only=True)
    assert resumed["RolloutDataModule"]["collector"]["frames"] == 128


def test_a_second_fit_with_the_same_datamodule_continues_the_counts():
    dm = RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=32)
    model = Agent()
    make_trainer(max_steps=2).fit(model, datamodule=dm)
    first = dm.collector
    episodes, version = first.loop.episodes, first.policy_version
    counter = EventCounter()
    make_trainer(max_steps=2, callbacks=[counter]).fit(model, datamodule=dm)  # a new trainer, the same dm
    assert model.steps == 4
    assert dm.collector is not first and dm.collector.frames == 4 * 32
    assert dm.collector.loop.episodes == episodes + counter.episodes
    assert model.versions[2] == [version + 1]
    assert counter.steps == 2 * 32  # events go to the new trainer's callbacks


@pytest.mark.parametrize("every_n_train_steps", [None, 2])
def test_model_checkpoint_monitors_eval_episode_reward(tmp_path, every_n_train_steps):
    recorder = EpisodesPerBatch()
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path), monitor="eval/episode_reward", mode="max",
                                 every_n_train_steps=every_n_train_steps)
    dm = RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=32, eval_every_n_steps=2, eval_episodes=2,
                           eval_max_episode_steps=40)
    trainer = make_trainer(max_steps=4, callbacks=[recorder, checkpoint], enable_checkpointing=True,
                           default_root_dir=str(tmp_path))
    trainer.fit(Agent(), datamodule=dm)
    assert len(recorder.eval_means) == 2  # after steps 2 and 4 (step 4 was just evaluated: no round at train end)
    assert trainer.callback_metrics["eval/episode_reward"].item() == pytest.approx(recorder.eval_means[-1])
    assert checkpoint.best_model_path and os.path.exists(checkpoint.best_model_path)
    if every_n_train_steps is None:  # checked once, at the end of the (only) epoch: the last round's value
        assert checkpoint.best_model_score.item() == pytest.approx(recorder.eval_means[-1])
    else:  # checked after every evaluation: the best round is kept
        assert checkpoint.best_model_score.item() == pytest.approx(max(recorder.eval_means))
    best = torch.load(checkpoint.best_model_path, weights_only=True)
    assert best["RolloutDataModule"]["collector"]["frames"] in (64, 128)


# -- DDP ---------------------------------------------------------------------------------------------------------

def test_ddp_two_cpu_ranks_collect_distinct_streams_and_log_reduced_metrics(tmp_path):
    out = tmp_path / "ddp"
    proc = subprocess.run([sys.executable, "tests/ddp_script.py", "--out", str(out)], cwd=str(REPO),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in reports] == [0, 1] and all(r["world_size"] == 2 for r in reports)
    assert all(r["steps"] == 3 and r["frames"] == 3 * 32 for r in reports)

    obs = [torch.load(str(out / f"obs_rank{r}.pt"), weights_only=True) for r in (0, 1)]
    assert obs[0].shape == obs[1].shape == (2, 16, 4)
    assert not torch.equal(obs[0], obs[1])  # each rank seeds its envs differently
    assert not torch.equal(obs[0][:, 0], obs[1][:, 0])

    m0, m1 = reports[0]["metrics"], reports[1]["metrics"]
    for key in ("rollout/episode_reward", "rollout/episode_length", "rollout/episodes", "rollout/frames",
                "eval/episode_reward"):
        assert key in m0, sorted(m0)
        assert m0[key] == m1[key], key
    assert m0["rollout/frames"] == 2 * 3 * 32
    assert m0["rollout/episodes"] == reports[0]["episodes"] + reports[1]["episodes"]
    # the last logged episode reward is the mean over both ranks' episodes of the last batch that finished any
    per_batch = [r["per_batch_rewards"] for r in reports]
    last = max(i for i in range(3) if per_batch[0][i] or per_batch[1][i])
    both = per_batch[0][last] + per_batch[1][last]
    assert m0["rollout/episode_reward"] == pytest.approx(sum(both) / len(both), rel=1e-5)
    first_eval = reports[0]["eval_rounds"][0] + reports[1]["eval_rounds"][0]  # the logged round, at step 2
    assert m0["eval/episode_reward"] == pytest.approx(sum(first_eval) / len(first_eval), rel=1e-5)


# -- bad configuration -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(num_envs=4, frames_per_batch=30), r"frames_per_batch \(30\) must be a multiple of num_envs \(4\)"),
    (dict(num_envs=4, frames_per_batch=32, total_frames=90), r"total_frames \(90\) must be a multiple of num_envs"),
    (dict(num_envs=4, frames_per_batch=32, total_frames=0), r"total_frames must be a positive int or -1"),
    (dict(num_envs=0, frames_per_batch=32), r"num_envs"),
])
def test_inconsistent_sizes_are_rejected_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutDataModule("CartPole-v1", **kwargs)


def test_module_without_actor_attribute_fails_fit_with_a_clear_message():
    class NoActor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            return self.net(batch["observation"]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=32)
    with pytest.raises(AttributeError, match=r"NoActor has no attribute 'actor'.*RolloutDataModule\(policy=\.\.\.\)"):
        make_trainer(max_steps=1).fit(NoActor(), datamodule=dm)
    assert rollout_threads() == []
