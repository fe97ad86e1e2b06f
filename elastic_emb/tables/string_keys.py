"""Keys of string features, made on the host: the int64 keys a `key_dtype="string"` layer
stores, bit for bit those the TensorFlow layer makes in its graph (`tf.fingerprint`,
FarmHash Fingerprint64), computed in C++ without TensorFlow."""

from __future__ import annotations

from typing import Any

import numpy as np

from elastic_emb import _core

__all__ = ["EMPTY_STRING_KEY", "string_keys"]


def string_keys(strings: Any) -> np.ndarray:
    """int64 keys of str/bytes (NumPy arrays of any shape, lists, eager TensorFlow string
    tensors); a str is hashed as its UTF-8 bytes, as TensorFlow stores it."""
    array = np.asarray(strings, dtype=object if isinstance(strings, (list, tuple)) else None)
    if array.dtype.kind not in "USO":
        raise TypeError(f"string_keys hashes strings. Received dtype={array.dtype.name}")
    return _core.string_keys(array.ravel().tolist()).reshape(array.shape)


# What `mask_zero=True` masks in a string layer: the key of "".
EMPTY_STRING_KEY = int(string_keys([""])[0])
