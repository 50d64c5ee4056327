"""Video of evaluation episodes: ``RolloutEvaluation(record_video=...)`` (issue 13, item 5).

The clips are read back: the MP4 files with ``imageio-ffmpeg`` and the TensorBoard video
summary (an animated GIF) from the event file, and their frame counts and shapes are
checked against the recorded episode (its length + 1 frames: the reset frame, then one
frame per step). CartPole renders ``[400, 600, 3]`` frames at 50 fps.
"""

from __future__ import annotations

import glob
import io
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

pytest.importorskip("imageio_ffmpeg", reason="the video extra is not installed")
pytest.importorskip("pygame", reason="CartPole's rgb_array rendering needs pygame (video extra)")

from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402
from PIL import Image  # noqa: E402

from lightning_helpers import Agent, make_trainer  # noqa: E402
from lightning_rollout import MultiEnvLoop, RolloutCallback  # noqa: E402
from lightning_rollout.envs import GymMaker  # noqa: E402
from lightning_rollout.lightning import RolloutDataModule, RolloutEvaluation, VideoRecording  # noqa: E402
from lightning_rollout.lightning import video as video_module  # noqa: E402
from lightning_rollout.lightning.video import VideoRecorder  # noqa: E402

pytestmark = pytest.mark.timeout(120)

CARTPOLE_FRAME = (400, 600, 3)
CARTPOLE_FPS = 50


def read_mp4(path: str) -> tuple[dict, list[np.ndarray]]:
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(path)
    meta = next(reader)
    width, height = meta["size"]
    frames = [np.frombuffer(f, np.uint8).reshape(height, width, 3) for f in reader]
    return meta, frames


def read_gif(data: bytes) -> tuple[list[tuple[int, int]], int]:
    """Sizes (height, width) of every GIF frame and the total duration in ms."""
    image = Image.open(io.BytesIO(data))
    sizes, total = [], 0
    try:
        while True:
            sizes.append((image.size[1], image.size[0]))
            total += image.info["duration"]
            image.seek(image.tell() + 1)
    except EOFError:
        pass
    return sizes, total


def read_video_summaries(log_dir: Path, tag: str) -> list:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = glob.glob(str(log_dir / "**" / "events.out.tfevents.*"), recursive=True)
    assert len(files) == 1, files
    acc = EventAccumulator(files[0], size_guidance={"images": 0})
    acc.Reload()
    return list(acc.Images(tag))


class EvalLengths(RolloutCallback):
    """Length of every evaluation round's episodes, in round order."""

    def __init__(self) -> None:
        self.rounds: list[list[int]] = []

    def on_eval_end(self, trainer, pl_module, episodes) -> None:
        self.rounds.append([e.length for e in episodes])


def test_fit_records_every_nth_evaluation_to_mp4_and_tensorboard(tmp_path):
    """CartPole by gym id: rounds 0 and 2 of 4 are recorded; the clips hold the round's episode, frame for frame."""
    torch.manual_seed(0)
    lengths = EvalLengths()
    evaluation = RolloutEvaluation(record_video=2)
    dm = RolloutDataModule("CartPole-v1", num_envs=4, frames_per_batch=64, total_frames=256,
                           eval_every_n_frames=64, eval_episodes=1, seed=0)
    trainer = make_trainer(max_epochs=1, logger=TensorBoardLogger(tmp_path, name="run"),
                           callbacks=[evaluation, lengths])
    trainer.fit(Agent(), datamodule=dm)

    assert len(lengths.rounds) == 4 and evaluation.evaluations == 4
    video_dir = tmp_path / "run" / "version_0" / "videos"  # next to the event file
    mp4s = sorted(video_dir.glob("*.mp4"))
    assert [p.name for p in mp4s] == ["eval-frames-0000000064.mp4", "eval-frames-0000000192.mp4"]
    assert evaluation.last_video == str(mp4s[-1])
    recorded = [lengths.rounds[0][0], lengths.rounds[2][0]]
    for path, length in zip(mp4s, recorded):
        meta, frames = read_mp4(str(path))
        assert meta["fps"] == CARTPOLE_FPS
        assert len(frames) == length + 1  # the reset frame, then one per step
        assert all(f.shape == CARTPOLE_FRAME for f in frames)
        assert len({f.tobytes() for f in frames}) > 1  # the cart moves

    summaries = read_video_summaries(tmp_path, "eval/video")
    assert [s.step for s in summaries] == [64, 192]
    for summary, length in zip(summaries, recorded):
        assert (summary.height, summary.width) == CARTPOLE_FRAME[:2]
        sizes, duration_ms = read_gif(summary.encoded_image_string)
        # Pillow merges consecutive identical frames into a longer one; the duration counts every frame
        assert 1 < len(sizes) <= length + 1 and duration_ms == (length + 1) * 1000 // CARTPOLE_FPS
        assert set(sizes) == {CARTPOLE_FRAME[:2]}


def test_recorder_caps_frames_and_ends_at_the_loops_time_limit():
    """Through a MultiEnvLoop: an episode cut by ``max_episode_steps`` (which the env never sees) ends the clip,
    ``max_frames`` keeps the first frames, and only one env of the loop is recorded."""
    recorder = VideoRecorder(VideoRecording(max_frames=1000))
    capped = VideoRecorder(VideoRecording(max_frames=3))
    policy = lambda obs: torch.zeros(obs.shape[0], dtype=torch.long)  # noqa: E731 (always push left)
    for rec, expected in ((recorder, 6), (capped, 3)):
        factory = rec.wrap_factory(GymMaker("CartPole-v1"))
        with MultiEnvLoop([factory] * 2, policy, eval=True, lookahead=False, max_episode_steps=5, seed=0) as loop:
            assert rec.take() is None  # the construction resets are not recorded
            rec.arm()
            episodes = loop.run_episodes(2)
            frames = rec.take()
        assert [e.batch_size[0] for e in episodes] == [5, 5]  # [T_i] trajectories
        assert frames is not None and len(frames) == expected
        assert all(f.shape == CARTPOLE_FRAME and f.dtype == np.uint8 for f in frames)
        assert rec.fps == CARTPOLE_FPS
        assert rec.take() is None  # taken once; disarmed


def test_write_mp4_pads_odd_sizes(tmp_path):
    frames = [np.full((5, 7, 3), 40 * i, np.uint8) for i in range(4)]
    path = tmp_path / "sub" / "clip.mp4"
    video_module.write_mp4(str(path), frames, fps=10)
    meta, back = read_mp4(str(path))
    assert meta["fps"] == 10 and len(back) == 4 and back[0].shape == (6, 8, 3)


class NoRender(gym.Env):
    """CartPole-shaped env made without a render mode."""

    metadata: dict = {"render_modes": []}
    observation_space = gym.spaces.Box(-1.0, 1.0, shape=(4,), dtype=np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(4, np.float32), {}

    def step(self, action):
        return np.zeros(4, np.float32), 1.0, True, False, {}


def test_factory_without_rgb_array_rendering_is_refused():
    with pytest.raises(ValueError, match="render_mode='rgb_array'"):
        VideoRecorder(VideoRecording()).wrap_factory(NoRender)()


def test_torchrl_env_factory_is_refused():
    from torchrl.envs import GymEnv

    with pytest.raises(ValueError, match="renders gymnasium envs"):
        VideoRecorder(VideoRecording()).wrap_factory(lambda: GymEnv("CartPole-v1"))()


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_bad_record_video_is_refused(bad):
    with pytest.raises(ValueError, match="record_video"):
        RolloutEvaluation(record_video=bad)


@pytest.mark.parametrize("kwargs", [dict(every_n_evals=0), dict(fps=0), dict(max_frames=0),
                                    dict(mp4=False, tensorboard=False)])
def test_bad_video_recording_is_refused(kwargs):
    with pytest.raises(ValueError, match="VideoRecording"):
        VideoRecording(**kwargs)


def test_missing_video_extra_names_it(monkeypatch):
    real = video_module.importlib.util.find_spec
    monkeypatch.setattr(video_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == "imageio_ffmpeg" else real(name, *a))
    with pytest.raises(ImportError, match=r"lightning_rollout\[video\]"):
        RolloutEvaluation(record_video=1)
    RolloutEvaluation(record_video=VideoRecording(mp4=False))  # the TensorBoard clip alone needs no ffmpeg


def test_failed_write_fails_fit(tmp_path, monkeypatch):
    """An error in the background writer is not lost: ``fit`` raises it at its end, chained."""
    def broken(path, frames, *, fps):
        raise OSError("disk full")

    monkeypatch.setattr(video_module, "write_mp4", broken)
    dm = RolloutDataModule("CartPole-v1", num_envs=2, frames_per_batch=32, total_frames=32, eval_episodes=1,
                           seed=0)
    trainer = make_trainer(max_epochs=1, default_root_dir=tmp_path,
                           callbacks=[RolloutEvaluation(record_video=VideoRecording(tensorboard=False))])
    with pytest.raises(RuntimeError, match="writing an evaluation clip failed: OSError: disk full") as info:
        trainer.fit(Agent(), datamodule=dm)
    assert isinstance(info.value.__cause__, OSError)


def test_recording_callback_pickles_for_ddp_spawn():
    """``strategy="ddp_spawn"`` pickles the trainer's callbacks: the recorder travels without its lock and threads."""
    import pickle

    evaluation = pickle.loads(pickle.dumps(RolloutEvaluation(record_video=VideoRecording(every_n_evals=3, fps=10))))
    assert evaluation.record_video == VideoRecording(every_n_evals=3, fps=10)
    assert evaluation.video_recorder is not None and evaluation.video_recorder.take() is None
