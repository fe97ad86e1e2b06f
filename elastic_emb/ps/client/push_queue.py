"""`PushQueue`: a worker's pushes, one per training step, sent in step order on a
background thread while training goes on. Every shard hears of every table of a step
(maybe with no keys), so all shards advance their step together; a failed push surfaces
on a later call, and a worker pulls again with at most `PUSHES_AHEAD` pushes in flight."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from typing import Any

import numpy as np

from elastic_emb import _core
from elastic_emb.ps.client.range_router import RangeRouter
from elastic_emb.ps.client.round_timings import RoundTimings
from elastic_emb.ps.wire import protocol
from elastic_emb.tables.sharding import NUM_SLOTS, RangeLayout

__all__ = ["PUSHES_AHEAD", "PushQueue", "StepGradients"]

# Pushes of a worker that may be in flight while it pulls again.
PUSHES_AHEAD = 2

# One step's gradients: {name: (dim, keys, grads)}.
StepGradients = dict[str, tuple[int, np.ndarray, np.ndarray]]


class PushQueue:
    """The pushes of a worker, queued and sent one at a time. Thread-safe.

    Args:
        router: the shards' ranges and servers.
        worker_index: this worker's index (in each request).
        encoding: the wire encoding of gradients (`protocol.encoding`).
        timings: counts each push round.
    """

    def __init__(
        self, router: RangeRouter, worker_index: int, encoding: Any, timings: RoundTimings
    ) -> None:
        # Read-only after construction (`timings` and the executor are thread-safe).
        self._router = router
        self._worker_index = worker_index
        self._encoding = encoding
        self._timings = timings
        # One thread: pushes leave in order, one step at a time, off the training thread.
        self._pusher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ee-push")
        self._in_flight_lock = threading.Lock()
        # Guarded by _in_flight_lock: queued pushes, oldest first.
        self._in_flight: collections.deque[concurrent.futures.Future[None]] = collections.deque()

    def send(self, step: int, tables: StepGradients) -> concurrent.futures.Future[None]:
        """Queues the push of training step `step`; its future."""
        future = self._pusher.submit(self._push_step, step, tables)
        with self._in_flight_lock:
            self._in_flight.append(future)
        return future

    def raise_errors(self, wait_all: bool = False) -> None:
        """Surfaces failed pushes; bounds (or, `wait_all`, drains) those in flight."""
        while True:
            with self._in_flight_lock:
                if not self._in_flight or not (
                    wait_all or self._in_flight[0].done() or len(self._in_flight) > PUSHES_AHEAD
                ):
                    return
                future = self._in_flight.popleft()
            future.result()

    def close(self) -> None:
        """Waits for the queued pushes to be sent (or fail); no push may be queued after."""
        self._pusher.shutdown(wait=True)

    def _push_step(self, step: int, tables: StepGradients) -> None:
        names = sorted(tables)
        keys = [np.ascontiguousarray(tables[n][1], np.int64) for n in names]
        grads = [np.ascontiguousarray(tables[n][2], np.float32) for n in names]

        def make(layout: RangeLayout) -> list[Any]:  # every range, every table (in C++)
            requests = _core.push_requests(
                names, keys, grads, layout.starts(), NUM_SLOTS, self._worker_index, step,
                self._encoding,
            )  # fmt: skip
            return [protocol.Encoded(r) for r in requests]

        start = time.perf_counter()
        self._router.per_range("Push", make)
        self._timings.add("push", time.perf_counter() - start)
