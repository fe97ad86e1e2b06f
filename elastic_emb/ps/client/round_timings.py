"""`RoundTimings`: how many Pull and Push rounds over the shards a worker made, and their
seconds from send to the last shard's answer (`Cluster.timings`)."""

from __future__ import annotations

import threading
from typing import Literal

__all__ = ["RoundTimings"]

# A round's kind -> its keys in the totals: (count, seconds).
_KEYS = {"pull": ("pulls", "pull_seconds"), "push": ("pushes", "push_seconds")}


class RoundTimings:
    """Counts and seconds of a worker's pull and push rounds. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Guarded by _lock: "pulls", "pull_seconds", "pushes", "push_seconds".
        self._totals = dict.fromkeys(("pulls", "pull_seconds", "pushes", "push_seconds"), 0.0)

    def add(self, kind: Literal["pull", "push"], seconds: float) -> None:
        """Counts one round of `kind` that took `seconds`."""
        count, total = _KEYS[kind]
        with self._lock:
            self._totals[count] += 1
            self._totals[total] += seconds

    def totals(self) -> dict[str, float]:
        """A copy of the counts and seconds so far."""
        with self._lock:
            return dict(self._totals)
