"""`Servicer`: the gRPC face of one shard (decode, call the `Shard`, encode, count).

Errors: a request the shard refuses (`RequestError`), a malformed message
(`protocol.WireError`) or an argument the C++ core rejects is answered with
its status (INVALID_ARGUMENT, NOT_FOUND, ...) and the shard's message. Any
other exception is a bug of the shard: it is logged with its traceback and
answered INTERNAL. A refused or malformed request changes nothing; after a
bug the shard keeps serving, but a multi-table push or a save may have been
applied in part.
"""

from __future__ import annotations

import bisect
import collections
import copy
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError

from elastic_emb import _core
from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.ps.coord.balance import LoadMeter, Usage
from elastic_emb.ps.server.audit import AuditLog, summary
from elastic_emb.ps.server.resources import resident_bytes
from elastic_emb.ps.server.shard import Ranges, RequestError, Shard, invalid
from elastic_emb.ps.wire import protocol
from elastic_emb.ps.wire.security import Caller, Tokens
from elastic_emb.tables.sharding import NUM_SLOTS
from elastic_emb.tables.table import DENSE_TABLE_PREFIX

if TYPE_CHECKING:
    from elastic_emb.ps.server.replication import Replica

__all__ = ["Servicer", "add_to_server"]

log = logging.getLogger("elastic_emb.server")

_VALIDATION_ERRORS = (protocol.WireError, _core.InvalidArgument)


# The calls an audit log records (`elastic_emb.ps.server.audit`): the administrative
# ones that change what a server holds or how it trains.
AUDITED = frozenset(
    ("CreateTables", "Join", "Leave", "ImportRows", "EraseRows", "Save", "Restore",
     "InstallSnapshot", "MoveIn")
)  # fmt: skip

# Refusals of access control, audited whatever the call.
_AUTH_CODES = ("UNAUTHENTICATED", "PERMISSION_DENIED")

# Upper bounds (seconds) of the RPC latency histogram's buckets (`metrics`).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class _MethodStats:
    def __init__(self) -> None:
        self.calls = self.errors = self.request_bytes = self.response_bytes = 0
        self.seconds = self.max_seconds = 0.0
        self.latency = [0] * (len(LATENCY_BUCKETS) + 1)  # per bucket, then above the last
        self.codes: collections.Counter[str] = collections.Counter()  # errors by status code


def _refusal(method: str, e: Exception) -> tuple[str, str]:
    """The status code and message that answer a request which raised `e`."""
    if isinstance(e, RequestError):
        return e.code, str(e)
    if isinstance(e, _VALIDATION_ERRORS):
        return "INVALID_ARGUMENT", str(e)
    log.exception("%s failed", method)  # a bug: the shard keeps serving
    return "INTERNAL", f"{type(e).__name__}: {e}"


def _rpc(method: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a servicer method: errors become statuses, calls are counted."""
    name = method.__name__

    def handler(self: Servicer, request: Any, context: grpc.ServicerContext) -> Any:
        start = time.perf_counter()
        response = None
        code = "UNKNOWN"  # what an exception that is none of these leaves (context.abort's)
        caller = None
        try:
            if self.tokens is not None:
                caller = self._caller(name, context)
            if isinstance(request, MalformedRequest):
                raise invalid(request.problem)
            if caller is not None:
                self._authorize(caller, name, request)
            response = method(self, request)
            return response
        except Exception as e:
            code, message = _refusal(name, e)
            context.abort(grpc.StatusCode[code], message)
        finally:
            self._record(name, time.perf_counter() - start, None if response is not None else code)
            if self.audit is not None and (name in AUDITED or code in _AUTH_CODES):
                who = "anonymous" if caller is None else caller.name
                self._audit(name, request, context, who, "OK" if response is not None else code)

    handler.__name__ = name
    return handler


_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def _data_rpc(name: str) -> Callable[..., bytes]:
    """The gRPC handler of a data method (`protocol.DATA_PLANE_METHODS`): its bytes go the
    data plane's way (`Servicer.serve_data`); gRPC only carries them."""

    def handler(self: Servicer, raw: bytes, context: grpc.ServicerContext) -> bytes:
        caller, refused = "anyone", None
        if self.tokens is not None:
            try:
                found = self._caller(name, context)
                caller = f"{found.role} {found.name}"
            except RequestError as e:
                refused = e
        if refused is not None:
            self._record(name, 0.0, refused.code, received=len(raw))
            self._audit(name, raw, context, "anonymous", refused.code)
            context.abort(grpc.StatusCode[refused.code], str(refused))
        left = context.time_remaining()
        code, response = self.serve_data(name, raw, caller, 3600.0 if left is None else left)
        if code != "OK":
            context.abort(grpc.StatusCode[code], response.decode())
        return response

    handler.__name__ = name
    return handler


class Servicer(ps_pb2_grpc.ParameterServerServicer):
    """The ParameterServer service over a server's `Ranges` (one `Shard` each). Thread-safe.

    A request names its slot range (`range`, 0 without a coordinator). With
    a `replica` (a server started with a coordinator), only the primary of
    the range's group serves pulls, pushes and saves, and it replicates
    every change (the requests of `replication.REPLICATED_METHODS`) to its
    backups. Any replica answers the reads of DescribeTables, ExportRows and
    Metadata (a backup's answer may miss the changes still in flight).
    """

    def __init__(self) -> None:
        self.ranges = Ranges()
        self.replica: Replica | None = None  # set once, before it joins the coordinator
        self.audit: AuditLog | None = None  # set once, before the server starts
        self.tokens: Tokens | None = None  # set once, before the server starts
        self.load: LoadMeter | None = None  # set once, before the server starts
        self.memory_budget = 0  # bytes the tables may take (`serve --memory-budget`)
        self._changes = 0  # change requests applied here (guarded by _stats_lock)
        # Pulls Python answered after waiting for other workers (the sync barrier, a
        # staleness bound) and their seconds (guarded by _stats_lock).
        self._pull_waits, self._pull_wait_seconds = 0, 0.0
        self._stats_lock = threading.Lock()
        self._stats: collections.defaultdict[str, _MethodStats] = collections.defaultdict(
            _MethodStats
        )  # guarded by _stats_lock
        self.data_port = 0  # the data plane's port (`data_plane.DataPlane`); 0: none
        # The data plane's own counts (`DataPlane.counters`), set once it listens.
        self.data_plane_counters: Callable[[], dict[str, int]] | None = None
        self._raw_methods: dict[str, Callable[[bytes], bytes]] = {
            "Pull": self._pull, "Push": self._push,
            "PullRanges": self._pull_ranges, "PushRanges": self._push_ranges,
            "Replicate": self._replicate,
        }  # fmt: skip

    @property
    def changes(self) -> int:
        """Change requests applied, by Python and by the data plane."""
        with self._stats_lock:
            return self._changes + self.ranges.native.changes

    def usage(self, cpu: float = 0.0) -> Usage:
        """Rows, the tables' bytes against the budget, resident bytes, keys/s over the load
        window (`elastic_emb.ps.server.resources`); `cpu`: the caller's measured rate."""
        tables = self.ranges.tables()
        keys = 0.0
        if self.load is not None:
            keys = float(self.load.rates()[1][0].sum())
        return Usage(
            rows=sum(len(t) for t in tables),
            memory_bytes=sum(t.memory_in_use() for t in tables),
            memory_budget=self.memory_budget,
            resident_bytes=resident_bytes(),
            cpu=cpu,
            keys=keys,
        )

    def _record(
        self, method: str, elapsed: float, error: str | None, received: int = 0, sent: int = 0
    ) -> None:
        """Counts a call: its latency, its status code if it failed, and (data plane) its
        request's and answer's bytes."""
        with self._stats_lock:
            stats = self._stats[method]
            stats.request_bytes += received
            stats.response_bytes += sent
            stats.calls += 1
            stats.seconds += elapsed
            stats.max_seconds = max(stats.max_seconds, elapsed)
            stats.latency[bisect.bisect_left(LATENCY_BUCKETS, elapsed)] += 1
            if error is not None:
                stats.errors += 1
                stats.codes[error] += 1

    def _count_wait(self, seconds: float) -> None:
        with self._stats_lock:
            self._pull_waits += 1
            self._pull_wait_seconds += seconds

    def pull_waits(self) -> tuple[int, float]:
        """Pulls that waited for other workers' pushes, and their seconds, on both planes."""
        waits, seconds = self.ranges.native.waits
        with self._stats_lock:
            return self._pull_waits + waits, self._pull_wait_seconds + seconds

    def _caller(self, method: str, context: Any) -> Caller:
        """The caller whose token a call carries; RequestError without a valid one."""
        if self.tokens is None:
            raise RuntimeError("tokens are checked only on a server started with --auth-tokens")
        caller = self.tokens.caller(context.invocation_metadata())
        if caller is None:
            raise RequestError(
                "UNAUTHENTICATED",
                f"{method}: no valid token; this server requires one (ee.init(token=...))",
            )
        return caller

    def _authorize(self, caller: Caller, method: str, request: Any) -> None:
        """RequestError unless the caller's role allows the call."""

        def workers_may() -> bool:
            if method == "ImportRows":
                return request.table.startswith(DENSE_TABLE_PREFIX) and not request.replace
            if all(t.name.startswith(DENSE_TABLE_PREFIX) for t in request.tables):
                return True
            shard = self.ranges.find(request.range)
            return shard is not None and all(shard.has_table(t.name) for t in request.tables)

        if not Tokens.allows(caller, method, workers_may):
            raise RequestError(
                "PERMISSION_DENIED",
                f"{method} needs the admin role; {caller.name!r} has the {caller.role} role "
                "(workers may train on tables that exist and create and fill those of dense "
                "weights; an admin creates, imports, erases, saves and restores them)",
            )

    def _audit(self, method: str, request: Any, context: Any, caller: str, result: str) -> None:
        """Records an administrative call in the audit log (never fails the call)."""
        try:
            if isinstance(request, bytes):  # protocol.RAW_METHODS
                args: dict[str, Any] = {"bytes": len(request)}
            elif isinstance(request, MalformedRequest):
                args = {"malformed": request.problem}
            else:
                args = summary(request) if hasattr(request, "ListFields") else {"stream": True}
            if self.audit is not None:
                self.audit.record(method, context.peer(), caller, args, result)
        except Exception:  # the call's outcome stands; the operator sees the failure
            log.exception("cannot write the audit record of %s", method)

    def method_stats(self) -> dict[str, _MethodStats]:
        """A copy of each method's counts (`metrics`), the data plane's calls included."""
        with self._stats_lock:
            stats = {name: copy.deepcopy(m) for name, m in self._stats.items()}
        for name, native in self.ranges.native.counts().items():
            m = stats.setdefault(name, _MethodStats())
            m.calls += native["calls"]
            m.errors += native["errors"]
            m.request_bytes += native["request_bytes"]
            m.response_bytes += native["response_bytes"]
            m.seconds += native["seconds"]
            m.max_seconds = max(m.max_seconds, native["max_seconds"])
            m.latency = [a + b for a, b in zip(m.latency, native["latency"], strict=True)]
            m.codes.update(native["codes"])
        return stats

    def count_bytes(self, method: str, received: int = 0, sent: int = 0) -> None:
        """Adds to a method's request and response bytes (see `add_to_server`)."""
        with self._stats_lock:
            stats = self._stats[method]
            stats.request_bytes += received
            stats.response_bytes += sent

    # The data methods (`protocol.DATA_PLANE_METHODS`), whichever transport brought them:
    # the data plane (`elastic_emb.ps.server.data_plane`) or gRPC (`_data_rpc`).

    def serve_data(
        self, method: str, raw: bytes, caller: str = "anyone", seconds: float = 3600.0
    ) -> tuple[str, bytes]:
        """Answers a data method's request as the data plane does: C++ what it can
        (`_core.ServerCore.serve`, waiting up to `seconds` for a parked one), Python the
        rest (`serve_raw`). (status code name, response bytes or message)."""
        from_peer = not caller.startswith("worker ")  # (a worker may not send changes)
        native = self.ranges.native.serve(
            protocol.DATA_PLANE_METHODS[method], raw, from_peer, seconds
        )
        if native is None:
            return self.serve_raw(method, raw, caller)
        status, response = native
        return _CODE_NAMES[status], response

    def serve_raw(self, method: str, raw: bytes, caller: str = "anyone") -> tuple[str, bytes]:
        """Answers in Python a Pull, Push, PullRanges, PushRanges or Replicate that C++ left
        to it: (status code name, response bytes or message). The caller's token was checked
        (a data-plane connection's when it connected, `authenticate`, which named the
        `caller`); every role may call the first four."""
        start = time.perf_counter()
        try:
            if method not in protocol.RAW_METHODS and caller != "anyone":
                role, _, name = caller.partition(" ")
                self._authorize_data_plane(Caller(name, role), method)
            response = self._raw_methods[method](raw)
        except Exception as e:
            code, message = _refusal(method, e)
            self._record(method, time.perf_counter() - start, code, received=len(raw))
            return code, message.encode()
        self._record(method, time.perf_counter() - start, None, len(raw), len(response))
        return "OK", response

    def authenticate(self, token: str, peer: str) -> tuple[bool, str]:
        """A data-plane connection's token: (True, the caller's name) or (False, why not);
        the refusal is audited like a gRPC call's."""
        if self.tokens is None:
            return True, "anyone"
        caller = self.tokens.find(token)
        if caller is not None:
            return True, f"{caller.role} {caller.name}"
        if self.audit is not None:
            self.audit.record("Connect", peer, "anonymous", {}, "UNAUTHENTICATED")
        return False, "data plane: no valid token; this server requires one (ee.init(token=...))"

    def _authorize_data_plane(self, caller: Caller, method: str) -> None:
        """`_authorize` for a data-plane call; a refusal is audited like a gRPC call's."""
        try:
            self._authorize(caller, method, None)
        except RequestError as e:
            if self.audit is not None:
                self.audit.record(method, "data plane", caller.name, {}, e.code)
            raise

    def _tables_response(self, tables: list[Any]) -> ps_pb2.TablesResponse:
        return ps_pb2.TablesResponse(tables=[protocol.table_info(t) for t in tables])

    def _change(self, method: str, request: Any) -> Any:
        """A request that changes a range: applied here, and by every backup."""
        if self.replica is None:
            return self.apply_change(method, request)
        return self.replica.replicate(method, request, lambda: self.apply_change(method, request))

    def apply_change(self, method: str, request: Any) -> Any:
        """Applies a change request; its response."""
        with self._stats_lock:
            self._changes += 1
        return getattr(self, f"_{method}")(request)

    def _shard(self, request: Any, serving: bool = False, read_only: bool = False) -> Shard:
        """The shard of the request's range; `serving`: only if this server serves it now.

        With a coordinator, only the primary of the range's group serves
        workers (a backup too, for `read_only` requests).
        """
        if serving and self.replica is not None:
            self.replica.check_primary(request.range, backup_too=read_only)
        return self.ranges.get(request.range)

    # Tables.

    @_rpc
    def CreateTables(self, request: ps_pb2.CreateTablesRequest) -> ps_pb2.TablesResponse:
        return self._change("CreateTables", request)

    def _CreateTables(self, request: ps_pb2.CreateTablesRequest) -> ps_pb2.TablesResponse:
        return self._tables_response(self._shard(request).create(protocol.table_configs(request)))

    @_rpc
    def DescribeTables(self, request: ps_pb2.DescribeTablesRequest) -> ps_pb2.TablesResponse:
        return self._tables_response(self._shard(request).tables(list(request.names)))

    # Training.

    @_rpc
    def Join(self, request: ps_pb2.JoinRequest) -> ps_pb2.JoinResponse:
        return self._change("Join", request)

    def _Join(self, request: ps_pb2.JoinRequest) -> ps_pb2.JoinResponse:
        step = self._shard(request).join(
            request.worker,
            request.num_workers,
            request.mode,
            request.staleness,
            request.elastic,
            request.again,
        )
        return ps_pb2.JoinResponse(step=step)

    @_rpc
    def Leave(self, request: ps_pb2.LeaveRequest) -> ps_pb2.JoinResponse:
        return self._change("Leave", request)

    def _Leave(self, request: ps_pb2.LeaveRequest) -> ps_pb2.JoinResponse:
        return ps_pb2.JoinResponse(step=self._shard(request).leave(request.worker))

    def worker_gone(self, worker: int) -> None:
        """A worker's lease ended (the primary hears it from the coordinator)."""
        for range_id, _ in self.ranges.items():
            try:
                self._change("Leave", ps_pb2.LeaveRequest(worker=worker, range=range_id))
            except RequestError as e:
                log.info("worker %d left; not recorded in range %d: %s", worker, range_id, e)

    # Pull, Push and their *Ranges arrive as bytes and are answered with bytes: where C++
    # does not answer them (`serve_data`), parsed, gathered or applied, and encoded by one
    # C++ call (`_core.PullMessage`, `PushMessage`); what is per request, not per key, here.

    Pull = _data_rpc("Pull")
    PullRanges = _data_rpc("PullRanges")
    Push = _data_rpc("Push")
    PushRanges = _data_rpc("PushRanges")

    def _pull_ranges(self, raw: bytes) -> bytes:
        return _core.join_parts([self._pull(part) for part in _core.request_parts(raw)])

    def _pull(self, raw: bytes) -> bytes:
        cpu = time.thread_time()
        message = protocol.pull_message(raw)
        # train=False inserts nothing: a backup may answer it.
        shard = self._shard(message, serving=True, read_only=not message.train)
        if message.encoding not in protocol.ENCODINGS.values():
            raise invalid(f"Unknown encoding {message.encoding}")
        timeout = message.timeout_ms / 1000 if message.timeout_ms > 0 else 3600.0
        response = shard.pull(message, timeout, self._count_wait)
        self._count_load(message, len(raw) + len(response), cpu)
        return response

    def _push_ranges(self, raw: bytes) -> bytes:
        return _core.join_parts([self._push(part) for part in _core.request_parts(raw)])

    def _push(self, raw: bytes) -> bytes:
        cpu = time.thread_time()
        message = protocol.push_message(raw)
        response = self._change("Push", message).SerializeToString()
        self._count_load(message, len(raw) + len(response), cpu)
        return response

    def _count_load(self, message: Any, nbytes: int, cpu: float) -> None:
        """Adds a served Pull or Push to the per-slot load (`elastic_emb.ps.coord.balance`)."""
        if self.load is not None:
            counts = message.count_by_slot(NUM_SLOTS)
            self.load.record_counts(counts, nbytes, time.thread_time() - cpu)

    def _Push(self, request: Any) -> ps_pb2.PushResponse:
        message = protocol.push_message(request)
        return ps_pb2.PushResponse(step=self._shard(message).push(message))

    # Row access.

    @_rpc
    def ImportRows(self, request: ps_pb2.ImportRowsRequest) -> ps_pb2.ImportRowsResponse:
        return self._change("ImportRows", request)

    def _ImportRows(self, request: ps_pb2.ImportRowsRequest) -> ps_pb2.ImportRowsResponse:
        shard = self._shard(request)
        table = shard.table(request.table)
        if request.replace:
            table.load_state(protocol.read_state(request, table.dim, table.num_slots))
        else:
            keys, values = protocol.imported_rows(request, table.dim)
            shard.check_keys([keys])
            table.import_rows(keys, values)
        return ps_pb2.ImportRowsResponse(rows=len(table))

    @_rpc
    def ExportRows(self, request: ps_pb2.ExportRowsRequest) -> ps_pb2.ExportRowsResponse:
        state = self._shard(request).table(request.table).export_state()
        return protocol.write_state(ps_pb2.ExportRowsResponse(), state, request.with_state)

    @_rpc
    def EraseRows(self, request: ps_pb2.EraseRowsRequest) -> ps_pb2.EraseRowsResponse:
        return self._change("EraseRows", request)

    def _EraseRows(self, request: ps_pb2.EraseRowsRequest) -> ps_pb2.EraseRowsResponse:
        table = self._shard(request).table(request.table)
        return ps_pb2.EraseRowsResponse(erased=table.erase(protocol.decode_keys(request.keys)))

    @_rpc
    def Metadata(self, request: ps_pb2.MetadataRequest) -> ps_pb2.MetadataResponse:
        table = self._shard(request).table(request.table)
        return protocol.metadata_response(*table.metadata(protocol.decode_keys(request.keys)))

    # Checkpoints.

    @_rpc
    def Save(self, request: ps_pb2.SaveRequest) -> ps_pb2.SaveResponse:
        shard = self._shard(request, serving=True)
        shard.check_slots((request.slot_begin, request.slot_end))
        rows, step, worker_steps = shard.save(
            request.directory,
            list(request.tables),
            incremental=request.incremental,
            max_deltas=request.max_deltas,
            after_step=request.after_step,
            hold=request.hold,
        )
        return ps_pb2.SaveResponse(rows=rows, step=step, worker_steps=worker_steps)

    @_rpc
    def Restore(self, request: ps_pb2.RestoreRequest) -> ps_pb2.TablesResponse:
        return self._change("Restore", request)

    def _Restore(self, request: ps_pb2.RestoreRequest) -> ps_pb2.TablesResponse:
        slots = (request.slot_begin, request.slot_end)
        shard = self._shard(request)
        shard.check_slots(slots)
        restored = shard.restore(
            list(request.directories),
            list(request.tables),
            request.num_shards,
            request.shard_index,
            request.num_slots,
            slots if request.slot_end > request.slot_begin else None,
        )
        return self._tables_response(restored)

    # Operations.

    @_rpc
    def Stats(self, request: ps_pb2.StatsRequest) -> ps_pb2.StatsResponse:
        methods = [
            ps_pb2.MethodStats(
                method=name,
                calls=m.calls,
                errors=m.errors,
                request_bytes=m.request_bytes,
                response_bytes=m.response_bytes,
                seconds=m.seconds,
                max_seconds=m.max_seconds,
            )
            for name, m in sorted(self.method_stats().items())
        ]
        waits, wait_seconds = self.pull_waits()
        tables = [protocol.table_info(t) for t in self.ranges.tables()]
        return ps_pb2.StatsResponse(
            methods=methods, tables=tables, step=self.ranges.step(), pull_waits=waits,
            pull_wait_seconds=wait_seconds,
        )  # fmt: skip

    @_rpc
    def Health(self, request: ps_pb2.HealthRequest) -> ps_pb2.HealthResponse:
        tables = self.ranges.tables()
        response = ps_pb2.HealthResponse(
            serving=True,
            step=self.ranges.step(),
            num_tables=len(tables),
            rows=sum(len(t) for t in tables),
            ranges=[range_id for range_id, _ in self.ranges.items()],
            data_port=self.data_port,
        )
        if self.replica is not None:
            if request.backup:
                self.replica.followed(request.backup, request.group, request.epoch)
            role, group, epoch, sequence = self.replica.status()
            response.role, response.group, response.epoch = role, group, epoch
            response.sequence = sequence
        return response

    # Replication.

    def _replica(self) -> Replica:
        if self.replica is None:
            raise RequestError(
                "FAILED_PRECONDITION", "this server was not started with --coordinator"
            )
        return self.replica

    Replicate = _data_rpc("Replicate")

    def _replicate(self, raw: bytes) -> bytes:
        """A Replicate that C++ left to Python."""
        try:
            request = ps_pb2.ReplicateRequest.FromString(raw)
        except DecodeError as e:
            raise invalid(protocol.malformed(raw, ps_pb2.ReplicateRequest.DESCRIPTOR, e)) from None
        return ps_pb2.ReplicateResponse(
            sequence=self._replica().on_replicate(request)
        ).SerializeToString()

    @_rpc
    def InstallSnapshot(self, request: Any) -> ps_pb2.InstallSnapshotResponse:
        return ps_pb2.InstallSnapshotResponse(
            rows=self._replica().install_snapshot(_parsed_chunks(request))
        )

    # Moving slot ranges between groups (`elastic_emb.ps.server.replication`).

    @_rpc
    def MoveIn(self, request: ps_pb2.MoveInRequest) -> ps_pb2.MoveInResponse:
        return self._replica().replicate(
            "MoveIn", request, lambda: self.apply_change("MoveIn", request)
        )

    def _MoveIn(self, request: ps_pb2.MoveInRequest) -> ps_pb2.MoveInResponse:
        return ps_pb2.MoveInResponse(rows=self._replica().move_in(request))

    def _ShrinkRange(self, request: ps_pb2.ShrinkRangeRequest) -> ps_pb2.TablesResponse:
        """The slots [slot, end) of a range moved to another group."""
        shard = self.ranges.get(request.range)
        if shard.slots is None or not shard.slots[0] < request.slot < shard.slots[1]:
            raise invalid(
                f"cannot shrink range {request.range} {shard.slots} to end at {request.slot}"
            )
        shard.shrink(request.slot)
        return ps_pb2.TablesResponse()

    def _DropRange(self, request: ps_pb2.DropRangeRequest) -> ps_pb2.TablesResponse:
        """A range that moved away is dropped (idempotent)."""
        shard = self.ranges.pop(request.range)
        if shard is not None:
            shard.retire(f"slot range {request.range} moved to another group")
        return ps_pb2.TablesResponse()


def add_to_server(servicer: Servicer, server: Any) -> None:
    """Registers `servicer` on a gRPC server, counting each message's bytes in its stats.

    The bytes are counted as gRPC parses requests and serializes responses,
    so no message is encoded a second time to measure it (`ByteSize()` costs
    as much as serializing: about 1 ms for a 0.8 MB pull response).
    """
    captured: list[Any] = []

    class Capture:
        def add_generic_rpc_handlers(self, handlers: Any) -> None:
            captured.extend(handlers)

    ps_pb2_grpc.add_ParameterServerServicer_to_server(servicer, Capture())
    server.add_generic_rpc_handlers(tuple(_ByteCounter(h, servicer) for h in captured))


class _ByteCounter(grpc.GenericRpcHandler):
    """A generic handler whose methods count the bytes they parse and serialize."""

    def __init__(self, handler: Any, servicer: Servicer) -> None:
        self._handler, self._servicer = handler, servicer

    def service(self, handler_call_details: Any) -> Any:
        handler = self._handler.service(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        parse, serialize = handler.request_deserializer, handler.response_serializer
        if method in protocol.DATA_PLANE_METHODS:  # (their handlers count their bytes)
            return handler._replace(request_deserializer=_as_is, response_serializer=_as_is)
        count = self._servicer.count_bytes
        service = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
        request_type = service.methods_by_name[method].input_type

        def counted_parse(raw: bytes) -> Any:
            count(method, received=len(raw))
            try:
                return parse(raw)
            except DecodeError as e:  # answered INVALID_ARGUMENT by the method (`_rpc`)
                return MalformedRequest(protocol.malformed(raw, request_type, e))

        def counted_serialize(message: Any) -> bytes:
            raw = serialize(message)
            count(method, sent=len(raw))
            return raw

        return handler._replace(
            request_deserializer=counted_parse, response_serializer=counted_serialize
        )


def _as_is(raw: bytes) -> bytes:
    return raw


class MalformedRequest:
    """A request that did not parse: what its method answers instead (INVALID_ARGUMENT)."""

    def __init__(self, problem: str) -> None:
        self.problem = problem


def _parsed_chunks(chunks: Iterable[Any]) -> Iterator[Any]:
    """A stream's messages; INVALID_ARGUMENT at the first that did not parse."""
    for chunk in chunks:
        if isinstance(chunk, MalformedRequest):
            raise invalid(chunk.problem)
        yield chunk
