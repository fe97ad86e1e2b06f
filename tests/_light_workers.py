"""Light elastic workers: real clients (`Routing` and `Cluster`, each its own etcd lease,
worker index and connections) without TensorFlow, many per process as threads. Shared by
tests/test_scale.py and bench/scale_bench.py.

Every worker pulls and pushes one SGD table (learning rate 1/8) with gradients of 1, so
a row ends at exactly -count/8, count being how many acknowledged pushes carried its key:
`check_rows` reads every replica and compares.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Callable

import numpy as np
from _replicas import export
from _states import assert_same_state

from elastic_emb.ps.client import shard_client
from elastic_emb.ps.client.cluster import Cluster, ClusterOptions
from elastic_emb.ps.client.routing import Routing
from elastic_emb.tables import sharding
from elastic_emb.tables.policies.optimizers import SGD
from elastic_emb.tables.table import TableConfig

DIM = 8
LEARNING_RATE = 0.125  # 1/8: -count/8 is exact in float32
VOCAB = 100_000


def keys_of(worker: int, step: int, batch: int) -> np.ndarray:
    """The distinct keys worker `worker` pulls and pushes at its `step`-th step."""
    rng = np.random.default_rng((worker, step))
    return np.unique(rng.integers(0, VOCAB, batch)).astype(np.int64)


def separate_connections() -> None:
    """Each worker of this process its own gRPC connections, as separate processes have."""
    option = ("grpc.use_local_subchannel_pool", 1)
    if option not in shard_client.NO_RETRY_OPTIONS:
        shard_client.NO_RETRY_OPTIONS.append(option)


def run_worker(
    coordinator: str,
    mode: str,
    worker: int,
    table: str,
    batch: int,
    go_on: Callable[[int], bool],
    started: Callable[[], None] = lambda: None,
    pulled: Callable[[int], None] = lambda step: None,
    lease_seconds: int = 3,
) -> dict:
    """One worker: steps while `go_on(steps made)`, calling `pulled(step)` between each
    step's pull and push; its report (steps pushed and acknowledged, step end times and
    durations, lease lapses, or the error)."""
    report: dict = {"worker": worker, "steps": 0, "ends": [], "pull": [], "step": []}
    config = TableConfig.make(DIM, SGD(LEARNING_RATE), "zeros", table, 0).to_dict()
    cluster = None
    try:
        routing = Routing(coordinator, connect_timeout=120)
        options = ClusterOptions(
            mode=mode,
            worker_index=worker,
            timeout=600,
            connect_timeout=120,
            failover_timeout=120,
            worker_lease_seconds=lease_seconds,
        )
        cluster = Cluster([], options, routing)
        cluster.create_tables([config])
        started()
        ones = np.ones((batch, DIM), np.float32)
        i = 0
        while go_on(i):
            i += 1
            keys = keys_of(worker, i, batch)
            began = time.monotonic()
            cluster.pull([(table, DIM, keys)], True)
            pull_ended = time.monotonic()
            pulled(i)
            cluster.push({table: (DIM, keys, ones[: len(keys)])})
            report["pull"].append(pull_ended - began)
            report["step"].append(time.monotonic() - began)
            report["ends"].append(time.monotonic())
        cluster.flush()  # every push acknowledged
        report["steps"] = i
        report["lease lapses"] = routing.registrations
    except BaseException as e:  # reported, not raised
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        if cluster is not None:
            try:
                cluster.close()
            except BaseException as e:
                report.setdefault("error", f"close: {type(e).__name__}: {e}")
    return report


def run_in_threads(
    coordinator: str,
    mode: str,
    workers: range,
    table: str,
    batch: int,
    steps: int,
    on_step: Callable[[int, int], None] = lambda worker, steps: None,
) -> list[dict]:
    """`workers` as threads of this process, `steps` steps each; their reports.
    `on_step(worker, steps made)` is called before each step."""
    separate_connections()
    reports: list[dict] = []
    lock = threading.Lock()

    def go_on(worker: int, made: int) -> bool:
        on_step(worker, made)
        return made < steps

    def run(worker: int) -> None:
        r = run_worker(coordinator, mode, worker, table, batch, lambda i: go_on(worker, i))
        with lock:
            reports.append(r)

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(reports, key=lambda r: r["worker"])


def check_rows(groups: list, table: str, reports: list[dict], batch: int) -> int:
    """Every row of `table` is -count/8 on its group's primary, and each backup holds
    exactly the primary's rows; the rows checked. `groups`: the cluster map's groups; each
    report counts steps `first` (default 1) to `steps` of its worker."""
    counts = np.zeros(VOCAB, np.int64)
    for r in reports:
        for step in range(r.get("first", 1), r["steps"] + 1):
            counts[keys_of(r["worker"], step, batch)] += 1
    found = []
    for group in groups:
        primary = export(group.primary, table)
        for backup in group.members:
            other = export(backup, table)
            try:
                assert_same_state(primary, other)
            except AssertionError as e:
                only = np.setdiff1d(primary["keys"], other["keys"])
                at = np.searchsorted(primary["keys"], only)
                raise AssertionError(
                    f"group {group.id}: backup {backup} differs from primary {group.primary}: "
                    f"{len(only)} keys only on the primary, slots "
                    f"{np.unique(sharding.slot_of(only))[:20].tolist()}, values "
                    f"{primary['values'][at[:5], 0].tolist()}, counts {counts[only[:5]].tolist()}"
                    f"; {e}"
                ) from None
        found.append(primary)
    keys = np.concatenate([f["keys"] for f in found])
    values = np.concatenate([f["values"] for f in found])
    expected_keys = np.flatnonzero(counts)
    if len(keys) != len(expected_keys) or not np.array_equal(np.sort(keys), expected_keys):
        raise AssertionError(f"{len(keys)} rows found; {len(expected_keys)} keys were pushed")
    want = (-counts[keys] * LEARNING_RATE).astype(np.float32)[:, None]
    wrong = np.flatnonzero((values != want).any(axis=1))
    if len(wrong):
        k = keys[wrong[0]]
        raise AssertionError(
            f"{len(wrong)} rows differ from -count/8, e.g. key {k}: {values[wrong[0]]} for "
            f"count {counts[k]}"
        )
    return len(keys)


class Training:
    """`workers` light workers stepping in threads until `finish()`, for fault tests and
    benchmarks: `steps()` counts each one's steps so far, `starts[w]` holds when each of
    worker w's steps began (so a step ended when the next one began)."""

    def __init__(
        self, coordinator: str, mode: str, batch: int, workers: int = 2, table: str = "t"
    ) -> None:
        separate_connections()
        self.workers = workers
        self.starts: list[list[float]] = [[] for _ in range(workers)]
        self._stop = threading.Event()
        self.reports: list[dict] = []

        def go_on(worker: int, made: int) -> bool:
            self.starts[worker].append(time.monotonic())
            return not self._stop.is_set()

        def run(worker: int) -> None:
            go = functools.partial(go_on, worker)
            self.reports.append(run_worker(coordinator, mode, worker, table, batch, go))

        self._threads = [threading.Thread(target=run, args=(w,)) for w in range(workers)]
        for t in self._threads:
            t.start()

    def steps(self) -> list[int]:
        return [max(len(s) - 1, 0) for s in self.starts]

    def wait_for(self, more: int, timeout: float = 120) -> None:
        """Until every worker made `more` steps more than now."""
        goal = [s + more for s in self.steps()]
        deadline = time.monotonic() + timeout
        while any(s < g for s, g in zip(self.steps(), goal, strict=True)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers stuck at {self.steps()} steps, short of {goal}")
            if not all(t.is_alive() for t in self._threads):
                raise RuntimeError(f"a worker ended: {self.reports}")
            time.sleep(0.02)

    def recovered(self, since: float, timeout: float = 120) -> float:
        """Seconds from `since` until every worker completed a step begun after it."""
        deadline = time.monotonic() + timeout
        ends = []
        for worker in range(self.workers):
            while True:
                starts = self.starts[worker]
                begun = [i for i, t in enumerate(starts) if t >= since]
                if len(begun) >= 2:  # step begun[0] ended when the next one began
                    ends.append(starts[begun[0] + 1])
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker {worker} completed no step begun after the fault")
                time.sleep(0.01)
        return max(ends) - since

    def slowest_step(self, begin: float, end: float) -> float:
        """The longest step (any worker) that ended within [begin, end]."""
        return max(
            (b - a for s in self.starts for a, b in itertools.pairwise(s) if begin <= b <= end),
            default=0.0,
        )

    def finish(self) -> list[dict]:
        """Stops the workers; their reports (raises if one failed)."""
        self._stop.set()
        for t in self._threads:
            t.join()
        errors = [r["error"] for r in self.reports if "error" in r]
        if errors:
            raise RuntimeError(f"workers failed: {errors}")
        return sorted(self.reports, key=lambda r: r["worker"])
