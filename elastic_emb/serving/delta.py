"""Deltas of exported models: the next version of a SavedModel from the rows changed.

`ee.export_delta(model, path, since=version)` compares the model's tables
and dense weights with the exported SavedModel `version` and writes only
what differs: per table the rows upserted (in the version's row format) and
the keys erased, and the dense variables whose values changed.
`ee.apply_delta(version, delta)` (or `elastic-emb apply-delta`) writes the
next numbered version directory: `version`'s graph and assets, and its
variables checkpoint with the delta merged in. The result is the SavedModel
a full export of the model would have written (the same keys, rows and
weights, bit for bit), without the model, the PS or a re-trace.

A delta names the version it was made from by the SHA-256 of its variables:
applied to any other, it is refused. Layout of a delta directory:

- `delta.json`: the base's digests, per table the counts, the dense entries;
  the SHA-256 of the data files;
- `delta.index`, `delta.data-00000-of-00001`: a TensorFlow tensor bundle
  with `table/<layer>/{keys,rows,scale,bias,erased}` and `dense/<entry>`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from elastic_emb.persistence.checkpoint import file_sha256
from elastic_emb.serving import export as serving
from elastic_emb.serving.export import Servable
from elastic_emb.tables.rows import export_rows

if TYPE_CHECKING:
    import keras

__all__ = ["apply_delta", "export_delta"]

FORMAT, VERSION = "elastic_emb.saved_model_delta", 1
DELTA = "delta.json"
BUNDLE = "delta"  # the tensor bundle's prefix in a delta directory
_CHUNK_ROWS = 1 << 18  # rows compared at a time


def export_delta(
    model: keras.Model, layers: Sequence[Servable], path: Any, since: Any
) -> dict[str, Any]:
    """Writes the changes of `model` (its ee.Embedding `layers`) since the exported
    SavedModel `since` to `path`.

    Args:
        model: the model `since` was exported from (the same layers, tables and
            dense variables), trained further.
        path: the delta directory to write (must not exist).
        since: a SavedModel directory written by `ee.export_saved_model`,
            `model.export` or `ee.apply_delta`: the version serving has.

    Returns:
        The delta's description (`delta.json`): rows upserted and keys erased
        per table, dense entries changed, bytes.

    Raises:
        ValueError: `since` has no elastic_emb manifest, or holds something a
            delta cannot update; the model's layers, tables or dense variables
            differ from those exported; `path` exists.
    """
    path, base = Path(path), Path(since)
    manifest = serving.read_manifest(base)
    if manifest["not_updatable"]:
        raise ValueError(
            f"The SavedModel {str(base)!r} cannot be updated by deltas: "
            f"{manifest['not_updatable']}. Export full models instead."
        )
    _check_absent(path)
    reader = tf.train.load_checkpoint(serving.variables_prefix(base))
    by_name = {layer.name: layer for layer in layers}
    if sorted(by_name) != sorted(manifest["tables"]):
        raise ValueError(
            f"The model's ee.Embedding layers {sorted(by_name)} are not those exported in "
            f"{str(base)!r} ({sorted(manifest['tables'])}): export a full model."
        )
    tensors: dict[str, np.ndarray] = {}
    tables = {}
    for name, entry in sorted(manifest["tables"].items()):
        _check_same_table(by_name[name], entry, base)
        old = {f: reader.get_tensor(key)[:-1] for f, key in entry["entries"].items()}
        new = serving.table_columns(export_rows(by_name[name].table, entry["row_dtype"]))
        upserted, erased = _changes(old, new)
        order = np.argsort(new["keys"][upserted])
        for field, array in new.items():
            tensors[f"table/{name}/{field}"] = array[upserted][order]
        tensors[f"table/{name}/erased"] = erased
        tables[name] = {"upserted": int(upserted.sum()), "erased": len(erased)}
    dense = []
    values = _dense_values(model, manifest, base)
    for key, value in values.items():
        exported = reader.get_tensor(key)
        if not _same_kind(exported, value):
            raise ValueError(
                f"The model's variable {manifest['dense'][key]!r} is {value.dtype}{value.shape}, "
                f"exported in {str(base)!r} as {exported.dtype}{exported.shape}: export a full "
                "model."
            )
        if not _same(exported, value):
            dense.append(key)
    tensors |= {f"dense/{key}": values[key] for key in dense}
    description = {
        "format": FORMAT,
        "version": VERSION,
        "id": secrets.token_hex(8),
        "base_variables_sha256": manifest["variables_sha256"],
        "base_graph_sha256": manifest["graph_sha256"],
        "tables": tables,
        "dense": dense,
    }
    _write_delta(path, tensors, description)
    return _read_description(path)


def apply_delta(base: Any, delta: Any, output: Any = None) -> Path:
    """Writes the version of `base` updated by `delta` as a new SavedModel directory.

    The directory appears complete or not at all (written beside, then
    renamed), so a TF Serving watching the model's base path never loads a
    partial version.

    Args:
        base: the SavedModel directory the delta was made from (`since=`).
        delta: a directory written by `ee.export_delta`.
        output: the directory to write (must not exist); by default the next
            version number beside `base` (`/models/ctr/7` -> `/models/ctr/8`).

    Returns:
        The directory written.

    Raises:
        ValueError: the delta was made from another version than `base` (or
            `base` changed since), a file of the delta is damaged, or `output`
            exists.
    """
    base, delta = Path(base), Path(delta)
    manifest = serving.read_manifest(base)
    description = _read_description(delta)
    output = _next_version(base) if output is None else Path(output)
    _check_absent(output)
    digest = serving.variables_digest(base)
    wanted = description["base_variables_sha256"]
    if description["base_graph_sha256"] != manifest["graph_sha256"] or wanted != digest:
        raise ValueError(
            f"The delta {str(delta)!r} was made from another version than {str(base)!r} "
            f"(variables SHA-256 {wanted[:16]}…, this one {digest[:16]}…): apply it to the "
            "version given as since= when it was exported, or to an unchanged copy of it."
        )
    if sorted(description["tables"]) != sorted(manifest["tables"]):
        raise ValueError(f"The delta's tables do not fit {str(base)!r}")
    changes = tf.train.load_checkpoint(str(delta / BUNDLE))
    reader = tf.train.load_checkpoint(serving.variables_prefix(base))
    tensors = {key: reader.get_tensor(key) for key in reader.get_variable_to_dtype_map()}
    for name, entry in sorted(manifest["tables"].items()):
        keys = entry["entries"]
        old = {f: tensors[key][:-1] for f, key in keys.items()}
        upserts = {f: changes.get_tensor(f"table/{name}/{f}") for f in keys}
        merged = _merge(old, upserts, changes.get_tensor(f"table/{name}/erased"))
        for field, key in keys.items():
            tensors[key] = merged[field]
        entry["rows"] = len(merged["keys"]) - 1
    for key in description["dense"]:
        value = changes.get_tensor(f"dense/{key}")
        if key not in tensors or not _same_kind(tensors[key], value):
            raise ValueError(f"The delta's dense entry {key!r} does not fit {str(base)!r}")
        tensors[key] = value
    tmp = output.with_name(f".{output.name}.tmp-{secrets.token_hex(4)}")
    try:
        _write_version(base, tmp, tensors)
        manifest["variables_sha256"] = serving.variables_digest(tmp)
        applied = {"delta": description["id"], "base_variables_sha256": digest}
        applied["applied"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        manifest["history"] = [*manifest["history"], applied]
        serving.save_manifest(tmp, manifest)
        os.rename(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output


# Export.


def _check_absent(path: Path) -> None:
    if path.exists():
        raise ValueError(f"{str(path)!r} exists: give a new directory")


def _check_same_table(layer: Any, entry: dict[str, Any], base: Path) -> None:
    """Refuses a layer whose table differs from the exported one in what the graph holds."""
    table = layer.table
    now = {
        "table": table.name,
        "dim": table.dim,
        "initializer": dataclasses.asdict(table.initializer),
        "seed": table.seed,
    }
    was = {field: entry[field] for field in now}
    if json.loads(json.dumps(now)) != was:
        raise ValueError(
            f"The table of layer {layer.name!r} is {now}, exported in {str(base)!r} as {was}: "
            "export a full model."
        )


def _changes(
    old: dict[str, np.ndarray], new: dict[str, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """(mask of `new`'s rows not in `old` as they are, keys of `old` not in `new`). `old`
    holds sorted keys and their rows, `new` keys in any order; rows are compared by bytes
    (NaNs included), a chunk at a time into one buffer (fresh memory is slow to touch)."""
    old_keys, new_keys = old["keys"], new["keys"]
    if not len(old_keys):
        return np.ones(len(new_keys), bool), old_keys
    order = np.argsort(new_keys)
    position = np.empty_like(order)
    position[order] = np.searchsorted(old_keys, new_keys[order])  # sorted: cache-friendly
    np.minimum(position, len(old_keys) - 1, out=position)
    same = old_keys[position] == new_keys
    kept = np.zeros(len(old_keys), bool)
    kept[position[same]] = True
    for field in sorted(new.keys() - {"keys"}):
        was, now = serving.row_items(old[field]), serving.row_items(new[field])
        buffer = np.empty(min(len(now), _CHUNK_ROWS), was.dtype)
        for start in range(0, len(now), _CHUNK_ROWS):
            chunk = slice(start, start + _CHUNK_ROWS)
            gathered = np.take(was, position[chunk], out=buffer[: len(now[chunk])])
            same[chunk] &= gathered == now[chunk]
    return ~same, old_keys[~kept]


def _dense_values(model: keras.Model, manifest: dict[str, Any], base: Path) -> dict[str, Any]:
    """The model's value of each dense entry of the manifest, by checkpoint key."""
    by_path: dict[str, list[Any]] = {}
    for variable in model.variables:
        by_path.setdefault(variable.path, []).append(variable)
    values = {}
    for key, name in manifest["dense"].items():
        owners = by_path.get(name, [])
        if len(owners) != 1:
            raise ValueError(
                f"The model has {len(owners)} variables named {name!r}, exported in "
                f"{str(base)!r} as one: export a full model."
            )
        values[key] = np.asarray(owners[0].value)
    return values


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return _same_kind(a, b) and a.tobytes() == b.tobytes()


def _same_kind(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype


def _write_delta(path: Path, tensors: dict[str, np.ndarray], description: dict[str, Any]) -> None:
    """Writes a delta directory: the bundle, then `delta.json`, then the rename."""
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        tmp.mkdir(parents=True)
        _save_bundle(str(tmp / BUNDLE), tensors)
        description["files"] = {f.name: file_sha256(f) for f in sorted(tmp.iterdir())}
        description["bytes"] = sum(f.stat().st_size for f in tmp.iterdir())
        (tmp / DELTA).write_text(json.dumps(description, indent=1, sort_keys=True))
        os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _save_bundle(prefix: str, tensors: dict[str, np.ndarray]) -> None:
    """Writes `tensors` as a TensorFlow tensor bundle (a checkpoint's format) at `prefix`."""
    names = sorted(tensors)
    tf.raw_ops.SaveV2(
        prefix=prefix,
        tensor_names=names,
        shape_and_slices=[""] * len(names),
        tensors=[_as_tensor(tensors[name]) for name in names],
    )


def _as_tensor(array: Any) -> tf.Tensor:
    """`array` as an eager tensor: sharing its memory where DLPack can (a copy of a
    table's rows is not free), else a copy (bfloat16, strings)."""
    try:
        return tf.experimental.dlpack.from_dlpack(np.ascontiguousarray(array).__dlpack__())
    except (AttributeError, BufferError, TypeError, ValueError):
        return tf.constant(array)


# Apply.


def _read_description(delta: Path) -> dict[str, Any]:
    """`delta.json` of a delta directory, its files checked against their digests."""
    try:
        description = json.loads((delta / DELTA).read_text())
        if description["format"] != FORMAT or description["version"] != VERSION:
            raise ValueError(f"format {description['format']!r}")
        files = description["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"{str(delta)!r} is not a delta written by ee.export_delta ({err})"
        ) from None
    for name, digest in files.items():
        if not (delta / name).exists() or file_sha256(delta / name) != digest:
            raise ValueError(f"The delta file {str(delta / name)!r} is missing or damaged")
    return dict(description)


def _merge(
    old: dict[str, np.ndarray], upserts: dict[str, np.ndarray], erased: np.ndarray
) -> dict[str, np.ndarray]:
    """`old`'s rows without the `erased` and upserted keys, plus the upserts, sorted by key,
    as a `ServingTable`'s variables (sentinel and zero row included). Both hold sorted keys."""
    old_keys, new_keys = old["keys"], upserts["keys"]
    if not (np.diff(new_keys) > 0).all():
        raise ValueError("The delta's keys are not sorted: it is damaged")
    dropped = np.zeros(len(old_keys), bool)
    for keys, must_exist in ((new_keys, False), (erased, True)):
        position = np.minimum(np.searchsorted(old_keys, keys), max(len(old_keys) - 1, 0))
        found = old_keys[position] == keys if len(old_keys) else np.zeros(len(keys), bool)
        if must_exist and not found.all():
            raise ValueError("The delta erases keys its base does not hold: it does not fit")
        dropped[position[found]] = True
    kept = ~dropped
    size = int(kept.sum()) + len(new_keys)
    # Each upserted row goes after the kept rows with smaller keys and the upserts before it.
    inserted = np.zeros(size, bool)
    destination = np.searchsorted(old_keys[kept], new_keys) + np.arange(len(new_keys))
    inserted[destination] = True
    merged = {}
    for field, array in old.items():
        out = np.zeros((size + 1, *array.shape[1:]), array.dtype)  # + the sentinel's row
        items = serving.row_items(out)  # a view: writes land in `out`
        items[:size][~inserted] = serving.row_items(array)[kept]
        items[destination] = serving.row_items(upserts[field])
        merged[field] = out
    merged["keys"][-1] = serving.SENTINEL
    return merged


def _next_version(base: Path) -> Path:
    """The next numbered version directory beside `base` (TF Serving's layout)."""
    if not base.resolve().name.isdigit():
        raise ValueError(
            f"{str(base)!r} is not a numbered version directory: give output= explicitly"
        )
    numbers = [int(p.name) for p in base.resolve().parent.iterdir() if p.name.isdigit()]
    return base.resolve().parent / str(max(numbers) + 1)


def _write_version(base: Path, output: Path, tensors: dict[str, np.ndarray]) -> None:
    """`base`'s SavedModel at `output` with `tensors` as its variables."""
    output.mkdir(parents=True)
    shutil.copy2(base / "saved_model.pb", output / "saved_model.pb")
    for folder in ("assets", "assets.extra"):
        if (base / folder).is_dir():
            shutil.copytree(base / folder, output / folder)
    (output / "variables").mkdir()
    _save_bundle(serving.variables_prefix(output), tensors)
    serving.record_table_shapes(output)  # (and its fingerprint)
