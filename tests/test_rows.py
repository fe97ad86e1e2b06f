"""ee.export_rows: a table's rows in float16, bfloat16 and int8 (row-wise scale and bias)."""

import types

import ml_dtypes
import numpy as np
import pytest

import elastic_emb as ee


def _table(rows: np.ndarray, name: str = "rows") -> ee.Table:
    table = ee.Table(dim=rows.shape[1], name=name)
    table.import_rows(np.arange(len(rows), dtype=np.int64) * 7, rows)
    return table


def _sorted(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(keys)
    return keys[order], values[order]


def test_half_precision_rows_round_to_nearest_even() -> None:
    rows = np.random.default_rng(0).normal(size=(300, 8)).astype(np.float32) * 50
    table = _table(rows)
    for dtype, numpy_type in (("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16)):
        compact = ee.export_rows(table, dtype)
        keys, values = _sorted(compact.keys, compact.values)
        np.testing.assert_array_equal(keys, np.arange(300) * 7)
        assert values.dtype == numpy_type and compact.bytes_per_row == 16
        assert values.tobytes() == rows.astype(numpy_type).tobytes()
    full = ee.export_rows(table)  # float32: the rows as they are
    assert _sorted(full.keys, full.values)[1].tobytes() == rows.tobytes()


def test_int8_rows_are_within_half_a_level_and_keep_each_rows_range() -> None:
    rng = np.random.default_rng(1)
    rows = rng.normal(size=(500, 16)).astype(np.float32) * rng.uniform(0.01, 100, (500, 1))
    rows = rows.astype(np.float32)
    rows[:5] = np.float32(-0.375)  # constant rows: exact
    compact = ee.export_rows(_table(rows), "int8")
    order = np.argsort(compact.keys)
    q = compact.values[order]
    scale, bias = compact.scale[order], compact.bias[order]
    back = compact.dequantize()[order]
    assert q.dtype == np.int8 and compact.bytes_per_row == 16 + 8
    np.testing.assert_array_equal(bias, rows.min(axis=1))
    np.testing.assert_allclose(scale * 255, np.ptp(rows, axis=1), rtol=1e-6)
    err = np.abs(back - rows)
    assert (err <= scale[:, None] / 2 + 1e-6 * np.abs(rows) + 1e-7).all()
    assert (q[5:].min(axis=1) == -128).all() and (q[5:].max(axis=1) == 127).all()
    np.testing.assert_array_equal(back[:5], rows[:5])
    # Within half a level, and not better than a quarter level on average: really 8 bits.
    assert err[5:].mean() > (scale[5:, None] / 8).mean()


def test_export_rows_of_chosen_keys_of_a_layer() -> None:
    layer = ee.Embedding(4, name="rows_layer")
    layer.table.import_rows(np.array([3, 5, 9]), np.arange(12, dtype=np.float32).reshape(3, 4))
    compact = ee.export_rows(layer, "int8", keys=[9, 3, 100])
    keys, values = _sorted(compact.keys, compact.dequantize())
    np.testing.assert_array_equal(keys, [3, 9])
    np.testing.assert_allclose(values, [[0, 1, 2, 3], [8, 9, 10, 11]], atol=3 / 255 / 2 + 1e-6)
    empty = ee.export_rows(ee.Table(dim=4, name="rows_empty"), "int8")
    assert empty.values.shape == (0, 4) and empty.dequantize().shape == (0, 4)


def test_export_rows_refuses_unknown_dtypes_and_non_finite_rows() -> None:
    with pytest.raises(ValueError, match="`dtype` must be one of"):
        ee.export_rows(ee.Table(dim=2, name="rows_bad"), "int4")
    values = np.array([[1.0, np.nan], [2.0, 3.0]], np.float32)
    broken = types.SimpleNamespace(name="broken", export_rows=lambda: (np.array([4, 5]), values))
    with pytest.raises(ValueError, match=r"'broken' has 1 rows holding NaN or Inf \(e\.g\. key 4"):
        ee.export_rows(broken, "float16")
