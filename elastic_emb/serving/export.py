"""Export to a SavedModel that serves with stock TensorFlow ops only.

`ee.export_saved_model(model, path)` and `model.export(path)` (routed here
by `keras_patches`) snapshot each `ee.Embedding` table into built-in ops:

- a `tf.Variable` of the sorted keys, searched with `tf.searchsorted`,
- a `tf.Variable` holding the rows in that order,
- for ids never trained, their initial value, computed by the same formulas
  as the C++ initializer (`csrc/initializer.cc`) in TensorFlow ops, so the
  SavedModel predicts like `model.predict` on seen and unseen ids.

The layer's own code (key hashing, combiners, masks, ragged and sparse ids)
runs unchanged around the lookup. The SavedModel needs neither elastic_emb
nor any custom op: TF Serving loads it as it is.

Every table and dense weight is a variable, so the whole state of the model
is in its `variables/` checkpoint. `assets.extra/elastic_emb.json` (the
manifest; TF Serving ignores `assets.extra`) names the checkpoint entry of
each, so that `elastic_emb.serving.delta` can write a later version of the
model by rewriting that checkpoint alone.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import inspect
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import tensorflow as tf

from elastic_emb.persistence.checkpoint import file_sha256, hash_file
from elastic_emb.tables.policies.initializers import InitializerSpec
from elastic_emb.tables.rows import CompactRows, export_rows
from elastic_emb.tables.table import Table

if TYPE_CHECKING:
    import keras


__all__ = [
    "MANIFEST",
    "ServingTable",
    "export",
    "initial_rows",
    "read_manifest",
    "saved_state",
    "serving",
    "serving_arrays",
    "table_columns",
]

MANIFEST = Path("assets.extra") / "elastic_emb.json"
FORMAT, VERSION = "elastic_emb.saved_model", 1
SERVING_SCOPE = "elastic_emb_serving"  # the name of each ServingTable variable starts so
SENTINEL = np.iinfo(np.int64).max  # the last key of every table, found by no lookup
OBJECT_GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"  # the checkpoint's own entry

_U64 = tf.uint64


def _u64(value: int) -> tf.Tensor:
    return tf.constant(value, _U64)


def _mix64(x: tf.Tensor) -> tf.Tensor:
    """splitmix64's finalizer, as `Mix64` in csrc/initializer.h (uint64, wrapping)."""
    x = x + _u64(0x9E3779B97F4A7C15)
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, _u64(30))) * _u64(0xBF58476D1CE4E5B9)
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, _u64(27))) * _u64(0x94D049BB133111EB)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, _u64(31)))


def _standard_normal(base: tf.Tensor, counter: tf.Tensor) -> tf.Tensor:
    """Box-Muller draw `counter` of stream `base`, as `StandardNormal` in initializer.cc."""
    h1 = _mix64(tf.bitwise.bitwise_xor(base, _mix64(_u64(2) * counter)))
    h2 = _mix64(tf.bitwise.bitwise_xor(base, _mix64(_u64(2) * counter + _u64(1))))
    scale = 1.0 / 9007199254740992.0  # 2^-53
    u1 = (tf.cast(tf.bitwise.right_shift(h1, _u64(11)), tf.float64) + 1.0) * scale
    u2 = tf.cast(tf.bitwise.right_shift(h2, _u64(11)), tf.float64) * scale
    z = tf.sqrt(-2.0 * tf.math.log(u1)) * tf.cos(6.283185307179586 * u2)
    return tf.cast(z, tf.float32)


def initial_rows(keys: tf.Tensor, spec: InitializerSpec, seed: int, dim: int) -> tf.Tensor:
    """The initial rows of int64 `keys` (n,) -> float32 (n, dim), in stock TensorFlow ops."""
    a, b = np.float32(spec.a), np.float32(spec.b)
    n = tf.shape(keys)[0]
    if spec.kind in ("zeros", "ones", "constant"):
        value = {"zeros": 0.0, "ones": 1.0}.get(spec.kind, a)
        return tf.fill([n, dim], tf.constant(value, tf.float32))
    k = tf.bitcast(tf.cast(keys, tf.int64), _U64)
    base = _mix64(tf.bitwise.bitwise_xor(_u64(seed & (2**64 - 1)), _mix64(k)))[:, None]
    columns = tf.range(dim, dtype=tf.int64)
    counter = tf.broadcast_to(tf.bitcast(columns, _U64)[None, :], [n, dim])
    if spec.kind == "uniform":
        bits = _mix64(base + counter)
        u = tf.cast(tf.bitwise.right_shift(bits, _u64(40)), tf.float32) * np.float32(
            1.0 / 16777216.0
        )
        return a + (b - a) * u
    z = _standard_normal(base, counter)
    if spec.kind == "truncated_normal":
        # Redraw beyond two standard deviations from counters j + dim, j + 2 dim, ...
        def redraw(z: tf.Tensor, counter: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            bad = tf.abs(z) > 2.0
            counter = tf.where(bad, counter + _u64(dim), counter)
            return tf.where(bad, _standard_normal(base, counter), z), counter

        z, _ = tf.while_loop(
            lambda z, _: tf.reduce_any(tf.abs(z) > 2.0), redraw, (z, counter), parallel_iterations=1
        )
    return a + b * z


class Servable(Protocol):
    """What export needs of a layer (`ee.Embedding` is one): its name, its table, and a
    place for its `ServingTable` while the model is exported (its lookups then use it)."""

    name: str
    table: Table
    serving_table: ServingTable | None


class ServingTable(tf.Module):
    """A snapshot of a table as stock ops: sorted keys, rows, initializer.

    The keys are a sorted int64 variable ending in a sentinel (the largest
    int64) and the rows a variable in the same order ending in a zero row;
    a lookup binary-searches the keys (`tf.searchsorted`). Both are
    variables of unknown length, so a delta (`elastic_emb.serving.delta`)
    can change the rows of an exported model by rewriting its variables
    only. `row_dtype` (`elastic_emb.tables.rows.ROW_DTYPES`): how the rows
    variable stores the rows; float16, bfloat16 and int8 (with a float32
    scale and bias per row) are turned back into float32 by the lookup.
    """

    def __init__(self, layer: Servable, number: int, row_dtype: str = "float32") -> None:
        super().__init__(name=f"{layer.name}_serving")
        table = layer.table
        self.layer_name, self.table_name = layer.name, table.name
        self.row_dtype = row_dtype
        arrays = serving_arrays(export_rows(table, row_dtype))
        self.num_rows = len(arrays["keys"]) - 1
        self.variable_names = {field: f"{SERVING_SCOPE}/{number}/{field}" for field in arrays}
        variables = {
            field: tf.Variable(
                array,
                shape=tf.TensorShape([None, *array.shape[1:]]),
                trainable=False,
                name=self.variable_names[field],
            )
            for field, array in arrays.items()
        }
        self.keys, self.rows = variables["keys"], variables["rows"]
        self.scale, self.bias = variables.get("scale"), variables.get("bias")
        self.initializer = table.initializer
        self.seed = table.seed
        self.dim = table.dim

    def lookup(self, flat_ids: tf.Tensor) -> tf.Tensor:
        """Rows of int64 ids (n,) -> float32 (n, dim): trained rows, else initial values."""
        position = tf.searchsorted(self.keys, flat_ids, side="left", out_type=tf.int64)
        sentinel = tf.shape(self.keys, out_type=tf.int64)[0] - 1
        position = tf.minimum(position, sentinel)
        found = (tf.gather(self.keys, position) == flat_ids) & (position < sentinel)
        rows = tf.cast(tf.gather(self.rows, position), tf.float32)
        if self.scale is not None and self.bias is not None:  # int8 levels -> values
            scale = tf.gather(self.scale, position)[:, None]
            rows = (rows + 128.0) * scale + tf.gather(self.bias, position)[:, None]
        initial = initial_rows(flat_ids, self.initializer, self.seed, self.dim)
        return tf.where(found[:, None], rows, initial)


def serving_arrays(compact: CompactRows) -> dict[str, np.ndarray]:
    """The variables of a `ServingTable` holding `compact`: keys sorted, then the sentinel
    (keys), rows in that order, then a zero row (rows; scale and bias for int8)."""
    columns = table_columns(compact)
    order = np.argsort(columns["keys"], kind="stable")
    arrays = {}
    for field, column in columns.items():
        out = np.zeros((len(column) + 1, *column.shape[1:]), column.dtype)
        np.take(row_items(column), order, out=row_items(out)[:-1])
        arrays[field] = out
    arrays["keys"][-1] = SENTINEL
    return arrays


def table_columns(compact: CompactRows) -> dict[str, np.ndarray]:
    """`keys`, `rows` (and `scale`, `bias` for int8) of `compact`, as its variables name them."""
    columns = {"keys": compact.keys, "rows": compact.values}
    if compact.scale is not None and compact.bias is not None:
        columns |= {"scale": compact.scale, "bias": compact.bias}
    return columns


def row_items(array: np.ndarray) -> np.ndarray:
    """Each row of `array` as one opaque item, `(m,)`: gathered whole, compared by bytes."""
    row_bytes = array.dtype.itemsize * int(np.prod(array.shape[1:]))
    flat = np.ascontiguousarray(array).reshape(len(array), -1 if len(array) else 0)
    return flat.view(np.dtype((np.void, row_bytes))).reshape(len(array))


@contextlib.contextmanager
def serving(
    model: keras.Model, layers: Sequence[Servable], row_dtype: str = "float32", path: Any = None
) -> Iterator[None]:
    """Within: these ee.Embedding layers look rows up in stock-op snapshots.

    With `path`, a SavedModel written there within gets its manifest on
    leaving (by the outermost of nested contexts, the one that took them).
    """
    attached = []
    try:
        for number, layer in enumerate(layers):
            if layer.serving_table is None:
                layer.serving_table = ServingTable(layer, number, row_dtype)
                attached.append(layer)
        yield
        if attached and path is not None and (Path(path) / "saved_model.pb").exists():
            record_table_shapes(Path(path))
            tables = [t for layer in attached if (t := layer.serving_table) is not None]
            write_manifest(Path(path), model, tables)
    finally:
        for layer in attached:
            layer.serving_table = None


def export(
    model: keras.Model,
    layers: Sequence[Servable],
    path: Any,
    input_signature: Any = None,
    verbose: bool = False,
    row_dtype: str = "float32",
    **kwargs: Any,
) -> None:
    """`ee.export_saved_model` (see `elastic_emb.keras.models.export_saved_model`) for `layers`."""
    composite = [
        spec
        for spec in tf.nest.flatten(input_signature or [])
        if isinstance(spec, tf.TypeSpec) and not isinstance(spec, tf.TensorSpec)
    ]
    # Keras < 3.8's export takes no input signature, and < 3.6 no `verbose`.
    takes = inspect.signature(model.export).parameters
    if "verbose" in takes:
        kwargs["verbose"] = verbose
    with serving(model, layers, row_dtype, path):
        if not composite and (input_signature is None or "input_signature" in takes):
            if input_signature is not None:
                kwargs["input_signature"] = input_signature
            model.export(path, format="tf_saved_model", **kwargs)
            return
        import keras

        # Keras' export takes dense inputs only: trace the endpoint ourselves.
        archive = keras.export.ExportArchive()
        archive.track(model)
        serve = tf.function(lambda *inputs: model(*inputs, training=False), autograph=False)
        serve.get_concrete_function(*input_signature)
        archive.add_endpoint("serve", serve)
        if "verbose" in inspect.signature(archive.write_out).parameters:
            archive.write_out(str(path), verbose=verbose)
        else:
            archive.write_out(str(path))


# The manifest.


def variables_prefix(path: Path) -> str:
    """The checkpoint prefix of the SavedModel at `path`."""
    return str(path / "variables" / "variables")


def variables_digest(path: Path) -> str:
    """SHA-256 of the SavedModel's `variables/` files (names and contents)."""
    digest = hashlib.sha256()
    for file in sorted((path / "variables").iterdir()):
        digest.update(file.name.encode() + b"\0")
        hash_file(digest, file)
    return digest.hexdigest()


def graph_digest(path: Path) -> str:
    """SHA-256 of the SavedModel's graph (`saved_model.pb`)."""
    return file_sha256(path / "saved_model.pb")


def checkpoint_entries(reader: Any) -> list[tuple[str, str, str]]:
    """(checkpoint key, attribute, full name) of each entry of a TF2 checkpoint."""
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor(OBJECT_GRAPH))
    attributes = [a for node in graph.nodes for a in node.attributes]
    return [(a.checkpoint_key, a.name, a.full_name) for a in attributes]


def record_table_shapes(path: Path) -> None:
    """Writes the rows of each table variable into the SavedModel's object graph.

    The variables are created with `None` rows, so that a delta can change
    their number, and so the graph and its functions take any; the object
    graph records the number this version holds, so that loaders which copy
    the variables into new ones (`keras.layers.TFSMLayer`) know their shapes.
    """
    from tensorflow.core.protobuf import saved_model_pb2

    reader = tf.train.load_checkpoint(variables_prefix(path))
    shapes = reader.get_variable_to_shape_map()
    by_name = {
        name: shapes[key]
        for key, attribute, name in checkpoint_entries(reader)
        if attribute == "VARIABLE_VALUE" and name.startswith(SERVING_SCOPE + "/")
    }
    saved = saved_model_pb2.SavedModel()
    saved.ParseFromString((path / "saved_model.pb").read_bytes())
    for node in saved.meta_graphs[0].object_graph_def.nodes:
        if node.WhichOneof("kind") == "variable" and node.variable.name in by_name:
            node.variable.shape.CopyFrom(tf.TensorShape(by_name[node.variable.name]).as_proto())
    (path / "saved_model.pb").write_bytes(saved.SerializeToString())
    write_fingerprint(path)


def write_fingerprint(path: Path) -> None:
    """`fingerprint.pb` of the SavedModel at `path` (TensorFlow's own function, where it
    has one)."""
    try:
        from tensorflow.python.saved_model.pywrap_saved_model import fingerprinting

        (path / "fingerprint.pb").write_bytes(fingerprinting.CreateFingerprintDef(str(path)))
    except (ImportError, AttributeError):  # optional: loaders do without it
        pass


def write_manifest(path: Path, model: keras.Model, tables: list[ServingTable]) -> None:
    """Writes the manifest of the SavedModel just exported at `path`.

    Each entry of its checkpoint is either a variable of a `ServingTable`
    or, by its full name (the Keras path), one variable of `model` holding
    the same value; anything else (another resource, an ambiguous path)
    makes the model one that deltas cannot update, with the reason kept.
    """
    reader = tf.train.load_checkpoint(variables_prefix(path))
    by_path = collections.defaultdict(list)
    for variable in model.variables:
        by_path[variable.path].append(variable)
    served, dense, problems = {}, {}, []
    for key, attribute, name in checkpoint_entries(reader):
        if attribute == "VARIABLE_VALUE" and name.startswith(SERVING_SCOPE + "/"):
            served[name] = key
            continue
        owners = by_path.get(name, []) if attribute == "VARIABLE_VALUE" else []
        if len(owners) == 1 and _same(reader.get_tensor(key), np.asarray(owners[0].value)):
            dense[key] = name
        else:
            problems.append(f"checkpoint entry {key!r} ({name!r}) is not one variable of the model")
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "variables_sha256": variables_digest(path),
        "graph_sha256": graph_digest(path),
        "tables": {
            table.layer_name: {
                "table": table.table_name,
                "dim": table.dim,
                "row_dtype": table.row_dtype,
                "initializer": dataclasses.asdict(table.initializer),
                "seed": table.seed,
                "rows": table.num_rows,
                "entries": {f: served[name] for f, name in table.variable_names.items()},
            }
            for table in tables
        },
        "dense": dense,
        "not_updatable": problems[0] if problems else None,
        "history": [],
    }
    save_manifest(path, manifest)


def save_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Writes `manifest` into the SavedModel at `path` (atomically)."""
    target = path / MANIFEST
    target.parent.mkdir(exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, target)


def read_manifest(path: Any) -> dict[str, Any]:
    """The manifest of the SavedModel at `path`.

    Raises:
        ValueError: `path` is no SavedModel written by `ee.export_saved_model`
            or `model.export` of this elastic_emb (or its manifest is damaged).
    """
    path = Path(path)
    if not (path / "saved_model.pb").exists():
        raise ValueError(f"{str(path)!r} is not a SavedModel directory (no saved_model.pb)")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        if manifest["format"] != FORMAT or manifest["version"] != VERSION:
            raise ValueError(f"format {manifest['format']!r} version {manifest['version']!r}")
        return dict(manifest)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"The SavedModel {str(path)!r} has no elastic_emb manifest ({MANIFEST}) of version "
            f"{VERSION} ({err}): it was not exported by ee.export_saved_model or model.export "
            "of this elastic_emb. Export a full model first."
        ) from None


def saved_state(path: Any) -> dict[str, np.ndarray]:
    """What the SavedModel at `path` serves: each table's variables (`"<layer>/keys"`,
    `"<layer>/rows"`, ...) and each dense variable (by its Keras path)."""
    path = Path(path)
    manifest = read_manifest(path)
    reader = tf.train.load_checkpoint(variables_prefix(path))
    entries = {
        f"{layer}/{field}": key
        for layer, entry in manifest["tables"].items()
        for field, key in entry["entries"].items()
    }
    entries |= {name: key for key, name in manifest["dense"].items()}
    return {name: reader.get_tensor(key) for name, key in entries.items()}


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal shapes, dtypes and bytes (NaNs included)."""
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
