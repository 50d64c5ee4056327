"""Lightning layer: RolloutDataModule, RolloutCallback and the built-in callbacks, end to end.

Every test runs a real ``Trainer.fit`` on CPU, kept tiny (a few steps, 32-64
frames per batch, 2-4 envs) so the file stays fast on a 2-core machine. The
autouse ``no_thread_leak`` fixture (conftest) fails any test that leaves a
``lightning_rollout-*`` thread alive. What issue 14 asked of the Lightning habits
(evaluation as the validation loop, metrics against frames, config, progress bar,
resume) is tested in ``test_lightning_habits.py``.
"""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import ProbabilisticActor

from conftest import MockEnv
from ddp_script import Agent as DDPAgent
from lightning_helpers import Agent, EventCounter, make_actor, make_trainer, rollout_threads
from lightning_rollout import EnvError, RolloutCallback, RolloutDataModule

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(120)


# -- events ------------------------------------------------------------------------------------------------------

def test_rollout_callback_receives_every_step_and_every_episode_end():
    counter = EventCounter()
    dm = RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=64, eval_every_n_frames=128, eval_episodes=2,
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
    # evaluation episodes go to on_eval_episode_end only: one round, in the validation loop after batch 2
    assert counter.eval_rounds == [2]
    assert counter.eval_episodes == 2


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


@pytest.mark.parametrize("accelerator", [
    "cpu",
    pytest.param("gpu", marks=[pytest.mark.cuda,
                               pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_on_policy_batches_are_acted_by_the_weights_of_the_latest_optimizer_step(accelerator):
    dm = RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=32,
                           exploration_type=ExplorationType.DETERMINISTIC)
    model = FlippingAgent()
    make_trainer(max_steps=4, accelerator=accelerator).fit(model, datamodule=dm)

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

    handler = signal.getsignal(signal.SIGINT)
    for reraise, expected in ((True, KeyboardInterrupt), (False, SystemExit)):  # False: Lightning's sys.exit(1)
        dm = RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=32, reraise_interrupt=reraise)
        try:
            with pytest.raises(expected):
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
    # the dataloader's own state is empty (it only tells Lightning that the DataModule resumes it)
    assert saved["loops"]["fit_loop"]["state_dict"].get("combined_loader") in (None, [], [{}])

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


# -- DDP ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["ddp", "ddp_spawn"])
def ddp_run(request, tmp_path_factory) -> Path:
    """The folder ``tests/ddp_script.py`` wrote into, run once per strategy for the tests below."""
    # ddp_spawn pickles the trainer, the module and a DataModule built from a plain gym id into its processes
    out = tmp_path_factory.mktemp(request.param)
    proc = subprocess.run([sys.executable, "tests/ddp_script.py", "--out", str(out), "--strategy", request.param],
                          cwd=str(REPO), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.mark.timeout(900)
def test_ddp_two_cpu_ranks_collect_distinct_streams_and_log_reduced_metrics(ddp_run):
    out = ddp_run
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in reports] == [0, 1] and all(r["world_size"] == 2 for r in reports)
    assert all(r["steps"] == 3 and r["frames"] == 3 * 32 for r in reports)

    obs = [torch.load(str(out / f"obs_rank{r}.pt"), weights_only=True) for r in (0, 1)]
    assert obs[0].shape == obs[1].shape == (2, 16, 4)
    assert not torch.equal(obs[0], obs[1])  # each rank seeds its envs differently
    assert not torch.equal(obs[0][:, 0], obs[1][:, 0])

    m0, m1 = reports[0]["metrics"], reports[1]["metrics"]
    for key in ("rollout/episode_reward", "rollout/episode_length", "rollout/episodes", "rollout/frames",
                "rollout/fps", "rollout/collect_fps", "eval/episode_reward"):
        assert key in m0, sorted(m0)
        assert m0[key] == m1[key], key
    assert m0["rollout/frames"] == 2 * 3 * 32
    assert m0["rollout/episodes"] == reports[0]["episodes"] + reports[1]["episodes"]
    # total frames/s of wall time: both ranks' frames over the (fake, 1 s a batch) seconds since fit started
    assert m0["rollout/fps"] == 2 * 3 * 32 / 3
    # per-rank collection speed: each rank's last batch over the seconds it waited for it, averaged over ranks
    per_rank = [32 / r["last_collect_seconds"] for r in reports]
    assert m0["rollout/collect_fps"] == pytest.approx(sum(per_rank) / 2, rel=1e-5)
    # the last logged episode reward is the mean over both ranks' episodes of the last batch that finished any
    per_batch = [r["per_batch_rewards"] for r in reports]
    last = max(i for i in range(3) if per_batch[0][i] or per_batch[1][i])
    both = per_batch[0][last] + per_batch[1][last]
    assert m0["rollout/episode_reward"] == pytest.approx(sum(both) / len(both), rel=1e-5)
    # one evaluation round per rank (validation loop after batch 2), reduced over both ranks' episodes
    assert [len(r["eval_rounds"]) for r in reports] == [1, 1]
    first_eval = reports[0]["eval_rounds"][0] + reports[1]["eval_rounds"][0]
    assert m0["eval/episode_reward"] == pytest.approx(sum(first_eval) / len(first_eval), rel=1e-5)


@pytest.mark.timeout(900)
def test_ranks_resumed_from_a_ddp_checkpoint_collect_different_reproducible_streams(ddp_run):
    # the checkpoint holds global rank zero's counters, and every rank resumes from it
    resumed = {(r, run): torch.load(str(path), weights_only=True) for r in (0, 1) for run in "BC"
               if (path := ddp_run / f"obs_rank{r}_resumed_{run}.pt").exists()}
    assert not torch.equal(resumed[0, "B"][:, 0], resumed[1, "B"][:, 0])  # the first observations of each env
    for r in (0, 1):
        assert not torch.equal(resumed[r, "B"], torch.load(str(ddp_run / f"obs_rank{r}.pt"), weights_only=True))
        if (r, "C") in resumed:  # ddp (one process a rank) resumed twice
            assert torch.equal(resumed[r, "B"], resumed[r, "C"])
    # rank 0 collects what one process resumed from the same checkpoint collects
    dm = RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=32, seed=0, eval_episodes=0)
    make_trainer(max_steps=4).fit(DDPAgent(str(ddp_run), "_resumed_here"), datamodule=dm,
                                  ckpt_path=str(ddp_run / "last.ckpt"))
    assert torch.equal(torch.load(str(ddp_run / "obs_rank0_resumed_here.pt"), weights_only=True), resumed[0, "B"])


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
