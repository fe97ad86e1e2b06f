"""ee.DistributedEmbedding against keras-rs's DistributedEmbedding (its CPU path: dense Keras
tables), with the tables copied across: identical outputs for 1-D, 2-D, ragged, sparse, shared
and weighted features; then the tables train sparsely with their configs' optimizers, and the
layer round-trips through `.keras` files (rows included) and `get_config`/`from_config`."""

from __future__ import annotations

import itertools
import types

import keras
import numpy as np
import pytest
import tensorflow as tf
from _processes import run_python

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


def _round_trip_model(features: dict) -> keras.Model:
    inputs = {
        "one": keras.Input((), dtype="int64", name="one"),
        "two": keras.Input((3,), dtype="int64", name="two"),
        "own": keras.Input((2,), dtype="int64", name="own"),
    }
    out = ee.DistributedEmbedding(features, name="features")(inputs)
    dense = keras.layers.Dense(1, kernel_initializer="ones")
    return keras.Model(inputs, dense(keras.layers.Concatenate()([out[k] for k in inputs])))


def _sorted_rows(table) -> tuple[np.ndarray, np.ndarray]:
    keys, values = table.export_rows()
    order = np.argsort(keys)
    return keys[order], values[order]


def test_keras_file_round_trip_rows_config_and_training(tmp_path):
    n = next(_names)
    shared = keras_rs.layers.TableConfig(
        f"mf_rt_shared_{n}", vocabulary_size=40, embedding_dim=4,
        optimizer=keras.optimizers.Adagrad(0.5),
    )  # fmt: skip
    own = keras_rs.layers.TableConfig(
        f"mf_rt_own_{n}", vocabulary_size=20, embedding_dim=2, combiner="sum",
        initializer=keras.initializers.RandomNormal(0.0, 0.1), optimizer=ee.optimizers.Adam(0.01),
    )  # fmt: skip
    features = {
        "one": keras_rs.layers.FeatureConfig("one", shared, (8,), (8, 4)),
        "two": keras_rs.layers.FeatureConfig("two", shared, (8, 3), (8, 4)),
        "own": keras_rs.layers.FeatureConfig("own", own, (8, 2), (8, 2)),
    }
    rng = np.random.default_rng(7)
    x = {
        "one": rng.integers(0, 40, 8),
        "two": rng.integers(0, 40, (8, 3)),
        "own": rng.integers(0, 20, (8, 2)),
    }
    y = rng.random((8, 1)).astype("float32")
    model = _round_trip_model(features)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")

    layer, loaded_layer = model.get_layer("features"), loaded.get_layer("features")
    assert isinstance(loaded_layer, ee.DistributedEmbedding)
    assert loaded_layer.get_config() == layer.get_config()
    rebuilt = loaded_layer.feature_configs
    assert isinstance(rebuilt["one"], keras_rs.layers.FeatureConfig)
    assert rebuilt["one"].table is rebuilt["two"].table  # still one shared table
    assert rebuilt["own"].table.optimizer == ee.optimizers.Adam(0.01)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    used = {
        shared.name: np.unique(np.concatenate([x["one"], x["two"].ravel()])),
        own.name: np.unique(x["own"]),
    }
    for name, keys in used.items():
        want, got = _sorted_rows(layer.tables[name]), _sorted_rows(loaded_layer.tables[name])
        np.testing.assert_array_equal(want[0], keys)  # the rows of the ids trained, no others
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        assert loaded_layer.tables[name].iterations == layer.tables[name].iterations == 4

    # One more step each: equal only if the optimizer slots and step counts came along too.
    history = [
        m.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0) for m in (model, loaded)
    ]
    assert history[0].history["loss"] == history[1].history["loss"]
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    for name in used:
        want, got = _sorted_rows(layer.tables[name]), _sorted_rows(loaded_layer.tables[name])
        np.testing.assert_array_equal(got[1], want[1])


def test_from_config_rebuilds_plain_attribute_configs():
    n = next(_names)
    shared = types.SimpleNamespace(
        name=f"mf_plain_shared_{n}", vocabulary_size=30, embedding_dim=3, combiner="sqrtn",
        initializer="zeros", optimizer=ee.optimizers.SGD(0.25),
    )  # fmt: skip
    other = types.SimpleNamespace(
        name=f"mf_plain_other_{n}", vocabulary_size=10, embedding_dim=2, combiner="sum",
        initializer=keras.initializers.Constant(0.5), optimizer="adagrad",
    )  # fmt: skip
    features = [
        {
            "a": types.SimpleNamespace(name="a", table=shared, input_shape=(4, 2)),
            "b": types.SimpleNamespace(name="b", table=shared, input_shape=(4,)),
        },
        types.SimpleNamespace(name="c", table=other, input_shape=(4, 3), output_shape=(4, 2)),
    ]
    layer = ee.DistributedEmbedding(features, name="plain")
    config = layer.get_config()
    assert config["config_objects"] == "plain"
    assert len(config["tables"]) == 2
    rebuilt = ee.DistributedEmbedding.from_config(config)
    assert rebuilt.get_config() == config

    configs = rebuilt.feature_configs
    assert isinstance(configs, list) and len(configs) == 2 and sorted(configs[0]) == ["a", "b"]
    a, b, c = configs[0]["a"], configs[0]["b"], configs[1]
    assert not isinstance(a, keras_rs.layers.FeatureConfig)  # plain in, plain out
    assert (a.name, a.input_shape, b.input_shape, c.input_shape) == ("a", (4, 2), (4,), (4, 3))
    assert c.output_shape == (4, 2) and a.output_shape is None
    assert a.table is b.table and a.table is not c.table
    for want, got in ((shared, a.table), (other, c.table)):
        for attr in ("name", "vocabulary_size", "embedding_dim", "combiner"):
            assert getattr(got, attr) == getattr(want, attr)
    assert a.table.optimizer == ee.optimizers.SGD(0.25)
    assert c.table.optimizer == "adagrad" and c.table.initializer.get_config()["value"] == 0.5
    tables = rebuilt.tables
    assert sorted(tables) == sorted([shared.name, other.name])
    assert isinstance(tables[other.name].optimizer, ee.optimizers.Adagrad)

    # Same layer: zeros and constant 0.5 rows, combined by sqrtn over (4, 2) and sum over (4, 3).
    ids = [{"a": tf.constant([[1, 2]] * 4), "b": tf.constant([5] * 4)}, tf.constant([[1] * 3] * 4)]
    out = rebuilt(ids, training=False)
    np.testing.assert_array_equal(out[0]["a"], np.zeros((4, 3), np.float32))
    np.testing.assert_array_equal(out[1], np.full((4, 2), 1.5, np.float32))


_LOAD_ALONE = """
import sys
import keras
import numpy as np
import elastic_emb  # registers ee.DistributedEmbedding; nothing else is imported
model = keras.models.load_model(sys.argv[1])
np.save(sys.argv[2], model.predict({"a": np.array([1, 2, 3]), "b": np.array([[3, 4]] * 3)}))
"""


def test_import_elastic_emb_alone_loads_the_keras_file(tmp_path):
    n = next(_names)
    table = keras_rs.layers.TableConfig(f"mf_alone_{n}", vocabulary_size=10, embedding_dim=2)
    features = {
        "a": keras_rs.layers.FeatureConfig("a", table, (3,), (3, 2)),
        "b": keras_rs.layers.FeatureConfig("b", table, (3, 2), (3, 2)),
    }
    inputs = {"a": keras.Input((), dtype="int64"), "b": keras.Input((2,), dtype="int64")}
    layer = ee.DistributedEmbedding(features)
    model = keras.Model(inputs, layer(inputs))
    keys = np.arange(10)
    layer.tables[table.name].import_rows(keys, np.stack([keys, -2 * keys], 1).astype("float32"))
    model.save(tmp_path / "m.keras")
    run_python("-c", _LOAD_ALONE, tmp_path / "m.keras", tmp_path / "out.npy", cwd=tmp_path)
    # Row k is (k, -2k): "a" looks up 1, 2, 3; "b" the mean of rows 3 and 4.
    want = {"a": [[1, -2], [2, -4], [3, -6]], "b": [[3.5, -7]] * 3}
    got = np.load(tmp_path / "out.npy", allow_pickle=True).item()
    for name in want:
        np.testing.assert_array_equal(got[name], np.array(want[name], np.float32))
