"""RolloutDataModule: ``Trainer.fit(model, datamodule=RolloutDataModule(...))`` trains an RL agent.

What it does for you:

* builds a :class:`~lightning_rollout.ThreadedCollector` in ``train_dataloader()``
  (after Lightning moved the module to its device; one per DDP rank, with
  distinct env seeds), acting with the policy found on the LightningModule;
* before every batch, pulls the actor's weights from the module (the seed's
  ``update_policy``), so an on-policy batch is acted by the weights of the latest
  optimizer step; the dataloader has a length, so Lightning does not prefetch a
  batch ahead (which would act it with the weights of one step before);
* dispatches collection events to every :class:`RolloutCallback` in
  ``trainer.callbacks`` and adds :class:`EpisodeStatsLogger` (and
  :class:`RolloutEvaluation` when ``eval_every_n_steps`` is set) unless you
  passed your own;
* saves its counters (frames, episodes, trajectory ids, seed, policy version)
  in Lightning checkpoints, once, through ``state_dict``; resumes them;
* closes every env thread on teardown, on exceptions and on ``KeyboardInterrupt``.

Threading: the collector is driven from Lightning's main thread; nothing here
is called from env threads.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import lightning.pytorch as pl
from tensordict import TensorDictBase
from torchrl.envs.utils import ExplorationType

from ..collector import ThreadedCollector
from ..envs import EnvFactory, resolve_env_factory
from ..events import EpisodeEnd, EventProcessor, TimeStep
from ..loop import MultiEnvLoop, _check_int
from .callbacks import EpisodeStatsLogger, RolloutCallback, RolloutEvaluation, overrides

__all__ = ["RolloutDataModule"]

_RANK_SEED_STRIDE = 100_003  # seeds of rank r start at seed + r * stride: disjoint across ranks
_EVAL_SEED_OFFSET = 1_000_000_007


class _Dispatcher(EventProcessor):
    """Forwards loop events to the trainer's RolloutCallbacks (main thread)."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.callbacks = [c for c in trainer.callbacks if isinstance(c, RolloutCallback)]
        self.step_callbacks = [c for c in self.callbacks if overrides(c, "on_rollout_step")]
        self.wants_timesteps = bool(self.step_callbacks)

    def on_timestep(self, step: TimeStep) -> None:
        for c in self.step_callbacks:
            c.on_rollout_step(self.trainer, self.trainer.lightning_module, step)

    def on_episode_end(self, episode: EpisodeEnd) -> None:
        for c in self.callbacks:
            c.on_episode_end(self.trainer, self.trainer.lightning_module, episode)

    def on_eval_episode_end(self, episode: EpisodeEnd) -> None:
        for c in self.callbacks:
            c.on_eval_episode_end(self.trainer, self.trainer.lightning_module, episode)


class _Batches:
    """What ``train_dataloader()`` returns: sized (so Lightning does not prefetch), no ``state_dict``
    (so Lightning does not save it into checkpoints: the DataModule does, once)."""

    def __init__(self, dm: RolloutDataModule, num_batches: int) -> None:
        self._dm = dm
        self._num_batches = num_batches

    def __len__(self) -> int:
        return self._num_batches

    def __iter__(self) -> Iterator[TensorDictBase]:
        for _ in range(self._num_batches):
            batch = self._dm._next_batch()
            if batch is None:
                return
            yield batch


class RolloutDataModule(pl.LightningDataModule):
    """A LightningDataModule whose training batches are collected by a :class:`ThreadedCollector`.

    Args:
        env: a gymnasium id, or a factory returning a ``gymnasium.Env`` or an
            unbatched torchrl ``EnvBase``.

    Keyword Args:
        num_envs: envs per rank.
        frames_per_batch: transitions per training batch (a multiple of
            ``num_envs`` with ``layout="env_time"``).
        total_frames: frames per rank before training stops (``-1``: endless;
            stop with ``max_steps`` / ``max_epochs`` / callbacks).
        policy: the attribute of the LightningModule holding the acting policy
            (default ``"actor"``), or a callable ``module -> policy``.
        layout: ``"env_time"`` (``[num_envs, T]``, for on-policy losses) or ``"flat"``.
        on_policy: see :class:`ThreadedCollector`; use ``False`` with a replay buffer.
        envs_per_thread, autobatch_size, max_wait, max_episode_steps, init_random_frames,
            exploration_type, step_timeout: passed to the collector.
        batches_per_epoch: batches per Lightning epoch for an endless collector
            (default 1000); a finite one is a single epoch.
        eval_every_n_steps: add a :class:`RolloutEvaluation` running every so many
            training steps (``None``: no evaluation unless you add the callback).
        eval_episodes: episodes per evaluation (per rank).
        eval_num_envs: envs of the evaluation loop (default ``min(eval_episodes, num_envs)``).
        eval_max_episode_steps: cap on evaluation episode length.
        seed: env ``i`` of rank ``r`` is seeded with ``seed + r * 100003 + i``.
        log_stats: add an :class:`EpisodeStatsLogger` unless the trainer has one.

    Raises:
        ValueError: bad configuration, with what to change.
    """

    def __init__(
        self,
        env: str | EnvFactory,
        *,
        num_envs: int = 8,
        frames_per_batch: int,
        total_frames: int = -1,
        policy: str | Callable[[pl.LightningModule], Any] = "actor",
        layout: Literal["env_time", "flat"] = "env_time",
        on_policy: bool = True,
        envs_per_thread: int = 1,
        autobatch_size: int | None = None,
        max_wait: float | None = None,
        max_episode_steps: int | None = None,
        init_random_frames: int = 0,
        exploration_type: ExplorationType = ExplorationType.RANDOM,
        step_timeout: float | None = None,
        batches_per_epoch: int | None = None,
        eval_every_n_steps: int | None = None,
        eval_episodes: int = 5,
        eval_num_envs: int | None = None,
        eval_max_episode_steps: int | None = None,
        seed: int = 0,
        log_stats: bool = True,
    ) -> None:
        super().__init__()
        self.env_factory = resolve_env_factory(env)
        _check_int("num_envs", num_envs, 1)
        _check_int("frames_per_batch", frames_per_batch, 1)
        if layout == "env_time" and frames_per_batch % num_envs:
            raise ValueError(f"frames_per_batch ({frames_per_batch}) must be a multiple of num_envs ({num_envs}) "
                             "with layout='env_time'")
        if not isinstance(total_frames, int) or isinstance(total_frames, bool) or (total_frames < 1
                                                                                   and total_frames != -1):
            raise ValueError(f"total_frames must be a positive int or -1 (endless), got {total_frames!r}")
        if layout == "env_time" and total_frames > 0 and total_frames % num_envs:
            raise ValueError(f"total_frames ({total_frames}) must be a multiple of num_envs ({num_envs}) "
                             "with layout='env_time'")
        if not (isinstance(policy, str) or callable(policy)):
            raise ValueError("policy must be the name of the LightningModule attribute holding the actor, "
                             "or a callable taking the module and returning the actor")
        if batches_per_epoch is not None:
            _check_int("batches_per_epoch", batches_per_epoch, 1)
        if eval_every_n_steps is not None:
            _check_int("eval_every_n_steps", eval_every_n_steps, 1)
        _check_int("eval_episodes", eval_episodes, 1)
        _check_int("seed", seed, 0)
        self.num_envs = num_envs
        self.frames_per_batch = frames_per_batch
        self.total_frames = total_frames
        self.policy = policy
        self.layout = layout
        self.on_policy = on_policy
        self.collector_kwargs = dict(envs_per_thread=envs_per_thread, autobatch_size=autobatch_size,
                                     max_wait=max_wait, max_frames_per_traj=max_episode_steps,
                                     init_random_frames=init_random_frames, exploration_type=exploration_type,
                                     step_timeout=step_timeout)
        self.batches_per_epoch = batches_per_epoch
        self.eval_every_n_steps = eval_every_n_steps
        self.eval_episodes = eval_episodes
        self.eval_num_envs = eval_num_envs
        self.eval_max_episode_steps = eval_max_episode_steps
        self.seed = seed
        self.log_stats = log_stats
        self.collector: ThreadedCollector | None = None
        self.last_collect_seconds = 0.0
        self._iterator: Iterator[Any] | None = None
        self._dispatcher: _Dispatcher | None = None
        self._eval_loop: MultiEnvLoop | None = None
        self._pending_state: dict[str, Any] | None = None
        self._final_state: dict[str, Any] | None = None

    # -- setup -------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        """Add the built-in callbacks the options ask for (before the trainer's own setup hooks)."""
        if stage != "fit" or self.trainer is None:
            return
        callbacks = self.trainer.callbacks
        if self.log_stats and not any(isinstance(c, EpisodeStatsLogger) for c in callbacks):
            callbacks.insert(0, EpisodeStatsLogger())
        if self.eval_every_n_steps is not None and not any(isinstance(c, RolloutEvaluation) for c in callbacks):
            callbacks.insert(0, RolloutEvaluation(every_n_steps=self.eval_every_n_steps, episodes=self.eval_episodes))

    def _actor(self) -> Any:
        module = self.trainer.lightning_module if self.trainer is not None else None
        if module is None:
            raise RuntimeError("RolloutDataModule must be used through Trainer.fit(model, datamodule=...)")
        if callable(self.policy) and not isinstance(self.policy, str):
            return self.policy(module)
        actor = getattr(module, self.policy, None)
        if actor is None:
            raise AttributeError(f"the LightningModule {type(module).__name__} has no attribute {self.policy!r} "
                                 "holding the acting policy; set RolloutDataModule(policy=...) to its name or to "
                                 "a callable returning it")
        return actor

    @property
    def _rank(self) -> int:
        return self.trainer.global_rank if self.trainer is not None else 0

    def train_dataloader(self) -> _Batches:
        """The batches of this rank's collector (created on first call).

        Returns an iterable with a length (``batches_per_epoch`` for an endless
        collector, the remaining batches for a finite one) and no ``state_dict``.
        A later ``fit`` with the same DataModule gets a fresh collector that continues
        the counts (or those of its ``ckpt_path``).
        """
        if self.collector is not None and self.collector.is_shut_down:
            if self._pending_state is None and self._final_state is not None:
                self._pending_state = {"collector": dict(self._final_state), "episodes": self.collector.loop.episodes}
            self.collector = None
            self._final_state = None
        if self.collector is None:
            self._build_collector()
        assert self.collector is not None
        if self.total_frames > 0:
            left = self.total_frames - self.collector.frames
            num_batches = max(0, math.ceil(left / self.frames_per_batch))
        else:
            num_batches = self.batches_per_epoch or 1000
        return _Batches(self, num_batches)

    def _build_collector(self) -> None:
        self._dispatcher = _Dispatcher(self.trainer) if self.trainer is not None else None
        self.collector = ThreadedCollector(
            self.env_factory, self._actor(), frames_per_batch=self.frames_per_batch, total_frames=self.total_frames,
            num_envs=self.num_envs, layout=self.layout, on_policy=self.on_policy,
            seed=self.seed + self._rank * _RANK_SEED_STRIDE, processor=self._dispatcher,
            name=f"rank{self._rank}", **self.collector_kwargs)
        if self._pending_state is not None:
            self.collector.load_state_dict(self._pending_state["collector"])
            self.collector.loop.episodes = int(self._pending_state.get("episodes", 0))
            self._pending_state = None
        self._iterator = iter(self.collector)

    def _next_batch(self) -> TensorDictBase | None:
        assert self.collector is not None and self._iterator is not None
        self.collector.update_policy_weights_(self._actor())
        start = time.perf_counter()
        try:
            batch = next(self._iterator)
        except StopIteration:
            batch = None
        self.last_collect_seconds = time.perf_counter() - start
        if batch is None:
            if self.trainer is not None:
                self.trainer.should_stop = True
            return None
        if self.trainer is not None and 0 < self.total_frames <= self.collector.frames:
            # the last batch: stop after it, rather than running one more (empty) epoch to find out
            self.trainer.should_stop = True
        if self._dispatcher is not None:
            for callback in self._dispatcher.callbacks:
                callback.on_rollout_batch(self.trainer, self.trainer.lightning_module, batch)
        return batch

    # -- evaluation ------------------------------------------------------------------------------
    def run_eval_episodes(self, episodes: int) -> list[EpisodeEnd]:
        """Run ``episodes`` fresh deterministic episodes with the module's current weights.

        Uses a separate evaluation loop (created on first use, closed on teardown);
        ``on_eval_episode_end`` goes to every :class:`RolloutCallback`.

        Returns:
            The finished episodes, in request order.
        """
        if self._eval_loop is None:
            n = self.eval_num_envs or min(episodes, self.num_envs)
            self._eval_loop = MultiEnvLoop(
                [self.env_factory] * n, self._actor(), exploration_type=ExplorationType.DETERMINISTIC,
                lookahead=False, eval=True, max_episode_steps=self.eval_max_episode_steps,
                seed=self.seed + _EVAL_SEED_OFFSET + self._rank * _RANK_SEED_STRIDE, name=f"rank{self._rank}-eval")
        results: list[EpisodeEnd] = []

        class _Collect(EventProcessor):
            def on_eval_episode_end(inner, episode: EpisodeEnd) -> None:  # noqa: N805
                results.append(episode)
                if self._dispatcher is not None:
                    self._dispatcher.on_eval_episode_end(episode)

        self._eval_loop.run_episodes(episodes, processor=_Collect())
        return results

    # -- checkpointing ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Counters for Lightning checkpoints (ints only; weights live in the module's own state)."""
        if self.collector is not None and not self.collector.is_shut_down:
            state = self.collector.state_dict(with_policy=False)
        elif self._final_state is not None:
            state = self._final_state
        elif self._pending_state is not None:
            return dict(self._pending_state)
        else:
            return {}
        episodes = self.collector.loop.episodes if self.collector is not None else 0
        return {"collector": dict(state), "episodes": episodes, "seed": self.seed, "rank": self._rank}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume counters saved by :meth:`state_dict` (applied when the collector is built).

        Raises:
            ValueError: the state is not a RolloutDataModule state.
        """
        if not state_dict:
            return
        if "collector" not in state_dict:
            raise ValueError(f"not a RolloutDataModule state (keys: {sorted(state_dict)})")
        if self.collector is not None and not self.collector.is_shut_down:
            self.collector.load_state_dict(state_dict["collector"])
            self.collector.loop.episodes = int(state_dict.get("episodes", 0))
        else:
            self._pending_state = dict(state_dict)

    # -- shutdown --------------------------------------------------------------------------------------
    def _close(self) -> None:
        if self.collector is not None and not self.collector.is_shut_down:
            self._final_state = self.collector.state_dict(with_policy=False)
            self.collector.shutdown(raise_on_error=False)
        if self._eval_loop is not None:
            self._eval_loop.close()
            self._eval_loop = None

    def teardown(self, stage: str) -> None:
        """Join every env thread (state stays available for a later checkpoint)."""
        self._close()

    def on_exception(self, exception: BaseException) -> None:
        """Join every env thread when ``fit`` fails or is interrupted."""
        self._close()
