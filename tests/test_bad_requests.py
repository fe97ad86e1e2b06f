"""Bad bytes stay bad requests: every gRPC method of a real `elastic-emb serve` answers a
malformed request with INVALID_ARGUMENT naming what is wrong (a field that is not UTF-8,
a truncated field), never INTERNAL, logs no traceback, and changes nothing stored.

The independent check of "names the field" is the message built here: the test puts the
bad bytes in a field it chose and expects that field's path in the answer.
"""

from __future__ import annotations

import json
import random

import grpc
import numpy as np
import pytest
from _cluster import shards

import elastic_emb as ee
from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.ps.wire import protocol

SERVICE = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
MARK = "MARK"  # replaced by bytes that are not UTF-8 once the message is serialized
NOT_UTF8 = b"\xff\xfe\xc0\x80"
# Left out of the mutation fuzz: their requests name files (a mutated path could name any).
NAMES_FILES = {"Save", "Restore"}


def _method_path(name: str) -> str:
    return f"/{SERVICE.full_name}/{name}"


def _call(channel: grpc.Channel, name: str, raw: bytes) -> tuple[grpc.StatusCode, str]:
    method = SERVICE.methods_by_name[name]
    try:
        if method.client_streaming:
            channel.stream_unary(_method_path(name))(iter([raw]), timeout=30)
        else:
            channel.unary_unary(_method_path(name))(raw, timeout=30)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def _message_with_bad_string(descriptor) -> tuple[bytes, str] | None:
    """Bytes of a message of `descriptor` whose first string field (depth first, through
    nested messages) is not UTF-8, and that field's path; None if it has no string."""

    def find(d, depth: int = 0):
        for f in d.fields:
            if f.type == f.TYPE_STRING:
                return [f]
        for f in d.fields:
            if f.type == f.TYPE_MESSAGE and depth < 3:
                rest = find(f.message_type, depth + 1)
                if rest:
                    return [f, *rest]
        return None

    path = find(descriptor)
    if path is None:
        return None
    message = getattr(ps_pb2, descriptor.name)()
    node, names = message, []
    for f in path[:-1]:
        repeated = f.label == f.LABEL_REPEATED if not hasattr(f, "is_repeated") else f.is_repeated
        node = getattr(node, f.name).add() if repeated else getattr(node, f.name)
        names.append(f"{f.name}[0]" if repeated else f.name)
    last = path[-1]
    repeated = (
        last.label == last.LABEL_REPEATED
        if not hasattr(last, "is_repeated")
        else (last.is_repeated)
    )
    if repeated:
        getattr(node, last.name).append(MARK)
        names.append(f"{last.name}[0]")
    else:
        setattr(node, last.name, MARK)
        names.append(last.name)
    raw = message.SerializeToString()
    assert raw.count(MARK.encode()) == 1
    return raw.replace(MARK.encode(), NOT_UTF8), ".".join(names)


@pytest.fixture(scope="module")
def served():
    """A server with tables "rows" (the requests') and "kept" (no request names it), and
    worker 0 joined; and its channel."""
    with shards(1) as (ps,):
        channel = grpc.insecure_channel(ps.address)
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        specs = []
        for name in ("rows", "kept"):
            table = ee.Table(4, ee.optimizers.SGD(0.5), initializer="zeros", name=name)
            specs.append(ps_pb2.TableSpec(name=name, config_json=json.dumps(table.config())))
        stub.CreateTables(ps_pb2.CreateTablesRequest(tables=specs), timeout=10)
        stub.ImportRows(
            protocol.import_rows_request("kept", np.arange(50), np.full((50, 4), 0.5, "f4")),
            timeout=10,
        )
        stub.Join(
            ps_pb2.JoinRequest(worker=0, num_workers=1, mode=ps_pb2.ASYNC, staleness=-1),
            timeout=10,
        )
        yield ps, channel
        channel.close()


def _kept(channel: grpc.Channel) -> bytes:
    stub = ps_pb2_grpc.ParameterServerStub(channel)
    request = ps_pb2.ExportRowsRequest(table="kept", with_state=True)
    return stub.ExportRows(request, timeout=10).SerializeToString()


def _no_traceback(ps) -> None:
    log = "".join(ps.output)
    assert "Traceback" not in log and "Exception deserializing" not in log, log[-3000:]


BAD_STRINGS = [
    (m.name, *found)
    for m in SERVICE.methods
    if (found := _message_with_bad_string(m.input_type)) is not None
]


@pytest.mark.parametrize("method, raw, field", BAD_STRINGS, ids=[b[0] for b in BAD_STRINGS])
def test_a_field_that_is_not_utf8_is_invalid_argument_naming_it(served, method, raw, field):
    ps, channel = served
    before = _kept(channel)
    code, details = _call(channel, method, raw)
    if method == "InstallSnapshot":  # (refused before its stream is read: no group here)
        assert (code, details) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "this server was not started with --coordinator",
        )
        return
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "not UTF-8" in details, details
    if method not in protocol.RAW_METHODS:  # (those are parsed in C++: "a table name")
        assert f"{field}: not UTF-8" in details, details
    assert _kept(channel) == before
    _no_traceback(ps)


def test_a_truncated_request_names_the_field_it_ends_in(served):
    ps, channel = served
    raw = ps_pb2.CreateTablesRequest(
        tables=[ps_pb2.TableSpec(name="x", config_json="{}" * 20)]
    ).SerializeToString()
    code, details = _call(channel, "CreateTables", raw[:-5])
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "tables[0]: truncated" in details, details
    _no_traceback(ps)


def _valid_requests() -> list[tuple[str, bytes]]:
    """A request of every method but those that name files, most of them well formed for
    the server of `served` (the rest: the message with its defaults)."""
    keys = np.arange(1, 9)
    pull = ps_pb2.PullRequest(
        worker=0, step=1, train=True, timeout_ms=2000,
        tables=[ps_pb2.TableKeys(table="rows", keys=keys.astype("<i8").tobytes())],
    )  # fmt: skip
    push = ps_pb2.PushRequest(
        worker=0, step=1,
        tables=[ps_pb2.TableGradients(table="rows", keys=keys.astype("<i8").tobytes(),
                                      gradients=np.full((8, 4), 0.25, "<f4").tobytes())],
    )  # fmt: skip
    known = {
        "Pull": pull,
        "Push": push,
        "ExportRows": ps_pb2.ExportRowsRequest(table="rows", with_state=True),
        "DescribeTables": ps_pb2.DescribeTablesRequest(),
        "ImportRows": protocol.import_rows_request("rows", keys, np.ones((8, 4), "f4")),
        "Join": ps_pb2.JoinRequest(worker=0, num_workers=1, mode=ps_pb2.ASYNC, staleness=-1),
        "Replicate": ps_pb2.ReplicateRequest(
            group=0, epoch=1, sequence=1, method="Push", request=push.SerializeToString()
        ),
    }
    out = []
    for m in SERVICE.methods:
        if m.name in NAMES_FILES:
            continue
        message = known.get(m.name) or getattr(ps_pb2, m.input_type.name)()
        out.append((m.name, message.SerializeToString()))
    return out


def test_mutated_requests_to_every_method_get_clear_refusals(served):
    """Bytes mutated from a request of every method: answered or refused with a status
    that is not INTERNAL or UNKNOWN, no traceback logged, the table no request names
    unchanged, and the server still serving."""
    ps, channel = served
    before = _kept(channel)
    rng = random.Random(40)
    codes: dict[grpc.StatusCode, int] = {}
    for method, raw in _valid_requests():
        for _ in range(25):
            mutated = bytearray(raw or b"\0")
            for _ in range(rng.randint(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            if rng.random() < 0.2:
                mutated = mutated[: rng.randrange(len(mutated))]
            code, details = _call(channel, method, bytes(mutated))
            assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (
                method,
                code,
                details,
            )
            codes[code] = codes.get(code, 0) + 1
    assert codes.get(grpc.StatusCode.INVALID_ARGUMENT, 0) > 50, codes
    assert _kept(channel) == before
    _no_traceback(ps)
    health = ps_pb2_grpc.ParameterServerStub(channel).Health(ps_pb2.HealthRequest(), timeout=10)
    assert health.serving


def test_the_parsers_utf8_check_agrees_with_pythons_strict_decoder():
    """Table names in Pulls are checked in C++ (csrc/wire.cc): the same verdict as
    Python's strict UTF-8 decoder on edge cases and on random bytes."""
    from elastic_emb import _core

    rng = random.Random(8)
    names = [b"ok", b"\xe2\x82\xac", b"\xf0\x9f\x98\x80", b"\xf4\x8f\xbf\xbf"]  # valid
    names += [b"\xed\xa0\x80", b"\xc0\x80", b"\xe0\x9f\xbf", b"\xf4\x90\x80\x80", b"\xc3"]
    names += [bytes(rng.randrange(256) for _ in range(rng.randint(1, 6))) for _ in range(2000)]
    for name in names:
        entry = b"\x0a" + bytes([len(name)]) + name  # TableKeys.table
        raw = b"\x10\x01" + b"\x32" + bytes([len(entry)]) + entry  # step 1, tables[0]
        try:
            name.decode("utf-8")
            valid = True
        except UnicodeDecodeError:
            valid = False
        try:
            _core.PullMessage(raw)
            parsed = True
        except _core.InvalidArgument as e:
            assert str(e) == "a table name is not UTF-8", e
            parsed = False
        assert parsed == valid, name


def test_the_health_service_refuses_a_malformed_check(served):
    ps, channel = served
    raw = b"\x0a\x02\xff\xfe"  # HealthCheckRequest.service, not UTF-8
    for method in ("Check", "Watch"):
        path = f"/grpc.health.v1.Health/{method}"
        call = channel.unary_unary if method == "Check" else channel.unary_stream
        with pytest.raises(grpc.RpcError) as refused:
            answer = call(path)(raw, timeout=10)
            if method == "Watch":
                next(iter(answer))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
    _no_traceback(ps)
