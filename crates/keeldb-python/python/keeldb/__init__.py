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

``keeldb.connect`` is a client for etcd's v3 API: a replicated ``keel serve`` cluster, or etcd:

    with keeldb.connect(["127.0.0.1:2379", "127.0.0.1:22379"], timeout=5.0) as client:
        rev = client.put("config/mode", "fast")            # str (UTF-8) or bytes; returns the revision
        assert client.get("config/mode") == b"fast"        # bytes, or None
        kvs = client.range("config/", prefix=True)         # [KeyValue(key, value, revisions, version, lease)]
        r = client.txn(compare=[keeldb.Compare.mod_revision("config/mode", "==", rev)],
                       success=[keeldb.Op.put("config/mode", "safe")],
                       failure=[keeldb.Op.get("config/mode")])
        print(r.succeeded, r.revision, r.responses)
        client.delete("config/", prefix=True)              # number of keys deleted
        with client.lease(10) as lease:                    # kept alive in the background, revoked at the end
            client.put("service/me", "10.0.0.7", lease=lease.id)
        with client.watch("config/", prefix=True, start_revision=rev) as events:
            for event in events:                           # WatchEvent: kind, key, value, revision, prev_kv
                break
        with client.lock("jobs/nightly"):                  # etcd's lock recipe (etcdctl lock, concurrency.Mutex)
            ...

Any member serves writes (they are forwarded to the leader). Requests that certainly were not
applied are retried on the other endpoints until the timeout; failures raise
``keeldb.ClusterError`` subclasses: ``Unavailable``, ``Timeout`` (a write's outcome is unknown),
``Compacted``, ``FutureRevision``, ``InvalidRequest``, ``LeaseNotFound``.
"""

from __future__ import annotations

from ._errors import (
    ClosedError,
    ClusterError,
    Compacted,
    ConflictError,
    CorruptionError,
    CpuBudgetError,
    Error,
    FutureRevision,
    InvalidArgumentError,
    InvalidRequest,
    IoError,
    LeaseNotFound,
    LimitError,
    LockedError,
    NotAStoreError,
    NotFoundError,
    PoisonedError,
    Timeout,
    TransactionDoneError,
    TxnTimeoutError,
    Unavailable,
    UnsupportedVersionError,
)
from ._keeldb import (
    FORMAT_VERSION,
    Client,
    Compare,
    Database,
    Edge,
    KeyValue,
    Lease,
    LeaseInfo,
    Lock,
    Member,
    MemberStatus,
    Node,
    Op,
    ReadTransaction,
    TxnResult,
    VerifyReport,
    Watch,
    WatchEvent,
    WriteTransaction,
    __version__,
    connect,
    open,
    verify,
)

__all__ = [
    "FORMAT_VERSION",
    "Client",
    "ClosedError",
    "ClusterError",
    "Compacted",
    "Compare",
    "ConflictError",
    "CorruptionError",
    "CpuBudgetError",
    "Database",
    "Edge",
    "Error",
    "FutureRevision",
    "InvalidArgumentError",
    "InvalidRequest",
    "IoError",
    "KeyValue",
    "Lease",
    "LeaseInfo",
    "LeaseNotFound",
    "LimitError",
    "Lock",
    "LockedError",
    "Member",
    "MemberStatus",
    "Node",
    "NotAStoreError",
    "NotFoundError",
    "Op",
    "PoisonedError",
    "ReadTransaction",
    "Timeout",
    "TransactionDoneError",
    "TxnResult",
    "TxnTimeoutError",
    "Unavailable",
    "UnsupportedVersionError",
    "VerifyReport",
    "Watch",
    "WatchEvent",
    "WriteTransaction",
    "__version__",
    "connect",
    "open",
    "verify",
]
