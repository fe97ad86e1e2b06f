"""`Table`: the interface every embedding table implements, and what they share.

Implementations are siblings: `elastic_emb.tables.local.LocalTable` (in-process,
C++), `elastic_emb.tables.gpu.GpuTable` (in-process, rows in GPU memory) and
`elastic_emb.ps.client.remote_table.RemoteTable` (rows on parameter-server shards). Calling the
interface itself, `Table(dim, optimizer, ...)`, creates a table where
`elastic_emb.placement` says it lives (`device=`, `ee.init`).
"""

from __future__ import annotations

import abc
import dataclasses
import math
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from elastic_emb.tables.policies import admission as admission_module
from elastic_emb.tables.policies import eviction as eviction_module
from elastic_emb.tables.policies import initializers, optimizers
from elastic_emb.tables.policies import storage as storage_module

__all__ = [
    "DENSE_TABLE_PREFIX",
    "NONFINITE_POLICIES",
    "POLICY_COUNTS",
    "ROW_STORAGE_DTYPES",
    "StepFusion",
    "Table",
    "TableConfig",
    "TableState",
    "check_finite_gradients",
    "check_keys",
    "check_nonfinite_policy",
    "check_rows",
    "sum_counts",
]

# How a table may store its rows' values in training (`row_dtype=`).
ROW_STORAGE_DTYPES = ("float32", "float16", "bfloat16")

# What `Table.policy_counts()` counts.
POLICY_COUNTS = ("evicted_rows", "evicted_bytes", "admitted_keys", "rejected_updates")

# What a table does with a push whose gradients hold NaN or ±Inf (`nonfinite=`).
NONFINITE_POLICIES = ("raise", "skip")

# The names of the tables of models' dense weights (`elastic_emb.keras.dense_ps_base`); the
# servers let workers create them and store their first values (`ps.security`).
DENSE_TABLE_PREFIX = "ee_dense/"


def check_nonfinite_policy(nonfinite: Any) -> str:
    """`nonfinite` if it is one of `NONFINITE_POLICIES`; ValueError listing them otherwise."""
    if not isinstance(nonfinite, str) or nonfinite not in NONFINITE_POLICIES:
        raise ValueError(
            f"`nonfinite` must be one of {NONFINITE_POLICIES}. Received: nonfinite={nonfinite!r}"
        )
    return nonfinite


def default_seed(name: str) -> int:
    """The seed of a table created without one: a stable hash of its name."""
    return zlib.crc32(name.encode())


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """What defines an empty table: checked once, shared by every implementation."""

    dim: int
    optimizer: optimizers.Optimizer
    initializer: initializers.InitializerSpec
    name: str
    seed: int
    nonfinite: str = "raise"  # one of NONFINITE_POLICIES
    row_dtype: str = "float32"  # one of ROW_STORAGE_DTYPES
    admission: admission_module.Frequency | None = None
    eviction: eviction_module.TTL | eviction_module.LRU | eviction_module.LFU | None = None
    storage: storage_module.Tiered | None = None

    @classmethod
    def make(
        cls,
        dim: Any,
        optimizer: Any = None,
        initializer: Any = "uniform",
        name: Any = "table",
        seed: Any = None,
        nonfinite: Any = "raise",
        admission: Any = None,
        eviction: Any = None,
        row_dtype: Any = "float32",
        storage: Any = None,
    ) -> TableConfig:
        """Checks and converts constructor arguments (optimizer and initializer names...).

        Raises:
            ValueError: on an invalid argument, naming it.
        """
        if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim <= 0:
            raise ValueError(f"`dim` must be a positive integer. Received: dim={dim!r}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"`name` must be a non-empty string. Received: name={name!r}")
        if seed is not None and (not isinstance(seed, int | np.integer) or seed < 0):
            raise ValueError(f"`seed` must be a non-negative integer. Received: seed={seed!r}")
        check_nonfinite_policy(nonfinite)
        if storage is not None and eviction is not None:
            raise ValueError(
                "A table takes `storage=ee.storage.Tiered(...)` or `eviction`, not both yet "
                f"(the RAM tier evicts to disk itself). Received: storage={storage!r}, "
                f"eviction={eviction!r}"
            )
        if not isinstance(row_dtype, str) or row_dtype not in ROW_STORAGE_DTYPES:
            raise ValueError(
                f"`row_dtype` must be one of {ROW_STORAGE_DTYPES} (int8 is for export: "
                f"ee.export_rows). Received: row_dtype={row_dtype!r}"
            )
        return cls(
            dim=int(dim),
            optimizer=optimizers.get(
                optimizers.Adagrad(learning_rate=0.05) if optimizer is None else optimizer
            ),
            initializer=initializers.get(initializer),
            name=name,
            seed=default_seed(name) if seed is None else int(seed),
            nonfinite=nonfinite,
            row_dtype=row_dtype,
            admission=admission_module.get(admission),
            eviction=eviction_module.get(eviction),
            storage=storage_module.get(storage),
        )

    def policies(self) -> dict[str, Any]:
        """The keyword arguments of the policies that are not the default (`Table(...)`)."""
        out: dict[str, Any] = {}
        if self.nonfinite != "raise":
            out["nonfinite"] = self.nonfinite
        if self.row_dtype != "float32":
            out["row_dtype"] = self.row_dtype
        if self.admission is not None:
            out["admission"] = self.admission
        if self.eviction is not None:
            out["eviction"] = self.eviction
        if self.storage is not None:
            out["storage"] = self.storage
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (checkpoint manifests, the wire's CreateTables)."""
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
            "nonfinite": self.nonfinite,
            # Policies only when set: configs without them read as before.
            **{
                k: v if isinstance(v, str) else v.to_dict()
                for k, v in self.policies().items()
                if k != "nonfinite"
            },
        }

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> TableConfig:
        """The inverse of `to_dict`; a key written before it existed gets its default."""
        return cls.make(
            dim=config["dim"],
            optimizer=config["optimizer"],
            initializer=initializers.InitializerSpec(**config["initializer"]),
            name=config["name"],
            seed=config["seed"],
            nonfinite=config.get("nonfinite", "raise"),
            admission=config.get("admission"),
            eviction=config.get("eviction"),
            row_dtype=config.get("row_dtype", "float32"),
            storage=config.get("storage"),
        )


class TableState:
    """Everything a table holds, as numpy arrays (row i belongs to keys[i]).

    `counts`: the admission sketch's counters (uint8), table-wide rather than
    per row; None for a table without admission.
    """

    FIELDS = ("keys", "values", "slots", "last_step", "update_count")

    def __init__(
        self,
        keys: np.ndarray,  # int64 (m,)
        values: np.ndarray,  # float32 (m, dim)
        slots: np.ndarray,  # float32 (m, num_slots * dim)
        last_step: np.ndarray,  # uint32 (m,)
        update_count: np.ndarray,  # uint32 (m,)
        iterations: int,
        counts: np.ndarray | None = None,  # uint8 (c,)
    ) -> None:
        self.keys = keys
        self.values = values
        self.slots = slots
        self.last_step = last_step
        self.update_count = update_count
        self.iterations = iterations
        self.counts = counts

    def select(self, mask: np.ndarray) -> TableState:
        """The rows `mask` selects (a boolean mask or positions); same step count and counts."""
        return TableState(
            self.keys[mask],
            self.values[mask],
            self.slots[mask],
            self.last_step[mask],
            self.update_count[mask],
            self.iterations,
            self.counts,
        )

    @staticmethod
    def concatenate(parts: list[TableState]) -> TableState:
        """The rows of all parts (of one table, e.g. its shards); the largest step count.

        Admission counts are summed (saturating at 255): the parts count
        disjoint keys, so the sum is what one table counting all of them
        holds.
        """
        keys, values, slots, last_step, update_count = (
            np.concatenate([getattr(p, f) for p in parts]) for f in TableState.FIELDS
        )
        iterations = max(p.iterations for p in parts)
        counts = sum_counts([p.counts for p in parts])
        return TableState(keys, values, slots, last_step, update_count, iterations, counts)

    def checked(self, dim: int, num_slots: int) -> TableState:
        """This state with dtypes and shapes checked for a table of `dim` and `num_slots`."""
        n = np.shape(self.keys)[0] if np.ndim(self.keys) == 1 else -1
        return TableState(
            check_keys(self.keys),
            check_rows(self.values, "values", n, dim),
            check_rows(self.slots, "slots", n, num_slots * dim),
            np.ascontiguousarray(self.last_step, np.uint32),
            np.ascontiguousarray(self.update_count, np.uint32),
            int(self.iterations),
            None if self.counts is None else np.ascontiguousarray(self.counts, np.uint8),
        )


def sum_counts(parts: list[np.ndarray | None]) -> np.ndarray | None:
    """The saturating (at 255) sum of admission counters; None if no part has any."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    total = np.sum([p.astype(np.uint16) for p in present], axis=0)
    return np.minimum(total, 255).astype(np.uint8)


def check_keys(keys: Any, name: str = "keys") -> np.ndarray:
    """`keys` as a contiguous int64 `(n,)` array; ValueError naming the problem otherwise."""
    arr = np.asarray(keys)
    if arr.size == 0 and arr.ndim == 1:  # [] is float64 to NumPy
        return np.zeros(0, np.int64)
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"`{name}` must be an integer array (int64). Received dtype={arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"`{name}` must be 1-D, shape (n,). Received shape={arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def check_rows(rows: Any, name: str, n: int, width: int) -> np.ndarray:
    """`rows` as a contiguous float32 `(n, width)` array; ValueError otherwise."""
    arr = np.asarray(rows)
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"`{name}` must be a float array (float32). Received dtype={arr.dtype}")
    if arr.shape != (n, width):
        raise ValueError(
            f"`{name}` must have shape (n, {width}) = {(n, width)} to match the keys and the "
            f"table's width. Received shape={arr.shape}"
        )
    return np.ascontiguousarray(arr, dtype=np.float32)


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_finite_gradients(name: str, keys: np.ndarray, grads: np.ndarray, policy: str) -> bool:
    """Whether a push may be applied: its gradients, and their sums per key, are all finite.

    What every table runs before applying a push, for callers that must check
    the tables of a multi-table push before applying any of them. A push sums
    the gradients of equal keys in float32, in order, so finite gradients can
    still sum to ±Inf; those sums are checked too (cheaply: only when the
    largest gradient times the number of rows could overflow). Thread-safe;
    reads its arguments only.

    Args:
        name: str, the table's name (for the message).
        keys: int64 `(n,)`, the pushed keys.
        grads: float `(n, dim)`, their gradients (host memory).
        policy: "raise" or "skip", the table's `nonfinite`.

    Returns:
        True: apply the push. False: policy "skip" and something is not
        finite; apply nothing.

    Raises:
        ValueError: policy "raise" and something is not finite (naming the
            table and how many values), or an unknown policy.
    """
    check_nonfinite_policy(policy)
    g = np.asarray(grads)
    if g.size == 0:
        return True
    # Two reductions, no temporary array; NaN propagates through both.
    largest = max(float(g.max()), -float(g.min()))
    if math.isfinite(largest):
        # |every partial sum of k terms| <= k * largest * (1 + 2^-24)^k (float32 rounding).
        rows = g.shape[0]
        if largest * rows * math.exp(min(rows * 2.0**-24, 700.0)) < _FLOAT32_MAX:
            return True
        overflowing, distinct = _overflowing_sums(keys, g)
        if not overflowing:
            return True
        problem = (
            f"the gradients of {overflowing} of {distinct} keys sum to values beyond "
            "float32's range (Inf)"
        )
    else:
        bad = g.size - int(np.count_nonzero(np.isfinite(g)))
        problem = f"{bad} of {g.size} gradient values are not finite (NaN or Inf)"
    if policy == "skip":
        return False
    raise ValueError(nonfinite_message(name, problem))


def nonfinite_message(name: str, problem: str) -> str:
    """The error of a push refused for gradients that are not finite (`problem` says how)."""
    return (
        f"Table {name!r}: {problem}; nothing was applied. Pass nonfinite='skip' to skip "
        "such pushes."
    )


def _overflowing_sums(keys: np.ndarray, grads: np.ndarray) -> tuple[int, int]:
    """(keys whose float32 sum of gradients is not finite, distinct keys); summed in order,
    as a push sums them."""
    unique, inverse = np.unique(np.asarray(keys), return_inverse=True)
    sums = np.zeros((len(unique), grads.shape[1]), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        np.add.at(sums, inverse.reshape(-1), grads.astype(np.float32, copy=False))
    return int(np.count_nonzero(~np.isfinite(sums).all(axis=1))), len(unique)


class _Placed(type):
    """Calling the interface, `Table(...)`, asks the placement for an implementation.

    `elastic_emb.tables.registry` registers itself here when imported (the
    package imports it first), so this module needs none of the implementations.
    """

    create: ClassVar[Callable[..., Any] | None] = None

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is not Table:
            return super().__call__(*args, **kwargs)
        if _Placed.create is None:  # pragma: no cover - the package registers it
            raise TypeError("Table is an interface; create tables with elastic_emb.Table(...)")
        return _Placed.create(*args, **kwargs)


class Table(metaclass=_Placed):
    """An embedding table: int64 keys to rows of `dim` float32 values.

    Rows are created on first training use with a deterministic initial value
    (a pure function of `seed` and the key) and trained by `optimizer`, which
    runs where the rows are. Every implementation is thread-safe.

    `Table(...)` creates the table where `elastic_emb.placement` puts it: in
    this process on the CPU (default), on the GPU with `device="gpu"`, or on
    parameter-server shards after `ee.init(ps=...)`.

    Example:
        >>> t = Table(dim=4, optimizer=optimizers.SGD(0.1), initializer="zeros", name="t")
        >>> rows = t.pull(np.array([3, 7]), train=True)   # float32 (2, 4)
        >>> t.push(np.array([3, 7]), np.ones((2, 4), np.float32))
        >>> len(t)
        2

    Args:
        dim: int, width of a row.
        optimizer: `elastic_emb.tables.policies.optimizers.*`, `keras.optimizers.*` (converted)
            or a name. Defaults to `Adagrad(learning_rate=0.05)`.
        initializer: Keras initializer name or object (zeros, ones, constant,
            uniform, normal, truncated_normal).
        name: str; checkpoints match tables by name. A new table with the name
            of a live one takes the name over (see `elastic_emb.tables.registry`).
        seed: int, initialization seed. Defaults to a hash of `name`.
        device: "cpu" (default) or "gpu": where rows and optimizer slots live
            (a GPU table needs a CUDA build; see `elastic_emb.tables.gpu`).
        nonfinite: "raise" (default) or "skip": what a push whose gradients
            hold NaN or ±Inf does. "raise": `ValueError`, nothing applied.
            "skip": nothing applied, counted in `nonfinite_pushes`. Either
            way the table is unchanged (rows, slots, metadata, `iterations`).
        row_dtype: "float32" (default), "float16" or "bfloat16": how the
            rows' values are stored. 16-bit rows are updated in float32 and
            rounded to nearest even; their optimizer slots are stored as
            bfloat16 (FTRL's stay float32). See `docs/storage.md`.
        admission: None (default: every id gets a row) or an
            `ee.admission` policy, e.g. `Frequency(min_count=2)`.
        eviction: None (default: rows stay) or an `ee.eviction` policy:
            `TTL(steps=...)`, `LRU(max_rows=...)`, `LFU(max_rows=...)`.
            Both run where the rows are (see `docs/storage.md`); GPU tables
            have neither yet.
        storage: None (default: all rows in RAM) or
            `ee.storage.Tiered(ram_rows=..., path=...)`: the hottest rows
            in RAM, the rest on local disk (not with `eviction`).

    Raises:
        ValueError: on an invalid argument.
    """

    device: str
    _config: TableConfig  # set by each implementation's constructor
    # The cluster whose shards hold the rows (a remote table's), or None: in this process.
    cluster: Any = None

    if TYPE_CHECKING:  # the public constructor, as `_Placed` routes it to the placement

        def __init__(
            self,
            dim: int,
            optimizer: Any = None,
            initializer: Any = "uniform",
            name: str = "table",
            seed: int | None = None,
            device: str = "cpu",
            nonfinite: str = "raise",
            admission: Any = None,
            eviction: Any = None,
            row_dtype: str = "float32",
            storage: Any = None,
        ) -> None: ...

    @property
    def name(self) -> str:
        return self._config.name

    @property
    def dim(self) -> int:
        return self._config.dim

    @property
    def optimizer(self) -> optimizers.Optimizer:
        return self._config.optimizer

    @property
    def initializer(self) -> initializers.InitializerSpec:
        return self._config.initializer

    @property
    def seed(self) -> int:
        return self._config.seed

    @property
    def nonfinite(self) -> str:
        """What a push with NaN or ±Inf gradients does: "raise" or "skip"."""
        return self._config.nonfinite

    @property
    def row_dtype(self) -> str:
        """How the rows' values are stored: "float32", "float16" or "bfloat16"."""
        return self._config.row_dtype

    @property
    def storage(self) -> storage_module.Tiered | None:
        """Where the rows live (`elastic_emb.tables.policies.storage`); None: all in RAM."""
        return self._config.storage

    @property
    def admission(self) -> admission_module.Frequency | None:
        """Which ids get a row (`elastic_emb.tables.policies.admission`); None: every id."""
        return self._config.admission

    @property
    def eviction(self) -> eviction_module.TTL | eviction_module.LRU | eviction_module.LFU | None:
        """Which rows the table lets go (`elastic_emb.tables.policies.eviction`); None: none."""
        return self._config.eviction

    def policy_counts(self) -> dict[str, int]:
        """What admission and eviction did so far: `evicted_rows`, `evicted_bytes`,
        `admitted_keys` (ids that got a row at a push) and `rejected_updates`
        (pushes of an id dropped by admission, one per id and push)."""
        return dict.fromkeys(POLICY_COUNTS, 0)

    @property
    def nonfinite_pushes(self) -> int:
        """Pushes this process skipped because their gradients were not finite ("skip").

        Tables that apply pushes in this process count them; this default, 0,
        is what a table whose pushes are checked elsewhere (a remote table's
        shards) reports.
        """
        return 0

    def config(self) -> dict[str, Any]:
        """What is needed to re-create an empty table like this one (JSON-ready)."""
        return self._config.to_dict()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Table:
        """A new empty table from `config()` output, placed like `Table(...)`."""
        c = TableConfig.from_dict(config)
        return Table(c.dim, c.optimizer, c.initializer, c.name, c.seed, **c.policies())

    @property
    def iterations(self) -> int:
        """Number of pushes applied so far (the optimizer's step count)."""
        raise NotImplementedError

    @property
    def num_slots(self) -> int:
        """Optimizer slot vectors stored per row."""
        raise NotImplementedError

    def pull(self, keys: Any, train: bool = True) -> Any:
        """Gathers rows: int64 `(n,)` -> float32 `(n, dim)`.

        With `train=False`, unseen keys are not inserted; they get their
        initial value.
        """
        raise NotImplementedError

    def push(self, keys: Any, grads: Any) -> None:
        """Applies one optimizer step: gradients of equal keys are summed first.

        A push whose gradients (or their sums) are not all finite changes
        nothing: it raises `ValueError` or, with `nonfinite="skip"`, is skipped
        and counted (see `check_finite_gradients`).

        Args:
            keys: int64 `(n,)`.
            grads: float32 `(n, dim)`.
        """
        raise NotImplementedError

    def import_rows(self, keys: Any, values: Any) -> None:
        """Sets the values of rows (inserting them); their optimizer slots are reset."""
        raise NotImplementedError

    def export_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """All rows: (int64 `(m,)` keys, float32 `(m, dim)` values), in no set order."""
        state = self.export_state()
        return state.keys, state.values

    def erase(self, keys: Any) -> int:
        """Removes rows; returns how many existed."""
        raise NotImplementedError

    def metadata(self, keys: Any) -> tuple[np.ndarray, np.ndarray]:
        """(last-updated step, update count) per key, int64; -1 for absent keys."""
        raise NotImplementedError

    def memory_bytes(self) -> int:
        """Bytes held by the index and the rows."""
        raise NotImplementedError

    def memory_in_use(self) -> int:
        """`memory_bytes` less the rows freed for reuse (erased, evicted, moved away): what
        the live rows take. (The memory held never shrinks; new rows reuse freed ones.)"""
        return self.memory_bytes()

    def __len__(self) -> int:
        raise NotImplementedError

    def export_state(self) -> TableState:
        """Every row with optimizer slots and metadata, plus the step count (one snapshot)."""
        raise NotImplementedError

    def load_state(self, state: TableState) -> None:
        """Replaces the whole content of the table with `state`."""
        raise NotImplementedError

    def step_fusion(self) -> StepFusion:
        """How the layers reach this table during a training step (see `StepFusion`)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, dim={self.dim}, rows={len(self)}, "
            f"optimizer={type(self.optimizer).__name__})"
        )


class StepFusion(abc.ABC):
    """A table's side of the layers' lookup: rows in input order, gradients per id.

    `ee.Embedding` has one lookup path for every kind of table. A layer hands
    over its ids as they come (duplicates included) and gets one row per id,
    in input order; its gradient, one row per id, comes back through
    `push_gradient`, which sums the rows of equal ids (`_core.sum_by_key`,
    bit for bit what `tf.unique` and `tf.math.unsorted_segment_sum` give)
    before the table applies them. No per-layer TensorFlow op touches the ids.

    An in-process table answers `lookup` at once. A `two_phase` table (remote)
    is reached in two phases instead: each layer `submit`s its ids, then
    `collect`s its rows, and all submissions of a traced step come before any
    collection, so the implementation fetches the rows of all its layers at
    once. Thread-safe.
    """

    two_phase = False

    @abc.abstractmethod
    def lookup(self, keys: np.ndarray, insert: bool, expects_push: bool) -> np.ndarray:
        """The float32 `(n, dim)` rows of int64 `keys` `(n,)`, in their order.

        `insert`: training (unseen ids get rows); `expects_push`: a gradient
        of these ids will be pushed in this step.
        """

    def submit(self, keys: np.ndarray, insert: bool, expects_push: bool) -> int:
        """`two_phase` tables: announces a layer's ids; returns a ticket for `collect`."""
        raise NotImplementedError(f"{type(self).__name__} is not two-phase: call lookup()")

    def collect(self, ticket: int) -> np.ndarray:
        """`two_phase` tables: the rows of a submission; blocks until they are there."""
        raise NotImplementedError(f"{type(self).__name__} is not two-phase: call lookup()")

    def read_ahead(self, keys: np.ndarray) -> tuple[Any, tuple[str, int, np.ndarray]] | None:
        """`two_phase` tables: (the group that pulls them, what to tell it) to read the rows
        of `keys` ahead of the training step that will look them up (`ee.lookahead`);
        None: nothing to gain. The group gets a `prefetch([what, ...])` per step."""
        return None

    @abc.abstractmethod
    def push_gradient(self, keys: np.ndarray, grads: np.ndarray, step_pushes: int) -> None:
        """A layer's gradient, float32 `(n, dim)` for its ids `(n,)` as looked up: one of
        the `step_pushes` pushes the table gets in this step (one per lookup whose gradient
        the step computes, on every replica of this process). The table applies the step's
        gradients once, summed per id."""
