"""`PeriodicCheckpoints`: the servers' own incremental checkpoints (`--checkpoint-every`).

Without a coordinator, every server writes its shard's tables into its own
`--checkpoint-dir` (an ordinary checkpoint of that shard's rows, a delta at
a time). With a coordinator, `--checkpoint-dir` is one directory on storage
every server shares, and one server, the primary of the group that owns
slot 0, writes a cluster checkpoint there as `ee.save(dir,
incremental=True)` would: each group's primary writes its part. In sync mode
the cut is a step boundary: every primary saves after the same step and
applies no later one until its part is written.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.persistence import checkpoint
from elastic_emb.ps.server.shard import Ranges, RequestError
from elastic_emb.ps.wire import protocol

if TYPE_CHECKING:
    from elastic_emb.ps.server.replication import Replica

__all__ = ["PeriodicCheckpoints"]

log = logging.getLogger("elastic_emb.server")

HOLD_ATTEMPTS = 10  # a primary past the chosen step refuses: choose again
_SAVE_TIMEOUT = 6 * 3600.0


class _Primaries:
    """The slot ranges' primaries as `checkpoint.save_cluster` writes through them."""

    def __init__(self, replica: Replica, mode: str) -> None:
        m = replica.cluster_map()
        ranges = m.by_slot()
        groups = [m.group(r.group) for r in ranges]
        self.mode = mode
        self.num_shards = len(ranges)
        self._ranges = [r.slots for r in ranges]
        self._ids = [r.id for r in ranges]
        self._stubs = [ps_pb2_grpc.ParameterServerStub(replica.channel(g.primary)) for g in groups]
        health = [s.Health(ps_pb2.HealthRequest(), timeout=10) for s in self._stubs]
        # What the ranges hold: no change in it, no new checkpoint.
        self.version = tuple(
            (r.id, r.slots, g.primary, g.epoch, h.sequence)
            for r, g, h in zip(ranges, groups, health, strict=True)
        )
        self._furthest = max((h.step for h in health), default=0)

    def slot_ranges(self) -> list[tuple[int, int]]:
        return self._ranges

    def save_tables(
        self, directories: list[str], names: list[str], incremental: bool, max_deltas: int
    ) -> list[Any]:
        # SYNC: after the furthest step applied; the others reach it by themselves.
        after = self._furthest if self.mode == "sync" else 0
        requests = [
            protocol.save_request(d, names, incremental, max_deltas, after, slots)
            for d, slots in zip(directories, self._ranges, strict=True)
        ]
        for r, range_id in zip(requests, self._ids, strict=True):
            r.hold, r.range = True, range_id
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            calls = [
                pool.submit(stub.Save, r, timeout=_SAVE_TIMEOUT)
                for stub, r in zip(self._stubs, requests, strict=True)
            ]
            return [c.result() for c in calls]


class PeriodicCheckpoints:
    """Writes a checkpoint every `every` seconds in a background thread (`start`, `stop`).

    Args:
        ranges: this server's shards (one without a coordinator).
        directory: where the checkpoints go (see the module docstring).
        every: seconds between two checkpoints.
        max_deltas: the most deltas a chain gets before a new base.
        replica: this server's place in a coordinated cluster, if any.
        changes: the number of changes the shard applied so far (without a
            coordinator): no change since the last checkpoint, no new one.
    """

    def __init__(
        self,
        ranges: Ranges,
        directory: str,
        every: float,
        max_deltas: int = checkpoint.DEFAULT_MAX_DELTAS,
        replica: Replica | None = None,
        changes: Callable[[], int] = lambda: -1,
    ) -> None:
        if every <= 0:
            raise ValueError(f"--checkpoint-every must be positive, not {every:g}")
        self.ranges = ranges
        self.directory = Path(directory).absolute()
        self.every = every
        self.max_deltas = max_deltas
        self.replica = replica
        self._changes = changes
        self._saved: Any = None  # what the last checkpoint holds (see `save_now`)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="ee-checkpoints")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.save_now()
            except Exception as e:  # logged; the next period tries again
                log.error("periodic checkpoint into %s failed: %s", self.directory, e)

    def save_now(self) -> bool:
        """Writes one checkpoint if this server writes them and anything changed; whether it did."""
        if not self.ranges.tables():
            return False
        if self.replica is None:
            changes = self._changes()
            if changes == self._saved:
                return False
            self.ranges.get(0).save(
                str(self.directory), [], incremental=True, max_deltas=self.max_deltas
            )
            self._saved = changes
            log.info("checkpoint written to %s", self.directory)
            return True
        if not self._leads(self.replica):
            return False
        mode = next((m for s in self.ranges.shards() if (m := s.mode_name())), "async")
        for attempt in range(HOLD_ATTEMPTS):
            primaries = _Primaries(self.replica, mode)
            if primaries.version == self._saved:
                return False
            try:
                checkpoint.save_cluster(
                    self.directory, primaries, [], {}, incremental=True,
                    max_deltas=self.max_deltas,
                )  # fmt: skip
            except grpc.RpcError as e:
                details = str(e.details())
                past = "cannot hold" in details
                if not past or attempt == HOLD_ATTEMPTS - 1:
                    raise RequestError(e.code().name, details) from None
                continue
            self._saved = primaries.version
            log.info("cluster checkpoint written to %s", self.directory)
            return True
        return False

    @staticmethod
    def _leads(replica: Replica) -> bool:
        """This server is the primary of the group that owns slot 0."""
        m = replica.cluster_map()
        ranges = m.by_slot()
        group = m.find_group(ranges[0].group) if ranges else None
        return group is not None and group.primary == replica.address
