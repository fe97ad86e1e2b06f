"""`Embedding` on Keras' TensorFlow backend: a drop-in replacement for `keras.layers.Embedding`."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from elastic_emb.keras import lookup
from elastic_emb.keras.base import FLOAT_MANTISSA_BITS, EmbeddingBase

__all__ = ["Embedding", "string_keys"]


def string_keys(strings: tf.Tensor) -> tf.Tensor:
    """Hashes strings to int64 keys with a stable 64-bit fingerprint (FarmHash)."""
    flat = tf.reshape(strings, [-1])
    keys = tf.bitcast(tf.fingerprint(flat), tf.int64)
    return tf.reshape(keys, tf.shape(strings))


@keras.saving.register_keras_serializable(package="elastic_emb")
class Embedding(EmbeddingBase):
    __doc__ = EmbeddingBase.__doc__

    @property
    def fusable(self) -> bool:
        """Whether a model may look this layer's rows up with its others' (`lookup.fused_call`):
        not if a subclass looks its rows up in its own way (overrides `_lookup`)."""
        return type(self)._lookup is Embedding._lookup

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        if not isinstance(inputs, tf.Tensor | tf.RaggedTensor | tf.SparseTensor):
            inputs = tf.convert_to_tensor(inputs)
        rows = self._lookup(self.flat_keys(inputs), training)
        if isinstance(inputs, tf.RaggedTensor) and self.combiner is None:
            # As keras.layers.Embedding: a ragged result, one row per id.
            return self._cast(inputs.with_flat_values(rows))
        if isinstance(inputs, tf.SparseTensor) and self.combiner is None:
            inputs = tf.sparse.to_dense(inputs)
        if isinstance(inputs, tf.RaggedTensor | tf.SparseTensor):
            return self._call_multi_hot(inputs, rows)
        ids_shape = tf.shape(inputs)
        if self.combiner is not None:
            if inputs.shape.rank != 2:
                raise ValueError(
                    "With a `combiner`, dense ids must have shape (batch, k). "
                    f"Received: shape={inputs.shape}"
                )
            rows = tf.reshape(rows, tf.concat([ids_shape, [self.output_dim]], 0))
            return self._cast(self._combine_dense(rows))
        out = tf.reshape(rows, tf.concat([ids_shape, [self.output_dim]], 0))
        return self._cast(out)

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        if not self.mask_zero or isinstance(inputs, tf.RaggedTensor | tf.SparseTensor):
            return None
        return keras.ops.not_equal(inputs, "" if self.key_dtype == "string" else 0)

    @property
    def serving_table(self) -> Any:
        """The stock-op snapshot the layer looks rows up in while exported, else None."""
        return self._serving_table

    @serving_table.setter
    def serving_table(self, value: Any) -> None:
        object.__setattr__(self, "_serving_table", value)

    def _trackable_children(self, save_type: str = "checkpoint", **kwargs: Any) -> Any:
        children = super()._trackable_children(save_type, **kwargs)
        if save_type == "savedmodel":
            if self._serving_table is None:
                raise ValueError(
                    f"elastic_emb.Embedding {self.name!r} reads its rows through Python, which "
                    "a SavedModel cannot hold. Export the Keras model itself, with "
                    "model.export(path), ee.export_saved_model(model, path) or "
                    "tf.saved_model.save(model, path): they write its rows as stock TensorFlow ops."
                )
            children["ee_serving"] = self._serving_table
        return children

    def _cast(self, x: tf.Tensor) -> tf.Tensor:
        return tf.cast(x, self.compute_dtype) if self.compute_dtype != "float32" else x

    def _keys(self, ids: Any) -> tf.Tensor:
        ids = tf.convert_to_tensor(ids) if not isinstance(ids, tf.Tensor) else ids
        if self.key_dtype == "string":
            if ids.dtype != tf.string:
                raise ValueError(
                    f'With key_dtype="string", ids must be strings. Received dtype={ids.dtype.name}'
                )
            return string_keys(ids)
        if not (ids.dtype.is_integer or ids.dtype.is_floating or ids.dtype == tf.bool):
            raise ValueError(
                f"`{self.name}` expects integer ids (int32 or int64). "
                f"Received dtype={ids.dtype.name}"
            )
        if ids.dtype.is_floating:
            return self._exact_float_keys(ids)
        return tf.cast(ids, tf.int64)

    def _exact_float_keys(self, ids: tf.Tensor) -> tf.Tensor:
        """Float ids (e.g. the float32 input a Sequential model without an Input builds)
        cast to int64 as keras.layers.Embedding does, but only while every id is a whole
        number the float holds exactly: a larger one may stand for several ids (2**24 + 1
        reads 2**24 in float32), which would share one row."""
        bits = FLOAT_MANTISSA_BITS[ids.dtype.name]
        exact = tf.reduce_all((tf.abs(ids) < 2.0**bits) & (tf.math.floor(ids) == ids))
        check = tf.debugging.Assert(
            exact,
            [
                f"`{self.name}` received {ids.dtype.name} ids that are not whole numbers below "
                f"2**{bits}: distinct ids may have been merged on their way through a float. "
                "Feed ids as int64: keras.Input(..., dtype='int64'), and the data cast with "
                ".astype('int64'). Ids:",
                ids,
            ],
            summarize=5,
        )
        with tf.control_dependencies([check]):
            return tf.cast(ids, tf.int64)

    def flat_keys(self, inputs: Any) -> tf.Tensor:
        """The int64 keys `call` looks up for `inputs`, flat, in lookup order."""
        if isinstance(inputs, tf.SparseTensor) and self.combiner is None:
            inputs = tf.sparse.to_dense(inputs)  # as keras.layers.Embedding: absent ids are 0
        if isinstance(inputs, tf.RaggedTensor) and self.combiner is None:
            return self._keys(inputs.flat_values)
        if isinstance(inputs, tf.RaggedTensor | tf.SparseTensor):
            return self._keys(self._segments(inputs)[0])
        return tf.reshape(self._keys(inputs), [-1])

    def _lookup(self, flat_ids: tf.Tensor, training: bool | None) -> tf.Tensor:
        """Rows of `flat_ids` (n,) -> (n, dim); their gradient, if computed, is pushed.

        A Functional model looked up the rows of all its layers at once
        before it called them (`elastic_emb.keras.lookup.fused_call`); otherwise
        the layer looks up on its own (`lookup.rows_of`).
        """
        if self._serving_table is not None:  # exporting: stock ops only
            return self._serving_table.lookup(flat_ids)
        rows = lookup.take(self)
        if rows is None:
            rows = lookup.rows_of([(self, flat_ids)], training)[0]
        return rows

    def _segments(self, inputs: Any) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """(flat ids, example index of each id, number of examples) of multi-hot ids."""
        if isinstance(inputs, tf.RaggedTensor):
            if inputs.ragged_rank != 1 or inputs.flat_values.shape.rank != 1:
                raise ValueError(
                    f"Ragged ids must have shape (batch, None). Received: shape={inputs.shape}"
                )
            return inputs.flat_values, inputs.value_rowids(), inputs.nrows()
        if inputs.shape.rank != 2:
            raise ValueError(
                f"Sparse ids must have shape (batch, k). Received: shape={inputs.shape}"
            )
        return inputs.values, inputs.indices[:, 0], inputs.dense_shape[0]

    def _call_multi_hot(self, inputs: Any, rows: tf.Tensor) -> tf.Tensor:
        """Combines the rows of multi-hot ids (ragged or sparse) per example."""
        _, example, batch = self._segments(inputs)
        summed = tf.math.unsorted_segment_sum(rows, example, batch)
        if self.combiner == "sum":
            return self._cast(summed)
        counts = tf.math.unsorted_segment_sum(tf.ones_like(example, tf.float32), example, batch)
        if self.combiner == "sqrtn":
            counts = tf.sqrt(counts)
        return self._cast(tf.math.divide_no_nan(summed, counts[:, None]))

    def _combine_dense(self, rows: tf.Tensor) -> tf.Tensor:
        """Reduces (batch, k, dim) rows over k with the combiner."""
        summed = tf.reduce_sum(rows, axis=1)
        k = tf.cast(tf.shape(rows)[1], tf.float32)
        if self.combiner == "sum":
            return summed
        return summed / (tf.sqrt(k) if self.combiner == "sqrtn" else k)
