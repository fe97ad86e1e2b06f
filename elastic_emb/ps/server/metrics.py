"""Prometheus metrics of a PS server (`elastic-emb serve --metrics-port PORT`).

A collector reads the server's state when Prometheus scrapes `/metrics`;
nothing is counted twice. The metrics (names start with `elastic_emb_`) are
listed in docs/operations.md.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from elastic_emb.ps.server.resources import cpu_seconds
from elastic_emb.ps.server.servicer import LATENCY_BUCKETS, Servicer

__all__ = ["ServerCollector", "start_metrics_server"]

PREFIX = "elastic_emb_"


class ServerCollector(Collector):
    """The metrics of one server's `Servicer`, read at each scrape."""

    def __init__(self, servicer: Servicer) -> None:
        self._servicer = servicer

    def collect(self) -> Iterator[Metric]:
        yield from self._rpcs()
        yield from self._tables()
        yield from self._steps()
        yield from self._resources()

    def _rpcs(self) -> Iterator[Metric]:
        stats = self._servicer.method_stats()
        calls = CounterMetricFamily(PREFIX + "rpc_calls", "RPCs answered", labels=["method"])
        errors = CounterMetricFamily(
            PREFIX + "rpc_errors", "RPCs that failed, by status code", labels=["method", "code"]
        )
        received = CounterMetricFamily(
            PREFIX + "rpc_received_bytes", "Request message bytes", labels=["method"]
        )
        sent = CounterMetricFamily(
            PREFIX + "rpc_sent_bytes", "Response message bytes", labels=["method"]
        )
        seconds = HistogramMetricFamily(
            PREFIX + "rpc_seconds", "Time to answer an RPC", labels=["method"]
        )
        for method, m in sorted(stats.items()):
            calls.add_metric([method], m.calls)
            for code, n in sorted(m.codes.items()):
                errors.add_metric([method, code], n)
            received.add_metric([method], m.request_bytes)
            sent.add_metric([method], m.response_bytes)
            cumulative, buckets = 0, []
            for bound, n in zip([*LATENCY_BUCKETS, float("inf")], m.latency, strict=True):
                cumulative += n
                buckets.append((_bound(bound), cumulative))
            seconds.add_metric([method], buckets, m.seconds)
        native = CounterMetricFamily(
            PREFIX + "data_plane_native_calls",
            "Of rpc_calls, those the data plane answered in C++ (the rest went through Python)",
            labels=["method"],
        )
        for method, counts in sorted(self._servicer.ranges.native.counts().items()):
            native.add_metric([method], counts["calls"])
        changes = CounterMetricFamily(
            PREFIX + "changes_applied", "Requests that changed a slot range"
        )
        changes.add_metric([], self._servicer.changes)
        pull_waits, pull_wait_seconds = self._servicer.pull_waits()
        waits = CounterMetricFamily(
            PREFIX + "pull_waits", "Pulls that waited for other workers' pushes"
        )
        waits.add_metric([], pull_waits)
        waited = CounterMetricFamily(
            PREFIX + "pull_wait_seconds", "Seconds pulls waited for other workers' pushes"
        )
        waited.add_metric([], pull_wait_seconds)
        yield from (calls, errors, received, sent, seconds, native, changes, waits, waited)
        plane = self._servicer.data_plane_counters
        if plane is not None:
            overloaded = CounterMetricFamily(
                PREFIX + "data_plane_overloaded",
                "Requests the data plane refused as overloaded (RESOURCE_EXHAUSTED, a retry "
                "hint; not in rpc_calls)",
            )
            overloaded.add_metric([], plane()["refused_overloaded"])
            yield overloaded

    def _tables(self) -> Iterator[Metric]:
        rows = GaugeMetricFamily(PREFIX + "table_rows", "Rows on this server", labels=["table"])
        memory = GaugeMetricFamily(
            PREFIX + "table_memory_bytes", "Bytes of the table on this server", labels=["table"]
        )
        counters = {
            "pushes": ("Pushes applied (the table's step count)", lambda t: t.iterations),
            "nonfinite_pushes": ("Pushes skipped for NaN or Inf", lambda t: t.nonfinite_pushes),
            "evicted_rows": ("Rows evicted", lambda t: t.policy_counts()["evicted_rows"]),
            "admitted_keys": ("Ids admitted", lambda t: t.policy_counts()["admitted_keys"]),
            "rejected_updates": (
                "Pushes of an id dropped by admission",
                lambda t: t.policy_counts()["rejected_updates"],
            ),
        }
        # A table may have a part in several slot ranges of this server: sum
        # them (the step count: the highest).
        totals: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for table in self._servicer.ranges.tables():
            total = totals[table.name]
            total["rows"] += len(table)
            total["memory"] += table.memory_bytes()
            for name, (_, read) in counters.items():
                value = int(read(table))
                total[name] = max(total[name], value) if name == "pushes" else total[name] + value
        families = {
            name: CounterMetricFamily(PREFIX + f"table_{name}", what, labels=["table"])
            for name, (what, _) in counters.items()
        }
        for name, total in sorted(totals.items()):
            rows.add_metric([name], total["rows"])
            memory.add_metric([name], total["memory"])
            for counter, family in families.items():
                family.add_metric([name], total[counter])
        yield from (rows, memory, *families.values())

    def _steps(self) -> Iterator[Metric]:
        step = GaugeMetricFamily(PREFIX + "range_step", "The slot range's step", labels=["range"])
        worker = GaugeMetricFamily(
            PREFIX + "worker_step", "A worker's last pushed step", labels=["range", "worker"]
        )
        lag = GaugeMetricFamily(
            PREFIX + "worker_lag_steps",
            "How many steps a worker is behind its range's step",
            labels=["range", "worker"],
        )
        for range_id, shard in self._servicer.ranges.items():
            current = shard.step()
            step.add_metric([str(range_id)], current)
            for w, pushed in sorted(shard.worker_steps().items()):
                worker.add_metric([str(range_id), str(w)], pushed)
                lag.add_metric([str(range_id), str(w)], max(current - pushed, 0))
        yield from (step, worker, lag)
        replica = self._servicer.replica
        if replica is not None:
            role, group, _, sequence = replica.status()
            seq = GaugeMetricFamily(
                PREFIX + "replica_sequence",
                "The last replicated change applied",
                labels=["role", "group"],
            )
            seq.add_metric([role, str(group)], sequence)
            yield seq

    def _resources(self) -> Iterator[Metric]:
        """What scaling decisions read (docs/autoscaling.md)."""
        usage = self._servicer.usage()
        gauges = {
            "memory_budget_bytes": ("Bytes the tables may take (serve --memory-budget)",
                                    usage.memory_budget),
            "memory_used_bytes": ("Bytes the live rows of the tables take on this server",
                                  usage.memory_bytes),
            "memory_budget_ratio": ("The tables' bytes over the memory budget",
                                    usage.memory_ratio),
            "resident_memory_bytes": ("Resident memory of the server process",
                                      usage.resident_bytes),
            "rows": ("Rows of every table on this server", usage.rows),
            "keys_per_second": ("Keys pulled and pushed per second over the load window "
                                "(serve --load-window; with --coordinator)", usage.keys),
        }  # fmt: skip
        for name, (what, value) in gauges.items():
            gauge = GaugeMetricFamily(PREFIX + name, what)
            gauge.add_metric([], value)
            yield gauge
        cpu = CounterMetricFamily(PREFIX + "cpu_seconds", "CPU seconds of the server process")
        cpu.add_metric([], cpu_seconds())
        yield cpu


def _bound(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


def start_metrics_server(
    servicer: Servicer,
    host: str,
    port: int,
    certfile: str | None = None,
    keyfile: str | None = None,
) -> Any:
    """Serves `/metrics` for `servicer` on host:port (0: any free port) in a daemon
    thread, over HTTPS with a certificate and key, else HTTP; returns the HTTP server
    (its `server_port` is the bound port)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(servicer))
    server, _ = start_http_server(
        port, addr=host, registry=registry, certfile=certfile, keyfile=keyfile
    )
    return server
