"""One model trained the same way on whichever Keras backend runs it: its losses, rows
and dense weights, saved to a .npz (`python _same_model.py OUT` under KERAS_BACKEND=...).
The JAX tests compare the JAX run with TensorFlow's, run by the CI's TensorFlow venv."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_ENABLE_X64", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

import elastic_emb as ee

TABLES = {  # name: (optimizer, its arguments)
    "same_adagrad": (ee.optimizers.Adagrad, {"learning_rate": 0.1}),
    "same_adam": (ee.optimizers.Adam, {"learning_rate": 0.01}),
    "same_ftrl": (ee.optimizers.Ftrl, {"learning_rate": 0.1, "l2_regularization_strength": 0.01}),
}


def train() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 10**12, (256, len(TABLES))) % 500  # repeats: rows trained many times
    y = rng.integers(0, 2, (256, 1)).astype(np.float32)
    words = np.array(["apple", "pear", "fig", "ünïcode", ""])[rng.integers(0, 5, (256, 1))]
    # JAX arrays hold no strings: there the input pipeline hashes them (docs/jax.md).
    on_tf = keras.backend.backend() == "tensorflow"
    ids = keras.Input((len(TABLES),), dtype="int64")
    word_ids = keras.Input((1,), dtype="string" if on_tf else "int64")
    layers = [
        ee.Embedding(8, optimizer=cls(**kwargs), name=name, seed=i)
        for i, (name, (cls, kwargs)) in enumerate(TABLES.items())
    ]
    word_layer = ee.Embedding(
        8, optimizer=ee.optimizers.Adagrad(0.1), key_dtype="string", name="same_words", seed=7
    )
    joined = keras.layers.Concatenate()(
        [layer(ids[:, i]) for i, layer in enumerate(layers)]
        + [keras.layers.Flatten()(word_layer(word_ids))]
    )
    hidden = keras.layers.Dense(16, activation="relu")(joined)
    model = keras.Model([ids, word_ids], keras.layers.Dense(1, activation="sigmoid")(hidden))
    # Dense weights from NumPy: seeded Keras initializers differ between backends.
    weights = np.random.default_rng(1)
    for layer in model.layers:
        if isinstance(layer, keras.layers.Dense):
            layer.set_weights(
                [weights.uniform(-0.3, 0.3, w.shape).astype(np.float32) for w in layer.weights]
            )
    model.compile(keras.optimizers.SGD(0.1), "binary_crossentropy")
    if on_tf:  # Keras takes strings as tensors, not NumPy arrays
        import tensorflow as tf

        inputs = [x, tf.constant(words)]
    else:
        inputs = [x, ee.string_keys(words)]
    history = model.fit(inputs, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    out = {"loss": np.array(history.history["loss"], np.float64)}
    for layer in [*layers, word_layer]:
        keys, values = layer.table.export_rows()
        order = np.argsort(keys)
        out[f"{layer.name}/keys"], out[f"{layer.name}/values"] = keys[order], values[order]
        out[f"{layer.name}/iterations"] = np.array(layer.table.iterations)
    dense = [
        w
        for layer in model.layers
        if isinstance(layer, keras.layers.Dense)
        for w in layer.get_weights()
    ]
    for i, w in enumerate(dense):
        out[f"dense/{i}"] = w
    return out


if __name__ == "__main__":
    np.savez(sys.argv[1], backend=keras.backend.backend(), **train())
