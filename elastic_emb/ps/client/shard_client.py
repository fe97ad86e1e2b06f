"""`ShardClient`: the connections to a set of PS shards, and how calls to them go.

Channels and stubs, deadlines, the retry policy of idempotent calls (gRPC's
service config: a call that found a shard UNAVAILABLE before it could start
is tried again with backoff; on the data plane, a call an overloaded server
refused is sent again after its retry hint, backing off), the mapping of gRPC errors to Python
exceptions, and client-side traffic statistics. No training logic: that is
`elastic_emb.ps.client.cluster`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from elastic_emb import _core
from elastic_emb._proto import health_pb2, ps_pb2, ps_pb2_grpc
from elastic_emb.errors import ModeMismatchError
from elastic_emb.ps.wire import protocol, security
from elastic_emb.ps.wire.security import GRPC_OPTIONS, SERVICE, ClientSecurity

__all__ = [
    "NotJoined", "NotPrimary", "Overloaded", "RangeChanged", "ShardClient", "ShardStats",
    "error_of", "error_of_status",
]  # fmt: skip

# Calls that change nothing when repeated (Pull inserts deterministic rows;
# ImportRows and Restore set state). Push, EraseRows and Save are not retried.
IDEMPOTENT_METHODS = (
    "CreateTables", "DescribeTables", "Join", "Pull", "ImportRows", "ExportRows", "Metadata",
    "Restore", "Stats", "Health",
)  # fmt: skip
RETRY_POLICY = {
    "maxAttempts": 5,
    "initialBackoff": "0.1s",
    "maxBackoff": "2s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}
_SERVICE_CONFIG = {
    "methodConfig": [
        {
            "name": [{"service": SERVICE, "method": m} for m in IDEMPOTENT_METHODS],
            "retryPolicy": RETRY_POLICY,
        }
    ]
}
# Reconnect to a restarted shard within a retry policy's window (default: 1 s, then more).
_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
CLIENT_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.enable_retries", 1),
    ("grpc.service_config", json.dumps(_SERVICE_CONFIG)),
    *_RECONNECT_OPTIONS,
]
# With a coordinator the worker re-routes a failed call itself (to a new primary).
NO_RETRY_OPTIONS = [*GRPC_OPTIONS, ("grpc.enable_retries", 0), *_RECONNECT_OPTIONS]
HEALTH_SERVICE = "grpc.health.v1.Health"  # the standard one, which every server serves
# A server without a data plane (or out of reach) is asked again after this many seconds.
DATA_PLANE_RECHECK_SECONDS = 10.0
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
# A call an overloaded server refused waits its retry hint, times this at each refusal, at
# most MAX_OVERLOAD_BACKOFF_SECONDS (and never past the call's deadline), then goes again.
OVERLOAD_BACKOFF_GROWTH = 1.5
MAX_OVERLOAD_BACKOFF_SECONDS = 1.0


class NotPrimary(ConnectionError):
    """The server is not (or no longer) the primary of its group: re-route."""


class NotJoined(ValueError):
    """The server does not count this elastic worker (its lease lapsed): join again."""


class Overloaded(RuntimeError):
    """The server refused the call unseen, overloaded: sending it again later is safe.
    `retry_after`: the server's hint, in seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RangeChanged(Exception):
    """A slot range was split since the request was made: split it again and re-send."""


@dataclasses.dataclass
class ShardStats:
    """Client-side traffic to one PS shard."""

    address: str
    rpcs: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    max_seconds: float = 0.0
    overloaded: int = 0  # calls the server refused as overloaded, then sent again


def _refused(address: str, seconds: float) -> bool:
    """Whether every TCP connection to `address` is refused for `seconds` (False as soon
    as one is taken, or an attempt gets no answer at all)."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=seconds).close()
            return False
        except ConnectionRefusedError:
            if time.monotonic() >= deadline:
                return True
            time.sleep(0.1)
        except OSError:  # no answer, unreachable, unresolved: gRPC's wait says
            return False


class ShardClient:
    """Channels to PS shards; calls one or all of them, concurrently.

    Thread-safe: any thread may call any method. `call` and `call_all` block
    until the answers (or `timeout`); `close` blocks until the calls started
    by `call_all` have finished.

    Args:
        addresses: "host:port" of each shard.
        timeout: default seconds a call may take.
        retry: retry idempotent calls that found a shard unavailable (off
            when the caller re-routes them itself).
        security: TLS and a token (`elastic_emb.ps.wire.security`); None: plaintext.
        data_plane: "native": Pull and Push (and their range forms) go on a server's
            C++ data plane where it has one (`elastic_emb.ps.server.data_plane`),
            else through gRPC; "grpc": always through gRPC. With TLS, the data plane's
            connections are TLS with the same certificates (gRPC in a build without TLS).

    Raises:
        ValueError: malformed addresses.
    """

    def __init__(
        self,
        addresses: list[str],
        timeout: float,
        retry: bool = True,
        security: ClientSecurity | None = None,
        data_plane: str = "native",
    ) -> None:
        if data_plane not in protocol.DATA_PLANES:
            raise ValueError(
                f"`data_plane` must be one of {protocol.DATA_PLANES}. Received: {data_plane!r}"
            )
        if not addresses or not all(isinstance(a, str) and ":" in a for a in addresses):
            raise ValueError(f'`ps` must list "host:port" addresses. Received: {addresses!r}')
        self.timeout = float(timeout)
        self._options = CLIENT_OPTIONS if retry else NO_RETRY_OPTIONS
        self._retry = retry
        self._security = security
        # With TLS, the data plane's connections are TLS too (gRPC where this build has none).
        self._data_tls = None if security is None else _data_plane_tls(security)
        self._native = data_plane == "native" and (
            security is None or security.ca is None or self._data_tls is not None
        )
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}  # by address; guarded by _lock
        # Data-plane connections by address, and when to ask again a server that had none
        # (guarded by _lock).
        self._data: dict[str, Any] = {}
        self._data_recheck: dict[str, float] = {}
        self._stubs = [self._stub(a) for a in addresses]  # guarded by _lock
        self.addresses = list(addresses)  # changed only by `set_address`
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(2 * len(addresses), 4), thread_name_prefix="ee-rpc"
        )
        # Pushes have their own threads: a shard holds a Pull until this worker's
        # push of the step before arrives, so pulls must never keep that push waiting.
        self._push_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(len(addresses), 2), thread_name_prefix="ee-push-rpc"
        )
        self._stats_lock = threading.Lock()
        self._stats = [ShardStats(a) for a in addresses]  # guarded by _stats_lock

    def _stub(self, address: str) -> Any:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = security.channel(
                address, self._options, self._security
            )
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        for method in protocol.RAW_METHODS:  # encoded and decoded in C++: bytes both ways
            setattr(
                stub,
                method,
                channel.unary_unary(
                    f"/{SERVICE}/{method}",
                    request_serializer=protocol.serialize,
                    response_deserializer=None,
                ),
            )
        return stub

    def set_addresses(self, addresses: list[str]) -> None:
        """Sends later calls to these shards (the cluster's slot ranges changed)."""
        with self._lock:
            self._stubs = [self._stub(a) for a in addresses]
            self.addresses = list(addresses)
        with self._stats_lock:  # the traffic so far stays with the shard's position
            old = self._stats
            self._stats = [
                old[i] if i < len(old) else ShardStats(a) for i, a in enumerate(addresses)
            ]
            for s, a in zip(self._stats, addresses, strict=True):
                s.address = a

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    def connect(self, timeout: float, refused_timeout: float | None = None) -> None:
        """Waits until every shard answers; closes and raises ConnectionError if one does not
        (`unreachable`)."""
        why = self.unreachable(self.addresses, timeout, refused_timeout)
        if why is not None:
            self.close()
            raise ConnectionError(why)

    def unreachable(
        self,
        addresses: list[str],
        timeout: float,
        refused_timeout: float | None = None,
        waited: float | None = None,
    ) -> str | None:
        """Why the first of `addresses` that does not answer within `timeout` is unreachable
        (its message says `waited` seconds, default `timeout`); None when all answer.

        Asks the standard health service (no token, no audit record), waiting for the
        connection: not `grpc.channel_ready_future`, whose polling thread outlives it and
        fails on a channel closed soon after. `refused_timeout`: a shard whose machine
        refuses every connection for this long is unreachable then (an address that drops
        them waits `timeout`).
        """
        for address in addresses:
            port = address.rsplit(":", 1)[-1]
            if refused_timeout is not None and _refused(address, refused_timeout):
                return (
                    f"elastic_emb: parameter server {address} refused the connection for "
                    f"{refused_timeout:g} s: nothing listens on port {port} there. Does "
                    "`elastic-emb serve` run there, on that port? For servers that start "
                    "after their workers, wait longer: ee.init(connect_timeout=SECONDS)"
                )
            with self._lock:
                self._stub(address)  # (its channel)
                channel = self._channels[address]
            check = channel.unary_unary(
                f"/{HEALTH_SERVICE}/Check",
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString,
            )
            try:
                check(health_pb2.HealthCheckRequest(), timeout=timeout, wait_for_ready=True)
                continue
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                    continue  # an answer: the server is there
            return (
                f"elastic_emb: parameter server {address} is unreachable (no answer "
                f"within {timeout if waited is None else waited:g} s): does `elastic-emb "
                f"serve --port {port}` run there (TLS on both sides or neither)? "
                "For servers that start after their workers, wait longer: "
                "ee.init(connect_timeout=SECONDS)"
            )
        return None

    def connect_data_plane(self) -> None:
        """Connects to the data plane of every shard that has one (else later calls do);
        its port is asked with a Health call, counted in the shard's traffic."""
        with self._lock:
            targets = list(enumerate(zip(self.addresses, self._stubs, strict=True)))
        for shard, (address, stub) in targets:
            self._data_connection(shard, address, stub)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._push_pool.shutdown(wait=True)
        with self._lock:
            channels = list(self._channels.values())
            self._data.clear()  # (each closes when its last call is done)
        for channel in channels:
            channel.close()

    def call(
        self,
        shard: int,
        method: str,
        request: Any,
        timeout: float | None = None,
        abandon: Callable[[str], bool] | None = None,
        address: str | None = None,
    ) -> Any:
        """`method` on one shard; gRPC errors become Python exceptions (`error_of`).

        `abandon(address)`, asked every 50 ms while the call runs, may give
        it up (it then raises `NotPrimary`): its server was replaced.
        `address`: another server of the shard's group to ask (a backup).
        """
        with self._lock:
            if address is None:
                address, stub = self.addresses[shard], self._stubs[shard]
            else:
                stub = self._stub(address)
        start = time.perf_counter()
        deadline = self.timeout if timeout is None else timeout
        if method in protocol.RAW_METHODS:
            answer = self._data_call(shard, address, stub, method, request, deadline, abandon)
            if answer is not None:
                return answer
        try:
            if abandon is None:
                response = getattr(stub, method)(request, timeout=deadline)
            else:
                future = getattr(stub, method).future(request, timeout=deadline)
                while True:
                    try:
                        response = future.result(timeout=0.05)
                        break
                    except grpc.FutureTimeoutError:
                        if abandon(address):
                            future.cancel()
                            raise NotPrimary(
                                f"elastic_emb PS {address} {method}: abandoned, the server "
                                "was replaced"
                            ) from None
        except grpc.RpcError as e:
            raise error_of(address, method, e) from None
        received = len(response) if isinstance(response, bytes) else response.ByteSize()
        self._count(shard, address, request.ByteSize(), received, start)
        return response

    def _count(self, shard: int, address: str, sent: int, received: int, start: float) -> None:
        elapsed = time.perf_counter() - start
        with self._stats_lock:
            if shard >= len(self._stats):  # the shards changed meanwhile
                return
            s = self._stats[shard]
            s.address = address
            s.rpcs += 1
            s.bytes_sent += sent
            s.bytes_received += received
            s.seconds += elapsed
            s.max_seconds = max(s.max_seconds, elapsed)

    # The data plane.

    def _data_call(
        self,
        shard: int,
        address: str,
        stub: Any,
        method: str,
        request: Any,
        deadline: float,
        abandon: Callable[[str], bool] | None,
        refusal: Overloaded | None = None,
    ) -> bytes | None:
        """`call` on the data plane; None when it goes through gRPC. A call the server
        refused as overloaded (`refusal`: already, by `_data_call_all`) waits and goes
        again (`_overload_backoff`) until its deadline."""
        start = time.perf_counter()
        end = time.monotonic() + deadline
        payload = protocol.serialize(request)
        number = protocol.DATA_PLANE_METHODS[method]
        for attempt in itertools.count():
            if refusal is not None:
                self._overload_backoff(shard, refusal, attempt, end)
            connection = self._data_connection(shard, address, stub)
            if connection is None:
                return None
            left = end - time.monotonic()
            (ticket,) = _core.data_plane_send([connection], [number], [payload], left)
            try:
                answer = self._data_answer(address, method, ticket, left, abandon)
            except Overloaded as e:
                refusal = e
                continue
            if answer is not None:
                self._count(shard, address, len(payload), len(answer), start)
            return answer
        raise AssertionError("unreachable")

    def _overload_backoff(self, shard: int, refusal: Overloaded, attempt: int, end: float) -> None:
        """Waits before sending again a call refused as overloaded: the server's hint,
        half as long again at each refusal, jittered, at most `MAX_OVERLOAD_BACKOFF_SECONDS`;
        raises the refusal if the call's deadline comes first. (Doubling it left the server
        idle while its callers waited: bench/overload_bench.py.)"""
        growth = OVERLOAD_BACKOFF_GROWTH ** min(attempt, 10)
        wait = min(refusal.retry_after * growth, MAX_OVERLOAD_BACKOFF_SECONDS)
        wait *= random.uniform(0.5, 1.5)  # (callers refused together do not come back together)
        if time.monotonic() + wait >= end:
            raise refusal
        with self._stats_lock:
            if shard < len(self._stats):
                self._stats[shard].overloaded += 1
        time.sleep(wait)

    def _data_connection(self, shard: int, address: str, stub: Any) -> Any:
        """The data-plane connection to `address` (of `shard`); None when the call goes
        through gRPC (no data plane here, the server has none, or it cannot be reached now).
        Its port is asked with a Health call, counted in the shard's traffic."""
        if not self._native:
            return None
        with self._lock:
            connection = self._data.get(address)
            if connection is not None and connection.alive:
                return connection
            self._data.pop(address, None)
            if time.monotonic() < self._data_recheck.get(address, 0.0):
                return None
            # Asked once at a time: other callers go through gRPC meanwhile.
            self._data_recheck[address] = time.monotonic() + DATA_PLANE_RECHECK_SECONDS
        wait = min(self.timeout, 5.0)
        try:
            start = time.perf_counter()
            health = stub.Health(ps_pb2.HealthRequest(), timeout=wait)
            self._count(shard, address, 0, health.ByteSize(), start)
            port = health.data_port
            if port == 0:
                return None
            token = "" if self._security is None else (self._security.token or "")
            connection = _core.DataPlaneConnection(
                address.rpartition(":")[0], port, token, wait, self._data_tls
            )
        except (grpc.RpcError, RuntimeError, ValueError):
            return None  # gRPC carries the call, and says what is wrong if anything is
        with self._lock:
            self._data[address] = connection
            self._data_recheck.pop(address, None)
        return connection

    def _data_answer(
        self,
        address: str,
        method: str,
        ticket: Any,
        deadline: float,
        abandon: Callable[[str], bool] | None,
        end: float | None = None,
    ) -> bytes | None:
        """The answer of a data-plane call given `deadline` seconds (until monotonic `end`,
        default: from now); None when its connection broke before it was sent, or an
        idempotent call's broke (gRPC sends it again).

        Raises what its gRPC call would raise (`error_of_status`), or `Overloaded`.
        """
        end = time.monotonic() + deadline if end is None else end
        # Without `abandon`, one wait on the answer; with it, asked every 50 ms.
        slice_ = deadline if abandon is None else 0.05
        while not _core.data_plane_wait([ticket], min(slice_, end - time.monotonic())):
            if time.monotonic() >= end:
                ticket.forget()
                raise TimeoutError(
                    f"elastic_emb PS {address} {method}: no answer within {deadline:g} s"
                )
            if abandon is not None and abandon(address):
                ticket.forget()
                raise NotPrimary(
                    f"elastic_emb PS {address} {method}: abandoned, the server was replaced"
                )
        status, body = ticket.answer()
        if status == 0:
            return bytes(body)
        code = _STATUS_CODES.get(status, grpc.StatusCode.UNKNOWN)
        if code == grpc.StatusCode.UNAVAILABLE and (
            not ticket.sent or (self._retry and method in IDEMPOTENT_METHODS)
        ):
            return None  # the connection broke: gRPC tries (and retries) it
        message = body.decode("utf-8", "replace")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and ticket.retry_after_ms > 0:
            raise Overloaded(
                f"elastic_emb PS {address} {method}: {message}", ticket.retry_after_ms / 1e3
            )
        raise error_of_status(address, method, code, message)

    def call_all(
        self,
        method: str,
        requests: list[Any],
        timeout: float | None = None,
        call: Callable[..., Any] | None = None,
    ) -> list[Any]:
        """Calls shard i with requests[i] (None: skip it and answer None), concurrently.

        `call(shard, method, request, timeout)` replaces `self.call` (a caller's re-routing).
        """
        if call is None and method in protocol.RAW_METHODS and self._native:
            answers = self._data_call_all(method, requests, timeout)
            if answers is not None:
                return answers
        pool = self._push_pool if method == "Push" else self._pool
        jobs = {
            i: pool.submit(call or self.call, i, method, r, timeout)
            for i, r in enumerate(requests)
            if r is not None
        }
        return [jobs[i].result() if i in jobs else None for i in range(len(requests))]

    def _data_call_all(
        self, method: str, requests: list[Any], timeout: float | None
    ) -> list[Any] | None:
        """`call_all` on the data plane: every request sent at once from this thread, and
        the answers awaited together. None (nothing sent) unless every shard called has a
        data plane. A call whose connection broke goes again through `call` (gRPC)."""
        with self._lock:
            targets = [
                (i, self.addresses[i], self._stubs[i])
                for i, r in enumerate(requests)
                if r is not None
            ]
        connections = [self._data_connection(i, a, stub) for i, a, stub in targets]
        if not targets or any(c is None for c in connections):
            return None
        deadline = self.timeout if timeout is None else timeout
        start, end = time.perf_counter(), time.monotonic() + deadline
        payloads = [protocol.serialize(requests[i]) for i, _, _ in targets]
        number = protocol.DATA_PLANE_METHODS[method]
        tickets = _core.data_plane_send(connections, [number] * len(targets), payloads, deadline)
        _core.data_plane_wait(tickets, deadline)
        answers: list[Any] = [None] * len(requests)
        for (i, address, stub), payload, ticket in zip(targets, payloads, tickets, strict=True):
            try:
                answer = self._data_answer(address, method, ticket, deadline, None, end)
            except Overloaded as refusal:
                left = end - time.monotonic()
                answer = self._data_call(i, address, stub, method, requests[i], left, None, refusal)
            if answer is None:
                answer = self.call(i, method, requests[i], timeout)
            else:
                self._count(i, address, len(payload), len(answer), start)
            answers[i] = answer
        return answers

    def per_shard(
        self, method: str, make: Callable[[int], Any], timeout: float | None = None
    ) -> list[Any]:
        """Calls `method` on every shard with `make(shard_index)`'s request."""
        return self.call_all(method, [make(i) for i in range(self.num_shards)], timeout)

    def data_plane_addresses(self) -> list[str]:
        """The servers this client reaches on their data plane now (the others: gRPC)."""
        with self._lock:
            return sorted(a for a, c in self._data.items() if c.alive)

    def stats(self) -> list[dict[str, Any]]:
        """Client-side RPC count, bytes and latency per shard."""
        with self._stats_lock:
            return [dataclasses.asdict(s) for s in self._stats]

    def reset_stats(self) -> None:
        with self._stats_lock:
            self._stats = [ShardStats(a) for a in self.addresses]


def _data_plane_tls(security: ClientSecurity) -> Any:
    """`security`'s data-plane TLS; None without TLS, or where it cannot be made (gRPC then
    carries the data, and says what is wrong with the certificates)."""
    try:
        return security.data_plane_tls()
    except ValueError:
        return None


def error_of(address: str, method: str, e: grpc.RpcError) -> Exception:
    """The Python exception a failed call raises: the shard's message and what it means."""
    return error_of_status(address, method, e.code(), e.details())


def error_of_status(address: str, method: str, code: grpc.StatusCode, details: str) -> Exception:
    """The Python exception of a call answered with `code` and `details` (either plane)."""
    message = f"elastic_emb PS {address} {method}: {details}"
    if code == grpc.StatusCode.ABORTED:
        return NotPrimary(message)
    if code == grpc.StatusCode.OUT_OF_RANGE:
        return RangeChanged(message)
    if code == grpc.StatusCode.UNAVAILABLE:
        return ConnectionError(f"{message} (parameter server {address} unreachable)")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError(message)
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return PermissionError(f"{message} ({code.name})")
    if code == grpc.StatusCode.FAILED_PRECONDITION and protocol.NOT_JOINED in message:
        return NotJoined(message)
    if code == grpc.StatusCode.FAILED_PRECONDITION and protocol.OTHER_JOB in message:
        return ModeMismatchError(message)
    if code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
    ):
        return ValueError(message)
    return RuntimeError(f"{message} ({code.name})")
