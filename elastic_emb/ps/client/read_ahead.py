"""`ReadAhead`: the rows of a worker's next training step, read while the step before it
ends. The input pipeline announces a coming step's keys (`announce`, from `ee.lookahead`);
once the step before it is pushed its rows are pulled on a background thread (without
inserting unseen keys), and the step's own pull takes them if it asks for exactly these
keys. The shards answer such a read when they would answer the step's pull, so the rows
are the same."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Callable

import numpy as np

from elastic_emb.ps.client.fused_pull import Tables

__all__ = ["PendingRead", "ReadAhead"]

log = logging.getLogger("elastic_emb")

# Coming steps' keys (`announce`) kept at most: the input pipeline runs one ahead.
_STEPS_AHEAD = 2


@dataclasses.dataclass(frozen=True)
class PendingRead:
    """The rows of training step `step`'s `tables`, being read."""

    step: int
    tables: Tables
    rows: concurrent.futures.Future[list[np.ndarray]]


class ReadAhead:
    """The keys of coming steps and the next step's rows read ahead. Thread-safe.

    Lock order: a caller holding its step counter's lock (`StepFuser._lock`)
    may call in; this class never calls back into a caller while holding `_lock`.

    Args:
        pull: `FusedPull.pull(tables, insert, step)`.
        enabled: False ignores every `announce` (with `read_from_backups`: backups may lag).
    """

    def __init__(self, pull: Callable[[Tables, bool, int], list[np.ndarray]], enabled: bool):
        # Read-only after construction (the executor is thread-safe).
        self._pull = pull
        self._enabled = enabled
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ee-ahead")
        self._lock = threading.Lock()
        # Guarded by _lock: keys of coming training steps, oldest first.
        self._coming: collections.deque[Tables] = collections.deque(maxlen=_STEPS_AHEAD)
        self._read: PendingRead | None = None  # guarded by _lock: the next step's rows
        self._steps_read = 0  # guarded by _lock: steps whose pull took rows read ahead

    @property
    def steps_read(self) -> int:
        """Training steps whose rows were read ahead and taken."""
        with self._lock:
            return self._steps_read

    def announce(self, tables: Tables) -> None:
        """The distinct keys of a coming training step, as its lookups will submit them."""
        if not self._enabled:
            return
        with self._lock:
            self._coming.append(tables)

    def step_pushed(self, next_step: int) -> None:
        """The step before `next_step` is queued: reads `next_step`'s rows if announced."""
        with self._lock:
            if self._coming:
                coming = self._coming.popleft()
                rows = self._reader.submit(self._pull, coming, False, next_step)
                self._read = PendingRead(next_step, coming, rows)

    def take(self, tables: Tables) -> PendingRead | None:
        """The read under way (forgotten here), or None; drops `tables` from the coming
        steps' keys if they came before their step's predecessor was pushed."""
        with self._lock:
            if self._coming and _same_tables(self._coming[0], tables):
                self._coming.popleft()
            read, self._read = self._read, None
            return read

    def rows(self, read: PendingRead | None, tables: Tables, step: int) -> list[np.ndarray] | None:
        """`read`'s rows if it is of step `step`'s `tables` and succeeded; else None."""
        if read is None or read.step != step or not _same_tables(read.tables, tables):
            return None
        try:
            rows = read.rows.result()
        except Exception as e:  # the step pulls instead (which raises if the cause lasts)
            log.debug("rows read ahead for step %d failed: %s", step, e)
            return None
        with self._lock:
            self._steps_read += 1
        return rows

    def close(self) -> None:
        """Cancels reads not started; does not wait for one under way."""
        self._reader.shutdown(wait=False, cancel_futures=True)


def _same_tables(a: Tables, b: Tables) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] and x[1] == y[1] and np.array_equal(x[2], y[2])
        for x, y in zip(a, b, strict=True)
    )
