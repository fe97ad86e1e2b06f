"""`serve`: one parameter-server shard process (`elastic-emb serve --port PORT`).

A gRPC server with the ParameterServer service (`Servicer` over a `Shard`)
and the standard `grpc.health.v1` health service (what Kubernetes' gRPC
probes and `elastic-emb health` ask), stopped gracefully by SIGTERM/SIGINT.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from elastic_emb.persistence import checkpoint
from elastic_emb.ps.coord.balance import LoadMeter, Policy
from elastic_emb.ps.server import resources
from elastic_emb.ps.server.checkpointer import PeriodicCheckpoints
from elastic_emb.ps.server.data_plane import serve_natively
from elastic_emb.ps.server.health import SERVING, HealthServicer
from elastic_emb.ps.server.servicer import Servicer, add_to_server
from elastic_emb.ps.wire.protocol import DATA_PLANES
from elastic_emb.ps.wire.security import (
    MAX_GRPC_MESSAGE_BYTES,
    MAX_MESSAGE_BYTES,
    SERVICE,
    Tokens,
    data_plane_server_tls,
    message_options,
    peer_security,
    server_credentials,
)

__all__ = ["ServerOptions", "serve"]

log = logging.getLogger("elastic_emb.server")


def loopback(host: str) -> bool:
    """Whether only this machine reaches `host` (localhost, 127.0.0.0/8, ::1)."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_address(address: str, what: str) -> tuple[str, int]:
    """(host, port) of "HOST:PORT" ("[IPV6]:PORT" too); ValueError naming `what` if it is
    not one, or the port is not in 1..65535."""
    host, colon, port = address.rpartition(":")
    if not colon or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must be HOST:PORT with a port in 1..65535. Received: {address!r}")
    return host, int(port)


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """What `elastic-emb serve` takes (the flags of the same names; see `serve`)."""

    port: int
    host: str = "127.0.0.1"
    # Started as requests come; a sync pull waiting for the others holds one.
    threads: int = 2048
    # Requests the data plane handles at once before refusing more (None: 32 per core).
    max_active_requests: int | None = None
    max_requests_per_connection: int = 256  # in flight on one data-plane connection
    max_message_bytes: int = MAX_MESSAGE_BYTES  # a request's or an answer's, both planes
    grace_seconds: float = 30.0
    data_plane: str = "native"  # or "grpc" (`elastic_emb.ps.server.data_plane`)
    data_port: int = 0
    advertise_data_port: int | None = None  # what Health tells others (default: data_port's)
    checkpoint_dir: str | None = None
    checkpoint_every: float | None = None
    max_deltas: int = 10
    coordinator: str | None = None
    replicas: int = 2
    advertise: str | None = None
    lease_seconds: int = 2
    move_pause: float = 0.0
    cutover_pause: float = 0.0
    metrics_port: int | None = None
    audit_log: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    auth_tokens: str | None = None
    tls_peer_ca: str | None = None
    peer_token_file: str | None = None
    load_window: float = 10.0
    balance: Policy | None = None
    memory_budget: int | None = None  # None: `resources.default_memory_budget()`
    memory_high_water: float | None = 0.8
    drain_timeout: float = 120.0

    def check(self) -> None:
        """Raises ValueError for flags that contradict each other or are out of range."""
        for name, least in (
            ("threads", 1), ("replicas", 1), ("lease_seconds", 1), ("grace_seconds", 0),
            ("max_deltas", 0), ("max_active_requests", 0), ("max_requests_per_connection", 0),
        ):  # fmt: skip
            value = getattr(self, name)
            if value is None:
                continue
            if value < least:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be at least {least}. Received: {value}")
        if not 1 << 16 <= self.max_message_bytes <= MAX_GRPC_MESSAGE_BYTES:
            raise ValueError(
                f"--max-message-bytes must be in [65536, {MAX_GRPC_MESSAGE_BYTES}] (gRPC's "
                f"limit). Received: {self.max_message_bytes}"
            )
        if self.advertise is not None:
            host, _ = split_address(self.advertise, "--advertise")
            if loopback(self.host) and not loopback(host):
                raise ValueError(
                    f"--advertise {self.advertise}: the other machines cannot reach this "
                    f"server, which listens on {self.host} only: add --host 0.0.0.0 (or this "
                    "machine's address; with TLS and tokens, docs/operations.md#security)"
                )
        if self.checkpoint_dir and os.path.exists(self.checkpoint_dir):
            if not os.path.isdir(self.checkpoint_dir):
                raise ValueError(
                    f"--checkpoint-dir {self.checkpoint_dir} is a file, not a directory: "
                    "give a directory (it is made if missing)"
                )
        if (self.tls_cert is None) != (self.tls_key is None) or (
            self.tls_client_ca and not self.tls_cert
        ):
            raise ValueError("--tls-cert and --tls-key go together; --tls-client-ca needs them")
        if not self.coordinator and (self.tls_peer_ca or self.peer_token_file):
            raise ValueError("--tls-peer-ca and --peer-token-file need --coordinator")
        if not self.coordinator and self.balance is not None:
            raise ValueError("--balance-threshold needs --coordinator (slots move between groups)")
        if self.memory_high_water is not None and not 0 < self.memory_high_water <= 1:
            raise ValueError(
                f"--memory-high-water must be in (0, 1]. Received: {self.memory_high_water}"
            )
        if self.data_plane not in DATA_PLANES:
            raise ValueError(
                f"--data-plane must be one of {DATA_PLANES}. Received: {self.data_plane!r}"
            )
        if self.drain_timeout < 0:
            raise ValueError(f"--drain-timeout must be >= 0. Received: {self.drain_timeout}")
        if self.load_window <= 0:
            raise ValueError(f"--load-window must be positive. Received: {self.load_window}")
        if self.checkpoint_every is not None and (
            not self.checkpoint_dir or self.checkpoint_every <= 0 or self.max_deltas < 0
        ):
            raise ValueError(
                "--checkpoint-every needs --checkpoint-dir, a positive period and --max-deltas >= 0"
            )

    def advertised(self, bound: int) -> str:
        """The "host:port" other servers and workers reach this one at."""
        return self.advertise or f"{'127.0.0.1' if self.host == '0.0.0.0' else self.host}:{bound}"


def serve(
    options: ServerOptions,
    ready: Callable[[int], None] | None = None,
    metrics_ready: Callable[[int], None] | None = None,
) -> int:
    """Runs one shard until SIGTERM or SIGINT; returns an exit status.

    On a signal the shard reports NOT_SERVING to health checks, stops taking
    new requests, lets in-flight ones finish (up to `options.grace_seconds`) and,
    with `checkpoint_dir` (and no coordinator), saves every table there.
    With `checkpoint_every` too, it writes incremental checkpoints there
    periodically (`elastic_emb.ps.server.checkpointer`).

    With `coordinator` ("etcd://host:port") the server joins a replicated
    cluster (`elastic_emb.ps.server.replication`) as "host:port" `advertise`
    (default: `host`, or 127.0.0.1 for 0.0.0.0, and the bound port), with
    `replicas` replicas per group.

    With `metrics_port` (0: any free port), Prometheus metrics are served
    over HTTP at `host:metrics_port/metrics` (`elastic_emb.ps.server.metrics`);
    `metrics_ready` gets the bound port. With `audit_log`, administrative
    calls are appended to that hash-chained file (`elastic_emb.ps.server.audit`).

    With `tls_cert` and `tls_key` (PEM files) the server speaks TLS only
    (its metrics too), and with `tls_client_ca` it requires client
    certificates that CA signed. With `auth_tokens` it requires a token on
    every call (`elastic_emb.ps.wire.security`). In a replicated cluster the
    servers call each other the same way: over TLS, trusting `tls_peer_ca`
    (default: `tls_client_ca`) and presenting their own certificate, and
    with the admin token in `peer_token_file`.

    With a coordinator, the server also publishes its load per slot over the
    last `load_window` seconds and its use of resources (memory against
    `memory_budget`, CPU, rows; `elastic_emb.ps.server.resources`), and with a
    `balance` policy its group moves slots away when it is the most loaded
    (`elastic_emb.ps.coord.balance`). As a primary whose tables passed
    `memory_high_water` of the budget, it moves slots to a group with room.
    On a signal it first drains itself (up to `drain_timeout` seconds; 0:
    not at all): a spare takes its place, or its group's ranges move away.
    """
    servicer = Servicer()
    try:
        options.check()
        credentials, peers = _security(options, servicer)
    except ValueError as e:
        log.error("%s", e)
        return 1
    if options.audit_log:
        from elastic_emb.ps.server.audit import AuditError, AuditLog

        try:
            servicer.audit = AuditLog(options.audit_log)
        except (OSError, AuditError) as e:
            log.error("cannot use the audit log %s: %s", options.audit_log, e)
            return 1
    if options.memory_budget is not None:
        servicer.memory_budget, source = options.memory_budget, "--memory-budget"
    else:
        servicer.memory_budget, source = resources.default_memory_budget()
    log.info("memory budget of the tables: %d bytes (%s)", servicer.memory_budget, source)
    health = HealthServicer()
    server, bound = _listen(options, servicer, health, credentials)
    if server is None:
        return 1
    replica = None
    if options.coordinator:
        advertised = options.advertised(bound).rpartition(":")[0]
        if loopback(advertised) and not loopback(options.host):
            log.warning(
                "advertising %s to the cluster (no --advertise): workers and servers on other "
                "machines cannot reach it; pass --advertise HOST:%d",
                options.advertised(bound), bound,
            )  # fmt: skip
        # Set before the server starts: a replicated server's calls need their replica.
        replica = _replica(options, options.coordinator, servicer, peers, bound)
        servicer.replica = replica
    serve_natively(servicer, options.max_message_bytes, coordinated=bool(options.coordinator))
    data = _data_plane(options, servicer, tls=credentials is not None)
    if data is False:
        return 1
    server.start()
    for service in ("", SERVICE):  # "": the whole server
        health.set(service, SERVING)
    log.info("elastic_emb parameter server listening on %s:%d", options.host, bound)
    if replica is not None:
        try:
            replica.start()
        except Exception as e:
            log.error("cannot join the cluster at %s: %s", options.coordinator, e)
            server.stop(0)
            if data is not None:
                data.stop()
            return 1
    acknowledged = None
    if replica is not None and servicer.audit is not None:
        from elastic_emb.ps.server.acknowledged import AcknowledgedAudit

        acknowledged = AcknowledgedAudit(
            servicer.audit, servicer.ranges.native.replication, replica.address
        )
    periodic = None
    if options.checkpoint_every is not None and options.checkpoint_dir:
        periodic = PeriodicCheckpoints(
            servicer.ranges, options.checkpoint_dir, options.checkpoint_every,
            options.max_deltas, replica, changes=lambda: servicer.changes,
        )  # fmt: skip
        periodic.start()
    if options.metrics_port is not None and not _serve_metrics(options, servicer, metrics_ready):
        server.stop(0)
        if data is not None:
            data.stop()
        return 1
    _wait_for_a_signal(ready, bound)
    if replica is not None and options.coordinator and options.drain_timeout > 0:
        _drain(options.coordinator, replica.address, options.drain_timeout)
    log.info("stopping: finishing in-flight requests (up to %.0f s)", options.grace_seconds)
    health.enter_graceful_shutdown()
    if periodic is not None:
        periodic.stop()
    if replica is not None:
        replica.stop()  # backups take over at once
    stopped = server.stop(options.grace_seconds)
    if data is not None:
        data.stop(options.grace_seconds)
    stopped.wait()
    if acknowledged is not None:
        acknowledged.stop()
    if options.checkpoint_dir and replica is None:  # (a replica's rows live on in its group)
        if periodic is not None:
            periodic.save_now()
        else:
            checkpoint.save(options.checkpoint_dir, servicer.ranges.tables())
        log.info("saved every table to %s", options.checkpoint_dir)
    return 0


def _data_plane(options: ServerOptions, servicer: Servicer, tls: bool) -> Any:
    """The server's data plane, listening (`--data-plane native`), over TLS with the gRPC
    server's certificates when it has TLS; None without one (gRPC carries the data:
    `--data-plane grpc`, or TLS in a build without it); False (logged) if it cannot listen."""
    if options.data_plane != "native":
        return None
    context = None
    if tls:
        assert options.tls_cert and options.tls_key  # (tls: they make the credentials)
        try:
            context = data_plane_server_tls(
                options.tls_cert, options.tls_key, options.tls_client_ca
            )
        except ValueError as e:
            log.error("data plane: %s", e)
            return False
        if context is None:
            log.info(
                "data plane: off with TLS, this build has none (OpenSSL was not found when "
                "elastic_emb was built): Pull and Push go through gRPC, encrypted"
            )
            return None
    from elastic_emb.ps.server.data_plane import DataPlane, default_max_active

    max_active = options.max_active_requests
    if max_active is None:
        max_active = default_max_active()
    try:
        data = DataPlane(
            servicer, options.host, options.data_port, options.threads,
            max_active=max_active,
            max_per_connection=options.max_requests_per_connection,
            max_frame_bytes=options.max_message_bytes, tls=context,
        )  # fmt: skip
    except RuntimeError as e:
        log.error("%s. Use another --data-port, or 0 for a free one", e)
        return False
    servicer.data_port = (
        data.port if options.advertise_data_port is None else (options.advertise_data_port)
    )
    servicer.data_plane_counters = data.counters
    log.info(
        "data plane (Pull, Push) on %s:%d%s", options.host, data.port, " over TLS" if tls else ""
    )
    return data


def _drain(coordinator: str, address: str, timeout: float) -> None:
    """Hands this server's place to a spare, or its group's ranges to the other groups,
    before it exits (`elastic-emb cluster drain` on itself); serves meanwhile."""
    from elastic_emb.ps.coord.drain import drain_server
    from elastic_emb.ps.coord.etcd import EtcdError

    log.info("draining %s before exiting (up to %.0f s)", address, timeout)
    start = time.monotonic()
    try:
        drain_server(coordinator, address, timeout)
    except (TimeoutError, ValueError, EtcdError, ConnectionError) as e:
        log.warning("leaving without draining: %s", e)
        return
    log.info("drained in %.1f s: %s holds nothing now", time.monotonic() - start, address)


def _security(options: ServerOptions, servicer: Servicer) -> tuple[Any, Any]:
    """The server's TLS credentials and its security towards its peers (each or None);
    sets the servicer's tokens and load meter."""
    credentials = peers = None
    if options.tls_cert and options.tls_key:
        credentials = server_credentials(options.tls_cert, options.tls_key, options.tls_client_ca)
    if options.auth_tokens:
        servicer.tokens = Tokens(options.auth_tokens)
    if options.coordinator:
        peers = peer_security(
            options.tls_cert, options.tls_key, options.tls_peer_ca or options.tls_client_ca,
            servicer.tokens, options.peer_token_file,
        )  # fmt: skip
        servicer.load = LoadMeter(options.load_window)
    _warn_if_exposed(options, tls=credentials is not None, tokens=servicer.tokens is not None)
    return credentials, peers


def _warn_if_exposed(options: ServerOptions, tls: bool, tokens: bool) -> None:
    """Logs what a server listening beyond this machine exposes without TLS or tokens."""
    if loopback(options.host):
        return
    where = f"listening on {options.host} (beyond this machine)"
    fix = "docs/operations.md#security; or --host 127.0.0.1 for this machine only"
    authenticated = tokens or bool(options.tls_client_ca)
    if not tls and not authenticated:
        log.warning(
            "%s without TLS or tokens: anyone who reaches its port can read and change every "
            "table, and the traffic is plaintext. Add --tls-cert/--tls-key and --auth-tokens (%s)",
            where, fix,
        )  # fmt: skip
    elif not authenticated:
        log.warning(
            "%s without tokens: TLS hides the traffic, but any client that reaches its port can "
            "read and change every table. Add --auth-tokens or --tls-client-ca (%s)",
            where, fix,
        )  # fmt: skip
    elif not tls:
        log.warning(
            "%s without TLS: the tokens and the rows cross the network in plaintext, for "
            "anyone on the path to read (and the tokens to reuse). Add --tls-cert/--tls-key (%s)",
            where, fix,
        )  # fmt: skip


def _listen(
    options: ServerOptions, servicer: Servicer, health: HealthServicer, credentials: Any
) -> tuple[Any, int]:
    """The gRPC server with both services, bound (not started), and its port; or
    (None, 0) if the port cannot be bound."""
    # No SO_REUSEPORT: a second server on a port in use must fail, not share its traffic.
    grpc_options = [*message_options(options.max_message_bytes), ("grpc.so_reuseport", 0)]
    executor = futures.ThreadPoolExecutor(max_workers=options.threads)
    server = grpc.server(executor, options=grpc_options)
    add_to_server(servicer, server)
    health.add_to_server(server)
    problem = _host_problem(options.host)
    if problem is not None:
        log.error(
            "cannot listen on %s: %s. Use --host 127.0.0.1 (this machine only), 0.0.0.0 "
            "(every address) or an address of this machine",
            options.host, problem,
        )  # fmt: skip
        return None, 0
    address = f"{options.host}:{options.port}"
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError:  # grpcio >= 1.60 raises where older versions returned 0
        bound = 0
    if bound == 0:
        log.error(
            "cannot listen on %s:%d (is the port in use?%s) Use another --port, or --port 0 "
            "for a free one",
            options.host, options.port,
            "" if credentials is None else " Or are --tls-cert and --tls-key not a pair?",
        )  # fmt: skip
        return None, 0
    return server, bound


def _host_problem(host: str) -> str | None:
    """Why this machine cannot listen on `host` (it does not resolve, or is no address of
    this machine), or None."""
    try:
        found = socket.getaddrinfo(host.strip("[]"), 0, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"no such host ({e.strerror})"
    why = "no address"
    for family, kind, proto, _, address in found:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind(address)
            return None
        except OSError as e:
            why = e.strerror or str(e)
    return f"not an address of this machine ({why})"


def _replica(
    options: ServerOptions, coordinator: str, servicer: Servicer, peers: Any, bound: int
) -> Any:
    """This server's `Replica` in the coordinated cluster (not started)."""
    from elastic_emb.ps.coord.etcd import Etcd
    from elastic_emb.ps.server.replication import Replica

    replica = Replica(
        servicer.ranges, servicer.apply_change, Etcd(coordinator),
        options.advertised(bound), options.replicas, options.lease_seconds,
        move_pause=options.move_pause, cutover_pause=options.cutover_pause, security=peers,
        load=servicer.load, balance=options.balance, usage=servicer.usage,
        memory_high_water=options.memory_high_water,
    )  # fmt: skip
    replica.worker_gone = servicer.worker_gone
    return replica


def _serve_metrics(
    options: ServerOptions, servicer: Servicer, ready: Callable[[int], None] | None
) -> bool:
    """Starts the Prometheus endpoint; False (logged) if it cannot listen."""
    from elastic_emb.ps.server.metrics import start_metrics_server

    host, port = options.host, options.metrics_port or 0
    try:
        metrics = start_metrics_server(servicer, host, port, options.tls_cert, options.tls_key)
    except OSError as e:
        log.error("cannot serve metrics on %s:%d: %s", host, port, e)
        return False
    scheme = "https" if options.tls_cert else "http"
    log.info("metrics on %s://%s:%d/metrics", scheme, host, metrics.server_port)
    if ready is not None:
        ready(metrics.server_port)
    return True


def _wait_for_a_signal(ready: Callable[[int], None] | None, bound: int) -> None:
    """Announces readiness, then waits for SIGTERM or SIGINT."""
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    # Before announcing readiness: a SIGTERM right after it must still stop gracefully.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if ready is not None:
        ready(bound)
    # With a timeout: a signal the kernel hands another thread (gRPC's) runs its Python
    # handler only once the main thread wakes, which a wait without one may never do.
    while not stop.wait(0.5):
        pass
