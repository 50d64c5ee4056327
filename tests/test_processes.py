"""Worker processes (``num_workers > 1``): same batches as threads, errors named, nothing left behind.

Children are spawned (a few seconds each to import torch), so the tests share few loops and keep
frame counts small.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from lightning_rollout import EnvError, MultiEnvLoop, StepTimeoutError, ThreadedCollector
from lightning_rollout.envs import GymMaker
from lightning_rollout.loop.auto import EnvTiming, cgroup_cpu_limit, choose_layout
from lightning_rollout.loop.process import _SPIN_S, spin_seconds
from conftest import assert_batches_equal
from process_helpers import CountEnv as CountEnvFactory
from process_helpers import balance_policy, count_envs, zero_policy

pytestmark = [pytest.mark.timeout(180), pytest.mark.skipif(sys.platform == "win32", reason="POSIX processes")]


def _children() -> set[int]:
    """Pids of this process's live worker processes (not multiprocessing's resource tracker)."""
    import psutil

    pids = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(p.cmdline()):
                pids.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


@pytest.mark.parametrize("envs_per_thread", [2, 4], ids=["whole blocks", "one block split over both"])
def test_worker_processes_give_the_same_batches_as_threads_value_for_value(envs_per_thread):
    kwargs = dict(num_envs=4, envs_per_thread=envs_per_thread, seed=3, lookahead=False)
    before = _children()
    with MultiEnvLoop(GymMaker("CartPole-v1"), balance_policy, num_workers=2, **kwargs) as remote:
        # one env thread: this process steps the first share and one worker the other; two: two workers
        assert remote.num_workers == 2 and len(_children() - before) == (1 if envs_per_thread == 4 else 2)
        ours = [remote.run_env_steps(30), remote.run_env_steps(30)]
        episodes = remote.run_episodes(2)
    with MultiEnvLoop(GymMaker("CartPole-v1"), balance_policy, **kwargs) as local:
        reference = [local.run_env_steps(30), local.run_env_steps(30)]
    assert_batches_equal(ours, reference)
    assert ours[0]["next", "done"].any() or ours[1]["next", "done"].any()
    assert all(e["next", "done"][-1].item() for e in episodes)
    assert not (_children() - before), "close() joins every worker process"


@pytest.mark.parametrize("envs_per_thread", [2, 4], ids=["whole blocks", "one block split over both"])
def test_env_error_in_a_worker_process_names_the_env_and_the_process_and_keeps_what_was_collected(envs_per_thread):
    factories = count_envs(4, fail_at={3: 7})
    with MultiEnvLoop(factories, zero_policy, num_workers=2, envs_per_thread=envs_per_thread,
                      lookahead=False) as loop:
        with pytest.raises(EnvError, match=r"env 3 failed in step at step 7: RuntimeError: env 3 step 7 broke") as info:
            loop.run_env_steps(50)
    error = info.value
    assert "(in worker process 1)" in str(error)
    assert "Traceback" in str(error.__cause__) and "process_helpers.py" in str(error.__cause__)  # the child's
    assert error.partial is not None and error.partial.shape == (4, 7)


def test_failed_reset_in_the_second_process_of_a_split_block_names_that_env_after_its_done_step():
    """One thread's block split over two processes: a reset failing in the second part is numbered as
    the block's env (3, not the part's 1), and the done step before it is delivered."""
    factories = count_envs(4, length=5, fail_reset={3: 1})
    with MultiEnvLoop(factories, zero_policy, num_workers=2, envs_per_thread=4, lookahead=False) as loop:
        with pytest.raises(EnvError, match=r"env 3 failed in reset .*env 3 reset 1 broke") as info:
            loop.run_env_steps(20)
    assert "(in worker process 1)" in str(info.value)
    partial = info.value.partial
    assert partial is not None and partial.shape == (4, 5) and partial["next", "done"][3, -1].item()


@pytest.mark.parametrize("num_workers, envs_per_thread", [(1, 4), (2, 2), (2, 4)],
                         ids=["in threads", "whole blocks", "one block split over both"])
def test_a_random_action_that_fails_names_its_env_wherever_it_runs(num_workers, envs_per_thread):
    """Env 3's action space cannot sample: its random step fails as env 3's step 0, whichever process
    and part of a block it is in."""
    factories = count_envs(4, fail_sample={3: True})
    with MultiEnvLoop(factories, zero_policy, num_workers=num_workers, envs_per_thread=envs_per_thread,
                      random_steps_per_env=2, lookahead=False) as loop:
        with pytest.raises(EnvError, match=r"env 3 failed in step at step 0: RuntimeError: this action space "
                                           r"cannot sample") as info:
            loop.run_env_steps(5)
    assert ("(in worker process 1)" in str(info.value)) == (num_workers == 2)
    assert info.value.env_id == 3


def test_a_child_spins_for_its_next_request_only_with_one_part_and_a_core_for_every_busy_process():
    assert spin_seconds(1, 1, 2) == _SPIN_S > 0  # one worker + this process on two cores: spins
    assert spin_seconds(1, 3, 4) == _SPIN_S
    assert spin_seconds(2, 1, 8) == 0.0  # two server threads in one child: a spin would hold the other's GIL
    assert spin_seconds(1, 2, 2) == 0.0  # more busy processes than cores: a spin would take a core another needs
    assert spin_seconds(1, 1, 1) == 0.0


def test_an_idle_worker_process_stops_spinning_and_blocks(monkeypatch):
    """A spinning child polls its pipe for at most ``_SPIN_S`` after each request: left idle for half a
    second (the caller training between batches), it uses a few milliseconds of CPU, not the half second."""
    import psutil

    from lightning_rollout.loop import auto

    monkeypatch.setattr(auto, "usable_cores", lambda: 8)  # a core for each process, whatever runs the tests
    with MultiEnvLoop(count_envs(4), zero_policy, num_workers=2, envs_per_thread=4, lookahead=False) as loop:
        assert loop._pool.spins == [_SPIN_S]
        batch = loop.run_env_steps(20)
        assert batch["next", "observation"][:, -1, 2].tolist() == [5.0, 5.0, 5.0, 5.0]  # episodes of 5 steps
        child = psutil.Process(loop._pool.processes[0].pid)
        before = sum(child.cpu_times()[:2])
        threading.Event().wait(0.5)  # idle
        used = sum(child.cpu_times()[:2]) - before
        assert used < 0.1, f"the idle worker process used {used:.3f} s of CPU in 0.5 s"
        assert loop.run_env_steps(5)["next", "observation"].shape == (4, 5, 3)  # and still answers


@pytest.mark.parametrize("envs_per_thread", [2, 4], ids=["whole blocks", "one block split over both"])
def test_one_env_thread_steps_the_first_share_in_this_process_several_leave_every_env_to_workers(envs_per_thread):
    """``num_workers`` counts the processes that step envs. With one env thread (a block split over the
    processes) this process is one of them: envs 0-1 step here and envs 2-3 in worker process 1, and an
    error of an env stepped here names no process and keeps what was collected. With two env threads,
    two workers step every env."""
    pids = {}
    for failing in (1, 2):  # the last env of the first share, the first of the second
        factories = count_envs(4, fail_at={failing: 6})
        before = _children()
        with MultiEnvLoop(factories, zero_policy, num_workers=2, envs_per_thread=envs_per_thread,
                          lookahead=False) as loop:
            assert len(_children() - before) == (1 if envs_per_thread == 4 else 2)
            with pytest.raises(EnvError, match=rf"env {failing} failed in step at step 6") as info:
                loop.run_env_steps(50)
        pids[failing] = int(str(info.value).split("in process ")[1].split()[0].rstrip(")"))
        process = failing // 2 if envs_per_thread == 2 else (1 if failing >= 2 else None)
        assert (f"(in worker process {process})" in str(info.value)) == (process is not None)
        assert info.value.partial is not None and info.value.partial.shape == (4, 6)
    if envs_per_thread == 4:
        assert pids[1] == os.getpid()
    else:
        assert pids[1] != os.getpid()
    assert pids[2] != os.getpid()  # a child (each loop spawns its own)


def test_env_failing_its_first_reset_in_the_main_processs_share_is_reported_by_the_constructor():
    before = _children()
    with pytest.raises(EnvError, match=r"env 1 failed in reset at step 0: RuntimeError: env 1 reset 0 broke"):
        MultiEnvLoop(count_envs(4, fail_reset={1: 0}), zero_policy, num_workers=2, envs_per_thread=4)
    assert not (_children() - before), "the child started before the failure is closed"


def test_env_failing_its_first_reset_in_a_worker_process_is_reported_by_the_constructor():
    with pytest.raises(EnvError, match=r"env 2 failed in reset at step 0: RuntimeError: env 2 reset 0 broke"):
        MultiEnvLoop(count_envs(4, fail_reset={2: 0}), zero_policy, num_workers=2, envs_per_thread=2)


def test_unpicklable_factory_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="picklable.*module level"):
        MultiEnvLoop([lambda: GymMaker("CartPole-v1")()] * 2, zero_policy, num_workers=2)


def test_hung_env_in_a_worker_process_times_out_and_its_process_is_ended():
    before = _children()
    loop = MultiEnvLoop(count_envs(2, hang_at={1: 4}), zero_policy, num_workers=2, step_timeout=1.0,
                        lookahead=False)
    try:
        with pytest.raises(StepTimeoutError, match="env 1"):
            loop.run_env_steps(20)
    finally:
        loop.close()
    assert not (_children() - before), "the stuck process is terminated, not left running"


def test_hung_env_in_the_main_processs_share_times_out_and_every_worker_process_is_ended():
    """One env thread over this process and a worker: env 0 steps here and hangs; the step times out
    like an in-process env's (its thread abandoned, with a warning) and close() still ends the worker."""
    import threading

    before = _children()
    loop = MultiEnvLoop(count_envs(2, hang_at={0: 4}, hang_s=4.0), zero_policy, num_workers=2, envs_per_thread=2,
                        step_timeout=1.0, lookahead=False)
    try:
        assert len(_children() - before) == 1
        with pytest.warns(RuntimeWarning, match="abandoned"):
            with pytest.raises(StepTimeoutError, match="env 0"):
                loop.run_env_steps(20)
    finally:
        loop.close()
    assert not (_children() - before), "the worker is closed although the env thread is stuck here"
    stuck = [t for t in threading.enumerate() if t.name == "lightning_rollout-loop-env0"]
    assert stuck and all(t.daemon for t in stuck)  # abandoned inside the env's step, as an in-process env's thread
    for t in stuck:  # the env's sleep ends; the thread then sees the closed loop and leaves
        t.join(30.0)
        assert not t.is_alive()


def test_collector_with_worker_processes_yields_torchrl_batches():
    collector = ThreadedCollector(GymMaker("CartPole-v1"), None, frames_per_batch=32, total_frames=64, num_envs=4,
                                  num_workers=2, envs_per_thread=2)
    try:
        batches = list(collector)
    finally:
        collector.shutdown()
    assert [tuple(b.shape) for b in batches] == [(4, 8), (4, 8)]
    assert torch.equal(batches[0]["collector", "traj_ids"][:, 0], torch.arange(4))


_ORPHAN_SCRIPT = """
import os, sys, time
sys.path.insert(0, {tests!r})
from lightning_rollout import MultiEnvLoop
from process_helpers import count_envs, zero_policy

if __name__ == "__main__":
    loop = MultiEnvLoop(count_envs(2), zero_policy, num_workers=2)  # one env per thread: two workers
    loop.run_env_steps(3)
    print(" ".join(str(p.pid) for p in loop._pool.processes), flush=True)
    time.sleep(60)  # killed here
"""


def test_worker_processes_exit_when_the_main_process_is_killed(tmp_path):
    import psutil

    root = Path(__file__).resolve().parents[1]
    # TMPDIR: the killed process cannot remove multiprocessing's temp folder (pymp-*); it is left in tmp_path
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""), TMPDIR=str(tmp_path))
    code = textwrap.dedent(_ORPHAN_SCRIPT).format(tests=str(root / "tests"))
    script = tmp_path / "orphan.py"
    script.write_text(code)  # spawn re-imports the main module from a file
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=root, env=env)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2, proc.stderr.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        gone, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=20)
        assert not alive, f"orphaned worker processes: {[p.pid for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()


def _cgroup(tmp_path, proc: str, files: dict[str, str]) -> float | None:
    """:func:`cgroup_cpu_limit` of a process whose ``/proc/self/cgroup`` reads ``proc``, over ``files``."""
    tmp_path.mkdir(parents=True)
    (tmp_path / "cgroup").write_text(proc)
    for name, text in files.items():
        path = tmp_path / "fs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return cgroup_cpu_limit(str(tmp_path / "cgroup"), str(tmp_path / "fs"))


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
    assert cgroup_cpu_limit(str(tmp_path / "missing"), str(tmp_path)) is None  # not Linux


def test_usable_cores_are_capped_by_a_containers_cpu_limit(monkeypatch):
    from lightning_rollout.loop import auto

    monkeypatch.setattr(auto, "cgroup_cpu_limit", lambda: None)
    affinity = auto.usable_cores()  # the CPU affinity alone
    assert affinity >= 1
    monkeypatch.setattr(auto, "cgroup_cpu_limit", lambda: 1.5)  # --cpus=1.5: one whole core
    assert auto.usable_cores() == 1
    monkeypatch.setattr(auto, "cgroup_cpu_limit", lambda: 0.5)
    assert auto.usable_cores() == 1  # at least one
    monkeypatch.setattr(auto, "cgroup_cpu_limit", lambda: 1000.0)
    assert auto.usable_cores() == affinity  # a limit above the affinity changes nothing


def test_auto_layout_rule():
    cheap = EnvTiming(step_s=10e-6, gil_release=0.0)
    gil_bound = EnvTiming(step_s=100e-6, gil_release=0.05)
    releasing_slow = EnvTiming(step_s=2e-3, gil_release=0.98)
    releasing_fast = EnvTiming(step_s=200e-6, gil_release=0.9)
    assert (choose_layout(16, cheap, cores=2).num_workers, choose_layout(16, cheap, cores=2).envs_per_thread) == (1, 16)
    choice = choose_layout(16, gil_bound, cores=5)  # a process a core, this one included; one thread drives them
    assert (choice.num_workers, choice.envs_per_thread) == (5, 16)
    assert "the main process and 4 worker processes" in choice.reason
    two = choose_layout(16, gil_bound, cores=2)  # two cores: this process and one worker (measured 1.5x one thread)
    assert (two.num_workers, two.envs_per_thread) == (2, 16)
    mujoco = EnvTiming(step_s=60e-6, gil_release=float("nan"))  # HalfCheetah: under cheap_s, not measured
    assert choose_layout(16, mujoco, cores=2).num_workers == 2  # 480 us a step for the other process: worth it
    assert choose_layout(4, mujoco, cores=2).num_workers == 1  # 120 us: less than a round trip to a child
    assert choose_layout(32, cheap, cores=2).num_workers == 1  # 32 CartPoles: 160 us, not worth it either
    assert choose_layout(16, mujoco, cores=2, round_trip_s=1e-3).num_workers == 1
    assert choose_layout(16, gil_bound, cores=2, expected_frames=20_000).num_workers == 1  # 0.3 s saved: not worth it
    assert choose_layout(4, gil_bound, cores=16, share_s=50e-6).num_workers == 4  # at most one process per env
    # many cores: at most as many processes as give each 200 us of env time a step
    assert choose_layout(8, gil_bound, cores=16).num_workers == 4
    many = choose_layout(16, gil_bound, cores=16)
    assert many.num_workers == 8 and "(a share of at least 200 us of env time each)" in many.reason
    assert choose_layout(64, gil_bound, cores=16).num_workers == 16  # 6.4 ms a step: a process a core
    assert choose_layout(16, mujoco, cores=16).num_workers == 4  # 960 us a step
    assert choose_layout(32, cheap, cores=16).num_workers == 1  # two shares of 160 us: less than a round trip
    assert choose_layout(3, gil_bound, cores=16).num_workers == 1  # 200 us a step to spread: not worth it
    assert (choose_layout(16, gil_bound, cores=1).num_workers) == 1
    choice = choose_layout(16, releasing_slow, cores=2)  # one block, each env stepped in its own helper thread
    assert (choice.num_workers, choice.envs_per_thread, choice.parallel_steps) == (1, 16, True)
    choice = choose_layout(16, releasing_fast, cores=2)  # 200 us of C: two processes step it on two cores
    assert (choice.num_workers, choice.envs_per_thread, choice.parallel_steps) == (2, 16, False)
    choice = choose_layout(16, releasing_fast, cores=1)  # one core: no processes; helpers overlap what waits
    assert (choice.num_workers, choice.envs_per_thread, choice.parallel_steps) == (1, 16, True)
    assert not choose_layout(16, cheap, cores=2).parallel_steps
    threads_only = choose_layout(16, gil_bound, cores=2, num_workers="threads")  # ~1 ms of env time per thread
    assert (threads_only.envs_per_thread, threads_only.parallel_steps) == (16, False)
    assert choose_layout(16, releasing_slow, cores=2, envs_per_thread=4).parallel_steps is False  # given: kept
    kept = choose_layout(16, gil_bound, cores=3, envs_per_thread=4)
    assert (kept.num_workers, kept.envs_per_thread) == (3, 4)
    assert kept.reason.endswith("(3 worker processes)")  # four env threads: every env in a worker


def test_auto_layout_measures_one_env_and_logs_the_choice(caplog):
    with caplog.at_level("INFO", logger="lightning_rollout"):
        collector = ThreadedCollector("CartPole-v1", None, frames_per_batch=16, num_envs=4)
    try:
        choice = collector.layout_choice
        assert choice is not None and (choice.num_workers, choice.envs_per_thread) == (1, 4)  # cheap: one thread
        assert "num_workers=1, envs_per_thread=4" in caplog.text
    finally:
        collector.shutdown()


def test_auto_keeps_envs_of_an_unpicklable_factory_in_threads(monkeypatch):
    import lightning_rollout.loop.auto as auto

    monkeypatch.setattr(auto, "measure_env", lambda *a, **k: EnvTiming(step_s=300e-6, gil_release=0.0))  # GIL-bound
    monkeypatch.setattr(auto, "usable_cores", lambda: 3)
    collector = ThreadedCollector([lambda: CountEnvFactory()] * 4, zero_policy, frames_per_batch=16, num_envs=4)
    try:
        choice = collector.layout_choice
        assert (choice.num_workers, collector.loop.num_workers) == (1, 1)
        assert "cannot be pickled" in choice.reason
    finally:
        collector.shutdown()


def test_auto_picks_worker_processes_for_a_gil_bound_env_with_a_picklable_factory(monkeypatch):
    import lightning_rollout.loop.auto as auto

    monkeypatch.setattr(auto, "measure_env", lambda *a, **k: EnvTiming(step_s=300e-6, gil_release=0.0))
    monkeypatch.setattr(auto, "usable_cores", lambda: 3)
    choice = auto.auto_layout(count_envs(4)[0], 4, num_workers="auto", envs_per_thread="auto")
    assert (choice.num_workers, choice.envs_per_thread) == (3, 4) and "2 worker processes" in choice.reason
    short = auto.auto_layout(count_envs(4)[0], 4, num_workers="auto", envs_per_thread="auto", expected_frames=1000)
    assert short.num_workers == 1 and "too few" in short.reason


def test_a_close_cut_short_by_ctrl_c_during_the_joins_of_worker_processes_is_finished_by_the_next_close(
        monkeypatch):
    """A second Ctrl-C while :meth:`close` waits for the worker processes to end cuts it short; the next
    ``close()`` of the loop ends every worker process and releases their pipes."""
    loop = MultiEnvLoop(count_envs(4), zero_policy, num_workers=2, envs_per_thread=4, lookahead=False)
    assert loop.run_env_steps(3)["next", "observation"].shape == (4, 3, 3)
    pool = loop._pool
    processes, remote = list(pool.processes), list(pool._remote)
    pids = {p.pid for p in processes}
    real_join = type(processes[0]).join
    calls: list[float | None] = []

    def join_interrupted_once(self, timeout=None):
        calls.append(timeout)
        if len(calls) == 1:
            raise KeyboardInterrupt  # the second Ctrl-C, while close() joins the first worker process
        return real_join(self, timeout)

    monkeypatch.setattr(type(processes[0]), "join", join_interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        loop.close()
    monkeypatch.undo()
    assert pool.processes  # cut short: the pool is not closed yet
    loop.close()
    assert not pool.processes and all(block.conn.closed for block in remote)
    assert not pids & _children()
