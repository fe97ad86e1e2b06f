"""`TieredTable`: an in-process table with its coldest rows on local disk (LMDB).

`ee.Table(..., storage=ee.storage.Tiered(ram_rows, path))` creates one, in
this process or on each PS shard. The RAM tier is the C++ table with LRU
eviction that keeps what it evicts (`keep_evicted`). After each push the
evicted rows are written to an LMDB database, whole (value, slots,
metadata), by a background thread; the table's next call finishes the
writing first if it is not done. A training pull or a push first moves the
disk rows it needs back to RAM. So every update happens in RAM on the row's exact state, and a
tiered table trains bit for bit like an all-in-RAM one.

`make_local_table(config)` is how every in-process table of a config is
built (placement, PS shards, snapshots).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import re
import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from elastic_emb import _core
from elastic_emb.tables import sharding
from elastic_emb.tables.local import LocalTable, core_options
from elastic_emb.tables.table import Table, TableConfig, TableState, check_keys, check_rows

__all__ = ["DiskRows", "TieredTable", "make_local_table"]

# Virtual address space reserved for a database; LMDB maps it lazily, so it
# costs only the pages written.
MAP_SIZE = 1 << 40


def make_local_table(config: TableConfig) -> LocalTable:
    """The in-process table `config` describes: a `TieredTable` with `storage`, else a
    `LocalTable`."""
    return LocalTable(config) if config.storage is None else TieredTable(config)


def _lmdb() -> Any:
    try:
        import lmdb
    except ImportError as e:
        raise ImportError(
            "ee.storage.Tiered keeps its disk tier in LMDB: install the lmdb package "
            '(pip install ".[disk]" in elastic_emb\'s source tree, or pip install lmdb)'
        ) from e
    return lmdb


_writer_pool: concurrent.futures.ThreadPoolExecutor | None = None
_writer_lock = threading.Lock()


def _writer() -> concurrent.futures.ThreadPoolExecutor:
    """The thread that writes demoted rows to disk, for every tiered table."""
    global _writer_pool
    with _writer_lock:
        if _writer_pool is None:
            _writer_pool = concurrent.futures.ThreadPoolExecutor(1, "ee-disk-tier")
        return _writer_pool


def _close(env: Any, directory: str) -> None:
    env.close()
    shutil.rmtree(directory, ignore_errors=True)


class DiskRows:
    """A table's rows in an LMDB database of its own, in a fresh directory under `root`.

    Keys are int64 big-endian; a record is the row's float32 value and slots
    and its uint32 last step and update count. The directory is removed when
    this object is freed (the disk tier is scratch space). Not synchronized:
    the owner serializes calls.
    """

    def __init__(self, root: str, name: str, dim: int, num_slots: int) -> None:
        lmdb = _lmdb()
        Path(root).mkdir(parents=True, exist_ok=True)
        prefix = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64] + "-"
        self.directory = tempfile.mkdtemp(prefix=prefix, dir=root)
        self._env = lmdb.open(
            self.directory, map_size=MAP_SIZE, sync=False, metasync=False, readahead=False
        )
        self._finalizer = weakref.finalize(self, _close, self._env, self.directory)
        self._record = np.dtype(
            [
                ("values", "<f4", (dim,)),
                ("slots", "<f4", (num_slots * dim,)),
                ("last_step", "<u4"),
                ("update_count", "<u4"),
            ]
        )
        self.count = 0

    def close(self) -> None:
        self._finalizer()

    def size_bytes(self) -> int:
        """Bytes of the database file."""
        info, stat = self._env.info(), self._env.stat()
        return int((info["last_pgno"] + 1) * stat["psize"])

    @staticmethod
    def _keys(keys: np.ndarray) -> list[bytes]:
        raw = np.ascontiguousarray(keys, ">i8").tobytes()
        return [raw[i : i + 8] for i in range(0, len(raw), 8)]

    def _state(self, keys: list[bytes], records: list[bytes]) -> TableState:
        k = np.frombuffer(b"".join(keys), ">i8").astype(np.int64)
        r = np.frombuffer(b"".join(records), self._record)
        return TableState(
            k,
            np.ascontiguousarray(r["values"], np.float32),
            np.ascontiguousarray(r["slots"], np.float32),
            np.ascontiguousarray(r["last_step"], np.uint32),
            np.ascontiguousarray(r["update_count"], np.uint32),
            iterations=0,
        )

    def put(self, state: TableState) -> None:
        """Writes rows (replacing rows of equal keys)."""
        if len(state.keys) == 0:
            return
        records = np.empty(len(state.keys), self._record)
        for field in ("values", "slots", "last_step", "update_count"):
            records[field] = getattr(state, field)
        raw = records.tobytes()
        size = self._record.itemsize
        records_raw = [raw[i : i + size] for i in range(0, len(raw), size)]
        items = zip(self._keys(state.keys), records_raw, strict=True)
        with self._env.begin(write=True) as txn:
            _, added = txn.cursor().putmulti(items)
        self.count += added

    def get(self, keys: np.ndarray, remove: bool = False) -> TableState:
        """The rows of `keys` found on disk (removed from it with `remove`)."""
        if self.count == 0 or len(keys) == 0:
            return self._state([], [])
        with self._env.begin(write=remove) as txn:
            found = txn.cursor().getmulti(self._keys(keys))
            if remove:
                for key, _ in found:
                    txn.delete(key)
        self.count -= len(found) if remove else 0
        return self._state([k for k, _ in found], [bytes(v) for _, v in found])

    def all(self) -> TableState:
        with self._env.begin() as txn:
            found = list(txn.cursor().iternext())
        return self._state([k for k, _ in found], [bytes(v) for _, v in found])

    def erase(self, keys: np.ndarray) -> int:
        """Removes rows; returns how many were on disk."""
        return len(self.get(keys, remove=True).keys)

    def clear(self) -> None:
        with self._env.begin(write=True) as txn:
            txn.drop(self._env.open_db(), delete=False)
        self.count = 0

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, TableState]:
        """(positions in `keys` of the keys on disk, the disk row of each), read in place."""
        found = self.get(np.unique(keys))
        if len(found.keys) == 0:
            return np.zeros(0, np.int64), found
        order = np.argsort(found.keys)
        where = np.minimum(np.searchsorted(found.keys[order], keys), len(order) - 1)
        hit = found.keys[order[where]] == keys
        return np.flatnonzero(hit), found.select(order[where[hit]])


class TieredTable(LocalTable):
    """A `LocalTable` whose rows beyond `storage.ram_rows` live on local disk.

    See `ee.storage.Tiered` for the semantics. Thread-safe: calls that move
    rows between the tiers are serialized.
    """

    def __init__(self, config: TableConfig) -> None:
        tier = config.storage
        if tier is None:
            raise ValueError(f"TieredTable {config.name!r} needs storage=ee.storage.Tiered(...)")
        options = core_options(config)
        # The RAM tier: LRU that hands over what it evicts.
        options.eviction.kind = _core.EvictionKind.lru
        options.eviction.max_rows = tier.ram_rows
        options.eviction.keep_evicted = True
        super().__init__(config, core=_core.Table(options))
        self._tier_lock = threading.RLock()
        self._pending: list[TableState] = []  # demoted, not on disk yet (tier lock)
        self._disk = DiskRows(tier.path, config.name, config.dim, self.num_slots)
        self._ram_hits = 0  # distinct existing rows a training call found in RAM
        self._disk_hits = 0  # ... and on disk

    @property
    def disk_directory(self) -> str:
        """The directory of this table's disk tier (removed when the table is freed)."""
        return self._disk.directory

    tracks_changes = False  # the disk tier does not (incremental checkpoints)

    def tier_counts(self) -> dict[str, int]:
        """`ram_rows`, `disk_rows`, `disk_bytes`, the rows moved to disk so far
        (`demoted_rows`), and the rows training calls found in each tier so far
        (`ram_hits`, `disk_hits`; distinct rows per call)."""
        with self._tiers():
            return {
                "ram_rows": int(self._core.size()),
                "disk_rows": self._disk.count,
                "disk_bytes": self._disk.size_bytes(),
                "demoted_rows": super().policy_counts()["evicted_rows"],
                "ram_hits": self._ram_hits,
                "disk_hits": self._disk_hits,
            }

    def policy_counts(self) -> dict[str, int]:
        counts = super().policy_counts()
        counts["evicted_rows"] = counts["evicted_bytes"] = 0  # moved to disk, not let go
        return counts

    def _promote(self, keys: np.ndarray) -> None:
        """Moves the disk rows of `keys` to RAM (caller holds the tier lock)."""
        distinct = np.unique(keys)
        present = self._core.metadata(distinct)[0] >= 0
        self._ram_hits += int(np.count_nonzero(present))
        if self._disk.count == 0 or present.all():
            return
        found = self._disk.get(distinct[~present], remove=True)
        self._disk_hits += len(found.keys)
        self._core.import_rows(
            found.keys, found.values, found.slots, found.last_step, found.update_count
        )

    @contextlib.contextmanager
    def _tiers(self) -> Iterator[None]:
        """The tier lock, with every demoted row on disk: rows the background writer has
        not written yet are written here first."""
        with self._tier_lock:
            self._write_pending()
            yield

    def _write_pending(self) -> None:
        """Writes the demoted rows not on disk yet (a batch that fails stays pending, and
        the next call raises)."""
        with self._tier_lock:
            while self._pending:
                self._disk.put(self._pending[0])
                self._pending.pop(0)

    def _demote(self) -> None:
        """Hands the rows the RAM tier evicted to the background writer (caller holds the
        tier lock)."""
        keys, values, slots, last_step, update_count = self._core.take_evicted()
        if len(keys):
            self._pending.append(TableState(keys, values, slots, last_step, update_count, 0))
            _writer().submit(self._write_pending)

    def _fit_ram(self) -> None:
        """Evicts (to disk) what exceeds the RAM budget now (caller holds the tier lock)."""
        self._core.evict_now()
        self._demote()

    def pull(self, keys: Any, train: bool = True) -> Any:
        k = check_keys(keys)
        with self._tiers():
            if train:
                self._promote(k)
                return self._core.pull(k, True)
            out = self._core.pull(k, False)
            if self._disk.count:  # evaluation reads disk rows where they are
                absent = np.flatnonzero(self._core.metadata(k)[0] < 0)
                at, rows = self._disk.lookup(k[absent])
                out[absent[at]] = rows.values
            return out

    def _push(
        self,
        keys: np.ndarray,
        grads: Any,
        apply: Any = None,
        host_grads: Any = None,
        finite: bool = False,
    ) -> None:
        with self._tiers():
            self._promote(keys)
            super()._push(keys, grads, apply, host_grads, finite)
            self._demote()

    def core_table(self) -> Any:
        return None  # pulls and pushes move rows between the tiers

    def import_rows(self, keys: Any, values: Any) -> None:
        k = check_keys(keys)
        v = check_rows(values, "values", k.shape[0], self.dim)
        with self._tiers():
            self._disk.erase(k)
            self._core.import_rows(k, v)
            self._fit_ram()

    # Table's (from every tier's state), not LocalTable's (the RAM tier's rows).
    export_rows = Table.export_rows

    def erase(self, keys: Any) -> int:
        k = check_keys(keys)
        with self._tiers():
            return int(self._core.erase(k)) + self._disk.erase(k)

    def metadata(self, keys: Any) -> tuple[np.ndarray, np.ndarray]:
        k = check_keys(keys)
        with self._tiers():
            last_step, update_count = self._core.metadata(k)
            if self._disk.count:
                absent = np.flatnonzero(last_step < 0)
                at, rows = self._disk.lookup(k[absent])
                last_step[absent[at]], update_count[absent[at]] = rows.last_step, rows.update_count
            return last_step, update_count

    def __len__(self) -> int:
        with self._tiers():
            return int(self._core.size()) + self._disk.count

    def export_state(self) -> TableState:
        with self._tiers():
            ram = super().export_state()
            disk = self._disk.all()
            disk.iterations, disk.counts = ram.iterations, None
            return TableState.concatenate([ram, disk])

    def export_slots(self, slots: tuple[int, int]) -> TableState:
        with self._tiers():
            ram = super().export_slots(slots)
            disk = self._disk.all()
            slot = sharding.slot_of(disk.keys)
            disk = disk.select((slot >= slots[0]) & (slot < slots[1]))
            disk.iterations, disk.counts = ram.iterations, None
            return TableState.concatenate([ram, disk])

    def erase_slots(self, slots: tuple[int, int]) -> int:
        with self._tiers():
            disk = self._disk.all().keys
            slot = sharding.slot_of(disk)
            inside = disk[(slot >= slots[0]) & (slot < slots[1])]
            return super().erase_slots(slots) + self._disk.erase(inside)

    def load_state(self, state: TableState) -> None:
        s = state.checked(self.dim, self.num_slots)
        with self._tiers():
            # The most recently updated rows to RAM, as the RAM tier ranks them.
            order = np.lexsort((s.keys, s.last_step))[::-1]
            ram = s.select(order[: self.storage.ram_rows])  # type: ignore[union-attr]
            disk = s.select(order[self.storage.ram_rows :])  # type: ignore[union-attr]
            self._disk.clear()
            super().load_state(ram)
            self._disk.put(disk)

    def add_state(self, state: TableState) -> None:
        with self._tiers():
            self._disk.erase(check_keys(state.keys))
            super().add_state(state)
            self._fit_ram()

    def export_changes(self, all_rows: bool = False) -> tuple[TableState, np.ndarray, int]:
        raise NotImplementedError(
            f"Table {self.name!r} has a disk tier, which does not track changed rows: save it "
            "with incremental=False"
        )
