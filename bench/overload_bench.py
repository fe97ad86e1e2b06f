"""Overload: workers offering 1x, 2x and 4x what one server answers, with the data plane's
admission control (`serve --max-active-requests`, `--max-requests-per-connection`) on and
off, every push accounted for.

One `elastic-emb serve` (async, one SGD table, learning rate 1/8) pinned to CPU 0; the
workers, each a thread with its own `ShardClient` (one data-plane connection, as a worker
process has), pinned to the other CPUs. First the server's capacity: closed-loop workers
pushing back to back. Then each worker pushes at a paced rate (open loop: a push late
because the one before it waited goes at once), so that together they offer a multiple
of that capacity, for --seconds; then a quarter of the capacity for --seconds, to see the
server recover. Every gradient is 1, so a row ends at exactly -count/8, count being the
acknowledged pushes that carried its key: the check reads every row at the end.

    python bench/overload_bench.py [--loads 1,2,4] [--workers 64] [--keys 4096]
                                   [--seconds 5] [--variants limits,none]
                                   [--memory-budget BYTES]

Per run: pushes acknowledged per second, the server's refusals and the client's sends
again, calls that failed, the push latency (median, 99th percentile), the server's
threads and resident memory (highest sampled) and its CPU seconds per 1,000 pushes; and
the tables' bytes against the server's memory budget (`serve --memory-budget`, its
metrics), with the resident memory beyond the tables (what requests in flight take).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _cluster import metrics_url, scrape, shards

import elastic_emb as ee
from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.ps.client.shard_client import ShardClient
from elastic_emb.ps.wire import security

DIM, LEARNING_RATE, VOCAB = 8, 0.125, 1_000_000
BATCHES = 8  # distinct pushes per worker, cycled
VARIANTS = {
    "limits": [],  # the defaults: 32 per core handled at once, 256 per connection
    "none": ["--max-active-requests", "0", "--max-requests-per-connection", "0"],
}


def _process_stats(pid: int) -> tuple[int, int, float]:
    """(resident bytes, threads, CPU seconds) of process `pid`."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss = int(fields["VmRSS"].split()[0]) * 1024
    threads = int(fields["Threads"])
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    return rss, threads, cpu


class Worker:
    """One worker: its client, its next step, and what it saw."""

    def __init__(self, address: str, index: int, keys: int) -> None:
        self.client = ShardClient([address], timeout=120)
        self.client.connect_data_plane()
        self.index, self.keys, self.step, self.pushes = index, keys, 0, 0
        self.counts = np.zeros(VOCAB, np.int64)  # acknowledged pushes per key
        self.latencies: list[float] = []
        self.failed: list[str] = []
        # Made once (each push cycles through them): the workers' own cost stays small, so
        # that one core of them can offer several times what the server's core answers.
        self.batches = []
        for b in range(BATCHES):
            rng = np.random.default_rng((index, b))
            ids = np.unique(rng.integers(0, VOCAB, keys)).astype("<i8")
            gradients = np.ones((len(ids), DIM), "<f4").tobytes()
            entry = ps_pb2.TableGradients(table="rows", keys=ids.tobytes(), gradients=gradients)
            self.batches.append((ids, entry))

    def push(self) -> None:
        self.step += 1
        keys, entry = self.batches[self.step % len(self.batches)]
        request = ps_pb2.PushRequest(worker=self.index, step=self.step, tables=[entry])
        start = time.perf_counter()
        try:
            self.client.call(0, "Push", request)
        except Exception as e:  # (counted and reported: a worker that died)
            self.failed.append(f"{type(e).__name__}: {e}")
            self.step -= 1
            raise
        self.latencies.append(time.perf_counter() - start)
        self.counts[keys] += 1
        self.pushes += 1

    def run(self, rate: float | None, seconds: float) -> None:
        """Pushes for `seconds`: back to back (`rate` None) or `rate` per second."""
        start = time.perf_counter()
        sent = 0
        while (now := time.perf_counter()) - start < seconds:
            if rate is not None:
                due = start + sent / rate
                if due > now:
                    time.sleep(due - now)
            try:
                self.push()
            except Exception:  # (its `failed` says why)
                return
            sent += 1


def _phase(workers: list[Worker], rate: float | None, seconds: float, pid: int) -> dict:
    """All workers for `seconds`; the server sampled meanwhile."""
    for w in workers:
        w.latencies.clear()
    acknowledged = sum(w.pushes for w in workers)
    _, _, cpu_before = _process_stats(pid)
    workers_before = time.process_time()
    peak = {"rss": 0, "threads": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.1):
            rss, threads, _ = _process_stats(pid)
            peak["rss"], peak["threads"] = max(peak["rss"], rss), max(peak["threads"], threads)

    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=w.run, args=(rate, seconds)) for w in workers]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    _, _, cpu_after = _process_stats(pid)
    workers_cpu = time.process_time() - workers_before
    pushes = sum(w.pushes for w in workers) - acknowledged
    latencies = sorted(x for w in workers for x in w.latencies)
    return {
        "pushes_per_s": pushes / wall,
        "pushes": pushes,
        "p50_ms": 1e3 * statistics.median(latencies) if latencies else float("nan"),
        "p99_ms": 1e3 * latencies[int(0.99 * (len(latencies) - 1))] if latencies else float("nan"),
        "server_cpu_ms_per_1k": 1e6 * (cpu_after - cpu_before) / max(pushes, 1),
        "server_busy": (cpu_after - cpu_before) / wall,  # of its one core
        "workers_busy": workers_cpu / wall,  # of theirs (the other cores)
        "server_rss_mb": peak["rss"] / 2**20,
        "server_threads": peak["threads"],
    }


def _run(variant: str, args: argparse.Namespace, cpus: list[int]) -> list[dict]:
    budget = ["--memory-budget", args.memory_budget] if args.memory_budget else []
    with shards(1, [*VARIANTS[variant], *budget, "--metrics-port", "0"]) as (ps,):
        pid = ps.process.pid
        os.sched_setaffinity(pid, {0})
        for thread in Path(f"/proc/{pid}/task").iterdir():
            os.sched_setaffinity(int(thread.name), {0})
        os.sched_setaffinity(0, set(cpus))
        stub = ps_pb2_grpc.ParameterServerStub(
            security.channel(ps.address, security.GRPC_OPTIONS, None)
        )
        table = ee.Table(DIM, ee.optimizers.SGD(LEARNING_RATE), initializer="zeros", name="rows")
        spec = ps_pb2.TableSpec(name="rows", config_json=json.dumps(table.config()))
        stub.CreateTables(ps_pb2.CreateTablesRequest(tables=[spec]), timeout=10)
        for w in range(args.workers):
            stub.Join(
                ps_pb2.JoinRequest(
                    worker=w, num_workers=args.workers, mode=ps_pb2.ASYNC, staleness=-1
                ),
                timeout=10,
            )
        workers = [Worker(ps.address, w, args.keys) for w in range(args.workers)]
        url = metrics_url(ps)

        def refused() -> float:
            return scrape(url).get(("elastic_emb_data_plane_overloaded_total", ()), 0.0)

        def memory() -> tuple[float, float]:
            """The tables' bytes and the budget, as the server's metrics say."""
            m = scrape(url)
            return m[("elastic_emb_memory_used_bytes", ())], m[
                ("elastic_emb_memory_budget_bytes", ())
            ]

        rows = []
        for w in workers:  # every row inserted: the phases measure updates alone
            for _ in range(BATCHES):
                w.push()
        capacity = _phase(workers, None, args.seconds, pid)["pushes_per_s"]
        for load in [*args.loads, 0.25]:
            before = refused(), sum(s["overloaded"] for w in workers for s in w.client.stats())
            result = _phase(workers, load * capacity / args.workers, args.seconds, pid)
            after = refused(), sum(s["overloaded"] for w in workers for s in w.client.stats())
            tables, budget_bytes = memory()
            result.update(
                tables_mb=tables / 2**20,
                budget_mb=budget_bytes / 2**20,
                beyond_tables_mb=result["server_rss_mb"] - tables / 2**20,
                variant=variant,
                load=load,
                capacity=capacity,
                refused=after[0] - before[0],
                sent_again=after[1] - before[1],
                failed=sum(len(w.failed) for w in workers),
            )
            rows.append(result)
            print(json.dumps(result), flush=True)
        # The check: every acknowledged push in the rows exactly once, nothing else.
        counts = sum(w.counts for w in workers)
        exported = stub.ExportRows(ps_pb2.ExportRowsRequest(table="rows"), timeout=60)
        keys = np.frombuffer(exported.keys, "<i8")
        values = np.frombuffer(exported.values, "<f4").reshape(-1, DIM)
        expected = -LEARNING_RATE * counts[keys].astype(np.float32)
        exact = bool(np.array_equal(values, np.repeat(expected[:, None], DIM, 1)))
        exact = exact and set(np.flatnonzero(counts)) <= set(keys.tolist())
        for row in rows:
            row["exact"] = exact
        for w in workers:
            w.client.close()
        return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", default="1,2,4", help="offered loads, times the capacity")
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--keys", type=int, default=4096, help="keys drawn per push")
    parser.add_argument("--seconds", type=float, default=5.0, help="per phase")
    parser.add_argument("--variants", default="limits,none")
    parser.add_argument("--memory-budget", default="", help="serve --memory-budget (default: its)")
    args = parser.parse_args()
    args.loads = [float(x) for x in args.loads.split(",")]
    cpus = sorted(os.sched_getaffinity(0) - {0}) or [0]
    rows = [row for v in args.variants.split(",") for row in _run(v, args, cpus)]
    cpu = platform.processor() or platform.machine()
    print(
        f"\n{os.cpu_count()} cores ({cpu}), no GPU; server on CPU 0, workers on {cpus}; "
        f"{args.workers} workers, {args.keys} keys a push, {args.seconds:g} s a phase\n"
    )
    print(
        "| admission | offered | pushes/s | refused | sent again | failed | p50 ms | p99 ms "
        "| server CPU ms / 1k pushes | server core busy | workers' cores busy | server threads "
        "| server RSS MB | tables MB / budget MB | RSS beyond the tables MB | exact |"
    )
    print("| --- " * 16 + "|")
    for r in rows:
        offered = "recovery 0.25x" if r["load"] == 0.25 else f"{r['load']:g}x"
        print(f"| {r['variant']} | {offered} of {r['capacity']:,.0f}/s | "
              f"{r['pushes_per_s']:,.0f} | {r['refused']:,.0f} | {r['sent_again']:,} | "
              f"{r['failed']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
              f"{r['server_cpu_ms_per_1k']:.0f} | {r['server_busy']:.0%} | "
              f"{r['workers_busy']:.0%} | "
              f"{r['server_threads']} | {r['server_rss_mb']:.0f} | "
              f"{r['tables_mb']:.1f} / {r['budget_mb']:,.0f} | {r['beyond_tables_mb']:.0f} | "
              f"{r['exact']} |")  # fmt: skip
    return 0 if all(r["exact"] and r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
