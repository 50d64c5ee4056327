"""Worker processes (``num_workers > 1``) that fail: each failure ends in a named error that says what
happened, keeps what was collected, closes every env built and leaves no process or thread running.

With ``num_workers=2`` and 4 envs (``envs_per_thread=2``), envs 0-1 step in this process and envs 2-3 in
worker process 1 (``lightning_rollout-loop-worker1``). What each failure says is listed in
``docs/reliability.rst`` ("Worker processes").

The misbehaving envs are in ``worker_helpers.py`` (a spawned child imports them by name). Failures that
need a real signal, a real process exit or a process's own limits run in a subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import steps_per_env
import torch

from lightning_rollout import CollectionError, EnvError, MultiEnvLoop, PolicyError, ThreadedCollector
from process_helpers import count_envs, worker_pids, zero_policy
from reliability_helpers import bounded
from worker_helpers import (ClosingEnv, FdStarvedEnv, ForkingEnv, KilledEnv, RaisingEnv, WrongShapeEnv, closed_envs,
                            factories, unpicklable_in_child)

pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(sys.platform == "win32", reason="POSIX processes")]

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def _run_script(tmp_path: Path, code: str, *, timeout: float = 120.0, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` as a script file (``spawn`` re-imports a main module from its file) in a subprocess."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    environ = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, env=environ,
                          timeout=timeout)


# -- an env raising what is not an Exception -------------------------------------------------------------
@pytest.mark.parametrize("kind", [SystemExit, KeyboardInterrupt])
def test_a_base_exception_in_a_worker_processs_env_ends_in_an_env_error_naming_it(kind):
    """Env 3 (the second env of worker process 1) raises ``SystemExit`` / ``KeyboardInterrupt``: answered like
    any error of the env, naming env 3, not the first env of its process."""
    before = worker_pids()
    loop = MultiEnvLoop(factories(RaisingEnv, 4, bad=3, at=3, kind=kind), zero_policy, num_workers=2,
                        envs_per_thread=1, lookahead=False)
    try:
        with pytest.raises(EnvError, match=rf"env 3 failed in step at step 3: {kind.__name__}: env 3 raised") as info:
            bounded(lambda: loop.run_env_steps(10), 30.0, "run_env_steps")
    finally:
        loop.close()
    assert "(in worker process 1)" in str(info.value)
    counts = steps_per_env(info.value.partial)
    assert counts[3] == 3 and min(counts.values()) >= 3
    assert not (worker_pids() - before)


# -- a worker's death names its cause ------------------------------------------------------------------
@pytest.mark.parametrize("when", ["step", "build"])
def test_a_worker_killed_by_a_signal_is_reported_with_the_signal_not_the_main_guard(when):
    """Env 3 runs in worker process 1 (envs 0-1 step here) and kills it with SIGKILL, at its fourth step
    or while it is being built: the error names the process's first env, says the process was killed by
    SIGKILL (and when), not that the main script lacks an ``if __name__ == "__main__":`` guard."""
    before = worker_pids()
    make = factories(KilledEnv, 4, bad=3, at=3 if when == "step" else None)
    if when == "build":
        with pytest.raises(EnvError, match="while building its envs") as info:
            MultiEnvLoop(make, zero_policy, num_workers=2, envs_per_thread=2)
    else:
        with MultiEnvLoop(make, zero_policy, num_workers=2, envs_per_thread=2, lookahead=False) as loop:
            with pytest.raises(EnvError, match="env 2 failed in step at step 3") as info:
                loop.run_env_steps(10)
        counts = steps_per_env(info.value.partial)
        assert counts[3] == 3 and min(counts.values()) >= 3
    message = str(info.value)
    assert "was killed by SIGKILL (exit code -9)" in message and "(in worker process 1)" in message
    assert "__main__" not in message and info.value.__cause__ is not None
    assert not (worker_pids() - before)


def test_a_factory_that_cannot_be_unpickled_in_the_worker_names_the_real_cause():
    before = worker_pids()
    make = count_envs(3) + [unpicklable_in_child()]  # env 3: in worker process 1
    with pytest.raises(EnvError, match=r"env 3 failed in reset at step 0: the env factory could not be unpickled in "
                                       r"the worker process \(RuntimeError: this factory cannot be rebuilt") as info:
        MultiEnvLoop(make, zero_policy, num_workers=2, envs_per_thread=2)
    assert "__main__" not in str(info.value) and "(in worker process 1)" in str(info.value)
    assert "_refuse_to_unpickle" in str(info.value.__cause__)  # the worker's traceback
    assert not (worker_pids() - before)


_UNGUARDED_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from lightning_rollout import MultiEnvLoop
from process_helpers import CountEnv


class BigFactory:  # pickles to 1 MiB, as a factory holding a map or a policy's weights does
    def __init__(self):
        self.payload = bytes(1 << 20)

    def __call__(self):
        return CountEnv()


MultiEnvLoop([BigFactory() for _ in range(4)], None, num_workers=2, envs_per_thread=2)  # no main guard
"""


def test_a_script_without_a_main_guard_is_told_to_add_one_whatever_its_factories_pickle_to(tmp_path):
    """A script builds a loop of worker processes at its top level, with env factories of 1 MiB pickled: the
    worker dies re-running the script, and the constructor says to guard it (not a hang in ``spawn``, which
    blocks for good writing a large start-up payload to a child that died reading it)."""
    run = _run_script(tmp_path, _UNGUARDED_SCRIPT.format(tests=str(TESTS)), timeout=60.0)
    assert run.returncode == 1
    assert 'guard it with `if __name__ == "__main__":`' in run.stderr.strip().splitlines()[-1], run.stderr[-2000:]


def test_a_worker_that_cannot_attach_its_shared_buffers_reports_why_at_construction():
    """Env 3 lowers its worker process's file-descriptor limit to the descriptors already open, so the
    worker cannot receive its shared buffers: the constructor says so, with the worker's error."""
    before = worker_pids()
    make = count_envs(3) + [factories(FdStarvedEnv, 4)[3]]
    with pytest.raises(EnvError, match=r"could not attach the shared buffers of envs \[2, 3\]") as info:
        MultiEnvLoop(make, zero_policy, num_workers=2, envs_per_thread=2)
    message = str(info.value)
    assert "ulimit -n" in message
    assert "(in worker process 1)" in message and "Traceback" in str(info.value.__cause__)
    assert not (worker_pids() - before)


_FD_SCRIPT = """
import json, os, resource, sys
sys.path.insert(0, {tests!r})
from lightning_rollout import CollectionError, MultiEnvLoop
from process_helpers import count_envs, worker_pids, zero_policy

if __name__ == "__main__":
    results = []
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    for extra in (4, 10, 24):  # where it runs out: starting the worker, sharing the buffers, sending them
        open_fds = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_fds + extra, hard))
        try:
            MultiEnvLoop(count_envs(8), zero_policy, num_workers=2, envs_per_thread=1).close()
            result = {{"error": None}}
        except BaseException as exc:
            result = {{"error": type(exc).__name__, "named": isinstance(exc, CollectionError), "message": str(exc),
                      "cause": repr(exc.__cause__)}}
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        result["extra"] = extra
        result["children"] = sorted(worker_pids())
        results.append(result)
        MultiEnvLoop(count_envs(2), zero_policy, num_workers=2, envs_per_thread=1).close()  # works again
    print(json.dumps(results), flush=True)
"""


def test_running_out_of_file_descriptors_says_so_and_what_to_do(tmp_path):
    """Eight envs over this process and a worker, with the file-descriptor limit a few above what the process
    holds, so that it runs out while starting the worker, or while sharing the envs' buffers: each time a named
    error (a :class:`CollectionError`) whose message says how to get more, with the error that said so chained, and
    no worker process left; each time, the limit raised again, a loop with a worker process works again. Where the
    buffers could not be shared the message says what ran out; where the worker could not be started, it may name
    the end of multiprocessing's fork server instead (a handshake this process could not finish ends it; the
    next start runs a new one)."""
    run = _run_script(tmp_path, _FD_SCRIPT.format(tests=str(TESTS)))
    assert run.returncode == 0, run.stderr
    results = json.loads(run.stdout.strip().splitlines()[-1])
    sharing = [r for r in results if r["message"].startswith("could not share the envs' buffers")]
    assert sharing, results
    for result in results:
        assert result["error"] is not None and result["named"], result
        assert "ulimit -n" in result["message"], result
        assert result["cause"] != "None", result
        assert result not in sharing or "Too many open files" in result["message"] + result["cause"], result
        assert result["children"] == [], result


# -- a refused construction closes every env it built ------------------------------------------------------
@pytest.mark.parametrize("where", ["this process", "worker processes"])
def test_an_env_refused_at_construction_is_closed_with_every_env_built_before_it(tmp_path, where):
    """Env 3 (in worker process 1 with worker processes: envs 0-1 are built here) has a space the loop cannot
    store: the construction is refused, and the refused env is closed as well as every env built."""
    num_workers = 1 if where == "this process" else 2
    with pytest.raises((ValueError, EnvError), match="Text"):
        MultiEnvLoop(factories(ClosingEnv, 4, marks=str(tmp_path), bad=3), zero_policy, num_workers=num_workers,
                     envs_per_thread=2)
    assert closed_envs(str(tmp_path)) == [0, 1, 2, 3]


def _broken_policy(obs: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("this policy cannot act")


def test_a_construction_refused_after_the_workers_built_their_envs_closes_them_all(tmp_path):
    before = worker_pids()
    with pytest.raises(PolicyError, match="this policy cannot act"):
        MultiEnvLoop(factories(ClosingEnv, 4, marks=str(tmp_path)), _broken_policy, num_workers=2, envs_per_thread=2)
    assert closed_envs(str(tmp_path)) == [0, 1, 2, 3]  # 0-1 here, 2-3 in worker process 1
    assert not (worker_pids() - before)


# -- the env that failed is named ----------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [1, 3], ids=["in this process", "in a worker process"])
def test_a_shape_error_without_validation_names_the_env_that_returned_it(bad):
    """``validate=False``: an observation of the wrong shape fails where it is written into the shared
    buffer; the error names that env, not the first env of its process's shard."""
    with MultiEnvLoop(factories(WrongShapeEnv, 4, bad=bad, at=2), zero_policy, num_workers=2,
                      envs_per_thread=2, validate=False, lookahead=False) as loop:
        with pytest.raises(EnvError, match=rf"env {bad} failed in step at step 2: ValueError") as info:
            loop.run_env_steps(10)
    assert info.value.env_id == bad and steps_per_env(info.value.partial)[bad] == 2


# -- daemonic processes -----------------------------------------------------------------------------------
def test_an_env_may_start_processes_of_its_own_in_a_worker_process():
    """Worker processes are not daemonic, so an env in one (env 1) may start processes (as gymnasium's
    ``AsyncVectorEnv`` does)."""
    with MultiEnvLoop(factories(ForkingEnv, 2), zero_policy, num_workers=2, envs_per_thread=1) as loop:
        batch = loop.run_env_steps(3)
    assert batch["next", "observation"][:, :, 2].tolist() == [[1.0, 2.0, 3.0]] * 2


class _CollectorDataset(torch.utils.data.IterableDataset):
    """Builds a collector with worker processes inside a ``DataLoader`` worker (a daemonic process)."""

    def __iter__(self):
        collector = ThreadedCollector(count_envs(2), zero_policy, frames_per_batch=4, total_frames=4, num_envs=2,
                                      num_workers=2, envs_per_thread=1)
        try:
            yield from collector
        finally:
            collector.shutdown()


def test_worker_processes_in_a_daemonic_process_are_refused_with_what_to_do():
    loader = torch.utils.data.DataLoader(_CollectorDataset(), batch_size=None, num_workers=1,
                                         multiprocessing_context="fork")
    with pytest.raises(CollectionError, match="daemonic.*num_workers=1"):
        next(iter(loader))


# -- Ctrl-C while the workers start ------------------------------------------------------------------------
_CTRL_C_SCRIPT = """
import os, signal, sys, time
sys.path.insert(0, {tests!r})
MARKS = {marks!r}
if __name__ == "__mp_main__" and {slow_import!r}:  # a worker importing this script: its imports take long
    open(os.path.join(MARKS, "importing-%d" % os.getpid()), "w").close()
    time.sleep(60)

from lightning_rollout import MultiEnvLoop
from process_helpers import worker_pids, zero_policy
from worker_helpers import SlowBuildEnv, factories

signalled = []


def on_sigint(signum, frame):
    signalled.append(time.monotonic())
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGINT, on_sigint)
    try:  # env 0 is built here, envs 1 and 2 in worker processes 1 and 2
        MultiEnvLoop(factories(SlowBuildEnv, 3, marks=MARKS), zero_policy, num_workers=3, envs_per_thread=1)
    except KeyboardInterrupt:
        took = time.monotonic() - signalled[0]
        children = sorted(worker_pids())
        print("interrupted after %.3f s, children %s" % (took, children), flush=True)
"""


def _ctrl_c_while(stage: str, tmp_path: Path) -> tuple[float, str, str]:
    """Start the script, wait until both worker processes reached ``stage`` (each leaves a file; while they
    build, this process builds env 0 too), send SIGINT to the script's process group (a Ctrl-C) and return
    how long the script took from the signal to its ``except KeyboardInterrupt``, its stdout and its stderr."""
    marks = tmp_path / "marks"
    marks.mkdir()
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(_CTRL_C_SCRIPT).format(tests=str(TESTS), marks=str(marks),
                                                             slow_import=stage == "importing"))
    environ = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=environ, start_new_session=True)
    try:
        deadline = time.monotonic() + 120.0
        expected = 3 if stage == "building" else 2  # env 0 is built here
        while len([m for m in os.listdir(marks) if m.startswith(stage)]) < expected:  # bounded wait for the workers
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0 and "interrupted after" in out, (out, err)
    assert out.strip().endswith("children []"), out
    return float(out.split("interrupted after ")[1].split()[0]), out, err


def test_ctrl_c_while_worker_processes_build_their_envs_ends_the_construction_within_a_second(tmp_path):
    took, _, err = _ctrl_c_while("building", tmp_path)
    assert took < 1.0, f"{took:.2f} s from Ctrl-C to the KeyboardInterrupt\n{err}"


def test_ctrl_c_while_worker_processes_import_prints_no_traceback_of_theirs(tmp_path):
    """SIGINT is blocked in a worker process from its start, before its first import: a Ctrl-C of the
    process group is the main process's alone, which ends the workers."""
    took, _, err = _ctrl_c_while("importing", tmp_path)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert took < 1.0, f"{took:.2f} s from Ctrl-C to the KeyboardInterrupt\n{err}"


# -- a clean exit ----------------------------------------------------------------------------------------
_EXIT_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from lightning_rollout import EnvError, MultiEnvLoop
from process_helpers import count_envs, zero_policy

if __name__ == "__main__":
    with MultiEnvLoop(count_envs(4), zero_policy, num_workers=2, envs_per_thread=2) as loop:
        print(tuple(loop.run_env_steps(3).shape), flush=True)
    try:
        MultiEnvLoop(count_envs(4, fail_reset={{3: 0}}), zero_policy, num_workers=2, envs_per_thread=2)
    except EnvError as exc:
        print("refused:", exc, flush=True)
"""


@pytest.fixture(scope="module")
def exit_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """A script that runs a loop with a worker process, then has a worker fail its construction, and
    exits; with a temp folder of its own."""
    tmp_path = tmp_path_factory.mktemp("exit")
    temp = tmp_path / "tmp"
    temp.mkdir()
    return _run_script(tmp_path, _EXIT_SCRIPT.format(tests=str(TESTS)), TMPDIR=str(temp)), temp


def test_worker_processes_leave_no_temp_folder(exit_run):
    run, temp = exit_run
    assert run.returncode == 0 and "(4, 3)" in run.stdout, run.stderr
    assert not [p.name for p in temp.iterdir() if p.name.startswith("pymp-")], run.stderr


def test_a_failed_worker_prints_no_abandoned_thread_line_at_exit(exit_run):
    run, _ = exit_run
    assert run.returncode == 0 and "refused: env 3 failed in reset at step 0" in run.stdout, run.stderr
    assert "abandoned" not in run.stderr, run.stderr
