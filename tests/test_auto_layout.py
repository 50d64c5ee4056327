"""The ``"auto"`` layout: the same env gets the same choice every time, on a loaded machine too; a step that
holds the GIL never gets a pool thread per env, picklable factory or not; the documented rule is short.

The envs are far from every threshold of the rule (a 2 ms step against 500 us, a share of the step without
the GIL near 0 or 1 against one half), so the assertions hold on a loaded machine: the measure reads shares of
a step, not speeds, and leaves out the waits for a CPU that other processes impose.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
import types
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from lightning_rollout import ThreadedCollector
from lightning_rollout.loop import auto
from process_helpers import CountEnv, zero_policy

pytestmark = pytest.mark.timeout(120)

REPEATS = 5
TUNING = Path(__file__).resolve().parent.parent / "docs" / "tuning.rst"


class _PythonDiscrete(gym.spaces.Discrete):
    """``Discrete`` whose ``sample`` is pure Python: numpy's generator lets the GIL go for an instant each
    draw, a way in for other threads that a pure-Python env would not otherwise have."""

    def sample(self, mask=None, probability=None):
        return np.int64(self.start)


class _SpinEnv(gym.Env):
    """A pure-Python step: spins for ``seconds`` of this thread's CPU time (however loaded the machine),
    holding the GIL throughout."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = _PythonDiscrete(2)

    def __init__(self, seconds: float = 2e-3) -> None:
        self.seconds = seconds
        self.obs = np.zeros(3, np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.obs, {}

    def step(self, action):
        end = time.thread_time() + self.seconds
        while time.thread_time() < end:
            pass
        return self.obs, 1.0, False, False, {}


class _SleepEnv(_SpinEnv):
    """A step that waits ``seconds`` in ``time.sleep``, without the GIL."""

    def step(self, action):
        time.sleep(self.seconds)
        return self.obs, 1.0, False, False, {}


RELEASES = functools.partial(_SleepEnv, 2e-3)
HOLDS = functools.partial(_SpinEnv, 2e-3)


def _layout(choice: auto.LayoutChoice) -> tuple[int, int, bool]:
    return choice.num_workers, choice.envs_per_thread, choice.parallel_steps


def _auto(factory, num_envs: int, **kwargs) -> auto.LayoutChoice:
    choice = auto.resolve_layout(factory, num_envs, **{"num_workers": "auto", "envs_per_thread": "auto", **kwargs})
    assert choice is not None
    return choice


@pytest.mark.parametrize("factory, expected", [
    (RELEASES, (1, 1, True)),  # each env in a pool thread of its own
    (HOLDS, (2, 2, False)),  # this process steps one half, one worker process the other
    (CountEnv, (1, 4, False)),  # cheap: every env in the stepping thread
], ids=["releases the GIL", "holds the GIL", "cheap"])
def test_the_same_env_gets_the_same_layout_every_time_with_every_core_loaded(monkeypatch, loaded_cores, factory,
                                                                              expected):
    monkeypatch.setattr(auto, "usable_cores", lambda: 2)
    choices = [_auto(factory, 4) for _ in range(REPEATS)]
    assert [_layout(c) for c in choices] == [expected] * REPEATS, [c.reason for c in choices]


def test_a_gil_holding_env_of_an_unpicklable_factory_stays_in_the_stepping_thread_and_the_log_says_why(
        monkeypatch, caplog, loaded_cores):
    monkeypatch.setattr(auto, "usable_cores", lambda: 2)
    for _ in range(REPEATS):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lightning_rollout"):
            collector = ThreadedCollector([lambda: _SpinEnv(2e-3)] * 4, zero_policy, frames_per_batch=8,
                                          num_envs=4)
        try:
            choice = collector.layout_choice
            assert _layout(choice) == (1, 4, False), choice.reason  # no pool thread for a step holding the GIL
            assert collector.loop.num_workers == 1 and not collector.loop.parallel_steps
            assert not list(collector.loop.threads())
            assert "cannot be pickled" in caplog.text  # logged at INFO
        finally:
            collector.shutdown()


def test_a_gil_holding_env_in_a_daemonic_process_stays_in_this_process(monkeypatch):
    """A daemonic process (a DataLoader worker) may not start worker processes: "auto" keeps to this one."""
    monkeypatch.setattr(auto, "usable_cores", lambda: 2)
    monkeypatch.setattr(auto.mp, "current_process", lambda: types.SimpleNamespace(daemon=True))
    choice = _auto(HOLDS, 4)
    assert _layout(choice) == (1, 4, False), choice.reason  # what the same env gets with an unpicklable factory


def test_num_workers_kept_at_one_for_an_env_that_processes_would_speed_up_is_warned_about_with_what_to_pass(
        monkeypatch):
    from lightning_rollout import LayoutWarning

    monkeypatch.setattr(auto, "usable_cores", lambda: 2)
    kept = _auto(HOLDS, 4, num_workers=1)
    assert (kept.num_workers, kept.envs_per_thread) == (1, 4)  # as asked: every env in this process
    assert kept.warning is not None and "num_workers='auto' would step them in 2 processes" in kept.warning
    assert "without the GIL" in kept.warning and "num_workers='auto' (or 2)" in kept.warning  # why, what to pass
    assert _auto(HOLDS, 4).warning is None  # chosen
    assert _auto(CountEnv, 4, num_workers=1).warning is None  # cheap: 1 anyway
    unpicklable = _auto(lambda: _SpinEnv(2e-3), 4, num_workers=1)
    assert unpicklable.warning is None  # "auto" could not have used processes either

    with pytest.warns(LayoutWarning, match="num_workers=1 keeps every env in this process") as record:
        collector = ThreadedCollector(HOLDS, zero_policy, num_envs=4, num_workers=1, frames_per_batch=8)
    collector.shutdown()
    warned = next(w for w in record if issubclass(w.category, LayoutWarning))
    assert warned.filename == __file__  # the user's line


def test_a_cheap_env_is_timed_without_a_gil_probe():
    timing = auto.measure_env(CountEnv)
    assert timing.step_s < 100e-6 and timing.gil_release != timing.gil_release  # NaN: not measured


def _rule_lines() -> list[str]:
    text = TUNING.read_text().splitlines()
    start, end = text.index(".. auto-rule-start"), text.index(".. auto-rule-end")
    return [line for line in text[start + 1:end] if line.strip()]


def test_the_documented_rule_is_short_and_states_the_thresholds_the_code_uses():
    lines = _rule_lines()
    assert 0 < len(lines) < 15, len(lines)
    rule = " ".join(" ".join(lines).split())
    defaults = {name: p.default for name, p in inspect.signature(auto.choose_layout).parameters.items()}
    for knob in ("cheap_s", "helper_s", "round_trip_s", "share_s"):
        assert f"{defaults[knob] * 1e6:.0f} us" in rule, knob
    assert f"{defaults['startup_s']:.0f} s" in rule and defaults["releases"] == 0.5 and "half" in rule
    assert "pickled" in rule and "never" in rule


def test_a_collector_given_one_env_a_thread_warns_with_what_to_pass_and_runs_it_as_given():
    import warnings

    from lightning_rollout import LayoutWarning

    with pytest.warns(LayoutWarning, match="steps each of the 4 envs in a pool thread of its own") as record:
        collector = ThreadedCollector(CountEnv, zero_policy, num_envs=4, envs_per_thread=1, num_workers=1,
                                      frames_per_batch=8, total_frames=8)
    warned = next(w for w in record if issubclass(w.category, LayoutWarning))
    assert "envs_per_thread='auto'" in str(warned.message) and "envs_per_thread=4" in str(warned.message)
    assert warned.filename == __file__  # it points at the line that built the collector
    try:
        assert (collector.loop.envs_per_thread, collector.loop.num_workers) == (1, 1)
        assert len(list(collector.loop.threads())) == 4
        assert next(iter(collector)).numel() == 8
    finally:
        collector.shutdown()
    with warnings.catch_warnings():  # groups of several envs, one env, the loop's default: no warning
        warnings.simplefilter("error", LayoutWarning)
        for num_envs, ept in ((4, 2), (1, 1)):
            ThreadedCollector(CountEnv, zero_policy, num_envs=num_envs, envs_per_thread=ept, num_workers=1,
                              frames_per_batch=4, total_frames=4).shutdown()
        from lightning_rollout import MultiEnvLoop

        MultiEnvLoop(CountEnv, zero_policy, num_envs=4).close()


def test_a_datamodule_given_one_env_a_thread_warns_at_the_users_fit_line_not_inside_lightning():
    import sys

    from lightning_helpers import Agent, make_trainer
    from lightning_rollout import LayoutWarning, RolloutDataModule

    dm = RolloutDataModule("CartPole-v1", num_envs=4, envs_per_thread=1, num_workers=1, frames_per_batch=8)
    trainer = make_trainer(max_steps=1)
    with pytest.warns(LayoutWarning, match="steps each of the 4 envs in a pool thread") as record:
        fit_line = sys._getframe().f_lineno + 1
        trainer.fit(Agent(), datamodule=dm)  # the collector is built inside Lightning's hooks
    warned = next(w for w in record if issubclass(w.category, LayoutWarning))
    assert (warned.filename, warned.lineno) == (__file__, fit_line)


def test_worker_processes_given_one_env_a_unit_are_not_warned_about_pool_threads(monkeypatch):
    """With worker processes every env is stepped by its process's own loop, one after the other: there is no
    pool thread to warn about, whatever ``envs_per_thread`` says; the layout runs as given."""
    import warnings

    from lightning_rollout import LayoutWarning

    monkeypatch.setattr(auto, "usable_cores", lambda: 2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        collector = ThreadedCollector(functools.partial(CountEnv), zero_policy, num_envs=4, envs_per_thread=1,
                                      num_workers=2, frames_per_batch=8, total_frames=8)
    try:
        assert (collector.loop.num_workers, collector.loop.envs_per_thread) == (2, 1)
        assert not list(collector.loop.threads())
        assert next(iter(collector)).batch_size == (4, 2)
    finally:
        collector.shutdown()
    layout = [str(w.message) for w in record if issubclass(w.category, LayoutWarning)]
    assert not [m for m in layout if "pool thread" in m], layout


def test_a_loop_given_one_env_a_unit_over_worker_processes_runs_it_as_given():
    from lightning_rollout import MultiEnvLoop

    with MultiEnvLoop(functools.partial(CountEnv), zero_policy, num_envs=4, envs_per_thread=1, num_workers=2) as loop:
        assert (loop.num_workers, loop.envs_per_thread) == (2, 1)
        batch = loop.run_env_steps(3)
    assert batch.batch_size[:2] == (4, 3)
    assert batch["next", "observation"][..., 2].tolist() == [[1.0, 2.0, 3.0]] * 4  # CountEnv: [env_id, episode, t]
