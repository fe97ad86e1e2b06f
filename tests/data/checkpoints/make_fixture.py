"""Writes the checkpoint fixtures that tests/test_upgrades.py restores.

    python tests/data/checkpoints/make_fixture.py OUTPUT_DIR

writes, in OUTPUT_DIR:

- `format-1/`: an ordinary checkpoint (`ee.save`, manifest version 1) of four
  small tables: int64 keys at both ends of the int64 range with Adagrad,
  Adam with an LRU eviction policy and `nonfinite="skip"`, hashed string keys
  with Ftrl and L1, and SGD with momentum and the smallest admission sketch (4 KiB);
- `format-2/`: an incremental checkpoint (`ee.save(..., incremental=True)`,
  manifest version 2) of two tables, each a base and one delta: one delta
  with updated, new and erased rows, one with no rows at all;
- `expected.npz`: what went in, written in the same run but apart from the
  checkpoints: every push (keys and gradients), the initial row of every key
  touched and of a few keys never trained, the strings behind the hashed
  keys, and each table's state after the save (keys sorted, values, slots,
  metadata, step count, admission counts), plus one more push per table for
  the test to apply after restoring.

The files in this directory were written by elastic_emb 0.1.0 (checkpoint
format versions 1 and 2). They are the previous release's checkpoints for
every later release: never regenerate a committed `format-N/`. When the
format changes, write the new fixture into a new directory and keep the old
one (see README.md here).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import elastic_emb as ee
from elastic_emb.keras.layers import string_keys

F32 = np.float32
I64 = np.int64

# Keys at the ends of the int64 range, negative and zero: a reader must keep all 64 bits.
EDGE_KEYS = np.array([-(2**63), -(2**40) - 3, -1, 0, 1, 5, 2**53 + 1, 2**63 - 1], I64)
UNSEEN = np.array([-7, 123_456_789, 2**62 + 9], I64)  # keys no table trains
WORDS = ["", "the", "elastic", "embedding", "table", "ünïcode", "ids"]


def _tables() -> dict[str, ee.Table]:
    """The tables of format-1/ (fresh, empty)."""
    return {
        "fixture_users": ee.Table(
            dim=4,
            optimizer=ee.optimizers.Adagrad(learning_rate=0.5, initial_accumulator_value=0.1),
            initializer="uniform",
            name="fixture_users",
            seed=7,
        ),
        "fixture_items": ee.Table(
            dim=3,
            optimizer=ee.optimizers.Adam(learning_rate=0.1),
            initializer=keras.initializers.RandomNormal(stddev=0.1),
            name="fixture_items",
            seed=11,
            nonfinite="skip",
            eviction=ee.eviction.LRU(max_rows=1000),
        ),
        "fixture_words": ee.Table(
            dim=2,
            optimizer=ee.optimizers.Ftrl(learning_rate=0.5, l1_regularization_strength=0.01),
            initializer="truncated_normal",
            name="fixture_words",
            seed=13,
        ),
        "fixture_clicks": ee.Table(
            dim=2,
            optimizer=ee.optimizers.SGD(learning_rate=0.25, momentum=0.5),
            initializer="zeros",
            name="fixture_clicks",
            seed=17,
            admission=ee.admission.Frequency(min_count=2, sketch_bytes=4096, sketch_depth=1),
        ),
    }


def _chain_tables() -> dict[str, ee.Table]:
    """The tables of format-2/ (fresh, empty)."""
    return {
        "fixture_events": ee.Table(
            dim=2,
            optimizer=ee.optimizers.Adagrad(learning_rate=0.25),
            initializer=keras.initializers.Constant(0.5),
            name="fixture_events",
            seed=5,
        ),
        "fixture_static": ee.Table(
            dim=2,
            optimizer=ee.optimizers.SGD(learning_rate=0.5),
            initializer="ones",
            name="fixture_static",
            seed=3,
        ),
    }


def _string_keys(words: list[str]) -> np.ndarray:
    """The int64 keys of `ee.Embedding(key_dtype="string")` for `words` (tf.fingerprint)."""
    return np.asarray(string_keys(tf.constant(words)), I64)


def _pushes(rng: np.random.Generator, pool: np.ndarray, dim: int, count: int) -> list[Any]:
    """`count` pushes of 6 keys drawn from `pool` (duplicates included), gradients
    multiples of 1/8."""
    out = []
    for _ in range(count):
        keys = rng.choice(pool, size=6)
        grads = (rng.integers(-8, 9, size=(6, dim)) / 8).astype(F32)
        out.append((keys.astype(I64), grads))
    return out


def _train(table: ee.Table, pushes: list[Any]) -> None:
    """Each push as a training step does it: a training pull (inserts), then the push."""
    for keys, grads in pushes:
        if table.admission is None:
            table.pull(keys, train=True)
        table.push(keys, grads)


def _record(arrays: dict[str, np.ndarray], name: str, table: ee.Table, prefix: str = "") -> None:
    """`table`'s whole state, sorted by key, under `name.<field>`."""
    state = table.export_state()
    order = np.argsort(state.keys)
    for field in ("keys", "values", "slots", "last_step", "update_count"):
        arrays[f"{name}.{prefix}{field}"] = getattr(state, field)[order]
    arrays[f"{name}.{prefix}iterations"] = np.array(state.iterations, I64)
    if state.counts is not None:
        arrays[f"{name}.{prefix}counts"] = state.counts


def _initial(arrays: dict[str, np.ndarray], name: str, table: ee.Table, keys: np.ndarray) -> None:
    """Initial rows of `keys` (before any push) and of `UNSEEN` keys, never trained."""
    everything = np.unique(np.concatenate([keys, UNSEEN]))
    arrays[f"{name}.initial_keys"] = everything
    arrays[f"{name}.initial_rows"] = table.pull(everything, train=False)


def _store_pushes(arrays: dict[str, np.ndarray], name: str, pushes: list[Any], tag: str) -> None:
    """The pushes, concatenated: `name.tag_keys`, `name.tag_grads`, and `name.tag_sizes`
    (the number of keys of each push, in order)."""
    arrays[f"{name}.{tag}_keys"] = np.concatenate([keys for keys, _ in pushes])
    arrays[f"{name}.{tag}_grads"] = np.concatenate([grads for _, grads in pushes])
    arrays[f"{name}.{tag}_sizes"] = np.array([len(keys) for keys, _ in pushes], I64)


def write(output: Path) -> None:
    """Writes format-1/, format-2/ and expected.npz into `output` (which must not hold them)."""
    for existing in ("format-1", "format-2", "expected.npz"):
        if (output / existing).exists():
            raise SystemExit(
                f"{output / existing} exists: the committed fixtures are the previous release's "
                "checkpoints and are never regenerated; write into another directory"
            )
    output.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20261129)
    arrays: dict[str, np.ndarray] = {"words.strings": np.array(WORDS)}
    word_keys = _string_keys(WORDS)
    arrays["words.keys"] = word_keys
    pools = {
        "fixture_users": EDGE_KEYS,
        "fixture_items": np.arange(-3, 9, dtype=I64) * 1_000_003,
        "fixture_words": word_keys,
        "fixture_clicks": np.array([2, 4, 8, 16, 32], I64),
    }

    tables = _tables()
    for name, table in tables.items():
        pushes = _pushes(rng, pools[name], table.dim, 4)
        _initial(arrays, name, table, pools[name])
        _train(table, pushes)
        _store_pushes(arrays, name, pushes, "push")
        _store_pushes(arrays, name, _pushes(rng, pools[name], table.dim, 1), "next")
    ee.save(output / "format-1", tables=list(tables.values()))
    for name, table in tables.items():
        _record(arrays, name, table)

    chain = _chain_tables()
    events, static = chain["fixture_events"], chain["fixture_static"]
    event_keys = np.array([10, 20, 30, 40], I64)
    _initial(arrays, "fixture_events", events, np.append(event_keys, 50))
    _initial(arrays, "fixture_static", static, np.array([1, 2], I64))
    base_pushes = _pushes(rng, event_keys, 2, 2)
    _train(events, base_pushes)
    static_pushes = [(np.array([1, 2, 2], I64), np.array([[1, -1], [0.5, 0.25], [-2, 4]], F32))]
    _train(static, static_pushes)
    ee.save(output / "format-2", tables=[events, static], incremental=True)  # the bases
    # Then the delta: a new key (50), an update of two keys, an erased key (20).
    delta_pushes = [
        (np.array([50, 10, 10, 30], I64), np.array([[1, 1], [-1, 2], [3, -1], [0.5, 0]], F32))
    ]
    _train(events, delta_pushes)
    events.erase(np.array([20], I64))
    ee.save(output / "format-2", tables=[events, static], incremental=True)  # the deltas
    _store_pushes(arrays, "fixture_events", base_pushes + delta_pushes, "push")
    arrays["fixture_events.erased"] = np.array([20], I64)
    _store_pushes(arrays, "fixture_static", static_pushes, "push")
    next_pools = {"fixture_events": np.array([10, 30, 50, UNSEEN[0]]), "fixture_static": UNSEEN}
    for name, table in chain.items():
        _store_pushes(arrays, name, _pushes(rng, next_pools[name], 2, 1), "next")
        _record(arrays, name, table)

    np.savez_compressed(output / "expected.npz", **arrays)
    manifest = json.loads((output / "format-2" / "manifest.json").read_text())
    kinds = {n: [link["kind"] for link in e["links"]] for n, e in manifest["tables"].items()}
    print(f"wrote {output}: format-2 chains {kinds}; elastic_emb {ee.__version__}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="a directory without fixtures in it")
    write(parser.parse_args(argv).output)


if __name__ == "__main__":
    main(sys.argv[1:])
