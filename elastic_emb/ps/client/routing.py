"""`Routing`: which server a worker sends each slot range's requests to, kept current from etcd.

Created by `ee.init(coordinator="etcd://host:port")`. It waits until the
cluster map (`elastic_emb.ps.coord.membership`) covers every slot with a primary,
seals the map (no new groups form once tables may exist), and watches it:
after a failover, `wait_for_change` wakes the worker's calls at once.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from elastic_emb.ps.coord import membership
from elastic_emb.ps.coord.etcd import Compare, Etcd, EtcdError, Op
from elastic_emb.ps.coord.membership import DEFAULT_PREFIX, ClusterMap, Group
from elastic_emb.tables.sharding import RangeLayout

__all__ = ["Routing"]

log = logging.getLogger("elastic_emb")


class Routing:
    """The slot ranges and the primaries of their groups. Thread-safe.

    Raises:
        ConnectionError: no complete cluster within `connect_timeout`.
    """

    def __init__(
        self, coordinator: str, connect_timeout: float, prefix: str = DEFAULT_PREFIX
    ) -> None:
        self.coordinator = coordinator
        self._etcd = Etcd(coordinator)
        self._prefix = prefix
        self._key = membership.map_key(prefix)
        self._cond = threading.Condition()
        self._map = self._sealed_map(connect_timeout)  # guarded by _cond
        self._keep_alive: Any = None  # this worker's lease (`register_worker`)
        self._worker_lease = 0
        self.worker: int | None = None  # the worker index this process holds
        self._watch = self._etcd.watch(self._key, self._on_events, self._map.revision + 1)

    def _sealed_map(self, timeout: float) -> ClusterMap:
        deadline = time.monotonic() + timeout
        current = ClusterMap()
        while True:
            try:
                current = ClusterMap.read(self._etcd, self._prefix)
                if current.ready() and current.sealed:
                    return current
                if current.ready():
                    current.sealed = True
                    compare = [Compare.mod_revision(self._key, "=", current.revision)]
                    result = self._etcd.txn(compare, [Op.put(self._key, current.to_json())])
                    if result.succeeded:
                        current.revision = result.revision
                        return current
                    continue
            except EtcdError as e:
                if time.monotonic() > deadline:
                    raise ConnectionError(
                        f"elastic_emb: coordinator {self.coordinator} is unreachable: {e}"
                    ) from None
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"elastic_emb: the cluster at {self.coordinator} has no primary for every "
                    f"slot after {timeout:g} s (start servers with `elastic-emb serve "
                    f"--coordinator {self.coordinator}`). Map: {current.describe()}"
                )
            time.sleep(0.1)

    def _on_events(self, events: list[Any]) -> None:
        new: ClusterMap | None = None
        if not events:  # the watch restarted: read the map again
            new = ClusterMap.read(self._etcd, self._prefix)
        for event in events:
            if event.type == "PUT":
                new = ClusterMap.from_json(event.kv.value, event.kv.mod_revision)
        with self._cond:
            if new is not None and new.revision > self._map.revision:
                self._map = new
                self._cond.notify_all()

    @property
    def version(self) -> int:
        with self._cond:
            return self._map.revision

    def layout(self) -> RangeLayout:
        """The slot ranges, in slot order."""
        with self._cond:
            ranges, version = self._map.by_slot(), self._map.revision
        return RangeLayout(tuple(r.id for r in ranges), tuple(r.slots for r in ranges), version)

    def _group_of_range(self, range_id: int) -> Group | None:
        with self._cond:
            r = self._map.range(range_id)
            return None if r is None else self._map.find_group(r.group)

    def primary_of(self, range_id: int) -> str:
        """The primary of the group that holds range `range_id` ("" while there is none)."""
        group = self._group_of_range(range_id)
        return group.primary if group else ""

    def replicas_of(self, range_id: int) -> list[str]:
        """The primary and the backups of the group that holds range `range_id`."""
        group = self._group_of_range(range_id)
        return group.replicas if group else []

    def hot(self, range_id: int) -> bool:
        """Whether range `range_id` holds hot slots (`elastic_emb.ps.coord.balance`)."""
        with self._cond:
            return range_id in self._map.hot

    def lost(self, range_id: int) -> str | None:
        """Why range `range_id`'s group lost every replica, or None while it may recover.

        A primary whose lease ended and that has no backup cannot come back
        with its rows: a server that restarts (or wakes after its lease
        expired) joins again empty.
        """
        g = self._group_of_range(range_id)
        if g is None or g.members:
            return None
        try:
            alive = self._etcd.get(membership.server_key(self._prefix, g.primary)) is not None
        except EtcdError:
            return None  # unknown: keep waiting
        if alive:
            return None
        return (
            f"group {g.id} (slot range {range_id}) lost every replica: its primary "
            f"{g.primary or '(none)'} is gone and it has no backup"
            + (f" ({', '.join(g.joining)} was still copying)" if g.joining else "")
            + "; its rows since the last checkpoint are lost. Restart the cluster and restore "
            "the last checkpoint (docs/fault-tolerance.md)"
        )

    def wait_for_change(self, version: int, timeout: float) -> None:
        """Returns once the map is newer than `version`, or after `timeout`."""
        with self._cond:
            self._cond.wait_for(lambda: self._map.revision > version, timeout)

    def register_worker(self, worker: int | None, lease_seconds: int) -> int:
        """Holds `workers/<worker>` under a lease while this worker lives (elastic workers);
        with `worker` None, the lowest index no live worker holds. Returns the index (the
        one held already, if this process registered before).

        Raises:
            ValueError: a live process already holds this worker index.
        """
        if self.worker is not None:
            if worker in (None, self.worker):
                return self.worker
            raise ValueError(f"this process is worker {self.worker}, not {worker}")
        lease = self._etcd.grant(lease_seconds)
        while True:
            index = worker if worker is not None else self._lowest_free_worker()
            key = membership.worker_key(self._prefix, index)
            created = self._etcd.txn(
                [Compare.version(key, "=", 0)], [Op.put(key, b"{}", lease.id)]
            ).succeeded
            if created:
                break
            if worker is not None:
                self._etcd.revoke(lease.id)
                raise ValueError(
                    f"worker {worker} is already connected to {self.coordinator} (another "
                    "process holds its index; give each worker its own `worker_index`, or none "
                    "to take a free one)"
                )
            # Another worker took that index meanwhile: look again.
        self.worker, self._worker_lease = index, lease.id
        self._keep_alive = self._etcd.keep_alive(
            lease.id, lease_seconds / 4, lambda: log.warning("worker lease lost")
        )
        return index

    def claim(self, name: str) -> bool:
        """Whether this worker holds the claim `name` (`<prefix>claims/<name>`), taking
        it if no live worker does: held under the worker's lease, so it passes on when
        its holder dies. Needs `register_worker` first."""
        if self.worker is None:
            raise RuntimeError("claims are held by registered workers: call register_worker")
        key = f"{self._prefix}claims/{name}"
        mine = str(self.worker).encode()
        result = self._etcd.txn(
            [Compare.version(key, "=", 0)],
            [Op.put(key, mine, self._worker_lease)],
            [Op.get(key)],
        )
        if result.succeeded:
            return True
        held = result.responses[0]
        return isinstance(held, list) and bool(held) and held[0].value == mine

    def _lowest_free_worker(self) -> int:
        held, _ = self._etcd.get_prefix(membership.workers_prefix(self._prefix))
        taken = {int(kv.key.rsplit("/", 1)[1]) for kv in held}
        return min(set(range(len(taken) + 1)) - taken)

    def close(self) -> None:
        if self._keep_alive is not None:
            self._keep_alive.stop()
            try:
                self._etcd.revoke(self._worker_lease)
            except EtcdError:
                pass
        self._watch.cancel()
        self._etcd.close()
