"""The ``preble`` command: ``serve`` a model repository in tritonserver, write one with
``repo``, or run the engine alone on the command line with ``demo``."""

# The subcommands are in commands.py, their options in options.py.

from __future__ import annotations

import importlib
import sys

from preble_backend.cli.options import build_parser

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    """Parse and run one command. A value the command itself refuses (a model directory
    without config.json, engines that would share cores, ...) is one line naming it, as
    argparse reports a malformed option, not a traceback."""
    parser = build_parser(__doc__)
    args = parser.parse_args(argv)
    module, _, name = args.func.partition(".")
    func = getattr(importlib.import_module(f"preble_backend.cli.{module}"), name)
    from preble_backend.runtime.launcher import LaunchError

    try:
        return func(args)
    except (ValueError, LaunchError, FileNotFoundError) as exc:
        print(f"preble {args.command}: error: {exc}", file=sys.stderr)
        return 2
