"""`IncomingRanges`: the slot ranges a group takes in. A range moving in from another group
arrives as numbered MoveIn messages, each applied on every replica of the group as one
change: the snapshot's parts build the range a part at a time, its last part installs
the step state, and the range's changes made since follow; a message out of order or
from a deposed source primary is refused. A group that holds no state yet adopts the
ranges the map gives it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from elastic_emb._proto import ps_pb2
from elastic_emb.ps.coord.membership import ClusterMap, Group
from elastic_emb.ps.server.replica_state import ReplicaState, aborted
from elastic_emb.ps.server.replicator import WORKER_CHANGES
from elastic_emb.ps.server.shard import Ranges, RequestError, Shard
from elastic_emb.ps.wire import protocol

__all__ = ["IncomingRanges"]


@dataclasses.dataclass
class _Incoming:
    """A range moving into this group: its source's epoch, the last MoveIn, and whether
    its step state is installed (the snapshot's last part). Guarded by `ReplicaState.cond`."""

    epoch: int
    index: int = 0
    installed: bool = False


class IncomingRanges:
    """The ranges moving into this server's group, and the map's ranges it adopts.

    Thread-safe: the moves in are guarded by `state.cond`.

    Args:
        state: the replica's shared state.
        ranges: the server's shards.
        apply: applies a change request: apply(method, request).
    """

    def __init__(
        self, state: ReplicaState, ranges: Ranges, apply: Callable[[str, Any], Any]
    ) -> None:
        self._state = state
        self._ranges = ranges
        self._apply = apply
        # Guarded by state.cond: ranges moving in -> their source epoch, last MoveIn, and
        # snapshot state.
        self._incoming: dict[int, _Incoming] = {}

    def ids(self) -> set[int]:
        """The ranges moving in now."""
        with self._state.cond:
            return set(self._incoming)

    def forget(self) -> None:
        """Gives up every move in (the server's state was wiped)."""
        with self._state.cond:
            self._incoming.clear()

    def follow(self, new: ClusterMap, group: Group | None) -> None:
        """Adopts the map's ranges of this server's group while it holds no state yet
        (before any table or worker); forgets moves in that finished or were given up."""
        with self._state.cond:
            for rid in list(self._incoming):
                r, move = new.range(rid), new.move
                if group is not None and r is not None and r.group == group.id:
                    del self._incoming[rid]  # moved in
                elif group is None or move is None or (move.new_range, move.to) != (rid, group.id):
                    del self._incoming[rid]  # given up
                    self._ranges.pop(rid)
            wanted = {r.id: r.slots for r in new.ranges_of(group.id)} if group else {}
            held = {rid: s for rid, s in self._ranges.items() if rid not in self._incoming}
            if {rid: shard.slots for rid, shard in held.items()} == wanted:
                return
            if all(shard.mode_name() is None and not shard.tables() for shard in held.values()):
                for rid in held:
                    self._ranges.pop(rid)
                for rid, slots in wanted.items():
                    self._ranges.put(rid, Shard(slots))

    def move_in(self, request: ps_pb2.MoveInRequest) -> int:
        """Applies one MoveIn (on every replica of the target group); the range's rows.

        Raises `aborted`, changing nothing, for a message out of order or from a
        deposed source primary.
        """
        incoming = self._accept(request)
        shard = self._ranges.get(request.range)
        if request.HasField("chunk"):
            self._install_part(shard, request.chunk, incoming)
        elif request.HasField("change"):
            self._apply_change(shard, request, incoming)
        with self._state.cond:
            incoming.index = request.index
        return sum(len(t) for t in shard.tables())

    def _accept(self, request: ps_pb2.MoveInRequest) -> _Incoming:
        """The move `request` continues (or, for its first message, starts)."""
        rid = request.range
        with self._state.cond:
            incoming = self._incoming.get(rid)
            if request.index == 0:
                if incoming is not None and request.source_epoch < incoming.epoch:
                    raise aborted(f"a newer move of slot range {rid} is under way")
                if incoming is None and self._ranges.find(rid) is not None:
                    raise aborted(f"slot range {rid} is already on {self._state.address}'s group")
                incoming = self._incoming[rid] = _Incoming(request.source_epoch)
                self._ranges.put(rid, Shard((request.chunk.slot_begin, request.chunk.slot_end)))
            elif (
                incoming is None
                or request.source_epoch != incoming.epoch
                or request.index != incoming.index + 1
            ):
                raise aborted(f"MoveIn {request.index} of slot range {rid} is out of order")
            return incoming

    def _install_part(self, shard: Shard, chunk: ps_pb2.SnapshotChunk, incoming: _Incoming) -> None:
        """One part of the range's snapshot: a table's rows, or the step state (the last)."""
        if chunk.table_config_json:
            (table,) = shard.create([json.loads(chunk.table_config_json)])
            table.add_state(protocol.read_state(chunk.rows, table.dim, table.num_slots))
        if chunk.steps_json:
            pending = [
                (p.worker, p.step, protocol.pushed_gradients(p, lambda n: shard.table(n).dim))
                for p in chunk.pending
            ]
            shard.install(shard.tables(), json.loads(chunk.steps_json), pending)
            with self._state.cond:
                incoming.installed = True

    def _apply_change(
        self, shard: Shard, request: ps_pb2.MoveInRequest, incoming: _Incoming
    ) -> None:
        """A change of the source range made since its snapshot, to the slots moving in."""
        change = request.change
        with self._state.cond:
            installed = incoming.installed
        if change.method not in WORKER_CHANGES or not installed:
            raise aborted(f"MoveIn {request.index}: {change.method} before the snapshot")
        message = protocol.change_request(change.method, change.request)
        if message.range != request.source_range:
            raise RequestError("INVALID_ARGUMENT", f"a change of range {message.range}")
        if shard.slots is None:
            raise RuntimeError(f"slot range {request.range} moving in has no slots")
        part = protocol.restricted(change.method, message, shard.slots, shard.table)
        part.range = request.range
        self._apply(change.method, part)
