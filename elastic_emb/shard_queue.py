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

While etcd cannot be reached, training goes on with the shard in hand: its
progress is written once etcd is back, and taking the next shard waits for
it (up to `ETCD_WAIT_SECONDS`, logged once). A worker whose lease lapsed
meanwhile takes a new one and claims its shards again.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from elastic_emb.ps.coord.etcd import Compare, Etcd, EtcdUnavailable, Op

__all__ = ["ETCD_WAIT_SECONDS", "ShardQueue"]

log = logging.getLogger("elastic_emb.shard_queue")

_POLL_SECONDS = 0.1
ETCD_WAIT_SECONDS = 600.0  # how long taking a shard waits for an unreachable etcd


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
        self._lease_seconds = lease_seconds
        self._prefix = f"/elastic_emb/jobs/{job}/epoch/"
        # (epoch, shard, batch number, batches in the shard) of each batch handed out
        # and not yet trained, in order.
        self._pending: collections.deque[tuple[int, int, int, int]] = collections.deque()
        self._lock = threading.Lock()
        self._held: set[tuple[int, int]] = set()  # guarded by _lock: (epoch, shard) claimed
        # Guarded by _lock: writes etcd could not take yet, in order (None: a delete).
        self._unwritten: dict[str, bytes | None] = {}
        self._etcd_lost_since: float | None = None  # guarded by _lock
        self.trained: list[tuple[int, int, int]] = []  # (epoch, shard, batch) this worker trained
        self._lease = self._etcd.grant(lease_seconds)
        self._keepalive = self._etcd.keep_alive(
            self._lease.id, max(lease_seconds / 3, 0.2), self._lost
        )

    def _lost(self) -> None:
        """The lease lapsed (etcd away, or this process too slow): a new one, and the shards
        this worker holds claimed again under it, unless another worker took one meanwhile."""
        log.warning("worker %s: its etcd lease lapsed; taking a new one", self.worker)
        lease = self._waiting(self._etcd.grant, self._lease_seconds)
        with self._lock:
            held = sorted(self._held)
        for epoch, shard in held:
            if not self._waiting(self._claim_again, self._key(epoch, "claim", shard), lease.id):
                log.error(
                    "worker %s: epoch %d shard %d was claimed by another worker while this "
                    "one's lease had lapsed: both train it", self.worker, epoch, shard,
                )  # fmt: skip
        self._lease = lease
        self._keepalive = self._etcd.keep_alive(
            lease.id, max(self._lease_seconds / 3, 0.2), self._lost
        )

    def _claim_again(self, key: str, lease: int) -> bool:
        """Whether the claim `key` is this worker's under `lease` now (it was this worker's
        under its old lease, or nobody's)."""
        mine = self.worker.encode()
        put = [Op.put(key, mine, lease)]
        return (
            self._etcd.txn([Compare.value(key, "=", mine)], put).succeeded
            or self._etcd.txn([Compare.create_revision(key, "=", 0)], put).succeeded
        )

    def _waiting(self, call: Callable[..., Any], *args: Any) -> Any:
        """`call(*args)` once etcd answers: waits while it cannot be reached, at most
        ETCD_WAIT_SECONDS; first writes what could not be written before."""
        deadline = time.monotonic() + ETCD_WAIT_SECONDS
        while True:
            try:
                self._write_unwritten()
                result = call(*args)
            except EtcdUnavailable as e:
                self._unreachable(e)
                if time.monotonic() > deadline:
                    raise ConnectionError(
                        f"elastic_emb: worker {self.worker} waited {ETCD_WAIT_SECONDS:g} s for "
                        f"etcd to take the next data shard: {e}"
                    ) from None
                time.sleep(0.5)
                continue
            with self._lock:
                since, self._etcd_lost_since = self._etcd_lost_since, None
            if since is not None:
                log.warning("worker %s: etcd answers again after %.1f s", self.worker,
                            time.monotonic() - since)  # fmt: skip
            return result

    def _unreachable(self, error: Exception) -> None:
        with self._lock:
            first = self._etcd_lost_since is None
            if first:
                self._etcd_lost_since = time.monotonic()
        if first:
            log.warning("worker %s: etcd cannot be reached (%s): training goes on with the "
                        "shard in hand; its progress is written once etcd is back",
                        self.worker, error)  # fmt: skip

    def _write(self, key: str, value: bytes | None) -> None:
        """Puts (or, None, deletes) `key` now, or once etcd answers again; in order."""
        with self._lock:
            self._unwritten.pop(key, None)
            self._unwritten[key] = value
        try:
            self._write_unwritten()
        except EtcdUnavailable as e:
            self._unreachable(e)

    def _write_unwritten(self) -> None:
        while True:
            with self._lock:
                if not self._unwritten:
                    return
                key, value = next(iter(self._unwritten.items()))
            if value is None:
                self._etcd.delete(key)
            else:
                self._etcd.put(key, value)
            with self._lock:
                if self._unwritten.get(key, b"") == value:  # (not rewritten meanwhile)
                    del self._unwritten[key]

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
        """A shard of `epoch` this worker now holds; None once every shard is done, or
        the only ones left are this worker's own (their batches are handed out already,
        and finish as they train: Keras takes a generator's first batches before it
        trains any). Waits while the only shards left are held by others, or etcd is away."""
        while True:
            done, claimed = self._waiting(self._state, epoch)
            with self._lock:
                mine = {s for e, s in self._held if e == epoch}
            if len(done | mine) == self.num_shards:
                return None
            free = [s for s in range(self.num_shards) if s not in done and s not in claimed]
            for shard in free:
                if self._waiting(self._try_claim, epoch, shard):
                    return shard
            time.sleep(_POLL_SECONDS)

    def _try_claim(self, epoch: int, shard: int) -> bool:
        key = self._key(epoch, "claim", shard)
        with self._lock:  # (held before the claim exists: a lapse meanwhile claims it again)
            self._held.add((epoch, shard))
        result = self._etcd.txn(
            [Compare.create_revision(key, "=", 0)],
            [Op.put(key, self.worker.encode(), self._lease.id)],
        )
        if result.succeeded and self._etcd.get(self._key(epoch, "done", shard)) is None:
            return True
        if result.succeeded:
            self._etcd.delete(key)  # done meanwhile by its last holder
        with self._lock:
            self._held.discard((epoch, shard))
        return False

    def finished(self) -> bool:
        """Whether every shard of every epoch is done (a worker joining now has nothing
        to train: Keras refuses a generator without batches)."""
        done, _ = self._waiting(self._state, self.epochs - 1)
        return len(done) == self.num_shards

    def _progress(self, epoch: int, shard: int) -> int:
        kv = self._etcd.get(self._key(epoch, "progress", shard))
        return 0 if kv is None else int(kv.value)

    def batches(self, read_shard: Callable[[int], Iterable[Any]]) -> Iterator[Any]:
        """Every batch this worker trains, over all epochs of the job: for `model.fit`
        (with `callback()`, which records each trained batch)."""
        for epoch in range(self.epochs):
            while (shard := self._claim(epoch)) is not None:
                start = self._waiting(self._progress, epoch, shard)
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
        # On JAX a step returns before its host callbacks (the pushes) have run.
        on_jax = keras.backend.backend() == "jax"

        class RecordTrainedBatches(keras.callbacks.Callback):
            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                if on_jax:
                    import jax

                    jax.effects_barrier()  # the step's push is handed to the PS client
                queue.trained_one()

        return RecordTrainedBatches()

    def trained_one(self) -> tuple[int, int, int]:
        """Records that the oldest batch handed out is trained; returns (epoch, shard,
        batch number). Call it after each training step when not using `callback()`."""
        with self._lock:
            epoch, shard, number, total = self._pending.popleft()
        self._write(self._key(epoch, "progress", shard), str(number + 1).encode())
        if number + 1 == total:
            self._finish(epoch, shard)
        self.trained.append((epoch, shard, number))
        return epoch, shard, number

    def _finish(self, epoch: int, shard: int) -> None:
        self._write(self._key(epoch, "done", shard), self.worker.encode())
        self._write(self._key(epoch, "claim", shard), None)
        with self._lock:
            self._held.discard((epoch, shard))

    def close(self) -> None:
        """Gives this worker's shards back at once (its lease revoked)."""
        self._keepalive.stop()
        try:
            self._write_unwritten()
            self._etcd.revoke(self._lease.id)
        finally:
            self._etcd.close()
