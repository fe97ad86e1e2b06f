"""Where tables live, and by what name: the one place that decides.

`Table(...)` (the public constructor) comes here: a table with
`device="gpu"` is a `GpuTable` in this process; otherwise, once
`init(ps=[...])` has connected this process to parameter servers (or the
`ELASTIC_EMB_PS` variable names them), a `RemoteTable` on those shards;
otherwise a `LocalTable`. Tables created before `init` stay where they are.

Names: the tables created here are registered by name for `ee.save` and
`ee.restore` (which match tables by name). A new table with the name of a
live one takes the name over: re-running the code that builds a model (a
notebook cell, `clone_model`, `from_config`) gives tables with the same
names, so checkpoints keep matching. The older table keeps working, but is
no longer saved or restored by `ee.save()` / `ee.restore()` without
`tables=`. A table kept alive only by the registry is dropped with it.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

from elastic_emb import table as table_module
from elastic_emb.table import Table, TableConfig
from elastic_emb.tiered import make_local_table

if TYPE_CHECKING:
    from elastic_emb.ps.cluster import Cluster

__all__ = [
    "ENV_COORDINATOR",
    "ENV_PS",
    "create_table",
    "current_cluster",
    "init",
    "registered_tables",
    "shutdown",
    "unregister",
]

ENV_PS = "ELASTIC_EMB_PS"
ENV_COORDINATOR = "ELASTIC_EMB_COORDINATOR"

_lock = threading.RLock()  # guards every global below (init runs under it)
_tables: weakref.WeakValueDictionary[str, Table] = weakref.WeakValueDictionary()
_cluster: Cluster | None = None
# Where models' dense weights train (ee.init's `dense`, resolved): "local" or "ps";
# and whether the caller asked for it (else: the default of the mode).
_dense, _dense_explicit = "local", False
_dense_pull_every = 1  # ee.init's `dense_pull_every`
_env_checked = False  # ELASTIC_EMB_PS was read (once, at the first table or init)


def create_table(
    dim: int,
    optimizer: Any = None,
    initializer: Any = "uniform",
    name: str = "table",
    seed: int | None = None,
    device: str = "cpu",
    nonfinite: str = "raise",
    admission: Any = None,
    eviction: Any = None,
    row_dtype: str = "float32",
    storage: Any = None,
) -> Table:
    """`Table(...)`: a new table, placed and registered (arguments as `Table`)."""
    config = TableConfig.make(
        dim, optimizer, initializer, name, seed, nonfinite, admission, eviction, row_dtype, storage
    )
    if device == "gpu":
        from elastic_emb.gpu import GpuTable

        table: Table = GpuTable(config)
    elif device == "cpu":
        cluster = current_cluster()
        if cluster is None:
            table = make_local_table(config)
        else:
            from elastic_emb.ps.remote_table import RemoteTable

            table = RemoteTable(config, cluster)
    else:
        raise ValueError(f'`device` must be "cpu" or "gpu". Received: device={device!r}')
    with _lock:
        _tables[table.name] = table
    return table


def registered_tables() -> dict[str, Table]:
    """The live tables of this process, by name."""
    with _lock:
        return dict(_tables.items())


def unregister(table: Table) -> None:
    """Removes `table` from the registry (its name becomes free)."""
    with _lock:
        if _tables.get(table.name) is table:
            del _tables[table.name]


def init(
    ps: list[str] | str | None = None,
    mode: str = "async",
    staleness: int | None = None,
    wire_dtype: str = "float32",
    worker_index: int | None = None,
    num_workers: int | None = None,
    timeout: float = 300.0,
    connect_timeout: float = 30.0,
    coordinator: str | None = None,
    failover_timeout: float = 60.0,
    read_from_backups: bool = False,
    cache_rows: int = 0,
    cache_staleness: int = 0,
    tls_ca: str | os.PathLike[str] | None = None,
    tls_cert: str | os.PathLike[str] | None = None,
    tls_key: str | os.PathLike[str] | None = None,
    token: str | None = None,
    dense: str | None = None,
    dense_pull_every: int = 1,
) -> Cluster | None:
    """Points this process at parameter servers; tables created after are remote.

    Tables created before stay in-process.

    Example:
        >>> ee.init(ps=["127.0.0.1:5000", "127.0.0.1:5001"], mode="sync")
        >>> layer = ee.Embedding(16, name="user")   # its table lives on both shards
        >>> ee.init(coordinator="etcd://127.0.0.1:2379", mode="sync")  # replicated cluster

    Args:
        ps: list of "host:port" (or one comma-separated string). None reads
            `ELASTIC_EMB_PS`; with neither, tables stay in-process (returns None).
        mode: "async" (each push applied on arrival) or "sync" (the pushes
            of all workers for a step are summed and applied once; the next
            pull waits for that step).
        staleness: async only: a worker starting step t waits until every
            worker has pushed step t - 1 - staleness. None: unbounded.
        wire_dtype: "float32", "float16" or "bfloat16": encoding of pulled
            rows and pushed gradients (the PS optimizer runs in float32).
        worker_index, num_workers: this worker's place; default from
            `TF_CONFIG` (task index, number of "worker"/"chief" tasks), else 0 of 1.
            With a coordinator, workers are elastic: any index >= 0 joins
            (and leaves when its process ends; docs/fault-tolerance.md), and
            without an index or `TF_CONFIG` a worker takes the lowest index no
            live worker holds (`cluster.worker_index`), so identical worker
            processes (a Kubernetes Deployment) need no configuration.
        timeout: seconds a call may wait for other workers (sync, bounded
            staleness) before failing with `TimeoutError`.
        connect_timeout: seconds to wait for each PS to answer at start.
        coordinator: "etcd://host:port" of a replicated cluster's etcd
            (servers started with `elastic-emb serve --coordinator`), instead
            of `ps`. None reads `ELASTIC_EMB_COORDINATOR`. The groups'
            primaries are found there; after a primary fails, calls follow
            the new one (see docs/fault-tolerance.md).
        cache_rows: rows of remote tables this worker keeps, the ones it
            pulls most often (0, the default: no cache). Pushes still go to
            the shards. See `elastic_emb.ps.row_cache` and docs/storage.md.
        cache_staleness: steps a cached row may be served without asking
            its shard. 0 (default): every pull asks, sending the versions of
            the cached rows, and the shard sends only rows that changed; the
            rows are exactly those without a cache, in fewer bytes. Above 0
            (not with mode="sync"): a row fetched or confirmed at most that
            many steps ago is served as is; it may lack the updates of the
            last `cache_staleness` steps (the worker's own included).
        tls_ca: PEM file of the CA that signed the servers' certificates:
            connect over TLS (servers started with `--tls-cert`). None:
            plaintext.
        tls_cert, tls_key: with `tls_ca`, this worker's certificate and key
            (PEM files), for servers that require client certificates
            (`--tls-client-ca`: mutual TLS).
        token: sent with every call (`authorization: Bearer TOKEN`), for
            servers started with `--auth-tokens` (docs/operations.md).
        failover_timeout: with a coordinator, seconds a call keeps waiting
            for a group's new primary before raising `ConnectionError`.
        read_from_backups: with a coordinator, pulls with `train=False`
            (evaluation, prediction) go to the primary and the backups of
            each group in turn, spreading the reads. A backup has applied
            every acknowledged push (sync: every step a pull may read); in
            async mode a read may miss pushes still in flight, as it may on
            the primary. Falls back to the primary if the backup fails.
        dense: where the dense (non-embedding) weights of models compiled
            after train. "local": in the worker, as Keras does (under
            MultiWorkerMirroredStrategy with several workers). "ps" (async
            mode): in one more table on the PS, pulled at each step and
            updated there with the optimizer given to `model.compile`; each
            worker runs plain `model.fit`, without all-reduce
            (`elastic_emb.dense_ps`, docs/distributed.md). None (default):
            "ps" with a coordinator in async mode, for models compiled
            without a multi-replica `tf.distribute` strategy (elastic workers
            come and go, which an all-reduce cannot survive); else "local".
        dense_pull_every: with dense weights on the PS, a training step pulls
            them only every this many steps (a named staleness): the steps
            between compute with the weights last pulled, older by up to
            `dense_pull_every - 1` steps of this worker (and whatever the
            others pushed meanwhile); every gradient is still pushed and
            applied on the PS. 1 (default): every step, exact.

    Returns:
        The `Cluster`, or None when no PS is configured.

    Raises:
        ValueError: invalid arguments, or already connected.
        ConnectionError: a PS did not answer within `connect_timeout`.
    """
    global _cluster, _dense, _dense_explicit, _dense_pull_every, _env_checked
    if isinstance(dense_pull_every, bool) or not isinstance(dense_pull_every, int):
        raise ValueError(
            f"`dense_pull_every` must be a positive integer. Received: {dense_pull_every!r}"
        )
    if dense_pull_every < 1 or (dense_pull_every > 1 and dense == "local"):
        raise ValueError(
            "`dense_pull_every` must be a positive integer, and > 1 only with the dense "
            f"weights on the PS. Received: dense_pull_every={dense_pull_every}, dense={dense!r}"
        )
    if dense not in (None, "local", "ps"):
        raise ValueError(f"`dense` must be 'local', 'ps' or None. Received: dense={dense!r}")
    if dense == "ps" and mode != "async":
        raise ValueError(
            "dense='ps' trains dense weights asynchronously on the PS; with mode='sync' they "
            "stay local (under MultiWorkerMirroredStrategy). Received: mode='sync'"
        )
    with _lock:
        _env_checked = True
        if ps is not None and coordinator is not None:
            raise ValueError("Pass `ps` or `coordinator`, not both")
        if ps is None and coordinator is None:
            ps = os.environ.get(ENV_PS) or None
            coordinator = None if ps else os.environ.get(ENV_COORDINATOR) or None
        if ps is None and coordinator is None:
            return None
        addresses = [a.strip() for a in ps.split(",")] if isinstance(ps, str) else list(ps or [])
        if _cluster is not None:
            raise ValueError(
                f"elastic_emb is already connected to {_cluster.addresses}; "
                "call ee.shutdown() first"
            )
        auto_index = (
            worker_index is None and coordinator is not None and not os.environ.get("TF_CONFIG")
        )
        if worker_index is None or num_workers is None:
            index, count = _tf_config_worker()
            worker_index = index if worker_index is None else worker_index
            num_workers = count if num_workers is None else num_workers
        if num_workers > 1:
            import keras  # noqa: F401  (first: loading Keras imports elastic_emb.layers)

            from elastic_emb.keras_patches import fix_keras_multi_worker

            fix_keras_multi_worker()
        from elastic_emb.ps.cluster import Cluster
        from elastic_emb.ps.security import ClientSecurity

        security = ClientSecurity.make(tls_ca, tls_cert, tls_key, token)

        routing = None
        if coordinator is not None:
            from elastic_emb.ps.cluster import WORKER_LEASE_SECONDS
            from elastic_emb.ps.routing import Routing

            routing = Routing(coordinator, connect_timeout)
            if auto_index:  # elastic workers without an index take the lowest free one
                try:
                    worker_index = routing.register_worker(None, WORKER_LEASE_SECONDS)
                except BaseException:
                    routing.close()
                    raise
        _dense_explicit = dense is not None
        if dense is None:
            dense = "ps" if coordinator is not None and mode == "async" else "local"
        if dense_pull_every > 1 and dense != "ps":
            raise ValueError(
                f"`dense_pull_every`={dense_pull_every} needs the dense weights on the PS; "
                f"they stay local here (mode={mode!r}, coordinator={coordinator!r}). Pass "
                "dense='ps' with mode='async'."
            )
        _dense, _dense_pull_every = dense, dense_pull_every
        try:
            _cluster = Cluster(
                addresses, mode, staleness, wire_dtype, worker_index, num_workers, timeout,
                connect_timeout, routing, failover_timeout, read_from_backups, cache_rows,
                cache_staleness, security,
            )  # fmt: skip
        except BaseException:
            if routing is not None:
                routing.close()
            raise
        return _cluster


def shutdown() -> None:
    """Sends pending pushes and disconnects; later tables are in-process.

    The remote tables of the connection can no longer be used; they leave
    the registry (so `ee.save()` no longer sees them).
    """
    global _cluster
    with _lock:
        cluster, _cluster = _cluster, None
        if cluster is not None:
            for name, table in list(_tables.items()):
                if getattr(table, "cluster", None) is cluster:
                    del _tables[name]
    if cluster is not None:
        cluster.close()


def dense_placement() -> tuple[str, bool]:
    """Where the dense weights of models compiled now train ("local" or "ps"), and
    whether `ee.init`'s caller chose it (else it is the mode's default)."""
    with _lock:
        return (_dense, _dense_explicit) if _cluster is not None else ("local", False)


def dense_pull_every() -> int:
    """Every how many training steps dense weights on the PS are pulled."""
    with _lock:
        return _dense_pull_every


def current_cluster() -> Cluster | None:
    """The cluster new tables go to (connecting from `ELASTIC_EMB_PS` once), or None."""
    with _lock:
        if not _env_checked and (os.environ.get(ENV_PS) or os.environ.get(ENV_COORDINATOR)):
            init()
        return _cluster


def _tf_config_worker() -> tuple[int, int]:
    """(worker index, number of workers) from TF_CONFIG, or (0, 1)."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return 0, 1
    try:
        config = json.loads(raw)
        cluster = config.get("cluster", {})
        task = config.get("task", {})
        chiefs = len(cluster.get("chief", []))
        workers = len(cluster.get("worker", []))
        index = int(task.get("index", 0)) + (chiefs if task.get("type") == "worker" else 0)
        return index, max(chiefs + workers, 1)
    except (ValueError, AttributeError, TypeError) as e:
        raise ValueError(f"TF_CONFIG is not valid: {e}") from e


table_module._Placed.create = create_table
