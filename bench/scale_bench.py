"""Hundreds of workers against replicated groups: throughput, the sync barrier, failover,
etcd's load and the servers' cost per connected worker, with every push accounted for.

A real cluster (etcd and 4 groups x R=2 `elastic-emb serve --coordinator`
processes on 127.0.0.1) and N light workers: each is a real client (`Routing`
and `Cluster`, its own etcd lease, worker index and gRPC connections) that pulls
and pushes one SGD table, without TensorFlow; many run as threads of a few
worker processes. Every gradient is 1 and the learning rate 1/8, so a row ends
at exactly -count/8, count being how many acknowledged pushes carried its key:
the check reads every row and compares (and each backup against its primary).

    python bench/scale_bench.py [--workers 16,64,256] [--modes sync,async]
                                [--kills 10] [--steps 30] [--batch 64]

Sections: one run per (mode, workers) pair, then, with the largest worker
count, the failover run (a primary SIGKILLed --kills times while every worker
trains, a new server copied in after each) and a live slot move (two servers
start, form a fifth group and take half a range) in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _light_workers import DIM, check_rows, keys_of, run_worker, separate_connections

from elastic_emb.ps.coord import membership
from elastic_emb.ps.coord.etcd import Etcd

WARM_UP_STEPS = 3  # steps every worker of a run makes before it is measured
# Priorities: etcd first, then the servers, then the simulated workers, as if each had
# machines of its own (on one small machine the workers would starve etcd of CPU).
SERVER_NICENESS, WORKER_NICENESS = 5, 10


# -- the worker processes --------------------------------------------------------------------


def worker_process(args: argparse.Namespace) -> None:
    """`--run-workers`: workers [first, first + count) as threads; one JSON line per worker."""
    separate_connections()
    stop = Path(args.stop)
    start_gate = threading.Barrier(args.count)
    warmed = threading.Barrier(args.count, action=Path(f"{args.stop}.ready-{args.first}").touch)
    lock = threading.Lock()

    def run(worker: int) -> None:
        def go_on(steps: int) -> bool:
            if args.steps < 0:  # connected and joined, idle until stopped
                while not stop.exists():
                    time.sleep(0.2)
                return False
            if steps == WARM_UP_STEPS:
                warmed.wait()
            return (args.steps == 0 or steps < args.steps) and not stop.exists()

        report = run_worker(
            args.coordinator,
            args.mode,
            worker,
            args.table,
            args.batch,
            go_on,
            start_gate.wait,
            lease_seconds=args.worker_lease,
        )
        if "error" in report:
            start_gate.abort(), warmed.abort()  # the others stop waiting for this one
        with lock:
            print(json.dumps(report), flush=True)

    threads = [
        threading.Thread(target=run, args=(args.first + i,), daemon=True) for i in range(args.count)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# -- measuring -------------------------------------------------------------------------------


def cpu_seconds(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def process_figures(pid: int) -> dict[str, int]:
    """RSS bytes, threads and open file descriptors of a process."""
    status = Path(f"/proc/{pid}/status").read_text()
    field = {line.split(":")[0]: line.split(":")[1].split() for line in status.splitlines()}
    return {
        "rss": int(field["VmRSS"][0]) * 1024,
        "threads": int(field["Threads"][0]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


def etcd_counters(url: str) -> dict[str, float]:
    """etcd's requests handled (all gRPC methods, the JSON gateway's included) and watch
    events sent, from its /metrics."""
    host = url.split("://", 1)[-1]
    text = urllib.request.urlopen(f"http://{host}/metrics", timeout=10).read().decode()
    requests = events = fsyncs = fsync_seconds = 0.0
    for line in text.splitlines():
        if line.startswith("grpc_server_handled_total{"):
            requests += float(line.rsplit(" ", 1)[1])
        elif line.startswith("etcd_debugging_mvcc_events_total "):
            events += float(line.rsplit(" ", 1)[1])
        elif line.startswith("etcd_disk_wal_fsync_duration_seconds_count "):
            fsyncs = float(line.rsplit(" ", 1)[1])
        elif line.startswith("etcd_disk_wal_fsync_duration_seconds_sum "):
            fsync_seconds = float(line.rsplit(" ", 1)[1])
    return {"requests": requests, "events": events, "fsyncs": fsyncs, "fsync s": fsync_seconds}


def pull_waits(addresses: list[str]) -> tuple[int, float]:
    """Pulls that waited for other workers and their seconds, summed over `addresses`."""
    import grpc

    from elastic_emb._proto import ps_pb2, ps_pb2_grpc

    calls, seconds = 0, 0.0
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            stats = stub.Stats(ps_pb2.StatsRequest(), timeout=10)
        calls, seconds = calls + stats.pull_waits, seconds + stats.pull_wait_seconds
    return calls, seconds


# -- one run ---------------------------------------------------------------------------------


class Run:
    """Worker processes training `table` until `stop()` (or `steps` each)."""

    def __init__(self, cluster, args, mode: str, workers: int, steps: int, table: str) -> None:
        self.table, self.stop_file = table, Path(cluster.directory) / f"stop-{table}"
        per = args.per_process
        self.processes = []
        self.firsts = range(0, workers, per)
        for first in self.firsts:
            command = [
                sys.executable, __file__, "--run-workers", "--coordinator", cluster.coordinator,
                "--mode", mode, "--first", str(first), "--count", str(min(per, workers - first)),
                "--steps", str(steps), "--batch", str(args.batch), "--table", table,
                "--stop", str(self.stop_file), "--worker-lease", str(args.worker_lease),
            ]  # fmt: skip
            self.processes.append(
                subprocess.Popen(
                    command,
                    stdout=subprocess.PIPE,
                    text=True,
                    env=_worker_env(),
                    preexec_fn=lambda: os.nice(WORKER_NICENESS),
                )
            )
        self.reports: list[dict] = []
        _RUNS.append(self)

    def wait_until_training(self, timeout: float = 600) -> None:
        """Until every worker has made WARM_UP_STEPS steps."""
        deadline = time.monotonic() + timeout
        ready = [Path(f"{self.stop_file}.ready-{first}") for first in self.firsts]
        while not all(r.exists() for r in ready):
            ended = [p for p in self.processes if p.poll() is not None]
            if ended:
                out = ended[0].communicate()[0]
                errors = [line for line in out.splitlines() if '"error"' in line]
                raise RuntimeError(
                    f"worker process {ended[0].args[6:10]} ended ({ended[0].returncode}): "
                    f"{errors[:2] or out[-2000:]}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"the workers did not start within {timeout} s")
            time.sleep(0.1)

    def stop(self) -> None:
        self.stop_file.touch()

    def wait(self, timeout: float) -> list[dict]:
        for p in self.processes:
            out, _ = p.communicate(timeout=timeout)
            self.reports += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        errors = [r for r in self.reports if "error" in r]
        if errors:
            raise RuntimeError(f"{len(errors)} workers failed, e.g. {errors[0]['error']}")
        return self.reports

    def kill(self) -> None:
        """Ends the worker processes still running (a failed run)."""
        for p in self.processes:
            if p.poll() is None:
                p.kill()
                p.communicate()

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]


_RUNS: list[Run] = []  # killed when the benchmark ends, whatever happened


def _worker_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_EMB_")}
    return {**env, "TF_CPP_MIN_LOG_LEVEL": "3"}


def lower_servers(cluster) -> None:
    for p in cluster.servers.values():
        if p.poll() is None:
            os.setpriority(os.PRIO_PROCESS, p.pid, SERVER_NICENESS)


def servers_figures(cluster) -> dict[str, float]:
    figures = [process_figures(p.pid) for p in cluster.servers.values() if p.poll() is None]
    return {k: statistics.mean(f[k] for f in figures) for k in figures[0]}


def measure(cluster, args, mode: str, workers: int) -> dict:
    """One run of `workers` workers, measured for `args.seconds` once all are training."""
    table = f"{mode}{workers}"
    lower_servers(cluster)
    server_pids = [p.pid for p in cluster.servers.values()]
    etcd_pid = cluster.etcd.process.pid
    idle = servers_figures(cluster)
    epochs = sum(g.epoch for g in cluster.map().groups)
    run = Run(cluster, args, mode, workers, 0, table)
    run.wait_until_training()
    connected = servers_figures(cluster)

    def sample() -> dict:
        return {
            "servers": cpu_seconds(server_pids),
            "workers": cpu_seconds(run.pids()),
            "etcd cpu": cpu_seconds([etcd_pid]),
            "etcd": etcd_counters(cluster.coordinator),
            "waits": pull_waits(list(cluster.servers)),
            "wall": time.monotonic(),
        }

    first = sample()
    time.sleep(args.seconds)
    last = sample()
    wall0, wall1 = first["wall"], last["wall"]
    cpu0, cpu1 = first["servers"], last["servers"]
    worker_cpu0, worker_cpu1 = first["workers"], last["workers"]
    etcd_cpu0, etcd_cpu1 = first["etcd cpu"], last["etcd cpu"]
    etcd0, etcd1 = first["etcd"], last["etcd"]
    waits0, waits1 = first["waits"], last["waits"]
    run.stop()
    reports = run.wait(600)
    groups = cluster.map().groups
    rows = check_rows(groups, table, reports, args.batch)
    steps = [
        (end, s, p)
        for r in reports
        for end, s, p in zip(r["ends"], r["step"], r["pull"], strict=True)
        if wall0 <= end <= wall1
    ]
    key_count = sum(
        len(keys_of(r["worker"], i + 1, args.batch))
        for r in reports
        for i, end in enumerate(r["ends"])
        if wall0 <= end <= wall1
    )
    seconds = wall1 - wall0
    wait_calls, wait_seconds = waits1[0] - waits0[0], waits1[1] - waits0[1]
    return {
        "mode": mode,
        "workers": workers,
        "steps": len(steps),
        "keys/s": 2 * key_count / seconds,  # pulled and pushed
        "keys per server CPU s": 2 * key_count / max(cpu1 - cpu0, 1e-9),
        "server CPU ms per step": 1e3 * (cpu1 - cpu0) / max(len(steps), 1),
        "server CPU s/s": (cpu1 - cpu0) / seconds,
        "worker CPU s/s": (worker_cpu1 - worker_cpu0) / seconds,
        "step ms": 1e3 * statistics.median(s for _, s, _ in steps),
        "pull ms": 1e3 * statistics.median(p for _, _, p in steps),
        "wait ms/pull": 1e3 * wait_seconds / max(wait_calls, 1),
        "wait ms/pull per worker": 1e3 * wait_seconds / max(wait_calls, 1) / workers,
        "etcd CPU s/s": (etcd_cpu1 - etcd_cpu0) / seconds,
        "etcd req/s": (etcd1["requests"] - etcd0["requests"]) / seconds,
        "watch events/s": (etcd1["events"] - etcd0["events"]) / seconds,
        "etcd fsync ms": 1e3
        * (etcd1["fsync s"] - etcd0["fsync s"])
        / max(etcd1["fsyncs"] - etcd0["fsyncs"], 1),
        "rss per worker KiB": (connected["rss"] - idle["rss"]) / workers / 1024,
        "threads": connected["threads"],
        "fds": connected["fds"],
        "lease lapses": sum(r.get("lease lapses", 0) for r in reports),
        # Nothing was killed: a new epoch is a backup taking over from a live primary.
        "failovers": sum(g.epoch for g in groups) - epochs,
        "rows checked": rows,
    }


def idle_cost(cluster, args, mode: str, workers: int) -> dict:
    """What `workers` connected workers cost while none steps (leases, watches, connections,
    the servers' own pings and load reports): CPU-seconds per second of each part."""
    table = f"idle{mode}{workers}"
    servers = [p.pid for p in cluster.servers.values() if p.poll() is None]
    etcd = cluster.etcd.process.pid

    def sample(pids: list[int]) -> tuple[float, float, float, float]:
        return cpu_seconds(servers), cpu_seconds([etcd]), cpu_seconds(pids), time.monotonic()

    s0, e0, _, t0 = sample([])
    time.sleep(args.seconds)
    s1, e1, _, t1 = sample([])
    run = Run(cluster, args, mode, workers, -1, table)
    prefix = membership.workers_prefix(membership.DEFAULT_PREFIX)
    with Etcd(cluster.coordinator) as etcd_client:
        cluster.wait_until(
            lambda: len(etcd_client.get_prefix(prefix)[0]) >= workers, 600, "workers registered"
        )
        time.sleep(3.0)  # (every worker's first calls done)
        s2, e2, w2, t2 = sample(run.pids())
        time.sleep(args.seconds)
        s3, e3, w3, t3 = sample(run.pids())
    run.stop()
    run.wait(600)
    return {
        "mode": mode,
        "workers": workers,
        "server CPU s/s, no workers": (s1 - s0) / (t1 - t0),
        "server CPU s/s": (s3 - s2) / (t3 - t2),
        "etcd CPU s/s, no workers": (e1 - e0) / (t1 - t0),
        "etcd CPU s/s": (e3 - e2) / (t3 - t2),
        "worker CPU s/s": (w3 - w2) / (t3 - t2),
        "worker CPU ms/s per worker": 1e3 * (w3 - w2) / (t3 - t2) / workers,
    }


def failover_and_move(cluster, args, mode: str, workers: int) -> dict:
    """Kills a primary --kills times while `workers` train, then moves slots live; checks."""
    table = f"failover{mode}{workers}"
    run = Run(cluster, args, mode, workers, 0, table)
    run.wait_until_training()
    kills: list[tuple[float, str]] = []
    promoted: list[float] = []  # kill -> the map names another primary of its group
    for k in range(args.kills):
        time.sleep(1.0)
        # Only with every group whole: a backup dropped under load (its lease lapsed) may not
        # be back yet, and a group's last replica killed loses its rows by design.
        cluster.wait_until(cluster.complete, 300, "every group has its backup again")
        victim = cluster.primaries()[k % len(cluster.primaries())]
        cluster.kill(victim)
        killed = time.monotonic()
        kills.append((killed, victim))
        cluster.wait_until(lambda v=victim: v not in cluster.primaries(), 60, "a backup took over")
        promoted.append(time.monotonic() - killed)
        newcomer = cluster.start_server()
        lower_servers(cluster)
        cluster.wait_until(
            lambda n=newcomer: any(n in g.members for g in cluster.map().groups), 300,
            "the new server is a backup",
        )  # fmt: skip
    moved_at = time.monotonic()
    before = len(cluster.map().ranges)
    cluster.start_server(), cluster.start_server()
    lower_servers(cluster)
    cluster.wait_until(
        lambda: len(cluster.map().ranges) > before and cluster.map().move is None, 300,
        "a fifth group took half a range",
    )  # fmt: skip
    move_seconds = time.monotonic() - moved_at
    time.sleep(2.0)
    run.stop()
    reports = run.wait(600)
    rows = check_rows(cluster.map().groups, table, reports, args.batch)
    # Per kill and worker: its first step begun after the kill, until it completed; and the
    # step it was in when the kill came (what the kill added to it: its time over a step's).
    after: list[float] = []
    spanning: list[float] = []
    for killed, _ in kills:
        for r in reports:
            begun = [e - d for e, d in zip(r["ends"], r["step"], strict=True)]
            first = next((e for e, b in zip(r["ends"], begun, strict=True) if b > killed), None)
            if first is not None:
                after.append(first - killed)
            spanning += [d for e, b, d in zip(r["ends"], begun, r["step"], strict=True)
                         if b <= killed < e]  # fmt: skip
    normal = statistics.median(d for r in reports for d in r["step"])
    slowest = max(max(r["step"]) for r in reports)
    return {
        "mode": mode,
        "workers": workers,
        "kills": len(kills),
        "kill -> backup promoted, median ms": 1e3 * statistics.median(promoted),
        "promoted max ms": 1e3 * max(promoted),
        "step ms, median (all steps)": 1e3 * normal,
        "kill -> a step begun after it done, median ms": 1e3 * statistics.median(after),
        "p90 ms": 1e3 * sorted(after)[int(0.9 * (len(after) - 1))],
        "max ms": 1e3 * max(after),
        "step in flight at the kill, median ms": 1e3 * statistics.median(spanning),
        "slot move s (start -> cutover)": move_seconds,
        "slowest step s": slowest,
        "lease lapses": sum(r.get("lease lapses", 0) for r in reports),
        "rows checked": rows,
    }


def table(rows: list[dict]) -> None:
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("| " + " | ".join("---" for _ in keys) + " |")
    for r in rows:
        cells = [f"{v:,.2f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else v
                 for v in r.values()]  # fmt: skip
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="16,64,256")
    parser.add_argument("--modes", default="sync,async")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured per run")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument(
        "--idle", action="store_true", help="only what connected, idle workers cost (per count)"
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--per-process", type=int, default=16, help="workers per process")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument(
        "--worker-lease", type=int, default=3, help="each worker's etcd lease TTL, seconds"
    )
    parser.add_argument(
        "--server-lease", type=int, default=2, help="each server's etcd lease TTL, seconds"
    )
    parser.add_argument(
        "--cluster-dir",
        help="etcd's data and the servers' logs (default: a new directory in /dev/shm, where "
        "etcd's fsyncs cost what they do on a server's SSD, not this VM disk's ~13 ms)",
    )
    # A worker process (started by the runs).
    parser.add_argument("--run-workers", action="store_true", help=argparse.SUPPRESS)
    for name in ("--coordinator", "--mode", "--table", "--stop"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    for name in ("--first", "--count", "--steps"):
        parser.add_argument(name, type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_workers:
        return worker_process(args)

    from elastic_emb.ps.coord.local_cluster import LocalCluster

    counts = [int(w) for w in args.workers.split(",")]
    modes = args.modes.split(",")
    cpu = platform.processor() or platform.machine()
    print(
        f"Machine: {os.cpu_count()} cores, {cpu}, no GPU; {args.groups} groups x R=2, batch "
        f"{args.batch} keys, dim {DIM}, SGD; leases: worker {args.worker_lease} s, server "
        f"{args.server_lease} s"
    )
    results, faults = [], []
    if args.cluster_dir is None and Path("/dev/shm").is_dir():
        args.cluster_dir = tempfile.mkdtemp(prefix="ee-scale-", dir="/dev/shm")
    try:
        for mode in modes:  # a cluster per mode: a shard's mode is set by its first worker
            directory = Path(args.cluster_dir) / mode
            with LocalCluster(args.groups, 2, directory, args.server_lease) as cluster:
                for workers in counts:
                    if args.idle:
                        results.append(idle_cost(cluster, args, mode, workers))
                        continue
                    results.append(measure(cluster, args, mode, workers))
                    print(json.dumps(results[-1]), file=sys.stderr, flush=True)
                if args.kills and not args.idle:
                    faults.append(failover_and_move(cluster, args, mode, max(counts)))
                    print(json.dumps(faults[-1]), file=sys.stderr, flush=True)
    finally:
        for run in _RUNS:
            run.kill()
    if args.idle:
        print("\n## What connected, idle workers cost\n")
    else:
        print("\n## Throughput, barrier, etcd and server cost by number of workers\n")
    table(results)
    if faults:
        print("\n## Failover with every worker connected, then a live slot move\n")
        table(faults)


if __name__ == "__main__":
    main()
