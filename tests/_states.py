"""Table states as key-sorted arrays, compared bit for bit (shared by the PS tests)."""

from __future__ import annotations

import numpy as np

from elastic_emb.tables.table import TableState


def sorted_state(state: TableState) -> dict[str, np.ndarray]:
    """Every array of `state`, rows in key order, and its iterations."""
    order = np.argsort(state.keys)
    out = {f: getattr(state, f)[order] for f in state.FIELDS}
    out["iterations"] = np.array(state.iterations)
    return out


def assert_same_state(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for field in a:
        np.testing.assert_array_equal(a[field], b[field], err_msg=field)
