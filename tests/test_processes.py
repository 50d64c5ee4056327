"""Worker processes (``num_workers > 1``): same batches as in-process envs, errors named, nothing left behind.

With ``num_workers=n`` the envs are cut into ``n`` contiguous shards: this process steps the first, worker
processes ``lightning_rollout-<name>-worker1`` .. ``worker<n-1>`` the others. Children are spawned (a few
seconds each to import torch), so the tests share few loops and keep frame counts small.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import pytest
import torch

from lightning_rollout import EnvError, MultiEnvLoop, StepTimeoutError, ThreadedCollector
from lightning_rollout.envs import GymMaker
from conftest import assert_batches_equal, steps_per_env
from process_helpers import EnvVarEnv, balance_policy, count_envs, worker_pids, zero_policy

pytestmark = [pytest.mark.timeout(180), pytest.mark.skipif(sys.platform == "win32", reason="POSIX processes")]

# envs_per_thread with num_workers=2 and 4 envs: one env a unit, or a unit a shard; either way envs 0-1 step
# in this process and envs 2-3 in worker process 1.
SHARDS = pytest.mark.parametrize("envs_per_thread", [1, 2], ids=["one env a unit", "a unit a shard"])


@SHARDS
def test_worker_processes_give_the_same_batches_as_in_process_envs_value_for_value(envs_per_thread):
    kwargs = dict(num_envs=4, envs_per_thread=envs_per_thread, seed=3, lookahead=False)
    before = worker_pids()
    with MultiEnvLoop(GymMaker("CartPole-v1"), balance_policy, num_workers=2, **kwargs) as remote:
        assert remote.num_workers == 2 and len(worker_pids() - before) == 1  # this process steps the first shard
        ours = [remote.run_env_steps(30), remote.run_steps(12), remote.run_env_steps(30)]
        episodes = remote.run_episodes(2)
    with MultiEnvLoop(GymMaker("CartPole-v1"), balance_policy, **kwargs) as local:
        reference = [local.run_env_steps(30), local.run_steps(12), local.run_env_steps(30)]
    assert_batches_equal(ours, reference)
    assert any(b["next", "done"].any() for b in ours)
    assert all(e["next", "done"][-1].item() for e in episodes)
    assert not (worker_pids() - before), "close() joins every worker process"


def test_more_worker_processes_than_units_of_envs_are_refused_with_what_to_do():
    """Each process steps whole units of ``envs_per_thread`` envs: 4 envs in one unit cannot be shared by two
    processes. The refusal says which knob to change, and no worker process is left running."""
    before = worker_pids()
    with pytest.raises(ValueError, match="num_workers.*envs_per_thread|envs_per_thread.*num_workers"):
        MultiEnvLoop(count_envs(4), zero_policy, num_workers=2, envs_per_thread=4)
    assert not (worker_pids() - before)


@SHARDS
def test_env_error_in_a_worker_process_names_the_env_and_the_process_and_keeps_what_was_collected(envs_per_thread):
    factories = count_envs(4, fail_at={3: 7})
    with MultiEnvLoop(factories, zero_policy, num_workers=2, envs_per_thread=envs_per_thread,
                      lookahead=False) as loop:
        with pytest.raises(EnvError, match=r"env 3 failed in step at step 7: RuntimeError: env 3 step 7 broke") as info:
            loop.run_env_steps(50)
    error = info.value
    assert "(in worker process 1)" in str(error)
    assert "Traceback" in str(error.__cause__) and "process_helpers.py" in str(error.__cause__)  # the child's
    counts = steps_per_env(error.partial)  # every complete step, in arrival order
    assert counts[3] == 7 and min(counts.values()) >= 7


def test_a_reset_failing_in_a_worker_process_after_a_done_step_names_that_env_and_delivers_the_done_step():
    """Env 3's reset after its first episode (5 steps) fails in worker process 1: the error names env 3, and
    the done step before it is delivered in ``exc.partial`` (a failed reset loses nothing before it)."""
    factories = count_envs(4, length=5, fail_reset={3: 1})
    with MultiEnvLoop(factories, zero_policy, num_workers=2, envs_per_thread=2, lookahead=False) as loop:
        with pytest.raises(EnvError, match=r"env 3 failed in reset .*env 3 reset 1 broke") as info:
            loop.run_env_steps(20)
    assert "(in worker process 1)" in str(info.value)
    partial = info.value.partial
    env3 = partial[partial["collector", "env_id"] == 3]
    assert env3.shape == (5,) and env3["next", "done"][-1].item()  # the done step is delivered


@pytest.mark.parametrize("num_workers", [1, 2], ids=["in this process", "in a worker process"])
def test_random_actions_are_drawn_from_the_action_spec_not_the_envs_space(num_workers):
    """Env 3's action space cannot sample: random steps do not call it (they are drawn, for every env at once,
    from the env's action spec in this process), wherever the env runs."""
    factories = count_envs(4, fail_sample={3: True})
    with MultiEnvLoop(factories, zero_policy, num_workers=num_workers, envs_per_thread=2, random_steps_per_env=2,
                      lookahead=False) as loop:
        batch = loop.run_env_steps(5)
    assert batch.shape == (4, 5)
    assert batch["policy_version"][:, :2].eq(-1).all() and batch["policy_version"][:, 2:].ge(0).all()
    assert set(batch["action"].unique().tolist()) <= {0, 1}


def test_an_idle_worker_process_blocks_instead_of_spinning():
    """Left idle for half a second (the caller training between batches), a worker process uses a few
    milliseconds of CPU, not the half second, and then answers again."""
    import psutil

    before = worker_pids()
    with MultiEnvLoop(count_envs(4), zero_policy, num_workers=2, envs_per_thread=2, lookahead=False) as loop:
        batch = loop.run_env_steps(20)
        assert batch["next", "observation"][:, -1, 2].tolist() == [5.0, 5.0, 5.0, 5.0]  # episodes of 5 steps
        (pid,) = worker_pids() - before
        child = psutil.Process(pid)
        used_before = sum(child.cpu_times()[:2])
        threading.Event().wait(0.5)  # idle
        used = sum(child.cpu_times()[:2]) - used_before
        assert used < 0.1, f"the idle worker process used {used:.3f} s of CPU in 0.5 s"
        assert loop.run_env_steps(5)["next", "observation"].shape == (4, 5, 3)  # and still answers


@SHARDS
def test_the_first_shard_steps_in_this_process_and_an_error_there_names_no_worker_process(envs_per_thread):
    """``num_workers`` counts the processes that step envs, this one included: envs 0-1 step here and envs 2-3
    in worker process 1. An error of an env stepped here names no process (the env's own message says which
    process ran it) and keeps what was collected, like an in-process env's."""
    pids = {}
    for failing in (1, 2):  # the last env of the first shard, the first of the second
        factories = count_envs(4, fail_at={failing: 6})
        before = worker_pids()
        with MultiEnvLoop(factories, zero_policy, num_workers=2, envs_per_thread=envs_per_thread,
                          lookahead=False) as loop:
            assert len(worker_pids() - before) == 1
            with pytest.raises(EnvError, match=rf"env {failing} failed in step at step 6") as info:
                loop.run_env_steps(50)
        pids[failing] = int(str(info.value).split("in process ")[1].split()[0].rstrip(")"))
        assert ("(in worker process 1)" in str(info.value)) == (failing == 2)
        assert "worker process 0" not in str(info.value)
        assert info.value.partial is not None and info.value.partial.batch_dims == 1  # every complete step
    assert pids[1] == os.getpid()
    assert pids[2] != os.getpid()


def test_env_failing_its_first_reset_in_this_processs_shard_is_reported_by_the_constructor():
    before = worker_pids()
    with pytest.raises(EnvError, match=r"env 1 failed in reset at step 0: RuntimeError: env 1 reset 0 broke"):
        MultiEnvLoop(count_envs(4, fail_reset={1: 0}), zero_policy, num_workers=2, envs_per_thread=2)
    assert not (worker_pids() - before), "the child started before the failure is closed"


def test_env_failing_its_first_reset_in_a_worker_process_is_reported_by_the_constructor():
    before = worker_pids()
    with pytest.raises(EnvError, match=r"env 2 failed in reset at step 0: RuntimeError: env 2 reset 0 broke") as info:
        MultiEnvLoop(count_envs(4, fail_reset={2: 0}), zero_policy, num_workers=2, envs_per_thread=2)
    assert "(in worker process 1)" in str(info.value)
    assert not (worker_pids() - before)


def test_unpicklable_factory_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="picklable.*module level"):
        MultiEnvLoop([lambda: GymMaker("CartPole-v1")()] * 2, zero_policy, num_workers=2)


def test_hung_env_in_a_worker_process_times_out_and_its_process_is_ended():
    before = worker_pids()
    loop = MultiEnvLoop(count_envs(2, hang_at={1: 4}), zero_policy, num_workers=2, step_timeout=1.0,
                        lookahead=False)
    try:
        with pytest.raises(StepTimeoutError, match="env 1") as info:
            loop.run_env_steps(20)
        assert (info.value.env_id, info.value.step) == (1, 4)
        counts = steps_per_env(info.value.partial)
        assert counts[1] == 4 and counts[0] >= 4
    finally:
        loop.close()
    assert not (worker_pids() - before), "the stuck process is terminated, not left running"


def test_hung_env_in_this_processs_shard_times_out_and_every_worker_process_is_ended():
    """Env 0 steps in this process and hangs for 4 s: ``step_timeout`` names it as it names an env of a worker
    process, and ``close()`` still ends the worker."""
    before = worker_pids()
    threads = set(threading.enumerate())
    loop = MultiEnvLoop(count_envs(2, hang_at={0: 4}, hang_s=4.0), zero_policy, num_workers=2, step_timeout=1.0,
                        lookahead=False)
    try:
        assert len(worker_pids() - before) == 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a thread stuck in the env's step may be abandoned
            with pytest.raises(StepTimeoutError, match="env 0") as info:
                loop.run_env_steps(20)
        assert (info.value.env_id, info.value.step) == (0, 4)
    finally:
        loop.close()
    assert not (worker_pids() - before), "the worker is closed although env 0 is stuck here"
    for t in set(threading.enumerate()) - threads:  # the env's sleep ends; a thread left in it then leaves
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
    for batch in batches:  # a CartPole observation is never all zeros: every env's steps arrive, 2-3's included
        assert (batch["next", "observation"].abs().sum(-1) > 0).all()
        assert (batch["next", "reward"] == 1).all()


def test_worker_processes_see_the_environment_variables_of_the_moment_their_loop_is_built(monkeypatch):
    """A variable set after a first loop with worker processes (which started multiprocessing's fork server) is
    seen by the next loop's worker as by this process's env, as a spawned process would see it."""
    monkeypatch.delenv("LIGHTNING_ROLLOUT_TEST_VALUE", raising=False)
    factories = [functools.partial(EnvVarEnv, "LIGHTNING_ROLLOUT_TEST_VALUE")] * 2  # env 1 in the worker

    def first_entries() -> list[float]:
        with MultiEnvLoop(factories, zero_policy, num_workers=2, envs_per_thread=1, lookahead=False) as loop:
            return loop.run_env_steps(1)["next", "observation"][:, 0, 0].tolist()

    assert first_entries() == [-1.0, -1.0]
    monkeypatch.setenv("LIGHTNING_ROLLOUT_TEST_VALUE", "7")
    assert first_entries() == [7.0, 7.0]


_ORPHAN_SCRIPT = """
import multiprocessing, os, sys, time
import psutil
sys.path.insert(0, {tests!r})
from lightning_rollout import MultiEnvLoop
from process_helpers import count_envs, zero_policy

if __name__ == "__main__":
    loop = MultiEnvLoop(count_envs(3), zero_policy, num_workers=3)  # this process and two workers
    loop.run_env_steps(3)
    workers = [p.pid for p in multiprocessing.active_children()]
    helpers = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in workers]  # tracker, server
    print(" ".join(map(str, workers)), "|", " ".join(map(str, helpers)), flush=True)
    time.sleep(60)  # killed here
"""


def test_worker_processes_and_multiprocessings_helpers_exit_when_the_main_process_is_killed(tmp_path):
    import psutil

    root = Path(__file__).resolve().parents[1]
    # TMPDIR: the killed process cannot remove multiprocessing's temp folder (pymp-*); it is left in tmp_path
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""), TMPDIR=str(tmp_path))
    code = textwrap.dedent(_ORPHAN_SCRIPT).format(tests=str(root / "tests"))
    script = tmp_path / "orphan.py"
    script.write_text(code)  # a worker re-imports the main module from a file
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=root, env=env)
    try:
        workers, helpers = ([int(p) for p in part.split()] for part in proc.stdout.readline().split("|"))
        assert len(workers) == 2, proc.stderr.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        pids = workers + helpers  # multiprocessing's resource tracker and fork server end too
        gone, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=20)
        assert not alive, f"orphaned processes: {[(p.pid, p.pid in workers) for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_close_cut_short_by_ctrl_c_during_the_joins_of_worker_processes_is_finished_by_the_next_close(
        monkeypatch):
    """A second Ctrl-C while :meth:`close` waits for the worker processes to end cuts it short; the next
    ``close()`` of the loop ends and reaps every worker process (none is left running or a zombie)."""
    import psutil

    before = worker_pids()
    loop = MultiEnvLoop(count_envs(4), zero_policy, num_workers=2, envs_per_thread=2, lookahead=False)
    assert loop.run_env_steps(3)["next", "observation"].shape == (4, 3, 3)
    pids = worker_pids() - before
    assert len(pids) == 1
    process_class = multiprocessing.process.BaseProcess  # whichever start method made them
    real_join = process_class.join
    calls: list[float | None] = []

    def join_interrupted_once(self, timeout=None):
        calls.append(timeout)
        if len(calls) == 1:
            raise KeyboardInterrupt  # the second Ctrl-C, while close() joins the first worker process
        return real_join(self, timeout)

    monkeypatch.setattr(process_class, "join", join_interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        loop.close()
    monkeypatch.undo()
    assert calls, "close() joined a worker process"
    loop.close()
    assert not [pid for pid in pids if psutil.pid_exists(pid)], "every worker process is joined by the next close()"
