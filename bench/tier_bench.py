"""The disk tier's price (issue 12): RAM hit rate and training-step slow-down.

Zipf-distributed ids (exponent 1.1) over a large id space, batches of
65,536 keys, dim 16, Adagrad: each step is a training pull and a push of
the batch, as a layer makes. The reference is the same table all in RAM,
run side by side: the variants take turns, round by round (A, B, C, A, B,
C, ...), and each tiered variant's figure is the median of its per-round
CPU-time ratios to the all-in-RAM table. Tiered variants keep 25 %, 10 %
and 2 % of the rows the warm-up touched in RAM; the rest is in LMDB in a
temporary directory (on this machine's disk, mostly in the page cache).

    python bench/tier_bench.py [--ids 2000000] [--warmup 30] [--rounds 5] [--steps 6]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import _common as c
import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ids", type=int, default=2_000_000, help="size of the id space")
    parser.add_argument("--batch", type=int, default=65_536)
    parser.add_argument("--warmup", type=int, default=30, help="untimed steps that fill the tables")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant per round")
    args = parser.parse_args()

    import elastic_emb as ee

    rng = np.random.default_rng(0)

    def batch() -> tuple[np.ndarray, np.ndarray]:
        keys = (rng.zipf(1.1, size=args.batch) % args.ids).astype(np.int64)
        return keys, rng.normal(size=(args.batch, 16)).astype(np.float32)

    warmup = [batch() for _ in range(args.warmup)]
    touched = len(np.unique(np.concatenate([k for k, _ in warmup])))
    shares = (0.25, 0.10, 0.02)
    with tempfile.TemporaryDirectory() as disk:
        opt = ee.optimizers.Adagrad(0.05)
        tables = {"all in RAM": ee.Table(16, opt, name="ram", seed=1)}
        for share in shares:
            tier = ee.storage.Tiered(int(touched * share), disk)
            tables[f"RAM {share:.0%}"] = ee.Table(16, opt, name=f"t{share}", seed=1, storage=tier)
        for t in tables.values():
            for keys, grads in warmup:
                t.pull(keys)
                t.push(keys, grads)
        before = {n: t.tier_counts() for n, t in tables.items() if hasattr(t, "tier_counts")}
        cpu: dict[str, list[float]] = {name: [] for name in tables}
        wall: dict[str, list[float]] = {name: [] for name in tables}
        for _ in range(args.rounds):
            steps = [batch() for _ in range(args.steps)]
            for name, t in tables.items():
                w, p = time.perf_counter(), time.process_time()
                for keys, grads in steps:
                    t.pull(keys)
                    t.push(keys, grads)
                wall[name].append(time.perf_counter() - w)
                cpu[name].append(time.process_time() - p)
        rows = []
        ram = "all in RAM"
        for name, t in tables.items():
            ratio = statistics.median(a / b for a, b in zip(cpu[name], cpu[ram], strict=True))
            keys_per_s = args.steps * args.batch / statistics.median(cpu[name])
            if hasattr(t, "tier_counts"):
                n, b = t.tier_counts(), before[name]
                ram_hits, disk_hits = n["ram_hits"] - b["ram_hits"], n["disk_hits"] - b["disk_hits"]
                hit = ram_hits / max(ram_hits + disk_hits, 1)
                ram_rows, disk_rows = n["ram_rows"], n["disk_rows"]
                disk_mib = n["disk_bytes"] / 2**20
            else:
                hit, ram_rows, disk_rows, disk_mib = 1.0, len(t), 0, 0.0
            rows.append(
                [
                    name,
                    f"{ram_rows:,}",
                    f"{disk_rows:,}",
                    f"{hit:.1%}",
                    f"{t.memory_bytes() / 2**20:.0f}",
                    f"{disk_mib:.0f}",
                    c.fmt_rate(keys_per_s),
                    f"{ratio:.2f}×",
                ]
            )
    print(
        f"\n`{c.command_line()}`: Zipf 1.1 over {args.ids:,} ids, batch {args.batch:,}, dim 16, "
        f"Adagrad; {touched:,} rows after {args.warmup} warm-up steps; {args.rounds} rounds of "
        f"{args.steps} steps; {c.machine()}\n"
    )
    headers = ["table", "rows in RAM", "rows on disk", "RAM hit rate (rows)", "RAM MiB"]
    headers += ["disk MiB", "keys/s (CPU, pull+push)", "CPU time vs all in RAM"]
    print(c.markdown_table(headers, rows))


if __name__ == "__main__":
    main()
