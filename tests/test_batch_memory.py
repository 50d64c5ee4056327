"""Batch memory: a batch's columns are recycled (``BatchPool``) only once nothing references them, and
big carried entries (images) are read from the rows the last step wrote instead of copied into the
carrier; both give the same values as fresh arrays and copies."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from lightning_rollout import MultiEnvLoop, ThreadedCollector
from lightning_rollout.envs import GymMaker
from lightning_rollout.loop import worker as worker_module
from lightning_rollout.loop.buffers import BatchPool
from collector_helpers import balance_policy
from conftest import assert_batches_equal
from process_helpers import frame_envs


class _Columns:
    """A stand-in layout: a float column of 3 per row and a flag column."""

    def allocate(self, lead: tuple[int, ...]) -> dict[str, np.ndarray]:
        return {"x": np.empty((*lead, 3)), "flag": np.empty(lead, dtype=bool)}


def test_columns_come_back_only_once_nothing_references_them():
    pool = BatchPool(_Columns())  # type: ignore[arg-type]
    first = pool.allocate(4)
    held = TensorDict({"x": torch.from_numpy(first["x"])}, [4])  # what a batch's TensorDict holds
    first_x = first["x"]
    del first
    second = pool.allocate(4)
    assert second["x"] is not first_x and pool.reused == 0, "a referenced batch is not handed out again"
    del held, first_x, second
    third = pool.allocate(4)
    assert pool.reused == 1 and third["x"].shape == (4, 3)


@pytest.mark.parametrize("hold", [
    lambda a: a[1:],
    lambda a: torch.from_numpy(a)[0],
    lambda a: torch.from_numpy(a).numpy(),
    lambda a: torch.from_numpy(a).view(-1),
], ids=["numpy slice", "tensor row", "tensor .numpy()", "tensor view"])
def test_any_view_of_a_batch_keeps_its_memory_from_being_written_again(hold: Callable[[np.ndarray], Any]):
    pool = BatchPool(_Columns())  # type: ignore[arg-type]
    columns = pool.allocate(4)
    keep = hold(columns["x"])
    x = columns["x"]
    x[...] = 7.0
    del columns, x
    for _ in range(3):  # the held batch is skipped: one fresh batch, then that one again and again
        pool.allocate(4)["x"][...] = -1.0
    assert pool.reused == 2
    assert (np.asarray(keep) == 7.0).all()


def test_kept_batches_are_bounded_and_matched_by_shape():
    pool = BatchPool(_Columns(), keep=2)  # type: ignore[arg-type]
    for rows in (4, 5, 4, 6):  # the second 4 reuses the first; the 5 is then the oldest and let go
        pool.allocate(rows)
    assert pool.reused == 1
    assert [shape for shape, _ in pool._kept] == [(4,), (6,)]
    never = BatchPool(_Columns(), keep=0)  # type: ignore[arg-type]
    for _ in range(3):
        never.allocate(4)
    assert never.reused == 0 and not never._kept


def _poison(loop: MultiEnvLoop) -> None:
    """Fill every kept batch's columns with garbage (the caller dropped them): a recycled batch must
    overwrite every value it returns."""
    for _, columns in loop._batches._kept:
        for array in columns.values():
            array.view(np.uint8).fill(0xA7)


# A flat batch from several env threads is in delivery order (not reproducible): one thread there.
@pytest.mark.parametrize(("call", "envs_per_thread", "num_workers"), [
    ("run_env_steps", 2, 1), ("run_steps", 4, 1), ("run_env_steps", 4, 2)],
    ids=["env_time", "flat", "env_time, worker process"])
def test_recycled_batches_equal_fresh_ones_value_for_value(call: str, envs_per_thread: int, num_workers: int):
    def batches(recycle: bool) -> list[TensorDict]:
        out = []
        with MultiEnvLoop(GymMaker("CartPole-v1"), balance_policy, num_envs=4, envs_per_thread=envs_per_thread,
                          num_workers=num_workers, seed=5) as loop:
            if not recycle:
                loop._batches.keep = 0
            for _ in range(6):
                batch = getattr(loop, call)(24 if call == "run_env_steps" else 40)
                out.append(batch.clone())
                del batch
                if recycle:
                    _poison(loop)
            assert (loop._batches.reused >= 4) if recycle else loop._batches.reused == 0
        return out

    recycled, fresh = batches(True), batches(False)
    assert any(b["next", "done"].any() for b in fresh), "episodes end (resets inside batches) are covered"
    assert_batches_equal(recycled, fresh)


def test_batches_a_training_loop_keeps_are_never_overwritten_and_dropped_ones_are_reused():
    collector = ThreadedCollector(GymMaker("CartPole-v1"), balance_policy, num_envs=4, envs_per_thread=2,
                                  frames_per_batch=64, total_frames=64 * 12, seed=1)
    kept: list[tuple[TensorDict, TensorDict]] = []
    try:
        for i, batch in enumerate(collector):
            if i % 3 == 0:  # keep some (as a list of rollouts would), drop the others
                kept.append((batch, batch.clone()))
        assert collector.loop._batches.reused > 0
    finally:
        collector.shutdown()
    assert len(kept) == 4
    for batch, copy in kept:
        for key in copy.keys(True, True):
            assert torch.equal(batch[key], copy[key]), key


def frame_policy(obs: torch.Tensor) -> torch.Tensor:
    """Deterministic: an action read off the observation's code."""
    return (obs[:, 0, 0, 0].long() // 3) % 2


def _decode(obs: torch.Tensor) -> torch.Tensor:
    """``[..., 3, 32, 32]`` frames -> their codes (checking every pixel carries the same one)."""
    base = obs - torch.arange(3, dtype=obs.dtype)[:, None, None]
    code = base[..., 0, 0, 0]
    assert torch.equal(base, code[..., None, None, None].expand_as(base)), "a frame mixes two steps"
    return code.long()


@contextlib.contextmanager
def _carried_lazily(lazy: bool) -> Iterator[None]:
    """Loops built inside read big entries from the last step's rows (``lazy``) or copy them (the old path)."""
    saved = worker_module._LAZY_BYTES
    worker_module._LAZY_BYTES = saved if lazy else 1 << 62
    try:
        yield
    finally:
        worker_module._LAZY_BYTES = saved


def _frame_batches(lazy: bool, call: str, *, num_workers: int = 1, envs_per_thread: int = 2, episodes_after: int = 5,
                   **kwargs: Any) -> list[TensorDict]:
    """Six calls of ``call`` on 4 FrameEnvs, copied as they come, with a reset of two envs after the
    fifth and two fresh episodes after call ``episodes_after`` (checked here: which envs play them is
    not reproducible, so batches after them differ from run to run)."""
    with _carried_lazily(lazy):
        out: list[TensorDict] = []
        with MultiEnvLoop(frame_envs(4), frame_policy, envs_per_thread=envs_per_thread, num_workers=num_workers,
                          seed=2, **kwargs) as loop:
            assert all(bool(w._lazy) == lazy for w in loop._workers)
            for i in range(6):
                batch = loop.run_env_steps(9) if call == "run_env_steps" else loop.run_steps(36)
                out.append(batch.clone())
                batch.get(("next", "observation")).fill_(-5.0)  # the caller's to change: never read again
                del batch
                if i == episodes_after:
                    for episode in loop.run_episodes(2):
                        obs, nxt = _decode(episode["observation"]), _decode(episode["next", "observation"])
                        assert obs[0] % 100 == 0 and torch.equal(obs[1:], nxt[:-1])
                if i == 4:
                    loop.reset_envs([1, 2])
        return out


@pytest.mark.parametrize(("call", "kwargs"), [
    ("run_env_steps", {}),
    ("run_env_steps", {"lookahead": False}),
    ("run_steps", {"envs_per_thread": 4}),
    ("run_env_steps", {"envs_per_thread": 4, "parallel_steps": "free"}),
    ("run_env_steps", {"envs_per_thread": 4, "num_workers": 2}),
], ids=["env_time", "no lookahead", "flat, one thread", "free-running helpers",
        "worker process"])
def test_big_entries_read_from_the_last_steps_rows_equal_a_copied_carrier(call: str, kwargs: dict[str, Any]):
    lazy, copied = _frame_batches(True, call, **kwargs), _frame_batches(False, call, **kwargs)
    assert_batches_equal(lazy, copied)


def test_each_steps_observation_is_the_last_steps_next_one_or_a_fresh_episodes_first():
    batches = _frame_batches(True, "run_env_steps", episodes_after=2)
    previous_next: torch.Tensor | None = None
    for batch in batches:
        obs, nxt = _decode(batch["observation"]), _decode(batch["next", "observation"])
        done = batch["next", "done"].squeeze(-1)
        first = obs[:, 0]
        if previous_next is not None:  # across calls: where the last call left each env (or a reset)
            carried = first == previous_next
            fresh = first % 100 == 0
            assert (carried | fresh).all()
        assert torch.equal(obs[:, 1:][~done[:, :-1]], nxt[:, :-1][~done[:, :-1]])
        assert (obs[:, 1:][done[:, :-1]] % 100 == 0).all(), "after a done step: a reset's t = 0"
        previous_next = nxt[:, -1]


def test_a_big_recurrent_state_is_carried_as_the_copied_carrier_carries_it():
    """An LSTM state of 1024 floats (4 KB a row) is a big carried entry too: same batches either way."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import ppo_lstm_cartpole

    def batches(lazy: bool) -> list[TensorDict]:
        with _carried_lazily(lazy):
            torch.manual_seed(0)
            actor, _ = ppo_lstm_cartpole.make_networks(obs_dim=2, n_actions=2, hidden=1024, memory="lstm")
            collector = ThreadedCollector(ppo_lstm_cartpole.make_env, actor, frames_per_batch=4 * 24,
                                          total_frames=3 * 4 * 24, num_envs=4, envs_per_thread=4, seed=0)
        try:
            assert bool(collector.loop._workers[0]._lazy) == lazy
            return [batch.clone() for batch in collector]
        finally:
            collector.shutdown()

    lazy, copied = batches(True), batches(False)
    assert any(b["next", "done"].any() for b in copied) and not (lazy[1]["recurrent_state_h"][:, 0] == 0).all()
    assert_batches_equal(lazy, copied)
