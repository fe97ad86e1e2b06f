"""Tests of incremental checkpoints: `ee.save(..., incremental=True)`, chains of a base and
deltas, `ee.checkpoint.compact`, and `ee.callbacks.Checkpoint(incremental=True)`.

The right answers come from elsewhere than the code under test:
- a restored table must equal the live table it was saved from, bit for bit
  (every array of `export_state` and the step count);
- what a delta holds is predicted by a plain-Python model of the tracking rule
  (`_Tracker`): the keys inserted, pushed or imported since the previous save
  that are still present, and the keys present at the previous save that have
  been erased since;
- concurrent pushes use plain SGD with gradients exact in float32, so the
  final rows are known in closed form, whatever the interleaving.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import elastic_emb as ee
from elastic_emb.persistence import checkpoint, files
from elastic_emb.persistence.checkpoint import CheckpointError
from elastic_emb.tables.policies import optimizers as eo

_names = itertools.count()

FIELDS = ("keys", "values", "slots", "last_step", "update_count")

OPTIMIZERS = {
    "sgd": lambda: eo.SGD(learning_rate=0.1),
    "sgd_momentum": lambda: eo.SGD(learning_rate=0.1, momentum=0.9),
    "adagrad": lambda: eo.Adagrad(learning_rate=0.2),
    "adam": lambda: eo.Adam(learning_rate=0.05),
    "ftrl": lambda: eo.Ftrl(learning_rate=0.2, l1_regularization_strength=0.01),
}


def _name(prefix: str = "inc") -> str:
    return f"{prefix}_{next(_names)}_{os.getpid()}"


def _state(table: Any) -> dict[str, Any]:
    st = table.export_state()
    order = np.argsort(st.keys)
    out: dict[str, Any] = {f: getattr(st, f)[order] for f in FIELDS}
    out["iterations"] = st.iterations
    return out


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["iterations"] == b["iterations"]
    for f in FIELDS:
        assert a[f].dtype == b[f].dtype, f
        assert a[f].shape == b[f].shape, f
        # Bit-identical, NaN or not.
        assert np.array_equal(a[f].view(np.uint8), b[f].view(np.uint8)), f


def _twin(table: Any) -> Any:
    """An empty table configured like `table` (it takes the name over)."""
    return ee.Table(
        dim=table.dim,
        optimizer=table.optimizer,
        initializer=table.initializer,
        name=table.name,
        seed=table.seed,
    )


def _restored(directory: Path, table: Any) -> dict[str, Any]:
    """The state a fresh table gets from `directory` (the live `table` is untouched)."""
    fresh = _twin(table)
    ee.restore(directory, tables=[fresh])
    return _state(fresh)


def _manifest(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "manifest.json").read_text())


def _links(directory: Path, name: str) -> list[dict[str, Any]]:
    return _manifest(directory)["tables"][name]["links"]


def _data_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("table-*.bin"))


class _Tracker:
    """The tracking rule in plain Python: the expected content of the next delta."""

    def __init__(self, table: Any) -> None:
        self.table = table
        self.saved: set[int] = set()  # keys present at the last save
        self.touched: set[int] = set()
        self.erased: set[int] = set()

    def present(self) -> set[int]:
        return {int(k) for k in self.table.export_state().keys}

    def pull(self, keys: np.ndarray) -> None:
        self.touched |= {int(k) for k in keys} - self.present()
        self.table.pull(keys, train=True)

    def push(self, keys: np.ndarray, grads: np.ndarray) -> None:
        self.touched |= {int(k) for k in keys}
        self.table.push(keys, grads)

    def import_rows(self, keys: np.ndarray, values: np.ndarray) -> None:
        self.touched |= {int(k) for k in keys}
        self.table.import_rows(keys, values)

    def erase(self, keys: np.ndarray) -> None:
        gone = {int(k) for k in keys} & self.present()
        self.erased |= gone & self.saved
        self.touched -= gone
        self.table.erase(keys)

    def saved_now(self) -> tuple[set[int], set[int]]:
        """(rows, erased keys) the delta just written must hold; starts the next one."""
        rows, erased = self.touched, self.erased
        self.saved, self.touched, self.erased = self.present(), set(), set()
        return rows, erased


def _read_delta(directory: Path, link: dict[str, Any], dim: int, num_slots: int):
    """(keys, erased keys) of a delta file, parsed here from the documented layout."""
    raw = (directory / link["file"]).read_bytes()
    m, e = link["num_rows"], link["num_erased"]
    row_bytes = 8 + 4 * dim + 4 * num_slots * dim + 4 + 4
    assert len(raw) == m * row_bytes + 8 * e
    keys = np.frombuffer(raw, "<i8", m, 0)
    erased = np.frombuffer(raw, "<i8", e, m * row_bytes)
    return {int(k) for k in keys}, {int(k) for k in erased}


# A chain of deltas restores exactly, and each delta holds what the rule says.


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("fraction", [0.01, 0.1])
def test_base_plus_deltas_restore_bit_identically(opt: str, fraction: float, tmp_path: Path):
    dim, rows = 6, 3000
    table = ee.Table(
        dim=dim, optimizer=OPTIMIZERS[opt](), initializer="uniform", name=_name(opt), seed=11
    )
    rng = np.random.default_rng(7)
    tracker = _Tracker(table)
    universe = np.arange(rows, dtype=np.int64) * 7 - 5000
    tracker.pull(universe)
    tracker.push(universe, rng.normal(size=(rows, dim)).astype(np.float32))
    ee.save(tmp_path, tables=[table], incremental=True)
    tracker.saved_now()
    base_bytes = _links(tmp_path, table.name)[0]["bytes"]
    _assert_same(_restored(tmp_path, table), _state(table))
    next_key = 10**6
    for round_ in range(1, 6):
        present = np.array(sorted(tracker.present()), np.int64)
        changed = rng.choice(present, size=max(1, int(fraction * len(present))), replace=False)
        # Duplicates in a push are summed; two pushes make two optimizer steps.
        tracker.push(changed, rng.normal(size=(changed.size, dim)).astype(np.float32))
        tracker.push(changed[:3].repeat(2), np.ones((6, dim), np.float32))
        tracker.erase(rng.choice(present, size=20, replace=False))
        tracker.erase(np.array([10**12]))  # absent: nothing to record
        new = np.arange(next_key, next_key + 15, dtype=np.int64)
        next_key += 15
        tracker.pull(new)  # inserted by a training pull, never pushed
        tracker.import_rows(new[:2] + 100, np.full((2, dim), round_, np.float32))
        tracker.import_rows(present[-3:], np.full((3, dim), -round_, np.float32))  # rewritten
        tracker.pull(np.array([next_key]))
        tracker.erase(np.array([next_key]))  # inserted and erased in one delta: no trace
        next_key += 1
        erased_then_back = present[:2]
        tracker.erase(erased_then_back)
        tracker.pull(erased_then_back)
        table.pull(present[:50], train=False)  # reads change nothing
        ee.save(tmp_path, tables=[table], incremental=True)
        expected_rows, expected_erased = tracker.saved_now()
        links = _links(tmp_path, table.name)
        assert [link["kind"] for link in links] == ["base"] + ["delta"] * round_
        assert [link["seq"] for link in links] == list(range(round_ + 1))
        got_rows, got_erased = _read_delta(tmp_path, links[-1], dim, table.num_slots)
        assert got_rows == expected_rows
        assert got_erased == expected_erased
        assert links[-1]["bytes"] < base_bytes * (fraction + 0.05)
        assert len(_data_files(tmp_path)) == round_ + 1
        _assert_same(_restored(tmp_path, table), _state(table))


def test_a_table_with_no_changes_gets_an_empty_delta(tmp_path: Path) -> None:
    t = ee.Table(dim=3, optimizer=eo.Adagrad(0.1), name=_name())
    t.push(np.arange(10), np.ones((10, 3), np.float32))
    ee.save(tmp_path, tables=[t], incremental=True)
    ee.save(tmp_path, tables=[t], incremental=True)
    delta = _links(tmp_path, t.name)[-1]
    assert (delta["kind"], delta["num_rows"], delta["num_erased"], delta["bytes"]) == (
        "delta",
        0,
        0,
        0,
    )
    _assert_same(_restored(tmp_path, t), _state(t))


def test_iterations_alone_are_a_change(tmp_path: Path) -> None:
    t = ee.Table(dim=2, optimizer=eo.SGD(0.5), name=_name())
    t.push(np.arange(4), np.ones((4, 2), np.float32))
    ee.save(tmp_path, tables=[t], incremental=True)
    t.push(np.zeros(0, np.int64), np.zeros((0, 2), np.float32))  # a step that updates no row
    ee.save(tmp_path, tables=[t], incremental=True)
    assert _links(tmp_path, t.name)[-1]["num_rows"] == 0
    assert _restored(tmp_path, t)["iterations"] == t.iterations == 2


def test_several_tables_each_get_their_own_chain(tmp_path: Path) -> None:
    a = ee.Table(dim=3, optimizer=eo.Adam(0.1), name=_name("a"))
    b = ee.Table(dim=2, optimizer=eo.Adagrad(0.1), name=_name("b"))
    a.push(np.arange(50), np.ones((50, 3), np.float32))
    ee.save(tmp_path, tables=[a], incremental=True)
    b.push(np.arange(40), np.ones((40, 2), np.float32))
    a.push(np.arange(5), np.ones((5, 3), np.float32))
    # `a` continues its chain; `b`, new in this directory, starts one.
    ee.save(tmp_path, tables=[a, b], incremental=True)
    assert [k["kind"] for k in _links(tmp_path, a.name)] == ["base", "delta"]
    assert [k["kind"] for k in _links(tmp_path, b.name)] == ["base"]
    assert (
        _manifest(tmp_path)["tables"][a.name]["chain"]
        != (_manifest(tmp_path)["tables"][b.name]["chain"])
    )
    fa, fb = _twin(a), _twin(b)
    restored = ee.restore(tmp_path)  # no `tables`: the newest tables of those names
    assert restored == {a.name: fa, b.name: fb}
    _assert_same(_state(fa), _state(a))
    _assert_same(_state(fb), _state(b))


# When a delta would not be exact, a base is written instead.


def test_other_directories_full_saves_and_restores_start_new_bases(tmp_path: Path) -> None:
    t = ee.Table(dim=3, optimizer=eo.Adagrad(0.1), name=_name())
    one, two = tmp_path / "one", tmp_path / "two"
    t.push(np.arange(100), np.ones((100, 3), np.float32))
    ee.save(one, tables=[t], incremental=True)
    t.push(np.arange(5), np.ones((5, 3), np.float32))
    ee.save(one, tables=[t], incremental=True)
    assert len(_links(one, t.name)) == 2
    # The table's changes went to `two` since: `one` must start over.
    ee.save(two, tables=[t], incremental=True)
    t.push(np.arange(5), np.ones((5, 3), np.float32))
    ee.save(one, tables=[t], incremental=True)
    assert [k["kind"] for k in _links(one, t.name)] == ["base"]
    _assert_same(_restored(one, t), _state(t))
    # A full save replaces the chain with an ordinary checkpoint.
    ee.save(one, tables=[t])
    assert _manifest(one)["version"] == 1 and len(_data_files(one)) == 1
    t.push(np.arange(5), np.ones((5, 3), np.float32))
    ee.save(one, tables=[t], incremental=True)
    assert [k["kind"] for k in _links(one, t.name)] == ["base"]
    # A restored table starts a new base too.
    ee.save(one, tables=[t], incremental=True)
    assert len(_links(one, t.name)) == 2
    ee.restore(one, tables=[t])
    t.push(np.arange(3), np.ones((3, 3), np.float32))
    ee.save(one, tables=[t], incremental=True)
    assert [k["kind"] for k in _links(one, t.name)] == ["base"]
    _assert_same(_restored(one, t), _state(t))


def test_a_new_table_of_the_same_name_starts_a_new_base(tmp_path: Path) -> None:
    old = ee.Table(dim=2, optimizer=eo.Adagrad(0.1), name=_name())
    old.push(np.arange(10), np.ones((10, 2), np.float32))
    ee.save(tmp_path, tables=[old], incremental=True)
    new = _twin(old)
    new.push(np.arange(3), np.ones((3, 2), np.float32))
    ee.save(tmp_path, tables=[new], incremental=True)
    assert [k["kind"] for k in _links(tmp_path, new.name)] == ["base"]
    _assert_same(_restored(tmp_path, new), _state(new))


def test_a_change_set_taken_by_someone_else_forces_a_base(tmp_path: Path) -> None:
    t = ee.Table(dim=2, optimizer=eo.SGD(0.5), name=_name())
    t.push(np.arange(10), np.ones((10, 2), np.float32))
    ee.save(tmp_path, tables=[t], incremental=True)
    t.push(np.arange(3), np.ones((3, 2), np.float32))
    t.export_changes()  # these changes are in no chain
    t.push(np.arange(8, 12), np.ones((4, 2), np.float32))
    ee.save(tmp_path, tables=[t], incremental=True)
    assert [k["kind"] for k in _links(tmp_path, t.name)] == ["base"]
    _assert_same(_restored(tmp_path, t), _state(t))


def test_max_deltas_bounds_the_chain(tmp_path: Path) -> None:
    t = ee.Table(dim=2, optimizer=eo.Adagrad(0.1), name=_name())
    kinds = []
    for i in range(7):
        t.push(np.arange(i, i + 20), np.ones((20, 2), np.float32))
        t.erase(np.array([i]))
        ee.save(tmp_path, tables=[t], incremental=True, max_deltas=2)
        kinds.append(len(_links(tmp_path, t.name)))
        assert len(_data_files(tmp_path)) == kinds[-1]
        _assert_same(_restored(tmp_path, t), _state(t))
    assert kinds == [1, 2, 3, 1, 2, 3, 1]
    ee.save(tmp_path, tables=[t], incremental=True, max_deltas=0)
    assert len(_links(tmp_path, t.name)) == 1


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_invalid_arguments_are_refused(bad: Any, tmp_path: Path) -> None:
    t = ee.Table(dim=2, name=_name())
    with pytest.raises(ValueError, match="max_deltas"):
        ee.save(tmp_path, tables=[t], incremental=True, max_deltas=bad)
    with pytest.raises(ValueError, match="incremental"):
        ee.save(tmp_path, tables=[t], incremental=1)
    with pytest.raises(ValueError, match="max_deltas"):
        ee.callbacks.Checkpoint(tmp_path, incremental=True, max_deltas=bad)
    assert not (tmp_path / "manifest.json").exists()


def test_tables_that_do_not_track_changes_are_refused(tmp_path: Path) -> None:
    from elastic_emb.tables.table import TableConfig

    class OtherTable(ee.Table):
        device = "cpu"

        def __init__(self) -> None:
            self._config = TableConfig.make(dim=2, name=_name("other"))

    local = ee.Table(dim=2, name=_name())
    local.push(np.arange(3), np.ones((3, 2), np.float32))
    with pytest.raises(NotImplementedError, match="track changed rows"):
        ee.save(tmp_path, tables=[local, OtherTable()], incremental=True)
    assert not (tmp_path / "manifest.json").exists()
    # Nothing was taken from `local`: its first incremental save holds every row.
    ee.save(tmp_path, tables=[local], incremental=True)
    _assert_same(_restored(tmp_path, local), _state(local))


# Broken chains are refused before any table changes.


@pytest.fixture
def chain(tmp_path: Path):
    """A base and three deltas of an Adam table; returns (directory, live table)."""
    t = ee.Table(dim=4, optimizer=eo.Adam(0.05), name=_name("chain"), seed=2)
    rng = np.random.default_rng(3)
    keys = np.arange(500, dtype=np.int64)
    t.push(keys, rng.normal(size=(500, 4)).astype(np.float32))
    ee.save(tmp_path, tables=[t], incremental=True)
    for i in range(3):
        some = rng.choice(keys, 30, replace=False)
        t.push(some, rng.normal(size=(30, 4)).astype(np.float32))
        t.erase(keys[i * 10 : i * 10 + 5])
        ee.save(tmp_path, tables=[t], incremental=True)
    assert len(_links(tmp_path, t.name)) == 4
    return tmp_path, t


def _target(t: Any) -> Any:
    """A live table of `t`'s name with other content, which a failed restore must keep."""
    target = _twin(t)
    target.push(np.arange(1000, 1010), np.ones((10, t.dim), np.float32))
    return target


def _corrupt(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("where", ["base", "middle delta", "last delta"])
def test_a_corrupted_link_raises_and_changes_nothing(chain, where: str) -> None:
    directory, t = chain
    link = _links(directory, t.name)[{"base": 0, "middle delta": 2, "last delta": 3}[where]]
    _corrupt(directory / link["file"], link["bytes"] // 2)
    target = _target(t)
    before = _state(target)
    with pytest.raises(CheckpointError, match=f"{link['file']}.*fails its checksum"):
        ee.restore(directory, tables=[target])
    _assert_same(_state(target), before)
    with pytest.raises(CheckpointError, match="fails its checksum"):
        ee.restore(directory)  # the newest table of that name is `target`
    _assert_same(_state(target), before)
    with pytest.raises(CheckpointError):
        checkpoint.compact(directory)
    assert (directory / link["file"]).exists()


def test_a_missing_or_truncated_delta_raises_and_changes_nothing(chain) -> None:
    directory, t = chain
    links = _links(directory, t.name)
    target = _target(t)
    before = _state(target)
    data = (directory / links[2]["file"]).read_bytes()
    (directory / links[2]["file"]).write_bytes(data[:-1])
    with pytest.raises(CheckpointError, match="truncated"):
        ee.restore(directory, tables=[target])
    (directory / links[2]["file"]).unlink()
    with pytest.raises(CheckpointError, match=f"{links[2]['file']}.*is missing"):
        ee.restore(directory, tables=[target])
    _assert_same(_state(target), before)


def _edit_links(directory: Path, name: str, edit) -> None:
    manifest = _manifest(directory)
    manifest.pop("manifest_sha256")  # as a release before manifest checksums wrote it
    edit(manifest["tables"][name]["links"])
    (directory / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda links: links.pop(2), "sequence 3 follows 1"),
        (lambda links: links.__setitem__(2, {**links[2], "parent": "0" * 64}), "its parent"),
        (lambda links: links.pop(0), "a base was expected"),
        (lambda links: links.__setitem__(1, {**links[1], "kind": "base"}), "a delta"),
        (lambda links: links.__setitem__(3, {**links[3], "iterations": 1}), "iterations"),
        (lambda links: links.clear(), "no chain"),
        (lambda links: links[3].pop("sha256"), "malformed"),
    ],
)
def test_a_broken_link_in_the_manifest_raises_and_changes_nothing(chain, edit, message) -> None:
    directory, t = chain
    _edit_links(directory, t.name, edit)
    target = _target(t)
    before = _state(target)
    with pytest.raises(CheckpointError, match=message):
        ee.restore(directory, tables=[target])
    _assert_same(_state(target), before)


def test_a_chain_manifest_must_have_version_2(chain) -> None:
    directory, t = chain
    manifest = _manifest(directory)
    manifest.pop("manifest_sha256")  # as a release before manifest checksums wrote it
    manifest["version"] = 1  # what an older release would wrongly read as bases only
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="does not fit format version 1"):
        ee.restore(directory, tables=[_target(t)])


def test_a_save_after_a_broken_chain_starts_a_new_base(chain) -> None:
    directory, t = chain
    (directory / _links(directory, t.name)[1]["file"]).unlink()
    t.push(np.arange(3), np.ones((3, 4), np.float32))
    ee.save(directory, tables=[t], incremental=True)
    assert [k["kind"] for k in _links(directory, t.name)] == ["base"]
    _assert_same(_restored(directory, t), _state(t))


def test_a_failed_save_loses_no_change(tmp_path: Path, monkeypatch) -> None:
    t = ee.Table(dim=3, optimizer=eo.Adagrad(0.1), name=_name())
    t.push(np.arange(100), np.ones((100, 3), np.float32))
    ee.save(tmp_path, tables=[t], incremental=True)
    t.push(np.arange(10), np.ones((10, 3), np.float32))
    before = _restored(tmp_path, t)

    def disk_full(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "write_manifest", disk_full)
    with pytest.raises(OSError, match="No space"):
        ee.save(tmp_path, tables=[t], incremental=True)
    monkeypatch.undo()
    _assert_same(_restored(tmp_path, t), before)  # the previous checkpoint is intact
    t.push(np.arange(5, 15), np.ones((10, 3), np.float32))
    # The change set taken by the failed save is in no chain: a new base.
    ee.save(tmp_path, tables=[t], incremental=True)
    assert [k["kind"] for k in _links(tmp_path, t.name)] == ["base"]
    assert len(_data_files(tmp_path)) == 1
    _assert_same(_restored(tmp_path, t), _state(t))


# Compaction.


def test_compaction_merges_the_chain_into_one_base(chain) -> None:
    directory, t = chain
    expected = _state(t)
    chain_id = _manifest(directory)["tables"][t.name]["chain"]
    assert checkpoint.compact(directory) == directory
    links = _links(directory, t.name)
    assert [(k["kind"], k["seq"], k["parent"]) for k in links] == [("base", 3, None)]
    assert links[0]["num_rows"] == len(t)
    assert _data_files(directory) == [links[0]["file"]]
    _assert_same(_restored(directory, t), expected)
    checkpoint.compact(directory)  # nothing to merge: unchanged
    assert _links(directory, t.name) == links
    # The chain keeps its identity: the next save of the live table is a delta.
    assert _manifest(directory)["tables"][t.name]["chain"] == chain_id
    t.push(np.arange(7), np.ones((7, 4), np.float32))
    ee.save(directory, tables=[t], incremental=True)
    assert [(k["kind"], k["seq"]) for k in _links(directory, t.name)] == [
        ("base", 3),
        ("delta", 4),
    ]
    _assert_same(_restored(directory, t), _state(t))


def test_compaction_leaves_ordinary_checkpoints_alone(tmp_path: Path) -> None:
    t = ee.Table(dim=2, name=_name())
    t.push(np.arange(3), np.ones((3, 2), np.float32))
    ee.save(tmp_path, tables=[t])
    manifest = (tmp_path / "manifest.json").read_bytes()
    checkpoint.compact(tmp_path)
    assert (tmp_path / "manifest.json").read_bytes() == manifest
    with pytest.raises(CheckpointError, match="missing"):
        checkpoint.compact(tmp_path / "nothing")


# Saves while training goes on.


def test_a_push_during_a_save_goes_to_the_next_delta(tmp_path: Path, monkeypatch) -> None:
    t = ee.Table(dim=2, optimizer=eo.SGD(0.5), initializer="zeros", name=_name())
    t.push(np.arange(10), np.ones((10, 2), np.float32))
    ee.save(tmp_path, tables=[t], incremental=True)
    t.push(np.array([1]), np.ones((1, 2), np.float32))
    write_data = files._write_data
    during: list[dict[str, Any]] = []

    def write_while_training(*args: Any) -> Any:
        # The change set is taken; another thread trains while it is written.
        worker = threading.Thread(
            target=lambda: t.push(np.array([2, 99]), np.ones((2, 2), np.float32))
        )
        worker.start()
        worker.join()
        during.append(_state(t))
        return write_data(*args)

    monkeypatch.setattr(files, "_write_data", write_while_training)
    ee.save(tmp_path, tables=[t], incremental=True)
    monkeypatch.undo()
    delta = _links(tmp_path, t.name)[-1]
    assert _read_delta(tmp_path, delta, 2, 0) == ({1}, set())
    assert delta["iterations"] == 2
    assert _restored(tmp_path, t)["iterations"] == 2
    ee.save(tmp_path, tables=[t], incremental=True)
    assert _read_delta(tmp_path, _links(tmp_path, t.name)[-1], 2, 0) == ({2, 99}, set())
    _assert_same(_restored(tmp_path, t), during[0])
    _assert_same(_restored(tmp_path, t), _state(t))


def test_concurrent_training_and_saves_lose_no_change(tmp_path: Path) -> None:
    """Pushers, inserting pullers and an eraser run while deltas are saved in a loop.

    Plain SGD with gradient 1 and learning rate 0.5 is exact in float32, so the
    live table is known in closed form; every delta chain restores it exactly.
    """
    t = ee.Table(dim=2, optimizer=eo.SGD(0.5), initializer="zeros", name=_name())
    keys = np.arange(2000, dtype=np.int64)
    t.pull(keys)
    ee.save(tmp_path, tables=[t], incremental=True, max_deltas=1000)
    stop = threading.Event()
    pushes = [0, 0]

    def pusher(i: int) -> None:
        rng = np.random.default_rng(i)
        while not stop.is_set():
            some = rng.choice(keys, 100, replace=False)
            t.push(some, np.ones((100, 2), np.float32))
            pushes[i] += 1

    def churn() -> None:
        k = 10**6
        while not stop.is_set():
            t.pull(np.arange(k, k + 10))
            t.erase(np.arange(k - 10, k - 5))
            k += 10

    threads = [threading.Thread(target=pusher, args=(i,)) for i in range(2)]
    threads.append(threading.Thread(target=churn))
    for th in threads:
        th.start()
    try:
        for _ in range(15):
            ee.save(tmp_path, tables=[t], incremental=True, max_deltas=1000)
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert sum(pushes) > 0
    ee.save(tmp_path, tables=[t], incremental=True, max_deltas=1000)
    assert len(_links(tmp_path, t.name)) == 17
    live = _state(t)
    assert live["iterations"] == sum(pushes)
    # -0.5 per push of a key: the counts say how often each key was pushed.
    base = live["keys"] < 10**6
    np.testing.assert_array_equal(live["values"][base, 0], -0.5 * live["update_count"][base])
    assert live["update_count"][base].sum() == 100 * sum(pushes)
    _assert_same(_restored(tmp_path, t), live)


# Clones and the Keras callback.


def test_a_clone_shares_files_and_continues_the_chain(chain, tmp_path_factory) -> None:
    directory, t = chain
    copy = tmp_path_factory.mktemp("clone") / "tables"
    checkpoint.clone(directory, copy)
    for link in _links(directory, t.name):
        assert os.path.samefile(directory / link["file"], copy / link["file"])
    t.push(np.arange(4), np.ones((4, 4), np.float32))
    ee.save(copy, tables=[t], incremental=True)
    assert len(_links(copy, t.name)) == 5
    assert len(_links(directory, t.name)) == 4  # the source is untouched
    _assert_same(_restored(copy, t), _state(t))
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        checkpoint.clone(directory, copy)


def test_checkpoint_callback_writes_deltas_and_resumes(tmp_path: Path) -> None:
    keras = pytest.importorskip("keras")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 400, (256, 3)).astype(np.int64)
    y = rng.normal(size=(256, 1)).astype(np.float32)

    def build(name: str) -> Any:
        layer = ee.Embedding(4, optimizer=ee.optimizers.Adagrad(0.3), name=name)
        inp = keras.Input((3,), dtype="int64")
        out = keras.layers.Dense(1)(keras.layers.Flatten()(layer(inp)))
        model = keras.Model(inp, out)
        model.compile(optimizer="sgd", loss="mse")
        return model, layer

    name = _name("cb")
    model, layer = build(name)
    states = []

    class Snapshot(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            states.append(_state(layer.table))

    callback = ee.callbacks.Checkpoint(tmp_path, incremental=True, max_to_keep=3)
    # Snapshot runs after the Checkpoint callback: it sees what was saved.
    model.fit(x, y, batch_size=64, epochs=4, verbose=0, callbacks=[callback, Snapshot()])
    saved = sorted(tmp_path.glob("ckpt-*"), key=lambda p: int(p.name.split("-")[1]))
    assert [p.name for p in saved] == ["ckpt-8", "ckpt-12", "ckpt-16"]
    for i, ckpt in enumerate(saved):
        links = _links(ckpt / "tables", name)
        assert [k["kind"] for k in links] == ["base"] + ["delta"] * (i + 1)
        # Each checkpoint is complete; earlier links are the same files, not copies.
        if i:
            previous = saved[i - 1] / "tables"
            for link in links[:-1]:
                assert os.path.samefile(ckpt / "tables" / link["file"], previous / link["file"])
        _assert_same(_restored(ckpt / "tables", layer.table), states[i + 1])
    # A new model resumes from the latest checkpoint.
    resumed, resumed_layer = build(name)
    resumed.fit(
        x,
        y,
        batch_size=64,
        epochs=4,
        verbose=0,
        callbacks=[ee.callbacks.Checkpoint(tmp_path, incremental=True)],
    )
    _assert_same(_state(resumed_layer.table), states[-1])
