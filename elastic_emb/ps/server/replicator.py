"""`Replicator`: a group's changes, from its primary to its backups. The primary applies
every change (the requests of `REPLICATED_METHODS`) in one order, numbers it (`sequence`)
and sends it to every backup, answering only once each applied it; a backup that fails to
is first removed from the group, so an acknowledged change is on every replica. A backup
applies the changes in sequence order, and only its current primary's: it stays
bit-identical to the primary. The primary also buffers its changes for the receivers of a
snapshot catching up (`copies`, `moves`)."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from elastic_emb._proto import ps_pb2
from elastic_emb.ps.server.catch_up import ChangeBuffers
from elastic_emb.ps.server.peer_channels import PeerChannels
from elastic_emb.ps.server.replica_state import ReplicaState, aborted
from elastic_emb.ps.server.shard import RequestError
from elastic_emb.ps.wire import protocol

__all__ = [
    "FORWARD_TIMEOUT",
    "REPLICATED_METHODS",
    "WORKER_CHANGES",
    "Replicator",
    "Sent",
]

log = logging.getLogger("elastic_emb.server")

# The requests that change a shard's state: every replica applies them, in order.
# The changes a worker sends, and the servers' own (moving ranges).
WORKER_CHANGES = ("CreateTables", "Join", "Leave", "Push", "ImportRows", "EraseRows", "Restore")
REPLICATED_METHODS = (*WORKER_CHANGES, "ShrinkRange", "DropRange", "MoveIn")
FORWARD_TIMEOUT = 30.0  # a backup that takes longer to apply a change is removed
DROP_CHECK_SECONDS = 0.05  # how often a primary waiting for a backup looks if it was dropped
GAP_TIMEOUT = 10.0  # a backup waits this long for a missing earlier change


class Sent(NamedTuple):
    """A change numbered at `epoch` of `group`, and its sending to each backup (what
    `wait_for_backups` waits for)."""

    group: int
    epoch: int
    sequence: int
    futures: dict[str, concurrent.futures.Future[None]]


class Replicator:
    """Sends a primary's changes to its backups, and applies them on a backup. Thread-safe.

    Args:
        state: the replica's shared state (the map, the applied sequence).
        apply: applies a change request: apply(method, request).
        channels: the channels to the other servers.
        drop: removes a backup from this primary's group: drop(address, why).
    """

    def __init__(
        self,
        state: ReplicaState,
        apply: Callable[[str, Any], Any],
        channels: PeerChannels,
        drop: Callable[[str, str], None],
    ) -> None:
        self._state = state
        self._apply = apply
        self._channels = channels
        self._drop = drop
        self._pool = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="ee-replicate")
        # Joining servers being copied to -> the changes made since their snapshot.
        self.copies: ChangeBuffers[str] = ChangeBuffers(state.cond, state.publish_serving)
        # Ranges being moved away -> their changes made since their snapshot.
        self.moves: ChangeBuffers[int] = ChangeBuffers(state.cond, state.publish_serving)
        # While either buffers, the data plane leaves this primary's changes to Python.
        state.catching_up = lambda: bool(self.copies) or bool(self.moves)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)

    # The primary's side.

    def replicate(self, method: str, request: Any, apply: Callable[[], Any]) -> Any:
        """The primary's path of a change: apply, send to every backup, wait for them."""
        with self._state.order:
            result, sent = self.replicate_in_order(method, request, apply)
        self.wait_for_backups(sent)
        return result

    def replicate_own(self, method: str, request: Any) -> Any:
        """A change this primary makes itself (not a worker's), replicated like any."""
        return self.replicate(method, request, lambda: self._apply(method, request))

    def replicate_in_order(
        self, method: str, request: Any, apply: Callable[[], Any]
    ) -> tuple[Any, Sent]:
        """Applies a change and sends it to the backups (the caller holds `state.order`);
        the result, and what `wait_for_backups` waits for."""
        state = self._state
        state.check_primary(request.range if method in WORKER_CHANGES else None)
        result = apply()
        with state.cond:
            group = state.map.group_of(state.address)
            if group is None or state.applied is None:
                # Replaced meanwhile (it rejoins empty): the worker re-sends to the new primary.
                raise aborted(f"{state.address} lost its group while applying {method}")
            sequence = state.applied + 1
            state.set_applied(sequence, group.epoch)
            forward = ps_pb2.ReplicateRequest(
                group=group.id,
                epoch=group.epoch,
                sequence=sequence,
                method=method,
                request=request.SerializeToString(),
                primary=state.address,
            )
            backups = list(group.members)
            self.copies.add_to_all(forward)
            if method in WORKER_CHANGES:
                self.moves.add(forward, request.range)
        sent = {b: self._pool.submit(self._forward, b, forward) for b in backups}
        return result, Sent(group.id, group.epoch, forward.sequence, sent)

    def wait_for_backups(self, sent: Sent) -> None:
        """Waits for every backup to apply a change; removes those that did not. Then the
        change may be acknowledged (counted so); if one cannot be removed, `aborted`."""
        for backup, future in sent.futures.items():
            try:
                self._wait_unless_dropped(backup, future)
            except Exception as e:
                self._drop(backup, f"it did not apply change {sent.sequence}: {e}")
        self._state.replication.count_acknowledged(
            sent.group, sent.epoch, sent.sequence, sent.sequence
        )

    def _wait_unless_dropped(self, backup: str, future: concurrent.futures.Future[None]) -> None:
        """Waits for `backup` to apply a change, or until this primary's map no longer lists
        it (dropped meanwhile, e.g. paused past its lease): a paused backup holds a change
        up for about a lease, not FORWARD_TIMEOUT."""
        state = self._state
        while True:
            try:
                return future.result(timeout=DROP_CHECK_SECONDS)
            except concurrent.futures.TimeoutError:
                with state.cond:
                    group = state.map.group_of(state.address)
                    if group and group.primary == state.address and not group.holds(backup):
                        return

    def send_all(self, address: str, changes: list[ps_pb2.ReplicateRequest]) -> None:
        """Sends changes concurrently (the receiver applies them in order)."""
        for future in [self._pool.submit(self._forward, address, c) for c in changes]:
            future.result()

    def _forward(self, address: str, request: ps_pb2.ReplicateRequest) -> None:
        self._channels.stub(address).Replicate(request, timeout=FORWARD_TIMEOUT)

    # The backup's side.

    def on_replicate(self, request: ps_pb2.ReplicateRequest) -> int:
        """Applies one change sent by the primary, in sequence order; returns its sequence."""
        if self._wait_for_turn(request):
            return int(request.sequence)  # applied already: sent again
        message = protocol.change_request(request.method, request.request)
        if request.method not in REPLICATED_METHODS:
            raise RequestError("INVALID_ARGUMENT", f"{request.method} is not a change")
        state = self._state
        try:
            self._apply(request.method, message)
        except Exception as e:
            # The sequence stays: the next change waits, and the primary drops this backup.
            log.exception("change %d (%s) failed on a backup", request.sequence, request.method)
            raise RequestError(
                "DATA_LOSS", f"{state.address} could not apply change {request.sequence}: {e}"
            ) from e
        state.set_applied(request.sequence, request.epoch, (request.method, request.request))
        return int(request.sequence)

    def _wait_for_turn(self, request: ps_pb2.ReplicateRequest) -> bool:
        """Waits until `request` is the next change to apply (False), or returns True for
        one applied already. Raises `aborted` for a sender that is not the primary, and
        DATA_LOSS for a replica that diverged or an earlier change missing too long: the
        data plane's own rules (`_core.Replication.wait_turn`)."""
        turn, why = self._state.replication.wait_turn(
            request.group, request.epoch, request.sequence, request.method,
            request.request, request.primary, GAP_TIMEOUT,
        )  # fmt: skip
        if turn == "refuse":
            raise aborted(why)
        if turn == "diverged":
            raise RequestError("DATA_LOSS", why)
        return turn == "done"
