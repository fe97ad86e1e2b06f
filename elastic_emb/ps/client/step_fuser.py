"""`StepFuser`: a worker's training steps, with the traffic of a step's layers fused. Each
layer `submit`s its keys for a ticket; the step's first `collect` pulls the rows of every
queued ticket at once (taking rows read ahead when they match); each layer's gradient
comes back through `push_gradient`, and once every layer that pulled has pushed, the
step's gradients are queued as one push. It also counts the steps pushed, and serves
single `pull`s and `push`es of many tables."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading

import numpy as np

from elastic_emb.ps.client.fused_pull import FusedPull, Tables, one_entry_per_table
from elastic_emb.ps.client.push_queue import PushQueue, StepGradients
from elastic_emb.ps.client.read_ahead import ReadAhead

__all__ = ["StepFuser"]


@dataclasses.dataclass
class _Ticket:
    """One layer's pull of one step (see `StepFuser.submit`)."""

    table: str
    dim: int
    keys: np.ndarray
    insert: bool
    expects_push: bool
    future: concurrent.futures.Future[list[np.ndarray]] | None = None  # set once pulled
    index: int = 0  # the entry of this ticket's table in the future's list
    positions: np.ndarray | None = None  # its keys' rows in the entry (None: all, in order)

    def pulled(self) -> concurrent.futures.Future[list[np.ndarray]]:
        """The rows of this ticket's pull (raises RuntimeError if it never started)."""
        if self.future is None:
            raise RuntimeError(f"elastic_emb: the pull of a ticket of {self.table!r} never started")
        return self.future


class StepFuser:
    """The step protocol of one worker. Thread-safe.

    `_lock` guards the step counter, the tickets and the step's gradients.
    Lock order: `_lock` before `ReadAhead`'s and `PushQueue`'s locks.

    Args:
        step: the steps this worker has pushed so far (the shards' step at Join).
        puller: pulls rows (`pull(tables, insert, step)`).
        pushes: sends the steps' pushes in order.
        read_ahead: the next step's rows, read once this step is pushed.
    """

    def __init__(
        self, step: int, puller: FusedPull, pushes: PushQueue, read_ahead: ReadAhead
    ) -> None:
        # Read-only after construction (each is thread-safe itself).
        self._puller = puller
        self._pushes = pushes
        self._read_ahead = read_ahead
        self._lock = threading.Lock()
        # Guarded by _lock: the step's tickets and gradients.
        self._step = step  # steps this worker has pushed (queued)
        self._tickets: dict[int, _Ticket] = {}
        self._unsent: list[_Ticket] = []  # submitted, not pulled yet
        self._next_ticket = 0
        self._expected_pushes = 0
        self._received_pushes = 0
        self._step_pushes: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._step_dims: dict[str, int] = {}

    @property
    def step(self) -> int:
        """Training steps this worker has pushed (queued)."""
        with self._lock:
            return self._step

    # Pull and push, fused over tables.

    def pull(self, tables: Tables, insert: bool) -> list[np.ndarray]:
        """Rows of many tables in one request per shard, for the next step."""
        self._pushes.raise_errors()
        with self._lock:
            step = self._step + 1
        return self._puller.pull(tables, insert, step)

    def push(self, tables: StepGradients) -> None:
        """One training step for many tables; waits until the shards have it."""
        with self._lock:
            self._send_unsent_pushes()
            future = self._start_push(tables)
        future.result()

    def flush(self) -> None:
        """Sends the pushes of a step not complete yet and waits for all pushes."""
        with self._lock:
            self._send_unsent_pushes()
        self._pushes.raise_errors(wait_all=True)

    def _start_push(self, tables: StepGradients) -> concurrent.futures.Future[None]:
        """Queues the push of the next step (caller holds `_lock`)."""
        self._step += 1
        future = self._pushes.send(self._step, tables)
        self._read_ahead.step_pushed(self._step + 1)  # its keys may be known: read its rows
        return future

    # The layers' fused path (`RemoteTable.step_fusion`).

    def submit(
        self, table: str, dim: int, keys: np.ndarray, insert: bool, expects_push: bool
    ) -> int:
        """Queues a layer's pull of unique `keys`; returns the ticket for `collect`."""
        with self._lock:
            self._next_ticket += 1
            ticket = _Ticket(table, dim, keys, insert, expects_push)
            self._tickets[self._next_ticket] = ticket
            self._unsent.append(ticket)
            return self._next_ticket

    def collect(self, ticket_id: int) -> np.ndarray:
        """The rows of a ticket; the first collect of a step pulls for every queued ticket."""
        with self._lock:
            ticket = self._tickets.pop(ticket_id)
            batch: list[_Ticket] = []
            if ticket.future is None:
                batch, self._unsent = self._unsent, []
                if any(t.expects_push for t in batch):
                    if self._received_pushes:  # a new step: the last one is over
                        self._send_unsent_pushes()
                    self._expected_pushes += sum(t.expects_push for t in batch)
                for t in batch:
                    t.future = concurrent.futures.Future()
        if batch:
            self._pull_batch(batch)
        rows = ticket.pulled().result()[ticket.index]
        return rows if ticket.positions is None else rows.take(ticket.positions, axis=0)

    def _pull_batch(self, batch: list[_Ticket]) -> None:
        """One pull for the tickets of a step (per `insert`): one entry per table, of the
        distinct keys of all its tickets (a table shared by several features or layers)."""
        for insert in (True, False):
            group = [t for t in batch if t.insert == insert]
            if not group:
                continue
            tables, picks = one_entry_per_table([(t.table, t.dim, t.keys) for t in group])
            for t, (index, positions) in zip(group, picks, strict=True):
                t.index, t.positions = index, positions
            try:
                rows = self._rows_read_ahead(tables) if insert else None
                if rows is None:
                    rows = self.pull(tables, insert)
            except BaseException as e:
                for t in group:
                    t.pulled().set_exception(e)
                raise
            for t in group:
                future = t.pulled()
                if not future.done():
                    future.set_result(rows)

    def _rows_read_ahead(self, tables: Tables) -> list[np.ndarray] | None:
        """The rows read ahead for this step's `tables`; None if none were."""
        with self._lock:
            read = self._read_ahead.take(tables)
            step = self._step + 1
        return self._read_ahead.rows(read, tables, step)

    def push_gradient(self, table: str, dim: int, keys: np.ndarray, grads: np.ndarray) -> None:
        """A layer's gradient; the step is pushed when all layers that pulled have pushed."""
        with self._lock:
            self._step_pushes.setdefault(table, []).append((keys, grads))
            self._step_dims[table] = dim
            self._received_pushes += 1
            if self._received_pushes >= self._expected_pushes:
                self._send_unsent_pushes()
        self._pushes.raise_errors()

    def _send_unsent_pushes(self) -> None:
        """Starts the push of the current step's gradients (caller holds `_lock`)."""
        if not self._received_pushes:
            return
        tables = {
            name: (
                self._step_dims[name],
                np.concatenate([k for k, _ in parts]),
                np.concatenate([g for _, g in parts]),
            )
            for name, parts in self._step_pushes.items()
        }
        self._step_pushes, self._received_pushes, self._expected_pushes = {}, 0, 0
        self._start_push(tables)
