"""The ``kvspec`` command line: discovers the subcommands in ``kvspec.commands`` (modules whose
name starts with ``_`` are helpers of several subcommands, not subcommands).

Exit codes, the same for every command: 0 clean, 1 a finding or violation (or a failed
check), 2 bad input or usage (one line on stderr, never a traceback), or an I/O error of the
user's environment (output that cannot be written: a full disk, ``> /dev/full``, an unwritable
directory), 3 an internal error of kvspec (one line; ``KVSPEC_TRACEBACK=1`` prints the
traceback), 130 interrupted.

A reader that goes away (``kvspec replay T --explain | head -1``) does not change the verdict:
the rest of the output is dropped and the command ends with the code its verdict gives.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import pkgutil
import sys
import traceback
from typing import Any, TextIO, cast

import kvspec.commands
from kvspec.contract.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    KVSpecError,
    echo,
    exit_codes,
)

EXIT_CODES = exit_codes("clean", "finding or violation")

# errno values that say the user's environment cannot take kvspec's output or files (exit 2, not 3)
ENVIRONMENT_ERRNOS = frozenset(
    getattr(errno, name) for name in ("ENOSPC", "EDQUOT", "EFBIG", "EIO", "EROFS", "EACCES", "EPERM", "ENXIO",
                                      "EMFILE", "ENFILE", "ENAMETOOLONG")
    if hasattr(errno, name))


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


class GuardedOutput:
    """``sys.stdout`` while a command runs: a reader that went away (EPIPE) silences the rest of
    the output instead of ending the command, so the verdict's exit code survives ``| head``;
    any other write error (ENOSPC on ``> /dev/full``) silences it too and is raised once, for
    ``main`` to report as an error of the environment. Everything else is the stream's."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.reader_gone = False
        self.failed = False

    def _silence(self) -> None:
        """Point file descriptor 1 at /dev/null so that no later flush (the interpreter's at exit
        included) fails again."""
        try:
            fd = self.stream.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # a stream without a descriptor (a test's)
            pass

    def _guard(self, write: Any, *args: Any) -> Any:
        if self.reader_gone or self.failed:
            return None
        try:
            return write(*args)
        except BrokenPipeError:
            self.reader_gone = True
            self._silence()
            return None
        except OSError:
            self.failed = True
            self._silence()
            raise

    def write(self, text: str) -> int:
        self._guard(self.stream.write, text)
        return len(text)

    def flush(self) -> None:
        self._guard(self.stream.flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def environment_error(exc: OSError) -> bool:
    """Whether ``exc`` is an I/O error of the user's environment (a full disk, a closed or
    unwritable output, a path that is not there) rather than a bug of kvspec."""
    return exc.errno in ENVIRONMENT_ERRNOS


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    real = sys.stdout
    out = GuardedOutput(real) if real is not None else None
    if out is not None:
        sys.stdout = cast(TextIO, out)
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
    except OSError as exc:
        if not environment_error(exc) and not (out is not None and out.failed):
            return _internal(args.command, exc)
        what = "cannot write the output" if out is not None and out.failed else "I/O error"
        where = f" ({echo(exc.filename)})" if exc.filename is not None else ""
        print(f"kvspec {args.command}: {what}{where}: {exc.strerror or exc} "
              "(an error of the environment, not of kvspec)", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:
        return _internal(args.command, exc)
    finally:
        if out is not None:
            sys.stdout = real


def _internal(command: str, exc: Exception) -> int:
    print(f"kvspec {command}: internal error: {type(exc).__name__}: {str(exc)[:300]} "
          "(a bug in kvspec; set KVSPEC_TRACEBACK=1 for the traceback)", file=sys.stderr)
    if os.environ.get("KVSPEC_TRACEBACK"):
        traceback.print_exc()
    return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
