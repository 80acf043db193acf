"""The one error hierarchy of kvspec.

Every public operation of the model and the implementation validates its input
before it changes anything, and raises a subclass of :class:`KVSpecError` with a
message that says what was wrong. A rejected call leaves the snapshot exactly as
it was (tests/test_errors.py proves it for every kind of bad input).
"""


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
