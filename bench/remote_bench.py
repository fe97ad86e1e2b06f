"""Remote tables (gRPC parameter servers) against in-process tables, side by side.

BENCH.md's reference for remote tables is "the same run with in-process
tables". Three measurements, each a ratio taken within this one run:

1. End-to-end training: the DLRM of `e2e.py` (`elastic_emb.examples.dlrm.build_dlrm`:
   13 dense + 26 categorical features, dim 16, MLP 512-256-1, batch 4096,
   Adagrad tables, `model.fit`) with in-process `ee.Embedding` tables, and
   with remote tables on 2 `elastic-emb serve` shards on 127.0.0.1 (async
   mode) for each wire dtype of `--wires` (float32, float16, bfloat16).
   Figure: examples/s; ratio: remote / in-process (target ≥ 0.7×).
2. Bytes on the wire per training step of each remote variant, from
   `Cluster.stats()` (client side, request + response message sizes, all
   shards) over the same timed windows, and the ratio to float32 (target
   ≤ 0.55×); and RPCs per step per shard (2 when pulls and pushes are fused:
   one Pull and one Push per shard for all 26 tables).
3. PS throughput as concurrent clients grow (`--clients`, default 1 2 4 8):
   separate client processes, each with its own `ee.init` connection (async,
   its own `worker_index`, the same `num_workers` = the largest count, since
   Join requires all workers of a shard to agree), loop a fused
   `Cluster.pull(train=True)` + `Cluster.push` of 65,536 Zipf(1.1) keys (as
   drawn, duplicates included, over 1M ids pre-inserted) into one shared
   dim-16 Adagrad table on 2 shards. Figure: pulled + pushed keys/s of all
   clients together; ratio: against 1 client in the same round.

Design. `ee.init` is process-global: one process holds one connection, so
one wire dtype, at a time (`ee.shutdown()` ends the use of the remote tables
made under it), and `ee.init` may refuse to run while in-process tables exist.
So every end-to-end variant runs in its own child process (multiprocessing,
spawn), built once, that trains a window of batches on the driver's command;
each remote variant has its own 2 fresh shards (a shard's step bookkeeping
belongs to the workers that joined it). The driver interleaves the windows
with `_common.interleave` (A B C D, D C B A, ...): only one child trains at a
time, the others (and their shards) wait idle on a pipe, so all variants share
the same machine conditions, and ratios are medians of per-round ratios.
Every child gets the same data and its own position in it. The clients of
part 3 are spawned once; a window starts them together at one instant and
they loop until a common deadline; windows of each client count take turns
in the same way. Shard CPU is read from /proc.

Usage:
    python bench/remote_bench.py --quick      # ~3 minutes
    python bench/remote_bench.py              # the full run, ~6-8 minutes
    python bench/remote_bench.py --sections clients --clients 1 2 4
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.connection
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import _common as c
import numpy as np
from table_bench import ZIPF_EXPONENT, KeySpace, make_batches

NUM_SHARDS = 2
E2E_TARGET = 0.7  # remote / in-process examples/s, at least
BYTES_TARGET = 0.55  # 16-bit wire bytes / float32 wire bytes, at most
WIRES = ("float32", "float16", "bfloat16")
IN_PROCESS = "in-process"
CLIENT_BATCH = 65_536
CLIENT_DIM = 16
CLIENT_BATCHES = 4  # distinct key batches each client cycles through
FILL_CHUNK = 1 << 18  # keys per pull when pre-inserting the id space
START_DELAY = 0.1  # seconds between the driver's "run" and the common start


def log(msg: str) -> None:
    """Progress goes to stderr, so stdout holds only the tables."""
    print(msg, file=sys.stderr, flush=True)


def remote_name(wire: str) -> str:
    return f"remote {wire}"


# ---------------------------------------------------------------------------------------------
# Child processes


def _child_main(conn: multiprocessing.connection.Connection, target: Any, args: tuple) -> None:
    """Runs `target(conn, *args)` in the child; a failure goes back as ("error", traceback)."""
    try:
        target(conn, *args)
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        conn.close()


class Child:
    """A spawned child process driven over a pipe; it answers ("kind", payload) messages."""

    def __init__(self, ctx: Any, name: str, target: Callable[..., None], *args: Any) -> None:
        self.name = name
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_child_main, args=(child_conn, target, args), name=name, daemon=True
        )
        self.process.start()
        child_conn.close()

    def send(self, msg: Any) -> None:
        self.conn.send(msg)

    def recv(self) -> Any:
        """The payload of the child's next message (raises if it failed or died)."""
        try:
            kind, payload = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"{self.name} exited (code {self.process.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"{self.name} failed:\n{payload}")
        return payload

    def request(self, msg: Any) -> Any:
        self.send(msg)
        return self.recv()

    def close(self) -> None:
        """Asks the child to finish (None), then terminates it if it does not."""
        if self.process.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.process.join(60)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join()
        self.conn.close()


@contextmanager
def children(make: Callable[[], dict[str, Child]]) -> Iterator[dict[str, Child]]:
    """`make()`'s children, closed on exit whatever happens."""
    started: dict[str, Child] = {}
    try:
        started.update(make())
        yield started
    finally:
        for child in started.values():
            child.close()


@contextmanager
def ps_shards(n: int) -> Iterator[list[Any]]:
    """`n` real `elastic-emb serve` shards on 127.0.0.1 (the tests' helper), stopped on exit."""
    tests_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    if tests_dir not in sys.path:
        sys.path.append(tests_dir)
    from _cluster import shards

    t0 = time.perf_counter()
    with shards(n) as started:
        log(f"{n} PS shards up in {time.perf_counter() - t0:.1f} s")
        yield started


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc; NaN elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------
# 1 and 2: end-to-end training, in-process vs remote


def e2e_worker(
    conn: multiprocessing.connection.Connection,
    ps: list[str] | None,
    wire: str,
    data_path: str,
    batch_size: int,
) -> None:
    """Child: builds the DLRM (remote tables when `ps`), then trains a window per message.

    Message: the number of batches (None: stop). Reply: the `Window`, and for
    a remote variant the per-shard `Cluster.stats()` of exactly that window
    (pushes still in flight are waited for outside the timed batches).
    """
    import keras
    import tensorflow as tf

    import elastic_emb as ee
    from elastic_emb.ps.client.remote_table import RemoteTable

    cluster = ee.init(ps=ps, mode="async", wire_dtype=wire) if ps else None
    arrays, vocab_sizes = c.load_data(data_path)
    model = c.build_keras3_dlrm("ee", "adagrad", vocab_sizes)
    runner = c.FitRunner(keras, model, c.BatchStream(tf, arrays, batch_size))
    tables = [layer.table for layer in model.layers if isinstance(layer, ee.Embedding)]
    info = {
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__},
        "gpu": bool(tf.config.list_physical_devices("GPU")),
        "tables": len(tables),
        "remote_tables": sum(isinstance(t, RemoteTable) for t in tables),
    }
    conn.send(("ready", info))
    while (steps := conn.recv()) is not None:
        if cluster is not None:
            cluster.flush()
            cluster.reset_stats()
        window = runner(steps)
        traffic = None
        if cluster is not None:
            cluster.flush()  # the last step's push is counted in this window
            traffic = cluster.stats()
        conn.send(("window", (window, traffic)))
    if cluster is not None:
        ee.shutdown()


class E2EVariant:
    """An `interleave` runner over an `e2e_worker` child; keeps each window's traffic."""

    def __init__(self, child: Child) -> None:
        self.child = child
        self.traffic: list[tuple[int, list[dict[str, Any]] | None]] = []

    def __call__(self, steps: int) -> c.Window:
        window, traffic = self.child.request(steps)
        self.traffic.append((steps, traffic))
        return window

    def timed_traffic(self) -> tuple[int, list[dict[str, float]]]:
        """(steps, per-shard totals) over the timed windows (the first, warm-up, left out)."""
        timed = self.traffic[1:]
        steps = sum(s for s, _ in timed)
        shards: list[dict[str, float]] = []
        for _, stats in timed:
            assert stats is not None
            for i, s in enumerate(stats):
                if i == len(shards):
                    shards.append(defaultdict(float))
                for key in ("rpcs", "bytes_sent", "bytes_received", "seconds"):
                    shards[i][key] += s[key]
        return steps, shards


def bench_e2e(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """Parts 1 and 2. Returns the Markdown tables and the versions/GPU facts."""
    ctx = multiprocessing.get_context("spawn")
    t0 = time.perf_counter()
    arrays, vocab_sizes = c.make_data(
        args.examples, seed=args.seed, vocab_size=c.parse_vocab(args.vocab)
    )
    seconds = time.perf_counter() - t0
    log(f"data: {args.examples:,} examples, {sum(vocab_sizes):,} ids, {seconds:.1f} s")
    tmp = tempfile.mkdtemp(prefix="ee-remote-bench-")
    data_path = os.path.join(tmp, "data.npz")
    c.save_data(data_path, arrays, vocab_sizes)
    del arrays
    try:
        with ps_shards(NUM_SHARDS * len(args.wires)) as shards:
            addresses = [s.address for s in shards]

            def make() -> dict[str, Child]:
                out = {
                    IN_PROCESS: Child(
                        ctx, IN_PROCESS, e2e_worker, None, "float32", data_path, args.batch_size
                    )
                }
                for i, wire in enumerate(args.wires):
                    ps = addresses[NUM_SHARDS * i : NUM_SHARDS * (i + 1)]
                    out[remote_name(wire)] = Child(
                        ctx, remote_name(wire), e2e_worker, ps, wire, data_path, args.batch_size
                    )
                return out

            with children(make) as workers:
                t0 = time.perf_counter()
                infos = {name: w.recv() for name, w in workers.items()}
                log(f"{len(workers)} training processes ready in {time.perf_counter() - t0:.1f} s")
                for name, info in infos.items():
                    want = 0 if name == IN_PROCESS else info["tables"]
                    if info["remote_tables"] != want:
                        raise RuntimeError(f"{name}: {info['remote_tables']} remote tables")
                runners = {name: E2EVariant(w) for name, w in workers.items()}
                results = c.interleave(
                    runners,
                    steps=args.steps,
                    rounds=args.rounds,
                    warmup_steps=args.warmup_steps,
                    log=log,
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    gpu = any(info["gpu"] for info in infos.values())
    machine = c.machine(gpu)
    workload = c.workload("adagrad", args.batch_size, vocab_sizes)
    shards_note = f"{NUM_SHARDS} shards on 127.0.0.1, async"
    inproc = results[IN_PROCESS]

    rows = []
    for wire in args.wires:
        r = results[remote_name(wire)]
        ratio = c.paired_ratio(r, inproc)
        rows.append(
            [
                workload,
                f"remote, {shards_note}, {wire} wire",
                c.fmt_rate(r.examples_per_s),
                c.fmt_rate(inproc.examples_per_s),
                c.fmt_ratio(ratio),
                f"≥ {E2E_TARGET}× ({'met' if ratio >= E2E_TARGET else 'missed'})",
                machine,
            ]
        )
    e2e_table = c.markdown_table(
        [
            "workload",
            "variant",
            "remote ex/s",
            "in-process ex/s",
            "remote / in-process",
            "target",
            "machine",
        ],
        rows,
    )
    notes = {IN_PROCESS: "in-process tables"}
    for wire in args.wires:
        notes[remote_name(wire)] = f"{shards_note}; CPU of the worker only, not the shards'"
    details = c.details_table(results, notes)

    # 2: bytes and RPCs per step over the same timed windows.
    per_step: dict[str, tuple[float, float, float, list[float], float]] = {}
    for wire in args.wires:
        steps, shard_totals = runners[remote_name(wire)].timed_traffic()
        sent = sum(s["bytes_sent"] for s in shard_totals) / steps
        received = sum(s["bytes_received"] for s in shard_totals) / steps
        rpcs = [s["rpcs"] / steps for s in shard_totals]
        rpc_ms = (
            1000 * sum(s["seconds"] for s in shard_totals) / sum(s["rpcs"] for s in shard_totals)
        )
        per_step[wire] = (sent, received, sent + received, rpcs, rpc_ms)
    base = per_step.get("float32")
    rows = []
    for wire, (sent, received, total, rpcs, rpc_ms) in per_step.items():
        ratio = "-" if base is None else f"{total / base[2]:.3f}×"  # 3 digits: vs the floor
        if wire == "float32":
            target = "-"
        else:
            met = base is not None and total / base[2] <= BYTES_TARGET
            target = f"≤ {BYTES_TARGET}× ({'met' if met else 'missed'})"
        rows.append(
            [
                f"{workload}, {shards_note}",
                wire,
                f"{sent / 1e6:.2f}",
                f"{received / 1e6:.2f}",
                f"{total / 1e6:.2f}",
                ratio,
                target,
                ", ".join(f"{x:.2f}" for x in rpcs),
                f"{rpc_ms:.1f}",
                machine,
            ]
        )
    bytes_table = c.markdown_table(
        [
            "workload",
            "wire",
            "MB sent / step",
            "MB received / step",
            "MB / step",
            "ratio to float32",
            "target",
            "RPCs / step, per shard",
            "mean RPC ms",
            "machine",
        ],
        rows,
    )
    dim = c.EMBEDDING_DIM
    windows = (
        f"{args.rounds} windows of {args.steps} batches after {args.warmup_steps} warm-up batches"
    )
    out = [
        f"### End-to-end DLRM training, remote vs in-process tables "
        f"(each variant in its own process; {windows}; ratio: median over rounds of "
        "remote / in-process ex/s within the round)",
        e2e_table,
        details,
        f"### Bytes on the wire per training step (Cluster.stats(), client side, all shards, "
        f"over the timed windows of the table above: {len(inproc.windows) * args.steps} steps "
        "per variant)",
        bytes_table,
        "Each distinct id of a step crosses the wire as a key in the Pull and again in the Push "
        "(ascending, delta + varint coded: 1-3 bytes for these ids instead of 8), and as a row "
        f"of {dim} values in the Pull's answer and in the Push's gradients; the values are what "
        "a 16-bit wire halves, so the ratio tends to 0.5 as keys get cheaper.",
    ]
    facts = {"versions": infos[IN_PROCESS]["versions"], "gpu": gpu}
    return out, facts


# ---------------------------------------------------------------------------------------------
# 3: PS throughput as concurrent clients grow


def ps_client(
    conn: multiprocessing.connection.Connection,
    ps: list[str],
    index: int,
    num_workers: int,
    batches: list[np.ndarray],
    seed: int,
) -> None:
    """Child: one PS client (worker `index`); loops fused pull + push on the driver's command.

    Messages: ("fill", keys): pre-insert keys with pulls (train=True);
    ("run", start, end): from monotonic time `start`, pull (train=True) and
    push a batch until `end` is passed; None: stop. Reply to "run":
    (loops, finish time, CPU seconds of this process).
    """
    import elastic_emb as ee

    cluster = ee.init(ps=ps, mode="async", worker_index=index, num_workers=num_workers)
    assert cluster is not None
    # Same name and config in every client: one table, shared on the shards.
    table = ee.Table(
        dim=CLIENT_DIM, optimizer=ee.optimizers.Adagrad(learning_rate=c.LEARNING_RATE), name="zipf"
    )
    rng = np.random.default_rng(seed)
    work = [
        (
            [(table.name, CLIENT_DIM, keys)],
            {
                table.name: (
                    CLIENT_DIM,
                    keys,
                    rng.normal(0, 0.01, (len(keys), CLIENT_DIM)).astype(np.float32),
                )
            },
        )
        for keys in batches
    ]
    conn.send(("ready", None))
    while (msg := conn.recv()) is not None:
        if msg[0] == "fill":
            keys = msg[1]
            for i in range(0, len(keys), FILL_CHUNK):
                cluster.pull([(table.name, CLIENT_DIM, keys[i : i + FILL_CHUNK])], insert=True)
            conn.send(("filled", len(table)))
            continue
        _, start, end = msg
        time.sleep(max(0.0, start - time.monotonic()))
        cpu0 = time.process_time()
        loops = 0
        while True:
            pulls, pushes = work[loops % len(work)]
            cluster.pull(pulls, insert=True)
            cluster.push(pushes)
            loops += 1
            if time.monotonic() >= end:
                break
        conn.send(("done", (loops, time.monotonic(), time.process_time() - cpu0)))
    ee.shutdown()


class ClientWindows:
    """`interleave` runners: a window of k clients looping together for a set time."""

    def __init__(self, clients: list[Child], shard_pids: list[int], keys_per_loop: int) -> None:
        self.clients = clients
        self.shard_pids = shard_pids
        self.keys_per_loop = keys_per_loop
        self.ps_cores: defaultdict[int, list[float]] = defaultdict(list)
        self.client_cores: defaultdict[int, list[float]] = defaultdict(list)

    def runner(self, k: int) -> Callable[[int], c.Window]:
        """The runner of k clients; `interleave`'s "steps" is the window length in ms."""
        return lambda window_ms: self.window(k, window_ms)

    def window(self, k: int, window_ms: int) -> c.Window:
        ps_cpu0 = sum(cpu_seconds(p) for p in self.shard_pids)
        start = time.monotonic() + START_DELAY
        for client in self.clients[:k]:
            client.send(("run", start, start + window_ms / 1000))
        replies = [client.recv() for client in self.clients[:k]]
        ps_cpu = sum(cpu_seconds(p) for p in self.shard_pids) - ps_cpu0
        wall = max(finish for _, finish, _ in replies) - start
        self.ps_cores[k].append(ps_cpu / wall)
        self.client_cores[k].append(sum(cpu for _, _, cpu in replies) / wall)
        loops = sum(n for n, _, _ in replies)
        return c.Window(loops * self.keys_per_loop / wall, float("nan"))


def bench_clients(args: argparse.Namespace) -> list[str]:
    """Part 3. Returns the Markdown table."""
    ctx = multiprocessing.get_context("spawn")
    counts = sorted(set(args.clients))
    num_workers = counts[-1]
    t0 = time.perf_counter()
    space = KeySpace(args.client_ids, args.seed)
    batches = [
        [b.keys for b in make_batches(space, "zipf", CLIENT_BATCHES, CLIENT_BATCH, 1000 + i)]
        for i in range(num_workers)
    ]
    distinct = statistics.median(len(np.unique(k)) for per in batches for k in per)
    log(f"client key batches: {time.perf_counter() - t0:.1f} s")
    with ps_shards(NUM_SHARDS) as shards:
        ps = [s.address for s in shards]

        def make() -> dict[str, Child]:
            return {
                f"client {i}": Child(
                    ctx, f"client {i}", ps_client, ps, i, num_workers, batches[i], 2000 + i
                )
                for i in range(num_workers)
            }

        with children(make) as started:
            clients = list(started.values())
            t0 = time.perf_counter()
            for client in clients:
                client.recv()
            log(f"{num_workers} clients connected in {time.perf_counter() - t0:.1f} s")
            t0 = time.perf_counter()
            rows = clients[0].request(("fill", space.keys))
            log(f"pre-inserted {rows:,} ids in {time.perf_counter() - t0:.1f} s")
            windows = ClientWindows(clients, [s.process.pid for s in shards], 2 * CLIENT_BATCH)
            names = {k: f"{k} client{'s' if k > 1 else ''}" for k in counts}
            results = c.interleave(
                {names[k]: windows.runner(k) for k in counts},
                steps=args.client_window_ms,
                rounds=args.client_rounds,
                warmup_steps=args.client_window_ms,
                log=log,
                unit="keys/s",
            )

    machine = c.machine()
    base = results[names[counts[0]]]
    workload = (
        f"fused Pull(train=True) + Push, {CLIENT_BATCH:,} Zipf({ZIPF_EXPONENT}) keys "
        f"(median {distinct:,.0f} distinct) over {args.client_ids:,} ids, dim {CLIENT_DIM} "
        f"Adagrad, {NUM_SHARDS} shards on 127.0.0.1, async"
    )
    rows = []
    for k in counts:
        r = results[names[k]]
        # The warm-up window is the first of ps_cores/client_cores: left out.
        rows.append(
            [
                workload,
                k,
                f"{r.examples_per_s / 1e6:.2f}",
                f"{r.examples_per_s / k / 1e6:.2f}",
                c.fmt_ratio(c.paired_ratio(r, base)),
                f"{statistics.median(windows.ps_cores[k][1:]):.2f}",
                f"{statistics.median(windows.client_cores[k][1:]):.2f}",
                f"{100 * r.spread:.0f}%",
                machine,
            ]
        )
    table = c.markdown_table(
        [
            "workload",
            "clients",
            "M keys/s (pull + push)",
            "M keys/s per client",
            f"scaling vs {counts[0]} client{'s' if counts[0] > 1 else ''}",
            "PS CPU (cores)",
            "clients CPU (cores)",
            "spread (max-min)/median",
            "machine",
        ],
        rows,
    )
    return [
        f"### PS throughput as concurrent clients grow (one process per client, "
        f"num_workers={num_workers}; {args.client_rounds} windows of "
        f"{args.client_window_ms / 1000:g} s per count after one warm-up window; scaling: median "
        "over rounds of the ratio within the round; CPU: CPU seconds per second of the window)",
        table,
    ]


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    c.add_run_args(p)
    p.add_argument("--sections", default="e2e,clients", help="comma-separated: e2e,clients")
    p.add_argument("--vocab", default="default", help=c.VOCAB_HELP)
    p.add_argument(
        "--wires",
        default=",".join(WIRES),
        help="comma-separated wire dtypes of the remote variants (float32 first: the bytes "
        "reference)",
    )
    p.add_argument(
        "--clients", type=int, nargs="+", default=[1, 2, 4, 8], help="client counts to compare"
    )
    p.add_argument("--client-ids", type=int, default=1_000_000, help="Zipf id space of part 3")
    p.add_argument(
        "--client-window-ms", type=int, help="length of a clients window (default 2000, quick 1000)"
    )
    p.add_argument(
        "--client-rounds", type=int, help="windows per client count (default 9, quick 3)"
    )
    args = c.finish_run_args(p.parse_args(argv))
    args.sections = [s for s in args.sections.split(",") if s]
    args.wires = [w for w in args.wires.split(",") if w]
    if not set(args.sections) <= {"e2e", "clients"}:
        p.error("--sections: choose from e2e, clients")
    if not args.wires or not set(args.wires) <= set(WIRES):
        p.error(f"--wires: choose from {', '.join(WIRES)}")
    if min(args.clients) < 1:
        p.error("--clients: counts must be >= 1")
    if args.client_window_ms is None:
        args.client_window_ms = 1000 if args.quick else 2000
    if args.client_rounds is None:
        args.client_rounds = 3 if args.quick else 9
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Runs the chosen sections and prints their Markdown tables to stdout."""
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # inherited by the children
    t_start = time.perf_counter()
    load_start = os.getloadavg()[0]
    tables: list[str] = []
    facts: dict[str, Any] = {}
    if "e2e" in args.sections:
        e2e_tables, facts = bench_e2e(args)
        tables += e2e_tables
    if "clients" in args.sections:
        tables += bench_clients(args)

    import grpc

    import elastic_emb

    versions = {"elastic_emb": elastic_emb.__version__, "grpcio": grpc.__version__}
    versions.update(facts.get("versions", {}))
    print()
    print(f"`{c.command_line()}`")
    print(
        ", ".join(f"{k} {v}" for k, v in versions.items())
        + f"; machine: {c.machine(facts.get('gpu', False))}; 1-min load average "
        f"{load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end (other work shares the "
        f"cores); {time.perf_counter() - t_start:.0f} s in all"
    )
    print()
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
