"""Balancing slots by load (`elastic_emb.ps.coord.balance`): `LoadReporter` publishes this
server's per-slot load to the coordinator under its lease, and `LoadBalancer` plans, for a
primary whose group has been the most loaded beyond a policy's threshold for long enough,
a move of slots away (and marks the ranges of hot slots, for workers to spread reads)."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from elastic_emb.ps.coord import balance
from elastic_emb.ps.coord.balance import LoadMeter, Policy
from elastic_emb.ps.coord.etcd import Etcd, EtcdError
from elastic_emb.ps.coord.membership import ClusterMap, Group
from elastic_emb.ps.server import resources
from elastic_emb.ps.server.replica_state import MapEditor, ReplicaState

__all__ = ["LoadBalancer", "LoadReporter", "MemoryBalancer"]

log = logging.getLogger("elastic_emb.server")


class LoadReporter:
    """Publishes the server's load and its use of resources (`usage(cpu rate)`) every fifth
    of the meter's window (`run`, a thread)."""

    def __init__(
        self,
        state: ReplicaState,
        etcd: Etcd,
        prefix: str,
        load: LoadMeter,
        usage: Callable[[float], balance.Usage] | None = None,
    ) -> None:
        self._state = state
        self._etcd = etcd
        self._prefix = prefix
        self._load = load
        self._usage = usage
        # (monotonic time, the process's CPU seconds then), oldest first, over the window.
        self._cpu: collections.deque[tuple[float, float]] = collections.deque()

    def _cpu_rate(self) -> float:
        """The process's CPU seconds per second over the load window."""
        now = time.monotonic()
        self._cpu.append((now, resources.cpu_seconds()))
        while len(self._cpu) > 2 and now - self._cpu[1][0] >= self._load.window:
            self._cpu.popleft()
        (since, before), (_, after) = self._cpu[0], self._cpu[-1]
        return (after - before) / (now - since) if now > since else 0.0

    def run(self) -> None:
        """Publishes the load until the replica stops, under its lease."""
        state = self._state
        key = balance.report_key(self._prefix, state.address)
        while True:
            with state.cond:
                if state.cond.wait_for(lambda: state.stopped, self._load.window / 5):
                    return
                lease = state.lease
            self._load.tick()
            usage = self._usage(self._cpu_rate()) if self._usage is not None else None
            report = balance.LoadReport.measure(state.address, self._load, usage)
            try:
                self._etcd.put(key, report.to_json(), lease)
            except EtcdError as e:
                log.info("cannot publish the load: %s", e)


class LoadBalancer:
    """Decides when this primary moves slots away for load. Used by the mover thread only.

    Args:
        etcd: the coordinator (the servers' load reports).
        prefix: the cluster's key prefix in etcd.
        load: this server's load meter (its window).
        policy: when to move (the threshold, how long, which measure).
        change_map: changes the cluster map (the move).
    """

    def __init__(
        self,
        etcd: Etcd,
        prefix: str,
        load: LoadMeter,
        policy: Policy,
        change_map: MapEditor,
    ) -> None:
        self._etcd = etcd
        self._prefix = prefix
        self._load = load
        self._policy = policy
        self._change_map = change_map
        # Since when (monotonic) and under which layout this primary's group has been the
        # most loaded beyond the threshold; None: it is not. Touched by the mover thread only.
        self._overloaded: tuple[float, Any] | None = None

    def plan(self, m: ClusterMap, group: Group) -> ClusterMap:
        """The map, with a move of slots away from this primary's group if it has been the
        most loaded beyond `policy.threshold` for `policy.after` seconds (and the ranges
        holding hot slots marked, for workers to spread their reads)."""
        policy = self._policy
        loads = self._slot_loads(m)
        if loads is None:  # a primary without a full window yet
            self._overloaded = None
            return m
        ratio, busiest = balance.imbalance(m, loads)
        if busiest != group.id or ratio <= policy.threshold:
            self._overloaded = None
            return m
        layout = [(r.id, r.slots, r.group) for r in m.ranges]
        if self._overloaded is None or self._overloaded[1] != layout:
            self._overloaded = (time.monotonic(), layout)
            return m
        if time.monotonic() - self._overloaded[0] < policy.after:
            return m
        self._overloaded = None
        hot = balance.hot_slots(m, loads, policy.threshold)
        hot_ranges = sorted({r.id for r in m.ranges for s in hot if r.slot_begin <= s < r.slot_end})

        def rebalance(current: ClusterMap) -> ClusterMap | None:
            if [(r.id, r.slots, r.group) for r in current.ranges] != layout:
                return None  # the ranges changed meanwhile: measure again
            new = balance.plan_move(current, loads, policy.threshold) or current.copy()
            new.hot = hot_ranges
            return new

        new = self._change_map(rebalance, as_primary=True)
        if new.move is not None:
            target = new.range(new.move.range)
            log.warning(
                "group %d carries %.2f times the mean %s/s: moving slots [%d, %d) of range %d "
                "to group %d", group.id, ratio, policy.measure, new.move.slot,
                target.slot_end if target else -1, new.move.range, new.move.to,
            )  # fmt: skip
        if hot:
            log.warning("hot slots %s carry more than %.2f times the mean %s/s each: no move "
                        "can balance them; ranges %s serve reads from every replica",
                        hot, policy.threshold, policy.measure, hot_ranges)  # fmt: skip
        return new

    def _slot_loads(self, m: ClusterMap) -> np.ndarray | None:
        """The slots' loads over every primary's recent report; None: a primary lacks one."""
        primaries = {g.primary for g in m.groups if g.primary}
        now, window = time.time(), self._load.window
        reports = [
            r
            for r in balance.read_reports(self._etcd, self._prefix)
            if r.address in primaries and now - r.time < window and r.seconds >= 0.8 * window
        ]
        if {r.address for r in reports} != primaries:
            return None
        return balance.slot_loads(reports, self._policy.measure, primaries)


class MemoryBalancer:
    """Moves slots off this primary's group when its tables pass `high_water` of their
    memory budget (`balance.plan_memory_move`), before the budget is reached. Used by the
    mover thread only.

    Args:
        etcd: the coordinator (the servers' reports and their usage).
        prefix: the cluster's key prefix in etcd.
        window: the load window: reports older than this are ignored.
        high_water: the share of the budget beyond which slots move away.
        change_map: changes the cluster map (the move).
    """

    # How often it says that no group has room, at most.
    FULL_LOG_SECONDS = 60.0

    def __init__(
        self, etcd: Etcd, prefix: str, window: float, high_water: float, change_map: MapEditor
    ) -> None:
        self._etcd = etcd
        self._prefix = prefix
        self._window = window
        self._high_water = high_water
        self._change_map = change_map
        self._said_full = -float("inf")  # monotonic time of the last "no room" line

    def plan(self, m: ClusterMap, group: Group) -> ClusterMap:
        """The map, with a move of slots off `group` if its memory passed the high-water
        mark and another group has room for them."""
        usages = self._usages(m)
        own = usages.get(group.id)
        if own is None or own.memory_ratio <= self._high_water:
            return m
        gid, high_water = group.id, self._high_water

        def relieve(current: ClusterMap) -> ClusterMap | None:
            return balance.plan_memory_move(current, usages, gid, high_water)

        new = self._change_map(relieve, as_primary=True)
        if new.move is not None and new.move.to != gid:
            log.warning(
                "group %d holds %.0f%% of its memory budget (%d of %d bytes; high-water "
                "mark %.0f%%): moving slots [%d, ...) of range %d to group %d",
                gid, 100 * own.memory_ratio, own.memory_bytes, own.memory_budget,
                100 * high_water, new.move.slot, new.move.range, new.move.to,
            )  # fmt: skip
        elif time.monotonic() - self._said_full >= self.FULL_LOG_SECONDS:
            self._said_full = time.monotonic()
            log.warning(
                "group %d holds %.0f%% of its memory budget (high-water mark %.0f%%) and no "
                "other group has room: add servers (elastic-emb cluster autoscale, or the "
                "Kubernetes autoscaler); at the budget, only the tables' admission and "
                "eviction policies bound their growth", gid, 100 * own.memory_ratio,
                100 * high_water,
            )  # fmt: skip
        return new

    def _usages(self, m: ClusterMap) -> dict[int, balance.Usage]:
        """Each group's usage, from its primary's recent report (groups without one left out)."""
        now = time.time()
        by_address = {
            r.address: r.usage
            for r in balance.read_reports(self._etcd, self._prefix)
            if now - r.time < self._window and r.usage.memory_budget
        }
        return {g.id: by_address[g.primary] for g in m.groups if g.primary in by_address}
