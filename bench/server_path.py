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
import socket
import statistics
import subprocess
import sys
import tempfile
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
    """The process's CPU seconds: its live threads' time on a CPU, counted in nanoseconds
    (/proc/PID/task/*/schedstat; /proc/PID/stat counts 10 ms ticks). The servers measured
    keep their threads, so none ends within a window."""
    on_cpu = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                on_cpu += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # (a thread that ended meanwhile)
    return on_cpu / 1e9


def configs() -> list[TableConfig]:
    return [
        TableConfig.make(DIM, ee.optimizers.Adagrad(0.05), name=f"t{i}", seed=i)
        for i in range(TABLES)
    ]


def key_batches(
    rng: np.random.Generator, n: int, requests: int, tables: int = TABLES
) -> list[list[np.ndarray]]:
    """Per request, per table: `n` distinct ascending existing keys."""
    return [
        [np.sort(rng.choice(ROWS, n, replace=False)).astype(np.int64) for _ in range(tables)]
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
    def __init__(self, tables: int) -> None:
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
        self.stub.CreateTables(
            protocol.create_tables_request(c.to_dict() for c in configs()[:tables])
        )
        self.stub.Join(protocol.join_request(0, 1, "async", None))
        self.step = 1
        everything = np.arange(ROWS, dtype=np.int64)
        for i in range(tables):
            self.stub.ImportRows(
                protocol.import_rows_request(
                    f"t{i}", everything, np.full((ROWS, DIM), 0.01, np.float32)
                )
            )
        port = self.stub.Health(ps_pb2.HealthRequest()).data_port
        self.data = _core.DataPlaneConnection("127.0.0.1", port, "", 10.0)

    def requests(
        self, batches: list[list[np.ndarray]], advance: bool = True
    ) -> list[tuple[Any, Any]]:
        """The Pulls and Pushes of the next steps (`advance`: counted as sent)."""
        first, out = self.step, []
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
        if not advance:
            self.step = first
        return out

    def run(self, requests: list[tuple[Any, Any]]) -> float:
        """Server CPU seconds for the requests."""

        def calls() -> None:
            for pull, push in requests:
                self.stub.Pull(pull)
                self.stub.Push(push)

        return self.cpu_of(calls)

    def run_data_plane(self, requests: list[tuple[Any, Any]]) -> float:
        """Server CPU seconds for the requests on the data plane."""
        methods = [protocol.DATA_PLANE_METHODS["Pull"], protocol.DATA_PLANE_METHODS["Push"]]
        calls = [[r.SerializeToString() for r in pair] for pair in requests]

        def send() -> None:
            for pull, push in calls:
                for method, raw in zip(methods, (pull, push), strict=True):
                    (ticket,) = _core.data_plane_send([self.data], [method], [raw], 60.0)
                    _core.data_plane_wait([ticket], 60.0)
                    assert ticket.answer()[0] == 0, ticket.answer()

        return self.cpu_of(send)


def answer_sizes(requests: list[tuple[Any, Any]], tables: int) -> list[tuple[bytes, int]]:
    """Each request's bytes and the size of the shard's answer (a pull: its rows; a push:
    a few bytes)."""
    out = []
    for pull, push in requests:
        rows = sum(len(protocol.decode_keys(t.keys, key_encoding=t.key_encoding))
                   for t in pull.tables) * DIM * 4  # fmt: skip
        out.append((pull.SerializeToString(), rows + sum(len(t.table) + 8 for t in pull.tables)))
        out.append((push.SerializeToString(), 4))
    return out


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
        calls = [size.to_bytes(8, "little") + raw for raw, size in answer_sizes(requests, 0)]
        return self.cpu_of(lambda: [self.call(raw) for raw in calls])


# The floor: a C server that reads a request (its length, then its bytes, the first 8 of
# them the answer's size) and writes the answer, on one loopback TCP connection.
C_ECHO = r"""
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
static int all(int fd, char* p, size_t n, int out) {
  while (n) { ssize_t k = out ? write(fd, p, n) : read(fd, p, n); if (k <= 0) return 0;
              p += k; n -= k; }
  return 1;
}
int main(void) {
  int s = socket(AF_INET, SOCK_STREAM, 0), one = 1;
  struct sockaddr_in a; memset(&a, 0, sizeof a); a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(s, (struct sockaddr*)&a, sizeof a); listen(s, 1);
  socklen_t n = sizeof a; getsockname(s, (struct sockaddr*)&a, &n);
  printf("%d\n", ntohs(a.sin_port)); fflush(stdout);
  int c = accept(s, 0, 0); setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  size_t cap = 1 << 20; char* buf = malloc(cap);
  for (;;) {
    unsigned long long len, size;
    if (!all(c, (char*)&len, 8, 0)) return 0;
    if (len > cap) { cap = len; buf = realloc(buf, cap); }
    if (!all(c, buf, len, 0)) return 0;
    memcpy(&size, buf, 8);
    if (size + 8 > cap) { cap = size + 8; buf = realloc(buf, cap); }
    unsigned long long total = size;
    memcpy(buf, &total, 8);
    if (!all(c, buf, 8 + size, 1)) return 0;
  }
}
"""


class CEcho:
    """`C_ECHO`, compiled and started; its client is a plain socket."""

    def __init__(self, directory: str) -> None:
        source, binary = os.path.join(directory, "echo.c"), os.path.join(directory, "echo")
        with open(source, "w") as f:
            f.write(C_ECHO)
        subprocess.run(["cc", "-O2", "-o", binary, source], check=True)
        self.process = subprocess.Popen([binary], stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        port = int(self.process.stdout.readline())
        self.socket = socket.create_connection(("127.0.0.1", port))
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def run(self, requests: list[tuple[Any, Any]]) -> float:
        calls = [
            (len(raw) + 8).to_bytes(8, "little") + size.to_bytes(8, "little") + raw
            for raw, size in answer_sizes(requests, 0)
        ]

        def send() -> None:
            for raw in calls:
                self.socket.sendall(raw)
                size = int.from_bytes(self._read(8), "little")
                self._read(size)

        before = cpu_seconds(self.process.pid)
        send()
        time.sleep(0.05)
        return cpu_seconds(self.process.pid) - before

    def _read(self, n: int) -> bytes:
        parts = []
        while n:
            part = self.socket.recv(min(n, 1 << 20))
            parts.append(part)
            n -= len(part)
        return b"".join(parts)

    def stop(self) -> None:
        self.socket.close()
        self.process.kill()
        self.process.wait()


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


def _us(seconds: list[float], per: int = 1) -> str:
    return f"{1e6 * statistics.median(seconds) / per:.1f}"


def _ratio(a: list[float], b: list[float]) -> str:
    return f"{statistics.median([x / y for x, y in zip(a, b, strict=True)]):.2f}x"


VARIANTS = ("gRPC plane", "data plane", "in-process", "gRPC echo", "C echo (floor)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keys", type=int, nargs="+", default=[1, 60, 1000])
    p.add_argument("--tables", type=int, default=TABLES, help="tables per request (<= 26)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.requests = 3, 60
    directory = tempfile.mkdtemp()
    server, echo, floor = Server(args.tables), EchoServer(), CEcho(directory)
    local = [_core.Table(core_options(c)) for c in configs()[: args.tables]]
    everything = np.arange(ROWS, dtype=np.int64)
    for t in local:
        t.import_rows(everything, np.full((ROWS, DIM), 0.01, np.float32))
    runs = [server.run, server.run_data_plane, None, echo.run, floor.run]
    rng = np.random.default_rng(0)
    rows = []
    try:
        for n in args.keys:
            cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
            warm = server.requests(key_batches(rng, n, 10, args.tables))
            server.run(warm[:5])
            server.run_data_plane(warm[5:])
            for r in range(args.rounds):
                # /proc counts CPU in 10 ms ticks: small requests come 5 times as many.
                count = args.requests * (5 if n * args.tables < 1000 else 1)
                batches = key_batches(rng, n, count, args.tables)
                order = list(range(len(VARIANTS)))
                if r % 2:
                    order.reverse()
                for i in order:
                    if VARIANTS[i] == "in-process":
                        seconds = in_process(local, batches)
                    else:  # (a plane's for the steps that come next: the same keys)
                        seconds = runs[i](server.requests(batches, advance=i < 2))
                    cpu[VARIANTS[i]].append(seconds / len(batches))
            keys = 2 * args.tables * n

            rows.append(
                [
                    f"{args.tables} x {n}",
                    *(_us(cpu[v]) for v in ("gRPC plane", "data plane", "in-process")),
                    *(_us(cpu[v]) for v in ("gRPC echo", "C echo (floor)")),
                    _us(cpu["data plane"], keys) + " / " + _us(cpu["in-process"], keys),
                    _ratio(cpu["data plane"], cpu["in-process"]),
                    _ratio(cpu["gRPC plane"], cpu["data plane"]),
                ]
            )
    finally:
        server.stop()
        echo.stop()
        floor.stop()
    print(f"\n## Server CPU per pull + push, both planes ({machine()})\n")
    print(
        markdown_table(
            [
                "tables x keys",
                "gRPC plane us",
                "data plane us",
                "in-process us",
                "gRPC echo us",
                "C echo us (floor)",
                "us/key: data plane / in-process",
                "data plane / in-process",
                "gRPC / data plane",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
