"""What TLS costs a server per small step: the data plane and gRPC, plaintext and TLS.

Four `elastic-emb serve` processes on 127.0.0.1, side by side in one run: plaintext (its
data plane), `--tls-cert/--tls-key` (its data plane over TLS), and each of them with
`--data-plane grpc` (Pull and Push carried by gRPC into the same C++ handling). Certificates
are made at run time (tests/_certs.py, ECDSA P-256). A small step is 26 tables x 64 keys
(dim 16, Adagrad, async), a pull and a push per table through `ee.Table`; the 1-key figure
is one pull and one push of 1 key; `model.fit` is the DLRM model of `step_overhead.py`
(26 `ee.Embedding` features, Zipf ids, dim 16, Adagrad) at batch 64. Figure: the server
process's CPU seconds (/proc/PID/stat utime + stime) per step, and the worker's wall time
per step; windows of `--steps` steps alternate between the servers (order reversed every
other round), medians over `--rounds`.

    python bench/tls_data_plane.py [--steps 100] [--one-key-steps 1000] [--fit-steps 100]
        [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.join(os.path.dirname(HERE), "tests"))
from _certs import make_pki  # noqa: E402
from _cluster import shards  # noqa: E402
from _common import machine, markdown_table  # noqa: E402
from remote_bench import cpu_seconds  # noqa: E402

TABLES, KEYS, DIM = 26, 64, 16
SERVERS = ("plaintext data plane", "TLS data plane", "plaintext via gRPC", "TLS via gRPC")
FIT = "model.fit, batch 64 x 26 features"


def steps(tables: list, keys: np.ndarray, count: int) -> None:
    """`count` steps: each table pulled and pushed once with `keys`."""
    grads = np.full((len(keys), DIM), 1e-3, np.float32)
    for _ in range(count):
        for table in tables:
            table.pull(keys)
            table.push(keys, grads)


def measure(server, security: dict, keys: np.ndarray, count: int, num_tables: int):
    """(server CPU s, worker wall s) per step over `count` steps, after a warm-up."""
    import elastic_emb as ee

    ee.init(ps=[server.address], mode="async", **security)
    try:
        tables = [
            ee.Table(DIM, ee.optimizers.Adagrad(0.05), name=f"t{i}", seed=i)
            for i in range(num_tables)
        ]
        steps(tables, keys, 10)
        cpu, wall = cpu_seconds(server.process.pid), time.perf_counter()
        steps(tables, keys, count)
        wall = time.perf_counter() - wall
        return (cpu_seconds(server.process.pid) - cpu) / count, wall / count
    finally:
        ee.shutdown()


def measure_fit(server, security: dict, data, count: int):
    """(server CPU s, worker wall s) per `model.fit` step over `count` steps."""
    from step_overhead import NUM_FEATURES, build

    import elastic_emb as ee

    ee.init(ps=[server.address], mode="async", **security)
    try:
        model = build("ee", NUM_FEATURES)  # its tables: the server's, as left
        model.fit(data, epochs=1, steps_per_epoch=5, verbose=0)
        cpu, wall = cpu_seconds(server.process.pid), time.perf_counter()
        model.fit(data, epochs=1, steps_per_epoch=count, verbose=0)
        wall = time.perf_counter() - wall
        return (cpu_seconds(server.process.pid) - cpu) / count, wall / count
    finally:
        ee.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100, help="small steps per window")
    p.add_argument("--one-key-steps", type=int, default=1000, help="1-key steps per window")
    p.add_argument("--fit-steps", type=int, default=100, help="model.fit steps per window")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    from elastic_emb import _core

    if not _core.with_tls:
        sys.exit("this build of elastic_emb has no TLS (OpenSSL was not found when it was built)")
    pki = make_pki(Path(tempfile.mkdtemp(prefix="tls-bench-")))
    cert, key = map(str, pki["server"])
    tls = ["--tls-cert", cert, "--tls-key", key]
    grpc = ["--data-plane", "grpc"]
    arguments = {SERVERS[0]: [], SERVERS[1]: tls, SERVERS[2]: grpc, SERVERS[3]: [*tls, *grpc]}
    security = {s: {"tls_ca": pki["ca"]} if "TLS" in s else {} for s in SERVERS}
    workloads = {
        f"{TABLES} tables x {KEYS} keys": (TABLES, KEYS, args.steps),
        "1 key": (1, 1, args.one_key_steps),
        FIT: (0, 0, args.fit_steps),
    }
    rng = np.random.default_rng(0)
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with contextlib.ExitStack() as stack:
        servers = {s: stack.enter_context(shards(1, arguments[s]))[0] for s in SERVERS}
        for name, (num_tables, num_keys, count) in workloads.items():
            if name == FIT:
                import tensorflow as tf
                from step_overhead import make_data

                x, y = make_data(64, count)
                data = tf.data.Dataset.from_tensor_slices((tuple(x), y)).batch(64).repeat()
            keys = rng.choice(1 << 20, max(num_keys, 1), replace=False).astype(np.int64)
            for r in range(args.rounds):
                for s in SERVERS if r % 2 == 0 else SERVERS[::-1]:
                    if name == FIT:
                        figure = measure_fit(servers[s], security[s], data, count)
                    else:
                        figure = measure(servers[s], security[s], keys, count, num_tables)
                    results.setdefault((name, s), []).append(figure)
    rows = []
    for name in workloads:
        base_cpu = statistics.median(c for c, _ in results[(name, SERVERS[0])])
        for s in SERVERS:
            cpu = statistics.median(c for c, _ in results[(name, s)])
            wall = statistics.median(w for _, w in results[(name, s)])
            rows.append(
                [name, s, f"{cpu * 1e3:.3f}", f"{cpu / base_cpu:.2f}x", f"{wall * 1e3:.3f}"]
            )
    print(
        f"\n{machine()}; float32 rows, dim {DIM}, Adagrad, async, 1 server; "
        f"medians of {args.rounds} rounds\n"
    )
    headers = [
        "workload",
        "server",
        "server CPU ms / step",
        "vs plaintext",
        "worker wall ms / step",
    ]
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    main()
