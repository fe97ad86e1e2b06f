"""What an upgrade keeps (docs/upgrades.md): checkpoints written by an earlier release.

`tests/data/checkpoints/format-1/` (an ordinary checkpoint, manifest version 1)
and `format-2/` (an incremental one, version 2: a base and a delta per
table) were written by elastic_emb 0.1.0 (`make_fixture.py` there) and are
never regenerated. This release restores them, and every key, value,
optimizer slot, metadata field, step count and admission count must come
back bit for bit as `expected.npz` (stored in the same run, apart from the
checkpoints) has them. Independently of both, a NumPy replay of the recorded
pushes from the recorded initial rows (`_numpy_reference`, Keras's formulas)
must give the same rows, and one more push after the restore must too: that
needs the slots in their order and the step count as the format defines
them. The configurations are checked against literals written here.

A checkpoint claiming a format version this release does not know is refused
with `CheckpointError` naming the version, before any table or file changes.
"""

from __future__ import annotations

import gc
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from _numpy_reference import ReferenceTable

import elastic_emb as ee
from elastic_emb.tables.registry import registered_tables

FIXTURES = Path(__file__).resolve().parent / "data" / "checkpoints"
EXPECTED = dict(np.load(FIXTURES / "expected.npz"))
UNSEEN = np.array([-7, 123_456_789, 2**62 + 9], np.int64)  # no table trained them

# What each table was made with (tests/data/checkpoints/make_fixture.py), written out:
# (optimizer kind and arguments for the replay, the restored table's configuration).
TABLES = {
    "fixture_users": {
        "dim": 4,
        "seed": 7,
        "optimizer": {"class_name": "Adagrad", "learning_rate": 0.5},
        "initializer": {"kind": "uniform", "a": -0.05, "b": 0.05},
    },
    "fixture_items": {
        "dim": 3,
        "seed": 11,
        "optimizer": {"class_name": "Adam", "learning_rate": 0.1},
        "initializer": {"kind": "normal", "a": 0.0, "b": 0.1},
        "nonfinite": "skip",
        "eviction": {"kind": "lru", "max_rows": 1000, "protect_steps": 1},
    },
    "fixture_words": {
        "dim": 2,
        "seed": 13,
        "optimizer": {
            "class_name": "Ftrl",
            "learning_rate": 0.5,
            "l1_regularization_strength": 0.01,
        },
        "initializer": {"kind": "truncated_normal", "a": 0.0, "b": 0.05},
    },
    "fixture_clicks": {
        "dim": 2,
        "seed": 17,
        "optimizer": {"class_name": "SGD", "learning_rate": 0.25, "momentum": 0.5},
        "initializer": {"kind": "zeros", "a": 0.0, "b": 0.0},
        "admission": {"kind": "frequency", "min_count": 2, "sketch_bytes": 4096, "sketch_depth": 1},
    },
    "fixture_events": {
        "dim": 2,
        "seed": 5,
        "optimizer": {"class_name": "Adagrad", "learning_rate": 0.25},
        "initializer": {"kind": "constant", "a": 0.5, "b": 0.0},
    },
    "fixture_static": {
        "dim": 2,
        "seed": 3,
        "optimizer": {"class_name": "SGD", "learning_rate": 0.5},
        "initializer": {"kind": "ones", "a": 0.0, "b": 0.0},
    },
}
FORMAT_1 = ["fixture_clicks", "fixture_items", "fixture_users", "fixture_words"]
FORMAT_2 = ["fixture_events", "fixture_static"]
STATE = ("keys", "values", "slots", "last_step", "update_count")


def _copy(name: str, tmp_path: Path) -> Path:
    """A copy of the fixture directory `name` (restores never write, but the tests edit)."""
    gc.collect()  # no live table of an earlier test keeps a fixture table's name
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


def _pushes(name: str, tag: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """The recorded pushes `tag` ("push": before the save, "next": after the restore)."""
    bounds = np.cumsum(EXPECTED[f"{name}.{tag}_sizes"])[:-1]
    keys = np.split(EXPECTED[f"{name}.{tag}_keys"], bounds)
    grads = np.split(EXPECTED[f"{name}.{tag}_grads"], bounds)
    return list(zip(keys, grads, strict=True))


def _initial_rows(name: str) -> dict[int, np.ndarray]:
    """The recorded initial row of each key the table `name` trained, and of `UNSEEN`."""
    keys, rows = EXPECTED[f"{name}.initial_keys"], EXPECTED[f"{name}.initial_rows"]
    return dict(zip(keys.tolist(), rows, strict=True))


class _Replay:
    """A NumPy replay of a table's pushes from the recorded initial rows, with its
    metadata (step of the last update, number of updates) and admission (an id gets a row
    at the push that brings its count of pushes to min_count; gradients before are dropped)."""

    def __init__(self, name: str):
        spec = TABLES[name]
        optimizer = dict(spec["optimizer"])
        self.kind = optimizer.pop("class_name").lower()
        self.lr = optimizer.pop("learning_rate")
        initial = _initial_rows(name)
        self.ref = ReferenceTable(self.kind, spec["dim"], lambda k: initial[k], **optimizer)
        self.min_count = spec.get("admission", {}).get("min_count", 1)
        self.counts: dict[int, int] = {}
        self.last_step: dict[int, int] = {}
        self.update_count: dict[int, int] = {}

    def push(self, keys: np.ndarray, grads: np.ndarray) -> None:
        for key in set(keys.tolist()):
            self.counts[key] = self.counts.get(key, 0) + 1
        admitted = np.array([self.counts[k] >= self.min_count for k in keys.tolist()], bool)
        keys, grads = keys[admitted], grads[admitted]
        if self.min_count == 1:
            self.ref.pull(keys)  # the training pull before the push
        self.ref.push(keys, grads, self.lr)
        for key in set(keys.tolist()):
            self.last_step[key] = self.ref.iterations
            self.update_count[key] = self.update_count.get(key, 0) + 1

    def erase(self, keys: np.ndarray) -> None:
        for key in keys.tolist():
            for rows in (self.ref.values, self.ref.slots, self.last_step, self.update_count):
                rows.pop(key, None)

    def check(self, state: ee.table.TableState) -> None:
        """`state` holds exactly the replayed rows, within float32 rounding of the formulas."""
        keys = np.array(sorted(self.ref.values), np.int64)
        order = np.argsort(state.keys)
        np.testing.assert_array_equal(state.keys[order], keys)
        values, slots = self.ref.rows(keys)
        np.testing.assert_allclose(state.values[order], values, rtol=2e-6, atol=1e-7)
        np.testing.assert_allclose(state.slots[order], slots, rtol=2e-6, atol=1e-7)
        np.testing.assert_array_equal(state.last_step[order], [self.last_step[k] for k in keys])
        want = [self.update_count[k] for k in keys]
        np.testing.assert_array_equal(state.update_count[order], want)
        assert state.iterations == self.ref.iterations


def _replayed(name: str) -> _Replay:
    replay = _Replay(name)
    for keys, grads in _pushes(name, "push"):
        replay.push(keys, grads)
    if f"{name}.erased" in EXPECTED:
        replay.erase(EXPECTED[f"{name}.erased"])
    return replay


def _check_restored(name: str, table: ee.Table) -> None:
    spec = TABLES[name]
    config = table.config()
    assert {k: config[k] for k in ("dim", "seed", "initializer")} == {
        k: spec[k] for k in ("dim", "seed", "initializer")
    }, name
    assert {k: config["optimizer"][k] for k in spec["optimizer"]} == spec["optimizer"], name
    assert config["nonfinite"] == spec.get("nonfinite", "raise")
    for policy in ("admission", "eviction"):
        assert config.get(policy) == spec.get(policy), (name, policy)
    # Bit for bit what was saved: every key, value, slot, metadata field, count.
    state = table.export_state()
    order = np.argsort(state.keys)
    for field in STATE:
        np.testing.assert_array_equal(
            getattr(state, field)[order], EXPECTED[f"{name}.{field}"], f"{name}.{field}"
        )
        assert getattr(state, field).dtype == EXPECTED[f"{name}.{field}"].dtype
    assert state.iterations == int(EXPECTED[f"{name}.iterations"])
    if f"{name}.counts" in EXPECTED:
        np.testing.assert_array_equal(state.counts, EXPECTED[f"{name}.counts"])
    else:
        assert state.counts is None
    # Ids never trained still get the initial rows they had (a function of seed and key).
    initial = _initial_rows(name)
    np.testing.assert_array_equal(
        table.pull(UNSEEN, train=False), np.stack([initial[k] for k in UNSEEN.tolist()])
    )
    assert len(table) == len(EXPECTED[f"{name}.keys"])  # the lookup inserted nothing


def _check_training_goes_on(name: str, table: ee.Table) -> None:
    """The replay agrees with the saved rows, and still does after one more push on both."""
    replay = _replayed(name)
    replay.check(table.export_state())
    for keys, grads in _pushes(name, "next"):
        if table.admission is None:
            table.pull(keys, train=True)
        table.push(keys, grads)
        replay.push(keys, grads)
    replay.check(table.export_state())


@pytest.mark.parametrize(("directory", "names"), [("format-1", FORMAT_1), ("format-2", FORMAT_2)])
def test_a_checkpoint_of_the_previous_release_restores_exactly(tmp_path, directory, names):
    copy = _copy(directory, tmp_path)
    manifest = json.loads((copy / "manifest.json").read_text())
    assert manifest["version"] == int(directory[-1])  # what the fixture is
    restored = ee.restore(copy)
    assert sorted(restored) == names
    for name in names:
        _check_restored(name, restored[name])
    for name in names:
        _check_training_goes_on(name, restored[name])


def test_the_chain_fixture_holds_a_base_and_a_delta_with_an_erased_key():
    tables = json.loads((FIXTURES / "format-2" / "manifest.json").read_text())["tables"]
    links = {
        name: [(link["kind"], link["num_erased"]) for link in e["links"]]
        for name, e in tables.items()
    }
    assert links == {
        "fixture_events": [("base", 0), ("delta", 1)],
        "fixture_static": [("base", 0), ("delta", 0)],
    }
    assert [link["num_rows"] for link in tables["fixture_static"]["links"]] == [2, 0]


def test_hashed_string_keys_are_the_keys_the_checkpoint_holds():
    import tensorflow as tf

    from elastic_emb.keras.layers import string_keys

    keys = np.asarray(string_keys(tf.constant([str(s) for s in EXPECTED["words.strings"]])))
    np.testing.assert_array_equal(keys, EXPECTED["words.keys"])
    # Every word was pushed, so the string-keyed table's rows are exactly these keys.
    np.testing.assert_array_equal(EXPECTED["fixture_words.keys"], np.sort(keys))


def _live_tables(names: list[str], manifest: dict) -> dict[str, ee.Table]:
    """Live tables with the checkpoint's names and configurations, each holding one row."""
    live = {}
    for name in names:
        entry = manifest["tables"][name]
        config = {k: entry[k] for k in ("dim", "seed", "optimizer", "initializer")}
        live[name] = ee.Table.from_config({"name": name, **config})
        live[name].import_rows([424242], np.full((1, entry["dim"]), 0.125, np.float32))
    return live


@pytest.mark.parametrize(
    ("directory", "names", "version"), [("format-1", FORMAT_1, 99), ("format-2", FORMAT_2, 100)]
)
def test_a_checkpoint_of_an_unknown_future_version_is_refused_and_nothing_is_lost(
    tmp_path, directory, names, version
):
    copy = _copy(directory, tmp_path)
    manifest = json.loads((copy / "manifest.json").read_text())
    live = _live_tables(names[:1], manifest)
    manifest["version"] = version
    (copy / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    files = _digests(copy)
    with pytest.raises(ee.CheckpointError) as error:
        ee.restore(copy)
    # The message names the file, the version found and the versions this release reads.
    message = f"{copy / 'manifest.json'} has format version {version}; this release reads "
    assert str(error.value).startswith(message) and "1 and 2" in str(error.value)
    for table in live.values():  # the live table is as it was
        state = table.export_state()
        np.testing.assert_array_equal(state.keys, [424242])
        np.testing.assert_array_equal(state.values, 0.125)
        assert state.iterations == 0
    assert sorted(set(names) & set(registered_tables())) == names[:1]  # none was created
    assert _digests(copy) == files  # the checkpoint is untouched


def test_an_incremental_checkpoint_labelled_version_1_is_refused(tmp_path):
    copy = _copy("format-2", tmp_path)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["version"] = 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ee.CheckpointError, match="does not fit format version 1"):
        ee.restore(copy)
