"""How many calls a second one server answers on one core: the data plane against gRPC.

One real `elastic-emb serve` process on 127.0.0.1, pinned to CPU 0 (`taskset`;
the client gets the other CPUs), one dim-16 table, 32 async workers joined.
The client opens 32 connections (32 gRPC channels, or 32 data-plane
connections) and keeps `--in-flight` small Pulls (1 key, train=False) in
flight on each for `--seconds`; the figure is the pulls answered per second
and the server's CPU per pull (its threads' on-CPU time, /proc schedstat).
Windows alternate between the planes (data, gRPC, gRPC, data, ...); medians
over rounds.

    python bench/data_plane_bench.py [--rounds 3] [--seconds 5] [--in-flight 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
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
from elastic_emb.ps.wire.security import GRPC_OPTIONS, SERVICE

sys.path.insert(0, os.path.dirname(__file__))
from _common import machine, markdown_table
from server_path import cpu_seconds

CONNECTIONS = 32


def start_server() -> tuple[subprocess.Popen[Any], str]:
    port = free_port()
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") and (os.cpu_count() or 1) > 1 else []
    process = subprocess.Popen(
        [*pin, *cli_command(), "serve", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    if pin:
        os.sched_setaffinity(0, set(range(1, os.cpu_count() or 2)))
    return process, f"127.0.0.1:{port}"


def pulls(count: int) -> list[bytes]:
    return [
        protocol.pull_request(
            w % CONNECTIONS, 1, False, ps_pb2.FLOAT32, 60.0, [("t", np.array([w], np.int64))]
        ).SerializeToString()
        for w in range(count)
    ]


def data_plane_window(connections: list[Any], requests: list[bytes], seconds: float) -> int:
    """Pulls answered in `seconds`, `len(requests)` in flight over `connections`."""
    method = protocol.DATA_PLANE_METHODS["Pull"]
    targets = [connections[i % len(connections)] for i in range(len(requests))]
    answered, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        tickets = _core.data_plane_send(targets, [method] * len(requests), requests, 60.0)
        assert _core.data_plane_wait(tickets, 60.0)
        assert all(t.answer()[0] == 0 for t in tickets)
        answered += len(tickets)
    return answered


def grpc_window(calls: list[Any], requests: list[bytes], seconds: float) -> int:
    answered, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        futures = [calls[i % len(calls)].future(r) for i, r in enumerate(requests)]
        for f in futures:
            f.result()
        answered += len(futures)
    return answered


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--in-flight", type=int, default=4, help="pulls in flight per connection")
    args = p.parse_args()
    where = machine()  # (before the client leaves CPU 0 to the server)
    process, address = start_server()
    try:
        channels = [grpc.insecure_channel(address, options=GRPC_OPTIONS) for _ in range(32)]
        grpc.channel_ready_future(channels[0]).result(timeout=60)
        stub = ps_pb2_grpc.ParameterServerStub(channels[0])
        config = ee.Table(16, ee.optimizers.SGD(0.1), name="t").config()
        stub.CreateTables(protocol.create_tables_request([config]))
        for w in range(CONNECTIONS):
            stub.Join(protocol.join_request(w, CONNECTIONS, "async", None))
        port = stub.Health(ps_pb2.HealthRequest()).data_port
        connections = [
            _core.DataPlaneConnection("127.0.0.1", port, "", 10.0) for _ in range(CONNECTIONS)
        ]
        calls = [c.unary_unary(f"/{SERVICE}/Pull") for c in channels]
        requests = pulls(CONNECTIONS * args.in_flight)
        runs = {
            "data plane": lambda s: data_plane_window(connections, requests, s),
            "gRPC": lambda s: grpc_window(calls, requests, s),
        }
        for run in runs.values():
            run(0.5)  # warm up
        rate: dict[str, list[float]] = {k: [] for k in runs}
        cpu: dict[str, list[float]] = {k: [] for k in runs}
        for r in range(args.rounds):
            for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
                before, start = cpu_seconds(process.pid), time.perf_counter()
                answered = runs[name](args.seconds)
                wall = time.perf_counter() - start
                rate[name].append(answered / wall)
                cpu[name].append(1e6 * (cpu_seconds(process.pid) - before) / answered)
    finally:
        process.kill()
        process.wait()
    rows = [
        [
            name,
            f"{statistics.median(rate[name]):,.0f}",
            f"{statistics.median(cpu[name]):.1f}",
            ", ".join(f"{x:,.0f}" for x in rate[name]),
        ]
        for name in rate
    ]
    print(
        f"\n## Pulls a server answers on one core, {CONNECTIONS} connections x "
        f"{args.in_flight} in flight, 1 key ({where}; the server pinned to one)\n"
    )
    print(markdown_table(["plane", "pulls/s (median)", "server CPU us/pull", "rounds"], rows))


if __name__ == "__main__":
    main()
