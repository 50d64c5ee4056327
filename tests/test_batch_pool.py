"""Batch memory is recycled (``BatchPool``): a batch's columns are written again only once nothing
references them, and a recycled batch holds the same values as a fresh one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from lightning_rollout import MultiEnvLoop, ThreadedCollector
from lightning_rollout.envs import GymMaker
from lightning_rollout.loop.buffers import BatchPool
from collector_helpers import balance_policy


class _Columns:
    """A stand-in layout: one float column of 3 per row."""

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
    for a, b in zip(recycled, fresh):
        assert set(a.keys(True, True)) == set(b.keys(True, True))
        for key in b.keys(True, True):
            assert torch.equal(a[key], b[key]), key


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
