"""The checkpoint directory format (docs/checkpoint-format.md): parts, manifests, data
files, and chains of deltas, written atomically and checksummed; `compact` and `clone`.

Ordinary checkpoints hold one data file per table. Incremental ones
(`save(..., incremental=True)`) hold a chain per table: a base, then deltas
with the rows changed since the previous link and the keys erased since;
`compact` merges a chain into a new base. What is saved (the registry's
tables, a cluster's shards) is `elastic_emb.persistence.checkpoint`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from elastic_emb.tables.policies import admission
from elastic_emb.tables.table import Table, TableState

__all__ = [
    "CheckpointError",
    "check_fits",
    "check_incremental",
    "clone",
    "compact",
    "file_sha256",
    "hash_file",
    "read_shards",
]

FORMAT = "elastic_emb.checkpoint"
VERSION = 1  # ordinary checkpoints: one data file per table
CHAIN_VERSION = 2  # incremental checkpoints: a chain of data files per table
MANIFEST = "manifest.json"
# The manifest's own checksum: the SHA-256 of the manifest written without it.
MANIFEST_SHA256 = "manifest_sha256"
DEFAULT_MAX_DELTAS = 10


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated, corrupted or does not fit the tables."""


def _write_atomically(path: Path, chunks: list[memoryview]) -> None:
    """Writes `chunks` to `path` through a synced temporary file renamed over it. If the
    write fails (a full disk), the temporary file is removed and `path` is untouched."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:
            e.filename = str(path)  # (a full disk fails the write, which names no file)
        raise


@contextlib.contextmanager
def _saving(root: Path, token: str) -> Iterator[None]:
    """A save into `root` whose files are named with `token`: if it fails, its files go
    (the checkpoint there before stays whole), and an OSError says where and why."""
    try:
        yield
    except BaseException as e:
        if _names(root / MANIFEST, token):  # committed (the failure came after the rename)
            raise
        for written in root.glob(f"table-*-{token}*"):
            written.unlink(missing_ok=True)
        if isinstance(e, OSError) and not isinstance(e, CheckpointError):
            raise OSError(
                e.errno,
                f"cannot save the checkpoint in {root}: {e.strerror or e} writing "
                f"{e.filename}; what was saved there before is unchanged",
            ) from e
        raise


def _names(manifest: Path, token: str) -> bool:
    """Whether the manifest at `manifest` names files of the save `token`."""
    try:
        return token in manifest.read_text(errors="replace")
    except OSError:
        return False


def fsync_directory(path: Path) -> None:
    """Makes the renames inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_incremental(incremental: Any, max_deltas: Any) -> None:
    """Raises `ValueError` unless `incremental` is a bool and `max_deltas` an int >= 0."""
    if not isinstance(incremental, bool):
        raise ValueError(f"`incremental` must be a bool. Received: incremental={incremental!r}")
    if isinstance(max_deltas, bool) or not isinstance(max_deltas, int) or max_deltas < 0:
        raise ValueError(
            f"`max_deltas` must be a non-negative int. Received: max_deltas={max_deltas!r}"
        )


def hash_file(digest: Any, path: Path) -> None:
    """Feeds the bytes of the file at `path` to `digest` (a `hashlib` object), in blocks."""
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)


def file_sha256(path: Path) -> str:
    """The SHA-256 of the file at `path`, in hex."""
    digest = hashlib.sha256()
    hash_file(digest, path)
    return digest.hexdigest()


def _layout(
    num_rows: int, dim: int, num_slots: int, num_erased: int | None = None, num_counts: int = 0
) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """The arrays of a table file, in order, as little-endian raw bytes.

    A delta file (`num_erased` given) has the erased keys after the rows; a
    table with admission ends with its sketch's `num_counts` counters.
    """
    layout: list[tuple[str, np.dtype, tuple[int, ...]]] = [
        ("keys", np.dtype("<i8"), (num_rows,)),
        ("values", np.dtype("<f4"), (num_rows, dim)),
        ("slots", np.dtype("<f4"), (num_rows, num_slots * dim)),
        ("last_step", np.dtype("<u4"), (num_rows,)),
        ("update_count", np.dtype("<u4"), (num_rows,)),
    ]
    if num_erased is not None:
        layout.append(("erased", np.dtype("<i8"), (num_erased,)))
    if num_counts:
        layout.append(("counts", np.dtype("u1"), (num_counts,)))
    return layout


def previous_parts(root: Path, slots: list[list[int]]) -> dict[str, Path]:
    """The parts of the cluster checkpoint in `root` by name, if its shards owned `slots`."""
    try:
        manifest = read_manifest(root)
    except CheckpointError:
        return {}
    if manifest.get("slots") != slots or not isinstance(manifest.get("parts"), list):
        return {}
    return {str(p).rsplit("/", 1)[-1]: root / str(p) for p in manifest["parts"]}


def save_part(root: Path, tables: dict[str, Table]) -> None:
    """Writes `tables` as one checkpoint (data files, then the manifest) in `root`."""
    root.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(4)
    entries: dict[str, Any] = {}
    with _saving(root, token):
        for i, (name, table) in enumerate(sorted(tables.items())):
            state = table.export_state()
            file_name = f"table-{i:04d}-{token}.bin"
            nbytes, digest = _write_data(
                root, file_name, _state_arrays(state, table.dim, table.num_slots)
            )
            entries[name] = {
                **table.config(),
                "num_slots": table.num_slots,
                "iterations": state.iterations,
                "num_rows": len(state.keys),
                "num_counts": _num_counts(state),
                "file": file_name,
                "bytes": nbytes,
                "sha256": digest,
            }
        write_manifest(root, {"format": FORMAT, "version": VERSION, "tables": entries})
    # The new manifest is in place: files of older checkpoints (and leftovers
    # of a crashed save) can go.
    _remove_data_files(root, keep={e["file"] for e in entries.values()})


# Incremental checkpoints.


@dataclasses.dataclass(frozen=True)
class _Mark:
    """Where a table's last incremental save went: its chain's link `seq`,
    taken when the table's change set `change_set` opened."""

    chain: str
    seq: int
    change_set: int


# The last incremental save of each table (tables are not kept alive by it).
_marks: weakref.WeakKeyDictionary[Table, _Mark] = weakref.WeakKeyDictionary()
# Serializes incremental saves and compactions of this process; guards _marks.
_chain_lock = threading.Lock()


def check_tracks_changes(tables: dict[str, Table]) -> None:
    for name, table in sorted(tables.items()):
        tracks = callable(getattr(table, "export_changes", None))
        if table.device != "cpu" or not tracks or not getattr(table, "tracks_changes", True):
            raise NotImplementedError(
                "ee.save(incremental=True) needs tables that track changed rows (in-process CPU "
                f"tables without a disk tier); table {name!r} is a {type(table).__name__} on "
                f"{table.device!r}: save it with incremental=False"
            )


def _link_files(entry: dict[str, Any]) -> list[str]:
    """The data files of a manifest entry (its chain's, or its one file)."""
    if "links" in entry:
        return [link["file"] for link in entry["links"]]
    return [entry["file"]]


def _current_chains(root: Path) -> dict[str, dict[str, Any]]:
    """The chains of `root`'s manifest that a delta may extend, by table name.

    A chain qualifies when the manifest is an incremental one and each of the
    chain's files exists with its recorded size; anything else (no manifest,
    a damaged one, an ordinary checkpoint) gets new bases.
    """
    try:
        manifest = read_manifest(root)
        if manifest.get("version") != CHAIN_VERSION:
            return {}
        chains = {}
        for name, entry in manifest["tables"].items():
            links = entry["links"]
            if not isinstance(entry["chain"], str) or not links:
                continue
            if all((root / link["file"]).stat().st_size == link["bytes"] for link in links):
                chains[name] = entry
        return chains
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _write_data(root: Path, file_name: str, arrays: list[np.ndarray]) -> tuple[int, str]:
    """Writes a data file atomically; returns its size and SHA-256."""
    _write_atomically(root / file_name, [a.reshape(-1).view(np.uint8).data for a in arrays])
    return sum(a.nbytes for a in arrays), file_sha256(root / file_name)


def _num_counts(state: TableState) -> int:
    return 0 if state.counts is None else len(state.counts)


def _state_arrays(
    state: TableState, dim: int, num_slots: int, erased: np.ndarray | None = None
) -> list[np.ndarray]:
    """The arrays of a table file (a delta's with `erased`), in `_layout` order."""
    fields = {"erased": erased, **{f: getattr(state, f) for f in (*TableState.FIELDS, "counts")}}
    layout = _layout(
        len(state.keys), dim, num_slots, None if erased is None else len(erased),
        _num_counts(state),
    )  # fmt: skip
    return [np.ascontiguousarray(fields[field], dtype) for field, dtype, _ in layout]


def _write_base(
    root: Path, file_name: str, state: TableState, dim: int, num_slots: int, seq: int
) -> dict[str, Any]:
    """Writes `state` as the base of a chain, link `seq`; returns the link."""
    nbytes, digest = _write_data(root, file_name, _state_arrays(state, dim, num_slots))
    return {
        "seq": seq,
        "kind": "base",
        "file": file_name,
        "bytes": nbytes,
        "sha256": digest,
        "num_rows": len(state.keys),
        "num_erased": 0,
        "num_counts": _num_counts(state),
        "iterations": state.iterations,
        "parent": None,
    }


def _chain_entry(table: Table, state: TableState, chain: str, links: list[Any]) -> dict[str, Any]:
    """The manifest entry of a table's chain."""
    return {
        **table.config(),
        "num_slots": table.num_slots,
        "iterations": state.iterations,
        "chain": chain,
        "links": links,
    }


def _save_link(
    root: Path, stem: str, table: Table, head: dict[str, Any] | None, max_deltas: int
) -> tuple[dict[str, Any], _Mark]:
    """Writes a table's next link (a delta, or a new base); returns its entry and mark."""
    mark = _marks.get(table)
    extend = (
        mark is not None
        and head is not None
        and head["chain"] == mark.chain
        and head["links"][-1]["seq"] == mark.seq
        and len(head["links"]) - 1 < max_deltas
    )
    export = table.export_changes  # type: ignore[attr-defined]
    state, erased, number = export(all_rows=not extend)
    if extend and number != mark.change_set:  # type: ignore[union-attr]
        # Someone else took change sets of this table since our last save:
        # what they took is not in the chain, so start a new one.
        state, erased, number = export(all_rows=True)
        extend = False
    if not extend:
        chain = secrets.token_hex(8)
        link = _write_base(root, f"{stem}.bin", state, table.dim, table.num_slots, seq=0)
        return _chain_entry(table, state, chain, [link]), _Mark(chain, 0, number + 1)
    if head is None:
        raise RuntimeError(f"table {table.name!r}: a delta needs the chain it extends")
    parent = head["links"][-1]
    arrays = _state_arrays(state, table.dim, table.num_slots, erased)
    file_name = f"{stem}-delta.bin"
    nbytes, digest = _write_data(root, file_name, arrays)
    link = {
        "seq": parent["seq"] + 1,
        "kind": "delta",
        "file": file_name,
        "bytes": nbytes,
        "sha256": digest,
        "num_rows": len(state.keys),
        "num_erased": len(erased),
        "num_counts": _num_counts(state),
        "iterations": state.iterations,
        "parent": parent["sha256"],
    }
    entry = _chain_entry(table, state, head["chain"], [*head["links"], link])
    return entry, _Mark(head["chain"], link["seq"], number + 1)


def save_chains(root: Path, tables: dict[str, Table], max_deltas: int) -> None:
    """Writes the next link of every table, then the manifest (the commit point)."""
    root.mkdir(parents=True, exist_ok=True)  # a cluster's new local part
    with _chain_lock:
        heads = _current_chains(root)
        token = secrets.token_hex(4)
        entries: dict[str, Any] = {}
        marks: dict[str, _Mark] = {}
        try:
            with _saving(root, token):
                for i, (name, table) in enumerate(sorted(tables.items())):
                    stem = f"table-{i:04d}-{token}"
                    entries[name], marks[name] = _save_link(
                        root, stem, table, heads.get(name), max_deltas
                    )
                manifest = {"format": FORMAT, "version": CHAIN_VERSION, "tables": entries}
                write_manifest(root, manifest)
        except BaseException:
            # The change sets taken are in no committed chain: the next
            # incremental save of these tables writes bases.
            for table in tables.values():
                _marks.pop(table, None)
            raise
        for name, table in tables.items():
            _marks[table] = marks[name]
    _remove_data_files(root, keep={f for e in entries.values() for f in _link_files(e)})


def _remove_data_files(root: Path, keep: set[str]) -> None:
    """Deletes `table-*.bin*` files of `root` not in `keep` (older checkpoints, crashed saves)."""
    for old in root.glob("table-*.bin*"):
        if old.name not in keep:
            old.unlink(missing_ok=True)


def compact(directory: str | os.PathLike[str]) -> Path:
    """Merges each table's chain (base and deltas) of a checkpoint into a new base.

    Everything is read and verified first; the new bases are written, then
    the manifest (the commit point), and only then are the old files deleted,
    so a crash leaves either checkpoint intact. A compacted chain keeps its
    identity: the next `save(..., incremental=True)` of a table still writes a
    delta. Ordinary checkpoints are left as they are; in a cluster checkpoint
    every part is compacted.

    Args:
        directory: a directory written by `save`.

    Returns:
        The directory as a `Path`.

    Raises:
        CheckpointError: the checkpoint is missing, corrupted or malformed
            (nothing is changed).
    """
    root = Path(directory).absolute()
    with _chain_lock:
        for part in part_directories(root):
            _compact_part(part)
    return root


def _compact_part(root: Path) -> None:
    manifest = read_manifest(root)
    if manifest["version"] != CHAIN_VERSION:
        return
    try:
        entries: dict[str, dict[str, Any]] = dict(manifest["tables"])
        long = sorted(n for n, e in entries.items() if len(e["links"]) > 1)
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"Checkpoint manifest in {root} is malformed: {e!r}") from e
    if not long:
        return
    _, states = read_shards([root], long)
    token = secrets.token_hex(4)
    for i, name in enumerate(long):
        entry = entries[name]
        base = _write_base(
            root,
            f"table-{i:04d}-{token}.bin",
            states[name],
            int(entry["dim"]),
            int(entry["num_slots"]),
            seq=entry["links"][-1]["seq"],
        )
        entries[name] = {**entry, "links": [base]}
    write_manifest(root, {"format": FORMAT, "version": CHAIN_VERSION, "tables": entries})
    _remove_data_files(root, keep={f for e in entries.values() for f in _link_files(e)})


def clone(source: str | os.PathLike[str], destination: str | os.PathLike[str]) -> Path:
    """Copies the checkpoint in `source` to `destination`, hard-linking its files.

    Data files are never modified in place, so the two directories may share
    them; where the file system has no hard links they are copied. An
    incremental save into the copy continues the source's chains (this is
    how `ee.callbacks.Checkpoint(incremental=True)` gives every checkpoint a
    complete chain while writing only deltas).

    Args:
        source: a directory written by `save`.
        destination: a directory holding no checkpoint; created if missing.

    Returns:
        `destination` as a `Path`.

    Raises:
        CheckpointError: `source` holds no readable manifest or misses a file.
        ValueError: `destination` already holds a checkpoint.
    """
    src, dst = Path(source).absolute(), Path(destination).absolute()
    manifest = read_manifest(src)
    if (dst / MANIFEST).exists():
        raise ValueError(f"`destination` already holds a checkpoint: {dst}")
    dst.mkdir(parents=True, exist_ok=True)
    try:
        if "parts" in manifest:
            for part in part_directories(src):
                clone(part, dst / part.relative_to(src))
            files = []
        else:
            files = [f for e in manifest["tables"].values() for f in _link_files(e)]
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"Checkpoint manifest in {src} is malformed: {e!r}") from e
    for name in files:
        if not (src / name).is_file():
            raise CheckpointError(f"Checkpoint file {src / name} is missing")
        try:
            os.link(src / name, dst / name)
        except OSError:
            shutil.copyfile(src / name, dst / name)
    _write_atomically(dst / MANIFEST, [memoryview((src / MANIFEST).read_bytes())])
    fsync_directory(dst)
    return dst


def _manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, indent=1, sort_keys=True).encode()


def _manifest_digest(manifest: dict[str, Any]) -> str:
    """The SHA-256 of `manifest` less its own checksum, as `write_manifest` writes it."""
    rest = {k: v for k, v in manifest.items() if k != MANIFEST_SHA256}
    return hashlib.sha256(_manifest_bytes(rest)).hexdigest()


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    """Writes `manifest` (with its checksum) atomically; this is a save's commit point."""
    manifest = json.loads(_manifest_bytes(manifest))  # as a reader parses it (keys as str)
    raw = _manifest_bytes({**manifest, MANIFEST_SHA256: _manifest_digest(manifest)})
    _write_atomically(root / MANIFEST, [memoryview(raw)])
    fsync_directory(root)


def remove_unused(root: Path, keep_parts: set[str]) -> None:
    """Removes the parts of older cluster checkpoints (and, after one, table files)."""
    for old in root.glob("parts-*"):
        if old.name not in keep_parts:
            shutil.rmtree(old, ignore_errors=True)
    if keep_parts:
        for old in root.glob("table-*.bin*"):
            old.unlink(missing_ok=True)


def read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"No checkpoint in {root}: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"Checkpoint manifest {path} is corrupted: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an elastic_emb checkpoint manifest")
    version = manifest.get("version")
    if version not in (VERSION, CHAIN_VERSION):
        raise CheckpointError(
            f"{path} has format version {version!r}; this release reads {VERSION} and "
            f"{CHAIN_VERSION}"
        )
    # Manifests of releases before the checksum have none: they are read as they are.
    if MANIFEST_SHA256 in manifest and manifest[MANIFEST_SHA256] != _manifest_digest(manifest):
        raise CheckpointError(
            f"Checkpoint manifest {path} fails its checksum: it is damaged; restore an intact "
            "copy or another checkpoint"
        )
    tables = manifest.get("tables")
    if isinstance(tables, dict):
        for name, entry in tables.items():
            # Version 2 entries are chains, version 1 entries are not: an older
            # release refuses a version 2 manifest instead of reading bases only.
            if isinstance(entry, dict) and ("links" in entry) != (version == CHAIN_VERSION):
                raise CheckpointError(
                    f"Checkpoint manifest {path} is malformed: the entry of table {name!r} "
                    f"does not fit format version {version}"
                )
    return manifest


def _read_data(
    path: Path, what: str, link: dict[str, Any], entry: dict[str, Any], delta: bool
) -> dict[str, np.ndarray]:
    """Checks and parses one data file (`what` names it in errors); native-endian arrays.

    `link` holds the file's `num_rows`, `bytes`, `sha256` (and `num_erased`
    when `delta`); `entry` its table's `dim` and `num_slots`.
    """
    if not path.is_file():
        raise CheckpointError(f"Checkpoint file {path} of {what} is missing")
    num_erased = link["num_erased"] if delta else None
    num_counts = link.get("num_counts", 0)  # written before admission existed: none
    layout = _layout(link["num_rows"], entry["dim"], entry["num_slots"], num_erased, num_counts)
    expected = sum(int(np.prod(shape)) * dtype.itemsize for _, dtype, shape in layout)
    if expected != link["bytes"]:
        erased = f" and {num_erased} erased keys" if delta else ""
        raise CheckpointError(
            f"Checkpoint manifest {path.parent / MANIFEST} is inconsistent for {what} "
            f"({path.name}): {link['num_rows']} "
            f"rows of dim {entry['dim']} with {entry['num_slots']} slots{erased} need {expected} "
            f"bytes, the manifest says {link['bytes']}"
        )
    size = path.stat().st_size
    if size != link["bytes"]:
        raise CheckpointError(
            f"Checkpoint file {path} of {what} is truncated or padded: "
            f"{size} bytes, expected {link['bytes']}"
        )
    if file_sha256(path) != link["sha256"]:
        raise CheckpointError(f"Checkpoint file {path} of {what} fails its checksum")
    raw = path.read_bytes()
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for field, dtype, shape in layout:
        count = int(np.prod(shape))
        arrays[field] = (
            np.frombuffer(raw, dtype, count, offset).reshape(shape).astype(dtype.newbyteorder("="))
        )
        offset += count * dtype.itemsize
    return arrays


def _read_table(root: Path, name: str, entry: dict[str, Any]) -> TableState:
    if "links" in entry:
        return _read_chain(root, name, entry)
    arrays = _read_data(root / entry["file"], f"table {name!r}", entry, entry, delta=False)
    return TableState(**arrays, iterations=int(entry["iterations"]))


def _check_links(root: Path, name: str, entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The links of a chain entry, checked: a base, then deltas in sequence, each naming
    its parent's checksum; CheckpointError naming the first broken link."""
    chain, links = entry["chain"], entry["links"]
    if not isinstance(chain, str) or not isinstance(links, list) or not links:
        raise CheckpointError(
            f"Checkpoint manifest {root / MANIFEST} is malformed: table {name!r} has no chain"
        )
    for i, link in enumerate(links):
        what = f"link {i} ({link['file']}) of table {name!r} in {root / MANIFEST}"
        kind = "base" if i == 0 else "delta"
        if link["kind"] != kind:
            raise CheckpointError(f"Checkpoint chain broken at {what}: a {kind} was expected")
        if i == 0:
            if link["parent"] is not None or link["num_erased"] != 0:
                raise CheckpointError(f"Checkpoint chain broken at {what}: a base has no parent")
            continue
        parent = links[i - 1]
        if link["seq"] != parent["seq"] + 1:
            raise CheckpointError(
                f"Checkpoint chain broken at {what}: sequence {link['seq']} follows {parent['seq']}"
            )
        if link["parent"] != parent["sha256"]:
            raise CheckpointError(
                f"Checkpoint chain broken at {what}: its parent is not {parent['file']}"
            )
    if links[-1]["iterations"] != entry["iterations"]:
        raise CheckpointError(
            f"Checkpoint manifest {root / MANIFEST} is inconsistent for table {name!r}: "
            f"iterations {entry['iterations']}, its last link says {links[-1]['iterations']}"
        )
    return links


def _read_chain(root: Path, name: str, entry: dict[str, Any]) -> TableState:
    """A table's state from its chain: the base, then each delta's erasures and rows.

    Every link is checked (sequence, parent, size, checksum) before any is used.
    """
    links = _check_links(root, name, entry)
    parsed = []
    for i, link in enumerate(links):
        what = f"table {name!r} (link {link['seq']} of its chain, a {link['kind']})"
        arrays = _read_data(root / link["file"], what, link, entry, delta=i > 0)
        erased = arrays.pop("erased", np.zeros(0, np.int64))
        parsed.append((TableState(**arrays, iterations=int(link["iterations"])), erased))
    return _merge_chain(parsed[0][0], parsed[1:])


def _merge_chain(base: TableState, deltas: list[tuple[TableState, np.ndarray]]) -> TableState:
    """Applies deltas, in order, to a base: each removes its erased keys, then sets its rows.

    All at once rather than delta by delta: a key's fate is decided by its
    last mention (a row, or an erasure; within a delta the erasures come
    first), and the base's rows that no delta mentions are kept as they are.
    """
    if not deltas:
        return base
    rows = TableState.concatenate([d for d, _ in deltas])  # every delta row, in link order
    counts = deltas[-1][0].counts  # each link holds the whole sketch: the newest wins
    keys, source, offset = [], [], 0
    for delta, erased in deltas:
        n = len(delta.keys)
        keys += [erased, delta.keys]
        source += [np.full(len(erased), -1, np.int64), np.arange(offset, offset + n)]
        offset += n
    mentioned, origin = np.concatenate(keys), np.concatenate(source)
    _, first_of_reversed = np.unique(mentioned[::-1], return_index=True)
    last = origin[len(mentioned) - 1 - first_of_reversed]  # per key: its newest row, or -1
    untouched = ~np.isin(base.keys, mentioned)
    state = TableState.concatenate([base.select(untouched), rows.select(last[last >= 0])])
    state.iterations = deltas[-1][0].iterations
    state.counts = counts
    return state


def part_directories(root: Path) -> list[Path]:
    """The directories holding table files: `root`, or the parts of a cluster checkpoint."""
    manifest = read_manifest(root)
    if "parts" not in manifest:
        return [root]
    parts = manifest["parts"]
    if not isinstance(parts, list) or not all(isinstance(p, str) for p in parts):
        raise CheckpointError(f"Checkpoint manifest in {root} is malformed: bad `parts`")
    return [root / p for p in parts]


def table_config(name: str, entry: dict[str, Any]) -> dict[str, Any]:
    """The `Table.config()` of a checkpointed table (policies when it has them)."""
    required = {k: entry[k] for k in ("dim", "seed", "optimizer", "initializer")}
    policies: dict[str, Any] = {
        k: entry[k]
        for k in ("nonfinite", "row_dtype", "admission", "eviction", "storage")
        if k in entry
    }
    return {"name": name, **required, **policies}


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
    part = roots[0]
    try:
        for part in dirs:
            for name, entry in sorted(read_manifest(part)["tables"].items()):
                if names is not None and name not in names:
                    continue
                first = entries.setdefault(name, entry)
                if table_config(name, first) != table_config(name, entry):
                    raise CheckpointError(
                        f"Table {name!r} has different configurations in the parts of {roots[0]}"
                    )
                parts.setdefault(name, []).append(_read_table(part, name, entry))
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"Checkpoint manifest {part / MANIFEST} is malformed: {e!r}") from e
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
    # The live table's policies apply; admission counts carry over when the
    # sketches have one shape (else the restore would have to guess them).
    live, saved = table.admission, admission.get(entry.get("admission"))
    if live is not None and saved is not None:
        shape = ("sketch_bytes", "sketch_depth")
        if [getattr(live, f) for f in shape] != [getattr(saved, f) for f in shape]:
            raise CheckpointError(
                f"Table {table.name!r} does not match the checkpoint: its admission sketch is "
                f"{live} live and {saved} in {root}; restore into a table with the "
                "checkpoint's sketch_bytes and sketch_depth"
            )


def forget_changes(tables: list[Table]) -> None:
    """Every row of `tables` counts as changed (they were restored): the next
    incremental save of each writes a base rather than a delta of every row."""
    with _chain_lock:
        for table in tables:
            _marks.pop(table, None)
