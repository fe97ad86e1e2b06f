"""`Cluster`: this worker's training-step protocol with the PS shards.

Created by `ee.init(ps=[...])`. Keys go to shards by `elastic_emb.tables.sharding`.
The layers of a model fuse their traffic: every table of a training step
travels in one Pull and one Push per shard, shards are called concurrently,
and pushes leave in step order on a background thread while training goes
on (a later pull waits for them as the mode requires, on the shard).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from elastic_emb._proto import ps_pb2
from elastic_emb.errors import ModeMismatchError
from elastic_emb.ps.client.fused_pull import FusedPull, Tables, one_entry_per_table
from elastic_emb.ps.client.push_queue import PushQueue, StepGradients
from elastic_emb.ps.client.range_router import RangeRouter
from elastic_emb.ps.client.read_ahead import ReadAhead
from elastic_emb.ps.client.round_timings import RoundTimings
from elastic_emb.ps.client.row_cache import RowCache
from elastic_emb.ps.client.shard_admin import ShardAdmin
from elastic_emb.ps.client.step_fuser import StepFuser
from elastic_emb.ps.wire import protocol
from elastic_emb.ps.wire.security import ClientSecurity
from elastic_emb.tables.sharding import RangeLayout

if TYPE_CHECKING:
    from elastic_emb.ps.client.routing import Routing

__all__ = ["MODES", "Cluster", "ClusterOptions"]

log = logging.getLogger("elastic_emb")

MODES = ("async", "sync")
# With a coordinator: a worker that stops renewing its lease for this long has left.
WORKER_LEASE_SECONDS = 3
# ... and a worker starting waits this long for a primary to answer before it reads the
# map again (the primary may have died; a backup takes its place).
MAP_RECHECK_SECONDS = 2.0


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
    worker_lease_seconds: int = WORKER_LEASE_SECONDS
    data_plane: str = "native"
    refused_timeout: float | None = None  # a shard refusing connections: fail after this

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
        if self.data_plane not in protocol.DATA_PLANES:
            raise ValueError(
                f"`data_plane` must be one of {protocol.DATA_PLANES}. "
                f"Received: data_plane={self.data_plane!r}"
            )
        lease = self.worker_lease_seconds
        if isinstance(lease, bool) or not isinstance(lease, int) or lease < 2:
            raise ValueError(
                "`worker_lease_seconds` must be an integer >= 2 (etcd's shortest lease). "
                f"Received: worker_lease_seconds={lease!r}"
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

    The parts, each thread-safe itself: `RangeRouter` (ranges, servers,
    failover), `ShardAdmin` (tables, checkpoints), `FusedPull` (pulls through
    the row cache), `PushQueue` (pushes in step order), `ReadAhead` (the next
    step's rows) and `StepFuser` (tickets, the step counter).

    Raises:
        ValueError: invalid arguments.
        ConnectionError: a shard did not answer within `connect_timeout`.
        ModeMismatchError: the job runs in another mode (a `ValueError`).
        RuntimeError: the shards are at different steps (sync mode).
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
        self.worker_index = options.worker_index
        self.num_workers = options.num_workers
        self.timeout = float(options.timeout)
        self._encoding = protocol.encoding(options.wire_dtype)
        self.routing = routing
        self.failover_timeout = options.failover_timeout
        self.read_from_backups = options.read_from_backups
        # The worker's cache of pulled rows (`ee.init(cache_rows=...)`), or None.
        self.cache = (
            RowCache(options.cache_rows, options.cache_staleness) if options.cache_rows else None
        )
        # The parts (set here, read-only after; each thread-safe itself).
        self._router = RangeRouter(
            addresses,
            routing,
            self.timeout,
            security,
            options.failover_timeout,
            options.read_from_backups,
            options.data_plane,
        )
        self.shards = self._router.shards
        self._timings = RoundTimings()
        self._puller = FusedPull(
            self._router, self.worker_index, self._encoding, self.timeout, self.cache, self._timings
        )
        self._pushes = PushQueue(self._router, self.worker_index, self._encoding, self._timings)
        self._read_ahead = ReadAhead(self._puller.pull, enabled=not options.read_from_backups)
        try:
            step = self._join(options.connect_timeout)
        except BaseException:
            self._close_connections()
            raise
        self._fuser = StepFuser(step, self._puller, self._pushes, self._read_ahead)
        self._router.join_again = self._join_again
        self._admin = ShardAdmin(self._router, self._fuser.flush, self.cache)

    def _join(self, connect_timeout: float) -> int:
        """Connects, registers this worker (elastic) and joins every shard; their step."""
        options, routing = self.options, self.routing
        if routing is None:
            self.shards.connect(connect_timeout, options.refused_timeout)
        else:
            self._connect_to_primaries(routing, connect_timeout)
        if routing is not None:  # elastic: no step waits for this worker once it is gone
            routing.fix_mode(options.mode, options.staleness)  # (a clear error first)
            routing.register_worker(self.worker_index, options.worker_lease_seconds)
        join = protocol.join_request(
            self.worker_index,
            self.num_workers,
            options.mode,
            options.staleness,
            elastic=routing is not None,
        )
        deadline, attempt = time.monotonic() + connect_timeout, 0
        while True:
            attempt += 1
            try:
                steps = {r.step for r in self._router.broadcast("Join", join)}
            except ModeMismatchError as e:
                raise ModeMismatchError(
                    f"elastic_emb: the parameter servers run another job than this worker "
                    f"asked for ({e}).\nThe first worker's ee.init fixed the job's mode"
                    + ("" if routing else " and num_workers")
                    + ": give every worker the same, or start new servers for a new job "
                    "(docs/fault-tolerance.md)"
                ) from None
            if routing is not None:
                routing.fix_mode(options.mode, options.staleness, record=True)
            self.shards.connect_data_plane()  # (once joined: its token was accepted)
            if len(steps) == 1:
                return steps.pop()
            if options.mode == "async":
                # This worker's last run died while a push had reached some ranges only:
                # go on from the step every range has; the ranges ahead skip its re-sends.
                return min(steps)
            # Elastic sync: a step the others pushed may be applied on some shards and not
            # yet on others. Leave (no step waits for this worker, which pushed nothing),
            # let the step finish everywhere, and join again.
            if routing is None or time.monotonic() > deadline:
                raise RuntimeError(f"PS shards {self.addresses} are at different steps {steps}")
            self._router.broadcast("Leave", ps_pb2.LeaveRequest(worker=self.worker_index))
            time.sleep(min(0.05 * attempt, 1.0))

    def _connect_to_primaries(self, routing: Routing, connect_timeout: float) -> None:
        """Waits until every range's primary answers, reading the map again while one does
        not: a primary that died as this worker started is replaced by the backup its
        coordinator promotes. ConnectionError (closed) after `connect_timeout`."""
        deadline = time.monotonic() + connect_timeout
        while True:
            layout = self._router.layout()
            primaries = [routing.primary_of(r) for r in layout.ids]
            left = deadline - time.monotonic()
            why = (
                "elastic_emb: a slot range has no primary in the coordinator's map (a "
                "failover under way, or no server started?)"
            )
            if all(primaries):
                attempt = min(max(left, 0.1), MAP_RECHECK_SECONDS)
                found = self.shards.unreachable(primaries, attempt, waited=connect_timeout)
                if found is None:
                    return
                why = found
            if time.monotonic() >= deadline:
                self.shards.close()
                raise ConnectionError(why)
            routing.wait_for_change(layout.version, 0.5)

    def _join_again(self, range_id: int) -> None:
        """A server no longer counts this worker (its lease lapsed, and the servers saw it
        leave): joins that range again, from this worker's own step. Its push of a sync step
        completed without it meanwhile is applied on its own: none is lost."""
        routing = self.routing
        if routing is None:
            raise RuntimeError("elastic_emb: only elastic workers join again")
        routing.check_registered()
        options = self.options
        join = protocol.join_request(
            self.worker_index,
            self.num_workers,
            options.mode,
            options.staleness,
            elastic=True,
            again=True,
        )
        step = self._router.call_range(range_id, "Join", join).step
        log.warning(
            "worker %d joined slot range %d again (its lease had lapsed) at the range's step "
            "%d; this worker is at step %d", self.worker_index, range_id, step, self.step,
        )  # fmt: skip

    @property
    def addresses(self) -> list[str]:
        return self.shards.addresses

    @property
    def num_shards(self) -> int:
        return len(self.layout().ids)

    @property
    def step(self) -> int:
        """Training steps this worker has pushed (queued)."""
        return self._fuser.step

    @property
    def steps_read_ahead(self) -> int:
        """Training steps whose rows were read ahead (`prefetch`)."""
        return self._read_ahead.steps_read

    def close(self) -> None:
        """Sends pending pushes, waits for them, leaves (elastic), closes the connections."""
        try:
            self.flush()
            if self.routing is not None:
                leave = ps_pb2.LeaveRequest(worker=self.worker_index)
                try:
                    self._router.broadcast("Leave", leave)
                except ConnectionError as e:  # the servers see this worker's lease end instead
                    log.warning("could not tell the servers that worker %d left: %s",
                                self.worker_index, e)  # fmt: skip
        finally:
            self._close_connections()

    def _close_connections(self) -> None:
        self._pushes.close()
        self._read_ahead.close()
        self.shards.close()
        if self.routing is not None:
            self.routing.close()

    def layout(self) -> RangeLayout:
        """The slot ranges as the coordinator's map has them now (fixed without one)."""
        return self._router.layout()

    # Tables (`ShardAdmin`).

    def create_tables(self, configs: list[dict[str, Any]]) -> list[Any]:
        """Creates the tables on every shard (or checks they exist alike); their TableInfo."""
        return self._admin.create_tables(configs)

    def describe(self, name: str) -> list[Any]:
        """The table's TableInfo on each shard."""
        return self._admin.describe(name)

    def server_stats(self) -> list[Any]:
        """Each shard's StatsResponse (with a coordinator: the server of each slot range)."""
        return self._admin.server_stats()

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
        return self._admin.save_tables(directories, names, incremental, max_deltas, after)

    def slot_ranges(self) -> list[tuple[int, int]]:
        """The slots [begin, end) each shard owns."""
        return self._admin.slot_ranges()

    def restore_tables(self, directory: str, names: list[str]) -> None:
        """Each shard loads the rows it owns of the named tables from a checkpoint."""
        self._admin.restore_tables(directory, names)

    def per_shard(self, method: str, make: Any, timeout: float | None = None) -> list[Any]:
        """`make(i)`'s request to every shard i, after this worker's pushes have landed."""
        return self._admin.per_shard(method, make, timeout)

    def by_range(self, method: str, keys: np.ndarray, make: Any) -> tuple[list[Any], list[Any]]:
        """`make(positions)`'s request to every shard, for its keys at `positions` of `keys`;
        (positions per shard, responses), after this worker's pushes have landed."""
        return self._admin.by_range(method, keys, make)

    def stats(self) -> list[dict[str, Any]]:
        """Client-side RPC count, bytes and latency per shard."""
        return self.shards.stats()

    def reset_stats(self) -> None:
        self.shards.reset_stats()

    def timings(self) -> dict[str, float]:
        """Pulls and pushes made so far (steps' Pull and Push rounds over the shards, each
        counted once) and their seconds, from send to the last shard's answer."""
        return self._timings.totals()

    # Pull and push, fused over tables (`StepFuser`, `FusedPull`).

    def pull(self, tables: Tables, insert: bool) -> list[np.ndarray]:
        """Rows of many tables in one request per shard: [(name, dim, keys)] -> [rows]."""
        return self._fuser.pull(tables, insert)

    def _pull(self, tables: Tables, insert: bool, step: int) -> list[np.ndarray]:
        """The rows of `tables` as of training step `step` (no wait for pushes)."""
        return self._puller.pull(tables, insert, step)

    def push(self, tables: StepGradients) -> None:
        """One training step of this worker for many tables: {name: (dim, keys, grads)}."""
        self._fuser.push(tables)

    def flush(self) -> None:
        """Sends the pushes of a step not complete yet and waits for all pushes."""
        self._fuser.flush()

    # The layers' fused path (`RemoteTable.step_fusion`, `elastic_emb.ps.client.remote_table`).

    def submit(
        self, table: str, dim: int, keys: np.ndarray, insert: bool, expects_push: bool
    ) -> int:
        """Queues a layer's pull of unique `keys`; returns the ticket for `collect`."""
        return self._fuser.submit(table, dim, keys, insert, expects_push)

    def collect(self, ticket_id: int) -> np.ndarray:
        """The rows of a ticket; the first collect of a step pulls for every queued ticket."""
        return self._fuser.collect(ticket_id)

    def prefetch(self, tables: Tables) -> None:
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
        self._read_ahead.announce(one_entry_per_table(tables)[0])  # as the step pulls them

    def push_gradient(self, table: str, dim: int, keys: np.ndarray, grads: np.ndarray) -> None:
        """A layer's gradient; the step is pushed when all layers that pulled have pushed."""
        self._fuser.push_gradient(table, dim, keys, grads)
