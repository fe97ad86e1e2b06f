"""`Replica`: a server's place in a coordinated cluster, and the copying of its changes.

Started by `elastic-emb serve --coordinator etcd://H:P`. The server holds an
etcd lease (its liveness) and takes its place in the cluster map
(`elastic_emb.ps.coord.membership`): primary, backup, joining backup or spare.

The primary applies every change (the requests of `REPLICATED_METHODS`) in
one order, numbers it (`sequence`), and sends it to every backup; it
answers the worker only once every backup applied it. A backup that fails
to is removed from the group first (an etcd transaction that only the
primary holding its lease can make), so an acknowledged change is always on
every replica of the group. Backups apply changes in sequence order: they
stay bit-identical to the primary.

A backup pings its primary; when the primary stops answering (or its lease
expires), the backup revokes the primary's lease and makes itself primary
with a new epoch. A server refuses changes sent with an old epoch, and a
primary serves nothing while its lease is not known to be alive: a deposed
primary can neither get a write acknowledged nor serve a stale read for
long. Workers re-send their unacknowledged pushes to the new primary,
which de-duplicates them by (worker, step) (`Shard.push`).

A joining server gets a snapshot of the primary's state (taken between two
changes), then the changes made since; once it has applied all of them the
primary admits it as a backup.

Slot ranges move between groups the same way (`_move`): the primary of the
source group sends the target group a snapshot of the range, then the
range's changes made since (MoveIn, which the target replicates to its
backups like any change); between two changes it sends the last ones and
commits the range's new group in the map, and then drops the range. A
range's state (rows, optimizer slots, who pushed which step) moves whole, so
a step a worker sends again to the range's new group is applied once.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np

from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.ps.coord import balance, membership
from elastic_emb.ps.coord.balance import LoadMeter, Policy
from elastic_emb.ps.coord.etcd import Compare, Etcd, EtcdError, LeaseLost
from elastic_emb.ps.coord.membership import DEFAULT_PREFIX, ClusterMap, Group, Move
from elastic_emb.ps.server.shard import Ranges, RequestError, Shard
from elastic_emb.ps.wire import protocol, security
from elastic_emb.ps.wire.security import GRPC_OPTIONS, ClientSecurity
from elastic_emb.tables import sharding
from elastic_emb.tables.table import TableConfig, TableState
from elastic_emb.tables.tiered import make_local_table

__all__ = ["REPLICATED_METHODS", "Replica"]

log = logging.getLogger("elastic_emb.server")

# The requests that change a shard's state: every replica applies them, in order.
REPLICATED_METHODS = (
    "CreateTables", "Join", "Leave", "Push", "ImportRows", "EraseRows", "Restore",
    "ShrinkRange", "DropRange", "MoveIn",
)  # fmt: skip
# The changes a worker sends (the others: servers moving ranges).
WORKER_CHANGES = REPLICATED_METHODS[:7]
PING_SECONDS = 0.1  # a backup asks its primary this often...
PING_FAILURES = 3  # ...and takes over after this many failures in a row
FORWARD_TIMEOUT = 30.0  # a backup that takes longer to apply a change is removed
GAP_TIMEOUT = 10.0  # a backup waits this long for a missing earlier change
SNAPSHOT_ROWS = 1 << 18  # rows per snapshot message
# Rows per MoveIn part: the target applies each as one change, which its ranges wait for.
MOVE_ROWS = 1 << 16
MOVE_RETRY_SECONDS = 1.0  # a move that failed is tried again after this long

_CHANNEL_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def aborted(message: str) -> RequestError:
    """A request sent to the wrong replica: the worker reads the map again and re-sends."""
    return RequestError("ABORTED", message)


class Replica:
    """This server's role in its replica group; replicates its ranges' changes, moves ranges.

    Thread-safe. `replicate` serializes the changes of a primary (`_order`);
    the role, the map, the applied sequence and the moves under way are
    guarded by `_cond`. Lock order: `_order` before `_cond`. A primary's
    `_mover` thread applies the map's splits and moves its ranges.

    Args:
        ranges: the server's shards (replaced on a snapshot or a reset).
        apply: applies a change request: apply(method, request).
        etcd: the coordinator.
        address: "host:port" the other servers and workers reach this one at.
        replicas: replicas per group (R), for the placement of this server.
        lease_seconds: TTL of this server's lease.
        prefix: the cluster's key prefix in etcd.
        move_pause: seconds a range move waits after sending its snapshot (fault tests).
        security: how to call the other servers (TLS, a token); None: plaintext.
        load: the server's per-slot load, published to the coordinator; None: not measured.
        balance: when this server, as the most loaded primary, moves slots away
            (`elastic_emb.ps.coord.balance`); None: never for load. Needs `load`.
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
        security: ClientSecurity | None = None,
        load: LoadMeter | None = None,
        balance: Policy | None = None,
    ) -> None:
        if balance is not None and load is None:
            raise ValueError("balancing slots by load needs the load measured (`load`)")
        self.ranges = ranges
        self._load = load
        self._balance = balance
        # Since when (monotonic) and under which layout this primary's group has been the
        # most loaded beyond the threshold; None: it is not.
        self._overloaded: tuple[float, Any] | None = None
        self._security = security
        self._move_pause = move_pause
        self._apply = apply
        self._etcd = etcd
        self.address = address
        self._replicas = replicas
        self._lease_seconds = lease_seconds
        self._prefix = prefix
        self._order = threading.Lock()
        self._cond = threading.Condition()
        # Guarded by _cond.
        self._map = ClusterMap()
        self._lease = 0
        self._last_keepalive = 0.0
        self._applied: int | None = 0  # sequence of the last change applied; None: no snapshot yet
        self._applied_epoch = 0
        # Joining servers being copied to -> the changes made since their snapshot.
        self._copying: dict[str, list[ps_pb2.ReplicateRequest]] = {}
        # Ranges being moved away -> their changes made since their snapshot.
        self._moving: dict[int, list[ps_pb2.ReplicateRequest]] = {}
        # Ranges moving in -> their source epoch, last MoveIn, and snapshot state.
        self._incoming: dict[int, _Incoming] = {}
        self._rebalance_due = False
        self._stopped = False
        self._channels: dict[str, grpc.Channel] = {}  # guarded by _cond
        self._pool = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="ee-replicate")
        self._threads: list[threading.Thread] = []
        self._watch: Any = None
        # Set by the server: records that an elastic worker left (a change, on a primary).
        self.worker_gone: Callable[[int], None] = lambda worker: None

    # Life cycle.

    def start(self) -> None:
        """Registers with the coordinator, takes a place, and starts the background work."""
        self._register(fresh=True)
        self._watch = self._etcd.watch(self._prefix, self._on_events, self._map.revision + 1)
        targets = [self._keep_alive, self._monitor, self._mover]
        if self._load is not None:
            targets.append(self._report_load)
        for target in targets:
            thread = threading.Thread(target=target, daemon=True, name=f"ee-{target.__name__}")
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Leaves the cluster: revokes the lease (backups take over at once)."""
        with self._cond:
            self._stopped = True
            lease = self._lease
            self._cond.notify_all()
        if self._watch is not None:
            self._watch.cancel()
        try:
            self._etcd.revoke(lease)
        except EtcdError:
            pass
        self._pool.shutdown(wait=False)
        with self._cond:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()

    def _register(self, fresh: bool = False) -> None:
        """A fresh lease, the server key under it, and a place in the map (state wiped).

        `fresh`: a new process; if its address was being drained, that was another server.
        """
        lease = self._etcd.grant(self._lease_seconds)
        key = membership.server_key(self._prefix, self.address)
        self._etcd.put(
            key, json.dumps({"address": self.address, "lease": lease.id}).encode(), lease.id
        )
        with self._cond:
            old, self._lease, self._last_keepalive = self._lease, lease.id, time.monotonic()
        if old:
            try:
                self._etcd.revoke(old)
            except EtcdError:
                pass
        self._reset_state()

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
                stub = ps_pb2_grpc.ParameterServerStub(self._channel(address))
                if stub.Health(ps_pb2.HealthRequest(), timeout=1.0).role == "spare":
                    spares.append(address)
            except grpc.RpcError:
                pass
        return spares

    def _take_place(self, change: Callable[[ClusterMap], ClusterMap | None]) -> None:
        placed = self._change_map(change, as_primary=False)
        group = placed.group_of(self.address)
        if group is not None and group.primary == self.address:
            with self._cond:  # a new group (or one that lost every replica): empty is its state
                self._applied, self._applied_epoch = 0, group.epoch

    def _fill_in(self) -> None:
        """A spare joins a group that lacks a replica (its state is empty: it was reset)."""

        def place(m: ClusterMap) -> ClusterMap | None:
            if m.group_of(self.address) is not None or self.address in m.draining:
                return None
            return m.place(self.address, self._replicas) if m.lacking() else None

        with self._cond:
            if self._stopped:
                return
        self._take_place(place)
        if self.role != "spare":
            log.info("%s left the spares: %s", self.address, self.role)

    def _reset_state(self) -> None:
        with self._cond:
            self.ranges.replace({})
            self._incoming.clear()
            self._applied, self._applied_epoch = None, 0

    # The map.

    def _read_map(self) -> ClusterMap:
        return ClusterMap.read(self._etcd, self._prefix)

    def _change_map(
        self, change: Callable[[ClusterMap], ClusterMap | None], as_primary: bool
    ) -> ClusterMap:
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
            with self._cond:
                lease = self._lease
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
        with self._cond:
            ours = self._map.group_of(self.address)
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
                    self._in_background(self.worker_gone, int(event.kv.key[len(workers) :]))

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
        with self._cond:
            if new.revision <= self._map.revision or self._stopped:
                return
            old_group = self._map.group_of(self.address)
            self._map = new
            group = new.group_of(self.address)
            self._follow_ranges(new, group)
            self._rebalance_due = True
            self._cond.notify_all()
            joining: list[str] = []
            if group is not None and group.primary == self.address:
                joining = [a for a in group.joining if a not in self._copying]
        if old_group is not None and group is None:
            log.warning("%s was removed from group %d: rejoining", self.address, old_group.id)
            self._in_background(self._rejoin)
        elif old_group is None and group is None and new.lacking():
            self._in_background(self._fill_in)
        else:
            for address in joining:  # (_copy_to checks again, under the lock)
                self._in_background(self._copy_to, address)

    def _server_gone(self, address: str) -> None:
        """A server's lease ended: its primary drops it; if it was our primary, take over."""
        with self._cond:
            group = self._map.group_of(self.address)
        if group is None or address == self.address:
            return
        if group.primary == address:
            self._in_background(self._take_over, address)
        elif group.primary == self.address and group.holds(address):
            self._in_background(self._drop, address, "its lease ended")

    def _in_background(self, target: Callable[..., None], *args: Any) -> None:
        def run() -> None:
            try:
                target(*args)
            except Exception:
                log.exception("%s%s failed", target.__name__, args)

        threading.Thread(target=run, daemon=True).start()

    @property
    def role(self) -> str:
        with self._cond:
            group = self._map.group_of(self.address)
        if group is None:
            return "spare"
        if group.primary == self.address:
            return "primary"
        return "backup" if self.address in group.members else "joining"

    def status(self) -> tuple[str, int, int, int]:
        """(role, group, epoch, sequence applied)."""
        role = self.role
        with self._cond:
            group = self._map.group_of(self.address)
            return (
                role,
                group.id if group else -1,
                group.epoch if group else 0,
                self._applied or 0,
            )

    # Liveness.

    def lease_alive(self) -> bool:
        with self._cond:
            return time.monotonic() - self._last_keepalive < self._lease_seconds

    def _keep_alive(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                lease = self._lease
            try:
                self._etcd.keepalive_once(lease)
                with self._cond:
                    self._last_keepalive = time.monotonic()
            except LeaseLost:
                log.warning("%s lost its lease: rejoining with an empty state", self.address)
                self._rejoin()
            except EtcdError as e:
                log.warning("cannot reach the coordinator: %s", e)
            with self._cond:
                self._cond.wait(self._lease_seconds / 4)

    def _rejoin(self) -> None:
        for attempt in range(1000):
            with self._cond:
                if self._stopped:
                    return
            try:
                self._register()
                return
            except (EtcdError, RequestError) as e:
                log.warning("cannot rejoin (%s); retrying", e)
                time.sleep(min(0.1 * 2**attempt, 2.0))

    def _monitor(self) -> None:
        """A backup pings its primary; after PING_FAILURES failures it takes over."""
        failures, watched = 0, ""
        while True:
            with self._cond:
                if self._stopped:
                    return
                group = self._map.group_of(self.address)
            primary = group.primary if group and self.address in group.members else ""
            if primary != watched:
                failures, watched = 0, primary
            if primary:
                try:
                    stub = ps_pb2_grpc.ParameterServerStub(self._channel(primary))
                    stub.Health(ps_pb2.HealthRequest(), timeout=3 * PING_SECONDS)
                    failures = 0
                except grpc.RpcError:
                    failures += 1
                    if failures >= PING_FAILURES:
                        self._take_over(primary)
                        failures = 0
            time.sleep(PING_SECONDS)

    def _take_over(self, primary: str) -> None:
        """Ends the lease of an unresponsive primary and becomes the group's primary."""
        key = membership.server_key(self._prefix, primary)
        try:
            kv = self._etcd.get(key)
            if kv is not None:
                self._etcd.revoke(json.loads(kv.value)["lease"])

            def promote(m: ClusterMap) -> ClusterMap | None:
                group = m.group_of(self.address)
                if group is None or group.primary != primary or self.address not in group.members:
                    return None
                return m.promote(group.id, self.address)

            new = self._change_map(promote, as_primary=False)
        except EtcdError as e:
            log.warning("cannot take over from %s: %s", primary, e)
            return
        group = new.group_of(self.address)
        if group is not None and group.primary == self.address:
            self._forget_gone_workers()
            log.warning(
                "%s is now the primary of group %d (epoch %d): %s stopped answering",
                self.address, group.id, group.epoch, primary,
            )  # fmt: skip

    # Serving.

    def check_primary(self, range_id: int | None = None, backup_too: bool = False) -> None:
        """Raises `aborted` unless this server may serve workers now (range `range_id`).

        `backup_too`: a backup may serve too (reads: it applied every
        acknowledged change).
        """
        with self._cond:
            group = self._map.group_of(self.address)
            alive = time.monotonic() - self._last_keepalive < self._lease_seconds
            where = self._map.range(range_id) if range_id is not None else None
            sealed = self._map.sealed
        if (
            range_id is not None
            and group is not None
            and (where is None or where.group != group.id)
        ):
            raise aborted(
                f"slot range {range_id} is not on {self.address}'s group {group.id}"
                + (f" but on group {where.group}" if where else "")
            )
        if range_id is not None and not sealed:
            raise aborted(f"{self.address} has not seen the sealed cluster map yet")
        serves = group is not None and (
            group.primary == self.address or (backup_too and self.address in group.members)
        )
        if not serves:
            why = f"group {group.id}'s primary is {group.primary}" if group else "it is a spare"
            raise aborted(f"{self.address} is not a primary ({why})")
        if not alive:
            raise aborted(f"{self.address} cannot reach the coordinator to renew its lease")

    def replicate(self, method: str, request: Any, apply: Callable[[], Any]) -> Any:
        """The primary's path of a change: apply, send to every backup, wait for them."""
        with self._order:
            result, sent = self._replicate_in_order(method, request, apply)
        self._wait_for_backups(sent)
        return result

    def _replicate_in_order(
        self, method: str, request: Any, apply: Callable[[], Any]
    ) -> tuple[Any, tuple[int, dict[str, Any]]]:
        """Applies a change and sends it to the backups (caller holds `_order`); the result,
        and what `_wait_for_backups` waits for."""
        self.check_primary(request.range if method in WORKER_CHANGES else None)
        result = apply()
        with self._cond:
            group = self._map.group_of(self.address)
            assert group is not None and self._applied is not None
            self._applied += 1
            self._applied_epoch = group.epoch
            forward = ps_pb2.ReplicateRequest(
                group=group.id,
                epoch=group.epoch,
                sequence=self._applied,
                method=method,
                request=request.SerializeToString(),
                primary=self.address,
            )
            backups = list(group.members)
            for buffered in self._copying.values():
                buffered.append(forward)
            if method in WORKER_CHANGES and request.range in self._moving:
                self._moving[request.range].append(forward)
        sent = {b: self._pool.submit(self._forward, b, forward) for b in backups}
        return result, (forward.sequence, sent)

    def _wait_for_backups(self, sent: tuple[int, dict[str, Any]]) -> None:
        sequence, futures = sent
        for backup, future in futures.items():
            try:
                future.result()
            except Exception as e:
                self._drop(backup, f"it did not apply change {sequence}: {e}")

    def _replicate_own(self, method: str, request: Any) -> Any:
        """A change this primary makes itself (not a worker's), replicated like any."""
        return self.replicate(method, request, lambda: self._apply(method, request))

    def _forward(self, address: str, request: ps_pb2.ReplicateRequest) -> None:
        stub = ps_pb2_grpc.ParameterServerStub(self._channel(address))
        stub.Replicate(request, timeout=FORWARD_TIMEOUT)

    def cluster_map(self) -> ClusterMap:
        """The newest map this server knows."""
        with self._cond:
            return self._map.copy()

    def channel(self, address: str) -> grpc.Channel:
        """A channel to another server (kept open)."""
        return self._channel(address)

    def _channel(self, address: str) -> grpc.Channel:
        with self._cond:
            channel = self._channels.get(address)
            if channel is None:
                channel = security.channel(address, _CHANNEL_OPTIONS, self._security)
                self._channels[address] = channel
            return channel

    def _drop(self, address: str, why: str) -> None:
        """Removes a backup (or joining server) from this primary's group."""
        log.warning("removing %s from the group: %s", address, why)

        def remove(m: ClusterMap) -> ClusterMap | None:
            group = m.group_of(self.address)
            if group is None or not group.holds(address) or address == self.address:
                return None
            return m.without(address)

        self._change_map(remove, as_primary=True)

    # The backup's side.

    def on_replicate(self, request: ps_pb2.ReplicateRequest) -> int:
        """Applies one change sent by the primary, in sequence order; returns its sequence."""
        deadline = time.monotonic() + GAP_TIMEOUT
        with self._cond:
            while True:
                self._check_sender(request.group, request.epoch, request.primary)
                if (
                    self._applied is not None
                    and request.epoch == self._map.group(request.group).epoch
                ):
                    if request.sequence == self._applied + 1:
                        break
                    if request.sequence <= self._applied and request.epoch == self._applied_epoch:
                        return int(request.sequence)
                    if request.sequence <= self._applied:
                        raise RequestError(
                            "DATA_LOSS",
                            f"{self.address} applied change {self._applied} of epoch "
                            f"{self._applied_epoch}; epoch {request.epoch} sends "
                            f"{request.sequence}: this replica has diverged",
                        )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RequestError(
                        "DATA_LOSS",
                        f"{self.address} waited {GAP_TIMEOUT:g} s for change "
                        f"{(self._applied or 0) + 1} before {request.sequence}",
                    )
                self._cond.wait(left)
        message = getattr(ps_pb2, f"{request.method}Request")()
        message.ParseFromString(request.request)
        if request.method not in REPLICATED_METHODS:
            raise RequestError("INVALID_ARGUMENT", f"{request.method} is not a change")
        try:
            self._apply(request.method, message)
        except Exception as e:
            log.exception("change %d (%s) failed on a backup", request.sequence, request.method)
            raise RequestError(
                "DATA_LOSS", f"{self.address} could not apply change {request.sequence}: {e}"
            ) from e
        finally:
            with self._cond:
                self._applied = request.sequence
                self._applied_epoch = request.epoch
                self._cond.notify_all()
        return int(request.sequence)

    def _check_sender(self, group_id: int, epoch: int, primary: str) -> None:
        """Refuses a change from anyone but the current primary (caller holds `_cond`)."""
        group = self._map.group_of(self.address)
        if group is None or group.id != group_id or self.address == group.primary:
            raise aborted(f"{self.address} is not a backup of group {group_id}")
        if epoch < group.epoch or (epoch == group.epoch and primary != group.primary):
            raise aborted(
                f"{primary} sent epoch {epoch}; group {group_id} is at epoch {group.epoch} "
                f"with primary {group.primary}"
            )

    def install_snapshot(self, chunks: Iterator[ps_pb2.SnapshotChunk]) -> int:
        """A joining server loads the primary's state (every range); returns its rows."""
        try:
            received = list(chunks)
        except grpc.RpcError as e:  # the sender died or gave up
            raise aborted(f"the snapshot stream broke: {e}") from None
        if not received:
            raise RequestError("INVALID_ARGUMENT", "an empty snapshot")
        first = received[0]
        with self._cond:
            self._check_sender(first.group, first.epoch, first.primary)
        shards = _Snapshot.read(received)
        with self._cond:
            self._check_sender(first.group, first.epoch, first.primary)
            self.ranges.replace(shards)
            self._follow_ranges(self._map, self._map.group_of(self.address))
            self._applied, self._applied_epoch = first.sequence, first.epoch
            self._cond.notify_all()
        return sum(len(t) for shard in shards.values() for t in shard.tables())

    # The primary copies its state to a joining server.

    def _copy_to(self, address: str) -> None:
        """Snapshot, then the changes made meanwhile, then admission as a backup."""
        with self._order:
            with self._cond:
                group = self._map.group_of(self.address)
                if address in self._copying or group is None or address not in group.joining:
                    return
                self._copying[address] = []
                header: dict[str, Any] = dict(
                    group=group.id,
                    epoch=group.epoch,
                    sequence=self._applied or 0,
                    primary=self.address,
                )
            snapshot = [_Snapshot.take(rid, shard) for rid, shard in self.ranges.items()]
        log.info("copying group %d (%d ranges) to %s", group.id, len(snapshot), address)

        def chunks() -> Iterator[ps_pb2.SnapshotChunk]:
            yield ps_pb2.SnapshotChunk(**header)  # (a group may hold no range)
            for part in snapshot:
                yield from part.chunks(header)

        try:
            stub = ps_pb2_grpc.ParameterServerStub(self._channel(address))
            stub.InstallSnapshot(chunks(), timeout=6 * 3600.0)
            while True:  # the changes made meanwhile, until few are left
                with self._cond:
                    changes, self._copying[address] = self._copying[address], []
                self._send_all(address, changes)
                if len(changes) < 16:
                    break
            with self._order:  # the last ones, and admission, between two changes
                with self._cond:
                    changes = self._copying.pop(address)
                self._send_all(address, changes)
                gid = group.id
                self._change_map(
                    lambda m: m.admit(gid, address) if address in m.group(gid).joining else None,
                    as_primary=True,
                )
            log.info("%s is now a backup of group %d", address, group.id)
        except Exception as e:
            with self._cond:
                self._copying.pop(address, None)
            self._drop(address, f"copying to it failed: {e}")

    # Slot ranges: following the map, and moving ranges between groups.

    def _follow_ranges(self, new: ClusterMap, group: Group | None) -> None:
        """Adopts the map's ranges of this server's group while it holds no state yet
        (before any table or worker); forgets moves in that finished or were given up.
        Caller holds `_cond`."""
        for rid in list(self._incoming):
            r, move = new.range(rid), new.move
            if group is not None and r is not None and r.group == group.id:
                del self._incoming[rid]  # moved in
            elif group is None or move is None or (move.new_range, move.to) != (rid, group.id):
                del self._incoming[rid]  # given up
                self.ranges.pop(rid)
        wanted = {r.id: r.slots for r in new.ranges_of(group.id)} if group else {}
        held = {rid: shard for rid, shard in self.ranges.items() if rid not in self._incoming}
        if {rid: shard.slots for rid, shard in held.items()} == wanted:
            return
        if all(shard.mode_name() is None and not shard.tables() for shard in held.values()):
            for rid in held:
                self.ranges.pop(rid)
            for rid, slots in wanted.items():
                self.ranges.put(rid, Shard(slots))

    def _mover(self) -> None:
        """A primary moves its ranges as the map plans (and retries a move that failed)."""
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._rebalance_due or self._stopped, MOVE_RETRY_SECONDS
                )
                if self._stopped:
                    return
                self._rebalance_due = False
            try:
                self._rebalance()
            except Exception as e:
                log.warning("moving slot ranges: %s (trying again)", e)
                time.sleep(MOVE_RETRY_SECONDS)

    def _rebalance(self) -> None:
        with self._cond:
            m, applied = self._map.copy(), self._applied
        group = m.group_of(self.address)
        if not m.sealed or group is None or group.primary != self.address or applied is None:
            return
        self._drop_moved(m, group)
        if m.plan() is not None:
            m = self._change_map(lambda current: current.plan(), as_primary=False)
            group = m.group_of(self.address)
            if group is None or group.primary != self.address:
                return
        if m.move is None and self._balance is not None:
            m = self._balance_load(m, group, self._balance)
        source = m.range(m.move.range) if m.move else None
        if m.move is not None and source is not None and source.group == group.id:
            self._move(m.move, m)
            return
        if group.retiring and not m.ranges_of(group.id):
            gid = group.id

            def dissolve(current: ClusterMap) -> ClusterMap | None:
                g = current.find_group(gid)
                if g is None or not g.retiring or current.ranges_of(gid):
                    return None
                return current.dissolve(gid)

            self._change_map(dissolve, as_primary=True)
            log.warning("group %d gave away every range and dissolved", gid)

    # Load.

    def _report_load(self) -> None:
        """Publishes this server's per-slot load every fifth of the window, under its lease."""
        assert self._load is not None
        key = balance.report_key(self._prefix, self.address)
        while True:
            with self._cond:
                if self._cond.wait_for(lambda: self._stopped, self._load.window / 5):
                    return
                lease = self._lease
            self._load.tick()
            report = balance.LoadReport.measure(self.address, self._load)
            try:
                self._etcd.put(key, report.to_json(), lease)
            except EtcdError as e:
                log.info("cannot publish the load: %s", e)

    def _balance_load(self, m: ClusterMap, group: Group, policy: Policy) -> ClusterMap:
        """The map, with a move of slots away from this primary's group if it has been the
        most loaded beyond `policy.threshold` for `policy.after` seconds (and the ranges
        holding hot slots marked, for workers to spread their reads)."""
        assert self._load is not None
        primaries = {g.primary for g in m.groups if g.primary}
        now, window = time.time(), self._load.window
        reports = [
            r
            for r in balance.read_reports(self._etcd, self._prefix)
            if r.address in primaries and now - r.time < window and r.seconds >= 0.8 * window
        ]
        if {r.address for r in reports} != primaries:  # a primary without a full window yet
            self._overloaded = None
            return m
        loads = balance.slot_loads(reports, policy.measure, primaries)
        ratio, busiest = balance.imbalance(m, loads)
        if busiest != group.id or ratio <= policy.threshold:
            self._overloaded = None
            return m
        layout = [(r.id, r.slots, r.group) for r in m.ranges]
        if self._overloaded is None or self._overloaded[1] != layout:
            self._overloaded = (time.monotonic(), layout)
            return m
        if time.monotonic() - self._overloaded[0] < policy.after:
            return m
        self._overloaded = None
        hot = balance.hot_slots(m, loads, policy.threshold)
        hot_ranges = sorted({r.id for r in m.ranges for s in hot if r.slot_begin <= s < r.slot_end})

        def rebalance(current: ClusterMap) -> ClusterMap | None:
            if [(r.id, r.slots, r.group) for r in current.ranges] != layout:
                return None  # the ranges changed meanwhile: measure again
            new = balance.plan_move(current, loads, policy.threshold) or current.copy()
            new.hot = hot_ranges
            return new

        new = self._change_map(rebalance, as_primary=True)
        if new.move is not None:
            target = new.range(new.move.range)
            log.warning(
                "group %d carries %.2f times the mean %s/s: moving slots [%d, %d) of range %d "
                "to group %d", group.id, ratio, policy.measure, new.move.slot,
                target.slot_end if target else -1, new.move.range, new.move.to,
            )  # fmt: skip
        if hot:
            log.warning("hot slots %s carry more than %.2f times the mean %s/s each: no move "
                        "can balance them; ranges %s serve reads from every replica",
                        hot, policy.threshold, policy.measure, hot_ranges)  # fmt: skip
        return new

    def _drop_moved(self, m: ClusterMap, group: Group) -> None:
        """Drops the ranges this group holds that the map gives to another group (a move
        whose source primary died before its DropRange)."""
        with self._cond:
            incoming = set(self._incoming)
        for rid, _ in self.ranges.items():
            now = m.range(rid)
            if rid not in incoming and (now is None or now.group != group.id):
                self._replicate_own("DropRange", ps_pb2.DropRangeRequest(range=rid))

    def _move(self, move: Move, m: ClusterMap) -> None:
        """Moves range `move.range`'s slots [move.slot, end) to group `move.to`: a snapshot,
        the range's changes since, and the cutover between two changes."""
        source, target = m.range(move.range), m.find_group(move.to)
        assert source is not None
        group = m.group(source.group)
        if target is None or not target.primary:
            log.warning(
                "slot range %d cannot move to group %d: it has no primary", move.range, move.to
            )
            time.sleep(MOVE_RETRY_SECONDS)
            return
        slots = (move.slot, source.slot_end)
        whole = move.slot == source.slot_begin
        started = time.monotonic()
        with self._order:
            self.check_primary(source.id)
            snapshot = _Snapshot.take(move.new_range, self.ranges.get(source.id), slots)
            with self._cond:
                self._moving[source.id] = []
        held = [time.monotonic() - started]  # how long the group's changes waited
        stub = ps_pb2_grpc.ParameterServerStub(self._channel(target.primary))
        index = itertools.count()

        def send(**what: Any) -> None:
            request = ps_pb2.MoveInRequest(
                range=move.new_range,
                source_range=source.id,
                source_group=group.id,
                source_epoch=group.epoch,
                index=next(index),
                **what,
            )
            stub.MoveIn(request, timeout=FORWARD_TIMEOUT)

        log.info("moving slots %s of range %d (%d rows) to group %d at %s",
                 slots, source.id, snapshot.rows, target.id, target.primary)  # fmt: skip
        try:
            for chunk in snapshot.chunks(dict(group=group.id, epoch=group.epoch), MOVE_ROWS):
                send(chunk=chunk)
            time.sleep(self._move_pause)
            while True:  # the range's changes made meanwhile, until few are left
                with self._cond:
                    changes, self._moving[source.id] = self._moving[source.id], []
                for change in changes:
                    send(change=change)
                if len(changes) < 16:
                    break
            with self._order:  # the last ones, and the cutover, between two changes
                cutover_began = time.monotonic()
                with self._cond:
                    changes = self._moving.pop(source.id)
                for change in changes:
                    send(change=change)

                def cutover(current: ClusterMap) -> ClusterMap | None:
                    to = current.find_group(target.id)
                    if current.move != move or current.range(source.id) != source:
                        return None
                    if to is None or to.primary != target.primary or to.epoch != target.epoch:
                        return None
                    return current.moved()

                if self._change_map(cutover, as_primary=True).move == move:
                    raise aborted(f"group {target.id} changed its primary during the move")
                shrunk = None
                if not whole:  # before any later change: the keys of `slots` are gone
                    shrink = ps_pb2.ShrinkRangeRequest(range=source.id, slot=move.slot)
                    _, shrunk = self._replicate_in_order(
                        "ShrinkRange", shrink, lambda: self._apply("ShrinkRange", shrink)
                    )
                held.append(time.monotonic() - cutover_began)
            if shrunk is not None:
                self._wait_for_backups(shrunk)
            else:
                self._replicate_own("DropRange", ps_pb2.DropRangeRequest(range=source.id))
            seconds = time.monotonic() - started
            log.warning("moved slots %s of range %d (%d rows) to group %d in %.2f s (changes "
                        "waited %.3f s for the snapshot, %.3f s for the cutover)",
                        slots, source.id, snapshot.rows, target.id, seconds, *held)  # fmt: skip
        except Exception as e:
            with self._cond:
                self._moving.pop(source.id, None)
            why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
            log.warning("moving slots %s of range %d to group %d failed (%s); trying again",
                        slots, source.id, target.id, why)  # fmt: skip
            time.sleep(MOVE_RETRY_SECONDS)

    def move_in(self, request: ps_pb2.MoveInRequest) -> int:
        """Applies one MoveIn (on every replica of the target group); the range's rows.

        The snapshot's parts build the incoming range a part at a time (each
        part one change, so the group's other ranges wait for little), its
        last part installs the step state, and the changes follow. Raises
        `aborted`, changing nothing, for a message out of order or from a
        deposed source primary.
        """
        rid = request.range
        with self._cond:
            incoming = self._incoming.get(rid)
            if request.index == 0:
                if incoming is not None and request.source_epoch < incoming.epoch:
                    raise aborted(f"a newer move of slot range {rid} is under way")
                if incoming is None and self.ranges.find(rid) is not None:
                    raise aborted(f"slot range {rid} is already on {self.address}'s group")
                incoming = self._incoming[rid] = _Incoming(request.source_epoch)
                self.ranges.put(rid, Shard((request.chunk.slot_begin, request.chunk.slot_end)))
            elif (
                incoming is None
                or request.source_epoch != incoming.epoch
                or request.index != incoming.index + 1
            ):
                raise aborted(f"MoveIn {request.index} of slot range {rid} is out of order")
        shard = self.ranges.get(rid)
        if request.HasField("chunk"):
            chunk = request.chunk
            if chunk.table_config_json:
                (table,) = shard.create([json.loads(chunk.table_config_json)])
                table.add_state(protocol.read_state(chunk.rows, table.dim, table.num_slots))
            if chunk.steps_json:
                pending = [
                    (p.worker, p.step, protocol.pushed_gradients(p, lambda n: shard.table(n).dim))
                    for p in chunk.pending
                ]
                shard.install(shard.tables(), json.loads(chunk.steps_json), pending)
                with self._cond:
                    incoming.installed = True
        elif request.HasField("change"):
            change = request.change
            with self._cond:
                installed = incoming.installed
            if change.method not in WORKER_CHANGES or not installed:
                raise aborted(f"MoveIn {request.index}: {change.method} before the snapshot")
            message = getattr(ps_pb2, f"{change.method}Request")()
            message.ParseFromString(change.request)
            if message.range != request.source_range:
                raise RequestError("INVALID_ARGUMENT", f"a change of range {message.range}")
            assert shard.slots is not None
            part = protocol.restricted(change.method, message, shard.slots, shard.table)
            part.range = rid
            self._apply(change.method, part)
        with self._cond:
            incoming.index = request.index
        return sum(len(t) for t in shard.tables())

    def _send_all(self, address: str, changes: list[ps_pb2.ReplicateRequest]) -> None:
        """Sends changes concurrently (the receiver applies them in order)."""
        for future in [self._pool.submit(self._forward, address, c) for c in changes]:
            future.result()


@dataclasses.dataclass
class _Incoming:
    """A range moving into this group: its source's epoch, the last MoveIn, and whether
    its step state is installed (the snapshot's last part). Guarded by `Replica._cond`."""

    epoch: int
    index: int = 0
    installed: bool = False


@dataclasses.dataclass
class _Snapshot:
    """One range's state, taken between two changes of its group."""

    range_id: int
    slots: tuple[int, int]
    tables: list[tuple[dict[str, Any], TableState]]
    steps: dict[str, Any]
    pending: list[tuple[int, int, list[Any]]]

    @classmethod
    def take(cls, range_id: int, shard: Shard, slots: tuple[int, int] | None = None) -> _Snapshot:
        """The shard's state (of `slots` only, as range `range_id`).

        (The caller makes sure no change is being applied: the order lock.)
        """
        slots = slots or shard.slots or (0, sharding.NUM_SLOTS)
        tables, steps, pending = shard.export_range(slots)
        return cls(range_id, slots, tables, steps, pending)

    @property
    def rows(self) -> int:
        return sum(len(state.keys) for _, state in self.tables)

    def chunks(
        self, header: dict[str, Any], per_part: int = SNAPSHOT_ROWS
    ) -> Iterator[ps_pb2.SnapshotChunk]:
        """The tables' rows in parts of `per_part` rows, then the step state (the last part)."""
        where = dict(header, range=self.range_id, slot_begin=self.slots[0], slot_end=self.slots[1])
        for config, state in self.tables:
            for begin in range(0, max(len(state.keys), 1), per_part):
                part = state.select(np.arange(begin, min(begin + per_part, len(state.keys))))
                if begin:  # the admission counts are table-wide: in the first part only
                    part.counts = None
                rows = protocol.write_state(ps_pb2.ExportRowsResponse(), part)
                yield ps_pb2.SnapshotChunk(**where, table_config_json=json.dumps(config), rows=rows)
        yield ps_pb2.SnapshotChunk(
            **where,
            steps_json=json.dumps(self.steps),
            pending=[protocol.push_request(w, s, ps_pb2.FLOAT32, p) for w, s, p in self.pending],
        )

    @staticmethod
    def read(chunks: list[ps_pb2.SnapshotChunk]) -> dict[int, Shard]:
        """The shards, by range id, that snapshot chunks describe."""
        shards: dict[int, Shard] = {}
        parts: dict[str, tuple[dict[str, Any], list[Any]]] = {}
        for chunk in chunks:
            if chunk.table_config_json:
                config = json.loads(chunk.table_config_json)
                parts.setdefault(config["name"], (config, []))[1].append(chunk.rows)
            if not chunk.steps_json:
                continue
            dims = {name: config["dim"] for name, (config, _) in parts.items()}
            pending = [
                (
                    push.worker,
                    push.step,
                    protocol.pushed_gradients(push, dims.__getitem__),
                )
                for push in chunk.pending
            ]
            tables = []
            for config, messages in parts.values():
                table = make_local_table(TableConfig.from_dict(config))
                states = [protocol.read_state(m, table.dim, table.num_slots) for m in messages]
                table.load_state(type(states[0]).concatenate(states))
                tables.append(table)
            shard = Shard((chunk.slot_begin, chunk.slot_end))
            shard.install(tables, json.loads(chunk.steps_json), pending)
            shards[chunk.range] = shard
            parts = {}
        if parts:
            raise RequestError("INVALID_ARGUMENT", "a snapshot ends without its step state")
        return shards
