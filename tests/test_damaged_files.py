"""Damaged and missing checkpoint files are refused with an error naming the file, and never
load wrong rows: a full checkpoint, the base and a delta of an incremental one, and their
manifests, each truncated, with one bit flipped, or missing.

In process, every single-bit flip of a manifest is tried: each is refused, or restores
exactly what was saved (a flip in the name of the manifest's own checksum leaves it one of
an older release, whose content is intact). On a real `elastic-emb serve`, the Restore RPC
of each damaged file is refused with FAILED_PRECONDITION naming it, and the server goes on
serving its rows unchanged; nothing is restored partly (not a first table before a second
one's bad configuration, not this process's tables before a shard refuses).

The independent reference for "no wrong rows" is the state exported before the damaged
load (after the save, the tables are changed again so that a load would show): it must be
bit-identical after the refusal (and, where a flipped manifest is accepted, the state
exported at the save). What test_checkpoint.py and test_incremental_checkpoint.py already
damage in process (a full checkpoint's data file and manifest, each link of a chain
flipped, a delta truncated or missing) is not repeated here.
"""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path

import grpc
import numpy as np
import pytest
from _cluster import shards
from _states import assert_same_state, sorted_state

import elastic_emb as ee
from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.persistence.checkpoint import CheckpointError
from elastic_emb.ps.wire import protocol
from elastic_emb.tables.registry import registered_tables

DIM = 2


def _manifest(directory: Path) -> dict:
    return json.loads((directory / "manifest.json").read_text())


def _file_of(directory: Path, kind: str) -> Path:
    """The file of `kind` (full data, base, delta, manifest) in the checkpoint in `directory`."""
    if kind == "manifest":
        return directory / "manifest.json"
    (entry,) = _manifest(directory)["tables"].values()
    if kind == "full data":
        return directory / entry["file"]
    return directory / entry["links"][{"base": 0, "delta": -1}[kind]]["file"]


def _flip(raw: bytes, at: int, bit: int) -> bytes:
    return raw[:at] + bytes([raw[at] ^ bit]) + raw[at + 1 :]


def _damage(path: Path, damage: str) -> None:
    """Truncates `path` by a byte, removes it, or flips one bit: in the middle of a data
    file; in a manifest, the low bit of the first digit of the field named after "flipped"
    (`iterations` by default), which leaves valid JSON with another number, or with
    "flipped key", the low bit of the key's last letter (another key)."""
    raw = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(raw[:-1])
    elif damage == "missing":
        path.unlink()
    elif damage.startswith("flipped key "):
        key = b'"%s"' % damage.removeprefix("flipped key ").encode()
        path.write_bytes(_flip(raw, raw.index(key) + len(key) - 2, 0x01))
    elif path.name == "manifest.json":
        field = b'"%s": ' % (damage.removeprefix("flipped").strip() or "iterations").encode()
        path.write_bytes(_flip(raw, raw.index(field) + len(field), 0x01))
    else:
        path.write_bytes(_flip(raw, len(raw) // 2, 0x10))


def _without_checksum(directory: Path) -> None:
    """Makes the manifest one of a release before manifest checksums (same content)."""
    manifest = _manifest(directory)
    manifest.pop("manifest_sha256")
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))


def _names(message: str, path: Path) -> bool:
    """Whether `message` names the file at `path` (its path, or its directory and name)."""
    return str(path) in message or (str(path.parent) in message and path.name in message)


def _table(name: str) -> ee.Table:
    return ee.Table(DIM, ee.optimizers.Adam(0.05), name=name, seed=4)


def _train(table: ee.Table, keys: np.ndarray, scale: float) -> None:
    table.push(keys, np.full((len(keys), DIM), scale, np.float32))


def _state(table: ee.Table) -> dict[str, np.ndarray]:
    return sorted_state(table.export_state())


# In process.


def _saved(directory: Path, name: str, kind: str) -> tuple[ee.Table, dict[str, np.ndarray]]:
    """A table saved in `directory` as `kind` (full: one save; chain: a base and a delta),
    then changed, so that a load would show; and its state when saved."""
    table = _table(name)
    _train(table, np.arange(20), 0.5)
    ee.save(directory, tables=[table], incremental=kind == "chain")
    if kind == "chain":
        _train(table, np.arange(10, 30), -0.25)
        ee.save(directory, tables=[table], incremental=True)
        assert [link["kind"] for link in _manifest(directory)["tables"][name]["links"]] == [
            "base",
            "delta",
        ]
    saved = _state(table)
    _train(table, np.arange(5, 40), 1.0)
    return table, saved


@pytest.mark.parametrize(
    ("kind", "target", "damage"),
    [
        ("full", "manifest", "flipped"),
        ("chain", "manifest", "flipped"),
        ("chain", "manifest", "truncated"),
        ("chain", "manifest", "missing"),
        ("chain", "base", "truncated"),
        ("chain", "base", "missing"),
        # Without a checksum of its own, a manifest is checked against its data files.
        ("full", "legacy manifest", "flipped num_rows"),
        ("chain", "legacy manifest", "flipped num_rows"),
        ("chain", "legacy manifest", "flipped iterations"),
        ("full", "legacy manifest", "flipped key sha256"),
    ],
)
def test_a_damaged_file_is_refused_by_name_and_changes_nothing(tmp_path, kind, target, damage):
    table, _ = _saved(tmp_path, f"damaged_{kind}_{target}_{damage}".replace(" ", "_"), kind)
    if target == "legacy manifest":
        _without_checksum(tmp_path)
    path = _file_of(tmp_path, target.removeprefix("legacy "))
    before = _state(table)
    _damage(path, damage)
    with pytest.raises(CheckpointError) as refused:
        ee.restore(tmp_path, tables=[table])
    assert _names(str(refused.value), path), str(refused.value)
    assert_same_state(_state(table), before)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["full", "chain"])
def test_every_bit_flip_of_a_manifest_is_refused_or_restores_what_was_saved(tmp_path, kind):
    name = f"flipped_manifest_{kind}"
    saved = tmp_path / "saved"
    table, state = _saved(saved, name, kind)
    reference = (table.config(), state)
    del table  # each restore creates the table from the manifest
    gc.collect()
    raw = (saved / "manifest.json").read_bytes()
    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    refused = 0
    for i in range(len(raw) * 8):
        flipped = bytearray(raw)
        flipped[i // 8] ^= 1 << (i % 8)
        (copy / "manifest.json").write_bytes(bytes(flipped))
        try:
            restored = ee.restore(copy)
        except CheckpointError as e:
            assert str(copy / "manifest.json") in str(e), str(e)
            assert name not in registered_tables()  # none was created
            refused += 1
            continue
        assert list(restored) == [name], (i, list(restored))
        assert restored[name].config() == reference[0], i
        assert_same_state(_state(restored[name]), reference[1])
        del restored
        gc.collect()
    assert refused > 0.9 * len(raw) * 8  # (the rest: flips in the checksum's own name)


# On a server.


@pytest.fixture(scope="module")
def server():
    """One `elastic-emb serve` and a stub to it."""
    with shards(1) as (ps,):
        channel = grpc.insecure_channel(ps.address)
        yield ps, ps_pb2_grpc.ParameterServerStub(channel)
        channel.close()


def _import(stub, name: str, keys: np.ndarray, value: float) -> None:
    rows = np.full((len(keys), DIM), value, np.float32)
    stub.ImportRows(protocol.import_rows_request(name, keys, rows), timeout=10)


def _exported(stub, name: str) -> bytes:
    request = ps_pb2.ExportRowsRequest(table=name, with_state=True)
    return stub.ExportRows(request, timeout=10).SerializeToString()


def _create(stub, names: list[str]) -> None:
    specs = [ps_pb2.TableSpec(name=n, config_json=json.dumps(_table(n).config())) for n in names]
    stub.CreateTables(ps_pb2.CreateTablesRequest(tables=specs), timeout=10)


def _restore(stub, directory: Path, names: list[str]) -> grpc.RpcError:
    request = ps_pb2.RestoreRequest(
        directories=[str(directory)], tables=names, num_shards=1, shard_index=0
    )
    with pytest.raises(grpc.RpcError) as refused:
        stub.Restore(request, timeout=30)
    return refused.value


def _still_serving(ps, stub, rows: dict[str, bytes]) -> None:
    assert ps.process.poll() is None
    assert stub.Health(ps_pb2.HealthRequest(), timeout=10).serving
    for name, exported in rows.items():
        assert _exported(stub, name) == exported, name
    assert "Traceback" not in "".join(ps.output)


@pytest.mark.parametrize("damage", ["truncated", "flipped", "missing"])
@pytest.mark.parametrize("target", ["full data", "base", "delta", "manifest", "chain manifest"])
def test_a_server_refuses_a_damaged_file_by_name_and_keeps_serving(
    server, tmp_path, target, damage
):
    ps, stub = server
    name = f"served_{target.replace(' ', '_')}_{damage}"
    incremental = target in ("base", "delta", "chain manifest")
    _create(stub, [name])
    _import(stub, name, np.arange(30), 0.5)
    stub.Save(protocol.save_request(str(tmp_path), [name], incremental), timeout=30)
    if incremental:
        _import(stub, name, np.arange(10, 20), -0.25)
        stub.Save(protocol.save_request(str(tmp_path), [name], incremental, 5), timeout=30)
        links = _manifest(tmp_path)["tables"][name]["links"]
        assert [link["kind"] for link in links] == ["base", "delta"]
    _import(stub, name, np.arange(0, 40), 1.0)  # (a load would show)
    rows = _exported(stub, name)
    path = _file_of(tmp_path, "manifest" if "manifest" in target else target)
    _damage(path, damage)
    refused = _restore(stub, tmp_path, [name])
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.details()
    assert _names(refused.details(), path), refused.details()
    _still_serving(ps, stub, {name: rows})


def test_a_server_creates_no_table_and_loads_none_when_one_config_is_bad(server, tmp_path):
    """The tables to create are checked before any table is loaded (the first one was
    loaded before the second one's configuration was refused)."""
    ps, stub = server
    first, second = "bad_config_a", "bad_config_b"  # loaded in this order
    saved = [_table(first), _table(second)]
    for table in saved:
        _train(table, np.arange(15), 0.5)
    ee.save(tmp_path, tables=saved)
    manifest = _manifest(tmp_path)
    manifest.pop("manifest_sha256")  # one of an older release, edited
    manifest["tables"][second]["optimizer"]["class_name"] = "Adadelta"
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    _create(stub, [first])
    _import(stub, first, np.arange(40), 1.0)
    rows = _exported(stub, first)
    refused = _restore(stub, tmp_path, [])
    _still_serving(ps, stub, {first: rows})
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.details()
    assert str(tmp_path) in refused.details() and second in refused.details()
    listed = stub.DescribeTables(ps_pb2.DescribeTablesRequest(), timeout=10)
    assert second not in [t.name for t in listed.tables]


def test_a_shard_that_refuses_a_restore_leaves_this_process_tables_unchanged(server, tmp_path):
    """`ee.restore` of in-process tables beside remote ones: a shard's refusal comes before
    any in-process table changes (they were loaded first)."""
    ps, _ = server
    local = _table("beside_refused")  # created before ee.init: it stays in this process
    gc.collect()
    ee.init(ps=[ps.address], mode="async")
    try:
        remote = _table("remote_refused")
        for table in (local, remote):
            _train(table, np.arange(25), 0.5)
        ee.save(tmp_path)
        for table in (local, remote):
            _train(table, np.arange(10, 50), 1.0)
        before = (_state(local), _state(remote))
        (part,) = _manifest(tmp_path)["parts"][:1]
        path = _file_of(tmp_path / part, "full data")
        _damage(path, "flipped")
        with pytest.raises(CheckpointError) as refused:
            ee.restore(tmp_path)
        assert _names(str(refused.value), path), str(refused.value)
        assert_same_state(_state(local), before[0])
        assert_same_state(_state(remote), before[1])
        del remote
    finally:
        ee.shutdown()
