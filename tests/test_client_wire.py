"""A worker's side of the hot messages, in C++ (`_core.PullPlan`, `_core.push_requests`): the
requests it encodes are the messages the Python builders (`protocol.pull_request`,
`push_request`, split by `RangeLayout.split`) make, field for field, in every wire encoding;
the rows it decodes from the server's answers are those the Python decoder gives; answers
that do not match the request are refused."""

from __future__ import annotations

import numpy as np
import pytest

import elastic_emb as ee
from elastic_emb import _core
from elastic_emb._proto import ps_pb2
from elastic_emb.ps.wire import protocol
from elastic_emb.tables.local import core_options
from elastic_emb.tables.sharding import NUM_SLOTS, RangeLayout
from elastic_emb.tables.table import TableConfig

ENCODINGS = [ps_pb2.FLOAT32, ps_pb2.FLOAT16, ps_pb2.BFLOAT16]
LAYOUT = RangeLayout((0, 1, 2), ((0, 100), (100, 3000), (3000, NUM_SLOTS)))


def _starts(layout: RangeLayout) -> np.ndarray:
    return np.array([begin for begin, _ in layout.slots], np.int64)


def _tables(rng: np.random.Generator) -> list[tuple[str, int, np.ndarray]]:
    """Distinct keys: small ones (delta-varint), huge and negative ones (raw), one table
    with none, one with a single key."""
    return [
        ("a", 4, np.unique(rng.integers(0, 5000, 300))),
        ("b", 3, np.unique(rng.integers(-(2**62), 2**62, 200))),
        ("empty", 2, np.zeros(0, np.int64)),
        ("one", 5, np.array([-7], np.int64)),
    ]


def _gradients(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    g = (rng.normal(size=(n, dim)) * 10.0 ** rng.integers(-9, 3, (n, 1))).astype(np.float32)
    if n > 3:
        g[0, 0], g[1, 0] = 1e-42, -0.0  # a subnormal, a negative zero
    return g


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_pushes_are_the_python_builders_messages(encoding):
    rng = np.random.default_rng(encoding)
    tables = {n: (d, k, _gradients(rng, len(k), d)) for n, d, k in _tables(rng)}
    names = sorted(tables)
    ours = _core.push_requests(
        names,
        [tables[n][1] for n in names],
        [tables[n][2] for n in names],
        _starts(LAYOUT),
        NUM_SLOTS,
        3,
        41,
        encoding,
    )
    split = {n: LAYOUT.split(k) for n, (_, k, _) in tables.items()}
    for r, raw in enumerate(ours):
        parts = [(n, tables[n][1][split[n][r]], tables[n][2][split[n][r]]) for n in names]
        expected = protocol.push_request(3, 41, encoding, parts)
        assert ps_pb2.PushRequest.FromString(raw) == expected, f"range {r}"
    assert any(m.gradient_exponent for m in expected.tables) == (encoding == ps_pb2.FLOAT16)


def test_a_push_of_nonfinite_gradients_is_sent_unscaled_as_python_does():
    keys = np.arange(4, dtype=np.int64)
    for bad in (np.nan, np.inf):
        grads = np.full((4, 2), 1e-6, np.float32)
        grads[2, 1] = bad
        (raw,) = _core.push_requests(
            ["t"], [keys], [grads], np.zeros(1, np.int64), NUM_SLOTS, 0, 1, ps_pb2.FLOAT16
        )
        expected = protocol.push_request(0, 1, ps_pb2.FLOAT16, [("t", keys, grads)])
        assert ps_pb2.PushRequest.FromString(raw) == expected


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_pulls_and_their_rows_match_the_python_path(encoding, cached):
    rng = np.random.default_rng(7)
    tables = _tables(rng)
    names, dims, keys = [t[0] for t in tables], [t[1] for t in tables], [t[2] for t in tables]
    held = [rng.integers(0, 3, len(k)).astype(np.uint32) for k in keys] if cached else None
    plan = _core.PullPlan(names, keys, dims, _starts(LAYOUT), NUM_SLOTS)
    ours = plan.requests(2, 9, True, encoding, 1500, held)
    split = [LAYOUT.split(k) for k in keys]
    # The server's side: each table's rows from a real table, some pushed to step 2.
    cores = {}
    for name, dim, k in tables:
        cores[name] = _core.Table(core_options(TableConfig.make(dim, ee.optimizers.SGD(0.5))))
        if len(k):
            pushed = np.ascontiguousarray(k[::2])
            cores[name].push(pushed, np.ones((len(pushed), dim), np.float32), 0.5, 2)
    answers = []
    for r, raw in enumerate(ours):
        mine = [i for i in range(len(tables)) if len(split[i][r])]
        if not mine:
            assert raw is None
            answers.append(None)
            continue
        expected = protocol.pull_request(
            2,
            9,
            True,
            encoding,
            1.5,
            [(names[i], keys[i][split[i][r]]) for i in mine],
            None if held is None else [held[i][split[i][r]] for i in mine],
        )
        assert ps_pb2.PullRequest.FromString(raw) == expected, f"range {r}"
        message = _core.PullMessage(raw)
        answers.append(message.answer([cores[n] for n in message.names]))
    rows, versions, unchanged = plan.rows(answers)
    # The Python decoder on the same answers.
    for i, (name, dim, k) in enumerate(tables):
        want_rows = np.zeros((len(k), dim), np.float32)
        want_versions, want_same = np.zeros(len(k), np.uint32), np.zeros(len(k), bool)
        for r, answer in enumerate(answers):
            if answer is None or not len(split[i][r]):
                continue
            response = ps_pb2.PullResponse.FromString(answer)
            mine = [j for j in range(len(tables)) if len(split[j][r])]
            shapes = [(names[j], len(split[j][r]), dims[j]) for j in mine]
            got, now, same = protocol.pulled_rows(response, shapes)[mine.index(i)]
            at = split[i][r]
            if same is None:
                want_rows[at] = got
            else:
                want_rows[at[~same]], want_versions[at[~same]], want_same[at] = got, now, same
        np.testing.assert_array_equal(unchanged[i], want_same)
        sent = ~want_same  # (an unchanged row comes from the worker's cache)
        assert rows[i][sent].tobytes() == want_rows[sent].tobytes(), name
        np.testing.assert_array_equal(versions[i], want_versions)
    if cached:  # the comparison can fail: some rows were left out, some sent
        assert 0 < sum(int(u.sum()) for u in unchanged) < sum(len(k) for k in keys)


def test_answers_that_do_not_match_the_pull_are_refused():
    keys = [np.arange(10, dtype=np.int64), np.arange(5, dtype=np.int64)]
    plan = _core.PullPlan(["a", "b"], keys, [2, 2], np.zeros(1, np.int64), NUM_SLOTS)
    plan.requests(0, 1, False, ps_pb2.FLOAT32, 0, None)

    def answer(*tables: tuple[str, int]) -> bytes:
        return ps_pb2.PullResponse(
            tables=[ps_pb2.TableValues(table=n, values=b"\0" * (8 * k)) for n, k in tables]
        ).SerializeToString()

    rows, _, _ = plan.rows([answer(("a", 10), ("b", 5))])
    assert [r.shape for r in rows] == [(10, 2), (5, 2)]
    with pytest.raises(ValueError, match="answered 1 tables; more were asked"):
        plan.rows([answer(("a", 10))])
    with pytest.raises(ValueError, match="answered 3 tables; 2 were asked"):
        plan.rows([answer(("a", 10), ("b", 5), ("c", 1))])
    with pytest.raises(ValueError, match="holds table 'b' where 'a' was asked"):
        plan.rows([answer(("b", 10), ("a", 5))])
    with pytest.raises(ValueError, match="`rows of b` has 32 bytes"):
        plan.rows([answer(("a", 10), ("b", 4))])
    with pytest.raises(ValueError, match="truncated"):
        plan.rows([answer(("a", 10), ("b", 5))[:-3]])
    with pytest.raises(ValueError, match="was asked but not answered"):
        plan.rows([None])
    with pytest.raises(ValueError, match="`keys` must have dtype int64"):
        _core.PullPlan(["a"], [np.zeros(2, np.int32)], [2], np.zeros(1, np.int64), NUM_SLOTS)
