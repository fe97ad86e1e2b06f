"""What a primary acknowledged, per epoch of its group, in its audit log.

A replicated server started with `--audit-log` appends an `Acknowledged` record for each
(group, epoch) in which it acknowledged changes as the primary: how many, their first and
last sequence, and when the first and last were answered (Unix seconds). It writes one each
second while the counts change, and a last one when it stops. Each record holds the totals
so far: the newest record of a (server, group, epoch) is the one that counts.

The history checker (tests/_history.py, `check_epochs`) reads every server's log: no two
servers acknowledged at one epoch of a group, and every change acknowledged at an epoch
comes before, in the group's sequence, every change acknowledged at a later one (the old
primary's acknowledged changes are all in what its successor took over). A server killed
(SIGKILL) loses up to a second of counts: the checker then sees fewer, never false ones.
"""

from __future__ import annotations

import threading
from typing import Any

from elastic_emb.ps.server.audit import AuditLog

__all__ = ["RECORD", "WRITE_SECONDS", "AcknowledgedAudit"]

RECORD = "Acknowledged"  # the audit record's `call`
WRITE_SECONDS = 1.0


class AcknowledgedAudit:
    """Writes a server's acknowledged changes per epoch (`_core.Replication.acknowledged`)
    to its audit log, in a thread, until `stop` (which writes the last counts).

    Args:
        audit: the server's audit log.
        replication: its data plane's `Replication`, which counts the changes of both
            planes.
        address: the server's address in the cluster map.
    """

    def __init__(self, audit: AuditLog, replication: Any, address: str) -> None:
        self._audit, self._replication, self._address = audit, replication, address
        self._written: dict[tuple[int, int], dict[str, Any]] = {}  # the thread's, then stop's
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="ee-acknowledged")
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(WRITE_SECONDS):
            self._write()

    def _write(self) -> None:
        for (group, epoch), counts in sorted(self._replication.acknowledged().items()):
            if self._written.get((group, epoch)) == counts:
                continue
            args = {"group": group, "epoch": epoch, **counts}
            self._audit.record(RECORD, "", self._address, args, "OK")
            self._written[(group, epoch)] = counts

    def stop(self) -> None:
        """Stops the thread and writes what changed since its last record."""
        self._stopped.set()
        self._thread.join()
        self._write()
