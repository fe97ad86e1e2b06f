"""`SnapshotCopy`: a joining server becomes a backup. Its group's primary sends it a
snapshot of every range (taken between two changes), then the changes made since; between
two changes it sends the last ones and admits it as a backup in the map. A failed copy
removes the joining server from the group."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from elastic_emb._proto import ps_pb2
from elastic_emb.ps.coord.membership import ClusterMap, Group
from elastic_emb.ps.server.catch_up import drain_then_cutover
from elastic_emb.ps.server.peer_channels import PeerChannels
from elastic_emb.ps.server.replica_state import MapEditor, ReplicaState, aborted
from elastic_emb.ps.server.replicator import Replicator
from elastic_emb.ps.server.shard import Ranges, RequestError
from elastic_emb.ps.server.snapshot import RangeSnapshot

__all__ = ["SnapshotCopy"]

log = logging.getLogger("elastic_emb.server")

SNAPSHOT_TIMEOUT = 6 * 3600.0  # seconds a joining server may take to load a snapshot


class SnapshotCopy:
    """Copies a primary's state to a joining server, and installs it there. Thread-safe.

    Args:
        state: the replica's shared state.
        ranges: the server's shards.
        replicator: buffers the changes made during a copy, and sends them.
        channels: the channels to the other servers.
        change_map: changes the cluster map (the admission).
        drop: removes a server from this primary's group: drop(address, why).
        follow_ranges: adopts the map's ranges once a snapshot is installed
            (`IncomingRanges.follow`; the caller holds `state.cond`).
    """

    def __init__(
        self,
        state: ReplicaState,
        ranges: Ranges,
        replicator: Replicator,
        channels: PeerChannels,
        change_map: MapEditor,
        drop: Callable[[str, str], None],
        follow_ranges: Callable[[ClusterMap, Group | None], None],
    ) -> None:
        self._state = state
        self._ranges = ranges
        self._replicator = replicator
        self._channels = channels
        self._change_map = change_map
        self._drop = drop
        self._follow_ranges = follow_ranges

    def copy_to(self, address: str) -> None:
        """The primary's side: snapshot, then the changes made meanwhile, then admission."""
        state, copies = self._state, self._replicator.copies
        with state.order:
            with state.cond:
                group = state.map.group_of(state.address)
                if address in copies or group is None or address not in group.joining:
                    return
                copies.open(address)
                header: dict[str, Any] = dict(
                    group=group.id,
                    epoch=group.epoch,
                    sequence=state.applied or 0,
                    primary=state.address,
                )
            snapshot = [RangeSnapshot.take(rid, shard) for rid, shard in self._ranges.items()]
        log.info("copying group %d (%d ranges) to %s", group.id, len(snapshot), address)

        def chunks() -> Iterator[ps_pb2.SnapshotChunk]:
            yield ps_pb2.SnapshotChunk(**header)  # (a group may hold no range)
            for part in snapshot:
                yield from part.chunks(header)

        gid = group.id

        def admit() -> None:
            self._change_map(
                lambda m: m.admit(gid, address) if address in m.group(gid).joining else None,
                as_primary=True,
            )

        try:
            self._channels.stub(address).InstallSnapshot(chunks(), timeout=SNAPSHOT_TIMEOUT)
            drain_then_cutover(
                state.order,
                copies,
                address,
                lambda changes: self._replicator.send_all(address, changes),
                admit,
            )
            log.info("%s is now a backup of group %d", address, group.id)
        except Exception as e:
            copies.discard(address)
            self._drop(address, f"copying to it failed: {e}")

    def install(self, chunks: Iterator[ps_pb2.SnapshotChunk]) -> int:
        """The joining server's side: loads the primary's state (every range); its rows."""
        try:
            received = list(chunks)
        except grpc.RpcError as e:  # the sender died or gave up
            raise aborted(f"the snapshot stream broke: {e}") from None
        if not received:
            raise RequestError("INVALID_ARGUMENT", "an empty snapshot")
        first = received[0]
        state = self._state
        state.check_sender(first.group, first.epoch, first.primary)
        shards = RangeSnapshot.read(received)
        with state.cond:
            state.check_sender(first.group, first.epoch, first.primary)
            self._ranges.replace(shards)
            self._follow_ranges(state.map, state.map.group_of(state.address))
            state.set_applied(first.sequence, first.epoch)
            state.cond.notify_all()
        return sum(len(t) for shard in shards.values() for t in shard.tables())
