"""Load-aware slot balancing: a skewed workload before and after the cluster evens it out.

Two clusters of real servers (etcd, `elastic-emb serve --coordinator`, R=1)
run side by side: one without balancing, one with `--balance-threshold`.
A worker (a remote `ee.Table`, pull + Adagrad push, sync) sends steps whose
keys are mostly Zipf-distributed ids (exponent 1.1) all hashing to the
slots of group 0, plus uniform ids over every slot: the hot slots sit on one
server. The balancing cluster is first trained until it has moved slots and
no move is left to plan; then rounds alternate between the two clusters
(A, B, A, B ...), each on a fresh table.

Per round: steps/s (and ids/s), the max/mean of the keys each group served
(counted from the keys sent and the map, not from the servers' meters), and
the max/mean of each server process's CPU seconds (/proc).

    python bench/balance_bench.py [--groups 4] [--rounds 3] [--seconds 8] [--keys 65536]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np

import elastic_emb as ee
from elastic_emb.ps.coord import balance
from elastic_emb.ps.coord.local_cluster import LocalCluster
from elastic_emb.ps.coord.membership import ClusterMap
from elastic_emb.tables import sharding

DIM = 16
HOT_SHARE = 0.75  # of a step's ids: Zipf over ids whose slots are group 0's
THRESHOLD = 1.2


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{os.cpu_count()} cores, {cpu}, Python {platform.python_version()}, no GPU"


class Workload:
    def __init__(self, groups: int, keys: int) -> None:
        self.keys = keys  # ids per step
        ids = np.arange(4_000_000, dtype=np.int64)
        first = sharding.even_ranges(groups)[0][1]
        self.hot = ids[sharding.slot_of(ids) < first]  # group 0's slots, in a fresh map
        self.rng = np.random.default_rng(0)

    def step(self) -> np.ndarray:
        n_hot = int(self.keys * HOT_SHARE)
        ranks = np.minimum(self.rng.zipf(1.1, n_hot), len(self.hot)) - 1
        uniform = self.rng.integers(0, 1 << 40, self.keys - n_hot)
        return np.unique(np.concatenate([self.hot[ranks], uniform]))


def owner_of_slots(m: ClusterMap) -> np.ndarray:
    owner = np.full(sharding.NUM_SLOTS, -1)
    for r in m.ranges:
        owner[r.slot_begin : r.slot_end] = r.group
    return owner


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def train_step(table: ee.Table, keys: np.ndarray) -> None:
    rows = table.pull(keys)
    table.push(keys, (rows * 0.01 + 0.001).astype(np.float32))


def run_round(cluster: LocalCluster, work: Workload, seconds: float, name: str) -> dict:
    """Trains a fresh table for `seconds`: steps/s, and the max/mean of keys and CPU."""
    ee.init(coordinator=cluster.coordinator, mode="sync")
    try:
        table = ee.Table(DIM, optimizer=ee.optimizers.Adagrad(0.05), name=name)
        for _ in range(3):
            train_step(table, work.step())
        m = cluster.map()
        owner = owner_of_slots(m)
        pids = {g.primary: cluster.servers[g.primary].pid for g in m.groups}
        cpu0 = {a: cpu_seconds(p) for a, p in pids.items()}
        served = np.zeros(len(m.groups))
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            keys = work.step()
            train_step(table, keys)
            served += np.bincount(owner[sharding.slot_of(keys)], minlength=len(m.groups))
            n += 1
        elapsed = time.perf_counter() - start
        assert cluster.map().ranges == m.ranges, "the slots moved during a measured round"
        cpu = np.array([cpu_seconds(p) - cpu0[a] for a, p in pids.items()])
        return {
            "steps/s": n / elapsed,
            "keys max/mean": served.max() / served.mean(),
            "cpu max/mean": cpu.max() / cpu.mean(),
            "cpu s/s": cpu.sum() / elapsed,
        }
    finally:
        ee.shutdown()


def balance_first(cluster: LocalCluster, work: Workload, timeout: float) -> tuple[int, float]:
    """Trains until the cluster has moved slots and has had none to plan for a while:
    (moves made, seconds)."""
    ee.init(coordinator=cluster.coordinator, mode="sync")
    try:
        table = ee.Table(DIM, optimizer=ee.optimizers.Adagrad(0.05), name="warm")
        start = last_change = time.monotonic()
        ranges = cluster.map().ranges
        while time.monotonic() - start < timeout:
            train_step(table, work.step())
            m = cluster.map()
            if m.ranges != ranges or m.move is not None:
                ranges, last_change = m.ranges, time.monotonic()
            elif len(ranges) > len(m.groups) and time.monotonic() - last_change > 10:
                return len(ranges) - len(m.groups), time.monotonic() - start
        raise TimeoutError(f"no balanced layout within {timeout} s: {cluster.map().describe()}")
    finally:
        ee.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--keys", type=int, default=65536, help="ids per step (BENCH.md: 65,536)")
    args = parser.parse_args()
    balancing = ["--load-window", "3", "--balance-threshold", str(THRESHOLD),
                 "--balance-after", "2"]  # fmt: skip
    print(f"# Load-aware slot balancing ({machine()})\n")
    print(f"{args.groups} groups (R=1); steps of {args.keys} ids (unique ones pulled and "
          f"pushed, dim {DIM}, Adagrad, sync): {HOT_SHARE:.0%} Zipf(1.1) over ids of group 0's "
          f"slots, the rest uniform. Threshold {THRESHOLD}.\n")  # fmt: skip
    with (
        LocalCluster(args.groups, 1) as fixed,
        LocalCluster(args.groups, 1, server_args=balancing) as balanced,
    ):
        work = Workload(args.groups, args.keys)
        moves, took = balance_first(balanced, work, 300)
        m = balanced.map()
        print(f"Balancing: {moves} moves in {took:.0f} s of training (including 10 s without a "
              f"move); ranges now {[(r.slots, r.group) for r in m.by_slot()]}\n")  # fmt: skip
        reports = balanced.load_reports()
        loads = balance.slot_loads(reports, "keys", [g.primary for g in m.groups])
        print(f"The servers' own meters, last window: max/mean "
              f"{balance.imbalance(m, loads)[0]:.2f}\n")  # fmt: skip
        print("| round | cluster | steps/s | ids/s | keys per group max/mean "
              "| server CPU max/mean | servers' CPU s/s |")  # fmt: skip
        print("| --- | --- | --- | --- | --- | --- | --- |")
        results: dict[str, list[dict]] = {"before": [], "after": []}
        for r in range(args.rounds):
            for label, cluster in (("before", fixed), ("after", balanced)):
                x = run_round(cluster, work, args.seconds, f"{label}_{r}")
                results[label].append(x)
                print(f"| {r + 1} | {label} balancing | {x['steps/s']:.1f} | "
                      f"{x['steps/s'] * args.keys:,.0f} | {x['keys max/mean']:.2f} | "
                      f"{x['cpu max/mean']:.2f} | {x['cpu s/s']:.2f} |", flush=True)  # fmt: skip
    med = {k: {f: statistics.median(x[f] for x in v) for f in v[0]} for k, v in results.items()}
    pairs = zip(results["after"], results["before"], strict=True)
    ratio = [a["steps/s"] / b["steps/s"] for a, b in pairs]
    print(f"\nMedians: keys max/mean {med['before']['keys max/mean']:.2f} before, "
          f"**{med['after']['keys max/mean']:.2f} after** (goal <= {THRESHOLD}); server CPU "
          f"max/mean {med['before']['cpu max/mean']:.2f} before, "
          f"{med['after']['cpu max/mean']:.2f} after; steps/s after / before "
          f"**{statistics.median(ratio):.2f}x**")  # fmt: skip


if __name__ == "__main__":
    main()
