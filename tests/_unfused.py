"""The reference for the fused lookup: ee.Embedding's lookup as per-layer TensorFlow ops.

`UnfusedEmbedding` is `ee.Embedding` with the lookup path it had before the
tables took duplicate ids themselves: `tf.unique`, a pull of the distinct ids,
`tf.gather`, and a gradient summed by `tf.math.unsorted_segment_sum` before
`Table.push` (one push per step: the calls of a layer and the replicas of a strategy
summed). `train`
fits the same model of mixed tables (dims, optimizers, combiners, string keys,
a layer called twice) with either layer, for the tests to compare bit for bit.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import elastic_emb as ee
from elastic_emb.keras.lookup import local_replicas

_LOCK = threading.Lock()
_PENDING: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}  # a step's pushes by table
# Per traced graph and table: the lookups traced in it.
_LOOKUPS: weakref.WeakKeyDictionary[Any, dict[str, list[int]]] = weakref.WeakKeyDictionary()


class UnfusedEmbedding(ee.Embedding):
    """`ee.Embedding` whose lookup de-duplicates, gathers and sums in TensorFlow ops."""

    def _lookup(self, flat_ids: tf.Tensor, training: bool | None) -> tf.Tensor:
        unique_ids, index = tf.unique(flat_ids)
        # A proxy, as the layer's own path holds it: TensorFlow keeps these
        # functions alive, and must not keep the table alive through them.
        table, insert = weakref.proxy(self.table), bool(training) and self.trainable
        # One list per table, shared by the replicas (each traces its own lookup);
        # a step pushes once per lookup traced in it (a layer called twice, every
        # replica), and the table applies their sum once.
        lock, pending = _LOCK, _PENDING.setdefault(table.name, [])
        if tf.executing_eagerly():
            lookups = [local_replicas()]
        else:
            lookups = _LOOKUPS.setdefault(tf.compat.v1.get_default_graph(), {})
            lookups = lookups.setdefault(table.name, [0])
            lookups[0] += 1

        def pull(keys: np.ndarray, _trigger: np.ndarray) -> np.ndarray:
            return table.pull(keys, train=insert)

        def push(keys: np.ndarray, grads: np.ndarray) -> np.ndarray:
            with lock:
                pending.append((keys, grads))
                if len(pending) < lookups[0]:
                    return np.zeros((1,), np.float32)
                batch = pending[:]
                pending.clear()
            table.push(np.concatenate([k for k, _ in batch]), np.concatenate([g for _, g in batch]))
            return np.zeros((1,), np.float32)

        @tf.custom_gradient
        def lookup(unique_ids: tf.Tensor, trigger: tf.Tensor) -> Any:
            rows = tf.numpy_function(pull, [unique_ids, trigger], tf.float32, stateful=False)
            rows.set_shape([None, self.output_dim])

            def grad(upstream: tf.Tensor) -> tuple[None, tf.Tensor]:
                summed = tf.math.unsorted_segment_sum(
                    upstream, index, tf.shape(unique_ids, out_type=index.dtype)[0]
                )
                pushed = tf.numpy_function(
                    push, [unique_ids, tf.cast(summed, tf.float32)], tf.float32, stateful=True
                )
                return None, tf.reshape(pushed, [1])

            return tf.gather(rows, index), grad

        return lookup(unique_ids, tf.convert_to_tensor(self._push_trigger))


def data(strings: bool, n: int = 192, seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Features with many duplicate ids per batch (Zipf), and labels."""
    rng = np.random.default_rng(seed)

    def zipf(shape: tuple[int, ...]) -> np.ndarray:
        return np.minimum(rng.zipf(1.3, shape), 500).astype(np.int64)

    x = {
        "user": zipf((n, 1)),
        "item": zipf((n, 2)),
        "tags": zipf((n, 3)),
        "hist": zipf((n, 4)),
        "city": zipf((n, 1)),
        "numeric": rng.normal(size=(n, 3)).astype(np.float32),
    }
    y = rng.integers(0, 2, (n, 1)).astype(np.float32)
    if strings:
        x["city"] = np.char.add("c", x["city"].astype(str))
    return x, y


def build(
    embedding: type[ee.Embedding], prefix: str, strings: bool
) -> tuple[keras.Model, list[ee.Embedding]]:
    """The mixed model; tables named `prefix`-..., seeded alike for either layer class."""

    def emb(name: str, dim: int, optimizer: Any, seed: int, **kw: Any) -> ee.Embedding:
        return embedding(dim, optimizer, name=f"{prefix}_{name}", seed=seed, **kw)

    user = emb("user", 8, ee.optimizers.Adagrad(0.1), 1)
    item = emb("item", 16, ee.optimizers.Adam(0.01), 2)  # called twice: item and hist
    tags = emb("tags", 4, ee.optimizers.SGD(0.2), 3, combiner="sqrtn")
    city = emb(
        "city",
        8,
        ee.optimizers.Ftrl(0.1, l2_regularization_strength=0.01),
        4,
        key_dtype="string" if strings else "int64",
    )
    inputs = {
        "user": keras.Input((1,), dtype="int64", name="user"),
        "item": keras.Input((2,), dtype="int64", name="item"),
        "tags": keras.Input((3,), dtype="int64", name="tags"),
        "hist": keras.Input((4,), dtype="int64", name="hist"),
        "city": keras.Input((1,), dtype="string" if strings else "int64", name="city"),
        "numeric": keras.Input((3,), name="numeric"),
    }
    hist_layer = item if strings else emb("hist", 16, ee.optimizers.Adam(0.01), 5)
    hist = keras.layers.Lambda(lambda r: keras.ops.mean(r, axis=1))(hist_layer(inputs["hist"]))
    features = [
        keras.layers.Flatten()(user(inputs["user"])),
        keras.layers.Flatten()(item(inputs["item"])),
        hist,
        tags(inputs["tags"]),
        keras.layers.Flatten()(city(inputs["city"])),
        inputs["numeric"],
    ]
    h = keras.layers.Dense(8, "relu", kernel_initializer=keras.initializers.GlorotUniform(5))(
        keras.layers.Concatenate()(features)
    )
    out = keras.layers.Dense(1, "sigmoid", kernel_initializer=keras.initializers.GlorotUniform(6))(
        h
    )
    model = keras.Model(inputs, out)
    model.compile(keras.optimizers.Adam(0.01), "binary_crossentropy")
    return model, [user, item, tags, city] + ([] if hist_layer is item else [hist_layer])


def train(
    embedding: type[ee.Embedding], prefix: str, strategy: Any = None
) -> dict[str, np.ndarray]:
    """Fits the mixed model 2 epochs; every table's state (sorted by key), weights, losses.

    Under a strategy the city feature is int64 (MirroredStrategy cannot
    distribute string inputs: its AddN refuses them), and the hist feature has
    its own table (a layer called twice pairs its replicas' pushes in the
    order they arrive, which varies).
    """
    strings = strategy is None
    strategy = strategy or tf.distribute.get_strategy()
    x, y = data(strings)
    with strategy.scope():
        model, tables = build(embedding, prefix, strings)
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    history = model.fit(batches, epochs=2, shuffle=False, verbose=0)
    out = {"loss": np.array(history.history["loss"], np.float64)}
    for layer in tables:
        state = layer.table.export_state()
        order = np.argsort(state.keys)
        name = layer.name.split("_", 1)[1]
        for field in ("keys", "values", "slots", "last_step", "update_count"):
            out[f"{name}.{field}"] = getattr(state, field)[order]
        out[f"{name}.iterations"] = np.array([state.iterations])
    for i, w in enumerate(model.get_weights()):
        out[f"weight{i}"] = np.asarray(w)
    return out
