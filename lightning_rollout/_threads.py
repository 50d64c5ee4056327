"""How many intra-op threads torch may use in each thread of a collection, whatever the user's torch settings.

Each thread running a parallel op has an OpenMP team of its own, and ``torch.set_num_threads`` is process-wide:
the loop sets the count around each policy call, so the policy's team and the envs stepped meanwhile fit the cores.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

__all__ = ["torch_threads", "torch_threads_set"]


def torch_threads(*, runs_policy: bool, busy: int = 0, requested: int | None = None, cores: int | None = None) -> int:
    """Intra-op torch threads for one thread (or worker process) of a collection: 1 for one that only steps envs
    (``runs_policy=False``: a team would spin on the cores the other env-stepping threads need); else
    ``requested`` (default: this thread's count), capped at the ``cores`` (default: the CPU affinity's) left by the
    ``busy`` threads or processes that may step envs during a forward pass, at least 1."""
    if not runs_policy:
        return 1
    requested = torch.get_num_threads() if requested is None else requested
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(requested, cores - busy))


@contextlib.contextmanager
def torch_threads_set(threads: int) -> Iterator[None]:
    """``torch.set_num_threads(threads)`` in this thread inside the block, the previous count restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
