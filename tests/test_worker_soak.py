"""Create / iterate / shut down a collector with worker processes, over and over: nothing accumulates.

A subprocess with the cyclic garbage collector disabled (``gc.disable()``) runs the cycles, so whatever
``shutdown()`` does not release at once stays, and samples after each cycle what it holds: open file
descriptors, ``/dev/shm`` entries named after it, child processes, threads and ``multiprocessing`` temp
folders (``pymp-*``, in a temp dir of its own). The memory soak (RSS over a long run) is
``tests/test_soak.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and /dev/shm")

_SOAK_SCRIPT = """
import gc, json, os, sys, threading

gc.disable()  # what shutdown() leaves to the garbage collector stays

sys.path.insert(0, {tests!r})
from lightning_rollout import ThreadedCollector
from lightning_rollout.envs import GymMaker
from process_helpers import worker_pids


def sample():
    children = worker_pids()
    return {{"fds": len(os.listdir("/proc/self/fd")),
             "shm": len([n for n in os.listdir("/dev/shm") if "_%d_" % os.getpid() in n]),
             "processes": len(children),
             "threads": threading.active_count(),
             "rollout_threads": len([t for t in threading.enumerate() if t.name.startswith("lightning_rollout-")]),
             "temp_folders": len([n for n in os.listdir(os.environ["TMPDIR"]) if n.startswith("pymp-")])}}


if __name__ == "__main__":
    samples = [sample()]
    for cycle in range({cycles}):
        collector = ThreadedCollector(GymMaker("CartPole-v1"), None, frames_per_batch=8, total_frames=16,
                                      num_envs=2, num_workers=2, envs_per_thread=1, name="soak")
        frames = sum(batch.numel() for batch in collector)
        collector.shutdown()
        assert frames == 16, frames
        samples.append(sample())
    print(json.dumps(samples), flush=True)
"""


def _soak(tmp_path: Path, cycles: int) -> tuple[list[dict[str, int]], list[str]]:
    """Run ``cycles`` cycles (one worker process each: the collector's one env thread steps env 0 here and
    env 1 in the worker); the samples before the first cycle and after each, and the temp folders left
    once the process exited."""
    # short: multiprocessing's fd-sharing socket lives in TMPDIR, and an AF_UNIX path has at most 107 bytes
    temp = Path(tempfile.mkdtemp(prefix="soak-"))
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TMPDIR=str(temp), PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = tmp_path / "soak.py"
    script.write_text(textwrap.dedent(_SOAK_SCRIPT).format(cycles=cycles, tests=str(root / "tests")))
    try:
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=root, env=env,
                             timeout=60 * cycles)
        left = [p.name for p in temp.glob("pymp-*")]
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert run.returncode == 0, run.stderr
    samples = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(samples) == cycles + 1
    return samples, left


def _assert_flat(samples: list[dict[str, int]], left: list[str]) -> None:
    start, after = samples[0], samples[1:]
    first = after[0]  # the first cycle makes what a process makes once (multiprocessing's fd-sharing listener)
    for i, s in enumerate(after, 1):
        assert s["fds"] <= start["fds"] + 8, f"cycle {i}: {s['fds']} fds open, {start['fds']} at the start: {samples}"
        assert s["fds"] <= first["fds"], f"cycle {i}: {s['fds']} fds open, {first['fds']} after the first: {samples}"
        assert s["processes"] == 0, f"cycle {i}: {s['processes']} child processes left running"
        assert s["shm"] == 0, f"cycle {i}: {s['shm']} /dev/shm entries left"
        assert s["rollout_threads"] == 0, f"cycle {i}: {s['rollout_threads']} lightning_rollout threads left"
        assert s["threads"] == first["threads"], f"cycle {i}: {s['threads']} threads, {first['threads']} after the first"
        assert s["temp_folders"] == first["temp_folders"] <= 1, f"cycle {i}: {s['temp_folders']} pymp-* folders"
    assert first["threads"] <= start["threads"] + 1, samples  # + multiprocessing's fd-sharing listener thread
    assert not left, f"temp folders left after the process exited: {left}"


@pytest.mark.timeout(1800)
def test_eight_create_iterate_shutdown_cycles_with_a_worker_process_release_everything_at_once(tmp_path):
    # every cycle after the first holds what the first held: a leak of one fd a cycle shows at the second
    _assert_flat(*_soak(tmp_path, 8))


@pytest.mark.slow
@pytest.mark.timeout(18000)
def test_three_hundred_create_iterate_shutdown_cycles_with_a_worker_process_release_everything_at_once(tmp_path):
    _assert_flat(*_soak(tmp_path, 300))
