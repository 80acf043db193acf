"""What ``kvspec snapshot`` says and writes, for both managers: a target's crash (nothing
written) and the snapshot file."""

from __future__ import annotations

import sys
from typing import Any

from kvspec.contract.errors import EXIT_CLEAN, EXIT_FINDING, ConfigError, echo
from kvspec.contract.snapshot_io import FORMAT_VERSION, dump_snapshot


def report_crash(target: str, index: int, exc: Exception) -> int:
    """A target crashed at operation ``index``: one line, nothing written, exit 1."""
    print(f"kvspec snapshot: {target} crashed at operation {index} ({type(exc).__name__}: "
          f"{str(exc)[:200]}); nothing written", file=sys.stderr)
    return EXIT_FINDING


def write_snapshot(snapshot: dict[str, Any], out: str, what: str, applied: int, rejected: int) -> int:
    """Write ``snapshot`` (validated first) to ``out`` and say so; exit 0. ``ConfigError`` when the
    file cannot be written."""
    try:
        dump_snapshot(snapshot, out)
    except OSError as exc:
        raise ConfigError(f"--out {echo(out)}: cannot write the snapshot: {exc.strerror or exc}") from None
    print(f"{out}: snapshot of {what} after {applied} operation(s) ({rejected} rejected), "
          f"format version {FORMAT_VERSION}")
    return EXIT_CLEAN
