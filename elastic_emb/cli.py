"""The `elastic-emb` command line: `demo`, `serve`, `health` and `bench`."""

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
    import tensorflow as tf

    import elastic_emb as ee
    from elastic_emb import data
    from elastic_emb.models import build_dlrm

    keras.utils.set_random_seed(args.seed)
    cluster = None
    if args.ps:
        cluster = ee.init(
            ps=args.ps,
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
        f"Training a DLRM-style model on {n_train:,} examples: "
        f"26 ee.Embedding(dim={args.dim}) + MLP, {where}"
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
    return 0


def _serve(args: argparse.Namespace) -> int:
    import logging

    from elastic_emb import server

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")

    def ready(port: int) -> None:
        print(f"elastic-emb serve: listening on {args.host}:{port}", flush=True)

    return server.serve(
        args.port,
        host=args.host,
        threads=args.threads,
        grace_seconds=args.grace_seconds,
        checkpoint_dir=args.checkpoint_dir,
        ready=ready,
    )


def _health(args: argparse.Namespace) -> int:
    import grpc

    from elastic_emb._proto import ps_pb2, ps_pb2_grpc

    with grpc.insecure_channel(args.address) as channel:
        try:
            reply = ps_pb2_grpc.ParameterServerStub(channel).Health(
                ps_pb2.HealthRequest(), timeout=args.timeout
            )
        except grpc.RpcError as e:
            print(f"{args.address}: not serving ({e.code().name}: {e.details()})", file=sys.stderr)
            return 1
    print(f"{args.address}: serving, {reply.num_tables} tables, step {reply.step}")
    return 0 if reply.serving else 1


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


def build_parser() -> argparse.ArgumentParser:
    """The `elastic-emb` argument parser (also checks the Kubernetes manifests)."""
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
    demo.add_argument(
        "--ps", help="comma-separated PS addresses (host:port); default: in-process tables"
    )
    demo.add_argument("--mode", choices=("async", "sync"), default="async", help="with --ps")
    demo.add_argument("--staleness", type=int, help="async staleness bound, with --ps")
    demo.add_argument("--wire-dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    demo.set_defaults(run=_demo)

    serve = sub.add_parser("serve", help="run one parameter-server shard")
    serve.add_argument("--port", type=int, required=True, help="TCP port (0: any free port)")
    serve.add_argument("--host", default="0.0.0.0", help="address to listen on")
    serve.add_argument("--threads", type=int, default=64, help="request threads")
    serve.add_argument(
        "--grace-seconds", type=float, default=30.0, help="on SIGTERM, time for in-flight requests"
    )
    serve.add_argument("--checkpoint-dir", help="on SIGTERM, save every table here")
    serve.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING"))
    serve.set_defaults(run=_serve)

    health = sub.add_parser("health", help="exit 0 if the PS at ADDRESS is serving")
    health.add_argument("address", help="host:port")
    health.add_argument("--timeout", type=float, default=5.0, help="seconds")
    health.set_defaults(run=_health)

    bench = sub.add_parser("bench", help="run a benchmark of bench/ (source checkout)")
    bench.add_argument("which", nargs="?", default="table_bench", help="table_bench or e2e")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    bench.set_defaults(run=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
