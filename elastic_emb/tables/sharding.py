"""Which parameter-server shard owns a key: virtual slots, for resharding.

A key hashes to one of `num_slots` virtual slots; slot ranges are assigned to
shards. The hash is a pure function of the key, so a checkpoint written by
any number of shards can be restored onto any other number: each new shard
keeps the keys whose slots it owns now.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from elastic_emb import _core

__all__ = ["NUM_SLOTS", "RangeLayout", "even_ranges", "shard_of", "slot_of", "split_by_shard"]

NUM_SLOTS = 4096

# MurmurHash3's 64-bit finalizer: independent of the table's own key hash
# (which picks internal shards by its top bits), so every PS shard still
# spreads its keys over all internal shards.
_C1 = np.uint64(0xFF51AFD7ED558CCD)
_C2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


def slot_of(keys: np.ndarray, num_slots: int = NUM_SLOTS) -> np.ndarray:
    """Virtual slot of each int64 key, in [0, num_slots)."""
    h = np.asarray(keys, np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        h = h ^ (h >> _S33)
        h = h * _C1
        h = h ^ (h >> _S33)
        h = h * _C2
        h = h ^ (h >> _S33)
    return (h % np.uint64(num_slots)).astype(np.int64)


def shard_of(keys: np.ndarray, num_shards: int, num_slots: int = NUM_SLOTS) -> np.ndarray:
    """Shard index of each key: shard i owns a contiguous range of slots."""
    return slot_of(keys, num_slots) * num_shards // num_slots


def even_ranges(num_shards: int, num_slots: int = NUM_SLOTS) -> list[tuple[int, int]]:
    """The slots [begin, end) of each of `num_shards` shards, as `shard_of` assigns them."""
    bounds = [-(-i * num_slots // num_shards) for i in range(num_shards + 1)]  # ceil
    return list(itertools.pairwise(bounds))


def split_by_shard(
    keys: np.ndarray, num_shards: int, starts: np.ndarray | None = None
) -> list[np.ndarray]:
    """Positions into `keys` of the keys owned by each shard, each in ascending key order.

    Shard i owns slot range i of `even_ranges(num_shards)`, or, given
    `starts` (ascending, starts[0] == 0), the slots [starts[i],
    starts[i + 1]) (the last one: up to NUM_SLOTS).

    Keys are ordered as unsigned 64-bit numbers, which makes them compact
    on the wire (`wire.encode_keys_compact`); equal keys keep their input
    order. One C++ pass (`_core.split_by_slot_range`, the hash of `slot_of`).
    """
    if starts is None:
        starts = np.array([begin for begin, _ in even_ranges(num_shards)], np.int64)
    order, bounds = _core.split_by_slot_range(
        np.ascontiguousarray(keys, np.int64), np.ascontiguousarray(starts, np.int64), NUM_SLOTS
    )
    return [order[bounds[i] : bounds[i + 1]] for i in range(num_shards)]


@dataclasses.dataclass(frozen=True)
class RangeLayout:
    """Slot ranges in slot order, as a worker splits its requests: shard i is range `ids[i]`.

    Static shards: one range (id 0) each, of `even_ranges`. With a
    coordinator: the cluster map's ranges at map revision `version`.
    """

    ids: tuple[int, ...]
    slots: tuple[tuple[int, int], ...]
    version: int = 0

    @classmethod
    def even(cls, num_shards: int) -> RangeLayout:
        return cls((0,) * num_shards, tuple(even_ranges(num_shards)))

    def starts(self) -> np.ndarray:
        """The first slot of each range, int64."""
        return np.array([begin for begin, _ in self.slots], np.int64)

    def split(self, keys: np.ndarray) -> list[np.ndarray]:
        """Positions into `keys` of each range's keys (`split_by_shard`)."""
        return split_by_shard(keys, len(self.ids), self.starts())
