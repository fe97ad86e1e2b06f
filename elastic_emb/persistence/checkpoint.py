"""Checkpoints of tables: `save` and `restore` (format in docs/checkpoint-format.md).

Which tables, and where their rows are: the process's registered tables by
name, in-process ones written here and a cluster's through its shards
(`save_cluster`). The directory format is `elastic_emb.persistence.files`.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any, Protocol

from elastic_emb.persistence import files
from elastic_emb.persistence.files import (
    DEFAULT_MAX_DELTAS,
    CheckpointError,
    check_fits,
    check_incremental,
    clone,
    compact,
    file_sha256,
    hash_file,
    read_shards,
    table_config,
)
from elastic_emb.tables.registry import registered_tables, unregister
from elastic_emb.tables.table import Table

__all__ = [
    "DEFAULT_MAX_DELTAS",
    "CheckpointError",
    "check_fits",
    "check_incremental",
    "clone",
    "compact",
    "file_sha256",
    "hash_file",
    "read_shards",
    "restore",
    "save",
    "table_config",
]


def _is_remote(table: Table) -> bool:
    """Whether `table`'s rows are on a cluster's shards (a remote table)."""
    return table.cluster is not None


def _tables_arg(tables: Any) -> dict[str, Table]:
    if tables is None:
        return registered_tables()
    chosen: dict[str, Table] = {}
    for t in tables:
        if chosen.get(t.name, t) is not t:
            raise ValueError(
                f"`tables` holds two tables named {t.name!r}; a checkpoint holds one table per name"
            )
        chosen[t.name] = t
    return chosen


def save(
    directory: str | os.PathLike[str],
    tables: Any = None,
    incremental: bool = False,
    max_deltas: int = files.DEFAULT_MAX_DELTAS,
) -> Path:
    """Writes every table of this process (or `tables`) to `directory`.

    Keys, values, optimizer slots, the optimizer step and row metadata are
    written. The write is atomic: data files get fresh names, and the
    checkpoint switches to them when `manifest.json` is replaced (a rename);
    a crash before that leaves the previous checkpoint intact.

    With `incremental=True` (CPU tables, in-process or on PS shards), a
    table whose previous incremental save went to this directory, and is
    still its newest link there, gets a delta: only the rows inserted, pushed or imported since then
    and the keys erased since. Otherwise (first save, another directory since,
    a restore, a changed directory, or `max_deltas` deltas already) it gets a
    new base, a full copy. `restore` applies base and deltas exactly.
    Training may go on in other threads meanwhile: each table's changes are
    taken in one atomic snapshot, and later changes go to the next delta.

    Remote tables (after `ee.init`) are written by their PS shards, each its
    own files and all in parallel, into `directory`, which must therefore be
    reachable by the shards under the same path (same machine or a shared
    file system). In sync mode every shard saves at the same step boundary
    (after this worker's last step); the manifest records each shard's step
    (`cut`). A shard's part continues its chains only while the shards own
    the same slots; after a failover the new primary starts new ones.

    Example:
        >>> ee.save("/tmp/ckpt", incremental=True)  # a base  # doctest: +SKIP
        >>> table.push(keys, grads)  # doctest: +SKIP
        >>> ee.save("/tmp/ckpt", incremental=True)  # a delta: the pushed rows  # doctest: +SKIP

    Args:
        directory: path; created if missing.
        tables: optional iterable of `Table` to save instead of all.
        incremental: bool, write deltas (see above) instead of full copies.
        max_deltas: int >= 0, the most deltas a table's chain gets; the save
            after them writes a new base (which replaces the chain).

    Returns:
        The directory as a `Path`.

    Raises:
        ValueError: an invalid argument.
        NotImplementedError: `incremental=True` with in-process GPU tables.
    """
    files.check_incremental(incremental, max_deltas)
    root = Path(directory).absolute()
    chosen = _tables_arg(tables)
    remote_tables = {n: t for n, t in chosen.items() if _is_remote(t)}
    local = {n: t for n, t in chosen.items() if n not in remote_tables}
    if incremental:
        files.check_tracks_changes(local)
    root.mkdir(parents=True, exist_ok=True)
    if remote_tables:
        clusters = {id(t.cluster): t.cluster for t in remote_tables.values()}
        if len(clusters) != 1:
            raise ValueError("ee.save: the remote tables belong to different ee.init() connections")
        (cluster,) = clusters.values()
        save_cluster(root, cluster, sorted(remote_tables), local, incremental, max_deltas)
        return root
    if incremental:
        files.save_chains(root, chosen, max_deltas)
    else:
        files.save_part(root, chosen)
    files.remove_unused(root, keep_parts=set())
    return root


class ShardSaver(Protocol):
    """What writes the shards' parts of a cluster checkpoint (`ps.cluster.Cluster`)."""

    @property
    def mode(self) -> str: ...

    @property
    def num_shards(self) -> int: ...

    def slot_ranges(self) -> list[tuple[int, int]]: ...

    def save_tables(
        self, directories: list[str], names: list[str], incremental: bool, max_deltas: int
    ) -> list[Any]: ...


def save_cluster(
    root: Path,
    cluster: ShardSaver,
    names: list[str],
    local: dict[str, Table],
    incremental: bool,
    max_deltas: int,
) -> None:
    """A cluster checkpoint: a part per shard (written by the shard) and one for `local`.

    `names`: the shards' tables to save (empty: all). Incremental: each part
    starts as a files.clone of the same shard's part in the checkpoint already in
    `root` (if its shards owned the same slots), and its chains get deltas.
    """
    slots = [list(r) for r in cluster.slot_ranges()]
    parts_dir = f"parts-{secrets.token_hex(4)}"
    part_names = [f"shard-{i:04d}" for i in range(cluster.num_shards)]
    part_names += ["local"] if local else []
    parts = [f"{parts_dir}/{name}" for name in part_names]
    previous = files.previous_parts(root, slots) if incremental else {}
    for name, part in zip(part_names, parts, strict=True):
        if name in previous:
            files.clone(previous[name], root / part)
    if local:
        if incremental:
            files.save_chains(root / parts[-1], local, max_deltas)
        else:
            files.save_part(root / parts[-1], local)
    saved = cluster.save_tables(
        [str(root / p) for p in parts[: cluster.num_shards]],
        names,
        incremental=incremental,
        max_deltas=max_deltas,
    )
    for part in parts:
        files.fsync_directory(root / part)
    cut = {
        "mode": cluster.mode,
        "steps": [r.step for r in saved],
        "worker_steps": [{str(w): s for w, s in sorted(r.worker_steps.items())} for r in saved],
    }
    manifest = {
        "format": files.FORMAT,
        "version": files.VERSION,
        "parts": parts,
        "slots": slots,
        "cut": cut,
    }
    files.write_manifest(root, manifest)
    files.remove_unused(root, keep_parts={parts_dir})


def restore(directory: str | os.PathLike[str], tables: Any = None) -> dict[str, Table]:
    """Loads a checkpoint written by `save` into the tables of this process.

    Each checkpointed table replaces the content of the live table of the
    same name; a checkpointed table with no live counterpart is created. The
    whole checkpoint is read and verified (sizes, checksums, dims and
    optimizers) before any table is changed, so a bad checkpoint raises and
    leaves every live table as it was.

    Incremental checkpoints are read as a whole: every link of each chain
    is verified (sequence, parent checksum, size, checksum), then the base
    and the deltas are applied in order.

    Checkpoints move freely between in-process tables and clusters of any
    number of PS shards: each shard keeps the rows whose keys it owns now.
    Remote tables are restored by their shards (which read `directory`
    themselves); each shard verifies everything before changing anything.

    Args:
        directory: a directory written by `save`.
        tables: optional iterable of `Table` to restore instead of all live
            tables; other checkpointed tables are then ignored.

    Returns:
        The restored tables by name (tables created here are only kept alive
        by this dict or by the caller).

    Raises:
        files.CheckpointError (a ValueError): missing, corrupted or mismatched checkpoint.
    """
    root = Path(directory).absolute()
    dirs = files.part_directories(root)
    try:
        available = {n for d in dirs for n in files.read_manifest(d)["tables"]}
    except (KeyError, TypeError, AttributeError) as e:
        raise files.CheckpointError(f"Checkpoint manifest in {root} is malformed: {e!r}") from e
    live = _tables_arg(tables)
    if tables is not None:
        missing = sorted(set(live) - available)
        if missing:
            raise files.CheckpointError(f"Tables {missing} are not in the checkpoint in {root}")
    wanted = sorted(available if tables is None else set(live))
    # Phase 1: read and verify everything, and create the tables that are
    # not live yet; no live table changes until all of it succeeded.
    created: list[Table] = []
    try:
        entries: dict[str, dict[str, Any]] = {}
        for d in dirs:
            for name, entry in files.read_manifest(d)["tables"].items():
                entries.setdefault(name, entry)
        targets: dict[str, Table] = {}
        for name in wanted:
            table = live.get(name)
            if table is None:
                table = Table.from_config(files.table_config(name, entries[name]))
                created.append(table)
            files.check_fits(table, entries[name], root)
            targets[name] = table
        local = [n for n, t in targets.items() if not _is_remote(t)]
        _, states = files.read_shards([root], local) if local else ({}, {})
    except Exception as e:
        for table in created:  # no trace in this process (remote ones stay, empty, on the shards)
            unregister(table)
        if isinstance(e, files.CheckpointError):
            raise
        if isinstance(e, KeyError | TypeError | ValueError | AttributeError):
            raise files.CheckpointError(f"Checkpoint manifest in {root} is malformed: {e!r}") from e
        raise
    # Phase 2: apply. The shards first: they verify what they read before they change
    # anything, and a shard that refuses leaves this process's tables unchanged too.
    remote_names = sorted(n for n, t in targets.items() if _is_remote(t))
    if remote_names:
        cluster = targets[remote_names[0]].cluster
        try:
            cluster.restore_tables(str(root), remote_names)
        except ValueError as e:
            raise files.CheckpointError(str(e)) from e
    for name, state in states.items():
        targets[name].load_state(state)
    files.forget_changes([targets[name] for name in states])
    return targets
