"""RolloutDataModule: ``Trainer.fit(model, datamodule=RolloutDataModule(...))`` trains an RL agent.

``docs/lightning.rst`` is the user's guide. Everything here runs in Lightning's main thread."""

from __future__ import annotations

import functools
import math
import re
import signal
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, Timer, TQDMProgressBar
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from tensordict import TensorDictBase
from torchrl.envs.utils import ExplorationType

from .._batched import batched_env, is_batched, takes_apart
from .._checks import check_int, warn_user
from ..collector import ThreadedCollector
from ..envs import EnvFactory, InfoKeys, close_quietly, info_key_list, resolve_env_factory
from ..events import EpisodeEnd, EventProcessor, TimeStep
from ..loop import MultiEnvLoop
from ..loop.auto import check_knobs
from .callbacks import (EpisodeStatsLogger, EvalRound, RolloutCallback, RolloutEvaluation, RolloutProgressBar,
                        RolloutRichProgressBar, StepAxis, _FitEnd)

__all__ = ["RolloutDataModule"]

_RANK_SEED_STRIDE = 100_003  # seeds of rank r start at seed + r * stride: disjoint across ranks
_EVAL_SEED_OFFSET = 1_000_000_007
# Trainer(precision=...) values that cast the module's weights, and the dtype they cast to
_CASTING_PRECISIONS = {"bf16-true": "torch.bfloat16", "16-true": "torch.float16", "64-true": "torch.float64"}
_EVAL_STEPS = {TrainerFn.VALIDATING: "validation_step", TrainerFn.TESTING: "test_step"}


class _Dispatcher(EventProcessor):
    """Forwards loop events to the trainer's RolloutCallbacks (main thread)."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.callbacks = [c for c in trainer.callbacks if isinstance(c, RolloutCallback)]
        self.step_callbacks = [c for c in self.callbacks  # only those overriding it get per-step events
                               if type(c).on_rollout_step is not RolloutCallback.on_rollout_step]
        self.wants_timesteps = bool(self.step_callbacks)

    def call(self, hook: str, *args: Any, callbacks: list[RolloutCallback] | None = None) -> None:
        """``callback.<hook>(trainer, module, *args)`` for each of ``callbacks`` (default: every RolloutCallback)."""
        for c in self.callbacks if callbacks is None else callbacks:
            getattr(c, hook)(self.trainer, self.trainer.lightning_module, *args)

    def on_timestep(self, step: TimeStep) -> None:
        self.call("on_rollout_step", step, callbacks=self.step_callbacks)

    def on_episode_end(self, episode: EpisodeEnd) -> None:
        self.call("on_episode_end", episode)

    def on_eval_episode_end(self, episode: EpisodeEnd) -> None:
        self.call("on_eval_episode_end", episode)


class _Loader:
    """A dataloader: ``iterate()`` with a length (so that Lightning fetches no batch ahead, acted by stale
    weights) and an empty ``state_dict`` (the DataModule saves the counters; an empty state means "resumable")."""

    def __init__(self, iterate: Callable[[], Iterator[Any]], length: int) -> None:
        self.iterate, self.length = iterate, length

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[Any]:
        return self.iterate()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to load: Lightning restores the DataModule's own state."""


def _lent_validation_step(self: pl.LightningModule, batch: Any, batch_idx: int = 0) -> None:
    """The ``validation_step`` / ``test_step`` lent to a module without one: :class:`RolloutEvaluation` logs."""


def _lend(module: pl.LightningModule, step: str, lent: list[tuple[pl.LightningModule, str]]) -> None:
    """Give ``module`` a do-nothing ``step`` (``validation_step`` / ``test_step``) unless it has its own."""
    if not is_overridden(step, module):
        setattr(module, step, types.MethodType(_lent_validation_step, module))
        lent.append((module, step))


def _rank(trainer: pl.Trainer | None) -> int:
    return trainer.global_rank if trainer is not None else 0


def _actor(dm: RolloutDataModule) -> Any:
    """The acting policy of ``dm``'s module (``RuntimeError`` without one, ``AttributeError`` for a bad name)."""
    module = dm.trainer.lightning_module if dm.trainer is not None else None
    if module is None:
        raise RuntimeError("RolloutDataModule must be used through Trainer.fit(model, datamodule=...)")
    if callable(dm.policy):
        return dm.policy(module)
    if (actor := getattr(module, dm.policy, None)) is None:
        raise AttributeError(f"the LightningModule {type(module).__name__} has no attribute {dm.policy!r} "
                             "holding the acting policy; set RolloutDataModule(policy=...) to its name or to "
                             "a callable returning it")
    return actor


def _has_step(dm: RolloutDataModule, step: str) -> bool:
    """Whether ``dm`` evaluates and the trainer's module has a ``step`` (its own or lent)."""
    module = dm.trainer.lightning_module if dm.trainer is not None else None
    return dm.evaluates and module is not None and is_overridden(step, module)


def _check_frames(num_envs: int, frames_per_batch: int, total_frames: int, layout: str) -> None:
    check_int("num_envs", num_envs, 1)
    check_int("frames_per_batch", frames_per_batch, 1)
    if not isinstance(total_frames, int) or isinstance(total_frames, bool) or (total_frames < 1 and total_frames != -1):
        raise ValueError(f"total_frames must be a positive int or -1 (endless), got {total_frames!r}")
    for name, frames in (("frames_per_batch", frames_per_batch), ("total_frames", total_frames)):
        if layout == "env_time" and frames > 0 and frames % num_envs:
            raise ValueError(f"{name} ({frames}) must be a multiple of num_envs ({num_envs}) with layout='env_time'")


def _check_eval(episodes: int, every_n_frames: int | None, every_n_steps: int | None, num_envs: int | None) -> None:
    check_int("eval_episodes", episodes, 0)
    check_int("eval_every_n_frames", every_n_frames, 1, optional=True)
    if every_n_steps is not None:
        check_int("eval_every_n_steps", every_n_steps, 1)
        warn_user("RolloutDataModule(eval_every_n_steps=) is deprecated: it counts optimizer steps, so the "
                  "frames between evaluations depend on the optimizer steps per batch. Use "
                  "eval_every_n_frames= (frames per rank) or Trainer(val_check_interval=) (batches).",
                  FutureWarning)
    if every_n_frames is not None and every_n_steps is not None:
        raise ValueError("pass eval_every_n_frames or the deprecated eval_every_n_steps, not both")
    if episodes == 0 and (every_n_frames is not None or every_n_steps is not None):
        raise ValueError("eval_episodes=0 turns evaluation off; drop eval_every_n_frames / eval_every_n_steps "
                         "or ask for at least one episode")
    check_int("eval_num_envs", num_envs, 1, optional=True)


def _check_precision(trainer: pl.Trainer) -> None:
    precision = str(getattr(trainer, "precision", "32-true"))
    if (dtype := _CASTING_PRECISIONS.get(precision)) is not None:
        raise ValueError(f"Trainer(precision={precision!r}) casts the module's weights, the acting policy's "
                         f"included, to {dtype}, while the envs' observations stay float32: the policy cannot act "
                         "on them. Use precision='bf16-mixed' or '16-mixed' (the weights stay float32 and "
                         "training_step runs under autocast) or '32-true'")


def _step_axis(callbacks: list[pl.Callback]) -> StepAxis:
    """The one x-axis of the trainer's stats / evaluation callbacks (``ValueError`` when they differ)."""
    axes = {c.step for c in callbacks if isinstance(c, (EpisodeStatsLogger, RolloutEvaluation))}
    if len(axes) > 1:
        raise ValueError("the trainer's EpisodeStatsLogger and RolloutEvaluation write at different x-axes "
                         "(step='frames' and step='batches'); pass the same step= to both, so that every row the "
                         "loggers receive has one x-axis")
    return axes.pop() if axes else "frames"


def _warn_about_checkpoint_names(trainer: pl.Trainer) -> None:
    """Warn about a ``ModelCheckpoint`` whose ``filename`` would write a metric name holding ``/``."""
    for checkpoint in trainer.checkpoint_callbacks:
        if not (isinstance(checkpoint, ModelCheckpoint) and checkpoint.auto_insert_metric_name):
            continue
        if names := [name for name in re.findall(r"\{([^:}]+)", checkpoint.filename or "") if "/" in name]:
            warn_user(f"ModelCheckpoint(filename={checkpoint.filename!r}) writes the metric name {names[0]!r} "
                      "into each file name, and its '/' makes a folder per checkpoint; pass "
                      "auto_insert_metric_name=False and name the figure yourself, e.g. "
                      f"filename='epoch={{epoch}}-step={{step}}-reward={{{names[0]}:.1f}}'")


def _set_eval_schedule(dm: RolloutDataModule, trainer: pl.Trainer) -> None:
    """Make the Trainer validate every ``dm.eval_every_n_frames`` frames (or deprecated ``eval_every_n_steps``);
    ``ValueError`` when it schedules validation itself (see :meth:`RolloutDataModule.setup`)."""
    if dm.eval_every_n_steps is not None:
        module = trainer.lightning_module
        if module is None or not module.automatic_optimization or trainer.accumulate_grad_batches != 1:
            raise ValueError(f"eval_every_n_steps={dm.eval_every_n_steps} counts optimizer steps, and this module "
                             "does not take exactly one per batch (manual optimization or gradient accumulation); "
                             "use eval_every_n_frames= (frames per rank, e.g. "
                             f"{dm.eval_every_n_steps * dm.frames_per_batch} for one evaluation every "
                             f"{dm.eval_every_n_steps} batches)")
        batches = dm.eval_every_n_steps
    elif dm.eval_every_n_frames is not None:
        batches = math.ceil(dm.eval_every_n_frames / dm.frames_per_batch)
    else:
        return
    ours = (trainer.val_check_interval == batches and trainer.check_val_every_n_epoch is None)
    defaults = (trainer.val_check_interval == 1.0 and not isinstance(trainer.val_check_interval, int)
                and trainer.check_val_every_n_epoch == 1
                and getattr(trainer, "_val_check_time_interval", None) is None)
    if not (ours or defaults):
        raise ValueError("eval_every_n_frames schedules evaluation (it sets the Trainer's val_check_interval and "
                         "check_val_every_n_epoch); leave those at their defaults, or drop eval_every_n_frames and "
                         f"schedule with the Trainer (got val_check_interval={trainer.val_check_interval!r}, "
                         f"check_val_every_n_epoch={trainer.check_val_every_n_epoch!r})")
    epoch = _limited_epoch(dm, trainer)
    if defaults and epoch is not None and epoch < batches:
        return  # a smoke run (fast_dev_run, limit_train_batches): evaluate at each epoch's end, as Lightning does
    trainer.val_check_interval = batches
    trainer.check_val_every_n_epoch = None


def _limited_epoch(dm: RolloutDataModule, trainer: pl.Trainer) -> int | None:
    """Batches of an epoch under the Trainer's ``limit_train_batches`` (``fast_dev_run`` sets it), or ``None``."""
    limit = trainer.limit_train_batches
    if isinstance(limit, float) and limit < 1.0:
        full = math.ceil(dm.total_frames / dm.frames_per_batch) if dm.total_frames > 0 else dm.batches_per_epoch or 1000
        return int(full * limit)
    return limit if isinstance(limit, int) else None


def _load_counters(collector: ThreadedCollector, state: dict[str, Any], rank: int) -> None:
    """Give ``collector`` the counters of ``state`` with ``rank``'s seed: a checkpoint holds global rank zero's,
    so each rank's seed moves by its distance to the saving rank (resumed ranks collect different streams)."""
    counters = dict(state["collector"])
    if counters.get("seed", -1) >= 0:
        counters["seed"] += (rank - int(state.get("rank", 0))) * _RANK_SEED_STRIDE
    collector.load_state_dict(counters)
    collector.loop.episodes = int(state.get("episodes", 0))


class _FramesAxis:
    """Makes every logger of a Trainer write each row at ``frames()``, whatever its step, until :meth:`restore`."""

    def __init__(self) -> None:
        self.loggers: list[Any] = []

    def set(self, trainer: pl.Trainer, frames: Callable[[], int] | None) -> None:
        """Wrap each logger's ``log_metrics`` to write at ``frames()`` (``None``: Lightning's own step)."""
        self.restore()
        for logger in trainer.loggers if frames is not None else ():
            write = logger.log_metrics

            def log_metrics(metrics: dict[str, Any], step: int | None = None, write: Callable = write) -> None:
                write(metrics, step=frames())

            logger.log_metrics = log_metrics  # type: ignore[method-assign]
            self.loggers.append(logger)

    def restore(self) -> None:
        for logger in self.loggers:
            logger.__dict__.pop("log_metrics", None)
        self.loggers.clear()


class RolloutDataModule(pl.LightningDataModule):
    """A LightningDataModule whose training batches are collected by a :class:`ThreadedCollector` and whose
    validation (and test) loop runs evaluation episodes.

    Args:
        env: a gymnasium id, or a factory of a ``gymnasium.Env`` or torchrl ``EnvBase`` (a batched one is stepped
            as is; evaluation needs one the collector can take apart), picklable for ``ddp_spawn`` (no lambda).

    Keyword Args:
        num_envs: envs per rank.
        frames_per_batch: transitions per training batch (a multiple of ``num_envs`` with ``layout="env_time"``).
        total_frames: frames per rank before training stops (``-1``: endless, stopped by the Trainer).
        policy: the LightningModule's attribute holding the acting policy, or a callable ``module -> policy``.
        layout: ``"env_time"`` (``[num_envs, T]``, for on-policy losses) or ``"flat"``.
        on_policy: see :class:`ThreadedCollector`; use ``False`` with a replay buffer.
        envs_per_thread, num_workers, parallel_steps, autobatch_size, max_wait, max_episode_steps,
            init_random_frames, exploration_type, step_timeout, info_keys: passed to the collector
            (``docs/torchrl.rst``, ``docs/tuning.rst``).
        batches_per_epoch: batches per epoch of an endless collector (default 1000); a finite one is one epoch.
        eval_every_n_frames: evaluate every this many frames of this rank (rounded up to whole batches; sets
            the Trainer's ``val_check_interval``, see ``docs/lightning.rst``). ``None``: Lightning's schedule.
        eval_every_n_steps: deprecated (counts optimizer steps; ``ValueError`` at ``fit`` unless one per batch).
        eval_episodes: episodes per evaluation round and rank, in ``fit``, ``validate`` and ``test``; ``0``: none.
        eval_num_envs: envs of the evaluation loop (default ``min(eval_episodes, num_envs)``).
        eval_max_episode_steps: cap on evaluation episode length.
        seed: env ``i`` of rank ``r`` is seeded with ``seed + r * 100003 + i``.
        log_stats: add an :class:`EpisodeStatsLogger` unless the trainer has one.
        progress_bar: swap Lightning's stock TQDM / Rich bar for the RL one.
        reraise_interrupt: a Ctrl-C ends ``fit`` with ``KeyboardInterrupt`` after Lightning's graceful shutdown
            (``False``: Lightning's ``sys.exit(1)``).

    Raises:
        ValueError: bad configuration, saying what to change (here, or at :meth:`setup` for the Trainer's).
    """

    def __init__(
        self, env: str | EnvFactory, *, num_envs: int = 8, frames_per_batch: int, total_frames: int = -1,
        policy: str | Callable[[pl.LightningModule], Any] = "actor", layout: Literal["env_time", "flat"] = "env_time",
        on_policy: bool = True, envs_per_thread: int | str = "auto", num_workers: int | str = "auto",
        parallel_steps: bool | Literal["auto", "free"] = "auto", autobatch_size: int | None = None,
        max_wait: float | None = None, max_episode_steps: int | None = None, init_random_frames: int = 0,
        exploration_type: ExplorationType = ExplorationType.RANDOM, step_timeout: float | None = None,
        info_keys: InfoKeys | None = None, batches_per_epoch: int | None = None,
        eval_every_n_frames: int | None = None, eval_every_n_steps: int | None = None, eval_episodes: int = 5,
        eval_num_envs: int | None = None, eval_max_episode_steps: int | None = None, seed: int = 0,
        log_stats: bool = True, progress_bar: bool = True, reraise_interrupt: bool = True,
    ) -> None:
        super().__init__()
        self.env_factory = resolve_env_factory(env)
        _check_frames(num_envs, frames_per_batch, total_frames, layout)
        if not (isinstance(policy, str) or callable(policy)):
            raise ValueError("policy must be the name of the LightningModule attribute holding the actor, "
                             "or a callable taking the module and returning the actor")
        check_int("batches_per_epoch", batches_per_epoch, 1, optional=True)
        _check_eval(eval_episodes, eval_every_n_frames, eval_every_n_steps, eval_num_envs)
        check_int("seed", seed, 0)
        check_knobs(envs_per_thread=envs_per_thread, num_workers=num_workers, parallel_steps=parallel_steps)
        self.collector_kwargs = dict(envs_per_thread=envs_per_thread, num_workers=num_workers,
                                     parallel_steps=parallel_steps, autobatch_size=autobatch_size,
                                     max_wait=max_wait, max_frames_per_traj=max_episode_steps,
                                     init_random_frames=init_random_frames, exploration_type=exploration_type,
                                     step_timeout=step_timeout, info_keys=info_keys)
        self.info_keys = info_key_list(info_keys)  # checked here, before any env is built
        self.num_envs, self.frames_per_batch, self.total_frames = num_envs, frames_per_batch, total_frames
        self.policy, self.layout, self.on_policy = policy, layout, on_policy
        self.batches_per_epoch = batches_per_epoch
        self.eval_every_n_frames, self.eval_every_n_steps = eval_every_n_frames, eval_every_n_steps
        self.eval_episodes, self.eval_num_envs = eval_episodes, eval_num_envs
        self.eval_max_episode_steps = eval_max_episode_steps
        self.seed, self.log_stats, self.progress_bar = seed, log_stats, progress_bar
        self.reraise_interrupt = bool(reraise_interrupt)
        self.collector: ThreadedCollector | None = None
        self.last_collect_seconds = 0.0
        self._iterator: Iterator[Any] | None = None
        self._dispatcher: _Dispatcher | None = None
        self._eval_loop: MultiEnvLoop | None = None
        self._lent: list[tuple[pl.LightningModule, str]] = []  # (module, step name) lent for this stage
        self._axis = _FramesAxis()
        self._pending_state: dict[str, Any] | None = None  # counters to resume from, or those of a closed collector

    @property
    def trainer(self) -> pl.Trainer | None:  # type: ignore[override]
        """The Trainer this DataModule is attached to (``None`` before). Attaching it for ``validate`` / ``test``
        lends the module a ``validation_step`` / ``test_step`` if it has none (for ``fit``, :meth:`setup` does);
        it raises ``RuntimeError`` for ``Trainer.predict``, ``ValueError`` for ``validate`` / ``test`` with
        ``eval_episodes=0``, and warns for ``fit`` of an endless collector with no limit on the Trainer."""
        return self.__dict__.get("_trainer")

    @trainer.setter
    def trainer(self, trainer: pl.Trainer | None) -> None:
        self.__dict__["_trainer"] = trainer
        if trainer is None or "eval_episodes" not in self.__dict__:  # (Lightning's __init__ sets None first)
            return
        fn = trainer.state.fn
        if fn == TrainerFn.PREDICTING:
            raise RuntimeError("Trainer.predict runs the module's forward over a dataset, which an RL agent has not: "
                               "use trainer.validate(model, datamodule=dm) (eval/... metrics of episodes run with the "
                               "policy) or trainer.test(...) (test/...), no step method needed")
        if (fn == TrainerFn.FITTING and self.total_frames == -1 and trainer.max_steps == -1
                and trainer.max_epochs is None and not any(isinstance(c, Timer) for c in trainer.callbacks)):
            frames = 1000 * (self.batches_per_epoch or 1000) * self.frames_per_batch
            warn_user(f"RolloutDataModule(total_frames=-1) collects endlessly and the Trainer has no max_steps, "
                      f"max_epochs or max_time: Lightning's default of 1000 epochs of {self.batches_per_epoch or 1000} "
                      f"batches stops it after {frames:,} frames per rank. Pass total_frames= (frames per rank), or "
                      "Trainer(max_steps=...) (optimizer steps) / max_epochs=...")
        step = _EVAL_STEPS.get(fn)
        if step is not None and not self.evaluates:
            raise ValueError(f"Trainer.{fn.value} runs evaluation episodes, and this RolloutDataModule has "
                             f"eval_episodes=0 (evaluation off): pass eval_episodes=N >= 1 (no {step} is needed)")
        selector = getattr(getattr(trainer, "_data_connector", None), "_datahook_selector", None)
        module = getattr(selector, "model", None)  # the module being attached along with this DataModule
        if step is not None and isinstance(module, pl.LightningModule):
            _lend(module, step, self._lent)

    @property
    def frames(self) -> int:
        """Frames this rank has collected (its collector's count, else the one restored from a checkpoint, or 0)."""
        if self.collector is not None:
            return int(self.collector.frames)
        return int((self._pending_state or {}).get("collector", {}).get("frames", 0))

    @property
    def evaluates(self) -> bool:
        """True when evaluation rounds run in the validation loop (``eval_episodes > 0``)."""
        return self.eval_episodes > 0

    def __getstate__(self) -> dict[str, Any]:
        """Everything but threads and trainer (``ddp_spawn``); the counters travel."""
        state = {**self.__dict__, **dict.fromkeys(("collector", "_iterator", "_dispatcher", "_eval_loop", "_trainer"))}
        state.update(_lent=[], _axis=_FramesAxis(), _pending_state=self.state_dict() or None, last_collect_seconds=0.0)
        return state

    def setup(self, stage: str) -> None:
        """Prepare ``fit``, ``validate`` or ``test`` (before the callbacks' ``setup``): check the Trainer, add the
        built-in callbacks, set the loggers' x-axis and, for ``fit``, the evaluation schedule and a lent
        ``validation_step``; warn about a ``ModelCheckpoint`` ``filename`` naming a metric with ``/``.

        Raises:
            ValueError: a ``Trainer(precision=...)`` that casts the weights; callbacks with different ``step``
                axes; an evaluation schedule the Trainer's own settings contradict (``docs/lightning.rst``).
        """
        if (trainer := self.trainer) is None:
            return
        _check_precision(trainer)
        self._dispatcher = None  # rebuilt from this trainer's callbacks on first use
        callbacks = trainer.callbacks
        axis = _step_axis(callbacks)
        if stage == "fit":
            if self.log_stats and not any(isinstance(c, EpisodeStatsLogger) for c in callbacks):
                callbacks.insert(0, EpisodeStatsLogger(step=axis))
            if not any(isinstance(c, _FitEnd) for c in callbacks):
                callbacks.insert(0, _FitEnd())
            _warn_about_checkpoint_names(trainer)
        if self.evaluates and not any(isinstance(c, RolloutEvaluation) for c in callbacks):
            callbacks.insert(0, RolloutEvaluation(step=axis))
        if self.progress_bar:
            for c in callbacks:  # Lightning's stock bars (not a subclass of the user's) become the RL ones, as they are
                rl_bar = {TQDMProgressBar: RolloutProgressBar, RichProgressBar: RolloutRichProgressBar}.get(type(c))
                if rl_bar is not None:
                    c.__class__ = rl_bar
        self._axis.set(trainer, (lambda: self.frames * trainer.world_size) if axis == "frames" else None)
        if stage == "fit" and self.evaluates:
            _set_eval_schedule(self, trainer)
            if trainer.lightning_module is not None:
                _lend(trainer.lightning_module, "validation_step", self._lent)

    def _events(self) -> _Dispatcher:
        if self._dispatcher is None:
            self._dispatcher = _Dispatcher(self.trainer)
        return self._dispatcher

    def train_dataloader(self) -> _Loader:
        """The batches of this rank's collector (a later ``fit`` gets a fresh one continuing the counts), as many
        as an epoch has (``batches_per_epoch`` when endless, else those left to ``total_frames``)."""
        if self.collector is None or self.collector.is_shut_down:
            rank = _rank(self.trainer)
            self.collector = ThreadedCollector(
                self.env_factory, _actor(self), frames_per_batch=self.frames_per_batch, total_frames=self.total_frames,
                num_envs=self.num_envs, layout=self.layout, on_policy=self.on_policy,
                seed=self.seed + rank * _RANK_SEED_STRIDE, processor=self._events(), track_policy_version=True,
                name=f"rank{rank}", **self.collector_kwargs)
            if self._pending_state is not None:
                _load_counters(self.collector, self._pending_state, rank)
                self._pending_state = None
            self._iterator = iter(self.collector)
        count = self.batches_per_epoch or 1000
        if self.total_frames > 0:
            left = max(0, math.ceil((self.total_frames - self.collector.frames) / self.frames_per_batch))
            epoch = self.trainer.fit_loop.epoch_loop if self.trainer is not None else None
            done = int(epoch.batch_progress.current.processed) if epoch is not None and epoch.restarting else 0
            count = done + left  # with the batches of this epoch before the checkpoint Lightning resumes from
        return _Loader(functools.partial(self._batches, count), count)

    def _batches(self, count: int) -> Iterator[TensorDictBase]:
        """At most ``count`` batches (fewer when the collector is exhausted), each after a weight update."""
        assert self.collector is not None and self._iterator is not None
        for _ in range(count):
            self.collector.update_policy_weights_(_actor(self))
            start = time.perf_counter()
            batch = next(self._iterator, None)
            self.last_collect_seconds = time.perf_counter() - start
            if batch is None or 0 < self.total_frames <= self.collector.frames:
                # the last batch: stop after it, rather than running one more (empty) epoch to find out
                # (Lightning then validates once more: the final evaluation round)
                self.trainer.should_stop = True
            if batch is None:
                return
            self._events().call("on_rollout_batch", batch)
            yield batch

    @property
    def val_dataloader(self) -> Callable[[], _Loader] | None:  # type: ignore[override]
        """The evaluation rounds, one per validation run; ``None`` while no validation loop can run (as before
        :meth:`setup` lent a ``validation_step``, which keeps Lightning from warning about a missing one)."""
        return self._eval_rounds if _has_step(self, "validation_step") else None

    @property
    def test_dataloader(self) -> Callable[[], _Loader] | None:  # type: ignore[override]
        """The evaluation round of ``Trainer.test`` (logged as ``test/...``); ``None`` while no test can run."""
        return self._eval_rounds if _has_step(self, "test_step") else None

    def _eval_rounds(self) -> _Loader:  # (a method: Lightning reads its __code__)
        return _Loader(self._eval_round, 1)

    def _eval_round(self) -> Iterator[EvalRound]:
        """One :class:`EvalRound`, run when Lightning fetches it; in the sanity check only the loop is built."""
        start = time.perf_counter()
        self._build_eval_loop()  # (its envs reset) before on_eval_start: a video starts at the round's own reset
        if self.trainer is not None and self.trainer.sanity_checking:
            return
        events = self._events()
        events.call("on_eval_start")
        episodes = self.run_eval_episodes(self.eval_episodes)
        seconds = time.perf_counter() - start
        events.call("on_eval_end", episodes)
        yield EvalRound(episodes, seconds=seconds, frames=self.frames)

    def _build_eval_loop(self) -> MultiEnvLoop:
        """The evaluation loop of single envs (a batched env's, taken apart), built on first use."""
        if self._eval_loop is not None:
            return self._eval_loop
        trainer, rank = self.trainer, _rank(self.trainer)
        n = self.eval_num_envs or max(1, min(self.eval_episodes, self.num_envs))
        recorders = [c.video_recorder for c in trainer.callbacks if isinstance(c, RolloutEvaluation)
                     and c.video_recorder is not None] if trainer is not None and trainer.is_global_zero else []
        factory = self.env_factory if not recorders else recorders[0].wrap_factory(self.env_factory)
        first = factory()
        if not is_batched(first):
            factories = [lambda: first] + [factory] * (n - 1)
        elif takes_apart(first):
            singles = batched_env(first, num_workers=1).factories
            factories = [singles[i % len(singles)] for i in range(n)]
        else:
            close_quietly([first])
            raise ValueError(
                f"evaluation runs whole episodes of single envs, and the env factory makes a natively batched "
                f"{type(first).__name__} that cannot be taken apart into them: pass eval_episodes=0 (and "
                "evaluate with env.rollout() yourself), or give RolloutDataModule a factory of one env")
        self._eval_loop = MultiEnvLoop(
            factories, _actor(self), exploration_type=ExplorationType.DETERMINISTIC, lookahead=False, eval=True,
            max_episode_steps=self.eval_max_episode_steps, info_keys=self.collector_kwargs["info_keys"],
            seed=self.seed + _EVAL_SEED_OFFSET + rank * _RANK_SEED_STRIDE, name=f"rank{rank}-eval")
        return self._eval_loop

    def run_eval_episodes(self, episodes: int) -> list[EpisodeEnd]:
        """The finished episodes, in request order, of ``episodes`` fresh deterministic episodes run now with the
        module's current weights; ``on_eval_episode_end`` goes to every :class:`RolloutCallback`, nothing is logged."""
        results: list[EpisodeEnd] = []
        events = self._events()

        class _Collect(EventProcessor):
            def on_eval_episode_end(inner, episode: EpisodeEnd) -> None:  # noqa: N805
                results.append(episode)
                events.on_eval_episode_end(episode)

        self._build_eval_loop().run_episodes(episodes, processor=_Collect())
        return results

    def state_dict(self) -> dict[str, Any]:
        """Counters for Lightning checkpoints (ints only; weights live in the module's own state)."""
        if self.collector is None or self.collector.is_shut_down:
            return dict(self._pending_state or {})
        return {"collector": dict(self.collector.state_dict(with_policy=False)),
                "episodes": self.collector.loop.episodes, "seed": self.seed, "rank": _rank(self.trainer)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the counters of :meth:`state_dict` (once the collector is built); ``ValueError`` for another state."""
        if not state_dict:
            return
        if "collector" not in state_dict:
            raise ValueError(f"not a RolloutDataModule state (keys: {sorted(state_dict)})")
        if self.collector is not None and not self.collector.is_shut_down:
            _load_counters(self.collector, state_dict, _rank(self.trainer))
        else:
            self._pending_state = dict(state_dict)

    def teardown(self, stage: str) -> None:
        """Join every env thread, take back the lent ``validation_step`` / ``test_step`` and give the
        loggers back Lightning's own x-axis (the counters stay available for a later checkpoint)."""
        if self.collector is not None and not self.collector.is_shut_down:
            self._pending_state = self.state_dict()  # for a checkpoint after teardown, or the next fit
            self.collector.shutdown(raise_on_error=False)
        if self._eval_loop is not None:
            self._eval_loop.close()
            self._eval_loop = None
        for module, step in self._lent:
            module.__dict__.pop(step, None)
        self._lent.clear()
        self._axis.restore()

    def on_exception(self, exception: BaseException) -> None:
        """Join every env thread when ``fit`` fails or is interrupted; with ``reraise_interrupt``, finish
        Lightning's graceful shutdown and re-raise a ``KeyboardInterrupt``."""
        self.teardown("fit")
        trainer = self.trainer
        if not (isinstance(exception, KeyboardInterrupt) and self.reraise_interrupt and trainer is not None):
            return
        # Lightning would run these after this hook, then sys.exit(1): run them and end with the interrupt.
        trainer.strategy.on_exception(exception)
        teardown = getattr(trainer, "_teardown", None)
        if callable(teardown):
            teardown()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.default_int_handler)  # Lightning ignored SIGINT for its shutdown
        raise exception
