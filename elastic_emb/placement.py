"""`ee.init` and `ee.shutdown`: this process's connection to parameter servers.

`init` checks its options (`InitOptions`), reads the environment
(`ELASTIC_EMB_PS`, `ELASTIC_EMB_COORDINATOR`, `TF_CONFIG`), connects a
`Cluster` (TLS, a coordinator's routing) and hands the registry of tables
(`elastic_emb.tables.registry`) a `Connection`: later `Table(...)`s are
remote tables on it, and Keras models compiled later read its dense-weights
policy from there. The one module that wires the client in.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import TYPE_CHECKING, Any

from elastic_emb.tables import registry
from elastic_emb.tables.registry import (
    Connection,
    create_table,
    current_cluster,
    registered_tables,
    unregister,
)

if TYPE_CHECKING:
    from elastic_emb.ps.client.cluster import Cluster, ClusterOptions
    from elastic_emb.ps.client.routing import Routing
    from elastic_emb.tables.table import Table, TableConfig

__all__ = [
    "ENV_COORDINATOR",
    "ENV_PS",
    "InitOptions",
    "create_table",
    "current_cluster",
    "init",
    "registered_tables",
    "shutdown",
    "unregister",
]

ENV_PS = "ELASTIC_EMB_PS"
ENV_COORDINATOR = "ELASTIC_EMB_COORDINATOR"
# `connect_timeout=None`: seconds for each PS of `ps` to answer (nothing listening is most
# often a typo or a server not started), and for a coordinator's cluster to have a primary
# for every slot (its servers may still be starting, e.g. pods scheduled at once).
PS_CONNECT_TIMEOUT = 5.0
CLUSTER_CONNECT_TIMEOUT = 30.0
# ... and, of those 5 s, how long a PS whose machine refuses the connection (nothing
# listens on its port) is tried again before `ee.init` fails naming it.
PS_REFUSED_TIMEOUT = 1.0


@dataclasses.dataclass(frozen=True)
class InitOptions:
    """`ee.init`'s arguments (see `init`), checked by `check`."""

    ps: list[str] | str | None = None
    mode: str = "async"
    staleness: int | None = None
    wire_dtype: str = "float32"
    worker_index: int | None = None
    num_workers: int | None = None
    timeout: float = 300.0
    connect_timeout: float | None = None
    coordinator: str | None = None
    failover_timeout: float = 60.0
    read_from_backups: bool = False
    cache_rows: int = 0
    cache_staleness: int = 0
    tls_ca: str | os.PathLike[str] | None = None
    tls_cert: str | os.PathLike[str] | None = None
    tls_key: str | os.PathLike[str] | None = None
    token: str | None = None
    dense: str | None = None
    dense_pull_every: int = 1
    worker_lease_seconds: int = 3
    data_plane: str = "native"

    def check(self) -> None:
        """Raises ValueError for options that contradict each other (the cluster
        checks the rest when it connects)."""
        every, dense = self.dense_pull_every, self.dense
        if isinstance(every, bool) or not isinstance(every, int):
            raise ValueError(f"`dense_pull_every` must be a positive integer. Received: {every!r}")
        if every < 1 or (every > 1 and dense == "local"):
            raise ValueError(
                "`dense_pull_every` must be a positive integer, and > 1 only with the dense "
                f"weights on the PS. Received: dense_pull_every={every}, dense={dense!r}"
            )
        if dense not in (None, "local", "ps"):
            raise ValueError(f"`dense` must be 'local', 'ps' or None. Received: dense={dense!r}")
        if dense == "ps" and self.mode != "async":
            raise ValueError(
                "dense='ps' trains dense weights asynchronously on the PS; with mode='sync' they "
                "stay local (under MultiWorkerMirroredStrategy). Received: mode='sync'"
            )
        if self.ps is not None and self.coordinator is not None:
            raise ValueError("Pass `ps` or `coordinator`, not both")
        wait = self.connect_timeout
        if wait is not None and (
            isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait > 0
        ):
            raise ValueError(
                f"`connect_timeout` must be a positive number of seconds, or None. "
                f"Received: connect_timeout={wait!r}"
            )

    def from_environment(self) -> InitOptions:
        """These options, with `ps` or `coordinator` read from the environment if neither
        is given."""
        if self.ps is not None or self.coordinator is not None:
            return self
        ps = os.environ.get(ENV_PS) or None
        coordinator = None if ps else os.environ.get(ENV_COORDINATOR) or None
        return dataclasses.replace(self, ps=ps, coordinator=coordinator)

    def dense_placement(self) -> str:
        """Where dense weights train: `dense`, else "ps" with a coordinator in async mode."""
        if self.dense is not None:
            return self.dense
        return "ps" if self.coordinator is not None and self.mode == "async" else "local"

    def wait_to_connect(self) -> float:
        """`connect_timeout`, or its default for `ps` or for a coordinator."""
        if self.connect_timeout is not None:
            return float(self.connect_timeout)
        return CLUSTER_CONNECT_TIMEOUT if self.coordinator is not None else PS_CONNECT_TIMEOUT

    def cluster_options(self, worker_index: int, num_workers: int) -> ClusterOptions:
        from elastic_emb.ps.client.cluster import ClusterOptions

        return ClusterOptions(
            self.mode, self.staleness, self.wire_dtype, worker_index, num_workers, self.timeout,
            self.wait_to_connect(), self.failover_timeout, self.read_from_backups, self.cache_rows,
            self.cache_staleness, self.worker_lease_seconds, self.data_plane,
            self.wait_when_refused(),
        )  # fmt: skip

    def wait_when_refused(self) -> float | None:
        """Seconds a shard of `ps` that refuses connections is tried (None: as long as
        `wait_to_connect`): a second by default; a `connect_timeout` given is waited whole
        (servers that start after their workers)."""
        if self.connect_timeout is not None or self.coordinator is not None:
            return None
        return PS_REFUSED_TIMEOUT


def init(
    ps: list[str] | str | None = None,
    mode: str = "async",
    staleness: int | None = None,
    wire_dtype: str = "float32",
    worker_index: int | None = None,
    num_workers: int | None = None,
    timeout: float = 300.0,
    connect_timeout: float | None = None,
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
    worker_lease_seconds: int = 3,
    data_plane: str = "native",
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
            `TF_CONFIG` (task index, number of "worker"/"chief" tasks); after
            `jax.distributed.initialize`, the JAX process index and count; else 0 of 1.
            With a coordinator, workers are elastic: any index >= 0 joins
            (and leaves when its process ends; docs/fault-tolerance.md), and
            without an index or `TF_CONFIG` a worker takes an index no live
            worker holds, the lowest free one unless others register at the
            same moment (`cluster.worker_index`), so identical worker
            processes (a Kubernetes Deployment) need no configuration.
        timeout: seconds a call may wait for other workers (sync, bounded
            staleness) before failing with `TimeoutError`.
        connect_timeout: seconds to wait at start for each PS of `ps` to
            answer (None: 5 s), or with a coordinator for every slot to have
            a primary (None: 30 s). Pass more for jobs that start their
            workers before their servers.
        coordinator: "etcd://host:port" of a replicated cluster's etcd
            (servers started with `elastic-emb serve --coordinator`), instead
            of `ps`. None reads `ELASTIC_EMB_COORDINATOR`. The groups'
            primaries are found there; after a primary fails, calls follow
            the new one (see docs/fault-tolerance.md).
        cache_rows: rows of remote tables this worker keeps, the ones it
            pulls most often (0, the default: no cache). Pushes still go to
            the shards. See `elastic_emb.ps.client.row_cache` and docs/storage.md.
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
            (`elastic_emb.keras.dense_ps_base`, docs/distributed.md; on Keras'
            TensorFlow and JAX backends). None (default): "ps" with a
            coordinator in async mode, for models compiled without a
            multi-replica `tf.distribute` strategy or `keras.distribution`
            (elastic workers come and go, which an all-reduce cannot survive);
            else "local".
        dense_pull_every: with dense weights on the PS, a training step pulls
            them only every this many steps (a named staleness): the steps
            between compute with the weights last pulled, older by up to
            `dense_pull_every - 1` steps of this worker (and whatever the
            others pushed meanwhile); every gradient is still pushed and
            applied on the PS. 1 (default): every step, exact.
        worker_lease_seconds: with a coordinator, the TTL of this worker's
            etcd lease, renewed every quarter of it: a dead worker counts as
            gone about this long plus 3 s after it died (sync steps wait for
            it until then). Each worker costs etcd 4 / TTL renewals a second:
            raise it for jobs of hundreds of workers (docs/deployment.md).
        data_plane: "native" (default): Pull and Push travel on each server's
            C++ data plane, framed TCP beside gRPC, where the server has one
            (`elastic-emb serve --data-plane native`, without TLS); "grpc":
            always through gRPC. Results are bit-identical either way
            (docs/architecture.md#two-planes).

    Returns:
        The `Cluster`, or None when no PS is configured.

    Raises:
        ValueError: invalid arguments, or already connected.
        ConnectionError: a PS did not answer within `connect_timeout`.
    """
    options = InitOptions(**{k: v for k, v in locals().items() if k in _INIT_FIELDS})
    return connect(options)


_INIT_FIELDS = frozenset(f.name for f in dataclasses.fields(InitOptions))


def connect(options: InitOptions) -> Cluster | None:
    """`init` with its arguments as `InitOptions`."""
    options.check()
    with registry.LOCK:
        registry.connect_from_environment(None)  # (asked for explicitly: the environment's is not)
        options = options.from_environment()
        if options.ps is None and options.coordinator is None:
            return None
        connected = registry.connection()
        if connected is not None:
            raise ValueError(
                f"elastic_emb is already connected to {connected.cluster.addresses}; "
                "call ee.shutdown() first"
            )
        dense = options.dense_placement()
        if options.dense_pull_every > 1 and dense != "ps":
            raise ValueError(
                f"`dense_pull_every`={options.dense_pull_every} needs the dense weights on the "
                f"PS; they stay local here (mode={options.mode!r}, "
                f"coordinator={options.coordinator!r}). Pass dense='ps' with mode='async'."
            )
        cluster = _connect_cluster(options)
        registry.connect(
            Connection(
                cluster,
                _remote_table_maker(cluster),
                dense,
                options.dense is not None,
                options.dense_pull_every,
            )
        )
        return cluster


def _keras_backend() -> str:
    import keras  # (first: loading Keras imports elastic_emb.keras)

    return str(keras.backend.backend())


def _connect_cluster(options: InitOptions) -> Cluster:
    """The `Cluster` of `options` (`ps` or `coordinator` set), connected."""
    from elastic_emb.ps.client.cluster import Cluster
    from elastic_emb.ps.wire.security import ClientSecurity

    ps, coordinator = options.ps, options.coordinator
    addresses = [a.strip() for a in ps.split(",")] if isinstance(ps, str) else list(ps or [])
    worker_index, num_workers = options.worker_index, options.num_workers
    auto_index = (
        worker_index is None and coordinator is not None and not os.environ.get("TF_CONFIG")
    )
    if worker_index is None or num_workers is None:
        index, count = _tf_config_worker() if os.environ.get("TF_CONFIG") else _jax_worker()
        worker_index = index if worker_index is None else worker_index
        num_workers = count if num_workers is None else num_workers
    if num_workers > 1 and _keras_backend() == "tensorflow":
        from elastic_emb.keras.patches import fix_keras_multi_worker

        fix_keras_multi_worker()
    security = ClientSecurity.make(options.tls_ca, options.tls_cert, options.tls_key, options.token)
    routing: Routing | None = None
    if coordinator is not None:
        from elastic_emb.ps.client.routing import Routing

        if auto_index:
            options.cluster_options(0, 1).check(elastic=True)  # before registering
        routing = Routing(coordinator, options.wait_to_connect())
        if auto_index:  # elastic workers without an index take a free one
            try:
                worker_index = routing.register_worker(None, options.worker_lease_seconds)
            except BaseException:
                routing.close()
                raise
    try:
        return Cluster(
            addresses, options.cluster_options(worker_index, num_workers), routing, security
        )
    except BaseException:
        if routing is not None:
            routing.close()
        raise


def _remote_table_maker(cluster: Cluster) -> Any:
    def make(config: TableConfig) -> Table:
        from elastic_emb.ps.client.remote_table import RemoteTable

        return RemoteTable(config, cluster)

    return make


def shutdown() -> None:
    """Sends pending pushes and disconnects; later tables are in-process.

    The remote tables of the connection can no longer be used; they leave
    the registry (so `ee.save()` no longer sees them).
    """
    with registry.LOCK:
        registry.connect_from_environment(None)
        old = registry.disconnect()
    if old is not None:
        old.cluster.close()


def _from_environment() -> None:
    """`init()` from ELASTIC_EMB_PS / ELASTIC_EMB_COORDINATOR, if either is set."""
    if os.environ.get(ENV_PS) or os.environ.get(ENV_COORDINATOR):
        init()


def install() -> None:
    """The first table, or the first ask for the connection, connects from the
    environment (`elastic_emb/__init__.py` calls this once)."""
    registry.connect_from_environment(_from_environment)


def _jax_worker() -> tuple[int, int]:
    """(process index, process count) once `jax.distributed.initialize` has run (where JAX
    has `jax.distributed.is_initialized`), else (0, 1). Starts no JAX backend."""
    jax: Any = sys.modules.get("jax")
    is_initialized = getattr(getattr(jax, "distributed", None), "is_initialized", None)
    if is_initialized is None or not is_initialized():
        return 0, 1
    return int(jax.process_index()), int(jax.process_count())


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
