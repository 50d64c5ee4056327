"""How many intra-op threads torch may use in each thread of a collection, whatever the user's torch settings.

Each thread that runs a parallel op gets an OpenMP team of its own, whose threads spin for a while after each op;
in this torch build ``torch.set_num_threads`` is a process-wide setting. The loop sets the count of the rule below
around each policy call (:func:`torch_threads_set`), so the policy's team and the threads or processes stepping
envs meanwhile stay within the cores.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

__all__ = ["torch_threads", "torch_threads_set"]


def torch_threads(*, runs_policy: bool, busy: int = 0, requested: int | None = None, cores: int | None = None) -> int:
    """Intra-op torch threads for one thread (or worker process) of a collection.

    Args:
        runs_policy: the thread runs the policy's forward pass (between its own env steps, if any); otherwise it
            only steps envs, and gets 1 thread: its ops are one env's tensors, and a team would spin on the
            cores the other env-stepping threads need.
        busy: how many other threads or processes of the collection may step envs while this one runs a forward
            pass (0 when every forward waits for all envs, as an on-policy batch does).
        requested: the user's setting (``torch.get_num_threads()`` of the thread that built the collector, or
            TorchRL's ``num_threads``); default: this thread's.
        cores: the cores this process may use; default: its CPU affinity.

    Returns:
        1 for a thread that only steps envs; else ``requested``, capped at the cores the ``busy`` ones leave
        (at least 1).
    """
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
