"""`Etcd`: a small etcd v3 client over etcd's JSON gateway, standard library only.

Keys, values and revisions; compare-and-swap transactions; leases and a
keep-alive thread; prefix watches that survive etcd restarts. Each call is one
HTTP request to `POST /v3/...`: keys and values travel base64-encoded, int64
fields as decimal strings, and fields at their zero value are left out of the
answers. No coordination logic: that belongs to the caller.

Where etcd is and how to reach it is one URL (`parse_endpoint`), the
`coordinator` string of every component:

    etcd://HOST:PORT[,HOST:PORT...]      plaintext ("http://" and a bare
                                         "HOST:PORT" mean the same)
    etcds://HOST:PORT[,HOST:PORT...][?ca=FILE&cert=FILE&key=FILE&user=NAME&password-file=FILE]

`etcds` is HTTPS with the server's certificate checked (against `ca`, else
the system's CAs, and against the member's host name); `cert` and `key` are a
client certificate (etcd's `--client-cert-auth`); `user` and `password-file`
log in to etcd's authentication (the password is read from the file, never
written in the URL). A call goes to the member that answered last and passes
on to the next one it cannot reach.
"""

from __future__ import annotations

import base64
import dataclasses
import http.client
import json
import logging
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote, unquote, urlsplit

__all__ = [
    "Compare",
    "Etcd",
    "EtcdEndpoint",
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
# What a member answers when it did not act on the request: safe to send to another one.
NOT_APPLIED = ("etcdserver: no leader", "raft proposal dropped")
# etcd's answers to a missing, expired or unknown token (a watch is "permission denied").
TOKEN_REFUSED = ("invalid auth token", "user name is empty")
RETRY_PAUSE = 0.05  # seconds between rounds over the members while the cluster has no leader
URL_FORMS = (
    "'etcd://HOST:PORT[,HOST:PORT...]' or 'etcds://HOST:PORT[,HOST:PORT...]"
    "[?ca=FILE&cert=FILE&key=FILE&user=NAME&password-file=FILE]'"
)
URL_OPTIONS = ("ca", "cert", "key", "user", "password-file")
_OPS = {"=": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}
_IDLE_CONNECTIONS = 4  # kept open per member for the next calls
# A header the gateway passes on as gRPC metadata (clientv3's WithRequireLeader): a member
# without a leader answers "no leader" at once instead of waiting, and ends its watches.
_REQUIRE_LEADER = "Grpc-Metadata-hasleader"
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


@dataclasses.dataclass(frozen=True)
class EtcdEndpoint:
    """A parsed coordinator URL (`parse_endpoint`): the members and how to reach them.

    `str()` gives the URL back; it holds file names, never a password.
    """

    members: tuple[tuple[str, int], ...]
    tls: bool = False
    ca: str | None = None  # CA certificate file that signed etcd's certificate
    cert: str | None = None  # client certificate file
    key: str | None = None  # the client certificate's key file
    user: str | None = None
    password_file: str | None = None

    def __str__(self) -> str:
        hosts = ",".join(_address(member) for member in self.members)
        values = (self.ca, self.cert, self.key, self.user, self.password_file)
        options = zip(URL_OPTIONS, values, strict=True)
        query = "&".join(f"{name}={quote(value, safe='/')}" for name, value in options if value)
        return f"{'etcds' if self.tls else 'etcd'}://{hosts}" + (f"?{query}" if query else "")

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS settings of `etcds` (None for plaintext): the server's certificate is
        checked against `ca` (else the system's CAs) and the member's host name.

        Raises:
            ValueError: a file cannot be read or is not a PEM certificate or key.
        """
        if not self.tls:
            return None
        for name, path in (("ca", self.ca), ("cert", self.cert), ("key", self.key)):
            if path is not None:
                _check_readable(name, path)
        try:
            context = ssl.create_default_context(cafile=self.ca)
        except ssl.SSLError as e:
            raise ValueError(
                f"etcd endpoint: ca={self.ca} is not a PEM CA certificate: {e}"
            ) from None
        if self.cert is not None:
            try:
                context.load_cert_chain(self.cert, self.key)
            except ssl.SSLError as e:
                raise ValueError(
                    f"etcd endpoint: cert={self.cert} and key={self.key} are not a PEM "
                    f"certificate and its key: {e}"
                ) from None
        return context

    def password(self) -> str:
        """The password in `password_file` (without the line break at its end).

        Raises:
            ValueError: the file cannot be read or is empty.
        """
        if self.password_file is None:
            raise ValueError("etcd endpoint: no password-file")
        try:
            password = Path(self.password_file).read_text().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) else "not text"
            raise ValueError(
                f"etcd endpoint: cannot read password-file={self.password_file}: {reason}"
            ) from None
        if not password:
            raise ValueError(f"etcd endpoint: password-file={self.password_file} is empty")
        return password


class Etcd:
    """A client of one etcd cluster: one member or several.

    Thread-safe: a call takes an idle HTTP connection of this client (or
    opens one) and puts it back after the answer; a few stay open for the
    next calls. Every call blocks for at most `timeout` seconds (`watch` and
    `keep_alive` return at once and work in a daemon thread).

    A call goes to the member that answered last. A member that cannot be
    reached, does not answer in its share of the time, or has no leader
    passes the call on to the next one (and, while the cluster elects a
    leader, round after round until `timeout`). Where the connection broke
    after the request went out, only requests that are harmless twice are
    sent again (reads, put, delete, lease calls); `txn` and `compact` raise
    `EtcdUnavailable` then, since the first may have been applied.

    With `user=` the client logs in at its first call and again, once per
    call, when etcd says its token is invalid (etcd's simple tokens expire).

    Example:
        etcd = Etcd("etcd://127.0.0.1:2379")
        rev = etcd.put("jobs/a", b"1")
        etcd.txn([Compare.mod_revision("jobs/a", "=", rev)], [Op.put("jobs/a", b"2")])

    Args:
        endpoint: a coordinator URL (see `parse_endpoint`), e.g.
            "etcd://10.0.0.1:2379,10.0.0.2:2379" or
            "etcds://etcd:2379?ca=/certs/ca.pem&user=ps&password-file=/secrets/pw".
        timeout: seconds one request may take.

    Raises:
        ValueError: a malformed endpoint, or a file it names cannot be used.
    """

    def __init__(self, endpoint: str, timeout: float = 5.0) -> None:
        self.endpoint = parse_endpoint(endpoint)
        if not timeout > 0:
            raise ValueError(f"`timeout` must be positive. Received: timeout={timeout!r}")
        self.timeout = float(timeout)
        self._ssl = self.endpoint.ssl_context()
        if self.endpoint.user is not None:
            self.endpoint.password()  # unreadable or empty: an error now, not at a call
        self._lock = threading.Lock()
        self._auth_lock = threading.Lock()  # one log-in at a time
        self._threads: list[Watch | KeepAlive] = []  # guarded by _lock
        self._idle: dict[int, list[http.client.HTTPConnection]] = {}  # guarded by _lock
        self._closed = False  # guarded by _lock
        self._preferred = 0  # guarded by _lock: index of the member tried first
        self._token: str | None = None  # guarded by _lock; "" once etcd said auth is off

    @property
    def members(self) -> tuple[tuple[str, int], ...]:
        """(host, port) of each member, as given."""
        return self.endpoint.members

    def __repr__(self) -> str:
        return f"Etcd({self.endpoint})"

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
        """Deletes the key; returns how many keys were deleted (0 or 1; 0 also when a
        first attempt on a member that failed meanwhile had deleted it)."""
        return int(self._call("/v3/kv/deleterange", {"key": _b64(key)}).get("deleted", 0))

    def delete_prefix(self, prefix: str) -> int:
        """Deletes every key that starts with `prefix`; returns how many were deleted."""
        return int(self._call("/v3/kv/deleterange", _range(prefix)).get("deleted", 0))

    def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        """Runs `success` if every comparison holds, else `failure`, atomically.

        Raises:
            EtcdUnavailable: no member answered; when the message says so, the
                transaction may have been applied.
        """
        answer = self._call(
            "/v3/kv/txn",
            {
                "compare": [c.to_json() for c in compare],
                "success": [o.to_json() for o in success],
                "failure": [o.to_json() for o in failure],
            },
            idempotent=False,
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
        body = {"revision": str(revision), "physical": True}
        self._call("/v3/kv/compaction", body, idempotent=False)

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

        From `start_revision` (0: from now). A broken stream is reopened, on the
        next member, from the revision after the last event seen; when that
        revision has been compacted, the watch restarts from now and calls
        `callback([])` once it is in place, so that the caller reads the keys
        again. A member that loses its leader ends its streams, so a watch does
        not sit on a member cut off from the others. The callback runs in the
        watch's thread and holds up the events after it.

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
            idle, self._idle = self._idle, {}
        for t in threads:
            t.stop() if isinstance(t, KeepAlive) else t.cancel()
        for connections in idle.values():
            for conn in connections:
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

    def _order(self) -> list[int]:
        """The members' indices, the preferred one first."""
        with self._lock:
            first = self._preferred
        n = len(self.members)
        return [(first + i) % n for i in range(n)]

    def _answered(self, member: int) -> None:
        with self._lock:
            self._preferred = member

    def _failed(self, member: int) -> None:
        """The next call starts with the member after `member`, unless another answered."""
        with self._lock:
            if self._preferred == member:
                self._preferred = (member + 1) % len(self.members)

    def _connected(self, member: int, timeout: float) -> http.client.HTTPConnection:
        """A new connection to `member` (TLS handshake done), in at most `timeout`.

        Raises:
            _Unreached: nothing was sent.
        """
        host, port = self.members[member]
        conn = (
            http.client.HTTPConnection(host, port, timeout=timeout)
            if self._ssl is None
            else http.client.HTTPSConnection(host, port, timeout=timeout, context=self._ssl)
        )
        try:
            conn.connect()
        except (OSError, http.client.HTTPException) as e:  # ssl.SSLError is an OSError
            conn.close()
            timed_out = isinstance(e, TimeoutError)
            raise _Unreached(_failure(e, self._ssl is not None), False, timed_out) from None
        return conn

    def _put_back(self, member: int, conn: http.client.HTTPConnection, closing: bool) -> None:
        with self._lock:
            idle = self._idle.setdefault(member, [])
            keep = not (closing or self._closed) and len(idle) < _IDLE_CONNECTIONS
            if keep:
                idle.append(conn)
        if not keep:
            conn.close()

    def _exchange(
        self,
        member: int,
        path: str,
        data: str,
        headers: dict[str, str],
        connect_timeout: float,
        answer_timeout: float,
    ) -> tuple[int, bytes]:
        """(HTTP status, first line of the answer) of one request to `member`.

        Raises:
            _Unreached: no answer (`sent`: the request may have reached etcd).
        """
        while True:
            with self._lock:
                idle = self._idle.get(member)
                conn = idle.pop() if idle else None
            reused = conn is not None
            if conn is None:
                conn = self._connected(member, connect_timeout)
            if conn.sock is not None:
                conn.sock.settimeout(answer_timeout)
            try:
                conn.request("POST", path, data, headers)
                response = conn.getresponse()
                # (A one-message stream, keepalive's, ends with the request: read it all.)
                text = response.read().split(b"\n", 1)[0]
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                if reused and isinstance(e, _CLOSED_BY_PEER):
                    continue  # etcd closed that idle connection before this request reached it
                # A TLS alert ends the connection before etcd reads the request.
                failure = _failure(e, self._ssl is not None, fresh=not reused)
                sent = not isinstance(e, ssl.SSLError)
                raise _Unreached(failure, sent, timed_out=isinstance(e, TimeoutError)) from None
            self._put_back(member, conn, response.will_close)
            return response.status, text

    def _send(
        self, path: str, data: str, token: str | None, deadline: float, idempotent: bool
    ) -> Any:
        """The JSON answer of the first member that answers, trying each in turn (see the
        class docstring) until `deadline`."""
        headers = {"Content-Type": "application/json", _REQUIRE_LEADER: "true"}
        if token:
            headers["Authorization"] = token
        failures: dict[int, str] = {}
        while True:
            # Another round only if a member is up but slow or without a leader (an
            # election may be under way); members that refuse connections fail fast.
            order, again = self._order(), False
            for i, member in enumerate(order):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                share = remaining / (len(order) - i)  # the last member gets all that is left
                where = f"etcd {_address(self.members[member])} {path}"
                try:
                    status, text = self._exchange(
                        member, path, data, headers, share, share if idempotent else remaining
                    )
                    answer = _decode(where, status, text)
                except _Unreached as e:
                    self._failed(member)
                    failures[member] = f"{where}: {e}"
                    if e.sent and not idempotent:
                        raise EtcdUnavailable(
                            f"{where}: {e}; the request may have been applied", 14
                        ) from None
                    again |= e.timed_out
                    continue
                except EtcdUnavailable as e:  # no leader, or etcd timed out inside
                    self._failed(member)
                    failures[member] = str(e)
                    if not (idempotent or any(m in str(e) for m in NOT_APPLIED)):
                        raise
                    again = True
                    continue
                except EtcdError:
                    self._answered(member)
                    raise
                self._answered(member)
                return answer
            if not (again and deadline - time.monotonic() > RETRY_PAUSE):
                break
            time.sleep(RETRY_PAUSE)
        if not failures:
            raise EtcdUnavailable(f"etcd {path}: no time left to ask {self!r}", 14)
        if len(self.members) == 1:
            raise EtcdUnavailable(next(iter(failures.values())), 14)
        raise EtcdUnavailable("no etcd member answered: " + "; ".join(failures.values()), 14)

    def _call(
        self,
        path: str,
        body: dict[str, Any],
        timeout: float | None = None,
        idempotent: bool = True,
    ) -> Any:
        """POSTs `body` to the gateway; the JSON answer (a streaming call's first message)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        data = json.dumps(body)
        token = self._token_for(deadline)
        try:
            return self._send(path, data, token, deadline, idempotent)
        except EtcdError as e:
            if not any(m in str(e) for m in TOKEN_REFUSED) or isinstance(e, EtcdUnavailable):
                raise
            if self.endpoint.user is None:
                raise EtcdError(
                    f"{e} (etcd requires authentication: add user=NAME&password-file=FILE "
                    "to an etcds:// coordinator URL)",
                    e.code,
                ) from None
        token = self._renew_token(token, deadline)  # expired: log in again, once
        return self._send(path, data, token, deadline, idempotent)

    def _token_for(self, deadline: float) -> str | None:
        """The token to send (None without a user); logs in first if there is none yet."""
        if self.endpoint.user is None:
            return None
        with self._lock:
            token = self._token
        return self._renew_token(None, deadline) if token is None else token

    def _renew_token(self, stale: str | None, deadline: float) -> str:
        """A token other than `stale`: one another thread got meanwhile, or a new log-in."""
        with self._auth_lock:
            with self._lock:
                current = self._token
            if current is not None and current != stale:
                return current
            token = self._log_in(deadline)
            with self._lock:
                self._token = token
            return token

    def _log_in(self, deadline: float) -> str:
        """A new token for `user` ("" when etcd has authentication off).

        Raises:
            EtcdError: wrong user name or password (the password is never shown).
        """
        user = self.endpoint.user
        data = json.dumps({"name": user, "password": self.endpoint.password()})
        try:
            answer = self._send("/v3/auth/authenticate", data, None, deadline, True)
        except EtcdUnavailable:
            raise
        except EtcdError as e:
            if "authentication is not enabled" in str(e):
                return ""
            raise EtcdError(
                f"etcd authentication as user {user!r} failed (password from "
                f"{self.endpoint.password_file}): {e}",
                e.code,
            ) from None
        return str(answer.get("token", ""))


class _Unreached(Exception):
    """A member gave no answer; `sent`: the request may have reached it; `timed_out`: it
    did not answer in time (rather than refusing)."""

    def __init__(self, message: str, sent: bool, timed_out: bool = False) -> None:
        super().__init__(message)
        self.sent, self.timed_out = sent, timed_out


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
        failing_since = 0.0  # when refreshes began to fail (0: they succeed)
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
                failing_since = failing_since or now
                if failing_since == now:  # once per outage; tried again every 0.1 s
                    log.warning("etcd lease %x: refresh failed, retrying: %s", self.lease_id, e)
                next_refresh = min(now + self.interval, time.monotonic() + 0.1)
                continue
            if failing_since:
                log.warning("etcd lease %x: refreshed again after %.1f s", self.lease_id,
                            now - failing_since)  # fmt: skip
                failing_since = 0.0
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
        token = etcd._token_for(time.monotonic() + etcd.timeout)
        headers = {"Content-Type": "application/json", _REQUIRE_LEADER: "true"}
        if token:
            headers["Authorization"] = token
        member, conn = self._connect()
        try:
            if conn.sock is None:
                raise ConnectionError(f"cannot watch {self.prefix!r}: no connection to etcd")
            with self._lock:
                if self._cancelled.is_set():
                    return False
                self._sock = conn.sock
            _keepalive_probes(conn.sock)
            conn.request("POST", "/v3/watch", json.dumps({"create_request": body}), headers)
            response = conn.getresponse()
            conn.sock.settimeout(None)  # events may be far apart; dead peers: TCP keep-alive
            if response.status != 200:
                raise EtcdError(f"etcd watch: HTTP {response.status}: {response.read(200)!r}")
            while line := response.readline():
                message = json.loads(line)
                if "error" in message:
                    error = _error(f"etcd watch {self.prefix!r}", message)
                    if token is not None and any(m in str(error) for m in TOKEN_REFUSED):
                        etcd._renew_token(token, time.monotonic() + etcd.timeout)
                    raise error
                result = message["result"]
                if result.get("canceled"):
                    if int(result.get("compact_revision", 0)) > 0:
                        log.info("etcd watch %r: revision compacted, resyncing", self.prefix)
                        self._next_revision = 0
                        return True
                    reason = result.get("cancel_reason", "")
                    if token is not None and "permission denied" in reason:
                        # What an expired token gets: log in again before the next try.
                        etcd._renew_token(token, time.monotonic() + etcd.timeout)
                    raise EtcdError(f"etcd watch canceled: {reason}")
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
            etcd._failed(member)  # the member ended the stream: the next one goes elsewhere
            return resync
        except (OSError, http.client.HTTPException, EtcdUnavailable):
            etcd._failed(member)
            raise
        finally:
            with self._lock:
                self._sock = None
            conn.close()

    def _connect(self) -> tuple[int, http.client.HTTPConnection]:
        """(member, connection) of the first member that accepts one, in the client's order.

        Raises:
            EtcdUnavailable: none did.
        """
        etcd = self._etcd
        failures = []
        order = etcd._order()
        for member in order:
            try:
                return member, etcd._connected(member, etcd.timeout / len(order))
            except _Unreached as e:
                etcd._failed(member)
                failures.append(f"{_address(etcd.members[member])}: {e}")
        raise EtcdUnavailable(f"etcd watch {self.prefix!r}: " + "; ".join(failures), 14)

    def _deliver(self, events: list[Event]) -> None:
        if self._cancelled.is_set():
            return
        try:
            self._callback(events)
        except Exception:
            log.exception("etcd watch %r: callback raised", self.prefix)


def parse_endpoint(url: str) -> EtcdEndpoint:
    """The members and settings of a coordinator URL (see the module docstring).

    "HOST:PORT" and "http://..." are plaintext like "etcd://...". Option values
    are percent-decoded. Files are not read here (`EtcdEndpoint.ssl_context`,
    `EtcdEndpoint.password` do).

    Example:
        >>> parse_endpoint("etcds://a:2379,b:2379?ca=ca.pem").members
        (('a', 2379), ('b', 2379))

    Raises:
        ValueError: anything else, saying what is wrong: another scheme, a member
            without a port or with a path, an unknown or repeated option, `cert`
            without `key`, `user` without `password-file`, or options (credentials
            above all) with plaintext etcd://.
    """

    def malformed(reason: str) -> ValueError:
        shown = _redacted(url) if isinstance(url, str) else url
        return ValueError(f"etcd endpoint must be {URL_FORMS}: {reason}. Received: {shown!r}")

    if not isinstance(url, str):
        raise malformed("not a string")
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "etcd", url
    if scheme not in ("etcd", "http", "etcds"):
        raise malformed(f"unknown scheme {scheme}://" + (", write etcds://" * (scheme == "https")))
    hosts, _, query = rest.partition("?")
    members: list[tuple[str, int]] = []
    for part in hosts.removesuffix("/").split(","):
        if "@" in part:
            raise malformed("a user goes in the options: ?user=NAME&password-file=FILE")
        try:
            parts = urlsplit("//" + part)
            host, port = parts.hostname, parts.port
        except ValueError as e:
            raise malformed(f"member {part!r}: {e}") from None
        if not host or port is None:
            raise malformed(f"member {part!r} is not HOST:PORT")
        if parts.path or parts.fragment:
            raise malformed(f"member {part!r} has a path")
        if (host, port) in members:
            raise malformed(f"member {part!r} appears twice")
        members.append((host, port))
    options: dict[str, str] = {}
    for item in query.split("&") if query else ():
        name, _, value = (unquote(s) for s in item.partition("="))
        if name not in URL_OPTIONS:
            hint = (
                " (the password goes in a file: password-file=FILE)" if name == "password" else ""
            )
            raise malformed(
                f"unknown option {name!r}{hint}; the options are {', '.join(URL_OPTIONS)}"
            )
        if not value:
            raise malformed(f"option {name!r} has no value")
        if name in options:
            raise malformed(f"option {name!r} appears twice")
        options[name] = value
    if scheme != "etcds" and options:
        if {"user", "password-file"} & options.keys():
            raise malformed("credentials need etcds:// (TLS); they would travel in plaintext")
        raise malformed(f"{', '.join(options)} need etcds:// (TLS)")
    if ("cert" in options) != ("key" in options):
        raise malformed("`cert` and `key` go together (the client certificate and its key)")
    if ("user" in options) != ("password-file" in options):
        raise malformed("`user` and `password-file` go together")
    return EtcdEndpoint(
        members=tuple(members),
        tls=scheme == "etcds",
        ca=options.get("ca"),
        cert=options.get("cert"),
        key=options.get("key"),
        user=options.get("user"),
        password_file=options.get("password-file"),
    )


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
    if code in GRPC_UNAVAILABLE or any(m in message for m in NOT_APPLIED):
        return EtcdUnavailable(f"{where}: {message}", code)
    return EtcdError(f"{where}: {message}", code)


def _address(member: tuple[str, int]) -> str:
    host, port = member
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _failure(error: BaseException, tls: bool, fresh: bool = True) -> str:
    """Why a member gave no answer, with a hint where the cause is likely ours."""
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, ssl.SSLCertVerificationError):
        return (
            f"{text} (does ca=FILE name the CA that signed etcd's certificate, and is that "
            "certificate valid for this host name?)"
        )
    if isinstance(error, ssl.SSLError) and "ALERT" in str(error):
        return (
            f"{text} (etcd refused the TLS connection: it may want a client certificate "
            "signed by its --trusted-ca-file, cert=FILE&key=FILE)"
        )
    if isinstance(error, ssl.SSLError) and "WRONG_VERSION_NUMBER" in str(error):
        return f"{text} (etcd does not speak TLS there: use etcd://)"
    if not tls and fresh and isinstance(error, _CLOSED_BY_PEER):
        # (Closed or reset, as the timing goes.)
        return f"{text} (an etcd that serves TLS closes plaintext connections: use etcds://)"
    return text


def _decode(where: str, status: int, text: bytes) -> Any:
    """The JSON answer of the gateway, or the EtcdError it stands for."""
    try:
        answer = json.loads(text)
    except ValueError:
        raise EtcdError(f"{where}: HTTP {status}: {text[:200]!r}") from None
    if not isinstance(answer, dict):
        raise EtcdError(f"{where}: HTTP {status}: {text[:200]!r}")
    if "error" in answer:
        raise _error(where, answer)
    if status != 200:
        raise EtcdError(f"{where}: HTTP {status}: {answer}")
    return answer


def _check_readable(option: str, path: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ValueError(f"etcd endpoint: cannot read {option}={path}: {e.strerror}") from None


def _redacted(url: str) -> str:
    """`url` without what may be secret: a user:password@ and the options' values."""
    hosts, sep, query = url.partition("?")
    hosts = re.sub(r"[^/,]*@", "…@", hosts)
    options = (item.partition("=")[0] + "=…" * ("=" in item) for item in query.split("&"))
    return hosts + sep + "&".join(options) if sep else hosts


def _keepalive_probes(sock: socket.socket) -> None:
    """TCP keep-alive: a watch on a vanished host ends within ~15 s instead of never."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 5)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
