"""``python -m benchmarks``: see :func:`benchmarks.cli.main`."""

from .cli import main

main()
