"""Ids of the wrong kind, refused before Keras converts them.

`model.fit`, `evaluate` and `predict` of a model with `ee.Embedding` layers
first compare the data with the model's integer inputs: strings there would
fail deep inside Keras ("Invalid dtype: str..."), and float ids have already
lost every id above 2**24 (float32) to its neighbours, so that distinct ids
would share one row. Either raises a `ValueError` that names the input and
the fix. Data Keras reads lazily (generators, `PyDataset`) is not looked at
here; the layer still checks float ids at run time (`Embedding._keys`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["check_ids"]


def check_ids(model: Any, x: Any) -> None:
    """Raises `ValueError` if `x` gives strings or floats to an integer input of `model`."""
    inputs = _integer_inputs(model)
    if not inputs or x is None:
        return
    for name, declared, dtype in _fed(inputs, _features(x)):
        if dtype in ("str", "bytes", "object", "string"):
            raise ValueError(
                f"Input {name!r} is declared {declared} (keras.Input(dtype={declared!r})) but "
                f'its data are strings. For string ids declare keras.Input(..., dtype="string") '
                f'and ee.Embedding(..., key_dtype="string"); otherwise convert the data to int64.'
            )
        if dtype.startswith(("float", "bfloat")):
            raise ValueError(
                f"Input {name!r} takes integer ids, but its data are {dtype}: ids that pass "
                f"through a float lose precision (above 2**24 for float32), and distinct ids "
                f"would share one row. Convert them to int64 before training, e.g. "
                f"x.astype('int64') (with pandas, fill or drop missing ids first)."
            )


def _integer_inputs(model: Any) -> dict[str, str]:
    """The model's integer-typed inputs: name -> dtype (empty when not yet known)."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):  # a subclassed or unbuilt Sequential model
        return {}
    found = {}
    for tensor in inputs or ():
        dtype = str(getattr(tensor, "dtype", ""))
        if dtype.startswith(("int", "uint")):
            found[_input_name(tensor)] = dtype
    return found


def _input_name(tensor: Any) -> str:
    history = getattr(tensor, "_keras_history", None)
    layer = getattr(history, "operation", None) if history is not None else None
    return str(getattr(layer, "name", None) or tensor.name)


def _features(x: Any) -> Any:
    """The features of `x`: a `tf.data.Dataset`'s element spec without labels and weights."""
    spec = getattr(x, "element_spec", None)
    if spec is None:
        return x
    if isinstance(spec, tuple) and len(spec) in (2, 3):
        return spec[0]
    return spec


def _fed(inputs: dict[str, str], features: Any) -> list[tuple[str, str, str]]:
    """(input name, its declared dtype, the data's dtype) for each integer input fed."""
    names = list(inputs)
    if hasattr(features, "columns") and hasattr(features, "dtypes"):  # a pandas DataFrame
        features = {str(c): features[c] for c in features.columns}
    if isinstance(features, dict):
        pairs = [(k, v) for k, v in features.items() if k in inputs]
        if len(inputs) == 1 and len(features) == 1 and not pairs:
            pairs = [(names[0], next(iter(features.values())))]
    elif isinstance(features, list | tuple):
        if len(features) != len(names):
            return []
        pairs = list(zip(names, features, strict=True))
    elif len(names) == 1:
        pairs = [(names[0], features)]
    else:
        return []
    return [(name, inputs[name], d) for name, data in pairs if (d := _dtype_of(data)) is not None]


def _dtype_of(data: Any) -> str | None:
    """A short dtype name of an array, tensor, tensor spec or pandas column; None if unknown."""
    dtype = getattr(data, "dtype", None)
    if dtype is None:
        if isinstance(data, list) and data and isinstance(data[0], str | bytes):
            return "str"
        return None
    name = getattr(dtype, "name", str(dtype))
    if isinstance(dtype, np.dtype):
        if dtype.kind in "US":
            return "str"
        if dtype.kind == "O":
            first = np.asarray(data).ravel()[:1]
            return "str" if first.size and isinstance(first[0], str | bytes) else None
    return str(name)
