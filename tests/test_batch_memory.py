"""Batch memory: a batch's memory is reused for a later batch only once nothing references it (no value a caller
holds ever changes), dropped batches' memory is reused, so memory use stays bounded; the entries a step carries
to the next (images, recurrent states) are read from the rows the last step wrote, and hold what it wrote,
whichever way the envs are stepped.

Recycling is observed through the batches alone: the address of a column's memory (``data_ptr``) and the values
a caller keeps.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from lightning_rollout import MultiEnvLoop, ThreadedCollector
from lightning_rollout.envs import GymMaker
from collector_helpers import balance_policy
from conftest import assert_batches_equal
from process_helpers import frame_envs


def _cartpoles(**kwargs: Any) -> MultiEnvLoop:
    return MultiEnvLoop(GymMaker("CartPole-v1"), balance_policy, **{"num_envs": 4, "envs_per_thread": 4, "seed": 5,
                                                                     **kwargs})


def _poison(batch: TensorDict) -> None:
    """Overwrite every byte of a batch the caller is done with: memory handed out again must be written in full."""
    for key in batch.keys(True, True):
        batch.get(key).view(torch.uint8).fill_(0xA7)


def test_a_dropped_batchs_memory_is_reused_and_a_held_ones_never_is():
    with _cartpoles() as loop:
        first = loop.run_steps(40)
        address = first["observation"].data_ptr()
        kept = first.clone()
        second = loop.run_steps(40)
        assert second["observation"].data_ptr() != address, "a batch the caller holds is not handed out again"
        del first
        third = loop.run_steps(40)
        assert third["observation"].data_ptr() == address, "the memory of a dropped batch is reused"
        assert third["observation"].data_ptr() != second["observation"].data_ptr()
        del second, third
    assert kept["observation"].abs().sum() > 0


@pytest.mark.parametrize("hold", [
    lambda t: t.numpy()[1:],
    lambda t: t[0],
    lambda t: t.numpy(),
    lambda t: t.view(-1),
], ids=["numpy slice", "tensor row", "tensor .numpy()", "tensor view"])
def test_any_view_of_a_batch_keeps_its_memory_from_being_written_again(hold: Callable[[torch.Tensor], Any]):
    with _cartpoles() as loop:
        batch = loop.run_steps(40)
        keep = hold(batch["observation"])
        address = torch.as_tensor(keep).data_ptr()
        expected = torch.as_tensor(keep).clone()
        del batch
        for _ in range(3):  # the held batch is skipped: later batches get other memory, and write theirs
            later = loop.run_steps(40)
            assert not (later["observation"].data_ptr() <= address
                        < later["observation"].data_ptr() + later["observation"].nbytes)
            _poison(later)
            del later
    assert torch.equal(torch.as_tensor(keep), expected)


def test_memory_stays_bounded_over_batches_of_two_sizes_that_are_dropped():
    addresses: dict[int, set[int]] = {40: set(), 24: set()}
    with _cartpoles() as loop:
        for i in range(20):
            frames = 40 if i % 2 else 24
            batch = loop.run_steps(frames)
            addresses[frames].add(batch["observation"].data_ptr())
            del batch
    assert all(len(a) <= 2 for a in addresses.values()), addresses


@pytest.mark.parametrize(("call", "envs_per_thread", "num_workers"), [
    ("run_env_steps", 2, 1), ("run_steps", 4, 1), ("run_env_steps", 2, 2)],
    ids=["env_time, pool threads", "flat", "env_time, worker process"])
def test_recycled_batches_equal_fresh_ones_value_for_value(call: str, envs_per_thread: int, num_workers: int):
    """The same seeded calls, once with every batch held (each one in fresh memory) and once with every batch
    copied, overwritten with garbage and dropped (their memory reused): the same values."""
    def batches(hold: bool) -> tuple[list[TensorDict], set[int]]:
        out, held, addresses = [], [], set()
        with _cartpoles(envs_per_thread=envs_per_thread, num_workers=num_workers) as loop:
            for _ in range(6):
                batch = getattr(loop, call)(24 if call == "run_env_steps" else 40)
                out.append(batch.clone())
                addresses.add(batch["observation"].data_ptr())
                if hold:
                    held.append(batch)
                else:
                    _poison(batch)
                del batch
        return out, addresses

    (recycled, reused), (fresh, distinct) = batches(hold=False), batches(hold=True)
    assert len(distinct) == 6 and len(reused) < 6
    assert any(b["next", "done"].any() for b in fresh), "episodes end (resets inside batches) are covered"
    assert_batches_equal(recycled, fresh)


def test_batches_a_training_loop_keeps_are_never_overwritten_and_dropped_ones_are_reused():
    collector = ThreadedCollector(GymMaker("CartPole-v1"), balance_policy, num_envs=4, envs_per_thread=2,
                                  frames_per_batch=64, total_frames=64 * 12, seed=1)
    kept: list[tuple[int, TensorDict, TensorDict]] = []
    addresses = []
    try:
        for i, batch in enumerate(collector):
            addresses.append(batch["observation"].data_ptr())
            if i % 3 == 0:  # keep some (as a list of rollouts would), drop the others
                kept.append((i, batch, batch.clone()))
    finally:
        collector.shutdown()
    assert len(kept) == 4
    assert len(set(addresses)) < len(addresses), "dropped batches' memory is reused"
    for i, batch, copy in kept:
        assert addresses[i] not in addresses[i + 1:], "a kept batch's memory is never handed out again"
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


def _frame_batches(call: str, *, num_workers: int = 1, envs_per_thread: int = 2, episodes_after: int = 3,
                   **kwargs: Any) -> list[TensorDict]:
    """Six calls of ``call`` on 4 FrameEnvs, copied as they come, with a reset of two envs after the
    fifth and two fresh episodes after call ``episodes_after`` (checked here); every batch's memory is
    overwritten once copied (the caller's to change: the loop must never read it again)."""
    out: list[TensorDict] = []
    with MultiEnvLoop(frame_envs(4), frame_policy, envs_per_thread=envs_per_thread, num_workers=num_workers,
                      seed=2, **kwargs) as loop:
        for i in range(6):
            batch = loop.run_env_steps(9) if call == "run_env_steps" else loop.run_steps(36)
            out.append(batch.clone())
            batch.get(("next", "observation")).fill_(-5.0)
            batch.get("observation").fill_(-5.0)
            del batch
            if i == episodes_after:
                for episode in loop.run_episodes(2):
                    obs, nxt = _decode(episode["observation"]), _decode(episode["next", "observation"])
                    assert obs[0] % 100 == 0 and torch.equal(obs[1:], nxt[:-1])
            if i == 4:
                loop.reset_envs([1, 2])
    return out


def _by_env(batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch's observation codes, next-observation codes and done flags as ``[env, time]``: an ``env_time``
    batch as it is, a flat one's rows grouped by env (in arrival order, each env's in time order)."""
    obs, nxt = _decode(batch["observation"]), _decode(batch["next", "observation"])
    done = batch["next", "done"].squeeze(-1)
    if batch.batch_dims == 2:
        return obs, nxt, done
    env_id = batch["collector", "env_id"]
    rows = [torch.nonzero(env_id == e).squeeze(-1) for e in range(4)]
    return (torch.stack([obs[r] for r in rows]), torch.stack([nxt[r] for r in rows]),
            torch.stack([done[r] for r in rows]))


@pytest.mark.parametrize(("call", "kwargs"), [
    ("run_env_steps", {}),
    ("run_env_steps", {"lookahead": False}),
    ("run_env_steps", {"envs_per_thread": 4}),
    ("run_steps", {"envs_per_thread": 4}),
    ("run_steps", {}),
    ("run_env_steps", {"envs_per_thread": 4, "parallel_steps": True}),
    ("run_env_steps", {"envs_per_thread": 4, "parallel_steps": "free"}),
    ("run_env_steps", {"envs_per_thread": 2, "num_workers": 2}),
], ids=["env_time, two pool threads", "no lookahead", "env_time, stepping thread", "flat, stepping thread",
        "flat, two pool threads", "a pool thread an env", "free-running pool threads", "worker process"])
def test_each_steps_observation_is_the_last_steps_next_one_or_a_fresh_episodes_first(call: str,
                                                                                      kwargs: dict[str, Any]):
    """What the next step reads of the last one's rows (the carried entries) is what that step wrote, through
    resets, fresh episodes and batches the caller overwrote, whichever way the envs are stepped."""
    previous_next: torch.Tensor | None = None
    previous_done: torch.Tensor | None = None
    for batch in _frame_batches(call, **kwargs):
        obs, nxt, done = _by_env(batch)
        first = obs[:, 0]
        if previous_next is not None:  # across calls: where the last call left each env, or a reset
            assert ((first == previous_next) & ~previous_done | (first % 100 == 0)).all()
        assert torch.equal(obs[:, 1:][~done[:, :-1]], nxt[:, :-1][~done[:, :-1]])
        assert (obs[:, 1:][done[:, :-1]] % 100 == 0).all(), "after a done step: a reset's t = 0"
        assert (nxt % 100 == obs % 100 + 1).all(), "each next observation is its step's"
        previous_next, previous_done = nxt[:, -1], done[:, -1]


def test_a_big_recurrent_state_is_carried_from_each_steps_next_state_and_zeroed_at_episode_starts():
    """An LSTM state of 1024 floats (4 KB a row), carried like an observation: each step's root state is
    the last step's ``"next"`` state, or zeros where an episode starts (``is_init``), as TorchRL's primer."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import ppo_lstm_cartpole

    torch.manual_seed(0)
    actor, _ = ppo_lstm_cartpole.make_networks(obs_dim=2, n_actions=2, hidden=1024, memory="lstm")
    collector = ThreadedCollector(ppo_lstm_cartpole.make_env, actor, frames_per_batch=4 * 24,
                                  total_frames=3 * 4 * 24, num_envs=4, envs_per_thread=4, seed=0)
    try:
        batches = [batch.clone() for batch in collector]
    finally:
        collector.shutdown()
    assert any(b["next", "done"].any() for b in batches)
    for batch in batches:
        for key in ("recurrent_state_h", "recurrent_state_c"):
            state, nxt = batch[key], batch["next", key]
            init = batch["is_init"].squeeze(-1)
            assert (state[init] == 0).all()
            carried = ~init[:, 1:]
            assert torch.equal(state[:, 1:][carried], nxt[:, :-1][carried]), key
            assert not (state[~init] == 0).all(), "a state was carried, not zeroed"
