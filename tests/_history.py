"""A history checker for fault scenarios: what workers saw acknowledged, proved against the
rows the servers hold at the end.

Each push of a recorded worker trains a key of its own (and nothing else) with SGD, learning
rate 1 and gradient 1 from a zero row, so its key's row says exactly how often the servers
applied it: -1 once, 0 never, -2 twice. The checker's verdicts:

- every acknowledged push is in the final rows exactly once;
- every push that failed (its worker saw an error, so it may or may not have been applied)
  is there at most once;
- no other key holds anything.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

import elastic_emb as ee

DIM = 2


def history_table(name: str) -> ee.Table:
    """The table the recorded pushes train: rows start at 0, SGD with learning rate 1."""
    return ee.Table(DIM, optimizer=ee.optimizers.SGD(1.0), initializer="zeros", name=name)


@dataclass
class History:
    """The pushes of one worker: acknowledged (key, time) and failed keys, in order."""

    acknowledged: list[tuple[int, float]] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)


class RecordingWorker:
    """Pushes key 0, 1, 2, ... of `table` (a pull, then a push of gradient 1), recording
    what each push's call said, in a thread, until `stop`."""

    def __init__(self, table: ee.Table, pause: float = 0.01) -> None:
        self.table, self.pause = table, pause
        self.history = History()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="recording worker")
        self._thread.start()

    def _run(self) -> None:
        key = 0
        while not self._stop.is_set():
            keys = np.array([key])
            try:
                self.table.pull(keys)
                self.table.push(keys, np.ones((1, DIM), np.float32))
                self.history.acknowledged.append((key, time.monotonic()))
            except Exception as e:  # the push may or may not have been applied
                self.history.failed.append((key, f"{type(e).__name__}: {e}"))
            key += 1
            time.sleep(self.pause)

    def stop(self, timeout: float = 120.0) -> History:
        self._stop.set()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the recording worker did not stop"
        return self.history


def check(history: History, keys: np.ndarray, values: np.ndarray) -> list[str]:
    """The checker's findings (none: the history holds) for final rows `values` of `keys`."""
    applied = dict(zip(keys.tolist(), (-values[:, 0]).tolist(), strict=True))
    problems = []
    for key, _ in history.acknowledged:
        if applied.get(key, 0.0) != 1.0:
            problems.append(f"acknowledged push of key {key} applied {applied.get(key, 0.0)} times")
    failed = {key for key, _ in history.failed}
    for key in failed:
        if applied.get(key, 0.0) not in (0.0, 1.0):
            problems.append(f"failed push of key {key} applied {applied[key]} times")
    pushed = failed | {key for key, _ in history.acknowledged}
    for key, times in applied.items():
        if key not in pushed and times != 0.0:
            problems.append(f"key {key}, never pushed, holds {times} pushes")
    if not np.all(values[:, :1] == values):
        problems.append("a row's numbers differ: not the pushes' exact sums")
    return problems
