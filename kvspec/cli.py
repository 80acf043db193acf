"""The ``kvspec`` command line: discovers the subcommands in ``kvspec.commands`` (modules whose
name starts with ``_`` are helpers of several subcommands, not subcommands).

Exit codes, the same for every command: 0 clean, 1 a finding or violation (or a failed
check), 2 bad input or usage (one line on stderr, never a traceback), 3 an internal error
of kvspec (one line; ``KVSPEC_TRACEBACK=1`` prints the traceback), 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import traceback

import kvspec.commands
from kvspec.contract.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, KVSpecError

EXIT_CODES = ("exit codes: 0 clean, 1 finding or violation, 2 bad input or usage, 3 internal error, "
              "130 interrupted")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvspec",
        description="Reference model, implementation, fuzzer and proofs for KV-cache offload bookkeeping.",
        epilog=EXIT_CODES,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(kvspec.commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"kvspec.commands.{info.name}")
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        if p.epilog is None:
            p.epilog = EXIT_CODES
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args._run(args))
        sys.stdout.flush()
        return code
    except KVSpecError as exc:
        print(f"kvspec {args.command}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"kvspec {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader went away (``kvspec prove --list | head -1``): not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception as exc:
        print(f"kvspec {args.command}: internal error: {type(exc).__name__}: {str(exc)[:300]} "
              "(a bug in kvspec; set KVSPEC_TRACEBACK=1 for the traceback)", file=sys.stderr)
        if os.environ.get("KVSPEC_TRACEBACK"):
            traceback.print_exc()
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
