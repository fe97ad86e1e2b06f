"""Eviction policies: which rows a table lets go (`ee.Table(eviction=...)`).

    t = ee.Table(dim=16, name="item", eviction=ee.eviction.LFU(max_rows=10_000_000))

Steps count the table's pushes (`Table.iterations`); a row's **last step**
is the step of its last push (`Table.metadata`). The policy runs in C++
where the rows are (in this process or on each PS shard), after each push,
and is saved with the table's configuration. Evicted rows are counted
(`Table.policy_counts()`), and logged as erased for incremental checkpoints.

**Protection.** A row *used* during the last `protect_steps` steps is never
evicted. A row is used at step t if step t pushed it, or if it was pulled
for training after step t - 1 (the pull belongs to the next push). With the
default 1, a row pulled for a step is still there for that step's push.
Pull marks are not saved in checkpoints: a table restored from a checkpoint
taken between steps evicts exactly as the saved table would have.

Async training lets other workers' pushes come between a worker's pull and
its push: set `protect_steps` to at least the number of pushes that can
come between them (workers × (staleness + 1)), or a pulled row may be
evicted before its push, which then starts it again from its initial value.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

__all__ = ["LFU", "LRU", "TTL", "get"]


@dataclasses.dataclass(frozen=True)
class _Policy:
    """What the policies share: positive integer fields, and a `to_dict()` with their kind."""

    KIND: ClassVar[str]

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 1 << 62:
                raise ValueError(
                    f"{type(self).__name__} `{field.name}` must be a positive integer. "
                    f"Received: {field.name}={value!r}"
                )

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.KIND, **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class TTL(_Policy):
    """Rows not updated for `steps` steps are removed.

    Checked every `max(1, steps // 4)` steps. So a row last updated at step
    u is removed at the first check after step u + steps (unless protected).
    That is at most `steps // 4` steps late.
    """

    KIND: ClassVar[str] = "ttl"
    steps: int
    protect_steps: int = 1


@dataclasses.dataclass(frozen=True)
class LRU(_Policy):
    """At most `max_rows` rows after each push, the least recently used evicted first.

    When a push leaves more than `max_rows` rows, unprotected rows are
    removed, least recently updated first (ties: smaller key first), down to
    `max_rows - max_rows // 16`. Evicting in batches keeps the work amortized:
    one pass ranks the table's rows once per `max_rows // 16` new rows.
    Protected rows are never removed, so a step that uses more than
    `max_rows` rows leaves the table above the limit until they age.
    """

    KIND: ClassVar[str] = "lru"
    max_rows: int
    protect_steps: int = 1


@dataclasses.dataclass(frozen=True)
class LFU(_Policy):
    """At most `max_rows` rows after each push, the least frequently updated evicted first.

    Like `LRU`, ranked by update count (the pushes that updated the row, as
    `Table.metadata` reports), then last step, then key, smallest first.
    """

    KIND: ClassVar[str] = "lfu"
    max_rows: int
    protect_steps: int = 1


_KINDS: dict[str, Any] = {policy.KIND: policy for policy in (TTL, LRU, LFU)}


def get(value: Any) -> TTL | LRU | LFU | None:
    """An eviction policy from a policy, its `to_dict()`, or None (rows are kept)."""
    if value is None or isinstance(value, TTL | LRU | LFU):
        return value
    if isinstance(value, dict) and value.get("kind") in _KINDS:
        return _KINDS[value["kind"]](**{k: v for k, v in value.items() if k != "kind"})
    raise ValueError(
        "`eviction` must be None or an ee.eviction policy (ee.eviction.TTL(steps=...), "
        f"LRU(max_rows=...) or LFU(max_rows=...)). Received: eviction={value!r}"
    )
