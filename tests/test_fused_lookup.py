"""The layers' lookup with duplicate ids handled in C++, one call for all the layers of a
Functional model, gives exactly what per-layer TensorFlow ops gave
(`_unfused.UnfusedEmbedding`): same tables, weights and losses, bit for bit, for mixed
tables in one model, with and without MirroredStrategy. Where fusing would not be exact,
each layer looks up on its own."""

from collections.abc import Callable
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from _processes import run_python
from _unfused import UnfusedEmbedding, build, data, train

import elastic_emb as ee
from elastic_emb import _core
from elastic_emb.keras import lookup

HERE = Path(__file__).parent
BATCHES, EPOCHS = 6, 2  # _unfused.train: 192 examples, batches of 32


def _assert_bitwise_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        x, y = np.asarray(a[name]), np.asarray(b[name])
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), f"{name} differs"


def _assert_trained(result: dict, item_pushes: int) -> None:
    """The comparison can fail: every table took every step's push and its rows moved."""
    for table, pushes in (("user", 1), ("item", item_pushes), ("tags", 1), ("city", 1)):
        assert result[f"{table}.iterations"][0] == BATCHES * EPOCHS * pushes, table
        assert result[f"{table}.update_count"].sum() > len(result[f"{table}.keys"])
    assert len(result["item.keys"]) > 50  # Zipf ids: many duplicates, many distinct


def test_unique_keys_and_sum_by_key_match_tensorflow_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    keys = rng.integers(-5, 60, 2000).astype(np.int64)
    grads = rng.normal(size=(2000, 7)).astype(np.float32) * 1e3
    grads[::5] = -0.0  # +0.0 + -0.0 is +0.0, as unsorted_segment_sum gives
    unique, index = _core.unique_keys(keys)
    tf_unique, tf_index = tf.unique(keys)
    np.testing.assert_array_equal(unique, tf_unique.numpy())
    np.testing.assert_array_equal(index, tf_index.numpy())
    distinct, sums = _core.sum_by_key(keys, grads)
    expected = tf.math.unsorted_segment_sum(grads, tf_index, len(tf_unique)).numpy()
    np.testing.assert_array_equal(distinct, tf_unique.numpy())
    assert sums.tobytes() == expected.tobytes()


def test_batch_key_helpers_refuse_bad_input() -> None:
    with pytest.raises(ValueError, match="`keys` must have dtype int64"):
        _core.unique_keys(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="`grads` has size 2 in dimension 0, expected 3"):
        _core.sum_by_key(np.zeros(3, np.int64), np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="`grads` must have 2 dimension"):
        _core.sum_by_key(np.zeros(3, np.int64), np.zeros(3, np.float32))
    empty, sums = _core.sum_by_key(np.zeros(0, np.int64), np.zeros((0, 4), np.float32))
    assert empty.shape == (0,) and sums.shape == (0, 4)


def test_fused_lookup_trains_mixed_tables_like_per_layer_ops() -> None:
    fused, unfused = train(ee.Embedding, "fused"), train(UnfusedEmbedding, "unfused")
    _assert_trained(fused, item_pushes=1)  # item is called twice: one push a step
    _assert_bitwise_equal(fused, unfused)


def test_fused_lookup_matches_per_layer_ops_under_mirrored_strategy(tmp_path: Path) -> None:
    # Two logical CPUs must be configured before TensorFlow starts: own process.
    fused_path, unfused_path = tmp_path / "fused.npz", tmp_path / "unfused.npz"
    run_python(HERE / "_fused_mirrored_worker.py", fused_path, unfused_path, cwd=HERE)
    fused, unfused = dict(np.load(fused_path)), dict(np.load(unfused_path))
    _assert_trained(fused, item_pushes=1)
    _assert_bitwise_equal(fused, unfused)


def _lookup_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records how many layer calls each traced lookup serves."""
    sizes: list[int] = []
    real = lookup.rows_of

    def spy(lookups: list, training: bool | None) -> list:
        sizes.append(len(lookups))
        return real(lookups, training)

    monkeypatch.setattr(lookup, "rows_of", spy)
    return sizes


def _ids(n: int = 64, width: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 40, (n, width)).astype(np.int64)


def _slices_model(width: int = 3, ids_layer: Callable | None = None) -> keras.Model:
    """One ee.Embedding per column of an int64 input (optionally passed through `ids_layer`)."""
    inp = keras.Input((width,), dtype="int64")
    ids = inp if ids_layer is None else ids_layer(inp)
    layers = [ee.Embedding(4, "adagrad", name=f"col{i}", seed=i) for i in range(width)]
    features = [keras.layers.Flatten()(layer(ids[:, i : i + 1])) for i, layer in enumerate(layers)]
    out = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(0))(
        keras.layers.Concatenate()(features)
    )
    model = keras.Model(inp, out)
    model.compile("sgd", "mse")
    return model


def _random_ids_model() -> keras.Model:
    """Ids through dropout, which draws random numbers: computed twice, they would differ."""
    dropout = keras.layers.Dropout(0.5, seed=1)
    return _slices_model(
        ids_layer=lambda x: keras.ops.cast(dropout(keras.ops.cast(x, "float32")), "int64")
    )


def test_a_functional_model_looks_up_all_its_layers_in_one_call(monkeypatch) -> None:
    sizes = _lookup_sizes(monkeypatch)
    batches = tf.data.Dataset.from_tensor_slices(data(strings=True)).batch(32)
    model, _ = build(ee.Embedding, "one_call", strings=True)
    model.fit(batches, epochs=1, verbose=0)
    model.predict(batches.map(lambda x, y: x), verbose=0)
    # user, item, hist (the item layer again), tags, city: every trace, one lookup.
    assert sizes and set(sizes) == {5}


def test_fused_predictions_equal_each_layer_looking_up_alone() -> None:
    model, x = _slices_model(), _ids()
    model.fit(x, np.ones((64, 1)), batch_size=16, epochs=2, verbose=0)
    fused = model.predict(x, batch_size=64, verbose=0)  # traced: one lookup
    alone = model(x, training=False).numpy()  # eager: each layer on its own
    assert fused.tobytes() == alone.tobytes()


def test_a_frozen_layer_in_a_fused_lookup_neither_grows_nor_trains(monkeypatch) -> None:
    sizes = _lookup_sizes(monkeypatch)
    model, x = _slices_model(), _ids()
    frozen = model.get_layer("col1")
    frozen.table.import_rows(np.arange(10, dtype=np.int64), np.ones((10, 4), np.float32))
    frozen.trainable = False
    model.compile("sgd", "mse")
    model.fit(x, np.ones((64, 1)), batch_size=16, epochs=1, verbose=0)
    assert set(sizes) == {3}
    state = frozen.table.export_state()
    assert len(frozen.table) == 10 and frozen.table.iterations == 0
    np.testing.assert_array_equal(state.values, np.ones((10, 4), np.float32))
    assert model.get_layer("col0").table.iterations == 4  # the others trained every step


def test_ids_from_a_layer_with_state_are_looked_up_layer_by_layer(monkeypatch) -> None:
    sizes = _lookup_sizes(monkeypatch)
    model = _random_ids_model()
    model.fit(_ids(), np.ones((64, 1)), batch_size=16, epochs=1, verbose=0)
    assert sizes and set(sizes) == {1}


def test_a_nested_functional_model_fuses_its_own_layers(monkeypatch) -> None:
    sizes = _lookup_sizes(monkeypatch)
    inner = _slices_model(width=2)
    inp = keras.Input((2,), dtype="int64")
    outer_emb = keras.layers.Flatten()(ee.Embedding(4, "sgd", name="outer", seed=9)(inp[:, :1]))
    out = keras.layers.Dense(1)(keras.layers.Concatenate()([inner(inp), outer_emb]))
    model = keras.Model(inp, out)
    model.compile("sgd", "mse")
    model.fit(_ids(width=2), np.ones((64, 1)), batch_size=16, epochs=1, verbose=0)
    assert sizes and set(sizes) == {1, 2}  # the outer layer alone, the inner two together
    assert inner.get_layer("col0").table.iterations == 4
    assert model.get_layer("outer").table.iterations == 4


def test_the_lookup_module_can_be_imported_first() -> None:
    # elastic_emb.keras.lookup imports Keras, whose loading imports elastic_emb.keras.layers, which
    # hooks lookup.fused_call into Keras: that must not need the half-imported module.
    code = (
        "import warnings; warnings.filterwarnings('error', 'elastic_emb could not');"
        "from elastic_emb.keras import lookup; from elastic_emb.keras.patches import _call_wrapped;"
        "print(_call_wrapped)"
    )
    assert run_python("-c", code, cwd=HERE).strip() == "True"


def test_lookahead_refuses_what_it_cannot_read_ahead_for() -> None:
    model = _slices_model()
    batches = tf.data.Dataset.from_tensor_slices((_ids(), np.ones((64, 1)))).batch(16)
    with pytest.raises(TypeError, match=r"takes a tf\.data\.Dataset\. Received: ndarray"):
        ee.lookahead(_ids(), model)

    class Subclassed(keras.Model):
        def call(self, x):
            return x

    with pytest.raises(ValueError, match="needs a Functional or Sequential Keras model"):
        ee.lookahead(batches, Subclassed())
    with pytest.raises(ValueError, match=r"no ee\.Embedding call whose ids ee\.lookahead can"):
        ee.lookahead(batches, _random_ids_model())
    # In-process tables answer at once: the batches are left as they are.
    assert ee.lookahead(batches, model) is batches
    sequential = keras.Sequential([keras.Input((3,), dtype="int64"), ee.Embedding(4, "sgd")])
    assert ee.lookahead(batches, sequential) is batches
