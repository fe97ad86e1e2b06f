"""The history checker's epochs verdict (tests/_history.py, `check_epochs`) on audit logs
written by `AcknowledgedAudit` from a data plane's counts: it holds for primaries that
hand over in order and names each overlap, and a log edited afterwards is refused."""

from __future__ import annotations

import json

import pytest
from _history import acknowledged_epochs, check_epochs

from elastic_emb import _core
from elastic_emb.ps.server.acknowledged import AcknowledgedAudit
from elastic_emb.ps.server.audit import AuditError, AuditLog


def _log(tmp_path, server: str, changes: list[tuple[int, int, int, int]]):
    """The audit log of `server`, whose plane counted acknowledged changes (group, epoch,
    first, last)."""
    path = tmp_path / f"{server}.jsonl"
    log = AuditLog(path)
    replication = _core.ServerCore().replication
    audit = AcknowledgedAudit(log, replication, server)
    for change in changes:
        replication.count_acknowledged(*change)
    audit.stop()
    log.close()
    return path


def test_primaries_that_hand_over_in_order_pass_and_their_counts_are_exact(tmp_path):
    logs = [
        _log(tmp_path, "a:1", [(0, 1, 1, 1), (0, 1, 2, 4), (1, 1, 1, 1)]),
        _log(tmp_path, "b:1", [(0, 2, 5, 5), (0, 2, 6, 6)]),
        _log(tmp_path, "c:1", [(1, 2, 2, 2)]),  # (another group's sequence)
    ]
    epochs = acknowledged_epochs(logs)
    assert check_epochs(epochs) == []
    counts = {k: [(s, c["changes"], c["first_sequence"], c["last_sequence"])
                  for s, c in v.items()] for k, v in epochs.items()}  # fmt: skip
    assert counts == {
        (0, 1): [("a:1", 4, 1, 4)],
        (0, 2): [("b:1", 2, 5, 6)],
        (1, 1): [("a:1", 1, 1, 1)],
        (1, 2): [("c:1", 1, 2, 2)],
    }
    a = epochs[(0, 1)]["a:1"]
    assert a["first_time"] <= a["last_time"]


def test_overlapping_epochs_are_named(tmp_path):
    logs = [
        _log(tmp_path, "a:1", [(0, 1, 1, 6)]),  # acknowledged change 6 at epoch 1...
        _log(tmp_path, "b:1", [(0, 2, 5, 7)]),  # ...which b:1 numbered 5 at epoch 2
        _log(tmp_path, "c:1", [(0, 2, 8, 8)]),  # and a second primary of epoch 2
    ]
    assert check_epochs(acknowledged_epochs(logs)) == [
        "epoch 2 of group 0: acknowledged by ['b:1', 'c:1']",
        "group 0: a:1 acknowledged change 6 at epoch 1, b:1 change 5 at epoch 2",
    ]


def test_an_edited_log_is_refused(tmp_path):
    path = _log(tmp_path, "a:1", [(0, 1, 1, 9)])
    lines = path.read_text().splitlines()
    record = json.loads(lines[-1])
    record["args"]["last_sequence"] = 3  # (hiding an overlap)
    path.write_text("\n".join([*lines[:-1], json.dumps(record, sort_keys=True)]) + "\n")
    with pytest.raises(AuditError, match="does not match its hash"):
        acknowledged_epochs([path])
