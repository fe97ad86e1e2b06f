"""Auto-scaling by load and memory: `elastic-emb cluster autoscale` and `cluster local
--autoscale MIN:MAX`.

`Autoscaler` reads what every server publishes to the coordinator (its keys
per second and its tables' bytes against its memory budget:
`balance.LoadReport`, `balance.Usage`), turns them into one ratio of load to
target, and adds or retires one replica group at a time through a
`Launcher`:

    ratio = max(keys/s of the cluster / (groups x target keys/s per group),
                tables' bytes / (budgets of the groups x memory target))

- ratio > 1 + tolerance, held for `sustain` seconds: start `replicas` servers
  (they form a new group, and half the largest slot range moves onto it);
- ratio x groups / (groups - 1) < 1 - tolerance (the groups left would still
  be below target), held as long: retire the group with the fewest rows (its
  ranges move to the others, it dissolves), then stop its servers;
- never below `min_servers` or above `max_servers`; after an action, nothing
  for `cooldown` seconds.

A group whose own memory passes the servers' high-water mark is relieved by
the servers themselves, moving slots to a group with room
(`serve --memory-high-water`); the cluster-wide memory term above adds a
group when no group has room left. At `max_servers` with the ratio still
above target, the controller says so in its log and its `at_max` metric;
the tables' admission and eviction policies are then what bounds their
growth. Every decision goes to the log and, with an audit log, to a
hash-chained record (who, what, why, the signal values).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from elastic_emb.ps.coord import membership
from elastic_emb.ps.coord.balance import read_reports
from elastic_emb.ps.coord.etcd import Etcd
from elastic_emb.ps.coord.membership import DEFAULT_PREFIX, ClusterMap

__all__ = [
    "Autoscaler", "Launcher", "ScalingPolicy", "Signals", "decide", "measure",
    "start_metrics_server",
]  # fmt: skip

log = logging.getLogger("elastic_emb.autoscale")


class Launcher(Protocol):
    """How the controller gets and gives back servers (local processes, a cloud's VMs, ...).

    `start_server` starts one `elastic-emb serve --coordinator ...` with the cluster's
    `--replicas` and returns its address once started (it registers and takes a place by
    itself). `stop_server` stops one the controller drained: it holds nothing.
    """

    def start_server(self) -> str: ...

    def stop_server(self, address: str) -> None: ...


@dataclasses.dataclass(frozen=True)
class ScalingPolicy:
    """When the controller adds or retires a group (`elastic-emb cluster autoscale` flags).

    Args:
        min_servers, max_servers: bounds, multiples of `replicas`.
        replicas: servers per group (the unit of scaling).
        target_keys: keys per second one group should serve (None: load is not a signal).
        memory_target: the share of the groups' memory budgets their tables should fill.
        tolerance: how far past the target the ratio must be before acting.
        sustain: seconds a decision must hold before it is carried out.
        cooldown: seconds after an action before the next.
    """

    min_servers: int
    max_servers: int
    replicas: int = 2
    target_keys: float | None = None
    memory_target: float = 0.7
    tolerance: float = 0.1
    sustain: float = 30.0
    cooldown: float = 60.0

    def __post_init__(self) -> None:
        r = self.replicas
        if r < 1 or not 0 < self.min_servers <= self.max_servers:
            raise ValueError(
                f"need 0 < min <= max servers and replicas >= 1. Received: min={self.min_servers}"
                f", max={self.max_servers}, replicas={r}"
            )
        if self.min_servers % r or self.max_servers % r:
            raise ValueError(
                f"min and max servers must be multiples of --replicas {r} (a group is the unit "
                f"of scaling). Received: {self.min_servers}:{self.max_servers}"
            )
        if self.target_keys is not None and self.target_keys <= 0:
            raise ValueError(f"the target keys/s must be positive. Received: {self.target_keys}")
        if not 0 < self.memory_target <= 1 or not 0 <= self.tolerance < 1:
            raise ValueError(
                "memory_target must be in (0, 1] and tolerance in [0, 1). Received: "
                f"{self.memory_target}, {self.tolerance}"
            )
        if self.sustain < 0 or self.cooldown < 0:
            raise ValueError("sustain and cooldown must be >= 0 seconds")

    @property
    def min_groups(self) -> int:
        return self.min_servers // self.replicas

    @property
    def max_groups(self) -> int:
        return self.max_servers // self.replicas


@dataclasses.dataclass(frozen=True)
class Signals:
    """The cluster's state as the controller sees it (read from etcd)."""

    groups: int  # complete groups not retiring
    busy: bool  # a move, a joining server, an incomplete or retiring group: wait
    keys: float  # keys/s the primaries served over their load window
    memory_bytes: int  # the tables' bytes, summed over primaries
    memory_budget: int  # the primaries' budgets, summed
    max_memory_ratio: float  # the fullest primary's tables over its budget
    rows: dict[int, int]  # rows of each complete group (its primary's)

    def ratio(self, policy: ScalingPolicy, groups: int | None = None) -> float:
        """Load over target with `groups` groups (default: as now)."""
        n = groups or self.groups
        if n <= 0:
            return math.inf
        load = self.keys / (n * policy.target_keys) if policy.target_keys else 0.0
        per_group_budget = self.memory_budget / max(self.groups, 1)
        memory = (
            self.memory_bytes / (n * per_group_budget * policy.memory_target)
            if per_group_budget
            else 0.0
        )
        return max(load, memory)

    def describe(self, policy: ScalingPolicy) -> dict[str, Any]:
        return {
            "groups": self.groups, "keys_per_second": round(self.keys, 1),
            "memory_bytes": self.memory_bytes, "memory_budget": self.memory_budget,
            "max_memory_ratio": round(self.max_memory_ratio, 4),
            "ratio": round(self.ratio(policy), 4),
        }  # fmt: skip


def measure(etcd: Any, prefix: str = DEFAULT_PREFIX, window: float = 60.0) -> Signals:
    """The signals now: the map, and each primary's latest report (newer than `window`)."""
    m = ClusterMap.read(etcd, prefix)
    now = time.time()
    reports = {r.address: r for r in read_reports(etcd, prefix) if now - r.time < window}
    complete = [g for g in m.groups if m.complete(g) and not g.retiring]
    busy = m.move is not None or len(complete) != len(m.groups) or not m.ready()
    usages = [reports[g.primary].usage for g in complete if g.primary in reports]
    return Signals(
        groups=len(complete),
        busy=busy or len(usages) != len(complete),
        keys=sum(u.keys for u in usages),
        memory_bytes=sum(u.memory_bytes for u in usages),
        memory_budget=sum(u.memory_budget for u in usages),
        max_memory_ratio=max((u.memory_ratio for u in usages), default=0.0),
        rows={g.id: reports[g.primary].usage.rows for g in complete if g.primary in reports},
    )


def decide(s: Signals, policy: ScalingPolicy) -> tuple[str | None, str]:
    """("add" | "retire" | None, why), from the signals alone."""
    ratio = s.ratio(policy)
    if s.groups < policy.min_groups:
        return "add", f"{s.groups} groups, below the minimum of {policy.min_groups}"
    if ratio > 1 + policy.tolerance:
        if s.groups >= policy.max_groups:
            return None, f"ratio {ratio:.2f} above target, but at the maximum of {s.groups} groups"
        return "add", f"ratio {ratio:.2f} > 1 + tolerance {policy.tolerance:g}"
    if s.groups > policy.min_groups and s.groups > 1:
        after = s.ratio(policy, s.groups - 1)
        if after < 1 - policy.tolerance:
            return "retire", (
                f"ratio {ratio:.2f}; with one group less {after:.2f} < 1 - tolerance "
                f"{policy.tolerance:g}"
            )
    return None, f"ratio {ratio:.2f} within target"


class Autoscaler:
    """The control loop: measures every `interval` seconds, acts on sustained decisions.

    Args:
        coordinator: etcd://HOST:PORT of the cluster.
        policy: the targets, bounds and timings.
        launcher: starts and stops servers.
        audit: records each decision (`elastic_emb.ps.server.audit.AuditLog`); None: log only.
        interval: seconds between measurements.
        timeout: seconds an action may take (new group serving, group drained).
    """

    def __init__(
        self,
        coordinator: str,
        policy: ScalingPolicy,
        launcher: Launcher,
        audit: Any = None,
        interval: float = 1.0,
        timeout: float = 600.0,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        self.coordinator, self.policy, self.launcher = coordinator, policy, launcher
        self.audit, self.interval, self.timeout, self.prefix = audit, interval, timeout, prefix
        self.who = f"autoscale@{socket.gethostname()}:{os.getpid()}"
        self.decisions: list[dict[str, Any]] = []  # each action taken, with its timings
        self.last: Signals | None = None
        self.at_max = False
        self._pending: tuple[str, float] | None = None  # (action, since when it holds)
        self._quiet_until = 0.0  # monotonic: the cooldown's end
        self._said_max = -math.inf
        self._stop = threading.Event()
        self._etcd = Etcd(coordinator)

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """Measures and acts until `stop`."""
        while not self._stop.wait(self.interval):
            try:
                self.step()
            except Exception as e:  # a lost etcd, a launcher error: try again
                log.warning("autoscale: %s: %s (trying again)", type(e).__name__, e)

    def step(self) -> str | None:
        """One measurement; carries out a decision held for `sustain`. The action taken."""
        s = self.last = measure(self._etcd, self.prefix, 6 * self.interval + 60)
        action, why = decide(s, self.policy)
        self._say_at_max(s)
        now = time.monotonic()
        if s.busy or now < self._quiet_until or action is None:
            self._pending = None if action is None else self._pending
            return None
        if self._pending is None or self._pending[0] != action:
            self._pending = (action, now)
            log.info("autoscale: %s wanted (%s); acting if it holds %.0f s", action, why,
                     self.policy.sustain)  # fmt: skip
        if now - self._pending[1] < self.policy.sustain:
            return None
        self._pending = None
        self._act(action, why, s)
        self._quiet_until = time.monotonic() + self.policy.cooldown
        return action

    def _say_at_max(self, s: Signals) -> None:
        """`at_max`, and a log line a minute while it holds."""
        policy = self.policy
        self.at_max = s.groups >= policy.max_groups and s.ratio(policy) > 1 + policy.tolerance
        if self.at_max and time.monotonic() - self._said_max >= 60:
            self._said_max = time.monotonic()
            log.warning(
                "autoscale: at its maximum of %d servers with load at %.2f of target (fullest "
                "server at %.0f%% of its memory budget): no server will be added; the tables' "
                "admission and eviction policies are what bounds their growth now",
                self.policy.max_servers, s.ratio(self.policy), 100 * s.max_memory_ratio,
            )  # fmt: skip

    def _act(self, action: str, why: str, s: Signals) -> None:
        signals = s.describe(self.policy)
        record: dict[str, Any] = {"action": action, "why": why, "signals": signals}
        log.warning("autoscale: %s a group: %s; signals %s", action, why, signals)
        self._audit(f"autoscale.{action}", record, "decided")
        began = time.monotonic()
        try:
            servers = self._add() if action == "add" else self._retire(s)
        except Exception as e:
            self._audit(f"autoscale.{action}", record, f"failed: {e}")
            raise
        record.update(servers=servers, seconds=round(time.monotonic() - began, 3))
        self.decisions.append(record)
        log.warning("autoscale: %s done in %.1f s: servers %s", action, record["seconds"],
                    servers)  # fmt: skip
        self._audit(f"autoscale.{action}", record, "done")

    def _audit(self, call: str, record: dict[str, Any], result: str) -> None:
        if self.audit is not None:
            self.audit.record(call, self.who, self.who, record, result)

    def _add(self) -> list[str]:
        """Starts a group's servers; returns once its group is complete and holds slots."""
        started = [self.launcher.start_server() for _ in range(self.policy.replicas)]

        def serving() -> bool:  # (a spare left from before may have taken a place too)
            m = ClusterMap.read(self._etcd, self.prefix)
            groups = [m.group_of(a) for a in started]
            return m.move is None and any(
                g is not None and m.complete(g) and bool(m.ranges_of(g.id)) for g in groups
            )

        self._wait(serving, f"the new group of {started} holds slots")
        return started

    def _retire(self, s: Signals) -> list[str]:
        """Retires the group with the fewest rows; stops its servers once it dissolved."""
        m = ClusterMap.read(self._etcd, self.prefix)
        candidates = [g for g in m.groups if g.id in s.rows and not g.retiring]
        group = min(candidates, key=lambda g: (s.rows[g.id], -g.id))
        servers = list(group.replicas)

        def retire(current: ClusterMap) -> ClusterMap:
            for address in servers:  # draining: placed nowhere once the group dissolved
                current = current.drain(address)
            return current.retire(group.id)

        def dissolved() -> bool:
            m = ClusterMap.read(self._etcd, self.prefix)
            return all(m.group_of(address) is None for address in servers)

        membership.update(self._etcd, self.prefix, retire)
        self._wait(dissolved, f"group {group.id} gives its slots away")
        for address in servers:
            self.launcher.stop_server(address)
        membership.update(self._etcd, self.prefix, lambda current: _forget(current, servers))
        return servers

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not done():
            if time.monotonic() > deadline or self._stop.is_set():
                raise TimeoutError(f"not within {self.timeout:g} s: {what}")
            time.sleep(0.1)


def _forget(m: ClusterMap, addresses: list[str]) -> ClusterMap | None:
    """Stopped servers are no longer draining (their addresses may serve again)."""
    if not any(a in m.draining for a in addresses):
        return None
    new = m.copy()
    new.draining = [a for a in new.draining if a not in addresses]
    return new


def start_metrics_server(scaler: Autoscaler, host: str, port: int) -> Any:
    """Serves the controller's metrics at http://host:port/metrics (0: any free port) in a
    daemon thread; returns the HTTP server (`server_port`)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client import start_http_server as start
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class Collector:
        def collect(self) -> Any:
            s, policy = scaler.last, scaler.policy
            gauges = {
                "autoscale_groups": ("Complete replica groups", s.groups if s else 0),
                "autoscale_ratio": ("Load over target (the larger of keys/s and memory)",
                                    s.ratio(policy) if s else 0.0),
                "autoscale_at_max": ("1 while the load is above target at the most servers",
                                     int(scaler.at_max)),
            }  # fmt: skip
            for name, (what, value) in gauges.items():
                gauge = GaugeMetricFamily("elastic_emb_" + name, what)
                gauge.add_metric([], value)
                yield gauge
            actions = CounterMetricFamily(
                "elastic_emb_autoscale_actions", "Groups added and retired", labels=["action"]
            )
            for action in ("add", "retire"):
                actions.add_metric([action], sum(d["action"] == action for d in scaler.decisions))
            yield actions

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    server, _ = start(port, addr=host, registry=registry)
    return server
