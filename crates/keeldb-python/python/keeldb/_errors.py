"""The exception hierarchy of keeldb. Every error the engine reports is a ``keeldb.Error``.

Errors that are also a familiar built-in category inherit from it too, so ``except ValueError``
catches a value that is too large and ``except LookupError`` catches a missing node.
"""

from __future__ import annotations

__all__ = [
    "Error",
    "ConflictError",
    "CorruptionError",
    "LockedError",
    "PoisonedError",
    "LimitError",
    "InvalidArgumentError",
    "NotFoundError",
    "NotAStoreError",
    "UnsupportedVersionError",
    "ClosedError",
    "TransactionDoneError",
    "CpuBudgetError",
    "TxnTimeoutError",
    "IoError",
]


class Error(Exception):
    """Base class of every error raised by keeldb."""


class ConflictError(Error):
    """Another transaction committed a conflicting write first; retrying may succeed."""


class CorruptionError(Error):
    """Stored bytes failed a checksum or a structural check; nothing was changed."""


class LockedError(Error):
    """Another handle (in this or another process) holds the store directory."""


class PoisonedError(Error):
    """An earlier write or fsync failed; the database refuses writes until reopened."""


class LimitError(Error, ValueError):
    """A key, value, name or transaction exceeded a documented limit; nothing was written."""


class InvalidArgumentError(Error, ValueError):
    """An argument was not valid (for example an empty table name)."""


class NotFoundError(Error, LookupError):
    """A graph operation named a node or edge that does not exist."""


class NotAStoreError(Error):
    """The path exists but is not a KeelDB store."""


class UnsupportedVersionError(Error):
    """The store was written by a newer format version."""


class ClosedError(Error):
    """The database was closed."""


class TransactionDoneError(Error):
    """The transaction was already committed or rolled back."""


class CpuBudgetError(Error):
    """The transaction used more CPU time than its budget and was rolled back."""


class TxnTimeoutError(Error, TimeoutError):
    """The transaction ran longer than its timeout and was rolled back."""


class IoError(Error, OSError):
    """An I/O error from the file system."""
