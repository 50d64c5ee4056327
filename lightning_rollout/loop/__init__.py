"""Env loops: the seed's request-driven runner, threaded, with worker processes when envs hold the GIL.

The files show the architecture (one data path: :mod:`~lightning_rollout.loop.worker` says how):

* :mod:`~lightning_rollout.loop.driver`: :class:`MultiEnvLoop` / :class:`EnvLoop`, the
  driver. Grants of steps, resets and episodes; batches copied out of the workers' storage in
  TorchRL's layouts; trajectory ids, events, errors and shutdown.
* :mod:`~lightning_rollout.loop.worker`: the env-side loop run by an env thread, one per
  block of ``envs_per_thread`` envs: the one step driver, settling.
* :mod:`~lightning_rollout.loop.buffers`: the column layout of a transition, each env thread's
  time-major storage, recycled batches.
* :mod:`~lightning_rollout.loop.block`: the block protocol (``begin`` / ``ended`` / ``finish``) and
  the in-process block (gymnasium and TorchRL envs, in this thread or in helper threads).
* :mod:`~lightning_rollout.loop.native`: a natively batched env (VMAS, envpool) as a block.
* :mod:`~lightning_rollout.loop.process`: worker processes hosting env blocks, with
  shared-memory buffers, for envs whose step holds the GIL (``num_workers > 1``).
* :mod:`~lightning_rollout.loop.messages`: the typed messages between the driver and its
  env threads, and between an env thread and a worker process.
* :mod:`~lightning_rollout.loop.auto`: the ``"auto"`` choice of ``num_workers`` and
  ``envs_per_thread`` from a few timed steps of one env.
"""

from .driver import EnvLoop, MultiEnvLoop

__all__ = ["EnvLoop", "MultiEnvLoop"]
