"""`BackupWatch`: a primary pings its backups and removes one that has answered nothing for
`DROP_AFTER_LEASES` lease TTLs. A backup its primary cannot reach while the backup still
reaches etcd (its lease lives on, so the map keeps it) would otherwise hold every change of
its group up for FORWARD_TIMEOUT (30 s), on either plane. The other side of
`failover`: a backup takes over from a primary silent for one TTL; a primary waits longer,
so that when the two cannot reach each other the backup's take-over comes first."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc

from elastic_emb._proto import ps_pb2
from elastic_emb.ps.server.failover import PING_SECONDS
from elastic_emb.ps.server.peer_channels import PeerChannels
from elastic_emb.ps.server.replica_state import ReplicaState

__all__ = ["DROP_AFTER_LEASES", "BackupWatch"]

log = logging.getLogger("elastic_emb.server")

DROP_AFTER_LEASES = 1.5  # a backup silent this many lease TTLs is removed


class BackupWatch:
    """Pings this primary's backups (`run`, a thread) and removes the silent ones.

    Args:
        state: the replica's shared state (the map, the lease TTL).
        channels: the channels to the other servers.
        drop: removes a backup from this primary's group: drop(address, why); may raise.
    """

    def __init__(
        self, state: ReplicaState, channels: PeerChannels, drop: Callable[[str, str], None]
    ) -> None:
        self._state = state
        self._channels = channels
        self._drop = drop

    def run(self) -> None:
        state = self._state
        limit = DROP_AFTER_LEASES * state.lease_seconds
        answered: dict[str, float] = {}  # backup -> when it last answered (or became one)
        pings: dict[str, grpc.Future] = {}  # backup -> its ping in flight
        ticked = time.monotonic()
        while True:
            with state.cond:
                if state.stopped:
                    return
                group = state.map.group_of(state.address)
                primary = group is not None and group.primary == state.address
                backups = list(group.members) if group is not None and primary else []
            now = time.monotonic()
            if now - ticked > state.lease_seconds / 2:
                # This thread did not run meanwhile (the process stopped or starved): the
                # silence it would see is its own, not its backups'.
                answered = dict.fromkeys(answered, now)
            ticked = now
            for gone in set(answered) - set(backups):
                del answered[gone]
                if (ping := pings.pop(gone, None)) is not None:
                    ping.cancel()
            for backup in backups:
                answered.setdefault(backup, now)
                ping = pings.get(backup)
                if ping is not None and ping.done():
                    if not ping.cancelled() and ping.exception() is None:
                        answered[backup] = now
                    ping = None
                if ping is None:
                    # A ping may take up to a lease (a slow link is not a dead one).
                    pings[backup] = self._channels.stub(backup).Health.future(
                        ps_pb2.HealthRequest(), timeout=state.lease_seconds
                    )
                silent = now - answered[backup]
                if silent > limit:
                    why = f"it answered no ping for {silent:.1f} s"
                    try:
                        self._drop(backup, why)
                    except Exception as e:  # (etcd out of reach: tried again a limit later)
                        log.warning("could not remove %s from the group: %s", backup, e)
                    answered[backup] = time.monotonic()
            time.sleep(PING_SECONDS)
