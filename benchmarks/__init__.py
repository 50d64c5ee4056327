"""Benchmarks of ``lightning_rollout`` against its peers.

``python -m benchmarks [--quick] [--scenario NAME ...] [--out DIR] [--repeats K]``
runs every contender of each scenario in one run and writes ``results.json``,
``table.md`` and ``plot.png`` into ``--out``. Modules: :mod:`.envs` (synthetic
envs), :mod:`.contenders` (one function per contender), :mod:`.scenarios`
(workloads and targets), :mod:`.harness` (timing), :mod:`.report` (outputs).
"""

from .cli import main, run_scenario

__all__ = ["main", "run_scenario"]
