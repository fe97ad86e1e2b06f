"""16-bit row storage (`ee.Table(row_dtype=...)`) against NumPy and ml_dtypes.

A 16-bit table rounds what it stores exactly as NumPy (float16) and ml_dtypes
(bfloat16) round float32, and trains as the float32 NumPy reference of its
optimizer does when the reference's rows and slots are rounded after every
step (slots to bfloat16, FTRL's kept float32).
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from _numpy_reference import ReferenceTable

import elastic_emb as ee
from elastic_emb.tables.policies import optimizers as eo

NUMPY_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(x, np.float32).astype(NUMPY_DTYPES[dtype]).astype(np.float32)


@pytest.mark.parametrize("dtype", sorted(NUMPY_DTYPES))
def test_stored_values_are_rounded_as_numpy_rounds_them(dtype):
    rng = np.random.default_rng(0)
    scale = np.float32(10.0) ** rng.integers(-10, 7, size=(2000, 1)).astype(np.float32)
    values = rng.normal(size=(2000, 4)).astype(np.float32) * scale
    values[0] = [np.inf, -np.inf, 65519.0, 65520.0]  # float16: the last rounds to Inf
    values[1] = [6e-8, 3e-8, 2.9e-8, -1e-45]  # subnormal halves, a subnormal float32
    values[2] = [np.float32(1) + np.float32(2**-11), 1.0 + 3 * 2**-11, -0.0, np.nan]  # ties
    t = ee.Table(4, name=f"round_{dtype}", row_dtype=dtype)
    t.import_rows(np.arange(2000), values)
    keys, got = t.export_rows()
    np.testing.assert_array_equal(got[np.argsort(keys)], _round(values, dtype))


class RoundedReference(ReferenceTable):
    """The float32 reference with rows and slots rounded after every step."""

    def __init__(self, dtype: str, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dtype = dtype

    def _round_all(self) -> None:
        for k in self.values:
            self.values[k] = _round(self.values[k], self.dtype)
            if self.kind != "ftrl":
                self.slots[k] = _round(self.slots[k], "bfloat16")

    def _row(self, key: int) -> None:
        fresh = key not in self.values
        super()._row(key)
        if fresh:
            self._round_all()

    def import_rows(self, keys, values) -> None:
        super().import_rows(keys, values)
        self._round_all()

    def push(self, keys, grads, lr: float) -> None:
        super().push(keys, grads, lr)
        self._round_all()


CASES = {
    "sgd_momentum": (eo.SGD(0.05, momentum=0.9), "sgd", {"momentum": 0.9}),
    "adagrad": (eo.Adagrad(0.1), "adagrad", {}),
    "adam": (eo.Adam(0.01), "adam", {}),
    "ftrl": (eo.Ftrl(0.2, l1_regularization_strength=0.01), "ftrl",
             {"l1_regularization_strength": 0.01}),
}  # fmt: skip


@pytest.mark.parametrize("dtype", sorted(NUMPY_DTYPES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_training_matches_the_reference_rounded_every_step(case, dtype):
    opt, kind, hparams = CASES[case]
    dim = 8
    table = ee.Table(dim, opt, initializer="zeros", name=f"train_{case}_{dtype}", row_dtype=dtype)
    ref = RoundedReference(dtype, kind, dim, lambda k: np.zeros(dim, np.float32), **hparams)
    rng = np.random.default_rng(3)
    start = rng.normal(0, 0.05, size=(40, dim)).astype(np.float32)
    table.import_rows(np.arange(40), start)
    ref.import_rows(np.arange(40), start)
    ulp = 2.0**-10 if dtype == "float16" else 2.0**-7  # one unit in the last place, relative
    for _ in range(8):
        keys = rng.integers(0, 50, size=32)
        grads = rng.normal(size=(32, dim)).astype(np.float32)
        table.push(keys, grads)
        ref.push(keys, grads, opt.learning_rate)
    state = table.export_state()
    order = np.argsort(state.keys)
    want_values, want_slots = ref.rows(state.keys[order])
    got_values, got_slots = state.values[order], state.slots[order]
    # The float32 arithmetic is the reference's up to an ulp, which can flip
    # a rounding: rows agree to one 16-bit unit, and nearly all exactly.
    np.testing.assert_allclose(got_values, want_values, rtol=ulp, atol=1e-7)
    np.testing.assert_allclose(got_slots, want_slots, rtol=2.0**-7, atol=1e-7)
    assert np.mean(got_values == want_values) > 0.95
    assert np.mean(got_slots == want_slots) > 0.95
    assert np.array_equal(got_values, _round(got_values, dtype))  # stored 16-bit
    stored_16_bit = np.array_equal(got_slots, _round(got_slots, "bfloat16"))
    assert stored_16_bit == (kind != "ftrl")  # FTRL's slots stay float32


def test_sgd_with_exact_arithmetic_matches_bit_for_bit():
    """lr 0.5 and small integer gradients: every float32 step is exact, so the only
    rounding is the storage's."""
    table = ee.Table(4, eo.SGD(0.5), initializer="zeros", name="exact16", row_dtype="float16")
    rng = np.random.default_rng(1)
    start = rng.normal(0, 100, size=(10, 4)).astype(np.float32)
    table.import_rows(np.arange(10), start)
    want = _round(start, "float16")
    for _ in range(20):
        keys = rng.permutation(10)[:6]
        grads = rng.integers(-3, 4, size=(6, 4)).astype(np.float32)
        table.push(keys, grads)
        want[keys] = _round(want[keys] - np.float32(0.5) * grads, "float16")
    np.testing.assert_array_equal(table.pull(np.arange(10)), want)


def test_sixteen_bit_rows_take_about_half_the_bytes():
    keys = np.arange(200_000, dtype=np.int64)
    sizes = {}
    for dtype in ("float32", "float16", "bfloat16"):
        t = ee.Table(16, eo.Adagrad(0.05), name=f"bytes_{dtype}", row_dtype=dtype)
        t.pull(keys, train=True)
        sizes[dtype] = t.memory_bytes() / len(keys)
    # Adagrad, dim 16: 136 bytes of row against 72, and the same index.
    assert sizes["float16"] == sizes["bfloat16"]
    assert sizes["float16"] / sizes["float32"] < 0.6, sizes


@pytest.mark.parametrize("dtype", sorted(NUMPY_DTYPES))
def test_unseen_ids_read_the_value_an_insert_stores(dtype):
    t = ee.Table(6, name=f"unseen_{dtype}", initializer="uniform", row_dtype=dtype)
    keys = np.arange(100, 140)
    before = t.pull(keys, train=False)
    assert len(t) == 0
    np.testing.assert_array_equal(t.pull(keys, train=True), before)
    float32 = ee.Table(6, name="unseen_f32", initializer="uniform", seed=t.seed)
    np.testing.assert_array_equal(before, _round(float32.pull(keys, train=False), dtype))


def test_checkpoints_restore_16_bit_tables_exactly(tmp_path: Path):
    t = ee.Table(4, eo.Adam(0.01), name="ckpt16", row_dtype="bfloat16")
    rng = np.random.default_rng(2)
    for _ in range(5):
        keys = rng.integers(0, 100, size=30)
        t.pull(keys)
        t.push(keys, rng.normal(size=(30, 4)).astype(np.float32))
    ee.save(tmp_path / "c", tables=[t])
    want = t.export_state()
    ee.placement.unregister(t)
    restored = ee.restore(tmp_path / "c")["ckpt16"]
    assert restored.row_dtype == "bfloat16"
    got = restored.export_state()
    order, got_order = np.argsort(want.keys), np.argsort(got.keys)
    for field in ("keys", "values", "slots", "last_step", "update_count"):
        np.testing.assert_array_equal(getattr(got, field)[got_order], getattr(want, field)[order])


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ee.Table(4, name="bad16", row_dtype="int8"), "int8 is for export"),
        (lambda: ee.Table(4, name="bad16", row_dtype=np.float16), "row_dtype"),
        (lambda: ee.Table(4, name="bad16", row_dtype="float16", device="gpu"), "row_dtype"),
    ],
)
def test_bad_row_dtypes_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_shards_store_16_bit_rows_as_this_process_does():
    from _cluster import shards

    local = ee.Table(4, eo.Adagrad(0.1), name="local16", seed=3, row_dtype="float16")
    with shards(2) as ps:
        ee.init(ps=[s.address for s in ps], mode="sync")
        try:
            remote = ee.Table(4, eo.Adagrad(0.1), name="remote16", seed=3, row_dtype="float16")
            rng = np.random.default_rng(4)
            for _ in range(6):
                keys = rng.integers(0, 200, size=40)
                np.testing.assert_array_equal(remote.pull(keys), local.pull(keys))
                grads = rng.normal(size=(40, 4)).astype(np.float32)
                remote.push(keys, grads)
                local.push(keys, grads)
            got, want = remote.export_state(), local.export_state()
        finally:
            ee.shutdown()
    g, w = np.argsort(got.keys), np.argsort(want.keys)
    np.testing.assert_array_equal(got.values[g], want.values[w])
    np.testing.assert_array_equal(got.slots[g], want.slots[w])
