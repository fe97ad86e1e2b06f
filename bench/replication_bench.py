"""Replicated PS groups: the cost of R=2, failover and copy times, live slot moves.

Real etcd and `elastic-emb serve --coordinator` processes on 127.0.0.1
(`elastic_emb.ps.coord.local_cluster.LocalCluster`), a worker driving a remote
table through `ee.Table.pull` / `push` in sync mode (no Keras: the PS path
alone, so the ratio is the replication's own cost).

- throughput: steps/s with 2 replicas per group against 1, two groups each,
  interleaved rounds, median of the per-round ratios (target >= 0.85x); with R=2, also the
  CPU per step of a primary and of a backup.
- failover: a worker trains while the primary of group 0 is killed with
  SIGKILL; kill -> next completed step, over --kills kills (a new server
  joins after each kill, so every kill hits a group of two).
- copy: a new server joins a group holding --rows rows: the time from its
  registration to its admission as a backup, rows/s.
- move: live resharding while a worker trains; a group (R=1) holding --rows
  rows, a new server forms a second group and half the slots move onto it
  (scale-out), then it is drained and they move back (scale-in): seconds
  from the planned move to its cutover, rows/s, and the worker's step time
  before and during each move.

    python bench/replication_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import threading
import time

import numpy as np

import elastic_emb as ee
from elastic_emb.ps.coord.local_cluster import LocalCluster, drain_server
from elastic_emb.tables import sharding

DIM = 16
KEYS_PER_STEP = 4096


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{os.cpu_count()} cores, {cpu}, Python {platform.python_version()}"


def step(table: ee.Table, rng: np.random.Generator, vocab: int) -> None:
    keys = np.unique(rng.integers(0, vocab, KEYS_PER_STEP))
    rows = table.pull(keys)
    table.push(keys, (rows * 0.01 + 0.001).astype(np.float32))


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes used so far (Linux /proc)."""
    total = 0
    for pid in pids:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def steps_per_second(
    cluster: LocalCluster, seconds: float, name: str
) -> tuple[float, float, float, float, float]:
    """Steps/s; the servers' and the worker's CPU milliseconds per step; and per step the
    CPU milliseconds of the primaries and of the backups (each, on average)."""
    ee.init(coordinator=cluster.coordinator, mode="sync")
    try:
        table = ee.Table(DIM, optimizer=ee.optimizers.Adagrad(0.05), name=name)
        rng = np.random.default_rng(0)
        for _ in range(5):  # warm up
            step(table, rng, 1_000_000)
        servers = {a: p.pid for a, p in cluster.servers.items()}
        before = {a: cpu_seconds([pid]) for a, pid in servers.items()}
        worker_cpu = time.process_time()
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            step(table, rng, 1_000_000)
            n += 1
        rate = n / (time.perf_counter() - start)
        ms = {a: 1000 * (cpu_seconds([pid]) - before[a]) / n for a, pid in servers.items()}
        primaries = set(cluster.primaries())
        backups = [v for a, v in ms.items() if a not in primaries]
        return (
            rate,
            sum(ms.values()),
            1000 * (time.process_time() - worker_cpu) / n,
            statistics.mean(v for a, v in ms.items() if a in primaries),
            statistics.mean(backups) if backups else 0.0,
        )
    finally:
        ee.shutdown()


def throughput(rounds: int, seconds: float) -> None:
    print("\n## Throughput: sync steps/s, 2 groups, R=2 against R=1\n")
    print(f"{KEYS_PER_STEP} keys per step (pull + Adagrad push), dim {DIM}\n")
    print(
        "CPU ms / step: the servers' (all of them) and the worker's, over the same steps; "
        "with R=2 also one primary's and one backup's (each, on average)\n"
    )
    print(
        "| round | R=1 steps/s | R=2 steps/s | R=2 / R=1 | R=1 CPU ms/step: servers, worker "
        "| R=2 CPU ms/step: servers, worker | R=2: a primary, a backup |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    ratios = []
    with LocalCluster(2, 1) as one, LocalCluster(2, 2) as two:
        for r in range(rounds):
            a, a_servers, a_worker, _, _ = steps_per_second(one, seconds, f"r1_{r}")
            b, b_servers, b_worker, primary, backup = steps_per_second(two, seconds, f"r2_{r}")
            ratios.append(b / a)
            print(
                f"| {r + 1} | {a:.1f} | {b:.1f} | {b / a:.2f}x | {a_servers:.1f}, {a_worker:.1f} "
                f"| {b_servers:.1f}, {b_worker:.1f} | {primary:.1f}, {backup:.1f} |",
                flush=True,
            )
    print(f"\nMedian R=2 / R=1: **{statistics.median(ratios):.2f}x** (target >= 0.85x)")


def failover(kills: int) -> None:
    print(f"\n## Failover: SIGKILL of a primary -> next completed step, {kills} kills\n")
    times: list[float] = []
    with LocalCluster(1, 2) as cluster:
        ee.init(coordinator=cluster.coordinator, mode="sync")
        table = ee.Table(DIM, optimizer=ee.optimizers.Adagrad(0.05), name="f")
        done: list[float] = []
        stop = threading.Event()
        errors: list[BaseException] = []

        def train() -> None:
            rng = np.random.default_rng(0)
            try:
                while not stop.is_set():
                    step(table, rng, 100_000)
                    done.append(time.monotonic())
            except BaseException as e:
                errors.append(e)

        worker = threading.Thread(target=train)
        worker.start()
        try:
            for _ in range(kills):
                time.sleep(0.5)
                victim = cluster.primaries()[0]
                cluster.kill(victim)  # returns once the process is gone
                killed = time.monotonic()
                while not errors and not any(t > killed for t in done[-3:]):
                    time.sleep(0.001)
                if errors:
                    raise errors[0]
                times.append(next(t for t in done[-3:] if t > killed) - killed)
                newcomer = cluster.start_server()
                # The next victim must have a backup: wait for the newcomer's admission
                # (the map may still list the killed primary and its backup as complete).
                cluster.wait_until(
                    lambda n=newcomer: n in cluster.map().groups[0].members, 60, "a new backup"
                )
        finally:
            stop.set()
            worker.join()
            ee.shutdown()
    ms = sorted(1000 * t for t in times)
    print("| kills | median ms | p90 ms | min ms | max ms |")
    print("| --- | --- | --- | --- | --- |")
    p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
    print(f"| {len(ms)} | {statistics.median(ms):.0f} | {p90:.0f} | {ms[0]:.0f} | {ms[-1]:.0f} |")
    print("\nAll (ms): " + ", ".join(f"{t:.0f}" for t in ms))


def fill(table: ee.Table, rows: int) -> np.ndarray:
    """Rows 0..rows-1, each pushed once; their keys."""
    keys = np.arange(rows, dtype=np.int64)
    for begin in range(0, rows, 1 << 18):
        part = keys[begin : begin + (1 << 18)]
        table.push(part, np.full((len(part), DIM), 0.01, np.float32))
    return keys


def copy(rows: int) -> None:
    print(f"\n## Copy to a new backup: a group holding {rows:,} rows (dim {DIM}, Adagrad)\n")
    with LocalCluster(1, 1) as cluster:
        ee.init(coordinator=cluster.coordinator, mode="sync")
        try:
            table = ee.Table(DIM, optimizer=ee.optimizers.Adagrad(0.05), name="c")
            fill(table, rows)
            cluster.replicas = 2
            start = time.monotonic()
            address = cluster.start_server()
            cluster.wait_until(lambda: cluster.map().groups[0].members == [address], 600, "copy")
            took = time.monotonic() - start
        finally:
            ee.shutdown()
    print("| rows | seconds (start of the process -> backup) | rows/s |")
    print("| --- | --- | --- |")
    print(f"| {rows:,} | {took:.2f} | {rows / took:,.0f} |")


def _watch_move(cluster: LocalCluster) -> tuple[tuple[int, int], float, float]:
    """Waits for the next planned move and its cutover: (slots, planned at, cut over at)."""
    while (m := cluster.map()).move is None:
        time.sleep(0.005)
    planned, move = time.monotonic(), m.move
    end = m.range(move.range).slot_end  # type: ignore[union-attr]
    while cluster.map().move == move:
        time.sleep(0.005)
    return (move.slot, end), planned, time.monotonic()


def move(rows: int, directory: str | None = None) -> None:
    print(f"\n## Slot moves while a worker trains: {rows:,} rows (dim {DIM}, Adagrad, sync, R=1)\n")
    with LocalCluster(1, 1, directory) as cluster:
        ee.init(coordinator=cluster.coordinator, mode="sync")
        try:
            table = ee.Table(DIM, optimizer=ee.optimizers.Adagrad(0.05), name="m")
            keys = fill(table, rows)
            slots = sharding.slot_of(keys)
            steps: list[tuple[float, float]] = []  # (end, seconds) of each step
            stop = threading.Event()

            def train() -> None:
                rng = np.random.default_rng(0)
                while not stop.is_set():
                    start = time.monotonic()
                    step(table, rng, rows)
                    steps.append((time.monotonic(), time.monotonic() - start))

            worker = threading.Thread(target=train)
            worker.start()
            time.sleep(3.0)
            newcomer = cluster.start_server()
            moves = [("scale-out: half the slots to a new group", *_watch_move(cluster))]
            drain = threading.Thread(target=drain_server, args=(cluster.coordinator, newcomer))
            drain.start()
            moves.append(("scale-in: drained, they move back", *_watch_move(cluster)))
            drain.join()
            time.sleep(1.0)
            stop.set()
            worker.join()
        finally:
            ee.shutdown()
    first = moves[0][2]
    before = [s for end, s in steps if end < first]
    print("| move | rows | seconds (planned -> cutover) | rows/s | steps during | "
          "step ms before, median | step ms during, median / max |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for what, (begin, end), planned, cut in moves:
        moved = int(((slots >= begin) & (slots < end)).sum())
        during = [s for t, s in steps if planned <= t <= cut]
        took = cut - planned
        print(
            f"| {what} | {moved:,} | {took:.2f} | {moved / took:,.0f} | {len(during)} | "
            f"{1e3 * statistics.median(before):.1f} | "
            f"{1e3 * statistics.median(during or [0.0]):.1f} / {1e3 * max(during or [0.0]):.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sections", default="throughput,failover,copy,move")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--cluster-dir", help="move: keep etcd's data and the servers' logs here")
    args = parser.parse_args()
    print(f"# Replication benchmark\n\nMachine: {machine()}")
    sections = args.sections.split(",")
    if "throughput" in sections:
        throughput(rounds=2 if args.quick else 5, seconds=3.0 if args.quick else 8.0)
    if "failover" in sections:
        failover(3 if args.quick else args.kills)
    if "copy" in sections:
        copy(200_000 if args.quick else args.rows)
    if "move" in sections:
        move(200_000 if args.quick else args.rows, args.cluster_dir)


if __name__ == "__main__":
    main()
