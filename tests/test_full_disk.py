"""A disk that fills during a save: the save fails with an error that names the checkpoint
and the cause, leaves nothing of itself behind (the disk is not left full), the checkpoint
saved there before stays loadable with its rows, and a server that was saving keeps
serving. The disk is a real tmpfs of 2 MiB mounted by the test (skipped where this
process may not mount)."""

from __future__ import annotations

import subprocess

import grpc
import numpy as np
import pytest
from _cluster import shards

import elastic_emb as ee
from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.ps.wire import protocol

DIM = 16
FITS, FILLS = 1_000, 40_000  # rows: ~200 KB of Adagrad state fit in 2 MiB, ~5 MB do not


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs, unmounted after the test."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_save_that_fills_the_disk_fails_clearly_and_keeps_the_last_checkpoint(small_disk):
    directory = small_disk / "ckpt"
    table = ee.Table(DIM, ee.optimizers.Adagrad(0.1), name="full_disk_local")
    table.pull(np.arange(FITS), train=True)
    table.push(np.arange(FITS), np.full((FITS, DIM), 0.5, np.float32))
    ee.save(directory, tables=[table])
    saved = table.pull(np.arange(FITS))
    files = sorted(p.name for p in directory.iterdir())

    table.pull(np.arange(FITS, FILLS), train=True)
    with pytest.raises(OSError, match="No space left on device") as info:
        ee.save(directory, tables=[table])
    message = str(info.value)
    assert f"cannot save the checkpoint in {directory}" in message, message
    assert "what was saved there before is unchanged" in message, message
    assert sorted(p.name for p in directory.iterdir()) == files  # nothing of it left

    restored = ee.Table(DIM, ee.optimizers.Adagrad(0.1), name="full_disk_local")
    ee.restore(directory, tables=[restored])
    assert len(restored) == FITS
    np.testing.assert_array_equal(restored.pull(np.arange(FITS)), saved)


def test_a_server_whose_disk_fills_refuses_the_save_and_keeps_serving(small_disk):
    directory = small_disk / "ckpt"
    with shards(1) as (ps,):
        stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(ps.address))
        config = ee.Table(DIM, ee.optimizers.Adagrad(0.1), name="full_disk").config()
        spec = ps_pb2.TableSpec(name="full_disk", config_json=protocol.json.dumps(config))
        stub.CreateTables(ps_pb2.CreateTablesRequest(tables=[spec]), timeout=10)

        def fill(n: int) -> None:
            rows = np.full((n, DIM), 0.25, np.float32)
            stub.ImportRows(protocol.import_rows_request("full_disk", np.arange(n), rows))

        fill(FITS)
        stub.Save(ps_pb2.SaveRequest(directory=str(directory)), timeout=30)
        fill(FILLS)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Save(ps_pb2.SaveRequest(directory=str(directory)), timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = refused.value.details()
        assert f"cannot save the checkpoint in {directory}" in details, details
        assert "No space left on device" in details, details
        assert "Traceback" not in "".join(ps.output)
        assert stub.Health(ps_pb2.HealthRequest(), timeout=10).serving
        exported = stub.ExportRows(ps_pb2.ExportRowsRequest(table="full_disk"), timeout=30)
        assert len(exported.keys) == 8 * FILLS  # (still serving every row)

    restored = ee.Table(DIM, ee.optimizers.Adagrad(0.1), name="full_disk")
    ee.restore(directory, tables=[restored])
    assert len(restored) == FITS
    np.testing.assert_array_equal(
        restored.pull(np.arange(FITS)), np.full((FITS, DIM), 0.25, np.float32)
    )


def test_a_save_that_fails_after_its_manifest_is_in_place_keeps_its_files(tmp_path, monkeypatch):
    """The manifest is the commit point: a failure after its rename (the directory's
    sync) leaves the new checkpoint whole, its files kept, rather than half removed."""
    from elastic_emb.persistence import files

    directory = tmp_path / "ckpt"
    table = ee.Table(DIM, ee.optimizers.Adagrad(0.1), name="full_disk_commit")
    table.pull(np.arange(10), train=True)
    ee.save(directory, tables=[table])
    table.push(np.arange(10), np.full((10, DIM), 0.5, np.float32))
    pushed = table.pull(np.arange(10))

    def fails(path):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(files, "fsync_directory", fails)
    with pytest.raises(OSError, match="Input/output error"):
        ee.save(directory, tables=[table])
    monkeypatch.undo()
    restored = ee.Table(DIM, ee.optimizers.Adagrad(0.1), name="full_disk_commit")
    ee.restore(directory, tables=[restored])
    np.testing.assert_array_equal(restored.pull(np.arange(10)), pushed)
