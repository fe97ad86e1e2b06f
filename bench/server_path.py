"""The parameter server's request path: server CPU per key against the in-process table.

One real `elastic-emb serve` process on 127.0.0.1 holds 26 dim-16 Adagrad
tables (the Criteo layout); a client sends fused Pulls (train=True) and
Pushes of existing keys, `--keys` per table per request, one request in
flight, requests built before the timed window (the client's own work is not
measured). Figure: the server process's CPU (user + system, /proc) per key
pulled and pushed. Reference, in the same run: the same pulls and pushes of
the same keys on 26 in-process C++ tables (`_core.Table`, the bench
process's CPU). Windows alternate (server, in-process, in-process, server,
...); the ratio is the median of the per-round ratios (target: <= 1.5x). The row of
1 key per table shows what a request costs the server whatever its keys (gRPC and the
per-request Python: authorization, the step protocol, metrics). A third variant in the
same rounds: a gRPC server in Python that does nothing but answer the same requests'
bytes with answers of the shard's sizes (what gRPC alone costs).

    python bench/server_path.py [--quick] [--keys 1 60 1000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import grpc
import numpy as np

import elastic_emb as ee
from elastic_emb import _core
from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.ps.coord.local_cluster import cli_command, free_port
from elastic_emb.ps.wire import protocol
from elastic_emb.ps.wire.security import GRPC_OPTIONS
from elastic_emb.tables.local import core_options
from elastic_emb.tables.table import TableConfig

sys.path.insert(0, os.path.dirname(__file__))
from _common import machine, markdown_table

TABLES = 26
DIM = 16
ROWS = 100_000  # per table, inserted before timing


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def configs() -> list[TableConfig]:
    return [
        TableConfig.make(DIM, ee.optimizers.Adagrad(0.05), name=f"t{i}", seed=i)
        for i in range(TABLES)
    ]


def key_batches(rng: np.random.Generator, n: int, requests: int) -> list[list[np.ndarray]]:
    """Per request, per table: `n` distinct ascending existing keys."""
    return [
        [np.sort(rng.choice(ROWS, n, replace=False)).astype(np.int64) for _ in range(TABLES)]
        for _ in range(requests)
    ]


class _Process:
    """A server process of the benchmark and its channel."""

    process: subprocess.Popen[Any]
    channel: grpc.Channel

    def cpu_of(self, calls: Any) -> float:
        """The process's CPU seconds while `calls()` runs (and its last answer is counted)."""
        before = cpu_seconds(self.process.pid)
        calls()
        time.sleep(0.05)
        return cpu_seconds(self.process.pid) - before

    def stop(self) -> None:
        self.channel.close()
        self.process.kill()
        self.process.wait()


class Server(_Process):
    def __init__(self) -> None:
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        self.process = subprocess.Popen(
            [*cli_command(), "serve", "--host", "127.0.0.1", "--port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.channel = grpc.insecure_channel(self.address, options=GRPC_OPTIONS)
        grpc.channel_ready_future(self.channel).result(timeout=60)
        self.stub = ps_pb2_grpc.ParameterServerStub(self.channel)
        self.stub.CreateTables(protocol.create_tables_request(c.to_dict() for c in configs()))
        self.stub.Join(protocol.join_request(0, 1, "async", None))
        self.step = 1
        everything = np.arange(ROWS, dtype=np.int64)
        for i in range(TABLES):
            self.stub.ImportRows(
                protocol.import_rows_request(
                    f"t{i}", everything, np.full((ROWS, DIM), 0.01, np.float32)
                )
            )

    def requests(self, batches: list[list[np.ndarray]]) -> list[tuple[Any, Any]]:
        out = []
        for keys in batches:
            tables = [(f"t{i}", k) for i, k in enumerate(keys)]
            grads = [
                (f"t{i}", k, np.full((len(k), DIM), 1e-3, np.float32)) for i, k in enumerate(keys)
            ]
            out.append(
                (
                    protocol.pull_request(0, self.step, True, ps_pb2.FLOAT32, 60.0, tables),
                    protocol.push_request(0, self.step, ps_pb2.FLOAT32, grads),
                )
            )
            self.step += 1
        return out

    def run(self, requests: list[tuple[Any, Any]]) -> float:
        """Server CPU seconds for the requests."""

        def calls() -> None:
            for pull, push in requests:
                self.stub.Pull(pull)
                self.stub.Push(push)

        return self.cpu_of(calls)


# A gRPC server in Python that answers each request with as many bytes as its first 8 bytes
# ask for, doing nothing else: what gRPC alone costs a server for calls of these sizes.
ECHO_SERVER = """
from concurrent import futures
import grpc
server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
def answer(raw, context):
    return bytes(int.from_bytes(raw[:8], "little"))
handler = grpc.unary_unary_rpc_method_handler(answer)
server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("echo", {"Call": handler}),))
print(server.add_insecure_port("127.0.0.1:0"), flush=True)
server.start()
server.wait_for_termination()
"""


class EchoServer(_Process):
    """`ECHO_SERVER` in its own process."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", ECHO_SERVER], stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        port = int(self.process.stdout.readline())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
        self.call = self.channel.unary_unary("/echo/Call")

    def run(self, requests: list[tuple[Any, Any]]) -> float:
        """Server CPU seconds for the same requests' bytes, each answered with as many bytes
        as the shard answers it (a pull: its rows; a push: a few bytes)."""
        calls = []
        for pull, push in requests:
            rows = sum(len(protocol.decode_keys(t.keys, key_encoding=t.key_encoding))
                       for t in pull.tables) * DIM * 4  # fmt: skip
            size = rows + sum(len(t.table) + 8 for t in pull.tables)
            calls.append(size.to_bytes(8, "little") + pull.SerializeToString())
            calls.append((4).to_bytes(8, "little") + push.SerializeToString())
        return self.cpu_of(lambda: [self.call(raw) for raw in calls])


def in_process(tables: list[Any], batches: list[list[np.ndarray]]) -> float:
    """CPU seconds of the same pulls and pushes on in-process C++ tables."""
    grads = [np.full((len(k), DIM), 1e-3, np.float32) for k in batches[0]]
    start = time.process_time()
    for step, keys in enumerate(batches, 1):  # as the server: every table's pull, then push
        for table, k in zip(tables, keys, strict=True):
            table.pull(k, True)
        for table, k, g in zip(tables, keys, grads, strict=True):
            table.push(k, g, 0.05, step)
    return time.process_time() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keys", type=int, nargs="+", default=[1, 60, 1000])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.requests = 3, 60
    server, echo = Server(), EchoServer()
    local = [_core.Table(core_options(c)) for c in configs()]
    everything = np.arange(ROWS, dtype=np.int64)
    for t in local:
        t.import_rows(everything, np.full((ROWS, DIM), 0.01, np.float32))
    rng = np.random.default_rng(0)
    rows = []
    try:
        for n in args.keys:
            ratios, server_us, local_us, per_request, echo_us = [], [], [], [], []
            server.run(server.requests(key_batches(rng, n, 10)))  # warm up
            for r in range(args.rounds):
                batches = key_batches(rng, n, args.requests)
                requests = server.requests(batches)
                keys = 2 * TABLES * n * len(batches)
                order = [0, 1, 2] if r % 2 == 0 else [2, 1, 0]
                cpu = [0.0, 0.0, 0.0]
                for which in order:
                    if which == 0:
                        cpu[0] = server.run(requests)
                    elif which == 1:
                        cpu[1] = in_process(local, batches)
                    else:
                        cpu[2] = echo.run(requests)
                server_us.append(1e6 * cpu[0] / keys)
                per_request.append(1e6 * cpu[0] / len(batches))
                echo_us.append(1e6 * cpu[2] / len(batches))
                local_us.append(1e6 * cpu[1] / keys)
                ratios.append(cpu[0] / cpu[1])
            rows.append(
                [
                    f"{TABLES} tables x {n} keys, pull + push",
                    f"{statistics.median(server_us):.3f}",
                    f"{statistics.median(local_us):.3f}",
                    f"{statistics.median(per_request):.0f}",
                    f"{statistics.median(echo_us):.0f}",
                    f"{statistics.median(ratios):.2f}x",
                    ", ".join(f"{x:.2f}" for x in ratios),
                ]
            )
    finally:
        server.stop()
        echo.stop()
    print(f"\n## Server CPU per key ({machine()})\n")
    print(
        markdown_table(
            [
                "request",
                "server CPU us/key",
                "in-process us/key",
                "server CPU us per pull + push",
                "gRPC echo server CPU us per pull + push",
                "ratio (median)",
                "rounds",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
