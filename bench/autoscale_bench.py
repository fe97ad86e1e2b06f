"""Auto-scaling timings: a decision to add a group -> the new group serving its slots, and
a decision to retire one -> its servers stopped, with a table of N rows and a worker
training throughout (async, as the filler; its slowest step during each is reported).

A real cluster (etcd, 1 group x R `elastic-emb serve --coordinator` on 127.0.0.1); the
table (dim 16, Adagrad) is filled with N rows first. The `Autoscaler` is driven through
its own decision path: a minimum of 2 groups makes it add one; then a target no load
reaches makes it retire one. Every row of the worker's SGD table is checked at the end
(-count/8, backups equal to primaries); tests/test_autoscale.py covers sync.

    python bench/autoscale_bench.py [--rows 1000000] [--replicas 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _light_workers import check_rows, run_worker, separate_connections

from elastic_emb.ps.client.cluster import Cluster, ClusterOptions
from elastic_emb.ps.client.routing import Routing
from elastic_emb.ps.coord.autoscale import Autoscaler, ScalingPolicy
from elastic_emb.ps.coord.local_cluster import LocalCluster, LocalLauncher
from elastic_emb.tables.policies.optimizers import Adagrad
from elastic_emb.tables.sharding import NUM_SLOTS
from elastic_emb.tables.table import TableConfig

BATCH = 256


def fill(coordinator: str, rows: int) -> float:
    """Inserts `rows` rows of a dim-16 Adagrad table; seconds taken."""
    began = time.monotonic()
    routing = Routing(coordinator, connect_timeout=120)
    cluster = Cluster([], ClusterOptions(mode="async", worker_index=1000), routing)
    cluster.create_tables([TableConfig.make(16, Adagrad(0.05), "zeros", "big", 0).to_dict()])
    for start in range(0, rows, 200_000):
        keys = np.arange(start, min(start + 200_000, rows), dtype=np.int64)
        cluster.pull([("big", 16, keys)], True)
    cluster.close()
    return time.monotonic() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args()
    r = args.replicas
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    print(f"commit {commit}, {platform.machine()}, {os.cpu_count()} cores; rows {args.rows:,}, "
          f"R={r}")  # fmt: skip
    separate_connections()
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(1, r, tmp) as c:
        print(f"filled {args.rows:,} rows in {fill(c.coordinator, args.rows):.1f} s")
        state: dict = {"stop": False, "report": {}}

        def go_on(steps: int) -> bool:
            time.sleep(0.02)
            return not state["stop"]

        def work() -> None:
            state["report"] = run_worker(c.coordinator, "async", 0, "steps", BATCH, go_on)

        worker = threading.Thread(target=work)
        worker.start()
        time.sleep(3)
        results = []
        layout = {(r.slot_begin, r.group) for r in c.map().ranges}
        grow = ScalingPolicy(2 * r, 2 * r, r, sustain=0, cooldown=0)
        shrink = ScalingPolicy(r, 2 * r, r, target_keys=1e12, sustain=0, cooldown=0)
        for policy in (grow, shrink):
            scaler = Autoscaler(c.coordinator, policy, LocalLauncher(c), interval=0.2)
            began = time.monotonic()
            while scaler.step() is None:
                assert time.monotonic() - began < 600, "no decision"
                time.sleep(0.2)
            # Rows moved: the big table's share of the slots that changed group (ids are
            # hashed, so rows spread evenly over slots).
            after = c.map()
            moved = sum(r.size for r in after.ranges if (r.slot_begin, r.group) not in layout)
            layout = {(r.slot_begin, r.group) for r in after.ranges}
            results.append((scaler.decisions[-1], began, time.monotonic(),
                            args.rows * moved // NUM_SLOTS))  # fmt: skip
            time.sleep(3)
        state["stop"] = True
        worker.join()
        report = state["report"]
        assert "error" not in report, report
        rows = check_rows(c.map().groups, "steps", [report], BATCH)
    print()
    print("| decision | servers | seconds (decision -> done) | rows moved (about) | s per "
          "million rows moved | slowest step during, s |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    for decision, began, ended, moved in results:
        during = [s for s, e in zip(report["step"], report["ends"], strict=True)
                  if began <= e <= ended + 1]  # fmt: skip
        seconds = decision["seconds"]
        print(f"| {decision['action']} a group | {', '.join(decision['servers'])} | "
              f"{seconds:.2f} | {moved:,} | {seconds / max(moved, 1) * 1e6:.2f} | "
              f"{max(during, default=float('nan')):.3f} |")  # fmt: skip
    print(f"\nworker: {len(report['step'])} steps, slowest {max(report['step']):.3f} s; "
          f"{rows:,} rows of its table at exactly -count/8")  # fmt: skip


if __name__ == "__main__":
    main()
