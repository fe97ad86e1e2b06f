"""ee.Embedding on Keras' JAX backend, against stock keras.layers.Embedding on JAX.

Both models start from the same rows (imported into the table) and the same dense
weights; the rows are trained by the stock optimizer in one and by the table's
optimizer of the same class and arguments in the other. Every row is looked up in
every step, so that the dense optimizer's update of rows without a gradient (Adam's
moments, FTRL's) cannot tell the two apart.
"""

import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import elastic_emb as ee

VOCAB, DIM, IDS_PER_EXAMPLE = 24, 4, 3
BATCH = VOCAB // IDS_PER_EXAMPLE
RTOL = 1e-5

OPTIMIZERS = {
    "sgd": (keras.optimizers.SGD, {"learning_rate": 0.1}),
    "adagrad": (keras.optimizers.Adagrad, {"learning_rate": 0.1}),
    "adam": (keras.optimizers.Adam, {"learning_rate": 0.01}),
    "ftrl": (
        keras.optimizers.Ftrl,
        {
            "learning_rate": 0.1,
            "l1_regularization_strength": 0.001,
            "l2_regularization_strength": 0.01,
        },
    ),
}


def _initial_rows() -> np.ndarray:
    return np.random.default_rng(1).uniform(-0.1, 0.1, (VOCAB, DIM)).astype(np.float32)


def _every_row_once(steps: int) -> np.ndarray:
    rng = np.random.default_rng(2)
    return np.concatenate(
        [rng.permutation(VOCAB).reshape(BATCH, IDS_PER_EXAMPLE) for _ in range(steps)]
    ).astype(np.int64)


def _model(embedding: keras.layers.Layer) -> keras.Model:
    ids = keras.Input((IDS_PER_EXAMPLE,), dtype="int64")
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=7))
    return keras.Model(ids, dense(keras.layers.Flatten()(embedding(ids))))


def _rows_of(layer: ee.Embedding) -> np.ndarray:
    keys, values = layer.table.export_rows()
    out = np.full((VOCAB, DIM), np.nan, np.float32)
    out[keys] = values
    return out


def _twins(mine_layer: ee.Embedding) -> tuple[keras.Model, keras.layers.Embedding, keras.Model]:
    """A stock model and one with `mine_layer`, from the same rows and dense weights."""
    stock_layer = keras.layers.Embedding(VOCAB, DIM)
    stock, mine = _model(stock_layer), _model(mine_layer)
    stock_layer.embeddings.assign(_initial_rows())
    mine_layer.table.import_rows(np.arange(VOCAB), _initial_rows())
    mine.layers[-1].set_weights(stock.layers[-1].get_weights())
    return stock, stock_layer, mine


def test_the_layer_is_the_jax_one_and_tensorflow_is_never_loaded():
    layer = ee.Embedding(DIM, name="which")
    assert type(layer).__module__ == "elastic_emb.keras.on_jax"
    assert keras.backend.backend() == "jax"
    assert "tensorflow" not in sys.modules


@pytest.mark.parametrize(
    ("opt_name", "steps_per_execution"), [*((name, 1) for name in sorted(OPTIMIZERS)), ("sgd", 3)]
)
def test_parity_with_stock_keras_embedding_on_jax(opt_name, steps_per_execution):
    """Several steps per execution: each step's pulls see the step before's pushes."""
    cls, kwargs = OPTIMIZERS[opt_name]
    steps = 6
    x = _every_row_once(steps)
    y = np.random.default_rng(3).normal(size=(len(x), 1)).astype(np.float32)
    mine_layer = ee.Embedding(DIM, optimizer=cls(**kwargs), name=f"parity_{opt_name}")
    stock, stock_layer, mine = _twins(mine_layer)
    losses = {}
    for name, model in (("stock", stock), ("ee", mine)):
        model.compile(cls(**kwargs), "mse", steps_per_execution=steps_per_execution)
        history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        losses[name] = history.history["loss"]
    np.testing.assert_allclose(losses["ee"], losses["stock"], rtol=RTOL)
    np.testing.assert_allclose(
        _rows_of(mine_layer), np.asarray(stock_layer.embeddings), rtol=RTOL, atol=1e-7
    )
    for a, b in zip(stock.layers[-1].get_weights(), mine.layers[-1].get_weights(), strict=True):
        np.testing.assert_allclose(b, a, rtol=RTOL, atol=1e-7)
    assert mine_layer.table.iterations == steps  # one push per step
    np.testing.assert_allclose(
        mine.predict(x, verbose=0), stock.predict(x, verbose=0), rtol=RTOL, atol=1e-7
    )
    assert mine_layer.table.iterations == steps and len(mine_layer.table) == VOCAB


def test_the_same_model_trains_as_on_the_tensorflow_backend(tmp_path):
    """`_same_model.py` run by a TensorFlow venv (`EE_TENSORFLOW_PYTHON`, set by .ci/jax)
    and here on JAX: the same losses, rows and dense weights to 1e-5."""
    python = os.environ.get("EE_TENSORFLOW_PYTHON")
    if not python:
        assert not os.environ.get("CI"), "CI must set EE_TENSORFLOW_PYTHON (.ci/jax)"
        pytest.skip("EE_TENSORFLOW_PYTHON (a Python with TensorFlow and elastic_emb) is not set")
    script = Path(__file__).with_name("_same_model.py")
    reference = tmp_path / "tensorflow.npz"
    env = {**os.environ, "KERAS_BACKEND": "tensorflow"}
    subprocess.run([python, str(script), str(reference)], check=True, env=env, timeout=600)
    sys.path.insert(0, str(script.parent))
    import _same_model

    on_jax, on_tf = _same_model.train(), np.load(reference)
    assert str(on_tf["backend"]) == "tensorflow"
    assert sorted(on_jax) == sorted(f for f in on_tf.files if f != "backend")
    for name, value in on_jax.items():
        if name.endswith(("keys", "iterations")):
            np.testing.assert_array_equal(value, on_tf[name], err_msg=name)
        else:
            np.testing.assert_allclose(value, on_tf[name], rtol=RTOL, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_mixed_float16_trains_as_stock_keras_skipping_the_same_steps(steps_per_execution):
    """Under loss scaling both models skip the steps whose scaled gradients overflow (a
    scale of 2**24 halves until they fit) and apply the rest unscaled."""
    steps = 12
    x = _every_row_once(steps)
    y = np.random.default_rng(3).normal(size=(len(x), 1)).astype(np.float32)
    keras.config.set_dtype_policy("mixed_float16")
    try:
        mine_layer = ee.Embedding(DIM, optimizer=ee.optimizers.SGD(0.1), name="scaled_rows")
        stock, stock_layer, mine = _twins(mine_layer)
        losses = {}
        for name, model in (("stock", stock), ("ee", mine)):
            scaled = keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(0.1), initial_scale=2.0**24
            )
            model.compile(scaled, "mse", steps_per_execution=steps_per_execution)
            history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
            losses[name] = history.history["loss"]
        applied = int(stock.optimizer.inner_optimizer.iterations.numpy())
        assert 0 < applied < steps  # some steps skipped, some applied
        assert (
            int(mine.optimizer.inner_optimizer.iterations.numpy())
            == applied
            == mine_layer.table.iterations
        )
        assert str(mine_layer(x[:1]).dtype) == "float16"
    finally:
        keras.config.set_dtype_policy("float32")
    np.testing.assert_allclose(losses["ee"], losses["stock"], rtol=1e-3)
    np.testing.assert_allclose(
        _rows_of(mine_layer), np.asarray(stock_layer.embeddings), rtol=RTOL, atol=1e-7
    )
    assert not np.allclose(_rows_of(mine_layer), _initial_rows())
