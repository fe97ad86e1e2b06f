"""Keras's weights by value carry the tables' rows on the TensorFlow backend (the tests in
_keras_weights.py, which the JAX tests share), and a KerasTuner search restores its best
model's rows."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _keras_weights import *  # noqa: F403 (the shared tests)
from _keras_weights import _data
from _small_model import sorted_rows

import elastic_emb as ee


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
