"""Criteo-format click-through data: a generator with a planted signal, a parser, tf.data.

The Criteo display-advertising format is one example per line, 40 tab-separated fields::

    label \\t I1 ... I13 \\t C1 ... C26 \\n

* ``label`` is ``0`` or ``1``.
* ``I1``-``I13`` are integers (counts in the real data; a few can be negative). An empty field
  means "missing".
* ``C1``-``C26`` are categorical values written as hexadecimal strings (8 characters in the real
  data, up to 16 accepted here). An empty field means "missing".

Files may be plain text or gzip-compressed (detected from the magic bytes, so the ``.gz`` suffix
is not required).

Conventions used by every reader in this module:

* A missing integer feature reads as ``0``; negative values are kept as they are (the
  ``log_dense`` transform of :func:`criteo_dataset` clips them to 0).
* A missing categorical feature reads as id ``0``. The hexadecimal string is decoded as an
  unsigned 64-bit integer and reinterpreted as ``int64`` (so 16-character values above
  ``7fffffffffffffff`` become negative ids; real Criteo values have 8 characters and are always
  non-negative). Files written by :func:`generate_criteo` never use id 0 for a present value, so
  there "id 0" and "missing" are the same thing and ``keras.layers.Embedding(vocab_size, ...)``
  gives missing values a row of their own.

Example:

```python
from elastic_emb import data as ee_data

info = ee_data.generate_criteo("/tmp/train.tsv.gz", 100_000, seed=0)
ds = ee_data.criteo_dataset("/tmp/train.tsv.gz", batch_size=1024, shuffle=True)
for features, labels in ds.take(1):
    print(features["dense"].shape, features["categorical"].shape, labels.shape)
```
"""

from __future__ import annotations

import gzip
import io
import itertools
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import numpy as np
import tensorflow as tf
from numpy.typing import ArrayLike, NDArray

__all__ = [
    "DEFAULT_VOCAB_SIZES",
    "NUM_CATEGORICAL",
    "NUM_DENSE",
    "NUM_FIELDS",
    "auc",
    "criteo_dataset",
    "generate_criteo",
    "iter_criteo",
    "log_counts",
    "model_inputs",
    "planted_logits",
    "read_criteo",
]

NUM_DENSE = 13
"""Number of integer features (``I1``-``I13``)."""

NUM_CATEGORICAL = 26
"""Number of categorical features (``C1``-``C26``)."""

NUM_FIELDS = 1 + NUM_DENSE + NUM_CATEGORICAL
"""Number of tab-separated fields on a line (label, integers, categoricals)."""

DEFAULT_VOCAB_SIZES: tuple[int, ...] = (
    1_500, 600, 200_000, 120_000, 300, 24, 12_000, 630, 10, 40_000,
    5_000, 180_000, 3_000, 27, 10_000, 150_000, 11, 4_000, 2_000, 15,
    160_000, 18, 16, 60_000, 100, 50_000,
)  # fmt: skip
"""Default vocabulary size of each categorical feature of :func:`generate_criteo`.

Loosely shaped like the real Criteo cardinalities, scaled down to about one million ids in
total. Each size counts id 0 (missing), so feature ``f`` has ``DEFAULT_VOCAB_SIZES[f] - 1`` real
values.
"""

# ----------------------------------------------------------------------------------------------
# The planted model. A hidden logistic model decides the labels of generated data; its weights
# are pure functions of (seed, feature, id), computed by hashing, so no table is ever stored.

_BIAS = -1.8  # With the default settings about 25% of the labels are positive.
_CATEGORICAL_SCALE = 0.35  # Std of a categorical weight, before the per-feature factor.
_DENSE_SCALE = 0.3  # Typical |weight| of an informative dense feature on its standardised log1p.
_DENSE_INFORMATIVE = 7  # Number of dense features with a non-zero hidden weight.
_MAX_COUNT = 999_999  # Dense counts are clipped to this (6 digits when written).

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """The splitmix64 finaliser, element-wise with wrap-around (a bijection on uint64)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def _hash_normal(seed: int, stream: int, ids: NDArray[np.int64]) -> NDArray[np.float64]:
    """Standard normal numbers that are a pure function of (seed, stream, id), via Box-Muller."""
    base = _splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    with np.errstate(over="ignore"):
        base = _splitmix64(base ^ (np.uint64(stream + 1) * _GOLDEN))
        h1 = _splitmix64(ids.astype(np.uint64) ^ base)
    h2 = _splitmix64(h1)
    scale = 2.0**-53
    u1 = ((h1 >> np.uint64(11)).astype(np.float64) + 1.0) * scale  # (0, 1]
    u2 = (h2 >> np.uint64(11)).astype(np.float64) * scale  # [0, 1)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def _model_params(seed: int) -> dict[str, NDArray[np.float64]]:
    """Per-feature parameters of the planted model and of the dense-count distributions."""
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"`seed` must be a non-negative integer. Received: seed={seed!r}")
    rng = np.random.default_rng([seed, 0x5EED])
    cat_scale = _CATEGORICAL_SCALE * rng.uniform(0.3, 1.0, NUM_CATEGORICAL)
    mu = rng.uniform(0.5, 4.0, NUM_DENSE)  # log-normal location of each count
    sigma = rng.uniform(0.5, 1.5, NUM_DENSE)
    dense_w = np.zeros(NUM_DENSE)
    informative = rng.choice(NUM_DENSE, _DENSE_INFORMATIVE, replace=False)
    dense_w[informative] = _DENSE_SCALE * rng.choice([-1.0, 1.0], _DENSE_INFORMATIVE)
    dense_w[informative] *= rng.uniform(0.5, 1.5, _DENSE_INFORMATIVE)
    return {"cat_scale": cat_scale, "mu": mu, "sigma": sigma, "dense_w": dense_w}


def planted_logits(
    dense: ArrayLike, categorical: ArrayLike, *, seed: int = 0
) -> NDArray[np.float64]:
    """Logits of the hidden model that labelled the data written by :func:`generate_criteo`.

    The hidden model is a logistic regression: ``bias + sum_f w(seed, f, id_f) +
    sum_j v_j * (log1p(count_j) - mu_j) / sigma_j``, where each categorical weight ``w`` is a
    pseudo-random normal number derived by hashing (seed, feature, id). The labels of a file
    generated with ``seed`` were drawn as ``Bernoulli(sigmoid(planted_logits(...)))`` from the
    values as they read back (missing values as 0), so for that file this function gives the
    true click probabilities.

    Example:

    ```python
    dense, categorical, labels = read_criteo("/tmp/train.tsv.gz")
    probs = 1 / (1 + np.exp(-planted_logits(dense, categorical, seed=0)))
    ```

    Args:
        dense: float or int array of shape ``[n, 13]``: the raw counts (not log-transformed),
            as returned by :func:`read_criteo`.
        categorical: int array of shape ``[n, 26]``: the ids.
        seed: int, the ``seed`` given to :func:`generate_criteo`.

    Returns:
        float64 array of shape ``[n]``.

    Raises:
        ValueError: if the shapes are wrong.
    """
    dense_arr = np.asarray(dense, dtype=np.float64)
    cat_arr = np.asarray(categorical, dtype=np.int64)
    if dense_arr.ndim != 2 or dense_arr.shape[1] != NUM_DENSE:
        raise ValueError(f"`dense` must have shape [n, {NUM_DENSE}]. Received: {dense_arr.shape}")
    if cat_arr.shape != (dense_arr.shape[0], NUM_CATEGORICAL):
        raise ValueError(
            f"`categorical` must have shape [{dense_arr.shape[0]}, {NUM_CATEGORICAL}]. "
            f"Received: {cat_arr.shape}"
        )
    params = _model_params(seed)
    logits = np.full(dense_arr.shape[0], _BIAS)
    for f in range(NUM_CATEGORICAL):
        logits += params["cat_scale"][f] * _hash_normal(seed, f, cat_arr[:, f])
    z = (log_counts(dense_arr) - params["mu"]) / params["sigma"]
    logits += z @ params["dense_w"]
    return logits


def log_counts(dense: np.ndarray) -> np.ndarray:
    """The usual transform of Criteo's integer counts: ``log1p(max(x, 0))``.

    Float input keeps its dtype (float32 stays float32); integers give float64.
    """
    dense = np.asarray(dense)
    return np.log1p(np.maximum(dense, dense.dtype.type(0)))


def model_inputs(dense: np.ndarray, categorical: np.ndarray) -> dict[str, np.ndarray]:
    """The inputs of `elastic_emb.examples.dlrm.build_dlrm`: log counts and ids."""
    return {"dense": log_counts(dense), "categorical": categorical}


def _sigmoid(x: NDArray[np.float64]) -> NDArray[np.float64]:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


# ----------------------------------------------------------------------------------------------
# AUC


def auc(labels: ArrayLike, scores: ArrayLike) -> float:
    """Exact area under the ROC curve (Mann-Whitney U), with tied scores counted as one half.

    Computed from the average ranks of the scores in ``O(n log n)``.

    Example:

    ```python
    auc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8])  # 0.75
    ```

    Args:
        labels: array of shape ``[n]`` with values 0 and 1 (bool, int or float).
        scores: array of shape ``[n]``: higher means "more likely positive".

    Returns:
        The AUC, a float in ``[0, 1]``.

    Raises:
        ValueError: if the shapes differ, a label is not 0 or 1, or only one class is present.
    """
    y = np.asarray(labels).reshape(-1)
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if y.shape != s.shape:
        raise ValueError(
            f"`labels` and `scores` must have the same size. Received: {y.size} and {s.size}"
        )
    pos = y == 1
    if not np.all(pos | (y == 0)):
        raise ValueError("`labels` must contain only 0 and 1.")
    n_pos = int(pos.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError(
            f"AUC needs both classes. Received: {n_pos} positive and {n_neg} negative labels"
        )
    order = np.argsort(s, kind="stable")
    sorted_s = s[order]
    # Tie groups: [first, last] index ranges of equal scores; all members get the mean rank.
    new_group = np.empty(s.size, dtype=bool)
    new_group[0] = True
    np.not_equal(sorted_s[1:], sorted_s[:-1], out=new_group[1:])
    group_start = np.flatnonzero(new_group)
    group_end = np.append(group_start[1:], s.size)  # exclusive
    mean_rank = (group_start + group_end + 1) / 2.0  # ranks are 1-based
    group_of = np.cumsum(new_group) - 1
    ranks = np.empty(s.size, dtype=np.float64)
    ranks[order] = mean_rank[group_of]
    rank_sum = float(ranks[pos].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


# ----------------------------------------------------------------------------------------------
# Generation

_GEN_CHUNK = 65_536
_HEX_CHARS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_DENSE_WIDTH = 6  # digits per dense slot; _MAX_COUNT fits
_TAB, _NL, _CR = 9, 10, 13


def _check_vocab_sizes(vocab_sizes: Sequence[int] | None) -> list[int]:
    sizes = list(DEFAULT_VOCAB_SIZES if vocab_sizes is None else vocab_sizes)
    if len(sizes) != NUM_CATEGORICAL:
        raise ValueError(
            f"`vocab_sizes` must have {NUM_CATEGORICAL} entries. Received: {len(sizes)} entries"
        )
    for v in sizes:
        if not isinstance(v, (int, np.integer)) or not 2 <= v <= 2**32:
            raise ValueError(
                "Each of `vocab_sizes` must be an integer in [2, 2**32] (id 0 is reserved for "
                f"missing values). Received: vocab_sizes={sizes}"
            )
    return [int(v) for v in sizes]


def _zipf_ids(
    rng: np.random.Generator, n: int, vocab_size: int, exponent: float, seed: int, feature: int
) -> NDArray[np.int64]:
    """``n`` ids in ``[1, vocab_size)``, Zipf-like: the r-th most frequent has weight ~ r^-s.

    Sampled by inverting the continuous power-law CDF on ``[1, vocab_size)`` and flooring (so
    rank ``r = 1, 2, ...`` has probability proportional to ``r^(1-s) - (r+1)^(1-s)``); the
    frequency rank is then mapped to an id by an affine bijection modulo ``vocab_size - 1`` so
    the frequent ids are scattered rather than 1, 2, 3, ...
    """
    m = vocab_size - 1  # real ids: 1 .. m
    u = rng.random(n)
    if abs(exponent - 1.0) < 1e-9:
        x = np.exp(u * math.log(m + 1))
    else:
        a = 1.0 - exponent
        x = (1.0 + u * ((m + 1) ** a - 1.0)) ** (1.0 / a)
    rank = np.clip(np.floor(x).astype(np.int64) - 1, 0, m - 1)
    mix = np.random.default_rng([seed, 0xB17E, feature])
    mult = int(mix.integers(1, 2**31)) | 1
    while math.gcd(mult, m) != 1:
        mult += 2
    offset = int(mix.integers(0, m))
    return 1 + (rank * (mult % m) + offset) % m


def _sample_dense(
    rng: np.random.Generator, n: int, params: dict[str, NDArray[np.float64]]
) -> NDArray[np.int64]:
    """Non-negative integer counts ``floor(exp(N(mu_j, sigma_j)))``, clipped to _MAX_COUNT."""
    z = rng.standard_normal((n, NUM_DENSE)) * params["sigma"] + params["mu"]
    return np.minimum(np.floor(np.exp(z)), _MAX_COUNT).astype(np.int64)


def _format_lines(
    labels: NDArray[np.bool_],
    dense: NDArray[np.int64],
    dense_missing: NDArray[np.bool_],
    categorical: NDArray[np.int64],
) -> bytes:
    """Criteo text for a block of examples, built as a byte matrix (0 bytes are dropped)."""
    n = labels.shape[0]
    head = np.empty((n, 2), dtype=np.uint8)
    head[:, 0] = ord("0") + labels
    head[:, 1] = _TAB
    # Dense: right-aligned decimal digits, leading zeros blanked (0 is written as "0").
    dblock = np.zeros((n, NUM_DENSE, _DENSE_WIDTH + 1), dtype=np.uint8)
    for k in range(_DENSE_WIDTH):
        p = 10 ** (_DENSE_WIDTH - 1 - k)
        show = (dense >= p) | (k == _DENSE_WIDTH - 1)
        show &= ~dense_missing
        digit = ((dense // p) % 10).astype(np.uint8) + ord("0")
        dblock[:, :, k] = np.where(show, digit, 0)
    dblock[:, :, _DENSE_WIDTH] = _TAB
    # Categorical: 8 lowercase hex characters, or nothing when missing (id 0).
    cblock = np.zeros((n, NUM_CATEGORICAL, 9), dtype=np.uint8)
    ids = categorical.astype(np.uint64)
    present = categorical != 0
    for k in range(8):
        nibble = (ids >> np.uint64(4 * (7 - k))) & np.uint64(15)
        cblock[:, :, k] = np.where(present, _HEX_CHARS[nibble.astype(np.intp)], 0)
    cblock[:, :, 8] = _TAB
    cblock[:, -1, 8] = _NL
    flat = np.concatenate([head, dblock.reshape(n, -1), cblock.reshape(n, -1)], axis=1).reshape(-1)
    return flat[flat != 0].tobytes()


def generate_criteo(
    path: str | os.PathLike[str],
    num_examples: int,
    *,
    seed: int = 0,
    vocab_sizes: Sequence[int] | None = None,
    zipf_exponent: float = 1.1,
    missing_rate: float = 0.02,
    sample_seed: int | None = None,
) -> dict[str, Any]:
    """Writes a synthetic Criteo-format file whose labels follow a hidden logistic model.

    Each categorical feature ``f`` takes ids in ``[1, vocab_sizes[f])``, drawn Zipf-like
    (the r-th most frequent id has probability ~ ``r ** -zipf_exponent``; exactly, proportional
    to ``r ** (1 - zipf_exponent) - (r + 1) ** (1 - zipf_exponent)``) and written as 8
    lowercase hexadecimal characters of the id itself, so ``int(field, 16)`` recovers the id and
    a stock ``keras.layers.Embedding(input_dim=vocab_sizes[f], ...)`` can be trained on the same
    data. Id 0 is never written: it is what a missing value reads as. The 13 integer features are
    non-negative, log-normally distributed counts; 7 of them carry signal through
    ``log1p(count)``. Each field is independently missing (empty) with probability
    ``missing_rate``. The label of an example is drawn from ``Bernoulli(sigmoid(logit))``, with
    ``logit`` given by :func:`planted_logits` on the values as written. The hidden categorical
    weights are hashes of (seed, feature, id), so nothing of the size of the vocabulary is
    stored, and generation streams in blocks of 65,536 examples.

    Example:

    ```python
    info = generate_criteo("/tmp/train.tsv.gz", 200_000, seed=0)
    info["oracle_auc"]  # the best AUC any model can reach on this file, about 0.83
    ```

    Args:
        path: str or path-like: output file. Gzip-compressed if the name ends in ``.gz``.
        num_examples: int, number of lines to write (``>= 0``).
        seed: int, seeds the hidden model (and the sampling, unless ``sample_seed`` is given).
        vocab_sizes: sequence of 26 ints in ``[2, 2**32]``, the vocabulary size of each
            categorical feature, counting id 0. Defaults to :data:`DEFAULT_VOCAB_SIZES`.
        zipf_exponent: float > 0, the skew of the id distribution.
        missing_rate: float in ``[0, 1)``, probability that a field is empty.
        sample_seed: int or None, seeds the sampling of the examples only. A training and a test
            file for the same hidden model use the same ``seed`` and different ``sample_seed``.
            Defaults to ``seed``.

    Returns:
        A dict with ``num_examples``, ``vocab_sizes`` (list of int), ``oracle_auc`` (AUC of the
        true probabilities against the drawn labels: the best a model can reach on this file),
        ``positive_rate``, ``seed``, ``sample_seed``, ``zipf_exponent``, ``missing_rate`` and
        ``path``.

    Raises:
        ValueError: for an invalid argument.
    """
    if not isinstance(num_examples, (int, np.integer)) or num_examples < 0:
        raise ValueError(
            f"`num_examples` must be a non-negative integer. Received: num_examples={num_examples}"
        )
    sizes = _check_vocab_sizes(vocab_sizes)
    if not zipf_exponent > 0:
        raise ValueError(f"`zipf_exponent` must be > 0. Received: zipf_exponent={zipf_exponent}")
    if not 0 <= missing_rate < 1:
        raise ValueError(f"`missing_rate` must be in [0, 1). Received: missing_rate={missing_rate}")
    path = os.fspath(path)
    num_examples = int(num_examples)
    params = _model_params(seed)
    if sample_seed is None:
        sample_seed = seed
    if not isinstance(sample_seed, (int, np.integer)) or sample_seed < 0:
        raise ValueError(
            f"`sample_seed` must be None or a non-negative integer. Received: {sample_seed!r}"
        )
    rng = np.random.default_rng([sample_seed, 0xDA7A])
    probs = np.empty(num_examples, dtype=np.float64)
    labels = np.empty(num_examples, dtype=bool)
    out: io.BufferedIOBase
    if path.endswith(".gz"):
        out = gzip.open(path, "wb", compresslevel=1)
    else:
        out = open(path, "wb")
    with out:
        for start in range(0, num_examples, _GEN_CHUNK):
            n = min(_GEN_CHUNK, num_examples - start)
            cat = np.empty((n, NUM_CATEGORICAL), dtype=np.int64)
            for f, v in enumerate(sizes):
                cat[:, f] = _zipf_ids(rng, n, v, zipf_exponent, seed, f)
            cat[rng.random((n, NUM_CATEGORICAL)) < missing_rate] = 0
            dense = _sample_dense(rng, n, params)
            dense_missing = rng.random((n, NUM_DENSE)) < missing_rate
            dense[dense_missing] = 0
            p = _sigmoid(planted_logits(dense, cat, seed=seed))
            y = rng.random(n) < p
            probs[start : start + n] = p
            labels[start : start + n] = y
            out.write(_format_lines(y, dense, dense_missing, cat))
    has_both = 0 < labels.sum() < num_examples
    return {
        "path": path,
        "num_examples": num_examples,
        "vocab_sizes": sizes,
        "oracle_auc": auc(labels, probs) if has_both else float("nan"),
        "positive_rate": float(labels.mean()) if num_examples else float("nan"),
        "seed": seed,
        "sample_seed": sample_seed,
        "zipf_exponent": zipf_exponent,
        "missing_rate": missing_rate,
    }


# ----------------------------------------------------------------------------------------------
# Parsing

_READ_BLOCK_BYTES = 8 << 20  # ~25k lines of real Criteo text per parsed block
_MAX_DENSE_CHARS = 18  # digits of an integer feature (fits int64)
_MAX_HEX_CHARS = 16  # characters of a categorical feature (fits uint64)
_PAD = 16  # bytes before a block's text, so that fixed-width windows never start before it

_HEX_VALUE = np.full(256, 255, dtype=np.uint8)
_HEX_VALUE[np.frombuffer(b"0123456789", dtype=np.uint8)] = np.arange(10, dtype=np.uint8)
_HEX_VALUE[np.frombuffer(b"abcdef", dtype=np.uint8)] = np.arange(10, 16, dtype=np.uint8)
_HEX_VALUE[np.frombuffer(b"ABCDEF", dtype=np.uint8)] = np.arange(10, 16, dtype=np.uint8)

_Chunk = tuple[NDArray[np.float32], NDArray[np.int64], NDArray[np.float32]]


def _field_name(i: int) -> str:
    if i == 0:
        return "label"
    if i <= NUM_DENSE:
        return f"I{i}"
    return f"C{i - NUM_DENSE}"


def _diagnose(line: bytes) -> str:
    """Says in words what is wrong with one line (slow path, only used to word an error)."""
    if line.endswith(b"\r"):
        line = line[:-1]
    fields = line.split(b"\t")
    if len(fields) != NUM_FIELDS:
        return (
            f"expected {NUM_FIELDS} tab-separated fields (label, {NUM_DENSE} integer, "
            f"{NUM_CATEGORICAL} categorical), found {len(fields)}"
        )
    for i, raw in enumerate(fields):
        text = raw.decode("utf-8", errors="replace")
        if i == 0:
            if raw not in (b"0", b"1"):
                return f"the label must be 0 or 1, found {text!r}"
        elif i <= NUM_DENSE:
            digits = raw[1:] if raw.startswith(b"-") else raw
            if raw and (not digits or not digits.isdigit() or not digits.isascii()):
                return f"field {_field_name(i)} is not an integer: {text!r}"
            if len(digits) > _MAX_DENSE_CHARS:
                return f"field {_field_name(i)} has more than {_MAX_DENSE_CHARS} digits: {text!r}"
        else:
            if any(_HEX_VALUE[b] == 255 for b in raw):
                return f"field {_field_name(i)} is not hexadecimal: {text!r}"
            if len(raw) > _MAX_HEX_CHARS:
                return (
                    f"field {_field_name(i)} has more than {_MAX_HEX_CHARS} hexadecimal "
                    f"characters: {text!r}"
                )
    return "malformed line"  # not reached: the vectorised checks and this one agree


def _right_aligned(
    padded: NDArray[np.uint8],
    ends: NDArray[np.int64],
    lengths: NDArray[np.int64],
    max_width: int,
    multiple: int = 1,
) -> NDArray[np.uint8]:
    """The last characters of each field, right-aligned in a fixed width, padded with "0".

    ``padded`` is the block's text preceded by ``_PAD`` bytes, and ``ends`` are (exclusive)
    field ends in the unpadded text. Returns a ``[*ends.shape, width]`` uint8 array whose row
    for a field holds the field's last ``width`` bytes (``width``: the longest length, at most
    ``max_width``, rounded up to a ``multiple``), with the positions before the field's start
    replaced by ``"0"``. One gather through a sliding-window view.
    """
    width = int(min(lengths.max(initial=0), max_width))
    width = max(multiple, -(-width // multiple) * multiple)
    windows = np.lib.stride_tricks.sliding_window_view(padded, width)
    chars = windows[ends + (_PAD - width)]  # == text[end - width : end]
    in_field = np.arange(width) >= (width - lengths)[..., None]
    return np.where(in_field, chars, np.uint8(ord("0")))


def _parse_block(data: NDArray[np.uint8], path: str, first_line: int) -> _Chunk:
    """Parses whole lines (``data`` ends with a newline); ``first_line`` is 1-based."""
    newlines = np.flatnonzero(data == _NL)
    n = newlines.size

    def fail(row: int) -> NoReturn:
        begin = 0 if row == 0 else int(newlines[row - 1]) + 1
        line = data[begin : int(newlines[row])].tobytes()
        raise ValueError(f"{path}, line {first_line + row}: {_diagnose(line)}")

    tabs = np.flatnonzero(data == _TAB)
    tabs_per_line = np.diff(np.searchsorted(tabs, newlines), prepend=0)
    wrong = np.flatnonzero(tabs_per_line != NUM_FIELDS - 1)
    if wrong.size:
        fail(int(wrong[0]))
    ends = np.flatnonzero((data == _TAB) | (data == _NL)).reshape(n, NUM_FIELDS)
    starts = np.empty_like(ends)
    starts[:, 1:] = ends[:, :-1] + 1
    starts[0, 0] = 0
    starts[1:, 0] = newlines[:-1] + 1
    last = ends[:, -1]  # "\r\n" line ends: the "\r" is not part of the last field
    last -= (last > starts[:, -1]) & (data[last - 1] == _CR)
    bad = np.zeros(n, dtype=bool)

    # Label: exactly "0" or "1".
    label_byte = data[starts[:, 0]].astype(np.int64) - ord("0")
    bad |= (ends[:, 0] - starts[:, 0] != 1) | (label_byte < 0) | (label_byte > 1)

    # Integers: optional "-", then 1 to 18 decimal digits.
    d_start = starts[:, 1 : 1 + NUM_DENSE]
    d_end = ends[:, 1 : 1 + NUM_DENSE]
    present = d_end > d_start
    negative = present & (data[d_start] == ord("-"))
    n_digits = d_end - d_start - negative
    bad |= np.any((negative & (n_digits == 0)) | (n_digits > _MAX_DENSE_CHARS), axis=1)
    padded = np.concatenate([np.zeros(_PAD, dtype=np.uint8), data])
    chars = _right_aligned(padded, d_end, n_digits, _MAX_DENSE_CHARS)
    digits = chars - np.uint8(ord("0"))  # wraps around: any non-digit becomes > 9
    bad |= np.any(digits > 9, axis=(1, 2))
    powers = 10 ** np.arange(chars.shape[2] - 1, -1, -1, dtype=np.int64)
    value = digits.astype(np.int64) @ powers
    dense = np.where(negative, -value, value).astype(np.float32)

    # Categoricals: up to 16 hexadecimal characters, decoded through a lookup table, paired
    # into bytes and read as big-endian 32- or 64-bit words.
    c_start = starts[:, 1 + NUM_DENSE :]
    c_end = ends[:, 1 + NUM_DENSE :]
    n_chars = c_end - c_start
    bad |= np.any(n_chars > _MAX_HEX_CHARS, axis=1)
    nibbles = _HEX_VALUE[_right_aligned(padded, c_end, n_chars, _MAX_HEX_CHARS, multiple=8)]
    bad |= np.any(nibbles == 255, axis=(1, 2))
    packed = np.ascontiguousarray((nibbles[:, :, 0::2] << 4) | nibbles[:, :, 1::2])
    word = ">u4" if packed.shape[2] == 4 else ">u8"
    ids = packed.view(word)[:, :, 0].astype(np.uint64).view(np.int64)

    if bad.any():
        fail(int(np.argmax(bad)))
    return dense, ids, label_byte.astype(np.float32)


def _open_binary(path: str) -> io.BufferedIOBase:
    """Opens a file for reading bytes, decompressing it if it starts with the gzip magic."""
    with open(path, "rb") as probe:
        magic = probe.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rb")
    return open(path, "rb")


def iter_criteo(
    path: str | os.PathLike[str],
    *,
    max_examples: int | None = None,
    block_bytes: int = _READ_BLOCK_BYTES,
) -> Iterator[_Chunk]:
    """Reads a Criteo-format file block by block, in file order.

    Reads ``block_bytes`` of text at a time (whole lines), so memory stays bounded whatever the
    file size. Blocks hold a varying number of examples (about 25,000 for the default size and
    real Criteo lines); concatenated they equal :func:`read_criteo`'s result.

    Args:
        path: str or path-like: a plain or gzip-compressed Criteo file.
        max_examples: int or None, stop after this many examples.
        block_bytes: int, bytes of text parsed at a time.

    Yields:
        Tuples ``(dense, categorical, labels)`` as described in :func:`read_criteo`.

    Raises:
        ValueError: for a malformed line, naming the file and the 1-based line number.
        OSError: if the file cannot be read.
    """
    if max_examples is not None and max_examples < 0:
        raise ValueError(
            f"`max_examples` must be None or >= 0. Received: max_examples={max_examples}"
        )
    if block_bytes < 1:
        raise ValueError(f"`block_bytes` must be positive. Received: block_bytes={block_bytes}")
    path = os.fspath(path)
    remaining = math.inf if max_examples is None else max_examples
    line = 1
    with _open_binary(path) as f:
        pending = b""
        while remaining > 0:
            block = f.read(block_bytes)
            at_eof = not block
            text = pending + block
            cut = len(text) if at_eof else text.rfind(b"\n") + 1
            if at_eof and text and not text.endswith(b"\n"):
                text += b"\n"
                cut = len(text)
            pending = text[cut:]
            if cut:
                data = np.frombuffer(text, np.uint8, count=cut)
                if max_examples is not None:  # parse no line beyond the last one wanted
                    newlines = np.flatnonzero(data == _NL)
                    if newlines.size > remaining:
                        data = data[: newlines[int(remaining) - 1] + 1]
                chunk = _parse_block(data, path, line)
                n = chunk[2].shape[0]
                line += n
                remaining -= n
                yield chunk
            if at_eof:
                break


def read_criteo(
    path: str | os.PathLike[str], *, max_examples: int | None = None
) -> tuple[NDArray[np.float32], NDArray[np.int64], NDArray[np.float32]]:
    """Reads a whole Criteo-format file into arrays.

    Parsing is vectorised with NumPy (about a million lines in a few seconds). Missing integer
    features read as 0 and negative ones are kept; missing categorical features read as id 0;
    hexadecimal strings (up to 16 characters, either case) are decoded as uint64 and
    reinterpreted as int64. Lines may end in ``"\\n"`` or ``"\\r\\n"``; the last line needs no
    newline. Integers beyond 2**24 lose precision in float32.

    Example:

    ```python
    dense, categorical, labels = read_criteo("/tmp/train.tsv.gz", max_examples=1000)
    dense.shape, categorical.shape, labels.shape  # (1000, 13), (1000, 26), (1000,)
    ```

    Args:
        path: str or path-like: a plain or gzip-compressed (detected by content) Criteo file.
        max_examples: int or None, read at most this many examples from the start.

    Returns:
        ``(dense, categorical, labels)``: float32 ``[n, 13]`` raw integer features, int64
        ``[n, 26]`` ids, float32 ``[n]`` labels (0.0 or 1.0).

    Raises:
        ValueError: for a malformed line (wrong number of fields, a label other than 0/1, an
            integer or hexadecimal field that does not parse), naming the file and the 1-based
            line number.
        OSError: if the file cannot be read.
    """
    chunks = list(iter_criteo(path, max_examples=max_examples))
    if not chunks:
        return (
            np.zeros((0, NUM_DENSE), np.float32),
            np.zeros((0, NUM_CATEGORICAL), np.int64),
            np.zeros((0,), np.float32),
        )
    return (
        np.concatenate([c[0] for c in chunks]),
        np.concatenate([c[1] for c in chunks]),
        np.concatenate([c[2] for c in chunks]),
    )


# ----------------------------------------------------------------------------------------------
# tf.data


def criteo_dataset(  # (long: one tf.data pipeline, read top to bottom)
    path: str | os.PathLike[str],
    batch_size: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    log_dense: bool = True,
    drop_remainder: bool = False,
    max_examples: int | None = None,
    shuffle_buffer: int = 1 << 20,
    count_examples: bool = True,
) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of batches from a Criteo-format file, streamed in blocks.

    The file is parsed with NumPy a block of lines at a time inside a Python generator
    (``tf.data.Dataset.from_generator``), and batches are cut in NumPy, so memory stays bounded
    for files of any size and TensorFlow sees one element per batch. Each pass over the dataset
    (each ``model.fit`` epoch, each ``repeat()``) reads the file again.

    Shuffling permutes windows of consecutive examples: whole parsed blocks (8 MiB of text,
    about 25,000 real Criteo lines) gathered until the window holds at least ``shuffle_buffer``
    examples, or the whole file when it holds fewer (which is then a uniform shuffle). It is
    deterministic: the ``i``-th pass over the dataset uses the permutation seeded by
    ``(seed, i)``, so two datasets made with the same arguments yield the same batches, and
    successive epochs differ.

    Example:

    ```python
    ds = criteo_dataset("/tmp/train.tsv.gz", 1024, shuffle=True, seed=1)
    model.fit(ds, epochs=2)  # features: {"dense": [B, 13], "categorical": [B, 26]}
    ```

    Args:
        path: str or path-like: a plain or gzip-compressed Criteo file.
        batch_size: int, examples per batch.
        shuffle: bool, whether to shuffle the examples (see above).
        seed: int, seed of the shuffle.
        log_dense: bool, whether to transform the integer features as ``log1p(max(x, 0))``;
            otherwise they are the raw values of :func:`read_criteo`.
        drop_remainder: bool, whether to drop a last batch smaller than ``batch_size`` (the batch
            dimension is then static).
        max_examples: int or None, use only the first ``max_examples`` examples of the file.
        shuffle_buffer: int, least number of consecutive examples permuted together when
            shuffling (memory: about 350 bytes per example).
        count_examples: bool, whether to count the lines of the file once, up front (a pass
            without parsing: well under a second per million plain-text lines, a few times more
            for gzip), so that the dataset has a known ``cardinality()``. Keras then knows the
            number of steps per epoch, and does not warn that the input "ran out of data" at
            the end of each epoch. Turn it off for very large files.

    Returns:
        A dataset of ``({"dense": float32 [B, 13], "categorical": int64 [B, 26]}, labels)``
        with ``labels`` float32 ``[B]``. Missing values are 0 (see :func:`read_criteo`).

    Raises:
        FileNotFoundError: if ``path`` is not a file.
        ValueError: for an invalid argument. A malformed line raises ``ValueError`` (naming file
            and line) when the iteration reaches it, surfaced by TensorFlow as an error of the
            iterator.
    """
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(
            f"`batch_size` must be a positive integer. Received: batch_size={batch_size}"
        )
    if shuffle_buffer < 1:
        raise ValueError(
            f"`shuffle_buffer` must be positive. Received: shuffle_buffer={shuffle_buffer}"
        )
    if max_examples is not None and max_examples < 0:
        raise ValueError(
            f"`max_examples` must be None or >= 0. Received: max_examples={max_examples}"
        )
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No such file: {path!r}")
    batch_size = int(batch_size)
    passes = itertools.count()

    def windows() -> Iterator[_Chunk]:
        """Blocks of examples in file order, or permuted windows of them when shuffling."""
        blocks = iter_criteo(path, max_examples=max_examples)
        if not shuffle:
            yield from blocks
            return
        rng = np.random.default_rng([seed, next(passes)])
        window: list[_Chunk] = []
        size = 0
        for block in itertools.chain(blocks, [None]):
            if block is not None:
                window.append(block)
                size += block[2].shape[0]
                if size < shuffle_buffer:
                    continue
            if size:
                perm = rng.permutation(size)
                yield (
                    np.concatenate([w[0] for w in window])[perm],
                    np.concatenate([w[1] for w in window])[perm],
                    np.concatenate([w[2] for w in window])[perm],
                )
            window, size = [], 0

    def make_batch(
        dense: NDArray[np.float32], cat: NDArray[np.int64], labels: NDArray[np.float32]
    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        if log_dense:
            return model_inputs(dense, cat), labels
        return {"dense": dense, "categorical": cat}, labels

    def batches() -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
        carry: _Chunk | None = None
        for dense, cat, labels in windows():
            if carry is not None:  # the tail of the previous block starts this one
                dense = np.concatenate([carry[0], dense])
                cat = np.concatenate([carry[1], cat])
                labels = np.concatenate([carry[2], labels])
            n_full = labels.shape[0] // batch_size * batch_size
            for i in range(0, n_full, batch_size):
                j = i + batch_size
                yield make_batch(dense[i:j], cat[i:j], labels[i:j])
            carry = (dense[n_full:], cat[n_full:], labels[n_full:])
        if carry is not None and carry[2].shape[0] and not drop_remainder:
            yield make_batch(*carry)

    b = batch_size if drop_remainder else None
    signature = (
        {
            "dense": tf.TensorSpec([b, NUM_DENSE], tf.float32),
            "categorical": tf.TensorSpec([b, NUM_CATEGORICAL], tf.int64),
        },
        tf.TensorSpec([b], tf.float32),
    )
    dataset = tf.data.Dataset.from_generator(batches, output_signature=signature)
    if count_examples:
        n = _count_lines(path, max_examples)
        num_batches = n // batch_size if drop_remainder else -(-n // batch_size)
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(num_batches))
    return dataset.prefetch(tf.data.AUTOTUNE)


def _count_lines(path: str, limit: int | None) -> int:
    """Number of lines (the last may lack its newline), stopping once ``limit`` is reached."""
    count = 0
    last = b"\n"
    with _open_binary(path) as f:
        while limit is None or count < limit:
            block = f.read(_READ_BLOCK_BYTES)
            if not block:
                break
            count += block.count(b"\n")
            last = block[-1:]
    if last != b"\n":
        count += 1
    return count if limit is None else min(count, limit)
