"""Exported SavedModels for tests: a model with every kind of feature, and a check that
loads a SavedModel in a fresh process where importing elastic_emb is blocked, both as
`tf.saved_model.load` does and as TF Serving does (a TF1 session running the
`serving_default` signature of the graph after its restore op).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import keras
import numpy as np
from _processes import run_python

import elastic_emb as ee

_LOAD = textwrap.dedent(
    """
    import sys

    class Blocked:
        def find_spec(self, name, path=None, target=None):
            if name == "elastic_emb" or name.startswith("elastic_emb."):
                raise ImportError("elastic_emb is blocked in this process")

    sys.meta_path.insert(0, Blocked())
    import numpy as np
    import tensorflow as tf

    path = sys.argv[1]
    loaded = tf.saved_model.load(path)
    cases = np.load("cases.npz", allow_pickle=True)
    worst = 0.0
    for name in cases["names"]:
        inputs = cases[f"{name}_inputs"].item()
        expected = cases[f"{name}_expected"]
        if "ragged" in inputs:
            arg = tf.RaggedTensor.from_row_lengths(inputs["values"], inputs["lengths"])
        else:
            arg = {k: tf.constant(v) for k, v in inputs.items()}
            (spec,) = loaded.serve.concrete_functions[0].structured_input_signature[0]
            # Keras < 3.8 exports dict inputs as a list of named inputs, or one input.
            if isinstance(spec, (list, tuple)):
                arg = [arg[s.name] for s in spec]
            elif isinstance(spec, tf.TensorSpec):
                arg = arg[spec.name]
        worst = max(worst, float(np.abs(loaded.serve(arg).numpy() - expected).max()))
        if "ragged" in inputs:
            continue
        # TF Serving's signature, in TF2 and as TF Serving runs it (graph, restore op).
        (out,) = loaded.signatures["serving_default"](
            **{k: tf.constant(v) for k, v in inputs.items()}
        ).values()
        worst = max(worst, float(np.abs(out.numpy() - expected).max()))
        with tf.Graph().as_default(), tf.compat.v1.Session() as session:
            meta = tf.compat.v1.saved_model.loader.load(session, ["serve"], path)
            signature = meta.signature_def["serving_default"]
            feed = {signature.inputs[k].name: v for k, v in inputs.items()}
            (output,) = signature.outputs.values()
            got = session.run(output.name, feed)
        worst = max(worst, float(np.abs(got - expected).max()))
    print("WORST", worst)
    """
)


def check_in_fresh_process(
    directory: Path, cases: dict[str, tuple[dict, np.ndarray]], model: str = "model"
) -> float:
    """The largest difference between what `directory / model` serves for each case's
    inputs and the case's expected outputs."""
    arrays: dict[str, object] = {"names": np.array(list(cases))}
    for name, (inputs, expected) in cases.items():
        arrays[f"{name}_inputs"] = np.array(inputs, dtype=object)
        arrays[f"{name}_expected"] = expected
    np.savez(directory / "cases.npz", **arrays)
    out = run_python("-c", _LOAD, model, cwd=directory)
    return float(out.split("WORST")[1])


def features_model() -> keras.Model:
    """An int64 id, a (batch, 3) id list with a mean combiner, a string id and two floats."""
    user = keras.Input((), dtype="int64", name="user")
    items = keras.Input((3,), dtype="int64", name="items")
    city = keras.Input((), dtype="string", name="city")
    counts = keras.Input((2,), dtype="float32", name="counts")
    embedded = [
        ee.Embedding(4, embeddings_initializer="uniform", name="exp_user")(user),
        ee.Embedding(
            4, embeddings_initializer="truncated_normal", combiner="mean", name="exp_items"
        )(items),
        ee.Embedding(
            3, embeddings_initializer="normal", key_dtype="string", name="exp_city", seed=5
        )(city),
        counts,
    ]
    out = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=3))(
        keras.layers.Concatenate()(embedded)
    )
    # (Keys in sorted order: Keras 3.8-3.9's export fails on others, stock layers too.)
    model = keras.Model({"city": city, "counts": counts, "items": items, "user": user}, out)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def inputs(rng: np.random.Generator, n: int, lo: int, hi: int) -> dict[str, np.ndarray]:
    return {
        "user": rng.integers(lo, hi, n).astype(np.int64),
        "items": rng.integers(lo, hi, (n, 3)).astype(np.int64),
        "city": np.array([f"city{i}" for i in rng.integers(lo, hi, n)], dtype=object),
        "counts": rng.normal(size=(n, 2)).astype(np.float32),
    }
