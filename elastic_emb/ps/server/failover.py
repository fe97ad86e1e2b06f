"""`Failover`: a backup pings its group's primary; when the primary stops answering (or its
lease ends), the backup revokes the primary's lease and makes itself the primary with a
new epoch. Workers re-send their unacknowledged pushes to the new primary, which
de-duplicates them by (worker, step) (`Shard.push`)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import grpc

from elastic_emb._proto import ps_pb2
from elastic_emb.ps.coord import membership
from elastic_emb.ps.coord.etcd import Etcd, EtcdError
from elastic_emb.ps.coord.membership import ClusterMap
from elastic_emb.ps.server.peer_channels import PeerChannels
from elastic_emb.ps.server.replica_state import MapEditor, ReplicaState

__all__ = ["PING_FAILURES", "PING_SECONDS", "Failover"]

log = logging.getLogger("elastic_emb.server")

PING_SECONDS = 0.1  # a backup asks its primary this often...
PING_FAILURES = 3  # ...and takes over after this many refused connections in a row (dead),
# or once a primary that still accepts connections has not answered for its lease's TTL
# (paused, or too overloaded to answer a ping within its lease: a ping waits that long).


class Failover:
    """Watches this backup's primary (`run`, a thread) and takes over from it. Thread-safe.

    Args:
        state: the replica's shared state.
        etcd: the coordinator.
        prefix: the cluster's key prefix in etcd.
        channels: the channels to the other servers.
        change_map: changes the cluster map (the promotion).
        promoted: called once this server became its group's primary.
    """

    def __init__(
        self,
        state: ReplicaState,
        etcd: Etcd,
        prefix: str,
        channels: PeerChannels,
        change_map: MapEditor,
        promoted: Callable[[], None],
    ) -> None:
        self._state = state
        self._etcd = etcd
        self._prefix = prefix
        self._channels = channels
        self._change_map = change_map
        self._promoted = promoted
        # Both the ping loop and the primary's lease ending call `take_over`: the (group,
        # epoch) this server last became primary of, so that `promoted` runs once for it.
        self._lock = threading.Lock()
        self._became: tuple[int, int] | None = None  # guarded by _lock
        self._taking_over = threading.Lock()  # one take-over at a time (its fence is its own)

    def run(self) -> None:
        """A backup pings its primary and takes over from a dead or unresponsive one: after
        PING_FAILURES refused connections in a row, or no answer for the lease's TTL."""
        state = self._state
        failures, watched, answered = 0, "", time.monotonic()
        while True:
            with state.cond:
                if state.stopped:
                    return
                group = state.map.group_of(state.address)
            primary = group.primary if group and state.address in group.members else ""
            if primary != watched:
                failures, watched, answered = 0, primary, time.monotonic()
            if group is not None and primary:
                # Naming the group and epoch followed: the primary's witness without etcd.
                ping = ps_pb2.HealthRequest(backup=state.address, group=group.id, epoch=group.epoch)
                # Waits as long as the lease leaves: a primary starved of CPU that answers
                # late, but within its lease, is not silent.
                wait = max(3 * PING_SECONDS, state.lease_seconds - (time.monotonic() - answered))
                try:
                    self._channels.stub(primary).Health(ping, timeout=wait)
                    failures, answered = 0, time.monotonic()
                except grpc.RpcError as e:
                    refused = e.code() == grpc.StatusCode.UNAVAILABLE  # nothing listens there
                    failures = failures + 1 if refused else 0
                    silent = time.monotonic() - answered
                    if failures >= PING_FAILURES or silent > state.lease_seconds:
                        self.take_over(primary)
                        failures, answered = 0, time.monotonic()
            time.sleep(PING_SECONDS)

    def take_over(self, primary: str) -> None:
        """Ends the lease of an unresponsive primary and becomes the group's primary.

        From the moment it decides, this backup refuses the old primary's changes: once
        etcd names it, the old primary can get none of them applied, so it acknowledges
        nothing more. It takes them again if the take-over fails.
        """
        with self._taking_over:
            self._state.depose(primary)
            try:
                new = self._promote(primary)
            finally:
                self._state.depose(None)
        if new is None:
            return
        address = self._state.address
        group = new.group_of(address)
        if group is None or group.primary != address:
            return
        with self._lock:
            if self._became == (group.id, group.epoch):
                return  # the other call said so
            self._became = (group.id, group.epoch)
        self._promoted()
        log.warning(
            "%s is now the primary of group %d (epoch %d): %s stopped answering",
            address, group.id, group.epoch, primary,
        )  # fmt: skip

    def _promote(self, primary: str) -> ClusterMap | None:
        """Revokes `primary`'s lease and promotes this backup in the map; None if etcd
        cannot be reached."""
        address = self._state.address
        key = membership.server_key(self._prefix, primary)
        try:
            kv = self._etcd.get(key)
            if kv is not None:
                self._etcd.revoke(json.loads(kv.value)["lease"])

            def promote(m: ClusterMap) -> ClusterMap | None:
                group = m.group_of(address)
                if group is None or group.primary != primary or address not in group.members:
                    return None
                return m.promote(group.id, address)

            return self._change_map(promote, as_primary=False)
        except EtcdError as e:
            log.warning("cannot take over from %s: %s", primary, e)
            return None
