"""Conversions between wire messages and numpy arrays (the only user of `_proto`).

Arrays travel as raw little-endian bytes. Float rows (pulled values, pushed
gradients) may be encoded as float16 or bfloat16 to halve the bytes; the
optimizer always runs in float32 on the parameter server.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from elastic_emb._proto import ps_pb2

__all__ = ["ENCODINGS", "WireError", "decode_floats", "decode_keys", "encode_floats", "encoding"]

ENCODINGS: dict[str, Any] = {
    "float32": ps_pb2.FLOAT32,
    "float16": ps_pb2.FLOAT16,
    "bfloat16": ps_pb2.BFLOAT16,
}
_ITEMSIZE: dict[int, int] = {ps_pb2.FLOAT32: 4, ps_pb2.FLOAT16: 2, ps_pb2.BFLOAT16: 2}


class WireError(ValueError):
    """A message does not hold what it claims (truncated bytes, bad encoding...)."""


def encoding(name: str) -> Any:
    """The wire enum of an encoding name ("float32", "float16", "bfloat16")."""
    if name not in ENCODINGS:
        raise ValueError(f"`wire_dtype` must be one of {sorted(ENCODINGS)}. Received: {name!r}")
    return ENCODINGS[name]


def encode_keys(keys: np.ndarray) -> bytes:
    return np.ascontiguousarray(keys, "<i8").tobytes()


def decode_keys(raw: bytes, what: str = "keys") -> np.ndarray:
    if len(raw) % 8:
        raise WireError(f"`{what}` has {len(raw)} bytes, not a whole number of int64 keys")
    return np.frombuffer(raw, "<i8").astype(np.int64, copy=False)


def decode_uint(raw: bytes, n: int, dtype: str, what: str) -> np.ndarray:
    arr = np.frombuffer(raw, dtype)
    if arr.shape[0] != n:
        raise WireError(f"`{what}` holds {arr.shape[0]} values; {n} expected")
    return arr.astype(np.dtype(dtype).newbyteorder("="))


def encode_floats(values: np.ndarray, enc: int) -> bytes:
    """float32 array -> bytes in wire encoding `enc`."""
    values = np.ascontiguousarray(values, np.float32)
    if enc == ps_pb2.FLOAT32:
        return values.astype("<f4", copy=False).tobytes()
    if enc == ps_pb2.FLOAT16:
        with np.errstate(over="ignore"):  # beyond float16's range: infinity
            return values.astype("<f2").tobytes()
    if enc == ps_pb2.BFLOAT16:
        bits = values.view(np.uint32)
        # Round to nearest even on the 16 bits dropped; NaNs stay NaN.
        rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
        rounded = np.where(np.isnan(values), bits | np.uint32(0x00400000), rounded)
        return (rounded >> np.uint32(16)).astype("<u2").tobytes()
    raise WireError(f"Unknown float encoding {enc}")


def decode_floats(raw: bytes, enc: int, n: int, dim: int, what: str = "values") -> np.ndarray:
    """Bytes in wire encoding `enc` -> float32 `(n, dim)`."""
    if enc not in _ITEMSIZE:
        raise WireError(f"Unknown encoding {enc} of `{what}`; known: {sorted(ENCODINGS)}")
    if len(raw) != n * dim * _ITEMSIZE[enc]:
        raise WireError(
            f"`{what}` has {len(raw)} bytes; {n} rows of dim {dim} in "
            f"{ps_pb2.Encoding.Name(enc).lower()} need {n * dim * _ITEMSIZE[enc]}"
        )
    if enc == ps_pb2.FLOAT32:
        out = np.frombuffer(raw, "<f4").astype(np.float32, copy=False)
    elif enc == ps_pb2.FLOAT16:
        out = np.frombuffer(raw, "<f2").astype(np.float32)
    else:
        out = (np.frombuffer(raw, "<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
    return out.reshape(n, dim)


def message_size(message: Any) -> int:
    return int(message.ByteSize())
