"""A worker's side of the request path: encoding a step's Pulls and Pushes, decoding the rows.

For 26 dim-16 tables (the Criteo layout) and `--keys` distinct keys per table,
split over `--ranges` slot ranges: the CPU a worker spends to make every
range's Pull and Push request bytes and to decode the ranges' answers into
each table's rows, in C++ (`_core.PullPlan`, `_core.push_requests`: what the
client runs) against the Python path it replaced (`RangeLayout.split`,
`protocol.pull_request` / `push_request` / `pulled_rows` over protobuf
messages), side by side in one process, rounds alternating. The answers are
made beforehand by the server's own code (`_core.PullMessage.answer` on C++
tables), so no network or server is measured. Both paths' outputs are
compared before timing.

    python bench/client_path.py [--quick] [--keys 60 1000] [--ranges 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

import elastic_emb as ee
from elastic_emb import _core
from elastic_emb._proto import ps_pb2
from elastic_emb.ps.wire import protocol
from elastic_emb.tables.local import core_options
from elastic_emb.tables.sharding import NUM_SLOTS, RangeLayout
from elastic_emb.tables.table import TableConfig

sys.path.insert(0, os.path.dirname(__file__))
from _common import machine, markdown_table

TABLES = 26
DIM = 16


def step_tables(rng: np.random.Generator, n: int) -> list[tuple[str, int, np.ndarray]]:
    return [(f"t{i}", DIM, np.unique(rng.integers(0, 1 << 40, n))) for i in range(TABLES)]


def answers(layout: RangeLayout, tables: list[Any], cores: dict[str, Any]) -> list[Any]:
    """Each range's PullResponse bytes, as a server answers the C++ request."""
    names, dims, keys = zip(*[(n, d, k) for n, d, k in tables], strict=True)
    plan = _core.PullPlan(list(names), list(keys), list(dims), layout.starts(), NUM_SLOTS)
    out = []
    for raw in plan.requests(0, 1, False, ps_pb2.FLOAT32, 0, None):
        message = None if raw is None else _core.PullMessage(raw)
        out.append(None if message is None else message.answer([cores[n] for n in message.names]))
    return out


def python_path(layout: RangeLayout, tables: list[Any], grads: list[Any], responses: list[Any]):
    """The Python builders and decoder: the requests' bytes and each table's rows."""
    split = [layout.split(k) for _, _, k in tables]
    pulls, pushes = [], []
    for r in range(len(layout.ids)):
        mine = [i for i in range(TABLES) if len(split[i][r])]
        entries = [(tables[i][0], tables[i][2][split[i][r]]) for i in mine]
        pulls.append(
            protocol.pull_request(0, 1, False, ps_pb2.FLOAT32, 0, entries).SerializeToString()
        )
        parts = [(n, k[split[i][r]], grads[i][split[i][r]]) for i, (n, _, k) in enumerate(tables)]
        pushes.append(protocol.push_request(0, 1, ps_pb2.FLOAT32, parts).SerializeToString())
    rows = [np.empty((len(k), d), np.float32) for _, d, k in tables]
    for r, raw in enumerate(responses):
        mine = [i for i in range(TABLES) if len(split[i][r])]
        shapes = [(tables[i][0], len(split[i][r]), DIM) for i in mine]
        response = ps_pb2.PullResponse.FromString(raw)
        for i, (got, _, _) in zip(mine, protocol.pulled_rows(response, shapes), strict=True):
            rows[i][split[i][r]] = got
    return pulls, pushes, rows


def cpp_path(layout: RangeLayout, tables: list[Any], grads: list[Any], responses: list[Any]):
    """The worker's C++ path: the same requests' bytes and rows."""
    names = [n for n, _, _ in tables]
    keys = [k for _, _, k in tables]
    plan = _core.PullPlan(names, keys, [d for _, d, _ in tables], layout.starts(), NUM_SLOTS)
    pulls = plan.requests(0, 1, False, ps_pb2.FLOAT32, 0, None)
    pushes = _core.push_requests(
        names, keys, grads, layout.starts(), NUM_SLOTS, 0, 1, ps_pb2.FLOAT32
    )
    rows, _, _ = plan.rows(responses)
    return pulls, pushes, rows


def check_same(a: Any, b: Any) -> None:
    """Both paths make the same messages and rows (protobuf-equal, bit-equal)."""
    for x, y in zip(a[0], b[0], strict=True):
        assert ps_pb2.PullRequest.FromString(x) == ps_pb2.PullRequest.FromString(y)
    for x, y in zip(a[1], b[1], strict=True):
        assert ps_pb2.PushRequest.FromString(x) == ps_pb2.PushRequest.FromString(y)
    for x, y in zip(a[2], b[2], strict=True):
        assert x.tobytes() == y.tobytes()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keys", type=int, nargs="+", default=[60, 1000])
    p.add_argument("--ranges", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps = 3, 50
    layout = RangeLayout.even(args.ranges)
    config = TableConfig.make(DIM, ee.optimizers.SGD(0.1))
    cores = {f"t{i}": _core.Table(core_options(config)) for i in range(TABLES)}
    rng = np.random.default_rng(0)
    rows = []
    for n in args.keys:
        steps = []
        for _ in range(args.steps):
            tables = step_tables(rng, n)
            grads = [rng.normal(size=(len(k), DIM)).astype(np.float32) for _, _, k in tables]
            steps.append((tables, grads, answers(layout, tables, cores)))
        check_same(python_path(layout, *steps[0]), cpp_path(layout, *steps[0]))
        keys = sum(len(k) for _, _, k in steps[0][0]) * len(steps)
        ratios, py_us, cpp_us = [], [], []
        for r in range(args.rounds):
            cpu = {}
            for path in (python_path, cpp_path) if r % 2 == 0 else (cpp_path, python_path):
                start = time.process_time()
                for step in steps:
                    path(layout, *step)
                cpu[path] = time.process_time() - start
            py_us.append(1e6 * cpu[python_path] / keys)
            cpp_us.append(1e6 * cpu[cpp_path] / keys)
            ratios.append(cpu[python_path] / cpu[cpp_path])
        rows.append(
            [
                f"{TABLES} tables x {n} keys, {args.ranges} ranges",
                f"{statistics.median(cpp_us):.3f}",
                f"{statistics.median(py_us):.3f}",
                f"{statistics.median(ratios):.2f}x",
            ]
        )
    print(f"\n## Worker CPU per key: Pull and Push requests made, rows decoded ({machine()})\n")
    print(
        markdown_table(
            ["step", "C++ us/key", "Python builders us/key", "Python / C++ (median)"], rows
        )
    )


if __name__ == "__main__":
    main()
