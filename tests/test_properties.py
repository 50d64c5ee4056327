"""Property tests: random configurations and random sequences of calls keep every promise.

Hypothesis draws ``(num_envs, envs_per_thread, autobatch_size, max_wait, lookahead,
episode lengths, truncation, per-env step latency)`` and a sequence of operations
(``run_steps``, ``run_env_steps``, ``run_episodes``, ``update_policy`` on a
:class:`MultiEnvLoop`; iteration of a :class:`ThreadedCollector` in both layouts
with ``update_policy_weights_`` between batches). The mock env's observation is
``[env_id, episode, t]``, so the checks are exact:

* counts: every call returns exactly what it was asked for;
* continuity: within one env, ``("next", "observation")`` of a step is the
  ``"observation"`` of that env's next delivered step unless the step is done (or
  ``run_episodes`` cut the running episode in between, which starts a new trajectory);
* nothing duplicated, nothing missing: each ``(env, episode, t)`` is delivered at most
  once over all calls, every step-mode episode is delivered from ``t = 0`` without gaps,
  every ``run_episodes`` episode is complete;
* ``traj_ids``: one id per ``(env, episode)`` and one ``(env, episode)`` per id; and exactly TorchRL's
  numbering: an env keeps its id until a done row, new ids are handed out in delivery order
  (arrival order for ``run_steps``, time then env for ``run_env_steps``);
* counters: ``step_count`` is the step's index in its episode and ``("next", "episode_reward")``
  the episode's return up to and including the step;
* every call returns within a bound, checked by a watchdog thread that dumps every
  thread's stack on a hang (:func:`reliability_helpers.bounded`).
"""

from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import ArgmaxNet, MockEnv, default_reward
from lightning_rollout import MultiEnvLoop, ThreadedCollector
from reliability_helpers import assert_no_rollout_threads, bounded

pytestmark = pytest.mark.timeout(300)

BOUND = 60.0
# Deterministic by default (the same 25 examples each run); LR_PROPERTY_EXAMPLES=500 explores further.
_EXAMPLES = int(os.environ.get("LR_PROPERTY_EXAMPLES", "25"))
SETTINGS = settings(max_examples=_EXAMPLES, deadline=None, derandomize="LR_PROPERTY_EXAMPLES" not in os.environ,
                    database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


class LatencyEnv(MockEnv):
    """MockEnv with a fixed step latency (an env that releases the GIL, like a simulator)."""

    def __init__(self, env_id: int, latency: float, **kwargs) -> None:
        super().__init__(env_id, **kwargs)
        self.latency = latency

    def step(self, action):
        if self.latency:
            time.sleep(self.latency)
        return super().step(action)


def length_fn_for(seed: int, max_len: int):
    def length(env_id: int, episode: int) -> int:
        return 1 + random.Random(seed * 1_000_003 + env_id * 7919 + episode).randrange(max_len)
    return length


@st.composite
def configs(draw):
    num_envs = draw(st.integers(1, 6))
    envs_per_thread = draw(st.sampled_from([d for d in range(1, num_envs + 1) if num_envs % d == 0]))
    return dict(
        num_envs=num_envs,
        envs_per_thread=envs_per_thread,
        autobatch_size=draw(st.one_of(st.none(), st.integers(1, 8))),
        max_wait=draw(st.sampled_from([None, 0.0, 0.001])),
        lookahead=draw(st.booleans()),
        length_seed=draw(st.integers(0, 10 ** 6)),
        max_len=draw(st.integers(1, 8)),
        truncate_at=draw(st.one_of(st.none(), st.integers(1, 5))),
        latencies=draw(st.lists(st.sampled_from([0.0, 0.0, 0.0005]), min_size=num_envs, max_size=num_envs)),
    )


OPS = st.one_of(
    st.tuples(st.just("steps"), st.integers(0, 8)),  # times envs_per_thread
    st.tuples(st.just("env_steps"), st.integers(0, 5)),
    st.tuples(st.just("episodes"), st.integers(0, 5)),
    st.tuples(st.just("update"), st.just(0)),
)


def make_factories(cfg):
    length = length_fn_for(cfg["length_seed"], cfg["max_len"])
    return [lambda i=i: LatencyEnv(i, cfg["latencies"][i], length_fn=length, truncate_at=cfg["truncate_at"])
            for i in range(cfg["num_envs"])]


def rows_of(td) -> list[dict]:
    """Plain per-row records of a flat TensorDict, in order."""
    obs = td["observation"].numpy()
    nxt = td["next", "observation"].numpy()
    done = td["next", "done"].reshape(-1).numpy()
    traj = td["collector", "traj_ids"].reshape(-1).numpy()
    env_ids = td.get(("collector", "env_id"), None)  # the loop's batches; a collector's carry TorchRL's keys only
    env = obs[:, 0].astype(int) if env_ids is None else env_ids.reshape(-1).numpy()  # MockEnv: obs[0] is the env
    version = td["policy_version"].reshape(-1).numpy()
    step_count = td["step_count"].reshape(-1).numpy()
    returns = td["next", "episode_reward"].reshape(-1).numpy()
    return [dict(obs=tuple(int(x) for x in obs[r]), next=tuple(int(x) for x in nxt[r]), done=bool(done[r]),
                 traj=int(traj[r]), env=int(env[r]), version=int(version[r]), step_count=int(step_count[r]),
                 ret=float(returns[r]))
            for r in range(len(obs))]


class Ledger:
    """Everything delivered, checked incrementally and at the end."""

    def __init__(self, num_envs: int) -> None:
        self.last: dict[int, dict | None] = {i: None for i in range(num_envs)}
        self.cut_since_last: dict[int, bool] = {i: False for i in range(num_envs)}
        self.seen: set[tuple[int, int, int]] = set()
        self.traj_of: dict[tuple[int, int], int] = {}
        self.owner_of: dict[int, tuple[int, int]] = {}

    def _common(self, row: dict) -> None:
        env_id, episode, t = row["obs"]
        assert env_id == row["env"], row
        assert row["step_count"] == t, row
        if "ret" in row:  # MockEnv's rewards, summed as the episode goes (float32 in the batch)
            expected = sum(default_reward(env_id, episode, k) for k in range(t + 1))
            assert abs(row["ret"] - expected) <= 1e-6 * max(1.0, expected), row
        assert (env_id, episode, t) not in self.seen, f"duplicate transition {row['obs']}"
        self.seen.add((env_id, episode, t))
        if not row["done"]:
            assert row["next"] == (env_id, episode, t + 1), row
        key = (env_id, episode)
        assert self.traj_of.setdefault(key, row["traj"]) == row["traj"], f"two traj ids for env/episode {key}"
        assert self.owner_of.setdefault(row["traj"], key) == key, f"traj id {row['traj']} used twice"

    def step_rows(self, rows: list[dict]) -> None:
        for row in rows:
            self._common(row)
            env_id = row["env"]
            prev = self.last[env_id]
            if prev is None:
                assert row["obs"][2] == 0, f"env {env_id}: first delivered step is not t=0: {row}"
            elif prev["done"] or self.cut_since_last[env_id] and row["obs"] != prev["next"]:
                # a new episode: from t = 0, a later episode, a new trajectory
                assert row["obs"][2] == 0 and row["obs"][1] > prev["obs"][1], (prev, row)
                assert row["traj"] != prev["traj"]
            else:
                assert row["obs"] == prev["next"], f"env {env_id}: stream broken {prev} -> {row}"
                assert row["traj"] == prev["traj"]
            self.last[env_id] = row
            self.cut_since_last[env_id] = False

    def episode(self, rows: list[dict]) -> None:
        assert rows, "an empty episode"
        env_id = rows[0]["env"]
        assert [r["obs"][2] for r in rows] == list(range(len(rows)))
        assert len({r["obs"][1] for r in rows}) == 1 and len({r["traj"] for r in rows}) == 1
        assert rows[-1]["done"] and not any(r["done"] for r in rows[:-1])
        for a, b in zip(rows, rows[1:]):
            assert a["next"] == b["obs"]
        for row in rows:
            self._common(row)
        self.cut_since_last[env_id] = True


@SETTINGS
@given(cfg=configs(), ops=st.lists(OPS, min_size=1, max_size=6))
def test_multi_env_loop_keeps_its_promises(cfg, ops):
    g, n_envs = cfg["envs_per_thread"], cfg["num_envs"]
    loop = MultiEnvLoop(make_factories(cfg), ArgmaxNet(), envs_per_thread=g, autobatch_size=cfg["autobatch_size"],
                        max_wait=cfg["max_wait"], lookahead=cfg["lookahead"], seed=0)
    ledger = Ledger(n_envs)
    rng = random.Random(cfg["length_seed"])
    try:
        for op, arg in ops:
            version = loop.policy_version
            if op == "steps":
                n = g * arg
                td = bounded(lambda: loop.run_steps(n), BOUND, f"run_steps({n})")
                assert tuple(td.batch_size) == (n,)
                rows = rows_of(td)
                ledger.step_rows(rows)
            elif op == "env_steps":
                td = bounded(lambda: loop.run_env_steps(arg), BOUND, f"run_env_steps({arg})")
                assert tuple(td.batch_size) == (n_envs, arg)
                assert td.names == [None, "time"]
                assert (td["collector", "env_id"] == torch.arange(n_envs)[:, None]).all()
                rows = rows_of(td.transpose(0, 1).reshape(-1)) if arg else []
                ledger.step_rows(rows)
            elif op == "episodes":
                episodes = bounded(lambda: loop.run_episodes(arg, rng=rng), BOUND, f"run_episodes({arg})")
                assert len(episodes) == arg
                rows = []
                for ep in episodes:
                    ep_rows = rows_of(ep)
                    ledger.episode(ep_rows)
                    rows += ep_rows
            else:
                new = bounded(lambda: loop.update_policy(ArgmaxNet().state_dict()), BOUND, "update_policy")
                assert new == version + 1 == loop.policy_version
                continue
            # policy versions: never from the future; on-policy never from the past;
            # lookahead lags by at most one step per env and call
            versions = [r["version"] for r in rows]
            assert all(v <= loop.policy_version for v in versions)
            if op != "episodes":
                stale: dict[int, int] = {}
                for r in rows:
                    if r["version"] < version:
                        stale[r["env"]] = stale.get(r["env"], 0) + 1
                limit = 0 if not cfg["lookahead"] else 1
                assert all(c <= limit for c in stale.values()), (stale, cfg)
            else:
                assert all(v == version for v in versions)
    finally:
        bounded(loop.close, BOUND, "close")
    assert_no_rollout_threads()


@SETTINGS
@given(num_envs=st.integers(1, 4), epts=st.sampled_from([1, 2]), layout=st.sampled_from(["env_time", "flat"]),
       on_policy=st.booleans(), steps_per_env=st.integers(1, 6), batches=st.integers(1, 5),
       updates=st.lists(st.booleans(), min_size=5, max_size=5), length_seed=st.integers(0, 10 ** 6),
       max_len=st.integers(1, 8), autobatch_size=st.one_of(st.none(), st.integers(1, 4)))
def test_threaded_collector_keeps_its_promises(num_envs, epts, layout, on_policy, steps_per_env, batches, updates,
                                               length_seed, max_len, autobatch_size):
    if num_envs % epts:
        epts = 1
    frames_per_batch = num_envs * steps_per_env
    if layout == "flat" and frames_per_batch % epts:
        frames_per_batch *= epts
    length = length_fn_for(length_seed, max_len)
    factories = [lambda i=i: MockEnv(i, length_fn=length) for i in range(num_envs)]
    policy = ArgmaxNet()
    collector = ThreadedCollector(factories, policy, frames_per_batch=frames_per_batch,
                                  total_frames=frames_per_batch * batches, envs_per_thread=epts, layout=layout,
                                  on_policy=on_policy, autobatch_size=autobatch_size, track_policy_version=True,
                                  name="prop")
    ledger = Ledger(num_envs)
    try:
        it = iter(collector)
        for b in range(batches):
            version = collector.policy_version
            batch = bounded(lambda: next(it), BOUND, f"batch {b}")
            if layout == "env_time" and num_envs == 1:  # one env: [T], as TorchRL's collector over one env
                assert tuple(batch.batch_size) == (frames_per_batch,)
                flat = batch
            elif layout == "env_time":
                assert tuple(batch.batch_size) == (num_envs, frames_per_batch // num_envs)
                assert (batch["observation"][..., 0] == torch.arange(num_envs)[:, None]).all()  # row i is env i
                flat = batch.transpose(0, 1).reshape(-1)
            else:
                assert tuple(batch.batch_size) == (frames_per_batch,)
                flat = batch
            rows = rows_of(flat)
            ledger.step_rows(rows)
            if on_policy:  # a batch is acted by a single policy version: the current one
                assert {r["version"] for r in rows} == {version}
            if updates[b]:
                with torch.no_grad():
                    policy.lin.weight.add_(1.0)
                bounded(collector.update_policy_weights_, BOUND, "update_policy_weights_")
                assert collector.policy_version == version + 1
        with pytest.raises(StopIteration):
            bounded(lambda: next(it), BOUND, "end of iteration")
        assert collector.frames == frames_per_batch * batches
    finally:
        bounded(collector.shutdown, BOUND, "shutdown")
    assert_no_rollout_threads()


def test_ledger_catches_a_gap():
    """The checker itself: a skipped step is reported."""
    ledger = Ledger(1)
    row = dict(obs=(0, 0, 0), next=(0, 0, 1), done=False, traj=0, env=0, version=0, step_count=0)
    ledger.step_rows([row])
    skipped = dict(obs=(0, 0, 2), next=(0, 0, 3), done=False, traj=0, env=0, version=0, step_count=2)
    with pytest.raises(AssertionError, match="stream broken"):
        ledger.step_rows([skipped])


def test_ledger_catches_a_duplicate():
    ledger = Ledger(1)
    row = dict(obs=(0, 0, 0), next=(0, 0, 1), done=False, traj=0, env=0, version=0, step_count=0)
    ledger.step_rows([row])
    with pytest.raises(AssertionError, match="duplicate"):
        ledger.step_rows([dict(row)])


_ = np  # numpy is used through rows_of's .numpy() arrays


class _StopAfter:
    """An :class:`~lightning_rollout.Interrupter`-like flag that fires once ``n`` env steps were taken in all."""

    def __init__(self, n: int) -> None:
        self.n, self.steps = n, 0

    def should_stop(self) -> bool:
        return self.steps >= self.n


@SETTINGS
@given(num_envs=st.integers(1, 4), epts=st.sampled_from([1, 2, "all"]), lookahead=st.booleans(),
       steps_per_env=st.integers(1, 12), stop_after=st.integers(0, 30), fail_env=st.integers(0, 3),
       fail_at=st.integers(0, 20), mode=st.sampled_from(["interrupt", "env_error"]),
       length_seed=st.integers(0, 10_000), max_len=st.integers(1, 6),
       parallel=st.sampled_from([False, True, "free"]), flat_extra=st.one_of(st.none(), st.integers(0, 3)))
def test_quota_cut_by_an_interrupt_or_an_env_error_keeps_every_promise(
        num_envs, epts, lookahead, steps_per_env, stop_after, fail_env, fail_at, mode, length_seed, max_len,
        parallel, flat_extra):
    """Mid-quota interrupts resume without losing or duplicating a step; mid-quota env errors arrive within the
    bound with ``exc.partial`` holding only complete, continuous steps, and leave no thread behind. With
    ``parallel_steps="free"`` the envs run free within the quota (each at its own pace), and the same holds.
    ``flat_extra`` (not None): the calls are ``run_steps(steps_per_env * num_envs + flat_extra)`` instead, the
    steps taken beyond them (whole groups of ``envs_per_thread`` envs step together) kept for the next call."""
    from lightning_rollout import EnvError, Interrupter

    epts = num_envs if epts == "all" else epts
    if num_envs % epts:
        epts = 1
    fail_env %= num_envs
    length = length_fn_for(length_seed, max_len)
    interrupter = Interrupter()
    counter = _StopAfter(stop_after)

    class Counting(MockEnv):
        def step(self, action):
            counter.steps += 1
            if counter.should_stop() and mode == "interrupt":
                interrupter.stop()
            return super().step(action)

    raise_on = {fail_env: fail_at} if mode == "env_error" else {}
    factories = [lambda i=i: Counting(i, length_fn=length, raise_on_step=raise_on.get(i)) for i in range(num_envs)]
    ledger = Ledger(num_envs)
    loop = MultiEnvLoop(factories, ArgmaxNet(), envs_per_thread=epts, lookahead=lookahead, parallel_steps=parallel)
    try:
        for _ in range(3):
            try:
                if flat_extra is None:
                    td = bounded(lambda: loop.run_env_steps(steps_per_env, interrupter=interrupter), BOUND, "quota")
                else:
                    n = steps_per_env * num_envs + flat_extra
                    td = bounded(lambda: loop.run_steps(n, interrupter=interrupter), BOUND, "steps")
            except EnvError as exc:
                assert mode == "env_error" and exc.env_id == fail_env
                if exc.partial is not None and flat_extra is None:  # complete steps only: a rectangle
                    assert exc.partial.batch_dims == 2 and exc.partial.shape[0] == num_envs
                    if exc.partial.batch_size.numel():  # (tensordict cannot reshape(-1) an empty batch)
                        ledger.step_rows(rows_of(exc.partial.transpose(0, 1).reshape(-1)))
                elif exc.partial is not None:
                    ledger.step_rows(rows_of(exc.partial))
                assert loop.closed
                break
            if flat_extra is not None:
                assert td.batch_dims == 1 and td.numel() <= n
                if td.numel() < n:
                    assert mode == "interrupt"
                ledger.step_rows(rows_of(td))
            else:
                assert td.batch_size[0] == num_envs and td.batch_size[1] <= steps_per_env
                if td.batch_size.numel():  # (tensordict cannot reshape(-1) an empty batch with a time dim)
                    ledger.step_rows(rows_of(td.transpose(0, 1).reshape(-1)))
            interrupter.reset()
            counter.n = counter.steps + stop_after  # the next interrupt, further on
    finally:
        bounded(loop.close, BOUND, "close")
    assert_no_rollout_threads()


class _TrajIds:
    """The definition of trajectory ids, env by env: an env keeps its id until a done row, then takes the
    next new id; new ids are handed out in delivery order."""

    def __init__(self, num_envs: int, start: int) -> None:
        self.cur = list(range(start, start + num_envs))
        self.next = start + num_envs

    def assign(self, env_ids: list[int], done: list[bool]) -> list[int]:
        traj = []
        for env, is_done in zip(env_ids, done):
            traj.append(self.cur[env])
            if is_done:
                self.cur[env] = self.next
                self.next += 1
        return traj


@SETTINGS
@given(num_envs=st.integers(1, 6), epts=st.sampled_from([1, 2, "all"]), lookahead=st.booleans(),
       traj_id_start=st.integers(0, 50), length_seed=st.integers(0, 10 ** 6), max_len=st.integers(1, 6),
       truncate_at=st.one_of(st.none(), st.integers(1, 4)),
       ops=st.lists(st.tuples(st.sampled_from(["steps", "env_steps"]), st.integers(0, 12)), min_size=1, max_size=5))
# a flat call that hands out one env's step of a group of two, then steps of every env
@example(num_envs=2, epts=2, lookahead=False, traj_id_start=0, length_seed=0, max_len=1, truncate_at=None,
         ops=[("steps", 1), ("env_steps", 1)])
def test_trajectory_ids_of_batches_are_those_of_their_definition_in_delivery_order(
        num_envs, epts, lookahead, traj_id_start, length_seed, max_len, truncate_at, ops):
    """Batches of both calls, through done steps (terminated or truncated) and across calls: every row's id is
    the one the definition gives it, rows taken in delivery order, and ``next_traj_id`` follows."""
    epts = num_envs if epts == "all" or num_envs % epts else epts
    length = length_fn_for(length_seed, max_len)
    factories = [lambda i=i: MockEnv(i, length_fn=length, truncate_at=truncate_at) for i in range(num_envs)]
    reference = _TrajIds(num_envs, traj_id_start)
    loop = MultiEnvLoop(factories, ArgmaxNet(), envs_per_thread=epts, lookahead=lookahead,
                        traj_id_start=traj_id_start)
    try:
        assert loop.next_traj_id == traj_id_start
        for op, arg in ops:
            if op == "steps":
                td = bounded(lambda: loop.run_steps(arg), BOUND, f"run_steps({arg})")
                env_ids = td["collector", "env_id"].tolist()
                done = td["next", "done"].reshape(-1).tolist()
                got = td["collector", "traj_ids"].tolist()
            else:
                td = bounded(lambda: loop.run_env_steps(arg), BOUND, f"run_env_steps({arg})")
                env_ids = [e for _ in range(arg) for e in range(num_envs)]  # time-major: env 0..N-1 each step
                done = td["next", "done"][..., 0].T.reshape(-1).tolist()
                got = td["collector", "traj_ids"].T.reshape(-1).tolist()
            assert got == reference.assign(env_ids, done), (op, arg)
            assert loop.next_traj_id == reference.next
    finally:
        bounded(loop.close, BOUND, "close")
    assert_no_rollout_threads()
