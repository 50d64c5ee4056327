"""Env loops: the seed's request-driven runner, threaded, with worker processes when envs hold the GIL.

The files show the architecture:

* :mod:`~lightning_rollout.loop.driver`: :class:`MultiEnvLoop` / :class:`EnvLoop`, the
  driver. Requests (a step, a quota of steps, a reset, an episode), batch assembly in
  TorchRL's layouts, trajectory ids, events, errors and shutdown.
* :mod:`~lightning_rollout.loop.worker`: the env-side loop run by an env thread, one per
  block of ``envs_per_thread`` envs: policy requests, env steps, ``step_mdp``.
* :mod:`~lightning_rollout.loop.process`: worker processes hosting env blocks, with
  shared-memory buffers, for envs whose step holds the GIL (``num_workers > 1``).
* :mod:`~lightning_rollout.loop.buffers`: the column layout of a transition.
* :mod:`~lightning_rollout.loop.auto`: the ``"auto"`` choice of ``num_workers`` and
  ``envs_per_thread`` from a few timed steps of one env.
"""

from .driver import EnvLoop, MultiEnvLoop

__all__ = ["EnvLoop", "MultiEnvLoop"]
