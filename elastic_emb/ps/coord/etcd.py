"""`Etcd`: a small etcd v3 client over etcd's JSON gateway, standard library only.

Keys, values and revisions; compare-and-swap transactions; leases and a
keep-alive thread; prefix watches that survive etcd restarts. Each call is one
HTTP request on its own connection to `POST /v3/...`: keys and values travel
base64-encoded, int64 fields as decimal strings, and fields at their zero value
are left out of the answers. No coordination logic: that belongs to the caller.
"""

from __future__ import annotations

import base64
import dataclasses
import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal
from urllib.parse import urlsplit

__all__ = [
    "Compare",
    "Etcd",
    "EtcdError",
    "EtcdUnavailable",
    "Event",
    "KeepAlive",
    "KeyValue",
    "Lease",
    "LeaseLost",
    "Op",
    "TxnResult",
    "Watch",
    "parse_endpoint",
]

log = logging.getLogger("elastic_emb.etcd")

GRPC_UNAVAILABLE = (4, 14)  # DEADLINE_EXCEEDED, UNAVAILABLE: etcd has no leader or is stopping
LEASE_NOT_FOUND = "requested lease not found"
_OPS = {"=": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}
_IDLE_CONNECTIONS = 4  # kept open per client for the next calls
# What a kept connection that etcd closed meanwhile raises before the request reaches it.
_CLOSED_BY_PEER = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


class EtcdError(Exception):
    """etcd refused a request; `code` is its gRPC status code (0 when there is none)."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class EtcdUnavailable(EtcdError):
    """etcd could not be reached, did not answer in time, or has no leader."""


class LeaseLost(EtcdError):
    """The lease does not exist (any more): revoked or expired."""


@dataclasses.dataclass(frozen=True)
class KeyValue:
    """One key as etcd stores it; `lease` is 0 without a lease."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int
    version: int = 0  # number of puts since the key was created


@dataclasses.dataclass(frozen=True)
class Event:
    """A change seen by a watch; a DELETE's `kv` has only `key` and `mod_revision`."""

    type: Literal["PUT", "DELETE"]
    kv: KeyValue


@dataclasses.dataclass(frozen=True)
class Lease:
    id: int
    ttl: int  # seconds, as granted (etcd may raise it to its minimum)


@dataclasses.dataclass(frozen=True)
class Compare:
    """A condition of a transaction: `target` of `key` `op` `operand`."""

    key: str
    target: Literal["VERSION", "CREATE", "MOD", "VALUE", "LEASE"]
    op: Literal["=", "!=", "<", ">"]
    operand: int | bytes

    @classmethod
    def mod_revision(cls, key: str, op: Literal["=", "!=", "<", ">"], rev: int) -> Compare:
        """The key's last modification revision (0 when absent)."""
        return cls(key, "MOD", op, rev)

    @classmethod
    def create_revision(cls, key: str, op: Literal["=", "!=", "<", ">"], rev: int) -> Compare:
        """The key's creation revision (0 when absent)."""
        return cls(key, "CREATE", op, rev)

    @classmethod
    def version(cls, key: str, op: Literal["=", "!=", "<", ">"], version: int) -> Compare:
        """Puts since the key was created; `version(key, "=", 0)`: the key is absent."""
        return cls(key, "VERSION", op, version)

    @classmethod
    def value(cls, key: str, op: Literal["=", "!=", "<", ">"], value: bytes) -> Compare:
        """The key's value (an absent key fails every value comparison)."""
        return cls(key, "VALUE", op, value)

    @classmethod
    def lease(cls, key: str, op: Literal["=", "!=", "<", ">"], lease_id: int) -> Compare:
        """The key's lease (0: none or absent)."""
        return cls(key, "LEASE", op, lease_id)

    def to_json(self) -> dict[str, Any]:
        if self.op not in _OPS:
            raise ValueError(f"`op` must be one of {list(_OPS)}. Received: op={self.op!r}")
        field = {"VERSION": "version", "CREATE": "create_revision", "MOD": "mod_revision"}.get(
            self.target, self.target.lower()
        )
        operand = _b64(self.operand) if isinstance(self.operand, bytes) else str(int(self.operand))
        return {
            "key": _b64(self.key),
            "target": self.target,
            "result": _OPS[self.op],
            field: operand,
        }


@dataclasses.dataclass(frozen=True)
class Op:
    """A request inside a transaction."""

    kind: Literal["put", "delete", "get"]
    key: str
    value: bytes = b""
    lease: int = 0

    @classmethod
    def put(cls, key: str, value: bytes, lease: int = 0) -> Op:
        return cls("put", key, value, lease)

    @classmethod
    def delete(cls, key: str) -> Op:
        return cls("delete", key)

    @classmethod
    def get(cls, key: str) -> Op:
        return cls("get", key)

    def to_json(self) -> dict[str, Any]:
        if self.kind == "put":
            return {"request_put": _put_body(self.key, self.value, self.lease)}
        name = {"delete": "request_delete_range", "get": "request_range"}[self.kind]
        return {name: {"key": _b64(self.key)}}


@dataclasses.dataclass(frozen=True)
class TxnResult:
    """`responses[i]` answers the i-th op of the branch taken: a get's list of KeyValue
    (empty or one), a delete's number of deleted keys, None for a put."""

    succeeded: bool
    revision: int
    responses: list[list[KeyValue] | int | None]


class Etcd:
    """A client of one etcd endpoint.

    Thread-safe: a call takes an idle HTTP connection of this client (or
    opens one) and puts it back after the answer; a few stay open for the
    next calls. Every call blocks for at most `timeout` seconds (`watch` and
    `keep_alive` return at once and work in a daemon thread).

    Example:
        etcd = Etcd("etcd://127.0.0.1:2379")
        rev = etcd.put("jobs/a", b"1")
        etcd.txn([Compare.mod_revision("jobs/a", "=", rev)], [Op.put("jobs/a", b"2")])

    Args:
        endpoint: "host:port", "etcd://host:port" or "http://host:port".
        timeout: seconds one request may take.

    Raises:
        ValueError: a malformed endpoint.
    """

    def __init__(self, endpoint: str, timeout: float = 5.0) -> None:
        self.host, self.port = parse_endpoint(endpoint)
        if not timeout > 0:
            raise ValueError(f"`timeout` must be positive. Received: timeout={timeout!r}")
        self.timeout = float(timeout)
        self._lock = threading.Lock()
        self._threads: list[Watch | KeepAlive] = []  # guarded by _lock
        self._idle: list[http.client.HTTPConnection] = []  # guarded by _lock
        self._closed = False  # guarded by _lock

    def __repr__(self) -> str:
        return f"Etcd({self.host}:{self.port})"

    # -- keys ---------------------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        """The key, or None when it is absent."""
        kvs = _kvs(self._call("/v3/kv/range", {"key": _b64(key)}))
        return kvs[0] if kvs else None

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key that starts with `prefix`, sorted by key, and the revision of the read."""
        answer = self._call("/v3/kv/range", _range(prefix))
        return _kvs(answer), _revision(answer)

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Sets the key (attached to `lease`, if not 0); returns the new revision.

        Raises:
            LeaseLost: `lease` does not exist.
        """
        return _revision(self._call("/v3/kv/put", _put_body(key, value, lease)))

    def delete(self, key: str) -> int:
        """Deletes the key; returns how many keys were deleted (0 or 1)."""
        return int(self._call("/v3/kv/deleterange", {"key": _b64(key)}).get("deleted", 0))

    def delete_prefix(self, prefix: str) -> int:
        """Deletes every key that starts with `prefix`; returns how many were deleted."""
        return int(self._call("/v3/kv/deleterange", _range(prefix)).get("deleted", 0))

    def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        """Runs `success` if every comparison holds, else `failure`, atomically."""
        answer = self._call(
            "/v3/kv/txn",
            {
                "compare": [c.to_json() for c in compare],
                "success": [o.to_json() for o in success],
                "failure": [o.to_json() for o in failure],
            },
        )
        responses: list[list[KeyValue] | int | None] = []
        for r in answer.get("responses", []):
            if "response_range" in r:
                responses.append(_kvs(r["response_range"]))
            elif "response_delete_range" in r:
                responses.append(int(r["response_delete_range"].get("deleted", 0)))
            else:
                responses.append(None)
        return TxnResult(bool(answer.get("succeeded", False)), _revision(answer), responses)

    def compact(self, revision: int) -> None:
        """Discards the history before `revision` (watches from older revisions resync)."""
        self._call("/v3/kv/compaction", {"revision": str(revision), "physical": True})

    # -- leases -------------------------------------------------------------------------------

    def grant(self, ttl_seconds: int) -> Lease:
        """A new lease that expires `ttl_seconds` after its last refresh."""
        answer = self._call("/v3/lease/grant", {"TTL": str(int(ttl_seconds))})
        return Lease(int(answer["ID"]), int(answer.get("TTL", 0)))

    def keepalive_once(self, lease_id: int, timeout: float | None = None) -> int:
        """Refreshes the lease; returns its TTL in seconds.

        Raises:
            LeaseLost: the lease was revoked or has expired.
        """
        answer = self._call("/v3/lease/keepalive", {"ID": str(lease_id)}, timeout)
        ttl = int(answer.get("result", {}).get("TTL", 0))
        if ttl <= 0:
            raise LeaseLost(f"etcd lease {lease_id:x} is gone (revoked or expired)", 5)
        return ttl

    def revoke(self, lease_id: int) -> None:
        """Ends the lease and deletes its keys; no error if it is gone already."""
        try:
            self._call("/v3/lease/revoke", {"ID": str(lease_id)})
        except LeaseLost:
            pass

    def keep_alive(self, lease_id: int, interval: float, on_lost: Callable[[], None]) -> KeepAlive:
        """Refreshes the lease every `interval` seconds in a daemon thread.

        The first refresh happens before this returns. `on_lost()` is called
        once, from that thread, when the lease is gone or could not be
        refreshed before it expired.

        Raises:
            LeaseLost: the lease is gone already.
            EtcdUnavailable: the first refresh failed.
        """
        keep = KeepAlive(self, lease_id, interval, on_lost)
        self._track(keep)
        return keep

    # -- watches ------------------------------------------------------------------------------

    def watch(
        self, prefix: str, callback: Callable[[list[Event]], None], start_revision: int = 0
    ) -> Watch:
        """Calls `callback(events)` from a daemon thread for each change under `prefix`.

        From `start_revision` (0: from now). A broken stream is reopened from the
        revision after the last event seen; when that revision has been
        compacted, the watch restarts from now and calls `callback([])` once it
        is in place, so that the caller reads the keys again. The callback runs
        in the watch's thread and holds up the events after it.

        To miss no change: `kvs, rev = get_prefix(prefix)`, then
        `watch(prefix, callback, start_revision=rev + 1)`.
        """
        w = Watch(self, prefix, callback, start_revision)
        self._track(w)
        return w

    def close(self) -> None:
        """Cancels the watches and stops the keep-alives started by this client."""
        with self._lock:
            self._closed, threads, self._threads = True, self._threads, []
            idle, self._idle = self._idle, []
        for t in threads:
            t.stop() if isinstance(t, KeepAlive) else t.cancel()
        for conn in idle:
            conn.close()

    def __enter__(self) -> Etcd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -----------------------------------------------------------------------------

    def _track(self, thread: Watch | KeepAlive) -> None:
        with self._lock:
            closed = self._closed
            if not closed:
                self._threads = [t for t in self._threads if t.alive()] + [thread]
        if closed:
            thread.stop() if isinstance(thread, KeepAlive) else thread.cancel()
            raise EtcdError(f"{self!r} is closed")

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def _connection(self, timeout: float) -> tuple[http.client.HTTPConnection, bool]:
        """An idle connection (True) or a new one (False), waiting at most `timeout`."""
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            return self._connect(timeout), False
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn, True

    def _put_back(self, conn: http.client.HTTPConnection, closing: bool) -> None:
        with self._lock:
            keep = not (closing or self._closed) and len(self._idle) < _IDLE_CONNECTIONS
            if keep:
                self._idle.append(conn)
        if not keep:
            conn.close()

    def _call(self, path: str, body: dict[str, Any], timeout: float | None = None) -> Any:
        """POSTs `body` to the gateway; the JSON answer (a streaming call's first message)."""
        wait = self.timeout if timeout is None else timeout
        data = json.dumps(body)
        while True:
            conn, reused = self._connection(wait)
            try:
                conn.request("POST", path, data, {"Content-Type": "application/json"})
                response = conn.getresponse()
                # (A one-message stream, keepalive's, ends with the request: read it all.)
                text = response.read().split(b"\n", 1)[0]
                status = response.status
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                if reused and isinstance(e, _CLOSED_BY_PEER):
                    continue  # etcd closed that idle connection before this request reached it
                raise EtcdUnavailable(f"etcd {self.host}:{self.port} {path}: {e!r}", 14) from None
            self._put_back(conn, response.will_close)
            break
        try:
            answer = json.loads(text)
        except ValueError:
            raise EtcdError(
                f"etcd {self.host}:{self.port} {path}: HTTP {status}: {text[:200]!r}"
            ) from None
        if "error" in answer:
            raise _error(f"etcd {self.host}:{self.port} {path}", answer)
        if status != 200:
            raise EtcdError(f"etcd {self.host}:{self.port} {path}: HTTP {status}: {answer}")
        return answer


class KeepAlive:
    """The daemon thread of `Etcd.keep_alive`. `stop()` is idempotent and thread-safe."""

    def __init__(
        self, etcd: Etcd, lease_id: int, interval: float, on_lost: Callable[[], None]
    ) -> None:
        if not interval > 0:
            raise ValueError(f"`interval` must be positive. Received: interval={interval!r}")
        self.lease_id, self.interval = lease_id, float(interval)
        self._etcd, self._on_lost = etcd, on_lost
        self._stopped = threading.Event()
        self._lost = threading.Event()
        sent = time.monotonic()
        self._deadline = sent + etcd.keepalive_once(lease_id)  # only the thread writes it
        self._thread = threading.Thread(
            target=self._run, name=f"ee-etcd-keepalive-{lease_id:x}", daemon=True
        )
        self._thread.start()

    @property
    def lost(self) -> bool:
        """Whether the lease was lost (`on_lost` has been or is being called)."""
        return self._lost.is_set()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stops refreshing (the lease then expires unless revoked); waits for the thread."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        next_refresh = time.monotonic() + self.interval
        while not self._stopped.wait(
            max(0.0, min(next_refresh, self._deadline) - time.monotonic())
        ):
            now = time.monotonic()
            if now >= self._deadline:
                break  # expired: no refresh succeeded within the TTL
            if now < next_refresh:
                continue
            try:
                ttl = self._etcd.keepalive_once(self.lease_id, timeout=self._deadline - now)
            except LeaseLost:
                break
            except EtcdError as e:
                log.warning("etcd lease %x: refresh failed, retrying: %s", self.lease_id, e)
                next_refresh = min(now + self.interval, time.monotonic() + 0.1)
                continue
            self._deadline, next_refresh = now + ttl, now + self.interval
        if self._stopped.is_set():
            return
        self._lost.set()
        try:
            self._on_lost()
        except Exception:
            log.exception("etcd lease %x: on_lost raised", self.lease_id)


class Watch:
    """The daemon thread of `Etcd.watch`. `cancel()` is idempotent and thread-safe."""

    def __init__(
        self,
        etcd: Etcd,
        prefix: str,
        callback: Callable[[list[Event]], None],
        start_revision: int = 0,
    ) -> None:
        self.prefix = prefix
        self._etcd, self._callback = etcd, callback
        self._next_revision = int(start_revision)  # only the thread writes it
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None  # guarded by _lock
        self._thread = threading.Thread(
            target=self._run, name=f"ee-etcd-watch-{prefix}", daemon=True
        )
        self._thread.start()

    @property
    def next_revision(self) -> int:
        """The revision the watch would restart from (0 before the first connection)."""
        return self._next_revision

    def alive(self) -> bool:
        return self._thread.is_alive()

    def cancel(self) -> None:
        """Stops the watch: closes its stream and waits for its thread (unless called from it)."""
        self._cancelled.set()
        with self._lock:
            if self._sock is not None:
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        backoff, resync = 0.1, False
        while not self._cancelled.is_set():
            try:
                resync = self._stream(resync)
                if resync:
                    continue  # compacted: start again from now at once
                backoff = 0.1
            except (OSError, http.client.HTTPException, EtcdError, ValueError) as e:
                if self._cancelled.is_set():
                    break
                log.info("etcd watch %r: stream broken, reconnecting: %s", self.prefix, e)
            if self._cancelled.wait(backoff):
                break
            backoff = min(1.0, backoff * 2)

    def _stream(self, resync: bool) -> bool:
        """One watch stream until it ends; True when the revision to start from was compacted."""
        etcd = self._etcd
        body = _range(self.prefix)
        if self._next_revision > 0:
            body["start_revision"] = str(self._next_revision)
        conn = etcd._connect(etcd.timeout)
        try:
            conn.connect()
            if conn.sock is None:
                raise ConnectionError(f"cannot watch {self.prefix!r}: no connection to etcd")
            with self._lock:
                if self._cancelled.is_set():
                    return False
                self._sock = conn.sock
            _keepalive_probes(conn.sock)
            conn.request("POST", "/v3/watch", json.dumps({"create_request": body}))
            response = conn.getresponse()
            conn.sock.settimeout(None)  # events may be far apart; dead peers: TCP keep-alive
            if response.status != 200:
                raise EtcdError(f"etcd watch: HTTP {response.status}: {response.read(200)!r}")
            while line := response.readline():
                message = json.loads(line)
                if "error" in message:
                    raise _error(f"etcd watch {self.prefix!r}", message)
                result = message["result"]
                if result.get("canceled"):
                    if int(result.get("compact_revision", 0)) > 0:
                        log.info("etcd watch %r: revision compacted, resyncing", self.prefix)
                        self._next_revision = 0
                        return True
                    raise EtcdError(f"etcd watch canceled: {result.get('cancel_reason', '')}")
                if result.get("created"):
                    if self._next_revision == 0:
                        self._next_revision = _revision(result) + 1
                    if resync:
                        resync = False
                        self._deliver([])
                    continue
                events = [
                    Event("DELETE" if e.get("type") == "DELETE" else "PUT", _kv(e["kv"]))
                    for e in result.get("events", [])
                ]
                if events:
                    self._next_revision = events[-1].kv.mod_revision + 1
                    self._deliver(events)
            return resync
        finally:
            with self._lock:
                self._sock = None
            conn.close()

    def _deliver(self, events: list[Event]) -> None:
        if self._cancelled.is_set():
            return
        try:
            self._callback(events)
        except Exception:
            log.exception("etcd watch %r: callback raised", self.prefix)


def parse_endpoint(url: str) -> tuple[str, int]:
    """("host", port) of "host:port", "etcd://host:port" or "http://host:port".

    Raises:
        ValueError: anything else (another scheme, a path, no port).
    """
    error = ValueError(
        "etcd endpoint must be 'host:port', 'etcd://host:port' or 'http://host:port'. "
        f"Received: {url!r}"
    )
    if not isinstance(url, str):
        raise error
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "etcd", url
    if scheme not in ("etcd", "http"):
        raise error
    try:
        parts = urlsplit("//" + rest)
        host, port = parts.hostname, parts.port
    except ValueError:
        raise error from None
    if not host or port is None or parts.path not in ("", "/") or parts.query or parts.username:
        raise error
    return host, port


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with `prefix` (b"\\0": no end)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"
    return stripped[:-1] + bytes([stripped[-1] + 1])


def _range(prefix: str) -> dict[str, Any]:
    key = prefix.encode()
    return {"key": _b64(key or b"\0"), "range_end": _b64(prefix_end(key))}


def _put_body(key: str, value: bytes, lease: int) -> dict[str, Any]:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"etcd values are bytes. Received: {type(value).__name__}")
    body = {"key": _b64(key), "value": _b64(bytes(value))}
    if lease:
        body["lease"] = str(lease)
    return body


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode("ascii")


def _kv(j: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=base64.b64decode(j["key"]).decode(),
        value=base64.b64decode(j.get("value", "")),
        mod_revision=int(j.get("mod_revision", 0)),
        create_revision=int(j.get("create_revision", 0)),
        lease=int(j.get("lease", 0)),
        version=int(j.get("version", 0)),
    )


def _kvs(answer: dict[str, Any]) -> list[KeyValue]:
    return [_kv(j) for j in answer.get("kvs", [])]


def _revision(answer: dict[str, Any]) -> int:
    return int(answer.get("header", {}).get("revision", 0))


def _error(where: str, answer: dict[str, Any]) -> EtcdError:
    """The exception of a gateway error answer: {"error": message, "code": gRPC code}, or
    {"error": {"grpc_code": ..., "message": ...}} in a stream."""
    error = answer["error"]
    if isinstance(error, dict):
        message, code = str(error.get("message", error)), int(error.get("grpc_code", 0))
    else:
        message, code = str(answer.get("message", error)), int(answer.get("code", 0))
    if LEASE_NOT_FOUND in message:
        return LeaseLost(f"{where}: {message}", code)
    if code in GRPC_UNAVAILABLE:
        return EtcdUnavailable(f"{where}: {message}", code)
    return EtcdError(f"{where}: {message}", code)


def _keepalive_probes(sock: socket.socket) -> None:
    """TCP keep-alive: a watch on a vanished host ends within ~15 s instead of never."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 5)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
