"""Keras's habits with ee.Embedding on JAX: model kinds, shared layers, combiners,
saving and loading, inference, frozen layers and what the layer refuses."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import keras
import numpy as np
import pytest

import elastic_emb as ee

DIM = 4


def _data(seed: int, n: int = 64, k: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 10**12, (n, k)), rng.normal(size=(n, 1)).astype(np.float32)


def _functional(layer: keras.layers.Layer, k: int = 3) -> keras.Model:
    ids = keras.Input((k,), dtype="int64")
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=3))
    return keras.Model(ids, dense(keras.layers.Flatten()(layer(ids))))


def _rows(layer: ee.Embedding) -> dict[int, np.ndarray]:
    keys, values = layer.table.export_rows()
    return dict(zip(keys.tolist(), values, strict=True))


class _Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding = ee.Embedding(DIM, optimizer=ee.optimizers.SGD(0.1), name="sub_rows")
        self.flatten = keras.layers.Flatten()
        self.out = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(3))

    def call(self, ids, training=None):
        return self.out(self.flatten(self.embedding(ids, training=training)))


def _build(kind: str) -> tuple[keras.Model, ee.Embedding]:
    if kind == "subclassed":
        model = _Subclassed()
        return model, model.embedding
    layer = ee.Embedding(DIM, optimizer=ee.optimizers.SGD(0.1), name=f"{kind}_rows")
    if kind == "functional":
        return _functional(layer), layer
    model = keras.Sequential([keras.Input((3,), dtype="int64"), layer, keras.layers.Flatten()])
    model.add(keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=3)))
    return model, layer


@pytest.mark.parametrize("kind", ["functional", "sequential", "subclassed"])
def test_every_kind_of_model_fits_evaluates_and_predicts_as_numpy_says(kind):
    model, layer = _build(kind)
    model.compile(keras.optimizers.SGD(0.05), "mse")
    x, y = _data(1, n=32)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert layer.table.iterations == 4 and len(layer.table) == len(np.unique(x))
    # The model's prediction, computed in NumPy from the table's rows and the dense weights.
    rows = _rows(layer)
    kernel, bias = (
        model.layers[-1].get_weights() if kind != "subclassed" else model.out.get_weights()
    )
    flat = np.stack([np.concatenate([rows[i] for i in example]) for example in x.tolist()])
    np.testing.assert_allclose(model.predict(x, verbose=0), flat @ kernel + bias, rtol=1e-5)
    loss = model.evaluate(x, y, verbose=0)
    np.testing.assert_allclose(loss, np.mean((flat @ kernel + bias - y) ** 2), rtol=1e-5)
    # Inference inserts nothing and pushes nothing.
    unseen = np.arange(10**13, 10**13 + 6).reshape(2, 3)
    model.predict(unseen, verbose=0)
    model.evaluate(unseen, np.zeros((2, 1), np.float32), verbose=0)
    assert layer.table.iterations == 4 and len(layer.table) == len(np.unique(x))


def test_a_layer_called_twice_in_a_step_pushes_once_as_a_stock_shared_embedding_trains():
    vocab, steps = 12, 5
    init = np.random.default_rng(0).uniform(-0.1, 0.1, (vocab, DIM)).astype(np.float32)

    def model(layer):
        a, b = keras.Input((2,), dtype="int64"), keras.Input((2,), dtype="int64")
        joined = keras.layers.Concatenate()(
            [keras.layers.Flatten()(layer(a)), keras.layers.Flatten()(layer(b))]
        )
        dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=5))
        return keras.Model([a, b], dense(joined))

    stock_layer = keras.layers.Embedding(vocab, DIM)
    mine_layer = ee.Embedding(DIM, optimizer=ee.optimizers.Adam(0.01), name="shared_rows")
    stock, mine = model(stock_layer), model(mine_layer)
    stock_layer.embeddings.assign(init)
    mine_layer.table.import_rows(np.arange(vocab), init)
    mine.layers[-1].set_weights(stock.layers[-1].get_weights())
    rng = np.random.default_rng(1)
    # Each step's 12 ids are every row once, split over the two calls (Adam moves untouched rows).
    ids = np.concatenate([rng.permutation(vocab).reshape(3, 4) for _ in range(steps)])
    x, y = [ids[:, :2], ids[:, 2:]], rng.normal(size=(len(ids), 1)).astype(np.float32)
    for m in (stock, mine):
        m.compile(keras.optimizers.Adam(0.01), "mse")
        m.fit(x, y, batch_size=3, epochs=1, shuffle=False, verbose=0)
    assert mine_layer.table.iterations == steps  # the two calls' gradients summed, one push
    keys, values = mine_layer.table.export_rows()
    np.testing.assert_allclose(
        values, np.asarray(stock_layer.embeddings)[keys], rtol=1e-5, atol=1e-7
    )


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_combiners_reduce_each_example_s_rows_as_numpy_does(combiner):
    layer = ee.Embedding(DIM, combiner=combiner, name=f"comb_{combiner}")
    ids = np.array([[1, 2, 3], [4, 4, 10**12]])
    out = np.asarray(layer(ids, training=True))
    rows = _rows(layer)
    summed = np.stack([sum(rows[i] for i in example) for example in ids.tolist()])
    expected = {"sum": summed, "mean": summed / 3, "sqrtn": summed / np.sqrt(3)}[combiner]
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_keras_files_and_weights_files_carry_the_rows(tmp_path):
    model, layer = _build("functional")
    model.compile("adam", "mse")
    x, y = _data(2)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    predicted = model.predict(x, verbose=0)
    model.save(tmp_path / "m.keras")
    model.save_weights(tmp_path / "m.weights.h5")
    saved = _rows(layer)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # the rows move on
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert type(loaded.layers[1]).__module__ == "elastic_emb.keras.on_jax"
    np.testing.assert_allclose(loaded.predict(x, verbose=0), predicted, rtol=1e-6)
    assert loaded.layers[1].table.iterations == 4
    model.load_weights(tmp_path / "m.weights.h5")
    assert _rows(layer).keys() == saved.keys()
    for key, row in saved.items():
        np.testing.assert_array_equal(_rows(layer)[key], row)
    np.testing.assert_allclose(model.predict(x, verbose=0), predicted, rtol=1e-6)


def test_ee_save_and_restore_round_trip_the_rows(tmp_path):
    model, layer = _build("functional")
    model.compile("sgd", "mse")
    x, y = _data(3)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    saved = _rows(layer)
    ee.save(tmp_path / "ckpt")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    ee.restore(tmp_path / "ckpt", tables=[layer.table])
    assert layer.table.iterations == 4 and _rows(layer).keys() == saved.keys()
    for key, row in saved.items():
        np.testing.assert_array_equal(_rows(layer)[key], row)


def test_a_frozen_layer_adds_and_trains_no_rows():
    model, layer = _build("functional")
    layer.trainable = False
    model.compile("sgd", "mse")
    x, y = _data(4)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert len(layer.table) == 0 and layer.table.iterations == 0


def test_float_ids_that_are_not_exact_whole_numbers_are_refused_naming_the_layer():
    layer = ee.Embedding(DIM, name="floaty")
    np.testing.assert_array_equal(
        np.asarray(layer(np.array([[1.0, 2.0]], np.float32))),
        np.asarray(layer(np.array([[1, 2]]))),
    )
    with pytest.raises(Exception, match=r"floaty.*not whole numbers"):
        np.asarray(layer(np.array([[1.5, 2.0]], np.float32)))


def test_string_ids_hashed_in_the_pipeline_train_the_rows_of_their_keys():
    """Strings reach a jitted step as `ee.string_keys` keys; NumPy strings given to the
    layer itself are hashed on the host. Keys from tf.fingerprint: test_layer.py."""
    layer = ee.Embedding(DIM, key_dtype="string", name="words")
    words = np.array([["apple", "pear", ""], ["pear", "fig", "apple"]] * 8)
    keys = ee.string_keys(words)
    assert keys.dtype == np.int64 and len(set(keys.ravel().tolist())) == 4
    model = _functional(layer)
    model.compile(keras.optimizers.SGD(0.05), "mse")
    before = np.asarray(layer(words))
    model.fit(keys, np.ones((16, 1), np.float32), batch_size=4, epochs=1, verbose=0)
    assert sorted(_rows(layer)) == sorted(set(keys.ravel().tolist()))
    assert layer.table.iterations == 4
    np.testing.assert_array_equal(np.asarray(layer(words)), np.asarray(layer(keys)))
    assert not np.array_equal(np.asarray(layer(words)), before)  # the pushes reached them
    masked = ee.Embedding(DIM, key_dtype="string", mask_zero=True, name="masked_words")
    np.testing.assert_array_equal(np.asarray(masked.compute_mask(words)), words != "")
    np.testing.assert_array_equal(np.asarray(masked.compute_mask(keys)), words != "")
    with pytest.raises(ValueError, match=r"takes strings, or on JAX their int64 keys.*int32"):
        layer(np.array([[1, 2]], np.int32))


def test_what_the_jax_layer_cannot_do_is_refused_clearly():
    keras.config.set_dtype_policy("mixed_float16")
    try:  # a gradient taken outside Keras's train step, which knows the loss scale
        layer = ee.Embedding(DIM, name="scaled")
        layer.build((1, 2))

        def loss(trainable):
            rows, _ = layer.stateless_call(trainable, [], np.array([[1, 2]]), training=True)
            return rows.astype("float32").sum()

        with pytest.raises(ValueError, match="Keras's own train step"):
            jax.grad(loss)([v.value for v in layer.trainable_variables])
    finally:
        keras.config.set_dtype_policy("float32")
    with pytest.raises(ImportError, match=r"TensorFlow backend.*KERAS_BACKEND is 'jax'"):
        ee.export_saved_model  # noqa: B018


def test_mixed_bfloat16_trains_with_bfloat16_outputs():
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model, layer = _build("functional")
        model.compile("sgd", "mse")
        x, y = _data(5)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        assert str(layer(x[:2]).dtype) == "bfloat16"
    finally:
        keras.config.set_dtype_policy("float32")
    assert layer.table.iterations == 4 and layer.table.row_dtype == "float32"


def test_without_64_bit_integers_ids_reach_the_table_whole(tmp_path):
    """With JAX_ENABLE_X64=0 (a subprocess): ids above 2**31, ids that share their low 32
    bits, -1, and string keys get rows of their own, in functional and subclassed models,
    which train as with 64-bit types on (this process, or a subprocess where this one has
    them off); wide ids for an input sliced before the layer are refused."""
    script = Path(__file__).with_name("_narrow_ids.py")

    def run(x64: str) -> dict[str, np.ndarray]:
        out = tmp_path / f"x64_{x64}.npz"
        env = {**os.environ, "KERAS_BACKEND": "jax", "JAX_ENABLE_X64": x64}
        done = subprocess.run(
            [sys.executable, str(script), str(out)], capture_output=True, text=True, env=env,
            timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        result = dict(np.load(out))
        assert bool(result.pop("x64")) == (x64 == "1")
        return result

    narrow = run("0")
    assert "JAX_ENABLE_X64=1" in str(narrow.pop("refusal")), narrow
    sys.path.insert(0, str(script.parent))
    import _narrow_ids

    if jax.config.jax_enable_x64:
        wide = _narrow_ids.train()
    else:
        wide = run("1")
        wide.pop("refusal")
    np.testing.assert_array_equal(narrow["narrow_ids_keys"], np.sort(_narrow_ids.IDS))
    words = ee.string_keys(_narrow_ids.WORDS)
    np.testing.assert_array_equal(narrow["narrow_words_keys"], np.sort(words))
    np.testing.assert_array_equal(narrow["narrow_subclassed_keys"], np.sort(_narrow_ids.IDS))
    assert sorted(wide) == sorted(narrow)
    for name, value in wide.items():
        if name.endswith(("keys", "mask")):
            np.testing.assert_array_equal(narrow[name], value, err_msg=name)
        else:
            np.testing.assert_allclose(narrow[name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def test_data_parallel_over_two_devices_trains_as_one_device_does():
    import jax

    assert len(jax.devices()) == 2  # (tests/jax_backend/conftest.py)

    def run(name):
        model, layer = _build("functional")
        model.compile(keras.optimizers.SGD(0.1), "mse")
        x, y = _data(6, n=64)
        history = model.fit(x % 50, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return history.history["loss"], _rows(layer), model.get_weights(), layer

    one = run("one_device")
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    try:
        two = run("two_devices")
    finally:
        keras.distribution.set_distribution(None)
    assert two[3].table.iterations == one[3].table.iterations == 4  # one push per step
    np.testing.assert_allclose(two[0], one[0], rtol=1e-6)
    assert two[1].keys() == one[1].keys()
    for key, row in one[1].items():
        np.testing.assert_allclose(two[1][key], row, rtol=1e-5, atol=1e-7)
    for a, b in zip(one[2], two[2], strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


def test_keras_checkpoint_callbacks_and_ee_s_carry_the_rows_on_jax(tmp_path):
    x, y = _data(7)
    model, layer = _build("functional")
    model.compile("adam", "mse")
    saving = keras.callbacks.ModelCheckpoint(tmp_path / "best.keras")
    ours = ee.callbacks.Checkpoint(tmp_path / "ee", save_freq="epoch")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[saving, ours])
    saved, predicted = _rows(layer), model.predict(x, verbose=0)
    loaded = keras.models.load_model(tmp_path / "best.keras")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), predicted, rtol=1e-6)
    loaded_rows = _rows(loaded.get_layer(layer.name))
    assert loaded_rows.keys() == saved.keys()
    for key, row in saved.items():
        np.testing.assert_array_equal(loaded_rows[key], row)
    # Resuming from ee's checkpoint restores the rows and skips the epoch done.
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    resumed = ee.callbacks.Checkpoint(tmp_path / "ee", save_freq="epoch")
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[resumed])
    assert len(history.history["loss"]) == 1  # epoch 1 was done
    assert layer.table.iterations == 4 + 4
    # BackupAndRestore: an interrupted fit goes on from the backup, rows included, and ends
    # as an uninterrupted one.
    straight, straight_layer = _build("functional")
    straight.compile("adam", "mse")
    straight.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    expected = _rows(straight_layer)

    class Stop(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                raise RuntimeError("interrupted")

    backup = tmp_path / "backup"
    for callbacks in ([Stop()], []):
        again, again_layer = _build("functional")
        again.compile("adam", "mse")
        try:
            history = again.fit(
                x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                callbacks=[keras.callbacks.BackupAndRestore(backup), *callbacks],
            )  # fmt: skip
        except RuntimeError as e:
            assert "interrupted" in str(e)
    assert len(history.history["loss"]) == 1 and again_layer.table.iterations == 8
    assert _rows(again_layer).keys() == expected.keys()
    for key, row in expected.items():
        np.testing.assert_allclose(_rows(again_layer)[key], row, rtol=1e-6, atol=1e-8)


def test_metrics_callback_reports_rows_and_refuses_a_log_dir_on_jax(tmp_path):
    with pytest.raises(ValueError, match="TensorFlow backend"):
        ee.callbacks.Metrics(log_dir=tmp_path)
    model, layer = _build("functional")
    model.compile("sgd", "mse")
    x, y = _data(8)
    history = model.fit(
        x, y, batch_size=16, epochs=1, verbose=0, callbacks=[ee.callbacks.Metrics()]
    )
    assert history.history["ee_rows"] == [float(len(layer.table))]


def test_the_jax_page_s_example_runs_and_prints_what_it_says(tmp_path):
    page = (Path(__file__).resolve().parents[2] / "docs" / "jax.md").read_text()
    marker = (
        "<!-- fragment: Keras on JAX (tests/jax_backend runs this page's blocks) -->\n```python\n"
    )
    blocks = [part.split("```", 1)[0] for part in page.split(marker)[1:]]
    assert blocks
    for block in blocks:
        expected = [line[2:] for line in block.splitlines() if line.startswith("# ")]
        done = subprocess.run(
            [sys.executable, "-c", block], capture_output=True, text=True, cwd=tmp_path,
            env={**os.environ, "KERAS_BACKEND": "jax"}, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == " ".join(expected).split(), done.stdout
