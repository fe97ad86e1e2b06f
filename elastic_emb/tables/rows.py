"""A table's rows in compact number formats, for serving and for shipping elsewhere.

`export_rows(table, dtype)` gives a table's rows as float32, float16,
bfloat16 or int8. int8 rows are quantized row by row, as FBGEMM's 8-bit
row-wise format does: each row keeps its own float32 `scale` and `bias`
(its minimum), and value j of a row is `(q[j] + 128) * scale + bias`, with
`q[j]` the nearest of the 256 levels between the row's minimum and maximum.
The error of a value is at most half a level, `scale / 2` (plus float32
rounding), and a row whose values are all equal comes back exactly.

Needs numpy and ml_dtypes only (no TensorFlow).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["ROW_DTYPES", "CompactRows", "export_rows"]

ROW_DTYPES = ("float32", "float16", "bfloat16", "int8")
_LEVELS = 255  # int8: 256 values, 255 steps between a row's minimum and maximum
_NUMPY = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


@dataclasses.dataclass(frozen=True)
class CompactRows:
    """Rows of `keys` in `dtype`; for int8, with each row's `scale` and `bias`."""

    keys: np.ndarray  # int64 (m,)
    values: np.ndarray  # (m, dim) in `dtype`
    dtype: str
    scale: np.ndarray | None = None  # int8: float32 (m,)
    bias: np.ndarray | None = None  # int8: float32 (m,)

    def dequantize(self) -> np.ndarray:
        """The rows as float32 `(m, dim)`."""
        if self.dtype != "int8":
            return self.values.astype(np.float32)
        if self.scale is None or self.bias is None:
            raise ValueError("int8 rows need their scale and bias")
        levels = self.values.astype(np.float32) + np.float32(128)
        return levels * self.scale[:, None] + self.bias[:, None]

    @property
    def bytes_per_row(self) -> int:
        """Bytes of one row's values (and its scale and bias), key excluded."""
        dim = self.values.shape[1]
        return dim * self.values.dtype.itemsize + (8 if self.dtype == "int8" else 0)


def export_rows(table: Any, dtype: str = "float32", keys: Any = None) -> CompactRows:
    """A table's rows (all of them, or those of `keys` that exist) in `dtype`.

    Args:
        table: an `ee.Table` (in-process, GPU or remote), or an `ee.Embedding`
            layer (its table).
        dtype: "float32", "float16", "bfloat16" (both rounded to nearest
            even) or "int8" (row-wise scale and bias, see the module).
        keys: optional int64 ids; rows of ids the table does not hold are
            left out. Default: every row, in the table's export order.

    Returns:
        `CompactRows`; `.dequantize()` gives float32 rows back.

    Raises:
        ValueError: an unknown `dtype`, or rows holding NaN or ±Inf (which no
            compact format can carry faithfully).
    """
    if dtype not in ROW_DTYPES:
        raise ValueError(f"`dtype` must be one of {ROW_DTYPES}. Received: dtype={dtype!r}")
    table = getattr(table, "table", table)  # a layer: its table
    all_keys, values = table.export_rows()
    if keys is not None:
        wanted = np.isin(all_keys, np.asarray(keys, np.int64))
        all_keys, values = all_keys[wanted], values[wanted]
    bad = ~np.isfinite(values).all(axis=1)
    if bad.any():
        raise ValueError(
            f"Table {table.name!r} has {int(bad.sum())} rows holding NaN or Inf (e.g. key "
            f"{int(all_keys[bad][0])}); a compact format cannot carry them."
        )
    if dtype != "int8":
        return CompactRows(all_keys, values.astype(_NUMPY[dtype], copy=False), dtype)
    low = values.min(axis=1) if len(values) else np.zeros(0, np.float32)
    high = values.max(axis=1) if len(values) else np.zeros(0, np.float32)
    scale = ((high - low) / np.float32(_LEVELS)).astype(np.float32)
    step = np.where(scale > 0, scale, np.float32(1))[:, None]  # equal values: level 0
    levels = np.rint((values - low[:, None]) / step)
    q = (np.clip(levels, 0, _LEVELS) - 128).astype(np.int8)
    return CompactRows(all_keys, q, dtype, scale, low.astype(np.float32))
