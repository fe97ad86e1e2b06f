"""Dynamic data sharding: workers take their data from a queue of shards kept in etcd.

Instead of a fixed split of the data per worker (`TF_CONFIG`), a job's data
is cut into `num_shards` shards, and each epoch every worker takes the next
shard nobody holds, trains on it batch by batch, and takes another, until
every shard of the epoch is done. Workers may come and go at any time:

    queue = ShardQueue("etcd://127.0.0.1:2379", job="ctr", num_shards=64, epochs=3)
    queue.fit(model, read_shard)  # model.fit on the batches this worker is given

`read_shard(shard)` returns the shard's batches, `(x, y)` (or `(x, y, w)`),
always the same ones in the same order. In etcd (under
`/elastic_emb/jobs/<job>/epoch/<e>/`):

- `claim/<shard>`: the worker holding it, attached to the worker's lease (it
  disappears `lease_seconds` after the worker dies);
- `progress/<shard>`: how many of its batches are trained, written after
  each training step (by `callback()`, at the end of the batch);
- `done/<shard>`: written once its last batch is trained.

A worker that takes a shard someone held before starts after the batches
recorded as trained. So the guarantee, per epoch: every batch of every shard
is trained exactly once, except the batch a worker was training when it
died (its push may or may not have reached the PS before it died, and the
next holder trains it again); the batches of completed shards are never
lost nor doubled.

Each claim, progress and completion is one etcd call. The batches must not
be reordered between the generator and the training step (no shuffling or
interleaving after it: Keras' own prefetching keeps the order).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from elastic_emb.ps.coord.etcd import Compare, Etcd, Op

__all__ = ["ShardQueue"]

log = logging.getLogger("elastic_emb.shard_queue")

_POLL_SECONDS = 0.1


class ShardQueue:
    """A job's queue of data shards in etcd (see the module docstring).

    Args:
        coordinator: "etcd://host:port" (the cluster's coordinator).
        job: the job's name; every worker of the job uses the same one.
        num_shards: shards per epoch (the same for every worker).
        epochs: epochs of the job.
        worker: this worker's name in etcd (default: host and process id).
        lease_seconds: how long after a worker dies its shard returns to the queue.

    Raises:
        ValueError: bad arguments.
    """

    def __init__(
        self,
        coordinator: str,
        job: str,
        num_shards: int,
        epochs: int = 1,
        worker: str | None = None,
        lease_seconds: int = 5,
    ) -> None:
        if num_shards < 1 or epochs < 1 or lease_seconds < 1:
            raise ValueError(
                "`num_shards`, `epochs` and `lease_seconds` must be >= 1. Received: "
                f"num_shards={num_shards}, epochs={epochs}, lease_seconds={lease_seconds}"
            )
        if not job or "/" in job:
            raise ValueError(f"`job` must be a non-empty name without '/'. Received: {job!r}")
        self.job, self.num_shards, self.epochs = job, num_shards, epochs
        self.worker = worker or f"{os.uname().nodename}:{os.getpid()}"
        self._etcd = Etcd(coordinator)
        self._lease = self._etcd.grant(lease_seconds)
        self._keepalive = self._etcd.keep_alive(
            self._lease.id, max(lease_seconds / 3, 0.2), self._lost
        )
        self._prefix = f"/elastic_emb/jobs/{job}/epoch/"
        # (epoch, shard, batch number, batches in the shard) of each batch handed out
        # and not yet trained, in order.
        self._pending: collections.deque[tuple[int, int, int, int]] = collections.deque()
        self._lock = threading.Lock()
        self.trained: list[tuple[int, int, int]] = []  # (epoch, shard, batch) this worker trained

    def _lost(self) -> None:
        log.error("lost the etcd lease of worker %s: its shards return to the queue", self.worker)

    def _key(self, epoch: int, kind: str, shard: int) -> str:
        return f"{self._prefix}{epoch}/{kind}/{shard}"

    def _state(self, epoch: int) -> tuple[set[int], set[int]]:
        """(done shards, claimed shards) of `epoch`."""
        kvs, _ = self._etcd.get_prefix(f"{self._prefix}{epoch}/")
        done, claimed = set(), set()
        for kv in kvs:
            kind, shard = kv.key.rsplit("/", 2)[-2:]
            if kind == "done":
                done.add(int(shard))
            elif kind == "claim":
                claimed.add(int(shard))
        return done, claimed

    def _claim(self, epoch: int) -> int | None:
        """A shard of `epoch` this worker now holds; None once every shard is done.
        Waits while the only shards left are held by others."""
        while True:
            done, claimed = self._state(epoch)
            if len(done) == self.num_shards:
                return None
            free = [s for s in range(self.num_shards) if s not in done and s not in claimed]
            for shard in free:
                key = self._key(epoch, "claim", shard)
                result = self._etcd.txn(
                    [Compare.create_revision(key, "=", 0)],
                    [Op.put(key, self.worker.encode(), self._lease.id)],
                )
                if result.succeeded:
                    if self._etcd.get(self._key(epoch, "done", shard)) is None:
                        return shard
                    self._etcd.delete(key)  # done meanwhile by its last holder
            time.sleep(_POLL_SECONDS)

    def finished(self) -> bool:
        """Whether every shard of every epoch is done (a worker joining now has nothing
        to train: Keras refuses a generator without batches)."""
        done, _ = self._state(self.epochs - 1)
        return len(done) == self.num_shards

    def _progress(self, epoch: int, shard: int) -> int:
        kv = self._etcd.get(self._key(epoch, "progress", shard))
        return 0 if kv is None else int(kv.value)

    def batches(self, read_shard: Callable[[int], Iterable[Any]]) -> Iterator[Any]:
        """Every batch this worker trains, over all epochs of the job: for `model.fit`
        (with `callback()`, which records each trained batch)."""
        for epoch in range(self.epochs):
            while (shard := self._claim(epoch)) is not None:
                start = self._progress(epoch, shard)
                shard_batches = list(read_shard(shard))
                log.info("worker %s: epoch %d shard %d from batch %d of %d", self.worker,
                         epoch, shard, start, len(shard_batches))  # fmt: skip
                if start >= len(shard_batches):  # trained, not yet marked done
                    self._finish(epoch, shard)
                    continue
                for number in range(start, len(shard_batches)):
                    with self._lock:
                        self._pending.append((epoch, shard, number, len(shard_batches)))
                    yield shard_batches[number]

    def fit(self, model: Any, read_shard: Callable[[int], Iterable[Any]], **fit_kwargs: Any) -> Any:
        """`model.fit` on `batches(read_shard)` with `callback()` first, then
        `fit_kwargs`'s callbacks; returns its History, or None without calling it when
        no batch is left for this worker: every shard was done, or finished by others
        while it waited (Keras refuses a generator without batches)."""
        batches = self.batches(read_shard)
        first = next(batches, None)
        if first is None:
            log.info("worker %s: no shard of job %r left to train", self.worker, self.job)
            return None
        callbacks = [self.callback(), *(fit_kwargs.pop("callbacks", None) or [])]

        def all_batches() -> Iterator[Any]:  # a generator: Keras takes no other iterator
            yield first
            yield from batches

        return model.fit(all_batches(), callbacks=callbacks, **fit_kwargs)

    def callback(self) -> Any:
        """The Keras callback that records each trained batch in etcd."""
        import keras

        queue = self

        class RecordTrainedBatches(keras.callbacks.Callback):
            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                queue.trained_one()

        return RecordTrainedBatches()

    def trained_one(self) -> tuple[int, int, int]:
        """Records that the oldest batch handed out is trained; returns (epoch, shard,
        batch number). Call it after each training step when not using `callback()`."""
        with self._lock:
            epoch, shard, number, total = self._pending.popleft()
        self._etcd.put(self._key(epoch, "progress", shard), str(number + 1).encode())
        if number + 1 == total:
            self._finish(epoch, shard)
        self.trained.append((epoch, shard, number))
        return epoch, shard, number

    def _finish(self, epoch: int, shard: int) -> None:
        self._etcd.put(self._key(epoch, "done", shard), self.worker.encode())
        self._etcd.delete(self._key(epoch, "claim", shard))

    def close(self) -> None:
        """Gives this worker's shards back at once (its lease revoked)."""
        self._keepalive.stop()
        try:
            self._etcd.revoke(self._lease.id)
        finally:
            self._etcd.close()
