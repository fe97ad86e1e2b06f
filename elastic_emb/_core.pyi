"""Type stubs of the private C++ extension (csrc/bindings.cc)."""

from typing import Any

import numpy as np

cxx_flags: str
with_cuda: bool

class InvalidArgument(ValueError): ...

def pool_threads() -> int: ...
def compiler() -> str: ...

class Table:
    dim: int
    num_slots: int
    def __init__(
        self,
        dim: int,
        initializer: str,
        init_a: float,
        init_b: float,
        seed: int,
        optimizer: str,
        optimizer_args: dict[str, Any],
        shard_bits: int = 6,
    ) -> None: ...
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
    def export_rows(
        self,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]: ...
    def erase(self, keys: np.ndarray) -> int: ...
    def metadata(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...
    def size(self) -> int: ...
    def memory_bytes(self) -> int: ...
