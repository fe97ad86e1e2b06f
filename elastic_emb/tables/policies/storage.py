"""Storage tiers: where a table's rows live (`ee.Table(storage=...)`).

    t = ee.Table(dim=16, name="item",
                 storage=ee.storage.Tiered(ram_rows=1_000_000, path="/mnt/ssd/ee"))

By default every row is in RAM. `Tiered` keeps the most recently updated
`ram_rows` rows in RAM and the rest in an LMDB database on local disk
(`elastic_emb.tables.tiered.TieredTable`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

__all__ = ["Tiered", "get"]


@dataclasses.dataclass(frozen=True)
class Tiered:
    """The hottest rows in RAM, the rest on local disk in LMDB.

    Semantics:
        - After each push, rows beyond `ram_rows` are moved to disk, whole:
          value, optimizer slots and metadata. They go least recently updated
          first, down to `ram_rows - ram_rows // 16`, as `ee.eviction.LRU`
          ranks rows. Rows the step used stay in RAM.
        - A row on disk that a training pull or a push needs is moved back
          to RAM first.
        - Evaluation pulls (`train=False`) read disk rows in place.
        - A tiered table trains exactly like an all-in-RAM one. Only where
          its rows are differs.
    Checkpoints, `export_state` and `len` include both tiers.

    The disk tier is scratch space. Each table opens a fresh database in a
    new directory under `path`, and deletes it when the table is freed. A
    restarted process starts from its checkpoint, as an all-in-RAM table
    does. Needs the `lmdb` package (`pip install ".[disk]"` in the source tree).

    Args:
        ram_rows: int >= 16, rows kept in RAM after each push.
        path: directory for the databases (created if missing). Each PS
            shard uses a directory of its own machine.

    Raises:
        ValueError: on an invalid argument.
    """

    ram_rows: int
    path: str

    def __post_init__(self) -> None:
        r = self.ram_rows
        if isinstance(r, bool) or not isinstance(r, int) or not 16 <= r < 1 << 62:
            raise ValueError(
                f"Tiered `ram_rows` must be an integer of at least 16. Received: ram_rows={r!r}"
            )
        if not isinstance(self.path, str | os.PathLike) or not str(self.path):
            raise ValueError(
                f"Tiered `path` must be a directory path. Received: path={self.path!r}"
            )
        object.__setattr__(self, "path", os.fspath(self.path))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "tiered", **dataclasses.asdict(self)}


def get(value: Any) -> Tiered | None:
    """A storage policy from a policy, its `to_dict()`, or None (all rows in RAM)."""
    if value is None or isinstance(value, Tiered):
        return value
    if isinstance(value, dict) and value.get("kind") == "tiered":
        return Tiered(**{k: v for k, v in value.items() if k != "kind"})
    raise ValueError(
        "`storage` must be None or an elastic_emb.tables.policies.storage policy "
        f"(ee.storage.Tiered(ram_rows=..., path=...)). Received: storage={value!r}"
    )
