"""Type stubs of the private C++ extension (csrc/bindings.cc)."""

from typing import Any, ClassVar, Literal, overload

import numpy as np

cxx_flags: str
with_cuda: bool

class InvalidArgument(ValueError): ...

def pool_threads() -> int: ...
def compiler() -> str: ...
def unique_keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct keys in order of first occurrence, position of each key among them)."""

def encode_delta_varint(keys: np.ndarray) -> bytes:
    """int64 keys -> bytes: deltas (modulo 2^64) as LEB128 varints."""

def decode_delta_varint(raw: bytes) -> tuple[np.ndarray, str | None]:
    """The inverse of encode_delta_varint: (keys, None), or (empty keys, what is malformed)."""

def count_by_slot(keys: np.ndarray, num_slots: int) -> np.ndarray:
    """The number of keys in each virtual slot."""

def split_by_slot_range(
    keys: np.ndarray, starts: np.ndarray, num_slots: int
) -> tuple[np.ndarray, np.ndarray]:
    """(positions of the keys ordered by slot range, then key as uint64; range bounds)."""

def sum_by_key(keys: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct keys, their rows of grads summed in input order from +0.0)."""

class OptimizerKind:
    sgd: ClassVar[OptimizerKind]
    adagrad: ClassVar[OptimizerKind]
    adam: ClassVar[OptimizerKind]
    ftrl: ClassVar[OptimizerKind]
    __members__: ClassVar[dict[str, OptimizerKind]]
    def __init__(self, value: int) -> None: ...
    def __int__(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

class InitKind:
    zeros: ClassVar[InitKind]
    ones: ClassVar[InitKind]
    constant: ClassVar[InitKind]
    uniform: ClassVar[InitKind]
    normal: ClassVar[InitKind]
    truncated_normal: ClassVar[InitKind]
    __members__: ClassVar[dict[str, InitKind]]
    def __init__(self, value: int) -> None: ...
    def __int__(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

class OptimizerOptions:
    kind: OptimizerKind
    momentum: float
    nesterov: bool
    beta_1: float
    beta_2: float
    epsilon: float
    initial_accumulator_value: float
    learning_rate_power: float
    l1_regularization_strength: float
    l2_regularization_strength: float
    l2_shrinkage_regularization_strength: float
    beta: float
    def __init__(self) -> None: ...

class InitializerOptions:
    kind: InitKind
    a: float
    b: float
    seed: int
    def __init__(self) -> None: ...

class AdmissionOptions:
    min_count: int
    sketch_bytes: int
    sketch_depth: int
    def __init__(self) -> None: ...

class RowDtype:
    float32: ClassVar[RowDtype]
    float16: ClassVar[RowDtype]
    bfloat16: ClassVar[RowDtype]
    __members__: ClassVar[dict[str, RowDtype]]
    def __init__(self, value: int) -> None: ...
    def __int__(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

class EvictionKind:
    none: ClassVar[EvictionKind]
    ttl: ClassVar[EvictionKind]
    lru: ClassVar[EvictionKind]
    lfu: ClassVar[EvictionKind]
    __members__: ClassVar[dict[str, EvictionKind]]
    def __init__(self, value: int) -> None: ...
    def __int__(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

class EvictionOptions:
    kind: EvictionKind
    ttl_steps: int
    max_rows: int
    protect_steps: int
    keep_evicted: bool
    def __init__(self) -> None: ...

class TableOptions:
    dim: int
    initializer: InitializerOptions
    optimizer: OptimizerOptions
    row_dtype: RowDtype
    admission: AdmissionOptions
    eviction: EvictionOptions
    shard_bits: int
    def __init__(self) -> None: ...

class Table:
    dim: int
    num_slots: int
    def __init__(self, options: TableOptions) -> None: ...
    def pull(self, keys: np.ndarray, train: bool) -> np.ndarray: ...
    def push(
        self, keys: np.ndarray, grads: np.ndarray, learning_rate: float, step: int
    ) -> None: ...
    def import_rows(
        self,
        keys: np.ndarray,
        values: np.ndarray,
        slots: np.ndarray | None = None,
        last_step: np.ndarray | None = None,
        update_count: np.ndarray | None = None,
    ) -> None: ...
    @overload
    def export_rows(self, with_state: Literal[False]) -> tuple[np.ndarray, np.ndarray]: ...
    @overload
    def export_rows(
        self, with_state: Literal[True] = True
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]: ...
    def erase(self, keys: np.ndarray) -> int: ...
    def metadata(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...
    def size(self) -> int: ...
    def memory_bytes(self) -> int: ...
    def export_slots(
        self, num_slots: int, begin: int, end: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]: ...
    def erase_slots(self, num_slots: int, begin: int, end: int) -> int: ...
    def export_counts(self) -> np.ndarray: ...
    def import_counts(self, counts: np.ndarray, add: bool) -> None: ...
    @property
    def num_counts(self) -> int: ...
    def set_clock(self, step: int) -> None: ...
    def take_evicted(
        self,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]: ...
    def evict_now(self) -> None: ...
    def policy_counts(self) -> dict[str, int]: ...

def cuda_device_count() -> int: ...

# Present only in a CUDA build (with_cuda is True).
class CudaError(RuntimeError): ...
class CudaOutOfMemory(MemoryError): ...

class DeviceTable(Table):
    capacity: int
    def __init__(self, options: TableOptions) -> None: ...
    def pull_to_device(self, keys: np.ndarray, out: int, train: bool) -> None: ...
    def push_from_device(
        self, keys: np.ndarray, grads: int, learning_rate: float, step: int
    ) -> None: ...
    def reserve(self, rows: int) -> None: ...
    def gather_rows(self, rows: int, n: int, out: int) -> None: ...
    def apply_rows(
        self, rows: int, n: int, grads: int, learning_rate: float, step: int
    ) -> None: ...
    def synchronize(self) -> None: ...

def device_malloc(bytes: int) -> int: ...
def device_free(ptr: int) -> None: ...
def copy_to_host(out: np.ndarray, src: int) -> None: ...
def copy_to_device(dst: int, src: np.ndarray) -> None: ...
def device_synchronize() -> None: ...
def to_dlpack(
    data: int, shape: list[int], code: int, bits: int, device_id: int, owner: object
) -> Any: ...
def dlpack_info(capsule: Any) -> dict[str, Any]: ...
