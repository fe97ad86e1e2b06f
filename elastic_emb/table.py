"""`Table`: the embedding table interface, and its in-process implementation."""

from __future__ import annotations

import os
import sys
import threading
import weakref
import zlib
from typing import Any

import numpy as np

from elastic_emb import _core, initializers, optimizers

__all__ = ["Table", "TableState", "registered_tables", "unregister"]

# Live tables of this process by name, for ee.save / ee.restore.
_REGISTRY: weakref.WeakValueDictionary[str, Table] = weakref.WeakValueDictionary()
_REGISTRY_LOCK = threading.Lock()


def registered_tables() -> dict[str, Table]:
    """The live tables of this process, by name."""
    with _REGISTRY_LOCK:
        return dict(_REGISTRY.items())


def _register(table: Table, name: str) -> str:
    """Registers `table` under `name`, or `name_1`, `name_2`... if taken."""
    with _REGISTRY_LOCK:
        unique, i = name, 0
        while unique in _REGISTRY:
            i += 1
            unique = f"{name}_{i}"
        _REGISTRY[unique] = table
        return unique


def unregister(table: Table) -> None:
    """Removes `table` from the registry (its name becomes free)."""
    with _REGISTRY_LOCK:
        if _REGISTRY.get(table.name) is table:
            del _REGISTRY[table.name]


def default_seed(name: str) -> int:
    """The seed of a table created without one: a stable hash of its name."""
    return zlib.crc32(name.encode())


def _remote_module() -> Any:
    """`elastic_emb.remote` where remote tables are possible, else None.

    Remote tables need `ee.init` (which imports the module) or the
    `ELASTIC_EMB_PS` variable; otherwise gRPC is not imported at all, so
    in-process tables work where it is not installed.
    """
    module = sys.modules.get("elastic_emb.remote")
    if module is None and os.environ.get("ELASTIC_EMB_PS"):
        from elastic_emb import remote as module
    return module


class TableState:
    """Everything a table holds, as numpy arrays (row i belongs to keys[i])."""

    def __init__(
        self,
        keys: np.ndarray,  # int64 (m,)
        values: np.ndarray,  # float32 (m, dim)
        slots: np.ndarray,  # float32 (m, num_slots * dim)
        last_step: np.ndarray,  # uint32 (m,)
        update_count: np.ndarray,  # uint32 (m,)
        iterations: int,
    ) -> None:
        self.keys = keys
        self.values = values
        self.slots = slots
        self.last_step = last_step
        self.update_count = update_count
        self.iterations = iterations

    def select(self, mask: np.ndarray) -> TableState:
        """The rows where `mask` is true (same step count)."""
        return TableState(
            self.keys[mask],
            self.values[mask],
            self.slots[mask],
            self.last_step[mask],
            self.update_count[mask],
            self.iterations,
        )

    @staticmethod
    def concatenate(parts: list[TableState]) -> TableState:
        """The rows of all parts (of one table, e.g. its shards); the largest step count."""
        keys, values, slots, last_step, update_count = (
            np.concatenate([getattr(p, f) for p in parts]) for f in TableState.FIELDS
        )
        iterations = max(p.iterations for p in parts)
        return TableState(keys, values, slots, last_step, update_count, iterations)

    FIELDS = ("keys", "values", "slots", "last_step", "update_count")


def _keys_arg(keys: Any, name: str = "keys") -> np.ndarray:
    arr = np.asarray(keys)
    if arr.size == 0 and arr.ndim == 1:  # [] is float64 to NumPy
        return np.zeros(0, np.int64)
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"`{name}` must be an integer array (int64). Received dtype={arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"`{name}` must be 1-D, shape (n,). Received shape={arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _rows_arg(rows: Any, name: str, n: int, width: int) -> np.ndarray:
    arr = np.asarray(rows)
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"`{name}` must be a float array (float32). Received dtype={arr.dtype}")
    if arr.shape != (n, width):
        raise ValueError(
            f"`{name}` must have shape (n, {width}) = {(n, width)} to match the keys and the "
            f"table's width. Received shape={arr.shape}"
        )
    return np.ascontiguousarray(arr, dtype=np.float32)


class Table:
    """An embedding table: int64 keys to rows of `dim` float32 values.

    Rows are created on first training use with a deterministic initial value
    (a pure function of `seed` and the key) and trained by `optimizer`, which
    runs inside the table. The table is in-process (C++ core); every method is
    thread-safe and releases the GIL while it works.

    Example:
        >>> t = Table(dim=4, optimizer=optimizers.SGD(0.1), initializer="zeros", name="t")
        >>> rows = t.pull(np.array([3, 7]), train=True)   # float32 (2, 4)
        >>> t.push(np.array([3, 7]), np.ones((2, 4), np.float32))
        >>> len(t)
        2

    Args:
        dim: int, width of a row.
        optimizer: `elastic_emb.optimizers.*`, `keras.optimizers.*` (converted)
            or a name. Defaults to `Adagrad(learning_rate=0.05)`.
        initializer: Keras initializer name or object (zeros, ones, constant,
            uniform, normal, truncated_normal).
        name: str, unique within the process (a suffix is added if taken);
            checkpoints match tables by name.
        seed: int, initialization seed. Defaults to a hash of `name`.
        device: "cpu" (default) or "gpu": where rows and optimizer slots live
            (a GPU table needs a CUDA build; see `elastic_emb.gpu`).

    Raises:
        ValueError: on an invalid argument.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Table:
        if cls is Table:
            device = kwargs.get("device", args[5] if len(args) > 5 else "cpu")
            if device == "gpu":
                from elastic_emb.gpu import GpuTable

                cls = GpuTable
            elif device == "cpu":
                # After ee.init(ps=...) (or with ELASTIC_EMB_PS set) tables are remote.
                remote = _remote_module()
                if remote is not None and remote.current() is not None:
                    cls = remote.RemoteTable
        return super().__new__(cls)

    def __init__(
        self,
        dim: int,
        optimizer: Any = None,
        initializer: Any = "uniform",
        name: str = "table",
        seed: int | None = None,
        device: str = "cpu",
    ) -> None:
        self._configure(dim, optimizer, initializer, name, seed, device)
        self._core = _core.Table(**self._core_options())
        self._iterations = 0
        self._init_step_lock()
        self.name = _register(self, name)

    def _core_options(self) -> dict[str, Any]:
        """The C++ table's constructor arguments (CPU and GPU tables alike)."""
        return {
            "dim": self.dim,
            "initializer": self.initializer.kind,
            "init_a": self.initializer.a,
            "init_b": self.initializer.b,
            "seed": self.seed,
            "optimizer": self.optimizer.kind,
            "optimizer_args": self.optimizer.core_args(),
        }

    def _init_step_lock(self) -> None:
        self._step_lock = threading.Lock()

    def _configure(
        self,
        dim: Any,
        optimizer: Any,
        initializer: Any,
        name: Any,
        seed: Any,
        device: Any = "cpu",
    ) -> None:
        """Checks and stores the arguments every implementation shares."""
        if device not in ("cpu", "gpu"):
            raise ValueError(f'`device` must be "cpu" or "gpu". Received: device={device!r}')
        self.device = device
        if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim <= 0:
            raise ValueError(f"`dim` must be a positive integer. Received: dim={dim!r}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"`name` must be a non-empty string. Received: name={name!r}")
        if seed is not None and (not isinstance(seed, int | np.integer) or seed < 0):
            raise ValueError(f"`seed` must be a non-negative integer. Received: seed={seed!r}")
        self.dim = int(dim)
        self.optimizer = optimizers.get(
            optimizers.Adagrad(learning_rate=0.05) if optimizer is None else optimizer
        )
        self.initializer = initializers.get(initializer)
        self.seed = default_seed(name) if seed is None else int(seed)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Table:
        """A new empty table from `config()` output."""
        return cls(
            dim=config["dim"],
            optimizer=config["optimizer"],
            initializer=initializers.InitializerSpec(**config["initializer"]),
            name=config["name"],
            seed=config["seed"],
        )

    @property
    def iterations(self) -> int:
        """Number of pushes applied so far (the optimizer's step count)."""
        return self._iterations

    @property
    def num_slots(self) -> int:
        """Optimizer slot vectors stored per row."""
        return int(self._core.num_slots)

    def pull(self, keys: Any, train: bool = True) -> np.ndarray:
        """Gathers rows: int64 `(n,)` -> float32 `(n, dim)`.

        With `train=False`, unseen keys are not inserted; they get their
        initial value.
        """
        return self._core.pull(_keys_arg(keys), bool(train))

    def push(self, keys: Any, grads: Any) -> None:
        """Applies one optimizer step: gradients of equal keys are summed first.

        Args:
            keys: int64 `(n,)`.
            grads: float32 `(n, dim)`.
        """
        k = _keys_arg(keys)
        g = _rows_arg(grads, "grads", k.shape[0], self.dim)
        with self._step_lock:
            self._iterations += 1
            step = self._iterations
            lr = self.optimizer.learning_rate_at(step - 1)
            self._core.push(k, g, lr, step)

    def import_rows(self, keys: Any, values: Any) -> None:
        """Sets the values of rows (inserting them); their optimizer slots are reset."""
        k = _keys_arg(keys)
        self._core.import_rows(k, _rows_arg(values, "values", k.shape[0], self.dim))

    def export_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """All rows: (int64 `(m,)` keys, float32 `(m, dim)` values), in no set order."""
        keys, values, *_ = self._core.export_rows()
        return keys, values

    def erase(self, keys: Any) -> int:
        """Removes rows; returns how many existed."""
        return int(self._core.erase(_keys_arg(keys)))

    def metadata(self, keys: Any) -> tuple[np.ndarray, np.ndarray]:
        """(last-updated step, update count) per key, int64; -1 for absent keys."""
        last_step, update_count = self._core.metadata(_keys_arg(keys))
        return last_step, update_count

    def memory_bytes(self) -> int:
        """Bytes held by the index and the row arena."""
        return int(self._core.memory_bytes())

    def __len__(self) -> int:
        return int(self._core.size())

    def __repr__(self) -> str:
        return (
            f"Table(name={self.name!r}, dim={self.dim}, rows={len(self)}, "
            f"optimizer={type(self.optimizer).__name__})"
        )

    # Checkpoint support.

    def config(self) -> dict[str, Any]:
        """What is needed to re-create an empty table like this one."""
        return {
            "name": self.name,
            "dim": self.dim,
            "seed": self.seed,
            "optimizer": self.optimizer.get_config(),
            "initializer": {
                "kind": self.initializer.kind,
                "a": self.initializer.a,
                "b": self.initializer.b,
            },
        }

    def export_state(self) -> TableState:
        """Every row with optimizer slots and metadata, plus the step count."""
        with self._step_lock:
            keys, values, slots, last_step, update_count = self._core.export_rows()
            return TableState(keys, values, slots, last_step, update_count, self._iterations)

    def load_state(self, state: TableState) -> None:
        """Replaces the whole content of the table with `state`."""
        n = state.keys.shape[0]
        keys = _keys_arg(state.keys)
        values = _rows_arg(state.values, "values", n, self.dim)
        slots = _rows_arg(state.slots, "slots", n, self.num_slots * self.dim)
        with self._step_lock:
            current, *_ = self._core.export_rows()
            self._core.erase(current)
            self._core.import_rows(
                keys,
                values,
                slots,
                np.ascontiguousarray(state.last_step, np.uint32),
                np.ascontiguousarray(state.update_count, np.uint32),
            )
            self._iterations = int(state.iterations)
