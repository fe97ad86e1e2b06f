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

from elastic_emb import checkpoint
from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.ps import protocol
from elastic_emb.ps.shard import RequestError, Shard

if TYPE_CHECKING:
    from elastic_emb.ps.replication import Replica

__all__ = ["PeriodicCheckpoints"]

log = logging.getLogger("elastic_emb.server")

HOLD_ATTEMPTS = 10  # a primary past the chosen step refuses: choose again
_SAVE_TIMEOUT = 6 * 3600.0


class _Primaries:
    """The groups' primaries as `checkpoint.save_cluster` writes through them."""

    def __init__(self, replica: Replica, mode: str) -> None:
        groups = replica.cluster_map().by_slot()
        self.mode = mode
        self.num_shards = len(groups)
        self._ranges = [(g.slot_begin, g.slot_end) for g in groups]
        self._stubs = [ps_pb2_grpc.ParameterServerStub(replica.channel(g.primary)) for g in groups]
        health = [s.Health(ps_pb2.HealthRequest(), timeout=10) for s in self._stubs]
        # What the groups hold: no change in it, no new checkpoint.
        self.version = tuple(
            (g.primary, g.epoch, h.sequence) for g, h in zip(groups, health, strict=True)
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
            protocol.save_request(d, names, incremental, max_deltas, after) for d in directories
        ]
        for r in requests:
            r.hold = True
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            calls = [
                pool.submit(stub.Save, r, timeout=_SAVE_TIMEOUT)
                for stub, r in zip(self._stubs, requests, strict=True)
            ]
            return [c.result() for c in calls]


class PeriodicCheckpoints:
    """Writes a checkpoint every `every` seconds in a background thread (`start`, `stop`).

    Args:
        shard: this server's shard.
        directory: where the checkpoints go (see the module docstring).
        every: seconds between two checkpoints.
        max_deltas: the most deltas a chain gets before a new base.
        replica: this server's place in a coordinated cluster, if any.
        changes: the number of changes the shard applied so far (without a
            coordinator): no change since the last checkpoint, no new one.
    """

    def __init__(
        self,
        shard: Shard,
        directory: str,
        every: float,
        max_deltas: int = checkpoint.DEFAULT_MAX_DELTAS,
        replica: Replica | None = None,
        changes: Callable[[], int] = lambda: -1,
    ) -> None:
        if every <= 0:
            raise ValueError(f"--checkpoint-every must be positive, not {every:g}")
        self.shard = shard
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
        if not self.shard.tables():
            return False
        if self.replica is None:
            changes = self._changes()
            if changes == self._saved:
                return False
            self.shard.save(str(self.directory), [], incremental=True, max_deltas=self.max_deltas)
            self._saved = changes
            log.info("checkpoint written to %s", self.directory)
            return True
        if not self._leads():
            return False
        mode = self.shard.mode_name() or "async"
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

    def _leads(self) -> bool:
        """This server is the primary of the group that owns slot 0."""
        assert self.replica is not None
        groups = self.replica.cluster_map().by_slot()
        return bool(groups) and groups[0].primary == self.replica.address
