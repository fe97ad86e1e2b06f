"""Export to a SavedModel that serves with stock TensorFlow ops only.

`ee.export_saved_model(model, path)` and `model.export(path)` (routed here
by `keras_patches`) snapshot each `ee.Embedding` table into built-in ops:

- a `tf.lookup.StaticHashTable` from key to row index,
- a `tf.Variable` holding the rows (one extra zero row for ids not found),
- for ids never trained, their initial value, computed by the same formulas
  as the C++ initializer (`csrc/initializer.cc`) in TensorFlow ops, so the
  SavedModel predicts like `model.predict` on seen and unseen ids.

The layer's own code (key hashing, combiners, masks, ragged and sparse ids)
runs unchanged around the lookup. The SavedModel needs neither elastic_emb
nor any custom op: TF Serving loads it as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from elastic_emb.initializers import InitializerSpec
from elastic_emb.rows import export_rows

if TYPE_CHECKING:
    import keras

    from elastic_emb.layers import Embedding  # (for types only: layers imports this module)

__all__ = ["MAX_EXPORT_ROWS", "ServingTable", "export", "initial_rows", "serving"]

# The key -> index map is a graph constant (16 bytes a row), and a GraphDef
# must stay below 2 GiB: above this many rows per table the export refuses.
MAX_EXPORT_ROWS = 64 << 20

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


class ServingTable(tf.Module):
    """A snapshot of a table as stock ops: key -> index hash table, rows variable, initializer.

    `row_dtype` (`elastic_emb.rows.ROW_DTYPES`): how the rows variable stores
    the rows; float16, bfloat16 and int8 (with a float32 scale and bias per
    row) are turned back into float32 by the lookup.
    """

    def __init__(self, layer: Embedding, row_dtype: str = "float32") -> None:
        super().__init__(name=f"{layer.name}_serving")
        table = layer.table
        compact = export_rows(table, row_dtype)
        keys, values = compact.keys, compact.values
        if len(keys) > MAX_EXPORT_ROWS:
            raise ValueError(
                f"Table {table.name!r} has {len(keys):,} rows; a SavedModel's key index holds at "
                f"most elastic_emb.serving.MAX_EXPORT_ROWS = {MAX_EXPORT_ROWS:,} (a GraphDef "
                "stays below 2 GiB). Serve larger tables from PS shards (docs/keras.md)."
            )
        m = len(keys)
        indices = np.arange(m, dtype=np.int64)
        if m == 0:  # a hash table cannot be empty: one entry that reads as "not found"
            keys, indices = np.zeros(1, np.int64), np.zeros(1, np.int64)
        self.index = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(tf.constant(keys), tf.constant(indices)),
            default_value=m,  # index m: not found (the extra zero row)
        )
        self.rows = tf.Variable(
            np.concatenate([values, np.zeros((1, table.dim), values.dtype)]),
            trainable=False,
            name="rows",
        )
        self.scale = self.bias = None
        if compact.scale is not None and compact.bias is not None:  # int8
            self.scale = tf.Variable(
                np.append(compact.scale, np.float32(0)), trainable=False, name="scale"
            )
            self.bias = tf.Variable(
                np.append(compact.bias, np.float32(0)), trainable=False, name="bias"
            )
        self.num_rows = m
        self.initializer = table.initializer
        self.seed = table.seed
        self.dim = table.dim

    def lookup(self, flat_ids: tf.Tensor) -> tf.Tensor:
        """Rows of int64 ids (n,) -> float32 (n, dim): trained rows, else initial values."""
        index = self.index.lookup(flat_ids)
        found = index < self.num_rows
        rows = tf.cast(tf.gather(self.rows, index), tf.float32)
        if self.scale is not None and self.bias is not None:  # int8 levels -> values
            rows = (rows + 128.0) * tf.gather(self.scale, index)[:, None] + tf.gather(
                self.bias, index
            )[:, None]
        initial = initial_rows(flat_ids, self.initializer, self.seed, self.dim)
        return tf.where(found[:, None], rows, initial)


@contextlib.contextmanager
def serving(layers: list[Embedding], row_dtype: str = "float32") -> Iterator[None]:
    """Within: these ee.Embedding layers look rows up in stock-op snapshots."""
    attached = []
    try:
        for layer in layers:
            if layer.serving_table is None:
                layer.serving_table = ServingTable(layer, row_dtype)
                attached.append(layer)
        yield
    finally:
        for layer in attached:
            layer.serving_table = None


def export(
    model: keras.Model,
    layers: list[Embedding],
    path: Any,
    input_signature: Any = None,
    verbose: bool = False,
    row_dtype: str = "float32",
    **kwargs: Any,
) -> None:
    """`ee.export_saved_model` (see `elastic_emb.layers.export_saved_model`) for `layers`."""
    composite = [
        spec
        for spec in tf.nest.flatten(input_signature or [])
        if isinstance(spec, tf.TypeSpec) and not isinstance(spec, tf.TensorSpec)
    ]
    with serving(layers, row_dtype):
        if not composite:
            model.export(path, format="tf_saved_model", input_signature=input_signature,
                         verbose=verbose, **kwargs)  # fmt: skip
            return
        import keras

        # Keras' export takes dense inputs only: trace the endpoint ourselves.
        archive = keras.export.ExportArchive()
        archive.track(model)
        serve = tf.function(lambda *inputs: model(*inputs, training=False), autograph=False)
        serve.get_concrete_function(*input_signature)
        archive.add_endpoint("serve", serve)
        archive.write_out(str(path), verbose=verbose)
