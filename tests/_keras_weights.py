"""Keras's weights by value carry the tables' rows, on either Keras backend: the tests that
test_keras_weights.py (TensorFlow) and jax_backend/test_jax_weights.py (JAX) collect.

Each right answer comes from the run itself: rows and dense weights recorded at every
epoch's end, and the predictions of the model whose weights were copied."""

from __future__ import annotations

import contextlib
import copy
import functools
import pickle
from collections.abc import Iterator

import keras
import numpy as np
import pytest
from _cluster import connected_shards
from _small_model import small_model, sorted_rows

import elastic_emb as ee
from elastic_emb.keras.base import embedding_layers

TABLES = ("_a", "_b")


@contextlib.contextmanager
def _placed(where: str) -> Iterator[None]:
    """Tables made inside are in-process ("local") or on 2 real shards in sync mode."""
    if where == "local":
        yield
        return
    with connected_shards(2):
        yield


def _data(n: int = 256, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 40, (n, 2))
    return x, rng.integers(0, 2, (n, 1)).astype(np.float32)


def _state(model: keras.Model) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], list]:
    """(sorted rows of every table, the dense weights), read without get_weights."""
    rows = {layer.name: sorted_rows(layer.table) for layer in embedding_layers(model)}
    dense = [
        keras.ops.convert_to_numpy(v) for v in model.weights if not hasattr(v, "ee_push_trigger")
    ]
    return rows, dense


def _assert_same(got: tuple, want: tuple, atol: float = 1e-6) -> None:
    assert got[0].keys() == want[0].keys()
    for name, (keys, values) in want[0].items():
        np.testing.assert_array_equal(got[0][name][0], keys)
        np.testing.assert_allclose(got[0][name][1], values, rtol=0, atol=atol)
    for a, b in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol)


def _distance(a: tuple, b: tuple) -> float:
    """How far apart two states' rows are (their common keys)."""
    far = 0.0
    for name, (keys, values) in a[0].items():
        other_keys, other_values = b[0][name]
        _, i, j = np.intersect1d(keys, other_keys, return_indices=True)
        far = max(far, float(np.abs(values[i] - other_values[j]).max()))
    return far


@pytest.mark.parametrize("where", ["local", "shards"])
def test_early_stopping_restores_the_best_epoch_s_rows_with_its_dense_weights(where):
    x, y = _data()
    with _placed(where):
        model = small_model(f"stop_{where}")
        states: list[tuple] = []
        record = keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs: states.append(_state(model))
        )
        stop = keras.callbacks.EarlyStopping(patience=2, restore_best_weights=True)
        # Validation labels opposite to the training ones: the first epoch is the best.
        history = model.fit(
            x, y, validation_data=(x[:64], 1 - y[:64]), batch_size=32, epochs=20,
            shuffle=False, verbose=0, callbacks=[record, stop],
        )  # fmt: skip
        losses = history.history["val_loss"]
        best = int(np.argmin(losses))
        assert len(losses) == best + 3 < 20  # stopped by EarlyStopping, 2 epochs after the best
        assert _distance(states[-1], states[best]) > 1e-3  # the rows moved on after the best
        _assert_same(_state(model), states[best])


@pytest.mark.parametrize("where", ["local", "shards"])
def test_set_weights_between_twins_and_clones_makes_them_predict_alike(where):
    x, y = _data()
    with _placed(where):
        model = small_model(f"twin_{where}")
        model.fit(x, y, batch_size=32, epochs=2, verbose=0)
        want = model.predict(x, verbose=0)
        twin = small_model(f"other_{where}")  # other tables, other names
        clone = keras.models.clone_model(model)  # the same names (in-process: other tables)
        clone.compile(keras.optimizers.SGD(0.1), "binary_crossentropy")
        assert np.abs(twin.predict(x, verbose=0) - want).max() > 1e-3
        weights = model.get_weights()
        for copied in (twin, clone):
            copied.set_weights(weights)
            np.testing.assert_allclose(copied.predict(x, verbose=0), want, rtol=0, atol=1e-6)
        # They train on alike too: the optimizer slots and step counts came with the rows.
        for copied in (model, twin):
            copied.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        np.testing.assert_allclose(twin.predict(x, verbose=0), model.predict(x, verbose=0),
                                   rtol=0, atol=1e-6)  # fmt: skip


def test_a_layer_s_weights_move_its_rows_to_another_layer():
    x, y = _data()
    model = small_model("layer_from")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    target = small_model("layer_to")
    source_layer, target_layer = model.get_layer("layer_from_a"), target.get_layer("layer_to_a")
    target_layer.set_weights(source_layer.get_weights())
    for got, want in zip(sorted_rows(target_layer.table), sorted_rows(source_layer.table),
                         strict=True):  # fmt: skip
        np.testing.assert_array_equal(got, want)
    assert target_layer.table.iterations == source_layer.table.iterations == 8
    matrix = np.ones((40, 8), np.float32)
    with pytest.raises(ValueError, match=r"set_weights\(\) got no table rows.*weights=matrix"):
        target_layer.set_weights([matrix])  # a stock Embedding's habit: pointed elsewhere


def test_copies_keep_the_rows_and_values_without_them_are_refused_changing_nothing():
    x, y = _data()
    model = small_model("copies")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    weights, saved = model.get_weights(), _state(model)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    moved = _state(model)
    for kept in (
        [w.copy() for w in weights],
        copy.deepcopy(weights),
        pickle.loads(pickle.dumps(weights)),
    ):
        model.set_weights(kept)
        _assert_same(_state(model), saved, atol=0)
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    for dropped in (
        [np.array(w) for w in weights],
        [w * 1.0 for w in weights],
        [np.mean([w, w], axis=0) for w in weights],  # averaging weights
    ):
        before = _state(model)
        with pytest.raises(ValueError, match=r"set_weights\(\) got no table rows for ee.Embed"):
            model.set_weights(dropped)
        _assert_same(_state(model), before, atol=0)  # nothing assigned, dense weights included
    assert _distance(moved, saved) > 1e-3


def test_rows_of_a_table_that_does_not_fit_are_refused_changing_nothing():
    x, y = _data()
    model = small_model("fits")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    other = small_model("fits_not")
    weights = model.get_weights()
    a, b = (i for i, v in enumerate(model.weights) if hasattr(v, "ee_push_trigger"))
    weights[a], weights[b] = weights[b], weights[a]  # table b's rows (Adam) at a's (Adagrad)
    before = _state(other)
    with pytest.raises(ValueError, match="does not match"):
        other.set_weights(weights)
    _assert_same(_state(other), before, atol=0)


@pytest.mark.skipif(not hasattr(keras.Model, "get_state_tree"), reason="Keras 3.6+")
def test_the_state_tree_carries_the_rows():
    x, y = _data()
    model = small_model("tree")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    # (As NumPy arrays: on TensorFlow the default format holds the live variables.)
    tree, saved = model.get_state_tree(value_format="numpy_array"), _state(model)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert _distance(_state(model), saved) > 1e-3
    model.set_state_tree(tree)
    _assert_same(_state(model), saved, atol=0)
    plain = keras.tree.map_structure(np.array, model.get_state_tree(value_format="numpy_array"))
    with pytest.raises(ValueError, match=r"set_state_tree\(\) got no table rows"):
        model.set_state_tree(plain)


def test_a_compile_optimizer_with_a_moving_average_is_refused():
    x, y = _data()
    model = small_model("ema")
    model.compile(keras.optimizers.SGD(0.1, use_ema=True), "binary_crossentropy")
    with pytest.raises(ValueError, match="use_ema=True"):
        model.fit(x, y, verbose=0)


def test_callbacks_that_copy_no_weights_leave_the_table_to_its_optimizer():
    x, y = _data()
    model = small_model("plateau")
    table = model.get_layer("plateau_a").table
    rate = table.optimizer.learning_rate
    seen: list[int] = []
    callbacks = [
        keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=10),
        keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs: seen.append(table.iterations)
        ),
    ]
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=callbacks)
    assert seen == [8, 16]
    # ReduceLROnPlateau halved the compile optimizer's rate (the dense weights'), not the table's.
    assert float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)) == pytest.approx(0.05)
    assert table.optimizer.learning_rate == rate


@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_terminate_on_nan_stops_a_table_that_skips_non_finite_steps(nonfinite):
    ids = keras.Input((1,), dtype="int64")
    layer = ee.Embedding(4, optimizer=ee.optimizers.SGD(0.1), nonfinite=nonfinite,
                         name=f"nan_{nonfinite}")  # fmt: skip
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(layer(ids))))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    x = np.arange(64).reshape(-1, 1)
    y = np.full((64, 1), np.nan, np.float32)
    fit = functools.partial(model.fit, x, y, batch_size=8, epochs=3, verbose=0,
                            callbacks=[keras.callbacks.TerminateOnNaN()])  # fmt: skip
    if nonfinite == "raise":  # the table stops fit first (JAX wraps its ValueError)
        with pytest.raises(Exception, match="gradient values are not finite"):
            fit()
    else:
        history = fit()
        assert len(history.history["loss"]) == 1 and np.isnan(history.history["loss"][0])
        assert layer.table.nonfinite_pushes == 1
    assert layer.table.iterations == 0


def test_count_params_and_summary_count_the_table_s_values():
    x, y = _data()
    model = small_model("summary")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    layers = embedding_layers(model)
    dense = sum(int(np.prod(v.shape)) for v in model.weights if not hasattr(v, "ee_push_trigger"))
    assert [layer.count_params() for layer in layers] == [len(layer.table) * 8 for layer in layers]
    assert model.count_params() == sum(len(layer.table) * 8 for layer in layers) + dense
    lines: list[str] = []
    model.summary(print_fn=lambda line, *a, **k: lines.append(line))
    for layer in layers:  # each table's row (Keras's totals count its variables: 1 a table)
        assert any(layer.name in line and f"{len(layer.table) * 8:,}" in line for line in lines)


def test_orbax_checkpoint_which_writes_variables_values_only_is_refused(tmp_path):
    if not hasattr(keras.callbacks, "OrbaxCheckpoint"):
        pytest.skip("Keras 3.13+")
    pytest.importorskip("orbax.checkpoint")
    x, y = _data()
    model = small_model("orbax")
    with pytest.raises(ValueError, match="OrbaxCheckpoint writes the values"):
        model.fit(x, y, verbose=0, callbacks=[keras.callbacks.OrbaxCheckpoint(tmp_path / "o")])
    assert model.get_layer("orbax_a").table.iterations == 0


def test_model_checkpoint_keeps_the_best_epoch_s_rows_in_a_weights_file(tmp_path):
    x, y = _data()
    model = small_model("best_file")
    states: list[tuple] = []
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: states.append(_state(model))
    )
    path = str(tmp_path / "best.weights.h5")
    best_only = keras.callbacks.ModelCheckpoint(path, save_weights_only=True, save_best_only=True)
    history = model.fit(
        x, y, validation_data=(x[:64], 1 - y[:64]), batch_size=32, epochs=3, shuffle=False,
        verbose=0, callbacks=[record, best_only],
    )  # fmt: skip
    best = int(np.argmin(history.history["val_loss"]))
    assert best < 2 and _distance(states[-1], states[best]) > 1e-3
    model.load_weights(path)
    _assert_same(_state(model), states[best], atol=0)


def test_a_keras_tuner_search_restores_the_best_trial_s_rows(tmp_path):
    keras_tuner = pytest.importorskip("keras_tuner")
    x, y = _data()
    seen: dict[tuple[int, int], tuple[float, tuple[np.ndarray, np.ndarray]]] = {}
    built: list[keras.Model] = []

    def build(hp: object) -> keras.Model:
        ids = keras.Input((2,), dtype="int64")
        rate = hp.Choice("rate", [0.05, 0.5])  # type: ignore[attr-defined]
        rows = ee.Embedding(4, optimizer=ee.optimizers.Adagrad(rate), name="tuned", seed=3)(ids)
        out = keras.layers.Dense(1, activation="sigmoid")(keras.layers.Flatten()(rows))
        model = keras.Model(ids, out)
        model.compile(keras.optimizers.SGD(0.1), "binary_crossentropy")
        built.append(model)
        return model

    def record(epoch: int, logs: dict) -> None:
        model = built[-1]
        seen[len(built), epoch] = (logs["val_loss"], sorted_rows(model.get_layer("tuned").table))

    tuner = keras_tuner.RandomSearch(
        build, objective="val_loss", max_trials=2, directory=tmp_path, seed=1
    )
    tuner.search(
        x, y, validation_data=(x[:64], y[:64]), epochs=3, batch_size=32, verbose=0,
        callbacks=[keras.callbacks.LambdaCallback(on_epoch_end=record)],
    )  # fmt: skip
    assert len({trial for trial, _ in seen}) == 2
    best_loss, best_rows = min(seen.values(), key=lambda v: v[0])
    restored = tuner.get_best_models(1)[0]
    for got, want in zip(sorted_rows(restored.get_layer("tuned").table), best_rows, strict=True):
        np.testing.assert_array_equal(got, want)
    assert restored.evaluate(x[:64], y[:64], verbose=0) == pytest.approx(best_loss, rel=1e-5)
