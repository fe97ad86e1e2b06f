"""`ShardAdmin`: the calls that manage the tables on every shard rather than train them:
create and describe tables, the shards' stats, save and restore checkpoints, and calls
made per shard or per key range. Each call that reads or writes rows first waits until
this worker's pushes have landed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from elastic_emb._proto import ps_pb2
from elastic_emb.ps.client.range_router import RangeRouter
from elastic_emb.ps.client.row_cache import RowCache
from elastic_emb.ps.wire import protocol
from elastic_emb.tables.sharding import RangeLayout

__all__ = ["CHECKPOINT_TIMEOUT", "ShardAdmin"]

# Shards write and read whole tables: allow them hours, not the step timeout.
CHECKPOINT_TIMEOUT = 6 * 3600.0


class ShardAdmin:
    """Table and checkpoint calls to every shard. Thread-safe (no state of its own).

    Args:
        router: the shards' ranges and servers.
        flush: sends this worker's pending pushes and waits for them.
        cache: the worker's row cache (cleared by a restore), or None.
    """

    def __init__(
        self, router: RangeRouter, flush: Callable[[], None], cache: RowCache | None
    ) -> None:
        # Read-only after construction (`cache` is thread-safe itself).
        self._router = router
        self._flush = flush
        self._cache = cache

    def create_tables(self, configs: list[dict[str, Any]]) -> list[Any]:
        """Creates the tables on every shard (or checks they exist alike); their TableInfo."""
        request = protocol.create_tables_request(configs)
        return list(self._router.broadcast("CreateTables", request)[0].tables)

    def describe(self, name: str) -> list[Any]:
        """The table's TableInfo on each shard."""
        request = ps_pb2.DescribeTablesRequest(names=[name])
        return [r.tables[0] for r in self._router.broadcast("DescribeTables", request)]

    def server_stats(self) -> list[Any]:
        """Each shard's StatsResponse (with a coordinator: the server of each slot range)."""
        return self._router.broadcast("Stats", ps_pb2.StatsRequest())

    def save_tables(
        self,
        directories: list[str],
        names: list[str],
        incremental: bool,
        max_deltas: int,
        after: int,
    ) -> list[Any]:
        """Each shard i writes its rows of the named tables to `directories[i]`, once it has
        applied step `after` (0: at once); each shard's SaveResponse."""

        def make(layout: RangeLayout) -> list[Any]:
            if len(layout.ids) != len(directories):
                raise RuntimeError("the cluster's slot ranges changed during the save: save again")
            return [
                protocol.save_request(d, names, incremental, max_deltas, after, slots)
                for d, slots in zip(directories, layout.slots, strict=True)
            ]

        self._flush()
        return self._router.per_range("Save", make, CHECKPOINT_TIMEOUT, again_if_changed=False)[1]

    def slot_ranges(self) -> list[tuple[int, int]]:
        """The slots [begin, end) each shard owns."""
        return list(self._router.layout().slots)

    def restore_tables(self, directory: str, names: list[str]) -> None:
        """Each shard loads the rows it owns of the named tables from a checkpoint."""
        self._flush()
        if self._cache is not None:  # restored rows may carry the versions of cached ones
            self._cache.clear()
        self._router.per_range(
            "Restore",
            lambda layout: [protocol.restore_request(directory, names, s) for s in layout.slots],
            timeout=CHECKPOINT_TIMEOUT,
        )

    def per_shard(self, method: str, make: Any, timeout: float | None = None) -> list[Any]:
        """`make(i)`'s request to every shard i, after this worker's pushes have landed."""
        self._flush()
        return self._router.per_range(
            method, lambda layout: [make(i) for i in range(len(layout.ids))], timeout
        )[1]

    def by_range(self, method: str, keys: np.ndarray, make: Any) -> tuple[list[Any], list[Any]]:
        """`make(positions)`'s request to every shard, for its keys at `positions` of `keys`;
        (positions per shard, responses), after this worker's pushes have landed."""
        self._flush()
        split: list[Any] = []

        def requests(layout: RangeLayout) -> list[Any]:
            split[:] = layout.split(keys)
            return [make(positions) for positions in split]

        return split, self._router.per_range(method, requests)[1]
