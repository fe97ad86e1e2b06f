"""`elastic-emb demo`: a DLRM-style CTR model on Criteo-format data, end to end.

Generates data with a planted signal (or reads a real Criteo file), trains
with `ee.Embedding` tables in-process (or on PS shards with `--ps`), and
prints the test AUC, the speed and the tables' memory.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["DEMO_LEARNING_RATES", "FULL_DEMO", "QUICK_DEMO", "dense_only_auc", "run"]

# `elastic-emb demo`'s sizes (training examples, epochs): the default and `--full`.
QUICK_DEMO = (750_000, 1)
FULL_DEMO = (2_000_000, 2)
# The tables' learning rate for each `--optimizer` (docs/choosing-hyperparameters.md).
DEMO_LEARNING_RATES = {"adagrad": 0.05, "adam": 0.001, "ftrl": 0.05, "sgd": 0.5}


def run(args: argparse.Namespace) -> int:
    """`elastic-emb demo` with the parsed arguments (see `elastic_emb.cli`)."""
    examples, epochs = FULL_DEMO if args.full else QUICK_DEMO
    args.examples = examples if args.examples is None else args.examples
    args.epochs = epochs if args.epochs is None else args.epochs
    args.lr = DEMO_LEARNING_RATES[args.optimizer] if args.lr is None else args.lr
    for flag in ("examples", "epochs", "batch_size", "dim", "test_examples"):
        if getattr(args, flag) < 1:
            name = "--" + flag.replace("_", "-")
            print(f"elastic-emb demo: {name} must be at least 1", file=sys.stderr)
            return 2
    if not args.lr > 0:
        print("elastic-emb demo: --lr must be positive", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="elastic_emb_demo_") as tmp:
        return _run_demo(args, Path(tmp))


class _Phases:
    """Prints a line as each phase of the demo starts, with the time since the first."""

    def __init__(self, quiet: bool) -> None:
        self._start = time.perf_counter()
        self._quiet = quiet

    def __call__(self, what: str) -> None:
        if not self._quiet:
            print(f"[{time.perf_counter() - self._start:6.1f}s] {what}", flush=True)


def dense_only_auc(train: tuple[Any, Any], test: tuple[Any, Any]) -> float:
    """The test AUC of a logistic regression on the 13 integer features alone (no ids):
    the baseline that the embeddings must beat. Fitted by Newton's method in NumPy."""
    import numpy as np

    from elastic_emb.examples import criteo as data

    def design(x: dict[str, Any]) -> Any:
        dense = np.asarray(x["dense"], np.float64)
        return np.hstack([dense, np.ones((len(dense), 1))])

    features, labels = design(train[0]), np.asarray(train[1], np.float64).reshape(-1)
    mean, std = features.mean(0), features.std(0)
    mean[-1], std[-1] = 0.0, 1.0
    std[std == 0] = 1.0
    features = (features - mean) / std
    weights = np.zeros(features.shape[1])
    for _ in range(8):
        p = 1 / (1 + np.exp(-features @ weights))
        hessian = (features * (p * (1 - p))[:, None]).T @ features + 1e-6 * np.eye(len(weights))
        weights -= np.linalg.solve(hessian, features.T @ (p - labels))
    scores = ((design(test[0]) - mean) / std) @ weights
    return data.auc(np.asarray(test[1]).reshape(-1), scores)


def _fit_from_queue(model: Any, train: tuple[Any, Any], args: argparse.Namespace) -> int:
    """Trains on the shards this worker takes from the job's queue; returns its examples
    per epoch on average."""
    import numpy as np

    from elastic_emb.shard_queue import ShardQueue

    x, y = train
    bounds = np.linspace(0, len(y), args.data_shards + 1).astype(int)

    def read_shard(shard: int) -> list[tuple[Any, Any]]:
        lo, hi = bounds[shard], bounds[shard + 1]
        return [
            ({k: v[i : min(i + args.batch_size, hi)] for k, v in x.items()},
             y[i : min(i + args.batch_size, hi)])
            for i in range(lo, hi, args.batch_size)
        ]  # fmt: skip

    queue = ShardQueue(args.coordinator, args.job, args.data_shards, epochs=args.epochs)
    try:
        if queue.fit(model, read_shard, verbose=args.verbose) is None:
            print(f"Job {args.job!r}: no shard left to train (start a new --job)")
        print(f"This worker trained {len(queue.trained)} batches of job {args.job!r}")
        examples = 0
        for _, shard, number in queue.trained:
            start = bounds[shard] + number * args.batch_size
            examples += min(start + args.batch_size, bounds[shard + 1]) - start
        return examples // args.epochs
    finally:
        queue.close()


def _run_demo(args: argparse.Namespace, workdir: Path) -> int:  # (long: the demo, step by step)
    phase = _Phases(quiet=args.verbose == 0)
    phase("starting TensorFlow and Keras")
    import keras
    import tensorflow as tf

    import elastic_emb as ee
    from elastic_emb.examples import criteo as data
    from elastic_emb.examples.dlrm import build_dlrm

    keras.utils.set_random_seed(args.seed)
    if not args.ps and not args.coordinator:  # (as ee.init: `elastic-emb cluster local` sets it)
        args.coordinator = os.environ.get("ELASTIC_EMB_COORDINATOR") or None
    if args.data_shards is not None and (not args.coordinator or args.data_shards < 1):
        print("elastic-emb demo: --data-shards needs --coordinator and N >= 1", file=sys.stderr)
        return 2
    cluster = None
    if args.ps or args.coordinator:
        cluster = ee.init(
            ps=args.ps,
            coordinator=args.coordinator,
            mode=args.mode,
            staleness=args.staleness,
            wire_dtype=args.wire_dtype,
        )
    oracle = None
    if args.data:
        dense, categorical, labels = data.read_criteo(args.data, max_examples=args.examples)
        split = int(len(labels) * (1 - args.test_fraction))
        if not 0 < split < len(labels):
            print(f"elastic-emb demo: {args.data} has too few examples to split", file=sys.stderr)
            return 2
        n_test = len(labels) - split
        print(f"Read {len(labels):,} examples from {args.data}; testing on the last {n_test:,}")
        train = data.model_inputs(dense[:split], categorical[:split]), labels[:split]
        test = data.model_inputs(dense[split:], categorical[split:]), labels[split:]
    else:
        phase(f"generating {args.examples:,} training and {args.test_examples:,} test examples")
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
        train = data.model_inputs(*train_arrays[:2]), train_arrays[2]
        test = data.model_inputs(*test_arrays[:2]), test_arrays[2]
    n_train = len(train[1])

    layers: list[ee.Embedding] = []

    optimizer = {"adagrad": ee.optimizers.Adagrad, "adam": ee.optimizers.Adam,
                 "ftrl": ee.optimizers.Ftrl, "sgd": ee.optimizers.SGD}[args.optimizer]  # fmt: skip

    def embedding(i: int) -> ee.Embedding:
        layer = ee.Embedding(args.dim, optimizer=optimizer(learning_rate=args.lr), name=f"C{i + 1}")
        layers.append(layer)
        return layer

    strategy = tf.distribute.get_strategy()
    if cluster is not None and cluster.num_workers > 1:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = build_dlrm(embedding, seed=args.seed)
        model.compile(
            optimizer=keras.optimizers.Adam(learning_rate=1e-3),
            loss="binary_crossentropy",
            metrics=[keras.metrics.AUC(name="auc")],
        )
    where = "in-process"
    if cluster is not None:
        where = (
            f"tables on {cluster.num_shards} PS shard(s) ({args.mode}, {args.wire_dtype} wire), "
            f"worker {cluster.worker_index} of {cluster.num_workers}"
        )
    print(
        f"Training a DLRM-style model on {n_train:,} examples for {args.epochs} epoch(s): "
        f"26 ee.Embedding(dim={args.dim}, {args.optimizer} lr={args.lr:g}) + MLP, {where}",
        flush=True,
    )
    t0 = time.perf_counter()
    if args.data_shards is None:
        model.fit(*train, batch_size=args.batch_size, epochs=args.epochs, shuffle=True,
                  verbose=args.verbose)  # fmt: skip
    else:
        n_train = _fit_from_queue(model, train, args)
    train_seconds = time.perf_counter() - t0
    phase(f"scoring {len(test[1]):,} test examples")
    scores = model.predict(test[0], batch_size=8192, verbose=0)[:, 0]
    test_auc = data.auc(test[1], scores)
    baseline = dense_only_auc(train, test)

    best = f"  (best reachable {oracle:.4f})" if oracle is not None else ""
    print()
    print(f"test AUC         {test_auc:.4f}{best}")
    print(f"baseline AUC     {baseline:.4f}  (the 13 integer features alone, no ids; "
          "guessing scores 0.5)")  # fmt: skip
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
    if cluster is not None:
        print()
        print(f"{'PS shard':<24}{'RPCs':>8}{'MiB sent':>10}{'MiB recv':>10}{'ms/RPC':>8}")
        for s in cluster.stats():
            ms = 1000 * s["seconds"] / max(s["rpcs"], 1)
            print(
                f"{s['address']:<24}{s['rpcs']:>8}{s['bytes_sent'] / 2**20:>10.1f}"
                f"{s['bytes_received'] / 2**20:>10.1f}{ms:>8.1f}"
            )
        ee.shutdown()
    phase("done")
    return 0
