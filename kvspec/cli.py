"""The ``kvspec`` command line: discovers the subcommands in ``kvspec.commands``."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import kvspec.commands
from kvspec.errors import KVSpecError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvspec",
        description="Reference model, implementation, fuzzer and proofs for KV-cache offload bookkeeping.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(kvspec.commands.__path__), key=lambda m: m.name):
        mod = importlib.import_module(f"kvspec.commands.{info.name}")
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args))
    except KVSpecError as exc:
        print(f"kvspec {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvspec {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
