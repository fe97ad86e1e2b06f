"""`ReplicaState`: what the parts of a `Replica` share (the newest cluster map, the lease,
the sequence of the last change applied) under one condition, and the checks made against
it: a server serves workers only as its group's primary while its lease is known to be
alive (or, while etcd cannot be reached, while every backup still follows it), and a
backup takes changes only from its group's current primary and epoch, so a deposed
primary can neither get a change acknowledged nor serve a stale read for long."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from elastic_emb.ps.coord.membership import ClusterMap, Group
from elastic_emb.ps.server.shard import RequestError

__all__ = ["MapChange", "MapEditor", "ReplicaState", "aborted"]

# A change of the cluster map: the new map, or None to leave it as it is.
MapChange = Callable[[ClusterMap], ClusterMap | None]


class MapEditor(Protocol):
    """Applies a `MapChange` in one etcd transaction (`Replica._change_map`); the new map.

    `as_primary`: only while this server is still its group's primary, with its lease.
    """

    def __call__(self, change: MapChange, as_primary: bool) -> ClusterMap: ...


def aborted(message: str) -> RequestError:
    """A request sent to the wrong replica: the worker reads the map again and re-sends."""
    return RequestError("ABORTED", message)


class _OrderLock:
    """The lock ordering a primary's changes: the data plane's (`_core.Replication`), which
    makes changes under it too. A context manager, taken with the GIL released."""

    def __init__(self, replication: Any) -> None:
        self._replication = replication

    def __enter__(self) -> None:
        self._replication.lock_order()

    def __exit__(self, *exc: object) -> None:
        self._replication.unlock_order()


class ReplicaState:
    """The shared state of one server's `Replica` and its parts. Thread-safe.

    `order` serializes a primary's changes (a snapshot is taken between two
    of them while holding it); `cond` guards the fields below it and is
    notified when the map changes, a change is applied, or the replica stops.
    Lock order: `order` before `cond`. `cond` is reentrant.

    `native` is the data plane's `_core.ServerCore`: it holds `order` and the
    applied sequence (`applied`, `applied_epoch`), which it advances itself
    for the changes it makes or applies, and is told where this server serves
    (`publish_serving`).
    """

    def __init__(self, address: str, lease_seconds: int, native: Any) -> None:
        self.address = address  # "host:port" of this server (never changes)
        self.lease_seconds = lease_seconds  # (never changes)
        self.native = native
        self.replication = native.replication
        self.order = _OrderLock(self.replication)
        self.cond = threading.Condition()
        self.map = ClusterMap()  # guarded by cond: the newest map this server knows
        self.lease = 0  # guarded by cond: the id of this server's lease
        self.last_keepalive = 0.0  # guarded by cond: when (monotonic) the lease was renewed
        # Guarded by cond: since when (monotonic) etcd cannot be reached; None: it can.
        self.coordinator_lost_since: float | None = None
        # Guarded by cond: backup -> (epoch, when) of its last ping naming this primary.
        self.followed_by: dict[str, tuple[int, float]] = {}
        # Guarded by cond: backup -> its data plane's port (0: none), as its Health says.
        self.data_ports: dict[str, int] = {}
        # Whether a receiver is being caught up from a snapshot (its changes are buffered,
        # by Python): the plane then leaves this primary's changes to Python.
        self.catching_up: Callable[[], bool] = lambda: False
        # Guarded by cond: (group, epoch, primary) this backup is taking over from; it
        # refuses that primary's changes from the moment it decides (`Failover.take_over`).
        self.deposing: tuple[int, int, str] | None = None
        self.stopped = False  # guarded by cond
        self.rebalance_due = False  # guarded by cond: the map changed since the mover looked

    @property
    def applied(self) -> int | None:
        """The sequence of the last change applied; None: no snapshot yet."""
        applied: int | None = self.replication.applied
        return applied

    @property
    def applied_epoch(self) -> int:
        """The epoch of that change."""
        epoch: int = self.replication.applied_epoch
        return epoch

    def set_applied(
        self, sequence: int | None, epoch: int, change: tuple[str, bytes] | None = None
    ) -> None:
        """Sets both (a change applied by Python, a snapshot installed, the state reset);
        the data plane serves only a server with a state (`publish_serving`). `change`: the
        (method, request bytes) of the change applied, told apart from another sent as its
        sequence later."""
        had = self.replication.applied is not None
        self.replication.set_applied(sequence, epoch, *(change or ("", b"")))
        if had != (sequence is not None):
            with self.cond:
                self.publish_serving()

    def group(self) -> Group | None:
        """This server's group in the newest map; None: a spare."""
        with self.cond:
            return self.map.group_of(self.address)

    def is_stopped(self) -> bool:
        with self.cond:
            return self.stopped

    def followed(self, backup: str, group_id: int, epoch: int) -> None:
        """A backup's failover ping: it follows this server as the primary of `group_id`
        at `epoch`."""
        with self.cond:
            group = self.map.group_of(self.address)
            if group is not None and group.id == group_id and group.primary == self.address:
                self.followed_by[backup] = (epoch, time.monotonic())

    def publish_serving(self) -> None:
        """Tells the data plane where this server serves workers now: `check_primary`'s
        lease path (as its group's primary, or a member for reads, until the lease's TTL
        from its last renewal); past that, and for anything else, the plane leaves the
        request to `check_primary`. And its role: the group, epoch and primary a backup
        takes changes from (`check_sender`), and, as a primary, whether the plane may make
        changes itself: the map sealed, every backup's data port known, no receiver being
        caught up. Call with `cond` held, after the map, the lease, a data port or a
        catch-up changed."""
        group = self.map.group_of(self.address)
        serving = {}
        if group is not None and self.map.sealed and self.applied is not None:
            primary, member = group.primary == self.address, self.address in group.members
            until = self.last_keepalive + self.lease_seconds
            ours = [r.id for r in self.map.ranges if r.group == group.id]
            serving = {range_id: (primary, member, until) for range_id in ours}
        self.native.set_serving(serving)
        backups = []
        changes = False
        if group is not None and group.primary == self.address and self.map.sealed:
            ports = {b: self.data_ports.get(b, 0) for b in group.members}
            backups = [(b, b.rsplit(":", 1)[0].strip("[]"), port) for b, port in ports.items()]
            changes = all(ports.values()) and not self.catching_up()
        self.replication.set_role(
            {
                "address": self.address,
                "group": -1 if group is None else group.id,
                "epoch": 0 if group is None else group.epoch,
                "primary": "" if group is None else group.primary,
                "holds": [] if group is None else [*group.members, *group.joining],
                "deposed": self._deposed(group),
                "changes": changes,
                "backups": backups if changes else [],
            }
        )

    def depose(self, primary: str | None) -> None:
        """A backup about to take over refuses `primary`'s changes at its group's current
        epoch from now on (None: it no longer does)."""
        with self.cond:
            group = self.map.group_of(self.address)
            self.deposing = None
            if primary is not None and group is not None and group.primary == primary:
                self.deposing = (group.id, group.epoch, primary)
            self.publish_serving()

    def _deposed(self, group: Group | None) -> str:
        """The primary of `group` this backup refuses while it takes over; "" if none."""
        if group is None or self.deposing != (group.id, group.epoch, group.primary):
            return ""
        return group.primary

    def _may_serve(self, group: Group) -> bool:
        """Whether this primary's lease was renewed within its TTL; or, while etcd cannot be
        reached (no backup can be promoted without it), whether every backup of its group
        pinged it at its epoch within the TTL. A group without a backup has no witness: it
        waits for etcd. Call with `cond` held."""
        now = time.monotonic()
        if now - self.last_keepalive < self.lease_seconds:
            return True
        if self.coordinator_lost_since is None or not group.members:
            return False
        for backup in group.members:
            epoch, when = self.followed_by.get(backup, (0, 0.0))
            if epoch != group.epoch or now - when >= self.lease_seconds:
                return False
        return True

    def role(self) -> str:
        """primary, backup, joining (a backup being copied to) or spare."""
        group = self.group()
        if group is None:
            return "spare"
        if group.primary == self.address:
            return "primary"
        return "backup" if self.address in group.members else "joining"

    def check_primary(self, range_id: int | None = None, backup_too: bool = False) -> None:
        """Raises `aborted` unless this server may serve workers now (range `range_id`).

        `backup_too`: a backup may serve too (reads: it applied every
        acknowledged change).
        """
        with self.cond:
            group = self.map.group_of(self.address)
            alive = group is not None and self._may_serve(group)
            where = self.map.range(range_id) if range_id is not None else None
            sealed = self.map.sealed
            stateless = self.applied is None
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
        if group is None or not serves:
            why = f"group {group.id}'s primary is {group.primary}" if group else "it is a spare"
            raise aborted(f"{self.address} is not a primary ({why})")
        if stateless:
            raise aborted(f"{self.address} has no state of group {group.id} yet (it is rejoining)")
        if not alive:
            raise aborted(
                f"{self.address} cannot reach the coordinator to renew its lease"
                + (" and not every backup follows it" if group.members else "")
            )

    def check_sender(self, group_id: int, epoch: int, primary: str) -> None:
        """Raises `aborted` for a change (or snapshot) from anyone but this backup's primary
        (the rule the data plane applies, on the role `publish_serving` gave it)."""
        why = self.replication.check_sender(group_id, epoch, primary)
        if why:
            raise aborted(why)
