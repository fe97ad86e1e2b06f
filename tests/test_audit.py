"""The servers' audit log (`elastic-emb serve --audit-log FILE`, `elastic-emb audit verify`).

The reference is what the test itself asked the server to do; tampering is
done by hand on the file, as an intruder would.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from _cluster import serve_command, serve_once, shards

import elastic_emb as ee
from elastic_emb._proto import ps_pb2


def _verify(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*serve_command(), "audit", "verify", str(path)], capture_output=True, text=True
    )


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def audited(tmp_path):
    """A log written by a real server: what a worker did, then a refused erase."""
    log = tmp_path / "audit" / "ps0.jsonl"
    with shards(1, ["--audit-log", str(log)]) as (ps,):
        cluster = ee.init(ps=[ps.address], mode="sync")
        try:
            t = ee.Table(4, ee.optimizers.SGD(0.1), name="audited", seed=0)
            t.pull(np.arange(10))
            t.push(np.arange(10), np.ones((10, 4), np.float32))  # training: not audited
            t.import_rows(np.arange(100, 105), np.ones((5, 4), np.float32))
            assert t.erase(np.arange(3)) == 3
            ee.save(tmp_path / "ckpt", tables=[t])
            ee.restore(tmp_path / "ckpt", tables=[t])
            with pytest.raises(ValueError, match="Unknown table"):
                cluster.per_shard("EraseRows", lambda i: ps_pb2.EraseRowsRequest(table="nope"))
        finally:
            ee.shutdown()
    return log


def test_administrative_calls_are_recorded_with_who_what_and_result(audited):
    records = _records(audited)
    calls = [(r["call"], r["result"]) for r in records]
    assert calls == [
        ("Join", "OK"),
        ("CreateTables", "OK"),
        ("ImportRows", "OK"),
        ("EraseRows", "OK"),
        ("Save", "OK"),
        ("Restore", "OK"),
        ("EraseRows", "NOT_FOUND"),
    ]
    assert [r["seq"] for r in records] == list(range(1, 8))
    for r in records:
        assert r["peer"].startswith("ipv4:127.0.0.1:") and r["caller"] == "anonymous"
    imported = records[2]["args"]
    assert imported["table"] == "audited" and imported["keys"] == {"bytes": 5 * 8}  # raw int64
    assert records[1]["args"]["tables"][0]["name"] == "audited"


def test_verify_accepts_the_intact_log(audited):
    done = _verify(audited)
    assert done.returncode == 0, done.stderr
    assert "intact, 7 records" in done.stdout


@pytest.mark.parametrize(
    ("tamper", "problem"),
    [
        (lambda lines: [lines[0].replace('"Join"', '"Leave"'), *lines[1:]], "edited"),
        (lambda lines: [*lines[:3], *lines[4:]], "sequence"),
        (lambda lines: [lines[1], lines[0], *lines[2:]], "sequence"),
        (lambda lines: lines[:-1], "cut off the end"),
        (lambda lines: [*lines[:-1], lines[-1][:40]], "not an audit record"),
    ],
    ids=["edited", "removed", "reordered", "truncated", "torn"],
)
def test_verify_detects_tampering(audited, tamper, problem):
    lines = audited.read_text().splitlines()
    audited.write_text("\n".join(tamper(lines)) + "\n")
    done = _verify(audited)
    assert done.returncode == 1
    assert problem in done.stderr


def test_a_head_one_record_behind_is_a_server_killed_between_two_writes(audited):
    """The record is appended, then the head rewritten: a SIGKILL between the two leaves
    a whole log that a restarted server must still open; two behind is a cut."""
    records = _records(audited)
    head = audited.with_name(audited.name + ".head")
    head.write_text(json.dumps({"seq": 6, "hash": records[5]["hash"]}))
    assert _verify(audited).returncode == 0
    head.write_text(json.dumps({"seq": 5, "hash": records[4]["hash"]}))
    done = _verify(audited)
    assert done.returncode == 1 and "added without the server" in done.stderr


def test_a_restarted_server_extends_its_log_and_refuses_a_broken_one(audited):
    with shards(1, ["--audit-log", str(audited)]) as (ps,):
        ee.init(ps=[ps.address], mode="async")
        ee.shutdown()
    records = _records(audited)
    assert [r["call"] for r in records[7:]] == ["Join"]
    assert records[7]["seq"] == 8 and records[7]["prev"] == records[6]["hash"]
    assert _verify(audited).returncode == 0

    audited.write_text(audited.read_text().replace('"Save"', '"Drop"'))
    done = serve_once("--audit-log", str(audited))
    assert done.returncode == 1
    assert "cannot use the audit log" in done.stdout + done.stderr
