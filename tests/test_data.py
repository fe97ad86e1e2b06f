"""Tests of `ee.data` (elastic_emb.examples.criteo): Criteo generation, parsing, AUC, tf.data."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from elastic_emb import data as ee_data

NUM_FIELDS = 40


def _python_parse(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An independent, line-by-line reference parser (str.split, int(x), int(x, 16))."""
    opener = gzip.open if path.suffix == ".gz" else open
    dense, categorical, labels = [], [], []
    with opener(path, "rt", newline="") as f:
        for line in f:
            fields = line.rstrip("\r\n").split("\t")
            assert len(fields) == NUM_FIELDS
            labels.append(float(fields[0]))
            dense.append([int(x) if x else 0 for x in fields[1:14]])
            ids = [int(x, 16) if x else 0 for x in fields[14:]]
            categorical.append([i - (1 << 64) if i >= 1 << 63 else i for i in ids])
    return (
        np.array(dense, dtype=np.float32).reshape(-1, 13),
        np.array(categorical, dtype=np.int64).reshape(-1, 26),
        np.array(labels, dtype=np.float32),
    )


def _line(label: str = "1", dense: list[str] | None = None, cat: list[str] | None = None) -> str:
    dense = dense if dense is not None else [str(i) for i in range(13)]
    cat = cat if cat is not None else [f"{i + 1:08x}" for i in range(26)]
    return "\t".join([label, *dense, *cat]) + "\n"


@pytest.fixture(scope="module")
def small_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("criteo") / "small.tsv"
    info = ee_data.generate_criteo(path, 3000, seed=7)
    return path, info


@pytest.mark.parametrize("name", ["gen.tsv", "gen.tsv.gz"])
def test_round_trip_matches_reference_parser(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    info = ee_data.generate_criteo(path, 2000, seed=3)
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == name.endswith(".gz")

    dense, categorical, labels = ee_data.read_criteo(path)
    assert dense.shape == (2000, 13) and dense.dtype == np.float32
    assert categorical.shape == (2000, 26) and categorical.dtype == np.int64
    assert labels.shape == (2000,) and labels.dtype == np.float32
    assert set(np.unique(labels)) <= {0.0, 1.0}
    assert info["num_examples"] == 2000
    assert info["vocab_sizes"] == list(ee_data.DEFAULT_VOCAB_SIZES)
    assert np.all(categorical >= 0)
    assert np.all(categorical < np.array(info["vocab_sizes"]))
    assert np.all(dense >= 0)
    assert info["positive_rate"] == pytest.approx(labels.mean())
    # ~2% of the values are missing, read as 0; generated ids are never 0 otherwise.
    assert abs(np.mean(categorical == 0) - 0.02) < 0.005

    ref_dense, ref_cat, ref_labels = _python_parse(path)
    np.testing.assert_array_equal(dense, ref_dense)
    np.testing.assert_array_equal(categorical, ref_cat)
    np.testing.assert_array_equal(labels, ref_labels)

    # Small blocks: lines cut across many reads give the same arrays.
    blocks = list(ee_data.iter_criteo(path, block_bytes=1000))
    assert len(blocks) > 100
    np.testing.assert_array_equal(np.concatenate([b[1] for b in blocks]), ref_cat)
    np.testing.assert_array_equal(np.concatenate([b[0] for b in blocks]), ref_dense)

    head = ee_data.read_criteo(path, max_examples=123)
    np.testing.assert_array_equal(head[1], ref_cat[:123])


def test_generation_is_deterministic(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.tsv", tmp_path / "b.tsv", tmp_path / "c.tsv"
    ee_data.generate_criteo(a, 500, seed=1)
    ee_data.generate_criteo(b, 500, seed=1)
    ee_data.generate_criteo(c, 500, seed=1, sample_seed=2)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_no_missing_values_and_custom_vocab(tmp_path: Path) -> None:
    path = tmp_path / "v.tsv"
    vocab = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41] * 2
    ee_data.generate_criteo(path, 4000, seed=2, vocab_sizes=vocab, missing_rate=0.0)
    assert b"\t\t" not in path.read_bytes()
    _, categorical, _ = ee_data.read_criteo(path)
    assert np.all(categorical >= 1)
    assert np.all(categorical < np.array(vocab))
    assert np.all(categorical[:, 0] == 1)  # vocabulary size 2: the one real id
    for f, v in enumerate(vocab):  # every id of a small vocabulary shows up
        assert len(np.unique(categorical[:, f])) == v - 1


def test_zipf_skew(tmp_path: Path) -> None:
    path = tmp_path / "z.tsv"
    ee_data.generate_criteo(path, 20_000, seed=4, missing_rate=0.0)
    _, categorical, _ = ee_data.read_criteo(path)
    v = ee_data.DEFAULT_VOCAB_SIZES[2]  # 200,000 ids
    counts = np.sort(np.bincount(categorical[:, 2], minlength=v))[::-1]
    # The documented law: P(rank r) = (r^-0.1 - (r+1)^-0.1) / (1 - v^-0.1), r = 1 .. v-1.
    for r in [1, 2, 3, 10]:
        expected = 20_000 * (r**-0.1 - (r + 1) ** -0.1) / (1 - v**-0.1)
        assert abs(counts[r - 1] - expected) < 5 * np.sqrt(expected), r


def test_hand_written_lines(tmp_path: Path) -> None:
    dense1 = ["", "-1", "0", "42", "", "7", "-123", "100000", "", "3", "2", "1", "16777216"]
    cat1 = ["68fd1e64", "", "05db9164", "FFFFFFFF", "0", "a", "7fffffffffffffff"]
    cat1 += ["ffffffffffffffff"] + [""] * 18
    lines = (
        _line("0", dense1, cat1)
        + _line("1").replace("\n", "\r\n")  # Windows line end
        + _line("1", [""] * 13, [""] * 26).rstrip("\n")  # all missing, no final newline
    )
    path = tmp_path / "hand.tsv"
    path.write_text(lines, newline="")
    dense, categorical, labels = ee_data.read_criteo(path)

    np.testing.assert_array_equal(labels, [0.0, 1.0, 1.0])
    np.testing.assert_array_equal(dense[0], [0, -1, 0, 42, 0, 7, -123, 100000, 0, 3, 2, 1, 2**24])
    np.testing.assert_array_equal(dense[1], np.arange(13))
    np.testing.assert_array_equal(dense[2], np.zeros(13))
    expected = [0x68FD1E64, 0, 0x05DB9164, 0xFFFFFFFF, 0, 10, 2**63 - 1, -1] + [0] * 18
    np.testing.assert_array_equal(categorical[0], expected)
    np.testing.assert_array_equal(categorical[1], np.arange(1, 27))
    np.testing.assert_array_equal(categorical[2], np.zeros(26))


def test_gzip_detected_by_content(tmp_path: Path) -> None:
    path = tmp_path / "no_suffix"
    with gzip.open(path, "wt") as f:
        f.write(_line("1") * 3)
    _, categorical, labels = ee_data.read_criteo(path)
    assert labels.tolist() == [1.0, 1.0, 1.0]
    np.testing.assert_array_equal(categorical[2], np.arange(1, 27))


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("1\t2\t3\n", "expected 40 tab-separated fields"),
        (_line().replace("\t", "\t\t", 1), "found 41"),
        ("\n", "found 1"),
        (_line("2"), "label"),
        (_line(""), "label"),
        (_line("1", ["12x"] + ["1"] * 12), "I1 is not an integer"),
        (_line("1", ["1"] * 12 + ["-"]), "I13 is not an integer"),
        (_line("1", ["1"] * 5 + ["1.5"] + ["1"] * 7), "I6 is not an integer"),
        (_line("1", None, ["68fd1e6g"] + ["0"] * 25), "C1 is not hexadecimal"),
        (_line("1", None, ["0"] * 25 + ["-1"]), "C26 is not hexadecimal"),
        (_line("1", None, ["0"] * 3 + ["1" * 17] + ["0"] * 22), "C4 has more than 16"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, bad_line: str, message: str) -> None:
    path = tmp_path / "bad.tsv"
    path.write_text(_line("0") * 6 + bad_line + _line("1") * 3)
    with pytest.raises(ValueError, match="line 7") as err:
        ee_data.read_criteo(path)
    assert message in str(err.value)
    assert str(path) in str(err.value)
    # The same line number when the bad line is not in the first block read.
    with pytest.raises(ValueError, match="line 7"):
        list(ee_data.iter_criteo(path, block_bytes=300))
    # Lines before the bad one are readable on their own.
    assert ee_data.read_criteo(path, max_examples=6)[2].shape == (6,)


def test_auc_against_pairwise_count() -> None:
    rng = np.random.default_rng(0)
    for n in [2, 7, 50, 300]:
        labels = rng.integers(0, 2, n)
        labels[:2] = [0, 1]
        scores = np.round(rng.normal(size=n) + 0.5 * labels, 1)  # many ties
        pos, neg = scores[labels == 1], scores[labels == 0]
        diff = pos[:, None] - neg[None, :]
        expected = (np.sum(diff > 0) + 0.5 * np.sum(diff == 0)) / diff.size
        assert ee_data.auc(labels, scores) == pytest.approx(expected, abs=1e-12)
        assert ee_data.auc(labels.astype(bool), scores) == pytest.approx(expected, abs=1e-12)
    assert ee_data.auc([0, 1], [0.3, 0.3]) == 0.5
    assert ee_data.auc([0, 0, 1], [3.0, 2.0, 1.0]) == 0.0
    with pytest.raises(ValueError, match="both classes"):
        ee_data.auc([1, 1], [0.1, 0.2])
    with pytest.raises(ValueError, match="only 0 and 1"):
        ee_data.auc([0, 2], [0.1, 0.2])


def test_planted_signal(tmp_path: Path) -> None:
    path = tmp_path / "signal.tsv.gz"
    info = ee_data.generate_criteo(path, 40_000, seed=11)
    dense, categorical, labels = ee_data.read_criteo(path)
    probs = 1.0 / (1.0 + np.exp(-ee_data.planted_logits(dense, categorical, seed=11)))
    # The hidden model, evaluated on the values as read back, gives the reported oracle AUC.
    assert ee_data.auc(labels, probs) == pytest.approx(info["oracle_auc"], abs=1e-12)
    assert 0.78 < info["oracle_auc"] < 0.87
    assert 0.2 < info["positive_rate"] < 0.32
    # Labels are Bernoulli(probs): calibrated within each decile of the probability.
    order = np.argsort(probs)
    for part in np.array_split(order, 10):
        p, y = probs[part], labels[part]
        sd = np.sqrt(np.sum(p * (1 - p))) / len(part)
        assert abs(y.mean() - p.mean()) < 4 * sd
    # Another seed is another hidden model: its logits barely predict these labels.
    other = ee_data.planted_logits(dense, categorical, seed=12)
    assert ee_data.auc(labels, other) < info["oracle_auc"] - 0.1


def test_argument_validation(tmp_path: Path) -> None:
    path = tmp_path / "x.tsv"
    with pytest.raises(ValueError, match="vocab_sizes"):
        ee_data.generate_criteo(path, 10, vocab_sizes=[10] * 25)
    with pytest.raises(ValueError, match="vocab_sizes"):
        ee_data.generate_criteo(path, 10, vocab_sizes=[1] * 26)
    with pytest.raises(ValueError, match="num_examples"):
        ee_data.generate_criteo(path, -1)
    with pytest.raises(ValueError, match="missing_rate"):
        ee_data.generate_criteo(path, 10, missing_rate=1.0)
    with pytest.raises(ValueError, match="seed"):
        ee_data.generate_criteo(path, 10, seed=-1)
    with pytest.raises(ValueError, match="batch_size"):
        ee_data.criteo_dataset(path, 0)
    with pytest.raises(ValueError, match="shape"):
        ee_data.planted_logits(np.zeros((2, 12)), np.zeros((2, 26)))


def _collect(ds: tf.data.Dataset) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    dense, cat, labels, sizes = [], [], [], []
    for features, y in ds.as_numpy_iterator():
        dense.append(features["dense"])
        cat.append(features["categorical"])
        labels.append(y)
        sizes.append(len(y))
    return np.concatenate(dense), np.concatenate(cat), np.concatenate(labels), sizes


def test_dataset_structure_and_values(small_file: tuple[Path, dict]) -> None:
    path, _ = small_file
    dense, categorical, labels = ee_data.read_criteo(path)
    ds = ee_data.criteo_dataset(path, 256)
    features_spec, label_spec = ds.element_spec
    assert set(features_spec) == {"dense", "categorical"}
    assert features_spec["dense"].dtype == tf.float32
    assert features_spec["dense"].shape.as_list() == [None, 13]
    assert features_spec["categorical"].dtype == tf.int64
    assert features_spec["categorical"].shape.as_list() == [None, 26]
    assert label_spec.dtype == tf.float32 and label_spec.shape.as_list() == [None]
    assert int(ds.cardinality()) == 12  # ceil(3000 / 256)

    d, c, y, sizes = _collect(ds)
    assert sizes == [256] * 11 + [3000 - 11 * 256]
    np.testing.assert_allclose(d, np.log1p(dense), rtol=1e-6)
    np.testing.assert_array_equal(c, categorical)
    np.testing.assert_array_equal(y, labels)

    raw = _collect(ee_data.criteo_dataset(path, 1000, log_dense=False, count_examples=False))
    np.testing.assert_array_equal(raw[0], dense)
    assert raw[3] == [1000] * 3

    ds = ee_data.criteo_dataset(path, 256, drop_remainder=True, max_examples=2900)
    assert ds.element_spec[1].shape.as_list() == [256]
    assert int(ds.cardinality()) == 11
    _, c, _, sizes = _collect(ds)
    assert sizes == [256] * 11
    np.testing.assert_array_equal(c, categorical[: 11 * 256])


def test_dataset_clips_negative_dense(tmp_path: Path) -> None:
    path = tmp_path / "neg.tsv"
    path.write_text(_line("1", ["-5", "", "3"] + ["0"] * 10) + _line("0"))
    features, _ = next(iter(ee_data.criteo_dataset(path, 2)))
    np.testing.assert_allclose(features["dense"][0, :3], [0.0, 0.0, np.log1p(3.0)], rtol=1e-6)


def test_shuffle_is_deterministic(small_file: tuple[Path, dict]) -> None:
    path, _ = small_file
    _, categorical, labels = ee_data.read_criteo(path)

    def order(ds: tf.data.Dataset) -> np.ndarray:
        return _collect(ds)[1]

    a = ee_data.criteo_dataset(path, 128, shuffle=True, seed=5)
    b = ee_data.criteo_dataset(path, 128, shuffle=True, seed=5)
    first_a, second_a = order(a), order(a)
    np.testing.assert_array_equal(first_a, order(b))  # same seed, same first pass
    np.testing.assert_array_equal(second_a, order(b))  # and same second pass
    assert not np.array_equal(first_a, second_a)  # successive passes differ
    assert not np.array_equal(first_a, categorical)
    assert not np.array_equal(first_a, order(ee_data.criteo_dataset(path, 128, shuffle=True)))
    # Each pass is a permutation of the file's examples, features and labels kept together.
    key = {tuple(row): y for row, y in zip(categorical.tolist(), labels.tolist(), strict=True)}
    _, c, y, _ = _collect(ee_data.criteo_dataset(path, 128, shuffle=True, seed=9))
    assert sorted(map(tuple, c.tolist())) == sorted(map(tuple, categorical.tolist()))
    assert all(key[tuple(row)] == label for row, label in zip(c.tolist(), y.tolist(), strict=True))


def test_keras_fit_on_dataset(small_file: tuple[Path, dict]) -> None:
    """A stock Keras model trains on the dataset; with a known cardinality Keras does not warn."""
    import warnings

    import keras

    path, info = small_file
    dense_in = keras.Input((13,), name="dense")
    cat_in = keras.Input((26,), dtype="int64", name="categorical")
    embs = [keras.layers.Embedding(v, 2)(cat_in[:, f]) for f, v in enumerate(info["vocab_sizes"])]
    x = keras.layers.Concatenate()([*embs, dense_in])
    logit = keras.layers.Dense(1, name="logit")(x)
    model = keras.Model({"dense": dense_in, "categorical": cat_in}, logit)
    model.compile("adam", keras.losses.BinaryCrossentropy(from_logits=True))
    ds = ee_data.criteo_dataset(path, 500, shuffle=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*ran out of data")
        history = model.fit(ds, epochs=2, verbose=0, shuffle=False)
    assert np.all(np.isfinite(history.history["loss"]))


def test_the_dlrm_model_takes_the_criteo_layout() -> None:
    from elastic_emb.examples import dlrm

    assert (dlrm.NUM_DENSE, dlrm.NUM_CATEGORICAL) == (ee_data.NUM_DENSE, ee_data.NUM_CATEGORICAL)
