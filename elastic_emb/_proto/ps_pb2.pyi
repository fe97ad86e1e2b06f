from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FLOAT32: _ClassVar[Encoding]
    FLOAT16: _ClassVar[Encoding]
    BFLOAT16: _ClassVar[Encoding]

class KeyEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KEYS_RAW: _ClassVar[KeyEncoding]
    KEYS_DELTA_VARINT: _ClassVar[KeyEncoding]

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ASYNC: _ClassVar[Mode]
    SYNC: _ClassVar[Mode]
FLOAT32: Encoding
FLOAT16: Encoding
BFLOAT16: Encoding
KEYS_RAW: KeyEncoding
KEYS_DELTA_VARINT: KeyEncoding
ASYNC: Mode
SYNC: Mode

class TableSpec(_message.Message):
    __slots__ = ("name", "config_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    config_json: str
    def __init__(self, name: _Optional[str] = ..., config_json: _Optional[str] = ...) -> None: ...

class TableInfo(_message.Message):
    __slots__ = ("name", "config_json", "dim", "num_slots", "rows", "iterations", "memory_bytes", "nonfinite_pushes", "evicted_rows", "evicted_bytes", "admitted_keys", "rejected_updates")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_PUSHES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_ROWS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_KEYS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_UPDATES_FIELD_NUMBER: _ClassVar[int]
    name: str
    config_json: str
    dim: int
    num_slots: int
    rows: int
    iterations: int
    memory_bytes: int
    nonfinite_pushes: int
    evicted_rows: int
    evicted_bytes: int
    admitted_keys: int
    rejected_updates: int
    def __init__(self, name: _Optional[str] = ..., config_json: _Optional[str] = ..., dim: _Optional[int] = ..., num_slots: _Optional[int] = ..., rows: _Optional[int] = ..., iterations: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., nonfinite_pushes: _Optional[int] = ..., evicted_rows: _Optional[int] = ..., evicted_bytes: _Optional[int] = ..., admitted_keys: _Optional[int] = ..., rejected_updates: _Optional[int] = ...) -> None: ...

class CreateTablesRequest(_message.Message):
    __slots__ = ("tables", "range")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableSpec]
    range: int
    def __init__(self, tables: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ..., range: _Optional[int] = ...) -> None: ...

class DescribeTablesRequest(_message.Message):
    __slots__ = ("names", "range")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    range: int
    def __init__(self, names: _Optional[_Iterable[str]] = ..., range: _Optional[int] = ...) -> None: ...

class TablesResponse(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableInfo]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableInfo, _Mapping]]] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("worker", "num_workers", "mode", "staleness", "elastic", "again", "range")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_FIELD_NUMBER: _ClassVar[int]
    AGAIN_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    worker: int
    num_workers: int
    mode: Mode
    staleness: int
    elastic: bool
    again: bool
    range: int
    def __init__(self, worker: _Optional[int] = ..., num_workers: _Optional[int] = ..., mode: _Optional[_Union[Mode, str]] = ..., staleness: _Optional[int] = ..., elastic: bool = ..., again: bool = ..., range: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("worker", "range")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    worker: int
    range: int
    def __init__(self, worker: _Optional[int] = ..., range: _Optional[int] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class TableKeys(_message.Message):
    __slots__ = ("table", "keys", "key_encoding", "versions")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEY_ENCODING_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: bytes
    key_encoding: KeyEncoding
    versions: bytes
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[bytes] = ..., key_encoding: _Optional[_Union[KeyEncoding, str]] = ..., versions: _Optional[bytes] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("worker", "step", "train", "encoding", "timeout_ms", "tables", "range")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    worker: int
    step: int
    train: bool
    encoding: Encoding
    timeout_ms: int
    tables: _containers.RepeatedCompositeFieldContainer[TableKeys]
    range: int
    def __init__(self, worker: _Optional[int] = ..., step: _Optional[int] = ..., train: bool = ..., encoding: _Optional[_Union[Encoding, str]] = ..., timeout_ms: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[TableKeys, _Mapping]]] = ..., range: _Optional[int] = ...) -> None: ...

class TableValues(_message.Message):
    __slots__ = ("table", "values", "versions", "unchanged")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    table: str
    values: bytes
    versions: bytes
    unchanged: bytes
    def __init__(self, table: _Optional[str] = ..., values: _Optional[bytes] = ..., versions: _Optional[bytes] = ..., unchanged: _Optional[bytes] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("encoding", "tables")
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    encoding: Encoding
    tables: _containers.RepeatedCompositeFieldContainer[TableValues]
    def __init__(self, encoding: _Optional[_Union[Encoding, str]] = ..., tables: _Optional[_Iterable[_Union[TableValues, _Mapping]]] = ...) -> None: ...

class TableGradients(_message.Message):
    __slots__ = ("table", "keys", "gradients", "gradient_exponent", "key_encoding")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_EXPONENT_FIELD_NUMBER: _ClassVar[int]
    KEY_ENCODING_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: bytes
    gradients: bytes
    gradient_exponent: int
    key_encoding: KeyEncoding
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[bytes] = ..., gradients: _Optional[bytes] = ..., gradient_exponent: _Optional[int] = ..., key_encoding: _Optional[_Union[KeyEncoding, str]] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("worker", "step", "encoding", "tables", "range")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    worker: int
    step: int
    encoding: Encoding
    tables: _containers.RepeatedCompositeFieldContainer[TableGradients]
    range: int
    def __init__(self, worker: _Optional[int] = ..., step: _Optional[int] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., tables: _Optional[_Iterable[_Union[TableGradients, _Mapping]]] = ..., range: _Optional[int] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class PullRangesRequest(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[PullRequest]
    def __init__(self, parts: _Optional[_Iterable[_Union[PullRequest, _Mapping]]] = ...) -> None: ...

class PullRangesResponse(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[PullResponse]
    def __init__(self, parts: _Optional[_Iterable[_Union[PullResponse, _Mapping]]] = ...) -> None: ...

class PushRangesRequest(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[PushRequest]
    def __init__(self, parts: _Optional[_Iterable[_Union[PushRequest, _Mapping]]] = ...) -> None: ...

class PushRangesResponse(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[PushResponse]
    def __init__(self, parts: _Optional[_Iterable[_Union[PushResponse, _Mapping]]] = ...) -> None: ...

class ImportRowsRequest(_message.Message):
    __slots__ = ("table", "keys", "values", "replace", "slots", "last_step", "update_count", "iterations", "counts", "range")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    UPDATE_COUNT_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: bytes
    values: bytes
    replace: bool
    slots: bytes
    last_step: bytes
    update_count: bytes
    iterations: int
    counts: bytes
    range: int
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[bytes] = ..., values: _Optional[bytes] = ..., replace: bool = ..., slots: _Optional[bytes] = ..., last_step: _Optional[bytes] = ..., update_count: _Optional[bytes] = ..., iterations: _Optional[int] = ..., counts: _Optional[bytes] = ..., range: _Optional[int] = ...) -> None: ...

class ImportRowsResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    def __init__(self, rows: _Optional[int] = ...) -> None: ...

class ExportRowsRequest(_message.Message):
    __slots__ = ("table", "with_state", "range")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    WITH_STATE_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    table: str
    with_state: bool
    range: int
    def __init__(self, table: _Optional[str] = ..., with_state: bool = ..., range: _Optional[int] = ...) -> None: ...

class ExportRowsResponse(_message.Message):
    __slots__ = ("keys", "values", "slots", "last_step", "update_count", "iterations", "counts")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    UPDATE_COUNT_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    values: bytes
    slots: bytes
    last_step: bytes
    update_count: bytes
    iterations: int
    counts: bytes
    def __init__(self, keys: _Optional[bytes] = ..., values: _Optional[bytes] = ..., slots: _Optional[bytes] = ..., last_step: _Optional[bytes] = ..., update_count: _Optional[bytes] = ..., iterations: _Optional[int] = ..., counts: _Optional[bytes] = ...) -> None: ...

class EraseRowsRequest(_message.Message):
    __slots__ = ("table", "keys", "range")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: bytes
    range: int
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[bytes] = ..., range: _Optional[int] = ...) -> None: ...

class EraseRowsResponse(_message.Message):
    __slots__ = ("erased",)
    ERASED_FIELD_NUMBER: _ClassVar[int]
    erased: int
    def __init__(self, erased: _Optional[int] = ...) -> None: ...

class MetadataRequest(_message.Message):
    __slots__ = ("table", "keys", "range")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: bytes
    range: int
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[bytes] = ..., range: _Optional[int] = ...) -> None: ...

class MetadataResponse(_message.Message):
    __slots__ = ("last_step", "update_count")
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    UPDATE_COUNT_FIELD_NUMBER: _ClassVar[int]
    last_step: bytes
    update_count: bytes
    def __init__(self, last_step: _Optional[bytes] = ..., update_count: _Optional[bytes] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("directory", "tables", "incremental", "max_deltas", "after_step", "hold", "slot_begin", "slot_end", "range")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    INCREMENTAL_FIELD_NUMBER: _ClassVar[int]
    MAX_DELTAS_FIELD_NUMBER: _ClassVar[int]
    AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    SLOT_BEGIN_FIELD_NUMBER: _ClassVar[int]
    SLOT_END_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    directory: str
    tables: _containers.RepeatedScalarFieldContainer[str]
    incremental: bool
    max_deltas: int
    after_step: int
    hold: bool
    slot_begin: int
    slot_end: int
    range: int
    def __init__(self, directory: _Optional[str] = ..., tables: _Optional[_Iterable[str]] = ..., incremental: bool = ..., max_deltas: _Optional[int] = ..., after_step: _Optional[int] = ..., hold: bool = ..., slot_begin: _Optional[int] = ..., slot_end: _Optional[int] = ..., range: _Optional[int] = ...) -> None: ...

class SaveResponse(_message.Message):
    __slots__ = ("rows", "step", "worker_steps")
    class WorkerStepsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    ROWS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORKER_STEPS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    step: int
    worker_steps: _containers.ScalarMap[int, int]
    def __init__(self, rows: _Optional[int] = ..., step: _Optional[int] = ..., worker_steps: _Optional[_Mapping[int, int]] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("slot_begin", "slot_end", "directories", "tables", "num_shards", "shard_index", "num_slots", "range")
    SLOT_BEGIN_FIELD_NUMBER: _ClassVar[int]
    SLOT_END_FIELD_NUMBER: _ClassVar[int]
    DIRECTORIES_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    slot_begin: int
    slot_end: int
    directories: _containers.RepeatedScalarFieldContainer[str]
    tables: _containers.RepeatedScalarFieldContainer[str]
    num_shards: int
    shard_index: int
    num_slots: int
    range: int
    def __init__(self, slot_begin: _Optional[int] = ..., slot_end: _Optional[int] = ..., directories: _Optional[_Iterable[str]] = ..., tables: _Optional[_Iterable[str]] = ..., num_shards: _Optional[int] = ..., shard_index: _Optional[int] = ..., num_slots: _Optional[int] = ..., range: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MethodStats(_message.Message):
    __slots__ = ("method", "calls", "errors", "request_bytes", "response_bytes", "seconds", "max_seconds")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    method: str
    calls: int
    errors: int
    request_bytes: int
    response_bytes: int
    seconds: float
    max_seconds: float
    def __init__(self, method: _Optional[str] = ..., calls: _Optional[int] = ..., errors: _Optional[int] = ..., request_bytes: _Optional[int] = ..., response_bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., max_seconds: _Optional[float] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("methods", "tables", "step", "pull_waits", "pull_wait_seconds")
    METHODS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PULL_WAITS_FIELD_NUMBER: _ClassVar[int]
    PULL_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    methods: _containers.RepeatedCompositeFieldContainer[MethodStats]
    tables: _containers.RepeatedCompositeFieldContainer[TableInfo]
    step: int
    pull_waits: int
    pull_wait_seconds: float
    def __init__(self, methods: _Optional[_Iterable[_Union[MethodStats, _Mapping]]] = ..., tables: _Optional[_Iterable[_Union[TableInfo, _Mapping]]] = ..., step: _Optional[int] = ..., pull_waits: _Optional[int] = ..., pull_wait_seconds: _Optional[float] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ("backup", "group", "epoch")
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    backup: str
    group: int
    epoch: int
    def __init__(self, backup: _Optional[str] = ..., group: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("serving", "step", "num_tables", "role", "group", "epoch", "sequence", "rows", "ranges", "data_port")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_TABLES_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    step: int
    num_tables: int
    role: str
    group: int
    epoch: int
    sequence: int
    rows: int
    ranges: _containers.RepeatedScalarFieldContainer[int]
    data_port: int
    def __init__(self, serving: bool = ..., step: _Optional[int] = ..., num_tables: _Optional[int] = ..., role: _Optional[str] = ..., group: _Optional[int] = ..., epoch: _Optional[int] = ..., sequence: _Optional[int] = ..., rows: _Optional[int] = ..., ranges: _Optional[_Iterable[int]] = ..., data_port: _Optional[int] = ...) -> None: ...

class ReplicateRequest(_message.Message):
    __slots__ = ("group", "epoch", "sequence", "method", "request", "primary")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    group: int
    epoch: int
    sequence: int
    method: str
    request: bytes
    primary: str
    def __init__(self, group: _Optional[int] = ..., epoch: _Optional[int] = ..., sequence: _Optional[int] = ..., method: _Optional[str] = ..., request: _Optional[bytes] = ..., primary: _Optional[str] = ...) -> None: ...

class ReplicateResponse(_message.Message):
    __slots__ = ("sequence",)
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    def __init__(self, sequence: _Optional[int] = ...) -> None: ...

class SnapshotChunk(_message.Message):
    __slots__ = ("group", "epoch", "sequence", "primary", "table_config_json", "rows", "steps_json", "pending", "range", "slot_begin", "slot_end")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    TABLE_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    STEPS_JSON_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    SLOT_BEGIN_FIELD_NUMBER: _ClassVar[int]
    SLOT_END_FIELD_NUMBER: _ClassVar[int]
    group: int
    epoch: int
    sequence: int
    primary: str
    table_config_json: str
    rows: ExportRowsResponse
    steps_json: str
    pending: _containers.RepeatedCompositeFieldContainer[PushRequest]
    range: int
    slot_begin: int
    slot_end: int
    def __init__(self, group: _Optional[int] = ..., epoch: _Optional[int] = ..., sequence: _Optional[int] = ..., primary: _Optional[str] = ..., table_config_json: _Optional[str] = ..., rows: _Optional[_Union[ExportRowsResponse, _Mapping]] = ..., steps_json: _Optional[str] = ..., pending: _Optional[_Iterable[_Union[PushRequest, _Mapping]]] = ..., range: _Optional[int] = ..., slot_begin: _Optional[int] = ..., slot_end: _Optional[int] = ...) -> None: ...

class ShrinkRangeRequest(_message.Message):
    __slots__ = ("range", "slot")
    RANGE_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    range: int
    slot: int
    def __init__(self, range: _Optional[int] = ..., slot: _Optional[int] = ...) -> None: ...

class DropRangeRequest(_message.Message):
    __slots__ = ("range",)
    RANGE_FIELD_NUMBER: _ClassVar[int]
    range: int
    def __init__(self, range: _Optional[int] = ...) -> None: ...

class MoveInRequest(_message.Message):
    __slots__ = ("range", "source_range", "source_group", "source_epoch", "index", "chunk", "change")
    RANGE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_RANGE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_GROUP_FIELD_NUMBER: _ClassVar[int]
    SOURCE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    CHANGE_FIELD_NUMBER: _ClassVar[int]
    range: int
    source_range: int
    source_group: int
    source_epoch: int
    index: int
    chunk: SnapshotChunk
    change: ReplicateRequest
    def __init__(self, range: _Optional[int] = ..., source_range: _Optional[int] = ..., source_group: _Optional[int] = ..., source_epoch: _Optional[int] = ..., index: _Optional[int] = ..., chunk: _Optional[_Union[SnapshotChunk, _Mapping]] = ..., change: _Optional[_Union[ReplicateRequest, _Mapping]] = ...) -> None: ...

class MoveInResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    def __init__(self, rows: _Optional[int] = ...) -> None: ...

class InstallSnapshotResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    def __init__(self, rows: _Optional[int] = ...) -> None: ...
