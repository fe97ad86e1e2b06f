"""`RemoteTable`: a table whose rows live on the PS shards of a `Cluster`."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from elastic_emb import _core
from elastic_emb._proto import ps_pb2
from elastic_emb.ps.client.cluster import Cluster
from elastic_emb.ps.wire import protocol
from elastic_emb.tables.table import (
    POLICY_COUNTS,
    StepFusion,
    Table,
    TableConfig,
    TableState,
    check_keys,
    check_rows,
)

__all__ = ["RemoteTable"]


class RemoteTable(Table):
    """A table whose rows live on the PS shards of `ee.init`; the `Table` interface.

    Created by `ee.Table(...)` (and `ee.Embedding`) once a cluster is
    configured. Its rows, optimizer slots and step count are on the shards
    (created there, or found there with the same configuration). Thread-safe;
    every method blocks for the network, after this worker's queued pushes.

    Args:
        config: the table's `TableConfig`.
        cluster: the `Cluster` of `ee.init`.

    Raises:
        ValueError: a table of that name exists on the shards with another
            configuration.
    """

    device = "cpu"  # the shards' CPUs

    def __init__(self, config: TableConfig, cluster: Cluster) -> None:
        self._config = config
        self.cluster = cluster
        self._num_slots = int(cluster.create_tables([self.config()])[0].num_slots)
        self._fusion = _RemoteStep(cluster, config.name, config.dim)

    @property
    def iterations(self) -> int:
        return max(int(i.iterations) for i in self.cluster.describe(self.name))

    @property
    def num_slots(self) -> int:
        return self._num_slots

    def pull(self, keys: Any, train: bool = True) -> np.ndarray:
        k = check_keys(keys)
        unique, inverse = np.unique(k, return_inverse=True)
        (rows,) = self.cluster.pull([(self.name, self.dim, unique)], bool(train))
        return rows[inverse.reshape(-1)]

    def push(self, keys: Any, grads: Any) -> None:
        k = check_keys(keys)
        g = check_rows(grads, "grads", k.shape[0], self.dim)
        self.cluster.push({self.name: (self.dim, k, g)})

    def _by_shard(self, method: str, keys: np.ndarray, make: Any) -> tuple[list[Any], list[Any]]:
        """Calls `method` on every shard with `make(its keys)`; (positions, responses)."""
        return self.cluster.by_range(method, keys, lambda positions: make(keys[positions]))

    def import_rows(self, keys: Any, values: Any) -> None:
        k = check_keys(keys)
        v = check_rows(values, "values", k.shape[0], self.dim)
        self.cluster.by_range(
            "ImportRows", k, lambda at: protocol.import_rows_request(self.name, k[at], v[at])
        )

    def erase(self, keys: Any) -> int:
        _, responses = self._by_shard(
            "EraseRows",
            check_keys(keys),
            lambda k: protocol.keys_request(ps_pb2.EraseRowsRequest, self.name, k),
        )
        return sum(int(r.erased) for r in responses)

    def metadata(self, keys: Any) -> tuple[np.ndarray, np.ndarray]:
        k = check_keys(keys)
        split, responses = self._by_shard(
            "Metadata",
            k,
            lambda part: protocol.keys_request(ps_pb2.MetadataRequest, self.name, part),
        )
        last_step = np.empty(len(k), np.int64)
        update_count = np.empty(len(k), np.int64)
        for positions, r in zip(split, responses, strict=True):
            last_step[positions], update_count[positions] = protocol.metadata_arrays(
                r, len(positions)
            )
        return last_step, update_count

    def memory_bytes(self) -> int:
        return sum(int(i.memory_bytes) for i in self.cluster.describe(self.name))

    @property
    def nonfinite_pushes(self) -> int:
        """Pushes the shards skipped for non-finite gradients (`nonfinite="skip"`)."""
        return sum(int(i.nonfinite_pushes) for i in self.cluster.describe(self.name))

    def policy_counts(self) -> dict[str, int]:
        """What admission and eviction did on the shards so far (summed)."""
        infos = self.cluster.describe(self.name)
        return {k: sum(int(getattr(i, k)) for i in infos) for k in POLICY_COUNTS}

    def __len__(self) -> int:
        return sum(int(i.rows) for i in self.cluster.describe(self.name))

    def export_state(self) -> TableState:
        responses = self.cluster.per_shard(
            "ExportRows", lambda i: ps_pb2.ExportRowsRequest(table=self.name, with_state=True)
        )
        return TableState.concatenate(
            [protocol.read_state(r, self.dim, self.num_slots) for r in responses]
        )

    def load_state(self, state: TableState) -> None:
        s = state.checked(self.dim, self.num_slots)
        if self.cluster.cache is not None:  # loaded rows may carry cached rows' versions
            self.cluster.cache.clear()
        self.cluster.by_range(
            "ImportRows",
            s.keys,
            lambda at: protocol.write_state(
                ps_pb2.ImportRowsRequest(table=self.name, replace=True), s.select(at)
            ),
        )

    def step_fusion(self) -> StepFusion:
        return self._fusion


class _RemoteStep(StepFusion):
    """The layers' lookup of a remote table: the cluster fuses every table of a step.

    Only distinct ids cross the network: a submission sends them, and the
    rows come back expanded to the layer's ids; a gradient is summed per id
    before it is sent.
    """

    two_phase = True

    def __init__(self, cluster: Cluster, name: str, dim: int) -> None:
        self._cluster, self._name, self._dim = cluster, name, dim
        self._lock = threading.Lock()  # guards _positions
        self._positions: dict[int, np.ndarray] = {}  # ticket -> each id's row among the distinct

    def lookup(self, keys: np.ndarray, insert: bool, expects_push: bool) -> np.ndarray:
        return self.collect(self.submit(keys, insert, expects_push))

    def submit(self, keys: np.ndarray, insert: bool, expects_push: bool) -> int:
        distinct, positions = _core.unique_keys(check_keys(keys))
        ticket = self._cluster.submit(self._name, self._dim, distinct, insert, expects_push)
        with self._lock:
            self._positions[ticket] = positions
        return ticket

    def collect(self, ticket: int) -> np.ndarray:
        rows = self._cluster.collect(ticket)
        with self._lock:
            positions = self._positions.pop(ticket)
        return rows.take(positions, axis=0)

    def read_ahead(self, keys: np.ndarray) -> tuple[Any, tuple[str, int, np.ndarray]]:
        distinct, _ = _core.unique_keys(check_keys(keys))
        return self._cluster, (self._name, self._dim, distinct)

    def push_gradient(self, keys: np.ndarray, grads: np.ndarray, step_pushes: int) -> None:
        # Each push counts once toward the step (see Cluster.collect).
        k = check_keys(keys)
        distinct, sums = _core.sum_by_key(k, check_rows(grads, "grads", len(k), self._dim))
        self._cluster.push_gradient(self._name, self._dim, distinct, sums)
