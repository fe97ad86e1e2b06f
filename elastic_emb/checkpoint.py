"""Checkpoints of tables: `save` and `restore` (format in docs/checkpoint-format.md)."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

import numpy as np

from elastic_emb.initializers import InitializerSpec
from elastic_emb.table import Table, TableState, registered_tables, unregister

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


def _tables_arg(tables: Any) -> dict[str, Table]:
    if tables is None:
        return registered_tables()
    return {t.name: t for t in tables}


def save(directory: str | os.PathLike[str], tables: Any = None) -> Path:
    """Writes every table of this process (or `tables`) to `directory`.

    Keys, values, optimizer slots, the optimizer step and row metadata are
    written. The write is atomic: data files get fresh names, and the
    checkpoint switches to them when `manifest.json` is replaced (a rename);
    a crash before that leaves the previous checkpoint intact.

    Args:
        directory: path; created if missing.
        tables: optional iterable of `Table` to save instead of all.

    Returns:
        The directory as a `Path`.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(4)
    entries: dict[str, Any] = {}
    for i, (name, table) in enumerate(sorted(_tables_arg(tables).items())):
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
    manifest = {"format": FORMAT, "version": VERSION, "tables": entries}
    tmp = root / (MANIFEST + ".tmp")
    _fsync_write(tmp, [memoryview(json.dumps(manifest, indent=1, sort_keys=True).encode())])
    os.replace(tmp, root / MANIFEST)
    _fsync_directory(root)
    # The new manifest is in place: files of older checkpoints (and leftovers
    # of a crashed save) can go.
    keep = {e["file"] for e in entries.values()}
    for old in root.glob("table-*.bin*"):
        if old.name not in keep:
            old.unlink(missing_ok=True)
    return root


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


def restore(directory: str | os.PathLike[str], tables: Any = None) -> dict[str, Table]:
    """Loads a checkpoint written by `save` into the tables of this process.

    Each checkpointed table replaces the content of the live table of the
    same name; a checkpointed table with no live counterpart is created. The
    whole checkpoint is read and verified (sizes, checksums, dims and
    optimizers) before any table is changed, so a bad checkpoint raises and
    leaves every live table as it was.

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
    root = Path(directory)
    manifest = _read_manifest(root)
    live = _tables_arg(tables)
    if tables is not None:
        missing = sorted(set(live) - set(manifest.get("tables", {})))
        if missing:
            raise CheckpointError(f"Tables {missing} are not in the checkpoint in {root}")
    # Phase 1: read and verify everything, and create the tables that are
    # not live yet; no live table changes until all of it succeeded.
    plan: list[tuple[Table, TableState]] = []
    created: list[Table] = []
    try:
        for name, entry in sorted(manifest["tables"].items()):
            if tables is not None and name not in live:
                continue
            table = live.get(name)
            if table is None:
                table = Table(
                    dim=entry["dim"],
                    optimizer=entry["optimizer"],
                    initializer=InitializerSpec(**entry["initializer"]),
                    name=name,
                    seed=entry["seed"],
                )
                created.append(table)
            expected = (table.dim, table.optimizer.kind, table.num_slots)
            found = (entry["dim"], entry["optimizer"]["class_name"].lower(), entry["num_slots"])
            if expected != found:
                raise CheckpointError(
                    f"Table {name!r} does not match the checkpoint: (dim, optimizer, slots) "
                    f"is {expected} live and {found} in {root}"
                )
            plan.append((table, _read_table(root, name, entry)))
    except Exception as e:
        for table in created:  # a failed restore leaves no trace
            unregister(table)
        if isinstance(e, CheckpointError):
            raise
        if isinstance(e, KeyError | TypeError | ValueError | AttributeError):
            raise CheckpointError(f"Checkpoint manifest in {root} is malformed: {e!r}") from e
        raise
    # Phase 2: apply.
    for table, state in plan:
        table.load_state(state)
    return {table.name: table for table, _ in plan}
