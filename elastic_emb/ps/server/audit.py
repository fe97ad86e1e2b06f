"""An append-only, hash-chained audit log of a server's administrative calls.

`elastic-emb serve --audit-log FILE` appends one JSON line per state-changing
administrative call (creating, importing, erasing, saving and restoring
tables; workers joining and leaving, which set the training mode; slot-range
moves): its time, the caller, the peer address, the call, a summary of its
arguments and its result. Pulls and pushes are not audited (they are the
training itself).

Each record holds `seq` (1, 2, ...), `prev` (the previous record's `hash`,
64 zeros for the first) and `hash`: the SHA-256 of `prev` and the record's
canonical JSON without `hash`. Editing, removing or reordering a record
breaks the chain. `FILE.head` holds the last record's `seq` and `hash`,
rewritten atomically after each append, so cutting records off the end is
detected too (a head one record behind is a server killed between the two
writes: the log is whole). `elastic-emb audit verify FILE` checks both (`verify`).

A log that a server reopens is checked first and extended; a broken one
is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["AuditError", "AuditLog", "summary", "verify"]

GENESIS = "0" * 64


class AuditError(ValueError):
    """An audit log that is not intact (names the first problem)."""


def _hash(prev: str, record: dict[str, Any]) -> str:
    body = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256((prev + body).encode()).hexdigest()


def summary(message: Any) -> dict[str, Any]:
    """A protobuf request's fields as JSON-ready values: scalars as they are, bytes
    as their length, nested messages by their fields, lists of scalars whole."""
    out: dict[str, Any] = {}
    for field, value in message.ListFields():
        if isinstance(value, bytes):
            out[field.name] = {"bytes": len(value)}
        elif hasattr(value, "ListFields"):
            out[field.name] = summary(value)
        elif isinstance(value, str | int | float | bool):
            out[field.name] = value
        else:  # repeated
            items = list(value)
            out[field.name] = [summary(v) if hasattr(v, "ListFields") else v for v in items]
    return out


class AuditLog:
    """Appends records to an audit log (see the module docstring). Thread-safe.

    Args:
        path: the log file; created with its directory if missing. An
            existing log is verified, then extended.

    Raises:
        AuditError: the existing log is broken.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        if self.path.exists():
            self._seq, self._prev = verify(self.path)
        else:
            self._seq, self._prev = 0, GENESIS
            _write_head(self.path, 0, GENESIS)
        self._file = open(self.path, "a", encoding="utf-8")

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def record(
        self, call: str, peer: str, caller: str, args: dict[str, Any], result: str
    ) -> dict[str, Any]:
        """Appends one record (flushed and synced before returning); returns it."""
        with self._lock:
            seq = self._seq + 1
            record: dict[str, Any] = {
                "seq": seq,
                "time": time.time(),
                "caller": caller,
                "peer": peer,
                "call": call,
                "args": args,
                "result": result,
                "prev": self._prev,
            }
            record["hash"] = _hash(self._prev, record)
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
            self._seq, self._prev = seq, record["hash"]
            _write_head(self.path, seq, self._prev)
            return record


def _head_path(path: Path) -> Path:
    return path.with_name(path.name + ".head")


def _write_head(path: Path, seq: int, digest: str) -> None:
    head = _head_path(path)
    tmp = head.with_name(head.name + ".tmp")
    tmp.write_text(json.dumps({"seq": seq, "hash": digest}))
    os.replace(tmp, head)


def verify(path: str | os.PathLike[str]) -> tuple[int, str]:
    """Checks an audit log: every record's sequence, link and hash, and that it ends
    where its head file says. Returns (records, the last hash).

    Raises:
        AuditError: naming the first broken record, or a cut or extended end.
    """
    path = Path(path)
    seq, prev = 0, GENESIS
    hashes = [GENESIS]  # of each record so far (a head may be one behind: below)
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            where = f"{path} line {number}"
            try:
                record = json.loads(line)
                claimed = record.pop("hash")
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise AuditError(f"{where} is not an audit record: {e}") from None
            if record.get("seq") != seq + 1:
                raise AuditError(f"{where}: sequence {record.get('seq')!r} after {seq}")
            if record.get("prev") != prev:
                raise AuditError(f"{where}: does not follow the record before it")
            if _hash(prev, record) != claimed:
                raise AuditError(f"{where}: its content does not match its hash (edited)")
            seq, prev = record["seq"], claimed
            hashes.append(claimed)
    head = _head_path(path)
    try:
        expected = json.loads(head.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise AuditError(f"{head} is missing or unreadable: {e}") from None
    # A server killed between appending a record and rewriting the head leaves the head
    # one record behind, at the record before: the log is whole.
    behind = seq >= 1 and (expected.get("seq"), expected.get("hash")) == (seq - 1, hashes[-2])
    if (expected.get("seq"), expected.get("hash")) != (seq, prev) and not behind:
        raise AuditError(
            f"{path} ends at record {seq}, its head {head} at record {expected.get('seq')}: "
            "records were cut off the end (or added without the server)"
        )
    return seq, prev
