"""What a Lightning user does by habit around ``fit`` works (issue 14).

* evaluation is Lightning's validation loop: ``EarlyStopping`` stops at the first
  evaluation that meets its bar and ``ModelCheckpoint`` keeps the best one, with a
  finite and an endless collector, on every schedule (frames, ``val_check_interval``,
  end of epoch);
* rollout and evaluation metrics reach TensorBoard at every batch, against frames;
* the DataModule, its env factory and its callbacks pickle (``ddp_spawn`` itself runs
  in ``test_lightning.py``'s DDP test);
* ``rollout/fps`` is total frames per second of wall time, ``rollout/collect_fps``
  per-rank collection speed;
* ``LightningCLI`` trains from a config file, and ``--print_config`` round-trips;
* the progress bar shows whole frames, fps and returns within 80 columns;
* resuming runs exactly the batches left and warns nothing misleading;
* the complete module of ``docs/lightning.rst`` runs as shown.

Evaluation returns are made exact by :class:`lightning_helpers.Climber`: after ``k``
training batches its evaluation episodes return ``4 k``. Nothing here waits on a
clock: ``rollout/fps`` is checked with a fake one.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from lightning.pytorch.loggers import TensorBoardLogger

from conftest import MockEnv
from lightning_helpers import (
    FPB,
    Agent,
    Climber,
    EpisodesPerBatch,
    climber_dm,
    eval_return,
    make_trainer,
    read_scalars,
    rollout_threads,
)
from lightning_rollout import (
    EpisodeStatsLogger,
    EvalRound,
    RolloutDataModule,
    RolloutEvaluation,
    RolloutProgressBar,
    RolloutRichProgressBar,
)

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(120)




class RecordedWarnings:
    """Records the warnings of a block, minus deprecations of Lightning / torch internals (not this package's)."""

    def __enter__(self) -> list[str]:
        self._catch = warnings.catch_warnings(record=True)
        self._records = self._catch.__enter__()
        warnings.simplefilter("always")
        self.messages: list[str] = []
        return self.messages

    def __exit__(self, *exc: object) -> None:
        self._catch.__exit__(*exc)
        self.messages.extend(str(w.message) for w in self._records
                             if not issubclass(w.category, (DeprecationWarning, FutureWarning))
                             or "RolloutDataModule" in str(w.message))


# -- item 1: evaluation is the validation loop ---------------------------------------------------------------------

@pytest.mark.parametrize("collector", ["finite", "endless"])
def test_early_stopping_and_checkpoint_act_at_the_first_eval_that_meets_the_bar(tmp_path, collector):
    # evaluations after batches 2, 4, 6... return 8, 16, 24...; the bar (20) is first met after batch 6
    frames = dict(total_frames=20 * FPB) if collector == "finite" else dict(total_frames=-1)
    dm = climber_dm(eval_every_n_frames=2 * FPB, **frames)
    recorder = EpisodesPerBatch()
    stopper = EarlyStopping(monitor="eval/episode_reward", mode="max", stopping_threshold=20, patience=1000)
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path), monitor="eval/episode_reward", mode="max")
    trainer = make_trainer(max_epochs=1 if collector == "finite" else -1, max_steps=100,
                           callbacks=[recorder, stopper, checkpoint], enable_checkpointing=True)
    model = Climber()
    trainer.fit(model, datamodule=dm)

    assert recorder.eval_means == [eval_return(2), eval_return(4), eval_return(6)]
    assert model.batches == 6 and dm.collector.frames == 6 * FPB  # stopped right after the first good eval
    assert stopper.stopping_reason == EarlyStoppingReason.STOPPING_THRESHOLD
    assert trainer.callback_metrics["eval/episode_reward"].item() == eval_return(6)
    assert checkpoint.best_model_score.item() == eval_return(6)
    best = torch.load(checkpoint.best_model_path, weights_only=True)
    assert best["RolloutDataModule"]["collector"]["frames"] == 6 * FPB
    assert best["state_dict"]["actor.module.level"].item() == 6  # the weights that scored it
    assert rollout_threads() == []


@pytest.mark.parametrize("schedule, evaluated_after", [
    ({}, [10]),  # Lightning's default: once per epoch, i.e. after a finite collector's last batch
    ({"trainer": dict(val_check_interval=3, check_val_every_n_epoch=None)}, [3, 6, 9, 10]),
    ({"dm": dict(eval_every_n_frames=3 * FPB)}, [3, 6, 9, 10]),
    ({"dm": dict(eval_every_n_frames=3 * FPB - 5)}, [3, 6, 9, 10]),  # rounded up to whole batches
])
def test_evaluation_runs_on_lightnings_schedule_and_after_the_last_batch(tmp_path, schedule, evaluated_after):
    dm = climber_dm(total_frames=10 * FPB, **schedule.get("dm", {}))
    recorder = EpisodesPerBatch()
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path), monitor="eval/episode_reward", mode="max")
    trainer = make_trainer(max_epochs=1, callbacks=[recorder, checkpoint], enable_checkpointing=True,
                           **schedule.get("trainer", {}))
    trainer.fit(Climber(), datamodule=dm)
    assert recorder.eval_means == [eval_return(k) for k in evaluated_after]
    # the last round reaches callback_metrics, and the best checkpoint is the best round's
    assert trainer.callback_metrics["eval/episode_reward"].item() == eval_return(10)
    assert checkpoint.best_model_score.item() == eval_return(10)
    assert os.path.basename(checkpoint.best_model_path) == "epoch=0-step=10.ckpt"


def test_eval_every_n_frames_counts_frames_whatever_the_optimizer_steps_per_batch():
    recorder = EpisodesPerBatch()
    model = Climber(optimizer_steps=4)  # manual optimization, 4 optimizer steps per batch (as PPO's minibatches)
    make_trainer(max_steps=4 * 6, callbacks=[recorder]).fit(model, datamodule=climber_dm(eval_every_n_frames=2 * FPB))
    assert model.batches == 6
    assert recorder.eval_means == [eval_return(2), eval_return(4), eval_return(6)]


def test_a_module_with_its_own_validation_step_receives_each_eval_round():
    class Graded(Climber):
        def __init__(self) -> None:
            super().__init__()
            self.rounds: list[EvalRound] = []

        def validation_step(self, batch, batch_idx):
            self.rounds.append(batch)
            self.log("eval/perfect", float(batch.mean_reward == 4 * self.batches), batch_size=1)

    model = Graded()
    trainer = make_trainer(max_steps=4)
    trainer.fit(model, datamodule=climber_dm(eval_every_n_frames=2 * FPB))
    assert [len(r.episodes) for r in model.rounds] == [2, 2]
    assert [r.frames for r in model.rounds] == [2 * FPB, 4 * FPB]
    assert [r.mean_reward for r in model.rounds] == [eval_return(2), eval_return(4)]
    assert trainer.callback_metrics["eval/perfect"].item() == 1.0
    assert "validation_step" not in model.__dict__  # its own, nothing lent


def test_the_lent_validation_step_is_taken_back_and_fit_warns_nothing(tmp_path):
    model = Climber()
    with RecordedWarnings() as messages:
        make_trainer(max_steps=4, callbacks=[ModelCheckpoint(dirpath=str(tmp_path), monitor="eval/episode_reward",
                                                             mode="max")],
                     enable_checkpointing=True).fit(model, datamodule=climber_dm(eval_every_n_frames=2 * FPB))
    assert messages == []
    assert "validation_step" not in model.__dict__

    recorder = EpisodesPerBatch()  # eval_episodes=0: no validation loop at all
    with RecordedWarnings() as messages:
        make_trainer(max_steps=2, callbacks=[recorder]).fit(model, datamodule=climber_dm(eval_episodes=0))
    assert messages == [] and recorder.eval_means == []


def test_eval_every_n_frames_refuses_a_schedule_given_to_the_trainer_too():
    with pytest.raises(ValueError, match="leave those at their defaults"):
        make_trainer(max_steps=2, val_check_interval=5).fit(Climber(), datamodule=climber_dm(eval_every_n_frames=32))
    assert rollout_threads() == []


def test_deprecated_eval_every_n_steps_warns_and_keeps_its_schedule_for_one_optimizer_step_per_batch():
    with pytest.warns(FutureWarning, match="eval_every_n_frames"):
        dm = climber_dm(eval_every_n_steps=2)
    recorder = EpisodesPerBatch()
    make_trainer(max_steps=6, callbacks=[recorder]).fit(Climber(), datamodule=dm)
    assert recorder.eval_means == [eval_return(2), eval_return(4), eval_return(6)]

    with pytest.warns(FutureWarning):
        dm = climber_dm(eval_every_n_steps=8)
    with pytest.raises(ValueError, match=r"manual optimization.*eval_every_n_frames= \(frames per rank, e.g. 128"):
        make_trainer(max_steps=8).fit(Climber(optimizer_steps=4), datamodule=dm)
    assert rollout_threads() == []


# -- item 3: metrics against frames, at every batch ------------------------------------------------------------------

@pytest.mark.parametrize("log_every_n_steps, step", [(1, "frames"), (50, "frames"), (50, "batches")])
def test_rollout_and_eval_metrics_are_written_at_every_batch_against_frames(tmp_path, log_every_n_steps, step):
    # episodes of 10, 13 or 16 steps, 8 steps per env per batch: some batches finish no episode
    ids = iter(range(100))
    dm = RolloutDataModule(lambda: MockEnv(next(ids), length_fn=lambda i, e: 10 + 3 * ((i + e) % 3)), num_envs=2,
                           frames_per_batch=16, eval_every_n_frames=48, eval_episodes=2, eval_max_episode_steps=5)
    recorder = EpisodesPerBatch()
    callbacks = [recorder, EpisodeStatsLogger(step=step), RolloutEvaluation(step=step)]
    trainer = make_trainer(max_steps=7, logger=TensorBoardLogger(str(tmp_path), name="tb"), callbacks=callbacks,
                           log_every_n_steps=log_every_n_steps)
    trainer.fit(Agent(obs_dim=3), datamodule=dm)
    scalars = read_scalars(tmp_path / "tb")

    x = (lambda batch: 16 * (batch + 1)) if step == "frames" else (lambda batch: batch)  # batch is 0-based
    assert scalars["rollout/frames"] == [(x(b), 16.0 * (b + 1)) for b in range(7)]
    for tag in ("rollout/episodes", "rollout/fps", "rollout/collect_fps", "rollout/policy_lag"):
        assert [s for s, _ in scalars[tag]] == [x(b) for b in range(7)], tag
    finished = [(b, episodes) for b, episodes in enumerate(recorder.per_batch) if episodes]
    assert 0 < len(finished) < 7
    assert [s for s, _ in scalars["rollout/episode_reward"]] == [x(b) for b, _ in finished]  # never a stale repeat
    assert [v for _, v in scalars["rollout/episode_reward"]] == pytest.approx(
        [sum(r for r, _ in eps) / len(eps) for _, eps in finished])
    assert [v for _, v in scalars["rollout/episode_length"]] == pytest.approx(
        [sum(n for _, n in eps) / len(eps) for _, eps in finished])
    # evaluation after batches 3 and 6 (48 frames each), at the same x as that batch's rollout metrics
    assert [s for s, _ in scalars["eval/episode_reward"]] == [x(2), x(5)]
    assert [v for _, v in scalars["eval/episode_reward"]] == pytest.approx(recorder.eval_means)
    assert all(v <= 5 for _, v in scalars["eval/episode_length"])  # eval_max_episode_steps caps the episodes


# -- item 4: everything the DataModule builds pickles ------------------------------------------------------------

def test_datamodule_env_factory_and_callbacks_pickle_before_and_after_fit():
    dm = RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=32, eval_every_n_frames=64, eval_episodes=1,
                           eval_max_episode_steps=20)
    copy_before = pickle.loads(pickle.dumps(dm))
    env = pickle.loads(pickle.dumps(dm.env_factory))()
    assert env.reset(seed=0)[0].shape == (4,)
    env.close()

    trainer = make_trainer(max_steps=2, enable_progress_bar=True)
    trainer.fit(Agent(), datamodule=dm)
    ours = [c for c in trainer.callbacks
            if isinstance(c, (EpisodeStatsLogger, RolloutEvaluation, RolloutProgressBar, RolloutRichProgressBar))]
    assert len(ours) == 3
    pickle.loads(pickle.dumps(ours))
    copy_after = pickle.loads(pickle.dumps(dm))  # the collector's threads stay behind, its counters travel
    assert copy_after.collector is None and copy_after.state_dict()["collector"]["frames"] == 64

    make_trainer(max_steps=1).fit(Agent(), datamodule=copy_after)
    assert copy_after.collector.frames == 3 * 32
    make_trainer(max_steps=1).fit(Agent(), datamodule=copy_before)
    assert copy_before.collector.frames == 32
    assert rollout_threads() == []


# -- item 5: what the throughput figures mean ------------------------------------------------------------------------

class TickClock:
    def __init__(self) -> None:
        self.now = -1.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_fps_is_frames_per_wall_second_since_fit_started_and_collect_fps_the_last_batchs_collection_speed(tmp_path):
    dm = RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=32)
    trainer = make_trainer(max_steps=2, callbacks=[EpisodeStatsLogger(clock=TickClock())])
    trainer.fit(Agent(), datamodule=dm)
    metrics = trainer.callback_metrics
    assert metrics["rollout/fps"].item() == 64 / 2  # 2 batches, one fake second each
    assert metrics["rollout/collect_fps"].item() == pytest.approx(32 / dm.last_collect_seconds, rel=1e-5)

    ckpt = str(tmp_path / "two.ckpt")
    trainer.save_checkpoint(ckpt)
    trainer = make_trainer(max_steps=3, callbacks=[EpisodeStatsLogger(clock=TickClock())])
    trainer.fit(Agent(), datamodule=RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=32), ckpt_path=ckpt)
    assert trainer.callback_metrics["rollout/frames"].item() == 96
    assert trainer.callback_metrics["rollout/fps"].item() == 32 / 1  # only the frames of this fit count


# -- item 6: LightningCLI --------------------------------------------------------------------------------------------

@pytest.mark.timeout(240)
def test_cli_trains_from_the_example_config_and_print_config_round_trips(tmp_path):
    def cli(*args: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.run([sys.executable, str(REPO / "examples" / "cli.py"), *args], cwd=str(tmp_path),
                              env=env, capture_output=True, text=True, timeout=200)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return proc

    config = REPO / "examples" / "configs" / "ppo_cartpole.yaml"
    tiny = ["--data.total_frames", "1024", "--data.frames_per_batch", "256", "--data.num_envs", "4",
            "--data.eval_every_n_frames", "512", "--data.eval_episodes", "2", "--data.eval_max_episode_steps", "50",
            "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), "--trainer.enable_progress_bar", "false"]
    printed = cli("fit", "--config", str(config), *tiny, "--print_config").stdout
    (tmp_path / "printed.yaml").write_text(printed)
    assert "class_path: ppo_cartpole.PPO" in printed and "eval_every_n_frames: 512" in printed

    cli("fit", "--config", str(tmp_path / "printed.yaml"))  # trains from the printed config...
    saved_configs = list((tmp_path / "runs").glob("**/config.yaml"))
    assert len(saved_configs) == 1 and saved_configs[0].read_text() == printed  # ...which it saves unchanged
    checkpoints = list((tmp_path / "runs").glob("**/checkpoints/*.ckpt"))
    assert len(checkpoints) == 1, sorted(str(p) for p in (tmp_path / "runs").glob("**/*"))
    saved = torch.load(str(checkpoints[0]), weights_only=False)
    assert saved["RolloutDataModule"]["collector"]["frames"] in (512, 1024)  # the best of the two evaluations
    assert list((tmp_path / "runs").glob("**/events.out.tfevents.*"))


# -- item 7: the progress bar ----------------------------------------------------------------------------------------

def test_progress_bar_shows_whole_frames_fps_and_returns_within_80_columns():
    # Seeded: an episode must end within the 32 steps of each env for "ret" to be shown (unseeded, neither of the
    # two envs' episodes ended in a few percent of runs).
    dm = RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=32, eval_every_n_frames=64, eval_episodes=1,
                           eval_max_episode_steps=20, seed=0)
    torch.manual_seed(0)
    model = Agent()
    # the TQDM bar, given: with rich installed, Lightning's default is its Rich bar (test_lightning_clients.py)
    trainer = make_trainer(max_steps=2, enable_progress_bar=True, callbacks=[TQDMProgressBar()])
    assert type(trainer.progress_bar_callback) is TQDMProgressBar
    trainer.fit(model, datamodule=dm)
    bar = trainer.progress_bar_callback
    assert isinstance(bar, RolloutProgressBar)  # the DataModule swapped Lightning's stock bar

    shown = bar.get_metrics(trainer, model)
    assert list(shown)[:4] == ["frames", "fps", "ret", "eval"]
    assert shown["frames"] == "64" and int(shown["fps"]) > 0  # whole numbers, as they are (tqdm would write 6.4e+1)
    assert float(shown["eval"]) == pytest.approx(trainer.callback_metrics["eval/episode_reward"].item(), abs=0.05)
    assert not any(k.startswith(("rollout/", "eval/")) or k == "v_num" for k in shown)

    # a long run's figures, drawn the way Lightning draws the training bar, at 80 columns
    line = render_bar(bar, {"rollout/frames": 12_345_678.0, "rollout/fps": 123_456.4,
                            "rollout/episode_reward": -1234.46, "eval/episode_reward": 500.0}, epoch=12,
                      elapsed=3 * 3600 + 61)
    assert len(line) <= 80, line
    for figure in ("frames=12345678", "fps=123456", "ret=-1234.5", "eval=500.0"):
        assert figure in line, line


def render_bar(bar: RolloutProgressBar, progress_bar_metrics: dict, *, epoch: int, elapsed: float) -> str:
    """The training bar's line for these progress-bar metrics, drawn as Lightning draws it, at 80 columns."""
    holder = Tqdm(total=100, disable=True)
    holder.set_postfix(bar.shown(progress_bar_metrics), refresh=False)
    return Tqdm.format_meter(n=45, total=100, elapsed=elapsed, ncols=80, prefix=f"Epoch {epoch}",
                             postfix=holder.postfix, bar_format=RolloutProgressBar.BAR_FORMAT)


def test_progress_bar_false_keeps_lightnings_stock_bar():
    trainer = make_trainer(max_steps=1, enable_progress_bar=True, callbacks=[TQDMProgressBar()])
    trainer.fit(Agent(), datamodule=RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=32,
                                                      progress_bar=False, eval_episodes=0))
    assert type(trainer.progress_bar_callback) is TQDMProgressBar


# -- item 8: resume ---------------------------------------------------------------------------------------------------

def fit_recording(dm: RolloutDataModule, ckpt_dir: Path, ckpt_path: str | None = None, **trainer_kwargs):
    """Fit a Climber with a ModelCheckpoint on eval/episode_reward; the batches run, rounds and warnings."""
    recorder = EpisodesPerBatch()
    checkpoint = ModelCheckpoint(dirpath=str(ckpt_dir), monitor="eval/episode_reward", mode="max", save_last=True,
                                 save_top_k=-1)
    trainer = make_trainer(callbacks=[recorder, checkpoint], enable_checkpointing=True, **trainer_kwargs)
    with RecordedWarnings() as messages:
        trainer.fit(Climber(), datamodule=dm, ckpt_path=ckpt_path)
    return trainer, recorder, messages


def test_resuming_from_an_end_of_epoch_last_ckpt_runs_no_extra_batch(tmp_path):
    def dm() -> RolloutDataModule:
        return climber_dm(batches_per_epoch=4)  # endless; Lightning's default schedule: evaluate at epoch end

    trainer, recorder, messages = fit_recording(dm(), tmp_path, max_epochs=2)
    assert recorder.eval_means == [eval_return(4), eval_return(8)] and messages == []
    trainer, recorder, messages = fit_recording(dm(), tmp_path, str(tmp_path / "last.ckpt"), max_epochs=3)
    assert len(recorder.per_batch) == 4 and trainer.datamodule.collector.frames == 12 * FPB
    assert recorder.eval_means == [eval_return(12)]
    assert sorted(p.name for p in tmp_path.glob("epoch=*.ckpt")) == [
        "epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]
    assert [m for m in messages if "exists and is not empty" not in m] == []  # that one is ModelCheckpoint's own


@pytest.mark.parametrize("collector", ["finite", "endless"])
def test_a_mid_epoch_resume_runs_exactly_the_batches_left_without_warnings(tmp_path, collector):
    def dm() -> RolloutDataModule:
        frames = dict(total_frames=8 * FPB) if collector == "finite" else dict(batches_per_epoch=3)
        return climber_dm(eval_every_n_frames=2 * FPB, **frames)

    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    _, recorder, messages = fit_recording(dm(), first_dir, max_steps=4)
    assert recorder.eval_means == [eval_return(2), eval_return(4)] and messages == []
    trainer, recorder, messages = fit_recording(dm(), second_dir, str(first_dir / "epoch=0-step=2.ckpt"
                                                                      if collector == "finite"
                                                                      else first_dir / "last.ckpt"),
                                                max_steps=8)
    left = 6 if collector == "finite" else 4
    assert len(recorder.per_batch) == left and trainer.global_step == 8
    assert trainer.datamodule.collector.frames == 8 * FPB
    evaluated = [4, 6, 8] if collector == "finite" else [6, 8]
    assert recorder.eval_means == [eval_return(k) for k in evaluated]  # the checkpoint's weights carry on climbing
    assert [m for m in messages if "dirpath has changed" not in m] == []  # ModelCheckpoint's own, for a new dir


# -- docs: the complete module of the Lightning guide ------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_the_lightning_guide_complete_module_runs_as_shown(tmp_path, monkeypatch):
    text = (REPO / "docs" / "lightning.rst").read_text(encoding="utf-8")
    match = re.search(r"\.\. _complete-module:\n.*?\.\. code-block:: python\n\n((?:(?:   [^\n]*)?\n)+)", text, re.S)
    assert match, "docs/lightning.rst has no code block after the `.. _complete-module:` label"
    code = "\n".join(line[3:] for line in match.group(1).splitlines())
    budget = re.compile(r"^TOTAL_FRAMES = .*$", re.M)
    assert budget.search(code), "the complete module sets its budget on a `TOTAL_FRAMES = ...` line"
    code = budget.sub("TOTAL_FRAMES = 4 * 1024", code)  # the one change: a tiny budget
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    exec(compile(code, "docs/lightning.rst", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.datamodule.collector.frames == 4 * 1024
    assert "eval/episode_reward" in trainer.callback_metrics
    assert list(tmp_path.glob("runs/**/events.out.tfevents.*"))
    assert rollout_threads() == []
