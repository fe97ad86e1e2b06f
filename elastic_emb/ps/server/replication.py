"""`Replica`: a server's place in a coordinated cluster (`elastic-emb serve --coordinator
etcd://H:P`). It holds an etcd lease (its liveness), takes its place in the cluster map
(`elastic_emb.ps.coord.membership`: primary, backup, joining backup or spare), follows the
map and makes its changes, and hands the rest to its parts: the replication of changes
(`replicator`), the copying of a snapshot to a joining backup (`snapshot_copy`), the slot
ranges moving in and out (`incoming_ranges`, `range_move`), the load (`load_balancing`),
the take-over from a dead primary (`failover`), the removal of a backup its primary
cannot reach (`backup_watch`) and the channels to the other servers
(`peer_channels`); the state they share is `replica_state`'s."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from elastic_emb._proto import ps_pb2
from elastic_emb.ps.coord import membership
from elastic_emb.ps.coord.balance import LoadMeter, Policy, Usage
from elastic_emb.ps.coord.etcd import Compare, Etcd, EtcdError, LeaseLost, Op
from elastic_emb.ps.coord.membership import DEFAULT_PREFIX, ClusterMap, Group
from elastic_emb.ps.server.backup_watch import BackupWatch
from elastic_emb.ps.server.failover import Failover
from elastic_emb.ps.server.incoming_ranges import IncomingRanges
from elastic_emb.ps.server.load_balancing import LoadBalancer, LoadReporter, MemoryBalancer
from elastic_emb.ps.server.peer_channels import PeerChannels
from elastic_emb.ps.server.range_move import RangeMover
from elastic_emb.ps.server.replica_state import MapChange, ReplicaState, aborted
from elastic_emb.ps.server.replicator import REPLICATED_METHODS, WORKER_CHANGES, Replicator
from elastic_emb.ps.server.shard import Ranges, RequestError
from elastic_emb.ps.server.snapshot import RangeSnapshot
from elastic_emb.ps.server.snapshot_copy import SnapshotCopy
from elastic_emb.ps.wire.security import ClientSecurity

__all__ = ["REPLICATED_METHODS", "WORKER_CHANGES", "Replica", "aborted"]

log = logging.getLogger("elastic_emb.server")

# A worker whose lease ended counts as gone only if it has not registered again this long
# after (a lapse under load, not a death): no sync step goes on without it meanwhile.
WORKER_GRACE_SECONDS = 3.0
DATA_PORT_TIMEOUT = 2.0  # a backup that does not say its data port in time: asked again later

_Snapshot = RangeSnapshot  # its name before the split (tests use it)


class Replica:
    """This server's role in its replica group; replicates its ranges' changes, moves ranges.

    Thread-safe. `replicate` serializes the changes of a primary
    (`ReplicaState.order`); the role, the map, the applied sequence and the
    moves under way are guarded by `ReplicaState.cond`. A primary's mover
    thread (`RangeMover`) applies the map's splits and moves its ranges.

    Args:
        ranges: the server's shards (replaced on a snapshot or a reset).
        apply: applies a change request: apply(method, request).
        etcd: the coordinator.
        address: "host:port" the other servers and workers reach this one at.
        replicas: replicas per group (R), for the placement of this server.
        lease_seconds: TTL of this server's lease.
        prefix: the cluster's key prefix in etcd.
        move_pause: seconds a range move waits after sending its snapshot (fault tests).
        cutover_pause: seconds a range move holds its changes before and after its cutover
            (fault tests).
        security: how to call the other servers (TLS, a token); None: plaintext.
        load: the server's per-slot load, published to the coordinator; None: not measured.
        balance: when this server, as the most loaded primary, moves slots away
            (`elastic_emb.ps.coord.balance`); None: never for load. Needs `load`.
        usage: this server's use of resources, published with the load, given the
            process's CPU rate (`Servicer.usage`); None: not published.
        memory_high_water: as a primary whose tables passed this share of their memory
            budget, move slots to a group with room; None: never. Needs `load` and `usage`.
    """

    def __init__(
        self,
        ranges: Ranges,
        apply: Callable[[str, Any], Any],
        etcd: Etcd,
        address: str,
        replicas: int,
        lease_seconds: int = 2,
        prefix: str = DEFAULT_PREFIX,
        move_pause: float = 0.0,
        cutover_pause: float = 0.0,
        security: ClientSecurity | None = None,
        load: LoadMeter | None = None,
        balance: Policy | None = None,
        usage: Callable[[float], Usage] | None = None,
        memory_high_water: float | None = None,
    ) -> None:
        if (balance is not None or memory_high_water is not None) and load is None:
            raise ValueError("balancing slots by load needs the load measured (`load`)")
        self.ranges = ranges
        self.address = address
        self._etcd = etcd
        self._replicas = replicas
        self._prefix = prefix
        state = self._state = ReplicaState(address, lease_seconds, ranges.native)
        # The data plane serves no range of this server until the map and lease say so.
        ranges.native.set_serving({})
        channels = self._channels = PeerChannels(security)
        self._replicator = Replicator(state, apply, channels, self._drop)
        # The data plane's changes: a backup that fails one is dropped as in Python.
        token = security.token if security is not None and security.token else ""
        state.replication.configure(self._drop_quietly, token)
        # Over TLS where the cluster has TLS (peer CA, this server's certificate).
        if security is not None:
            state.replication.set_tls(security.data_plane_tls())
        self._incoming = IncomingRanges(state, ranges, apply)
        self._copier = SnapshotCopy(
            state, ranges, self._replicator, channels, self._change_map, self._drop,
            self._incoming.follow,
        )  # fmt: skip
        self._failover = Failover(
            state, etcd, prefix, channels, self._change_map, self._forget_gone_workers
        )
        self._backup_watch = BackupWatch(state, channels, self._drop)
        balancers: list[LoadBalancer | MemoryBalancer] = []
        if memory_high_water is not None and load is not None:
            balancers.append(
                MemoryBalancer(etcd, prefix, load.window, memory_high_water, self._change_map)
            )
        if balance is not None and load is not None:
            balancers.append(LoadBalancer(etcd, prefix, load, balance, self._change_map))
        self._mover = RangeMover(
            state, ranges, apply, self._replicator, self._incoming, channels, self._change_map,
            balancers, move_pause, cutover_pause,
        )  # fmt: skip
        self._reporter = None
        if load is not None:
            self._reporter = LoadReporter(state, etcd, prefix, load, usage)
        self._threads: list[threading.Thread] = []  # started by `start`
        # Held while this server takes a new lease (`_register`, `_keep_place`): two rejoins
        # at once (the lease ended and the map dropped it) must not revoke each other's.
        self._leasing = threading.Lock()
        self._watch: Any = None  # the etcd watch: set by `start`, cancelled by `stop`
        # Set by the server before `start`: records that an elastic worker left (a change,
        # on a primary).
        self.worker_gone: Callable[[int], None] = lambda worker: None

    # Life cycle.

    def start(self) -> None:
        """Registers with the coordinator, takes a place, and starts the background work."""
        self._register(fresh=True)
        with self._state.cond:
            revision = self._state.map.revision
        self._watch = self._etcd.watch(self._prefix, self._on_events, revision + 1)
        targets = [
            ("ee-_keep_alive", self._keep_alive),
            ("ee-_monitor", self._failover.run),
            ("ee-_watch_backups", self._backup_watch.run),
            ("ee-_mover", self._mover.run),
        ]
        if self._reporter is not None:
            targets.append(("ee-_report_load", self._reporter.run))
        for name, target in targets:
            thread = threading.Thread(target=target, daemon=True, name=name)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Leaves the cluster: revokes the lease (backups take over at once)."""
        with self._state.cond:
            self._state.stopped = True
            lease = self._state.lease
            self._state.cond.notify_all()
        if self._watch is not None:
            self._watch.cancel()
        try:
            self._etcd.revoke(lease)
        except EtcdError:
            pass
        self._replicator.shutdown()
        self._channels.close()

    def _register(self, fresh: bool = False) -> None:
        """A fresh lease, the server key under it, and a place in the map (state wiped).

        `fresh`: a new process; if its address was being drained, that was another server.
        """
        with self._leasing:
            self._register_now(fresh)

    def _register_now(self, fresh: bool) -> None:
        state = self._state
        lease = self._etcd.grant(state.lease_seconds)
        key = membership.server_key(self._prefix, self.address)
        self._etcd.put(
            key, json.dumps({"address": self.address, "lease": lease.id}).encode(), lease.id
        )
        # Emptied before the new lease counts: the map this server knows may still name it a
        # primary, and its old state is not its group's any longer.
        self._reset_state()
        with state.cond:
            old, state.lease, state.last_keepalive = state.lease, lease.id, time.monotonic()
            state.publish_serving()
        if old:
            try:
                self._etcd.revoke(old)
            except EtcdError:
                pass

        others = self._live_spares()

        def place(m: ClusterMap) -> ClusterMap:
            if fresh:
                m = m.undrain(self.address) or m
            spares = [a for a in others if m.group_of(a) is None and a not in m.draining]
            return m.place(self.address, self._replicas, spares=len(spares))

        self._take_place(place)
        log.info("registered as %s: %s", self.address, self.role)

    def _live_spares(self) -> list[str]:
        """The other servers that answer as spares now (a dead one's key outlives it a while)."""
        registered, _ = self._etcd.get_prefix(membership.servers_prefix(self._prefix))
        m = self._read_map()
        spares = []
        for kv in registered:
            address = kv.key.rsplit("/", 1)[1]
            if address == self.address or m.group_of(address) is not None:
                continue
            try:
                health = self._channels.stub(address).Health(ps_pb2.HealthRequest(), timeout=1.0)
                if health.role == "spare":
                    spares.append(address)
            except grpc.RpcError:
                pass
        return spares

    def _take_place(self, change: MapChange) -> None:
        placed = self._change_map(change, as_primary=False)
        group = placed.group_of(self.address)
        if group is not None and group.primary == self.address:
            with self._state.cond:  # a new group (or one that lost every replica): empty
                self._state.set_applied(0, group.epoch)

    def _fill_in(self) -> None:
        """A spare joins a group that lacks a replica (its state is empty: it was reset)."""

        def place(m: ClusterMap) -> ClusterMap | None:
            if m.group_of(self.address) is not None or self.address in m.draining:
                return None
            return m.place(self.address, self._replicas) if m.lacking() else None

        if self._state.is_stopped():
            return
        self._take_place(place)
        if self.role != "spare":
            log.info("%s left the spares: %s", self.address, self.role)

    def _reset_state(self) -> None:
        """Forgets this server's state (between two changes): it serves no worker until it
        has its group's again (a snapshot, or an empty new group)."""
        with self._state.order, self._state.cond:
            self.ranges.replace({})
            self._incoming.forget()
            self._state.set_applied(None, 0)

    # The map.

    def _read_map(self) -> ClusterMap:
        return ClusterMap.read(self._etcd, self._prefix)

    def _change_map(self, change: MapChange, as_primary: bool) -> ClusterMap:
        """Applies `change` to the current map in one etcd transaction (retried on races).

        With `as_primary`, only while this server is still its group's
        primary, with its lease (else `aborted`).
        """

        def checked(current: ClusterMap) -> ClusterMap | None:
            if as_primary:
                self._check_primary_in(current)
            return change(current)

        def holds_lease() -> list[Any]:
            if not as_primary:
                return []
            with self._state.cond:
                lease = self._state.lease
            key = membership.server_key(self._prefix, self.address)
            return [Compare.lease(key, "=", lease)]

        try:
            new, changed = membership.update(self._etcd, self._prefix, checked, holds_lease)
        except RuntimeError as e:
            raise aborted(str(e)) from None
        if changed:
            self._set_map(new)
        return new

    def _check_primary_in(self, current: ClusterMap) -> Group:
        ours = self._state.group()
        group = current.group_of(self.address)
        if (
            group is None
            or ours is None
            or group.primary != self.address
            or group.epoch != ours.epoch
        ):
            raise aborted(f"{self.address} is no longer the primary of its group")
        return group

    def _on_events(self, events: list[Any]) -> None:
        map_key = membership.map_key(self._prefix)
        servers = membership.servers_prefix(self._prefix)
        workers = membership.workers_prefix(self._prefix)
        if not events:  # the watch restarted: read everything again
            self._set_map(self._read_map())
            self._in_background(self._forget_gone_workers)
            return
        for event in events:
            if event.kv.key == map_key and event.type == "PUT":
                self._set_map(ClusterMap.from_json(event.kv.value, event.kv.mod_revision))
            elif event.kv.key.startswith(servers) and event.type == "DELETE":
                self._server_gone(event.kv.key[len(servers) :])
            elif event.kv.key.startswith(workers) and event.type == "DELETE":
                if self.role == "primary":
                    self._in_background(self._worker_gone, event.kv.key)

    def _worker_gone(self, key: str) -> None:
        """A worker's key was deleted: it left, unless it registers again within
        WORKER_GRACE_SECONDS (its lease had lapsed: no sync step goes on without it)."""
        state = self._state
        with state.cond:
            if state.cond.wait_for(lambda: state.stopped, WORKER_GRACE_SECONDS):
                return
        if self._etcd.get(key) is None:
            self.worker_gone(int(key.rsplit("/", 1)[1]))

    def _forget_gone_workers(self) -> None:
        """A new primary: the elastic workers whose leases ended meanwhile leave."""
        if self.role != "primary":
            return
        registered, _ = self._etcd.get_prefix(membership.workers_prefix(self._prefix))
        alive = {int(kv.key.rsplit("/", 1)[1]) for kv in registered}
        live = {w for shard in self.ranges.shards() for w in shard.export_steps()[0]["live"]}
        for worker in sorted(live - alive):
            self.worker_gone(worker)

    def _set_map(self, new: ClusterMap) -> None:
        """Adopts a newer map and acts on what it says of this server."""
        state = self._state
        with state.cond:
            if new.revision <= state.map.revision or state.stopped:
                return
            old_group = state.map.group_of(self.address)
            state.map = new
            group = new.group_of(self.address)
            members = set(group.members) if group is not None else set()
            state.data_ports = {a: p for a, p in state.data_ports.items() if a in members}
            state.publish_serving()
            learn = group is not None and group.primary == self.address
            learn = learn and any(b not in state.data_ports for b in members)
            self._incoming.follow(new, group)
            state.rebalance_due = True
            state.cond.notify_all()
            lease = state.lease
            joining: list[str] = []
            if group is not None and group.primary == self.address:
                joining = [a for a in group.joining if a not in self._replicator.copies]
        if learn:
            self._in_background(self._learn_data_ports)
        if old_group is not None and group is None:
            log.warning("%s was removed from group %d: rejoining", self.address, old_group.id)
            self._in_background(self._rejoin, lease)
        elif old_group is None and group is None and new.lacking():
            self._in_background(self._fill_in)
        else:
            for address in joining:  # (copy_to checks again, under the lock)
                self._in_background(self._copier.copy_to, address)

    def _server_gone(self, address: str) -> None:
        """A server's lease ended: its primary drops it; if it was our primary, take over."""
        group = self._state.group()
        if group is None or address == self.address:
            return
        if group.primary == address:
            self._in_background(self._failover.take_over, address)
        elif group.primary == self.address and group.holds(address):
            self._in_background(self._drop, address, "its lease ended")

    def _learn_data_ports(self) -> None:
        """Asks this primary's backups for their data planes' ports (Health): the data plane
        sends its changes there once it knows every backup's (`publish_serving`)."""
        state = self._state
        group = state.group()
        if group is None or group.primary != self.address:
            return
        for backup in group.members:
            with state.cond:
                if backup in state.data_ports:
                    continue
            try:
                health = self._channels.stub(backup).Health(
                    ps_pb2.HealthRequest(), timeout=DATA_PORT_TIMEOUT
                )
            except grpc.RpcError as e:  # (asked again at the next map change)
                log.info("%s did not say its data port: %s", backup, e.code().name)
                continue
            with state.cond:
                state.data_ports[backup] = health.data_port
                state.publish_serving()

    def _drop_quietly(self, address: str, why: str) -> bool:
        """`_drop` for the data plane, on a thread of its own: whether it removed the backup
        (or it was gone already); a failure is logged (the change is not acknowledged)."""
        try:
            self._drop(address, why)
        except Exception as e:
            log.warning("could not remove %s from the group: %s", address, e)
            return False
        return True

    def _in_background(self, target: Callable[..., None], *args: Any) -> None:
        def run() -> None:
            try:
                target(*args)
            except Exception:
                log.exception("%s%s failed", target.__name__, args)

        threading.Thread(target=run, daemon=True).start()

    def _drop(self, address: str, why: str) -> None:
        """Removes a backup (or joining server) from this primary's group; `aborted` if it
        cannot (no longer the primary, or etcd out of reach): a change that backup did not
        apply is then not acknowledged."""
        log.warning("removing %s from the group: %s", address, why)

        def remove(m: ClusterMap) -> ClusterMap | None:
            group = m.group_of(self.address)
            if group is None or not group.holds(address) or address == self.address:
                return None
            return m.without(address)

        try:
            self._change_map(remove, as_primary=True)
        except EtcdError as e:
            raise aborted(
                f"{self.address} cannot remove {address} from its group without the "
                f"coordinator ({e}): not acknowledged"
            ) from None

    @property
    def role(self) -> str:
        return self._state.role()

    def status(self) -> tuple[str, int, int, int]:
        """(role, group, epoch, sequence applied)."""
        role = self.role
        with self._state.cond:
            group = self._state.map.group_of(self.address)
            return (
                role,
                group.id if group else -1,
                group.epoch if group else 0,
                self._state.applied or 0,
            )

    def cluster_map(self) -> ClusterMap:
        """The newest map this server knows."""
        with self._state.cond:
            return self._state.map.copy()

    def channel(self, address: str) -> grpc.Channel:
        """A channel to another server (kept open)."""
        return self._channels.channel(address)

    # Liveness.

    def _keep_alive(self) -> None:
        """Refreshes the lease every quarter of its TTL; a failed refresh is tried again
        soon, each try bounded by what is left of the lease."""
        state = self._state
        next_refresh = time.monotonic()
        while True:
            # state.cond is notified at every change a backup applies: wait out the interval.
            with state.cond:
                while not state.stopped and (left := next_refresh - time.monotonic()) > 0:
                    state.cond.wait(left)
                if state.stopped:
                    return
                lease, last = state.lease, state.last_keepalive
            sent = time.monotonic()
            interval = state.lease_seconds / 4
            try:
                self._etcd.keepalive_once(lease, max(0.2, last + state.lease_seconds - sent))
                self._coordinator_reached()
                with state.cond:
                    state.last_keepalive = max(state.last_keepalive, sent)  # at the latest
                    state.publish_serving()
            except LeaseLost:
                self._coordinator_reached()
                with state.cond:
                    replaced = state.lease != lease  # rejoined meanwhile
                if not replaced and not self._keep_place():
                    log.warning("%s lost its lease: rejoining with an empty state", self.address)
                    self._rejoin(lease)
            except EtcdError as e:
                with state.cond:
                    first = state.coordinator_lost_since is None
                    if first:
                        state.coordinator_lost_since = sent
                if first:
                    log.warning(
                        "%s cannot reach the coordinator (%s): as a primary it serves on while "
                        "every backup follows it; failover, joins and moves wait for etcd",
                        self.address, e,
                    )  # fmt: skip
                interval = 0.1
            next_refresh = sent + interval

    def _coordinator_reached(self) -> None:
        with self._state.cond:
            since, self._state.coordinator_lost_since = self._state.coordinator_lost_since, None
        if since is not None:
            log.warning(
                "%s reaches the coordinator again after %.1f s", self.address,
                time.monotonic() - since,
            )  # fmt: skip

    def followed(self, backup: str, group_id: int, epoch: int) -> None:
        """A backup's failover ping: it follows this server at `epoch` (`ReplicaState`)."""
        self._state.followed(backup, group_id, epoch)

    def _keep_place(self) -> bool:
        """After a lapse of its lease (etcd or this machine too slow to renew it): a primary
        the map still names, at the epoch it serves, takes a new lease and keeps its place
        and its rows; False (nothing done) otherwise.

        A backup that saw the lease end may still take over (it holds every acknowledged
        change); then this server is demoted and rejoins as usual. A group without a backup
        keeps its rows instead of restarting empty.
        """
        with self._leasing:
            return self._keep_place_now()

    def _keep_place_now(self) -> bool:
        state = self._state
        with state.cond:
            ours = state.map.group_of(self.address)
            serving = state.applied is not None
        try:
            for _ in range(100):  # (the map may change for other reasons meanwhile)
                m = self._read_map()
                group = m.group_of(self.address)
                if not (serving and ours and group and group.primary == self.address):
                    return False
                if group.epoch != ours.epoch:
                    return False
                lease = self._etcd.grant(state.lease_seconds)
                value = json.dumps({"address": self.address, "lease": lease.id}).encode()
                kept = self._etcd.txn(
                    [Compare.mod_revision(membership.map_key(self._prefix), "=", m.revision)],
                    [Op.put(membership.server_key(self._prefix, self.address), value, lease.id)],
                ).succeeded
                if kept:
                    break
                self._etcd.revoke(lease.id)
            else:
                return False
        except EtcdError as e:
            log.warning("%s cannot renew its place after its lease lapsed: %s", self.address, e)
            return False
        with state.cond:
            state.lease, state.last_keepalive = lease.id, time.monotonic()
            state.publish_serving()
        log.warning(
            "%s's lease lapsed; the map still names it the primary of group %d (epoch %d): it "
            "keeps its place and its rows under a new lease", self.address, group.id, group.epoch,
        )  # fmt: skip
        return True

    def _rejoin(self, lost: int) -> None:
        """Registers again after this server lost its lease `lost`, or its place while
        holding it; nothing if it took a new lease since (a waking server sees both, and
        the second rejoin would wipe the copy the first one got)."""
        for attempt in range(1000):
            if self._state.is_stopped():
                return
            try:
                with self._leasing:
                    with self._state.cond:
                        if self._state.lease != lost:
                            return
                    self._register_now(False)
                return
            except (EtcdError, RequestError) as e:
                log.warning("cannot rejoin (%s); retrying", e)
                time.sleep(min(0.1 * 2**attempt, 2.0))

    # Serving, and the parts' requests (`Servicer`).

    def check_primary(self, range_id: int | None = None, backup_too: bool = False) -> None:
        """Raises `aborted` unless this server may serve workers now (range `range_id`).

        `backup_too`: a backup may serve too (reads: it applied every
        acknowledged change).
        """
        self._state.check_primary(range_id, backup_too)

    def replicate(self, method: str, request: Any, apply: Callable[[], Any]) -> Any:
        """The primary's path of a change: apply, send to every backup, wait for them."""
        return self._replicator.replicate(method, request, apply)

    def on_replicate(self, request: ps_pb2.ReplicateRequest) -> int:
        """Applies one change sent by the primary, in sequence order; returns its sequence."""
        return self._replicator.on_replicate(request)

    def install_snapshot(self, chunks: Iterator[ps_pb2.SnapshotChunk]) -> int:
        """A joining server loads the primary's state (every range); returns its rows."""
        return self._copier.install(chunks)

    def move_in(self, request: ps_pb2.MoveInRequest) -> int:
        """Applies one MoveIn (on every replica of the target group); the range's rows."""
        return self._incoming.move_in(request)
