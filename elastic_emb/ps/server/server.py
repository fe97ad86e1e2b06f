"""`serve`: one parameter-server shard process (`elastic-emb serve --port PORT`).

A gRPC server with the ParameterServer service (`Servicer` over a `Shard`)
and the standard `grpc.health.v1` health service (what Kubernetes' gRPC
probes and `elastic-emb health` ask), stopped gracefully by SIGTERM/SIGINT.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from elastic_emb.persistence import checkpoint
from elastic_emb.ps.coord.balance import LoadMeter, Policy
from elastic_emb.ps.server.checkpointer import PeriodicCheckpoints
from elastic_emb.ps.server.health import SERVING, HealthServicer
from elastic_emb.ps.server.servicer import Servicer, add_to_server
from elastic_emb.ps.wire.security import (
    GRPC_OPTIONS,
    SERVICE,
    Tokens,
    peer_security,
    server_credentials,
)

__all__ = ["serve"]

log = logging.getLogger("elastic_emb.server")

# Addresses that only this machine reaches.
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def serve(
    port: int,
    host: str = "0.0.0.0",
    threads: int = 64,
    grace_seconds: float = 30.0,
    checkpoint_dir: str | None = None,
    checkpoint_every: float | None = None,
    max_deltas: int = 10,
    ready: Callable[[int], None] | None = None,
    coordinator: str | None = None,
    replicas: int = 2,
    advertise: str | None = None,
    lease_seconds: int = 2,
    move_pause: float = 0.0,
    metrics_port: int | None = None,
    metrics_ready: Callable[[int], None] | None = None,
    audit_log: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_client_ca: str | None = None,
    auth_tokens: str | None = None,
    tls_peer_ca: str | None = None,
    peer_token_file: str | None = None,
    load_window: float = 10.0,
    balance: Policy | None = None,
) -> int:
    """Runs one shard until SIGTERM or SIGINT; returns an exit status.

    On a signal the shard reports NOT_SERVING to health checks, stops taking
    new requests, lets in-flight ones finish (up to `grace_seconds`) and,
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
    last `load_window` seconds, and with a `balance` policy its group moves
    slots away when it is the most loaded (`elastic_emb.ps.coord.balance`).
    """
    servicer = Servicer()
    credentials = peers = None
    try:
        if (tls_cert is None) != (tls_key is None) or (tls_client_ca and not tls_cert):
            raise ValueError("--tls-cert and --tls-key go together; --tls-client-ca needs them")
        if tls_cert and tls_key:
            credentials = server_credentials(tls_cert, tls_key, tls_client_ca)
        if auth_tokens:
            servicer.tokens = Tokens(auth_tokens)
        if coordinator:
            peers = peer_security(
                tls_cert, tls_key, tls_peer_ca or tls_client_ca, servicer.tokens, peer_token_file
            )
        elif tls_peer_ca or peer_token_file:
            raise ValueError("--tls-peer-ca and --peer-token-file need --coordinator")
        elif balance is not None:
            raise ValueError("--balance-threshold needs --coordinator (slots move between groups)")
        if coordinator:
            servicer.load = LoadMeter(load_window)
    except ValueError as e:
        log.error("%s", e)
        return 1
    if credentials is None and servicer.tokens is None and host not in _LOOPBACK:
        log.warning(
            "listening on %s without TLS or tokens: anyone who reaches this port can read and "
            "change every table. Use --tls-cert/--tls-key and --auth-tokens (docs/operations.md"
            "#security), or --host 127.0.0.1",
            host,
        )
    if audit_log:
        from elastic_emb.ps.server.audit import AuditError, AuditLog

        try:
            servicer.audit = AuditLog(audit_log)
        except (OSError, AuditError) as e:
            log.error("cannot use the audit log %s: %s", audit_log, e)
            return 1
    health_servicer = HealthServicer()
    # No SO_REUSEPORT: a second server on a port in use must fail, not share its traffic.
    options = [*GRPC_OPTIONS, ("grpc.so_reuseport", 0)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), options=options)
    add_to_server(servicer, server)
    health_servicer.add_to_server(server)
    try:
        if credentials is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            bound = server.add_secure_port(f"{host}:{port}", credentials)
    except RuntimeError:  # grpcio >= 1.60 raises where older versions returned 0
        bound = 0
    if bound == 0:
        log.error("cannot listen on %s:%d (is the port in use?)", host, port)
        return 1
    server.start()
    for service in ("", SERVICE):  # "": the whole server
        health_servicer.set(service, SERVING)
    log.info("elastic_emb parameter server listening on %s:%d", host, bound)
    replica = None
    if coordinator:
        from elastic_emb.ps.coord.etcd import Etcd
        from elastic_emb.ps.server.replication import Replica

        address = advertise or f"{'127.0.0.1' if host == '0.0.0.0' else host}:{bound}"
        replica = Replica(
            servicer.ranges, servicer.apply_change, Etcd(coordinator), address, replicas,
            lease_seconds, move_pause=move_pause, security=peers, load=servicer.load,
            balance=balance,
        )  # fmt: skip
        servicer.replica = replica
        replica.worker_gone = servicer.worker_gone
        try:
            replica.start()
        except Exception as e:
            log.error("cannot join the cluster at %s: %s", coordinator, e)
            server.stop(0)
            return 1
    periodic = None
    if checkpoint_every is not None:
        if not checkpoint_dir or checkpoint_every <= 0 or max_deltas < 0:
            log.error("--checkpoint-every needs --checkpoint-dir, a positive period and "
                      "--max-deltas >= 0")  # fmt: skip
            server.stop(0)
            return 1
        periodic = PeriodicCheckpoints(
            servicer.ranges, checkpoint_dir, checkpoint_every, max_deltas, replica,
            changes=lambda: servicer.changes,
        )  # fmt: skip
        periodic.start()
    if metrics_port is not None:
        from elastic_emb.ps.server.metrics import start_metrics_server

        try:
            metrics = start_metrics_server(servicer, host, metrics_port, tls_cert, tls_key)
        except OSError as e:
            log.error("cannot serve metrics on %s:%d: %s", host, metrics_port, e)
            server.stop(0)
            return 1
        log.info("metrics on http://%s:%d/metrics", host, metrics.server_port)
        if metrics_ready is not None:
            metrics_ready(metrics.server_port)
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    # Before announcing readiness: a SIGTERM right after it must still stop gracefully.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if ready is not None:
        ready(bound)
    stop.wait()
    log.info("stopping: finishing in-flight requests (up to %.0f s)", grace_seconds)
    health_servicer.enter_graceful_shutdown()
    if periodic is not None:
        periodic.stop()
    if replica is not None:
        replica.stop()  # backups take over at once
    server.stop(grace_seconds).wait()
    if checkpoint_dir and replica is None:  # (a replica's rows live on in its group)
        if periodic is not None:
            periodic.save_now()
        else:
            checkpoint.save(checkpoint_dir, servicer.ranges.tables())
        log.info("saved every table to %s", checkpoint_dir)
    return 0
