"""Chaos soak: a replicated cluster trains while a seeded injector kills and pauses servers
and workers and cuts, slows and flaps servers' links; at the end every row must be exact.

A real cluster (`LocalCluster`: etcd, `--groups` groups x R=2 `elastic-emb serve
--coordinator` processes and `--spares` spare servers on 127.0.0.1; each server, a
replacement too, behind proxies of its own, tests/_link_proxy.py: its ways in, gRPC and
data plane, which it advertises, and its link to etcd, its `--coordinator`) and `--workers`
worker processes (this script with `--worker-process`): each is a real elastic client
(`Routing` and `Cluster`, no TensorFlow) that pulls and pushes one SGD table (learning
rate 1/8, gradients of 1). The keys of a worker's step are a function of (worker, step
number) (`_light_workers.keys_of`), and a worker's step number is the one the shards
give it at Join (async: its last step that every range has; sync: the steps applied),
so a restarted worker pushes again from where the shards stand. Each row must end at
exactly -count/8, count being the steps 1..final of every worker that carry its key,
on every replica (`_light_workers.check_rows`).

The faults, drawn from `--seed` before the run (exponential gaps of mean
`--fault-interval` seconds; the kind by `--weights`; the target as a group and a role,
or a worker index; the length): SIGKILL of a server (its replacement starts once
the map has dropped it: a spare or the replacement takes its place), SIGSTOP of a server
for 0.5-6 s (the lease TTL is 2 s) then SIGCONT, SIGKILL of a worker (restarted at once
with the same index), SIGSTOP of a worker then SIGCONT; and faults of a server's links,
every process alive: `cut-server`, its ways in cut for 0.5-6 s, both ways, or only what
reaches it ("in"), or only what it answers ("out"), workers and its group's other replica
alike (it may be failed over: nobody can tell it from a dead one); `cut-server-etcd`, its
link to etcd cut for 0.5-6 s; `slow-server`, its ways in delayed 200 ms each way for
2-8 s; `flap-server-etcd`, its link to etcd cut 1 s in every 3 s (seeded offsets) for
6-12 s. The link faults' own draws (direction, length, flap seed) come from a second
stream of the seed, so with their weights 0 a seed gives the schedule it gave before they
existed (`--weights kill-server=1,pause-server=1,kill-worker=1,pause-worker=1`); by
default every kind has weight 1. A server fault waits until its group has all its
replicas, each registered and none paused or under a link fault (the injector never
takes a group below one live replica). The proxies of a killed server stay open until the
end, resetting every connection as a dead server's port refuses it (so no later server is
given its address). In sync mode no worker is killed (a worker that dies changes which
pushes a step sums) and worker pauses last 0.5-4 s (a sync worker gone
for longer than its lease and the servers' grace, about 5 s, is counted out of the
steps completed without it, by design).

Recovery is measured from the injection, on the events observed: a server fault, until
every worker not itself under a fault has completed a step it began after the
injection; a worker fault, until that worker completes its next step; and, for server
faults, until the map lists the group with all its replicas again. A link fault is
measured as a server fault, from its start (a flap's first cut comes within 3 s). For
server faults also: the longest stall (the longest a worker under no fault of its own
went without a step, until the fault, its recovery and its group's return all ended: a
link to etcd cut stalls nobody until the lease lapses, after the recovery as measured),
and whether a paused or impaired server lost its place in the map (displaced).

    python bench/chaos.py [--duration 600] [--seed 1] [--mode async|sync] [--groups 2]
                          [--spares 1] [--workers 4] [--fault-interval 10]
                          [--weights kill-server=1,pause-server=1,kill-worker=1,
                                     pause-worker=1,cut-server=1,cut-server-etcd=1,
                                     slow-server=1,flap-server-etcd=1]
                          [--batch 128] [--pace 0.02] [--json FILE] [--directory DIR]

Exit status 1 if the check fails, a process died by itself, or a fault never recovered.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _history import acknowledged_epochs, check_epochs
from _light_workers import DIM, LEARNING_RATE, check_rows, keys_of
from _link_proxy import LinkProxy, flap_schedule

from elastic_emb.ps.coord import membership
from elastic_emb.ps.coord.etcd import Etcd, EtcdError
from elastic_emb.ps.coord.local_cluster import LocalCluster, free_port
from elastic_emb.ps.coord.membership import DEFAULT_PREFIX, ClusterMap
from elastic_emb.ps.server import acknowledged

REPLICAS = 2
LEASE_SECONDS = 2  # the servers' lease TTL
TABLE = "chaos"
WORKER_KINDS = ("kill-worker", "pause-worker")
LINK_KINDS = ("cut-server", "cut-server-etcd", "slow-server", "flap-server-etcd")
# (New kinds go at the end: a kind's index is what the seed draws.)
KINDS = ("kill-server", "pause-server", *WORKER_KINDS, *LINK_KINDS)
SERVER_PAUSE = (0.5, 6.0)  # seconds
CUT = (0.5, 6.0)  # seconds a link is cut (cut-server, cut-server-etcd)
CUT_DIRECTIONS = ("both", "in", "out")
SLOW = (2.0, 8.0)  # seconds a server's ways in are slowed
SLOW_DELAY = 0.2  # seconds each byte is delayed, each way
FLAP = (6.0, 12.0)  # seconds a link flaps
FLAP_EVERY, FLAP_CUT = 3.0, 1.0  # a cut of 1 s in every 3 s (within the lease TTL)
WORKER_PAUSE = {"async": (0.5, 6.0), "sync": (0.5, 4.0)}
# After SIGCONT a server may find its lease gone and leave its group: it counts as
# unsettled (its group takes no fault) for this long.
SETTLE_SECONDS = LEASE_SECONDS + 1.0
DEFER_LIMIT = 120.0  # seconds a fault waits for its target to be ready before it is skipped
TICK = 0.05
# Priorities: etcd first, then the servers, then the workers, as if each had machines of
# its own (on a small machine, starved servers miss lease renewals: faults nobody injected).
SERVER_NICENESS, WORKER_NICENESS = 5, 10


# -- the schedule ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fault:
    """One planned fault."""

    at: float  # seconds after the soak's start
    kind: str  # one of KINDS
    target: int  # the group (server faults) or the worker index
    role: str  # "primary" or "backup" (server faults), "" (worker faults)
    pause: float  # seconds it lasts (pauses and link faults), else 0
    direction: str = ""  # cut-server: "both", "in" or "out"
    flap_seed: int = 0  # flap-server-etcd: the seed of its cuts' offsets


LIVE = ("pause-server", *LINK_KINDS)  # server faults that leave the process alive


def is_server_kind(kind: str) -> bool:
    return kind not in WORKER_KINDS


def make_schedule(
    seed: int,
    duration: float,
    interval: float,
    weights: dict[str, float],
    groups: int,
    workers: int,
    mode: str,
) -> list[Fault]:
    """The faults of a soak: a pure function of its arguments. Every draw is made for every
    fault, so the times and targets do not depend on which kinds have weight; the link
    faults' own draws come from a second stream, so that they change nothing else."""
    if mode == "sync":
        weights = {**weights, "kill-worker": 0.0}
    total = sum(weights.get(k, 0.0) for k in KINDS)
    if total <= 0:
        return []
    p = np.array([weights.get(k, 0.0) / total for k in KINDS])
    rng = np.random.default_rng(seed)
    links = np.random.default_rng((seed, 1))
    faults, at = [], 0.0
    while True:
        at += float(rng.exponential(interval))
        kind = KINDS[int(rng.choice(len(KINDS), p=p))]
        group, role = int(rng.integers(groups)), ("primary", "backup")[int(rng.integers(2))]
        worker = int(rng.integers(workers))
        server_pause = float(rng.uniform(*SERVER_PAUSE))
        worker_pause = float(rng.uniform(*WORKER_PAUSE[mode]))
        direction = CUT_DIRECTIONS[int(links.integers(len(CUT_DIRECTIONS)))]
        lengths = {
            "pause-server": server_pause,
            "cut-server": float(links.uniform(*CUT)),
            "cut-server-etcd": float(links.uniform(*CUT)),
            "slow-server": float(links.uniform(*SLOW)),
            "flap-server-etcd": float(links.uniform(*FLAP)),
        }
        flap_seed = int(links.integers(2**31))
        if at >= duration:
            return faults
        if is_server_kind(kind):
            pause = round(lengths.get(kind, 0.0), 2)
            fault = Fault(round(at, 3), kind, group, role, pause)
            if kind == "cut-server":
                fault = dataclasses.replace(fault, direction=direction)
            elif kind == "flap-server-etcd":
                fault = dataclasses.replace(fault, flap_seed=flap_seed)
            faults.append(fault)
        else:
            pause = worker_pause if kind == "pause-worker" else 0.0
            faults.append(Fault(round(at, 3), kind, worker, "", round(pause, 2)))


def parse_weights(text: str) -> dict[str, float]:
    weights = {k: 0.0 for k in KINDS}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name not in KINDS:
            raise SystemExit(f"--weights: unknown fault {name!r} (known: {', '.join(KINDS)})")
        weights[name] = float(value)
    return weights


# -- the worker processes --------------------------------------------------------------------


def worker_process(args: argparse.Namespace) -> None:
    """`--worker-process`: one elastic worker. It writes one JSON line per event to
    `args.log` (`joined` with the step the shards gave it, `begin` and `step` per step,
    `done`), each written through at once, so a SIGKILL loses no line."""
    from elastic_emb.ps.client.cluster import Cluster, ClusterOptions
    from elastic_emb.ps.client.routing import Routing
    from elastic_emb.tables.policies.optimizers import SGD
    from elastic_emb.tables.table import TableConfig

    log = open(args.log, "a", buffering=1)

    def note(event: str, **fields: Any) -> None:
        log.write(json.dumps({"e": event, "t": time.monotonic(), **fields}) + "\n")

    note("start")
    options = ClusterOptions(
        mode=args.mode, worker_index=args.index, timeout=600, connect_timeout=120,
        failover_timeout=120,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while True:
        try:
            cluster = Cluster([], options, Routing(args.coordinator, connect_timeout=120))
            break
        except ValueError:  # the killed process's lease (3 s) still holds the index
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    note("joined", step=cluster.step)
    config = TableConfig.make(DIM, SGD(LEARNING_RATE), "zeros", TABLE, 0).to_dict()
    cluster.create_tables([config])
    ones = np.ones((args.batch, DIM), np.float32)
    stop = Path(args.stop)
    while not stop.exists():
        step = cluster.step + 1
        keys = keys_of(args.index, step, args.batch)
        began = time.monotonic()
        note("begin", step=step)
        cluster.pull([(TABLE, DIM, keys)], True)
        cluster.push({TABLE: (DIM, keys, ones[: len(keys)])})  # returns once acknowledged
        note("step", step=step, began=began)
        if args.pace:
            time.sleep(args.pace)
    cluster.flush()
    note("done", step=cluster.step)
    cluster.close()


def read_events(path: Path) -> list[dict[str, Any]]:
    """A worker process's events (a last line cut by a kill is left out)."""
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return events


class WorkerSlot:
    """Worker `index`: its processes, one after the other (a killed one is replaced)."""

    def __init__(self, index: int, chaos: Chaos) -> None:
        self.index, self.chaos = index, chaos
        self.processes: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        self.ends: list[str] = []  # per process: "" while it runs, then how it ended
        self.stopped = False  # SIGSTOPped now
        self._read = 0  # bytes of the current log read by `progress`
        self.steps_now = 0  # steps the current process has completed

    @property
    def process(self) -> subprocess.Popen[bytes]:
        return self.processes[-1]

    def start(self) -> None:
        n, c = len(self.processes), self.chaos
        log = c.directory / f"worker-{self.index}-{n}.jsonl"
        command = [
            sys.executable, str(Path(__file__).resolve()), "--worker-process",
            "--index", str(self.index), "--coordinator", c.cluster.coordinator,
            "--mode", c.config.mode, "--batch", str(c.config.batch), "--pace", str(c.config.pace),
            "--log", str(log), "--stop", str(c.stop_file),
        ]  # fmt: skip
        with open(c.directory / f"worker-{self.index}-{n}.err", "ab") as err:
            process = subprocess.Popen(
                command,
                stdout=err,
                stderr=subprocess.STDOUT,
                env={**_clean_env(), "PYTHONUNBUFFERED": "1"},
                preexec_fn=lambda: os.nice(WORKER_NICENESS),
            )
        self.processes.append(process)
        self.logs.append(log)
        self.ends.append("")
        self._read, self.steps_now = 0, 0

    def progress(self) -> int:
        """Steps the current process has completed (reads its log's new lines)."""
        path = self.logs[-1]
        try:
            with open(path, "rb") as f:
                f.seek(self._read)
                data = f.read()
        except FileNotFoundError:
            return 0
        whole = data[: data.rfind(b"\n") + 1]
        self._read += len(whole)
        self.steps_now += whole.count(b'"e": "step"')
        return self.steps_now

    def error_tail(self, lines: int = 6) -> str:
        path = self.chaos.directory / f"worker-{self.index}-{len(self.processes) - 1}.err"
        text = path.read_text(errors="replace") if path.exists() else ""
        return " | ".join(text.strip().splitlines()[-lines:])


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_EMB_")}
    return {**env, "TF_CPP_MIN_LOG_LEVEL": "3"}


# -- the soak --------------------------------------------------------------------------------


@dataclasses.dataclass
class Config:
    duration: float = 600.0
    seed: int = 1
    mode: str = "async"
    groups: int = 2
    spares: int = 1
    workers: int = 4
    fault_interval: float = 10.0
    weights: dict[str, float] = dataclasses.field(default_factory=lambda: {k: 1.0 for k in KINDS})
    batch: int = 128
    pace: float = 0.02  # seconds a worker sleeps between steps


@dataclasses.dataclass
class Links:
    """A server the soak started and its proxies: `ways_in` (gRPC, data plane; it advertises
    them, so the map, workers and its group's other replica reach it through them) and
    `etcd` (its `--coordinator`)."""

    address: str  # what it advertises: its gRPC proxy's address (the map's name for it)
    listens: str  # where it listens (`LocalCluster.servers`' key)
    ways_in: list[LinkProxy]
    etcd: LinkProxy

    @property
    def proxies(self) -> list[LinkProxy]:
        return [*self.ways_in, self.etcd]


class Aborted(Exception):
    """The soak cannot go on (a server died by itself, a worker keeps dying, SIGTERM)."""


@dataclasses.dataclass
class Record:
    """A fault as injected, and what was observed after it (monotonic seconds)."""

    fault: Fault
    injected: float = 0.0  # when the signal was sent
    deferred: float = 0.0  # seconds it waited for its target to be ready
    victim: str = ""  # the server's address, or the worker index
    role: str = ""  # server faults: the victim's role in the map when hit
    resumed: float = 0.0  # pauses: when SIGCONT was sent; link faults: when healed
    replacement: str = ""  # server kills: the server started in its place
    replaced: float = 0.0  # ... when it started
    complete: float = 0.0  # server faults: the group listed with all its replicas again
    displaced: bool = False  # pauses, link faults: the victim lost its place in the map
    recovered: float | None = None  # set by `analyse`
    stall: float | None = None  # ... server faults: the longest wait for a step meanwhile
    unmeasured: bool = False  # ... a server fault while every worker was under a fault
    overlapped: bool = False  # ... another fault's span (injection to recovery) met its own
    skipped: str = ""  # why the fault was not injected


class Chaos:
    """One soak: `start`, `inject`, `finish`, then `stop` (always) and `result`."""

    def __init__(self, config: Config, directory: Path) -> None:
        self.config, self.directory = config, directory
        self.cluster = LocalCluster(config.groups, REPLICAS, directory, LEASE_SECONDS, audit=True)
        self.servers: dict[str, Links] = {}  # advertised address -> the server, its proxies
        self.ports: set[int] = set()  # ports given to servers (a port is given once)
        self.stop_file = directory / "stop"
        self.etcd: Etcd | None = None
        self.map = ClusterMap()
        self.registered: set[str] = set()
        self.workers = [WorkerSlot(i, self) for i in range(config.workers)]
        self.records: list[Record] = []
        self.failures: list[str] = []
        self.killed: set[str] = set()  # servers killed by the injector
        self.stopped: set[str] = set()  # servers SIGSTOPped now
        self.impaired: set[str] = set()  # servers under a link fault now
        self.unsettled: dict[str, float] = {}  # resumed server -> until when it is unsettled
        self.timers: list[tuple[float, int, Callable[[], None]]] = []  # (due, n, action)
        self._timer_count = 0
        self.to_replace: list[Record] = []  # server kills whose replacement waits
        self.awaiting_complete: list[Record] = []
        self.unexpected_exits: dict[int, int] = {}  # worker -> restarts after a crash
        self.started = 0.0
        self.check: dict[str, Any] = {}

    # Setup and teardown.

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.cluster.start(servers=False)
        assert self.cluster.etcd is not None
        self.ports |= {self.cluster.etcd.port, self.cluster.etcd.peer_port}
        for _ in range(self.config.groups * REPLICAS):
            self.start_server()
        self.cluster.wait_until(self.cluster.complete, 120, "every group has all its replicas")
        self.etcd = Etcd(self.cluster.coordinator)
        _seal(self.cluster.coordinator)  # spares started now wait instead of forming groups
        for _ in range(self.config.spares):
            self.start_server()
        self._wait(lambda: self.registered >= set(self.servers), 120, "spares registered")
        for w in self.workers:
            w.start()
        self._wait(lambda: all(w.progress() >= 3 for w in self.workers), 300, "workers training")
        self.started = time.monotonic()

    def start_server(self) -> str:
        """One more server, behind proxies of its own; its advertised address."""
        assert self.cluster.etcd is not None
        while True:
            port, data = self._fresh_port(), self._fresh_port()
            ways_in = [LinkProxy(port, f"-> {port}"), LinkProxy(data, f"-> {port} data")]
            etcd = LinkProxy(self.cluster.etcd.port, f"{port} -> etcd")
            taken = {link.port for link in [*ways_in, etcd]}
            if not taken & self.ports:  # (a proxy took none of the servers' ports)
                break
            for link in [*ways_in, etcd]:
                link.close()
        self.ports |= taken
        listens = self.cluster.start_server(
            port=port,
            extra_args=[
                "--advertise", ways_in[0].address, "--data-port", str(data),
                "--advertise-data-port", str(ways_in[1].port),
                "--coordinator", f"etcd://{etcd.address}",
            ],
        )  # fmt: skip
        assert listens == f"127.0.0.1:{port}", (listens, port)
        server = Links(ways_in[0].address, listens, ways_in, etcd)
        self.servers[server.address] = server
        os.setpriority(os.PRIO_PROCESS, self.cluster.servers[listens].pid, SERVER_NICENESS)
        return server.address

    def _fresh_port(self) -> int:
        while (port := free_port()) in self.ports:
            pass
        self.ports.add(port)
        return port

    def process(self, address: str) -> subprocess.Popen[bytes]:
        return self.cluster.servers[self.servers[address].listens]

    def stop(self) -> None:
        for address in list(self.stopped):
            self._signal_server(address, signal.SIGCONT)
        for server in self.servers.values():
            for link in server.proxies:
                link.heal()
        for w in self.workers:
            if w.processes and w.process.poll() is None:
                if w.stopped:
                    w.process.send_signal(signal.SIGCONT)
                w.process.kill()
                w.process.wait()
        if self.etcd is not None:
            self.etcd.close()
        self.cluster.stop()  # (the servers leave etcd through their proxies, then these close)
        for server in self.servers.values():
            for link in server.proxies:
                link.close()

    # The event loop: observe, run due timers, replace killed servers, watch processes.

    def tick(self) -> None:
        now = time.monotonic()
        while self.timers and self.timers[0][0] <= now:
            heapq.heappop(self.timers)[2]()
        self._observe()
        now = time.monotonic()
        for r in list(self.to_replace):
            if self.map.group_of(r.victim) is None:  # dropped: its place is free
                r.replacement, r.replaced = self.start_server(), now
                self.to_replace.remove(r)
        for r in list(self.awaiting_complete):
            g = self.map.find_group(r.fault.target)
            if (
                g is None
                or r.victim not in g.replicas
                or (r.role == "primary" and g.primary != r.victim)
            ):
                r.displaced = r.displaced or r.fault.kind != "kill-server"
            if self.group_complete(r.fault.target):
                r.complete = now
                self.awaiting_complete.remove(r)
        self.unsettled = {a: until for a, until in self.unsettled.items() if until > now}
        self._watch_processes()

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while True:
            self.tick()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(TICK, left))

    def _wait(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.tick()
            if condition():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"not within {timeout:g} s: {what}; {self.map.describe()}")
            time.sleep(TICK)

    def _observe(self) -> None:
        assert self.etcd is not None
        try:
            self.map = ClusterMap.read(self.etcd)
            held, _ = self.etcd.get_prefix(membership.servers_prefix(DEFAULT_PREFIX))
        except EtcdError:
            return  # (etcd busy: the next tick reads again)
        prefix = membership.servers_prefix(DEFAULT_PREFIX)
        self.registered = {kv.key[len(prefix) :] for kv in held}

    def _watch_processes(self) -> None:
        for address, server in self.servers.items():
            p = self.cluster.servers[server.listens]
            if address not in self.killed and p.poll() is not None:
                self.killed.add(address)
                how = "SIGKILL, not sent by the injector" if p.returncode == -9 else "status"
                raise Aborted(
                    f"server {address} ({server.listens}) exited by itself ({how} "
                    f"{p.returncode}): "
                    + " | ".join(self.cluster.log_tail(server.listens, 6).splitlines())
                )
        for w in self.workers:
            if not w.processes or w.ends[-1] or w.process.poll() is None:
                continue
            if w.process.returncode == 0 and self.stop_file.exists():
                w.ends[-1] = "done"
                continue
            w.ends[-1] = f"crashed ({w.process.returncode})"
            self.failures.append(
                f"worker {w.index} exited by itself ({w.process.returncode}): {w.error_tail()}"
            )
            restarts = self.unexpected_exits[w.index] = self.unexpected_exits.get(w.index, 0) + 1
            if restarts > 3:
                raise Aborted(f"worker {w.index} exited by itself {restarts} times")
            if not self.stop_file.exists():
                w.start()

    def _at(self, due: float, action: Callable[[], None]) -> None:
        self._timer_count += 1
        heapq.heappush(self.timers, (due, self._timer_count, action))

    # Readiness.

    def group_complete(self, group_id: int) -> bool:
        """The map lists the group with all its replicas, none joining, each registered
        (its lease alive), none paused, under a link fault or killed by the injector."""
        g = self.map.find_group(group_id)
        if g is None or not self.map.complete(g):
            return False
        under_fault = self.stopped | self.impaired | self.killed
        return all(a in self.registered and a not in under_fault for a in g.replicas)

    def group_ready(self, group_id: int, now: float) -> bool:
        """`group_complete`, no slot move under way, and no replica resumed less than
        SETTLE_SECONDS ago: the group may take a fault."""
        g = self.map.find_group(group_id)
        return (
            g is not None
            and self.map.move is None
            and self.group_complete(group_id)
            and all(self.unsettled.get(a, 0.0) <= now for a in g.replicas)
        )

    def worker_ready(self, w: WorkerSlot) -> bool:
        return not w.stopped and not w.ends[-1] and w.process.poll() is None and w.progress() >= 1

    # Faults.

    def inject(self, faults: list[Fault]) -> None:
        """Injects `faults` at their times (each after its target is ready), until the end
        of the soak."""
        for fault in faults:
            self.sleep(max(0.0, self.started + fault.at - time.monotonic()))
            record = Record(fault)
            self.records.append(record)
            due = time.monotonic()
            while not self._ready(fault):
                if time.monotonic() - due > DEFER_LIMIT:
                    record.skipped = f"its target was not ready within {DEFER_LIMIT:g} s"
                    raise Aborted(f"{fault}: {record.skipped}")
                self.sleep(TICK)
            record.deferred = time.monotonic() - due
            self._inject(record)
        self.sleep(max(0.0, self.started + self.config.duration - time.monotonic()))

    def _ready(self, fault: Fault) -> bool:
        if is_server_kind(fault.kind):
            return self.group_ready(fault.target, time.monotonic())
        return self.worker_ready(self.workers[fault.target])

    def _inject(self, r: Record) -> None:
        f = r.fault
        if is_server_kind(f.kind):
            g = self.map.group(f.target)
            r.victim = g.primary if f.role == "primary" or not g.members else g.members[0]
            r.role = "primary" if r.victim == g.primary else "backup"
            server = self.servers[r.victim]
            if f.kind == "kill-server":
                self.killed.add(r.victim)
                self.cluster.kill(server.listens)  # returns once the process is gone
                r.injected = time.monotonic()
                self.to_replace.append(r)
            elif f.kind == "pause-server":
                self._signal_server(r.victim, signal.SIGSTOP)
                r.injected = time.monotonic()
                self.stopped.add(r.victim)
                self._at(r.injected + f.pause, lambda: self._resume_server(r))
            else:
                self._impair(r, server)
            self.awaiting_complete.append(r)
            return
        w = self.workers[f.target]
        r.victim = str(w.index)
        if f.kind == "kill-worker":
            w.process.kill()
            w.process.wait()
            r.injected = time.monotonic()
            w.ends[-1] = "killed"
            w.start()
        else:
            w.process.send_signal(signal.SIGSTOP)
            r.injected = time.monotonic()
            w.stopped = True
            self._at(r.injected + f.pause, lambda: self._resume_worker(r, w))

    def _impair(self, r: Record, server: Links) -> None:
        """Starts a link fault on `server`; a timer heals it after `pause` seconds."""
        f = r.fault
        self.impaired.add(r.victim)
        if f.kind == "cut-server":
            for link in server.ways_in:
                link.cut(f.direction)
        elif f.kind == "cut-server-etcd":
            server.etcd.cut()
        elif f.kind == "slow-server":
            for link in server.ways_in:
                link.slow(SLOW_DELAY)
        else:  # flap-server-etcd: the cuts on the soak's timers (each heal before the next)
            now = time.monotonic()
            for start in flap_schedule(f.flap_seed, f.pause, FLAP_EVERY, FLAP_CUT):
                self._at(now + start, server.etcd.cut)
                self._at(now + start + FLAP_CUT, server.etcd.heal)
        r.injected = time.monotonic()
        self._at(r.injected + f.pause, lambda: self._heal(r, server))

    def _heal(self, r: Record, server: Links) -> None:
        for link in server.proxies:
            link.heal()
        r.resumed = time.monotonic()
        self.impaired.discard(r.victim)
        self.unsettled[r.victim] = r.resumed + SETTLE_SECONDS

    def _signal_server(self, address: str, sig: signal.Signals) -> None:
        p = self.process(address)
        if p.poll() is None:
            p.send_signal(sig)

    def _resume_server(self, r: Record) -> None:
        self._signal_server(r.victim, signal.SIGCONT)
        r.resumed = time.monotonic()
        self.stopped.discard(r.victim)
        self.unsettled[r.victim] = r.resumed + SETTLE_SECONDS

    def _resume_worker(self, r: Record, w: WorkerSlot) -> None:
        w.process.send_signal(signal.SIGCONT)
        r.resumed = time.monotonic()
        w.stopped = False

    def finish(self) -> None:
        """Ends the soak: lets every fault end, waits for a complete cluster and a step of
        every worker, stops the workers (each flushes its pushes), checks every row on every
        replica."""
        while self.timers:  # pauses under way end as planned
            self.sleep(TICK)
        try:
            self._wait(
                lambda: (
                    not self.to_replace
                    and all(self.group_ready(g.id, time.monotonic()) for g in self.map.groups)
                    and all(self.worker_ready(w) for w in self.workers)
                ),
                180,
                "every group has all its replicas again and every worker trains",
            )
        except TimeoutError as e:
            self.failures.append(str(e))
        self.stop_file.touch()
        try:
            self._wait(lambda: all(w.ends[-1] for w in self.workers), 300, "workers stopped")
        except TimeoutError as e:
            self.failures.append(str(e))
        reports = []
        for w in self.workers:
            first = [e for e in read_events(w.logs[0]) if e["e"] == "joined"]
            last = [e for e in read_events(w.logs[-1]) if e["e"] == "done"]
            if not first or not last:
                self.failures.append(f"worker {w.index} did not end its run ({w.ends[-1]})")
                continue
            reports.append(
                {"worker": w.index, "first": first[0]["step"] + 1, "steps": last[0]["step"]}
            )
        self.check = {"passed": False, "rows": 0, "replicas compared": 0, "error": ""}
        try:
            if len(reports) < len(self.workers):
                raise AssertionError("some workers did not report their last step")
            groups = self.map.groups
            self.check["rows"] = check_rows(groups, TABLE, reports, self.config.batch)
            self.check["replicas compared"] = sum(len(g.members) for g in groups)
            time.sleep(2 * acknowledged.WRITE_SECONDS)  # (the servers' last counts written)
            epochs = acknowledged_epochs(self.cluster.audit_logs())
            self.check["epochs"] = len(epochs)
            problems = check_epochs(epochs)
            if problems:
                raise AssertionError("; ".join(problems))
            self.check["passed"] = True
        except Exception as e:
            self.check["error"] = f"{type(e).__name__}: {e}"
        self.check["reports"] = reports

    # Results.

    def result(self) -> dict[str, Any]:
        workers = [_worker_history(w) for w in self.workers]
        analyse(self.records, workers)
        return {
            "config": dataclasses.asdict(self.config),
            "machine": machine(),
            "soak seconds": round(time.monotonic() - self.started, 1) if self.started else 0,
            "faults": [_record_json(r, self.started) for r in self.records],
            "workers": [{"worker": w["worker"], "processes": w["processes"]} for w in workers],
            "steps": _step_figures(workers, self.started),
            "check": self.check,
            "failures": self.failures,
            "passed": bool(self.check.get("passed"))
            and not self.failures
            and all(r.recovered is not None or r.unmeasured for r in self.records if r.injected),
        }


def _seal(coordinator: str) -> None:
    """Seals the map as a worker's first connection does (`Routing`)."""
    from elastic_emb.ps.client.routing import Routing

    Routing(coordinator, connect_timeout=60).close()


# -- analysis --------------------------------------------------------------------------------


def _worker_history(w: WorkerSlot) -> dict[str, Any]:
    """A worker's completed steps (began, ended) over all its processes, and per process:
    how it ended, the step it joined at, its last step begun and acknowledged."""
    steps: list[tuple[float, float]] = []
    processes = []
    for log, end in zip(w.logs, w.ends, strict=True):
        events = read_events(log)
        joined = next((e["step"] for e in events if e["e"] == "joined"), None)
        begun = max((e["step"] for e in events if e["e"] == "begin"), default=None)
        acked = max((e["step"] for e in events if e["e"] == "step"), default=None)
        steps += [(e["began"], e["t"]) for e in events if e["e"] == "step"]
        processes.append({"end": end, "joined": joined, "begun": begun, "acknowledged": acked})
    return {"worker": w.index, "steps": steps, "processes": processes}


def analyse(records: list[Record], workers: list[dict[str, Any]]) -> None:
    """Sets each record's `recovered` (None: never), `unmeasured` and `stall` from the
    workers' steps.

    A worker fault: that worker's first step completed after the injection. A server
    fault: the last of the workers' first steps begun after the injection, over the
    workers under no fault of their own meanwhile (`unmeasured` if there was none); its
    stall: the longest time one of those workers went without completing a step, from the
    injection to the latest of its recovery, its end (SIGCONT, heal) and its group
    complete again (a link to etcd cut stalls nobody until the lease lapses: later than
    the recovery).
    """
    busy: dict[int, list[tuple[float, float]]] = {}  # worker -> (from, to) of its faults
    for r in records:
        if r.injected and not is_server_kind(r.fault.kind):
            w = workers[r.fault.target]
            after = [end for _, end in w["steps"] if end > r.injected]
            r.recovered = after[0] - r.injected if after else None
            busy.setdefault(r.fault.target, []).append(
                (r.injected, after[0] if after else float("inf"))
            )
    for r in records:
        if not r.injected or not is_server_kind(r.fault.kind):
            continue
        ends, never = [], False
        for w in workers:
            nxt = next((end for began, end in w["steps"] if began > r.injected), None)
            until = float("inf") if nxt is None else nxt
            if any(a < until and b > r.injected for a, b in busy.get(w["worker"], [])):
                continue  # under a fault of its own meanwhile
            if nxt is None:
                never = True
            else:
                ends.append(nxt)
        r.recovered = max(ends) - r.injected if ends and not never else None
        r.unmeasured = not ends and not never
        if r.recovered is not None:
            until = max(r.injected + r.recovered, r.resumed, r.complete)
            r.stall = max(
                _longest_gap([end for _, end in w["steps"]], r.injected, until)
                for w in workers
                if not any(a < until and b > r.injected for a, b in busy.get(w["worker"], []))
            )
    spans = [
        (r, r.injected, r.injected + (float("inf") if r.recovered is None else r.recovered))
        for r in records
        if r.injected
    ]
    for r, a, b in spans:
        r.overlapped = any(o is not r and a2 < b and b2 > a for o, a2, b2 in spans)


def _longest_gap(ends: list[float], start: float, until: float) -> float:
    """The longest time between `start`, the step ends (sorted) after it and the first
    end after `until`."""
    times = [start, *(t for t in ends if t > start and t <= until)]
    later = next((t for t in ends if t > until), None)
    times += [later] if later is not None else []
    return max(b - a for a, b in itertools.pairwise(times)) if len(times) > 1 else 0.0


def kind_of(r: Record) -> str:
    """The table row of a record: the kind with the victim's role and, for pauses and cuts
    of servers, whether the fault outlasted the lease."""
    f = r.fault
    role = r.role or f.role
    length = "< TTL" if f.pause < LEASE_SECONDS else ">= TTL"
    if f.kind == "kill-server":
        return f"kill {role}"
    if f.kind == "pause-server":
        return f"pause {role} {length}"
    if f.kind == "cut-server":
        return f"cut ways in, {role} {length}"
    if f.kind == "cut-server-etcd":
        return f"cut etcd link, {role} {length}"
    if f.kind == "slow-server":
        return f"slow ways in, {role}"
    if f.kind == "flap-server-etcd":
        return f"flap etcd link, {role}"
    return f.kind.replace("-", " ")


ROW_ORDER = [
    "kill primary", "kill backup", "pause primary < TTL", "pause primary >= TTL",
    "pause backup < TTL", "pause backup >= TTL",
    *(f"cut {link}, {role} {length}" for link in ("ways in", "etcd link")
      for role in ("primary", "backup") for length in ("< TTL", ">= TTL")),
    "slow ways in, primary", "slow ways in, backup", "flap etcd link, primary",
    "flap etcd link, backup", "kill worker", "pause worker",
]  # fmt: skip


def _record_json(r: Record, started: float) -> dict[str, Any]:
    def rel(t: float) -> float | None:
        return round(t - started, 3) if t else None

    return {
        **dataclasses.asdict(r.fault),
        "row": kind_of(r),
        "victim": r.victim,
        "role": r.role,
        "injected": rel(r.injected),
        "deferred": round(r.deferred, 3),
        "resumed": rel(r.resumed),
        "replacement": r.replacement,
        "replaced": rel(r.replaced),
        "recovery": None if r.recovered is None else round(r.recovered, 3),
        "longest stall": None if r.stall is None else round(r.stall, 3),
        "unmeasured": r.unmeasured,
        "overlapped": r.overlapped,
        "group complete": round(r.complete - r.injected, 3) if r.complete else None,
        "displaced": r.displaced,
        "skipped": r.skipped,
    }


def _step_figures(workers: list[dict[str, Any]], started: float) -> dict[str, Any]:
    durations = [end - began for w in workers for began, end in w["steps"] if began > started]
    lost = redone = 0
    for w in workers:
        procs = w["processes"]
        for dead, new in itertools.pairwise(procs):
            begun, acked = dead["begun"] or 0, dead["acknowledged"] or 0
            lost += begun - min(acked, begun)
            if new["joined"] is not None:
                redone += max(0, begun - new["joined"])
    return {
        "acknowledged": sum(len(w["steps"]) for w in workers),
        "step seconds median": round(statistics.median(durations), 4) if durations else None,
        "step seconds p99": round(float(np.percentile(durations, 99)), 4) if durations else None,
        "never acknowledged": lost,
        "redone": redone,
    }


# -- reporting -------------------------------------------------------------------------------


def machine() -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return f"{cores} cores, {cpu}, GPU: no"


def markdown(result: dict[str, Any]) -> str:
    c = result["config"]
    out = [
        f"## Chaos soak: {c['mode']}, seed {c['seed']}, {c['duration']:g} s",
        "",
        f"{c['groups']} groups x R={REPLICAS} + {c['spares']} spare (lease TTL {LEASE_SECONDS} "
        f"s), {c['workers']} worker processes, {c['batch']} keys a step, SGD lr 1/8, one fault "
        f"every {c['fault_interval']:g} s on average; {result['machine']}",
        "",
        "Recovery: from the injection to every other worker's next step begun after it "
        "(server faults) or the worker's next completed step (worker faults). Group complete: "
        "to the map listing the group with all its replicas again. Overlapped: another "
        "fault happened between its injection and its recovery (both recoveries include it). "
        "Displaced: the paused or impaired server lost its place (failed over, or dropped "
        "as a backup). Longest stall: the longest a worker went without a step from the "
        "injection until the fault, its recovery and its group's return all ended. Link "
        "faults count as server faults.",
        "",
        "| fault | injected | recovered | recovery s: min / median / max | of which overlapped "
        "| displaced | longest stall s: median / max | group complete s: median / max "
        "| length s: min-max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    by_row: dict[str, list[dict[str, Any]]] = {}
    for f in result["faults"]:
        if not f["skipped"]:
            by_row.setdefault(f["row"], []).append(f)
    for row in ROW_ORDER:
        faults = by_row.get(row, [])
        if not faults:
            continue
        rec = sorted(f["recovery"] for f in faults if f["recovery"] is not None)
        comp = sorted(f["group complete"] for f in faults if f["group complete"] is not None)
        stall = sorted(f["longest stall"] for f in faults if f["longest stall"] is not None)
        pauses = [f["pause"] for f in faults if f["pause"]]
        out.append(
            f"| {row} | {len(faults)} | {len(rec)} | "
            + (f"{rec[0]:.2f} / {statistics.median(rec):.2f} / {rec[-1]:.2f}" if rec else "-")
            + f" | {sum(f['overlapped'] for f in faults if f['recovery'] is not None)} | "
            + (f"{sum(f['displaced'] for f in faults)}" if faults[0]["kind"] in LIVE else "-")
            + " | "
            + (f"{statistics.median(stall):.2f} / {stall[-1]:.2f}" if stall else "-")
            + " | "
            + (f"{statistics.median(comp):.2f} / {comp[-1]:.2f}" if comp else "-")
            + " | "
            + (f"{min(pauses):.1f}-{max(pauses):.1f}" if pauses else "-")
            + " |"
        )
    faults = result["faults"]
    skipped = [f for f in faults if f["skipped"]]
    deferred = [f["deferred"] for f in faults if f["deferred"] > 0.5]
    s, chk = result["steps"], result["check"]
    out += [
        "",
        f"Faults: {len(faults) - len(skipped)} injected, {len(skipped)} skipped (target not "
        f"ready in {DEFER_LIMIT:g} s), {len(deferred)} waited > 0.5 s for their target"
        + (f" (max {max(deferred):.1f} s)" if deferred else "")
        + "."
        + (
            " Cuts of ways in by direction: "
            + ", ".join(
                f"{d} {sum(f['direction'] == d for f in faults if not f['skipped'])}"
                for d in CUT_DIRECTIONS
            )
            + "."
        ),
        "",
        "| steps acknowledged | step s: median / p99 | steps never acknowledged (in flight at "
        "a worker kill) | steps redone | rows checked | backups compared bit for bit | "
        "epochs checked (audit logs) | exact |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {s['acknowledged']:,} | {s['step seconds median']} / {s['step seconds p99']} | "
        f"{s['never acknowledged']} | {s['redone']} | {chk.get('rows', 0):,} | "
        f"{chk.get('replicas compared', 0)} | {chk.get('epochs', 0)} | "
        f"{'PASS' if chk.get('passed') else 'FAIL'} |",
    ]
    if chk.get("error"):
        out += ["", f"Check: {chk['error']}"]
    for failure in result["failures"]:
        out.append(f"\nFailure: {failure}")
    out += ["", f"**{'PASS' if result['passed'] else 'FAIL'}**"]
    return "\n".join(out)


def run(config: Config, directory: Path | None = None) -> dict[str, Any]:
    """One soak; its result (`markdown` prints it)."""
    faults = make_schedule(
        config.seed, config.duration, config.fault_interval, config.weights, config.groups,
        config.workers, config.mode,
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ee-chaos-") as tmp:
        chaos = Chaos(config, Path(directory or tmp))
        try:
            chaos.start()
            chaos.inject(faults)
            chaos.finish()
        except Aborted as e:
            chaos.failures.append(f"aborted: {e}")
        except Exception:
            chaos.failures.append(traceback.format_exc())
        finally:
            chaos.stop()
        result = chaos.result()
    result["schedule"] = [dataclasses.asdict(f) for f in faults]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of faults")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--mode", choices=["async", "sync"], default="async")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--spares", type=int, default=1)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--fault-interval", type=float, default=10.0, help="mean seconds between")
    p.add_argument("--weights", default=",".join(f"{k}=1" for k in KINDS))
    p.add_argument("--batch", type=int, default=128, help="keys a worker pushes a step")
    p.add_argument("--pace", type=float, default=0.02, help="seconds between a worker's steps")
    p.add_argument("--json", help="also write the result as JSON to this file")
    p.add_argument("--directory", help="keep logs here (default: a temporary directory)")
    # A worker process (started by the soak).
    p.add_argument("--worker-process", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", help=argparse.SUPPRESS)
    p.add_argument("--log", help=argparse.SUPPRESS)
    p.add_argument("--stop", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker_process:
        worker_process(args)
        return
    config = Config(
        args.duration, args.seed, args.mode, args.groups, args.spares, args.workers,
        args.fault_interval, parse_weights(args.weights), args.batch, args.pace,
    )  # fmt: skip

    def on_sigterm(signum: int, frame: Any) -> None:
        raise Aborted("SIGTERM")  # the soak stops its processes and reports

    signal.signal(signal.SIGTERM, on_sigterm)
    if args.mode == "sync" and config.weights["kill-worker"]:
        print("sync: no worker kills (a dead worker changes which pushes a step sums)")
    result = run(config, Path(args.directory) if args.directory else None)
    print(markdown(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
