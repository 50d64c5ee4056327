"""What a Lightning 2.6 user's tools get from the DataModule: progress bars, checkpoints, loggers, ``validate``.

* Lightning's stock bar, TQDM or Rich (its default once ``rich`` is installed), is swapped for
  the RL bar, and the Rich one keeps a long run's figures legible on one line of 100 columns;
* ``last.ckpt`` holds the last step whatever stops ``fit`` (``max_steps`` between evaluations);
* every row a logger receives has one x-axis: frames by default, Lightning's own ``self.log``
  rows included (a CSV ``step`` column that only grows);
* ``Trainer.validate`` and ``Trainer.test`` run evaluation episodes and return their metrics;
* ``fast_dev_run`` and a small ``limit_train_batches`` evaluate once;
* the checkpoint file-name recipe of ``docs/lightning.rst`` works as written, and a name that
  would make folders warns;
* a precision that casts the weights (``bf16-true``) is refused up front.

Evaluation returns are exact thanks to :class:`lightning_helpers.Climber`: after ``k`` training
batches its evaluation episodes return ``4 k``.
"""

from __future__ import annotations

import ast
import io
import os
import re
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger

from lightning_helpers import (
    FPB,
    LEVEL_EPISODE_STEPS,
    Agent,
    Climber,
    EpisodesPerBatch,
    climber_dm,
    eval_return,
    make_trainer,
    read_csv_rows,
    rollout_threads,
)
from lightning_rollout import EpisodeStatsLogger, RolloutDataModule, RolloutEvaluation

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(120)




# -- progress bars -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stock", ["tqdm", "rich"])
def test_lightnings_stock_bar_of_either_kind_is_swapped_for_the_rl_bar(stock):
    if stock == "rich":
        pytest.importorskip("rich")
    dm = RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=32, eval_every_n_frames=64, eval_episodes=1,
                           eval_max_episode_steps=20, seed=0)
    torch.manual_seed(0)  # an episode ends within each env's 32 steps, so "ret" is shown
    model = Agent()
    callbacks = [TQDMProgressBar()] if stock == "tqdm" else []  # rich installed: Lightning's default is Rich
    trainer = make_trainer(max_steps=2, enable_progress_bar=True, callbacks=callbacks)
    assert type(trainer.progress_bar_callback) is (TQDMProgressBar if stock == "tqdm" else RichProgressBar)
    trainer.fit(model, datamodule=dm)

    bar = trainer.progress_bar_callback
    assert type(bar).__name__ == ("RolloutProgressBar" if stock == "tqdm" else "RolloutRichProgressBar")
    shown = bar.get_metrics(trainer, model)
    assert list(shown)[:4] == ["frames", "fps", "ret", "eval"]
    assert shown["frames"] == "64" and int(shown["fps"]) > 0
    assert float(shown["eval"]) == pytest.approx(trainer.callback_metrics["eval/episode_reward"].item(), abs=0.05)
    assert not any(k.startswith(("rollout/", "eval/")) or k == "v_num" for k in shown)


def render_rich_training_bar(bar, *, width: int) -> str:
    """The Rich training bar's line as Lightning draws it (its own columns and metrics column), ``width`` columns."""
    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(bar.progress.make_tasks_table([bar.train_progress_bar]))
    return out.getvalue()


def test_the_rich_rl_bar_shows_a_long_runs_figures_legibly_on_one_line_of_100_columns():
    pytest.importorskip("rich")
    trainer = make_trainer(max_steps=2, enable_progress_bar=True)
    trainer.fit(Agent(), datamodule=RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=32,
                                                      eval_every_n_frames=64, eval_episodes=1,
                                                      eval_max_episode_steps=20, seed=0))
    bar = trainer.progress_bar_callback
    assert isinstance(bar, RichProgressBar)
    line = render_rich_training_bar(bar, width=100)
    assert "frames: 64 " in line and "rollout/" not in line and "." not in line.split("frames: ")[1].split()[0]

    # a long run's figures, in the bar Lightning drew
    bar.progress.update(bar.train_progress_bar_id, description="Epoch 12/99", completed=45, total=100)
    bar._metric_component.update(bar.shown({"rollout/frames": 12_345_678.0, "rollout/fps": 123_456.4,
                                            "rollout/episode_reward": -1234.46, "eval/episode_reward": 500.0}))
    line = render_rich_training_bar(bar, width=100)
    assert line.count("\n") == 1 and len(line.rstrip("\n")) <= 100, line
    for figure in ("frames: 12345678", "fps: 123456", "ret: -1234.5", "eval: 500.0", "45%"):
        assert figure in line, line


# -- last.ckpt ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("save_last", [True, "link"])
def test_last_ckpt_holds_the_last_step_when_max_steps_stops_between_evaluations(tmp_path, save_last):
    def fit(max_steps: int, ckpt_path: str | None = None) -> EpisodesPerBatch:
        recorder = EpisodesPerBatch()
        checkpoint = ModelCheckpoint(dirpath=str(tmp_path), monitor="eval/episode_reward", mode="max",
                                     save_last=save_last)
        make_trainer(max_steps=max_steps, callbacks=[recorder, checkpoint], enable_checkpointing=True).fit(
            Climber(), datamodule=climber_dm(eval_every_n_frames=4 * FPB), ckpt_path=ckpt_path)
        return recorder

    assert fit(6).eval_means == [eval_return(4)]  # evaluated (and checkpointed) after batch 4, stopped after 6
    last = torch.load(str(tmp_path / "last.ckpt"), weights_only=False)
    assert last["global_step"] == 6
    assert last["RolloutDataModule"]["collector"]["frames"] == 6 * FPB
    assert last["state_dict"]["actor.module.level"].item() == 6
    best = torch.load(str(tmp_path / "epoch=0-step=4.ckpt"), weights_only=False)
    assert best["global_step"] == 4  # the best checkpoint is left as it was (a link is replaced, not written through)

    recorder = fit(8, str(tmp_path / "last.ckpt"))  # the resume runs the batches after step 6 only
    assert len(recorder.per_batch) == 2 and recorder.eval_means == [eval_return(8)]
    assert rollout_threads() == []


# -- one x-axis for every logger row -----------------------------------------------------------------------------------

class LoggingClimber(Climber):
    """A Climber that logs its level with ``self.log`` at every training step."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/level", float(self.actor.module.level), batch_size=1)
        return loss


@pytest.mark.parametrize("step", ["frames", "batches"])
def test_every_csv_row_self_log_included_is_written_at_one_x_axis(tmp_path, step):
    callbacks = [] if step == "frames" else [EpisodeStatsLogger(step="batches"), RolloutEvaluation(step="batches")]
    trainer = make_trainer(max_steps=4, logger=CSVLogger(str(tmp_path)), callbacks=callbacks)
    trainer.fit(LoggingClimber(), datamodule=climber_dm(eval_every_n_frames=2 * FPB))
    rows = read_csv_rows(tmp_path)

    x = (lambda batch: FPB * batch) if step == "frames" else (lambda batch: batch - 1)  # after batch 1, 2...
    steps = [int(r["step"]) for r in rows]
    assert steps == sorted(steps)  # the column only grows
    assert {int(r["step"]) for r in rows if r["train/level"]} == {x(b) for b in (1, 2, 3, 4)}
    assert {int(r["step"]) for r in rows if r["rollout/frames"]} == {x(b) for b in (1, 2, 3, 4)}
    assert [(int(r["step"]), float(r["eval/episode_reward"])) for r in rows if r["eval/episode_reward"]] == [
        (x(2), eval_return(2)), (x(4), eval_return(4))]
    for r in rows:  # Lightning's and the callbacks' rows of one batch agree on its frames
        if r["train/level"] and step == "frames":
            assert int(r["step"]) == FPB * int(float(r["train/level"]))


def test_callbacks_asking_for_two_x_axes_are_refused():
    trainer = make_trainer(max_steps=1, callbacks=[EpisodeStatsLogger(step="batches"), RolloutEvaluation()])
    with pytest.raises(ValueError, match="pass the same step= to both"):
        trainer.fit(Climber(), datamodule=climber_dm(eval_every_n_frames=FPB))
    assert rollout_threads() == []

    recorder = EpisodesPerBatch()  # one of them given: the one the DataModule adds takes its axis
    trainer = make_trainer(max_steps=2, callbacks=[recorder, EpisodeStatsLogger(step="batches")])
    trainer.fit(Climber(), datamodule=climber_dm(eval_every_n_frames=FPB))
    assert [c.step for c in trainer.callbacks if isinstance(c, RolloutEvaluation)] == ["batches"]
    assert recorder.eval_means == [eval_return(1), eval_return(2)]


# -- Trainer.validate / Trainer.test -----------------------------------------------------------------------------------

def test_validate_and_test_run_evaluation_episodes_and_return_their_metrics(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    make_trainer(max_steps=3, callbacks=[checkpoint], enable_checkpointing=True).fit(
        Climber(), datamodule=climber_dm())
    ckpt = str(tmp_path / "last.ckpt")

    model = Climber()
    evaluation = RolloutEvaluation()
    (validated,) = make_trainer(callbacks=[evaluation]).validate(model, datamodule=climber_dm(), ckpt_path=ckpt)
    assert validated["eval/episode_reward"] == eval_return(3)  # the checkpoint's weights, fresh episodes
    assert validated["eval/episode_length"] == LEVEL_EPISODE_STEPS
    assert len(evaluation.last_round.episodes) == 2 and evaluation.last_round.frames == 3 * FPB
    assert "validation_step" not in model.__dict__  # lent for the call, taken back

    (tested,) = make_trainer().test(model, datamodule=climber_dm(eval_episodes=3), ckpt_path=ckpt)
    assert tested["test/episode_reward"] == eval_return(3) and tested["test/episode_reward_min"] == eval_return(3)
    assert not any(k.startswith("eval/") for k in tested)
    assert "test_step" not in model.__dict__

    (untrained,) = make_trainer().validate(Climber(), datamodule=climber_dm())
    assert untrained["eval/episode_reward"] == 0.0
    assert rollout_threads() == []


# -- smoke runs evaluate -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("smoke, batches", [(dict(fast_dev_run=True), 1),
                                            (dict(limit_train_batches=2, max_epochs=1), 2)])
def test_fast_dev_run_and_a_small_limit_train_batches_run_the_evaluation(smoke, batches):
    recorder = EpisodesPerBatch()
    model = Climber()
    make_trainer(callbacks=[recorder], **smoke).fit(model, datamodule=climber_dm(eval_every_n_frames=4 * FPB,
                                                                                  total_frames=10 * FPB))
    assert model.batches == batches
    assert recorder.eval_means == [eval_return(batches)]
    assert rollout_threads() == []


# -- checkpoint file names ---------------------------------------------------------------------------------------------

def documented_checkpoint_recipe() -> str:
    """The imports and the ``checkpoint = ModelCheckpoint(...)`` statement of the docs' file-name recipe, verbatim."""
    text = (REPO / "docs" / "lightning.rst").read_text(encoding="utf-8")
    match = re.search(r"\.\. _checkpoint-filenames:\n.*?\.\. code-block:: python\n\n((?:(?:   [^\n]*)?\n)+)",
                      text, re.S)
    assert match, "docs/lightning.rst has no code block after the `.. _checkpoint-filenames:` label"
    code = "\n".join(line[3:] for line in match.group(1).splitlines())
    tree = ast.parse(code)
    kept = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
            or (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["checkpoint"])]
    assert any(isinstance(node, ast.Assign) for node in kept), "the recipe sets `checkpoint = ModelCheckpoint(...)`"
    return "\n".join(ast.get_source_segment(code, node) for node in kept)


def test_the_documented_checkpoint_filename_recipe_writes_flat_files_named_by_the_figures(tmp_path):
    namespace: dict = {}
    exec(compile(documented_checkpoint_recipe(), "docs/lightning.rst", "exec"), namespace)
    checkpoint = namespace["checkpoint"]
    assert isinstance(checkpoint, ModelCheckpoint)
    trainer = make_trainer(max_steps=6, default_root_dir=str(tmp_path), callbacks=[checkpoint],
                           enable_checkpointing=True)
    trainer.fit(Climber(), datamodule=climber_dm(eval_every_n_frames=2 * FPB))
    folders = [p for p in tmp_path.rglob("*") if p.is_dir()]
    assert folders == [Path(checkpoint.dirpath)], folders  # one folder, no folder per checkpoint
    names = sorted(os.listdir(checkpoint.dirpath))
    assert len(names) == checkpoint.save_top_k and all(n.endswith(".ckpt") for n in names)
    best = os.path.basename(checkpoint.best_model_path)
    assert f"{eval_return(6):.1f}" in best and "step=6" in best and "/" not in best, best


def test_a_checkpoint_filename_that_would_make_folders_warns(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path), filename="{epoch}-{step}-{eval/episode_reward:.1f}",
                                 monitor="eval/episode_reward", mode="max")
    with pytest.warns(UserWarning, match=r"auto_insert_metric_name=False.*reward=\{eval/episode_reward:\.1f\}"):
        make_trainer(max_steps=2, callbacks=[checkpoint], enable_checkpointing=True).fit(
            Climber(), datamodule=climber_dm(eval_every_n_frames=2 * FPB))


# -- precision ---------------------------------------------------------------------------------------------------------

def test_a_precision_that_casts_the_weights_is_refused_up_front_and_mixed_precision_trains():
    with pytest.raises(ValueError, match=r"precision='bf16-true'.*torch.bfloat16.*'bf16-mixed'"):
        make_trainer(max_steps=1, precision="bf16-true").fit(Agent(), datamodule=RolloutDataModule(
            "CartPole-v1", num_envs=2, frames_per_batch=32, eval_episodes=1, eval_max_episode_steps=10))
    assert rollout_threads() == []

    trainer = make_trainer(max_epochs=1, precision="bf16-mixed")  # what the message advises
    trainer.fit(Agent(), datamodule=RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=32, total_frames=32,
                                                      eval_episodes=1, eval_max_episode_steps=10))
    assert trainer.global_step == 1 and "eval/episode_reward" in trainer.callback_metrics
