"""One parameter-server shard: a gRPC server over the in-process C++ tables.

`elastic-emb serve --port PORT` runs `serve()`. The shard holds any number of
tables (created by the workers), answers fused Pull and Push requests,
applies the training mode the workers joined with (sync, async or bounded
staleness), and writes and reads its own checkpoint files. A malformed
request is answered with an error status and changes nothing.
"""

from __future__ import annotations

import collections
import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from elastic_emb import checkpoint, remote, sharding, wire
from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.table import Table, TableState, unregister

__all__ = ["ParameterServer", "serve"]

log = logging.getLogger("elastic_emb.server")


class _Status(Exception):
    """An error answered with a gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _invalid(message: str) -> _Status:
    return _Status(grpc.StatusCode.INVALID_ARGUMENT, message)


class _MethodStats:
    def __init__(self) -> None:
        self.calls = self.errors = self.request_bytes = self.response_bytes = 0
        self.seconds = self.max_seconds = 0.0


class _Steps:
    """Training-mode bookkeeping: who pushed which step, what is applied."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.mode: int | None = None  # set by the first Join
        self.num_workers = 1
        self.staleness = -1
        self.pushed: dict[int, int] = {}  # worker -> last step pushed
        self.applying: set[int] = set()  # ASYNC: workers whose push is being applied
        self.applied = 0  # SYNC: steps applied
        # SYNC: step -> (workers that pushed it, table -> [(keys, grads)])
        self.pending: dict[int, tuple[set[int], dict[str, list[tuple[np.ndarray, np.ndarray]]]]]
        self.pending = {}

    def step(self) -> int:
        if self.mode == ps_pb2.SYNC:
            return self.applied
        return max(self.pushed.values(), default=0)

    def wait_for(self, worker: int, step: int, timeout: float) -> None:
        """Blocks a pull for `step` until the mode allows it (call under `cond`).

        Always: the worker's own push of step - 1 has arrived (it may still be
        in flight). SYNC: step - 1 is applied. Bounded staleness s: every
        worker has pushed step - 1 - s.
        """
        deadline = time.monotonic() + timeout
        while True:
            late, what = self._late(worker, step)
            if not late:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Status(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"worker {worker} waited {timeout:g} s to pull step {step}: {what}; workers "
                    f"{late} have not pushed it (stopped or dead?). Steps pushed: "
                    f"{dict(sorted(self.pushed.items()))}",
                )
            self.cond.wait(left)

    def _late(self, worker: int, step: int) -> tuple[list[int], str]:
        """Workers whose pushes a pull of `step` by `worker` still waits for, and why."""
        if self.pushed.get(worker, 0) < step - 1:
            return [worker], f"its own push of step {step - 1} has not arrived"
        if self.mode == ps_pb2.SYNC:
            needed, what = step - 1, f"step {step - 1} must be applied"
        elif self.mode == ps_pb2.ASYNC and self.staleness >= 0:
            needed = step - 1 - self.staleness
            what = f"staleness {self.staleness}: every worker must have pushed step {needed}"
        else:
            return [], ""
        if needed <= 0 or (self.mode == ps_pb2.SYNC and self.applied >= needed):
            return [], ""
        return [w for w in range(self.num_workers) if self.pushed.get(w, 0) < needed], what


def _rpc(method: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a servicer method: errors become statuses, calls are counted."""
    name = method.__name__

    def handler(self: ParameterServer, request: Any, context: grpc.ServicerContext) -> Any:
        start = time.perf_counter()
        response = None
        try:
            response = method(self, request)
            return response
        except _Status as e:
            context.abort(e.code, str(e))
        except (ValueError, KeyError, TypeError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:  # the shard keeps serving whatever went wrong
            log.exception("%s failed", name)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        finally:
            elapsed = time.perf_counter() - start
            with self._stats_lock:
                self._record(self._stats[name], elapsed, request, response)

    handler.__name__ = name
    return handler


class ParameterServer(ps_pb2_grpc.ParameterServerServicer):
    """The servicer of one shard. Thread-safe; tables run their own thread pool."""

    def __init__(self) -> None:
        self._tables: dict[str, Table] = {}
        self._tables_lock = threading.Lock()
        self._steps = _Steps()
        self._stats: collections.defaultdict[str, _MethodStats] = collections.defaultdict(
            _MethodStats
        )
        self._stats_lock = threading.Lock()

    @staticmethod
    def _record(stats: _MethodStats, elapsed: float, request: Any, response: Any) -> None:
        stats.calls += 1
        stats.errors += response is None
        stats.seconds += elapsed
        stats.max_seconds = max(stats.max_seconds, elapsed)
        stats.request_bytes += request.ByteSize()
        if response is not None:
            stats.response_bytes += response.ByteSize()

    # Tables.

    def _table(self, name: str) -> Table:
        table = self._tables.get(name)
        if table is None:
            raise _Status(
                grpc.StatusCode.NOT_FOUND,
                f"Unknown table {name!r}; this shard has {sorted(self._tables)}",
            )
        return table

    def _info(self, table: Table) -> ps_pb2.TableInfo:
        return ps_pb2.TableInfo(
            name=table.name,
            config_json=json.dumps(table.config(), sort_keys=True),
            dim=table.dim,
            num_slots=table.num_slots,
            rows=len(table),
            iterations=table.iterations,
            memory_bytes=table.memory_bytes(),
        )

    def _create(self, config: dict[str, Any]) -> Table:
        """The table `config` describes: created, or checked against the existing one."""
        return self._create_all([config])[0]

    def _create_all(self, configs: list[dict[str, Any]]) -> list[Table]:
        """Like `_create` for each config, all or nothing: on an error none is created."""
        with self._tables_lock:
            chosen: dict[Any, Table] = {}
            new: list[Table] = []
            try:
                for config in configs:
                    name = config.get("name")
                    # (not `or`: an empty table is falsy)
                    existing = self._tables.get(name, chosen.get(name))  # type: ignore[arg-type]
                    if existing is not None:
                        ours = json.dumps(existing.config(), sort_keys=True)
                        if ours != json.dumps(config, sort_keys=True):
                            raise _Status(
                                grpc.StatusCode.ALREADY_EXISTS,
                                f"Table {name!r} exists with another configuration: {ours} "
                                f"(requested {json.dumps(config, sort_keys=True)})",
                            )
                        chosen[name] = existing
                        continue
                    table = Table.from_config(config)
                    new.append(table)
                    if table.name != name:
                        raise _invalid(f"Table name {name!r} is taken in this process")
                    chosen[name] = table
            except BaseException:
                for table in new:
                    unregister(table)
                raise
            for table in new:
                self._tables[table.name] = table
            return [chosen[c.get("name")] for c in configs]

    @_rpc
    def CreateTables(self, request: ps_pb2.CreateTablesRequest) -> ps_pb2.TablesResponse:
        configs = []
        for spec in request.tables:
            try:
                config = json.loads(spec.config_json)
            except json.JSONDecodeError as e:
                raise _invalid(f"Table {spec.name!r}: config_json is not JSON: {e}") from e
            if not isinstance(config, dict) or config.get("name") != spec.name:
                raise _invalid(f"Table {spec.name!r}: config_json does not name that table")
            configs.append(config)
        return ps_pb2.TablesResponse(tables=[self._info(t) for t in self._create_all(configs)])

    @_rpc
    def DescribeTables(self, request: ps_pb2.DescribeTablesRequest) -> ps_pb2.TablesResponse:
        names = list(request.names) or sorted(self._tables)
        return ps_pb2.TablesResponse(tables=[self._info(self._table(n)) for n in names])

    # Training.

    @_rpc
    def Join(self, request: ps_pb2.JoinRequest) -> ps_pb2.JoinResponse:
        s = self._steps
        if request.num_workers < 1 or not 0 <= request.worker < request.num_workers:
            raise _invalid(
                f"worker {request.worker} of {request.num_workers}: need 0 <= worker < num_workers"
            )
        if request.mode not in (ps_pb2.SYNC, ps_pb2.ASYNC):
            raise _invalid(f"Unknown mode {request.mode}")
        wanted = (request.mode, request.num_workers, request.staleness)
        with s.cond:
            if s.mode is not None and (s.mode, s.num_workers, s.staleness) != wanted:
                current = (ps_pb2.Mode.Name(s.mode), s.num_workers, s.staleness)
                raise _Status(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"worker {request.worker} joined with (mode, num_workers, staleness) = "
                    f"{(ps_pb2.Mode.Name(request.mode), *wanted[1:])}; this shard runs {current}",
                )
            s.mode, s.num_workers, s.staleness = wanted
            if s.mode == ps_pb2.SYNC:
                step = s.applied
            else:
                step = s.pushed.get(request.worker, 0)
            s.pushed[request.worker] = max(s.pushed.get(request.worker, 0), step)
            return ps_pb2.JoinResponse(step=step)

    def _check_worker(self, worker: int, step: int) -> None:
        s = self._steps
        if s.mode is not None and not 0 <= worker < s.num_workers:
            raise _invalid(f"worker {worker} is not one of the {s.num_workers} workers that joined")
        if step < 1:
            raise _invalid(f"wrong step {step}: steps start at 1")

    @_rpc
    def Pull(self, request: ps_pb2.PullRequest) -> ps_pb2.PullResponse:
        if request.encoding not in _ENCODINGS:
            raise _invalid(f"Unknown encoding {request.encoding}")
        self._check_worker(request.worker, request.step)
        s = self._steps
        with s.cond:
            last = s.pushed.get(request.worker, 0)
            if request.step > last + 1 + MAX_PUSHES_IN_FLIGHT:
                raise _invalid(
                    f"wrong step {request.step}: worker {request.worker} has pushed step {last}, "
                    f"so it can pull step {last + 1 + MAX_PUSHES_IN_FLIGHT} at most"
                )
        work = [
            (self._table(t.table), wire.decode_keys(t.keys, f"keys of {t.table}", t.key_encoding))
            for t in request.tables
        ]
        timeout = request.timeout_ms / 1000 if request.timeout_ms > 0 else 3600.0
        with s.cond:
            s.wait_for(request.worker, request.step, timeout)
        out = [
            ps_pb2.TableValues(
                table=table.name,
                values=wire.encode_floats(table.pull(keys, train=request.train), request.encoding),
            )
            for table, keys in work
        ]
        return ps_pb2.PullResponse(encoding=request.encoding, tables=out)

    @_rpc
    def Push(self, request: ps_pb2.PushRequest) -> ps_pb2.PushResponse:
        self._check_worker(request.worker, request.step)
        work: dict[str, tuple[Table, np.ndarray, np.ndarray]] = {}
        for t in request.tables:
            table = self._table(t.table)
            if t.table in work:
                raise _invalid(f"Table {t.table!r} appears twice in one push")
            keys = wire.decode_keys(t.keys, f"keys of {t.table}", t.key_encoding)
            grads = wire.decode_floats(
                t.gradients, request.encoding, len(keys), table.dim, f"gradients of {t.table}"
            )
            if abs(t.gradient_exponent) > 200:
                raise _invalid(f"gradient_exponent {t.gradient_exponent} of {t.table!r} is absurd")
            grads = wire.scale(grads, -t.gradient_exponent)
            if not np.isfinite(grads).all():
                raise _invalid(f"gradients of {t.table!r} hold NaN or infinity")
            work[t.table] = (table, keys, grads)
        s = self._steps
        with s.cond:
            last = s.pushed.get(request.worker, 0)
            if request.step != last + 1 or request.worker in s.applying:
                raise _invalid(
                    f"wrong step {request.step}: worker {request.worker} pushed step {last} "
                    f"last, so its next push is step {last + 1}"
                    + (" (once that one is applied)" if request.worker in s.applying else "")
                )
            if s.mode == ps_pb2.SYNC:
                s.pushed[request.worker] = request.step
                workers, tables = s.pending.setdefault(request.step, (set(), {}))
                workers.add(request.worker)
                for name, (_, keys, grads) in work.items():
                    tables.setdefault(name, []).append((keys, grads))
                self._apply_complete_steps()
                return ps_pb2.PushResponse(step=s.applied)
            s.applying.add(request.worker)
        # ASYNC: applied at once, outside the lock. The step counts as pushed
        # once applied, so the worker's next pull reads its own update.
        try:
            for table, keys, grads in work.values():
                table.push(keys, grads)
        finally:
            with s.cond:
                s.applying.discard(request.worker)
                s.pushed[request.worker] = request.step
                s.cond.notify_all()
        with s.cond:
            return ps_pb2.PushResponse(step=s.step())

    def _apply_complete_steps(self) -> None:
        """SYNC: applies, in order, every step all workers have pushed (under `cond`)."""
        s = self._steps
        while True:
            entry = s.pending.get(s.applied + 1)
            if entry is None or len(entry[0]) < s.num_workers:
                return
            del s.pending[s.applied + 1]
            for name, parts in sorted(entry[1].items()):
                keys = np.concatenate([k for k, _ in parts])
                grads = np.concatenate([g for _, g in parts])
                self._tables[name].push(keys, grads)
            s.applied += 1
            s.cond.notify_all()

    # Row access.

    @_rpc
    def ImportRows(self, request: ps_pb2.ImportRowsRequest) -> ps_pb2.ImportRowsResponse:
        table = self._table(request.table)
        keys = wire.decode_keys(request.keys)
        values = wire.decode_floats(request.values, ps_pb2.FLOAT32, len(keys), table.dim)
        if not request.replace:
            table.import_rows(keys, values)
            return ps_pb2.ImportRowsResponse(rows=len(table))
        n = len(keys)
        state = TableState(
            keys=keys,
            values=values,
            slots=wire.decode_floats(
                request.slots, ps_pb2.FLOAT32, n, table.num_slots * table.dim, "slots"
            ),
            last_step=wire.decode_uint(request.last_step, n, "<u4", "last_step"),
            update_count=wire.decode_uint(request.update_count, n, "<u4", "update_count"),
            iterations=request.iterations,
        )
        table.load_state(state)
        return ps_pb2.ImportRowsResponse(rows=len(table))

    @_rpc
    def ExportRows(self, request: ps_pb2.ExportRowsRequest) -> ps_pb2.ExportRowsResponse:
        table = self._table(request.table)
        state = table.export_state()
        response = ps_pb2.ExportRowsResponse(
            keys=wire.encode_keys(state.keys),
            values=wire.encode_floats(state.values, ps_pb2.FLOAT32),
            iterations=state.iterations,
        )
        if request.with_state:
            response.slots = wire.encode_floats(state.slots, ps_pb2.FLOAT32)
            response.last_step = np.ascontiguousarray(state.last_step, "<u4").tobytes()
            response.update_count = np.ascontiguousarray(state.update_count, "<u4").tobytes()
        return response

    @_rpc
    def EraseRows(self, request: ps_pb2.EraseRowsRequest) -> ps_pb2.EraseRowsResponse:
        table = self._table(request.table)
        return ps_pb2.EraseRowsResponse(erased=table.erase(wire.decode_keys(request.keys)))

    @_rpc
    def Metadata(self, request: ps_pb2.MetadataRequest) -> ps_pb2.MetadataResponse:
        table = self._table(request.table)
        last_step, update_count = table.metadata(wire.decode_keys(request.keys))
        return ps_pb2.MetadataResponse(
            last_step=np.ascontiguousarray(last_step, "<i8").tobytes(),
            update_count=np.ascontiguousarray(update_count, "<i8").tobytes(),
        )

    # Checkpoints.

    @_rpc
    def Save(self, request: ps_pb2.SaveRequest) -> ps_pb2.SaveResponse:
        tables = [self._table(n) for n in request.tables] if request.tables else None
        chosen = tables if tables is not None else list(self._tables.values())
        checkpoint.save(request.directory, chosen)
        return ps_pb2.SaveResponse(rows=sum(len(t) for t in chosen))

    @_rpc
    def Restore(self, request: ps_pb2.RestoreRequest) -> ps_pb2.TablesResponse:
        if not request.directories:
            raise _invalid("Restore needs at least one checkpoint directory")
        if request.num_shards < 1 or not 0 <= request.shard_index < request.num_shards:
            raise _invalid(
                f"shard {request.shard_index} of {request.num_shards}: "
                "need 0 <= shard_index < num_shards"
            )
        num_slots = request.num_slots or sharding.NUM_SLOTS
        try:
            configs, states = checkpoint.read_shards(
                [Path(d) for d in request.directories], list(request.tables) or None
            )
        except checkpoint.CheckpointError as e:
            raise _Status(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from e
        # Verify every table before changing any.
        plan = []
        for name, state in states.items():
            table = self._tables.get(name)
            if table is not None:
                checkpoint.check_fits(table, configs[name], request.directories[0])
            mine = (
                sharding.shard_of(state.keys, request.num_shards, num_slots) == request.shard_index
            )
            plan.append((name, state.select(mine)))
        restored = []
        for name, state in plan:
            table = self._tables.get(name)
            if table is None:
                table = self._create(checkpoint.table_config(name, configs[name]))
            table.load_state(state)
            restored.append(self._info(table))
        return ps_pb2.TablesResponse(tables=restored)

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
            for name, m in sorted(self._stats.items())
        ]
        with self._steps.cond:
            step = self._steps.step()
        tables = [self._info(t) for _, t in sorted(self._tables.items())]
        return ps_pb2.StatsResponse(methods=methods, tables=tables, step=step)

    @_rpc
    def Health(self, request: ps_pb2.HealthRequest) -> ps_pb2.HealthResponse:
        with self._steps.cond:
            step = self._steps.step()
        return ps_pb2.HealthResponse(serving=True, step=step, num_tables=len(self._tables))

    def save_all(self, directory: str) -> None:
        checkpoint.save(directory, list(self._tables.values()))


_ENCODINGS = set(wire.ENCODINGS.values())
# A worker's pushes leave in the background: its pull may overtake them.
MAX_PUSHES_IN_FLIGHT = 4

# Pushes carry every table of a step: allow large messages.
MAX_MESSAGE_BYTES = 1 << 30
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def serve(
    port: int,
    host: str = "0.0.0.0",
    threads: int = 64,
    grace_seconds: float = 30.0,
    checkpoint_dir: str | None = None,
    ready: Callable[[int], None] | None = None,
) -> int:
    """Runs one shard until SIGTERM or SIGINT; returns an exit status.

    On a signal the shard stops taking new requests, lets in-flight ones
    finish (up to `grace_seconds`) and, with `checkpoint_dir`, saves every
    table there.
    """
    remote.disable()  # the shard's own tables are always in-process
    servicer = ParameterServer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), options=GRPC_OPTIONS)
    ps_pb2_grpc.add_ParameterServerServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        log.error("cannot listen on %s:%d", host, port)
        return 1
    server.start()
    log.info("elastic_emb parameter server listening on %s:%d", host, bound)
    if ready is not None:
        ready(bound)
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stop.wait()
    log.info("stopping: finishing in-flight requests (up to %.0f s)", grace_seconds)
    server.stop(grace_seconds).wait()
    if checkpoint_dir:
        servicer.save_all(checkpoint_dir)
        log.info("saved every table to %s", checkpoint_dir)
    return 0
