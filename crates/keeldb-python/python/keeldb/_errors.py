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
    "ClusterError",
    "Unavailable",
    "Timeout",
    "Compacted",
    "FutureRevision",
    "InvalidRequest",
    "LeaseNotFound",
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
    """The database (or the cluster client) was closed."""


class TransactionDoneError(Error):
    """The transaction was already committed or rolled back."""


class CpuBudgetError(Error):
    """The transaction used more CPU time than its budget and was rolled back."""


class TxnTimeoutError(Error, TimeoutError):
    """The transaction ran longer than its timeout and was rolled back."""


class IoError(Error, OSError):
    """An I/O error from the file system."""


# Errors of the cluster client (keeldb.connect), mapped from gRPC status codes and etcd's messages.


class ClusterError(Error):
    """A request to an etcd v3 API cluster (``keel serve`` or etcd) failed."""


class Unavailable(ClusterError, ConnectionError):
    """No endpoint could serve the request within the timeout (down, unreachable, no leader).

    Raised only when the request certainly was not applied, so it is safe to retry.
    """


class Timeout(ClusterError, TimeoutError):
    """No answer in time, or the connection broke: the outcome is unknown.

    A write may or may not have been applied; read the key (or compare revisions) before
    repeating it. The client never retries such a write by itself.
    """


class Compacted(ClusterError):
    """The requested revision has been compacted away."""


class LeaseNotFound(ClusterError, LookupError):
    """The lease does not exist: it was never granted, expired, or was revoked."""


class FutureRevision(ClusterError):
    """The requested revision is newer than the store's current revision."""


class InvalidRequest(ClusterError, ValueError):
    """The server refused the request as invalid (duplicate key in a txn, request too large,
    empty key, ...); nothing was applied."""
