"""`DistributedEmbedding`: keras-rs's multi-feature embedding front-end over ee tables.

`ee.DistributedEmbedding(feature_configs)` takes the feature configs of
`keras_rs.layers.DistributedEmbedding` (`keras_rs.layers.FeatureConfig` /
`TableConfig`, or any objects with the same attributes) and has its call
signature: a nested structure of inputs (dense, ragged or sparse ids, with
optional per-id weights) to the same structure of embeddings. Each table is
a growing `ee.Table` (no vocabulary limit, sparse updates) trained by the
table config's optimizer; features that share a table make one lookup and
one push per step. The combiners follow keras-rs's `EmbedReduce`. The layer
round-trips through `get_config`/`from_config` and `.keras` files, its tables'
rows with it (each table is an `ee.Embedding` sublayer).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import keras
import tensorflow as tf

from elastic_emb.keras import lookup
from elastic_emb.keras.layers import Embedding
from elastic_emb.tables.policies import initializers, optimizers

__all__ = ["DistributedEmbedding"]

# The table attributes the layer reads, written by `get_config` for table
# configs that are not keras-rs's (all of a keras-rs `TableConfig`'s fields are).
_TABLE_ATTRS = ("name", "vocabulary_size", "embedding_dim", "initializer", "optimizer", "combiner")


@dataclasses.dataclass
class _TableConfig:
    """A table config that `DistributedEmbedding.from_config` rebuilds other than keras-rs's."""

    name: str
    vocabulary_size: int
    embedding_dim: int
    initializer: Any
    optimizer: Any
    combiner: str = "mean"


@dataclasses.dataclass
class _FeatureConfig:
    """A feature config that `DistributedEmbedding.from_config` rebuilds other than keras-rs's."""

    name: str
    table: Any
    input_shape: Any
    output_shape: Any = None


@keras.saving.register_keras_serializable(package="elastic_emb")
class DistributedEmbedding(keras.layers.Layer):
    """Embeds and combines many features, keras-rs style, on elastic_emb tables.

    Example:
        >>> import keras_rs
        >>> table = keras_rs.layers.TableConfig("items", vocabulary_size=1000, embedding_dim=8,
        ...                                     optimizer=keras.optimizers.Adagrad(0.1))
        >>> features = {"item": keras_rs.layers.FeatureConfig("item", table, (None,), (None, 8))}
        >>> layer = ee.DistributedEmbedding(features)
        >>> layer({"item": tf.constant([3, 10**9])})["item"].shape
        TensorShape([2, 8])

    Args:
        feature_configs: a FeatureConfig or a nested structure (dict, list) of
            them. Each has `name`, `table` and `input_shape`; each table has
            `name`, `embedding_dim`, `vocabulary_size` (used only to resolve
            `VarianceScaling`-style initializers, not as a limit),
            `initializer`, `optimizer` and `combiner` ("mean", "sum", "sqrtn").
        table_stacking, update_stats: accepted for keras-rs compatibility
            (TPU options; no effect here, kept in the config).

    Call arguments:
        inputs: the structure of `feature_configs`, of int ids: `(batch,)`
            (one id per example), `(batch, k)`, `tf.RaggedTensor (batch, None)`
            or `tf.SparseTensor (batch, k)`.
        weights: optional, the same structure, per-id float weights shaped
            like the ids.
        training: as for `ee.Embedding`.

    Returns:
        The structure of `feature_configs`, each `(batch, embedding_dim)`.

    `get_config()` writes the configs as keras-rs's `DistributedEmbedding`
    does (each table once, in `"tables"`; features refer to it by index);
    `from_config` rebuilds keras-rs configs where they were keras-rs's and
    keras-rs is installed, else plain dataclasses with the same attributes.
    Lists and tuples of features come back as lists.
    """

    def __init__(
        self,
        feature_configs: Any,
        *,
        table_stacking: Any = "auto",
        update_stats: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.table_stacking = table_stacking
        self.update_stats = update_stats
        # Kept as given, not as a Keras-tracked copy, to match the inputs' structure.
        object.__setattr__(self, "_feature_configs", feature_configs)
        object.__setattr__(self, "_features", keras.tree.flatten(feature_configs))
        if not self._features:
            raise ValueError("`feature_configs` holds no feature config")
        by_table: dict[int, Embedding] = {}
        self._feature_layers: list[Embedding] = []
        for feature in self._features:
            table = feature.table
            if table.combiner not in ("mean", "sum", "sqrtn"):
                raise ValueError(
                    f"Table {table.name!r}: `combiner` must be mean, sum or sqrtn. "
                    f"Received: {table.combiner!r}"
                )
            layer = by_table.get(id(table))
            if layer is None:
                layer = by_table[id(table)] = Embedding(
                    table.embedding_dim,
                    optimizer=table.optimizer,
                    embeddings_initializer=table.initializer,
                    input_dim=table.vocabulary_size,
                    name=table.name,
                )
            self._feature_layers.append(layer)
        self._table_layers = list(by_table.values())

    def build(self, input_shape: Any = None) -> None:
        for layer in self._table_layers:
            layer.build()
        self.built = True

    def call(self, inputs: Any, weights: Any = None, training: bool | None = None) -> Any:
        keras.tree.assert_same_structure(self._feature_configs, inputs)
        flat_inputs = keras.tree.flatten(inputs)
        flat_weights = (
            keras.tree.flatten(weights) if weights is not None else [None] * len(flat_inputs)
        )
        # One lookup per table (the ids of all its features, concatenated), all
        # tables in one call.
        ids = [_ids_of(x) for x in flat_inputs]
        rows: list[tf.Tensor | None] = [None] * len(ids)
        features, lookups = [], []
        for table_layer in self._table_layers:
            mine = [i for i, layer in enumerate(self._feature_layers) if layer is table_layer]
            keys = [table_layer._keys(ids[i]) for i in mine]
            features.append((mine, keys))
            lookups.append((table_layer, tf.concat(keys, 0)))
        if any(layer.serving_table is not None for layer in self._table_layers):
            looked_up = [layer._lookup(k, training) for layer, k in lookups]  # stock ops
        else:
            looked_up = lookup.rows_of(lookups, training)
        for (mine, keys), table_rows in zip(features, looked_up, strict=True):
            parts = tf.split(table_rows, [tf.shape(k)[0] for k in keys], num=len(keys))
            for i, part in zip(mine, parts, strict=True):
                rows[i] = part
        outputs = [
            _combine(x, r, w, self._feature_layers[i].output_dim, self._features[i].table.combiner)
            for i, (x, r, w) in enumerate(zip(flat_inputs, rows, flat_weights, strict=True))
        ]
        return keras.tree.pack_sequence_as(self._feature_configs, outputs)

    def compute_output_shape(self, input_shape: Any) -> Any:
        return keras.tree.map_structure(
            lambda f: (None, f.table.embedding_dim), self._feature_configs
        )

    def get_config(self) -> dict[str, Any]:
        base_config = super().get_config()
        as_keras_rs = all(_is_keras_rs(feature) for feature in self._features)
        tables: list[dict[str, Any]] = []
        index: dict[int, int] = {}  # id(table config) -> its index in `tables`

        def feature_config(feature: Any) -> dict[str, Any]:
            table = feature.table
            if id(table) not in index:
                index[id(table)] = len(tables)
                tables.append(_table_config(table, as_keras_rs))
            return {
                "name": feature.name,
                "table": index[id(table)],
                "input_shape": _shape(feature.input_shape),
                "output_shape": _shape(getattr(feature, "output_shape", None)),
            }

        config = {
            "feature_configs": keras.tree.map_structure(feature_config, self._feature_configs),
            "tables": tables,
            "config_objects": "keras_rs" if as_keras_rs else "plain",
            "table_stacking": self.table_stacking,
            "update_stats": self.update_stats,
        }
        return {**base_config, **config}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DistributedEmbedding:
        config = dict(config)
        table_configs = config.pop("tables")
        # A config without "config_objects" is keras-rs's own DistributedEmbedding's.
        kind = config.pop("config_objects", "keras_rs")
        table_cls: Any = _TableConfig
        feature_cls: Any = _FeatureConfig
        if kind == "keras_rs":
            try:
                import keras_rs

                table_cls = keras_rs.layers.TableConfig
                feature_cls = keras_rs.layers.FeatureConfig
            except ImportError:
                pass
        tables: list[Any] = [None] * len(table_configs)

        def feature(node: Any) -> Any:
            if not (isinstance(node, dict) and isinstance(node.get("name"), str)):
                return None  # not a feature: `traverse` recurses into it
            i = node["table"]
            if tables[i] is None:
                tables[i] = _table_from_config(table_configs[i], table_cls)
            return feature_cls(
                name=node["name"],
                table=tables[i],
                input_shape=_shape(node["input_shape"]),
                output_shape=_shape(node.get("output_shape")),
            )

        config["feature_configs"] = keras.tree.traverse(feature, config["feature_configs"])
        return cls(**config)

    @property
    def feature_configs(self) -> Any:
        """The feature configs, as given (or as rebuilt by `from_config`)."""
        return self._feature_configs

    @property
    def tables(self) -> dict[str, Any]:
        """The `ee.Table` of each table config, by table name."""
        return {layer.name: layer.table for layer in self._table_layers}


def _is_keras_rs(feature: Any) -> bool:
    """Whether `feature` and its table are keras-rs's config classes (never imports keras-rs)."""
    layers = getattr(sys.modules.get("keras_rs"), "layers", None)
    return (
        layers is not None
        and isinstance(feature, layers.FeatureConfig)
        and isinstance(feature.table, layers.TableConfig)
    )


def _shape(shape: Any) -> Any:
    """A feature shape as a tuple (JSON turns tuples into lists), or None."""
    return None if shape is None else tuple(shape)


def _table_config(table: Any, as_keras_rs: bool) -> dict[str, Any]:
    """The dict of keras-rs's `TableConfig.get_config` (its fields, or `_TABLE_ATTRS`),
    with elastic_emb initializers and optimizers written so that they load back."""
    names = [f.name for f in dataclasses.fields(table)] if as_keras_rs else _TABLE_ATTRS
    config = {name: getattr(table, name) for name in names}
    init = table.initializer
    if isinstance(init, initializers.InitializerSpec):
        init = init.to_keras()
    config["initializer"] = keras.saving.serialize_keras_object(init)
    opt = table.optimizer
    if isinstance(opt, optimizers.Optimizer):
        # Keras cannot deserialize these: marked, and read back by `_table_from_config`.
        config["optimizer"] = {"module": optimizers.__name__, "config": opt.get_config()}
    else:
        config["optimizer"] = keras.saving.serialize_keras_object(opt)
    return config


def _table_from_config(config: dict[str, Any], table_cls: Any) -> Any:
    config = dict(config)
    if table_cls is _TableConfig:
        config = {k: v for k, v in config.items() if k in _TABLE_ATTRS}
    config["initializer"] = keras.saving.deserialize_keras_object(config["initializer"])
    opt = config["optimizer"]
    if isinstance(opt, dict) and opt.get("module") == optimizers.__name__:
        config["optimizer"] = optimizers.Optimizer.from_config(opt["config"])
    else:
        config["optimizer"] = keras.saving.deserialize_keras_object(opt)
    return table_cls(**config)


def _ids_of(x: Any) -> tf.Tensor:
    """The ids of a feature input, flat (dense: row-major; ragged and sparse: their values)."""
    if isinstance(x, tf.RaggedTensor):
        return x.flat_values
    if isinstance(x, tf.SparseTensor):
        return x.values
    return tf.reshape(x, [-1])


def _combine(x: Any, rows: tf.Tensor, weights: Any, dim: int, combiner: str) -> tf.Tensor:
    """keras-rs `EmbedReduce`: weighted rows reduced per example by the combiner."""
    if isinstance(x, tf.RaggedTensor):
        unreduced = x.with_flat_values(rows)
        w = weights if weights is not None else tf.ones_like(x, tf.float32)
        w = tf.cast(w, tf.float32)
    elif isinstance(x, tf.SparseTensor):
        dense_shape = tf.concat([tf.cast(x.dense_shape, tf.int32), [dim]], 0)
        unreduced = tf.scatter_nd(tf.cast(x.indices, tf.int32), rows, dense_shape)
        present = weights if weights is not None else tf.sparse.map_values(tf.ones_like, x)
        w = tf.sparse.to_dense(tf.sparse.map_values(tf.cast, present, tf.float32))
    else:
        unreduced = tf.reshape(rows, tf.concat([tf.shape(x), [dim]], 0))
        if x.shape.rank == 1:  # one id per example: nothing to reduce
            if weights is not None and combiner == "sum":
                return unreduced * tf.cast(weights, tf.float32)[:, None]
            return unreduced
        w = tf.cast(weights, tf.float32) if weights is not None else tf.ones_like(x, tf.float32)
    w = tf.expand_dims(w, -1)
    summed = tf.reduce_sum(unreduced * w, axis=-2)
    if combiner == "sum":
        return summed
    if combiner == "mean":
        return tf.math.divide_no_nan(summed, tf.reduce_sum(w, axis=-2))
    return tf.math.divide_no_nan(summed, tf.sqrt(tf.reduce_sum(tf.square(w), axis=-2)))
