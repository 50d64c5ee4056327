"""What a Lightning 2.6 user found in round 4 (issue 46, B and A7), through Trainer, the DataModule and its files.

* ``LearningRateMonitor`` and ``DeviceStatsMonitor`` rows are on the frame axis, as every other row;
* a resume from a ``last.ckpt`` written at the end of ``fit`` keeps Lightning's epoch count;
* the end of ``fit`` says what stopped it and in which unit; an endless collector meeting the
  Trainer's default epoch limit warns;
* ``Trainer.predict``, and ``validate`` / ``test`` with evaluation off, point to what to do;
* the Rich bar left on screen shows the last evaluation, and a line logged at the end goes above it;
* a DataModule of a ``SerialEnv`` factory evaluates (its single envs).
* ``EpisodeStatsLogger`` on a trainer without a ``RolloutDataModule`` says what to pass.

The DDP resume (B1) is tested with the other DDP tests in ``test_lightning.py``.
"""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Iterator

import pytest
from lightning.pytorch.callbacks import Callback, DeviceStatsMonitor, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torchrl.envs import GymEnv, SerialEnv

from lightning_helpers import (
    FPB,
    Agent,
    Climber,
    climber_dm,
    eval_return,
    make_trainer,
    read_csv_rows,
    rollout_threads,
)
from lightning_rollout import RolloutDataModule, RolloutRichProgressBar

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def lightning_info() -> Iterator[list[str]]:
    """The messages Lightning's loggers (``rank_zero_info``) emit during the test."""
    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(handler)
    yield messages
    logger.removeHandler(handler)


# -- B2: every row on the frame axis -----------------------------------------------------------------------------------

def test_lr_and_device_stats_monitor_rows_are_written_at_the_frames_too(tmp_path):
    monitors = [LearningRateMonitor(), DeviceStatsMonitor(cpu_stats=True)]
    make_trainer(max_steps=4, logger=CSVLogger(str(tmp_path)), callbacks=monitors).fit(
        Climber(), datamodule=climber_dm(eval_every_n_frames=2 * FPB))
    rows = read_csv_rows(tmp_path)
    steps = [int(r["step"]) for r in rows]
    assert steps == sorted(steps)  # one x-axis: the column only grows
    batches = {FPB * b for b in (1, 2, 3, 4)}  # the frames after batch 1, 2...
    assert {int(r["step"]) for r in rows if r["lr-SGD"]} == {0} | batches  # the first at fit's start
    device = [k for k in rows[0] if k.startswith("DeviceStatsMonitor")]
    assert device and {int(r["step"]) for r in rows if any(r[k] for k in device)} == batches


# -- B3: a resume from the last.ckpt of the end of fit -----------------------------------------------------------------

class EpochRecorder(Climber):
    """A Climber recording ``(global_step, current_epoch, batch_idx)`` at every training step."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int, int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append((self.trainer.global_step, self.trainer.current_epoch, batch_idx))
        return super().training_step(batch, batch_idx)


def test_a_resume_from_the_last_ckpt_written_at_the_end_of_fit_keeps_the_epoch_count(tmp_path):
    def fit(max_steps: int, folder: str, ckpt_path: str | None = None) -> tuple[list[tuple[int, int, int]], int]:
        module = EpochRecorder()
        checkpoint = ModelCheckpoint(dirpath=str(tmp_path / folder), save_last=True, every_n_train_steps=2)
        trainer = make_trainer(max_steps=max_steps, callbacks=[checkpoint], enable_checkpointing=True)
        trainer.fit(module, datamodule=climber_dm(batches_per_epoch=4, eval_every_n_frames=4 * FPB),
                    ckpt_path=ckpt_path)
        return module.seen, trainer.current_epoch

    whole, whole_epoch = fit(10, "whole")
    fit(7, "cut")  # stopped in epoch 1, after its third batch; last.ckpt written when fit ends
    resumed, epoch = fit(10, "cut", str(tmp_path / "cut" / "last.ckpt"))
    assert whole[7:] == [(7, 1, 3), (8, 2, 0), (9, 2, 1)]
    assert resumed == whole[7:] and epoch == whole_epoch == 3


# -- B4: what stopped the run ------------------------------------------------------------------------------------------

def test_the_end_of_fit_says_which_limit_stopped_it_in_its_unit(lightning_info):
    make_trainer(max_steps=20).fit(Climber(), datamodule=climber_dm(total_frames=4 * FPB, eval_episodes=0))
    make_trainer(max_steps=8).fit(Climber(optimizer_steps=16), datamodule=climber_dm(eval_episodes=0))
    make_trainer(max_epochs=2).fit(Climber(), datamodule=climber_dm(batches_per_epoch=2, eval_episodes=0))
    stops = [m for m in lightning_info if m.startswith("Training stopped")]
    assert stops == [
        "Training stopped after 4 batches (64 frames per rank, global_step=4): RolloutDataModule(total_frames=64) "
        "reached (frames per rank)",
        "Training stopped after 1 batch (16 frames per rank, global_step=16): Trainer(max_steps=8) reached; it "
        "counts optimizer steps, 16 a batch here (RolloutDataModule(total_frames=...) counts frames per rank)",
        "Training stopped after 4 batches (64 frames per rank, global_step=4): Trainer(max_epochs=2) reached (an "
        "epoch is 2 batches)"]


class StopAfterOneBatch(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.should_stop = True


def test_an_endless_collector_under_the_trainers_default_epoch_limit_warns_in_frames(lightning_info):
    with pytest.warns(UserWarning, match=r"default of 1000 epochs of 1000 batches stops it after 16,000,000 frames"):
        make_trainer(callbacks=[StopAfterOneBatch()]).fit(Climber(), datamodule=climber_dm(eval_episodes=0))
    assert lightning_info[-1] == ("Training stopped after 1 batch (16 frames per rank, global_step=1): "
                                  "trainer.should_stop was set (by EarlyStopping, Trainer(max_time=...) or a "
                                  "callback)")


# -- B5: predict, and evaluation turned off ----------------------------------------------------------------------------

def test_predict_and_evaluation_turned_off_point_to_what_to_run():
    with pytest.raises(RuntimeError, match=r"Trainer.predict .* use trainer.validate\(model, datamodule=dm\)"):
        make_trainer().predict(Climber(), datamodule=climber_dm())
    for run in ("validate", "test"):
        with pytest.raises(ValueError, match=rf"Trainer.{run} runs evaluation episodes, .* eval_episodes=0"):
            getattr(make_trainer(), run)(Climber(), datamodule=climber_dm(eval_episodes=0))
    assert rollout_threads() == []


# -- B7: the Rich bar left on screen -----------------------------------------------------------------------------------

def test_the_rich_bar_left_on_screen_shows_the_last_evaluation_below_the_lines_logged_at_the_end():
    pytest.importorskip("rich")
    screen = io.StringIO()  # one terminal: the bar's console and a log handler write to it
    handler = logging.StreamHandler(screen)
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(handler)
    try:
        bar = RolloutRichProgressBar(console_kwargs=dict(file=screen, force_terminal=True, width=120,
                                                         color_system=None))
        make_trainer(max_steps=4, enable_progress_bar=True, callbacks=[bar]).fit(
            Climber(), datamodule=climber_dm(eval_every_n_frames=2 * FPB))
    finally:
        logger.removeHandler(handler)
    lines = re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue()))
    bars = [line for line in lines if "frames:" in line]
    assert any("`Trainer.fit` stopped" in line for line in lines)
    assert not any("stopped" in line for line in bars)  # each logged line on a line of its own
    assert bars[-1].rstrip().endswith(f"eval: {eval_return(4)}")


# -- A7: a SerialEnv factory ------------------------------------------------------------------------------------------

def serial_cartpoles() -> SerialEnv:
    return SerialEnv(2, lambda: GymEnv("CartPole-v1"))


def test_a_serial_env_factory_trains_validates_and_tests():
    dm = RolloutDataModule(serial_cartpoles, num_envs=2, envs_per_thread=2, frames_per_batch=32,
                           eval_every_n_frames=32, eval_episodes=2, eval_max_episode_steps=20, seed=0)
    module, trainer = Agent(), make_trainer(max_steps=2)
    trainer.fit(module, datamodule=dm)
    assert trainer.callback_metrics["eval/episode_length"] > 0
    (validated,), (tested,) = [getattr(trainer, run)(module, datamodule=dm) for run in ("validate", "test")]
    assert validated["eval/episode_length"] > 0 and tested["test/episode_length"] > 0
    assert rollout_threads() == []


def test_the_episode_stats_logger_without_a_rollout_datamodule_names_what_to_pass() -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from lightning_rollout import EpisodeStatsLogger

    class Plain(pl.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(torch.zeros(4, 4), batch_size=2)

    class Fit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.layer(batch).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(TypeError, match=r"datamodule=RolloutDataModule\(\.\.\.\)"):
        make_trainer(max_steps=1, callbacks=[EpisodeStatsLogger()]).fit(Fit(), datamodule=Plain())
