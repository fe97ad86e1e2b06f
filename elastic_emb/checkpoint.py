"""Checkpoints of tables: `save` and `restore` (format in docs/checkpoint-format.md)."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np

from elastic_emb.placement import registered_tables, unregister
from elastic_emb.table import Table, TableState

if TYPE_CHECKING:
    from elastic_emb.ps.remote_table import RemoteTable

__all__ = ["CheckpointError", "restore", "save"]

FORMAT = "elastic_emb.checkpoint"
VERSION = 1
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated, corrupted or does not fit the tables."""


def _fsync_write(path: Path, chunks: list[memoryview]) -> None:
    """Writes `chunks` to `path` and syncs it to disk."""
    with open(path, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def _fsync_directory(path: Path) -> None:
    """Makes the renames inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _layout(num_rows: int, dim: int, num_slots: int) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """The arrays of a table file, in order, as little-endian raw bytes."""
    return [
        ("keys", np.dtype("<i8"), (num_rows,)),
        ("values", np.dtype("<f4"), (num_rows, dim)),
        ("slots", np.dtype("<f4"), (num_rows, num_slots * dim)),
        ("last_step", np.dtype("<u4"), (num_rows,)),
        ("update_count", np.dtype("<u4"), (num_rows,)),
    ]


def _is_remote(table: Table) -> TypeGuard[RemoteTable]:
    """Whether `table` is a `RemoteTable`.

    Remote tables exist only once `elastic_emb.ps.remote_table` is loaded, so
    this imports neither it nor gRPC and protobuf (checkpoints of in-process
    tables work without them).
    """
    remote = sys.modules.get("elastic_emb.ps.remote_table")
    return remote is not None and isinstance(table, remote.RemoteTable)


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


def save(directory: str | os.PathLike[str], tables: Any = None) -> Path:
    """Writes every table of this process (or `tables`) to `directory`.

    Keys, values, optimizer slots, the optimizer step and row metadata are
    written. The write is atomic: data files get fresh names, and the
    checkpoint switches to them when `manifest.json` is replaced (a rename);
    a crash before that leaves the previous checkpoint intact.

    Remote tables (after `ee.init`) are written by their PS shards, each its
    own files and all in parallel, into `directory`, which must therefore be
    reachable by the shards under the same path (same machine or a shared
    file system).

    Args:
        directory: path; created if missing.
        tables: optional iterable of `Table` to save instead of all.

    Returns:
        The directory as a `Path`.
    """
    root = Path(directory).absolute()
    root.mkdir(parents=True, exist_ok=True)
    chosen = _tables_arg(tables)
    remote_tables = {n: t for n, t in chosen.items() if _is_remote(t)}
    if not remote_tables:
        _save_part(root, chosen)
        _remove_unused(root, keep_parts=set())
        return root
    clusters = {id(t.cluster): t.cluster for t in remote_tables.values()}
    if len(clusters) != 1:
        raise ValueError("ee.save: the remote tables belong to different ee.init() connections")
    (cluster,) = clusters.values()
    parts_dir = f"parts-{secrets.token_hex(4)}"
    parts = [f"{parts_dir}/shard-{i:04d}" for i in range(cluster.num_shards)]
    names = sorted(remote_tables)
    local = {n: t for n, t in chosen.items() if n not in remote_tables}
    if local:
        parts.append(f"{parts_dir}/local")
        _save_part(root / parts[-1], local)
    cluster.save_tables([str(root / p) for p in parts[: cluster.num_shards]], names)
    for part in parts:
        _fsync_directory(root / part)
    manifest = {"format": FORMAT, "version": VERSION, "parts": parts}
    _write_manifest(root, manifest)
    _remove_unused(root, keep_parts={parts_dir})
    return root


def _save_part(root: Path, tables: dict[str, Table]) -> None:
    """Writes `tables` as one checkpoint (data files, then the manifest) in `root`."""
    root.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(4)
    entries: dict[str, Any] = {}
    for i, (name, table) in enumerate(sorted(tables.items())):
        state = table.export_state()
        arrays = [
            np.ascontiguousarray(getattr(state, field), dtype)
            for field, dtype, _ in _layout(len(state.keys), table.dim, table.num_slots)
        ]
        file_name = f"table-{i:04d}-{token}.bin"
        tmp = root / (file_name + ".tmp")
        _fsync_write(tmp, [a.reshape(-1).view(np.uint8).data for a in arrays])
        os.replace(tmp, root / file_name)
        entries[name] = {
            **table.config(),
            "num_slots": table.num_slots,
            "iterations": state.iterations,
            "num_rows": len(state.keys),
            "file": file_name,
            "bytes": sum(a.nbytes for a in arrays),
            "sha256": _sha256(root / file_name),
        }
    _write_manifest(root, {"format": FORMAT, "version": VERSION, "tables": entries})
    # The new manifest is in place: files of older checkpoints (and leftovers
    # of a crashed save) can go.
    keep = {e["file"] for e in entries.values()}
    for old in root.glob("table-*.bin*"):
        if old.name not in keep:
            old.unlink(missing_ok=True)


def _write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    tmp = root / (MANIFEST + ".tmp")
    _fsync_write(tmp, [memoryview(json.dumps(manifest, indent=1, sort_keys=True).encode())])
    os.replace(tmp, root / MANIFEST)
    _fsync_directory(root)


def _remove_unused(root: Path, keep_parts: set[str]) -> None:
    """Removes the parts of older cluster checkpoints (and, after one, table files)."""
    for old in root.glob("parts-*"):
        if old.name not in keep_parts:
            shutil.rmtree(old, ignore_errors=True)
    if keep_parts:
        for old in root.glob("table-*.bin*"):
            old.unlink(missing_ok=True)


def _read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"No checkpoint in {root}: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"Checkpoint manifest {path} is corrupted: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an elastic_emb checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{path} has format version {manifest.get('version')!r}; this release reads {VERSION}"
        )
    return manifest


def _read_table(root: Path, name: str, entry: dict[str, Any]) -> TableState:
    path = root / entry["file"]
    if not path.is_file():
        raise CheckpointError(f"Checkpoint file {path} of table {name!r} is missing")
    layout = _layout(entry["num_rows"], entry["dim"], entry["num_slots"])
    expected = sum(int(np.prod(shape)) * dtype.itemsize for _, dtype, shape in layout)
    if expected != entry["bytes"]:
        raise CheckpointError(
            f"Checkpoint manifest entry of table {name!r} is inconsistent: {entry['num_rows']} "
            f"rows of dim {entry['dim']} with {entry['num_slots']} slots need {expected} bytes, "
            f"the manifest says {entry['bytes']}"
        )
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(
            f"Checkpoint file {path} of table {name!r} is truncated or padded: "
            f"{size} bytes, expected {entry['bytes']}"
        )
    if _sha256(path) != entry["sha256"]:
        raise CheckpointError(f"Checkpoint file {path} of table {name!r} fails its checksum")
    raw = path.read_bytes()
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for field, dtype, shape in layout:
        count = int(np.prod(shape))
        arrays[field] = (
            np.frombuffer(raw, dtype, count, offset).reshape(shape).astype(dtype.newbyteorder("="))
        )
        offset += count * dtype.itemsize
    return TableState(**arrays, iterations=int(entry["iterations"]))


def part_directories(root: Path) -> list[Path]:
    """The directories holding table files: `root`, or the parts of a cluster checkpoint."""
    manifest = _read_manifest(root)
    if "parts" not in manifest:
        return [root]
    parts = manifest["parts"]
    if not isinstance(parts, list) or not all(isinstance(p, str) for p in parts):
        raise CheckpointError(f"Checkpoint manifest in {root} is malformed: bad `parts`")
    return [root / p for p in parts]


def table_config(name: str, entry: dict[str, Any]) -> dict[str, Any]:
    """The `Table.config()` of a checkpointed table."""
    return {"name": name, **{k: entry[k] for k in ("dim", "seed", "optimizer", "initializer")}}


def read_shards(
    roots: list[Path], names: list[str] | None
) -> tuple[dict[str, dict[str, Any]], dict[str, TableState]]:
    """Reads and verifies tables from checkpoints (cluster checkpoints expanded).

    A table found in several parts (the shards of a cluster) gets the rows of
    all of them. Returns (manifest entry, state) by table name.

    Raises:
        CheckpointError: a part is missing, corrupted or inconsistent, or a
            table of `names` is in none of them.
    """
    entries: dict[str, dict[str, Any]] = {}
    parts: dict[str, list[TableState]] = {}
    dirs = [part for root in roots for part in part_directories(root)]
    try:
        for part in dirs:
            for name, entry in sorted(_read_manifest(part)["tables"].items()):
                if names is not None and name not in names:
                    continue
                first = entries.setdefault(name, entry)
                if table_config(name, first) != table_config(name, entry):
                    raise CheckpointError(
                        f"Table {name!r} has different configurations in the parts of {roots[0]}"
                    )
                parts.setdefault(name, []).append(_read_table(part, name, entry))
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"Checkpoint manifest in {roots[0]} is malformed: {e!r}") from e
    missing = sorted(set(names or ()) - set(entries))
    if missing:
        raise CheckpointError(f"Tables {missing} are not in the checkpoint in {roots[0]}")
    return entries, {n: TableState.concatenate(p) for n, p in parts.items()}


def check_fits(table: Table, entry: dict[str, Any], root: Any) -> None:
    """Raises CheckpointError unless `table` can hold the checkpointed table `entry`."""
    expected = (table.dim, table.optimizer.kind, table.num_slots)
    found = (entry["dim"], entry["optimizer"]["class_name"].lower(), entry["num_slots"])
    if expected != found:
        raise CheckpointError(
            f"Table {table.name!r} does not match the checkpoint: (dim, optimizer, slots) "
            f"is {expected} live and {found} in {root}"
        )


def restore(directory: str | os.PathLike[str], tables: Any = None) -> dict[str, Table]:
    """Loads a checkpoint written by `save` into the tables of this process.

    Each checkpointed table replaces the content of the live table of the
    same name; a checkpointed table with no live counterpart is created. The
    whole checkpoint is read and verified (sizes, checksums, dims and
    optimizers) before any table is changed, so a bad checkpoint raises and
    leaves every live table as it was.

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
        CheckpointError (a ValueError): missing, corrupted or mismatched checkpoint.
    """
    root = Path(directory).absolute()
    dirs = part_directories(root)
    try:
        available = {n for d in dirs for n in _read_manifest(d)["tables"]}
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"Checkpoint manifest in {root} is malformed: {e!r}") from e
    live = _tables_arg(tables)
    if tables is not None:
        missing = sorted(set(live) - available)
        if missing:
            raise CheckpointError(f"Tables {missing} are not in the checkpoint in {root}")
    wanted = sorted(available if tables is None else set(live))
    # Phase 1: read and verify everything, and create the tables that are
    # not live yet; no live table changes until all of it succeeded.
    created: list[Table] = []
    try:
        entries: dict[str, dict[str, Any]] = {}
        for d in dirs:
            for name, entry in _read_manifest(d)["tables"].items():
                entries.setdefault(name, entry)
        targets: dict[str, Table] = {}
        for name in wanted:
            table = live.get(name)
            if table is None:
                table = Table.from_config(table_config(name, entries[name]))
                created.append(table)
            check_fits(table, entries[name], root)
            targets[name] = table
        local = [n for n, t in targets.items() if not _is_remote(t)]
        _, states = read_shards([root], local) if local else ({}, {})
    except Exception as e:
        for table in created:  # no trace in this process (remote ones stay, empty, on the shards)
            unregister(table)
        if isinstance(e, CheckpointError):
            raise
        if isinstance(e, KeyError | TypeError | ValueError | AttributeError):
            raise CheckpointError(f"Checkpoint manifest in {root} is malformed: {e!r}") from e
        raise
    # Phase 2: apply.
    for name, state in states.items():
        targets[name].load_state(state)
    remote_names = sorted(n for n, t in targets.items() if _is_remote(t))
    if remote_names:
        cluster = targets[remote_names[0]].cluster  # type: ignore[attr-defined]
        try:
            cluster.restore_tables(str(root), remote_names)
        except ValueError as e:
            raise CheckpointError(str(e)) from e
    return targets
