"""`Cluster`: this worker's training-step protocol with the PS shards.

Created by `ee.init(ps=[...])`. Keys go to shards by `elastic_emb.tables.sharding`.
The layers of a model fuse their traffic: every table of a training step
travels in one Pull and one Push per shard, shards are called concurrently,
and pushes leave in step order on a background thread while training goes
on (a later pull waits for them as the mode requires, on the shard).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from elastic_emb._proto import ps_pb2
from elastic_emb.ps.client.row_cache import RowCache
from elastic_emb.ps.client.shard_client import NotPrimary, RangeChanged, ShardClient
from elastic_emb.ps.wire import protocol
from elastic_emb.ps.wire.security import ClientSecurity
from elastic_emb.tables.sharding import RangeLayout

if TYPE_CHECKING:
    from elastic_emb.ps.client.routing import Routing

__all__ = ["MODES", "Cluster", "ClusterOptions"]

log = logging.getLogger("elastic_emb")

MODES = ("async", "sync")
# An RPC may wait `timeout` for other workers on the shard; its deadline is longer.
_RPC_MARGIN_SECONDS = 60.0
# Shards write and read whole tables: allow them hours, not the step timeout.
CHECKPOINT_TIMEOUT = 6 * 3600.0
# With a coordinator: a worker that stops renewing its lease for this long has left.
WORKER_LEASE_SECONDS = 3
# Pushes of a worker that may be in flight while it pulls again.
_PUSHES_AHEAD = 2
# Coming steps' keys (`prefetch`) kept at most: the input pipeline runs one ahead.
_STEPS_AHEAD = 2

# [(table, dim, keys)]: the tables of one pull, in submission order.
_Tables = list[tuple[str, int, np.ndarray]]


@dataclasses.dataclass
class _Ticket:
    """One layer's pull of one step (see `submit`)."""

    table: str
    dim: int
    keys: np.ndarray
    insert: bool
    expects_push: bool
    future: concurrent.futures.Future[list[np.ndarray]] | None = None
    index: int = 0  # this ticket's rows in the future's list


@dataclasses.dataclass(frozen=True)
class ClusterOptions:
    """How a worker trains with the shards (`ee.init`'s arguments of the same names)."""

    mode: str = "async"
    staleness: int | None = None
    wire_dtype: str = "float32"
    worker_index: int = 0
    num_workers: int = 1
    timeout: float = 300.0
    connect_timeout: float = 30.0
    failover_timeout: float = 60.0
    read_from_backups: bool = False
    cache_rows: int = 0
    cache_staleness: int = 0

    def check(self, elastic: bool) -> None:
        """Raises ValueError for invalid options; `elastic`: with a coordinator."""
        mode, staleness = self.mode, self.staleness
        if mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}. Received: mode={mode!r}")
        if staleness is not None and (mode != "async" or staleness < 0):
            raise ValueError(
                "`staleness` must be a non-negative integer, with mode='async'. "
                f"Received: staleness={staleness!r}, mode={mode!r}"
            )
        index, count = self.worker_index, self.num_workers
        if count < 1 or index < 0 or (index >= count and not elastic):
            raise ValueError(
                "`worker_index` must be in [0, num_workers) (any index >= 0 with a coordinator). "
                f"Received: worker_index={index}, num_workers={count}"
            )
        if self.read_from_backups and not elastic:
            raise ValueError("`read_from_backups` needs a coordinator (replicated groups)")
        for name in ("cache_rows", "cache_staleness"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"`{name}` must be a non-negative integer. Received: {name}={value!r}"
                )
        if self.cache_staleness and (mode == "sync" or not self.cache_rows):
            raise ValueError(
                "`cache_staleness` > 0 serves rows without asking the shards: it needs "
                "cache_rows > 0 and mode 'async' (sync steps read every row as of the step "
                f"before). Received: cache_staleness={self.cache_staleness}, "
                f"cache_rows={self.cache_rows}, mode={mode!r}"
            )


class Cluster:
    """The PS shards of this worker, and its step protocol.

    A step: every layer `submit`s its keys, the first `collect` pulls the
    rows of all of them (one Pull per shard), each layer's gradient comes
    back through `push_gradient`, and once every layer that pulled has
    pushed, the step's gradients leave as one Push per shard.

    Thread-safe: every public method may be called from any thread. `pull`,
    `collect`, `push` and `flush` block for the network; `submit` and
    `push_gradient` do not (a push is only queued).

    With a `routing` (a coordinator), shard i is the i-th slot range of the
    cluster map, served by its group's primary: a call that finds the
    primary gone (or the range moved) waits for the coordinator's new
    primary and is sent again (pushes too: a range applies a (worker, step)
    once), for up to `failover_timeout` seconds. When ranges split, the
    worker splits its requests again and re-sends them. A server that
    serves several ranges gets a step's Pulls (Pushes) of all of them in
    one PullRanges (PushRanges) call.

    Raises:
        ValueError: invalid arguments.
        ConnectionError: a shard did not answer within `connect_timeout`.
        RuntimeError: the shards are at different steps.
    """

    def __init__(
        self,
        addresses: list[str],
        options: ClusterOptions,
        routing: Routing | None = None,
        security: ClientSecurity | None = None,
    ) -> None:
        options.check(elastic=routing is not None)
        # Read-only after construction.
        self.options = options
        self.mode = options.mode
        self.staleness = options.staleness
        self.wire_dtype = options.wire_dtype
        self.worker_index = worker_index = options.worker_index
        self.num_workers = num_workers = options.num_workers
        self.timeout = float(options.timeout)
        self._encoding = protocol.encoding(options.wire_dtype)
        self.routing = routing
        self.failover_timeout = options.failover_timeout
        self.read_from_backups = options.read_from_backups
        mode, staleness = options.mode, options.staleness
        cache_rows, cache_staleness = options.cache_rows, options.cache_staleness
        connect_timeout = options.connect_timeout
        # The worker's cache of pulled rows (`ee.init(cache_rows=...)`), or None.
        self.cache = RowCache(cache_rows, cache_staleness) if cache_rows else None
        self._reads = itertools.count()  # round robin over a group's replicas
        self._layout_lock = threading.Lock()  # guards _layout (changed with a coordinator)
        if routing is None:
            self._layout = RangeLayout.even(len(addresses))
        else:
            self._layout = routing.layout()
            addresses = [routing.primary_of(r) for r in self._layout.ids]
        self.shards = ShardClient(
            addresses,
            timeout=self.timeout + _RPC_MARGIN_SECONDS,
            retry=routing is None,
            security=security,
        )
        # Pushes leave in order, one step at a time, off the training thread.
        self._pusher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ee-push")
        self._lock = threading.Lock()
        # Guarded by _lock: the step's tickets and gradients.
        self._step = 0  # steps this worker has pushed (queued)
        self._tickets: dict[int, _Ticket] = {}
        self._unsent: list[_Ticket] = []  # submitted, not pulled yet
        self._next_ticket = 0
        self._expected_pushes = 0
        self._received_pushes = 0
        self._step_pushes: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._step_dims: dict[str, int] = {}
        # Keys of coming training steps (`prefetch`), oldest first, and the next step's
        # rows read ahead: (step, tables, rows).
        self._ahead: collections.deque[_Tables] = collections.deque(maxlen=_STEPS_AHEAD)
        self._read_ahead: tuple[int, _Tables, concurrent.futures.Future[list[Any]]] | None = None
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ee-ahead")
        self.steps_read_ahead = 0  # training steps whose rows were read ahead (`prefetch`)
        # Guarded by _lock: see `timings`.
        self._timings = dict.fromkeys(("pulls", "pull_seconds", "pushes", "push_seconds"), 0.0)
        # Guarded by _in_flight_lock: queued pushes, oldest first.
        self._in_flight_lock = threading.Lock()
        self._in_flight: collections.deque[concurrent.futures.Future[None]] = collections.deque()
        try:
            self.shards.connect(connect_timeout)
            if routing is not None:  # elastic: no step waits for this worker once it is gone
                routing.register_worker(worker_index, WORKER_LEASE_SECONDS)
            join = protocol.join_request(
                worker_index, num_workers, mode, staleness, elastic=routing is not None
            )
            steps = {r.step for r in self._broadcast("Join", join)}
            if len(steps) != 1:
                raise RuntimeError(f"PS shards {self.addresses} are at different steps {steps}")
        except BaseException:
            self._close_connections()
            raise
        self._step = steps.pop()

    @property
    def addresses(self) -> list[str]:
        return self.shards.addresses

    @property
    def num_shards(self) -> int:
        return len(self.layout().ids)

    @property
    def step(self) -> int:
        """Training steps this worker has pushed (queued)."""
        with self._lock:
            return self._step

    def close(self) -> None:
        """Sends pending pushes, waits for them, leaves (elastic), closes the connections."""
        try:
            self.flush()
            if self.routing is not None:
                leave = ps_pb2.LeaveRequest(worker=self.worker_index)
                try:
                    self._broadcast("Leave", leave)
                except ConnectionError as e:  # the servers see this worker's lease end instead
                    log.warning("could not tell the servers that worker %d left: %s",
                                self.worker_index, e)  # fmt: skip
        finally:
            self._close_connections()

    def _close_connections(self) -> None:
        self._pusher.shutdown(wait=True)
        self._reader.shutdown(wait=False, cancel_futures=True)
        self.shards.close()
        if self.routing is not None:
            self.routing.close()

    def layout(self) -> RangeLayout:
        """The slot ranges as the coordinator's map has them now (fixed without one)."""
        if self.routing is None:
            return self._layout  # (fixed: never changes)
        with self._layout_lock:
            current = self.routing.layout()
            if (current.ids, current.slots) != (self._layout.ids, self._layout.slots):
                self.shards.set_addresses([self.routing.primary_of(r) for r in current.ids])
                self._layout = current
            return self._layout

    def _per_range(
        self,
        method: str,
        make: Any,
        timeout: float | None = None,
        again_if_changed: bool = True,
    ) -> tuple[RangeLayout, list[Any]]:
        """`make(layout)`'s requests (None: skip) to every range; (layout, responses).

        With a coordinator: requests made for ranges that split meanwhile
        are made again for the new ones and re-sent, and so are the whole
        call's when the ranges changed while it ran (`again_if_changed`), so
        that every range hears of it (pushes are de-duplicated by step).
        """
        while True:
            layout = self.layout()
            requests = make(layout)
            if self.routing is None:
                return layout, self.shards.call_all(method, requests, timeout)
            seen: set[int] = set()
            for i, request in enumerate(requests):
                if request is None or "range" not in request.DESCRIPTOR.fields_by_name:
                    continue
                if id(request) in seen:  # one message for all: each range gets its own
                    request = requests[i] = type(request).FromString(request.SerializeToString())
                seen.add(id(request))
                request.range = layout.ids[i]
            try:
                responses = self._call_per_server(method, requests, timeout)
            except RangeChanged:
                self.routing.wait_for_change(layout.version, 1.0)
                continue
            if not again_if_changed or self.layout().ids == layout.ids:
                return layout, responses

    def _broadcast(self, method: str, request: Any, timeout: float | None = None) -> list[Any]:
        """The same request to every range."""
        return self._per_range(method, lambda layout: [request] * len(layout.ids), timeout)[1]

    def _call_per_server(
        self, method: str, requests: list[Any], timeout: float | None
    ) -> list[Any]:
        """`requests[i]` to range i (None: skip it), concurrently; with a coordinator, a
        server's Pulls (Pushes) go in one PullRanges (PushRanges) call, not one per range."""
        routing = self.routing
        if routing is None or method not in ("Pull", "Push"):
            return self.shards.call_all(method, requests, timeout, call=self._call_range)
        by_server: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            if request is None:
                continue
            alone = (
                method == "Pull"
                and not request.train
                and (self.read_from_backups or routing.hot(request.range))
            )  # spread over the replicas: a call of its own
            server = f"#{i}" if alone else routing.primary_of(request.range)
            by_server.setdefault(server, []).append(i)
        calls: list[Any] = [None] * len(by_server)
        for n, indices in enumerate(by_server.values()):
            calls[n] = [requests[i] if i in indices else None for i in range(len(requests))]
        answers = self.shards.call_all(method, calls, timeout, call=self._call_ranges)
        responses: list[Any] = [None] * len(requests)
        for indices, answer in zip(by_server.values(), answers, strict=True):
            for i in indices:
                responses[i] = answer[i]
        return responses

    def _call_ranges(
        self, n: int, method: str, requests: list[Any], timeout: float | None
    ) -> list[Any]:
        """The requests that are not None, to one server: in one call if several (see
        `_call_per_server`), each on its own (following failovers and moves) if it fails."""
        routing = self.routing
        assert routing is not None
        indices = [i for i, r in enumerate(requests) if r is not None]
        out: list[Any] = [None] * len(requests)
        address = routing.primary_of(requests[indices[0]].range) if indices else ""
        if len(indices) > 1 and address:  # (no primary now: each waits for its own)
            parts = [requests[i] for i in indices]
            ranges = [r.range for r in parts]
            batch = getattr(ps_pb2, f"{method}RangesRequest")(parts=parts)

            def abandon(address: str) -> bool:  # a range moved, or its primary changed
                return any(routing.primary_of(r) != address for r in ranges)

            try:
                answer = self.shards.call(
                    indices[0], f"{method}Ranges", batch, timeout, abandon, address
                )
                for i, part in zip(indices, answer.parts, strict=True):
                    out[i] = part
                return out
            except (ConnectionError, RangeChanged, RuntimeError):  # NotPrimary too
                pass  # each range on its own, as it now stands
        for i in indices:
            out[i] = self._call_range(i, method, requests[i], timeout)
        return out

    def _call_range(self, index: int, method: str, request: Any, timeout: float | None) -> Any:
        """One call to a range's primary, following failovers and moves (a read, with
        `read_from_backups` or to a range with hot slots: maybe to a backup)."""
        routing = self.routing
        assert routing is not None
        if "range" in request.DESCRIPTOR.fields_by_name:
            range_id = request.range
        else:
            with self._layout_lock:
                ids = self._layout.ids
            range_id = ids[min(index, len(ids) - 1)]
        spread = self.read_from_backups or routing.hot(range_id)
        if spread and method == "Pull" and not request.train:
            replicas = routing.replicas_of(range_id)
            if replicas:
                address = replicas[next(self._reads) % len(replicas)]
                try:
                    return self.shards.call(index, method, request, timeout, address=address)
                except ConnectionError:  # that server is gone or no replica any more
                    pass  # the primary answers
        deadline = time.monotonic() + self.failover_timeout

        def abandon(address: str) -> bool:  # a stopped (not dead) primary was replaced
            return routing.primary_of(range_id) != address

        while True:
            version = routing.version
            address = routing.primary_of(range_id)
            try:
                return self.shards.call(index, method, request, timeout, abandon, address)
            except ConnectionError as e:  # NotPrimary too
                left = deadline - time.monotonic()
                lost = None if isinstance(e, NotPrimary) else routing.lost(range_id)
                if lost is not None:
                    raise ConnectionError(f"elastic_emb: {lost}") from None
                if left <= 0:
                    raise ConnectionError(
                        f"{e} (no primary of slot range {range_id} answered for "
                        f"{self.failover_timeout:g} s)"
                    ) from None
                # The server may know less than this worker (a move it has not seen yet).
                wait = 0.02 if isinstance(e, NotPrimary) else 0.25
                if routing.primary_of(range_id) == address:
                    routing.wait_for_change(version, min(left, wait))

    # Tables.

    def create_tables(self, configs: list[dict[str, Any]]) -> list[Any]:
        """Creates the tables on every shard (or checks they exist alike); their TableInfo."""
        request = protocol.create_tables_request(configs)
        return list(self._broadcast("CreateTables", request)[0].tables)

    def describe(self, name: str) -> list[Any]:
        """The table's TableInfo on each shard."""
        request = ps_pb2.DescribeTablesRequest(names=[name])
        return [r.tables[0] for r in self._broadcast("DescribeTables", request)]

    def server_stats(self) -> list[Any]:
        """Each shard's StatsResponse (with a coordinator: the server of each slot range)."""
        return self._broadcast("Stats", ps_pb2.StatsRequest())

    def save_tables(
        self,
        directories: list[str],
        names: list[str],
        incremental: bool = False,
        max_deltas: int = 0,
    ) -> list[Any]:
        """Each shard i writes its rows of the named tables to `directories[i]`.

        SYNC: every shard saves after this worker's last step is applied, a
        step boundary everywhere. Returns each shard's SaveResponse.
        """
        after = self.step if self.mode == "sync" else 0

        def make(layout: RangeLayout) -> list[Any]:
            if len(layout.ids) != len(directories):
                raise RuntimeError("the cluster's slot ranges changed during the save: save again")
            return [
                protocol.save_request(d, names, incremental, max_deltas, after, slots)
                for d, slots in zip(directories, layout.slots, strict=True)
            ]

        self.flush()
        return self._per_range("Save", make, CHECKPOINT_TIMEOUT, again_if_changed=False)[1]

    def slot_ranges(self) -> list[tuple[int, int]]:
        """The slots [begin, end) each shard owns."""
        return list(self.layout().slots)

    def restore_tables(self, directory: str, names: list[str]) -> None:
        """Each shard loads the rows it owns of the named tables from a checkpoint."""
        self.flush()
        if self.cache is not None:  # restored rows may carry the versions of cached ones
            self.cache.clear()
        self._per_range(
            "Restore",
            lambda layout: [protocol.restore_request(directory, names, s) for s in layout.slots],
            timeout=CHECKPOINT_TIMEOUT,
        )

    def per_shard(self, method: str, make: Any, timeout: float | None = None) -> list[Any]:
        """`make(i)`'s request to every shard i, after this worker's pushes have landed."""
        self.flush()
        return self._per_range(method, lambda layout: [make(i) for i in range(len(layout.ids))],
                               timeout)[1]  # fmt: skip

    def by_range(self, method: str, keys: np.ndarray, make: Any) -> tuple[list[Any], list[Any]]:
        """`make(positions)`'s request to every shard, for its keys at `positions` of `keys`;
        (positions per shard, responses), after this worker's pushes have landed."""
        self.flush()
        split: list[Any] = []

        def requests(layout: RangeLayout) -> list[Any]:
            split[:] = layout.split(keys)
            return [make(positions) for positions in split]

        return split, self._per_range(method, requests)[1]

    def stats(self) -> list[dict[str, Any]]:
        """Client-side RPC count, bytes and latency per shard."""
        return self.shards.stats()

    def reset_stats(self) -> None:
        self.shards.reset_stats()

    # Pull and push, fused over tables.

    def pull(self, tables: _Tables, insert: bool) -> list[np.ndarray]:
        """Rows of many tables in one request per shard: [(name, dim, keys)] -> [rows]."""
        self._raise_push_errors()
        with self._lock:
            step = self._step + 1
        return self._pull(tables, insert, step)

    def _pull(self, tables: _Tables, insert: bool, step: int) -> list[np.ndarray]:
        cache = self.cache
        # With a cache: the keys it serves, and for the others the versions it holds.
        plans = []
        if cache is not None:
            plans = [cache.plan(name, dim, keys, step) for name, dim, keys in tables]
        asked = (
            [(n, d, k[~p[0]]) for (n, d, k), p in zip(tables, plans, strict=True)]
            if cache is not None
            else tables
        )
        split: list[list[np.ndarray]] = []

        def make(layout: RangeLayout) -> list[Any]:
            split[:] = [layout.split(keys) for _, _, keys in asked]
            requests: list[Any] = []
            for shard in range(len(layout.ids)):
                mine = [i for i in range(len(asked)) if len(split[i][shard])]
                entries = [(asked[i][0], asked[i][2][split[i][shard]]) for i in mine]
                held = [plans[i][2][split[i][shard]] for i in mine] if plans else None
                if not entries:
                    requests.append(None)
                    continue
                request = protocol.pull_request(
                    self.worker_index, step, insert, self._encoding, self.timeout, entries, held
                )
                requests.append(request)
            return requests

        start = time.perf_counter()
        _, responses = self._per_range("Pull", make, again_if_changed=False)
        self._time("pulls", "pull_seconds", time.perf_counter() - start)
        out = [np.empty((len(keys), dim), np.float32) for _, dim, keys in asked]
        versions = [np.zeros(len(keys), np.uint32) for _, _, keys in asked]
        unchanged = [np.zeros(len(keys), bool) for _, _, keys in asked]
        for shard, response in enumerate(responses):
            if response is None:
                continue
            mine = [i for i in range(len(asked)) if len(split[i][shard])]
            shapes = [(asked[i][0], len(split[i][shard]), asked[i][1]) for i in mine]
            for i, (rows, now, same) in zip(
                mine, protocol.pulled_rows(response, shapes), strict=True
            ):
                at = split[i][shard]
                if same is None or now is None:
                    out[i][at] = rows
                    continue
                out[i][at[~same]] = rows
                versions[i][at[~same]] = now
                unchanged[i][at] = same
        if not plans:
            return out
        assert cache is not None
        whole = []
        for i, ((name, dim, keys), (served, served_rows, _, held_rows)) in enumerate(
            zip(tables, plans, strict=True)
        ):
            rows = np.empty((len(keys), dim), np.float32)
            rows[served] = served_rows
            rows[~served] = cache.answer(
                name, asked[i][2], out[i], versions[i], unchanged[i], held_rows, step
            )
            whole.append(rows)
        cache.fit(step)
        return whole

    def push(self, tables: dict[str, tuple[int, np.ndarray, np.ndarray]]) -> None:
        """One training step of this worker for many tables: {name: (dim, keys, grads)}."""
        with self._lock:
            self._send_unsent_pushes()
            future = self._start_push(tables)
        future.result()

    def flush(self) -> None:
        """Sends the pushes of a step not complete yet and waits for all pushes."""
        with self._lock:
            self._send_unsent_pushes()
        self._raise_push_errors(wait_all=True)

    def _start_push(
        self, tables: dict[str, tuple[int, np.ndarray, np.ndarray]]
    ) -> concurrent.futures.Future[None]:
        """Queues the push of the next step (caller holds `_lock`)."""
        self._step += 1
        future = self._pusher.submit(self._push_step, self._step, tables)
        with self._in_flight_lock:
            self._in_flight.append(future)
        if self._ahead:  # the next step's keys are known: read its rows now
            coming, step = self._ahead.popleft(), self._step + 1
            self._read_ahead = (step, coming, self._reader.submit(self._pull, coming, False, step))
        return future

    def _push_step(self, step: int, tables: dict[str, tuple[int, np.ndarray, np.ndarray]]) -> None:
        # Every shard hears of every table of the step (maybe with no keys),
        # so all shards advance their step and optimizer iterations together.
        def make(layout: RangeLayout) -> list[Any]:
            split = {n: layout.split(k) for n, (_, k, _) in tables.items()}
            return [
                protocol.push_request(
                    self.worker_index,
                    step,
                    self._encoding,
                    [
                        (name, keys[split[name][shard]], grads[split[name][shard]])
                        for name, (_, keys, grads) in sorted(tables.items())
                    ],
                )
                for shard in range(len(layout.ids))
            ]

        start = time.perf_counter()
        self._per_range("Push", make)
        self._time("pushes", "push_seconds", time.perf_counter() - start)

    def _time(self, count: str, total: str, seconds: float) -> None:
        with self._lock:
            self._timings[count] += 1
            self._timings[total] += seconds

    def timings(self) -> dict[str, float]:
        """Pulls and pushes made so far (steps' Pull and Push rounds over the shards, each
        counted once) and their seconds, from send to the last shard's answer."""
        with self._lock:
            return dict(self._timings)

    def _raise_push_errors(self, wait_all: bool = False) -> None:
        """Surfaces failed background pushes; bounds (or drains) those in flight."""
        while True:
            with self._in_flight_lock:
                if not self._in_flight or not (
                    wait_all or self._in_flight[0].done() or len(self._in_flight) > _PUSHES_AHEAD
                ):
                    return
                future = self._in_flight.popleft()
            future.result()

    # The layers' fused path (`RemoteTable.step_fusion`, `elastic_emb.ps.client.remote_table`).

    def submit(
        self, table: str, dim: int, keys: np.ndarray, insert: bool, expects_push: bool
    ) -> int:
        """Queues a layer's pull of unique `keys`; returns the ticket for `collect`."""
        with self._lock:
            self._next_ticket += 1
            ticket = _Ticket(table, dim, keys, insert, expects_push)
            self._tickets[self._next_ticket] = ticket
            self._unsent.append(ticket)
            return self._next_ticket

    def collect(self, ticket_id: int) -> np.ndarray:
        """The rows of a ticket; the first collect of a step pulls for every queued ticket."""
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
            tables = [(t.table, t.dim, t.keys) for t in group]
            try:
                rows = self._rows_read_ahead(tables) if insert else None
                if rows is None:
                    rows = self.pull(tables, insert)
            except BaseException as e:
                for t in group:
                    assert t.future is not None
                    t.future.set_exception(e)
                raise
            for t in group:
                assert t.future is not None
                if not t.future.done():
                    t.future.set_result(rows)

    def prefetch(self, tables: _Tables) -> None:
        """The distinct keys of a coming training step, as its lookups will submit them.

        Once the step before it is pushed, its rows are read (without
        inserting unseen keys: their initial values come back, and the step's
        push inserts them) while that step ends; the step's collect takes
        them if it asks for exactly these keys, else pulls as usual. The
        shards answer such a read only once the step before it is applied
        (sync) or has arrived (async), as they answer the step's own pull:
        the rows are the same. `ee.lookahead` calls this from the input
        pipeline. Ignored with `read_from_backups` (backups may lag).
        """
        if self.read_from_backups:
            return
        with self._lock:
            self._ahead.append(tables)

    def _rows_read_ahead(self, tables: _Tables) -> list[np.ndarray] | None:
        """The rows read ahead for this step's `tables`; None if none were."""
        with self._lock:
            if self._ahead and _same_tables(self._ahead[0], tables):
                self._ahead.popleft()  # came before its step's predecessor was pushed
            read, self._read_ahead = self._read_ahead, None
            step = self._step + 1
        if read is None or read[0] != step or not _same_tables(read[1], tables):
            return None
        try:
            rows = read[2].result()
        except Exception as e:  # the step pulls instead (which raises if the cause lasts)
            log.debug("rows read ahead for step %d failed: %s", step, e)
            return None
        with self._lock:
            self.steps_read_ahead += 1
        return rows

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
        """Starts the push of the current step's gradients (caller holds `_lock`)."""
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


def _same_tables(a: _Tables, b: _Tables) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] and x[1] == y[1] and np.array_equal(x[2], y[2])
        for x, y in zip(a, b, strict=True)
    )
