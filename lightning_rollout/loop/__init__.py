"""Env loops: one stepping loop over an async vector env (envpool's ``send`` / ``recv`` shape).

* :mod:`~lightning_rollout.loop.driver`: :class:`MultiEnvLoop` / :class:`EnvLoop`, the public calls.
* :mod:`~lightning_rollout.loop.stepper`: the one stepping loop and its stop rules.
* :mod:`~lightning_rollout.loop.executors`: where the envs run (the stepping thread, pool threads);
  :mod:`~lightning_rollout.loop.processes`: worker processes.
* :mod:`~lightning_rollout.loop.storage`: the columns, the ring of recent steps, recycled batches;
  :mod:`~lightning_rollout.loop.delivery`: batches, trajectory ids and events.
* :mod:`~lightning_rollout.loop.auto`: the ``"auto"`` layout from a few timed steps of one env.
"""

from .driver import EnvLoop, MultiEnvLoop

__all__ = ["EnvLoop", "MultiEnvLoop"]
