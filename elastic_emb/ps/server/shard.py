"""`Shard`: the state one parameter-server shard keeps for one slot range, and the rules it
applies, composed of its tables (`TableSet`), its training mode and step protocol
(`StepClock`) and its checkpoint files (`table_files`); and `Ranges`, a server's shards by
range. No gRPC here: `elastic_emb.ps.server.servicer` decodes requests, calls a `Shard` and
encodes the answers. A request the shard refuses raises `RequestError` before anything
changes."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from elastic_emb import _core
from elastic_emb.persistence import checkpoint
from elastic_emb.ps.server.request_error import RequestError, invalid
from elastic_emb.ps.server.step_clock import ASYNC, MAX_PUSHES_IN_FLIGHT, SYNC
from elastic_emb.ps.server.table_files import restore_owned_rows, write_tables
from elastic_emb.ps.server.table_set import CheckedPush, TableSet, answer_pull, row_versions
from elastic_emb.tables import sharding
from elastic_emb.tables.local import LocalTable
from elastic_emb.tables.table import TableState

__all__ = [
    "ASYNC",
    "MAX_PUSHES_IN_FLIGHT",
    "SYNC",
    "Ranges",
    "RequestError",
    "Shard",
    "invalid",
    "row_versions",
]

# A sync save waits this long for the other workers to push its step.
SAVE_WAIT_SECONDS = 600.0


class Shard:
    """One slot range's tables and step protocol.

    Thread-safe: the servicer calls every method from its request threads.
    `pull` blocks while the mode makes it wait for other workers; the others
    block only for the tables' own work. Locks: the tables' (`TableSet`) and
    the step clock's (`step_clock`), taken in that order (`install`); tables
    push a sync step and `shrink` erases rows under the clock's.

    `native` (a `_core.ShardCore`) holds the clock, the slots and the tables as
    the data plane sees them (`elastic_emb.ps.server.data_plane`).
    """

    def __init__(self, slots: tuple[int, int] | None = None) -> None:
        self._tables = TableSet()
        # (weakly: the C++ side holding the tables' method would keep a dropped shard's
        # tables alive, in a cycle Python's collector does not see)
        self.native = _core.ShardCore(_weak_call(self._tables.apply_sync_table))
        self._tables.publish_to(self.native)
        self.native.set_slots(slots, sharding.NUM_SLOTS)
        self._clock = self.native.clock
        # The slots [begin, end) whose keys this shard takes (None: every key). Written
        # under the clock's lock (`shrink`); read without (a tuple, replaced whole).
        self.slots = slots

    def check_keys(self, keys: list[np.ndarray] | Any) -> None:
        """Refuses (OUT_OF_RANGE) keys outside `slots`: the sender split by an older map.

        `keys`: arrays, or a parsed Pull or Push (`_core.PullMessage`, `PushMessage`).
        """
        if self.slots is None:
            return
        begin, end = self.slots
        if isinstance(keys, list):
            slots = [sharding.slot_of(k) for k in keys if len(k)]
            outside = any(s.min() < begin or s.max() >= end for s in slots)
        else:
            outside = keys.keys_outside(sharding.NUM_SLOTS, begin, end)
        if outside:
            raise RequestError(
                "OUT_OF_RANGE",
                f"keys outside this range's slots [{begin}, {end}): the range was split "
                "or moved; read the cluster map again",
            )

    def check_slots(self, slots: tuple[int, int]) -> None:
        """Refuses (OUT_OF_RANGE) a request made for other slots than this range's now."""
        if self.slots is not None and slots != (0, 0) and slots != self.slots:
            raise RequestError(
                "OUT_OF_RANGE",
                f"this range holds slots {list(self.slots)}, not {list(slots)}: it was split",
            )

    def retire(self, why: str) -> None:
        """This shard's range moved away: waiting and later requests are refused (ABORTED)."""
        self._clock.retire(why)

    # Tables.

    def table(self, name: str) -> LocalTable:
        return self._tables.get(name)

    def has_table(self, name: str) -> bool:
        return self._tables.find(name) is not None

    def tables(self, names: list[str] | None = None) -> list[LocalTable]:
        """The named tables (all, sorted by name, for None)."""
        return self._tables.named(names)

    def create(self, configs: list[dict[str, Any]]) -> list[LocalTable]:
        """The tables `configs` describe: created, or checked against the existing ones.

        All or nothing: on an error none is created.
        """
        return self._tables.create(configs)

    # Training.

    def join(
        self,
        worker: int,
        num_workers: int,
        mode: int,
        staleness: int,
        elastic: bool = False,
        again: bool = False,
    ) -> int:
        """Registers a worker; returns the step it continues from (`StepClock.join`)."""
        return self._clock.join(worker, num_workers, mode, staleness, elastic, again)

    def leave(self, worker: int) -> int:
        """An elastic worker leaves: no step waits for it any more. Returns the shard's step."""
        return self._clock.leave(worker)

    def pull(
        self, message: Any, timeout: float, waited: Callable[[float], None] | None = None
    ) -> bytes:
        """The PullResponse's bytes answering a parsed Pull (`_core.PullMessage`), once the
        mode lets its worker read its step.

        The rows' versions go only for the tables the worker caches. They are
        read before the rows, so a push landing in between makes a version
        older than its row, never newer: a cache holding that row re-fetches
        it next time instead of keeping a stale row under a current version.
        """
        worker, step = message.worker, message.step
        self._clock.check_worker(worker, step)
        self.check_keys(message)
        self._clock.check_pull_step(worker, step)
        tables = [self.table(name) for name in message.names]
        slots = self.slots
        seconds = self._clock.wait_to_pull(worker, step, timeout)
        if seconds and waited is not None:
            waited(seconds)
        self.check_keys(message)  # (again: slots may have moved away while it waited)
        answer = answer_pull(tables, message)
        if self.slots != slots and slots is not None and self.slots is not None:
            # They moved while it was answered: the rows it inserted there are not this
            # range's (the move's own erase may have run before they were inserted).
            for table in tables:
                table.erase_slots((self.slots[1], slots[1]))
            self.check_keys(message)
        return answer

    def push(self, message: Any) -> int:
        """Applies (SYNC: queues until every worker pushed) one step of a parsed Push
        (`_core.PushMessage`); the shard's step."""
        self._clock.check_worker(message.worker, message.step)
        self.check_keys(message)
        checked = CheckedPush(self._tables, message)
        return self._clock.push(message.worker, message.step, checked.queue, checked.apply)

    def worker_steps(self) -> dict[int, int]:
        """The last step each worker that joined pushed."""
        return self._clock.worker_steps()

    def mode_name(self) -> str | None:
        """ "sync" or "async" once a worker joined, else None."""
        return self._clock.mode_name()

    def step(self) -> int:
        """Steps applied (SYNC) or the furthest step pushed (ASYNC)."""
        return self._clock.step()

    # Replicas (`elastic_emb.ps.server.replication`): a joining backup gets the primary's state.

    def export_steps(self) -> tuple[dict[str, Any], list[tuple[int, int, list[Any]]]]:
        """The step state (JSON-ready) and the pushes of sync steps not applied yet.

        The caller makes sure no push is being applied (the replication order lock).
        """
        return self._clock.export()

    def install(
        self,
        tables: list[LocalTable],
        state: dict[str, Any],
        pending: list[tuple[int, int, list[Any]]],
    ) -> None:
        """The shard's tables become exactly `tables` (any other is dropped), and its step
        state `state` and `pending` (`export_steps` of another replica or range), at once."""
        with self._tables.replacing(tables):
            self._clock.install(state, pending)

    def export_range(
        self, slots: tuple[int, int]
    ) -> tuple[list[tuple[dict[str, Any], TableState]], dict[str, Any], list[Any]]:
        """The state of this shard's slots [begin, end): each table's config and rows, the
        step state, and the pending sync pushes' parts within those slots.

        With the step state copied, a shard built from it applies a worker's
        step once, like this one: a step this shard saw, it saw too. The
        caller makes sure no change is being applied (the replication order
        lock).
        """
        tables = [(t.config(), t.export_slots(slots)) for t in self.tables()]
        steps, pending = self.export_steps()
        inside = _slot_filter(slots)
        pending = [
            (w, step, [(n, k[inside(k)], g[inside(k)]) for n, k, g in parts])
            for w, step, parts in pending
        ]
        return tables, steps, pending

    def shrink(self, at: int) -> None:
        """Slots [at, end) moved away: their rows and pending sync pushes go, and this
        shard takes keys of [begin, at) only."""
        if self.slots is None or not self.slots[0] < at < self.slots[1]:
            raise RuntimeError(f"cannot shrink slots {self.slots} to end at {at}")
        begin, end = self.slots

        def erase_moved_rows() -> None:
            self.slots = (begin, at)
            self.native.set_slots(self.slots, sharding.NUM_SLOTS)
            for table in self.tables():
                table.erase_slots((at, end))

        self._clock.keep_pending(sharding.NUM_SLOTS, begin, at, erase_moved_rows)

    # Checkpoints.

    def save(
        self,
        directory: str,
        names: list[str],
        incremental: bool = False,
        max_deltas: int = checkpoint.DEFAULT_MAX_DELTAS,
        after_step: int = 0,
        timeout: float = SAVE_WAIT_SECONDS,
        hold: bool = False,
    ) -> tuple[int, int, dict[int, int]]:
        """Writes the named tables (all for none) to `directory`.

        SYNC with `after_step`: once that step is applied (the saving worker
        pushes nothing meanwhile, so no later one is). With `hold` (a save
        not sent by a worker), no later step is applied until the tables are
        written, and a shard past `after_step` already refuses. Returns the
        rows written and where the state stands: the shard's step, and each
        worker's last push applied before the save began (ASYNC: pushes
        applied while the tables are written may be in them too).
        """
        chosen = self.tables(names)
        if max_deltas < 0:
            raise invalid(f"max_deltas must be >= 0, not {max_deltas}")
        held = hold and self._clock.hold_at(after_step)
        try:
            step, worker_steps = self._clock.wait_applied(after_step, timeout)
            rows = write_tables(directory, chosen, incremental, max_deltas)
            return rows, step, worker_steps
        finally:
            if held:
                self._clock.release_hold()

    def restore(
        self,
        directories: list[str],
        names: list[str],
        num_shards: int,
        shard_index: int,
        num_slots: int,
        slots: tuple[int, int] | None = None,
    ) -> list[LocalTable]:
        """Loads the rows this shard owns from checkpoints.

        It owns shard `shard_index` of `num_shards`, or, given `slots`, the
        keys whose slot is in [slots[0], slots[1]). Everything is read and
        verified before any table changes.
        """
        return restore_owned_rows(
            self._tables, directories, names, num_shards, shard_index, num_slots, slots
        )


def _weak_call(method: Callable[..., None]) -> Callable[..., None]:
    """Calls `method` while its object lives (then nothing)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


def _slot_filter(slots: tuple[int, int]) -> Any:
    """keys -> the mask of those whose slot is in [begin, end)."""

    def inside(keys: np.ndarray) -> np.ndarray:
        slot = sharding.slot_of(keys)
        return (slot >= slots[0]) & (slot < slots[1])

    return inside


class Ranges:
    """A server's shards by slot-range id: without a coordinator, one (id 0, every key).

    Thread-safe. With a coordinator a group holds several ranges
    (`elastic_emb.ps.coord.membership`), each its own `Shard`, so that one can
    move to another group whole. `native` (a `_core.ServerCore`) holds the same
    shards for the data plane.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.native = _core.ServerCore()
        self._shards: dict[int, Shard] = {}  # guarded by _lock
        self.put(0, Shard())

    def get(self, range_id: int) -> Shard:
        with self._lock:
            shard = self._shards.get(range_id)
        if shard is None:
            raise RequestError(
                "ABORTED",
                f"slot range {range_id} is not on this server (it moved; read the cluster map "
                "again)",
            )
        return shard

    def find(self, range_id: int) -> Shard | None:
        with self._lock:
            return self._shards.get(range_id)

    def items(self) -> list[tuple[int, Shard]]:
        """(range id, shard), by id."""
        with self._lock:
            return sorted(self._shards.items())

    def shards(self) -> list[Shard]:
        return [shard for _, shard in self.items()]

    def tables(self) -> list[LocalTable]:
        """Every table of every range."""
        return [t for shard in self.shards() for t in shard.tables()]

    def step(self) -> int:
        return max((shard.step() for shard in self.shards()), default=0)

    def put(self, range_id: int, shard: Shard) -> None:
        with self._lock:
            self._shards[range_id] = shard
            self.native.put_range(range_id, shard.native)

    def pop(self, range_id: int) -> Shard | None:
        with self._lock:
            self.native.drop_range(range_id)
            return self._shards.pop(range_id, None)

    def replace(self, shards: dict[int, Shard]) -> None:
        with self._lock:
            for range_id in self._shards:
                self.native.drop_range(range_id)
            for range_id, shard in shards.items():
                self.native.put_range(range_id, shard.native)
            self._shards = dict(shards)
