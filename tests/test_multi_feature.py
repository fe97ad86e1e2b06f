"""ee.DistributedEmbedding against keras-rs's DistributedEmbedding (its CPU path: dense Keras
tables), with the tables copied across: identical outputs for 1-D, 2-D, ragged, sparse, shared
and weighted features; then the tables train sparsely with their configs' optimizers."""

from __future__ import annotations

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

import elastic_emb as ee

keras_rs = pytest.importorskip("keras_rs")

_names = itertools.count()


def _features() -> dict:
    n = next(_names)
    shared = keras_rs.layers.TableConfig(
        f"mf_shared_{n}", vocabulary_size=50, embedding_dim=4, combiner="mean",
        optimizer=keras.optimizers.Adagrad(0.1),
    )  # fmt: skip
    summed = keras_rs.layers.TableConfig(
        f"mf_sum_{n}", vocabulary_size=30, embedding_dim=3, combiner="sum", optimizer="sgd"
    )
    sqrtn = keras_rs.layers.TableConfig(
        f"mf_sqrtn_{n}", vocabulary_size=30, embedding_dim=5, combiner="sqrtn"
    )
    return {
        "one": keras_rs.layers.FeatureConfig("one", shared, (8,), (8, 4)),
        "two": keras_rs.layers.FeatureConfig("two", shared, (8, 3), (8, 4)),
        "ragged": keras_rs.layers.FeatureConfig("ragged", summed, (8, None), (8, 3)),
        "sparse": keras_rs.layers.FeatureConfig("sparse", sqrtn, (8, 4), (8, 5)),
    }


def _inputs(seed: int) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 4, 8)
    ragged = tf.RaggedTensor.from_row_lengths(rng.integers(0, 30, int(lengths.sum())), lengths)
    indices = np.array([[0, 0], [0, 2], [3, 1], [5, 0], [5, 3], [7, 3]])
    inputs = {
        "one": tf.constant(rng.integers(0, 50, 8)),
        "two": tf.constant(rng.integers(0, 50, (8, 3))),
        "ragged": ragged,
        "sparse": tf.sparse.SparseTensor(indices, tf.constant(rng.integers(0, 30, 6)), [8, 4]),
    }
    weights = {
        "one": tf.constant(rng.random(8), tf.float32),
        "two": tf.constant(rng.random((8, 3)), tf.float32),
        "ragged": ragged.with_flat_values(tf.constant(rng.random(int(lengths.sum())), tf.float32)),
        "sparse": tf.sparse.SparseTensor(indices, tf.constant(rng.random(6), tf.float32), [8, 4]),
    }
    return inputs, weights


def test_outputs_equal_keras_rs_with_the_tables_copied_across():
    features = _features()
    reference = keras_rs.layers.DistributedEmbedding(features)
    ours = ee.DistributedEmbedding(features)
    inputs, weights = _inputs(0)
    reference(inputs)  # builds its tables
    copied = 0
    for name, matrix in reference.get_embedding_tables().items():
        matrix = keras.ops.convert_to_numpy(matrix)
        ours.tables[name].import_rows(np.arange(len(matrix)), matrix)
        copied += 1
    assert copied == 3  # "one" and "two" share a table
    for seed in (0, 1):
        inputs, weights = _inputs(seed)
        for w in (None, weights):
            want, got = reference(inputs, w), ours(inputs, w, training=False)
            for name in features:
                assert (
                    got[name].shape == want[name].shape == (8, features[name].table.embedding_dim)
                )
                np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), name)


def test_tables_train_with_their_optimizers_one_push_per_table_per_step():
    features = _features()
    layer = ee.DistributedEmbedding(features)
    inputs, weights = _inputs(2)
    names = [
        features["one"].table.name,
        features["ragged"].table.name,
        features["sparse"].table.name,
    ]
    assert isinstance(layer.tables[names[0]].optimizer, ee.optimizers.Adagrad)
    assert isinstance(layer.tables[names[1]].optimizer, ee.optimizers.SGD)
    assert isinstance(layer.tables[names[2]].optimizer, ee.optimizers.Adam)  # keras-rs default
    # keras-rs's VarianceScaling default resolves to the spread Keras draws for a (30, 5) table.
    table = layer.tables[names[2]]
    assert table.initializer.kind == "truncated_normal"
    keras_draws = features["sparse"].table.initializer(shape=(20_000, 5)).numpy()  # fan_out 5
    ours = table.pull(np.arange(20_000), train=False)
    assert abs(ours.std() / keras_draws.std() - 1) < 0.02
    assert np.abs(ours).max() <= 2 * table.initializer.b
    for _ in range(3):
        with tf.GradientTape() as tape:
            out = layer(inputs, weights, training=True)
            loss = sum(tf.reduce_sum(v) for v in out.values())
        grads = tape.gradient(loss, layer.trainable_variables)
        keras.optimizers.SGD(0.0).apply(grads, layer.trainable_variables)
    for name in names:
        assert layer.tables[name].iterations == 3  # "one" and "two" pushed together
    # Sparse: only the ids used have rows.
    used = np.unique(np.concatenate([inputs["one"].numpy(), inputs["two"].numpy().ravel()]))
    assert len(layer.tables[names[0]]) == len(used)
    # Ids far beyond keras-rs's vocabulary size are fine.
    far = {**inputs, "one": tf.constant([10**12] * 8, tf.int64)}
    assert layer(far, training=False)["one"].shape == (8, 4)


def test_save_weights_carries_the_tables(tmp_path):
    features = _features()

    def build() -> keras.Model:
        inputs = {
            "one": keras.Input((), dtype="int64", name="one"),
            "two": keras.Input((3,), dtype="int64", name="two"),
        }
        out = ee.DistributedEmbedding({k: features[k] for k in inputs})(inputs)
        return keras.Model(
            inputs, keras.layers.Dense(1)(keras.layers.Concatenate()(list(out.values())))
        )

    inputs, _ = _inputs(3)
    x = {k: inputs[k] for k in ("one", "two")}
    model = build()
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, np.ones((8, 1)), verbose=0)
    model.save_weights(tmp_path / "w.weights.h5")
    fresh = build()
    before = fresh.predict(x, verbose=0)
    fresh.load_weights(tmp_path / "w.weights.h5")
    np.testing.assert_array_equal(fresh.predict(x, verbose=0), model.predict(x, verbose=0))
    assert not np.array_equal(before, model.predict(x, verbose=0))
