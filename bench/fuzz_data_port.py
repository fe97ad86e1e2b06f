"""Fuzzes a live server's data port: hostile and broken clients, and what must still hold.

A real `elastic-emb serve` with `--auth-tokens` (started here, or `--target HOST:PORT`, a
server started by hand) is attacked for `--seconds`, in two phases: as an outsider (no
token, a wrong or huge one, no hello at all) and as an authenticated worker (the worker
token; every frame reaches the request handlers). Each attack family is a function below,
drawn at random from `--seed`: random bytes; frames with a header field mutated (magic,
length, huge announced lengths with short bodies, request ids, deadlines, unknown methods,
statuses); valid Pull/Push/PullRanges/PushRanges/Replicate bodies with bytes flipped, cut
or extended; protobuf field-level mutations (wrong wire types, huge length prefixes,
delta-varint keys, huge key counts, absurd dims, NaN gradients, unknown tables); frames cut
mid-way; many frames pipelined in one write; slowloris (a byte at a time, half-open
connections held); floods of connections, one above the server's connection limit;
tokens; and Replicate frames with the server's own group, epoch, next sequence and
address, from outsiders and from a worker.

Invariants, each checked on its own, continuously and at the end of each phase:
  alive      the server process is running and answers Health;
  rows       a reference client with a valid token pulls the same rows, bit for bit, from
             a table no fuzzed request names; and after the outsider phase, both tables
             export exactly as before it (an outsider changes nothing);
  status     no answer is INTERNAL (13), no outsider's request and no worker's Replicate
             is answered OK;
  memory     the server's RSS stays within `--max-rss-growth-mb` of its size before;
  sanitizer  (`--sanitized`, a server started here) no AddressSanitizer or UBSan report in
             its output.
Each violation is a finding, printed with the bytes that caused it where one frame did.

    python bench/fuzz_data_port.py [--seconds 120] [--seed 1] [--phases outsider,worker]
        [--tls] [--sanitized --server-pythonpath /tmp/asan-tree] [--limit-flood]
        [--target HOST:PORT --admin-token T --worker-token T [--pid PID]]

The sanitized build: docs/operations.md#fuzzing-the-data-port. Exit status 1 on any finding.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import resource
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import elastic_emb as ee
from elastic_emb import _core
from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.ps.server.data_plane import MAX_CONNECTIONS
from elastic_emb.ps.wire import security

HEADER = struct.Struct("<IIQIBBH")  # magic, length, request id, deadline ms, method, status, retry
MAGIC = 0x50444545
HELLO, PULL, PUSH, PULL_RANGES, PUSH_RANGES, REPLICATE = range(6)
OK, INVALID_ARGUMENT, PERMISSION_DENIED, INTERNAL, UNAUTHENTICATED = 0, 3, 7, 13, 16
ADMIN_TOKEN, WORKER_TOKEN = "fuzz-admin-token", "fuzz-worker-token"
REFERENCE_TABLE, FUZZ_TABLE = "reference-rows-never-fuzzed", "fuzz"
REFERENCE_KEYS = np.arange(1000, 1064, dtype="<i8")
FUZZ_DIM, REFERENCE_DIM = 4, 8
SANITIZER_MARKS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer")


@dataclass
class Finding:
    invariant: str  # alive, rows, status, memory, sanitizer
    family: str
    phase: str
    detail: str
    frame: bytes = b""  # the bytes that caused it, where one frame did

    def describe(self) -> str:
        where = f"[{self.phase}/{self.family}] " if self.family else f"[{self.phase}] "
        shown = self.frame[:512].hex()
        more = f" (first 512 of {len(self.frame)} bytes)" if len(self.frame) > 512 else ""
        frame = f"\n    frame: {shown}{more}" if self.frame else ""
        return f"{self.invariant}: {where}{self.detail}{frame}"


@dataclass
class Tally:
    """What each family sent and got, and the findings (guarded by `lock`)."""

    frames: collections.Counter = field(default_factory=collections.Counter)
    connections: collections.Counter = field(default_factory=collections.Counter)
    statuses: dict[str, collections.Counter] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    peak_rss: int = 0
    base_rss: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, finding: Finding) -> None:
        with self.lock:
            if len(self.findings) < 200:
                self.findings.append(finding)


# ---------------------------------------------------------------------------------------------
# The server and the reference client


class Target:
    """A server under attack: its addresses, tokens, and (if started here) its process."""

    def __init__(
        self,
        address: str,
        admin_token: str | None,
        worker_token: str | None,
        pki: dict | None = None,
        process: subprocess.Popen | None = None,
        pid: int | None = None,
    ) -> None:
        self.address, self.host = address, address.rsplit(":", 1)[0]
        self.admin_token, self.worker_token = admin_token, worker_token
        self.process, self.pid = process, process.pid if process else pid
        self.output: list[str] = []  # the server's stdout and stderr, if started here
        self.ssl: ssl.SSLContext | None = None
        self.core_tls = None
        ca = pki["ca"] if pki else None
        if pki:
            self.ssl = ssl.create_default_context(cafile=str(ca))
            self.core_tls = _core.TlsContext.client(Path(ca).read_bytes())
        admin = security.ClientSecurity.make(tls_ca=ca, token=admin_token) if (
            ca or admin_token
        ) else None  # fmt: skip
        self.stub = ps_pb2_grpc.ParameterServerStub(security.channel(address, [], admin))
        self.data_port = self.health().data_port
        if self.data_port <= 0:
            raise RuntimeError(f"{address} has no data port (started with --data-plane grpc?)")

    def health(self) -> ps_pb2.HealthResponse:
        return self.stub.Health(ps_pb2.HealthRequest(), timeout=10)

    def alive(self) -> bool:
        return self.process is None or self.process.poll() is None

    def rss(self) -> int:
        if self.pid is None:
            return 0
        with contextlib.suppress(OSError), open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def connect(self, timeout: float = 3.0) -> socket.socket:
        sock = socket.create_connection((self.host, self.data_port), timeout=timeout)
        if self.ssl is not None:
            sock = self.ssl.wrap_socket(sock, server_hostname=self.host)
        return sock

    def reference_connection(self) -> _core.DataPlaneConnection:
        token = self.admin_token or ""
        return _core.DataPlaneConnection(self.host, self.data_port, token, 5.0, self.core_tls)


def start_server(
    directory: Path,
    sanitized: bool = False,
    pythonpath: str | None = None,
    tls: bool = False,
    extra_args: tuple[str, ...] = (),
) -> Target:
    """`elastic-emb serve` with tokens (and TLS), its output kept; sanitized: the extension
    built with ASan/UBSan at `pythonpath`, their runtimes preloaded."""
    tokens = directory / "tokens"
    tokens.write_text(f"{ADMIN_TOKEN} admin fuzz-admin\n{WORKER_TOKEN} worker fuzz-worker\n")
    args = ["--auth-tokens", str(tokens), *extra_args]
    pki = None
    if tls:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from _certs import make_pki

        pki = make_pki(directory)
        cert, key = pki["server"]
        args += ["--tls-cert", str(cert), "--tls-key", str(key)]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("ELASTIC_EMB_PS", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    if sanitized:
        runtimes = [sanitizer_runtime(name) for name in ("libasan.so", "libubsan.so")]
        env["LD_PRELOAD"] = " ".join(runtimes)
        # Python frees little at exit by design: leaks are not what is looked for here.
        env["ASAN_OPTIONS"] = "detect_leaks=0:allocator_may_return_null=1"
        env["UBSAN_OPTIONS"] = "print_stacktrace=1"
    script = Path(sys.executable).parent / "elastic-emb"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "elastic_emb.cli"]
    process = subprocess.Popen(
        [*command, "serve", "--port", "0", "--host", "127.0.0.1", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env=env,
    )
    output: list[str] = []
    ready = threading.Event()
    address: list[str] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line)
            if line.startswith("elastic-emb serve: listening on") and not address:
                address.append(line.rsplit(" ", 1)[-1].strip())
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(180) or not address:
        stop_server(process)
        raise RuntimeError("elastic-emb serve did not start:\n" + "".join(output))
    target = Target(address[0], ADMIN_TOKEN, WORKER_TOKEN, pki, process)
    target.output = output
    return target


def sanitizer_runtime(name: str) -> str:
    """The path of a sanitizer's runtime library of the compiler that built the extension."""
    found = subprocess.run(
        [os.environ.get("CXX", "g++"), f"-print-file-name={name}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not os.path.isabs(found):
        raise RuntimeError(f"{name} not found by the compiler (install its sanitizer runtime)")
    return found


def stop_server(process: subprocess.Popen) -> int | None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def prepare(target: Target) -> None:
    """Creates the two tables (SGD), joins worker 0 (async, unbounded staleness) and gives
    the reference rows values of their own."""
    specs = []
    for name, dim in ((REFERENCE_TABLE, REFERENCE_DIM), (FUZZ_TABLE, FUZZ_DIM)):
        table = ee.Table(dim, ee.optimizers.SGD(0.5), initializer="uniform", name=name, seed=7)
        config = json.dumps(table.config())
        specs.append(ps_pb2.TableSpec(name=name, config_json=config))
    target.stub.CreateTables(ps_pb2.CreateTablesRequest(tables=specs), timeout=30)
    join = ps_pb2.JoinRequest(worker=0, num_workers=1, mode=ps_pb2.ASYNC, staleness=-1)
    target.stub.Join(join, timeout=30)
    gradients = np.linspace(-1, 1, len(REFERENCE_KEYS) * REFERENCE_DIM, dtype="<f4")
    push = ps_pb2.PushRequest(
        worker=0,
        step=1,
        tables=[
            ps_pb2.TableGradients(
                table=REFERENCE_TABLE, keys=REFERENCE_KEYS.tobytes(), gradients=gradients.tobytes()
            )
        ],
    )
    target.stub.Push(push, timeout=30)


def reference_rows(target: Target, connection: list) -> bytes:
    """The reference keys' rows as the reference client pulls them on the data plane
    (`connection`: a one-element list holding the connection, replaced if it died)."""
    entry = ps_pb2.TableKeys(table=REFERENCE_TABLE, keys=REFERENCE_KEYS.tobytes())
    pull = ps_pb2.PullRequest(worker=0, step=1, train=False, tables=[entry])
    for attempt in range(3):
        try:
            if not connection or not connection[0].alive:
                connection[:] = [target.reference_connection()]
            (ticket,) = _core.data_plane_send(
                [connection[0]], [PULL], [pull.SerializeToString()], 10
            )
            if _core.data_plane_wait([ticket], 10):
                status, payload = ticket.answer()
                if status == OK:
                    return ps_pb2.PullResponse.FromString(payload).tables[0].values
                raise RuntimeError(f"status {status}: {payload[:200]!r}")
        except RuntimeError:
            if attempt == 2:
                raise
        connection.clear()
        time.sleep(0.2)
    raise RuntimeError("no answer within 10 s")


def exported(target: Target) -> dict[str, bytes]:
    """Every row of both tables with its state, sorted by key (gRPC, the admin token)."""
    tables = {}
    for name in (REFERENCE_TABLE, FUZZ_TABLE):
        rows = target.stub.ExportRows(
            ps_pb2.ExportRowsRequest(table=name, with_state=True), timeout=60
        )
        order = np.argsort(np.frombuffer(rows.keys, "<i8"), kind="stable")
        parts = [rows.keys, rows.values, rows.slots, rows.last_step, rows.update_count]
        widths = [8, 4 * len(rows.values) // max(1, 4 * len(order)), 0, 4, 4]
        sorted_parts = []
        for part, width in zip(parts, widths, strict=True):
            if width and len(order) and len(part) == width * len(order):
                sorted_parts.append(
                    np.frombuffer(part, np.uint8).reshape(len(order), width)[order].tobytes()
                )
            else:
                sorted_parts.append(part)
        tables[name] = b"|".join(sorted_parts) + b"|" + str(rows.iterations).encode()
    return tables


# ---------------------------------------------------------------------------------------------
# Frames and protobuf bytes


def frame(
    method: int,
    body: bytes,
    request_id: int = 1,
    deadline_ms: int = 0,
    magic: int = MAGIC,
    length: int | None = None,
    status: int = 0,
    retry_after_ms: int = 0,
) -> bytes:
    length = len(body) if length is None else length
    return (
        HEADER.pack(magic, length, request_id, deadline_ms, method, status, retry_after_ms) + body
    )


def varint(value: int) -> bytes:
    """Protobuf's base-128 varint of a non-negative int (any size: longer ones overflow)."""
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def pb_field(number: int, wire_type: int, value: bytes | int) -> bytes:
    """One field: a varint (0; bytes read as a little-endian number), 64-bit (1), bytes
    with their length (2) or 32-bit (5)."""
    key = varint(number << 3 | wire_type)
    if wire_type == 0:
        number_value = int.from_bytes(value, "little") if isinstance(value, bytes) else value
        return key + varint(number_value & (1 << 64) - 1)
    data = value if isinstance(value, bytes) else varint(int(value))
    if wire_type == 2:
        return key + varint(len(data)) + data
    return key + data[: 8 if wire_type == 1 else 4].ljust(8 if wire_type == 1 else 4, b"\0")


def pb_fields(data: bytes) -> list[tuple[int, int, bytes]] | None:
    """The top-level (number, wire type, raw value) fields of a message; None if malformed."""
    fields, at = [], 0

    def read_varint() -> int:
        nonlocal at
        value, shift = 0, 0
        while True:
            if at >= len(data) or shift > 63:
                raise ValueError
            byte = data[at]
            at += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    try:
        while at < len(data):
            key = read_varint()
            number, wire_type = key >> 3, key & 7
            start = at
            if wire_type == 0:
                read_varint()
                fields.append((number, 0, data[start:at]))
            elif wire_type == 2:
                size = read_varint()
                if at + size > len(data):
                    return None
                fields.append((number, 2, data[at : at + size]))
                at += size
            elif wire_type in (1, 5):
                at += 8 if wire_type == 1 else 4
                fields.append((number, wire_type, data[start:at]))
            else:
                return None
    except ValueError:
        return None
    return fields


def pb_join(fields: list[tuple[int, int, bytes]]) -> bytes:
    out = b""
    for number, wire_type, raw in fields:
        key = varint(number << 3 | wire_type)
        out += key + (varint(len(raw)) + raw if wire_type == 2 else raw)
    return out


def delta_keys(keys: np.ndarray) -> bytes:
    """KEYS_DELTA_VARINT: each key's zigzag delta from the previous one, as a varint."""
    out, previous = bytearray(), 0
    for key in keys.tolist():
        delta = (key - previous) & (1 << 64) - 1
        signed = delta - (1 << 64) if delta >> 63 else delta
        out += varint(((signed << 1) ^ (signed >> 63)) & (1 << 64) - 1)
        previous = key
    return bytes(out)


@dataclass
class Corpus:
    """Valid requests to mutate: (method, body), and the server's replication state."""

    requests: list[tuple[int, bytes]]
    group: int = 0
    epoch: int = 0
    sequence: int = 0
    address: str = ""

    @classmethod
    def make(cls, target: Target, rng: random.Random) -> Corpus:
        health = target.health()
        corpus = cls([], health.group, health.epoch, health.sequence, target.address)
        for _ in range(6):
            keys = np.array(sorted(rng.sample(range(1, 5000), rng.randint(1, 40))), "<i8")
            corpus.requests += [
                (PULL, pull_body(keys, rng).SerializeToString()),
                (PUSH, push_body(keys, rng).SerializeToString()),
                (PULL_RANGES, ps_pb2.PullRangesRequest(
                    parts=[pull_body(keys, rng), pull_body(keys[::2], rng)]
                ).SerializeToString()),
                (PUSH_RANGES, ps_pb2.PushRangesRequest(
                    parts=[push_body(keys, rng), push_body(keys[::2], rng)]
                ).SerializeToString()),
                (REPLICATE, corpus.replicate(rng).SerializeToString()),
            ]  # fmt: skip
        return corpus

    def replicate(self, rng: random.Random) -> ps_pb2.ReplicateRequest:
        """A change as this server's primary would send it: its group, epoch, the next
        sequence and an address; it names the reference rows."""
        keys = REFERENCE_KEYS[: rng.randint(1, len(REFERENCE_KEYS))]
        choice = rng.randrange(3)
        if choice == 0:
            gradients = np.full(len(keys) * REFERENCE_DIM, 0.5, "<f4")
            entry = ps_pb2.TableGradients(
                table=REFERENCE_TABLE, keys=keys.tobytes(), gradients=gradients.tobytes()
            )
            method, request = "Push", ps_pb2.PushRequest(worker=0, step=2, tables=[entry])
        elif choice == 1:
            method = "EraseRows"
            request = ps_pb2.EraseRowsRequest(table=REFERENCE_TABLE, keys=keys.tobytes())
        else:
            method = "ImportRows"
            request = ps_pb2.ImportRowsRequest(
                table=REFERENCE_TABLE,
                keys=keys.tobytes(),
                values=np.zeros(len(keys) * REFERENCE_DIM, "<f4").tobytes(),
            )
        return ps_pb2.ReplicateRequest(
            group=self.group,
            epoch=self.epoch + rng.choice([0, 0, 1, -1]),
            sequence=self.sequence + rng.choice([1, 1, 0, 2]),
            method=method,
            request=request.SerializeToString(),
            primary=rng.choice([self.address, "127.0.0.1:1", ""]),
        )


def pull_body(keys: np.ndarray, rng: random.Random) -> ps_pb2.PullRequest:
    encoded, encoding = (keys.tobytes(), 0) if rng.random() < 0.5 else (delta_keys(keys), 1)
    entry = ps_pb2.TableKeys(table=FUZZ_TABLE, keys=encoded, key_encoding=encoding)
    return ps_pb2.PullRequest(worker=0, step=rng.randint(1, 3), train=True, tables=[entry])


def push_body(keys: np.ndarray, rng: random.Random) -> ps_pb2.PushRequest:
    encoded, encoding = (keys.tobytes(), 0) if rng.random() < 0.5 else (delta_keys(keys), 1)
    gradients = np.asarray([rng.uniform(-1, 1) for _ in range(len(keys) * FUZZ_DIM)], "<f4")
    entry = ps_pb2.TableGradients(
        table=FUZZ_TABLE, keys=encoded, gradients=gradients.tobytes(), key_encoding=encoding
    )
    return ps_pb2.PushRequest(worker=0, step=rng.randint(1, 3), tables=[entry])


# ---------------------------------------------------------------------------------------------
# Connections


class Link:
    """One raw connection to the data port; what it sent by request id, to blame answers."""

    def __init__(self, session: Session, family: str) -> None:
        self.session, self.family = session, family
        self.sock = session.target.connect()
        self.sent: dict[int, bytes] = {}
        self.buffer = b""
        self.eof = False
        session.count_connection(family)

    def send(self, data: bytes, frames: int = 1) -> bool:
        """Sends `data` (`frames` frames, for the tally); False once the peer closed."""
        self.session.count_frames(self.family, frames)
        if len(data) >= HEADER.size:
            self.sent[HEADER.unpack_from(data)[2]] = data
        try:
            self.sock.sendall(data)
            return True
        except (OSError, ValueError):
            self.eof = True
            return False

    def hello(self, token: str | bytes | None) -> int | None:
        """Sends a hello with `token` (None: none) and returns its answer's status."""
        body = token.encode() if isinstance(token, str) else token or b""
        self.send(frame(HELLO, body, request_id=0))
        answers = self.answers(5.0, want=1)
        return answers[0][0] if answers else None

    def answers(self, seconds: float, want: int | None = None) -> list[tuple[int, int, bytes]]:
        """(status, request id, body) of the answers that come within `seconds`, until EOF
        or `want` of them; each one checked (Session.check)."""
        got: list[tuple[int, int, bytes]] = []
        deadline = time.monotonic() + seconds
        while not self.eof and (want is None or len(got) < want):
            while len(self.buffer) >= HEADER.size:
                _, length, request_id, _, _, status, _ = HEADER.unpack_from(self.buffer)
                if len(self.buffer) < HEADER.size + length:
                    break
                body = self.buffer[HEADER.size : HEADER.size + length]
                self.buffer = self.buffer[HEADER.size + length :]
                got.append((status, request_id, body))
                self.session.check(self, status, request_id, body)
            if want is not None and len(got) >= want:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                self.sock.settimeout(left)
                data = self.sock.recv(1 << 16)
            except (TimeoutError, ssl.SSLWantReadError):
                break
            except (OSError, ssl.SSLError):
                data = b""
            if not data:
                self.eof = True
            self.buffer += data
        return got

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


# ---------------------------------------------------------------------------------------------
# The session: one phase's attacks and their checks


class Session:
    def __init__(
        self,
        target: Target,
        corpus: Corpus,
        tally: Tally,
        phase: str,
        rng: random.Random,
        hold_seconds: float,
    ) -> None:
        self.target, self.corpus, self.tally = target, corpus, tally
        self.phase, self.rng, self.hold_seconds = phase, rng, hold_seconds
        self.held: list[tuple[float, Link, bytes]] = []  # (until, link, bytes left to trickle)
        self.next_id = 1

    def request_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def count_frames(self, family: str, n: int) -> None:
        with self.tally.lock:
            self.tally.frames[family] += n

    def count_connection(self, family: str) -> None:
        with self.tally.lock:
            self.tally.connections[family] += 1

    def token(self) -> str | bytes | None:
        """The token of this phase: a worker's, or one of an outsider's."""
        if self.phase == "worker":
            return self.target.worker_token
        return self.rng.choice(
            [None, "", "guess", (self.target.worker_token or "x") + "x", b"\0" * 32, "x" * 70000]
        )

    def open(self, family: str, hello: bool = True) -> Link | None:
        """A connection with this phase's hello (an outsider's sometimes skips it)."""
        try:
            link = Link(self, family)
        except OSError:
            return None  # refused (a flood beside it, a limit): not a finding
        if hello and (self.phase == "worker" or self.rng.random() < 0.7):
            status = link.hello(self.token())
            if self.phase == "worker" and status != OK:
                link.close()
                return None
        return link

    def check(self, link: Link, status: int, request_id: int, body: bytes) -> None:
        family = link.family
        with self.tally.lock:
            self.tally.statuses.setdefault(family, collections.Counter())[status] += 1
        sent = link.sent.get(request_id, b"")
        method = HEADER.unpack_from(sent)[4] if len(sent) >= HEADER.size else -1
        if status == INTERNAL:
            detail = f"answered INTERNAL: {body[:300]!r}"
            self.tally.add(Finding("status", family, self.phase, detail, sent))
        elif status == OK and self.phase == "outsider":
            detail = f"an outsider's frame (method {method}) answered OK: {body[:100]!r}"
            self.tally.add(Finding("status", family, self.phase, detail, sent))
        elif status == OK and method == REPLICATE and request_id != 0:
            detail = f"a worker's Replicate answered OK: {body[:100]!r}"
            self.tally.add(Finding("status", family, self.phase, detail, sent))

    def valid(self) -> tuple[int, bytes]:
        return self.rng.choice(self.corpus.requests)

    def trickle(self) -> None:
        """Sends the next byte of each held slowloris connection; closes those whose time
        is up."""
        now, kept = time.monotonic(), []
        for until, link, rest in self.held:
            if now >= until or link.eof:
                link.close()
                continue
            if rest and self.rng.random() < 0.5:
                with contextlib.suppress(OSError):
                    link.sock.sendall(rest[:1])
                rest = rest[1:]
            kept.append((until, link, rest))
        self.held = kept

    def release(self) -> None:
        for _, link, _ in self.held:
            link.close()
        self.held = []


# ---------------------------------------------------------------------------------------------
# The attack families


def random_bytes(s: Session) -> None:
    """Bytes that are not frames, after the hello (or without one), sometimes after a
    valid magic."""
    link = s.open("random-bytes")
    if link is None:
        return
    data = s.rng.randbytes(s.rng.randint(1, 4096))
    if s.rng.random() < 0.3:
        data = struct.pack("<I", MAGIC) + data
    link.send(data)
    link.answers(0.2)
    link.close()


def mutated_headers(s: Session) -> None:
    """A valid request whose header has one field mutated."""
    link = s.open("header-fields")
    if link is None:
        return
    method, body = s.valid()
    fields = dict(
        method=method, body=body, request_id=s.request_id(), deadline_ms=0, magic=MAGIC,
        length=None, status=0, retry_after_ms=0,
    )  # fmt: skip
    which = s.rng.choice(["magic", "length", "request_id", "deadline_ms", "method", "status"])
    r = s.rng
    if which == "magic":
        fields["magic"] = r.choice([0, MAGIC ^ 1 << r.randrange(32), r.getrandbits(32)])
    elif which == "length":
        short = r.random() < 0.5
        fields["length"] = r.choice(
            [0, 1, len(body) - 1, len(body) + 1, 1 << 20, 1 << 30, (1 << 32) - 1, r.getrandbits(32)]
        )
        if short:  # a huge announced length, a short body, then the connection closes
            fields["body"] = body[: r.randint(0, len(body))]
    elif which == "request_id":
        fields["request_id"] = r.choice([0, (1 << 64) - 1, r.getrandbits(64)])
    elif which == "deadline_ms":
        fields["deadline_ms"] = r.choice([1, (1 << 32) - 1, r.getrandbits(32)])
    elif which == "method":
        fields["method"] = r.choice([HELLO, 6, 7, 127, 255, r.getrandbits(8)])
    else:
        fields["status"], fields["retry_after_ms"] = r.getrandbits(8), r.getrandbits(16)
    data = frame(**fields)  # type: ignore[arg-type]
    link.send(data)
    if fields["length"] is not None and fields["length"] > len(fields["body"]):
        link.answers(0.05)
        if r.random() < 0.5:  # or it waits, half sent, until the end of the phase
            s.held.append((time.monotonic() + r.uniform(0, s.hold_seconds), link, b""))
            return
    else:
        link.answers(1.0, want=1)
    link.close()


def mutate_bytes(rng: random.Random, body: bytes) -> bytes:
    data = bytearray(body)
    for _ in range(rng.randint(1, 8)):
        choice = rng.randrange(5)
        if choice == 0 and data:  # a bit flip
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif choice == 1 and data:  # a byte set
            data[rng.randrange(len(data))] = rng.choice([0, 0x7F, 0x80, 0xFF, rng.randrange(256)])
        elif choice == 2:  # cut
            data = data[: rng.randint(0, len(data))]
        elif choice == 3:  # extended
            data += rng.randbytes(rng.randint(1, 64))
        elif data:  # a slice repeated
            start = rng.randrange(len(data))
            data[start:start] = data[start : start + rng.randint(1, 32)]
    return bytes(data)


def mutated_bodies(s: Session) -> None:
    """Valid bodies with bytes flipped, set, cut, extended or repeated; a few per
    connection."""
    link = s.open("body-bytes")
    if link is None:
        return
    for _ in range(s.rng.randint(1, 8)):
        method, body = s.valid()
        link.send(frame(method, mutate_bytes(s.rng, body), s.request_id()))
        if not link.answers(1.0, want=1):
            break
    link.close()


def mutate_fields(rng: random.Random, body: bytes, depth: int = 0) -> bytes:
    """One protobuf field-level mutation, at the top level or inside a nested message."""
    fields = pb_fields(body)
    if not fields:
        return mutate_bytes(rng, body)
    at = rng.randrange(len(fields))
    number, wire_type, raw = fields[at]
    nested = pb_fields(raw) if wire_type == 2 else None
    if nested and depth < 3 and rng.random() < 0.5:
        fields[at] = (number, 2, mutate_fields(rng, raw, depth + 1))
        return pb_join(fields)
    choice = rng.randrange(6)
    if choice == 0:  # the wrong wire type for the field
        other = rng.choice([t for t in (0, 1, 2, 5) if t != wire_type])
        value = raw if other != 0 else rng.getrandbits(rng.choice([7, 32, 64]))
        replacement = pb_field(number, other, value)
        return pb_join(fields[:at]) + replacement + pb_join(fields[at + 1 :])
    if choice == 1:  # a huge length prefix over a short value
        huge = rng.choice([1 << 31, (1 << 32) - 1, (1 << 63) - 1, len(raw) + 1])
        cut = varint(number << 3 | 2) + varint(huge) + raw[: rng.randint(0, len(raw))]
        return pb_join(fields[:at]) + cut
    if choice == 2:  # an extreme varint (also one longer than 10 bytes)
        value = rng.choice([(1 << 64) - 1, 1 << 63, (1 << 31) - 1, 1 << 31, 1 << 70])
        replacement = varint(number << 3) + varint(value)
        return pb_join(fields[:at]) + replacement + pb_join(fields[at + 1 :])
    if choice == 3:  # the field repeated
        return pb_join(fields[: at + 1] + [fields[at]] * rng.randint(1, 50) + fields[at + 1 :])
    if choice == 4:  # an unknown field
        unknown = pb_field(rng.randint(16, 1 << 28), rng.choice([0, 2]), rng.randbytes(8))
        return pb_join(fields) + unknown
    return pb_join(fields[:at] + fields[at + 1 :])  # the field dropped


def absurd_keys(rng: random.Random) -> tuple[bytes, int, int]:
    """(keys bytes, key encoding, number of keys meant): delta varints, cut or overlong,
    or many keys."""
    choice = rng.randrange(6)
    if choice == 0:  # many delta-encoded keys in a few bytes each (bounded ids)
        n = rng.choice([1000, 20000, 100000])
        return varint(2) + b"\x02" * (n - 1), 1, n
    if choice == 1:  # a varint that never ends
        return b"\x02\x04" + b"\xff" * rng.randint(1, 20), 1, 3
    if choice == 2:  # extreme keys, delta-encoded
        keys = np.array([0, -(1 << 63), (1 << 63) - 1, -1, 1], "<i8")
        return delta_keys(keys), 1, len(keys)
    if choice == 3:  # raw keys whose length is not a multiple of 8
        return rng.randbytes(rng.choice([1, 7, 9, 15])), 0, 1
    if choice == 4:  # an unknown encoding
        return rng.randbytes(16), rng.choice([2, 99, (1 << 31) - 1]), 2
    n = rng.randint(1, 64)
    return np.asarray([rng.getrandbits(63) for _ in range(n)], "<i8").tobytes(), 0, n


def absurd_gradients(rng: random.Random, n: int) -> tuple[bytes, int, int]:
    """(gradient bytes, encoding, exponent) for `n` keys: NaN and Inf, absurd dims,
    16-bit encodings cut short, extreme exponents."""
    dim = rng.choice([FUZZ_DIM, FUZZ_DIM, 0, 1, 3, 1000])
    n = min(n, 200000 // max(dim, 1))
    values = np.full(n * dim, rng.choice([np.nan, np.inf, -np.inf, 1e38, 0.0]), "<f4")
    encoding = rng.choice([0, 0, 1, 2, 7])
    data = values.tobytes()
    if encoding in (1, 2):
        data = data[: len(data) // 2 - rng.choice([0, 1])]
    return data, encoding, rng.choice([0, 0, 127, -128, (1 << 31) - 1, -(1 << 31)])


def protobuf_fields(s: Session) -> None:
    """Requests made with absurd field values, or valid ones with one protobuf field
    mutated."""
    link = s.open("protobuf-fields")
    if link is None:
        return
    r = s.rng
    for _ in range(r.randint(1, 4)):
        if r.random() < 0.5:
            method, body = s.valid()
            body = mutate_fields(r, body)
        else:
            method, body = absurd_request(r)
        link.send(frame(method, body, s.request_id()))
        if not link.answers(1.0, want=1):  # (a pull for a later step may wait)
            break
    link.close()


def absurd_request(r: random.Random) -> tuple[int, bytes]:
    keys, key_encoding, n = absurd_keys(r)
    table = r.choice([FUZZ_TABLE, FUZZ_TABLE, "", "no-such-table", "t" * 70000])
    method = r.choice([PULL, PUSH, PULL_RANGES, PUSH_RANGES])
    many = n < 1000  # many tables or parts only of few keys: the request stays < 2 MB
    extremes = [0, -1, 1 << 31, -(1 << 31), (1 << 62), r.getrandbits(31)]
    if method in (PULL, PULL_RANGES):
        entry = ps_pb2.TableKeys(table=table, keys=keys, key_encoding=key_encoding)
        pull = ps_pb2.PullRequest(
            worker=r.choice([0, 0, -1, (1 << 31) - 1]),
            step=r.choice([1, 2, *extremes]),
            train=key_encoding == 1 and r.random() < 0.5,  # ids bounded: inserts bounded
            encoding=r.choice([0, 1, 2, 9]),
            timeout_ms=r.choice([0, 100, -1]),
            tables=[entry] * r.choice([1, 1, 2, 100] if many else [1]),
            range=r.choice([0, 0, -1, 1 << 20]),
        )
        if method == PULL:
            return method, pull.SerializeToString()
        return method, ps_pb2.PullRangesRequest(
            parts=[pull] * r.choice([0, 1, 3, 300] if many else [0, 1])
        ).SerializeToString()
    gradients, encoding, exponent = absurd_gradients(r, n)
    grad_entry = ps_pb2.TableGradients(
        table=table,
        keys=keys,
        gradients=gradients,
        gradient_exponent=exponent,
        key_encoding=key_encoding,
    )
    push = ps_pb2.PushRequest(
        worker=r.choice([0, 0, -1, (1 << 31) - 1]),
        step=r.choice([1, 2, *extremes]),
        encoding=encoding,
        tables=[grad_entry] * r.choice([1, 1, 2, 50] if many else [1]),
    )
    if method == PUSH:
        return method, push.SerializeToString()
    return method, ps_pb2.PushRangesRequest(parts=[push] * r.choice([0, 1, 3])).SerializeToString()


def truncated(s: Session) -> None:
    """A frame cut mid-header or mid-body, then the connection closed or half-closed."""
    link = s.open("truncated")
    if link is None:
        return
    method, body = s.valid()
    data = frame(method, body, s.request_id())
    link.send(data[: s.rng.randrange(1, len(data))])
    if s.rng.random() < 0.5:
        with contextlib.suppress(OSError):
            link.sock.shutdown(socket.SHUT_WR)
        link.answers(0.2)
    link.close()


def pipelined(s: Session) -> None:
    """Many frames in one write: valid ones and mutated ones, answered in any order."""
    link = s.open("pipelined")
    if link is None:
        return
    count = s.rng.choice([10, 50, 200, 500])
    data, sent = bytearray(), {}
    for _ in range(count):
        method, body = s.valid()
        if s.rng.random() < 0.3:
            body = mutate_bytes(s.rng, body)
        one = frame(method, body, s.request_id())
        sent[HEADER.unpack_from(one)[2]] = one
        data += one
    link.send(bytes(data), frames=count)
    link.sent.update(sent)  # (each answer is blamed on its own frame)
    link.answers(10.0, want=count)
    link.close()


def slowloris(s: Session) -> None:
    """Connections that send their hello or a frame a byte at a time, held half-open
    (trickled by Session.trickle) for up to `hold_seconds`."""
    for _ in range(s.rng.randint(1, 20)):
        try:
            link = Link(s, "slowloris")
        except OSError:
            return
        token = s.token()
        body = token.encode() if isinstance(token, str) else token or b""
        rest = frame(HELLO, body, request_id=0)
        if s.phase == "worker" and s.rng.random() < 0.5:
            if link.hello(token) != OK:
                link.close()
                continue
            method, request = s.valid()
            rest = frame(method, request, s.request_id())
        s.count_frames("slowloris", 1)
        until = time.monotonic() + s.rng.uniform(0.1, s.hold_seconds)
        s.held.append((until, link, rest[: s.rng.randint(0, len(rest))]))


def flood(s: Session, count: int | None = None) -> None:
    """Hundreds of connections at once: some silent, some with a hello, some with half a
    header; all closed together."""
    count = count or s.rng.randint(100, 400)
    links = []
    for _ in range(count):
        try:
            link = Link(s, "flood")
        except OSError:
            break
        choice = s.rng.randrange(3)
        if choice == 1:
            token = s.token()
            link.send(frame(HELLO, token.encode() if isinstance(token, str) else token or b"", 0))
        elif choice == 2:
            link.send(frame(HELLO, b"")[: s.rng.randrange(1, HEADER.size)])
        links.append(link)
    time.sleep(0.2)
    for link in links:
        link.close()


def limit_flood(s: Session) -> None:
    """More connections than the server's limit (MAX_CONNECTIONS), held for a second."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MAX_CONNECTIONS + 200
    if soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, wanted + 500), hard))
    flood(s, count=wanted)


def tokens(s: Session) -> None:
    """Hellos with no token, a wrong one, one above the hello limit, twice; a request
    before any hello; a worker's Replicate."""
    link = s.open("tokens", hello=False)
    if link is None:
        return
    r = s.rng
    choice = r.randrange(5)
    if choice == 0 and s.phase == "outsider":
        link.hello(r.choice([None, "", "guess", "\0", "x" * 65536, "x" * 65537, b"\xff" * 300]))
    elif choice == 1:  # a huge announced hello body
        link.send(frame(HELLO, b"x" * 100, request_id=0, length=r.choice([1 << 20, 1 << 31])))
        link.answers(0.3)
    elif choice == 2:  # a request first
        method, body = s.valid()
        link.send(frame(method, body, s.request_id()))
        link.answers(1.0, want=1)
    elif choice == 3:  # two hellos
        status = link.hello(s.token())
        if status == OK:
            link.hello(s.token())
    else:  # a worker (or an outsider) sending a replica's change
        status = link.hello(s.token())
        if s.phase == "outsider" or status == OK:
            change = s.corpus.replicate(r).SerializeToString()
            link.send(frame(REPLICATE, change, s.request_id()))
            link.answers(2.0, want=1)
    link.close()


def outsider_replicate(s: Session) -> None:
    """Replicate frames as the server's primary would send them (its group, epoch, next
    sequence, an address), changing the reference rows: nothing may apply."""
    link = s.open("outsider-replicate")
    if link is None:
        return
    for _ in range(s.rng.randint(1, 5)):
        change = s.corpus.replicate(s.rng).SerializeToString()
        link.send(frame(REPLICATE, change, s.request_id()))
        if not link.answers(1.0, want=1):
            break
    link.close()


FAMILIES: dict[str, tuple[Callable[[Session], None], float]] = {  # weight: how often drawn
    "random-bytes": (random_bytes, 3),
    "header-fields": (mutated_headers, 4),
    "body-bytes": (mutated_bodies, 6),
    "protobuf-fields": (protobuf_fields, 6),
    "truncated": (truncated, 2),
    "pipelined": (pipelined, 1),
    "slowloris": (slowloris, 1),
    "flood": (flood, 0.2),
    "tokens": (tokens, 2),
    "outsider-replicate": (outsider_replicate, 2),
}


# ---------------------------------------------------------------------------------------------
# The run: phases, the monitor, the end checks


class Monitor:
    """Checks the server while a phase runs: alive and answering Health, RSS within its
    bound, no sanitizer report, and the reference rows (every `rows_every` seconds)."""

    def __init__(
        self, target: Target, tally: Tally, max_growth: int, expected_rows: bytes, rows_every: float
    ) -> None:
        self.target, self.tally, self.max_growth = target, tally, max_growth
        self.expected_rows, self.rows_every = expected_rows, rows_every
        self.phase = ""
        self.stopped = threading.Event()
        self.reported: set[str] = set()
        self.scanned = 0
        self.connection: list = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Monitor:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(30)

    def once(self, rows: bool) -> None:
        """Every check, once (and each failing one reported once per phase)."""
        target, tally = self.target, self.tally
        if not target.alive():
            code = target.process.returncode if target.process else None
            self._report("alive", f"the server exited ({code})")
            return
        try:
            if not target.health().serving:
                self._report("alive", "Health says not serving")
        except Exception as e:  # grpc.RpcError and transport errors
            self._report("alive", f"Health failed: {str(e)[:300]}")
        rss = target.rss()
        with tally.lock:
            tally.peak_rss = max(tally.peak_rss, rss)
        if tally.base_rss and rss > tally.base_rss + self.max_growth:
            growth = (rss - tally.base_rss) >> 20
            self._report(
                "memory", f"RSS grew {growth} MiB, over the bound of {self.max_growth >> 20}"
            )
        self.scan_output()
        if rows:
            try:
                now = reference_rows(target, self.connection)
                if now != self.expected_rows:
                    self._report("rows", "the reference rows changed")
            except RuntimeError as e:
                self._report("rows", f"the reference pull failed: {e}")

    def scan_output(self) -> None:
        lines = self.target.output
        end = len(lines)
        for at in range(self.scanned, end):
            if any(mark in lines[at] for mark in SANITIZER_MARKS):
                report = "".join(lines[at : at + 30])
                self._report("sanitizer", report[:4000], key=lines[at])
        self.scanned = end

    def _report(self, invariant: str, detail: str, key: str | None = None) -> None:
        key = f"{self.phase}|{invariant}|{key or ''}"
        if key not in self.reported:
            self.reported.add(key)
            self.tally.add(Finding(invariant, "", self.phase, detail))

    def _run(self) -> None:
        last_rows = time.monotonic()
        while not self.stopped.wait(0.5):
            rows = time.monotonic() - last_rows >= self.rows_every
            self.once(rows)
            if rows:
                last_rows = time.monotonic()


@dataclass
class Options:
    seconds: float = 20.0
    seed: int = 1
    phases: tuple[str, ...] = ("outsider", "worker")
    max_rss_growth_mb: int = 512
    hold_seconds: float = 3.0
    rows_every: float = 2.0
    limit_flood: bool = False
    families: tuple[str, ...] = tuple(FAMILIES)


def run(target: Target, options: Options, log: Callable[[str], None] = print) -> Tally:
    """Attacks `target` for options.seconds (split over the phases) and checks it; the
    tally holds the counts and every finding."""
    rng = random.Random(options.seed)
    tally = Tally()
    prepare(target)
    corpus = Corpus.make(target, rng)
    monitor_connection: list = []
    expected = reference_rows(target, monitor_connection)
    tally.base_rss = tally.peak_rss = target.rss()
    monitor = Monitor(target, tally, options.max_rss_growth_mb << 20, expected, options.rows_every)
    monitor.connection = monitor_connection
    monitor.start()
    names = list(options.families)
    weights = [FAMILIES[name][1] for name in names]
    try:
        for phase in options.phases:
            monitor.phase = phase
            before = exported(target) if phase == "outsider" else None
            session = Session(target, corpus, tally, phase, rng, options.hold_seconds)
            end = time.monotonic() + options.seconds / len(options.phases)
            if options.limit_flood:
                limit_flood(session)
            while time.monotonic() < end and target.alive():
                name = rng.choices(names, weights)[0]
                try:
                    FAMILIES[name][0](session)
                except (OSError, ssl.SSLError):
                    pass  # the server closed a connection under our feet: what it may do
                session.trickle()
            session.release()
            time.sleep(0.5)
            monitor.once(rows=True)
            if before is not None and target.alive():
                if exported(target) != before:
                    detail = "the tables' rows, state or step count changed"
                    tally.add(Finding("rows", "", phase, detail))
            log(f"phase {phase}: done, findings so far: {len(tally.findings)}")
    finally:
        monitor.stop()
    monitor.once(rows=target.alive())
    return tally


def summary(tally: Tally, seconds: float) -> str:
    names = sorted(set(tally.frames) | set(tally.connections))
    lines = [
        "| family | connections | frames | answers by status |",
        "| --- | ---: | ---: | --- |",
    ]
    for name in names:
        statuses = tally.statuses.get(name, collections.Counter())
        shown = ", ".join(f"{code}: {n}" for code, n in sorted(statuses.items())) or "-"
        lines.append(f"| {name} | {tally.connections[name]} | {tally.frames[name]} | {shown} |")
    total_c, total_f = sum(tally.connections.values()), sum(tally.frames.values())
    lines.append(f"| **all** | {total_c} | {total_f} | |")
    lines.append("")
    lines.append(
        f"{seconds / 60:.1f} min; server RSS {tally.base_rss >> 20} MiB before, "
        f"peak {tally.peak_rss >> 20} MiB; findings: {len(tally.findings)}"
    )
    lines += [finding.describe() for finding in tally.findings]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=120.0, help="attack time, over all phases")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--phases", default="outsider,worker")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--tls", action="store_true", help="a TLS server (its data port is TLS)")
    p.add_argument("--sanitized", action="store_true", help="preload ASan/UBSan in the server")
    p.add_argument("--server-pythonpath", help="PYTHONPATH of the server (a sanitized tree)")
    p.add_argument("--max-message-bytes", help="the server's --max-message-bytes")
    p.add_argument(
        "--max-rss-growth-mb", type=int, default=None, help="default 512 (1536 sanitized)"
    )
    p.add_argument("--hold-seconds", type=float, default=3.0, help="longest half-open hold")
    p.add_argument(
        "--limit-flood", action="store_true", help=f"{MAX_CONNECTIONS}+ connections per phase"
    )
    p.add_argument("--target", help="HOST:PORT (gRPC) of a server started by hand")
    p.add_argument("--admin-token", help="with --target")
    p.add_argument("--worker-token", help="with --target")
    p.add_argument("--pid", type=int, help="with --target: its process, for RSS")
    args = p.parse_args()
    options = Options(
        seconds=args.seconds,
        seed=args.seed,
        phases=tuple(args.phases.split(",")),
        max_rss_growth_mb=args.max_rss_growth_mb or (1536 if args.sanitized else 512),
        hold_seconds=args.hold_seconds,
        limit_flood=args.limit_flood,
        families=tuple(args.families.split(",")),
    )
    directory = Path(tempfile.mkdtemp(prefix="fuzz-data-port-"))
    extra = ("--max-message-bytes", args.max_message_bytes) if args.max_message_bytes else ()
    if args.target:
        target = Target(args.target, args.admin_token, args.worker_token, pid=args.pid)
    else:
        target = start_server(directory, args.sanitized, args.server_pythonpath, args.tls, extra)
    started = time.monotonic()
    print(f"fuzzing {target.address} (data port {target.data_port}), seed {args.seed}", flush=True)
    try:
        tally = run(target, options)
    finally:
        if target.process is not None:
            code = stop_server(target.process)
            print(f"server exit status {code}")
        shutil.rmtree(directory, ignore_errors=True)
    print(f"\nmachine: {os.cpu_count()} cores; tls: {args.tls}; sanitized: {args.sanitized}\n")
    print(summary(tally, time.monotonic() - started))
    sys.exit(1 if tally.findings else 0)


@contextlib.contextmanager
def fuzzed_server(directory: Path, **kwargs: object) -> Iterator[Target]:
    """A server started for fuzzing, always stopped."""
    target = start_server(directory, **kwargs)  # type: ignore[arg-type]
    try:
        yield target
    finally:
        assert target.process is not None
        stop_server(target.process)


if __name__ == "__main__":
    main()
