"""`Shard`: the state one parameter-server shard keeps, and the rules it applies.

Its tables (in-process `LocalTable`s), the training mode the workers joined
with (sync, async or bounded staleness) and which worker pushed which step,
and its own checkpoint files. No gRPC here: `elastic_emb.ps.server.servicer` decodes
requests, calls a `Shard` and encodes the answers. A request the shard
refuses raises `RequestError` before anything changes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from elastic_emb.persistence import checkpoint
from elastic_emb.tables import sharding
from elastic_emb.tables.local import LocalTable
from elastic_emb.tables.table import TableConfig, TableState, check_finite_gradients
from elastic_emb.tables.tiered import make_local_table

__all__ = ["MAX_PUSHES_IN_FLIGHT", "Ranges", "RequestError", "Shard"]

log = logging.getLogger("elastic_emb.server")

# A sync save waits this long for the other workers to push its step.
SAVE_WAIT_SECONDS = 600.0
# A worker's pushes leave in the background: its pull may overtake them.
MAX_PUSHES_IN_FLIGHT = 4
# Training modes (the wire's Mode values).
ASYNC, SYNC = 0, 1
_MODE_NAMES = {ASYNC: "ASYNC", SYNC: "SYNC"}


class RequestError(Exception):
    """A request the shard refuses; `code` names the gRPC status it is answered with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def invalid(message: str) -> RequestError:
    return RequestError("INVALID_ARGUMENT", message)


class _Steps:
    """Training-mode bookkeeping: who pushed which step, what is applied.

    Every field is guarded by `cond` (its lock).
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.mode: int | None = None  # set by the first Join
        self.num_workers = 1
        self.elastic = False  # set by the first Join: workers come and go
        self.live: set[int] = set()  # elastic: the workers that joined and have not left
        self.staleness = -1
        self.pushed: dict[int, int] = {}  # worker -> last step pushed
        self.applying: set[int] = set()  # ASYNC: workers whose push is being applied
        self.applied = 0  # SYNC: steps applied
        self.hold: int | None = None  # SYNC: apply no step after this one (a save)
        # SYNC: step -> worker -> its pushed [(table, keys, grads)], applied
        # in worker order once every worker pushed (the same sums everywhere).
        self.pending: dict[int, dict[int, list[tuple[str, np.ndarray, np.ndarray]]]] = {}
        self.gone: str | None = None  # why this shard serves no more (its range moved away)

    def step(self) -> int:
        if self.mode == SYNC:
            return self.applied
        return max(self.pushed.values(), default=0)

    def wait_for(self, worker: int, step: int, timeout: float) -> None:
        """Blocks a pull for `step` until the mode allows it (caller holds `cond`).

        Always: the worker's own push of step - 1 has arrived (it may still be
        in flight). SYNC: step - 1 is applied. Bounded staleness s: every
        worker has pushed step - 1 - s.
        """
        deadline = time.monotonic() + timeout
        while True:
            if self.gone is not None:
                raise RequestError("ABORTED", self.gone)
            blocked, late, what = self._late(worker, step)
            if not blocked:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                why = (
                    f"workers {late} have not pushed it (stopped or dead?)"
                    if late
                    else f"a checkpoint holds step {self.hold} back"
                )
                raise RequestError(
                    "DEADLINE_EXCEEDED",
                    f"worker {worker} waited {timeout:g} s to pull step {step}: {what}; {why}. "
                    f"Steps pushed: {dict(sorted(self.pushed.items()))}",
                )
            self.cond.wait(left)

    def _late(self, worker: int, step: int) -> tuple[bool, list[int], str]:
        """Whether a pull of `step` by `worker` must wait; the workers it waits for; why.

        SYNC waits until step - 1 is applied, even once every worker pushed
        it (a save may hold it back).
        """
        if self.pushed.get(worker, 0) < step - 1:
            return True, [worker], f"its own push of step {step - 1} has not arrived"
        if self.mode == SYNC:
            needed, what = step - 1, f"step {step - 1} must be applied"
        elif self.mode == ASYNC and self.staleness >= 0:
            needed = step - 1 - self.staleness
            what = f"staleness {self.staleness}: every worker must have pushed step {needed}"
        else:
            return False, [], ""
        if needed <= 0 or (self.mode == SYNC and self.applied >= needed):
            return False, [], ""
        late = [w for w in self.workers() if self.pushed.get(w, 0) < needed]
        return self.mode == SYNC or bool(late), late, what

    def workers(self) -> list[int]:
        """The workers every step waits for."""
        return sorted(self.live) if self.elastic else list(range(self.num_workers))

    def step_complete(self, pushed_by: dict[int, Any]) -> bool:
        if self.elastic:
            return bool(pushed_by) and self.live <= pushed_by.keys()
        return len(pushed_by) >= self.num_workers


class Shard:
    """One shard's tables and step protocol.

    Thread-safe: the servicer calls every method from its request threads.
    `pull` blocks while the mode makes it wait for other workers; the others
    block only for the tables' own work. `_tables` is guarded by
    `_tables_lock` for changes; reads of one entry need no lock (a table,
    once created, stays).
    """

    def __init__(self, slots: tuple[int, int] | None = None) -> None:
        self._tables: dict[str, LocalTable] = {}
        self._tables_lock = threading.Lock()
        self._steps = _Steps()
        # The slots [begin, end) whose keys this shard takes (None: every key).
        self.slots = slots

    def check_keys(self, keys: list[np.ndarray]) -> None:
        """Refuses (OUT_OF_RANGE) keys outside `slots`: the sender split by an older map."""
        if self.slots is None:
            return
        begin, end = self.slots
        for k in keys:
            slot = sharding.slot_of(k)
            if len(k) and (slot.min() < begin or slot.max() >= end):
                raise RequestError(
                    "OUT_OF_RANGE",
                    f"keys outside this range's slots [{begin}, {end}): the range was split "
                    "or moved; read the cluster map again",
                )

    def retire(self, why: str) -> None:
        """This shard's range moved away: waiting and later requests are refused (ABORTED)."""
        with self._steps.cond:
            self._steps.gone = why
            self._steps.cond.notify_all()

    # Tables.

    def table(self, name: str) -> LocalTable:
        table = self._tables.get(name)
        if table is None:
            raise RequestError(
                "NOT_FOUND", f"Unknown table {name!r}; this shard has {sorted(self._tables)}"
            )
        return table

    def has_table(self, name: str) -> bool:
        return name in self._tables

    def tables(self, names: list[str] | None = None) -> list[LocalTable]:
        """The named tables (all, sorted by name, for None)."""
        if not names:
            return [t for _, t in sorted(self._tables.items())]
        return [self.table(n) for n in names]

    def create(self, configs: list[dict[str, Any]]) -> list[LocalTable]:
        """The tables `configs` describe: created, or checked against the existing ones.

        All or nothing: on an error none is created.
        """
        with self._tables_lock:
            chosen: dict[str, LocalTable] = {}
            for config in configs:
                name = config.get("name")
                # (not `or`: an empty table is falsy)
                existing = self._tables.get(name, chosen.get(name))  # type: ignore[arg-type]
                if existing is not None:
                    ours = json.dumps(existing.config(), sort_keys=True)
                    try:  # defaults filled in (a client may omit newer fields)
                        theirs = json.dumps(TableConfig.from_dict(config).to_dict(), sort_keys=True)
                    except (ValueError, KeyError, TypeError):
                        theirs = json.dumps(config, sort_keys=True)
                    if ours != theirs:
                        raise RequestError(
                            "ALREADY_EXISTS",
                            f"Table {name!r} exists with another configuration: {ours} "
                            f"(requested {json.dumps(config, sort_keys=True)})",
                        )
                    chosen[existing.name] = existing
                    continue
                try:
                    table = make_local_table(TableConfig.from_dict(config))
                except (ValueError, KeyError, TypeError) as e:
                    raise invalid(f"Table {name!r}: invalid configuration {config}: {e}") from e
                chosen[table.name] = table
            self._tables.update(chosen)
            return [chosen[c["name"]] for c in configs]

    # Training.

    def join(
        self, worker: int, num_workers: int, mode: int, staleness: int, elastic: bool = False
    ) -> int:
        """Registers a worker; returns the step it continues from.

        Fixed workers (not `elastic`): every worker joins with the same
        (mode, num_workers, staleness), and steps wait for workers
        0..num_workers-1. Elastic: workers join (at the current step) and
        `leave` at any time; they must agree on (mode, staleness), and steps
        wait for the workers that joined and have not left.
        """
        s = self._steps
        if num_workers < 1 or not 0 <= worker < (1 << 30 if elastic else num_workers):
            raise invalid(f"worker {worker} of {num_workers}: need 0 <= worker < num_workers")
        if mode not in _MODE_NAMES:
            raise invalid(f"Unknown mode {mode}")
        wanted = (mode, staleness, elastic) if elastic else (mode, num_workers, staleness, elastic)
        with s.cond:
            ours = (
                (s.mode, s.staleness, s.elastic)
                if elastic
                else (s.mode, s.num_workers, s.staleness, s.elastic)
            )
            if s.mode is not None and ours != wanted:
                what = "(mode, staleness, elastic)" if elastic else "(mode, num_workers, staleness)"
                current = (_MODE_NAMES[s.mode], *ours[1:])
                asked = (_MODE_NAMES[mode], *wanted[1:])
                if not elastic:
                    current, asked = current[:3], asked[:3]
                if s.elastic != elastic:
                    what, current, asked = "elastic", (s.elastic,), (elastic,)
                raise RequestError(
                    "FAILED_PRECONDITION",
                    f"worker {worker} joined with {what} = {asked}; this shard runs {current}",
                )
            s.mode, s.num_workers, s.staleness, s.elastic = mode, num_workers, staleness, elastic
            step = s.applied if s.mode == SYNC else s.pushed.get(worker, 0)
            s.pushed[worker] = max(s.pushed.get(worker, 0), step)
            if elastic:
                s.live.add(worker)
            return step

    def leave(self, worker: int) -> int:
        """An elastic worker leaves: no step waits for it any more. Returns the shard's step."""
        s = self._steps
        with s.cond:
            if not s.elastic:
                raise RequestError(
                    "FAILED_PRECONDITION", "only elastic workers leave (this shard has fixed ones)"
                )
            s.live.discard(worker)
            if s.mode == SYNC:
                self._apply_complete_steps()
            s.cond.notify_all()
            return s.step()

    def _check_worker(self, worker: int, step: int) -> None:
        s = self._steps
        with s.cond:
            gone, elastic, live = s.gone, s.elastic, worker in s.live
            joined, num_workers = s.mode is not None, s.num_workers
        if gone is not None:
            raise RequestError("ABORTED", gone)
        if elastic and not live:
            raise RequestError(
                "FAILED_PRECONDITION",
                f"worker {worker} is not an elastic worker of this shard (it left, or its lease "
                "expired): it must join again",
            )
        if not elastic and joined and not 0 <= worker < num_workers:
            raise invalid(f"worker {worker} is not one of the {num_workers} workers that joined")
        if step < 1:
            raise invalid(f"wrong step {step}: steps start at 1")

    def pull(
        self,
        worker: int,
        step: int,
        train: bool,
        timeout: float,
        keys: list[tuple[str, np.ndarray]],
        versions: list[bool] | None = None,
    ) -> list[tuple[str, np.ndarray, np.ndarray | None]]:
        """(name, rows, versions) per (name, keys), once the mode lets `worker` read `step`.

        The rows' versions (`row_versions`) only for the tables
        `versions` flags (a worker cache), else None. They are read before
        the rows, so a push landing in between makes a version older than
        its row, never newer: a cache holding that row re-fetches it next
        time instead of keeping a stale row under a current version.
        """
        self._check_worker(worker, step)
        self.check_keys([k for _, k in keys])
        s = self._steps
        with s.cond:
            last = s.pushed.get(worker, 0)
            if step > last + 1 + MAX_PUSHES_IN_FLIGHT:
                raise invalid(
                    f"wrong step {step}: worker {worker} has pushed step {last}, "
                    f"so it can pull step {last + 1 + MAX_PUSHES_IN_FLIGHT} at most"
                )
        work = [(self.table(name), k) for name, k in keys]
        with s.cond:
            s.wait_for(worker, step, timeout)
        out: list[tuple[str, np.ndarray, np.ndarray | None]] = []
        for i, (table, k) in enumerate(work):
            now = row_versions(table, k) if versions is not None and versions[i] else None
            out.append((table.name, table.pull(k, train=train), now))
        return out

    def push(self, worker: int, step: int, gradients: list[tuple[str, Any, Any]]) -> int:
        """Applies (SYNC: queues until every worker pushed) one step; the shard's step."""
        self._check_worker(worker, step)
        self.check_keys([k for _, k, _ in gradients])
        work = [(self.table(name), keys, grads) for name, keys, grads in gradients]
        try:  # every table of the push before any is applied
            finite = [check_finite_gradients(t.name, k, g, t.nonfinite) for t, k, g in work]
        except ValueError as e:
            raise invalid(str(e)) from e
        s = self._steps
        with s.cond:
            last = s.pushed.get(worker, 0)
            if step <= last and worker not in s.applying:
                return s.step()  # sent again after a failover: applied once already
            if step != last + 1 or worker in s.applying:
                raise invalid(
                    f"wrong step {step}: worker {worker} pushed step {last} "
                    f"last, so its next push is step {last + 1}"
                    + (" (once that one is applied)" if worker in s.applying else "")
                )
            if s.mode == SYNC:
                s.pushed[worker] = step
                for (table, keys, grads), ok in zip(work, finite, strict=True):
                    if not ok:  # nonfinite="skip": counted, and left out of the step's sum
                        table.push(keys, grads)
                parts = [(t.name, k, g) for (t, k, g), ok in zip(work, finite, strict=True) if ok]
                s.pending.setdefault(step, {})[worker] = parts
                self._apply_complete_steps()
                return s.applied
            s.applying.add(worker)
        # ASYNC: applied at once, outside the lock. The step counts as pushed
        # once applied, so the worker's next pull reads its own update.
        try:
            for table, keys, grads in work:
                table.push(keys, grads)
        finally:
            with s.cond:
                s.applying.discard(worker)
                s.pushed[worker] = step
                s.cond.notify_all()
        with s.cond:
            return s.step()

    def _apply_complete_steps(self) -> None:
        """SYNC: applies, in order, every step all workers have pushed (caller holds `cond`)."""
        s = self._steps
        while s.hold is None or s.applied < s.hold:
            entry = s.pending.get(s.applied + 1)
            if entry is None or not s.step_complete(entry):
                return
            del s.pending[s.applied + 1]
            parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
            for worker in sorted(entry):
                for name, keys, grads in entry[worker]:
                    parts.setdefault(name, []).append((keys, grads))
            for name, table_parts in sorted(parts.items()):
                table = self._tables[name]
                if len(table_parts) == 1:  # one worker's part, checked finite in `push`
                    table._push(*table_parts[0], finite=True)
                    continue
                keys = np.concatenate([k for k, _ in table_parts])
                grads = np.concatenate([g for _, g in table_parts])
                # Each worker's part was finite; their sum may overflow: skip, never raise
                # (the step is acknowledged to every worker already).
                if check_finite_gradients(name, keys, grads, "skip"):
                    table._push(keys, grads, finite=True)
                else:
                    log.error(
                        "step %d of table %r sums to NaN or Inf: skipped", s.applied + 1, name
                    )
            s.applied += 1
            s.cond.notify_all()

    def worker_steps(self) -> dict[int, int]:
        """The last step each worker that joined pushed."""
        s = self._steps
        with s.cond:
            return {} if s.mode is None else {w: s.pushed.get(w, 0) for w in s.workers()}

    def mode_name(self) -> str | None:
        """ "sync" or "async" once a worker joined, else None."""
        with self._steps.cond:
            mode = self._steps.mode
        return None if mode is None else _MODE_NAMES[mode].lower()

    def step(self) -> int:
        """Steps applied (SYNC) or the furthest step pushed (ASYNC)."""
        with self._steps.cond:
            return self._steps.step()

    # Replicas (`elastic_emb.ps.server.replication`): a joining backup gets the primary's state.

    def export_steps(self) -> tuple[dict[str, Any], list[tuple[int, int, list[Any]]]]:
        """The step state (JSON-ready) and the pushes of sync steps not applied yet.

        The caller makes sure no push is being applied (the replication order lock).
        """
        s = self._steps
        with s.cond:
            state = {
                "mode": s.mode,
                "num_workers": s.num_workers,
                "elastic": s.elastic,
                "live": sorted(s.live),
                "staleness": s.staleness,
                "pushed": {str(w): step for w, step in s.pushed.items()},
                "applied": s.applied,
            }
            pending = [
                (worker, step, parts)
                for step, workers in sorted(s.pending.items())
                for worker, parts in sorted(workers.items())
            ]
        return state, pending

    def install(
        self,
        tables: list[LocalTable],
        state: dict[str, Any],
        pending: list[tuple[int, int, list[Any]]],
    ) -> None:
        """Replaces every table and the step state (a snapshot of another replica)."""
        s = self._steps
        with self._tables_lock, s.cond:
            self._tables = {t.name: t for t in tables}
            s.mode, s.num_workers = state["mode"], state["num_workers"]
            s.elastic, s.live = state["elastic"], set(state["live"])
            s.staleness, s.applied = state["staleness"], state["applied"]
            s.pushed = {int(w): step for w, step in state["pushed"].items()}
            s.pending = {}
            for worker, step, parts in pending:
                s.pending.setdefault(step, {})[worker] = parts
            s.applying = set()
            s.cond.notify_all()

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
        assert self.slots is not None and self.slots[0] < at < self.slots[1]
        begin, end = self.slots
        kept = _slot_filter((begin, at))
        s = self._steps
        with s.cond:
            self.slots = (begin, at)
            for table in self.tables():
                table.erase_slots((at, end))
            for workers in s.pending.values():
                for worker, parts in workers.items():
                    workers[worker] = [(n, k[kept(k)], g[kept(k)]) for n, k, g in parts]

    def check_slots(self, slots: tuple[int, int]) -> None:
        """Refuses (OUT_OF_RANGE) a request made for other slots than this range's now."""
        if self.slots is not None and slots != (0, 0) and slots != self.slots:
            raise RequestError(
                "OUT_OF_RANGE",
                f"this range holds slots {list(self.slots)}, not {list(slots)}: it was split",
            )

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
        s = self._steps
        with s.cond:
            held = hold and bool(after_step) and s.mode == SYNC
            if held:
                if s.applied > after_step or s.hold is not None:
                    raise RequestError(
                        "FAILED_PRECONDITION",
                        f"cannot hold at step {after_step}: step {s.applied} is applied"
                        + (f" and another save holds step {s.hold}" if s.hold is not None else ""),
                    )
                s.hold = after_step
        try:
            return self._save_at(directory, chosen, incremental, max_deltas, after_step, timeout)
        finally:
            if held:
                with s.cond:
                    s.hold = None
                    self._apply_complete_steps()
                    s.cond.notify_all()

    def _save_at(
        self,
        directory: str,
        chosen: list[LocalTable],
        incremental: bool,
        max_deltas: int,
        after_step: int,
        timeout: float,
    ) -> tuple[int, int, dict[int, int]]:
        s = self._steps
        with s.cond:
            if after_step and s.mode == SYNC:
                deadline = time.monotonic() + timeout
                while s.applied < after_step:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        late = [w for w in s.workers() if s.pushed.get(w, 0) < after_step]
                        raise RequestError(
                            "DEADLINE_EXCEEDED",
                            f"waited {timeout:g} s to save after step {after_step}: workers "
                            f"{late} have not pushed it (stopped or dead?)",
                        )
                    s.cond.wait(left)
            step, worker_steps = s.step(), dict(s.pushed)
        try:
            checkpoint.save(directory, chosen, incremental=incremental, max_deltas=max_deltas)
        except OSError as e:  # the directory, not the shard: the caller can act on it
            raise RequestError("FAILED_PRECONDITION", f"cannot write {directory}: {e}") from e
        except checkpoint.CheckpointError as e:
            raise RequestError("FAILED_PRECONDITION", str(e)) from e
        return sum(len(t) for t in chosen), step, worker_steps

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
        if not directories:
            raise invalid("Restore needs at least one checkpoint directory")
        if slots is not None and not 0 <= slots[0] < slots[1] <= sharding.NUM_SLOTS:
            raise invalid(f"slot range {slots} is not within [0, {sharding.NUM_SLOTS})")
        if slots is None and (num_shards < 1 or not 0 <= shard_index < num_shards):
            raise invalid(
                f"shard {shard_index} of {num_shards}: need 0 <= shard_index < num_shards"
            )
        num_slots = num_slots or sharding.NUM_SLOTS
        try:
            configs, states = checkpoint.read_shards([Path(d) for d in directories], names or None)
            for name in states:
                table = self._tables.get(name)
                if table is not None:
                    checkpoint.check_fits(table, configs[name], directories[0])
        except (checkpoint.CheckpointError, OSError) as e:
            raise RequestError("FAILED_PRECONDITION", str(e)) from e
        plan: list[tuple[str, TableState]] = []
        for name, state in states.items():
            if slots is None:
                mine = sharding.shard_of(state.keys, num_shards, num_slots) == shard_index
            else:
                slot = sharding.slot_of(state.keys)
                mine = (slot >= slots[0]) & (slot < slots[1])
            plan.append((name, state.select(mine)))
        restored = []
        for name, state in plan:
            table = self._tables.get(name)
            if table is None:
                table = self.create([checkpoint.table_config(name, configs[name])])[0]
            table.load_state(state)
            restored.append(table)
        return restored


def row_versions(table: LocalTable, keys: np.ndarray) -> np.ndarray:
    """The versions of `keys`' rows in `table`, uint32: the step of the row's last push
    (`Table.metadata`), 0 for rows never pushed or absent (a version that never matches).

    A row's value changes only by a push, which gives it the table's new step
    (one per push), or by `import_rows`, which sets its update count to 0,
    and so its version; after an eviction a new row's first push gives it a
    later step. So equal versions mean equal values (a restore is the
    exception: a worker clears its cache when it restores).
    """
    last_step, update_count = table.metadata(keys)
    return np.where(update_count > 0, last_step, 0).astype(np.uint32)


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
    move to another group whole.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shards: dict[int, Shard] = {0: Shard()}  # guarded by _lock

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

    def pop(self, range_id: int) -> Shard | None:
        with self._lock:
            return self._shards.pop(range_id, None)

    def replace(self, shards: dict[int, Shard]) -> None:
        with self._lock:
            self._shards = dict(shards)
