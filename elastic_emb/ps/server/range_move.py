"""`RangeMover`: a primary's thread that carries out the cluster map's plans for its slot
ranges: it splits them as the map plans, moves slots to another group, drops the ranges
the map gave away, moves slots for load, and dissolves a retiring group left without
ranges. A move sends the target group's primary a snapshot of the slots, then the range's
changes made since (MoveIn, which the target replicates like any change); between two
changes it sends the last ones and commits the range's new group in the map, then drops
(or shrinks) the range. A range's state moves whole, so a step a worker sends again to the
range's new group is applied once."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from elastic_emb._proto import ps_pb2
from elastic_emb.ps.coord.membership import ClusterMap, Group, Move, Range
from elastic_emb.ps.server.catch_up import drain_then_cutover
from elastic_emb.ps.server.incoming_ranges import IncomingRanges
from elastic_emb.ps.server.load_balancing import LoadBalancer, MemoryBalancer
from elastic_emb.ps.server.peer_channels import PeerChannels
from elastic_emb.ps.server.replica_state import MapEditor, ReplicaState, aborted
from elastic_emb.ps.server.replicator import FORWARD_TIMEOUT, Replicator, Sent
from elastic_emb.ps.server.shard import Ranges
from elastic_emb.ps.server.snapshot import RangeSnapshot

__all__ = ["MOVE_RETRY_SECONDS", "MOVE_ROWS", "RangeMover"]

log = logging.getLogger("elastic_emb.server")

# Rows per MoveIn part: the target applies each as one change, which its ranges wait for.
MOVE_ROWS = 1 << 16
MOVE_RETRY_SECONDS = 1.0  # a move that failed is tried again after this long


class RangeMover:
    """Moves this primary's ranges as the map plans (`run`, a thread).

    Args:
        state: the replica's shared state.
        ranges: the server's shards.
        apply: applies a change request: apply(method, request).
        replicator: replicates the changes a move makes (ShrinkRange, DropRange), and
            buffers the range's changes during a move.
        incoming: the ranges moving in (never dropped as given away).
        channels: the channels to the other servers.
        change_map: changes the cluster map.
        balancers: plan moves of slots away (for memory, for load), asked in order until
            one plans a move.
        move_pause: seconds a move waits after sending its snapshot (fault tests).
        cutover_pause: seconds a move holds its group's changes at the cutover, before
            committing the map and again after, before it gives the slots up (fault tests).
    """

    def __init__(
        self,
        state: ReplicaState,
        ranges: Ranges,
        apply: Callable[[str, Any], Any],
        replicator: Replicator,
        incoming: IncomingRanges,
        channels: PeerChannels,
        change_map: MapEditor,
        balancers: list[LoadBalancer | MemoryBalancer],
        move_pause: float,
        cutover_pause: float = 0.0,
    ) -> None:
        self._state = state
        self._ranges = ranges
        self._apply = apply
        self._replicator = replicator
        self._incoming = incoming
        self._channels = channels
        self._change_map = change_map
        self._balancers = balancers
        self._move_pause = move_pause
        self._cutover_pause = cutover_pause

    def run(self) -> None:
        """Acts on each new map (and retries a move that failed) until the replica stops."""
        state = self._state
        while True:
            with state.cond:
                state.cond.wait_for(
                    lambda: state.rebalance_due or state.stopped, MOVE_RETRY_SECONDS
                )
                if state.stopped:
                    return
                state.rebalance_due = False
            try:
                self._rebalance()
            except Exception as e:
                log.warning("moving slot ranges: %s (trying again)", e)
                time.sleep(MOVE_RETRY_SECONDS)

    def _rebalance(self) -> None:
        state = self._state
        with state.cond:
            m, applied = state.map.copy(), state.applied
        group = m.group_of(state.address)
        if not m.sealed or group is None or group.primary != state.address or applied is None:
            return
        self._drop_moved(m, group)
        if m.plan() is not None:
            m = self._change_map(lambda current: current.plan(), as_primary=False)
            group = m.group_of(state.address)
            if group is None or group.primary != state.address:
                return
        for balancer in self._balancers:
            if m.move is not None:
                break
            m = balancer.plan(m, group)
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

    def _drop_moved(self, m: ClusterMap, group: Group) -> None:
        """Drops the ranges this group holds that the map gives to another group, and
        shrinks those whose upper slots it gave away (a move whose source primary died
        after the cutover, before its DropRange or ShrinkRange reached this replica)."""
        incoming = self._incoming.ids()
        for rid, shard in self._ranges.items():
            now = m.range(rid)
            if rid in incoming:
                continue
            if now is None or now.group != group.id:
                self._replicator.replicate_own("DropRange", ps_pb2.DropRangeRequest(range=rid))
            elif shard.slots is not None and shard.slots[0] < now.slot_end < shard.slots[1]:
                shrink = ps_pb2.ShrinkRangeRequest(range=rid, slot=now.slot_end)
                self._replicator.replicate_own("ShrinkRange", shrink)

    def _move(self, move: Move, m: ClusterMap) -> None:
        """Moves range `move.range`'s slots [move.slot, end) to group `move.to`: a snapshot,
        the range's changes since, and the cutover between two changes."""
        source, target = m.range(move.range), m.find_group(move.to)
        if source is None:
            raise RuntimeError(f"the map moves slot range {move.range}, which it does not hold")
        group = m.group(source.group)
        if target is None or not target.primary:
            log.warning(
                "slot range %d cannot move to group %d: it has no primary", move.range, move.to
            )
            time.sleep(MOVE_RETRY_SECONDS)
            return
        slots = (move.slot, source.slot_end)
        started = time.monotonic()
        with self._state.order:
            self._state.check_primary(source.id)
            snapshot = RangeSnapshot.take(move.new_range, self._ranges.get(source.id), slots)
            self._replicator.moves.open(source.id)
        held = [time.monotonic() - started]  # how long the group's changes waited
        log.info("moving slots %s of range %d (%d rows) to group %d at %s",
                 slots, source.id, snapshot.rows, target.id, target.primary)  # fmt: skip
        try:
            held.append(self._hand_over(move, source, group, target, snapshot))
            seconds = time.monotonic() - started
            log.warning("moved slots %s of range %d (%d rows) to group %d in %.2f s (changes "
                        "waited %.3f s for the snapshot, %.3f s for the cutover)",
                        slots, source.id, snapshot.rows, target.id, seconds, *held)  # fmt: skip
        except Exception as e:
            self._replicator.moves.discard(source.id)
            why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
            log.warning("moving slots %s of range %d to group %d failed (%s); trying again",
                        slots, source.id, target.id, why)  # fmt: skip
            time.sleep(MOVE_RETRY_SECONDS)

    def _hand_over(
        self, move: Move, source: Range, group: Group, target: Group, snapshot: RangeSnapshot
    ) -> float:
        """Sends the snapshot and the range's changes since to the target, commits the move
        and gives the slots up; the seconds the group's changes waited for the cutover."""
        stub = self._channels.stub(target.primary)
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

        def send_changes(changes: list[ps_pb2.ReplicateRequest]) -> None:
            for change in changes:
                send(change=change)

        for chunk in snapshot.chunks(dict(group=group.id, epoch=group.epoch), MOVE_ROWS):
            send(chunk=chunk)
        time.sleep(self._move_pause)
        shrunk, waited = drain_then_cutover(
            self._state.order,
            self._replicator.moves,
            source.id,
            send_changes,
            lambda: self._cut_over(move, source, target),
        )
        if shrunk is not None:
            self._replicator.wait_for_backups(shrunk)
        else:
            self._replicator.replicate_own("DropRange", ps_pb2.DropRangeRequest(range=source.id))
        return waited

    def _cut_over(self, move: Move, source: Range, target: Group) -> Sent | None:
        """Commits the range's new group in the map (the caller holds `state.order`); for
        part of a range, shrinks it (what to wait for); None: the whole range moved."""

        def commit(current: ClusterMap) -> ClusterMap | None:
            to = current.find_group(target.id)
            if current.move != move or current.range(source.id) != source:
                return None
            if to is None or to.primary != target.primary or to.epoch != target.epoch:
                return None
            return current.moved()

        time.sleep(self._cutover_pause)  # (fault tests: changes arriving wait meanwhile)
        if self._change_map(commit, as_primary=True).move == move:
            raise aborted(f"group {target.id} changed its primary during the move")
        time.sleep(self._cutover_pause)  # (the map names the new group, the rows are here)
        if move.slot == source.slot_begin:
            return None
        # Before any later change: the keys of the moved slots are gone.
        shrink = ps_pb2.ShrinkRangeRequest(range=source.id, slot=move.slot)
        _, shrunk = self._replicator.replicate_in_order(
            "ShrinkRange", shrink, lambda: self._apply("ShrinkRange", shrink)
        )
        return shrunk
