"""`RangeSnapshot`: one slot range's state (rows, optimizer slots, who pushed which step),
taken between two changes of its group, and its wire form: the `SnapshotChunk`s a primary
sends to a joining backup (InstallSnapshot) or, for a range move, to the range's new group
(MoveIn), and the shards read back from them."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from elastic_emb._proto import ps_pb2
from elastic_emb.ps.server.shard import RequestError, Shard
from elastic_emb.ps.wire import protocol
from elastic_emb.tables import sharding
from elastic_emb.tables.table import TableConfig, TableState
from elastic_emb.tables.tiered import make_local_table

__all__ = ["SNAPSHOT_ROWS", "RangeSnapshot"]

SNAPSHOT_ROWS = 1 << 18  # rows per snapshot message


@dataclasses.dataclass
class RangeSnapshot:
    """One range's state, taken between two changes of its group."""

    range_id: int
    slots: tuple[int, int]
    tables: list[tuple[dict[str, Any], TableState]]
    steps: dict[str, Any]
    pending: list[tuple[int, int, list[Any]]]

    @classmethod
    def take(
        cls, range_id: int, shard: Shard, slots: tuple[int, int] | None = None
    ) -> RangeSnapshot:
        """The shard's state (of `slots` only, as range `range_id`).

        (The caller makes sure no change is being applied: the order lock.)
        """
        slots = slots or shard.slots or (0, sharding.NUM_SLOTS)
        tables, steps, pending = shard.export_range(slots)
        return cls(range_id, slots, tables, steps, pending)

    @property
    def rows(self) -> int:
        return sum(len(state.keys) for _, state in self.tables)

    def chunks(
        self, header: dict[str, Any], per_part: int = SNAPSHOT_ROWS
    ) -> Iterator[ps_pb2.SnapshotChunk]:
        """The tables' rows in parts of `per_part` rows, then the step state (the last part)."""
        where = dict(header, range=self.range_id, slot_begin=self.slots[0], slot_end=self.slots[1])
        for config, state in self.tables:
            for begin in range(0, max(len(state.keys), 1), per_part):
                part = state.select(np.arange(begin, min(begin + per_part, len(state.keys))))
                if begin:  # the admission counts are table-wide: in the first part only
                    part.counts = None
                rows = protocol.write_state(ps_pb2.ExportRowsResponse(), part)
                yield ps_pb2.SnapshotChunk(**where, table_config_json=json.dumps(config), rows=rows)
        yield ps_pb2.SnapshotChunk(
            **where,
            steps_json=json.dumps(self.steps),
            pending=[protocol.push_request(w, s, ps_pb2.FLOAT32, p) for w, s, p in self.pending],
        )

    @staticmethod
    def read(chunks: list[ps_pb2.SnapshotChunk]) -> dict[int, Shard]:
        """The shards, by range id, that snapshot chunks describe."""
        shards: dict[int, Shard] = {}
        parts: dict[str, tuple[dict[str, Any], list[Any]]] = {}
        for chunk in chunks:
            if chunk.table_config_json:
                config = json.loads(chunk.table_config_json)
                parts.setdefault(config["name"], (config, []))[1].append(chunk.rows)
            if not chunk.steps_json:
                continue
            dims = {name: config["dim"] for name, (config, _) in parts.items()}
            pending = [
                (
                    push.worker,
                    push.step,
                    protocol.pushed_gradients(push, dims.__getitem__),
                )
                for push in chunk.pending
            ]
            tables = []
            for config, messages in parts.values():
                table = make_local_table(TableConfig.from_dict(config))
                states = [protocol.read_state(m, table.dim, table.num_slots) for m in messages]
                table.load_state(type(states[0]).concatenate(states))
                tables.append(table)
            shard = Shard((chunk.slot_begin, chunk.slot_end))
            shard.install(tables, json.loads(chunk.steps_json), pending)
            shards[chunk.range] = shard
            parts = {}
        if parts:
            raise RequestError("INVALID_ARGUMENT", "a snapshot ends without its step state")
        return shards
