"""Table microbenchmarks: pull, push (Adagrad) and memory per row, against references.

Every figure is a ratio against a reference measured side by side in the same
run, as the project's BENCH.md asks:

1. pull (find-or-insert with `train=True` + gather) of a batch of existing
   keys, against `np.take` on a dense array with precomputed row indices (the
   random-access floor) and against `tf.lookup.experimental.DenseHashTable`
   find-or-insert + `tf.gather` (what a TensorFlow user has without a plugin).
2. push with Adagrad, against a NumPy implementation of the same update on
   the same rows (checked for equal results first).
3. memory: RSS growth per row of a table of many rows, each configuration in a
   fresh subprocess, against the budget 1.3 × (value + slot bytes) + 16.

Keys: the table of N rows holds N random int64 keys; a Zipf batch draws ranks
over N with exponent ~1.1 and maps rank r to row `perm[r]` of a fixed random
permutation (so hot rows are scattered, in the dense array as in the table);
a uniform batch draws rows uniformly. Each timed sample runs several distinct
batches; variants take turns within each round (rotating the order), and the
reported figure is the median over rounds, the ratio the median of per-round
ratios.

Usage:
    python bench/table_bench.py --quick      # ~1-2 min: 1M rows, memory at 1M rows
    python bench/table_bench.py              # full: 1M and 10M rows, memory at 10M rows
    python bench/table_bench.py --sections pull --rows 1000000 --dims 16
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from _common import machine, markdown_table

BATCH = 65_536
ZIPF_EXPONENT = 1.1
LEARNING_RATE = 0.05
KEY_LIMIT = 2**62  # keys are drawn in [0, KEY_LIMIT): no clash with the sentinels below
EMPTY_KEY, DELETED_KEY = -1, -2  # DenseHashTable sentinels
FILL_CHUNK = 1 << 18  # keys per pull when filling a table


def log(msg: str) -> None:
    """Progress messages go to stderr, so stdout holds only the tables."""
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Reporting


def mkeys(x: float) -> str:
    """Keys/s as M keys/s."""
    return f"{x / 1e6:.2f}"


def human(n: int) -> str:
    """1000000 -> '1M', 10000000 -> '10M', 65536 -> '65,536'."""
    return f"{n // 1_000_000}M" if n % 1_000_000 == 0 else f"{n:,}"


# ---------------------------------------------------------------------------------------------
# Workload


class KeySpace:
    """N distinct random int64 keys; row i of every dense array belongs to keys[i]."""

    def __init__(self, num_rows: int, seed: int, exponent: float = ZIPF_EXPONENT):
        rng = np.random.default_rng(seed)
        keys = np.unique(rng.integers(0, KEY_LIMIT, size=num_rows + num_rows // 1000 + 16))
        while keys.size < num_rows:  # collisions are rare in 2^62: top up
            keys = np.unique(np.concatenate([keys, rng.integers(0, KEY_LIMIT, size=num_rows)]))
        self.keys = rng.permutation(keys)[:num_rows]
        self.num_rows = num_rows
        # Zipf rank r (0 = hottest) lives at row perm[r].
        self.perm = rng.permutation(num_rows)
        cdf = np.cumsum(np.arange(1, num_rows + 1, dtype=np.float64) ** -exponent)
        self.cdf = cdf / cdf[-1]

    def rows(self, rng: np.random.Generator, dist: str, n: int) -> np.ndarray:
        """Row indices (int64 (n,)) of one batch drawn from `dist` ('zipf' or 'uniform')."""
        if dist == "uniform":
            return rng.integers(0, self.num_rows, size=n)
        ranks = np.minimum(np.searchsorted(self.cdf, rng.random(n)), self.num_rows - 1)
        return self.perm[ranks]


@dataclass
class Batch:
    """One batch: row indices into the dense arrays and the keys of those rows."""

    rows: np.ndarray  # int64 (n,)
    keys: np.ndarray  # int64 (n,)
    tf_keys: Any = None  # the keys as a tf.Tensor, made outside the timed region
    grads: np.ndarray | None = None  # float32 (n, dim), for pushes


def make_batches(space: KeySpace, dist: str, count: int, size: int, seed: int) -> list[Batch]:
    """`count` distinct batches of `size` keys from `dist`."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        rows = space.rows(rng, dist, size)
        out.append(Batch(rows, np.ascontiguousarray(space.keys[rows])))
    return out


def fill_table(table: Any, keys: np.ndarray) -> None:
    """Inserts `keys` with pulls (train=True), the path a new key takes in training."""
    for i in range(0, keys.size, FILL_CHUNK):
        table.pull(keys[i : i + FILL_CHUNK], train=True)


# ---------------------------------------------------------------------------------------------
# Timing


def interleave(
    variants: dict[str, Callable[[Batch], object]],
    batches: Sequence[Batch],
    *,
    rounds: int,
    per_sample: int,
) -> dict[str, list[float]]:
    """Keys/s of each variant per round; variants take turns, the order rotating.

    A sample runs `per_sample` consecutive batches (cycling through `batches`,
    the same ones for every variant in a round) after one warm-up sample each.
    """
    names = list(variants)
    keys_per_sample = sum(batches[i % len(batches)].keys.size for i in range(per_sample))
    for name in names:  # warm-up: page faults, tf.function tracing, thread start
        for i in range(per_sample):
            variants[name](batches[i % len(batches)])
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        chosen = [batches[(r * per_sample + i) % len(batches)] for i in range(per_sample)]
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn = variants[name]
            t0 = time.perf_counter()
            for b in chosen:
                fn(b)
            rates[name].append(keys_per_sample / (time.perf_counter() - t0))
    return rates


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of a/b in the same round (a burst of load tends to hit both)."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def spread(xs: list[float]) -> str:
    """(max - min) / median, as a percentage: how noisy a figure is."""
    return f"{100 * (max(xs) - min(xs)) / statistics.median(xs):.0f}%"


# ---------------------------------------------------------------------------------------------
# 1. pull


class DenseHashTableRef:
    """Find-or-insert + gather with `tf.lookup.experimental.DenseHashTable` (key -> row)."""

    def __init__(self, tf: Any, keys: np.ndarray):
        n = keys.size
        buckets = 1 << max(4, int(np.ceil(np.log2(n / 0.75 + 1))))  # no rehash while filling
        self.tf = tf
        self.table = tf.lookup.experimental.DenseHashTable(
            key_dtype=tf.int64,
            value_dtype=tf.int64,
            default_value=-1,
            empty_key=EMPTY_KEY,
            deleted_key=DELETED_KEY,
            initial_num_buckets=buckets,
        )
        # One big insert: a find-or-insert per batch would take minutes for 10M rows.
        self.table.insert(tf.constant(keys), tf.range(n, dtype=tf.int64))
        self.values: Any = None
        self.find_or_insert = tf.function(
            self._find_or_insert,
            input_signature=[
                tf.TensorSpec([None], tf.int64),
                tf.TensorSpec([None, None], tf.float32),
            ],
        )

    def _find_or_insert(self, keys: Any, values: Any) -> Any:
        """Rows of `keys`; missing keys get new rows (n, n+1, ...); then gathers `values`."""
        tf = self.tf
        rows = tf.reshape(self.table.lookup(keys), tf.shape(keys))
        missing = rows < 0
        new_keys, index = tf.unique(tf.boolean_mask(keys, missing))
        new_rows = self.table.size() + tf.range(tf.size(new_keys, out_type=tf.int64))
        self.table.insert(new_keys, new_rows)
        rows = tf.tensor_scatter_nd_update(rows, tf.where(missing), tf.gather(new_rows, index))
        return tf.gather(values, rows)

    def pull(self, batch: Batch) -> np.ndarray:
        """The rows of `batch.keys` as a NumPy array, like `Table.pull`."""
        return self.find_or_insert(batch.tf_keys, self.values).numpy()


def pull_variants(
    table: Any, values: np.ndarray, dht: DenseHashTableRef
) -> dict[str, Callable[[Batch], object]]:
    """The timed pull of ours and of both references."""
    return {
        "ours": lambda b: table.pull(b.keys, train=True),
        "np.take": lambda b: np.take(values, b.rows, axis=0),
        "DenseHashTable": dht.pull,
    }


def bench_pull(args: argparse.Namespace, tf: Any, ee: Any) -> str:
    """Section 1: the pull table."""
    out_rows = []
    for num_rows in args.rows:
        log(f"[pull] {human(num_rows)} rows: keys, DenseHashTable fill")
        space = KeySpace(num_rows, seed=args.seed)
        dht = DenseHashTableRef(tf, space.keys)
        batches = {
            dist: make_batches(space, dist, args.num_batches, args.batch, seed=args.seed + k + 1)
            for k, dist in enumerate(("zipf", "uniform"))
        }
        for bs in batches.values():
            for b in bs:
                b.tf_keys = tf.constant(b.keys)
        for dim in args.dims:
            log(f"[pull] {human(num_rows)} rows, dim {dim}: filling the table and dense arrays")
            table = ee.Table(
                dim=dim,
                optimizer=ee.optimizers.Adagrad(learning_rate=LEARNING_RATE),
                initializer="uniform",
                name=f"pull_{num_rows}_{dim}",
                seed=0,
            )
            t0 = time.perf_counter()
            fill_table(table, space.keys)
            log(f"  table filled in {time.perf_counter() - t0:.1f} s, {len(table):,} rows")
            values = np.random.default_rng(args.seed).random((num_rows, dim), dtype=np.float32)
            dht.values = tf.convert_to_tensor(values)
            # The references must gather the same rows.
            b = batches["zipf"][0]
            np.testing.assert_array_equal(dht.pull(b), np.take(values, b.rows, axis=0))
            for dist, bs in batches.items():
                rates = interleave(
                    pull_variants(table, values, dht),
                    bs,
                    rounds=args.rounds,
                    per_sample=args.per_sample,
                )
                ours = statistics.median(rates["ours"])
                log(
                    f"  {dist}: ours {mkeys(ours)} M keys/s (spread {spread(rates['ours'])}), "
                    f"np.take {mkeys(statistics.median(rates['np.take']))}, "
                    f"DenseHashTable {mkeys(statistics.median(rates['DenseHashTable']))}"
                )
                take, dht_rate = (
                    statistics.median(rates[k]) for k in ("np.take", "DenseHashTable")
                )
                vs_take = paired_ratio(rates["ours"], rates["np.take"])
                vs_dht = paired_ratio(rates["ours"], rates["DenseHashTable"])
                out_rows.append(
                    [
                        f"pull {dist}, {human(num_rows)} rows, dim {dim}",
                        mkeys(ours),
                        mkeys(take),
                        f"{vs_take:.2f}× ({'met' if vs_take >= 0.5 else 'missed'})",
                        mkeys(dht_rate),
                        f"{vs_dht:.2f}× ({'met' if vs_dht >= 10 else 'missed'})",
                        f"{paired_ratio(rates['np.take'], rates['DenseHashTable']):.2f}×",
                        " / ".join(spread(rates[k]) for k in rates),
                        machine(),
                    ]
                )
            del table, values
            dht.values = None
            gc.collect()
        del dht, space, batches
        gc.collect()
    return (
        f"### pull: find-or-insert (train=True) + gather of existing keys, batch "
        f"{args.batch:,} int64 keys -> float32 rows, Adagrad tables, M keys/s "
        f"(median of {args.rounds} rounds; ours runs on the table's pool of "
        f"{ee.build_info()['threads']} threads, np.take on one)\n\n"
        + markdown_table(
            [
                "workload",
                "ours",
                "np.take",
                "ours / np.take (target ≥ 0.5×)",
                "DenseHashTable",
                "ours / DenseHashTable (target ≥ 10×)",
                "np.take / DenseHashTable",
                "spread ours / np.take / DHT",
                "machine",
            ],
            out_rows,
        )
    )


# ---------------------------------------------------------------------------------------------
# 2. push


class NumpyAdagrad:
    """The table's Adagrad update on dense arrays: acc += g²; v -= lr * g / sqrt(acc + eps).

    Gradients of equal rows are summed first (in input order), then each
    distinct row is updated once, as `Table.push` does.
    """

    def __init__(self, values: np.ndarray, lr: float, initial_acc: float, eps: float):
        self.values = values  # float32 (N, dim)
        self.acc = np.full_like(values, initial_acc)
        self.lr = np.float32(lr)
        self.eps = np.float32(eps)

    def push(self, rows: np.ndarray, grads: np.ndarray) -> None:
        """One step: rows int64 (n,), grads float32 (n, dim)."""
        order = np.argsort(rows, kind="stable")  # stable: sums in input order
        sorted_rows = rows[order]
        starts = np.flatnonzero(np.r_[True, sorted_rows[1:] != sorted_rows[:-1]])
        uniq = sorted_rows[starts]
        g = np.add.reduceat(grads[order], starts, axis=0)
        acc = self.acc[uniq] + g * g
        self.acc[uniq] = acc
        self.values[uniq] -= self.lr * g / np.sqrt(acc + self.eps)


def check_push(ee: Any) -> None:
    """Checks once that `Table.push` and `NumpyAdagrad` give the same values."""
    rng = np.random.default_rng(1)
    num_rows, dim = 1000, 8
    keys = rng.permutation(np.arange(10**12, 10**12 + num_rows, dtype=np.int64))
    values = rng.standard_normal((num_rows, dim), dtype=np.float32)
    opt = ee.optimizers.Adagrad(learning_rate=LEARNING_RATE)
    table = ee.Table(dim=dim, optimizer=opt, initializer="zeros", name="push_check", seed=0)
    table.import_rows(keys, values)  # slots reset to the initial accumulator
    ref = NumpyAdagrad(values.copy(), LEARNING_RATE, opt.initial_accumulator_value, opt.epsilon)
    space_rows = np.arange(num_rows)
    for _ in range(3):
        rows = rng.choice(space_rows, size=3000)  # with duplicates
        grads = rng.standard_normal((rows.size, dim), dtype=np.float32)
        table.push(keys[rows], grads)
        ref.push(rows, grads)
    np.testing.assert_allclose(table.pull(keys, train=False), ref.values, rtol=1e-5, atol=1e-6)


def push_ours(table: Any) -> Callable[[Batch], None]:
    """The timed push of ours."""
    return lambda b: table.push(b.keys, b.grads)


def push_numpy(ref: NumpyAdagrad) -> Callable[[Batch], None]:
    """The timed push of the NumPy reference (on precomputed rows: no hashing)."""
    return lambda b: ref.push(b.rows, b.grads)


def bench_push(args: argparse.Namespace, ee: Any) -> str:
    """Section 2: the push table."""
    check_push(ee)
    log("[push] Table.push and the NumPy Adagrad agree on a small case")
    out_rows = []
    num_rows = args.push_rows
    space = KeySpace(num_rows, seed=args.seed)
    batches = make_batches(space, "zipf", args.num_batches, args.batch, seed=args.seed + 7)
    distinct = statistics.median(np.unique(b.rows).size for b in batches)
    grad_rng = np.random.default_rng(args.seed + 8)
    for dim in args.dims:
        log(f"[push] {human(num_rows)} rows, dim {dim}")
        grads = [grad_rng.standard_normal((b.keys.size, dim), dtype=np.float32) for b in batches]
        gbatches = [Batch(b.rows, b.keys, grads=g) for b, g in zip(batches, grads, strict=True)]
        opt = ee.optimizers.Adagrad(learning_rate=LEARNING_RATE)
        table = ee.Table(dim=dim, optimizer=opt, initializer="uniform", name=f"push_{dim}", seed=0)
        fill_table(table, space.keys)
        values = np.random.default_rng(args.seed).random((num_rows, dim), dtype=np.float32)
        ref = NumpyAdagrad(values, LEARNING_RATE, opt.initial_accumulator_value, opt.epsilon)
        rates = interleave(
            {"ours": push_ours(table), "NumPy": push_numpy(ref)},
            gbatches,
            rounds=args.rounds,
            per_sample=args.per_sample,
        )
        ours, numpy_rate = statistics.median(rates["ours"]), statistics.median(rates["NumPy"])
        ratio = paired_ratio(rates["ours"], rates["NumPy"])
        log(
            f"  ours {mkeys(ours)} M keys/s (spread {spread(rates['ours'])}), "
            f"NumPy {mkeys(numpy_rate)}"
        )
        out_rows.append(
            [
                f"push Adagrad zipf, {human(num_rows)} rows, dim {dim}",
                mkeys(ours),
                "NumPy (argsort + reduceat + dense update)",
                mkeys(numpy_rate),
                f"{ratio:.2f}× ({'met' if ratio >= 2 else 'missed'})",
                f"{spread(rates['ours'])} / {spread(rates['NumPy'])}",
                machine(),
            ]
        )
        del table, ref, values
        gc.collect()
    return (
        f"### push: Adagrad step (sum duplicates, one update per distinct key), Zipf batch "
        f"{args.batch:,} keys (median {distinct:,.0f} distinct), float32 grads, M keys/s "
        f"(median of {args.rounds} rounds)\n\n"
        + markdown_table(
            [
                "workload",
                "ours",
                "reference",
                "reference figure",
                "ours / reference (target ≥ 2×)",
                "spread ours / ref",
                "machine",
            ],
            out_rows,
        )
    )


# ---------------------------------------------------------------------------------------------
# 3. memory


MEMORY_CONFIGS = [(16, "sgd"), (16, "adagrad"), (64, "adagrad")]


def rss_bytes() -> int:
    """Resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Resets the kernel's peak-RSS mark (VmHWM) of this process; False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident set size (VmHWM) of this process since start or the last reset."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_child(dim: int, optimizer: str, num_rows: int) -> None:
    """Fills a fresh table with `num_rows` keys; prints its RSS growth as JSON."""
    import elastic_emb as ee

    opt = (
        ee.optimizers.SGD(learning_rate=LEARNING_RATE)
        if optimizer == "sgd"
        else ee.optimizers.Adagrad(learning_rate=LEARNING_RATE)
    )
    table = ee.Table(dim=dim, optimizer=opt, initializer="uniform", name="mem", seed=0)
    rng = np.random.default_rng(0)
    # Warm-up before the baseline: sizes the per-thread scratch and the allocator's pools.
    table.pull(rng.integers(0, KEY_LIMIT, size=FILL_CHUNK), train=False)
    gc.collect()
    base = rss_bytes()
    peak_reset = reset_peak_rss()
    t0 = time.perf_counter()
    for i in range(0, num_rows, FILL_CHUNK):
        table.pull(rng.integers(0, KEY_LIMIT, size=min(FILL_CHUNK, num_rows - i)), train=True)
    seconds = time.perf_counter() - t0
    gc.collect()
    after = rss_bytes()
    peak = peak_rss_bytes()
    print(
        json.dumps(
            {
                "rows": len(table),
                "growth": after - base,
                "peak_growth": peak - base if peak_reset else None,
                "memory_bytes": table.memory_bytes(),
                "num_slots": table.num_slots,
                "fill_seconds": seconds,
            }
        )
    )


def bench_memory(args: argparse.Namespace) -> str:
    """Section 3: the memory table, one fresh subprocess per configuration."""
    out_rows = []
    for dim, optimizer in MEMORY_CONFIGS:
        log(f"[memory] {human(args.memory_rows)} rows, dim {dim}, {optimizer}")
        cmd = [sys.executable, os.path.abspath(__file__), "--memory-child"]
        cmd += [str(dim), optimizer, str(args.memory_rows)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"memory child failed:\n{proc.stderr[-4000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        rows = r["rows"]
        payload = 4 * dim * (1 + r["num_slots"])
        target = 1.3 * payload + 16
        ours = r["growth"] / rows
        log(f"  {ours:.1f} B/row, fill {rows / r['fill_seconds'] / 1e6:.2f} M rows/s")
        out_rows.append(
            [
                f"dim {dim}, {optimizer}, {human(rows)} rows",
                f"{ours:.1f}",
                payload,
                f"{target:.1f}",
                f"{ours / target:.2f}×",
                "met" if ours <= target else "missed",
                "n/a" if r["peak_growth"] is None else f"{r['peak_growth'] / rows:.1f}",
                f"{r['memory_bytes'] / rows:.1f}",
                machine(),
            ]
        )
    return (
        "### memory: bytes per row (RSS growth / rows, one fresh process per configuration, "
        "filled by pulls with train=True; target = 1.3 × (value + slot bytes) + 16)\n\n"
        + markdown_table(
            [
                "workload",
                "ours (B/row)",
                "value + slot bytes",
                "target (B/row)",
                "ours / target",
                "≤ target",
                "peak growth during fill (B/row)",
                "memory_bytes() (B/row)",
                "machine",
            ],
            out_rows,
        )
    )


# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line flags; `--quick` changes the defaults of the size flags."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="~1-2 min run: 1M rows, fewer rounds")
    p.add_argument("--sections", default="pull,push,memory", help="comma-separated subset")
    p.add_argument("--rows", type=int, nargs="+", help="pull table sizes (default 1M 10M)")
    p.add_argument("--dims", type=int, nargs="+", default=[16, 64], help="embedding dims")
    p.add_argument("--batch", type=int, default=BATCH, help="keys per batch")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 81, quick 21)")
    p.add_argument("--per-sample", type=int, default=4, help="batches per timed sample")
    p.add_argument("--num-batches", type=int, default=8, help="distinct batches per workload")
    p.add_argument("--push-rows", type=int, default=1_000_000, help="push table size")
    p.add_argument("--memory-rows", type=int, help="memory table size (default 10M, quick 1M)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--memory-child", nargs=3, metavar=("DIM", "OPT", "ROWS"), help=argparse.SUPPRESS
    )
    args = p.parse_args(argv)
    if args.rows is None:
        args.rows = [1_000_000] if args.quick else [1_000_000, 10_000_000]
    if args.rounds is None:
        args.rounds = 21 if args.quick else 81
    if args.memory_rows is None:
        args.memory_rows = 1_000_000 if args.quick else 10_000_000
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(args.sections) - {"pull", "push", "memory"}
    if unknown:
        p.error(f"unknown sections: {sorted(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Runs the chosen sections and prints their Markdown tables to stdout."""
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.memory_child:
        dim, optimizer, rows = args.memory_child
        memory_child(int(dim), optimizer, int(rows))
        return
    t_start = time.perf_counter()
    import tensorflow as tf

    import elastic_emb as ee

    load_start = os.getloadavg()[0]
    tables = []
    if "pull" in args.sections:
        tables.append(bench_pull(args, tf, ee))
    if "push" in args.sections:
        tables.append(bench_push(args, ee))
    if "memory" in args.sections:
        tables.append(bench_memory(args))
    info = ee.build_info()
    command = " ".join(["python bench/table_bench.py", *(sys.argv[1:] if argv is None else argv)])
    print(
        f"`{command}`: elastic_emb {info['version']} ({info['compiler']}, {info['cxx_flags']}, "
        f"{info['threads']} threads), TensorFlow {tf.__version__}, NumPy {np.__version__}; "
        f"machine: {machine()}; 1-min load average {load_start:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end (other work shares the cores)\n"
    )
    print("\n\n".join(tables))
    log(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
