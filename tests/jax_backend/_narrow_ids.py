"""One small model with int64 ids above 2**31 and string keys, trained by whichever JAX
runs it: with 64-bit types off (`python _narrow_ids.py OUT`, JAX_ENABLE_X64=0, saves a
.npz) or on (the tests' own process, `train()`), to compare the two."""

from __future__ import annotations

import sys

import keras
import numpy as np

import elastic_emb as ee

# Ids JAX would cut to 32 bits: the first three share their low 32 bits pairwise or with 1.
IDS = np.array([2**31 + 1, 2**31 + 2**32 + 1, 2**53 + 1, -1], np.int64)
WORDS = np.array(["apple", "pear", "fig", ""])


def train() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = {
        "ids": IDS[rng.integers(0, 4, (16, 3))],
        "words": ee.string_keys(WORDS[rng.integers(0, 4, (16, 2))]),
        "other": rng.normal(size=(16, 1)),  # float64: Keras casts it, as without ee
    }
    y = rng.normal(size=(16, 1)).astype(np.float32)
    inputs = {
        "ids": keras.Input((3,), dtype="int64", name="ids"),
        "words": keras.Input((2,), dtype="int64", name="words"),
        "other": keras.Input((1,), name="other"),
    }
    ids = ee.Embedding(4, optimizer=ee.optimizers.SGD(0.5), combiner="mean", name="narrow_ids")
    words = ee.Embedding(
        4, key_dtype="string", mask_zero=True, optimizer=ee.optimizers.Adagrad(0.1),
        name="narrow_words",
    )  # fmt: skip
    joined = keras.layers.Concatenate()(
        [ids(inputs["ids"]), keras.ops.sum(words(inputs["words"]), axis=1), inputs["other"]]
    )
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=5))
    model = keras.Model(inputs, dense(joined))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    out = {"loss": np.array(history.history["loss"]), "predicted": model.predict(x, verbose=0)}
    out["evaluated"] = np.array(model.evaluate(x, y, verbose=0))
    out["mask"] = np.asarray(words.compute_mask(x["words"]))
    for layer in (ids, words):
        keys, rows = layer.table.export_rows()
        order = np.argsort(keys)
        out[f"{layer.name}_keys"], out[f"{layer.name}_rows"] = keys[order], rows[order]
    out["kernel"], out["bias"] = dense.get_weights()
    # A subclassed model: its int64 input reaches the layer as it is called.
    subclassed = _Subclassed()
    subclassed.compile(keras.optimizers.SGD(0.1), "mse")
    subclassed.fit(x["ids"], y[:, 0], batch_size=8, shuffle=False, verbose=0)
    keys, rows = subclassed.rows.table.export_rows()
    out["narrow_subclassed_keys"], out["narrow_subclassed_rows"] = (
        np.sort(keys),
        rows[np.argsort(keys)],
    )
    return out


class _Subclassed(keras.Model):
    def __init__(self) -> None:
        super().__init__()
        self.rows = ee.Embedding(2, optimizer=ee.optimizers.SGD(0.5), name="narrow_subclassed")

    def call(self, ids: object) -> object:
        return keras.ops.sum(self.rows(ids), axis=(1, 2))


if __name__ == "__main__":
    import jax

    result = train()

    # An int64 input sliced before an ee.Embedding layer: JAX would cut it, so wide ids
    # are refused there.
    ids = keras.Input((2,), dtype="int64")
    model = keras.Model(ids, ee.Embedding(2, name="narrow_sliced")(ids[:, 0]))
    model.compile("sgd", "mse")
    try:
        model.fit(IDS.reshape(2, 2), np.zeros((2, 2), np.float32), verbose=0)
        refusal = ""
    except ValueError as e:
        refusal = str(e)
    np.savez(sys.argv[1], x64=jax.config.jax_enable_x64, refusal=refusal, **result)
