"""A Functional model's ee.Embedding lookups on JAX, fused: one host callback per step for
the pulls of all its tables and one for their pushes, training bit for bit as each layer
looking up on its own (the path tested against stock Keras in test_jax_layer.py)."""

import collections

import keras
import numpy as np
import pytest

import elastic_emb as ee
from elastic_emb.keras import jax_processes, model_lookups, on_jax

DIM, BATCH, STEPS = 4, 8, 6


def _model(prefix: str) -> tuple[keras.Model, list[ee.Embedding]]:
    """Four lookups of three tables: one layer called twice, one with a combiner, one frozen."""
    keras.utils.set_random_seed(0)
    ids = keras.Input((4,), dtype="int64")
    adagrad, sgd = ee.optimizers.Adagrad(0.1), ee.optimizers.SGD(0.5)
    shared = ee.Embedding(DIM, optimizer=adagrad, name=f"{prefix}_shared", seed=1)
    mean = ee.Embedding(DIM, optimizer=sgd, combiner="mean", name=f"{prefix}_mean", seed=2)
    frozen = ee.Embedding(DIM, name=f"{prefix}_frozen", trainable=False, seed=3)
    parts = [shared(ids[:, 0]), shared(ids[:, 1]), mean(ids[:, 2:]), frozen(ids[:, 3])]
    out = keras.layers.Dense(1)(keras.layers.Concatenate()(parts))
    return keras.Model(ids, out), [shared, mean, frozen]


def _data(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 40, (n, 4)), rng.normal(size=(n, 1)).astype(np.float32)


def _train(prefix: str, optimizer: keras.optimizers.Optimizer, calls: collections.Counter):
    model, layers = _model(prefix)
    model.compile(optimizer, "mse", steps_per_execution=2)
    x, y = _data(1, BATCH * STEPS)
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    trained = dict(calls)
    calls.clear()
    unseen, _ = _data(2, 2 * BATCH)
    predicted = model.predict(unseen + 1000, batch_size=BATCH, verbose=0)
    inferred = dict(calls)
    calls.clear()
    return history.history["loss"], model, layers, trained, predicted, inferred


def _counting(monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    """Counts the host callbacks of the layers as they run, by kind (pull, push)."""
    calls: collections.Counter = collections.Counter()
    io_callback = on_jax.io_callback

    def counted(fn, *args, **kwargs):
        def run(*arrays):
            calls[fn.__name__] += 1
            return fn(*arrays)

        return io_callback(run, *args, **kwargs)

    monkeypatch.setattr(on_jax, "io_callback", counted)
    monkeypatch.setattr(jax_processes, "io_callback", counted)  # (one layer's lookup)
    return calls


def _sorted_rows(layer: ee.Embedding) -> tuple[np.ndarray, np.ndarray]:
    keys, values = layer.table.export_rows()
    order = np.argsort(keys)
    return keys[order], values[order]


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_fused_lookups_train_bit_for_bit_as_one_lookup_per_layer(monkeypatch, policy):
    calls = _counting(monkeypatch)
    keras.config.set_dtype_policy(policy)
    try:
        results = {}
        for fused in (False, True):
            with monkeypatch.context() as m:
                if not fused:  # no plan: every layer looks up on its own
                    m.setattr(model_lookups, "plan_of", lambda model, layer_type: None)
                optimizer: keras.optimizers.Optimizer = keras.optimizers.SGD(0.1)
                if policy == "mixed_float16":  # (a scale that overflows at first: skips)
                    optimizer = keras.optimizers.LossScaleOptimizer(
                        optimizer, initial_scale=2.0**17
                    )
                results[fused] = _train(f"fused_{fused}_{policy}", optimizer, calls)
    finally:
        keras.config.set_dtype_policy("float32")
    loss, model, layers, trained, predicted, inferred = results[True]
    loss_1, model_1, layers_1, trained_1, predicted_1, inferred_1 = results[False]
    assert loss == loss_1
    for layer, layer_1 in zip(layers, layers_1, strict=True):
        assert layer.table.iterations == layer_1.table.iterations
        for got, want in zip(_sorted_rows(layer), _sorted_rows(layer_1), strict=True):
            np.testing.assert_array_equal(got, want)
    for got, want in zip(model.get_weights(), model_1.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(predicted, predicted_1)
    # Per step, fused: one pull for the four lookups and one push for the three that train;
    # alone: a pull per lookup and a push per trained lookup.
    assert trained["pull"] == STEPS and trained["push"] == STEPS, trained
    assert trained_1["pull"] == 4 * STEPS and trained_1["push"] == 3 * STEPS, trained_1
    assert inferred == {"pull": 2} and inferred_1 == {"pull": 8}  # two batches, no push
    shared, mean, frozen = layers
    applied = STEPS
    if policy == "mixed_float16":
        applied = int(model.optimizer.inner_optimizer.iterations.numpy())
        assert 0 < applied < STEPS  # some steps skipped, some applied
        assert trained["settle"] == STEPS
    assert shared.table.iterations == mean.table.iterations == applied
    assert frozen.table.iterations == 0 and len(frozen.table) == 0
    # Prediction pulled the unseen ids without inserting them.
    x, _ = _data(1, BATCH * STEPS)
    assert len(shared.table) == len(np.unique(x[:, :2]))


def test_fused_lookups_with_data_parallel_train_as_on_one_device():
    def run(prefix):
        model, layers = _model(prefix)
        model.compile(keras.optimizers.SGD(0.1), "mse")
        x, y = _data(3, BATCH * 4)
        history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        return history.history["loss"], [_sorted_rows(layer) for layer in layers], model

    one = run("one_device")
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    try:
        two = run("two_devices")
    finally:
        keras.distribution.set_distribution(None)
    np.testing.assert_allclose(two[0], one[0], rtol=1e-6)
    for (keys, values), (keys_1, values_1) in zip(two[1], one[1], strict=True):
        np.testing.assert_array_equal(keys, keys_1)
        np.testing.assert_allclose(values, values_1, rtol=1e-5, atol=1e-7)
    for a, b in zip(two[2].get_weights(), one[2].get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
