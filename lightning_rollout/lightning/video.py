"""Video of evaluation episodes: :class:`VideoRecording` and the machinery of ``RolloutEvaluation(record_video=...)``.

``docs/lightning.rst`` ("Video of evaluation episodes") describes what is recorded, in which thread, and what it
needs. Frames stay in memory until written (``H x W x 3`` bytes each)."""

from __future__ import annotations

import importlib.util
import io
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from .._checks import check_int, warn_user
from ..envs import GymMaker, close_quietly

__all__ = ["VideoRecording"]

_DEFAULT_FPS = 30


@dataclass(frozen=True, kw_only=True)
class VideoRecording:
    """What ``RolloutEvaluation(record_video=...)`` records: one episode of the evaluation rounds ``0, N, 2N, ...``
    of ``fit``, on global rank zero (``record_video=N`` is ``VideoRecording(every_n_evals=N)``).

    Attributes:
        every_n_evals: record one episode every this many evaluation rounds (``1``: every round).
        fps: frames per second of the clip; ``None`` (default): the env's ``metadata["render_fps"]``, else 30.
        max_frames: frames kept per clip (the first of the episode, reset frame included); bounds its memory.
        mp4: write ``<dirpath>/<prefix>-<step axis>-<step>.mp4`` (H.264, needs ``imageio-ffmpeg``).
        tensorboard: write the clip to every ``TensorBoardLogger`` as the summary ``<prefix>/video`` (needs Pillow).
        dirpath: folder of the MP4 files; ``None`` (default): ``videos/`` in the trainer's ``log_dir``.

    Raises:
        ValueError: a count or rate below 1, or both outputs turned off.
    """

    every_n_evals: int = 1
    fps: int | None = None
    max_frames: int = 1000
    mp4: bool = True
    tensorboard: bool = True
    dirpath: str | None = None

    def __post_init__(self) -> None:
        for name in ("every_n_evals", "max_frames", "fps"):
            check_int(f"VideoRecording.{name}", getattr(self, name), 1, optional=name == "fps")
        if not (self.mp4 or self.tensorboard):
            raise ValueError("VideoRecording with mp4=False and tensorboard=False writes nothing; "
                             "turn one on, or drop record_video")


def as_video_recording(record_video: int | VideoRecording | None) -> VideoRecording | None:
    """``record_video`` as :class:`VideoRecording` (``None``: off); ``ValueError`` for another type,
    ``ImportError`` when an output's package is missing."""
    if record_video is None:
        return None
    if isinstance(record_video, int) and not isinstance(record_video, bool) and record_video >= 1:
        config = VideoRecording(every_n_evals=record_video)
    elif isinstance(record_video, VideoRecording):
        config = record_video
    else:
        raise ValueError(f"record_video must be None, an int N >= 1 (one episode every N evaluations) or a "
                         f"VideoRecording, got {record_video!r}")
    missing = [pkg for pkg, needed in (("imageio_ffmpeg", config.mp4), ("PIL", config.tensorboard))
               if needed and importlib.util.find_spec(pkg) is None]
    if missing:
        raise ImportError(f"record_video needs {', '.join(missing)}: pip install 'lightning_rollout[video]' "
                          "(imageio-ffmpeg for the MP4 file, Pillow for the TensorBoard clip)")
    return config


class VideoRecorder:
    """Captures one evaluation episode's frames (of ``config``) and writes them out. :meth:`on_reset` /
    :meth:`on_step` run in the wrapped envs' threads, the rest in the main thread; a lock guards the state."""

    def __init__(self, config: VideoRecording) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._armed = False
        self._owner: _RecordingEnv | None = None
        self._frames: list[np.ndarray] = []
        self._steps = 0
        self.fps = config.fps or _DEFAULT_FPS  # of the clips: the env's render_fps unless the config sets one
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None

    def __getstate__(self) -> dict[str, Any]:  # ddp_spawn pickles the trainer's callbacks
        self.wait(raise_errors=False)
        return {"config": self.config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["config"])  # type: ignore[misc]

    def wrap_factory(self, factory: Callable[[], Any]) -> Callable[[], gym.Env]:
        """A factory of recordable evaluation envs: a :class:`~lightning_rollout.envs.GymMaker` is rebuilt with
        ``render_mode="rgb_array"``; another factory must return a ``gymnasium.Env`` made with it (checked when
        called: ``ValueError``)."""
        if isinstance(factory, GymMaker):
            factory = GymMaker(factory.env_id, **{**factory.kwargs, "render_mode": "rgb_array"})

        def make() -> gym.Env:
            env = factory()
            if not isinstance(env, gym.Env) or env.render_mode != "rgb_array":
                close_quietly([env])
                got = f"render_mode={env.render_mode!r}" if isinstance(env, gym.Env) else type(env).__name__
                raise ValueError(f"RolloutEvaluation(record_video=...) renders gymnasium envs made with "
                                 f"render_mode='rgb_array', and the env factory returned {got}: pass a gymnasium id, "
                                 "or a factory of gym.make(..., render_mode='rgb_array')")
            return _RecordingEnv(env, self)

        return make

    def arm(self) -> None:
        """Record the next episode that starts (the next reset of any wrapped env)."""
        with self._lock:
            self._armed, self._owner, self._frames, self._steps = True, None, [], 0

    def take(self) -> list[np.ndarray] | None:
        """The recorded frames (``[H, W, 3]`` uint8 each), or ``None`` when no episode started since :meth:`arm`;
        ends an episode still captured (cut by the loop's ``max_episode_steps``) and disarms the recorder."""
        with self._lock:
            frames = self._frames
            self._armed, self._owner, self._frames, self._steps = False, None, [], 0
        return frames or None

    def on_reset(self, env: _RecordingEnv) -> None:
        with self._lock:
            if self._owner is env and self._steps > 0:  # a new episode: the recorded one is over
                self._owner = None
                return
            if not (self._owner is env or (self._armed and self._owner is None)):
                return
            self._owner, self._armed, self._frames, self._steps = env, False, [], 0  # (re)start: no step yet
            if self.config.fps is None:
                self.fps = int(env.metadata.get("render_fps") or _DEFAULT_FPS)
        self._add(env, env.render())

    def on_step(self, env: _RecordingEnv, done: bool) -> None:
        if self._owner is not env:  # unlocked read: only ``env``'s thread sets the owner to env
            return
        self._add(env, env.render() if len(self._frames) < self.config.max_frames else None, step=True)
        if done:
            with self._lock:
                if self._owner is env:
                    self._owner = None

    def _add(self, env: _RecordingEnv, frame: Any, *, step: bool = False) -> None:
        if frame is not None:
            frame = np.array(frame, dtype=np.uint8)  # a copy: a renderer may reuse its buffer
            if frame.ndim != 3 or frame.shape[-1] != 3:
                raise ValueError(f"record_video: the env's render() returned shape {frame.shape}; expected "
                                 "[height, width, 3] (render_mode='rgb_array')")
        with self._lock:
            if self._owner is not env:
                return
            self._steps += step
            if frame is not None and len(self._frames) < self.config.max_frames:
                self._frames.append(frame)

    def write(self, frames: list[np.ndarray], *, mp4_path: str | None, summary_writers: list[Any], tag: str,
              step: int) -> None:
        """Write ``frames`` in a background thread once the previous write is done (``RuntimeError`` if it
        failed): the MP4 at ``mp4_path`` (``None``: none), the video summary ``tag`` at ``step`` to each writer."""
        self.wait()
        fps = self.fps

        def run() -> None:
            try:
                if mp4_path is not None:
                    write_mp4(mp4_path, frames, fps=fps)
                if summary_writers:
                    summary = video_summary(tag, frames, fps=fps)
                    for writer in summary_writers:  # what SummaryWriter.add_video does (a closed writer has none)
                        if writer.file_writer is not None:
                            writer.file_writer.add_summary(summary, step)
                            writer.flush()
            except BaseException as exc:  # reported in the main thread by wait()
                self._error = exc

        self._writer = threading.Thread(target=run, name="rollout-video-writer", daemon=False)
        self._writer.start()

    def wait(self, *, raise_errors: bool = True) -> None:
        """Wait for the clip being written; ``RuntimeError`` if that failed (a warning without ``raise_errors``)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.join()
        error, self._error = self._error, None
        if error is not None:
            message = f"record_video: writing an evaluation clip failed: {type(error).__name__}: {error}"
            if raise_errors:
                raise RuntimeError(message) from error
            warn_user(message, RuntimeWarning)


class _RecordingEnv(gym.Wrapper):
    """Renders one frame after each reset and step while its :class:`VideoRecorder` records this env."""

    def __init__(self, env: gym.Env, recorder: VideoRecorder) -> None:
        super().__init__(env)
        self._recorder = recorder

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        result = self.env.reset(**kwargs)
        self._recorder.on_reset(self)
        return result

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._recorder.on_step(self, bool(terminated) or bool(truncated))
        return obs, reward, terminated, truncated, info


def write_mp4(path: str, frames: list[np.ndarray], *, fps: int) -> None:
    """Write ``frames`` (``[H, W, 3]`` uint8) as an H.264 yuv420p MP4 with ``imageio-ffmpeg``'s ffmpeg, odd sizes
    padded by one edge pixel, the folder created (``ValueError`` without frames)."""
    import imageio_ffmpeg

    if not frames:
        raise ValueError("no frames to write")
    height, width = frames[0].shape[:2]
    pad_h, pad_w = height % 2, width % 2
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    writer = imageio_ffmpeg.write_frames(path, (width + pad_w, height + pad_h), fps=fps, codec="libx264",
                                         pix_fmt_out="yuv420p", macro_block_size=1, quality=None,
                                         output_params=["-crf", "23"], ffmpeg_log_level="error")
    writer.send(None)  # start ffmpeg
    try:
        for frame in frames:
            if pad_h or pad_w:
                frame = np.pad(frame, ((0, pad_h), (0, pad_w), (0, 0)), mode="edge")
            writer.send(np.ascontiguousarray(frame))
    finally:
        writer.close()


def video_summary(tag: str, frames: list[np.ndarray], *, fps: int) -> Any:
    """The TensorBoard ``Summary`` that ``SummaryWriter.add_video`` writes (a looping animated GIF), encoded with
    Pillow instead of the removed ``moviepy.editor``."""
    from PIL import Image
    from tensorboard.compat.proto.summary_pb2 import Summary

    images = [Image.fromarray(f).quantize(method=Image.Quantize.FASTOCTREE) for f in frames]
    gif = io.BytesIO()
    images[0].save(gif, format="GIF", save_all=True, append_images=images[1:], duration=1000 / fps, loop=0)
    height, width, channels = frames[0].shape
    image = Summary.Image(height=height, width=width, colorspace=channels, encoded_image_string=gif.getvalue())
    return Summary(value=[Summary.Value(tag=tag, image=image)])
