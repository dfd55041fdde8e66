"""Swallow's benchmarks: each a `swallow bench NAME --json` command that
prints one JSON object and compares against a baseline in the same run.

Every bench module owns its options and its run: ``add_arguments(parser)``
and ``run(args) -> dict``; ``bench.registry`` names them.
"""

from __future__ import annotations

import sys


def log(message: str) -> None:
    """Progress for the person running a bench: stderr, so stdout stays the JSON object."""
    print(message, file=sys.stderr, flush=True)
