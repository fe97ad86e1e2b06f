"""The PS client and the shard's error handling: retries, cleanup, statuses, health.

- An idempotent call that finds a shard UNAVAILABLE (not started yet) is
  retried by gRPC's service config and succeeds; with retries off it fails
  at once (the control that shows the test can fail).
- A `Cluster` whose Join is refused releases its threads and channels.
- The servicer answers a refused request with the shard's status, and a bug
  (an unexpected exception) with INTERNAL, logged with its traceback.
- Real `elastic-emb serve` shards answer the standard grpc.health.v1 service,
  asked with grpcio-health-checking's client (an independent implementation:
  our messages are wire-compatible) and with ours, both imported here.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from _cluster import shards
from grpc_health.v1 import health_pb2, health_pb2_grpc

from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.ps.client import shard_client as client_module
from elastic_emb.ps.client.cluster import Cluster, ClusterOptions
from elastic_emb.ps.client.shard_client import ShardClient
from elastic_emb.ps.server import health
from elastic_emb.ps.server.servicer import Servicer
from elastic_emb.ps.wire.security import GRPC_OPTIONS, SERVICE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _describe_before_the_server_starts(delay: float) -> tuple[object, float]:
    """DescribeTables on a port whose server (the real servicer) starts `delay` s later."""
    port = _free_port()
    client = ShardClient([f"127.0.0.1:{port}"], timeout=10)
    started: list[grpc.Server] = []

    def start() -> None:
        time.sleep(delay)
        server = grpc.server(futures.ThreadPoolExecutor(2), options=GRPC_OPTIONS)
        ps_pb2_grpc.add_ParameterServerServicer_to_server(Servicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        started.append(server)

    thread = threading.Thread(target=start)
    thread.start()
    t0 = time.monotonic()
    try:
        outcome: object = client.call(0, "DescribeTables", ps_pb2.DescribeTablesRequest())
    except ConnectionError as e:
        outcome = e
    elapsed = time.monotonic() - t0
    thread.join()
    started[0].stop(0)
    client.close()
    return outcome, elapsed


def test_idempotent_calls_are_retried_while_a_shard_is_unavailable(monkeypatch):
    outcome, elapsed = _describe_before_the_server_starts(0.3)
    assert isinstance(outcome, ps_pb2.TablesResponse), outcome
    assert elapsed >= 0.3
    # Control: the same call with retries off fails at once.
    monkeypatch.setattr(
        client_module, "CLIENT_OPTIONS", [*GRPC_OPTIONS, ("grpc.enable_retries", 0)]
    )
    outcome, elapsed = _describe_before_the_server_starts(0.3)
    assert isinstance(outcome, ConnectionError) and "unreachable" in str(outcome)
    assert elapsed < 0.3


def test_push_is_not_in_the_retry_policy():
    retried = client_module._SERVICE_CONFIG["methodConfig"][0]["name"]
    methods = {m["method"] for m in retried}
    assert "Push" not in methods and "EraseRows" not in methods
    assert {"Pull", "Join", "DescribeTables", "ExportRows"} <= methods
    assert all(m["service"] == SERVICE for m in retried)
    # Every retried method exists in the service.
    service = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
    assert methods <= {m.name for m in service.methods}


def _rpc_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(("ee-rpc", "ee-push"))}


def test_a_refused_join_releases_threads_and_channels():
    with shards(1) as (shard,):
        first = Cluster([shard.address], ClusterOptions("sync", None, "float32", 0, 1, 10.0, 30))
        try:
            before = _rpc_threads()
            for _ in range(3):
                with pytest.raises(ValueError, match="this shard runs"):
                    Cluster(
                        [shard.address], ClusterOptions("async", None, "float32", 0, 1, 10.0, 30)
                    )
            assert _rpc_threads() == before
        finally:
            first.close()
    assert not _rpc_threads() - before


class _Aborted(Exception):
    pass


class _Context:
    """The part of grpc.ServicerContext the servicer uses: `abort` raises."""

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise _Aborted


def _call(servicer: Servicer, method: str, request: object) -> _Context:
    context = _Context()
    with pytest.raises(_Aborted):
        getattr(servicer, method)(request, context)
    return context


def test_refused_requests_get_their_status_and_bugs_get_internal(monkeypatch, caplog):
    servicer = Servicer()
    unknown = _call(servicer, "ExportRows", ps_pb2.ExportRowsRequest(table="nope"))
    assert unknown.code == grpc.StatusCode.NOT_FOUND and "nope" in unknown.details
    truncated = ps_pb2.EraseRowsRequest(table="nope", keys=b"\0" * 7)
    config = (
        '{"name": "t", "dim": 2, "seed": 1, "optimizer": {"class_name": "SGD", '
        '"learning_rate": 0.1}, "initializer": {"kind": "zeros", "a": 0, "b": 0}}'
    )
    servicer.CreateTables(
        ps_pb2.CreateTablesRequest(tables=[ps_pb2.TableSpec(name="t", config_json=config)]),
        _Context(),
    )
    truncated.table = "t"
    malformed = _call(servicer, "EraseRows", truncated)
    assert malformed.code == grpc.StatusCode.INVALID_ARGUMENT and "7 bytes" in malformed.details
    bad_dim = config.replace('"dim": 2', '"dim": -2').replace('"t"', '"u"')
    invalid = _call(
        servicer,
        "CreateTables",
        ps_pb2.CreateTablesRequest(tables=[ps_pb2.TableSpec(name="u", config_json=bad_dim)]),
    )
    assert invalid.code == grpc.StatusCode.INVALID_ARGUMENT and "dim" in invalid.details

    # A bug, even one raising ValueError, is not the caller's bad input.
    def broken(name: str) -> object:
        raise ValueError("a bug in the shard")

    monkeypatch.setattr(servicer.ranges.get(0), "table", broken)
    with caplog.at_level(logging.ERROR, logger="elastic_emb.server"):
        bug = _call(servicer, "ExportRows", ps_pb2.ExportRowsRequest(table="t"))
    assert bug.code == grpc.StatusCode.INTERNAL and "a bug in the shard" in bug.details
    (record,) = [r for r in caplog.records if r.name == "elastic_emb.server"]
    assert record.exc_info is not None and "ExportRows" in record.getMessage()
    stats = {m.method: m for m in servicer.Stats(ps_pb2.StatsRequest(), _Context()).methods}
    assert stats["ExportRows"].calls == 2 and stats["ExportRows"].errors == 2
    # The table is still there and works.
    monkeypatch.undo()
    exported = servicer.ExportRows(ps_pb2.ExportRowsRequest(table="t"), _Context())
    assert np.frombuffer(exported.keys, "<i8").size == 0


def test_shards_answer_the_standard_health_service():
    with shards(1) as (shard,), grpc.insecure_channel(shard.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        # Our own client (elastic-emb health's) gets the same answers.
        for service in ("", SERVICE):
            assert health.check(channel, service, timeout=10).status == health.SERVING
        with pytest.raises(grpc.RpcError) as info:
            health.check(channel, "no.such.Service", timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_watch_streams_changes_and_ends_when_the_server_stops():
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    servicer.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            watch = stub.Watch(health_pb2.HealthCheckRequest(service="svc"), timeout=10)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            servicer.set("svc", health.SERVING)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            # A cancelled Watch gives its server thread back: 4 more calls still get answers.
            watch.cancel()
            cancelled = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=10) for _ in range(4)]
            for call in cancelled:
                assert next(call).status == health_pb2.HealthCheckResponse.SERVING
                call.cancel()
            last = stub.Watch(health_pb2.HealthCheckRequest(service="svc"), timeout=10)
            assert next(last).status == health_pb2.HealthCheckResponse.SERVING
            servicer.enter_graceful_shutdown()
            servicer.set("svc", health.SERVING)  # ignored from now on
            assert [r.status for r in last] == [health_pb2.HealthCheckResponse.NOT_SERVING]
            assert last.code() == grpc.StatusCode.OK
            t0 = time.monotonic()
            server.stop(30).wait()  # no Watch left open to wait for
            assert time.monotonic() - t0 < 5
    finally:
        server.stop(0)


def test_a_checkpoint_directory_the_shard_cannot_write_is_the_callers_problem(tmp_path):
    servicer = Servicer()
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    refused = _call(servicer, "Save", ps_pb2.SaveRequest(directory=str(blocker / "ckpt")))
    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION
    assert str(blocker / "ckpt") in refused.details
    unreadable = _call(
        servicer,
        "Restore",
        ps_pb2.RestoreRequest(directories=[str(blocker / "ckpt")], num_shards=1, shard_index=0),
    )
    assert unreadable.code == grpc.StatusCode.FAILED_PRECONDITION
    # And the shard still saves where it can.
    saved = servicer.Save(ps_pb2.SaveRequest(directory=str(tmp_path / "ok")), _Context())
    assert saved.rows == 0 and (tmp_path / "ok" / "manifest.json").is_file()
