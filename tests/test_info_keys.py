"""``info_keys``: entries of a gymnasium env's ``info`` in batches, in ``EpisodeEnd.info`` and as ``rollout/<key>``.

``InfoEnv`` writes into ``info``, after reset and after every step, values that say
where they come from (the step index, the episode), a nested dict, and at each
episode's last step only, an ``is_success`` flag (true for even episodes). So every
entry of a batch can be checked against the step that produced it.
"""

from __future__ import annotations

import gymnasium as gym
import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from tensordict import TensorDictBase
from torchrl.data import Unbounded
from torchrl.envs import GymWrapper, default_info_dict_reader

from lightning_helpers import Agent
from lightning_rollout import EventProcessor, MultiEnvLoop, ThreadedCollector
from lightning_rollout.envs import GymMaker
from lightning_rollout.lightning import RolloutDataModule

pytestmark = pytest.mark.timeout(120)


class InfoEnv(gym.Env):
    """Episode ``e`` lasts ``3 + e % 2`` steps. ``info``: ``t`` (int, steps so far), ``vec`` (float32 ``[e, t, 1]``),
    ``meta.depth`` (float ``t / 2``) after reset and every step; ``is_success`` (``e`` even) at the last step only."""

    metadata: dict = {"render_modes": []}
    observation_space = gym.spaces.Box(-1e6, 1e6, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self) -> None:
        self.episode = -1
        self.t = 0

    def _info(self) -> dict:
        return {"t": self.t, "vec": np.array([self.episode, self.t, 1], np.float32), "meta": {"depth": self.t / 2}}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.episode += 1
        self.t = 0
        return np.array([self.episode, 0], np.float32), self._info()

    def step(self, action):
        self.t += 1
        done = self.t >= 3 + self.episode % 2
        info = self._info()
        if done:
            info["is_success"] = self.episode % 2 == 0
        return np.array([self.episode, self.t], np.float32), 1.0, done, False, info


SUCCESS_SPEC = {"is_success": Unbounded((), dtype=torch.bool)}


def zero_policy(observation: torch.Tensor) -> torch.Tensor:
    return torch.zeros(observation.shape[:-1], dtype=torch.int64)


def collect(env, info_keys, *, num_envs: int = 2, frames: int = 24, **kwargs) -> TensorDictBase:
    collector = ThreadedCollector(env, zero_policy, frames_per_batch=frames, total_frames=frames, num_envs=num_envs,
                                  envs_per_thread=1, num_workers=1, info_keys=info_keys, seed=0, **kwargs)
    try:
        return next(iter(collector))
    finally:
        collector.shutdown()


def test_info_entries_are_root_and_next_columns_with_specs_inferred_from_the_first_reset():
    batch = collect(InfoEnv, ["t", "vec", ("meta", "depth")])
    assert batch.batch_size == (2, 12)
    assert (batch["t"].dtype, batch["t"].shape) == (torch.int64, (2, 12))            # a Python int
    assert (batch["vec"].dtype, batch["vec"].shape) == (torch.float32, (2, 12, 3))  # a numpy float32 array
    assert (batch["meta", "depth"].dtype, batch["meta", "depth"].shape) == (torch.float32, (2, 12))  # a Python float
    step = batch["observation"][..., 1].long()
    # root: the info of the reset or step that produced the observation; ("next", ...): the step's own info
    assert torch.equal(batch["t"], step)
    assert torch.equal(batch["next", "t"], step + 1)
    assert torch.equal(batch["vec"][..., 1].long(), step)
    assert torch.equal(batch["next", "vec"][..., 0], batch["observation"][..., 0])
    torch.testing.assert_close(batch["next", "meta", "depth"], (step + 1) / 2)
    init = batch["is_init"].squeeze(-1)
    assert init.sum() >= 4 and (batch["t"][init] == 0).all(), "an episode's first row holds its reset's info"


def test_a_spec_dict_casts_values_and_an_entry_missing_from_info_is_zero():
    batch = collect(InfoEnv, {**SUCCESS_SPEC, "vec": Unbounded((3,), dtype=torch.float64),
                              "t": Unbounded((), dtype=torch.bool)})
    assert batch["next", "vec"].dtype == torch.float64
    assert batch["t"].dtype == torch.bool and torch.equal(batch["t"], batch["observation"][..., 1] > 0)
    done = batch["next", "done"].squeeze(-1)
    episode = batch["observation"][..., 0].long()
    assert torch.equal(batch["next", "is_success"], done & (episode % 2 == 0)), "only at the last step of even episodes"
    assert not batch["is_success"].any(), "never in a reset's info: zeros"


def test_the_policy_sees_the_info_entries_of_each_row():
    seen: list[torch.Tensor] = []

    def policy(td: TensorDictBase) -> TensorDictBase:
        seen.append(td["t"].clone())
        return td.set("action", (td["t"] % 2).long())

    collector = ThreadedCollector(InfoEnv, policy, frames_per_batch=16, total_frames=16, num_envs=2,
                                  envs_per_thread=2, num_workers=1, info_keys=["t"], seed=0)
    batch = next(iter(collector))
    collector.shutdown()
    assert torch.equal(batch["action"], batch["t"] % 2)
    assert len(seen) > 1


def test_bad_info_keys_are_refused_with_what_to_do():
    def refused(env, info_keys, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            MultiEnvLoop(env, zero_policy, num_envs=2, info_keys=info_keys).close()

    refused(InfoEnv, ["is_success"], "not in the info of the env's first reset.*is_success")
    refused(InfoEnv, ["observation"], "clashes with an observation entry")
    refused(InfoEnv, "t", r"info_keys=\['t'\]")
    refused(InfoEnv, {"t": "int"}, "TensorSpec")
    refused(lambda: GymWrapper(InfoEnv()), ["t"], "set_info_dict_reader")
    with pytest.raises(ValueError, match="info_keys"):
        RolloutDataModule(InfoEnv, frames_per_batch=8, info_keys="t")


class EpisodeInfo(EventProcessor):
    def __init__(self) -> None:
        self.infos: list[dict] = []
        self.lengths: list[int] = []

    def on_episode_end(self, episode) -> None:
        self.infos.append(episode.info)
        self.lengths.append(episode.length)

    def on_eval_episode_end(self, episode) -> None:
        self.on_episode_end(episode)


@pytest.mark.parametrize("layout", ["env_time", "flat"])
def test_episode_end_info_holds_the_values_of_the_last_step(layout):
    events = EpisodeInfo()
    batch = collect(InfoEnv, {**SUCCESS_SPEC, "t": Unbounded((), dtype=torch.int64)}, frames=32, layout=layout,
                    processor=events, on_policy=layout == "env_time")
    done = batch["next", "done"].squeeze(-1)
    assert len(events.infos) == int(done.sum()) >= 4
    assert sorted(int(i["t"]) for i in events.infos) == sorted(batch["next", "t"][done].tolist())
    for info in events.infos:
        assert set(info) == {"is_success", "t"} and info["t"].shape == () and isinstance(info["t"], np.ndarray)
        assert bool(info["is_success"]) == (int(info["t"]) == 3), "even episodes last 3 steps and succeed"


def test_evaluation_episodes_carry_info_too():
    events = EpisodeInfo()
    with MultiEnvLoop(InfoEnv, zero_policy, num_envs=2, eval=True, info_keys=SUCCESS_SPEC, seed=0) as loop:
        loop.run_episodes(6, processor=events)
    assert len(events.infos) == 6 and all(set(i) == {"is_success"} for i in events.infos)
    assert [bool(i["is_success"]) for i in events.infos] == [n == 3 for n in events.lengths]


def test_a_torchrl_env_reads_info_with_its_own_reader_and_info_keys_name_the_entries():
    def make():
        env = GymWrapper(InfoEnv())
        return env.set_info_dict_reader(default_info_dict_reader(["vec"], spec=[Unbounded((3,))]))  # numpy values

    events = EpisodeInfo()
    batch = collect(make, ["vec"], frames=16, processor=events)
    assert torch.equal(batch["next", "vec"][..., 1], batch["next", "observation"][..., 1])
    assert events.infos and [int(i["vec"][1]) for i in events.infos] == events.lengths


def test_info_entries_from_worker_processes_equal_those_of_threads():
    """Taxi's ``action_mask``: the same seeded batch from envs in two worker processes and in threads."""
    def mask_policy(td: TensorDictBase) -> TensorDictBase:  # the first allowed action
        return td.set("action", td["action_mask"].float().argmax(-1))

    batches = []
    for workers in (1, 2):
        collector = ThreadedCollector(GymMaker("Taxi-v4"), mask_policy, frames_per_batch=64, total_frames=64,
                                      num_envs=4, envs_per_thread=2, num_workers=workers, info_keys=["action_mask"],
                                      seed=3)
        batches.append(next(iter(collector)))
        collector.shutdown()
    threads, processes = batches
    assert processes["action_mask"].dtype == torch.int8 and processes["action_mask"].shape == (4, 16, 6)
    assert torch.equal(threads["action_mask"], processes["action_mask"])
    assert torch.equal(threads["next", "action_mask"], processes["next", "action_mask"])
    allowed = threads["action_mask"].gather(-1, threads["action"].unsqueeze(-1))
    assert allowed.bool().all()


class SuccessRate(pl.Callback):
    """Records ``rollout/is_success`` and the episodes' info at every batch end."""

    def __init__(self) -> None:
        self.rates: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        value = trainer.callback_metrics.get("rollout/is_success")
        if value is not None:
            self.rates.append(float(value))


def test_datamodule_logs_the_per_episode_mean_of_one_element_info_entries(tmp_path):
    """Episodes alternate success / failure, so ``rollout/is_success`` is the share of even episodes of each
    batch; ``vec`` (3 elements) is in the batches but not logged."""
    class Recorder(Agent):
        def training_step(self, batch, batch_idx):
            assert batch["next", "is_success"].dtype == torch.bool and batch["vec"].shape[-1] == 3
            return super().training_step(batch, batch_idx)

    rates = SuccessRate()
    dm = RolloutDataModule(InfoEnv, num_envs=2, frames_per_batch=14, total_frames=42, envs_per_thread=1,
                           num_workers=1, info_keys={**SUCCESS_SPEC, "vec": Unbounded((3,))}, eval_episodes=0)
    trainer = pl.Trainer(max_epochs=1, logger=CSVLogger(tmp_path), callbacks=[rates], enable_progress_bar=False,
                         log_every_n_steps=1,
                         enable_model_summary=False, enable_checkpointing=False, accelerator="cpu")
    trainer.fit(Recorder(obs_dim=2), datamodule=dm)
    # each env's 7 steps of a batch end one successful 3-step episode and one failed 4-step one
    assert rates.rates == [pytest.approx(0.5)] * 3
    logged = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "rollout/is_success" in logged and "rollout/vec" not in logged
