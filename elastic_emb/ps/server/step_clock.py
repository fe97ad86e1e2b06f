"""`StepClock`: one shard's training mode and step protocol. Workers join with a mode (sync,
async, bounded staleness) and push their steps in order; the clock says when a pull may read
a step, queues a sync step's pushes until every worker pushed it and then has it applied in
worker order (the same sums on every replica), holds steps back while a save writes, and
hands its state to another replica or range. It keeps no tables: a sync step is applied by
the callback it is given."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from elastic_emb.ps.server.request_error import RequestError, invalid
from elastic_emb.ps.wire.protocol import NOT_JOINED, OTHER_JOB

__all__ = ["ASYNC", "MAX_PUSHES_IN_FLIGHT", "MODE_NAMES", "SYNC", "StepClock"]

# Training modes (the wire's Mode values).
ASYNC, SYNC = 0, 1
MODE_NAMES = {ASYNC: "ASYNC", SYNC: "SYNC"}
# A worker's pushes leave in the background: its pull may overtake them.
MAX_PUSHES_IN_FLIGHT = 4

# One table's part of a worker's push: (table name, keys, gradients).
Part = tuple[str, np.ndarray, np.ndarray]
# Applies sync step `step`: table name -> its (keys, gradients) parts, in worker order.
ApplyStep = Callable[[int, dict[str, list[tuple[np.ndarray, np.ndarray]]]], None]


class StepClock:
    """Who joined, who pushed which step, what is applied.

    Thread-safe. The fields after `_cond` are read and written only under
    it: the public methods take it; the private ones (`_step`, `_late`,
    `_workers`, `_step_complete`, `_apply_complete_steps`, `_wait_until`)
    expect the caller to hold it.
    """

    def __init__(self, apply_step: ApplyStep) -> None:
        self._apply_step = apply_step  # called under _cond, one sync step at a time, in order
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # a step applied, a worker came or went
        # Guarded by _cond:
        # ASYNC without a staleness bound: worker -> what its pulls wait on (its own push;
        # one condition each, so that a push wakes its worker's pulls only).
        self._own_push: dict[int, threading.Condition] = {}
        self._furthest = 0  # the furthest step pushed
        self._mode: int | None = None  # set by the first Join
        self._num_workers = 1
        self._elastic = False  # set by the first Join: workers come and go
        self._live: set[int] = set()  # elastic: the workers that joined and have not left
        self._staleness = -1
        self._pushed: dict[int, int] = {}  # worker -> last step pushed
        self._applying: set[int] = set()  # ASYNC: workers whose push is being applied
        self._applied = 0  # SYNC: steps applied
        self._hold: int | None = None  # SYNC: apply no step after this one (a save)
        # SYNC: step -> worker -> its pushed parts, applied in worker order once
        # every worker pushed (the same sums everywhere).
        self._pending: dict[int, dict[int, list[Part]]] = {}
        # SYNC: (worker, step, parts) of late pushes (`_apply_late`) that came while a save
        # held the steps, applied when it ends.
        self._held_late: list[tuple[int, int, list[Part]]] = []
        self._gone: str | None = None  # why the shard serves no more (its range moved away)

    # Workers.

    def join(
        self,
        worker: int,
        num_workers: int,
        mode: int,
        staleness: int,
        elastic: bool = False,
        again: bool = False,
    ) -> int:
        """Registers a worker; returns the step it continues from.

        Fixed workers (not `elastic`): every worker joins with the same
        (mode, num_workers, staleness), and steps wait for workers
        0..num_workers-1. Elastic: workers join (at the current step) and
        `leave` at any time; they must agree on (mode, staleness), and steps
        wait for the workers that joined and have not left. An elastic
        worker that joins `again` (its lease lapsed, the shard counted it as
        gone) goes on from its own step: its pushes of sync steps applied
        without it are applied on their own as they come (`push`).
        """
        if num_workers < 1 or not 0 <= worker < (1 << 30 if elastic else num_workers):
            raise invalid(f"worker {worker} of {num_workers}: need 0 <= worker < num_workers")
        if mode not in MODE_NAMES:
            raise invalid(f"Unknown mode {mode}")
        wanted = (mode, staleness, elastic) if elastic else (mode, num_workers, staleness, elastic)
        with self._cond:
            ours = (
                (self._mode, self._staleness, self._elastic)
                if elastic
                else (self._mode, self._num_workers, self._staleness, self._elastic)
            )
            if self._mode is not None and ours != wanted:
                what = "(mode, staleness, elastic)" if elastic else "(mode, num_workers, staleness)"
                current = (MODE_NAMES[self._mode], *ours[1:])
                asked = (MODE_NAMES[mode], *wanted[1:])
                if not elastic:
                    current, asked = current[:3], asked[:3]
                if self._elastic != elastic:
                    what, current, asked = "elastic", (self._elastic,), (elastic,)
                raise RequestError(
                    "FAILED_PRECONDITION",
                    f"worker {worker} joined with {what} = {asked}; {OTHER_JOB} {current}",
                )
            self._mode, self._num_workers = mode, num_workers
            self._staleness, self._elastic = staleness, elastic
            step = self._applied if self._mode == SYNC else self._pushed.get(worker, 0)
            if not (again and elastic and worker in self._pushed):
                self._set_pushed(worker, max(self._pushed.get(worker, 0), step))
            if elastic:
                self._live.add(worker)
            return step

    def leave(self, worker: int) -> int:
        """An elastic worker leaves: no step waits for it any more. Returns the shard's step."""
        with self._cond:
            if not self._elastic:
                raise RequestError(
                    "FAILED_PRECONDITION", "only elastic workers leave (this shard has fixed ones)"
                )
            self._live.discard(worker)
            if self._mode == SYNC:
                self._apply_complete_steps()
            self._wake_all()
            return self._step()

    def retire(self, why: str) -> None:
        """Waiting and later requests are refused (ABORTED) with `why`."""
        with self._cond:
            self._gone = why
            self._wake_all()

    def check_worker(self, worker: int, step: int) -> None:
        """Refuses a request of `worker` for `step` that the shard does not take."""
        with self._cond:
            gone, elastic, live = self._gone, self._elastic, worker in self._live
            joined, num_workers = self._mode is not None, self._num_workers
        if gone is not None:
            raise RequestError("ABORTED", gone)
        if elastic and not live:
            raise RequestError(
                "FAILED_PRECONDITION",
                f"worker {worker} {NOT_JOINED} (it left, or its lease expired): it must join again",
            )
        if not elastic and joined and not 0 <= worker < num_workers:
            raise invalid(f"worker {worker} is not one of the {num_workers} workers that joined")
        if step < 1:
            raise invalid(f"wrong step {step}: steps start at 1")

    # Pulls.

    def check_pull_step(self, worker: int, step: int) -> None:
        """Refuses a pull of a step beyond the pushes `worker` may have in flight."""
        with self._cond:
            last = self._pushed.get(worker, 0)
            if step > last + 1 + MAX_PUSHES_IN_FLIGHT:
                raise invalid(
                    f"wrong step {step}: worker {worker} has pushed step {last}, "
                    f"so it can pull step {last + 1 + MAX_PUSHES_IN_FLIGHT} at most"
                )

    def wait_to_pull(self, worker: int, step: int, timeout: float) -> float:
        """Blocks a pull for `step` until the mode allows it; the seconds it waited.

        Always: the worker's own push of step - 1 has arrived (it may still be
        in flight). SYNC: step - 1 is applied. Bounded staleness s: every
        worker has pushed step - 1 - s.
        """

        def ready() -> bool:
            if self._gone is not None:
                raise RequestError("ABORTED", self._gone)
            return not self._late(worker, step)[0]

        def timed_out() -> RequestError:
            _, late, what = self._late(worker, step, who=True)
            why = (
                f"workers {late} have not pushed it (stopped or dead?)"
                if late
                else f"a checkpoint holds step {self._hold} back"
            )
            return RequestError(
                "DEADLINE_EXCEEDED",
                f"worker {worker} waited {timeout:g} s to pull step {step}: {what}; {why}. "
                f"Steps pushed: {dict(sorted(self._pushed.items()))}",
            )

        with self._cond:
            if ready():
                return 0.0
            began = time.monotonic()
            own = self._mode == ASYNC and self._staleness < 0  # only its own push to wait for
            cond = self._own_push.setdefault(worker, threading.Condition(self._lock))
            self._wait_until(ready, timeout, timed_out, cond if own else self._cond)
            return time.monotonic() - began

    # Pushes.

    def push(
        self, worker: int, step: int, queue: Callable[[], list[Part]], apply: Callable[[], None]
    ) -> int:
        """Takes `worker`'s push of `step` once; returns the shard's step.

        SYNC: `queue()` (called under the lock) gives the push's parts, applied
        with the other workers' once every worker pushed the step; a push of
        a step applied without it (it was gone, and joined `again`) is
        applied on its own (`_apply_late`). ASYNC: `apply()` applies it at
        once, outside the lock. A step pushed again (after a failover) is
        taken once.
        """
        with self._cond:
            last = self._pushed.get(worker, 0)
            if step <= last and worker not in self._applying:
                return self._step()  # sent again after a failover: applied once already
            if step != last + 1 or worker in self._applying:
                raise invalid(
                    f"wrong step {step}: worker {worker} pushed step {last} "
                    f"last, so its next push is step {last + 1}"
                    + (" (once that one is applied)" if worker in self._applying else "")
                )
            if self._mode == SYNC:
                self._set_pushed(worker, step)
                if step <= self._applied:
                    self._apply_late(worker, step, queue())
                    self._cond.notify_all()  # its own pull of step + 1 may wait for it
                    return self._applied
                self._pending.setdefault(step, {})[worker] = queue()
                self._apply_complete_steps()
                return self._applied
            self._applying.add(worker)
        # ASYNC: the step counts as pushed once applied, so the worker's next
        # pull reads its own update.
        try:
            apply()
        finally:
            with self._cond:
                self._applying.discard(worker)
                self._set_pushed(worker, step)
                if worker in self._own_push:
                    self._own_push[worker].notify_all()
                if self._staleness >= 0:  # the bound's waits depend on every worker's pushes
                    self._cond.notify_all()
        with self._cond:
            return self._step()

    # Saves.

    def hold_at(self, after_step: int) -> bool:
        """SYNC with `after_step`: applies no later step until `release_hold`; whether it holds.

        Refuses (FAILED_PRECONDITION) once a later step is applied, or while
        another save holds a step.
        """
        with self._cond:
            if not (after_step and self._mode == SYNC):
                return False
            if self._applied > after_step or self._hold is not None:
                other = "" if self._hold is None else f" and another save holds step {self._hold}"
                raise RequestError(
                    "FAILED_PRECONDITION",
                    f"cannot hold at step {after_step}: step {self._applied} is applied{other}",
                )
            self._hold = after_step
            return True

    def release_hold(self) -> None:
        """Ends `hold_at`: the late pushes and the steps every worker pushed meanwhile are
        applied."""
        with self._cond:
            self._hold = None
            for worker, step, parts in self._held_late:
                self._apply_step(step, _by_table([(worker, parts)]))
            self._held_late = []
            self._apply_complete_steps()
            self._wake_all()

    def wait_applied(self, after_step: int, timeout: float) -> tuple[int, dict[int, int]]:
        """SYNC with `after_step`: waits until that step is applied. Returns the shard's step
        and each worker's last step pushed, then."""
        with self._cond:
            if after_step and self._mode == SYNC:

                def timed_out() -> RequestError:
                    late = [w for w in self._workers() if self._pushed.get(w, 0) < after_step]
                    return RequestError(
                        "DEADLINE_EXCEEDED",
                        f"waited {timeout:g} s to save after step {after_step}: workers "
                        f"{late} have not pushed it (stopped or dead?)",
                    )

                self._wait_until(lambda: self._applied >= after_step, timeout, timed_out)
            return self._step(), dict(self._pushed)

    # Reading.

    def worker_steps(self) -> dict[int, int]:
        """The last step each worker that joined pushed."""
        with self._cond:
            if self._mode is None:
                return {}
            return {w: self._pushed.get(w, 0) for w in self._workers()}

    def mode_name(self) -> str | None:
        """ "sync" or "async" once a worker joined, else None."""
        with self._cond:
            mode = self._mode
        return None if mode is None else MODE_NAMES[mode].lower()

    def step(self) -> int:
        """Steps applied (SYNC) or the furthest step pushed (ASYNC)."""
        with self._cond:
            return self._step()

    # Copies (a replica's snapshot, a range move).

    def export(self) -> tuple[dict[str, Any], list[tuple[int, int, list[Any]]]]:
        """The state (JSON-ready) and the pushes of sync steps not applied yet."""
        with self._cond:
            state = {
                "mode": self._mode,
                "num_workers": self._num_workers,
                "elastic": self._elastic,
                "live": sorted(self._live),
                "staleness": self._staleness,
                "pushed": {str(w): step for w, step in self._pushed.items()},
                "applied": self._applied,
            }
            pending = list(self._held_late) + [
                (worker, step, parts)
                for step, workers in sorted(self._pending.items())
                for worker, parts in sorted(workers.items())
            ]
        return state, pending

    def install(self, state: dict[str, Any], pending: list[tuple[int, int, list[Any]]]) -> None:
        """Replaces the whole state with an `export`ed one (the tables hold the exported
        rows already: late pushes a save held back are applied to them)."""
        with self._cond:
            self._mode, self._num_workers = state["mode"], state["num_workers"]
            self._elastic, self._live = state["elastic"], set(state["live"])
            self._staleness, self._applied = state["staleness"], state["applied"]
            self._pushed = {int(w): step for w, step in state["pushed"].items()}
            self._furthest = max(self._pushed.values(), default=0)
            self._pending, self._held_late = {}, []
            for worker, step, parts in pending:
                if step <= self._applied:
                    # A late push a save held back there: applied now, before any later
                    # step, as the holder applies it when the save ends.
                    self._apply_step(step, _by_table([(worker, parts)]))
                else:
                    self._pending.setdefault(step, {})[worker] = parts
            self._applying = set()
            self._wake_all()

    def keep_pending(
        self, keep: Callable[[np.ndarray], np.ndarray], first: Callable[[], None]
    ) -> None:
        """Runs `first()`, then keeps of each pending push's parts the keys `keep` masks:
        both under the lock, so that no step is applied in between."""
        with self._cond:
            first()

            def kept(parts: list[Part]) -> list[Part]:
                return [(n, k[keep(k)], g[keep(k)]) for n, k, g in parts]

            for workers in self._pending.values():
                for worker, parts in workers.items():
                    workers[worker] = kept(parts)
            self._held_late = [(w, step, kept(parts)) for w, step, parts in self._held_late]

    # Under _cond.

    def _step(self) -> int:
        return self._applied if self._mode == SYNC else self._furthest

    def _set_pushed(self, worker: int, step: int) -> None:
        self._pushed[worker] = step
        self._furthest = max(self._furthest, step)

    def _wake_all(self) -> None:
        """Wakes every waiting call (the rare changes: a worker left, a save, a new state)."""
        self._cond.notify_all()
        for cond in self._own_push.values():
            cond.notify_all()

    def _late(self, worker: int, step: int, who: bool = False) -> tuple[bool, list[int], str]:
        """Whether a pull of `step` by `worker` must wait; the workers it waits for (with
        `who`, else []: a check is O(1) in SYNC); why.

        SYNC waits until step - 1 is applied, even once every worker pushed
        it (a save may hold it back).
        """
        if self._pushed.get(worker, 0) < step - 1:
            return True, [worker], f"its own push of step {step - 1} has not arrived"
        if self._mode == SYNC:
            needed, what = step - 1, f"step {step - 1} must be applied"
        elif self._mode == ASYNC and self._staleness >= 0:
            needed = step - 1 - self._staleness
            what = f"staleness {self._staleness}: every worker must have pushed step {needed}"
        else:
            return False, [], ""
        if needed <= 0 or (self._mode == SYNC and self._applied >= needed):
            return False, [], ""
        if who:
            late = [w for w in self._workers() if self._pushed.get(w, 0) < needed]
            return self._mode == SYNC or bool(late), late, what
        workers = self._live if self._elastic else range(self._num_workers)
        waits = self._mode == SYNC or any(self._pushed.get(w, 0) < needed for w in workers)
        return waits, [], what

    def _workers(self) -> list[int]:
        """The workers every step waits for."""
        return sorted(self._live) if self._elastic else list(range(self._num_workers))

    def _step_complete(self, pushed_by: dict[int, Any]) -> bool:
        if self._elastic:  # (the sizes first: the subset test runs about once a step)
            return (
                bool(pushed_by)
                and len(pushed_by) >= len(self._live)
                and self._live <= pushed_by.keys()
            )
        return len(pushed_by) >= self._num_workers

    def _apply_late(self, worker: int, step: int, parts: list[Part]) -> None:
        """SYNC: `worker`'s push of `step`, applied without it (the worker was gone), is
        applied on its own now: nothing acknowledged is lost. While a save holds the steps,
        it waits with them."""
        if self._hold is not None:
            self._held_late.append((worker, step, parts))
        else:
            self._apply_step(step, _by_table([(worker, parts)]))

    def _apply_complete_steps(self) -> None:
        """SYNC: applies, in order, every step all workers have pushed (up to a held one)."""
        while self._hold is None or self._applied < self._hold:
            entry = self._pending.get(self._applied + 1)
            if entry is None or not self._step_complete(entry):
                return
            del self._pending[self._applied + 1]
            self._apply_step(self._applied + 1, _by_table(sorted(entry.items())))
            self._applied += 1
            self._cond.notify_all()

    def _wait_until(
        self,
        ready: Callable[[], bool],
        timeout: float,
        timed_out: Callable[[], RequestError],
        cond: threading.Condition | None = None,
    ) -> None:
        """Waits on `cond` (default `_cond`) until `ready()`; raises `timed_out()` once
        `timeout` s have passed."""
        deadline = time.monotonic() + timeout
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                raise timed_out()
            (cond or self._cond).wait(left)


def _by_table(
    pushes: list[tuple[int, list[Part]]],
) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    """Table name -> its (keys, gradients) parts, in the order of `pushes` ((worker, parts))."""
    parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for _, pushed in pushes:
        for name, keys, grads in pushed:
            parts.setdefault(name, []).append((keys, grads))
    return parts
