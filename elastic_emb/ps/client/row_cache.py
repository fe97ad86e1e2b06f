"""`RowCache`: a worker's cache of the rows it pulls from the shards (`ee.init(cache_rows=...)`).

Each cached row keeps its version (the step of its last push,
`shard.row_versions`) and the step it was last fetched or confirmed at.
A pull then:

- serves a cached row itself while it is at most `staleness` steps old
  (never with `staleness=0`);
- asks the shards for every other key, sending the versions of the rows
  it holds; a shard answers a row whose version is unchanged with one bit
  instead of its values, and the cached values are used. With
  `staleness=0` every row is checked, so pulls return exactly what they
  would without a cache, in fewer bytes.

Pushes are not affected: they go to the shards.

At most `capacity` rows are cached once a pull is answered: beyond, the
least valuable go, down to `capacity - capacity // 8`, fewest pulls first,
then the oldest, the current pull's rows last. Pulls are
counted for every key, cached or not, in a fixed array of counters indexed
by a hash of the key (4 per cached row; collisions only raise a count), and
halved after every `8 * capacity` pulled keys, so old popularity fades.
Thread-safe.
"""

from __future__ import annotations

import threading
import zlib
from typing import Any

import numpy as np

__all__ = ["RowCache"]


class _Rows:
    """One table's cached rows, sorted by key."""

    def __init__(self, dim: int) -> None:
        self.keys = np.zeros(0, np.int64)
        self.values = np.zeros((0, dim), np.float32)
        self.versions = np.zeros(0, np.uint32)
        self.fetched = np.zeros(0, np.int64)  # step fetched or confirmed unchanged at

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(position of each key among the cached ones, whether it is cached); the
        positions of keys not cached are any valid position (or 0 in an empty cache)."""
        if len(self.keys) == 0:
            return np.zeros(len(keys), np.int64), np.zeros(len(keys), bool)
        at = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        return at, self.keys[at] == keys

    def gather(self, field: str, at: np.ndarray) -> np.ndarray:
        """`field` at positions `at` (zeros for an empty cache)."""
        arr = getattr(self, field)
        if len(arr) == 0:
            return np.zeros((len(at), *arr.shape[1:]), arr.dtype)
        return arr[at]

    def keep(self, mask: np.ndarray) -> None:
        for field in ("keys", "values", "versions", "fetched"):
            setattr(self, field, getattr(self, field)[mask])


class RowCache:
    """Rows pulled from the shards, with their versions (see the module docstring).

    Args:
        capacity: int > 0, rows cached over all tables.
        staleness: int >= 0, steps a cached row may be served without asking.
    """

    def __init__(self, capacity: int, staleness: int) -> None:
        self.capacity = capacity
        self.staleness = staleness
        self._lock = threading.Lock()
        self._tables: dict[str, _Rows] = {}
        self._since_aging = 0
        self._pulls = np.zeros(max(1024, 4 * capacity), np.uint32)  # by hash of (table, key)
        self._salts: dict[str, int] = {}
        # Keys of pulls: served here without asking; confirmed by a shard
        # (values not sent); fetched with their values.
        self.served = self.confirmed = self.fetched = 0

    def __len__(self) -> int:
        with self._lock:
            return sum(len(t.keys) for t in self._tables.values())

    def clear(self) -> None:
        """Forgets every row (after a restore: versions may repeat)."""
        with self._lock:
            self._tables.clear()

    def counts(self) -> dict[str, int]:
        """`rows` cached, and keys pulled so far that were `served` from the cache,
        `confirmed` unchanged by a shard, or `fetched` with their values."""
        with self._lock:
            rows = sum(len(t.keys) for t in self._tables.values())
            return {
                "rows": rows,
                "served": self.served,
                "confirmed": self.confirmed,
                "fetched": self.fetched,
            }

    def plan(
        self, name: str, dim: int, keys: np.ndarray, step: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For a pull of distinct `keys` at `step`: (which keys the cache serves, their
        rows; for the other keys, the versions to send (0 where none is cached) and the
        cached rows they stand for). The rows are copies: a concurrent pull may drop
        them from the cache before this one's answer comes."""
        with self._lock:
            rows = self._tables.setdefault(name, _Rows(dim))
            at, cached = rows.find(keys)
            counters, pulls = np.unique(self._counter(name, keys), return_counts=True)
            self._pulls[counters] += pulls.astype(np.uint32)
            self._since_aging += len(keys)
            age = step - rows.gather("fetched", at)
            fresh = cached & (age <= self.staleness) & (self.staleness > 0)
            held = np.where(cached, rows.gather("versions", at), np.uint32(0)).astype(np.uint32)
            values = rows.gather("values", at)
            self.served += int(np.count_nonzero(fresh))
            return fresh, values[fresh], held[~fresh], values[~fresh]

    def answer(
        self,
        name: str,
        keys: np.ndarray,
        fetched: np.ndarray,
        versions: np.ndarray,
        unchanged: np.ndarray,
        held_rows: np.ndarray,
        step: int,
    ) -> np.ndarray:
        """The rows of the `keys` a pull asked for, as the shards answered: `fetched`
        holds the rows of the keys not `unchanged` (the others are the `held_rows` the
        plan gave), `versions` the changed rows' versions (the others are the held
        ones). Caches the rows that have a version. Returns every key's row
        (`fetched`, completed)."""
        with self._lock:
            rows = self._tables[name]
            at, cached = rows.find(keys)
            out = fetched
            out[unchanged] = held_rows[unchanged]
            rows.fetched[at[unchanged & cached]] = step
            self.confirmed += int(np.count_nonzero(unchanged))
            self.fetched += len(keys) - int(np.count_nonzero(unchanged))
            # Changed rows with a version: update the cached ones, add the others.
            update = ~unchanged & (versions != 0)
            again = update & cached
            rows.values[at[again]] = out[again]
            rows.versions[at[again]] = versions[again]
            rows.fetched[at[again]] = step
            gone = cached & ~unchanged & (versions == 0)  # no longer cacheable
            if np.any(gone):
                keep = np.ones(len(rows.keys), bool)
                keep[at[gone]] = False
                rows.keep(keep)
            new = update & ~cached
            if np.any(new):
                self._add(rows, keys[new], out[new], versions[new], step)
            return out

    def _add(
        self, rows: _Rows, keys: np.ndarray, values: np.ndarray, versions: Any, step: int
    ) -> None:
        order = np.argsort(np.concatenate([rows.keys, keys]), kind="stable")
        rows.keys = np.concatenate([rows.keys, keys])[order]
        rows.values = np.concatenate([rows.values, values])[order]
        rows.versions = np.concatenate([rows.versions, versions])[order]
        rows.fetched = np.concatenate([rows.fetched, np.full(len(keys), step)])[order]

    def _counter(self, name: str, keys: np.ndarray) -> np.ndarray:
        """The pull counter of each key of table `name` (a multiplicative hash)."""
        salt = self._salts.setdefault(name, zlib.crc32(name.encode()))
        mixed = (keys.astype(np.uint64) ^ np.uint64(salt)) * np.uint64(0x9E3779B97F4A7C15)
        return ((mixed >> np.uint64(32)) % np.uint64(len(self._pulls))).astype(np.int64)

    def fit(self, step: int) -> None:
        """Drops the least valuable rows beyond `capacity`: once a pull at `step` is
        answered (its rows count as the most valuable)."""
        with self._lock:
            self._fit(step)

    def _fit(self, step: int) -> None:
        """`fit` (caller holds the lock)."""
        if self._since_aging >= 8 * self.capacity:
            self._pulls //= 2
            self._since_aging = 0
        total = sum(len(t.keys) for t in self._tables.values())
        if total <= self.capacity:
            return
        # Down to 7/8 of the capacity: a ranking pass per capacity / 8 new rows.
        keep = self.capacity - self.capacity // 8
        names = list(self._tables)
        sizes = [len(self._tables[n].keys) for n in names]
        pulls = np.concatenate([self._pulls[self._counter(n, self._tables[n].keys)] for n in names])
        fetched = np.concatenate([self._tables[n].fetched for n in names])
        # One number per row, smallest least valuable: this pull's rows last,
        # then by pulls, then by age (steps and pulls stay far below 2^30).
        value = (
            ((fetched >= step).astype(np.int64) << 62)
            | (np.minimum(pulls, (1 << 30) - 1).astype(np.int64) << 31)
            | np.minimum(fetched, (1 << 31) - 1)
        )
        drop = np.zeros(total, bool)
        drop[np.argpartition(value, total - keep - 1)[: total - keep]] = True
        for n, mine in zip(names, np.split(~drop, np.cumsum(sizes)[:-1]), strict=True):
            self._tables[n].keep(mine)
