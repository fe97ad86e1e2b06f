"""Tests of `ee.save` / `ee.restore`: exact round trips (values, optimizer slots,
iterations, metadata), across processes, replacement semantics, and corrupted
checkpoints that must raise `CheckpointError` and leave every live table as it was.

The right answer is always a twin: the same table trained the same way without
the checkpoint (in this process or in a child process).
"""

from __future__ import annotations

import gc
import inspect
import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest
from _processes import run_python

import elastic_emb as ee
from elastic_emb.persistence.checkpoint import CheckpointError
from elastic_emb.tables.policies import optimizers as eo

_names = itertools.count()


def _name(prefix: str = "c") -> str:
    return f"{prefix}_ckpt_{next(_names)}_{os.getpid()}"


# Deterministic training, shared verbatim with the child processes (by source).


def train(table, seed, pushes=5, key_range=60):
    """Pulls and pushes a seeded sequence of batches with duplicate keys."""
    rng = np.random.default_rng(seed)
    for _ in range(pushes):
        keys = rng.integers(-key_range, key_range, size=40).astype(np.int64)
        table.pull(keys[:10], train=True)
        grads = rng.normal(size=(keys.size, table.dim)).astype(np.float32)
        table.push(keys, grads)


def dump(table, path):
    """Writes every row with slots and metadata, sorted by key, and the step count."""
    st = table.export_state()
    order = np.argsort(st.keys)
    np.savez(
        path,
        keys=st.keys[order],
        values=st.values[order],
        slots=st.slots[order],
        last_step=st.last_step[order],
        update_count=st.update_count[order],
        iterations=np.array(st.iterations),
    )


TRAIN_SRC = "import numpy as np\n\n" + inspect.getsource(train) + "\n" + inspect.getsource(dump)

FIELDS = ("keys", "values", "slots", "last_step", "update_count", "iterations")


def _state(table: ee.Table) -> dict[str, np.ndarray]:
    st = table.export_state()
    order = np.argsort(st.keys)
    return {
        "keys": st.keys[order],
        "values": st.values[order],
        "slots": st.slots[order],
        "last_step": st.last_step[order],
        "update_count": st.update_count[order],
        "iterations": np.array(st.iterations),
    }


def _assert_state_equal(a: dict, b: dict) -> None:
    for f in FIELDS:
        np.testing.assert_array_equal(a[f], b[f], err_msg=f)
        if f != "iterations":
            assert a[f].dtype == b[f].dtype, f


OPTIMIZERS = {
    "sgd": lambda: eo.SGD(learning_rate=0.1),
    "sgd_momentum": lambda: eo.SGD(learning_rate=0.1, momentum=0.9),
    "sgd_nesterov": lambda: eo.SGD(learning_rate=0.1, momentum=0.7, nesterov=True),
    "adagrad": lambda: eo.Adagrad(learning_rate=0.2),
    "adam": lambda: eo.Adam(learning_rate=0.05),
    "ftrl": lambda: eo.Ftrl(
        learning_rate=0.2,
        l1_regularization_strength=0.01,
        l2_regularization_strength=0.02,
        l2_shrinkage_regularization_strength=0.03,
        beta=0.1,
    ),
}


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_round_trip_is_exact_and_training_continues_identically(opt: str, tmp_path: Path) -> None:
    dim = 5
    live = ee.Table(
        dim=dim, optimizer=OPTIMIZERS[opt](), initializer="uniform", name=_name(opt), seed=3
    )
    twin = ee.Table(
        dim=dim, optimizer=OPTIMIZERS[opt](), initializer="uniform", name=_name(opt), seed=3
    )
    train(live, seed=1)
    train(twin, seed=1)
    _assert_state_equal(_state(live), _state(twin))
    assert ee.save(tmp_path, tables=[live]) == tmp_path
    # Change everything: more steps, new rows, erased rows, imported values.
    train(live, seed=2, key_range=200)
    live.erase(np.arange(-10, 10))
    live.import_rows(np.array([10_000]), np.ones((1, dim), np.float32))
    restored = ee.restore(tmp_path, tables=[live])
    assert restored == {live.name: live}
    _assert_state_equal(_state(live), _state(twin))
    assert live.iterations == twin.iterations == 5
    # Slots and the step count are observable by training on.
    train(live, seed=3)
    train(twin, seed=3)
    _assert_state_equal(_state(live), _state(twin))
    keys = np.arange(-60, 60)
    for x, y in zip(live.metadata(keys), twin.metadata(keys), strict=True):
        np.testing.assert_array_equal(x, y)


def test_restore_replaces_the_content_entirely(tmp_path: Path) -> None:
    t = ee.Table(dim=3, optimizer=eo.Adagrad(0.1), initializer="zeros", name=_name())
    t.import_rows(np.arange(100), np.tile(np.arange(100, dtype=np.float32)[:, None], 3))
    t.push(np.arange(0, 100, 2), np.ones((50, 3), np.float32))
    saved = _state(t)
    ee.save(tmp_path, tables=[t])
    t.pull(np.arange(100, 200), train=True)
    t.erase(np.arange(10))
    t.push(np.arange(50, 150), np.ones((100, 3), np.float32))
    ee.restore(tmp_path, tables=[t])
    _assert_state_equal(_state(t), saved)
    assert len(t) == 100
    np.testing.assert_array_equal(t.metadata(np.array([150, 199]))[0], [-1, -1])


def test_empty_table_round_trip_empties_the_table(tmp_path: Path) -> None:
    e = ee.Table(dim=3, optimizer=eo.Adagrad(0.1), name=_name())
    ee.save(tmp_path, tables=[e])
    e.pull(np.arange(5))
    e.push(np.arange(5), np.ones((5, 3), np.float32))
    ee.restore(tmp_path, tables=[e])
    assert len(e) == 0 and e.iterations == 0
    assert e.export_rows()[0].shape == (0,)


def test_plain_sgd_table_without_slots_round_trip(tmp_path: Path) -> None:
    t = ee.Table(dim=2, optimizer=eo.SGD(0.5), initializer="uniform", name=_name(), seed=4)
    assert t.num_slots == 0
    train(t, seed=1)
    saved = _state(t)
    assert saved["slots"].shape == (len(t), 0)
    ee.save(tmp_path, tables=[t])
    train(t, seed=2)
    ee.restore(tmp_path, tables=[t])
    _assert_state_equal(_state(t), saved)


def test_restore_creates_checkpointed_tables_without_a_live_one(tmp_path: Path) -> None:
    name = _name("orphan")
    opt = eo.Ftrl(learning_rate=0.3, l1_regularization_strength=0.05)
    t = ee.Table(dim=4, optimizer=opt, initializer="truncated_normal", name=name, seed=17)
    train(t, seed=5)
    saved = _state(t)
    unseen = np.array([10**9, -(10**9)])
    init_unseen = t.pull(unseen, train=False)
    ee.save(tmp_path, tables=[t])
    del t
    gc.collect()
    assert name not in ee.placement.registered_tables()
    restored = ee.restore(tmp_path)
    assert set(restored) == {name}
    new = restored[name]
    assert new.name == name and new.dim == 4 and new.seed == 17
    assert new.optimizer == opt
    _assert_state_equal(_state(new), saved)
    np.testing.assert_array_equal(new.pull(unseen, train=False), init_unseen)
    # `tables=` restricts the restore; a requested table missing from the
    # checkpoint is an error, not a silent no-op.
    other = ee.Table(dim=4, name=_name())
    other.pull(np.arange(3))
    with pytest.raises(ee.CheckpointError, match="not in the checkpoint"):
        ee.restore(tmp_path, tables=[other])
    assert len(other) == 3
    assert set(ee.restore(tmp_path, tables=[new])) == {name}


def test_save_and_restore_every_table_of_the_process_by_default(tmp_path: Path) -> None:
    gc.collect()  # only this test's tables should be live
    a = ee.Table(dim=2, optimizer=eo.SGD(0.5, momentum=0.5), name=_name("all"), seed=1)
    b = ee.Table(dim=3, optimizer=eo.Adam(0.1), name=_name("all"), seed=2)
    train(a, seed=1)
    train(b, seed=2)
    sa, sb = _state(a), _state(b)
    ee.save(tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert {a.name, b.name} <= set(manifest["tables"])
    train(a, seed=3)
    train(b, seed=4)
    restored = ee.restore(tmp_path)
    assert restored[a.name] is a and restored[b.name] is b
    _assert_state_equal(_state(a), sa)
    _assert_state_equal(_state(b), sb)


CHILD = (
    TRAIN_SRC
    + """
import sys
import numpy as np
import elastic_emb as ee
from elastic_emb.tables.policies import optimizers as eo

prefix = sys.argv[1]
a = ee.Table(dim=5, optimizer=eo.Adam(0.05), initializer="normal", name=prefix + "_a", seed=1)
b = ee.Table(dim=3, optimizer=eo.Ftrl(0.2, l1_regularization_strength=0.01, beta=0.1),
             initializer="uniform", name=prefix + "_b", seed=2)
train(a, seed=11)
train(b, seed=12)
ee.save("from_child")          # every table of this process
dump(a, "child_a.npz")
dump(b, "child_b.npz")
train(a, seed=13)               # training on after the save
train(b, seed=14)
dump(a, "child_a_after.npz")
dump(b, "child_b_after.npz")
# The reverse direction: restore the parent's checkpoint (no live tables of those names).
for name, t in ee.restore("from_parent").items():
    dump(t, f"restored_{name}.npz")
    train(t, seed=15)
    dump(t, f"restored_{name}_after.npz")
"""
)


def _load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def test_checkpoints_work_across_processes(tmp_path: Path) -> None:
    prefix = f"xproc{os.getpid()}_{next(_names)}"
    # Parent -> child.
    p1 = ee.Table(
        dim=4,
        optimizer=eo.SGD(0.1, momentum=0.9),
        initializer="uniform",
        name=prefix + "_p1",
        seed=21,
    )
    p2 = ee.Table(
        dim=2, optimizer=eo.Adagrad(0.3), initializer="normal", name=prefix + "_p2", seed=22
    )
    train(p1, seed=31)
    train(p2, seed=32)
    ee.save(tmp_path / "from_parent", tables=[p1, p2])
    (tmp_path / "child.py").write_text(CHILD)
    run_python("child.py", prefix, cwd=tmp_path, timeout=180)
    for t in (p1, p2):
        _assert_state_equal(_load(tmp_path / f"restored_{t.name}.npz"), _state(t))
        train(t, seed=15)
        _assert_state_equal(_load(tmp_path / f"restored_{t.name}_after.npz"), _state(t))
    # Child -> parent: the child's tables are live here with other content.
    a = ee.Table(dim=5, optimizer=eo.Adam(0.05), initializer="normal", name=prefix + "_a", seed=1)
    a.pull(np.arange(1000, 1100), train=True)
    restored = ee.restore(tmp_path / "from_child")
    assert set(restored) == {prefix + "_a", prefix + "_b"}
    assert restored[prefix + "_a"] is a
    b = restored[prefix + "_b"]  # created by the restore
    _assert_state_equal(_state(a), _load(tmp_path / "child_a.npz"))
    _assert_state_equal(_state(b), _load(tmp_path / "child_b.npz"))
    train(a, seed=13)
    train(b, seed=14)
    _assert_state_equal(_state(a), _load(tmp_path / "child_a_after.npz"))
    _assert_state_equal(_state(b), _load(tmp_path / "child_b_after.npz"))


# Atomicity.


def _data_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != "manifest.json")


def test_saving_twice_leaves_one_set_of_data_files(tmp_path: Path) -> None:
    a = ee.Table(dim=3, optimizer=eo.Adagrad(0.1), name=_name())
    b = ee.Table(dim=2, optimizer=eo.Adam(0.1), name=_name())
    train(a, seed=1)
    train(b, seed=2)
    ee.save(tmp_path, tables=[a, b])
    first = _data_files(tmp_path)
    assert len(first) == 2 and all(f.endswith(".bin") for f in first)
    train(a, seed=3)
    train(b, seed=4)
    sa, sb = _state(a), _state(b)
    ee.save(tmp_path, tables=[a, b])
    second = _data_files(tmp_path)
    assert len(second) == 2 and all(f.endswith(".bin") for f in second)
    assert not set(first) & set(second)  # fresh names: the old set stayed valid until the switch
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert sorted(e["file"] for e in manifest["tables"].values()) == second
    train(a, seed=5)
    train(b, seed=6)
    ee.restore(tmp_path, tables=[a, b])
    _assert_state_equal(_state(a), sa)
    _assert_state_equal(_state(b), sb)


def test_leftovers_of_a_crashed_save_do_not_break_restore(tmp_path: Path) -> None:
    t = ee.Table(dim=3, optimizer=eo.Adam(0.1), name=_name())
    train(t, seed=1)
    saved = _state(t)
    ee.save(tmp_path, tables=[t])
    # A crash while writing the next checkpoint: temporary files and a complete
    # data file that no manifest refers to yet.
    (tmp_path / "table-0000-deadbeef.bin.tmp").write_bytes(os.urandom(100))
    (tmp_path / "manifest.json.tmp").write_text('{"format": "garbage"')
    (tmp_path / "table-0000-cafebabe.bin").write_bytes(os.urandom(64))
    train(t, seed=2)
    ee.restore(tmp_path, tables=[t])
    _assert_state_equal(_state(t), saved)
    # And the next save over the debris succeeds.
    train(t, seed=3)
    again = _state(t)
    ee.save(tmp_path, tables=[t])
    train(t, seed=4)
    ee.restore(tmp_path, tables=[t])
    _assert_state_equal(_state(t), again)


# Corrupted checkpoints.


@pytest.fixture
def saved_pair(tmp_path: Path):
    """Live tables a, b saved with an orphan c; a and b then trained on (so a restore shows)."""
    prefix = _name("pair")
    a = ee.Table(
        dim=4, optimizer=eo.Adagrad(0.1), initializer="uniform", name=prefix + "_a", seed=1
    )
    b = ee.Table(dim=3, optimizer=eo.Adam(0.1), initializer="normal", name=prefix + "_b", seed=2)
    c = ee.Table(
        dim=2,
        optimizer=eo.SGD(0.1, momentum=0.5),
        initializer="uniform",
        name=prefix + "_c",
        seed=3,
    )
    for i, t in enumerate((a, b, c)):
        train(t, seed=i)
    directory = tmp_path / "ckpt"
    ee.save(directory, tables=[a, b, c])
    del c
    gc.collect()
    train(a, seed=10)
    train(b, seed=11)
    return directory, a, b, prefix


def _entry(directory: Path, prefix: str, suffix: str) -> dict:
    return json.loads((directory / "manifest.json").read_text())["tables"][prefix + suffix]


def _edit_manifest(directory: Path, fn) -> None:
    """Edits the manifest as one of a release before manifest checksums (else the checksum
    would refuse every edit before the checks behind it are reached)."""
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.pop("manifest_sha256")
    fn(manifest)
    path.write_text(json.dumps(manifest))


def _truncate(d, p):
    f = d / _entry(d, p, "_b")["file"]
    f.write_bytes(f.read_bytes()[:-7])


def _pad(d, p):
    f = d / _entry(d, p, "_b")["file"]
    f.write_bytes(f.read_bytes() + b"\0")


def _flip(d, p):
    f = d / _entry(d, p, "_b")["file"]
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    f.write_bytes(bytes(raw))


def _delete_data(d, p):
    (d / _entry(d, p, "_b")["file"]).unlink()


def _delete_manifest(d, p):
    (d / "manifest.json").unlink()


def _garble_json(d, p):
    path = d / "manifest.json"
    path.write_text(path.read_text()[: len(path.read_text()) // 2])


def _binary_manifest(d, p):
    (d / "manifest.json").write_bytes(b"\xff\xfe\x00garbage")


def _not_a_manifest(d, p):
    (d / "manifest.json").write_text("[1, 2, 3]")


def _wrong_format(d, p):
    _edit_manifest(d, lambda m: m.__setitem__("format", "something.else"))


def _wrong_version(d, p):
    _edit_manifest(d, lambda m: m.__setitem__("version", 2))


def _missing_field(d, p):
    _edit_manifest(d, lambda m: m["tables"][p + "_b"].pop("sha256"))


def _missing_tables(d, p):
    _edit_manifest(d, lambda m: m.pop("tables"))


def _num_rows_inconsistent(d, p):
    # The data file and its checksum are intact; the manifest's row count is not.
    _edit_manifest(
        d,
        lambda m: m["tables"][p + "_b"].__setitem__(
            "num_rows", m["tables"][p + "_b"]["num_rows"] - 3
        ),
    )


def _orphan_bad_optimizer(d, p):
    # The table to be created by the restore (c, after a and b) has a bad config.
    _edit_manifest(
        d, lambda m: m["tables"][p + "_c"]["optimizer"].__setitem__("class_name", "Adadelta")
    )


def _orphan_bad_dim(d, p):
    _edit_manifest(d, lambda m: m["tables"][p + "_c"].__setitem__("dim", 0))


CORRUPTIONS = {
    "truncated_data": (_truncate, "truncated"),
    "padded_data": (_pad, "truncated or padded"),
    "flipped_byte": (_flip, "checksum"),
    "deleted_data": (_delete_data, "missing"),
    "deleted_manifest": (_delete_manifest, "missing"),
    "garbled_json": (_garble_json, "corrupted"),
    "binary_manifest": (_binary_manifest, "corrupted"),
    "not_a_manifest": (_not_a_manifest, "not an elastic_emb checkpoint"),
    "wrong_format": (_wrong_format, "not an elastic_emb checkpoint"),
    "wrong_version": (_wrong_version, "version"),
    "missing_field": (_missing_field, "malformed"),
    "missing_tables": (_missing_tables, "malformed"),
    "num_rows_inconsistent": (_num_rows_inconsistent, None),
    "orphan_bad_optimizer": (_orphan_bad_optimizer, None),
    "orphan_bad_dim": (_orphan_bad_dim, None),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupted_checkpoint_raises_and_leaves_live_tables_unchanged(
    saved_pair, corruption: str
) -> None:
    directory, a, b, prefix = saved_pair
    corrupt, needle = CORRUPTIONS[corruption]
    corrupt(directory, prefix)
    before = (_state(a), _state(b))
    with pytest.raises(CheckpointError) as info:
        ee.restore(directory)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    if needle is not None:
        assert needle in message, message
    assert str(directory) in message or prefix in message, message  # says where
    _assert_state_equal(_state(a), before[0])
    _assert_state_equal(_state(b), before[1])
    assert prefix + "_c" not in ee.placement.registered_tables()


@pytest.mark.parametrize(
    ("make_live", "what"),
    [
        (lambda name: ee.Table(dim=5, optimizer=eo.SGD(0.1, momentum=0.5), name=name), "dim"),
        (lambda name: ee.Table(dim=2, optimizer=eo.Adam(0.1), name=name), "adam"),
        (lambda name: ee.Table(dim=2, optimizer=eo.SGD(0.1), name=name), "slots"),
    ],
    ids=["dim", "optimizer", "slots"],
)
def test_mismatched_live_table_raises_and_nothing_changes(saved_pair, make_live, what) -> None:
    directory, a, b, prefix = saved_pair
    name = prefix + "_c"  # saved as dim 2, SGD with momentum (1 slot); no live table now
    mismatched = make_live(name)
    assert mismatched.name == name
    mismatched.pull(np.arange(7), train=True)
    before = (_state(a), _state(b), _state(mismatched))
    with pytest.raises(CheckpointError, match="does not match") as info:
        ee.restore(directory)
    assert name in str(info.value) and what in str(info.value)
    _assert_state_equal(_state(a), before[0])
    _assert_state_equal(_state(b), before[1])
    _assert_state_equal(_state(mismatched), before[2])


def test_save_refuses_two_tables_of_one_name(tmp_path: Path) -> None:
    name = _name("twice")
    older = ee.Table(dim=2, optimizer=eo.SGD(0.1), name=name)
    newer = ee.Table(dim=2, optimizer=eo.SGD(0.1), name=name)  # takes the name over
    with pytest.raises(ValueError, match=f"two tables named '{name}'"):
        ee.save(tmp_path, tables=[older, newer])
    assert not (tmp_path / "manifest.json").exists()
    ee.save(tmp_path, tables=[newer])  # one per name is fine
    assert ee.placement.registered_tables()[name] is newer
