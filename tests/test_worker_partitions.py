"""A worker's links cut while the servers still reach each other and etcd, checked by the
history checker (tests/_history.py): the worker's calls wait (or, with short deadlines,
fail) and it pushes again once healed; there is no failover, since nothing is wrong with
the group; every push the worker saw acknowledged is in the rows exactly once, each failed
one at most once; and the backup equals the primary bit for bit.

The cut worker is a process (tests/_recording_worker.py) in a network namespace of its own
(tests/_netns.py): its only ways out are `LinkProxy`s to etcd and to each server's gRPC and
data-plane ports. The servers (1 group x R=2, real `elastic-emb serve`, lease 2 s) and etcd
have their plain addresses on the host, where the backup and etcd reach the primary
directly: cutting the worker's two links to the primary cuts nobody else.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from _history import (
    History,
    RecordingWorker,
    acknowledged_epochs,
    check,
    check_epochs,
    history_table,
)  # fmt: skip
from _link_proxy import LinkProxy
from _netns import WorkerNamespace
from _replicas import export
from _states import assert_same_state

import elastic_emb as ee
from elastic_emb.ps.coord.local_cluster import LocalCluster, free_port

CUT_SECONDS = 10.0
WORKER = Path(__file__).with_name("_recording_worker.py")


@dataclass
class Server:
    address: str
    links: list[LinkProxy]  # the cut worker's links to its gRPC and data-plane ports

    def cut(self, direction: str) -> None:
        for link in self.links:
            link.cut(direction)

    def heal(self) -> None:
        for link in self.links:
            link.heal()


class CutWorker:
    """The recording worker process in the namespace, and the history it writes."""

    def __init__(
        self, cluster: LocalCluster, ns: WorkerNamespace, args: list[str], etcd: LinkProxy
    ) -> None:
        self.etcd = etcd  # its link to etcd
        self.out = cluster.directory / "history.json"
        self.progress = self.out.with_name(self.out.name + ".progress")
        command = [sys.executable, str(WORKER), cluster.coordinator, str(self.out), *args]
        self.process = cluster.start_worker(ns.command(command))
        self.log = cluster.directory / f"worker-{len(cluster.workers) - 1}.log"

    def acknowledged(self) -> int:
        if self.process.poll() is not None:
            raise RuntimeError(f"the cut worker exited: {self.log.read_text()[-3000:]}")
        try:
            return json.loads(self.progress.read_text())["acknowledged"]
        except FileNotFoundError:
            return 0

    def stop(self) -> History:
        self.out.with_name(self.out.name + ".stop").touch()
        assert self.process.wait(timeout=120) == 0, self.log.read_text()[-3000:]
        written = json.loads(self.out.read_text())
        return History(
            [(k, t) for k, t in written["acknowledged"]], [(k, r) for k, r in written["failed"]]
        )


@contextlib.contextmanager
def _group_and_a_cut_worker(
    tmp_path, worker_args: list[str]
) -> Iterator[tuple[LocalCluster, Server, Server, CutWorker]]:
    """etcd, a primary A and its backup B, and a recording worker in a namespace whose links
    to etcd, A and B each go through a proxy; yields (cluster, A, B, the worker) once the
    worker has 20 pushes acknowledged. Everything is stopped on exit."""
    with WorkerNamespace() as ns:
        cluster = LocalCluster(1, 2, tmp_path / "cluster", audit=True)
        try:
            cluster.start(servers=False)
            assert cluster.etcd is not None
            etcd = ns.forward(cluster.etcd.port, "worker -> etcd")
            servers = []
            for name in "AB":  # A first: the primary
                port, data = free_port(), free_port()
                address = cluster.start_server(port, ["--data-port", str(data)])
                links = [ns.forward(p, f"worker -> {name}:{p}") for p in (port, data)]
                servers.append(Server(address, links))
                cluster.wait_until(
                    lambda: cluster.primaries() == [servers[0].address], 60, "A leads"
                )
            cluster.wait_until(cluster.complete, 60, "B is A's backup")
            worker = CutWorker(cluster, ns, worker_args, etcd)
            cluster.wait_until(lambda: worker.acknowledged() >= 20, 60, "20 pushes")
            yield cluster, servers[0], servers[1], worker
        finally:
            cluster.stop()


def _group(cluster: LocalCluster) -> tuple[str, list[str], int]:
    """The group's primary, backups and epoch: a failover changes them."""
    (g,) = cluster.map().groups
    return g.primary, g.members, g.epoch


def _cut(
    cluster: LocalCluster, a: Server, worker: CutWorker, direction: str
) -> tuple[float, float]:
    """Cuts the worker's links to A for `CUT_SECONDS`, then waits for 20 more pushes and
    checks that the group did not change; (when cut, when healed)."""
    group = _group(cluster)
    cut_at = time.monotonic()
    a.cut(direction)
    time.sleep(CUT_SECONDS)
    a.heal()
    healed_at = time.monotonic()
    healed = worker.acknowledged()
    cluster.wait_until(lambda: worker.acknowledged() >= healed + 20, 60, "20 more pushes")
    assert _group(cluster) == group  # no failover: same primary, backup and epoch
    return cut_at, healed_at


def _exact_on_both(history: History, table: str, primary: str, backup: str) -> None:
    """The checker holds on the primary's rows of `table`; the backup's are the same."""
    rows = export(primary, table)
    assert check(history, rows["keys"], rows["values"]) == []
    assert_same_state(rows, export(backup, table))


def _what_it_saw(history: History, cut_at: float, healed_at: float, who: str) -> str:
    """The worker's view of the cut: failed calls, the longest wait between two
    acknowledgements, and from the heal to the first acknowledgement after it."""
    times = np.array([t for _, t in history.acknowledged])
    # Nothing is acknowledged through the cut (but answers already on their way: 0.5 s).
    during = times[(times > cut_at + 0.5) & (times < healed_at)]
    assert len(during) == 0, f"{len(during)} pushes acknowledged during the cut"
    reasons = sorted({r.split(" no answer")[0] for _, r in history.failed})
    return (
        f"{who}: {len(history.acknowledged)} acknowledged, {len(history.failed)} failed"
        f" {reasons}; longest wait {np.diff(times).max():.2f} s; first acknowledged"
        f" {times[times >= healed_at].min() - healed_at:.2f} s after the heal"
    )


@pytest.mark.parametrize("direction", ["both", "in", "out"])
def test_a_worker_cut_from_its_primary_for_10_s_waits_and_resumes_without_a_failover(
    tmp_path, direction
):
    """The worker's links to the primary A (gRPC and data plane) are cut for 10 s, both ways
    or one ("in": what the worker sends is held; "out": what A answers). A and its backup B
    still reach each other and etcd, and so does the worker etcd: no failover. A call's
    deadline (ee.init's timeout plus a minute) outlasts the cut, so the worker's call in
    flight waits and none fails; once healed it is answered and the worker goes on. Each
    acknowledged push is in the rows once, on both replicas alike."""
    with _group_and_a_cut_worker(tmp_path, ["--mode", "async"]) as (cluster, a, b, worker):
        cut_at, healed_at = _cut(cluster, a, worker, direction)
        history = worker.stop()
        _exact_on_both(history, "h", a.address, b.address)
        print("\n" + _what_it_saw(history, cut_at, healed_at, direction))
        assert history.failed == []


@pytest.mark.parametrize("outside", [False, True], ids=["alone", "with an outside worker"])
def test_a_sync_worker_cut_from_its_primary_for_10_s_resumes(tmp_path, outside):
    """The same cut, both ways, in sync mode. Alone, the worker's own steps wait and resume.
    With a second worker outside the namespace (this process, reaching the servers directly,
    pushing a table of its own, "h2"), that worker's steps wait for the cut one's at the
    barrier, and resume with them. No failover, no failure, both histories hold."""
    with _group_and_a_cut_worker(tmp_path, ["--mode", "sync"]) as (cluster, a, b, worker):
        other = None
        try:
            if outside:
                ee.init(coordinator=cluster.coordinator, mode="sync")
                other = RecordingWorker(history_table("h2"))
                cluster.wait_until(lambda: len(other.history.acknowledged) >= 20, 60, "20 steps")
            cut_at, healed_at = _cut(cluster, a, worker, "both")
            history = worker.stop()
            other_history = None if other is None else other.stop()
        finally:
            ee.shutdown()
        _exact_on_both(history, "h", a.address, b.address)
        print("\n" + _what_it_saw(history, cut_at, healed_at, "sync"))
        assert history.failed == []
        if other_history is not None:
            _exact_on_both(other_history, "h2", a.address, b.address)
            # (`_what_it_saw`: the outside worker too acknowledged nothing during the cut.)
            print(_what_it_saw(other_history, cut_at, healed_at, "outside worker"))
            assert other_history.failed == []


@pytest.mark.parametrize("direction", ["in", "out"])
def test_a_cut_longer_than_the_calls_deadlines_fails_calls_and_loses_nothing(tmp_path, direction):
    """The cut of the first test, one way, with every call of the worker giving up after 3 s:
    its calls fail (TimeoutError), and the requests held ("in") arrive after the heal, or
    those that arrived are answered to nobody ("out"). Each acknowledged push is in the rows
    once, each failed one at most once; no failover. The replicas agree on every row the
    backup holds; the primary alone also holds the rows the failed training Pulls inserted
    (a Pull is not replicated: those rows hold their initial value, never updated)."""
    args = ["--mode", "async", "--deadline", "3"]
    with _group_and_a_cut_worker(tmp_path, args) as (cluster, a, b, worker):
        cut_at, healed_at = _cut(cluster, a, worker, direction)
        history = worker.stop()
        print("\n" + _what_it_saw(history, cut_at, healed_at, f"{direction}, 3 s deadlines"))
        assert history.failed  # (the cut outlasts the deadlines)
        rows, backup = export(a.address, "h"), export(b.address, "h")
        assert check(history, rows["keys"], rows["values"]) == []
        on_b = np.isin(rows["keys"], backup["keys"])
        assert_same_state({f: v[on_b] if v.ndim else v for f, v in rows.items()}, backup)
        only_a = rows["keys"][~on_b]
        assert set(only_a.tolist()) <= {k for k, _ in history.failed}
        assert np.all(rows["values"][~on_b] == 0) and np.all(rows["update_count"][~on_b] == 0)
        print(f"rows on the primary alone: {only_a.tolist()}")


def test_a_worker_s_slow_then_flapping_links_to_its_primary_make_no_failover(tmp_path):
    """The worker's links to A delay every byte 200 ms each way for 4 s, then flap (cut 1 s
    in every 3 s, seeded) for 9 s. Its pushes slow down, pause at each cut and go on; the
    group never changes (nothing is wrong with it); no call fails; each acknowledged push
    is in the rows once, on both replicas alike."""
    with _group_and_a_cut_worker(tmp_path, ["--mode", "async"]) as (cluster, a, b, worker):
        group = _group(cluster)

        def rate(seconds: float) -> float:
            before = worker.acknowledged()
            time.sleep(seconds)
            return (worker.acknowledged() - before) / seconds

        free = rate(2)
        for link in a.links:
            link.slow(0.2)
        slowed = rate(4)
        for link in a.links:
            link.slow(0)
            link.flap(seed=41, seconds=9, every=3.0, cut_for=1.0)  # (both links together)
        flapping = rate(9.5)
        healed = worker.acknowledged()
        cluster.wait_until(lambda: worker.acknowledged() >= healed + 20, 60, "20 more pushes")
        history = worker.stop()
        assert _group(cluster) == group  # no failover
        _exact_on_both(history, "h", a.address, b.address)
        assert history.failed == []
        times = np.array([t for _, t in history.acknowledged])
        print(
            f"\npushes/s: {free:.1f} free, {slowed:.1f} slowed, {flapping:.1f} flapping; "
            f"longest wait {np.diff(times).max():.2f} s"
        )
        assert slowed < free / 2, (free, slowed)  # the links were slowed


def test_a_worker_s_flapping_link_to_etcd_through_a_failover_loses_nothing(tmp_path):
    """The worker's link to etcd flaps (cut 1 s in every 3 s, seeded) for 6 s: no call
    fails, the group stays. Then it is cut, the primary A killed (SIGKILL) and B promoted
    while the worker cannot see the map; healed 1 s later, it flaps again for 6 s. The
    worker learns of B through the link and trains on; each acknowledged push is in B's
    rows once, and the audit logs show one primary per epoch."""
    with _group_and_a_cut_worker(tmp_path, ["--mode", "async"]) as (cluster, a, b, worker):
        group = _group(cluster)
        worker.etcd.flap(seed=43, seconds=6, every=3.0, cut_for=1.0)
        time.sleep(6.5)
        assert _group(cluster) == group
        worker.etcd.cut()
        killed = worker.acknowledged()
        cluster.kill(a.address)
        cluster.wait_until(lambda: cluster.primaries() == [b.address], 60, "B promoted")
        time.sleep(1.0)
        before = worker.acknowledged()
        healed_at = time.monotonic()
        worker.etcd.heal()
        worker.etcd.flap(seed=44, seconds=6, every=3.0, cut_for=1.0)
        cluster.wait_until(lambda: worker.acknowledged() >= before + 20, 60, "20 pushes on B")
        resumed = time.monotonic() - healed_at
        time.sleep(max(0.0, healed_at + 6.5 - time.monotonic()))  # (the flapping ends)
        history = worker.stop()
        assert _group(cluster)[2] > group[2]  # (a new epoch)
        rows = export(b.address, "h")
        assert check(history, rows["keys"], rows["values"]) == []
        print(
            f"\n20 pushes on B {resumed:.2f} s after the worker's etcd link healed; "
            f"{before - killed} acknowledged between the kill and the heal; "
            f"{len(history.acknowledged)} acknowledged, {len(history.failed)} failed"
        )
    epochs = acknowledged_epochs(cluster.audit_logs())
    assert check_epochs(epochs) == [] and len(epochs) >= 2
