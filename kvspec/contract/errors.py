"""The one error hierarchy of kvspec.

Every public operation of the model and the implementation validates its input
before it changes anything, and raises a subclass of :class:`KVSpecError` with a
message that says what was wrong. A rejected call leaves the snapshot exactly as
it was (tests/test_errors.py proves it for every kind of bad input).
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvspec.contract.schema_check import FormatIssue


class KVSpecError(Exception):
    """Base class of every error kvspec raises on purpose."""


class InvalidBlockError(KVSpecError):
    """A block id out of range, or an operation the null block does not allow."""


class DoubleFreeError(KVSpecError):
    """A block freed more often than it is referenced (vLLM: a negative ref count)."""


class QueueCorruptionError(KVSpecError):
    """The free queue would hold a block twice, or a block outside it was unlinked."""


class OutOfBlocksError(KVSpecError):
    """More blocks were requested than the pool has free (vLLM: ValueError)."""


class InvalidCountError(KVSpecError):
    """A negative or oversized count (tokens, blocks, worker reports)."""


class UnknownRequestError(KVSpecError):
    """An operation named a request that the receiver does not know."""


class UnknownEventError(KVSpecError):
    """An operation named a transfer event that was never issued."""


class GroupCountError(KVSpecError):
    """Per-group data with a number of groups other than the configuration's."""


class ConfigError(KVSpecError):
    """A configuration that the modelled system would reject."""


class InvalidOperationError(KVSpecError):
    """An operation that is not allowed in the current state (e.g. finishing twice)."""


class TraceError(KVSpecError):
    """A trace file that cannot be read: carries the 1-based line number."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line


class SnapshotFormatError(KVSpecError):
    """A snapshot that does not follow the schema: names the field and why."""

    # Set by kvspec.contract.snapshot_io.validate_snapshot (not by the other raisers): every problem
    # found, and the first one's field path.
    issues: "list[FormatIssue]"
    path: str


# -- exit codes of every ``kvspec`` command ---------------------------------------------------

EXIT_CLEAN = 0  # nothing found, every check passed
EXIT_FINDING = 1  # a violation, a crash of a target, a divergence, or a failed check
EXIT_BAD_INPUT = 2  # bad input or usage: a malformed file, an unknown name, a bad option; also an
# I/O error of the user's environment (output that cannot be written: a full disk, /dev/full, a
# read-only or unwritable directory), which is no more kvspec's bug than a malformed file
EXIT_INTERNAL = 3  # kvspec itself failed (a bug in kvspec: please report it)
EXIT_INTERRUPTED = 130  # Ctrl-C: statistics so far printed, findings kept

ECHO_LIMIT = 80


def exit_codes(clean: str, finding: str, bad: str = "bad input or usage") -> str:
    """The exit-code line of a command's ``--help``: every code, in the words of that command
    for 0, 1 and 2 (the same codes for every command)."""
    return (f"exit codes: 0 {clean}, 1 {finding}, 2 {bad} or an I/O error of the environment "
            "(e.g. output to a full disk), 3 internal error of kvspec, 130 interrupted")


_SCALARS = (str, int, float, bool, type(None))


def echo(value: object, limit: int = ECHO_LIMIT) -> str:
    """A bounded rendering of an input value for an error message, safe for any input: ``repr``
    cut to at most ``limit`` characters (a 5 MB request id reads ``'rrrr…' (5000000 chars)``); an
    integer too long to print is described by its bit length; a container is rendered only when
    small (at most 8 items) and flat, else described by its type and size, so that neither a huge
    nor a deeply nested value is ever rendered whole. O(limit) for strings, O(1) for containers."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, str) and len(value) > limit:
        return f"{value[: max(1, limit - 12)]!r}… ({len(value)} chars)"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        parts = [x for kv in value.items() for x in kv] if isinstance(value, dict) and len(value) <= 8 else value
        flat = len(value) <= 8 and all(
            isinstance(x, _SCALARS) and not (isinstance(x, int) and x.bit_length() > 256) for x in parts)
        if not flat:
            return f"a {type(value).__name__} of {len(value)} item(s)"
    elif not isinstance(value, _SCALARS):
        return f"a value of type {type(value).__name__}"
    text = repr(value)
    if len(text) > limit:
        return f"{text[: max(1, limit - 12)]}… ({len(text)} chars)"
    return text
