"""`DataPlane`: a server's Pull, Push, PullRanges, PushRanges and Replicate on the C++ data
plane.

gRPC stays the control plane (joins, tables, health, admin, checkpoints, snapshots);
these methods also come on a port of their own, framed TCP whose connections, frames,
limits and tokens C++ handles (`_core.DataPlaneServer`, csrc/data_plane.h), with no gRPC
on the way. C++ answers the requests it can itself (`_core.ServerCore`,
csrc/shard_core.h: the shards' step clocks, slots and tables, no Python and no GIL per
request; on a coordinated server where the replica's last snapshot says it serves the
range, its pushes sent to the backups' data planes and applied there in sequence,
csrc/replication.h, the load metered for the balancer); the others are decided by the
`Servicer`'s own Python code. The same methods arriving over gRPC take the same way
(`Servicer.serve_data`: gRPC only carries their bytes), so both transports give the same
answers, statuses and metrics. A server with TLS serves its data plane over TLS with the
same certificates (`tls`: never a plaintext port beside TLS); a build without TLS
(`_core.with_tls` False) has no data plane on such a server: its data goes through gRPC.
"""

from __future__ import annotations

import logging
import os
import resource
from typing import TYPE_CHECKING, Any

import grpc

from elastic_emb import _core
from elastic_emb.ps.wire.protocol import DATA_PLANE_METHODS
from elastic_emb.ps.wire.security import MAX_MESSAGE_BYTES
from elastic_emb.tables.sharding import NUM_SLOTS

if TYPE_CHECKING:
    from elastic_emb.ps.server.servicer import Servicer

__all__ = [
    "IDLE_SECONDS",
    "MAX_CONNECTIONS",
    "DataPlane",
    "default_max_active",
    "raise_open_files_limit",
    "serve_natively",
]

log = logging.getLogger("elastic_emb.server")

# A connection with no request in flight, or a frame half sent, for this long is closed
# (the client reconnects when it next calls).
IDLE_SECONDS = 600.0
# Connections a server takes at once (one per worker, and one per worker process's
# range router): beyond, a connection is refused with RESOURCE_EXHAUSTED.
MAX_CONNECTIONS = 4096
# Descriptors a server holds besides its data-plane connections (gRPC, files, threads).
OTHER_OPEN_FILES = 1024


def raise_open_files_limit(needed: int) -> int:
    """Raises this process's soft limit of open files towards `needed` (at most the hard
    limit, which only root may raise); returns the soft limit now. The usual soft limit,
    1,024, is below the data plane's default of 4,096 connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        return wanted
    return soft


def default_max_active() -> int:
    """Requests handled at once before an overloaded server refuses more
    (`serve --max-active-requests`): 32 per core this process may use."""
    return 32 * len(os.sched_getaffinity(0))


def serve_natively(servicer: Servicer, max_message_bytes: int, coordinated: bool) -> None:
    """Lets the server's C++ side (`_core.ServerCore`) answer the data methods it can, on
    either transport (the data plane, gRPC: `Servicer.serve_data`); `coordinated`: a server
    with a coordinator, whose changes replicate to its backups."""
    core = servicer.ranges.native
    if servicer.load is not None:
        core.meter_load(NUM_SLOTS)
        servicer.load.count_also(core.load)
    core.set_max_answer_bytes(max_message_bytes)
    core.set_enabled(True, pushes=not coordinated)


_NAMES = {number: name for name, number in DATA_PLANE_METHODS.items()}
_STATUS = {code.name: code.value[0] for code in grpc.StatusCode}


class DataPlane:
    """Serves `servicer`'s data methods on host:port (0: any free port) until `stop`.

    `threads`: the most requests in progress at once (a pull parked at the sync barrier,
    or a push waiting for the backups, holds none). Overload: a request finding
    `max_active` others being handled (0: no limit), or `max_per_connection` in flight on
    its connection, is refused before anything is done, RESOURCE_EXHAUSTED with a retry
    hint, and the client sends it again after it (`ShardClient`); a primary's changes to
    its backups are never refused so. What `serve_natively` let C++ answer is answered
    there; the rest by the servicer's Python. `tls`: a server `_core.TlsContext`
    (`security.data_plane_server_tls`): every connection is TLS; None: plaintext.

    Raises:
        RuntimeError: the port cannot be bound.
    """

    def __init__(
        self,
        servicer: Servicer,
        host: str,
        port: int,
        threads: int,
        idle_seconds: float = IDLE_SECONDS,
        max_connections: int = MAX_CONNECTIONS,
        max_frame_bytes: int = MAX_MESSAGE_BYTES,
        max_active: int = 0,
        max_per_connection: int = 256,
        tls: Any = None,
    ) -> None:
        raise_open_files_limit(max_connections + OTHER_OPEN_FILES)
        options = _core.DataPlaneOptions()
        options.host, options.port, options.max_threads = host, port, threads
        options.max_active, options.max_per_connection = max_active, max_per_connection
        options.idle_seconds, options.max_connections = idle_seconds, max_connections
        options.max_frame_bytes = max_frame_bytes
        options.tls = tls
        self._servicer = servicer
        self._server = _core.DataPlaneServer(
            options, self._handle, self._authenticate, servicer.ranges.native
        )
        self.port: int = self._server.port

    def _handle(self, method: int, payload: bytes, deadline_ms: int, caller: str) -> Any:
        name = _NAMES.get(method)
        if name is None:  # (the C++ side refuses unknown methods before this)
            return _STATUS["INVALID_ARGUMENT"], f"unknown method {method}".encode()
        code, response = self._servicer.serve_raw(name, payload, caller)
        return _STATUS[code], response

    def _authenticate(self, token: bytes, peer: str) -> tuple[bool, str]:
        try:
            text = token.decode("utf-8")
        except UnicodeDecodeError:
            return False, "data plane: the token is not UTF-8"
        return self._servicer.authenticate(text, peer)

    def counters(self) -> dict[str, int]:
        """The plane's own counts: connections accepted, refused and closed idle, frames
        refused, requests, requests refused as overloaded, connections closed for a failed
        TLS handshake or record."""
        return dict(self._server.counters())

    def stop(self, grace_seconds: float = 0.0) -> None:
        """Takes no new request; answers those in progress (up to `grace_seconds`)."""
        self._server.stop(grace_seconds)
