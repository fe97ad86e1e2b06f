"""Deltas of exported models (`ee.export_delta`, `ee.apply_delta`). The reference is a fresh
full export of the same model: its checkpoint tensors bit for bit, and its predictions
in the test process against the applied version's in a fresh process (TF2 and TF1 loaders)
where importing elastic_emb is blocked.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from _saved_models import check_in_fresh_process, features_model, inputs

import elastic_emb as ee
from elastic_emb import cli
from elastic_emb.serving import export as serving


def _fit(model: keras.Model, rng: np.random.Generator, lo: int, hi: int) -> dict:
    x = inputs(rng, 128, lo, hi)
    model.fit(x, rng.normal(size=(128, 1)), batch_size=32, epochs=1, verbose=0)
    return x


def _tensors(path: Path) -> dict[str, bytes]:
    return {name: array.tobytes() for name, array in serving.saved_state(path).items()}


def _flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 1
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("row_dtype", ["float32", "int8"])
def test_a_base_and_its_deltas_serve_exactly_as_a_fresh_export(tmp_path, row_dtype):
    rng = np.random.default_rng(0)
    model = features_model()
    _fit(model, rng, 0, 40)
    ee.export_saved_model(model, tmp_path / "ctr" / "1", row_dtype=row_dtype)
    # Ids 30..59: old rows change, new rows appear; then rows are erased.
    second = _fit(model, rng, 30, 60)
    user = model.get_layer("exp_user").table
    assert user.erase(np.arange(5)) == 5  # trained before, not since
    delta = ee.export_delta(model, tmp_path / "delta-2", since=tmp_path / "ctr" / "1")
    assert ee.apply_delta(tmp_path / "ctr" / "1", tmp_path / "delta-2") == tmp_path / "ctr" / "2"
    if row_dtype == "float32":  # exactly the rows trained since, and the erased ones
        assert delta["tables"]["exp_user"] == {"upserted": len(set(second["user"])), "erased": 5}
        assert delta["tables"]["exp_items"]["upserted"] == len(set(second["items"].ravel()))
        assert delta["tables"]["exp_city"]["upserted"] == len(set(second["city"]))
    assert len(delta["dense"]) >= 2  # the Dense kernel and bias moved
    # A second delta, from the applied version.
    third = _fit(model, rng, 50, 80)
    items = model.get_layer("exp_items").table
    assert items.erase(np.arange(10)) == 10
    ee.export_delta(model, tmp_path / "delta-3", since=tmp_path / "ctr" / "2")
    assert ee.apply_delta(tmp_path / "ctr" / "2", tmp_path / "delta-3") == tmp_path / "ctr" / "3"
    ee.export_saved_model(model, tmp_path / "full", row_dtype=row_dtype)

    assert _tensors(tmp_path / "ctr" / "3") == _tensors(tmp_path / "full")
    manifest = serving.read_manifest(tmp_path / "ctr" / "3")
    assert [h["delta"] for h in manifest["history"]] == [
        json.loads((tmp_path / d / "delta.json").read_text())["id"] for d in ("delta-2", "delta-3")
    ]
    assert manifest["variables_sha256"] == serving.variables_digest(tmp_path / "ctr" / "3")
    fresh = tf.saved_model.load(str(tmp_path / "full"))
    probe = {k: np.concatenate([a[:40], b[:40]]) for (k, a), b in zip(
        second.items(), third.values(), strict=True)}  # fmt: skip
    probe["user"][:5] = np.arange(5)  # erased: initial values again
    unseen = inputs(rng, 16, 10**9, 10**12)
    cases = {
        name: (x, fresh.serve({k: tf.constant(v) for k, v in x.items()}).numpy())
        for name, x in (("seen", probe), ("unseen", unseen))
    }
    ctr = tmp_path / "ctr"
    assert check_in_fresh_process(ctr, cases, "3") == 0.0
    assert check_in_fresh_process(ctr, cases, "1") > 1e-4  # the check can fail: v1 is older
    if row_dtype == "float32":
        assert np.abs(cases["seen"][1] - model.predict(probe, verbose=0)).max() <= 1e-6


def test_a_delta_applies_only_to_the_version_it_was_made_from(tmp_path, capsys):
    rng = np.random.default_rng(1)
    model = features_model()
    _fit(model, rng, 0, 40)
    base = tmp_path / "ctr" / "1"
    model.export(base, verbose=False)
    _fit(model, rng, 20, 60)
    ee.export_delta(model, tmp_path / "delta", since=base)
    with pytest.raises(ValueError, match="exists"):
        ee.export_delta(model, tmp_path / "delta", since=base)
    ee.export_saved_model(model, tmp_path / "other" / "1")  # newer: not the delta's base
    tampered = tmp_path / "tampered" / "1"
    shutil.copytree(base, tampered)
    _flip_a_byte(next((tampered / "variables").glob("variables.data-*")))
    for wrong in (tmp_path / "other" / "1", tampered):
        with pytest.raises(ValueError, match="made from another version"):
            ee.apply_delta(wrong, tmp_path / "delta")
        assert sorted(p.name for p in wrong.parent.iterdir()) == ["1"]  # nothing written
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "delta", damaged)
    _flip_a_byte(next(damaged.glob("delta.data-*")))
    with pytest.raises(ValueError, match="missing or damaged"):
        ee.apply_delta(base, damaged)
    with pytest.raises(ValueError, match="not a delta"):
        ee.apply_delta(base, tmp_path / "other")
    with pytest.raises(ValueError, match="exists"):
        ee.apply_delta(base, tmp_path / "delta", output=tmp_path / "other" / "1")
    # The CLI, on a copy of the base (a delta names its base by content, not by path).
    copy = tmp_path / "copy" / "7"
    shutil.copytree(base, copy)
    assert cli.main(["apply-delta", str(copy), str(tmp_path / "delta")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "copy" / "8")
    assert cli.main(["apply-delta", str(tampered), str(tmp_path / "delta")]) == 1
    assert "made from another version" in capsys.readouterr().err
    ee.export_saved_model(model, tmp_path / "full")
    assert _tensors(tmp_path / "copy" / "8") == _tensors(tmp_path / "full")


def _small(dim: int = 4, units: int = 1) -> keras.Model:
    ids = keras.Input((), dtype="int64", name="ids")
    out = keras.layers.Dense(units, name="delta_dense")(ee.Embedding(dim, name="delta_ids")(ids))
    model = keras.Model({"ids": ids}, out)
    model.predict({"ids": np.arange(8)}, verbose=0)
    return model


def test_export_delta_refuses_what_a_delta_cannot_express(tmp_path):
    ee.export_saved_model(_small(), tmp_path / "base")
    with pytest.raises(ValueError, match="The table of layer 'delta_ids'"):
        ee.export_delta(_small(dim=5), tmp_path / "d1", since=tmp_path / "base")
    with pytest.raises(ValueError, match=r"'delta_dense/(kernel|bias)' is float32"):
        ee.export_delta(_small(units=2), tmp_path / "d2", since=tmp_path / "base")
    with pytest.raises(ValueError, match=r"ee\.Embedding layers"):
        ee.export_delta(features_model(), tmp_path / "d3", since=tmp_path / "base")
    (tmp_path / "base" / serving.MANIFEST).unlink()
    with pytest.raises(ValueError, match="no elastic_emb manifest"):
        ee.export_delta(_small(), tmp_path / "d4", since=tmp_path / "base")
    with pytest.raises(ValueError, match="not a SavedModel"):
        ee.export_delta(_small(), tmp_path / "d5", since=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]  # nothing written
