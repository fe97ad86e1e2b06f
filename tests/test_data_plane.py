"""The data plane (csrc/data_plane.h): its transport's limits, and Pull and Push on it
answered exactly as through gRPC, by real `elastic-emb serve` processes.

The transport tests drive `_core.DataPlaneServer` with a Python handler that records
what reached it, so a refusal is known to have happened before any request did. The
server tests compare the data plane with the gRPC plane of the same servers: the same
rows bit for bit, the same status codes and messages, nothing changed by a refusal.
"""

from __future__ import annotations

import json
import random
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest
from _certs import make_pki
from _cluster import metrics_url, scrape, shards

import elastic_emb as ee
from elastic_emb import _core
from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.ps.server.step_clock import ASYNC
from elastic_emb.ps.wire import protocol, security
from elastic_emb.ps.wire.security import WORKER_METHODS, ClientSecurity

PULL, PUSH = protocol.DATA_PLANE_METHODS["Pull"], protocol.DATA_PLANE_METHODS["Push"]
PULL_RANGES = protocol.DATA_PLANE_METHODS["PullRanges"]
OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED = 0, 3, 8
UNAVAILABLE, INTERNAL = 14, 13
HEADER = struct.Struct("<IIQIBBH")  # magic, length, request id, deadline ms, method, status


def _frame(method: int, payload: bytes, request_id: int = 1, magic: int = 0x50444545) -> bytes:
    return HEADER.pack(magic, len(payload), request_id, 0, method, 0, 0) + payload


def _read_frame(sock: socket.socket) -> tuple[int, bytes] | None:
    """(status, payload) of the next frame; None at EOF."""
    head = b""
    while len(head) < HEADER.size:
        got = sock.recv(HEADER.size - len(head))
        if not got:
            return None
        head += got
    _, length, _, _, _, status, _ = HEADER.unpack(head)
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    return status, body


def _closed(sock: socket.socket, within: float) -> bool:
    """Whether the peer closes `sock` within `within` seconds (what it sends is dropped)."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


class Echo:
    """A data-plane server whose handler records each request and answers its payload."""

    def __init__(self, tokens: tuple[str, ...] = ("",), **options: object) -> None:
        settings = _core.DataPlaneOptions()
        for name, value in options.items():
            setattr(settings, name, value)
        self.seen: list[bytes] = []
        self.release = threading.Event()  # what a "slow" request waits for
        self._lock = threading.Lock()

        def handle(method: int, payload: bytes, deadline_ms: int, caller: str):
            with self._lock:
                self.seen.append(payload)
            if payload.startswith(b"slow"):
                self.release.wait(10)
            return OK, bytes([method]) + payload + b"|" + caller.encode()

        def authenticate(token: bytes, peer: str):
            ok = token.decode() in tokens
            return ok, f"caller-{token.decode()}" if ok else f"token refused from {peer}"

        self.server = _core.DataPlaneServer(settings, handle, authenticate)
        self.port = self.server.port

    def __enter__(self) -> Echo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(1.0)

    def connect(self, token: str = "") -> _core.DataPlaneConnection:
        return _core.DataPlaneConnection("127.0.0.1", self.port, token, 5.0)

    def greeted_socket(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        sock.sendall(_frame(0, b"", request_id=0))
        assert _read_frame(sock) == (OK, b"")
        return sock


def _call(connection, method: int, payload: bytes, timeout: float = 10.0) -> tuple[int, bytes]:
    (ticket,) = _core.data_plane_send([connection], [method], [payload], timeout)
    assert _core.data_plane_wait([ticket], timeout)
    return ticket.answer()


# 1. The transport.


def test_answers_find_their_calls_whatever_their_order():
    with Echo() as echo:
        c = echo.connect()
        slow, fast = _core.data_plane_send([c, c], [PULL, PUSH], [b"slow-1", b"fast-2"], 20.0)
        assert _core.data_plane_wait([fast], 20.0)
        assert not slow.done()  # the fast one was answered first, on the same connection
        echo.release.set()
        assert _core.data_plane_wait([slow], 20.0)
        assert slow.answer() == (OK, b"\x01slow-1|caller-")
        assert fast.answer() == (OK, b"\x02fast-2|caller-")
        big = bytes(range(256)) * 40_000  # 10 MB each way
        assert _call(c, PUSH, big) == (OK, b"\x02" + big + b"|caller-")


def test_every_call_is_answered_under_load_from_many_threads():
    """Pipelined calls of mixed sizes on shared connections from several threads (answers
    large enough to fill the sockets, so that writers and readers arm connections at
    once): every call gets its own answer, none is lost."""
    with Echo() as echo:
        connections = [echo.connect() for _ in range(4)]
        failures: list[str] = []

        def client(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(20):
                payloads = [bytes([rng.randrange(256)]) * rng.choice((1, 100, 300_000))
                            for _ in range(16)]  # fmt: skip
                chosen = [rng.choice(connections) for _ in payloads]
                tickets = _core.data_plane_send(chosen, [PULL] * len(payloads), payloads, 30.0)
                if not _core.data_plane_wait(tickets, 30.0):
                    failures.append(f"client {seed}: calls unanswered after 30 s")
                    return
                for payload, ticket in zip(payloads, tickets, strict=True):
                    if ticket.answer() != (OK, b"\x01" + payload + b"|caller-"):
                        failures.append(f"client {seed}: a wrong answer")
                        return

        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert failures == []


def test_a_frame_above_the_limit_is_refused_before_the_server_reads_it():
    with Echo(max_frame_bytes=1024) as echo:
        c = echo.connect()
        status, message = _call(c, PULL, b"x" * 4096)
        assert status == RESOURCE_EXHAUSTED
        assert b"4096 bytes is above this server's limit of 1024" in message
        assert echo.seen == []
        assert _call(echo.connect(), PULL, b"y" * 1000)[0] == OK  # the server serves on


def test_an_answer_above_the_limit_is_refused_not_sent():
    with Echo(max_frame_bytes=1024) as echo:
        c = echo.connect()
        # The echo answers the method, the payload, "|" and the caller: 1,033 bytes.
        status, message = _call(c, PULL, b"y" * 1024)
        assert status == RESOURCE_EXHAUSTED, message
        assert b"an answer of 1033 bytes is above this server's limit of 1024" in message
        assert _call(c, PULL, b"z" * 1000) == (OK, bytes([PULL]) + b"z" * 1000 + b"|caller-")
    with pytest.raises(ValueError, match="max_frame_bytes is above 4294967295"):
        Echo(max_frame_bytes=1 << 32)


def test_bytes_that_are_not_frames_close_only_their_connection():
    with Echo() as echo:
        good = echo.connect()
        stranger = socket.create_connection(("127.0.0.1", echo.port), timeout=5)
        stranger.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\0" * 64)  # a gRPC client
        status, message = _read_frame(stranger)
        assert status == INVALID_ARGUMENT and b"wrong magic" in message
        assert _closed(stranger, 5)
        early = socket.create_connection(("127.0.0.1", echo.port), timeout=5)
        early.sendall(_frame(PULL, b"before-hello"))
        status, message = _read_frame(early)
        assert status == INVALID_ARGUMENT and b"before the connection's hello" in message
        unknown = echo.greeted_socket()
        unknown.sendall(_frame(200, b"what"))
        assert _read_frame(unknown)[1].endswith(b"unknown method 200")
        assert echo.seen == []
        assert _call(good, PULL, b"still") == (OK, b"\x01still|caller-")
        assert echo.server.counters()["frames_refused"] == 3


def test_connections_beyond_the_limit_are_refused():
    with Echo(max_connections=2) as echo:
        kept = [echo.connect(), echo.connect()]
        with pytest.raises(RuntimeError, match="maximum of 2 connections"):
            echo.connect()
        assert all(_call(c, PULL, b"a")[0] == OK for c in kept)
        assert echo.server.counters()["connections_refused"] == 1


def test_idle_and_half_open_connections_are_closed():
    with Echo(idle_seconds=1.0) as echo:
        idle = echo.greeted_socket()
        half = echo.greeted_socket()
        half.sendall(_frame(PULL, b"0123456789")[:10])  # part of a header, then nothing
        assert _closed(idle, 5) and _closed(half, 5)
        assert echo.server.counters()["connections_closed_idle"] == 2
        assert echo.seen == []
        # A client whose connection was closed learns it at once, not at its deadline.
        c = echo.connect()
        deadline = time.monotonic() + 10
        while c.alive and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not c.alive
        assert _call(c, PULL, b"late", timeout=60)[0] == UNAVAILABLE


def test_a_refused_token_lets_no_request_through():
    with Echo(tokens=("s3cret",)) as echo:
        with pytest.raises(RuntimeError, match=r"token refused from ipv4:127\.0\.0\.1"):
            echo.connect("wrong")
        raw = socket.create_connection(("127.0.0.1", echo.port), timeout=5)
        raw.sendall(_frame(0, b"wrong", request_id=0) + _frame(PULL, b"smuggled"))
        # Refused: the hello (UNAUTHENTICATED) or the request sent before its answer.
        assert _read_frame(raw)[0] in (16, INVALID_ARGUMENT)
        assert _closed(raw, 5)
        assert echo.seen == []
        assert _call(echo.connect("s3cret"), PULL, b"in") == (OK, b"\x01in|caller-s3cret")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_hello_announcing_a_large_body_is_refused_before_anything_is_allocated():
    """Four peers without a token each announce a 256 MiB hello: refused at its header, the
    server's memory (this process's RSS) unchanged; a real hello still gets through."""
    with Echo(tokens=("s3cret",)) as echo:
        before = _rss_bytes()
        peers = [socket.create_connection(("127.0.0.1", echo.port), timeout=5) for _ in range(4)]
        for peer in peers:
            peer.sendall(HEADER.pack(0x50444545, 256 << 20, 0, 0, 0, 0, 0) + b"x" * 1000)
        for peer in peers:
            status, message = _read_frame(peer)
            assert status == RESOURCE_EXHAUSTED
            assert message.endswith(b"above this server's limit of 65536 (a hello holds a token)")
            assert _closed(peer, 5)
        assert _rss_bytes() - before < 64 << 20  # (allocating the bodies: 1 GiB)
        assert echo.seen == []
        assert _call(echo.connect("s3cret"), PULL, b"in") == (OK, b"\x01in|caller-s3cret")


def test_hellos_not_finished_hold_only_what_their_peers_sent():
    """400 peers without a token each announce a hello just under the bound and send 1,000
    bytes of it: the server holds about what came (was: 64 KiB each, 25 MiB in all, until
    the hello deadline)."""
    with Echo(tokens=("s3cret",)) as echo:
        before = _rss_bytes()
        peers = [socket.create_connection(("127.0.0.1", echo.port), timeout=5) for _ in range(400)]
        for peer in peers:
            peer.sendall(HEADER.pack(0x50444545, 65535, 0, 0, 0, 0, 0) + b"x" * 1000)
        deadline = time.monotonic() + 10
        while echo.server.counters()["connections_accepted"] < 400 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # (the bytes read)
        assert _rss_bytes() - before < 8 << 20
        for peer in peers:
            peer.close()


def test_a_frame_announcing_a_large_body_holds_about_what_was_sent_not_its_length():
    """Found by bench/fuzz_data_port.py: four greeted peers (a worker's token, or no token
    on a server without tokens) each announce a 256 MiB request and send 1000 bytes of it
    (was: 1 GiB allocated and zeroed, held while the connections stay open). A body sent
    whole, in pieces, still arrives intact."""
    with Echo() as echo:
        before = _rss_bytes()
        peers = [echo.greeted_socket() for _ in range(4)]
        for peer in peers:
            peer.sendall(HEADER.pack(0x50444545, 256 << 20, 2, 0, PULL, 0, 0) + b"x" * 1000)
        time.sleep(0.5)
        assert _rss_bytes() - before < 64 << 20
        assert echo.seen == []
        whole = bytes(random.Random(3).randbytes(3 << 20))
        sock = echo.greeted_socket()
        message = _frame(PULL, whole)
        for at in range(0, len(message), 100_003):  # pieces across the body's growth steps
            sock.sendall(message[at : at + 100_003])
        sock.settimeout(10)
        assert _read_frame(sock) == (OK, b"\x01" + whole + b"|caller-")
        for peer in peers:
            peer.close()


def test_a_connection_without_a_whole_hello_is_closed_after_hello_seconds():
    with Echo(hello_seconds=1.0) as echo:
        silent = socket.create_connection(("127.0.0.1", echo.port), timeout=5)
        partial = socket.create_connection(("127.0.0.1", echo.port), timeout=5)
        partial.sendall(_frame(0, b"token")[:-2])  # the hello but its last 2 bytes
        greeted = echo.greeted_socket()
        assert _closed(silent, 5) and _closed(partial, 5)
        assert echo.server.counters()["connections_closed_idle"] == 2
        # The greeted connection, idle as long, is open (idle_seconds is 600).
        greeted.sendall(_frame(PULL, b"still"))
        assert _read_frame(greeted) == (OK, b"\x01still|caller-")
        with pytest.raises(ValueError, match="hello_seconds must be positive"):
            Echo(hello_seconds=0)


_AT_THE_FD_LIMIT = """
import resource, sys
from elastic_emb import _core
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
options = _core.DataPlaneOptions()
options.max_connections = 1000
server = _core.DataPlaneServer(options, lambda *a: (0, b"ok"), lambda t, p: (True, "c"))
print(server.port, flush=True)
sys.stdin.read()
"""


def test_at_the_descriptor_limit_connections_beyond_it_are_closed_not_left_waiting():
    """A server whose process may hold 64 descriptors, asked for 100 connections: those
    it cannot hold are accepted on its spare descriptor and closed (before: they waited
    in the backlog unanswered while the server's threads spun on the listening socket),
    and the connections it holds are served."""
    server = subprocess.Popen(
        [sys.executable, "-c", _AT_THE_FD_LIMIT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        port = int(server.stdout.readline())
        peers = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(100)]
        for peer in peers:
            peer.sendall(_frame(0, b"", request_id=0))
        answered, closed = set(), set()
        deadline = time.monotonic() + 10
        while len(answered) + len(closed) < 100 and time.monotonic() < deadline:
            waiting = [p for p in peers if p not in answered and p not in closed]
            for peer in select.select(waiting, [], [], 0.2)[0]:
                try:
                    got = peer.recv(4096)
                except ConnectionResetError:
                    got = b""
                (answered if got else closed).add(peer)
        assert len(answered) + len(closed) == 100  # none left waiting
        assert len(closed) >= 100 - 64 and len(answered) >= 32
        kept = next(iter(answered))
        kept.sendall(_frame(PULL, b"still"))
        assert _read_frame(kept) == (OK, b"ok")
    finally:
        server.stdin.close()
        server.wait(10)


def test_a_server_raises_its_soft_limit_of_open_files_for_its_connections():
    code = (
        "import resource\n"
        "from elastic_emb.ps.server.data_plane import raise_open_files_limit\n"
        "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "want = 5120 if hard == resource.RLIM_INFINITY else min(5120, hard)\n"
        "assert raise_open_files_limit(5120) == want, (hard, want)\n"
        "assert resource.getrlimit(resource.RLIMIT_NOFILE) == (want, hard)\n"
        "assert raise_open_files_limit(100) == want  # never lowered\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _seen(echo: Echo, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(echo.seen) < count:
        assert time.monotonic() < deadline, echo.seen
        time.sleep(0.01)


def test_an_overloaded_server_refuses_requests_unseen_with_a_retry_hint():
    """Beyond `max_active` requests handled at once, a request is answered RESOURCE_EXHAUSTED
    with a hint before its handler sees it; a primary's change (Replicate) never is."""
    replicate = protocol.DATA_PLANE_METHODS["Replicate"]
    with Echo(max_active=1) as echo:
        busy, other = echo.connect(), echo.connect()
        (slow,) = _core.data_plane_send([busy], [PULL], [b"slow-1"], 20.0)
        _seen(echo, 1)  # handled, waiting: the limit is reached
        (refused,) = _core.data_plane_send([other], [PUSH], [b"refused"], 20.0)
        assert _core.data_plane_wait([refused], 10.0)
        status, message = refused.answer()
        assert status == RESOURCE_EXHAUSTED and refused.retry_after_ms >= 1
        assert b"server overloaded (1 requests being handled, its limit 1)" in message
        assert _call(other, replicate, b"change") == (OK, b"\x05change|caller-")
        assert echo.seen == [b"slow-1", b"change"]  # the refused one never reached it
        echo.release.set()
        assert _core.data_plane_wait([slow], 10.0) and slow.answer()[0] == OK
        assert _call(other, PUSH, b"again") == (OK, b"\x02again|caller-")
        assert slow.retry_after_ms == 0
        assert echo.server.counters()["refused_overloaded"] == 1


def test_a_connection_beyond_its_requests_in_flight_gets_the_rest_refused():
    with Echo(max_per_connection=2) as echo:
        c = echo.connect()
        held = _core.data_plane_send([c, c], [PULL, PULL], [b"slow-1", b"slow-2"], 20.0)
        _seen(echo, 2)
        status, message = _call(c, PUSH, b"third")
        assert status == RESOURCE_EXHAUSTED
        assert b"2 requests in flight on this connection, its limit 2" in message
        assert _call(echo.connect(), PUSH, b"elsewhere")[0] == OK  # other connections: not
        echo.release.set()
        assert _core.data_plane_wait(held, 10.0) and all(t.answer()[0] == OK for t in held)
        assert _call(c, PUSH, b"third")[0] == OK
        assert b"third" in echo.seen and echo.seen.count(b"third") == 1


def test_a_stopped_server_fails_the_calls_in_flight_at_once():
    echo = Echo()
    c = echo.connect()
    (ticket,) = _core.data_plane_send([c], [PULL], [b"slow-forever"], 60.0)
    while not echo.seen:
        time.sleep(0.01)
    echo.server.stop(0.0)
    assert _core.data_plane_wait([ticket], 10.0)  # long before its deadline
    assert ticket.answer()[0] == UNAVAILABLE
    assert not c.alive
    echo.release.set()  # (its handler ends; the answer goes nowhere)


def test_the_data_plane_carries_what_workers_call_and_the_replicas_changes():
    # Tokens are checked once per connection; the role per call only for Replicate (test
    # below): every other method on it must be a worker's.
    assert set(protocol.DATA_PLANE_METHODS) - {"Replicate"} <= WORKER_METHODS
    assert "Replicate" not in WORKER_METHODS
    assert set(protocol.DATA_PLANE_METHODS) - {"Replicate"} == protocol.RAW_METHODS


# 2. A real server: both planes.


def _stub(address: str):
    return ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(address))


def _data_connection(address: str, token: str = "") -> _core.DataPlaneConnection:
    port = _stub(address).Health(ps_pb2.HealthRequest(), timeout=10).data_port
    assert port > 0
    return _core.DataPlaneConnection("127.0.0.1", port, token, 5.0)


def _train(address: str, plane: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Five sync steps of Adam on random keys (with repeats); the rows and the addresses
    reached through the data plane."""
    ee.init(ps=[address], mode="sync", data_plane=plane)
    try:
        table = ee.Table(8, ee.optimizers.Adam(0.01), initializer="uniform", name="t", seed=3)
        rng = np.random.default_rng(0)
        for _ in range(5):
            keys = rng.integers(0, 300, 200)
            table.pull(keys)
            table.push(keys, rng.standard_normal((200, 8)).astype(np.float32))
        keys, values = table.export_rows()
        order = np.argsort(keys)
        cluster = ee.placement.registry.connection().cluster
        return keys[order], values[order], cluster.shards.data_plane_addresses()
    finally:
        ee.shutdown()


def test_both_planes_train_bit_identically():
    with (
        shards(2, ["--data-plane", "native"]) as (a, b),
        shards(1, ["--data-plane", "grpc"]) as (g,),
    ):
        assert _stub(g.address).Health(ps_pb2.HealthRequest(), timeout=10).data_port == 0
        native = _train(a.address, "native")
        chosen = _train(b.address, "grpc")  # a server with one, not used
        plain = _train(g.address, "native")  # asked for, but the server has none
        assert native[2] == [a.address] and chosen[2] == [] and plain[2] == []
        for other in (chosen, plain):
            np.testing.assert_array_equal(native[0], other[0])
            assert native[1].tobytes() == other[1].tobytes()


@pytest.fixture(scope="module")
def served():
    """A server with a table "rows" (dim 4) and worker 0 joined, async."""
    with shards(1) as (ps,):
        stub = _stub(ps.address)
        local = ee.Table(4, ee.optimizers.SGD(0.5), initializer="zeros", name="rows")
        config = json.dumps(local.config())
        stub.CreateTables(
            ps_pb2.CreateTablesRequest(tables=[ps_pb2.TableSpec(name="rows", config_json=config)]),
            timeout=10,
        )
        stub.Join(
            ps_pb2.JoinRequest(worker=0, num_workers=1, mode=ps_pb2.ASYNC, staleness=-1),
            timeout=10,
        )
        yield ps, stub


def _rows(stub) -> bytes:
    return stub.ExportRows(
        ps_pb2.ExportRowsRequest(table="rows", with_state=True), timeout=10
    ).SerializeToString()


def _pull(keys, step: int = 1, table: str = "rows") -> ps_pb2.PullRequest:
    entry = ps_pb2.TableKeys(table=table, keys=np.asarray(keys, "<i8").tobytes())
    return ps_pb2.PullRequest(worker=0, step=step, train=True, timeout_ms=5000, tables=[entry])


def _push(keys, grads, step: int) -> ps_pb2.PushRequest:
    entry = ps_pb2.TableGradients(
        table="rows",
        keys=np.asarray(keys, "<i8").tobytes(),
        gradients=np.asarray(grads, "<f4").tobytes(),
    )
    return ps_pb2.PushRequest(worker=0, step=step, tables=[entry])


REFUSED = [
    ("unknown-table", "Pull", _pull([1, 2], table="nope")),
    ("step-0", "Pull", _pull([1], step=0)),
    ("ragged-keys", "Pull", ps_pb2.PullRequest(
        worker=0, step=1, tables=[ps_pb2.TableKeys(table="rows", keys=b"\1\2\3")])),
    ("wrong-step", "Push", _push([1], np.ones((1, 4)), step=7)),
    ("grads-short", "Push", ps_pb2.PushRequest(worker=0, step=1, tables=[ps_pb2.TableGradients(
        table="rows", keys=np.arange(3, dtype="<i8").tobytes(), gradients=b"\0" * 12)])),
    ("not-protobuf", "Push", b"\xff\xff\xff\xff"),
]  # fmt: skip


@pytest.mark.parametrize("method, request_", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_a_refused_request_gets_the_same_answer_on_both_planes(served, method, request_):
    ps, stub = served
    raw = request_ if isinstance(request_, bytes) else request_.SerializeToString()
    before = _rows(stub)
    status, message = _call(_data_connection(ps.address), protocol.DATA_PLANE_METHODS[method], raw)
    with pytest.raises(grpc.RpcError) as through_grpc:
        grpc.insecure_channel(ps.address).unary_unary(
            f"/elastic_emb.ps.v1.ParameterServer/{method}"
        )(raw, timeout=10)
    assert status == through_grpc.value.code().value[0] != INTERNAL
    assert message.decode() == through_grpc.value.details()
    assert _rows(stub) == before


def test_the_data_port_survives_mutated_requests(served):
    """Bytes mutated from valid Pulls, Pushes and Replicates (and frames with mutated
    headers) sent to a live server: never INTERNAL, never a crash or a hang."""
    ps, stub = served
    rng = random.Random(7)
    keys = np.arange(1, 9)
    push = _push(keys, np.full((8, 4), 0.25), step=1).SerializeToString()
    change = ps_pb2.ReplicateRequest(
        group=0, epoch=1, sequence=1, method="Push", request=push, primary="127.0.0.1:1"
    )  # (this server has no group: refused, whichever way it is read)
    valid = [
        (PULL, _pull(keys).SerializeToString()),
        (PUSH, push),
        (protocol.DATA_PLANE_METHODS["Replicate"], change.SerializeToString()),
    ]
    connection = _data_connection(ps.address)
    statuses: dict[int, int] = {}
    for _ in range(400):
        method, raw = rng.choice(valid)
        mutated = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            where = rng.randrange(len(mutated))
            mutated[where] = rng.randrange(256)
        if rng.random() < 0.2:
            mutated = mutated[: rng.randrange(len(mutated))]
        status, _ = _call(connection, method, bytes(mutated))
        statuses[status] = statuses.get(status, 0) + 1
    assert INTERNAL not in statuses and UNAVAILABLE not in statuses, statuses
    assert statuses.get(INVALID_ARGUMENT, 0) > 100, statuses
    port = _stub(ps.address).Health(ps_pb2.HealthRequest(), timeout=10).data_port
    # Mutated headers (not the length: a longer one waits for its bytes, as it should):
    # refused or answered, and the server stays.
    for _ in range(50):
        frame = bytearray(_frame(PULL, valid[0][1]))
        frame[rng.choice([*range(4), *range(8, HEADER.size)])] ^= 1 << rng.randrange(8)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(_frame(0, b"", request_id=0))
            _read_frame(sock)
            sock.sendall(bytes(frame))
            sock.settimeout(10)
            answer = _read_frame(sock)
            assert answer is not None and answer[0] != INTERNAL
    after = _call(_data_connection(ps.address), PULL, _pull(keys, step=2).SerializeToString())
    assert after[0] in (OK, INVALID_ARGUMENT)  # (a mutated push may have been step 1)
    assert stub.Health(ps_pb2.HealthRequest(), timeout=10).serving


def test_tls_servers_have_no_plaintext_data_port(tmp_path):
    pki = make_pki(tmp_path)
    cert, key = pki["server"]
    with shards(1, ["--tls-cert", str(cert), "--tls-key", str(key)]) as (ps,):
        credentials = grpc.ssl_channel_credentials(pki["ca"].read_bytes())
        stub = ps_pb2_grpc.ParameterServerStub(grpc.secure_channel(ps.address, credentials))
        port = stub.Health(ps_pb2.HealthRequest(), timeout=10).data_port
        if not _core.with_tls:  # a build without OpenSSL: the data goes through gRPC
            assert port == 0
            assert any("data plane: off with TLS" in line for line in ps.output)
            return
        # Its data port is TLS (tests/test_data_plane_tls.py): plaintext is refused.
        with pytest.raises(RuntimeError, match="speaks TLS"):
            _core.DataPlaneConnection("127.0.0.1", port, "", 5.0)


def test_tokens_are_checked_per_data_plane_connection(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret-admin admin ops\ns3cret-worker worker trainer\n")
    log = tmp_path / "audit.jsonl"
    with shards(1, ["--auth-tokens", str(tokens), "--audit-log", str(log)]) as (ps,):
        admin = ClientSecurity.make(token="s3cret-admin")
        stub = ps_pb2_grpc.ParameterServerStub(security.channel(ps.address, [], admin))
        port = stub.Health(ps_pb2.HealthRequest(), timeout=10).data_port
        for wrong in ("guess", ""):
            with pytest.raises(RuntimeError, match="no valid token"):
                _core.DataPlaneConnection("127.0.0.1", port, wrong, 5.0)
        assert log.read_text().count('"UNAUTHENTICATED"') == 2
        ee.init(ps=[ps.address], token="s3cret-admin")
        try:
            table = ee.Table(4, ee.optimizers.SGD(0.5), initializer="zeros", name="x")
            table.push(np.arange(5), np.ones((5, 4), np.float32))
            np.testing.assert_array_equal(table.pull(np.arange(5)), np.full((5, 4), -0.5))
            cluster = ee.placement.registry.connection().cluster
            assert cluster.shards.data_plane_addresses() == [ps.address]
            # A worker's connection may not send a replica's change: refused, audited, and
            # nothing applied.
            push = ps_pb2.PushRequest(
                tables=[
                    ps_pb2.TableGradients(
                        table="x",
                        keys=np.arange(5, dtype=np.int64).tobytes(),
                        gradients=np.ones((5, 4), np.float32).tobytes(),
                    )
                ]
            )
            change = ps_pb2.ReplicateRequest(
                group=0, epoch=1, sequence=1, method="Push", request=push.SerializeToString()
            )
            worker = _core.DataPlaneConnection("127.0.0.1", port, "s3cret-worker", 5.0)
            status, message = _call(
                worker, protocol.DATA_PLANE_METHODS["Replicate"], change.SerializeToString()
            )
            assert status == grpc.StatusCode.PERMISSION_DENIED.value[0]
            assert b"Replicate needs the admin role; 'trainer' has the worker role" in message
            assert '"Replicate"' in log.read_text()
            np.testing.assert_array_equal(table.pull(np.arange(5)), np.full((5, 4), -0.5))
        finally:
            ee.shutdown()


def test_sync_pulls_wait_on_the_plane_holding_no_thread():
    """Seven of eight sync workers pull step 2 before the eighth pushed step 1, on a
    server with 2 request threads: their pulls wait holding none, so the eighth's push
    is served, applies the step and answers the seven with the step's rows (an
    in-process table pushed the same gradients, in worker order, says which); a pull
    that waits past its deadline is refused, naming the late worker. A PullRanges
    waits the same way, its parts answered together (or refused as soon as one is)."""
    workers, keys = 8, np.array([3, 1, 4, 1, 5, 9], np.int64)
    grads = np.random.default_rng(1).standard_normal((workers, len(keys), 4)).astype(np.float32)

    def pull(worker: int, step: int, timeout_ms: int = 20_000) -> bytes:
        entry = ps_pb2.TableKeys(table="rows", keys=keys.astype("<i8").tobytes())
        return ps_pb2.PullRequest(
            worker=worker, step=step, train=True, timeout_ms=timeout_ms, tables=[entry]
        ).SerializeToString()

    def pull_ranges(*parts: bytes) -> bytes:
        return ps_pb2.PullRangesRequest(
            parts=[ps_pb2.PullRequest.FromString(p) for p in parts]
        ).SerializeToString()

    def push(worker: int) -> bytes:
        entry = ps_pb2.TableGradients(
            table="rows", keys=keys.astype("<i8").tobytes(), gradients=grads[worker].tobytes()
        )
        return ps_pb2.PushRequest(worker=worker, step=1, tables=[entry]).SerializeToString()

    with shards(1, ["--threads", "2", "--metrics-port", "0"]) as (ps,):
        stub = _stub(ps.address)
        config = ee.Table(4, ee.optimizers.SGD(0.5), initializer="zeros", name="rows").config()
        stub.CreateTables(
            ps_pb2.CreateTablesRequest(
                tables=[ps_pb2.TableSpec(name="rows", config_json=json.dumps(config))]
            ),
            timeout=10,
        )
        for w in range(workers):
            stub.Join(
                ps_pb2.JoinRequest(worker=w, num_workers=workers, mode=ps_pb2.SYNC, staleness=-1),
                timeout=10,
            )
        conns = [_data_connection(ps.address) for _ in range(workers)]
        for w in range(workers):
            assert _call(conns[w], PULL, pull(w, 1))[0] == OK
        for w in range(workers - 1):
            assert _call(conns[w], PUSH, push(w))[0] == OK
        waiting = [
            _core.data_plane_send([conns[w]], [PULL], [pull(w, 2)], 30.0)[0]
            for w in range(workers - 2)
        ]  # fmt: skip
        (both,) = _core.data_plane_send(
            [conns[6]], [PULL_RANGES], [pull_ranges(pull(6, 2), pull(6, 2))], 30.0
        )
        status, message = _call(conns[0], PULL, pull(0, 2, timeout_ms=300))
        assert status == 4 and "workers [7] have not pushed it" in message.decode(), message
        status, message = _call(conns[1], PULL_RANGES, pull_ranges(pull(1, 2, timeout_ms=300)))
        assert status == 4 and "workers [7] have not pushed it" in message.decode(), message
        assert not any(t.done() for t in [*waiting, both])

        assert _call(conns[-1], PUSH, push(workers - 1))[0] == OK
        assert _core.data_plane_wait([*waiting, both], 30.0)
        reference = ee.Table(4, ee.optimizers.SGD(0.5), initializer="zeros", name="reference")
        reference.push(np.tile(keys, workers), grads.reshape(-1, 4))
        expected = reference.pull(keys).astype("<f4").tobytes()
        for ticket in waiting:
            status, answer = ticket.answer()
            assert status == OK
            assert ps_pb2.PullResponse.FromString(answer).tables[0].values == expected
        status, answer = both.answer()
        assert status == OK
        parts = ps_pb2.PullRangesResponse.FromString(answer).parts
        assert [p.tables[0].values for p in parts] == [expected, expected]
        stats = stub.Stats(ps_pb2.StatsRequest(), timeout=10)
        assert stats.pull_waits == workers  # (the PullRanges's two parts waited)
        assert {m.method: m.calls for m in stats.methods}["PullRanges"] == 2
        native = (("method", "PullRanges"),)
        assert scrape(metrics_url(ps))[("elastic_emb_data_plane_native_calls_total", native)] == 2


def test_what_the_plane_leaves_to_python_trains_as_in_process(tmp_path):
    """On a native server, a tiered table's calls and a scheduled table's pushes are
    served by the servicer's Python, the rest by C++ (the server's metrics count which);
    gradients that are not finite are skipped either way. All three tables train as
    in-process tables do, bit for bit."""
    keras = pytest.importorskip("keras")
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=2, decay_rate=0.5)

    def tables(where: str) -> list:
        return [
            ee.Table(4, ee.optimizers.Adagrad(0.1), name="plain", seed=1, nonfinite="skip"),
            ee.Table(4, ee.optimizers.SGD(schedule), name="scheduled", seed=2),
            ee.Table(
                4, ee.optimizers.Adagrad(0.1), name="tiered", seed=3,
                storage=ee.storage.Tiered(16, str(tmp_path / where)),
            ),
        ]  # fmt: skip

    def train(chosen: list) -> list:
        rng = np.random.default_rng(5)
        for step in range(4):
            keys = rng.integers(0, 60, 40)
            for table in chosen:
                table.pull(keys)
                grads = rng.standard_normal((40, 4)).astype(np.float32)
                if step == 2 and table.name == "plain":
                    grads[3, 1] = np.nan
                table.push(keys, grads)
        return [table.export_state() for table in chosen]

    want = train(tables("local"))
    with shards(1, ["--metrics-port", "0"]) as (ps,):
        ee.init(ps=[ps.address], mode="sync", data_plane="native")
        try:
            got = train(tables("remote"))
        finally:
            ee.shutdown()
        metrics = scrape(metrics_url(ps))
    for g, w in zip(got, want, strict=True):
        order_g, order_w = np.argsort(g.keys), np.argsort(w.keys)
        np.testing.assert_array_equal(g.keys[order_g], w.keys[order_w])
        assert g.values[order_g].tobytes() == w.values[order_w].tobytes()
        assert g.slots[order_g].tobytes() == w.slots[order_w].tobytes()

    def calls(name: str, method: str) -> float:
        return metrics.get((f"elastic_emb_{name}_total", (("method", method),)), 0.0)

    # In C++: the plain and the scheduled table's pulls (a pull needs no learning rate),
    # the plain table's pushes that reached the server finite.
    assert calls("data_plane_native_calls", "Pull") == 8
    assert calls("rpc_calls", "Pull") == 12
    assert 3 <= calls("data_plane_native_calls", "Push") <= 4 < calls("rpc_calls", "Push")


@pytest.mark.parametrize("dropped", [True, False], ids=["dropped", "not-dropped"])
def test_a_push_its_backup_refused_is_acknowledged_only_once_the_backup_is_dropped(dropped):
    """A primary's data plane applies a push and sends it to its backup, which refuses it:
    the backup is dropped (the callback is Python's `Replica._drop`) and then the worker
    answered OK; when it cannot be dropped (this server is no longer the primary), the
    push is not acknowledged: ABORTED, and the worker sends it again to the group's
    primary. The primary's row took the push either way (an in-process table says)."""
    refused: list[bytes] = []

    def refuse(method: int, payload: bytes, deadline_ms: int, caller: str):
        refused.append(payload)
        return grpc.StatusCode.DATA_LOSS.value[0], b"cannot apply it"

    backup = _core.DataPlaneServer(_core.DataPlaneOptions(), refuse, lambda t, p: (True, "anyone"))
    drops: list[tuple[str, str]] = []

    def drop(address: str, why: str) -> bool:
        drops.append((address, why))
        return dropped

    table = ee.Table(4, ee.optimizers.SGD(0.5), initializer="zeros", name="rows")
    shard = _core.ShardCore(lambda step, name, parts: None)
    shard.set_tables([("rows", table.core_table(), 0.5)])
    shard.clock.join(0, 1, ASYNC, -1)
    core = _core.ServerCore()
    core.put_range(0, shard)
    core.set_serving({0: (True, False, time.monotonic() + 600)})
    core.replication.configure(drop, "")
    core.replication.set_role(
        {"address": "127.0.0.1:1", "group": 0, "epoch": 1, "primary": "127.0.0.1:1",
         "holds": ["127.0.0.1:2"], "deposed": "", "changes": True,
         "backups": [("127.0.0.1:2", "127.0.0.1", backup.port)]}
    )  # fmt: skip
    core.set_enabled(True, pushes=False)
    primary = _core.DataPlaneServer(
        _core.DataPlaneOptions(), lambda *a: (INTERNAL, b"not for Python"),
        lambda t, p: (True, "anyone"), core,
    )  # fmt: skip
    try:
        worker = _core.DataPlaneConnection("127.0.0.1", primary.port, "", 5.0)
        status, answer = _call(
            worker, PUSH, _push([7], np.ones((1, 4)), step=1).SerializeToString()
        )
        assert len(refused) == 1
        change = ps_pb2.ReplicateRequest.FromString(refused[0])
        assert (change.group, change.epoch, change.sequence, change.method) == (0, 1, 1, "Push")
        assert drops == [("127.0.0.1:2", "it did not apply change 1: cannot apply it")]
        acknowledged = core.replication.acknowledged()
        if dropped:
            assert status == OK and ps_pb2.PushResponse.FromString(answer).step == 1
            assert [(k, v["changes"], v["first_sequence"], v["last_sequence"])
                    for k, v in acknowledged.items()] == [((0, 1), 1, 1, 1)]  # fmt: skip
        else:
            assert status == grpc.StatusCode.ABORTED.value[0]
            assert b"could not remove 127.0.0.1:2, which did not apply change 1" in answer
            assert acknowledged == {}  # (the audit log's count: nothing acknowledged)
        reference = ee.Table(4, ee.optimizers.SGD(0.5), initializer="zeros", name="reference")
        reference.push(np.array([7]), np.ones((1, 4), np.float32))
        np.testing.assert_array_equal(table.pull(np.array([7])), reference.pull(np.array([7])))
    finally:
        primary.stop(1.0)
        backup.stop(1.0)


def _backup_core() -> tuple[ee.Table, Any]:
    """An in-process table "rows" (dim 4, SGD 0.5) and a `ServerCore` over it, as a
    coordinated backup's at epoch 1 with nothing applied yet (its role still to set)."""
    table = ee.Table(4, ee.optimizers.SGD(0.5), initializer="zeros", name="rows")
    shard = _core.ShardCore(lambda step, name, parts: None)
    shard.set_tables([("rows", table.core_table(), 0.5)])
    shard.clock.join(0, 1, ASYNC, -1)
    core = _core.ServerCore()
    core.put_range(0, shard)
    core.replication.set_applied(0, 1)
    core.set_enabled(True, pushes=False)
    return table, core


def test_a_backup_taking_over_refuses_its_old_primary_s_changes_on_the_plane():
    """From the moment a backup decides to take over (`Failover.take_over`: the role's
    `deposed`), its plane applies no change of the old primary's epoch; until then, and
    again once the take-over is called off, it does."""
    table, core = _backup_core()
    role = {"address": "127.0.0.1:2", "group": 0, "epoch": 1, "primary": "127.0.0.1:1",
            "holds": ["127.0.0.1:2"], "changes": False, "backups": []}  # fmt: skip
    backup = _core.DataPlaneServer(
        _core.DataPlaneOptions(), lambda *a: (INTERNAL, b"not for Python"),
        lambda t, p: (True, "peer"), core,
    )  # fmt: skip
    replicate = protocol.DATA_PLANE_METHODS["Replicate"]

    def change(sequence: int) -> tuple[int, bytes]:
        push = _push([7], np.ones((1, 4)), step=sequence).SerializeToString()
        request = ps_pb2.ReplicateRequest(
            group=0, epoch=1, sequence=sequence, method="Push", request=push,
            primary="127.0.0.1:1",
        )  # fmt: skip
        return _call(primary, replicate, request.SerializeToString())

    try:
        primary = _core.DataPlaneConnection("127.0.0.1", backup.port, "", 5.0)
        core.replication.set_role({**role, "deposed": ""})
        assert change(1)[0] == OK
        core.replication.set_role({**role, "deposed": "127.0.0.1:1"})
        status, answer = change(2)
        assert status == grpc.StatusCode.ABORTED.value[0]
        assert answer.decode() == (
            "127.0.0.1:2 is taking over group 0 from 127.0.0.1:1 (its epoch 1 is over)"
        )
        assert core.replication.applied == 1
        core.replication.set_role({**role, "deposed": ""})  # (the take-over failed)
        assert change(2)[0] == OK
        reference = ee.Table(4, ee.optimizers.SGD(0.5), initializer="zeros", name="reference")
        for _ in range(2):
            reference.push(np.array([7]), np.ones((1, 4), np.float32))
        np.testing.assert_array_equal(table.pull(np.array([7])), reference.pull(np.array([7])))
    finally:
        backup.stop(1.0)


def test_a_change_sent_as_a_sequence_applied_already_must_be_the_same_change():
    """Without tokens anyone reaching a backup's port may send it a Replicate naming the
    group's epoch and primary (docs/operations.md#security). What it changes is then the
    backup's alone, so the primary's own change of that sequence is refused DATA_LOSS (the
    primary drops the backup, which copies the group's state again), never skipped as sent
    again; the primary's change sent again is still taken as done."""
    _table, core = _backup_core()
    core.replication.set_role(
        {"address": "127.0.0.1:2", "group": 0, "epoch": 1, "primary": "127.0.0.1:1",
         "holds": ["127.0.0.1:2"], "deposed": "", "changes": False, "backups": []}
    )  # fmt: skip
    backup = _core.DataPlaneServer(
        _core.DataPlaneOptions(), lambda *a: (INTERNAL, b"not for Python"),
        lambda t, p: (True, "anyone"), core,
    )  # fmt: skip
    replicate = protocol.DATA_PLANE_METHODS["Replicate"]

    def change(sequence: int, key: int) -> bytes:
        push = _push([key], np.ones((1, 4)), step=sequence).SerializeToString()
        return ps_pb2.ReplicateRequest(
            group=0, epoch=1, sequence=sequence, method="Push", request=push,
            primary="127.0.0.1:1",
        ).SerializeToString()  # fmt: skip

    try:
        outsider = _core.DataPlaneConnection("127.0.0.1", backup.port, "", 5.0)
        assert _call(outsider, replicate, change(1, key=7))[0] == OK
        primary = _core.DataPlaneConnection("127.0.0.1", backup.port, "", 5.0)
        status, answer = _call(primary, replicate, change(1, key=8))
        assert status == grpc.StatusCode.DATA_LOSS.value[0]
        assert answer.decode() == (
            "127.0.0.1:2 applied another change 1 of epoch 1: this replica has diverged"
        )
        assert _call(outsider, replicate, change(1, key=7)) == (
            OK, ps_pb2.ReplicateResponse(sequence=1).SerializeToString()
        )  # fmt: skip
        # Python's check (a change the plane leaves to it) reads the same record.
        assert core.replication.same_change(1, 1, "Push", ps_pb2.ReplicateRequest.FromString(
            change(1, key=7)).request)  # fmt: skip
        assert not core.replication.same_change(1, 1, "Push", ps_pb2.ReplicateRequest.FromString(
            change(1, key=8)).request)  # fmt: skip
        assert core.replication.applied == 1
    finally:
        backup.stop(1.0)


def _server_memory(pid: int, field: str) -> int:
    """A /proc/PID/status field (VmRSS, VmHWM) in bytes."""
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _with_table(address: str, dim: int, mode: int = ps_pb2.ASYNC, workers: int = 1) -> Any:
    stub = _stub(address)
    config = json.dumps(ee.Table(dim, ee.optimizers.SGD(0.5), name="rows").config())
    stub.CreateTables(
        ps_pb2.CreateTablesRequest(tables=[ps_pb2.TableSpec(name="rows", config_json=config)]),
        timeout=10,
    )
    for worker in range(workers):
        stub.Join(
            ps_pb2.JoinRequest(worker=worker, num_workers=workers, mode=mode, staleness=-1),
            timeout=10,
        )
    return stub


def _delta_keys(n: int) -> bytes:
    """Keys 1..n delta-varint encoded: one byte each."""
    return b"\x02" + b"\x01" * (n - 1)  # (zigzag: 1 is 2, then +1 steps)


def test_a_pull_whose_rows_exceed_the_message_limit_is_refused_on_both_planes():
    """A small request may not demand a huge answer: 200,000 delta-encoded keys (200 KB)
    would answer 3.2 MB of rows, above --max-message-bytes 1 MiB: RESOURCE_EXHAUSTED,
    the same on both transports, before any row is inserted; a pull that fits is served."""
    with shards(1, ["--max-message-bytes", str(1 << 20)]) as (ps,):
        stub = _with_table(ps.address, dim=4)
        entry = ps_pb2.TableKeys(table="rows", keys=_delta_keys(200_000), key_encoding=1)
        raw = ps_pb2.PullRequest(worker=0, step=1, train=True, tables=[entry]).SerializeToString()
        status, message = _call(_data_connection(ps.address), PULL, raw)
        assert status == RESOURCE_EXHAUSTED
        assert message.decode() == (
            "a pull answering 3200000 bytes of rows is above this server's limit of 1048576 "
            "bytes a message; pull fewer keys per request"
        )
        with pytest.raises(grpc.RpcError) as through_grpc:
            grpc.insecure_channel(ps.address).unary_unary(
                "/elastic_emb.ps.v1.ParameterServer/Pull"
            )(raw, timeout=10)
        assert through_grpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert through_grpc.value.details() == message.decode()
        described = stub.DescribeTables(ps_pb2.DescribeTablesRequest(), timeout=10)
        assert [t.rows for t in described.tables] == [0]
        ok = ps_pb2.TableKeys(table="rows", keys=_delta_keys(1000), key_encoding=1)
        fits = ps_pb2.PullRequest(worker=0, step=1, train=True, tables=[ok])
        assert _call(_data_connection(ps.address), PULL, fits.SerializeToString())[0] == OK


def test_a_push_is_checked_against_its_gradient_bytes_before_its_buffer_is_sized():
    """1,000,000 delta-encoded keys (1 MB) of a table of dim 64 and 4 bytes of gradients:
    refused INVALID_ARGUMENT with the server's peak memory up by about the keys (8 MB),
    not by the 256 MB their gradients would take."""
    with shards(1) as (ps,):
        _with_table(ps.address, dim=64)
        pid = ps.process.pid
        before = _server_memory(pid, "VmHWM")
        entry = ps_pb2.TableGradients(
            table="rows", keys=_delta_keys(1_000_000), key_encoding=1, gradients=b"\0" * 4
        )
        raw = ps_pb2.PushRequest(worker=0, step=1, tables=[entry]).SerializeToString()
        status, message = _call(_data_connection(ps.address), PUSH, raw)
        assert status == INVALID_ARGUMENT
        assert b"`gradients of rows` has 4 bytes; 1000000 rows of dim 64" in message
        assert _server_memory(pid, "VmHWM") - before < 64 << 20


def test_parked_sync_pulls_are_freed_when_their_connection_closes(monkeypatch):
    """Sync pulls of step 2 wait for worker 1's push of step 1; their connections close
    first. What they held (1,000,000 keys each, 8 MB) is freed then, not when the step
    completes."""
    # (blocks of 1 MiB and more mapped on their own, so that freeing them shows in the RSS)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    with shards(1) as (ps,):
        _with_table(ps.address, dim=4, mode=ps_pb2.SYNC, workers=2)
        pid = ps.process.pid
        push = _push([1], np.ones((1, 4)), step=1).SerializeToString()
        entry = ps_pb2.TableKeys(table="rows", keys=_delta_keys(1_000_000), key_encoding=1)
        pull = ps_pb2.PullRequest(worker=0, step=2, train=False, tables=[entry], timeout_ms=60_000)
        first = _data_connection(ps.address)
        assert _call(first, PUSH, push)[0] == OK  # worker 0's step 1: step 2 waits for worker 1
        baseline = _server_memory(pid, "VmRSS")
        connections = [_data_connection(ps.address) for _ in range(12)]
        tickets = _core.data_plane_send(
            connections, [PULL] * 12, [pull.SerializeToString()] * 12, 60.0
        )
        assert not _core.data_plane_wait(tickets, 1.0)  # parked
        assert _server_memory(pid, "VmRSS") - baseline > 48 << 20  # their keys
        del connections, tickets  # (the connections close)
        deadline = time.monotonic() + 10
        while _server_memory(pid, "VmRSS") - baseline > 24 << 20 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _server_memory(pid, "VmRSS") - baseline <= 24 << 20
