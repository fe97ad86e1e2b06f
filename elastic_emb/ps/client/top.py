"""`elastic-emb top ADDR...`: a live view of PS servers (rows, memory, QPS, latency, steps).

Each refresh reads every server's `Stats` and `Health` twice, `interval`
seconds apart, and shows what happened in between: calls per second, the
mean latency of pulls and pushes, bytes per second each way, errors, next
to the server's rows, memory, step and role.
"""

from __future__ import annotations

import time
from typing import Any

import grpc

from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.ps.wire.security import GRPC_OPTIONS, ClientSecurity, channel

__all__ = ["render", "sample", "snapshot"]


def snapshot(
    address: str, timeout: float, security: ClientSecurity | None = None
) -> dict[str, Any]:
    """One server's counters now: `Stats` and `Health`, or {"error": ...}."""
    with channel(address, GRPC_OPTIONS, security) as chan:
        stub = ps_pb2_grpc.ParameterServerStub(chan)
        try:
            stats = stub.Stats(ps_pb2.StatsRequest(), timeout=timeout)
            health = stub.Health(ps_pb2.HealthRequest(), timeout=timeout)
        except grpc.RpcError as e:
            return {"address": address, "error": f"{e.code().name}: {e.details()}"}
    return {
        "address": address,
        "time": time.monotonic(),
        "role": health.role or "shard",
        "step": int(stats.step),
        "tables": len(stats.tables),
        "rows": sum(int(t.rows) for t in stats.tables),
        "memory_bytes": sum(int(t.memory_bytes) for t in stats.tables),
        "methods": {m.method: _counts(m) for m in stats.methods},
    }


def _counts(m: Any) -> tuple[int, int, float, int, int]:
    """(calls, errors, seconds, request bytes, response bytes) of a `MethodStats`."""
    return (
        int(m.calls),
        int(m.errors),
        float(m.seconds),
        int(m.request_bytes),
        int(m.response_bytes),
    )


def sample(
    addresses: list[str],
    interval: float,
    timeout: float = 5.0,
    security: ClientSecurity | None = None,
) -> list[dict[str, Any]]:
    """Each server's state and its rates over `interval` seconds (JSON-ready)."""
    before = [snapshot(a, timeout, security) for a in addresses]
    time.sleep(interval)
    after = [snapshot(a, timeout, security) for a in addresses]
    return [_rates(b, a) for b, a in zip(before, after, strict=True)]


def _rates(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    if "error" in after or "error" in before:
        return {"address": after["address"], "error": after.get("error", before.get("error"))}
    seconds = max(after["time"] - before["time"], 1e-9)
    delta = {
        method: [x - y for x, y in zip(now, before["methods"].get(method, (0,) * 5), strict=True)]
        for method, now in after["methods"].items()
        if method not in ("Stats", "Health")  # this view's own calls
    }

    def mean_ms(method: str) -> float | None:
        """Over the calls of `method` and of its per-server batches (`PullRanges`, ...)."""
        calls = secs = 0.0
        for name in (method, f"{method}Ranges"):
            n, _, s, _, _ = delta.get(name, (0, 0, 0.0, 0, 0))
            calls, secs = calls + n, secs + s
        return None if calls == 0 else 1000.0 * secs / calls

    out = {k: after[k] for k in ("address", "role", "step", "tables", "rows", "memory_bytes")}
    out.update(
        {
            "calls_per_s": sum(d[0] for d in delta.values()) / seconds,
            "errors_per_s": sum(d[1] for d in delta.values()) / seconds,
            "pull_ms": mean_ms("Pull"),
            "push_ms": mean_ms("Push"),
            "received_bytes_per_s": sum(d[3] for d in delta.values()) / seconds,
            "sent_bytes_per_s": sum(d[4] for d in delta.values()) / seconds,
            "interval_s": seconds,
        }
    )
    return out


def render(rows: list[dict[str, Any]]) -> str:
    """`sample`'s rows as a fixed-width table for a terminal."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    lines = [
        f"{'server':22} {'role':8} {'step':>8} {'rows':>13} {'MiB':>8} {'calls/s':>9} "
        f"{'pull ms':>8} {'push ms':>8} {'in MiB/s':>9} {'out MiB/s':>9} {'err/s':>6}"
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['address']:22} unreachable: {r['error']}")
            continue
        lines.append(
            f"{r['address']:22} {r['role']:8} {r['step']:>8} {r['rows']:>13,} "
            f"{r['memory_bytes'] / 2**20:>8.1f} {r['calls_per_s']:>9.1f} {ms(r['pull_ms']):>8} "
            f"{ms(r['push_ms']):>8} {r['received_bytes_per_s'] / 2**20:>9.2f} "
            f"{r['sent_bytes_per_s'] / 2**20:>9.2f} {r['errors_per_s']:>6.1f}"
        )
    return "\n".join(lines)
