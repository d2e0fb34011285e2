"""KeelDB: an embedded, memory-resident, durable transactional key-value store and property graph.

    import keeldb
    db = keeldb.open("./store")                  # durability="sync" by default
    with db.write() as tx:                       # commits on normal exit, rolls back on exception
        a = tx.add_node("task", {"title": "design", "status": "todo"})
        b = tx.add_node("task", {"title": "build", "status": "todo"})
        tx.add_edge(b, a, "depends_on")
        tx.put("meta", b"owner", b"ada")
    with db.read() as rx:                        # a snapshot; never blocks writers
        print(rx.neighbors(b, direction="out", type="depends_on"))
        for key, value in rx.scan("meta", prefix=b"o"):
            print(key, value)

See docs/GUARANTEES.md for what each durability mode promises.
"""

from __future__ import annotations

from ._errors import (
    ClosedError,
    ConflictError,
    CorruptionError,
    CpuBudgetError,
    Error,
    InvalidArgumentError,
    IoError,
    LimitError,
    LockedError,
    NotAStoreError,
    NotFoundError,
    PoisonedError,
    TransactionDoneError,
    TxnTimeoutError,
    UnsupportedVersionError,
)
from ._keeldb import (
    FORMAT_VERSION,
    Database,
    Edge,
    Node,
    ReadTransaction,
    VerifyReport,
    WriteTransaction,
    __version__,
    open,
    verify,
)

__all__ = [
    "FORMAT_VERSION",
    "ClosedError",
    "ConflictError",
    "CorruptionError",
    "CpuBudgetError",
    "Database",
    "Edge",
    "Error",
    "InvalidArgumentError",
    "IoError",
    "LimitError",
    "LockedError",
    "Node",
    "NotAStoreError",
    "NotFoundError",
    "PoisonedError",
    "ReadTransaction",
    "TransactionDoneError",
    "TxnTimeoutError",
    "UnsupportedVersionError",
    "VerifyReport",
    "WriteTransaction",
    "__version__",
    "open",
    "verify",
]
