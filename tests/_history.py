"""A history checker for fault scenarios: what workers saw acknowledged, proved against the
rows the servers hold at the end.

Each push of a recorded worker trains a key of its own (and nothing else) with SGD, learning
rate 1 and gradient 1 from a zero row, so its key's row says exactly how often the servers
applied it: -1 once, 0 never, -2 twice. The checker's verdicts:

- every acknowledged push is in the final rows exactly once;
- every push that failed (its worker saw an error, so it may or may not have been applied)
  is there at most once;
- no other key holds anything.

And from the servers' audit logs (`check_epochs`, elastic_emb/ps/server/acknowledged.py):
no two primaries of a group acknowledged changes in overlapping epochs.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

import elastic_emb as ee
from elastic_emb.ps.server import acknowledged, audit

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


# (group, epoch) -> server -> its last `Acknowledged` counts there.
Epochs = dict[tuple[int, int], dict[str, dict]]


def acknowledged_epochs(logs: list[os.PathLike[str]]) -> Epochs:
    """What each server's audit log (verified first) says it acknowledged, per epoch."""
    epochs: Epochs = defaultdict(dict)
    for log in logs:
        audit.verify(log)
        with open(log, encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                if record["call"] == acknowledged.RECORD:
                    args = record["args"]
                    epochs[(args["group"], args["epoch"])][record["caller"]] = args
    return dict(epochs)


def check_epochs(epochs: Epochs) -> list[str]:
    """The checker's findings on `acknowledged_epochs` (none: they hold): one primary per
    epoch of a group, and every change acknowledged at an epoch before, in the group's
    sequence of changes, every change acknowledged at a later epoch (the old primary's
    acknowledged changes are all in what the new one took over)."""
    problems = []
    for (group, epoch), servers in sorted(epochs.items()):
        if len(servers) > 1:
            problems.append(f"epoch {epoch} of group {group}: acknowledged by {sorted(servers)}")
    for (group, epoch), servers in sorted(epochs.items()):
        for (later_group, later), later_servers in sorted(epochs.items()):
            if later_group != group or later <= epoch:
                continue
            for server, counts in servers.items():
                for successor, began in later_servers.items():
                    if counts["last_sequence"] >= began["first_sequence"]:
                        problems.append(
                            f"group {group}: {server} acknowledged change "
                            f"{counts['last_sequence']} at epoch {epoch}, {successor} change "
                            f"{began['first_sequence']} at epoch {later}"
                        )
    return problems
