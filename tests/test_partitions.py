"""Links that fail while every process stays alive (tests/_link_proxy.py), checked by the
history checker (tests/_history.py): no split brain, nothing acknowledged lost.

Real `elastic-emb serve` processes and a real etcd on 127.0.0.1; the links under test go
through proxies the servers advertise (`--advertise`, `--advertise-data-port`, or a
`--coordinator` URL naming the proxy of etcd).
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from _cluster import scrape
from _history import RecordingWorker, check, history_table
from _link_proxy import LinkProxy
from _replicas import export
from _states import assert_same_state

import elastic_emb as ee
from elastic_emb.ps.coord.local_cluster import LocalCluster, free_port


def _metrics(cluster: LocalCluster, port: int) -> dict:
    log = (cluster.directory / f"server-{port}.log").read_text()
    (url,) = re.findall(r"^elastic-emb serve: metrics on (\S+)", log, re.MULTILINE)
    return scrape(url)


def _pushes_acknowledged(cluster: LocalCluster, port: int) -> float:
    """The Pushes a server answered OK (calls less errors), from its metrics."""
    m = _metrics(cluster, port)
    calls = m.get(("elastic_emb_rpc_calls_total", (("method", "Push"),)), 0.0)
    errors = sum(
        v
        for (name, labels), v in m.items()
        if name == "elastic_emb_rpc_errors_total" and ("method", "Push") in labels
    )
    return calls - errors


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


def test_a_primary_cut_from_etcd_and_its_backup_acknowledges_nothing_once_replaced(tmp_path):
    """The split-brain case: the primary A loses etcd and its backup B, and workers still
    reach it. A acknowledges nothing from then on (it cannot replicate, nor drop B without
    etcd), B is promoted when A's lease lapses, the worker moves to B once it can reach it,
    A's late changes are refused by B, and when A reaches etcd again it rejoins as B's
    backup. Every push the worker saw acknowledged is in the rows exactly once."""
    cluster = LocalCluster(1, 2, tmp_path / "cluster", server_args=["--metrics-port", "0"])
    links: list[LinkProxy | LinksIn] = []
    try:
        cluster.start(servers=False)
        assert cluster.etcd is not None
        # A reaches etcd through a link of its own.
        a_etcd = LinkProxy(cluster.etcd.port, "A -> etcd")
        links.append(a_etcd)
        a = cluster.start_server(extra_args=["--coordinator", f"etcd://{a_etcd.address}"])
        cluster.wait_until(lambda: cluster.primaries() == [a], 60, "A is the primary")
        # Whoever reaches B (A's replication, later the worker) goes through B's links.
        b = LinksIn(cluster, "B")
        links.append(b)
        cluster.wait_until(cluster.complete, 60, "B is A's backup")
        a_port = int(a.rsplit(":", 1)[1])

        ee.init(coordinator=cluster.coordinator, mode="async")
        table = history_table("h")
        worker = RecordingWorker(table)
        cluster.wait_until(lambda: len(worker.history.acknowledged) >= 20, 60, "20 pushes")

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
        assert _pushes_acknowledged(cluster, a_port) == a_acknowledged  # nothing more from A
        a_etcd.heal()
        cluster.wait_until(cluster.complete, 60, "A rejoined as B's backup")
        history = worker.stop()

        rows = export(b.address, "h")
        assert check(history, rows["keys"], rows["values"]) == []
        assert_same_state(rows, export(a, "h"))
        stalled = [t for _, t in history.acknowledged if cut_at < t < promoted_at]
        print(
            f"promoted {promoted_at - cut_at:.2f} s after the cut; "
            f"{len(history.acknowledged)} acknowledged, {len(history.failed)} failed, "
            f"{len(stalled)} acknowledged between the cut and the promotion"
        )
    finally:
        ee.shutdown()
        cluster.stop()
        for link in links:
            link.close()


@pytest.mark.parametrize("direction", ["both", "in", "out"])
def test_a_primary_nobody_reaches_for_3_s_is_replaced_and_nothing_is_lost(tmp_path, direction):
    """The links into the primary A (gRPC and data plane, from the worker and from its
    backup B alike) are cut for 3 s, both ways or one ("in": what reaches A is held; "out":
    what A answers). A still reaches etcd and B. B's pings go unanswered for a lease, so B
    takes over (as it must: it cannot tell a dead primary from an unreachable one); the
    worker moves to B; A rejoins as B's backup once healed. Every acknowledged push is in
    the rows exactly once, on both replicas. (A cut of the worker's links alone needs the
    worker to reach A at an address B does not use: not built.)"""
    cluster = LocalCluster(1, 2, tmp_path / "cluster")
    links: list[LinksIn] = []
    try:
        cluster.start(servers=False)
        a = LinksIn(cluster, "A")
        links.append(a)
        cluster.wait_until(lambda: cluster.primaries() == [a.address], 60, "A primary")
        b = cluster.start_server()
        cluster.wait_until(cluster.complete, 60, "B is A's backup")

        ee.init(coordinator=cluster.coordinator, mode="async")
        worker = RecordingWorker(history_table("h"))
        cluster.wait_until(lambda: len(worker.history.acknowledged) >= 20, 60, "20 pushes")
        a.cut(direction)
        time.sleep(3)
        a.heal()
        healed = len(worker.history.acknowledged)
        cluster.wait_until(
            lambda: len(worker.history.acknowledged) >= healed + 20, 60, "20 more pushes"
        )
        cluster.wait_until(cluster.complete, 60, "A rejoined as B's backup")
        history = worker.stop()
        assert cluster.primaries() == [b]  # B took over

        rows = export(b, "h")
        assert check(history, rows["keys"], rows["values"]) == []
        assert_same_state(rows, export(f"127.0.0.1:{a.port}", "h"))
        times = [t for _, t in history.acknowledged]
        print(f"{direction}: longest wait between acknowledgements {max(np.diff(times)):.2f} s")
    finally:
        ee.shutdown()
        cluster.stop()
        for link in links:
            link.close()
