"""Every conversion between wire messages and numpy arrays (keys, rows, table state).

Arrays travel as raw little-endian bytes. Keys may travel as delta + LEB128
varints (ascending keys, 1-3 bytes each). Float rows (pulled values, pushed
gradients) may be encoded as float16 or bfloat16 to halve the bytes; the
optimizer always runs in float32 on the parameter server. Builders are named
after the message they make, readers after what they return; both sides of
the wire use the same functions, so a field is written and read in one place.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from elastic_emb import _core
from elastic_emb._proto import ps_pb2
from elastic_emb.tables import sharding
from elastic_emb.tables.table import Table, TableState

__all__ = [
    "DATA_PLANES",
    "DATA_PLANE_METHODS",
    "ENCODINGS",
    "NOT_JOINED",
    "OTHER_JOB",
    "RAW_METHODS",
    "Encoded",
    "WireError",
    "change_request",
    "copy_request",
    "decode_floats",
    "decode_keys",
    "encode_floats",
    "encode_keys",
    "encode_keys_compact",
    "encoding",
    "gradient_exponent",
    "has_range",
    "malformed",
    "pull_message",
    "push_message",
    "pushed_gradients",
    "ranges_request",
    "response_parts",
    "scale",
    "serialize",
]

# The calls whose requests and answers both sides read and write in C++ (`_core.PullMessage`,
# `PushMessage`, `PullPlan`, `push_requests`): sent and received as bytes.
RAW_METHODS = frozenset(("Pull", "Push", "PullRanges", "PushRanges"))
# The data plane's method numbers in its frames (csrc/data_plane.h): the RAW_METHODS, and
# Replicate (a primary's changes to its backups; the admin role's, as on gRPC).
DATA_PLANE_METHODS = {"Pull": 1, "Push": 2, "PullRanges": 3, "PushRanges": 4, "Replicate": 5}
# `serve --data-plane` and `ee.init(data_plane=)`: the data plane in C++, or gRPC only.
DATA_PLANES = ("native", "grpc")

# In the FAILED_PRECONDITION a shard answers an elastic worker it does not count (the
# worker left, or its lease lapsed): the worker joins that range again and re-sends.
NOT_JOINED = "is not an elastic worker of this shard"
# In the FAILED_PRECONDITION a shard answers a Join with another mode (staleness, number of
# workers) than its job's: `ModeMismatchError` on the worker.
OTHER_JOB = "this shard runs"

ENCODINGS: dict[str, Any] = {
    "float32": ps_pb2.FLOAT32,
    "float16": ps_pb2.FLOAT16,
    "bfloat16": ps_pb2.BFLOAT16,
}
# Little-endian on the wire; bfloat16 (native byte order only) travels as its uint16 bits.
_WIRE_DTYPES: dict[int, np.dtype] = {
    ps_pb2.FLOAT32: np.dtype("<f4"),
    ps_pb2.FLOAT16: np.dtype("<f2"),
    ps_pb2.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
}


class WireError(ValueError):
    """A message does not hold what it claims (truncated bytes, bad encoding...)."""


def malformed(raw: bytes, descriptor: Any, error: Exception) -> str:
    """The refusal of `raw`, which the parser of `descriptor`'s messages (a protobuf
    Descriptor) refused with `error`: what is wrong, naming the field (a string that is
    not UTF-8, a truncated field, a bad tag), or the parser's own words if none of these."""
    try:
        problem = _wire_problem(memoryview(raw), descriptor, "")
    except RecursionError:  # (no message of ours nests this deep)
        problem = ""
    return f"a malformed {descriptor.name}: {problem or error}"


def _varint(raw: memoryview, pos: int) -> tuple[int, int]:
    """The varint at `pos` and the position after it; ValueError if it does not end."""
    value = 0
    for shift in range(0, 70, 7):
        if pos >= len(raw):
            raise ValueError("truncated")
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
    raise ValueError("a varint longer than 10 bytes")


def _repeated(field: Any) -> bool:
    if hasattr(field, "is_repeated"):  # (protobuf >= 5; `label` is gone in 7)
        return bool(field.is_repeated)
    return bool(field.label == field.LABEL_REPEATED)


def _wire_problem(raw: memoryview, descriptor: Any, path: str) -> str:
    fixed = {1: 8, 5: 4}  # wire types of fixed width
    counts: dict[int, int] = {}
    pos = 0
    while pos < len(raw):
        try:
            key, pos = _varint(raw, pos)
        except ValueError as e:
            return f"{path or 'the message'}: a field's tag is {e} (byte {pos})"
        number, wire = key >> 3, key & 7
        field = descriptor.fields_by_number.get(number)
        name = path + (field.name if field is not None else f"field {number}")
        if field is not None and _repeated(field):
            name += f"[{counts.get(number, 0)}]"
            counts[number] = counts.get(number, 0) + 1
        if number == 0 or wire in (3, 4, 6, 7):
            return f"{name}: invalid tag (field {number}, wire type {wire})"
        try:
            if wire == 0:
                _, pos = _varint(raw, pos)
                continue
            size, pos = (fixed[wire], pos) if wire in fixed else _varint(raw, pos)
        except ValueError as e:
            return f"{name}: {e}"
        if pos + size > len(raw):
            return f"{name}: truncated ({size} bytes announced, {len(raw) - pos} left)"
        value, pos = raw[pos : pos + size], pos + size
        if field is None or wire != 2:
            continue
        if field.type == field.TYPE_STRING:
            try:
                str(value, "utf-8")
            except UnicodeDecodeError:
                return f"{name}: not UTF-8"
        elif field.type == field.TYPE_MESSAGE:
            problem = _wire_problem(value, field.message_type, name + ".")
            if problem:
                return problem
    return ""


def encoding(name: str) -> Any:
    """The wire enum of an encoding name ("float32", "float16", "bfloat16")."""
    if name not in ENCODINGS:
        raise ValueError(f"`wire_dtype` must be one of {sorted(ENCODINGS)}. Received: {name!r}")
    return ENCODINGS[name]


# Keys.


def encode_keys(keys: np.ndarray, key_encoding: int = ps_pb2.KEYS_RAW) -> bytes:
    """int64 keys -> bytes: raw, or delta + varint (compact when keys ascend as uint64)."""
    keys = np.ascontiguousarray(keys, np.int64)
    if key_encoding == ps_pb2.KEYS_RAW:
        return keys.astype("<i8", copy=False).tobytes()
    return _core.encode_delta_varint(keys)


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
    keys, malformed = _core.decode_delta_varint(raw)
    if malformed is not None:
        raise WireError(f"`{what}` {malformed}")
    return keys


def decode_uint(raw: bytes, n: int, dtype: str, what: str) -> np.ndarray:
    arr = np.frombuffer(raw, dtype)
    if arr.shape[0] != n:
        raise WireError(f"`{what}` holds {arr.shape[0]} values; {n} expected")
    return arr.astype(np.dtype(dtype).newbyteorder("="))


def _uint_bytes(values: np.ndarray, dtype: str) -> bytes:
    return np.ascontiguousarray(values, dtype).tobytes()


# Floats.


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
    """float32 array -> bytes in wire encoding `enc` (16-bit ones round to nearest even)."""
    if enc not in _WIRE_DTYPES:
        raise WireError(f"Unknown float encoding {enc}")
    values = np.ascontiguousarray(values, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # out of range: infinity; NaN stays NaN
        encoded = values.astype(_WIRE_DTYPES[enc], copy=False)
    if enc == ps_pb2.BFLOAT16:
        encoded = encoded.view(np.uint16).astype("<u2", copy=False)
    return encoded.tobytes()


def decode_floats(raw: bytes, enc: int, n: int, dim: int, what: str = "values") -> np.ndarray:
    """Bytes in wire encoding `enc` -> float32 `(n, dim)`."""
    if enc not in _WIRE_DTYPES:
        raise WireError(f"Unknown encoding {enc} of `{what}`; known: {sorted(ENCODINGS)}")
    itemsize = _WIRE_DTYPES[enc].itemsize
    if len(raw) != n * dim * itemsize:
        raise WireError(
            f"`{what}` has {len(raw)} bytes; {n} rows of dim {dim} in "
            f"{ps_pb2.Encoding.Name(enc).lower()} need {n * dim * itemsize}"
        )
    if enc == ps_pb2.BFLOAT16:
        bits = np.frombuffer(raw, "<u2").astype(np.uint16, copy=False)
        return bits.view(ml_dtypes.bfloat16).astype(np.float32).reshape(n, dim)
    return np.frombuffer(raw, _WIRE_DTYPES[enc]).astype(np.float32, copy=False).reshape(n, dim)


# Tables.


def create_tables_request(configs: Iterable[dict[str, Any]]) -> ps_pb2.CreateTablesRequest:
    return ps_pb2.CreateTablesRequest(
        tables=[
            ps_pb2.TableSpec(name=c["name"], config_json=json.dumps(c, sort_keys=True))
            for c in configs
        ]
    )


def table_configs(request: ps_pb2.CreateTablesRequest) -> list[dict[str, Any]]:
    """The table configs of a CreateTables request, each checked to name its table."""
    configs = []
    for spec in request.tables:
        try:
            config = json.loads(spec.config_json)
        except json.JSONDecodeError as e:
            raise WireError(f"Table {spec.name!r}: config_json is not JSON: {e}") from e
        if not isinstance(config, dict) or config.get("name") != spec.name:
            raise WireError(f"Table {spec.name!r}: config_json does not name that table")
        configs.append(config)
    return configs


def table_info(table: Table) -> ps_pb2.TableInfo:
    return ps_pb2.TableInfo(
        name=table.name,
        config_json=json.dumps(table.config(), sort_keys=True),
        dim=table.dim,
        num_slots=table.num_slots,
        rows=len(table),
        iterations=table.iterations,
        memory_bytes=table.memory_bytes(),
        nonfinite_pushes=table.nonfinite_pushes,
        **table.policy_counts(),
    )


# Training.


def join_request(
    worker: int,
    num_workers: int,
    mode: str,
    staleness: int | None,
    elastic: bool = False,
    again: bool = False,
) -> Any:
    return ps_pb2.JoinRequest(
        worker=worker,
        num_workers=num_workers,
        mode=ps_pb2.SYNC if mode == "sync" else ps_pb2.ASYNC,
        staleness=-1 if staleness is None else staleness,
        elastic=elastic,
        again=again,
    )


def pull_request(
    worker: int,
    step: int,
    train: bool,
    enc: Any,
    timeout: float,
    tables: Sequence[tuple[str, np.ndarray]],
    versions: Sequence[np.ndarray | None] | None = None,
) -> ps_pb2.PullRequest:
    """A Pull of the ascending `keys` of each (name, keys) of `tables`; with `versions`
    (a worker cache), the version of each key's cached row (0: none), per table.

    Workers make their Pulls in C++ (`_core.PullPlan.requests`), field for field this
    message (tested)."""
    entries = []
    for i, (name, keys) in enumerate(tables):
        raw, key_encoding = encode_keys_compact(keys)
        held = None if versions is None else versions[i]
        entries.append(
            ps_pb2.TableKeys(
                table=name,
                keys=raw,
                key_encoding=key_encoding,
                versions=b"" if held is None else _uint_bytes(held, "<u4"),
            )
        )
    return ps_pb2.PullRequest(
        worker=worker,
        step=step,
        train=train,
        encoding=enc,
        timeout_ms=int(timeout * 1000),
        tables=entries,
    )


def pulled_rows(
    response: ps_pb2.PullResponse, shapes: Sequence[tuple[str, int, int]]
) -> list[tuple[np.ndarray, np.ndarray | None, np.ndarray | None]]:
    """Per table of a Pull, given each (name, rows, dim) asked for: (float32 rows, their
    versions, which rows are unchanged). With a worker cache the rows and versions are
    those of the changed rows only; without, all the rows and (rows, None, None).

    Workers read answers in C++ (`_core.PullPlan.rows`); this reader is the reference
    the tests and `bench/client_path.py` hold it to."""
    if len(response.tables) != len(shapes):
        raise WireError(f"a Pull of {len(shapes)} tables answered {len(response.tables)}")
    out: list[tuple[np.ndarray, np.ndarray | None, np.ndarray | None]] = []
    for values, (name, n, dim) in zip(response.tables, shapes, strict=True):
        if not values.unchanged:
            rows = decode_floats(values.values, response.encoding, n, dim, f"rows of {name}")
            out.append((rows, None, None))
            continue
        bits = np.frombuffer(values.unchanged, np.uint8)
        if len(bits) != (n + 7) // 8:
            raise WireError(f"`unchanged` of {name} holds {len(bits) * 8} bits; {n} expected")
        same = np.unpackbits(bits, count=n).astype(bool)
        changed = n - int(np.count_nonzero(same))
        rows = decode_floats(values.values, response.encoding, changed, dim, f"rows of {name}")
        versions = decode_uint(values.versions, changed, "<u4", f"versions of {name}")
        out.append((rows, versions, same))
    return out


def push_request(
    worker: int, step: int, enc: Any, tables: Sequence[tuple[str, np.ndarray, np.ndarray]]
) -> ps_pb2.PushRequest:
    """A Push of (name, ascending keys, float32 gradients) per table."""
    entries = []
    for name, keys, grads in tables:
        raw, key_encoding = encode_keys_compact(keys)
        exponent = gradient_exponent(grads, enc)
        entries.append(
            ps_pb2.TableGradients(
                table=name,
                keys=raw,
                key_encoding=key_encoding,
                gradients=encode_floats(scale(grads, exponent), enc),
                gradient_exponent=exponent,
            )
        )
    return ps_pb2.PushRequest(worker=worker, step=step, encoding=enc, tables=entries)


class Encoded:
    """A worker's Pull or Push encoded in C++ (`_core.PullPlan`, `_core.push_requests`), or
    several ranges' in one *Ranges request: its bytes, and the `range` the router gives it
    (field 15, appended when it is sent; proto3 leaves range 0 out)."""

    __slots__ = ("body", "range", "train")

    def __init__(self, body: bytes, train: bool = False) -> None:
        self.body, self.train, self.range = body, train, 0

    def copy(self) -> Encoded:
        return Encoded(self.body, self.train)

    def SerializeToString(self) -> bytes:
        if self.range == 0:
            return self.body
        field = bytearray([15 << 3])  # field 15, a varint
        value = self.range
        while value >= 0x80:
            field.append(value & 0x7F | 0x80)
            value >>= 7
        field.append(value)
        return self.body + bytes(field)

    def ByteSize(self) -> int:
        return len(self.SerializeToString())


def has_range(request: Any) -> bool:
    """Whether a request names its slot range (the router sets it)."""
    return isinstance(request, Encoded) or "range" in request.DESCRIPTOR.fields_by_name


def copy_request(request: Any) -> Any:
    """A copy of a request (a message, or an `Encoded`) to give another range."""
    if isinstance(request, Encoded):
        return request.copy()
    return type(request).FromString(request.SerializeToString())


def serialize(request: Any) -> bytes:
    """A request's bytes: a message's, or an `Encoded`'s."""
    return request.SerializeToString()


def ranges_request(method: str, parts: list[Any]) -> Any:
    """The PullRangesRequest or PushRangesRequest (`method`: "Pull", "Push") of the parts."""
    if all(isinstance(p, Encoded) for p in parts):
        return Encoded(_core.join_parts([p.SerializeToString() for p in parts]))
    return getattr(ps_pb2, f"{method}RangesRequest")(parts=parts)


def response_parts(answer: Any) -> list[Any]:
    """The parts of a PullRangesResponse or PushRangesResponse (its bytes, or the message)."""
    return _core.request_parts(answer) if isinstance(answer, bytes) else list(answer.parts)


def pull_message(raw: bytes) -> Any:
    """A Pull's bytes, parsed in C++ (`_core.PullMessage`: keys decoded, answered by
    `answer`); raises `_core.InvalidArgument` on malformed bytes."""
    return _core.PullMessage(raw)


def push_message(request: Any) -> Any:
    """A Push (its bytes, or a `PushRequest`), parsed in C++ (`_core.PushMessage`: keys
    decoded; `decode` the gradients); raises `_core.InvalidArgument` on malformed bytes."""
    if isinstance(request, _core.PushMessage):
        return request
    return _core.PushMessage(request if isinstance(request, bytes) else request.SerializeToString())


def pushed_gradients(request: Any, dim_of: Any) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(name, keys, float32 gradients) per table of a Push (`push_message`'s argument);
    `dim_of(name)` gives widths.

    Raises:
        _core.InvalidArgument: a malformed entry, a table twice, an absurd scale.
    """
    message = push_message(request)
    message.decode([dim_of(name) for name in message.names])
    return [(name, message.keys(i), message.gradients(i)) for i, name in enumerate(message.names)]


# Rows and table state (ImportRows with `replace` and ExportRows share the fields).


def import_rows_request(name: str, keys: np.ndarray, values: np.ndarray) -> Any:
    return ps_pb2.ImportRowsRequest(
        table=name, keys=encode_keys(keys), values=encode_floats(values, ps_pb2.FLOAT32)
    )


def write_state(message: Any, state: TableState, with_state: bool = True) -> Any:
    """Fills the state fields of an ImportRowsRequest or ExportRowsResponse; returns it."""
    message.keys = encode_keys(state.keys)
    message.values = encode_floats(state.values, ps_pb2.FLOAT32)
    message.iterations = int(state.iterations)
    if with_state:
        message.slots = encode_floats(state.slots, ps_pb2.FLOAT32)
        message.last_step = _uint_bytes(state.last_step, "<u4")
        message.update_count = _uint_bytes(state.update_count, "<u4")
        if state.counts is not None:
            message.counts = np.ascontiguousarray(state.counts, np.uint8).tobytes()
    return message


def read_state(message: Any, dim: int, num_slots: int) -> TableState:
    """The inverse of `write_state` (with state)."""
    keys = decode_keys(message.keys)
    n = len(keys)
    return TableState(
        keys=keys,
        values=decode_floats(message.values, ps_pb2.FLOAT32, n, dim),
        slots=decode_floats(message.slots, ps_pb2.FLOAT32, n, num_slots * dim, "slots"),
        last_step=decode_uint(message.last_step, n, "<u4", "last_step"),
        update_count=decode_uint(message.update_count, n, "<u4", "update_count"),
        iterations=int(message.iterations),
        counts=np.frombuffer(message.counts, np.uint8) if message.counts else None,
    )


def imported_rows(request: ps_pb2.ImportRowsRequest, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys, float32 values) of an ImportRows without `replace`."""
    keys = decode_keys(request.keys)
    return keys, decode_floats(request.values, ps_pb2.FLOAT32, len(keys), dim)


def keys_request(message_type: Any, name: str, keys: np.ndarray) -> Any:
    """An EraseRowsRequest or MetadataRequest for `keys` of table `name`."""
    return message_type(table=name, keys=encode_keys(keys))


def metadata_response(last_step: np.ndarray, update_count: np.ndarray) -> Any:
    return ps_pb2.MetadataResponse(
        last_step=_uint_bytes(last_step, "<i8"), update_count=_uint_bytes(update_count, "<i8")
    )


def metadata_arrays(response: ps_pb2.MetadataResponse, n: int) -> tuple[np.ndarray, np.ndarray]:
    return (
        decode_uint(response.last_step, n, "<i8", "last_step"),
        decode_uint(response.update_count, n, "<i8", "update_count"),
    )


# Checkpoints.


def save_request(
    directory: str,
    tables: Sequence[str],
    incremental: bool = False,
    max_deltas: int = 0,
    after_step: int = 0,
    slots: tuple[int, int] = (0, 0),
) -> ps_pb2.SaveRequest:
    return ps_pb2.SaveRequest(
        directory=directory,
        tables=list(tables),
        incremental=incremental,
        max_deltas=max_deltas,
        after_step=after_step,
        slot_begin=slots[0],
        slot_end=slots[1],
    )


def restore_request(
    directory: str, tables: Sequence[str], slots: tuple[int, int]
) -> ps_pb2.RestoreRequest:
    """The shard keeps the rows whose keys' slots are in [slots[0], slots[1])."""
    return ps_pb2.RestoreRequest(
        directories=[directory], tables=list(tables), slot_begin=slots[0], slot_end=slots[1]
    )


# A change of a range, cut to a part of its slots (the part moving to another group).


def restricted(method: str, request: Any, slots: tuple[int, int], table: Any) -> Any:
    """A copy of a change request holding only the keys whose slot is in `slots`.

    Gradients travel as the float32 values the request decodes to (exact);
    `table(name)` gives a table's `dim` and `num_slots`. Requests without
    keys (CreateTables, Join, Leave) are copied; a Restore reads `slots`.
    """

    def inside(keys: np.ndarray) -> np.ndarray:
        slot = sharding.slot_of(keys)
        return (slot >= slots[0]) & (slot < slots[1])

    if method == "Push":
        parts = [
            (name, keys[mask], grads[mask])
            for name, keys, grads in pushed_gradients(request, lambda n: table(n).dim)
            for mask in [inside(keys)]
        ]
        return push_request(request.worker, request.step, ps_pb2.FLOAT32, parts)
    if method == "ImportRows":
        t = table(request.table)
        if request.replace:
            state = read_state(request, t.dim, t.num_slots)
            message = ps_pb2.ImportRowsRequest(table=request.table, replace=True)
            return write_state(message, state.select(inside(state.keys)))
        keys, values = imported_rows(request, t.dim)
        return import_rows_request(request.table, keys[inside(keys)], values[inside(keys)])
    if method == "EraseRows":
        keys = decode_keys(request.keys)
        return keys_request(ps_pb2.EraseRowsRequest, request.table, keys[inside(keys)])
    copy = type(request).FromString(request.SerializeToString())
    if method == "Restore":
        copy.slot_begin, copy.slot_end = slots
    return copy


def change_request(method: str, raw: bytes) -> Any:
    """The request message of a replicated change `method` ("Push", ...), from its bytes:
    a Push parsed in C++ (`push_message`), the others as protobuf messages."""
    if method == "Push":
        return push_message(raw)
    message = getattr(ps_pb2, f"{method}Request")()
    message.ParseFromString(raw)
    return message
