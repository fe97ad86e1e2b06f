"""The cluster map: replica groups, their slot ranges, members and primaries.

With a coordinator, one etcd key (`<prefix>map`) holds the whole map as
JSON, and every change to it is a transaction that compares the key's
revision: two servers that change it at once never both succeed. Live
servers hold `<prefix>servers/<address>` under their lease; a primary whose
key is gone is dead. This module is the map's data model and its pure
changes (placement, promotion, removal); `elastic_emb.ps.server.replication` and
`elastic_emb.ps.client.routing` apply them through etcd.

The slots (`elastic_emb.tables.sharding`) are cut into ranges, and each range
lives on one group; a group may hold several. A range is the unit of
routing and of state: a worker sends each range its own requests, and a
server keeps each range's rows and step bookkeeping apart, so a range can
move to another group (`move`: all of it, or its upper part as a new range).
A group's `primary` serves workers and sends every change to the `members`
(backups) before acknowledging it; `joining` servers are receiving a copy of
the primary's state and are not backups yet. `epoch` grows at every change
of primary: a server refuses changes sent with any other epoch, so a
deposed primary can never get a write acknowledged.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from elastic_emb.tables import sharding

__all__ = [
    "DEFAULT_PREFIX", "ClusterMap", "Group", "Move", "Range", "map_key", "server_key",
    "servers_prefix", "update", "worker_key", "workers_prefix",
]  # fmt: skip

DEFAULT_PREFIX = "/elastic_emb/default/"  # every key of a cluster starts with its prefix


def map_key(prefix: str) -> str:
    return f"{prefix}map"


def servers_prefix(prefix: str) -> str:
    return f"{prefix}servers/"


def server_key(prefix: str, address: str) -> str:
    return f"{servers_prefix(prefix)}{address}"


def workers_prefix(prefix: str) -> str:
    """Elastic workers hold `<prefix>workers/<index>` under their lease."""
    return f"{prefix}workers/"


def worker_key(prefix: str, worker: int) -> str:
    return f"{workers_prefix(prefix)}{worker}"


@dataclasses.dataclass
class Group:
    """One replica group: the servers that hold the same ranges."""

    id: int
    primary: str = ""
    members: list[str] = dataclasses.field(default_factory=list)  # backups, primary excluded
    joining: list[str] = dataclasses.field(default_factory=list)
    epoch: int = 0
    retiring: bool = False  # its ranges move to the other groups, then it dissolves

    @property
    def replicas(self) -> list[str]:
        """The primary and its backups (not the joining servers)."""
        return ([self.primary] if self.primary else []) + self.members

    def holds(self, address: str) -> bool:
        return address in self.replicas or address in self.joining


@dataclasses.dataclass
class Range:
    """The slots [slot_begin, slot_end) of one range, and the group that holds it."""

    id: int
    slot_begin: int
    slot_end: int
    group: int

    @property
    def slots(self) -> tuple[int, int]:
        return self.slot_begin, self.slot_end

    @property
    def size(self) -> int:
        return self.slot_end - self.slot_begin


@dataclasses.dataclass
class Move:
    """The move under way: range `range`'s slots [slot, its end) go to group `to`.

    All of the range (`slot` == its begin) keeps its id; a part becomes
    range `new_range`.
    """

    range: int
    slot: int
    to: int
    new_range: int


@dataclasses.dataclass
class ClusterMap:
    """Groups and ranges by id, the replication factor, and whether tables exist (`sealed`).

    Until a worker connects (seals the map), the slot ranges may be redrawn
    freely: no server holds rows yet. Afterwards ranges change only by a
    split (in place) and a move (`elastic_emb.ps.server.replication`).
    """

    replicas: int = 1
    groups: list[Group] = dataclasses.field(default_factory=list)
    ranges: list[Range] = dataclasses.field(default_factory=list)
    sealed: bool = False
    # Servers being retired (`elastic-emb cluster drain`): placed nowhere, and
    # not counted as replicas, so that a spare joins their group first.
    draining: list[str] = dataclasses.field(default_factory=list)
    next_range: int = 0  # the id of the next range made by a split
    move: Move | None = None  # one at a time
    revision: int = 0  # the etcd mod_revision it was read at (not stored)
    # Ranges holding hot slots (`elastic_emb.ps.coord.balance`): workers spread their
    # read-only pulls over the group's replicas.
    hot: list[int] = dataclasses.field(default_factory=list)
    # The job's training mode ("sync" or "async") and async staleness bound (None:
    # unbounded), fixed by the first worker (`Routing.fix_mode`); None until one joins.
    mode: str | None = None
    staleness: int | None = None

    @classmethod
    def read(cls, etcd: Any, prefix: str = DEFAULT_PREFIX) -> ClusterMap:
        """The map stored in etcd (an empty one if there is none yet)."""
        kv = etcd.get(map_key(prefix))
        return cls.from_json(kv.value if kv else None, kv.mod_revision if kv else 0)

    @classmethod
    def from_json(cls, raw: bytes | None, revision: int = 0) -> ClusterMap:
        if not raw:
            return cls(revision=revision)
        data = json.loads(raw)
        return cls(
            data["replicas"],
            [Group(**g) for g in data["groups"]],
            [Range(**r) for r in data["ranges"]],
            data["sealed"],
            data["draining"],
            data["next_range"],
            Move(**data["move"]) if data["move"] else None,
            revision,
            data.get("hot", []),
            data.get("mode"),
            data.get("staleness"),
        )

    def to_json(self) -> bytes:
        data = {
            "replicas": self.replicas,
            "sealed": self.sealed,
            "draining": self.draining,
            "next_range": self.next_range,
            "move": dataclasses.asdict(self.move) if self.move else None,
            "hot": self.hot,
            "mode": self.mode,
            "staleness": self.staleness,
            "groups": [dataclasses.asdict(g) for g in self.groups],
            "ranges": [dataclasses.asdict(r) for r in self.ranges],
        }
        return json.dumps(data, sort_keys=True).encode()

    def copy(self) -> ClusterMap:
        return ClusterMap.from_json(self.to_json(), self.revision)

    def group(self, group_id: int) -> Group:
        return next(g for g in self.groups if g.id == group_id)

    def find_group(self, group_id: int) -> Group | None:
        return next((g for g in self.groups if g.id == group_id), None)

    def group_of(self, address: str) -> Group | None:
        return next((g for g in self.groups if g.holds(address)), None)

    def range(self, range_id: int) -> Range | None:
        return next((r for r in self.ranges if r.id == range_id), None)

    def ranges_of(self, group_id: int) -> list[Range]:
        """The ranges group `group_id` holds, in slot order."""
        return [r for r in self.by_slot() if r.group == group_id]

    def slots_of(self, group_id: int) -> int:
        return sum(r.size for r in self.ranges if r.group == group_id)

    def ready(self) -> bool:
        """Every slot is in a range whose group has a primary."""
        end = 0
        for r in self.by_slot():
            g = self.find_group(r.group)
            if r.slot_begin != end or g is None or not g.primary:
                return False
            end = r.slot_end
        return end == sharding.NUM_SLOTS

    def lacking(self) -> list[Group]:
        """The groups with fewer than `replicas` replicas (joining ones counted, draining
        not), retiring ones excepted."""
        return [g for g in self.groups if self._count(g) < self.replicas and not g.retiring]

    def _count(self, g: Group) -> int:
        return len([a for a in g.replicas + g.joining if a not in self.draining])

    def complete(self, g: Group) -> bool:
        """`replicas` replicas, none joining: ready to take ranges."""
        return bool(g.primary) and not g.joining and len(g.replicas) >= self.replicas

    def by_slot(self) -> list[Range]:
        return sorted(self.ranges, key=lambda r: r.slot_begin)

    # Changes: each returns the new map (or None when there is nothing to do).

    def place(self, address: str, replicas: int, spares: int = 0) -> ClusterMap:
        """A new (or restarted, hence empty) server `address` takes its place.

        It leaves any group it was in (a restarted server holds nothing).
        Then: a group without any replica takes it as primary (its rows are
        lost); a group below `replicas` takes it as a joining backup; before
        any table exists it makes a new group and the slot ranges are
        redrawn evenly; afterwards, with `spares` other spare servers, enough
        for a group of `replicas`, it makes a new empty group, which `plan`
        then gives slots (scale-out); otherwise it stays a spare. A draining
        server gets no place, and draining servers do not count toward a
        group's replicas.
        """
        new = self.without(address)
        new.replicas = max(new.replicas, replicas)
        if address in new.draining:
            return new
        for g in new.groups:
            if not g.primary and not g.retiring:
                g.primary, g.epoch = address, g.epoch + 1
                return new
        for g in sorted(new.groups, key=lambda g: (new._count(g), g.id)):
            if new._count(g) < new.replicas and not g.retiring:
                g.joining.append(address)
                return new
        if new.sealed and spares + 1 < new.replicas:
            return new
        next_id = max((g.id for g in new.groups), default=-1) + 1
        new.groups.append(Group(next_id, primary=address, epoch=1))
        if not new.sealed:
            ranges = sharding.even_ranges(len(new.groups))
            new.ranges = [
                Range(g.id, b, e, g.id) for g, (b, e) in zip(new.groups, ranges, strict=True)
            ]
            new.next_range = len(new.groups)
        return new

    def without(self, address: str) -> ClusterMap:
        """`address` removed from every group; a lost primary's first backup takes over."""
        new = self.copy()
        for g in new.groups:
            if address in g.joining:
                g.joining.remove(address)
            if address in g.members:
                g.members.remove(address)
            if g.primary == address:
                g.primary = g.members.pop(0) if g.members else ""
                g.epoch += 1
        return new

    def promote(self, group_id: int, address: str) -> ClusterMap:
        """Backup `address` becomes the primary of its group; the old primary leaves."""
        new = self.copy()
        g = new.group(group_id)
        if address not in g.members:
            raise ValueError(f"{address} is not a backup of group {group_id}: {g}")
        g.members.remove(address)
        g.primary, g.epoch = address, g.epoch + 1
        return new

    def admit(self, group_id: int, address: str) -> ClusterMap:
        """Joining server `address` has caught up: it becomes a backup."""
        new = self.copy()
        g = new.group(group_id)
        g.joining.remove(address)
        g.members.append(address)
        return new

    def drain(self, address: str) -> ClusterMap:
        """`address` is being retired: it stays in its group until a spare replaces it."""
        new = self.copy()
        if address not in new.draining:
            new.draining.append(address)
        return new

    def undrain(self, address: str) -> ClusterMap | None:
        """`address` is not being retired (any more); None if it was not."""
        if address not in self.draining:
            return None
        new = self.copy()
        new.draining.remove(address)
        return new

    def replaced(self, address: str) -> bool:
        """Whether draining `address` can leave its group: the others make `replicas`."""
        g = self.group_of(address)
        if g is None:
            return True
        others = [a for a in g.replicas if a != address and a not in self.draining]
        return len(others) >= self.replicas

    def retire(self, group_id: int) -> ClusterMap:
        """Group `group_id` gives its ranges to the others, then dissolves (scale-in)."""
        new = self.copy()
        new.group(group_id).retiring = True
        return new

    def plan(self) -> ClusterMap | None:
        """The next move of slots between groups, or None while there is none to plan.

        Scale-in: each range of a retiring group moves whole to the complete
        group holding the fewest slots. Scale-out: an empty complete group
        takes the upper half of the largest range (a new range). One move at
        a time.
        """
        if self.move is not None or not self.sealed:
            return None
        takers = [g for g in self.groups if not g.retiring and self.complete(g)]
        for g in self.groups:
            ranges = self.ranges_of(g.id)
            if not g.retiring or not ranges:
                continue
            others = [t for t in takers if t.id != g.id]
            if not others:
                return None
            new = self.copy()
            target = min(others, key=lambda t: (self.slots_of(t.id), t.id))
            new.move = Move(ranges[0].id, ranges[0].slot_begin, target.id, ranges[0].id)
            return new
        empty = [g for g in takers if not self.ranges_of(g.id)]
        largest = max(self.ranges, key=lambda r: (r.size, -r.slot_begin), default=None)
        if not empty or largest is None or largest.size < 2:
            return None
        new = self.copy()
        middle = (largest.slot_begin + largest.slot_end) // 2
        new.move = Move(largest.id, middle, empty[0].id, new.next_range)
        new.next_range += 1
        return new

    def moved(self) -> ClusterMap:
        """The move under way is done: its slots live on its target group."""
        new = self.copy()
        move = new.move
        r = new.range(move.range) if move else None
        if move is None or r is None:
            raise ValueError("no move is under way")
        if move.slot == r.slot_begin:
            r.group = move.to
        else:
            new.ranges.append(Range(move.new_range, move.slot, r.slot_end, move.to))
            r.slot_end = move.slot
        new.move = None
        return new

    def dissolve(self, group_id: int) -> ClusterMap:
        """A retiring group that gave away every range leaves the map; its servers are spares."""
        new = self.copy()
        new.groups = [g for g in new.groups if g.id != group_id]
        return new

    def describe(self) -> dict[str, Any]:
        data = json.loads(self.to_json())
        data["revision"] = self.revision
        return data


def update(
    etcd: Any,
    prefix: str,
    change: Callable[[ClusterMap], ClusterMap | None],
    compare: Callable[[], list[Any]] = list,
) -> tuple[ClusterMap, bool]:
    """Applies `change` to the stored map in one etcd transaction, retried on races.

    `change` returns the new map, or None (or the same map) for no change;
    `compare()` adds conditions to the transaction. Returns (the map now,
    whether it changed).

    Raises:
        RuntimeError: the map kept changing under 100 tries.
    """
    from elastic_emb.ps.coord.etcd import Compare, Op

    key = map_key(prefix)
    for _ in range(100):
        current = ClusterMap.read(etcd, prefix)
        new = change(current)
        if new is None or new.to_json() == current.to_json():
            return current, False
        conditions = [
            Compare.mod_revision(key, "=", current.revision)
            if current.revision
            else Compare.version(key, "=", 0),
            *compare(),
        ]
        result = etcd.txn(conditions, [Op.put(key, new.to_json())])
        if result.succeeded:
            new.revision = result.revision
            return new, True
    raise RuntimeError("the cluster map kept changing: gave up after 100 tries")
