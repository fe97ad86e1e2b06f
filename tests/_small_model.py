"""The two-table model the remote-training tests train on shards and in-process, on either
Keras backend (TensorFlow: test_remote_training.py; JAX: jax_backend/test_jax_remote.py)."""

from __future__ import annotations

import keras
import numpy as np

import elastic_emb as ee


def small_model(prefix: str) -> keras.Model:
    keras.utils.set_random_seed(0)
    ids = keras.Input((2,), dtype="int64")
    a = ee.Embedding(8, optimizer=ee.optimizers.Adagrad(0.1), name=f"{prefix}_a", seed=1)
    b = ee.Embedding(8, optimizer=ee.optimizers.Adam(0.01), name=f"{prefix}_b", seed=2)
    x = keras.layers.Concatenate()([a(ids[:, 0]), b(ids[:, 1])])
    out = keras.layers.Dense(1, activation="sigmoid")(x)
    model = keras.Model(ids, out)
    model.compile(keras.optimizers.SGD(0.1), "binary_crossentropy")
    return model


def sorted_rows(table: ee.Table) -> tuple[np.ndarray, np.ndarray]:
    keys, values = table.export_rows()
    order = np.argsort(keys)
    return keys[order], values[order]
