"""The layers' lookup with duplicate ids handled in C++ gives exactly what per-layer
TensorFlow ops gave (`_unfused.UnfusedEmbedding`): same tables, weights and losses, bit for
bit, for mixed tables in one model, with and without MirroredStrategy."""

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from _processes import run_python
from _unfused import UnfusedEmbedding, train

import elastic_emb as ee
from elastic_emb import _core

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
    _assert_trained(fused, item_pushes=2)  # item is called twice
    _assert_bitwise_equal(fused, unfused)


def test_fused_lookup_matches_per_layer_ops_under_mirrored_strategy(tmp_path: Path) -> None:
    # Two logical CPUs must be configured before TensorFlow starts: own process.
    fused_path, unfused_path = tmp_path / "fused.npz", tmp_path / "unfused.npz"
    run_python(HERE / "_fused_mirrored_worker.py", fused_path, unfused_path, cwd=HERE)
    fused, unfused = dict(np.load(fused_path)), dict(np.load(unfused_path))
    _assert_trained(fused, item_pushes=1)
    _assert_bitwise_equal(fused, unfused)
