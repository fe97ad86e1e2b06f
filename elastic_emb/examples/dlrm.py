"""The DLRM-style CTR model of the demo, the benchmarks and the tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import keras

# The Criteo layout, as elastic_emb.examples.criteo has it (which needs TensorFlow: the
# model does not, and builds on Keras' JAX backend too).
NUM_DENSE, NUM_CATEGORICAL = 13, 26


def build_dlrm(
    embedding_factory: Callable[[int], keras.layers.Layer],
    *,
    num_dense: int = NUM_DENSE,
    num_categorical: int = NUM_CATEGORICAL,
    bottom_mlp: Sequence[int] = (64, 16),
    top_mlp: Sequence[int] = (512, 256),
    seed: int = 0,
    feature_offsets: Sequence[int] | None = None,
) -> keras.Model:
    """Builds a DLRM-style CTR model over Criteo-layout inputs.

    The dense features go through a bottom MLP; each categorical feature goes
    through its own embedding layer (made by `embedding_factory(i)`); the
    embeddings and the bottom-MLP output are concatenated and fed to a top MLP
    ending in one sigmoid unit.

    Args:
        embedding_factory: callable, `i -> layer` mapping `int64[B]` ids of
            categorical feature `i` to `float32[B, dim]`.
        num_dense: int, number of dense features.
        num_categorical: int, number of categorical features.
        bottom_mlp: sequence of int, bottom MLP widths.
        top_mlp: sequence of int, top MLP widths (before the output unit).
        seed: int, seed of the dense layers' initializers.
        feature_offsets: None (one layer per feature), or one int per
            categorical feature: then a single layer, `embedding_factory(0)`,
            embeds every feature (one shared table), the ids of feature `i`
            shifted by `feature_offsets[i]` so that the features do not collide.

    Returns:
        A `keras.Model` taking `{"dense": float32[B, num_dense],
        "categorical": int64[B, num_categorical]}` and returning
        `float32[B, 1]` click probabilities.
    """
    dense_in = keras.Input(shape=(num_dense,), dtype="float32", name="dense")
    cat_in = keras.Input(shape=(num_categorical,), dtype="int64", name="categorical")
    init_seed = [seed]

    def dense(units: int, activation: str | None, name: str) -> keras.layers.Dense:
        init_seed[0] += 1
        return keras.layers.Dense(
            units,
            activation=activation,
            kernel_initializer=keras.initializers.GlorotUniform(seed=init_seed[0]),
            name=name,
        )

    x = dense_in
    for i, width in enumerate(bottom_mlp):
        x = dense(width, "relu", f"bottom_{i}")(x)
    if feature_offsets is None:
        columns = keras.ops.split(cat_in, num_categorical, axis=1)
        embedded = [
            embedding_factory(i)(keras.ops.squeeze(col, axis=1)) for i, col in enumerate(columns)
        ]
    else:
        if len(feature_offsets) != num_categorical:
            raise ValueError(
                f"`feature_offsets` needs one offset per categorical feature ({num_categorical})."
                f" Received: {len(feature_offsets)}"
            )
        offsets = keras.ops.convert_to_tensor([list(feature_offsets)], dtype="int64")
        rows = embedding_factory(0)(cat_in + offsets)  # (batch, features, dim)
        embedded = [keras.layers.Flatten()(rows)]
    x = keras.ops.concatenate([x, *embedded], axis=1)
    for i, width in enumerate(top_mlp):
        x = dense(width, "relu", f"top_{i}")(x)
    out = dense(1, "sigmoid", "click")(x)
    return keras.Model({"dense": dense_in, "categorical": cat_in}, out, name="dlrm")
