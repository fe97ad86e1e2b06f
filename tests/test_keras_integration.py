"""Keras's own habits with ee.Embedding: every save path carries the rows, loading needs only
`import elastic_emb`, and the stock layer's documented behaviours (float ids, ragged and sparse
ids without a combiner, pretrained `weights`, a meaningful summary).

References: the model before saving (rows, slots, predictions), a second model trained side by
side, and stock `keras.layers.Embedding` with the same rows.
"""

from __future__ import annotations

import itertools
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
from _processes import run_python

import elastic_emb as ee
from elastic_emb.keras import base as ee_base

_names = itertools.count()


def _name(prefix: str = "k") -> str:
    return f"keras_{prefix}_{next(_names)}"


def _data(n: int = 96, vocab: int = 60, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab, (n, 3)).astype(np.int64)
    return x, rng.normal(size=(n, 1)).astype(np.float32)


def _model(name: str, optimizer: object = None) -> keras.Model:
    inp = keras.Input((3,), dtype="int64")
    emb = ee.Embedding(4, optimizer=optimizer or ee.optimizers.Adam(0.05), name=name)
    out = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=1))(
        keras.layers.Flatten()(emb(inp))
    )
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def _state(table: ee.Table) -> dict[str, np.ndarray]:
    s = table.export_state()
    order = np.argsort(s.keys)
    out = {f: getattr(s, f)[order] for f in s.FIELDS}
    out["iterations"] = np.array([s.iterations])
    return out


def _assert_same_state(a: ee.Table, b: ee.Table) -> None:
    sa, sb = _state(a), _state(b)
    assert len(sa["keys"]) > 0
    for field in sa:
        np.testing.assert_array_equal(sa[field], sb[field], err_msg=field)


def _fit(model: keras.Model, x: np.ndarray, y: np.ndarray, epochs: int = 1, **kw) -> None:
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0, **kw)


# 1. Save paths.


def test_model_save_and_load_model_round_trip_rows_and_keep_training_identically(tmp_path):
    x, y = _data()
    name = _name("save")
    model = _model(name)
    _fit(model, x, y)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    table, loaded_table = model.get_layer(name).table, loaded.get_layer(name).table
    assert loaded_table is not table
    _assert_same_state(table, loaded_table)  # rows, Adam slots, metadata, step count
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    # Training goes on identically from the reloaded model (the .keras file holds the
    # compile optimizer's state too). The live model trains on a table the loaded one
    # took the name of; both keep working.
    _fit(model, x, y)
    _fit(loaded, x, y)
    _assert_same_state(table, loaded_table)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


def test_save_weights_and_load_weights_round_trip_rows(tmp_path):
    x, y = _data(seed=1)
    name = _name("weights")
    model = _model(name, ee.optimizers.Adagrad(0.1))
    _fit(model, x, y)
    model.save_weights(tmp_path / "w.weights.h5")
    fresh = _model(name, ee.optimizers.Adagrad(0.1))
    before = fresh.predict(x, verbose=0)
    fresh.load_weights(tmp_path / "w.weights.h5")
    _assert_same_state(model.get_layer(name).table, fresh.get_layer(name).table)
    after = fresh.predict(x, verbose=0)
    np.testing.assert_array_equal(after, model.predict(x, verbose=0))
    assert not np.allclose(before, after)  # the check can fail: fresh rows predict otherwise


@pytest.mark.parametrize("weights_only", [True, False])
def test_model_checkpoint_carries_the_rows(tmp_path, weights_only):
    x, y = _data(seed=2)
    name = _name("mc")
    model = _model(name)
    path = tmp_path / ("best.weights.h5" if weights_only else "best.keras")
    checkpoint = keras.callbacks.ModelCheckpoint(path, save_weights_only=weights_only)
    _fit(model, x, y, epochs=2, callbacks=[checkpoint])
    if weights_only:
        restored = _model(name)
        restored.load_weights(path)
    else:
        restored = keras.models.load_model(path)
    _assert_same_state(model.get_layer(name).table, restored.get_layer(name).table)
    np.testing.assert_array_equal(restored.predict(x, verbose=0), model.predict(x, verbose=0))


class _StopAtEpoch(keras.callbacks.Callback):
    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch: int, logs: object = None) -> None:
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


def test_backup_and_restore_resumes_with_the_trained_rows(tmp_path):
    x, y = _data(seed=3)
    name = _name("backup")
    model = _model(name)
    backup = tmp_path / "backup"
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(
            model,
            x,
            y,
            epochs=3,
            callbacks=[keras.callbacks.BackupAndRestore(backup), _StopAtEpoch(1)],
        )
    after_one_epoch = _state(model.get_layer(name).table)
    predicted = model.predict(x, verbose=0)
    # A new process would rebuild the model: its table starts fresh, then BackupAndRestore
    # restores epoch 1 (and with epochs=1 trains no further).
    rebuilt = _model(name)
    assert len(rebuilt.get_layer(name).table) == 0
    _fit(rebuilt, x, y, epochs=1, callbacks=[keras.callbacks.BackupAndRestore(backup)])
    restored = _state(rebuilt.get_layer(name).table)
    for field in after_one_epoch:
        np.testing.assert_array_equal(restored[field], after_one_epoch[field], err_msg=field)
    np.testing.assert_array_equal(rebuilt.predict(x, verbose=0), predicted)


def test_a_table_too_large_for_a_keras_file_is_refused_clearly(tmp_path, monkeypatch):
    x, y = _data(seed=4)
    name = _name("large")
    model = _model(name)
    _fit(model, x, y)
    monkeypatch.setattr(ee_base, "MAX_SAVED_TABLE_BYTES", 1000)
    with pytest.raises(ValueError, match=r"ee\.save") as info:
        model.save_weights(tmp_path / "w.weights.h5")
    assert name in str(info.value) and "MAX_SAVED_TABLE_BYTES" in str(info.value)


def test_loading_into_a_table_of_another_shape_is_refused(tmp_path):
    x, y = _data(seed=5)
    name = _name("shape")
    model = _model(name, ee.optimizers.Adagrad(0.1))
    _fit(model, x, y)
    model.save_weights(tmp_path / "w.weights.h5")
    other = _model(name, ee.optimizers.Adam(0.1))  # other optimizer slots
    with pytest.raises(ValueError, match="does not match"):
        other.load_weights(tmp_path / "w.weights.h5")
    assert len(other.get_layer(name).table) == 0


# 2. `import elastic_emb` is enough to load.


def test_load_model_in_a_fresh_process_needs_only_import_elastic_emb(tmp_path):
    x, y = _data(seed=6)
    name = _name("fresh")
    model = _model(name)
    _fit(model, x, y)
    model.save(tmp_path / "m.keras")
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "expected.npy", model.predict(x, verbose=0))
    script = textwrap.dedent(
        """
        import sys
        import elastic_emb  # nothing else of elastic_emb is touched
        assert "tensorflow" not in sys.modules, "import elastic_emb imported TensorFlow"
        import keras
        import numpy as np
        model = keras.models.load_model("m.keras")
        np.testing.assert_array_equal(model.predict(np.load("x.npy"), verbose=0),
                                      np.load("expected.npy"))
        print("LOADED", type(model.layers[1]).__module__)
        """
    )
    out = run_python("-c", script, cwd=tmp_path)
    assert "LOADED elastic_emb.keras.layers" in out


# 4. The stock layer's behaviours.


def test_float_ids_of_a_sequential_model_without_input_are_cast_like_the_stock_layer():
    name = _name("seq")
    model = keras.Sequential(
        [ee.Embedding(4, optimizer=ee.optimizers.SGD(0.1), name=name), keras.layers.Flatten()]
    )
    x, _ = _data(seed=7)
    out = model.predict(x.astype(np.float32), verbose=0)  # Keras builds a float32 input
    table = model.get_layer(name).table
    expected = table.pull(x.reshape(-1), train=False).reshape(len(x), -1)
    np.testing.assert_array_equal(out, expected)
    with pytest.raises(ValueError, match="integer ids"):
        ee.Embedding(4, name=_name("str"))(tf.constant([["a"]]))


def test_ragged_ids_without_a_combiner_give_a_ragged_result_like_the_stock_layer():
    matrix = np.random.default_rng(8).normal(size=(20, 4)).astype(np.float32)
    ours = ee.Embedding(4, weights=[matrix], name=_name("ragged"))
    stock = keras.layers.Embedding(20, 4, weights=[matrix])
    ids = tf.ragged.constant([[1, 2, 3], [], [19, 0]], dtype=tf.int64)
    got, want = ours(ids), stock(ids)
    assert isinstance(got, tf.RaggedTensor) and isinstance(want, tf.RaggedTensor)
    np.testing.assert_array_equal(got.row_splits.numpy(), want.row_splits.numpy())
    np.testing.assert_allclose(got.flat_values.numpy(), want.flat_values.numpy(), rtol=0, atol=0)


def test_sparse_ids_without_a_combiner_give_a_dense_result_like_the_stock_layer():
    matrix = np.random.default_rng(9).normal(size=(20, 4)).astype(np.float32)
    ours = ee.Embedding(4, weights=[matrix], name=_name("sparse"))
    stock = keras.layers.Embedding(20, 4, weights=[matrix])
    ids = tf.sparse.SparseTensor(
        [[0, 0], [0, 2], [2, 1]], tf.constant([5, 7, 19], tf.int64), [3, 3]
    )
    got, want = ours(ids), stock(ids)
    assert not isinstance(got, tf.SparseTensor) and got.shape == want.shape == (3, 3, 4)
    np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_pretrained_weights_train_like_the_stock_layer():
    matrix = np.random.default_rng(10).normal(size=(30, 4)).astype(np.float32)
    x, y = _data(n=64, vocab=30, seed=10)
    models = []
    for layer in (
        ee.Embedding(4, optimizer=ee.optimizers.SGD(0.1), weights=[matrix], name=_name("pre")),
        keras.layers.Embedding(30, 4, weights=[matrix]),
    ):
        inp = keras.Input((3,), dtype="int64")
        out = keras.layers.Dense(1, kernel_initializer="ones")(keras.layers.Flatten()(layer(inp)))
        model = keras.Model(inp, out)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        models.append(model)
    ours, stock = models
    np.testing.assert_array_equal(ours.predict(x, verbose=0), stock.predict(x, verbose=0))
    _fit(ours, x, y)
    _fit(stock, x, y)
    np.testing.assert_allclose(ours.predict(x, verbose=0), stock.predict(x, verbose=0), atol=1e-5)
    with pytest.raises(ValueError, match=r"shape \(n, 4\)"):
        ee.Embedding(4, weights=[np.zeros((3, 5))], name=_name("badw"))


def test_summary_counts_the_table_values():
    name = _name("summary")
    model = _model(name)
    x, y = _data(seed=11)
    _fit(model, x, y)
    layer = model.get_layer(name)
    assert layer.count_params() == len(layer.table) * 4 == len(np.unique(x)) * 4
    lines: list[str] = []
    model.summary(print_fn=lambda line, **_: lines.append(line))
    (row,) = [line for line in "\n".join(lines).splitlines() if name in line]
    assert f"{len(layer.table) * 4:,}" in row


def test_the_legacy_h5_format_refuses_a_model_with_tables(tmp_path):
    model = _model(_name("h5"))
    with pytest.raises(ValueError, match=r"\.keras"):
        model.save(tmp_path / "m.h5")
    assert not (tmp_path / "m.h5").exists()
    plain = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    plain.save(tmp_path / "plain.h5")  # models without tables save as before
    assert (tmp_path / "plain.h5").is_file()


def test_remote_tables_save_and_load_through_the_cluster(tmp_path):
    from _cluster import shards

    x, y = _data(seed=12)
    name = _name("remote")
    with shards(2) as started:
        ee.init(ps=[s.address for s in started], mode="sync")
        try:
            model = _model(name)
            _fit(model, x, y)
            remote = model.get_layer(name).table
            saved = _state(remote)
            model.save(tmp_path / "m.keras")
            _fit(model, x, y)  # the shards move on
            assert not np.array_equal(_state(remote)["values"], saved["values"])
            loaded = keras.models.load_model(tmp_path / "m.keras")  # rewrites the shards' rows
            restored = _state(loaded.get_layer(name).table)
            for field in saved:
                np.testing.assert_array_equal(restored[field], saved[field], err_msg=field)
        finally:
            ee.shutdown()


def test_variance_scaling_initializers_need_and_use_the_vocabulary_size():
    layer = ee.Embedding(
        4, embeddings_initializer="glorot_uniform", input_dim=1000, name=_name("glorot")
    )
    spec = layer.table.initializer
    limit = np.sqrt(6 / (1000 + 4))  # Glorot: uniform in ±sqrt(6 / (fan_in + fan_out))
    assert spec.kind == "uniform" and np.isclose(spec.b, limit) and np.isclose(spec.a, -limit)
    rows = layer.table.pull(np.arange(5000), train=False)
    assert np.abs(rows).max() <= limit and np.abs(rows).max() > 0.95 * limit
    with pytest.raises(ValueError, match="input_dim"):
        ee.Embedding(4, embeddings_initializer=keras.initializers.HeNormal(), name=_name("he"))
