"""`LocalTable`: an in-process table over the C++ core (the default placement)."""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

import numpy as np

from elastic_emb import _core
from elastic_emb.tables import sharding
from elastic_emb.tables.table import (
    StepFusion,
    Table,
    TableConfig,
    TableState,
    check_finite_gradients,
    check_keys,
    check_rows,
)

__all__ = ["LocalTable", "core_options", "push_parsed"]


def core_options(config: TableConfig, shard_bits: int | None = None) -> _core.TableOptions:
    """The C++ table's options (CPU and GPU tables); C++ checks them when building the table."""
    init = _core.InitializerOptions()
    init.kind = _core.InitKind.__members__[config.initializer.kind]
    init.a = config.initializer.a
    init.b = config.initializer.b
    init.seed = config.seed
    opt = _core.OptimizerOptions()
    opt.kind = _core.OptimizerKind.__members__[config.optimizer.kind]
    for field, value in config.optimizer.core_args().items():
        setattr(opt, field, value)
    options = _core.TableOptions()
    options.dim = config.dim
    options.initializer = init
    options.optimizer = opt
    options.row_dtype = _core.RowDtype.__members__[config.row_dtype]
    if config.admission is not None:
        options.admission.min_count = config.admission.min_count
        options.admission.sketch_bytes = config.admission.sketch_bytes
        options.admission.sketch_depth = config.admission.sketch_depth
    if config.eviction is not None:
        ev = config.eviction
        options.eviction.kind = _core.EvictionKind.__members__[ev.to_dict()["kind"]]
        options.eviction.ttl_steps = getattr(ev, "steps", 0)
        options.eviction.max_rows = getattr(ev, "max_rows", 0)
        options.eviction.protect_steps = ev.protect_steps
    if shard_bits is not None:
        options.shard_bits = shard_bits
    return options


class LocalTable(Table):
    """A table in this process: rows and optimizer slots in the C++ core.

    Created by `ee.Table(...)` with no cluster configured. Every method is
    thread-safe and releases the GIL while the core works; `push` calls are
    serialized (each is one optimizer step). A push with gradients that are
    not finite is refused before it reaches the core (`config.nonfinite`).

    Args:
        config: the table's `TableConfig`.
        core: the C++ table holding the rows; default a CPU `_core.Table`.
    """

    device = "cpu"
    tracks_changes = True  # export_changes works (incremental checkpoints)

    def __init__(self, config: TableConfig, core: Any = None) -> None:
        self._config = config
        self._core = _core.Table(core_options(config)) if core is None else core
        # The step lock orders pushes and guards the counts (`_iterations`,
        # `_nonfinite_pushes`); a C++ table keeps them itself, shared with the data plane.
        self._steps = self._core if isinstance(self._core, _core.Table) else _StepState()
        self._step_lock = _StepLock(self._steps)
        self._fusion = _LocalStep(self)

    @property
    def _iterations(self) -> int:
        return int(self._steps.iterations)

    @_iterations.setter
    def _iterations(self, n: int) -> None:
        self._steps.iterations = n

    @property
    def _nonfinite_pushes(self) -> int:
        return int(self._steps.nonfinite_pushes)

    @_nonfinite_pushes.setter
    def _nonfinite_pushes(self, n: int) -> None:
        self._steps.nonfinite_pushes = n

    def _step_order(self) -> int:
        """The order in which pushes take several tables' step locks (the data plane's too)."""
        return int(self._steps.step_order) if isinstance(self._steps, _core.Table) else id(self)

    @property
    def iterations(self) -> int:
        return self._iterations

    @property
    def nonfinite_pushes(self) -> int:
        """Pushes skipped so far because their gradients were not finite (`nonfinite="skip"`)."""
        return self._nonfinite_pushes

    @property
    def num_slots(self) -> int:
        return int(self._core.num_slots)

    def pull(self, keys: Any, train: bool = True) -> Any:
        return self._core.pull(check_keys(keys), bool(train))

    def push(self, keys: Any, grads: Any) -> None:
        k = check_keys(keys)
        self._push(k, check_rows(grads, "grads", k.shape[0], self.dim))

    def push_checked(self, keys: np.ndarray, grads: np.ndarray) -> None:
        """`push` of int64 `(n,)` keys and float32 `(n, dim)` gradients that the caller
        checked already, finiteness included (`check_finite_gradients`)."""
        self._push(keys, grads, finite=True)

    def _push(
        self,
        keys: np.ndarray,
        grads: Any,
        apply: Any = None,
        host_grads: Any = None,
        finite: bool = False,
    ) -> None:
        """One optimizer step with checked `keys`; `apply(keys, grads, lr, step)` runs it.

        `host_grads`: the gradients as a numpy array when `grads` is not one (a
        device pointer); they must be finite (`check_finite_gradients`), or the
        step raises or is skipped, leaving the table as it was. `finite`: the
        caller checked that already (checked float32 `(n, dim)` gradients).
        """
        host = grads if host_grads is None else host_grads
        if not finite and not check_finite_gradients(self.name, keys, host, self._config.nonfinite):
            self.skip_nonfinite()
            return
        with self._step_lock:
            self._iterations += 1
            step = self._iterations
            lr = self.optimizer.learning_rate_at(step - 1)
            (apply or self._core.push)(keys, grads, lr, step)

    def constant_learning_rate(self) -> float | None:
        """The learning rate of every push, or None when a schedule sets each one."""
        return self.optimizer.constant_learning_rate()

    def core_table(self) -> Any:
        """The C++ table that a parameter server's request path may pull from and push to
        itself (`push_parsed`), or None when this table's pulls and pushes do more than
        call it (a tiered table)."""
        return self._core if isinstance(self._core, _core.Table) else None

    def skip_nonfinite(self) -> None:
        """Counts a push skipped for gradients that are not finite (`nonfinite="skip"`)."""
        with self._step_lock:
            self._nonfinite_pushes += 1

    def import_rows(self, keys: Any, values: Any) -> None:
        k = check_keys(keys)
        self._core.import_rows(k, check_rows(values, "values", k.shape[0], self.dim))

    def export_rows(self) -> tuple[np.ndarray, np.ndarray]:
        keys, values = self._core.export_rows(with_state=False)
        return keys, values

    def erase(self, keys: Any) -> int:
        return int(self._core.erase(check_keys(keys)))

    def metadata(self, keys: Any) -> tuple[np.ndarray, np.ndarray]:
        last_step, update_count = self._core.metadata(check_keys(keys))
        return last_step, update_count

    def memory_bytes(self) -> int:
        return int(self._core.memory_bytes())

    def memory_in_use(self) -> int:
        return int(self._core.memory_in_use())

    def __len__(self) -> int:
        return int(self._core.size())

    def policy_counts(self) -> dict[str, int]:
        counts = getattr(self._core, "policy_counts", None)
        return super().policy_counts() if counts is None else dict(counts())

    def _counts(self) -> np.ndarray | None:
        """The admission sketch's counters (call with the step lock held); None without."""
        return self._core.export_counts() if self._config.admission is not None else None

    def _load_counts(self, state: TableState, add: bool) -> None:
        """Sets the sketch from `state` (or clears it, when replacing with a state without
        counts) and the step pulls count from (call with the step lock held)."""
        if self._config.admission is not None:
            if state.counts is not None:
                self._core.import_counts(state.counts, add)
            elif not add:
                self._core.import_counts(np.zeros(self._core.num_counts, np.uint8), False)
        if hasattr(self._core, "set_clock"):
            self._core.set_clock(self._iterations)

    def _check_counts(self, counts: np.ndarray | None) -> None:
        """ValueError unless `counts` (a state's) fits this table's admission sketch."""
        if counts is None or self._config.admission is None:
            return
        if np.shape(counts) != (self._core.num_counts,):
            raise ValueError(
                f"Table {self.name!r}: the admission counts hold {np.size(counts)} counters, "
                f"this table's sketch {self._core.num_counts} (a different sketch_bytes or "
                "sketch_depth)"
            )

    def export_state(self) -> TableState:
        with self._step_lock:
            keys, values, slots, last_step, update_count = self._core.export_rows()
            return TableState(
                keys, values, slots, last_step, update_count, self._iterations, self._counts()
            )

    def export_slots(self, slots: tuple[int, int]) -> TableState:
        """The state of the rows whose virtual slot (`sharding`) is in [begin, end), with
        the whole admission sketch (the receiver adds it to its own)."""
        with self._step_lock:
            keys, values, slots_, last_step, update_count = self._core.export_slots(
                sharding.NUM_SLOTS, *slots
            )
            return TableState(
                keys, values, slots_, last_step, update_count, self._iterations, self._counts()
            )

    def erase_slots(self, slots: tuple[int, int]) -> int:
        """Erases the rows whose virtual slot is in [begin, end); returns how many."""
        return int(self._core.erase_slots(sharding.NUM_SLOTS, *slots))

    def load_state(self, state: TableState) -> None:
        s = state.checked(self.dim, self.num_slots)
        self._check_counts(s.counts)
        with self._step_lock:
            current, _ = self._core.export_rows(with_state=False)
            self._core.erase(current)
            self._core.import_rows(s.keys, s.values, s.slots, s.last_step, s.update_count)
            self._iterations = s.iterations
            self._load_counts(s, add=False)

    def add_state(self, state: TableState) -> None:
        """Adds rows with their optimizer slots and metadata (the other rows stay), and
        takes the state's step count: a table received in parts."""
        s = state.checked(self.dim, self.num_slots)
        self._check_counts(s.counts)
        with self._step_lock:
            self._core.import_rows(s.keys, s.values, s.slots, s.last_step, s.update_count)
            self._iterations = s.iterations
            self._load_counts(s, add=True)

    def step_fusion(self) -> StepFusion:
        return self._fusion

    def export_changes(self, all_rows: bool = False) -> tuple[TableState, np.ndarray, int]:
        """Closes the table's current change set and opens the next (incremental checkpoints).

        A change set holds the rows inserted, pushed or imported since the
        previous call, and the keys present at the previous call that were
        erased since. The snapshot is consistent (rows and step count) and
        atomic: a change made by another thread meanwhile lands in exactly one
        change set. `ee.save(..., incremental=True)` relies on seeing every
        change set of a table; it notices when another caller took one (by its
        number) and then writes a full base.

        Thread-safe; blocks pulls and pushes while the rows are copied.

        Args:
            all_rows: bool, return every row (and no erased keys) instead of the
                changed ones.

        Returns:
            `(state, erased, number)`: the changed rows with `iterations` (a
            `TableState`), the erased keys (int64 `(e,)`), and the number of
            the change set (how many calls came before; set 0 holds every row).

        Raises:
            NotImplementedError: the table does not track changes (GPU tables).
        """
        export = getattr(self._core, "export_changes", None)
        if export is None:
            raise NotImplementedError(
                f"{type(self).__name__} {self.name!r} does not track changed rows (only CPU "
                "tables do): save it with incremental=False"
            )
        with self._step_lock:
            keys, values, slots, last_step, update_count, erased, number = export(bool(all_rows))
            state = TableState(
                keys, values, slots, last_step, update_count, self._iterations, self._counts()
            )
        return state, erased, int(number)


class _StepState:
    """The step lock and counts of a table whose core keeps none (a tiered table)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.iterations = 0
        self.nonfinite_pushes = 0

    def lock_step(self) -> None:
        self._lock.acquire()

    def unlock_step(self) -> None:
        self._lock.release()


class _StepLock:
    """`with`: holds a table's step lock (`_StepState`, or a `_core.Table`'s own)."""

    def __init__(self, steps: Any) -> None:
        self._steps = steps

    def __enter__(self) -> None:
        self._steps.lock_step()

    def __exit__(self, *exc: object) -> None:
        self._steps.unlock_step()


class _LocalStep(StepFusion):
    """The layers' lookup of an in-process table: one core call per lookup and per push.

    A step can push several times: a layer called twice, and under a
    `tf.distribute` strategy every replica's backward pass. The pushes are
    summed into one, so the table sees one step (one optimizer update per
    key), as a remote table and stock Keras do. That push is checked as a
    whole: if any part of it, or any key's sum, is not finite, none of it is
    applied.
    """

    def __init__(self, table: LocalTable) -> None:
        # A proxy: no reference cycle, so a table is freed as soon as it is unused.
        self._table = weakref.proxy(table)
        self._lock = threading.Lock()  # guards _step_pushes
        self._step_pushes: list[tuple[np.ndarray, np.ndarray]] = []

    def lookup(self, keys: np.ndarray, insert: bool, expects_push: bool) -> np.ndarray:
        return self._table.pull(keys, train=insert)

    def push_gradient(self, keys: np.ndarray, grads: np.ndarray, step_pushes: int) -> None:
        k = check_keys(keys)
        keys, grads = _core.sum_by_key(k, check_rows(grads, "grads", len(k), self._table.dim))
        # sum_by_key's arrays are checked already: straight to the step.
        if step_pushes == 1:
            self._table._push(keys, grads)
            return
        with self._lock:
            self._step_pushes.append((keys, grads))
            if len(self._step_pushes) < step_pushes:
                return
            batch, self._step_pushes = self._step_pushes, []
        self._table._push(
            np.concatenate([k for k, _ in batch]), np.concatenate([g for _, g in batch])
        )


def push_parsed(tables: list[LocalTable | None], message: Any) -> None:
    """Pushes each table of a parsed Push (`_core.PushMessage`, decoded and checked finite)
    its part: `tables[i]` gets part i (None: none). The tables with a `core_table` take
    theirs in one C++ call without the GIL, under all their step locks; the others push
    one by one."""
    direct = []
    for i, table in enumerate(tables):
        if table is not None and table.core_table() is None:
            table.push_checked(message.keys(i), message.gradients(i))
        elif table is not None:
            direct.append((i, table))
    cores: list[Any] = [None] * len(tables)
    rates = [0.0] * len(tables)
    steps = [0] * len(tables)
    with contextlib.ExitStack() as locks:
        for _, table in sorted(direct, key=lambda it: it[1]._step_order()):  # no deadlock
            locks.enter_context(table._step_lock)
        for i, table in direct:
            table._iterations += 1
            steps[i] = table._iterations
            rates[i] = table.optimizer.learning_rate_at(table._iterations - 1)
            cores[i] = table.core_table()
        message.apply(cores, rates, steps)
