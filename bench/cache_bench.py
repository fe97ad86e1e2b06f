"""The worker cache of remote rows (issue 12): bytes on the wire, examples/s and AUC.

The demo's DLRM-style model (26 `ee.Embedding` tables, dim 16, Adagrad)
trained for one epoch on generated Criteo-format data with a planted signal,
its tables on 2 `elastic-emb serve` shards on 127.0.0.1, async mode, one
worker; then its test AUC (`model.predict`, pulls with `train=False`). Each
variant gets 2 fresh shards and the same data, seed and batch order:

- no cache (the reference);
- `cache_rows=N, cache_staleness=0`: every pull asks, sending versions; the
  rows are exactly the reference's;
- `cache_staleness=S` for each S of `--staleness`: rows fetched at most S
  steps ago are served from the cache.

Bytes are the client's message sizes (`Cluster.stats()`: requests sent,
responses received, all shards) per training step, over the training only.
CPU time counts this process and both shards. Prints a Markdown table.

    python bench/cache_bench.py [--examples 300000] [--cache-rows 100000] [--staleness 1 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import _common as c
from remote_bench import cpu_seconds, ps_shards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--examples", type=int, default=300_000)
    parser.add_argument("--test-examples", type=int, default=50_000)
    parser.add_argument("--cache-rows", type=int, default=100_000)
    parser.add_argument("--staleness", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import keras

    import elastic_emb as ee
    from elastic_emb.examples import criteo as data
    from elastic_emb.examples.dlrm import build_dlrm

    train, test, info = c.train_and_test(args.examples, args.test_examples, args.seed)
    batch = 4096
    steps = -(-args.examples // batch)

    def run(**cache: int) -> dict[str, float]:
        with ps_shards(2) as shards:
            cluster = ee.init(ps=[s.address for s in shards], mode="async", **cache)
            try:
                keras.utils.set_random_seed(args.seed)
                model = build_dlrm(
                    lambda i: ee.Embedding(16, ee.optimizers.Adagrad(0.05), name=f"C{i + 1}"),
                    seed=args.seed,
                )
                model.compile(keras.optimizers.Adam(1e-3), "binary_crossentropy")
                pids = [os.getpid(), *(s.process.pid for s in shards)]
                cpu0 = sum(cpu_seconds(p) for p in pids)
                wall = time.perf_counter()
                model.fit(*train, batch_size=batch, epochs=1, verbose=0, shuffle=False)
                cluster.flush()
                wall = time.perf_counter() - wall
                cpu = sum(cpu_seconds(p) for p in pids) - cpu0
                stats = cluster.stats()
                counts = cluster.cache.counts() if cluster.cache is not None else None
                scores = model.predict(test[0], batch_size=8192, verbose=0)[:, 0]
            finally:
                ee.shutdown()
        pulled = sum(s["bytes_received"] for s in stats) / steps
        sent = sum(s["bytes_sent"] for s in stats) / steps
        served = 0.0
        if counts is not None:
            keys = sum(counts[k] for k in ("served", "confirmed", "fetched"))
            served = counts["served"] / max(keys, 1)
        return {
            "received": pulled,
            "sent": sent,
            "wall": args.examples / wall,
            "cpu": args.examples / cpu,
            "auc": data.auc(test[1], scores),
            "served": served,
            "confirmed": (counts or {}).get("confirmed", 0),
        }

    variants: list[tuple[str, dict[str, int]]] = [("no cache", {})]
    variants.append(("cache, staleness 0", {"cache_rows": args.cache_rows}))
    for s in args.staleness:
        variants.append(
            (f"cache, staleness {s}", {"cache_rows": args.cache_rows, "cache_staleness": s})
        )
    results = []
    for name, cache in variants:
        results.append((name, run(**cache)))
        print(f"{name}: done", file=sys.stderr)
    base = results[0][1]
    rows = []
    for name, r in results:
        rows.append(
            [
                name,
                f"{r['received'] / 1024:,.1f}",
                f"{r['received'] / base['received']:.2f}",
                f"{r['sent'] / 1024:,.1f}",
                f"{r['served']:.1%}",
                f"{r['wall']:,.0f}",
                f"{r['cpu']:,.0f}",
                f"{r['auc']:.5f}",
                f"{r['auc'] - base['auc']:+.5f}",
            ]
        )
    print(
        f"\n`{c.command_line()}`: {args.examples:,} training examples (one epoch, {steps} steps "
        f"of {batch}), {args.test_examples:,} test; 2 shards on 127.0.0.1, async, one worker; "
        f"cache of {args.cache_rows:,} rows; best reachable AUC {info['oracle_auc']:.4f}; "
        f"{c.machine()}\n"
    )
    headers = ["variant", "KiB received / step", "× no cache", "KiB sent / step"]
    headers += ["keys served by the cache", "examples/s (wall)", "examples/s (CPU, all)"]
    headers += ["test AUC", "Δ AUC"]
    print(c.markdown_table(headers, rows))


if __name__ == "__main__":
    main()
