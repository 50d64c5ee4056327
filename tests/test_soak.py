"""A short soak: memory stays flat over a (short) long run.

Runs :func:`benchmarks.soak.run_soak` in-process for 60k frames with 16 envs, RSS
sampled every 10k frames. The full soak (2 million frames, target < 5 % growth after
warm-up) is ``python -m benchmarks.soak --frames 2000000 --envs 16``; here the bound
is a generous 50 % so the test does not depend on the machine or on what the test
process allocated before, while still catching a per-frame leak (a copy of every
batch kept alive would grow RSS by hundreds of MiB over 60k frames).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from reliability_helpers import assert_no_rollout_threads, bounded

pytestmark = pytest.mark.timeout(600)


def _soak_module():
    try:
        from benchmarks import soak
        return soak
    except ImportError:  # benchmarks/ not importable as a package: load the file
        path = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"
        spec = importlib.util.spec_from_file_location("_lr_soak", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module


def test_short_soak_memory_is_flat():
    soak = _soak_module()
    report = bounded(lambda: soak.run_soak(frames=60_000, envs=16, every=10_000, verbose=False), 540.0, "soak")
    print("\n" + soak.format_table(report))
    assert report["frames"] >= 60_000
    assert len(report["samples"]) >= 7
    assert report["rss_growth_pct"] < 50.0, soak.format_table(report)
    assert_no_rollout_threads()
