"""`FusedPull`: the rows of many tables as of a step, in one Pull per shard. With a
`RowCache` the cache serves the rows it may without asking, the request tells each shard
the versions of the other rows the cache holds so that it sends only rows that changed,
and the cache fills in the rest and keeps what came back."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from elastic_emb import _core
from elastic_emb.ps.client.range_router import RangeRouter
from elastic_emb.ps.client.round_timings import RoundTimings
from elastic_emb.ps.client.row_cache import RowCache
from elastic_emb.ps.wire import protocol
from elastic_emb.tables.sharding import NUM_SLOTS, RangeLayout

__all__ = ["FusedPull", "Tables", "one_entry_per_table"]

# [(table, dim, keys)]: the tables of one pull, in submission order.
Tables = list[tuple[str, int, np.ndarray]]


def one_entry_per_table(tables: Tables) -> tuple[Tables, list[tuple[int, np.ndarray | None]]]:
    """`tables` with the lookups of one table (several features or layers) merged into one
    entry of their distinct keys, and for each lookup where its rows are: (the entry, the
    positions of its keys among the entry's rows, or None when it has the entry alone)."""
    entries: dict[str, list[int]] = {}
    for i, (name, _, _) in enumerate(tables):
        entries.setdefault(name, []).append(i)
    if len(entries) == len(tables):
        return tables, [(i, None) for i in range(len(tables))]
    merged: Tables = []
    picks: list[tuple[int, np.ndarray | None]] = [(0, None)] * len(tables)
    for name, lookups in entries.items():
        dim = tables[lookups[0]][1]
        if len(lookups) == 1:
            picks[lookups[0]] = (len(merged), None)
            merged.append(tables[lookups[0]])
            continue
        keys = [tables[i][2] for i in lookups]
        distinct, positions = _core.unique_keys(np.concatenate(keys))
        ends = np.cumsum([len(k) for k in keys])
        for i, part in zip(lookups, np.split(positions, ends[:-1]), strict=True):
            picks[i] = (len(merged), part)
        merged.append((name, dim, distinct))
    return merged, picks


class FusedPull:
    """A worker's pulls of many tables at once. Thread-safe (no state of its own).

    Args:
        router: the shards' ranges and servers.
        worker_index: this worker's index (in each request).
        encoding: the wire encoding of rows (`protocol.encoding`).
        timeout: seconds a shard may hold a pull for other workers.
        cache: the worker's row cache, or None.
        timings: counts each pull round.
    """

    def __init__(
        self,
        router: RangeRouter,
        worker_index: int,
        encoding: Any,
        timeout: float,
        cache: RowCache | None,
        timings: RoundTimings,
    ) -> None:
        # Read-only after construction (`cache` and `timings` are thread-safe themselves).
        self._router = router
        self._worker_index = worker_index
        self._encoding = encoding
        self._timeout = timeout
        self._cache = cache
        self._timings = timings

    def pull(self, tables: Tables, insert: bool, step: int) -> list[np.ndarray]:
        """The rows of `tables` for training step `step`: [(name, dim, keys)] -> [rows]."""
        cache = self._cache
        # With a cache: the keys it serves, and for the others the versions it holds.
        plans = []
        if cache is not None:
            plans = [cache.plan(name, dim, keys, step) for name, dim, keys in tables]
        asked = (
            [(n, d, k[~p[0]]) for (n, d, k), p in zip(tables, plans, strict=True)]
            if cache is not None
            else tables
        )
        pulls: list[Any] = []  # the C++ plan of the requests made last (`_core.PullPlan`)

        def make(layout: RangeLayout) -> list[Any]:
            pulls[:] = [_core.PullPlan(*_columns(asked), layout.starts(), NUM_SLOTS)]
            held = [np.ascontiguousarray(p[2], np.uint32) for p in plans] if plans else None
            timeout_ms = int(self._timeout * 1000)
            requests = pulls[0].requests(
                self._worker_index, step, insert, self._encoding, timeout_ms, held
            )
            return [None if r is None else protocol.Encoded(r, insert) for r in requests]

        start = time.perf_counter()
        _, responses = self._router.per_range("Pull", make, again_if_changed=False)
        self._timings.add("pull", time.perf_counter() - start)
        out, versions, unchanged = pulls[0].rows(responses)
        if cache is None or not plans:
            return out
        whole = []
        for i, ((name, dim, keys), (served, served_rows, _, held_rows)) in enumerate(
            zip(tables, plans, strict=True)
        ):
            rows = np.empty((len(keys), dim), np.float32)
            rows[served] = served_rows
            rows[~served] = cache.answer(
                name, asked[i][2], out[i], versions[i], unchanged[i], held_rows, step
            )
            whole.append(rows)
        cache.fit(step)
        return whole


def _columns(tables: Tables) -> tuple[list[str], list[np.ndarray], list[int]]:
    """(names, keys, dims) of `tables`."""
    return (
        [name for name, _, _ in tables],
        [np.ascontiguousarray(keys, np.int64) for _, _, keys in tables],
        [dim for _, dim, _ in tables],
    )
