"""Trains a small model in its own process, for the resume tests.

Usage: python _resume_worker.py OUT_NPZ EPOCHS [CHECKPOINT_DIR]
Trains to EPOCHS (resuming from CHECKPOINT_DIR if given) and writes the
final dense weights and table rows to OUT_NPZ.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

import elastic_emb as ee


def main() -> None:
    out, epochs = sys.argv[1], int(sys.argv[2])
    ckpt = sys.argv[3] if len(sys.argv) > 3 else None
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, (256, 4)).astype(np.int64)
    y = (ids.sum(axis=1, keepdims=True) % 2).astype(np.float32)
    inp = keras.Input((4,), dtype="int64")
    emb_a = ee.Embedding(8, optimizer=ee.optimizers.Adam(0.01), name="a")
    emb_b = ee.Embedding(8, optimizer=ee.optimizers.Ftrl(0.1), name="b")
    x = keras.layers.Concatenate()(
        [
            keras.layers.Flatten()(emb_a(inp)),
            keras.layers.Flatten()(emb_b(inp)),
        ]
    )
    x = keras.layers.Dense(16, activation="relu")(x)
    model = keras.Model(inp, keras.layers.Dense(1, activation="sigmoid")(x))
    model.compile(keras.optimizers.Adam(0.01), "binary_crossentropy")
    callbacks = [ee.callbacks.Checkpoint(ckpt, save_freq="epoch")] if ckpt else []
    model.fit(ids, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)
    arrays = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    arrays.update({f"opt{i}": np.asarray(v) for i, v in enumerate(model.optimizer.variables)})
    for layer in (emb_a, emb_b):
        state = layer.table.export_state()
        order = np.argsort(state.keys)
        arrays[f"{layer.name}_keys"] = state.keys[order]
        arrays[f"{layer.name}_values"] = state.values[order]
        arrays[f"{layer.name}_slots"] = state.slots[order]
        arrays[f"{layer.name}_iterations"] = np.array(state.iterations)
    np.savez(out, **arrays)


if __name__ == "__main__":
    main()
