"""etcd members cut from each other while a replicated group trains, every process alive,
checked by the history checker (tests/_history.py): a follower or the leader cut from the
majority causes no failover and no worker error; a failover during the leader's cut goes
through the majority; nothing acknowledged is lost, and the replicas end equal bit for bit.

A 3-member etcd on 127.0.0.1 whose raft links (member to member, on the peer URLs) go
through `LinkProxy`s, one per ordered pair of members (`EtcdPeerLinks`); one group of 2
real `elastic-emb serve` processes and an async `RecordingWorker` whose coordinator URLs
name the cut member first, so that their etcd clients start on it and must move away.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
from _history import RecordingWorker, history_table
from _link_proxy import LinkProxy
from test_partitions import _exact_on_both

import elastic_emb as ee
from elastic_emb.ps.coord import membership
from elastic_emb.ps.coord.etcd import Etcd
from elastic_emb.ps.coord.etcd_process import EtcdCluster, EtcdProcess, start_etcd_cluster
from elastic_emb.ps.coord.local_cluster import LocalCluster, free_port
from elastic_emb.ps.coord.membership import ClusterMap

MEMBERS = 3


class EtcdPeerLinks:
    """The raft links of an etcd cluster of `n` members: a `LinkProxy` per ordered pair,
    `links[(j, i)]` carrying every connection member j opens to member i's peer port
    (j's streams that bring i's messages to j, j's pipeline and lease calls to i).

    Member i advertises `advertised[i]`, a listener that hands each connection it accepts
    to the link of the member that opened it (the etcd process holding the connection's
    other end, found in /proc, named by its `--name m<j>`) and closes any other. (Not a
    proxy per pair in each member's --initial-cluster: etcd derives a member's id from its
    peer URLs, so every member must name the same ones.)
    """

    def __init__(self, n: int) -> None:
        self.peer_ports = [free_port() for _ in range(n)]
        self.links = {
            (j, i): LinkProxy(self.peer_ports[i], f"m{j} -> m{i}")
            for i in range(n)
            for j in range(n)
            if i != j
        }
        self._listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
        self.advertised = [s.getsockname()[1] for s in self._listeners]
        self.unsorted = 0  # connections aborted: no member of ours opened them
        self._threads = [
            threading.Thread(target=self._sort, args=(i,), daemon=True, name=f"-> m{i} peer")
            for i in range(n)
        ]
        for t in self._threads:
            t.start()

    def isolate(self, i: int) -> None:
        """Cuts member i from every other, both ways, on every connection."""
        for (j, k), link in self.links.items():
            if i in (j, k):
                link.cut()

    def heal(self) -> None:
        for link in self.links.values():
            link.heal()

    def close(self) -> None:
        for s in self._listeners:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        for t in self._threads:
            t.join(timeout=5)
        for link in self.links.values():
            link.close()

    def _sort(self, i: int) -> None:
        listener = self._listeners[i]
        while True:
            try:
                client, (_, port) = listener.accept()
            except OSError:
                return  # closed
            j = _member_that_opened(port, self.advertised[i])
            if j is None or (j, i) not in self.links:
                self.unsorted += 1
                client.close()
            else:
                self.links[(j, i)].adopt(client)


def _member_that_opened(port: int, to: int) -> int | None:
    """j, of the etcd process named m<j> that holds the end at 127.0.0.1:`port` of a TCP
    connection to 127.0.0.1:`to`; None if there is none."""
    end = f"0100007F:{port:04X} 0100007F:{to:04X}"  # /proc/net/tcp's local and remote
    with open("/proc/net/tcp") as table:
        inodes = [f[9] for f in map(str.split, table) if len(f) > 9 and f"{f[1]} {f[2]}" == end]
    if not inodes:
        return None
    held = f"socket:[{inodes[0]}]"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as comm:
                if comm.read().strip() != "etcd":
                    continue
            if any(
                _readlink(f"/proc/{pid}/fd/{fd}") == held for fd in os.listdir(f"/proc/{pid}/fd")
            ):
                with open(f"/proc/{pid}/cmdline") as cmdline:
                    name = re.search(r"\0--name\0m(\d+)\0", cmdline.read())
                return int(name[1]) if name else None
        except OSError:
            continue  # (it exited meanwhile)
    return None


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""  # (closed meanwhile)


def _keepalives(member: EtcdProcess) -> float:
    """The lease keep-alives `member` has served (its LeaseKeepAlive streams, from /metrics:
    each of our clients' refreshes opens one through etcd's gateway)."""
    conn = http.client.HTTPConnection(member.host, member.port, timeout=5)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    found = re.search(r'^grpc_server_started_total\{grpc_method="LeaseKeepAlive"[^}]*\} (\S+)$',
                      text, re.MULTILINE)  # fmt: skip
    return float(found[1]) if found else 0.0


def _leader_of(members: list[EtcdProcess]) -> str | None:
    """The member id that every one of `members` names its leader, if they agree on one."""
    leaders = set()
    for m in members:
        try:
            leaders.add(m.status().get("leader"))
        except (OSError, http.client.HTTPException, ValueError):
            return None
    return leaders.pop() if len(leaders) == 1 else None


def _leases(cluster: LocalCluster) -> dict[str, int]:
    """The lease of each server's and each worker's key."""
    prefix = membership.DEFAULT_PREFIX
    with Etcd(cluster.coordinator) as etcd:
        kvs = [
            kv
            for p in (membership.servers_prefix(prefix), membership.workers_prefix(prefix))
            for kv in etcd.get_prefix(p)[0]
        ]
    return {kv.key: kv.lease for kv in kvs}


@contextlib.contextmanager
def _group_on_three_members(
    tmp_path, cut: str
) -> Iterator[tuple[EtcdCluster, EtcdPeerLinks, EtcdProcess, LocalCluster, RecordingWorker]]:
    """A 3-member etcd whose raft links go through `EtcdPeerLinks`; the member to cut (the
    leader, or a follower), named first in the coordinator URL of the servers A (primary)
    and B (backup) and of an async recording worker, 20 of whose pushes are acknowledged.
    Everything is stopped on exit. Yields (etcd, its links, the member to cut, the
    cluster, the worker)."""
    links = EtcdPeerLinks(MEMBERS)
    try:
        with start_etcd_cluster(
            MEMBERS, tmp_path / "etcd",
            peer_ports=links.peer_ports, advertise_peer_ports=links.advertised,
        ) as members:  # fmt: skip
            leader = members.leader()
            victim = leader if cut == "leader" else next(m for m in members.members if m != leader)
            others = [m.endpoint for m in members.members if m is not victim]
            url = f"etcd://{victim.endpoint},{','.join(others)}"
            cluster = LocalCluster(1, 2, tmp_path / "cluster", coordinator=url)
            try:
                cluster.start(servers=False)
                a = cluster.start_server()
                cluster.wait_until(lambda: cluster.primaries() == [a], 60, "A is the primary")
                cluster.start_server()
                cluster.wait_until(cluster.complete, 60, "B is A's backup")
                ee.init(coordinator=url, mode="async")
                worker = RecordingWorker(history_table("h"))
                cluster.wait_until(lambda: len(worker.history.acknowledged) >= 20, 60, "20 pushes")
                yield members, links, victim, cluster, worker
            finally:
                ee.shutdown()
                cluster.stop()
    finally:
        links.close()


def _cut_for_5_s_while_training(tmp_path, cut: str, kill_primary: bool = False) -> None:
    """The member `cut` (the leader or a follower) is cut from the two others for 5 s
    (2.5 leases of the servers), then healed; with `kill_primary`, the group's primary is
    SIGKILLed 0.2 s into the cut and restarted once healed. See the tests."""
    with _group_on_three_members(tmp_path, cut) as (members, links, victim, cluster, worker):
        (group,) = cluster.map().groups
        (backup,) = group.members
        rest = [m for m in members.members if m is not victim]
        leases = _leases(cluster)
        before = _keepalives(victim)
        time.sleep(1)
        on_victim = _keepalives(victim) - before
        assert on_victim > 0  # (the servers' and the worker's clients are on it)
        assert (members.leader() is victim) == (cut == "leader")
        victim_id = victim.status()["header"]["member_id"]

        cut_at = time.monotonic()
        links.isolate(members.members.index(victim))
        moved = sum(map(_keepalives, rest))
        new_leader = victim_alone = promoted_at = None
        if kill_primary:
            time.sleep(0.2)
            cluster.kill(group.primary)
            killed_at = time.monotonic()
        majority = Etcd(f"etcd://{','.join(m.endpoint for m in rest)}")
        while time.monotonic() < cut_at + 5:
            new_leader = _leader_of(rest) or new_leader
            victim_alone = victim_alone or _leader_of([victim]) in (None, "0")
            if kill_primary and promoted_at is None:
                if ClusterMap.read(majority).groups[0].primary == backup:
                    promoted_at = time.monotonic()
            time.sleep(0.1)
        majority.close()
        moved = sum(map(_keepalives, rest)) - moved
        links.heal()
        healed_at = time.monotonic()
        if kill_primary:
            cluster.wait_until(lambda: cluster.primaries() == [backup], 60, "B promoted")
            promoted_at = promoted_at or time.monotonic()
            assert [r for _, _, r in cluster.restart_dead()] == [True]
        acknowledged = len(worker.history.acknowledged)
        cluster.wait_until(
            lambda: len(worker.history.acknowledged) >= acknowledged + 20, 60, "20 more pushes"
        )
        cluster.wait_until(cluster.complete, 60, "the group has both replicas")
        history = worker.stop()

        (after,) = cluster.map().groups
        if kill_primary:  # one failover, to B, and A back as its backup
            assert (after.primary, after.epoch, after.members) == (
                backup, group.epoch + 1, [group.primary],
            )  # fmt: skip
            _exact_on_both(history, backup, group.primary)
            b_log = (cluster.directory / f"server-{backup.rsplit(':', 1)[1]}.log").read_text()
            assert b_log.count("is now the primary") == 1  # (one take-over acted, not two)
        else:  # no failover, and every lease held throughout
            assert (after.primary, after.epoch) == (group.primary, group.epoch)
            assert _leases(cluster) == leases and len(leases) == 3
            _exact_on_both(history, group.primary, backup)
        assert links.unsorted == 0
        assert victim_alone  # the cut member lost its leader: the cut held
        assert new_leader not in (None, victim_id)  # the majority had a leader (a new one)
        assert moved > 0  # the keep-alives moved to the majority
        times = [t for _, t in history.acknowledged]
        during = [t for t in times if cut_at < t < healed_at]
        longest = max(np.diff(times))
        promoted = (
            f"B promoted {promoted_at - killed_at:.2f} s after the kill; " if kill_primary else ""
        )
        print(
            f"{cut} cut 5 s{', primary killed' * kill_primary}: {promoted}longest wait "
            f"between acknowledgements {longest:.2f} s; {len(during)} "
            f"acknowledged during the cut, {len(history.failed)} failed; keep-alives on the "
            f"cut member before it {on_victim:.0f}/s, on the others during it {moved:.0f}"
        )
        assert len(during) > 0 and longest < 15  # training went on through the cut
        if not kill_primary:
            assert history.failed == []  # nothing visible


def test_a_follower_cut_from_the_majority_changes_nothing(tmp_path):
    """A follower of the 3 etcd members, the one the servers' and the worker's etcd
    clients start on, is cut from the two others for 5 s (longer than the servers' 2 s
    lease): it loses its leader and answers "no leader"; the clients' calls and keep-alives
    move to the majority, which keeps a leader. No failover (same primary, same epoch), no
    worker error, training goes on through the cut, every acknowledged push is in the rows
    once, and the backup's rows equal the primary's bit for bit."""
    _cut_for_5_s_while_training(tmp_path, "follower")


def test_the_etcd_leader_cut_from_the_majority_changes_nothing(tmp_path):
    """The etcd leader, the member the clients start on, is cut from the two others for
    5 s: it steps down (no quorum), the majority elects a new leader, and the clients move
    to it. No failover either (etcd's new leader extends every lease when it takes over),
    no worker error, every acknowledged push is in the rows once, replicas equal."""
    _cut_for_5_s_while_training(tmp_path, "leader")


def test_a_failover_while_the_etcd_leader_is_cut_goes_through_the_majority(tmp_path):
    """The etcd leader is cut as above and, 0.2 s later, the primary A is SIGKILLed: the
    backup B, whose etcd client starts on the cut leader, takes over through the majority
    (one failover: epoch + 1), the worker's map watch moves there and it re-sends to B;
    restarted after the heal, A rejoins as B's backup. Every acknowledged push is in the
    rows exactly once, on both replicas."""
    _cut_for_5_s_while_training(tmp_path, "leader", kill_primary=True)


def test_the_etcd_leader_s_links_flapping_change_nothing(tmp_path):
    """Every raft link of the etcd leader (the member the clients start on) is cut 1 s in
    every 3 s for 9 s, all together (seeded): leadership may move at each cut. No failover,
    every server's and worker's lease held throughout, no worker error, every acknowledged
    push in the rows once, replicas equal."""
    with _group_on_three_members(tmp_path, "leader") as (members, links, victim, cluster, worker):
        (group,) = cluster.map().groups
        leases = _leases(cluster)
        i = members.members.index(victim)
        for (j, k), link in links.links.items():
            if i in (j, k):
                link.flap(seed=42, seconds=9, every=3.0, cut_for=1.0)
        time.sleep(9.5)
        acknowledged = len(worker.history.acknowledged)
        cluster.wait_until(
            lambda: len(worker.history.acknowledged) >= acknowledged + 20, 60, "20 more pushes"
        )
        history = worker.stop()
        (after,) = cluster.map().groups
        assert (after.primary, after.epoch) == (group.primary, group.epoch)  # no failover
        assert _leases(cluster) == leases
        _exact_on_both(history, group.primary, group.members[0])
        assert history.failed == [] and links.unsorted == 0
        times = [t for _, t in history.acknowledged]
        print(f"leader flapping: longest wait between acknowledgements {max(np.diff(times)):.2f} s")
