"""Links that fail while every process stays alive (tests/_link_proxy.py), checked by the
history checker (tests/_history.py): no split brain, nothing acknowledged lost.

Real `elastic-emb serve` processes and a real etcd on 127.0.0.1; the links under test go
through proxies the servers advertise (`--advertise`, `--advertise-data-port`, or a
`--coordinator` URL naming the proxy of etcd).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from _cluster import scrape
from _history import (
    Epochs,
    History,
    RecordingWorker,
    acknowledged_epochs,
    check,
    check_epochs,
    history_table,
)  # fmt: skip
from _link_proxy import LinkProxy
from _replicas import export
from _states import assert_same_state

import elastic_emb as ee
from elastic_emb import _core
from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.ps.coord.local_cluster import LocalCluster, free_port
from elastic_emb.ps.wire import protocol, security


def _metrics(cluster: LocalCluster, port: int) -> dict:
    log = (cluster.directory / f"server-{port}.log").read_text()
    (url,) = re.findall(r"^elastic-emb serve: metrics on (\S+)", log, re.MULTILINE)
    return scrape(url)


def _pushes_acknowledged(cluster: LocalCluster, port: int) -> float:
    """The Pushes and PushRanges a server answered OK (calls less errors), from its metrics."""
    m = _metrics(cluster, port)
    total = 0.0
    for method in ("Push", "PushRanges"):
        total += m.get(("elastic_emb_rpc_calls_total", (("method", method),)), 0.0)
        total -= sum(
            v
            for (name, labels), v in m.items()
            if name == "elastic_emb_rpc_errors_total" and ("method", method) in labels
        )
    return total


class LinksIn:
    """A server's ways in (gRPC and data plane), each through a `LinkProxy` it advertises."""

    def __init__(self, cluster: LocalCluster, name: str) -> None:
        self.port, data = free_port(), free_port()
        self.links = [LinkProxy(self.port, f"-> {name}"), LinkProxy(data, f"-> {name} data")]
        self.address = self.links[0].address  # (what the map names it)
        cluster.start_server(
            port=self.port,
            extra_args=["--advertise", self.address, "--data-port", str(data),
                        "--advertise-data-port", str(self.links[1].port)],
        )  # fmt: skip

    def cut(self, direction: str = "both") -> None:
        for link in self.links:
            link.cut(direction)

    def heal(self) -> None:
        for link in self.links:
            link.heal()

    def close(self) -> None:
        for link in self.links:
            link.close()


@contextlib.contextmanager
def _group_with_links_to_the_backup(
    tmp_path, server_args: list[str] | None = None, mode: str = "async"
) -> Iterator[tuple[LocalCluster, str, LinkProxy, LinksIn, RecordingWorker]]:
    """Server A, its link to etcd through a proxy, then its backup B, which whoever reaches
    it (A's replication, a worker after a failover) reaches through its `LinksIn`; and an
    async worker recording its pushes, 20 of them acknowledged. Everything is stopped on
    exit. Yields (cluster, A's address, A's etcd link, B's links, the worker)."""
    cluster = LocalCluster(1, 2, tmp_path / "cluster", server_args=server_args, audit=True)
    links: list[LinkProxy | LinksIn] = []
    try:
        cluster.start(servers=False)
        assert cluster.etcd is not None
        a_etcd = LinkProxy(cluster.etcd.port, "A -> etcd")
        links.append(a_etcd)
        a = cluster.start_server(extra_args=["--coordinator", f"etcd://{a_etcd.address}"])
        cluster.wait_until(lambda: cluster.primaries() == [a], 60, "A is the primary")
        b = LinksIn(cluster, "B")
        links.append(b)
        cluster.wait_until(cluster.complete, 60, "B is A's backup")
        ee.init(coordinator=cluster.coordinator, mode=mode)
        worker = RecordingWorker(history_table("h"))
        cluster.wait_until(lambda: len(worker.history.acknowledged) >= 20, 60, "20 pushes")
        yield cluster, a, a_etcd, b, worker
    finally:
        ee.shutdown()
        cluster.stop()
        for link in links:
            link.close()


def _raw_pushes(address: str, key: int) -> list[tuple[str, grpc.StatusCode, str]]:
    """Worker 0's next push, of `key` (table "h"), sent to `address` itself on each plane:
    (plane, status, message) of each answer."""
    with grpc.insecure_channel(address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        health = stub.Health(ps_pb2.HealthRequest(), timeout=10)
        (range_id,) = health.ranges
        info = stub.DescribeTables(
            ps_pb2.DescribeTablesRequest(names=["h"], range=range_id), timeout=10
        )
        entry = ps_pb2.TableGradients(
            table="h",
            keys=np.asarray([key], "<i8").tobytes(),
            gradients=np.ones((1, 2), "<f4").tobytes(),
        )
        step = info.tables[0].iterations + 1  # (one worker, one table: its pushes so far)
        request = ps_pb2.PushRequest(worker=0, step=step, tables=[entry], range=range_id)
        payload = request.SerializeToString()
        try:
            channel.unary_unary(f"/{security.SERVICE}/Push")(payload, timeout=10)
            answers = [("grpc", grpc.StatusCode.OK, "")]
        except grpc.RpcError as e:
            answers = [("grpc", e.code(), e.details())]
    connection = _core.DataPlaneConnection("127.0.0.1", health.data_port, "", 5.0)
    method = protocol.DATA_PLANE_METHODS["Push"]
    (ticket,) = _core.data_plane_send([connection], [method], [payload], 10.0)
    assert _core.data_plane_wait([ticket], 10.0)
    status, body = ticket.answer()
    codes = {c.value[0]: c for c in grpc.StatusCode}
    return [*answers, ("data plane", codes[status], body.decode())]


def _one_primary_per_epoch(cluster: LocalCluster) -> Epochs:
    """The checker's verdict on the epochs in the servers' audit logs (read once the
    servers stopped: their last counts), and those epochs."""
    epochs = acknowledged_epochs(cluster.audit_logs())
    assert check_epochs(epochs) == []
    return epochs


def _exact_on_both(history: History, primary: str, backup: str) -> None:
    """The checker holds on the primary's rows, and the backup's are the same bit for bit."""
    rows = export(primary, "h")
    assert check(history, rows["keys"], rows["values"]) == []
    assert_same_state(rows, export(backup, "h"))


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_primary_cut_from_etcd_and_its_backup_acknowledges_nothing_once_replaced(tmp_path, mode):
    """The split-brain case: the primary A loses etcd and its backup B, and workers still
    reach it. A acknowledges nothing new from then on (it cannot replicate, nor drop B
    without etcd), B is promoted when A's lease lapses, the worker moves to B once it can reach it,
    A's late changes are refused by B, and when A reaches etcd again it rejoins as B's
    backup. Every push the worker saw acknowledged is in the rows exactly once."""
    with _group_with_links_to_the_backup(tmp_path, ["--metrics-port", "0"], mode) as (
        cluster, a, a_etcd, b, worker,
    ):  # fmt: skip
        a_port = int(a.rsplit(":", 1)[1])
        cut_at = time.monotonic()
        a_etcd.cut()
        b.cut()
        cluster.wait_until(lambda: cluster.primaries() == [b.address], 60, "B promoted")
        promoted_at = time.monotonic()
        a_acknowledged = _pushes_acknowledged(cluster, a_port)
        acknowledged_before = len(worker.history.acknowledged)
        b.heal()  # the worker (and A's replication) reach B again; A still lacks etcd
        cluster.wait_until(
            lambda: len(worker.history.acknowledged) >= acknowledged_before + 20,
            60,
            "20 pushes acknowledged by B",
        )
        # Nothing new from A; at most the one push whose change B had applied when its
        # link was cut, B's answer held in the link until now (in B's rows: the audit logs'
        # verdict below puts it before B's epoch).
        late = _pushes_acknowledged(cluster, a_port) - a_acknowledged
        assert late in (0, 1), late
        # The ABORTED path: A, cut from etcd, acknowledges no push on either plane and says
        # why (its lease, or a backup it cannot drop); the worker would ask the map again
        # and go to B. Whatever A did with it, it is not in the final rows (the checker).
        for plane, code, message in _raw_pushes(a, key=10**9):
            assert code == grpc.StatusCode.ABORTED, (plane, code, message)
            assert "without the coordinator" in message or "renew its lease" in message
        a_etcd.heal()
        cluster.wait_until(cluster.complete, 60, "A rejoined as B's backup")
        history = worker.stop()

        _exact_on_both(history, b.address, a)
        stalled = [t for _, t in history.acknowledged if cut_at < t < promoted_at]
        print(
            f"{mode}: promoted {promoted_at - cut_at:.2f} s after the cut; "
            f"{len(history.acknowledged)} acknowledged, {len(history.failed)} failed, "
            f"{len(stalled)} acknowledged between the cut and the promotion, {late} by A "
            "after it (held in the link)"
        )
    # From the audit logs: A's last epoch as the primary, then B's, every change A
    # acknowledged before B's first in the group's order; and in time too, unless B's
    # answer was held in the cut link (it then reaches A when the link heals).
    epochs = _one_primary_per_epoch(cluster)
    ((_, a_epoch), a_counts), ((_, b_epoch), b_counts) = [
        (key, server) for key, servers in sorted(epochs.items()) for server in servers.values()
    ][-2:]
    assert [*epochs[(0, a_epoch)]] == [a] and [*epochs[(0, b_epoch)]] == [b.address]
    assert a_epoch < b_epoch and a_counts["changes"] > 0 and b_counts["changes"] >= 20
    assert a_counts["last_sequence"] < b_counts["first_sequence"]
    if late == 0:
        assert a_counts["last_time"] < b_counts["first_time"]


@contextlib.contextmanager
def _a_primary_behind_its_links(
    tmp_path, mode: str
) -> Iterator[tuple[LocalCluster, LinksIn, str, RecordingWorker]]:
    """A primary A whose ways in (its backup's and the worker's alike) go through its
    `LinksIn`, its backup B, and a worker recording its pushes, 20 of them acknowledged.
    Everything is stopped on exit. Yields (cluster, A's links, B's address, the worker)."""
    cluster = LocalCluster(
        1, 2, tmp_path / "cluster", server_args=["--metrics-port", "0"], audit=True
    )
    links: list[LinksIn] = []
    try:
        cluster.start(servers=False)
        a = LinksIn(cluster, "A")
        links.append(a)
        cluster.wait_until(lambda: cluster.primaries() == [a.address], 60, "A primary")
        b = cluster.start_server()
        cluster.wait_until(cluster.complete, 60, "B is A's backup")
        ee.init(coordinator=cluster.coordinator, mode=mode)
        worker = RecordingWorker(history_table("h"))
        cluster.wait_until(lambda: len(worker.history.acknowledged) >= 20, 60, "20 pushes")
        yield cluster, a, b, worker
    finally:
        ee.shutdown()
        cluster.stop()
        for link in links:
            link.close()


@pytest.mark.parametrize(
    "direction, mode", [("both", "async"), ("in", "async"), ("out", "async"), ("both", "sync")]
)
def test_a_primary_nobody_reaches_for_3_s_is_replaced_and_nothing_is_lost(
    tmp_path, direction, mode
):
    """The links into the primary A (gRPC and data plane, from the worker and from its
    backup B alike) are cut for 3 s, both ways or one ("in": what reaches A is held; "out":
    what A answers). A still reaches etcd and B. B's pings go unanswered for a lease, so B
    takes over (as it must: it cannot tell a dead primary from an unreachable one); the
    worker moves to B; A rejoins as B's backup once healed. Every acknowledged push is in
    the rows exactly once, on both replicas. (A cut of the worker's links alone needs the
    worker to reach A at an address B does not use: tests/test_worker_partitions.py.)
    Once B is promoted, A acknowledges no push (its own count, from its metrics)."""
    with _a_primary_behind_its_links(tmp_path, mode) as (cluster, a, b, worker):
        cut_at = time.monotonic()
        a.cut(direction)
        cluster.wait_until(lambda: cluster.primaries() == [b], 60, "B promoted")
        a_acknowledged = _pushes_acknowledged(cluster, a.port)  # (its metrics: not cut)
        time.sleep(max(0.0, cut_at + 3 - time.monotonic()))
        a.heal()
        healed = len(worker.history.acknowledged)
        cluster.wait_until(
            lambda: len(worker.history.acknowledged) >= healed + 20, 60, "20 more pushes"
        )
        cluster.wait_until(cluster.complete, 60, "A rejoined as B's backup")
        history = worker.stop()
        assert cluster.primaries() == [b]  # B took over
        assert _pushes_acknowledged(cluster, a.port) == a_acknowledged  # none by A since

        _exact_on_both(history, b, f"127.0.0.1:{a.port}")
        times = [t for _, t in history.acknowledged]
        longest = max(np.diff(times))
        print(f"{direction}, {mode}: longest wait between acknowledgements {longest:.2f} s")


def _rate(worker: RecordingWorker, seconds: float) -> float:
    """Acknowledged pushes per second over the next `seconds`."""
    before = len(worker.history.acknowledged)
    time.sleep(seconds)
    return (len(worker.history.acknowledged) - before) / seconds


def test_a_slow_link_to_the_backup_slows_pushes_without_a_failover(tmp_path):
    """The link into the backup B (A's replication) delays every byte 200 ms each way for
    4 s: A waits for B on each push, so pushes slow down; no failover (B's pings reach A);
    once healed the rate comes back; every acknowledged push is in the rows once."""
    with _group_with_links_to_the_backup(tmp_path) as (cluster, a, _, b, worker):
        fast = _rate(worker, 2)
        for link in b.links:
            link.slow(0.2)
        slow = _rate(worker, 4)
        b.heal()
        time.sleep(0.5)
        again = _rate(worker, 2)
        history = worker.stop()
        assert cluster.primaries() == [a]  # no failover
        _exact_on_both(history, a, b.address)
        print(f"pushes/s: {fast:.1f} before, {slow:.1f} slowed, {again:.1f} healed")
        assert slow < fast / 2 and again > 2 * slow, (fast, slow, again)


@pytest.mark.parametrize("which", ["A -> etcd", "-> B"])
def test_a_flapping_link_makes_no_failover_and_loses_nothing(tmp_path, which):
    """A link cut 1 s in every 3 s for 9 s (seeded): the primary's link to etcd (its
    lease, 2 s, outlives each cut), or the link into the backup (A's replication waits
    for each heal). No failover; every acknowledged push is in the rows once."""
    with _group_with_links_to_the_backup(tmp_path) as (cluster, a, a_etcd, b, worker):
        for link in [a_etcd] if which == "A -> etcd" else b.links:
            link.flap(seed=40, seconds=9, every=3.0, cut_for=1.0)  # (B's two links together)
        time.sleep(9.5)
        acknowledged = len(worker.history.acknowledged)
        cluster.wait_until(
            lambda: len(worker.history.acknowledged) >= acknowledged + 10, 60, "10 more pushes"
        )
        history = worker.stop()
        assert cluster.primaries() == [a]  # no failover
        _exact_on_both(history, a, b.address)
        times = [t for _, t in history.acknowledged]
        print(f"{which}: longest wait between acknowledgements {max(np.diff(times)):.2f} s")


def test_a_primary_answering_slowly_within_its_lease_is_not_failed_over(tmp_path):
    """Every way into the primary A (its backup's pings and the worker's calls alike)
    delays each byte 250 ms each way for 6 s (3 leases): a ping takes 0.5 s, within A's
    lease (2 s), so B must not take over (it did while a ping waited only 0.3 s). Pushes
    slow down and recover; every acknowledged push is in the rows once, on both replicas."""
    with _a_primary_behind_its_links(tmp_path, "async") as (cluster, a, b, worker):
        fast = _rate(worker, 2)
        for link in a.links:
            link.slow(0.25)
        slow = _rate(worker, 6)
        a.heal()
        again = _rate(worker, 2)
        history = worker.stop()
        assert cluster.primaries() == [a.address]  # no failover
        _exact_on_both(history, a.address, b)
        print(f"pushes/s: {fast:.1f} before, {slow:.1f} slowed, {again:.1f} healed")
