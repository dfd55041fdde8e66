"""`swallow`'s command line: every sub-command, from the package that owns it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from api.cli import add_serving_commands
from api.cli import main as run_command
from bench.registry import add_bench_command
from demo.cli import add_demo_commands

if TYPE_CHECKING:
    from api.routes import RouteSet, ServerContext


def demo_routes(context: ServerContext) -> RouteSet:
    """The demo's routes, imported by the server that mounts them: every other
    command (a worker, an encoder, a bench) starts without the HTTP side's
    imports (media decoding, torchvision)."""
    from demo.routes import DemoRoutes

    return DemoRoutes(context)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swallow", description="Hybrid-SWA MoE serving")
    commands = parser.add_subparsers(dest="command", required=True)
    add_serving_commands(commands, route_sets=(demo_routes,))
    add_demo_commands(commands)
    add_bench_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(argv, build_parser())


if __name__ == "__main__":
    sys.exit(main())
