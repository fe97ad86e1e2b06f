"""`Routing`: which server a worker sends each slot range's requests to, kept current from etcd.

Created by `ee.init(coordinator="etcd://host:port")`. It waits until the
cluster map (`elastic_emb.ps.coord.membership`) covers every slot with a primary,
seals the map (no new groups form once tables may exist), and watches it:
after a failover, `wait_for_change` wakes the worker's calls at once.
"""

from __future__ import annotations

import functools
import itertools
import logging
import random
import threading
import time
from typing import Any

from elastic_emb.ps.coord import membership
from elastic_emb.ps.coord.etcd import Compare, Etcd, EtcdError, EtcdUnavailable, LeaseLost, Op
from elastic_emb.ps.coord.membership import DEFAULT_PREFIX, ClusterMap, Group
from elastic_emb.tables.sharding import RangeLayout

__all__ = ["Routing", "describe_mode"]

log = logging.getLogger("elastic_emb")


def describe_mode(mode: str | None, staleness: int | None) -> str:
    """ "sync", "async", "async (staleness 3)"; "(none yet)" before a worker fixed one."""
    if mode is None:
        return "(none yet)"
    return mode if staleness is None else f"{mode} (staleness {staleness})"


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
        # This worker's lease (`register_worker`) and its keep-alive; guarded by _cond.
        self._keep_alive: Any = None
        self._worker_lease = 0
        self._lease_seconds = 0
        self.registrations = 0  # guarded by _cond: times the lease lapsed and was taken again
        # Guarded by _cond: the leases this worker was granted and did not see end (one may
        # still hold its key: a lapsed one etcd has not expired yet, or one whose put
        # reached etcd though its answer was lost and whose revoke failed).
        self._granted: set[int] = set()
        self._identity_lost: str | None = None  # why this worker cannot register again
        self._closed = threading.Event()
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
                        f"elastic_emb: coordinator {self.coordinator} is unreachable: {e} "
                        f"(no answer within {timeout:g} s: does etcd run there? "
                        "`elastic-emb cluster local` starts one with servers)"
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

    def fix_mode(self, mode: str, staleness: int | None, record: bool = False) -> None:
        """Checks that the job trains in `mode` (and `staleness`), if a worker fixed its
        mode already; with `record` (once the servers took this worker), fixes it in the map
        if none did (the first worker's `ee.init` fixes it, as the servers' step clocks do).

        Raises:
            ModeMismatchError: the job runs in another mode (or staleness bound).
        """
        from elastic_emb.errors import ModeMismatchError

        def change(m: ClusterMap) -> ClusterMap | None:
            if m.mode is not None or not record:
                return None
            new = m.copy()
            new.mode, new.staleness = mode, staleness
            return new

        current, _ = membership.update(self._etcd, self._prefix, change)
        if current.mode is not None and (current.mode, current.staleness) != (mode, staleness):
            raise ModeMismatchError(
                f"elastic_emb: the job at {self.coordinator} trains in "
                f"{describe_mode(current.mode, current.staleness)} mode, fixed by its first "
                f"worker's ee.init; this worker asked for {describe_mode(mode, staleness)}.\n"
                f"Pass mode={current.mode!r}"
                + (f", staleness={current.staleness}" if current.staleness is not None else "")
                + " as every worker of this job, or start a new job on a new cluster (a new "
                "etcd and new servers: another `elastic-emb cluster local`; "
                "docs/fault-tolerance.md)"
            )

    def register_worker(self, worker: int | None, lease_seconds: int, timeout: float = 60.0) -> int:
        """Holds `workers/<worker>` under a lease while this worker lives (elastic workers);
        with `worker` None, one of the lowest indices no live worker holds. Returns the index
        (the one held already, if this process registered before).

        The lease is kept alive from its grant on. If it lapses (etcd or this
        machine too slow to renew it within `lease_seconds`), a new one is
        taken and the same index registered again: the servers, which saw the
        worker leave, ask it to join again (`Cluster`).

        Raises:
            ValueError: a live process already holds this worker index.
            ConnectionError: no lease could be held within `timeout` seconds.
        """
        if self.worker is not None:
            if worker in (None, self.worker):
                return self.worker
            raise ValueError(f"this process is worker {self.worker}, not {worker}")
        self._lease_seconds = lease_seconds
        self.worker = self._hold(worker, timeout)
        return self.worker

    def _hold(self, worker: int | None, timeout: float) -> int:
        """Registers (`_register`) and installs the lease; again if it lapsed meanwhile."""
        while True:
            index, lease, keep = self._register(worker, timeout)
            with self._cond:
                self._worker_lease, self._keep_alive = lease, keep
            if not keep.lost:  # (else its lapse was ignored: not installed yet)
                return index
            worker = index

    def _register(self, worker: int | None, timeout: float) -> tuple[int, int, Any]:
        """A new lease, kept alive, and a worker index held under it: (index, lease, keep)."""
        deadline = time.monotonic() + timeout
        while True:
            lease = self._etcd.grant(self._lease_seconds)
            with self._cond:
                self._granted.add(lease.id)
            keep = None
            try:
                # Kept alive before the index is taken: a slow registration cannot outlive it.
                keep = self._etcd.keep_alive(
                    lease.id,
                    self._lease_seconds / 4,
                    functools.partial(self._on_lease_lost, lease.id),
                )
                return self._take_index(worker, lease.id), lease.id, keep
            except LeaseLost:
                if time.monotonic() > deadline:
                    raise ConnectionError(
                        f"elastic_emb: cannot hold a worker lease of {self._lease_seconds} s at "
                        f"{self.coordinator}: each expired before it was renewed (etcd overloaded?)"
                    ) from None
                log.info("the worker lease expired while registering; taking another")
            except BaseException:
                self._end_lease(lease.id, keep)
                raise
            finally:
                if keep is not None and keep.lost:
                    keep.stop()

    def _take_index(self, worker: int | None, lease: int) -> int:
        """`worker` (or a free index) held under `lease`; taken over from another lease of
        this worker's (`_granted`) if etcd still holds it there.

        Workers started together each try one of the lowest free indices at
        random, a wider choice after each collision: a few transactions each,
        not one per worker ahead of them.
        """
        for attempt in itertools.count():
            if worker is not None:
                index = worker
            else:
                free = self._free_workers(1 << min(attempt, 16))
                index = free[random.randrange(len(free))]
            key = membership.worker_key(self._prefix, index)
            result = self._etcd.txn(
                [Compare.version(key, "=", 0)], [Op.put(key, b"{}", lease)], [Op.get(key)]
            )
            if result.succeeded:
                return index
            held = result.responses[0]
            holder = held[0].lease if isinstance(held, list) and held else 0
            if holder == lease:
                return index  # (a put that succeeded although its answer was lost)
            with self._cond:
                ours = holder in self._granted
            if ours:
                # Not renewed in time here, but not expired in etcd yet: move the key over.
                moved = self._etcd.txn(
                    [Compare.lease(key, "=", holder)], [Op.put(key, b"{}", lease)]
                ).succeeded
                if moved:
                    self._end_lease(holder, None)
                    return index
                continue
            if worker is not None:
                raise ValueError(
                    f"worker {worker} is already connected to {self.coordinator} (another "
                    "process holds its index; give each worker its own `worker_index`, or none "
                    "to take a free one)"
                )
        raise AssertionError("unreachable")

    def _free_workers(self, count: int) -> list[int]:
        """The `count` lowest indices no live worker holds."""
        held, _ = self._etcd.get_prefix(membership.workers_prefix(self._prefix))
        taken = {int(kv.key.rsplit("/", 1)[1]) for kv in held}
        return [i for i in range(len(taken) + count) if i not in taken][:count]

    def _on_lease_lost(self, lease: int) -> None:
        """A keep-alive thread's last act: `lease` lapsed; if it was this worker's, hold the
        same index again under a new one."""
        with self._cond:
            worker = self.worker
            current = lease == self._worker_lease
        if worker is None or not current or self._closed.is_set():
            return  # registering (`_hold` sees it) or closing
        log.warning(
            "worker %d: its etcd lease lapsed (not renewed within %d s: etcd or this machine "
            "too slow); registering again", worker, self._lease_seconds,
        )  # fmt: skip
        delay = 0.1
        while not self._closed.is_set():
            try:
                self._hold(worker, 60.0)
            except ValueError as e:  # another process took the index meanwhile
                self._identity_lost = str(e)
                log.error("worker %d cannot register again: %s", worker, e)
                return
            except (EtcdError, ConnectionError) as e:
                # Once per lapse (etcd away: training goes on meanwhile), then quietly.
                (log.warning if delay == 0.1 else log.debug)(
                    "worker %d: cannot register again yet, retrying: %s", worker, e
                )
                self._closed.wait(delay)
                delay = min(2 * delay, 2.0)
                continue
            with self._cond:
                self.registrations += 1
            log.warning("worker %d: registered again under a new lease", worker)
            if self._closed.is_set():  # closed meanwhile: `close` may have missed this lease
                with self._cond:
                    lease, keep = self._worker_lease, self._keep_alive
                self._end_lease(lease, keep)
            return

    def check_registered(self) -> None:
        """Raises RuntimeError if this worker's index was taken by another process while its
        lease had lapsed (it cannot go on as that worker)."""
        if self._identity_lost is not None:
            raise RuntimeError(
                f"elastic_emb: worker {self.worker} lost its place: {self._identity_lost}"
            )

    def _end_lease(self, lease: int, keep: Any) -> None:
        if keep is not None:
            keep.stop()
        try:
            self._etcd.revoke(lease)
        except EtcdError:
            return  # (it may still hold a key until it expires: `_take_index` moves it)
        with self._cond:
            self._granted.discard(lease)

    def claim(self, name: str) -> bool:
        """Whether this worker holds the claim `name` (`<prefix>claims/<name>`), taking
        it if no live worker does: held under the worker's lease, so it passes on when
        its holder dies. Needs `register_worker` first. False while etcd cannot be reached
        (the caller asks again)."""
        if self.worker is None:
            raise RuntimeError("claims are held by registered workers: call register_worker")
        key = f"{self._prefix}claims/{name}"
        mine = str(self.worker).encode()
        try:
            result = self._etcd.txn(
                [Compare.version(key, "=", 0)],
                [Op.put(key, mine, self._worker_lease)],
                [Op.get(key)],
            )
        except EtcdUnavailable as e:
            log.warning("worker %d: cannot take the claim %r yet: %s", self.worker, name, e)
            return False
        if result.succeeded:
            return True
        held = result.responses[0]
        return isinstance(held, list) and bool(held) and held[0].value == mine

    def close(self) -> None:
        self._closed.set()
        with self._cond:
            keep, lease = self._keep_alive, self._worker_lease
        if keep is not None:
            self._end_lease(lease, keep)
        self._watch.cancel()
        self._etcd.close()
