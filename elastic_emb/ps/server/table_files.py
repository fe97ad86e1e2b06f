"""A shard's checkpoint files: its tables written into a checkpoint directory, and the rows it
owns (shard i of n, or a slot range) read back from checkpoints, everything read and verified
before any table changes. A file the shard cannot write or read is refused as
FAILED_PRECONDITION (the directory's fault, not the shard's), or RESOURCE_EXHAUSTED when the
disk is full. A damaged checkpoint (and one whose tables cannot be created) is refused before
any table changes."""

from __future__ import annotations

import errno
from pathlib import Path

from elastic_emb.persistence import checkpoint
from elastic_emb.ps.server.request_error import RequestError, invalid
from elastic_emb.ps.server.table_set import TableSet
from elastic_emb.tables import sharding
from elastic_emb.tables.local import LocalTable
from elastic_emb.tables.table import TableConfig, TableState

__all__ = ["restore_owned_rows", "write_tables"]


def write_tables(
    directory: str, tables: list[LocalTable], incremental: bool, max_deltas: int
) -> int:
    """Writes `tables` to `directory` (`checkpoint.save`); returns the rows written."""
    try:
        checkpoint.save(directory, tables, incremental=incremental, max_deltas=max_deltas)
    except OSError as e:  # the directory, not the shard: the caller can act on it
        full = e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # (a disk that filled)
        code = "RESOURCE_EXHAUSTED" if full else "FAILED_PRECONDITION"
        why = str(e) if e.filename else e.strerror or str(e)  # (a failed save's names it)
        message = why if directory in why else f"cannot write {directory}: {why}"
        raise RequestError(code, message) from e
    except checkpoint.CheckpointError as e:
        raise RequestError("FAILED_PRECONDITION", str(e)) from e
    return sum(len(t) for t in tables)


def restore_owned_rows(
    tables: TableSet,
    directories: list[str],
    names: list[str],
    num_shards: int,
    shard_index: int,
    num_slots: int,
    slots: tuple[int, int] | None = None,
) -> list[LocalTable]:
    """Loads into `tables` the rows a shard owns from checkpoints (`Shard.restore`)."""
    if not directories:
        raise invalid("Restore needs at least one checkpoint directory")
    if slots is not None and not 0 <= slots[0] < slots[1] <= sharding.NUM_SLOTS:
        raise invalid(f"slot range {slots} is not within [0, {sharding.NUM_SLOTS})")
    if slots is None and (num_shards < 1 or not 0 <= shard_index < num_shards):
        raise invalid(f"shard {shard_index} of {num_shards}: need 0 <= shard_index < num_shards")
    num_slots = num_slots or sharding.NUM_SLOTS
    try:
        configs, states = checkpoint.read_shards([Path(d) for d in directories], names or None)
        missing = []  # the configs of the tables to create, each checked
        for name in states:
            table = tables.find(name)
            if table is not None:
                checkpoint.check_fits(table, configs[name], directories[0])
                continue
            config = checkpoint.table_config(name, configs[name])
            try:
                TableConfig.from_dict(config)
            except (ValueError, KeyError, TypeError) as e:
                raise checkpoint.CheckpointError(
                    f"Checkpoint manifest in {directories[0]} is malformed: table {name!r} has "
                    f"an invalid configuration: {e!r}"
                ) from e
            missing.append(config)
    except (checkpoint.CheckpointError, OSError) as e:
        raise RequestError("FAILED_PRECONDITION", str(e)) from e
    plan: list[tuple[str, TableState]] = []
    for name, state in states.items():
        if slots is None:
            mine = sharding.shard_of(state.keys, num_shards, num_slots) == shard_index
        else:
            slot = sharding.slot_of(state.keys)
            mine = (slot >= slots[0]) & (slot < slots[1])
        plan.append((name, state.select(mine)))
    tables.create(missing)  # all or none, before any table changes
    restored = []
    for name, state in plan:
        table = tables.get(name)
        table.load_state(state)
        restored.append(table)
    return restored
