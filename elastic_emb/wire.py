"""Conversions between wire messages and numpy arrays (the only user of `_proto`).

Arrays travel as raw little-endian bytes. Float rows (pulled values, pushed
gradients) may be encoded as float16 or bfloat16 to halve the bytes; the
optimizer always runs in float32 on the parameter server.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from elastic_emb._proto import ps_pb2

__all__ = [
    "ENCODINGS",
    "WireError",
    "decode_floats",
    "decode_keys",
    "encode_floats",
    "encode_keys",
    "encode_keys_compact",
    "encoding",
    "gradient_exponent",
    "scale",
]

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


def encode_keys(keys: np.ndarray, key_encoding: int = ps_pb2.KEYS_RAW) -> bytes:
    """int64 keys -> bytes: raw, or delta + varint (compact when keys ascend as uint64)."""
    keys = np.ascontiguousarray(keys, np.int64)
    if key_encoding == ps_pb2.KEYS_RAW:
        return keys.astype("<i8", copy=False).tobytes()
    u = keys.view(np.uint64)
    deltas = np.empty_like(u)
    deltas[:1] = u[:1]
    np.subtract(u[1:], u[:-1], out=deltas[1:])  # modulo 2^64
    # LEB128: 7 bits a byte, low bits first, high bit set on all but the last.
    nbytes = np.ones(len(deltas), np.int64)
    for k in range(1, 10):
        nbytes += deltas >= np.uint64(1 << (7 * k))
    ends = np.cumsum(nbytes)
    owner = np.repeat(np.arange(len(deltas)), nbytes)
    index = np.arange(int(ends[-1]) if len(ends) else 0) - (ends - nbytes)[owner]
    shifts = (7 * index).astype(np.uint64)
    out = ((deltas[owner] >> shifts) & np.uint64(0x7F)).astype(np.uint8)
    out[index < nbytes[owner] - 1] |= 0x80
    return out.tobytes()


def encode_keys_compact(keys: np.ndarray) -> tuple[bytes, Any]:
    """(bytes, key encoding): delta + varint unless raw is smaller."""
    varint = encode_keys(keys, ps_pb2.KEYS_DELTA_VARINT)
    if len(varint) <= 8 * len(keys):
        return varint, ps_pb2.KEYS_DELTA_VARINT
    return encode_keys(keys), ps_pb2.KEYS_RAW


def decode_keys(raw: bytes, what: str = "keys", key_encoding: int = ps_pb2.KEYS_RAW) -> np.ndarray:
    """The inverse of `encode_keys`; raises WireError on malformed bytes."""
    if key_encoding == ps_pb2.KEYS_RAW:
        if len(raw) % 8:
            raise WireError(f"`{what}` has {len(raw)} bytes, not a whole number of int64 keys")
        return np.frombuffer(raw, "<i8").astype(np.int64, copy=False)
    if key_encoding != ps_pb2.KEYS_DELTA_VARINT:
        raise WireError(f"Unknown key encoding {key_encoding} of `{what}`")
    b = np.frombuffer(raw, np.uint8)
    if len(b) == 0:
        return np.zeros(0, np.int64)
    last = (b & 0x80) == 0
    if not last[-1]:
        raise WireError(f"`{what}` ends inside a varint (truncated)")
    starts = np.concatenate([[0], np.flatnonzero(last)[:-1] + 1])
    lengths = np.diff(np.concatenate([starts, [len(b)]]))
    if lengths.max() > 10 or (b[starts[lengths == 10] + 9] > 1).any():
        raise WireError(f"`{what}` holds a varint beyond 64 bits")
    k = np.arange(len(b)) - np.repeat(starts, lengths)
    parts = (b & 0x7F).astype(np.uint64) << (7 * k).astype(np.uint64)
    deltas = np.bitwise_or.reduceat(parts, starts)
    return np.cumsum(deltas, dtype=np.uint64).view(np.int64)


def decode_uint(raw: bytes, n: int, dtype: str, what: str) -> np.ndarray:
    arr = np.frombuffer(raw, dtype)
    if arr.shape[0] != n:
        raise WireError(f"`{what}` holds {arr.shape[0]} values; {n} expected")
    return arr.astype(np.dtype(dtype).newbyteorder("="))


def gradient_exponent(grads: np.ndarray, enc: int) -> int:
    """The power of two that brings float16 gradients' largest magnitude to [2^14, 2^15).

    Embedding gradients are often below float16's smallest normal number
    (6.1e-5); scaling by a power of two is exact and keeps their precision.
    """
    if enc != ps_pb2.FLOAT16 or grads.size == 0:
        return 0
    largest = float(np.max(np.abs(grads)))
    if not 0 < largest < np.inf:
        return 0
    return int(np.clip(14 - np.floor(np.log2(largest)), -100, 100))


def scale(values: np.ndarray, exponent: int) -> np.ndarray:
    """values * 2^exponent (exact in float32 away from overflow and underflow)."""
    if exponent == 0:
        return values
    return np.ldexp(values, np.int32(exponent)).astype(np.float32, copy=False)


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
