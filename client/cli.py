"""``tandem`` command line.

Each subcommand is a module of ``tandem.client`` with an
``add_parser(subparsers)`` function that adds its parser and sets ``func``
(called with the parsed args; returns the exit code). To add one, list it in
:data:`SUBCOMMANDS`. Only the module of the command being run is imported
(``--help`` imports them all), so a heavy import in one command does not slow
the others down.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command name -> module of tandem.client, in --help order
SUBCOMMANDS = {
    "serve": "serve.cli",
    "generate": "generate",
    "make-demo-checkpoint": "demo_checkpoint",
    "bench": "bench.registry",
    "perf": "bench.perf_analyzer",
    "train": "train.cli",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every subcommand, or only ``command``'s when it is a known one."""
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Tandem: LLM serving on Triton with disaggregated prefill/decode and speculative decoding.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    names = [command] if command in SUBCOMMANDS else list(SUBCOMMANDS)
    for name in names:
        importlib.import_module(f"tandem.client.{SUBCOMMANDS[name]}").add_parser(subparsers)
    return parser


# what a user causes (a wrong path, a bad value): a one-line message, not a traceback;
# TANDEM_DEBUG=1 shows the traceback anyway
USER_ERRORS = (FileNotFoundError, NotADirectoryError, PermissionError, ValueError)


def main(argv: list[str] | None = None) -> int:
    import os
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as exc:
        if os.environ.get("TANDEM_DEBUG"):
            raise
        print(f"tandem {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
