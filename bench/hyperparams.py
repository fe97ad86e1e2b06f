"""Embedding dimension, table optimizer and learning rate: what each costs and reaches.

The model of `elastic-emb demo` (`elastic_emb.examples.dlrm.build_dlrm`: 26
`ee.Embedding` tables, an MLP compiled with Adam at 1e-3) on the demo's
generated Criteo-format data with a planted signal, trained once per point
of a grid: dims x table optimizers x learning rates (by default each
optimizer at the demo's learning rate, `DEMO_LEARNING_RATES`). Every point
gets the same data, seed and dense network; only the tables differ.

For each point: test AUC, its difference from the demo's defaults (dim 16,
Adagrad at 0.05: the reference, trained in the same run), the tables' bytes
per row (`memory_bytes` over rows: values, slots, metadata, index), and the
training time (wall and this process's CPU) with its ratio to the
reference's. The best reachable AUC (the generator's own model) and the AUC
of the dense features alone (no ids, `elastic_emb.examples.demo.dense_only_auc`)
frame the figures. The points run one after another, so the times share the
machine's noise less than interleaved variants would: read them as rough
ratios, the AUCs as the result.

    python bench/hyperparams.py [--examples 750000] [--epochs 1] [--dims 4,8,16,32]
        [--optimizers sgd,adagrad,adam,ftrl] [--lr sgd=0.1,0.5,2] [--seeds 0]

The full grid (16 points at 750,000 examples) takes about 16 demo runs;
`--examples 20000 --dims 8 --optimizers adagrad` checks that it runs.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import _common as c

OPTIMIZERS = {"adagrad": "Adagrad", "adam": "Adam", "ftrl": "Ftrl", "sgd": "SGD"}
REFERENCE = (16, "adagrad")  # the demo's defaults, at the demo's learning rate


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 4,8,16, got {text!r}")
    return values


def _optimizers(text: str) -> list[str]:
    names = text.split(",")
    unknown = sorted(set(names) - set(OPTIMIZERS))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown optimizers {unknown}; known: {sorted(OPTIMIZERS)}"
        )
    return names


def _learning_rates(text: str) -> tuple[str, list[float]]:
    """`NAME=LR[,LR...]` of `--lr`."""
    name, _, rates = text.partition("=")
    try:
        values = [float(v) for v in rates.split(",")]
    except ValueError:
        values = []
    if name not in OPTIMIZERS or not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(
            f"--lr: expected NAME=LR[,LR...] with NAME in {sorted(OPTIMIZERS)} and positive "
            f"rates, got {text!r}"
        )
    return name, values


def train_one(
    dim: int, optimizer: str, lr: float, seed: int, data: tuple[Any, Any], args: argparse.Namespace
) -> dict[str, Any]:
    """Trains the demo's model with tables of `dim` trained by `optimizer` at `lr`; its figures.

    A step that meets a non-finite gradient (a learning rate too large) stops the run:
    its AUC is NaN and `failed` says why.
    """
    import keras
    import tensorflow as tf

    import elastic_emb as ee
    from elastic_emb.examples import criteo
    from elastic_emb.examples.dlrm import build_dlrm

    train, test = data
    keras.utils.set_random_seed(seed)
    layers: list[ee.Embedding] = []

    def embedding(i: int) -> ee.Embedding:
        table_optimizer = getattr(ee.optimizers, OPTIMIZERS[optimizer])(learning_rate=lr)
        table_seed = None if seed == 0 else 1000 * seed + i  # seed 0: the demo's initial rows
        layer = ee.Embedding(dim, optimizer=table_optimizer, name=f"C{i + 1}", seed=table_seed)
        layers.append(layer)
        return layer

    model = build_dlrm(embedding, seed=seed)
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=args.dense_lr), loss="binary_crossentropy"
    )
    result: dict[str, Any] = {"failed": None}
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        model.fit(*train, batch_size=args.batch_size, epochs=args.epochs, shuffle=True, verbose=0)
    except (ValueError, tf.errors.OpError) as e:  # the tables' nonfinite="raise", through TF
        result["failed"] = "non-finite gradient" if "finite" in str(e) else type(e).__name__
    result["wall"], result["cpu"] = time.perf_counter() - wall, time.process_time() - cpu
    result["auc"] = float("nan")
    if result["failed"] is None:
        scores = model.predict(test[0], batch_size=8192, verbose=0)[:, 0]
        result["auc"] = criteo.auc(test[1], scores)
    rows = sum(len(layer.table) for layer in layers)
    result["bytes_per_row"] = sum(layer.table.memory_bytes() for layer in layers) / max(rows, 1)
    result["rows"] = rows
    layers.clear()
    del model
    keras.backend.clear_session()
    gc.collect()
    return result


def main() -> None:
    from elastic_emb.examples.demo import DEMO_LEARNING_RATES, QUICK_DEMO

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=QUICK_DEMO[0], help="training examples")
    parser.add_argument("--test-examples", type=int, default=100_000)
    parser.add_argument("--epochs", type=int, default=QUICK_DEMO[1])
    parser.add_argument("--batch-size", type=int, default=2048, help="as the demo's")
    parser.add_argument("--dims", type=_ints, default=[4, 8, 16, 32])
    parser.add_argument("--optimizers", type=_optimizers, default=list(OPTIMIZERS))
    parser.add_argument(
        "--lr",
        type=_learning_rates,
        action="append",
        default=[],
        metavar="NAME=LR[,LR...]",
        help="the learning rates of one optimizer (repeatable); default: the demo's "
        + ", ".join(f"{k} {v:g}" for k, v in sorted(DEMO_LEARNING_RATES.items())),
    )
    parser.add_argument("--dense-lr", type=float, default=1e-3, help="the MLP's Adam (as the demo)")
    parser.add_argument(
        "--seeds", type=lambda t: [int(v) for v in t.split(",")], default=[0],
        help="model seeds (initial rows, dense weights, shuffling); AUC averaged over them",
    )  # fmt: skip
    parser.add_argument("--data-seed", type=int, default=0)
    args = parser.parse_args()
    if min(args.examples, args.test_examples, args.epochs, args.batch_size) < 1:
        raise SystemExit("--examples, --test-examples, --epochs and --batch-size must be >= 1")
    rates = {name: [DEMO_LEARNING_RATES[name]] for name in OPTIMIZERS} | dict(args.lr)

    from elastic_emb.examples.demo import dense_only_auc

    t0 = time.perf_counter()
    train, test, info = c.train_and_test(args.examples, args.test_examples, args.data_seed)
    dense_auc = dense_only_auc(train, test)
    print(f"data: {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    # An untimed warm-up (TensorFlow's first traces and allocations), so that the first
    # point timed, the reference, does not pay for them.
    n = min(len(train[1]), 8 * args.batch_size)
    head = ({k: v[:n] for k, v in train[0].items()}, train[1][:n])
    train_one(*REFERENCE, DEMO_LEARNING_RATES["adagrad"], args.seeds[0], (head, head), args)

    points = [(*REFERENCE, DEMO_LEARNING_RATES["adagrad"])]  # the reference, first
    points += [
        (dim, name, lr)
        for dim in args.dims
        for name in args.optimizers
        for lr in rates[name]
        if (dim, name, lr) != points[0]
    ]
    results = {}
    for dim, name, lr in points:
        runs = [train_one(dim, name, lr, seed, (train, test), args) for seed in args.seeds]
        results[dim, name, lr] = runs
        auc = statistics.fmean(r["auc"] for r in runs)
        print(
            f"dim {dim:>3} {name:<8} lr {lr:<8g} AUC {auc:.4f}  "
            f"{statistics.median(r['wall'] for r in runs):.1f} s",
            file=sys.stderr,
            flush=True,
        )

    reference = results[points[0]]
    ref_auc = statistics.fmean(r["auc"] for r in reference)
    ref_wall = statistics.median(r["wall"] for r in reference)
    rows = []
    for (dim, name, lr), runs in results.items():
        aucs = [r["auc"] for r in runs]
        auc = statistics.fmean(aucs)
        spread = f" ± {(max(aucs) - min(aucs)) / 2:.4f}" if len(aucs) > 1 else ""
        wall = statistics.median(r["wall"] for r in runs)
        failed = next((r["failed"] for r in runs if r["failed"]), None)
        rows.append(
            [
                dim,
                OPTIMIZERS[name],
                f"{lr:g}",
                f"{auc:.4f}{spread}" if failed is None else f"diverged ({failed})",
                f"{auc - ref_auc:+.4f}" if failed is None else "",
                f"{statistics.median(r['bytes_per_row'] for r in runs):.0f}",
                f"{wall:.1f}",
                f"{statistics.median(r['cpu'] for r in runs):.1f}",
                c.fmt_ratio(wall / ref_wall),
            ]
        )
    headers = ["dim", "optimizer", "lr", "test AUC", f"Δ AUC vs dim 16 Adagrad {points[0][2]:g}"]
    headers += ["bytes/row", "train s (wall)", "train s (CPU)", "× reference time"]
    print(
        f"\n`{c.command_line()}`: {args.examples:,} training and {args.test_examples:,} test "
        f"examples, {args.epochs} epoch(s), batch {args.batch_size}, 26 tables, dense Adam "
        f"{args.dense_lr:g}, seeds {args.seeds}; best reachable AUC {info['oracle_auc']:.4f}, "
        f"dense features alone {dense_auc:.4f}; {c.machine()}\n"
    )
    print(c.markdown_table(headers, rows))


if __name__ == "__main__":
    main()
