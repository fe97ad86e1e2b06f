"""Admission policies: which ids get a row (`ee.Table(admission=...)`).

Most ids of a production id space are seen once or twice and never again.
An admission policy keeps them out of the table until they have proved
themselves, so the rows go to ids that recur.

    t = ee.Table(dim=16, name="item", admission=ee.admission.Frequency(min_count=2))

The policy runs where the rows are (in this process, or on each PS shard),
in C++, and its state is saved by `ee.save` and Keras's save paths.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["Frequency", "get"]


@dataclasses.dataclass(frozen=True)
class Frequency:
    """An id gets a row from the `min_count`-th training step it occurs in.

    Semantics:
        - A training step counts an id once, however often it occurs in the
          batch. Counting happens when the step's gradient is pushed.
        - Until its count reaches `min_count`, an id has no row. It reads its
          initial value (the initializer's, as a `train=False` lookup does),
          and its gradients are dropped.
        - The push that brings the count to `min_count` inserts the row with
          its initial value and applies that push's gradient. Every later
          push updates it as usual.
        - Pulls never insert rows into an admission table.
        - Counts only grow. An evicted id whose count reached `min_count`
          gets a new row at its next push.

    Memory: the counts live in a count-min sketch of `sketch_bytes` 8-bit
    counters in `sketch_depth` rows, with conservative update. Its size does
    not grow with the id space. A sketch never undercounts. Collisions can
    only raise an estimate, and so admit an id early. With `n` distinct
    unadmitted ids counted so far, an id seen for the first time is admitted
    at `min_count=2` with probability at most about
    `(1 - exp(-n * depth / sketch_bytes)) ** depth`
    (see `false_admission_rate`). In the default 4 MiB sketch that is
    0.007 % after 100,000 such ids and 14 % after 1 million; a 32 MiB sketch
    brings 1 million back to 0.02 %. Size the sketch by the number of
    distinct ids a shard sees.

    Each PS shard holds its own sketch of this size for its keys.

    Args:
        min_count: int in [1, 255]; 1 admits every id (no admission).
        sketch_bytes: int, counters in the sketch (one byte each). Default 4 MiB.
        sketch_depth: int in [1, 8], hash rows of the sketch.

    Raises:
        ValueError: on an invalid argument.
    """

    min_count: int = 2
    sketch_bytes: int = 4 << 20
    sketch_depth: int = 4

    def __post_init__(self) -> None:
        for field, low, high in (
            ("min_count", 1, 255),
            ("sketch_bytes", 1, 1 << 40),
            ("sketch_depth", 1, 8),
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(
                    f"Frequency `{field}` must be an integer in [{low}, {high}]. "
                    f"Received: {field}={value!r}"
                )

    def false_admission_rate(self, distinct_ids: int) -> float:
        """About how likely an id seen once is admitted at `min_count=2`, after
        `distinct_ids` other unadmitted ids were counted (an upper estimate)."""
        load = distinct_ids * self.sketch_depth / self.sketch_bytes
        return (1.0 - math.exp(-load)) ** self.sketch_depth

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "frequency", **dataclasses.asdict(self)}


def get(value: Any) -> Frequency | None:
    """An admission policy from a policy, its `to_dict()`, or None (every id admitted)."""
    if value is None or isinstance(value, Frequency):
        return value
    if isinstance(value, dict) and value.get("kind") == "frequency":
        return Frequency(**{k: v for k, v in value.items() if k != "kind"})
    raise ValueError(
        "`admission` must be None or an elastic_emb.tables.policies.admission policy "
        f"(e.g. ee.admission.Frequency(min_count=2)). Received: admission={value!r}"
    )
