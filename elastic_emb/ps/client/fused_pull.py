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
from elastic_emb.tables.sharding import RangeLayout

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
        split: list[list[np.ndarray]] = []  # per table, per shard: positions in its keys

        def make(layout: RangeLayout) -> list[Any]:
            split[:] = [layout.split(keys) for _, _, keys in asked]
            return self._requests(len(layout.ids), asked, split, plans, insert, step)

        start = time.perf_counter()
        _, responses = self._router.per_range("Pull", make, again_if_changed=False)
        self._timings.add("pull", time.perf_counter() - start)
        out, versions, unchanged = _answered_rows(responses, asked, split)
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

    def _requests(
        self,
        num_shards: int,
        asked: Tables,
        split: list[list[np.ndarray]],
        plans: list[Any],
        insert: bool,
        step: int,
    ) -> list[Any]:
        """Each shard's PullRequest for its keys of `asked` (None: it has none)."""
        requests: list[Any] = []
        for shard in range(num_shards):
            mine = [i for i in range(len(asked)) if len(split[i][shard])]
            entries = [(asked[i][0], asked[i][2][split[i][shard]]) for i in mine]
            held = [plans[i][2][split[i][shard]] for i in mine] if plans else None
            if not entries:
                requests.append(None)
                continue
            request = protocol.pull_request(
                self._worker_index, step, insert, self._encoding, self._timeout, entries, held
            )
            requests.append(request)
        return requests


def _answered_rows(
    responses: list[Any], asked: Tables, split: list[list[np.ndarray]]
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """The shards' answers per table of `asked`: (rows, versions, unchanged); a row the
    shard left out as unchanged since the version held is marked in `unchanged` only."""
    out = [np.empty((len(keys), dim), np.float32) for _, dim, keys in asked]
    versions = [np.zeros(len(keys), np.uint32) for _, _, keys in asked]
    unchanged = [np.zeros(len(keys), bool) for _, _, keys in asked]
    for shard, response in enumerate(responses):
        if response is None:
            continue
        mine = [i for i in range(len(asked)) if len(split[i][shard])]
        shapes = [(asked[i][0], len(split[i][shard]), asked[i][1]) for i in mine]
        for i, (rows, now, same) in zip(mine, protocol.pulled_rows(response, shapes), strict=True):
            at = split[i][shard]
            if same is None or now is None:
                out[i][at] = rows
                continue
            out[i][at[~same]] = rows
            versions[i][at[~same]] = now
            unchanged[i][at] = same
    return out, versions, unchanged
