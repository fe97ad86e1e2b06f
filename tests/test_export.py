"""Export: `model.export()` and `ee.export_saved_model` write SavedModels that serve with stock
TensorFlow ops. The reference is `model.predict` of the live model; the SavedModel is loaded
in a fresh process where importing elastic_emb is blocked.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from _saved_models import check_in_fresh_process, features_model, inputs

import elastic_emb as ee
from elastic_emb.keras.patches import keras_version
from elastic_emb.serving import export as serving


@pytest.mark.parametrize("how", ["model.export", "ee.export_saved_model"])
def test_exported_model_serves_with_stock_ops_like_predict(tmp_path, how):
    rng = np.random.default_rng(0)
    model = features_model()
    train = inputs(rng, 256, 0, 40)
    model.fit(train, rng.normal(size=(256, 1)), batch_size=32, epochs=2, verbose=0)
    if how == "model.export":
        model.export(tmp_path / "model")  # (Keras < 3.6 takes no `verbose`)
    else:
        ee.export_saved_model(model, tmp_path / "model")
    for name in ("exp_user", "exp_items", "exp_city"):
        assert model.get_layer(name).serving_table is None  # the live model is live again
    seen = {k: v[:32] for k, v in train.items()}
    unseen = inputs(rng, 32, 10**9, 10**12)  # never trained: initial values
    cases = {
        "seen": (seen, model.predict(seen, verbose=0)),
        "unseen": (unseen, model.predict(unseen, verbose=0)),
    }
    assert check_in_fresh_process(tmp_path, cases) <= 1e-6
    # The check can fail: the live model after more training predicts otherwise.
    model.fit(train, rng.normal(size=(256, 1)), batch_size=32, epochs=1, verbose=0)
    moved = {"seen": (seen, model.predict(seen, verbose=0))}
    assert check_in_fresh_process(tmp_path, moved) > 1e-4


@pytest.mark.skipif(keras_version() < (3, 9), reason="keras.Input(ragged=True) is new in Keras 3.9")
def test_ragged_ids_export_through_ee_export_saved_model(tmp_path):
    ids = keras.Input(shape=(None,), dtype="int64", ragged=True)
    out = keras.layers.Dense(1)(ee.Embedding(4, combiner="sqrtn", name="exp_ragged")(ids))
    model = keras.Model(ids, out)
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(1)
    lengths = rng.integers(0, 4, 64)
    values = rng.integers(0, 30, int(lengths.sum())).astype(np.int64)
    x = tf.RaggedTensor.from_row_lengths(values, lengths)
    model.fit(x, rng.normal(size=(64, 1)), batch_size=16, verbose=0)
    ee.export_saved_model(
        model, tmp_path / "model", input_signature=[tf.RaggedTensorSpec([None, None], tf.int64)]
    )
    unseen_values = values + 10**10
    unseen = tf.RaggedTensor.from_row_lengths(unseen_values, lengths)
    cases = {
        "seen": (
            {"ragged": 1, "values": values, "lengths": lengths},
            model.predict(x, verbose=0),
        ),
        "unseen": (
            {"ragged": 1, "values": unseen_values, "lengths": lengths},
            model.predict(unseen, verbose=0),
        ),
    }
    assert check_in_fresh_process(tmp_path, cases) <= 1e-6


def test_a_saved_model_holding_the_model_inside_another_object_refuses_loudly(tmp_path):
    # (tf.saved_model.save of the model itself writes stock ops: test_keras_compat.py.)
    ids = keras.Input((), dtype="int64")
    model = keras.Model(ids, ee.Embedding(2, name="exp_refuse")(ids))
    model.predict(np.arange(5), verbose=0)
    holder = tf.Module()
    holder.model = model
    with pytest.raises(ValueError, match=r"tf\.saved_model\.save\(model, path\)"):
        tf.saved_model.save(holder, str(tmp_path / "raw"))
    assert model.get_layer("exp_refuse").serving_table is None


def test_empty_tables_and_extreme_keys_export(tmp_path):
    """No rows at all, then rows at both ends of int64 (the largest is also the sentinel's)."""
    ids = keras.Input((), dtype="int64", name="ids")
    model = keras.Model({"ids": ids}, ee.Embedding(3, name="exp_extremes")(ids))
    probe = {"ids": np.array([0, 7, -(2**63), 2**63 - 1], np.int64)}
    model.export(tmp_path / "model")  # nothing trained: no rows
    cases = {"empty": (probe, model.predict(probe, verbose=0))}
    table = model.get_layer("exp_extremes").table
    table.import_rows(probe["ids"][2:], np.full((2, 3), 5.0, np.float32))
    model.export(tmp_path / "extremes")
    expected = model.predict(probe, verbose=0)
    assert (expected[2:] == 5.0).all() and (np.abs(expected[:2]) < 1).all()
    assert check_in_fresh_process(tmp_path, cases) == 0.0
    assert check_in_fresh_process(tmp_path, {"rows": (probe, expected)}, "extremes") == 0.0


@pytest.mark.parametrize(
    "kind", ["zeros", "ones", "constant", "uniform", "normal", "truncated_normal"]
)
def test_initial_rows_in_tensorflow_ops_equal_the_cores(kind):
    initializer = keras.initializers.Constant(0.25) if kind == "constant" else kind
    table = ee.Table(dim=7, initializer=initializer, name=f"exp_init_{kind}", seed=2**40 + 3)
    keys = np.concatenate([np.arange(-300, 300), [2**63 - 1, -(2**63), 2**40 + 7]]).astype(np.int64)
    ours = serving.initial_rows(tf.constant(keys), table.initializer, table.seed, 7).numpy()
    np.testing.assert_allclose(ours, table.pull(keys, train=False), rtol=0, atol=1e-7)


@pytest.mark.parametrize("row_dtype", ["float16", "bfloat16", "int8"])
def test_compact_rows_serve_like_the_model_holding_those_rows(tmp_path, row_dtype):
    rng = np.random.default_rng(2)
    model = features_model()
    train = inputs(rng, 256, 0, 40)
    model.fit(train, rng.normal(size=(256, 1)), batch_size=32, epochs=1, verbose=0)
    ee.export_saved_model(model, tmp_path / "model", row_dtype=row_dtype)
    saved = tf.train.load_checkpoint(str(tmp_path / "model" / "variables" / "variables"))
    assert row_dtype in {d.name for d in saved.get_variable_to_dtype_map().values()}
    seen, unseen = {k: v[:32] for k, v in train.items()}, inputs(rng, 32, 10**9, 10**12)
    exact = model.predict(seen, verbose=0)
    # The reference: the live model with each table's rows replaced by their compact form.
    for name in ("exp_user", "exp_items", "exp_city"):
        table = model.get_layer(name).table
        compact = ee.export_rows(table, row_dtype)
        table.import_rows(compact.keys, compact.dequantize())
    expected = model.predict(seen, verbose=0)
    assert np.abs(expected - exact).max() > 1e-6  # the format really is coarser
    cases = {
        "seen": (seen, expected),
        "unseen": (unseen, model.predict(unseen, verbose=0)),  # initial values, as float32
    }
    assert check_in_fresh_process(tmp_path, cases) <= 1e-5
