"""``python -m benchmarks.e2e``: see :func:`benchmarks.e2e.cli.main`."""

from .cli import main

main()
