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

pytestmark = [pytest.mark.timeout(120), pytest.mark.serial]  # steps are timed: alone under xdist

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
    choice = auto.resolve_layout(factory, num_envs, **{"num_workers": "auto", "envs_per_thread": "auto", **kwargs})[0]
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
    defaults = {name: p.default for fn in (auto.measure_env, auto.choose_layout)
                for name, p in inspect.signature(fn).parameters.items()}
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


# -- the rule (loop/auto.py's module docstring, docs/tuning.rst) -------------------------------------------
CHEAP = auto.EnvTiming(step_s=10e-6, gil_release=0.0)  # CartPole
GIL_BOUND = auto.EnvTiming(step_s=100e-6, gil_release=0.05)  # a pure-Python simulator
MUJOCO = auto.EnvTiming(step_s=60e-6, gil_release=float("nan"))  # a cheap MuJoCo step: not measured for the GIL
HALF_CHEETAH = auto.EnvTiming(step_s=120e-6, gil_release=0.0)  # as "auto" measures it (four rows of one unit)
RELEASING_SLOW = auto.EnvTiming(step_s=2e-3, gil_release=0.98)
RELEASING_FAST = auto.EnvTiming(step_s=200e-6, gil_release=0.9)


@pytest.mark.parametrize("num_envs, timing, kwargs, expected", [
    (16, CHEAP, {}, (1, 16, False)),  # 80 us a step for another process: less than a round trip
    (32, CHEAP, {}, (1, 32, False)),  # 160 us: not worth it either
    (32, CHEAP, {"cores": 16}, (1, 32, False)),
    (16, GIL_BOUND, {}, (2, 8, False)),  # this process and one worker, half the envs each
    (16, GIL_BOUND, {"cores": 5}, (4, 4, False)),  # a process a core, as many as divide the envs
    (16, MUJOCO, {}, (2, 8, False)),  # 480 us a step for the other process: worth it
    (4, MUJOCO, {}, (1, 4, False)),  # 120 us: less than a round trip
    (16, MUJOCO, {"round_trip_s": 1e-3}, (1, 16, False)),
    (16, GIL_BOUND, {"expected_frames": 20_000}, (1, 16, False)),  # 0.6 s saved: under the start-up cost
    (8, HALF_CHEETAH, {"expected_frames": 163_840}, (1, 8, False)),  # 20,480 steps x (480 - 300) us: 3.7 s
    (8, HALF_CHEETAH, {"expected_frames": 1_000_000}, (2, 4, False)),  # 22.5 s
    (4, GIL_BOUND, {"cores": 16, "share_s": 50e-6}, (4, 1, False)),  # at most one process an env
    (8, GIL_BOUND, {"cores": 16}, (4, 2, False)),  # at most a process a share of 200 us of env time
    (16, GIL_BOUND, {"cores": 16}, (8, 2, False)),
    (64, GIL_BOUND, {"cores": 16}, (16, 4, False)),  # 6.4 ms a step: a process a core
    (16, MUJOCO, {"cores": 16}, (4, 4, False)),
    (3, GIL_BOUND, {"cores": 16}, (1, 3, False)),  # no divisor of 3 but 3 itself, over the shares' bound
    (16, GIL_BOUND, {"cores": 1}, (1, 16, False)),  # one core: no worker process
    (16, GIL_BOUND, {"picklable": False}, (1, 16, False)),
    (16, RELEASING_SLOW, {}, (1, 1, True)),  # a pool thread an env
    (16, RELEASING_FAST, {}, (2, 8, False)),  # 200 us of C a step: under 500 us, processes
    (16, RELEASING_FAST, {"cores": 1}, (1, 16, False)),
    (16, GIL_BOUND, {"cores": 3, "num_workers": 1}, (1, 16, False)),  # a given num_workers is kept
    (16, GIL_BOUND, {"cores": 3, "num_workers": 2}, (2, 8, False)),
    (16, GIL_BOUND, {"cores": 16, "envs_per_thread": 4}, (4, 4, False)),  # processes of whole given groups
    (16, GIL_BOUND, {"envs_per_thread": 16}, (1, 16, False)),  # one group: no second process to give it to
    (16, RELEASING_SLOW, {"envs_per_thread": 4}, (1, 4, False)),  # pool threads of the given groups
    (16, GIL_BOUND, {"envs_per_thread": 1, "cores": 1}, (1, 1, False)),  # a given one env a thread stays one
    (4, CHEAP, {"envs_per_thread": 1}, (1, 1, False)),
    (16, auto.EnvTiming(step_s=float("nan"), gil_release=float("nan"), batch=8), {}, (1, 8, False)),  # native
])
def test_auto_layout_rule(num_envs, timing, kwargs, expected):
    choice = auto.choose_layout(num_envs, timing, **{"cores": 2, **kwargs})
    assert _layout(choice) == expected, choice.reason
    if choice.num_workers > 1 and "num_workers" not in kwargs:
        assert f"{choice.num_workers} processes on" in choice.reason
    assert choice.reason


def test_auto_layout_measures_one_env_and_logs_the_choice(caplog):
    with caplog.at_level("INFO", logger="lightning_rollout"):
        collector = ThreadedCollector("CartPole-v1", None, frames_per_batch=16, num_envs=4)
    try:
        choice = collector.layout_choice
        assert choice is not None and _layout(choice) == (1, 4, False)  # cheap: the stepping thread
        assert not list(collector.loop.threads())
        assert "num_workers=1, envs_per_thread=4" in caplog.text
    finally:
        collector.shutdown()


def test_a_given_envs_per_thread_with_num_workers_auto_gets_processes_of_whole_groups(monkeypatch):
    """``envs_per_thread=8`` over 8 envs of an env that processes would speed up: one process of the 8 (it raised,
    ``num_workers (2) must be at most num_envs / envs_per_thread (1)``)."""
    monkeypatch.setattr(auto, "measure_env", lambda *a, **k: GIL_BOUND)
    monkeypatch.setattr(auto, "usable_cores", lambda: 2)
    collector = ThreadedCollector(functools.partial(CountEnv), zero_policy, frames_per_batch=16, num_envs=8,
                                  envs_per_thread=8)
    try:
        assert (collector.loop.num_workers, collector.loop.envs_per_thread) == (1, 8)
        assert next(iter(collector)).numel() == 16
    finally:
        collector.shutdown()


def test_auto_keeps_envs_of_an_unpicklable_factory_in_this_process(monkeypatch, caplog):
    monkeypatch.setattr(auto, "measure_env", lambda *a, **k: auto.EnvTiming(step_s=300e-6, gil_release=0.0))
    monkeypatch.setattr(auto, "usable_cores", lambda: 3)
    with caplog.at_level("INFO", logger="lightning_rollout"):
        collector = ThreadedCollector([lambda: CountEnv()] * 4, zero_policy, frames_per_batch=16, num_envs=4)
    try:
        choice = collector.layout_choice
        assert (choice.num_workers, collector.loop.num_workers) == (1, 1)
        assert "cannot be pickled" in caplog.text
    finally:
        collector.shutdown()


def test_auto_picks_worker_processes_for_a_gil_bound_env_with_a_picklable_factory(monkeypatch):
    monkeypatch.setattr(auto, "measure_env", lambda *a, **k: auto.EnvTiming(step_s=300e-6, gil_release=0.0))
    monkeypatch.setattr(auto, "usable_cores", lambda: 3)
    choice = _auto(functools.partial(CountEnv), 4)
    assert _layout(choice) == (2, 2, False) and "2 processes on 3 cores" in choice.reason  # 2 divides 4, 3 does not
    short = _auto(functools.partial(CountEnv), 4, expected_frames=1000)  # 0.15 s saved: under the start-up cost
    assert short.num_workers == 1


def _cgroup(tmp_path, proc: str, files: dict[str, str]) -> float | None:
    """:func:`cgroup_cpu_limit` of a process whose ``/proc/self/cgroup`` reads ``proc``, over ``files``."""
    tmp_path.mkdir(parents=True)
    (tmp_path / "cgroup").write_text(proc)
    for name, text in files.items():
        path = tmp_path / "fs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return auto.cgroup_cpu_limit(str(tmp_path / "cgroup"), str(tmp_path / "fs"))


def test_cgroup_cpu_limit_reads_v2_and_v1_quotas_and_none_without_one(tmp_path):
    v2 = "0::/kubepods/pod1\n"
    assert _cgroup(tmp_path / "a", v2, {"kubepods/pod1/cpu.max": "150000 100000\n"}) == 1.5
    assert _cgroup(tmp_path / "b", v2, {"kubepods/pod1/cpu.max": "max 100000\n"}) is None
    assert _cgroup(tmp_path / "c", "0::/\n", {"cpu.max": "200000 100000"}) == 2.0  # a container: its own root
    v1 = "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n"  # hybrid: the cpu controller is v1
    assert _cgroup(tmp_path / "d", v1, {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000",
                                        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000"}) == 3.0
    unlimited_v1 = {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}
    assert _cgroup(tmp_path / "e", "3:cpu:/\n", unlimited_v1) is None
    assert _cgroup(tmp_path / "f", v1, {}) is None  # no cgroup files
    assert _cgroup(tmp_path / "g", v2, {"kubepods/pod1/cpu.max": "garbage"}) is None
    # the kernel enforces every ancestor's limit: the smallest applies
    assert _cgroup(tmp_path / "h", v2, {"kubepods/pod1/cpu.max": "max 100000", "kubepods/cpu.max": "400000 100000",
                                        "cpu.max": "800000 100000"}) == 4.0
    assert auto.cgroup_cpu_limit(str(tmp_path / "missing"), str(tmp_path)) is None  # not Linux


def test_usable_cores_are_capped_by_a_containers_cpu_limit(monkeypatch):
    monkeypatch.setattr(auto, "cgroup_cpu_limit", lambda: None)
    affinity = auto.usable_cores()  # the CPU affinity alone
    assert affinity >= 1
    monkeypatch.setattr(auto, "cgroup_cpu_limit", lambda: 1.5)  # --cpus=1.5: one whole core
    assert auto.usable_cores() == 1
    monkeypatch.setattr(auto, "cgroup_cpu_limit", lambda: 0.5)
    assert auto.usable_cores() == 1  # at least one
    monkeypatch.setattr(auto, "cgroup_cpu_limit", lambda: 1000.0)
    assert auto.usable_cores() == affinity  # a limit above the affinity changes nothing
