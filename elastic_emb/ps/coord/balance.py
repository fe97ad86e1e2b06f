"""Load-aware slot balancing: what each slot costs, and the moves that even it out.

Every server with a coordinator counts, per slot, the keys, bytes and CPU
seconds of the pulls and pushes it serves (`LoadMeter`), and publishes the
rates over a sliding window to the coordinator (`<prefix>load/<address>`,
under its lease; `LoadReport`). A slot's load does not depend on which group
serves it, so the load any placement would give each group is a sum over
the map's ranges (`group_loads`).

With `elastic-emb serve --balance-threshold T`, the primary of the most
loaded group watches the ratio of its load to the mean: once it has stayed
above T for `--balance-after` seconds, it plans one move of slots to the
least loaded group (`plan_move`) and runs it as any other move (the
two-phase move of `elastic_emb.ps.server.replication`). A slot is the smallest
thing that moves: one that alone carries more than T times the mean
(`hot_slots`, a few hot keys) cannot be balanced by placement; the map
marks the range holding it as hot, and workers spread that range's
read-only pulls over the group's replicas.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from elastic_emb import _core
from elastic_emb.ps.coord.membership import ClusterMap, Group, Move
from elastic_emb.tables.sharding import NUM_SLOTS

__all__ = [
    "MEASURES",
    "LoadMeter",
    "LoadReport",
    "Policy",
    "Usage",
    "group_loads",
    "hot_slots",
    "plan_memory_move",
    "plan_move",
    "report_key",
    "reports_prefix",
    "slot_loads",
]  # fmt: skip

# What a slot's load is measured in: keys pulled and pushed, bytes received
# and sent, CPU seconds of the threads that served it (all per second).
MEASURES = ("keys", "bytes", "cpu")

# A move must lower the larger of its two groups' loads by this share of the mean.
MIN_GAIN = 0.05


@dataclasses.dataclass(frozen=True)
class Policy:
    """When a cluster moves slots for load (`elastic-emb serve --balance-threshold ...`).

    Args:
        threshold: move once the most loaded group carries more than this
            times the mean load (> 1).
        after: ... for this many seconds in a row.
        measure: what load is: "keys", "bytes" or "cpu" (per second).
    """

    threshold: float
    after: float = 30.0
    measure: str = "keys"

    def __post_init__(self) -> None:
        if not self.threshold > 1:
            raise ValueError(
                f"`threshold` must be greater than 1. Received: threshold={self.threshold}"
            )
        if not self.after >= 0:
            raise ValueError(f"`after` must be >= 0 seconds. Received: after={self.after}")
        if self.measure not in MEASURES:
            raise ValueError(
                f"`measure` must be one of {MEASURES}. Received: measure={self.measure!r}"
            )


def reports_prefix(prefix: str) -> str:
    return f"{prefix}load/"


def report_key(prefix: str, address: str) -> str:
    return f"{reports_prefix(prefix)}{address}"


class LoadMeter:
    """Per-slot totals of the requests a server served, and their rates over a window.

    Thread-safe. `record` is called for each Pull and Push; `tick` (every
    few seconds) remembers the totals so that `rates` covers the last
    `window` seconds.
    """

    def __init__(self, window: float, clock: Callable[[], float] = time.monotonic) -> None:
        if window <= 0:
            raise ValueError(f"`window` must be positive. Received: window={window}")
        self.window = window
        self._clock = clock
        self._lock = threading.Lock()
        self._totals = np.zeros((len(MEASURES), NUM_SLOTS))  # guarded by _lock
        # Another meter's running totals, added to ours (`count_also`).
        self._also: Callable[[], np.ndarray] | None = None
        # (time, totals then), oldest first; the first is when counting began.
        self._marks: deque[tuple[float, np.ndarray]] = deque([(clock(), self._totals.copy())])

    def count_also(self, totals: Callable[[], np.ndarray]) -> None:
        """Adds the running totals (`(len(MEASURES), NUM_SLOTS)`, from 0 now) that
        `totals()` reads, at each `tick` and `rates`: the data plane's meter
        (`_core.ServerCore.load`)."""
        with self._lock:
            self._also = totals

    def _all_totals(self) -> np.ndarray:
        """Ours and the other meter's (call with `_lock` held)."""
        return self._totals + self._also() if self._also is not None else self._totals.copy()

    def record(self, keys: Iterable[np.ndarray], nbytes: int, cpu_seconds: float) -> None:
        """One request: its keys (any number of arrays), and its bytes and CPU time, which
        are shared among the slots in proportion to their keys."""
        counts = np.zeros(NUM_SLOTS)
        for k in keys:
            counts += _core.count_by_slot(np.ascontiguousarray(k, np.int64).ravel(), NUM_SLOTS)
        self.record_counts(counts, nbytes, cpu_seconds)

    def record_counts(self, counts: np.ndarray, nbytes: int, cpu_seconds: float) -> None:
        """`record` of a request whose keys per slot are `counts` (`NUM_SLOTS`,)."""
        counts = np.asarray(counts, np.float64)
        n = counts.sum()
        if not n:
            return
        with self._lock:
            self._totals[0] += counts
            self._totals[1] += counts * (nbytes / n)
            self._totals[2] += counts * (cpu_seconds / n)

    def tick(self) -> None:
        """Remembers the totals now; forgets marks older than the window needs."""
        now = self._clock()
        with self._lock:
            self._marks.append((now, self._all_totals()))
            while len(self._marks) > 2 and now - self._marks[1][0] >= self.window:
                self._marks.popleft()

    def rates(self) -> tuple[float, np.ndarray]:
        """(seconds covered, per-second rates of shape (len(MEASURES), NUM_SLOTS)) from the
        oldest mark within the window (or the first one) to now."""
        now = self._clock()
        with self._lock:
            since, then = self._marks[0]
            totals = self._all_totals()
        seconds = now - since
        return seconds, (totals - then) / max(seconds, 1e-9)


@dataclasses.dataclass(frozen=True)
class Usage:
    """One server's use of its resources (`elastic_emb.ps.server.resources`), published with
    its load."""

    rows: int = 0
    memory_bytes: int = 0  # what the tables' live rows take on this server
    memory_budget: int = 0  # what they may take (`serve --memory-budget`)
    resident_bytes: int = 0
    cpu: float = 0.0  # CPU seconds per second over the load window
    keys: float = 0.0  # keys pulled and pushed per second over the load window

    @property
    def memory_ratio(self) -> float:
        """The tables' bytes over the budget (0 without a budget)."""
        return self.memory_bytes / self.memory_budget if self.memory_budget else 0.0


@dataclasses.dataclass
class LoadReport:
    """One server's rates per slot (slots with none left out), as published."""

    address: str
    time: float  # wall-clock seconds when measured
    seconds: float  # how long the rates cover
    slots: np.ndarray  # (n,) int64
    rates: np.ndarray  # (len(MEASURES), n) float64
    usage: Usage = dataclasses.field(default_factory=Usage)

    @classmethod
    def measure(cls, address: str, meter: LoadMeter, usage: Usage | None = None) -> LoadReport:
        seconds, rates = meter.rates()
        slots = np.flatnonzero(rates[0])
        return cls(address, time.time(), seconds, slots, rates[:, slots], usage or Usage())

    def to_json(self) -> bytes:
        rates = {m: np.round(self.rates[i], 6).tolist() for i, m in enumerate(MEASURES)}
        data = {"address": self.address, "time": self.time, "seconds": self.seconds,
                "slots": self.slots.tolist(), **rates,
                "usage": dataclasses.asdict(self.usage)}  # fmt: skip
        return json.dumps(data).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> LoadReport:
        data = json.loads(raw)
        slots = np.asarray(data["slots"], np.int64)
        rates = np.array([data[m] for m in MEASURES], np.float64).reshape(len(MEASURES), -1)
        usage = Usage(**data.get("usage", {}))
        return cls(data["address"], data["time"], data["seconds"], slots, rates, usage)

    def per_slot(self, measure: str) -> np.ndarray:
        """(NUM_SLOTS,) rates of `measure`, zero where none was reported."""
        out = np.zeros(NUM_SLOTS)
        out[self.slots] = self.rates[MEASURES.index(measure)]
        return out


def read_reports(etcd: Any, prefix: str) -> list[LoadReport]:
    kvs, _ = etcd.get_prefix(reports_prefix(prefix))
    return [LoadReport.from_json(kv.value) for kv in kvs]


def slot_loads(reports: Iterable[LoadReport], measure: str, addresses: Iterable[str]) -> np.ndarray:
    """(NUM_SLOTS,) load of each slot: the sum over the reports of `addresses` (the
    servers that served it during the window: a slot that moved has two)."""
    if measure not in MEASURES:
        raise ValueError(f"`measure` must be one of {MEASURES}. Received: measure={measure!r}")
    wanted = set(addresses)
    total = np.zeros(NUM_SLOTS)
    for report in reports:
        if report.address in wanted:
            total += report.per_slot(measure)
    return total


def _takers(m: ClusterMap) -> list[Group]:
    """The groups that can hold slots: complete, not retiring."""
    return [g for g in m.groups if m.complete(g) and not g.retiring]


def group_loads(m: ClusterMap, loads: np.ndarray) -> dict[int, float]:
    """The load of each group that can hold slots, given each slot's load."""
    return {
        g.id: float(sum(loads[r.slot_begin : r.slot_end].sum() for r in m.ranges_of(g.id)))
        for g in _takers(m)
    }


def imbalance(m: ClusterMap, loads: np.ndarray) -> tuple[float, int | None]:
    """(max / mean of the groups' loads, the most loaded group); (1.0, None) without load."""
    per_group = group_loads(m, loads)
    mean = sum(per_group.values()) / max(len(per_group), 1)
    if len(per_group) < 2 or mean <= 0:
        return 1.0, None
    busiest = max(per_group, key=lambda g: (per_group[g], -g))
    return per_group[busiest] / mean, busiest


def hot_slots(m: ClusterMap, loads: np.ndarray, threshold: float) -> list[int]:
    """The slots that alone carry more than `threshold` times the mean group load."""
    per_group = group_loads(m, loads)
    mean = sum(per_group.values()) / max(len(per_group), 1)
    if mean <= 0:
        return []
    return [int(s) for s in np.flatnonzero(loads > threshold * mean)]


def plan_move(m: ClusterMap, loads: np.ndarray, threshold: float) -> ClusterMap | None:
    """The map with a move that evens the groups' loads out, or None.

    When the most loaded group carries more than `threshold` times the mean:
    it gives the least loaded group the upper part [slot, end) of one of its
    ranges (all of it when slot is its begin) whose load comes closest to
    what takes both groups nearest the mean, among the moves after which the
    larger of the two loads is lower by at least `MIN_GAIN` of the mean.
    None when no such move exists (a hot slot), with a move under way, or
    before the map is sealed.
    """
    if m.move is not None or not m.sealed:
        return None
    per_group = group_loads(m, loads)
    ratio, source = imbalance(m, loads)
    if source is None or ratio <= threshold:
        return None
    mean = sum(per_group.values()) / len(per_group)
    target = min(per_group, key=lambda g: (per_group[g], g))
    high, low = per_group[source], per_group[target]
    want = min(high - mean, mean - low)
    best: tuple[float, bool, int, int] | None = None  # (miss, split, range, slot)
    for r in m.ranges_of(source):
        # moved[i]: the load of slots [slot_begin + i, slot_end).
        moved = np.cumsum(loads[r.slot_begin : r.slot_end][::-1])[::-1]
        after = np.maximum(high - moved, low + moved)
        ok = (moved > 0) & (after <= high - MIN_GAIN * mean)
        if not ok.any():
            continue
        miss = np.where(ok, np.abs(moved - want), np.inf)
        i = int(np.argmin(miss))
        candidate = (float(miss[i]), i > 0, r.id, r.slot_begin + i)
        if best is None or candidate < best:
            best = candidate
    if best is None:
        return None
    _, split, range_id, slot = best
    new = m.copy()
    new.move = Move(range_id, slot, target, new.next_range if split else range_id)
    if split:
        new.next_range += 1
    return new


def plan_memory_move(
    m: ClusterMap, usages: dict[int, Usage], source: int, high_water: float
) -> ClusterMap | None:
    """The map with a move of slots off group `source`, whose tables passed `high_water`
    of their memory budget, to the group with the most room; None when no group has room
    (a server must be added), with a move under way, or before the map is sealed.

    Rows spread evenly over slots (ids are hashed), so a slot of `source` weighs its
    bytes over its slots. The move takes the upper part of `source`'s largest range that
    brings both groups nearest the same share of their budgets, and only while the
    target stays below `high_water` after it.
    """
    own = usages.get(source)
    if m.move is not None or not m.sealed or own is None or own.memory_ratio <= high_water:
        return None
    takers = [g.id for g in _takers(m) if g.id != source and usages.get(g.id)]
    if not takers:
        return None
    target = min(takers, key=lambda g: (usages[g].memory_ratio, g))
    there = usages[target]
    # Bytes to move for equal shares: (own - x) / own_budget == (there + x) / there_budget.
    x = (own.memory_bytes * there.memory_budget - there.memory_bytes * own.memory_budget) / (
        own.memory_budget + there.memory_budget
    )
    per_slot = own.memory_bytes / max(m.slots_of(source), 1)
    ranges = m.ranges_of(source)
    if not ranges or per_slot <= 0:
        return None
    largest = max(ranges, key=lambda r: (r.size, -r.slot_begin))
    slots = min(int(x // per_slot), largest.size)
    if slots < 1 or (there.memory_bytes + slots * per_slot) / there.memory_budget >= high_water:
        return None
    new = m.copy()
    slot = largest.slot_end - slots
    split = slot > largest.slot_begin
    new.move = Move(largest.id, slot, target, new.next_range if split else largest.id)
    if split:
        new.next_range += 1
    return new
