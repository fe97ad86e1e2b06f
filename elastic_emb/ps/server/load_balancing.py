"""Balancing slots by load (`elastic_emb.ps.coord.balance`): `LoadReporter` publishes this
server's per-slot load to the coordinator under its lease, and `LoadBalancer` plans, for a
primary whose group has been the most loaded beyond a policy's threshold for long enough,
a move of slots away (and marks the ranges of hot slots, for workers to spread reads)."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from elastic_emb.ps.coord import balance
from elastic_emb.ps.coord.balance import LoadMeter, Policy
from elastic_emb.ps.coord.etcd import Etcd, EtcdError
from elastic_emb.ps.coord.membership import ClusterMap, Group
from elastic_emb.ps.server.replica_state import MapEditor, ReplicaState

__all__ = ["LoadBalancer", "LoadReporter"]

log = logging.getLogger("elastic_emb.server")


class LoadReporter:
    """Publishes the server's load every fifth of the meter's window (`run`, a thread)."""

    def __init__(self, state: ReplicaState, etcd: Etcd, prefix: str, load: LoadMeter) -> None:
        self._state = state
        self._etcd = etcd
        self._prefix = prefix
        self._load = load

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
            report = balance.LoadReport.measure(state.address, self._load)
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
