"""The `elastic-emb` command line: `demo` and `bench`."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _demo(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="elastic_emb_demo_") as tmp:
        return _run_demo(args, Path(tmp))


def _run_demo(args: argparse.Namespace, workdir: Path) -> int:
    import keras

    import elastic_emb as ee
    from elastic_emb import data
    from elastic_emb.models import build_dlrm

    keras.utils.set_random_seed(args.seed)
    oracle = None
    if args.data:
        dense, categorical, labels = data.read_criteo(args.data, max_examples=args.examples)
        split = int(len(labels) * (1 - args.test_fraction))
        if not 0 < split < len(labels):
            print(f"elastic-emb demo: {args.data} has too few examples to split", file=sys.stderr)
            return 2
        n_test = len(labels) - split
        print(f"Read {len(labels):,} examples from {args.data}; testing on the last {n_test:,}")
        train = _features(dense[:split], categorical[:split]), labels[:split]
        test = _features(dense[split:], categorical[split:]), labels[split:]
    else:
        t0 = time.perf_counter()
        info = data.generate_criteo(workdir / "train.tsv", args.examples, seed=args.seed)
        data.generate_criteo(
            workdir / "test.tsv", args.test_examples, seed=args.seed, sample_seed=args.seed + 1
        )
        oracle = info["oracle_auc"]
        train_arrays = data.read_criteo(workdir / "train.tsv")
        test_arrays = data.read_criteo(workdir / "test.tsv")
        print(
            f"Generated {args.examples:,} training and {args.test_examples:,} test examples "
            f"(Criteo format, planted signal; best reachable AUC {oracle:.4f}) "
            f"in {time.perf_counter() - t0:.1f}s"
        )
        train = _features(*train_arrays[:2]), train_arrays[2]
        test = _features(*test_arrays[:2]), test_arrays[2]
    n_train = len(train[1])

    layers: list[ee.Embedding] = []

    def embedding(i: int) -> ee.Embedding:
        layer = ee.Embedding(
            args.dim, optimizer=ee.optimizers.Adagrad(learning_rate=args.lr), name=f"C{i + 1}"
        )
        layers.append(layer)
        return layer

    model = build_dlrm(embedding, seed=args.seed)
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=1e-3),
        loss="binary_crossentropy",
        metrics=[keras.metrics.AUC(name="auc")],
    )
    print(
        f"Training a DLRM-style model on {n_train:,} examples: "
        f"26 ee.Embedding(dim={args.dim}) + MLP, in-process"
    )
    t0 = time.perf_counter()
    model.fit(
        *train, batch_size=args.batch_size, epochs=args.epochs, shuffle=True, verbose=args.verbose
    )
    train_seconds = time.perf_counter() - t0
    scores = model.predict(test[0], batch_size=8192, verbose=0)[:, 0]
    test_auc = data.auc(test[1], scores)

    best = f"  (best reachable {oracle:.4f})" if oracle is not None else ""
    print()
    print(f"test AUC         {test_auc:.4f}{best}")
    print(f"training speed   {n_train * args.epochs / train_seconds:,.0f} examples/s")
    print(f"training time    {train_seconds:.1f}s for {args.epochs} epoch(s)")
    print()
    print(f"{'table':<8}{'rows':>12}{'MiB':>10}{'bytes/row':>11}")
    total_rows = total_bytes = 0
    for layer in layers:
        rows, nbytes = len(layer.table), layer.table.memory_bytes()
        total_rows += rows
        total_bytes += nbytes
        print(
            f"{layer.table.name:<8}{rows:>12,}{nbytes / 2**20:>10.1f}{nbytes / max(rows, 1):>11.0f}"
        )
    print(f"{'total':<8}{total_rows:>12,}{total_bytes / 2**20:>10.1f}")
    return 0


def _features(dense: np.ndarray, categorical: np.ndarray) -> dict[str, np.ndarray]:
    """The model inputs of `build_dlrm`: log-transformed counts and ids."""
    return {"dense": np.log1p(np.maximum(dense, 0)), "categorical": categorical}


def _bench(args: argparse.Namespace) -> int:
    bench_dir = Path(__file__).resolve().parent.parent / "bench"
    script = bench_dir / f"{args.which}.py"
    if not script.is_file():
        print(
            f"elastic-emb bench: {script} not found; the benchmarks live in bench/ of a source "
            "checkout (install it with `pip install -e .`).",
            file=sys.stderr,
        )
        return 2
    os.execv(sys.executable, [sys.executable, str(script), *args.bench_args])
    return 0  # not reached


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elastic-emb", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a DLRM-style CTR model in-process")
    demo.add_argument(
        "--data", help="a real Criteo TSV file (plain or .gz) instead of generated data"
    )
    demo.add_argument("--examples", type=int, default=2_000_000, help="training examples")
    demo.add_argument("--test-examples", type=int, default=100_000, help="generated test examples")
    demo.add_argument("--test-fraction", type=float, default=0.1, help="held out with --data")
    demo.add_argument("--epochs", type=int, default=2)
    demo.add_argument("--batch-size", type=int, default=2048)
    demo.add_argument("--dim", type=int, default=16, help="embedding dimension")
    demo.add_argument("--lr", type=float, default=0.05, help="Adagrad learning rate of the tables")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--verbose", type=int, default=1, help="Keras fit verbosity (0, 1, 2)")
    demo.set_defaults(run=_demo)

    bench = sub.add_parser("bench", help="run a benchmark of bench/ (source checkout)")
    bench.add_argument("which", nargs="?", default="table_bench", help="table_bench or e2e")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    bench.set_defaults(run=_bench)

    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
