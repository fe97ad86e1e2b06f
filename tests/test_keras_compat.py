"""Keras behaviours of the stock Embedding that ee.Embedding keeps, each checked against stock
Keras (or a remote table) doing the same thing: pretrained `weights`, ragged symbolic outputs,
mixed_float16 loss scaling, a layer called twice in a step, and Keras' SavedModel reloaders.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from _cluster import shards

import elastic_emb as ee
from elastic_emb.keras import models as ee_models
from elastic_emb.keras import patches as keras_patches
from elastic_emb.keras.patches import keras_version
from elastic_emb.ps.client import fused_pull
from elastic_emb.tables.local import _LocalStep

VOCAB, DIM = 30, 4


def _initial_rows() -> np.ndarray:
    return np.random.default_rng(7).normal(size=(VOCAB, DIM)).astype(np.float32)


def _batches(n: int = 48, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, (n, 3)).astype(np.int64)  # duplicate ids within batches
    return x, rng.normal(size=(n, 1)).astype(np.float32)


@pytest.mark.parametrize("weights", ["matrix", "list"])
def test_weights_take_the_matrix_alone_or_in_a_list(weights):
    matrix = _initial_rows()
    given = matrix if weights == "matrix" else [matrix]
    ours = ee.Embedding(DIM, weights=given, name=f"pretrained_{weights}")
    stock = keras.layers.Embedding(VOCAB, DIM, weights=given)
    ids = np.array([[0, 5], [29, 5]], np.int64)
    np.testing.assert_array_equal(ours(ids), stock(ids))
    with pytest.raises(ValueError, match="a list of 2"):
        ee.Embedding(DIM, weights=[matrix, matrix], name="pretrained_two")


@pytest.mark.skipif(keras_version() < (3, 9), reason="keras.Input(ragged=True) is Keras 3.9+")
def test_ragged_symbolic_output_is_ragged_like_the_stock_layer():
    ids = keras.Input(shape=(None,), dtype="int64", ragged=True)
    ours = ee.Embedding(DIM, name="ragged_out")(ids)
    stock = keras.layers.Embedding(VOCAB, DIM)(ids)
    assert ours.ragged and stock.ragged and ours.shape == stock.shape
    combined = ee.Embedding(DIM, combiner="mean", name="ragged_mean")(ids)
    assert not combined.ragged and combined.shape == (None, DIM)
    model = keras.Model(ids, ours)
    out = model(tf.ragged.constant([[1, 2], [3]], dtype=tf.int64))
    assert isinstance(out, tf.RaggedTensor) and out.row_lengths().numpy().tolist() == [2, 1]


# A layer called twice in a step (one table for two features).


def _two_feature_model(embedding: keras.layers.Layer) -> keras.Model:
    first = keras.Input((3,), dtype="int64", name="first")
    second = keras.Input((3,), dtype="int64", name="second")
    both = keras.layers.Concatenate()(
        [keras.layers.Flatten()(embedding(first)), keras.layers.Flatten()(embedding(second))]
    )
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=2))
    return keras.Model({"first": first, "second": second}, dense(both))


class TwoFeatures(keras.Model):
    """The same model subclassed: each call of the layer looks up on its own."""

    def __init__(self, embedding: keras.layers.Layer) -> None:
        super().__init__()
        self.embedding, self.flatten = embedding, keras.layers.Flatten()
        self.concatenate = keras.layers.Concatenate()
        self.dense = keras.layers.Dense(
            1, kernel_initializer=keras.initializers.GlorotUniform(seed=2)
        )

    def call(self, inputs: dict) -> tf.Tensor:
        first = self.flatten(self.embedding(inputs["first"]))
        second = self.flatten(self.embedding(inputs["second"]))
        return self.dense(self.concatenate([first, second]))


def _train_two_features(embedding: keras.layers.Layer, subclassed: bool = False) -> keras.Model:
    model = TwoFeatures(embedding) if subclassed else _two_feature_model(embedding)
    model.compile(keras.optimizers.SGD(0.05), "mse")
    x1, y = _batches(seed=1)
    x2, _ = _batches(seed=2)
    model.fit({"first": x1, "second": x2}, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model


def _count_lookups(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[list[str]]]:
    """Records the keys of each in-process table lookup and the tables of each Pull."""
    local_keys: list[int] = []
    pulled: list[list[str]] = []
    local_lookup, columns = _LocalStep.lookup, fused_pull._columns

    def lookup(self, keys, *args):
        local_keys.append(len(keys))
        return local_lookup(self, keys, *args)

    def pull_columns(tables):  # the tables of one Pull, before its split by shard
        pulled.append([name for name, _, _ in tables])
        return columns(tables)

    monkeypatch.setattr(_LocalStep, "lookup", lookup)
    monkeypatch.setattr(fused_pull, "_columns", pull_columns)
    return local_keys, pulled


@pytest.mark.parametrize("subclassed", [False, True])
def test_a_layer_called_twice_pushes_once_a_step_like_stock_keras_and_remote_tables(
    subclassed, monkeypatch
):
    # Adagrad applied once to the sum of both calls' gradients is not the same as
    # applied twice: the comparison can fail.
    def ours(name: str) -> ee.Embedding:
        return ee.Embedding(
            DIM, optimizer=ee.optimizers.Adagrad(0.1), weights=[_initial_rows()], name=name
        )

    local_keys, pulled = _count_lookups(monkeypatch)
    local_layer = ours(f"twice_local_{subclassed}")
    _train_two_features(local_layer, subclassed)
    assert local_layer.table.iterations == 6  # 3 steps a epoch, one push each
    if not subclassed:  # a Functional model: both calls' ids in one lookup of 16 x 3 x 2
        assert set(local_keys) == {96}
    keys, rows = local_layer.table.export_rows()

    # Stock Keras: one table variable, its gradient for the step summed over both calls
    # by TensorFlow, Keras's Adagrad formula applied to it once (NumPy, on the rows the
    # step used), and the same compile optimizer for the dense weights.
    stock_layer = keras.layers.Embedding(VOCAB, DIM, weights=[_initial_rows()])
    stock = _two_feature_model(stock_layer)
    dense_weights = [v for v in stock.trainable_variables if v is not stock_layer.embeddings]
    dense_optimizer = keras.optimizers.SGD(0.05)
    accumulator = np.full((VOCAB, DIM), 0.1, np.float32)
    x1, y = _batches(seed=1)
    x2, _ = _batches(seed=2)
    for _ in range(2):
        for i in range(0, len(y), 16):
            batch = {"first": x1[i : i + 16], "second": x2[i : i + 16]}
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(keras.losses.mean_squared_error(y[i : i + 16], stock(batch)))
            grads = tape.gradient(loss, [stock_layer.embeddings, *dense_weights])
            dense_optimizer.apply(grads[1:], dense_weights)
            g = tf.convert_to_tensor(grads[0]).numpy()
            used = np.unique(np.concatenate([batch["first"], batch["second"]]))
            value = stock_layer.embeddings.numpy()
            accumulator[used] += g[used] * g[used]
            value[used] -= 0.1 * g[used] / (np.sqrt(accumulator[used]) + 1e-7)
            stock_layer.embeddings.assign(value)
    order = np.argsort(keys)
    np.testing.assert_allclose(
        rows[order], stock_layer.embeddings.numpy()[keys[order]], rtol=1e-5, atol=1e-6
    )

    with shards(2) as servers:
        ee.init(ps=[s.address for s in servers], mode="async")
        try:
            remote_layer = ours(f"twice_remote_{subclassed}")
            _train_two_features(remote_layer, subclassed)
            remote_keys, remote_rows = remote_layer.table.export_rows()
        finally:
            ee.shutdown()
    # Both calls' distinct ids in one entry of each Pull.
    assert pulled and all(tables == [remote_layer.table.name] for tables in pulled)
    np.testing.assert_array_equal(np.sort(remote_keys), np.sort(keys))
    np.testing.assert_array_equal(remote_rows[np.argsort(remote_keys)], rows[order])


# mixed_float16: loss scaling.


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _mixed_model(embedding: keras.layers.Layer) -> keras.Model:
    ids = keras.Input((3,), dtype="int64")
    x = keras.layers.Flatten()(embedding(ids))
    x = keras.layers.Dense(
        8, activation="relu", kernel_initializer=keras.initializers.GlorotUniform(seed=4)
    )(x)
    out = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=5))(x)
    model = keras.Model(ids, keras.layers.Activation("linear", dtype="float32")(out))
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return model


def test_mixed_float16_trains_like_the_stock_layer_and_skips_the_same_steps(mixed_float16):
    x, y = _batches(64, seed=3)
    y[16:32] *= 1e4  # the second step's scaled gradients overflow float16: Keras skips it
    stock_layer = keras.layers.Embedding(VOCAB, DIM, weights=[_initial_rows()])
    ours_layer = ee.Embedding(
        DIM, optimizer=ee.optimizers.SGD(0.05), weights=[_initial_rows()], name="mixed16"
    )
    stock, ours = _mixed_model(stock_layer), _mixed_model(ours_layer)
    assert isinstance(ours.optimizer, keras.optimizers.LossScaleOptimizer)
    histories = [
        m.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
        for m in (stock, ours)
    ]
    # The overflowing step was skipped in each epoch, for the dense weights and the table alike.
    steps = [
        int(keras.ops.convert_to_numpy(m.optimizer.inner_optimizer.iterations))
        for m in (stock, ours)
    ]
    assert steps == [6, 6]
    assert ours_layer.table.iterations == 6
    assert (
        float(keras.ops.convert_to_numpy(ours.optimizer.scale_loss(1.0))) < 2.0**15
    )  # the scale moved: it mattered
    np.testing.assert_allclose(histories[1], histories[0], rtol=1e-6)
    keys, rows = ours_layer.table.export_rows()
    np.testing.assert_allclose(rows, stock_layer.embeddings.numpy()[keys], rtol=1e-6, atol=1e-7)
    for a, b in zip(ours.get_weights()[1:], stock.get_weights()[1:], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# Keras' and TensorFlow's own SavedModel paths.


def _trained_model(name: str, lo: int = 0) -> tuple[keras.Model, np.ndarray]:
    ids = keras.Input((3,), dtype="int64", name="ids")
    layer = ee.Embedding(DIM, optimizer=ee.optimizers.Adagrad(0.1), name=name)
    out = keras.layers.Dense(1)(keras.layers.Flatten()(layer(ids)))
    model = keras.Model(ids, out)
    model.compile(keras.optimizers.SGD(0.05), "mse")
    x, y = _batches(seed=4)
    model.fit(x + lo, y, batch_size=16, verbose=0)
    probe = np.concatenate([x, x + 10**6])  # trained ids, then ids never seen
    return model, probe


def _python_ops(path) -> set[str]:
    """The Python-calling ops a SavedModel's graph holds (none: stock TensorFlow serves it)."""
    graph = (path / "saved_model.pb").read_bytes()
    return {op for op in ("PyFunc", "EagerPyFunc", "PyFuncStateless") if op.encode() in graph}


def test_tfsm_layer_reloads_model_export_and_a_delta_applied_to_it(tmp_path):
    model, probe = _trained_model("tfsm")
    model.export(tmp_path / "1")
    assert not _python_ops(tmp_path / "1")
    reloaded = keras.layers.TFSMLayer(tmp_path / "1", call_endpoint="serve")
    np.testing.assert_array_equal(reloaded(tf.constant(probe)), model.predict(probe, verbose=0))
    # More rows (new ids), shipped as a delta: the next version reloads too.
    x, y = _batches(seed=5)
    model.fit(x + 100, y, batch_size=16, verbose=0)
    ee.export_delta(model, tmp_path / "delta", since=tmp_path / "1")
    ee.apply_delta(tmp_path / "1", tmp_path / "delta")
    grown = np.concatenate([probe, x + 100])
    reloaded = keras.layers.TFSMLayer(tmp_path / "2", call_endpoint="serve")
    np.testing.assert_array_equal(reloaded(tf.constant(grown)), model.predict(grown, verbose=0))


def test_tf_saved_model_save_writes_the_stock_ops_model(tmp_path):
    model, probe = _trained_model("tf_save")
    tf.saved_model.save(model, str(tmp_path / "m"))
    assert not _python_ops(tmp_path / "m")
    expected = model.predict(probe, verbose=0)
    loaded = tf.saved_model.load(str(tmp_path / "m"))
    serve = loaded.signatures["serving_default"]
    # (Keras 3.3 signs a float input: these ids are exact in float32.)
    (spec,) = serve.structured_input_signature[1].values()
    assert probe.max() < 2**24
    (served,) = serve(tf.cast(probe, spec.dtype)).values()
    np.testing.assert_array_equal(served, expected)
    # The layer looks its rows up in its table again: it still trains.
    rows_before = model.get_layer("tf_save").table.export_rows()[1].copy()
    x, y = _batches(seed=4)
    model.fit(x, y, batch_size=16, verbose=0)
    assert not np.array_equal(model.get_layer("tf_save").table.export_rows()[1], rows_before)


def test_mixed_float16_with_remote_tables_is_refused_at_compile(mixed_float16):
    with shards(1) as servers:
        ee.init(ps=[s.address for s in servers], mode="async")
        try:
            layer = ee.Embedding(DIM, name="mixed16_remote")
            with pytest.raises(ValueError, match="in-process tables only"):
                _mixed_model(layer)
        finally:
            ee.shutdown()


# The gates on Keras internals (docs/keras.md#supported-versions).


def test_a_keras_older_than_the_floor_is_refused_by_name(monkeypatch):
    keras_patches.check_keras()  # this one is supported
    monkeypatch.setattr(keras, "__version__", "3.2.1")
    with pytest.raises(ImportError, match=r"Keras 3\.3 through 3\.\d+.*this is Keras 3\.2\.1"):
        keras_patches.check_keras()


def test_a_missing_keras_internal_fails_loudly_with_the_versions_and_the_remedy():
    class NotKeras:  # has no _flatten_layers
        pass

    message = rf"Keras {keras.__version__} no longer has Layer\._flatten_layers.*tested with"
    with pytest.raises(RuntimeError, match=message):
        ee_models.embedding_layers(NotKeras())
