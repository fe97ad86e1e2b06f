"""ee.Embedding against stock keras.layers.Embedding trained side by side.

Both models start from the same embedding values (imported into the table)
and the same dense weights; the dense weights are trained by the same
compile optimizer in both, the embeddings by the stock optimizer in one and
by the table optimizer of the same class and arguments in the other.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _numpy_reference import ReferenceTable

import elastic_emb as ee

VOCAB, DIM, IDS_PER_EXAMPLE = 24, 4, 3
RTOL = 1e-5

OPTIMIZERS = {
    "sgd": (keras.optimizers.SGD, {"learning_rate": 0.1}),
    "sgd_momentum": (keras.optimizers.SGD, {"learning_rate": 0.05, "momentum": 0.9}),
    "sgd_nesterov": (
        keras.optimizers.SGD,
        {"learning_rate": 0.05, "momentum": 0.8, "nesterov": True},
    ),
    "adagrad": (keras.optimizers.Adagrad, {"learning_rate": 0.1}),
    "adam": (keras.optimizers.Adam, {"learning_rate": 0.01}),
    "rmsprop": (keras.optimizers.RMSprop, {"learning_rate": 0.01}),
    "rmsprop_centered_momentum": (
        keras.optimizers.RMSprop,
        {"learning_rate": 0.01, "momentum": 0.5, "centered": True},
    ),
    "ftrl": (
        keras.optimizers.Ftrl,
        {
            "learning_rate": 0.1,
            "l1_regularization_strength": 0.001,
            "l2_regularization_strength": 0.01,
        },
    ),
}


def _initial_embeddings() -> np.ndarray:
    return np.random.default_rng(1).uniform(-0.1, 0.1, (VOCAB, DIM)).astype(np.float32)


def _pair(embedding_kwargs=None):
    """(stock model, stock layer, ee model, ee layer) with equal initial weights."""
    embedding_kwargs = embedding_kwargs or {}
    stock_layer = keras.layers.Embedding(VOCAB, DIM, **embedding_kwargs)
    ee_layer = ee.Embedding(DIM, **embedding_kwargs, name="parity")

    def model(layer):
        inp = keras.Input((IDS_PER_EXAMPLE,), dtype="int64")
        x = keras.layers.Flatten()(layer(inp))
        dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=7))
        return keras.Model(inp, dense(x))

    stock, mine = model(stock_layer), model(ee_layer)
    stock_layer.embeddings.assign(_initial_embeddings())
    ee_layer.table.import_rows(np.arange(VOCAB), _initial_embeddings())
    return stock, stock_layer, mine, ee_layer


def _every_row_once(steps: int, batch: int) -> np.ndarray:
    """Batches in which every id appears exactly once (VOCAB = batch * IDS_PER_EXAMPLE)."""
    assert batch * IDS_PER_EXAMPLE == VOCAB
    rng = np.random.default_rng(2)
    return np.concatenate(
        [rng.permutation(VOCAB).reshape(batch, IDS_PER_EXAMPLE) for _ in range(steps)]
    ).astype(np.int64)


def _table_values(layer: ee.Embedding) -> np.ndarray:
    keys, values = layer.table.export_rows()
    out = np.zeros((VOCAB, DIM), np.float32)
    out[keys] = values
    return out


def _fit_both(opt_name, x, y, batch):
    cls, kwargs = OPTIMIZERS[opt_name]
    stock, stock_layer, _, _ = _pair({})
    mine_layer = ee.Embedding(DIM, optimizer=cls(**kwargs), name="parity_opt")
    inp = keras.Input((IDS_PER_EXAMPLE,), dtype="int64")
    dense = keras.layers.Dense(1)
    mine = keras.Model(inp, dense(keras.layers.Flatten()(mine_layer(inp))))
    dense.set_weights(stock.layers[-1].get_weights())
    mine_layer.table.import_rows(np.arange(VOCAB), _initial_embeddings())
    stock.compile(cls(**kwargs), "mse")
    mine.compile(cls(**kwargs), "mse")
    losses = {}
    for name, model in (("stock", stock), ("ee", mine)):
        losses[name] = [
            float(model.train_on_batch(x[i : i + batch], y[i : i + batch]))
            for i in range(0, len(x), batch)
        ]
    return (
        losses,
        stock_layer.embeddings.numpy(),
        _table_values(mine_layer),
        stock,
        mine,
        mine_layer,
    )


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_parity_every_row_touched(opt_name):
    batch, steps = VOCAB // IDS_PER_EXAMPLE, 6
    x = _every_row_once(steps, batch)
    y = np.random.default_rng(3).normal(size=(len(x), 1)).astype(np.float32)
    losses, stock_emb, ee_emb, stock, mine, layer = _fit_both(opt_name, x, y, batch)
    np.testing.assert_allclose(losses["ee"], losses["stock"], rtol=RTOL)
    np.testing.assert_allclose(ee_emb, stock_emb, rtol=RTOL, atol=1e-7)
    for a, b in zip(stock.layers[-1].get_weights(), mine.layers[-1].get_weights(), strict=True):
        np.testing.assert_allclose(b, a, rtol=RTOL, atol=1e-7)
    assert layer.table.iterations == steps


def test_parity_duplicate_ids_sgd():
    # Duplicates inside batches and rows left out of some steps: stock Keras
    # sums the gradients of duplicate ids, so plain SGD matches exactly.
    rng = np.random.default_rng(4)
    x = rng.integers(0, VOCAB, (40, IDS_PER_EXAMPLE)).astype(np.int64)
    y = rng.normal(size=(len(x), 1)).astype(np.float32)
    losses, stock_emb, ee_emb, *_ = _fit_both("sgd", x, y, 8)
    np.testing.assert_allclose(losses["ee"], losses["stock"], rtol=RTOL)
    np.testing.assert_allclose(ee_emb, stock_emb, rtol=RTOL, atol=1e-7)


@pytest.mark.parametrize("opt_name", ["adagrad", "adam", "ftrl", "sgd_momentum"])
def test_duplicate_ids_against_sum_then_apply_reference(opt_name):
    """With duplicate ids, the table sums gradients then applies once per key.

    The gradient with respect to the embedding rows comes from a stock model
    with the same weights (a GradientTape sums duplicates), and the NumPy
    reference applies the Keras formula once per distinct row.
    """
    cls, kwargs = OPTIMIZERS[opt_name]
    rng = np.random.default_rng(5)
    x = rng.integers(0, VOCAB // 2, (24, IDS_PER_EXAMPLE)).astype(np.int64)  # many duplicates
    y = rng.normal(size=(len(x), 1)).astype(np.float32)
    stock, stock_layer, _, _ = _pair()
    layer = ee.Embedding(DIM, optimizer=cls(**kwargs), name="dup")
    inp = keras.Input((IDS_PER_EXAMPLE,), dtype="int64")
    dense = keras.layers.Dense(1, trainable=False)
    mine = keras.Model(inp, dense(keras.layers.Flatten()(layer(inp))))
    dense.set_weights(stock.layers[-1].get_weights())
    layer.table.import_rows(np.arange(VOCAB), _initial_embeddings())
    mine.compile(keras.optimizers.SGD(0.0), "mse")
    init = _initial_embeddings()
    hparams = {k: v for k, v in kwargs.items() if k != "learning_rate"}
    kind = opt_name.split("_")[0]
    reference = ReferenceTable(kind, DIM, lambda k: init[k], **hparams)
    batch = 8
    for i in range(0, len(x), batch):
        xb, yb = x[i : i + batch], y[i : i + batch]
        # Reference gradient: the stock model evaluated at the reference's rows.
        stock_layer.embeddings.assign(reference.pull(np.arange(VOCAB)))
        with tf.GradientTape() as tape:
            loss = keras.losses.mean_squared_error(yb, stock(xb))
            loss = tf.reduce_mean(loss)
        grad = tf.convert_to_tensor(tape.gradient(loss, stock_layer.embeddings)).numpy()
        touched = np.unique(xb)
        reference.push(touched, grad[touched], kwargs["learning_rate"])
        mine.train_on_batch(xb, yb)
    keys = np.arange(VOCAB)
    expected, expected_slots = reference.rows(keys)
    state = layer.table.export_state()
    order = np.argsort(state.keys)
    np.testing.assert_allclose(state.values[order], expected, rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(state.slots[order], expected_slots, rtol=RTOL, atol=1e-7)


def _multi_hot_reference(values: np.ndarray, rows: list[list[int]], combiner: str) -> np.ndarray:
    out = []
    for ids in rows:
        s = values[ids].sum(axis=0) if ids else np.zeros(DIM, np.float32)
        n = len(ids)
        if combiner == "mean" and n:
            s = s / n
        elif combiner == "sqrtn" and n:
            s = s / np.sqrt(n)
        out.append(s)
    return np.stack(out)


class _StockMultiHot(keras.layers.Layer):
    """keras.layers.Embedding on the flat ids + the same reduction (the reference)."""

    def __init__(self, combiner):
        super().__init__()
        self.embedding = keras.layers.Embedding(VOCAB, DIM)
        self.combiner = combiner

    def call(self, ids):
        rows = self.embedding(ids.flat_values)
        segments = ids.value_rowids()
        summed = tf.math.unsorted_segment_sum(rows, segments, ids.nrows())
        if self.combiner == "sum":
            return summed
        n = tf.cast(ids.row_lengths(), tf.float32)[:, None]
        return tf.math.divide_no_nan(summed, n if self.combiner == "mean" else tf.sqrt(n))


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("kind", ["ragged", "sparse"])
def test_multi_hot_combiners_train_like_stock(combiner, kind):
    rng = np.random.default_rng(6)
    rows = [rng.integers(0, VOCAB, rng.integers(0, 5)).tolist() for _ in range(32)]
    rows[3] = []  # an example with no ids
    y = rng.normal(size=(len(rows), 1)).astype(np.float32)
    ragged = tf.ragged.constant(rows, dtype=tf.int64, ragged_rank=1)

    layer = ee.Embedding(DIM, optimizer=ee.optimizers.SGD(0.2), combiner=combiner, name="mh")
    layer.table.import_rows(np.arange(VOCAB), _initial_embeddings())
    stock_layer = _StockMultiHot(combiner)
    stock_layer.embedding.build()
    stock_layer.embedding.embeddings.assign(_initial_embeddings())

    # Forward values against NumPy.
    ids = ragged if kind == "ragged" else ragged.to_sparse()
    expected = _multi_hot_reference(_initial_embeddings(), rows, combiner)
    np.testing.assert_allclose(layer(ids).numpy(), expected, rtol=1e-6, atol=1e-7)

    # Training (SGD, duplicates included) against the stock reference layer.
    kernel = np.random.default_rng(7).normal(size=(DIM, 1)).astype(np.float32)
    stock_opt = keras.optimizers.SGD(0.2)
    for start in range(0, len(rows), 8):
        batch = ragged[start : start + 8]
        ids = batch if kind == "ragged" else batch.to_sparse()
        target = y[start : start + 8]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((layer(ids, training=True) @ kernel - target) ** 2)
        tape.gradient(loss, layer.trainable_variables)  # runs the push
        with tf.GradientTape() as tape:
            stock_loss = tf.reduce_mean((stock_layer(batch) @ kernel - target) ** 2)
        grads = tape.gradient(stock_loss, stock_layer.trainable_variables)
        stock_opt.apply_gradients(zip(grads, stock_layer.trainable_variables, strict=True))
        np.testing.assert_allclose(float(loss), float(stock_loss), rtol=RTOL)
    np.testing.assert_allclose(
        _table_values(layer), stock_layer.embedding.embeddings.numpy(), rtol=RTOL, atol=1e-7
    )


def test_mask_zero_matches_stock():
    x = np.random.default_rng(8).integers(0, VOCAB, (32, IDS_PER_EXAMPLE)).astype(np.int64)
    x[::3, -1] = 0  # padding
    y = np.random.default_rng(9).normal(size=(32, 1)).astype(np.float32)

    def model(layer):
        inp = keras.Input((IDS_PER_EXAMPLE,), dtype="int64")
        pooled = keras.layers.GlobalAveragePooling1D()(layer(inp))  # honours the mask
        dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=7))
        return keras.Model(inp, dense(pooled))

    stock_layer = keras.layers.Embedding(VOCAB, DIM, mask_zero=True)
    layer = ee.Embedding(DIM, optimizer=ee.optimizers.SGD(0.1), mask_zero=True, name="masked")
    stock, mine = model(stock_layer), model(layer)
    stock_layer.embeddings.assign(_initial_embeddings())
    layer.table.import_rows(np.arange(VOCAB), _initial_embeddings())
    np.testing.assert_array_equal(layer.compute_mask(tf.constant(x)).numpy(), x != 0)
    stock.compile(keras.optimizers.SGD(0.1), "mse")
    mine.compile(keras.optimizers.SGD(0.1), "mse")
    for model in (stock, mine):
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(
        mine.evaluate(x, y, verbose=0), stock.evaluate(x, y, verbose=0), rtol=RTOL
    )
    np.testing.assert_allclose(
        _table_values(layer), stock_layer.embeddings.numpy(), rtol=RTOL, atol=1e-7
    )
