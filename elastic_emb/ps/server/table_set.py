"""`TableSet`: one shard's tables (in-process `LocalTable`s) by name: created from configs or
checked against the existing ones, looked up, swapped whole for a snapshot's; and the table
side of a step: a worker's push checked before any table applies it (`CheckedPush`), a sync
step's summed parts applied, rows pulled with their versions (`row_versions`)."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from elastic_emb.ps.server.request_error import RequestError, invalid
from elastic_emb.tables.local import LocalTable, push_parsed
from elastic_emb.tables.table import (
    TableConfig,
    check_finite_gradients,
    check_nonfinite_policy,
    nonfinite_message,
)
from elastic_emb.tables.tiered import make_local_table

__all__ = ["CheckedPush", "TableSet", "answer_pull", "row_versions"]

log = logging.getLogger("elastic_emb.server")


class TableSet:
    """A shard's tables by name. Thread-safe.

    `_tables` changes only under `_lock`: `create` adds tables to it,
    `replacing` swaps in another dict. Readers take no lock: they see the
    set before or after a change, and a table they found stays usable. Each
    change is published to the data plane's copy (`publish_to`).
    """

    def __init__(self) -> None:
        self._tables: dict[str, LocalTable] = {}  # changed under _lock; read without
        self._lock = threading.Lock()
        self._native: Any = None  # the `_core.ShardCore` told of each change

    def publish_to(self, native: Any) -> None:
        """Tells `native` (a `_core.ShardCore`) the tables now and after each change: the
        C++ table of each, and its learning rate where it is constant (the plane pushes
        those tables itself)."""
        with self._lock:
            self._native = native
            self._publish()

    def _publish(self) -> None:
        if self._native is not None:
            tables = self._tables.values()
            self._native.set_tables(
                [(t.name, t.core_table(), t.constant_learning_rate()) for t in tables]
            )

    def get(self, name: str) -> LocalTable:
        """The table `name`; refuses (NOT_FOUND) an unknown one."""
        table = self._tables.get(name)
        if table is None:
            raise RequestError(
                "NOT_FOUND", f"Unknown table {name!r}; this shard has {sorted(self._tables)}"
            )
        return table

    def find(self, name: str) -> LocalTable | None:
        return self._tables.get(name)

    def named(self, names: list[str] | None = None) -> list[LocalTable]:
        """The named tables (all, sorted by name, for None)."""
        if not names:
            return [t for _, t in sorted(self._tables.items())]
        return [self.get(n) for n in names]

    def create(self, configs: list[dict[str, Any]]) -> list[LocalTable]:
        """The tables `configs` describe: created, or checked against the existing ones.

        All or nothing: on an error none is created.
        """
        with self._lock:
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
            self._publish()
            return [chosen[c["name"]] for c in configs]

    @contextlib.contextmanager
    def replacing(self, tables: list[LocalTable]) -> Iterator[None]:
        """The set becomes exactly `tables` (those not among them are dropped); the body
        runs under the lock too, so that what changes with the tables changes at once."""
        with self._lock:
            self._tables = {t.name: t for t in tables}
            self._publish()
            yield

    def apply_sync_table(
        self, step: int, name: str, parts: list[tuple[np.ndarray, np.ndarray]]
    ) -> None:
        """Applies table `name`'s parts (in worker order) of sync step `step` in one push,
        for the step clock (`_core.ShardCore`, which pushes the tables it can itself, the
        same way).

        Each part was checked finite (`CheckedPush`); their sum may overflow:
        the table then skips the step (logged), never raises (the step is
        acknowledged to every worker already).
        """
        table = self._tables[name]
        if len(parts) == 1:  # one worker's part, checked finite already
            table.push_checked(*parts[0])
            return
        keys = np.concatenate([k for k, _ in parts])
        grads = np.concatenate([g for _, g in parts])
        if check_finite_gradients(name, keys, grads, "skip"):
            table.push_checked(keys, grads)
        else:
            log.error("step %d of table %r sums to NaN or Inf: skipped", step, name)


class CheckedPush:
    """A worker's push of one step (a `_core.PushMessage`): its tables found and every
    table's gradients decoded and checked finite before any table applies its part
    (INVALID_ARGUMENT, NOT_FOUND otherwise)."""

    def __init__(self, tables: TableSet, message: Any) -> None:
        self._message = message
        self._tables = [tables.get(name) for name in message.names]
        problems = message.decode([t.dim for t in self._tables])
        for table, problem in zip(self._tables, problems, strict=True):
            if problem and check_nonfinite_policy(table.nonfinite) == "raise":
                raise invalid(nonfinite_message(table.name, problem))
        self._finite = [not p for p in problems]

    def apply(self) -> None:
        """ASYNC: every table applies its part now (one C++ call: `push_parsed`)."""
        for table, ok in zip(self._tables, self._finite, strict=True):
            if not ok:
                table.skip_nonfinite()
        chosen = [t if ok else None for t, ok in zip(self._tables, self._finite, strict=True)]
        push_parsed(chosen, self._message)

    def queue(self) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """SYNC: the (table name, keys, gradients) parts to sum into the step.

        A part that is not finite (nonfinite="skip") is counted by its table
        and left out of the step's sum.
        """
        parts = []
        for i, (table, ok) in enumerate(zip(self._tables, self._finite, strict=True)):
            if ok:
                parts.append((table.name, self._message.keys(i), self._message.gradients(i)))
            else:
                table.skip_nonfinite()
        return parts


def answer_pull(tables: list[LocalTable], message: Any) -> bytes:
    """The PullResponse's bytes answering a parsed Pull (`_core.PullMessage`): table i's
    keys from `tables[i]`, with their versions where the worker caches (read before the
    rows: `Shard.pull` says why); gathered in one C++ call without the GIL."""
    sources: list[Any] = []
    cached = message.cached()
    for i, table in enumerate(tables):
        core = table.core_table()
        if core is not None:
            sources.append(core)
            continue
        keys = message.keys(i)
        now = row_versions(table, keys) if cached[i] else None
        sources.append((table.pull(keys, train=message.train), now))
    return bytes(message.answer(sources))


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
