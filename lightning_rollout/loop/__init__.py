"""Env loops: one stepping loop over an async vector env (envpool's ``send`` / ``recv`` shape).

``driver``: :class:`MultiEnvLoop` / :class:`EnvLoop`, the public calls; ``stepper``: the stepping loop and its
stop rules; ``executors`` / ``processes``: where the envs run (stepping thread, pool threads, worker processes);
``storage``: columns, ring, recycled batches; ``delivery``: batches, trajectory ids, events; ``auto``: the
``"auto"`` layout from a few timed steps of one env.
"""

from .driver import EnvLoop, MultiEnvLoop

__all__ = ["EnvLoop", "MultiEnvLoop"]
