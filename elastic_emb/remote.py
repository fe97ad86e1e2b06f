"""Remote tables: tables sharded over `elastic-emb serve` processes.

`init(ps=[...])` (or the `ELASTIC_EMB_PS` variable) makes every table the
process creates afterwards a `RemoteTable`. Keys go to shards by
`elastic_emb.sharding`. The layers of a model fuse their traffic: all tables
of a training step travel in one Pull and one Push per shard, and shards are
called concurrently.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import os
import threading
import time
from typing import Any

import grpc
import numpy as np

from elastic_emb import sharding, wire
from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.table import (
    Table,
    TableState,
    _keys_arg,
    _register,
    _rows_arg,
    registered_tables,
    unregister,
)

__all__ = ["Cluster", "RemoteTable", "current", "disable", "init", "shutdown"]

MODES = ("async", "sync")
ENV_PS = "ELASTIC_EMB_PS"

_GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 1 << 30),
    ("grpc.max_receive_message_length", 1 << 30),
]

_cluster: Cluster | None = None
_env_checked = False
_disabled = False
_lock = threading.Lock()


def init(
    ps: list[str] | str | None = None,
    mode: str = "async",
    staleness: int | None = None,
    wire_dtype: str = "float32",
    worker_index: int | None = None,
    num_workers: int | None = None,
    timeout: float = 300.0,
    connect_timeout: float = 30.0,
) -> Cluster | None:
    """Points this process at parameter servers; tables created after are remote.

    Tables created before stay in-process.

    Example:
        >>> ee.init(ps=["127.0.0.1:5000", "127.0.0.1:5001"], mode="sync")
        >>> layer = ee.Embedding(16, name="user")   # its table lives on both shards

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
        timeout: seconds a call may wait for other workers (sync, bounded
            staleness) before failing with `TimeoutError`.
        connect_timeout: seconds to wait for each PS to answer at start.

    Returns:
        The `Cluster`, or None when no PS is configured.

    Raises:
        ValueError: invalid arguments, or already connected.
        ConnectionError: a PS did not answer within `connect_timeout`.
    """
    global _cluster, _env_checked
    with _lock:
        _env_checked = True
        if ps is None:
            ps = os.environ.get(ENV_PS) or None
        if ps is None:
            return None
        addresses = [a.strip() for a in ps.split(",")] if isinstance(ps, str) else list(ps)
        if _cluster is not None:
            raise ValueError(
                f"elastic_emb is already connected to {_cluster.addresses}; "
                "call ee.shutdown() first"
            )
        if worker_index is None or num_workers is None:
            index, count = _tf_config_worker()
            worker_index = index if worker_index is None else worker_index
            num_workers = count if num_workers is None else num_workers
        if num_workers > 1:
            from elastic_emb.distribute import fix_keras_multi_worker

            fix_keras_multi_worker()
        _cluster = Cluster(
            addresses, mode, staleness, wire_dtype, worker_index, num_workers, timeout,
            connect_timeout,
        )  # fmt: skip
        return _cluster


def shutdown() -> None:
    """Sends pending pushes and disconnects; later tables are in-process.

    The remote tables of the connection can no longer be used; they leave
    the registry (so `ee.save()` no longer sees them).
    """
    global _cluster
    with _lock:
        cluster, _cluster = _cluster, None
    if cluster is None:
        return
    for table in registered_tables().values():
        if isinstance(table, RemoteTable) and table.cluster is cluster:
            unregister(table)
    cluster.close()


def current() -> Cluster | None:
    """The cluster new tables go to (connecting from `ELASTIC_EMB_PS` once), or None."""
    if _disabled:
        return None
    if not _env_checked and os.environ.get(ENV_PS):
        init()
    return _cluster


def disable() -> None:
    """Keeps every table of this process in-process (used by the PS itself)."""
    global _disabled
    _disabled = True


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


@dataclasses.dataclass
class ShardStats:
    """Client-side traffic to one PS shard."""

    address: str
    rpcs: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    max_seconds: float = 0.0


@dataclasses.dataclass
class _Ticket:
    table: str
    dim: int
    keys: np.ndarray
    insert: bool
    expects_push: bool
    future: concurrent.futures.Future[list[np.ndarray]] | None = None
    index: int = 0


class Cluster:
    """Connections to the PS shards, and the step protocol of this worker.

    Created by `init`. Thread-safe.
    """

    def __init__(
        self,
        addresses: list[str],
        mode: str,
        staleness: int | None,
        wire_dtype: str,
        worker_index: int,
        num_workers: int,
        timeout: float,
        connect_timeout: float,
    ) -> None:
        if not addresses or not all(isinstance(a, str) and ":" in a for a in addresses):
            raise ValueError(f'`ps` must list "host:port" addresses. Received: {addresses!r}')
        if mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}. Received: mode={mode!r}")
        if staleness is not None and (mode != "async" or staleness < 0):
            raise ValueError(
                "`staleness` must be a non-negative integer, with mode='async'. "
                f"Received: staleness={staleness!r}, mode={mode!r}"
            )
        if num_workers < 1 or not 0 <= worker_index < num_workers:
            raise ValueError(
                "`worker_index` must be in [0, num_workers). "
                f"Received: worker_index={worker_index}, num_workers={num_workers}"
            )
        self.addresses = list(addresses)
        self.mode = mode
        self.staleness = staleness
        self.wire_dtype = wire_dtype
        self._encoding = wire.encoding(wire_dtype)
        self.worker_index = worker_index
        self.num_workers = num_workers
        self.timeout = float(timeout)
        self._channels = [grpc.insecure_channel(a, options=_GRPC_OPTIONS) for a in addresses]
        self._stubs = [ps_pb2_grpc.ParameterServerStub(c) for c in self._channels]
        self.shard_stats = [ShardStats(a) for a in addresses]
        self._stats_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(2 * len(addresses), 4), thread_name_prefix="ee-rpc"
        )
        # Pushes leave in order, one step at a time, off the training thread.
        self._pusher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ee-push")
        self._lock = threading.Lock()
        self._tickets: dict[int, _Ticket] = {}
        self._unsent: list[_Ticket] = []
        self._next_ticket = 0
        self._expected_pushes = 0
        self._step_pushes: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._step_dims: dict[str, int] = {}
        self._received_pushes = 0
        self._in_flight: collections.deque[concurrent.futures.Future[None]] = collections.deque()
        self._in_flight_lock = threading.Lock()
        self._connect(connect_timeout)
        join = ps_pb2.JoinRequest(
            worker=worker_index,
            num_workers=num_workers,
            mode=ps_pb2.SYNC if mode == "sync" else ps_pb2.ASYNC,
            staleness=-1 if staleness is None else staleness,
        )
        steps = {r.step for r in self._call_all("Join", [join] * len(addresses))}
        if len(steps) != 1:
            raise RuntimeError(f"PS shards {self.addresses} are at different steps {steps}")
        self._step = steps.pop()  # steps this worker has pushed

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    @property
    def step(self) -> int:
        """Training steps this worker has pushed."""
        return self._step

    def _connect(self, timeout: float) -> None:
        for address, channel in zip(self.addresses, self._channels, strict=True):
            try:
                grpc.channel_ready_future(channel).result(timeout=timeout)
            except grpc.FutureTimeoutError:
                self.close()
                raise ConnectionError(
                    f"elastic_emb: parameter server {address} is unreachable "
                    f"(no answer within {timeout:g} s)"
                ) from None

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._pool.shutdown(wait=False)
            self._pusher.shutdown(wait=True)
            for channel in self._channels:
                channel.close()

    # RPCs.

    def _call(self, shard: int, method: str, request: Any, timeout: float | None = None) -> Any:
        address = self.addresses[shard]
        start = time.perf_counter()
        try:
            response = getattr(self._stubs[shard], method)(
                request, timeout=self.timeout + 60 if timeout is None else timeout
            )
        except grpc.RpcError as e:
            raise _error(address, method, e) from None
        elapsed = time.perf_counter() - start
        with self._stats_lock:
            s = self.shard_stats[shard]
            s.rpcs += 1
            s.bytes_sent += request.ByteSize()
            s.bytes_received += response.ByteSize()
            s.seconds += elapsed
            s.max_seconds = max(s.max_seconds, elapsed)
        return response

    def _call_all(
        self, method: str, requests: list[Any], timeout: float | None = None
    ) -> list[Any]:
        """Calls shard i with requests[i] (None: skip), concurrently."""
        jobs = {
            i: self._pool.submit(self._call, i, method, r, timeout)
            for i, r in enumerate(requests)
            if r is not None
        }
        return [jobs[i].result() if i in jobs else None for i in range(len(requests))]

    # Tables.

    def create_tables(self, configs: list[dict[str, Any]]) -> list[ps_pb2.TableInfo]:
        request = ps_pb2.CreateTablesRequest(
            tables=[
                ps_pb2.TableSpec(name=c["name"], config_json=json.dumps(c, sort_keys=True))
                for c in configs
            ]
        )
        return list(self._call_all("CreateTables", [request] * self.num_shards)[0].tables)

    def describe(self, name: str) -> list[ps_pb2.TableInfo]:
        """The table's info on each shard."""
        request = ps_pb2.DescribeTablesRequest(names=[name])
        return [r.tables[0] for r in self._call_all("DescribeTables", [request] * self.num_shards)]

    def server_stats(self) -> list[ps_pb2.StatsResponse]:
        return self._call_all("Stats", [ps_pb2.StatsRequest()] * self.num_shards)

    def per_shard(self, method: str, make: Any, timeout: float | None = None) -> list[Any]:
        """Calls `method` on every shard with `make(shard_index)`'s request.

        `timeout`: seconds per call; default `self.timeout` plus a minute.
        """
        return self._call_all(method, [make(i) for i in range(self.num_shards)], timeout)

    # Pull and push, fused over tables.

    def pull(self, tables: list[tuple[str, int, np.ndarray]], insert: bool) -> list[np.ndarray]:
        """Rows of many tables in one request per shard: [(name, dim, keys)] -> [rows]."""
        self._raise_push_errors()
        split = [sharding.split_by_shard(keys, self.num_shards) for _, _, keys in tables]
        requests: list[ps_pb2.PullRequest | None] = []
        for shard in range(self.num_shards):
            entries = [
                ps_pb2.TableKeys(table=name, keys=raw, key_encoding=key_encoding)
                for i, (name, _, keys) in enumerate(tables)
                if len(split[i][shard])
                for raw, key_encoding in [wire.encode_keys_compact(keys[split[i][shard]])]
            ]
            requests.append(
                ps_pb2.PullRequest(
                    worker=self.worker_index,
                    step=self._step + 1,
                    train=insert,
                    encoding=self._encoding,
                    timeout_ms=int(self.timeout * 1000),
                    tables=entries,
                )
                if entries
                else None
            )
        responses = self._call_all("Pull", requests)
        out = [np.empty((len(keys), dim), np.float32) for _, dim, keys in tables]
        for shard, response in enumerate(responses):
            if response is None:
                continue
            got = iter(response.tables)
            for i, (name, dim, _) in enumerate(tables):
                positions = split[i][shard]
                if len(positions):
                    values = next(got)
                    out[i][positions] = wire.decode_floats(
                        values.values, response.encoding, len(positions), dim, f"rows of {name}"
                    )
        return out

    def push(self, tables: dict[str, tuple[int, np.ndarray, np.ndarray]]) -> None:
        """One training step of this worker for many tables: {name: (dim, keys, grads)}."""
        with self._lock:
            self._send_unsent_pushes()
            future = self._start_push(tables)
        future.result()

    def _start_push(
        self, tables: dict[str, tuple[int, np.ndarray, np.ndarray]]
    ) -> concurrent.futures.Future[None]:
        """Queues the push of the next step (under `_lock`)."""
        self._step += 1
        future = self._pusher.submit(self._push_step, self._step, tables)
        with self._in_flight_lock:
            self._in_flight.append(future)
        return future

    def _push_step(self, step: int, tables: dict[str, tuple[int, np.ndarray, np.ndarray]]) -> None:
        # Every shard hears of every table of the step (maybe with no keys),
        # so all shards advance their step and optimizer iterations together.
        requests = []
        split = {n: sharding.split_by_shard(k, self.num_shards) for n, (_, k, _) in tables.items()}
        for shard in range(self.num_shards):
            entries = []
            for name, (_, keys, grads) in sorted(tables.items()):
                positions = split[name][shard]
                raw_keys, key_encoding = wire.encode_keys_compact(keys[positions])
                shard_grads = grads[positions]
                exponent = wire.gradient_exponent(shard_grads, self._encoding)
                entries.append(
                    ps_pb2.TableGradients(
                        table=name,
                        keys=raw_keys,
                        key_encoding=key_encoding,
                        gradients=wire.encode_floats(
                            wire.scale(shard_grads, exponent), self._encoding
                        ),
                        gradient_exponent=exponent,
                    )
                )
            requests.append(
                ps_pb2.PushRequest(
                    worker=self.worker_index, step=step, encoding=self._encoding, tables=entries
                )
            )
        self._call_all("Push", requests)

    def _raise_push_errors(self, wait_all: bool = False, keep: int = 2) -> None:
        """Surfaces failed background pushes; bounds (or drains) those in flight."""
        while True:
            with self._in_flight_lock:
                if not self._in_flight or not (
                    wait_all or self._in_flight[0].done() or len(self._in_flight) > keep
                ):
                    return
                future = self._in_flight.popleft()
            future.result()

    def flush(self) -> None:
        """Sends the pushes of a step not complete yet and waits for all pushes."""
        with self._lock:
            self._send_unsent_pushes()
        self._raise_push_errors(wait_all=True)

    # The layers' fused path: every layer submits its keys, and the first
    # one to collect pulls for all of them (see layers.py for the ordering).

    def submit(
        self, table: str, dim: int, keys: np.ndarray, insert: bool, expects_push: bool
    ) -> int:
        with self._lock:
            self._next_ticket += 1
            ticket = _Ticket(table, dim, keys, insert, expects_push)
            self._tickets[self._next_ticket] = ticket
            self._unsent.append(ticket)
            return self._next_ticket

    def collect(self, ticket_id: int) -> np.ndarray:
        with self._lock:
            ticket = self._tickets.pop(ticket_id)
            batch: list[_Ticket] = []
            if ticket.future is None:
                batch, self._unsent = self._unsent, []
                if any(t.expects_push for t in batch):
                    if self._received_pushes:  # a new step: the last one is over
                        self._send_unsent_pushes()
                    self._expected_pushes += sum(t.expects_push for t in batch)
                for t in batch:
                    t.future = concurrent.futures.Future()
        if batch:
            self._pull_batch(batch)
        assert ticket.future is not None
        return ticket.future.result()[ticket.index]

    def _pull_batch(self, batch: list[_Ticket]) -> None:
        for insert in (True, False):
            group = [t for t in batch if t.insert == insert]
            if not group:
                continue
            for i, t in enumerate(group):
                t.index = i
            try:
                rows = self.pull([(t.table, t.dim, t.keys) for t in group], insert)
            except BaseException as e:
                for t in group:
                    assert t.future is not None
                    t.future.set_exception(e)
                raise
            for t in group:
                assert t.future is not None
                if not t.future.done():
                    t.future.set_result(rows)

    def push_gradient(self, table: str, dim: int, keys: np.ndarray, grads: np.ndarray) -> None:
        """A layer's gradient; the step is pushed when all layers that pulled have pushed."""
        with self._lock:
            self._step_pushes.setdefault(table, []).append((keys, grads))
            self._step_dims[table] = dim
            self._received_pushes += 1
            if self._received_pushes >= self._expected_pushes:
                self._send_unsent_pushes()
        self._raise_push_errors()

    def _send_unsent_pushes(self) -> None:
        """Starts the push of the current step's gradients (under `_lock`)."""
        if not self._received_pushes:
            return
        tables = {
            name: (
                self._step_dims[name],
                np.concatenate([k for k, _ in parts]),
                np.concatenate([g for _, g in parts]),
            )
            for name, parts in self._step_pushes.items()
        }
        self._step_pushes, self._received_pushes, self._expected_pushes = {}, 0, 0
        self._start_push(tables)

    def stats(self) -> list[dict[str, Any]]:
        """Client-side RPC count, bytes and latency per shard."""
        with self._stats_lock:
            return [dataclasses.asdict(s) for s in self.shard_stats]

    def reset_stats(self) -> None:
        with self._stats_lock:
            self.shard_stats = [ShardStats(a) for a in self.addresses]


def _error(address: str, method: str, e: grpc.RpcError) -> Exception:
    code = e.code()
    message = f"elastic_emb PS {address} {method}: {e.details()}"
    if code == grpc.StatusCode.UNAVAILABLE:
        return ConnectionError(f"{message} (parameter server {address} unreachable)")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError(message)
    if code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
    ):
        return ValueError(message)
    return RuntimeError(f"{message} ({code.name})")


class RemoteTable(Table):
    """A table whose rows live on the PS shards of `ee.init`; same interface as `Table`.

    Created by `ee.Table(...)` (and `ee.Embedding`) once a cluster is
    configured. Its rows, optimizer slots and step count are on the shards.
    """

    def __init__(
        self,
        dim: int,
        optimizer: Any = None,
        initializer: Any = "uniform",
        name: str = "table",
        seed: int | None = None,
        device: str = "cpu",
    ) -> None:
        if device != "cpu":
            raise ValueError(
                f"Remote tables live on the PS shards' CPUs. Received: device={device!r}"
            )
        cluster = current()
        if cluster is None:
            raise ValueError("RemoteTable needs ee.init(ps=[...]) first")
        self._configure(dim, optimizer, initializer, name, seed)
        self.cluster = cluster
        self.name = _register(self, name)
        self._num_slots = int(cluster.create_tables([self.config()])[0].num_slots)

    @property
    def iterations(self) -> int:
        return max(int(i.iterations) for i in self.cluster.describe(self.name))

    @property
    def num_slots(self) -> int:
        return self._num_slots

    def pull(self, keys: Any, train: bool = True) -> np.ndarray:
        k = _keys_arg(keys)
        unique, inverse = np.unique(k, return_inverse=True)
        (rows,) = self.cluster.pull([(self.name, self.dim, unique)], bool(train))
        return rows[inverse.reshape(-1)]

    def push(self, keys: Any, grads: Any) -> None:
        k = _keys_arg(keys)
        g = _rows_arg(grads, "grads", k.shape[0], self.dim)
        self.cluster.push({self.name: (self.dim, k, g)})

    def _call_by_shard(
        self, method: str, keys: np.ndarray, make: Any
    ) -> tuple[list[np.ndarray], list[Any]]:
        """Calls `method` on every shard with `make(positions of the keys it owns)`."""
        split = sharding.split_by_shard(keys, self.cluster.num_shards)
        self.cluster.flush()
        return split, self.cluster.per_shard(method, lambda i: make(split[i]))

    def import_rows(self, keys: Any, values: Any) -> None:
        k = _keys_arg(keys)
        v = _rows_arg(values, "values", k.shape[0], self.dim)
        self._call_by_shard(
            "ImportRows",
            k,
            lambda p: ps_pb2.ImportRowsRequest(
                table=self.name,
                keys=wire.encode_keys(k[p]),
                values=wire.encode_floats(v[p], ps_pb2.FLOAT32),
            ),
        )

    def export_rows(self) -> tuple[np.ndarray, np.ndarray]:
        state = self.export_state()
        return state.keys, state.values

    def erase(self, keys: Any) -> int:
        k = _keys_arg(keys)
        _, responses = self._call_by_shard(
            "EraseRows",
            k,
            lambda p: ps_pb2.EraseRowsRequest(table=self.name, keys=wire.encode_keys(k[p])),
        )
        return sum(int(r.erased) for r in responses)

    def metadata(self, keys: Any) -> tuple[np.ndarray, np.ndarray]:
        k = _keys_arg(keys)
        split, responses = self._call_by_shard(
            "Metadata",
            k,
            lambda p: ps_pb2.MetadataRequest(table=self.name, keys=wire.encode_keys(k[p])),
        )
        last_step = np.empty(len(k), np.int64)
        update_count = np.empty(len(k), np.int64)
        for positions, r in zip(split, responses, strict=True):
            last_step[positions] = np.frombuffer(r.last_step, "<i8")
            update_count[positions] = np.frombuffer(r.update_count, "<i8")
        return last_step, update_count

    def memory_bytes(self) -> int:
        return sum(int(i.memory_bytes) for i in self.cluster.describe(self.name))

    def __len__(self) -> int:
        return sum(int(i.rows) for i in self.cluster.describe(self.name))

    def export_state(self) -> TableState:
        self.cluster.flush()
        responses = self.cluster.per_shard(
            "ExportRows", lambda i: ps_pb2.ExportRowsRequest(table=self.name, with_state=True)
        )
        parts = []
        for r in responses:
            keys = wire.decode_keys(r.keys)
            n = len(keys)
            parts.append(
                TableState(
                    keys=keys,
                    values=wire.decode_floats(r.values, ps_pb2.FLOAT32, n, self.dim),
                    slots=wire.decode_floats(
                        r.slots, ps_pb2.FLOAT32, n, self.num_slots * self.dim, "slots"
                    ),
                    last_step=wire.decode_uint(r.last_step, n, "<u4", "last_step"),
                    update_count=wire.decode_uint(r.update_count, n, "<u4", "update_count"),
                    iterations=int(r.iterations),
                )
            )
        return TableState.concatenate(parts)

    def load_state(self, state: TableState) -> None:
        n = state.keys.shape[0]
        keys = _keys_arg(state.keys)
        values = _rows_arg(state.values, "values", n, self.dim)
        slots = _rows_arg(state.slots, "slots", n, self.num_slots * self.dim)
        self._call_by_shard(
            "ImportRows",
            keys,
            lambda p: ps_pb2.ImportRowsRequest(
                table=self.name,
                keys=wire.encode_keys(keys[p]),
                values=wire.encode_floats(values[p], ps_pb2.FLOAT32),
                replace=True,
                slots=wire.encode_floats(slots[p], ps_pb2.FLOAT32),
                last_step=np.ascontiguousarray(state.last_step[p], "<u4").tobytes(),
                update_count=np.ascontiguousarray(state.update_count[p], "<u4").tobytes(),
                iterations=int(state.iterations),
            ),
        )
