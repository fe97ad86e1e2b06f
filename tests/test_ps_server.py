"""The parameter-server shard, over real `elastic-emb serve` processes on 127.0.0.1.

Malformed requests (sent with the raw gRPC stub, bypassing the client's own
checks), an unreachable PS, how keys spread over shards, the float16 and
bfloat16 wire encodings, the `health` command, SIGTERM checkpoints and the
Stats RPC.

Expected values come from outside the code under test: NumPy's float16 and
ml_dtypes' bfloat16 casts, an in-process `ee.Table` trained on the same
data, `sharding.shard_of` applied to the keys by the test, the sizes of the
raw payloads, and the server's row dumps taken before and after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import json
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest
from _cluster import serve_command, shards

import elastic_emb as ee
from elastic_emb import placement
from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.ps.client.cluster import Cluster
from elastic_emb.ps.client.remote_table import RemoteTable
from elastic_emb.ps.wire import protocol as wire
from elastic_emb.tables import sharding

# Every Join to the module's shards must agree: ASYNC, 4 workers, unbounded
# staleness. The ee.init sessions are worker 0; the raw-stub tests are worker 3.
NUM_WORKERS = 4
RAW_WORKER = 3
CODE = grpc.StatusCode

_names = itertools.count()


def _name(prefix: str) -> str:
    return f"ps_{prefix}_{next(_names)}"


@pytest.fixture(scope="module")
def cluster():
    """Three shards shared by the module's tests."""
    with shards(3) as started:
        yield started


@pytest.fixture(scope="module")
def stubs(cluster):
    channels = [grpc.insecure_channel(s.address) for s in cluster]
    yield [ps_pb2_grpc.ParameterServerStub(c) for c in channels]
    for c in channels:
        c.close()


@contextlib.contextmanager
def _connected(addresses: list[str], **kwargs: Any) -> Iterator[Cluster]:
    """`ee.init` as worker 0 of NUM_WORKERS (async), always shut down."""
    gc.collect()  # in-process tables of earlier tests must be gone before ee.init
    kwargs.setdefault("worker_index", 0)
    kwargs.setdefault("num_workers", NUM_WORKERS)
    cluster = ee.init(ps=addresses, **kwargs)
    try:
        yield cluster
    finally:
        ee.shutdown()


def _config(name: str, dim: int = 4, seed: int = 11) -> dict[str, Any]:
    """A table configuration as `Table.config()` writes it, built by hand."""
    return {
        "name": name,
        "dim": dim,
        "seed": seed,
        "optimizer": {
            "class_name": "Adagrad",
            "learning_rate": 0.1,
            "initial_accumulator_value": 0.1,
            "epsilon": 1e-07,
        },
        "initializer": {"kind": "uniform", "a": -0.05, "b": 0.05},
    }


def _spec(config: dict[str, Any]) -> ps_pb2.TableSpec:
    return ps_pb2.TableSpec(name=config["name"], config_json=json.dumps(config))


def _keys(keys: np.ndarray) -> bytes:
    return np.asarray(keys, "<i8").tobytes()


def _f32(values: np.ndarray) -> bytes:
    return np.asarray(values, "<f4").tobytes()


def _method_stats(stub) -> dict[str, ps_pb2.MethodStats]:
    return {m.method: m for m in stub.Stats(ps_pb2.StatsRequest(), timeout=10).methods}


# 1. Malformed requests.


@dataclasses.dataclass
class RawWorker:
    """Worker RAW_WORKER on shard 0, talking through the raw stub."""

    stub: Any
    tables: list[str]  # both dim 4
    keys: np.ndarray  # rows present in both tables
    step: int  # last step pushed
    dim: int = 4

    def grads(self, n: int, dim: int | None = None) -> bytes:
        return _f32(np.full((n, dim or self.dim), 0.25, np.float32))

    def pull(self, keys: np.ndarray, train: bool = False, **kwargs: Any) -> ps_pb2.PullRequest:
        kwargs.setdefault("step", self.step + 1)
        if "tables" not in kwargs:
            kwargs["tables"] = [ps_pb2.TableKeys(table=self.tables[0], keys=_keys(keys))]
        return ps_pb2.PullRequest(worker=RAW_WORKER, train=train, timeout_ms=5000, **kwargs)

    def push(self, tables: list[ps_pb2.TableGradients], **kwargs: Any) -> ps_pb2.PushRequest:
        kwargs.setdefault("step", self.step + 1)
        return ps_pb2.PushRequest(worker=RAW_WORKER, tables=tables, **kwargs)

    def entry(
        self, table: int = 0, keys: Any = None, grads: bytes | None = None, **fields: Any
    ) -> Any:
        keys = self.keys if keys is None else keys
        raw_keys = keys if isinstance(keys, bytes) else _keys(keys)
        n = len(raw_keys) // 8
        return ps_pb2.TableGradients(
            table=self.tables[table],
            keys=raw_keys,
            gradients=self.grads(n) if grads is None else grads,
            **fields,
        )

    def snapshot(self) -> tuple[Any, ...]:
        """Everything a malformed request must leave alone."""
        exports = tuple(
            self.stub.ExportRows(
                ps_pb2.ExportRowsRequest(table=t, with_state=True), timeout=10
            ).SerializeToString()
            for t in self.tables
        )
        described = self.stub.DescribeTables(ps_pb2.DescribeTablesRequest(), timeout=10)
        return exports, described.SerializeToString(), self.stub.Health(ps_pb2.HealthRequest()).step


@pytest.fixture(scope="module")
def raw(stubs):
    stub = stubs[0]
    tables = [_name("malformed"), _name("malformed")]
    stub.CreateTables(
        ps_pb2.CreateTablesRequest(tables=[_spec(_config(t)) for t in tables]), timeout=10
    )
    joined = stub.Join(
        ps_pb2.JoinRequest(
            worker=RAW_WORKER, num_workers=NUM_WORKERS, mode=ps_pb2.ASYNC, staleness=-1
        ),
        timeout=10,
    )
    keys = np.arange(1, 41, dtype=np.int64) * 7919
    worker = RawWorker(stub, tables, keys, int(joined.step))
    pull = worker.pull(
        keys,
        train=True,
        tables=[ps_pb2.TableKeys(table=t, keys=_keys(keys)) for t in tables],
    )
    stub.Pull(pull, timeout=10)
    stub.Push(worker.push([worker.entry(0), worker.entry(1)]), timeout=10)
    worker.step += 1
    return worker


# Each case: (id, RPC, request builder, status code, words the message must hold).
Builder = Callable[[RawWorker, Path], Any]
_NEW_KEYS = np.arange(1, 11, dtype=np.int64) * -104729  # never pulled before


def _create_conflicting(w: RawWorker, _: Path) -> ps_pb2.CreateTablesRequest:
    # A new table first, then an existing name with another dim: neither may happen.
    return ps_pb2.CreateTablesRequest(
        tables=[_spec(_config("ps_never_created")), _spec(_config(w.tables[0], dim=8))]
    )


MALFORMED: list[tuple[str, str, Builder, grpc.StatusCode, tuple[str, ...]]] = [
    (
        "pull-unknown-table",
        "Pull",
        lambda w, _: w.pull(
            w.keys, tables=[ps_pb2.TableKeys(table="ps_no_such_table", keys=_keys(w.keys))]
        ),
        CODE.NOT_FOUND,
        ("ps_no_such_table",),
    ),
    (
        "push-unknown-table",
        "Push",
        lambda w, _: w.push(
            [
                w.entry(0),
                ps_pb2.TableGradients(
                    table="ps_no_such_table", keys=_keys(w.keys), gradients=w.grads(len(w.keys))
                ),
            ]
        ),
        CODE.NOT_FOUND,
        ("ps_no_such_table",),
    ),
    (
        "pull-ranges-with-an-unknown-table",
        "PullRanges",
        lambda w, _: ps_pb2.PullRangesRequest(
            parts=[
                w.pull(w.keys),
                w.pull(w.keys, tables=[ps_pb2.TableKeys(table="ps_no_such", keys=_keys(w.keys))]),
            ]
        ),
        CODE.NOT_FOUND,
        ("ps_no_such",),
    ),
    (
        "push-ranges-with-an-unknown-table",
        "PushRanges",
        lambda w, _: ps_pb2.PushRangesRequest(
            parts=[
                w.push(
                    [
                        ps_pb2.TableGradients(
                            table="ps_no_such", keys=_keys(w.keys), gradients=w.grads(len(w.keys))
                        )
                    ]
                )
            ]
        ),
        CODE.NOT_FOUND,
        ("ps_no_such",),
    ),
    (
        "export-unknown-table",
        "ExportRows",
        lambda w, _: ps_pb2.ExportRowsRequest(table="ps_no_such_table"),
        CODE.NOT_FOUND,
        ("ps_no_such_table",),
    ),
    (
        "push-gradients-of-another-dim",
        "Push",
        lambda w, _: w.push([w.entry(0), w.entry(1, grads=w.grads(len(w.keys), dim=3))]),
        CODE.INVALID_ARGUMENT,
        ("gradients of", "dim 4", f"{len(np.arange(40)) * 3 * 4} bytes"),
    ),
    (
        "pull-truncated-keys",
        "Pull",
        # The first entry would insert new rows; the second is 3 bytes short.
        lambda w, _: w.pull(
            None,
            train=True,
            tables=[
                ps_pb2.TableKeys(table=w.tables[0], keys=_keys(_NEW_KEYS)),
                ps_pb2.TableKeys(table=w.tables[1], keys=_keys(_NEW_KEYS)[:-3]),
            ],
        ),
        CODE.INVALID_ARGUMENT,
        ("keys of", "77 bytes", "int64"),
    ),
    (
        "push-truncated-keys",
        "Push",
        lambda w, _: w.push(
            [w.entry(0), w.entry(1, keys=_keys(w.keys)[:-5], grads=w.grads(len(w.keys)))]
        ),
        CODE.INVALID_ARGUMENT,
        ("keys of", "315 bytes", "int64"),
    ),
    (
        "push-gradients-a-few-bytes-short",
        "Push",
        lambda w, _: w.push([w.entry(0), w.entry(1, grads=w.grads(len(w.keys))[:-3])]),
        CODE.INVALID_ARGUMENT,
        ("gradients of", "637 bytes", "640"),
    ),
    (
        "push-nan-gradients",
        "Push",
        lambda w, _: w.push(
            [w.entry(0), w.entry(1, grads=_f32(np.full((len(w.keys), 4), np.nan, np.float32)))]
        ),
        CODE.INVALID_ARGUMENT,
        ("NaN",),
    ),
    (
        "pull-unknown-encoding",
        "Pull",
        lambda w, _: w.pull(w.keys, encoding=7),
        CODE.INVALID_ARGUMENT,
        ("Unknown encoding 7",),
    ),
    (
        "push-unknown-encoding",
        "Push",
        lambda w, _: w.push([w.entry(0)], encoding=7),
        CODE.INVALID_ARGUMENT,
        ("Unknown encoding 7",),
    ),
    (
        "push-skipping-a-step",
        "Push",
        lambda w, _: w.push([w.entry(0)], step=w.step + 2),
        CODE.INVALID_ARGUMENT,
        ("wrong step",),
    ),
    (
        "push-step-0",
        "Push",
        lambda w, _: w.push([w.entry(0)], step=0),
        CODE.INVALID_ARGUMENT,
        ("wrong step 0",),
    ),
    (
        "pull-step-0",
        "Pull",
        lambda w, _: w.pull(w.keys, step=0),
        CODE.INVALID_ARGUMENT,
        ("wrong step 0",),
    ),
    (
        "pull-steps-ahead",
        "Pull",
        lambda w, _: w.pull(w.keys, step=w.step + 100),
        CODE.INVALID_ARGUMENT,
        ("wrong step",),
    ),
    (
        "pull-truncated-varint-keys",
        "Pull",
        lambda w, _: w.pull(
            None,
            tables=[
                ps_pb2.TableKeys(table=w.tables[0], keys=_keys(_NEW_KEYS)),
                ps_pb2.TableKeys(
                    table=w.tables[1], keys=b"\x05\x81", key_encoding=ps_pb2.KEYS_DELTA_VARINT
                ),
            ],
        ),
        CODE.INVALID_ARGUMENT,
        ("truncated",),
    ),
    (
        "push-unknown-key-encoding",
        "Push",
        lambda w, _: w.push([w.entry(0), w.entry(1, key_encoding=9)]),
        CODE.INVALID_ARGUMENT,
        ("key encoding 9",),
    ),
    (
        "push-absurd-gradient-exponent",
        "Push",
        lambda w, _: w.push([w.entry(0), w.entry(1, gradient_exponent=5000)]),
        CODE.INVALID_ARGUMENT,
        ("gradient_exponent 5000",),
    ),
    (
        "push-table-twice",
        "Push",
        lambda w, _: w.push([w.entry(0), w.entry(1), w.entry(0)]),
        CODE.INVALID_ARGUMENT,
        ("appears twice",),
    ),
    (
        "create-config-not-json",
        "CreateTables",
        lambda w, _: ps_pb2.CreateTablesRequest(
            tables=[ps_pb2.TableSpec(name="ps_not_json", config_json="{'dim': 4,")]
        ),
        CODE.INVALID_ARGUMENT,
        ("ps_not_json", "not JSON"),
    ),
    (
        "create-existing-with-another-config",
        "CreateTables",
        _create_conflicting,
        CODE.ALREADY_EXISTS,
        ("another configuration",),
    ),
    (
        "join-another-mode",
        "Join",
        lambda w, _: ps_pb2.JoinRequest(
            worker=RAW_WORKER, num_workers=NUM_WORKERS, mode=ps_pb2.SYNC, staleness=-1
        ),
        CODE.FAILED_PRECONDITION,
        ("SYNC", "ASYNC"),
    ),
    (
        "join-another-num-workers",
        "Join",
        lambda w, _: ps_pb2.JoinRequest(worker=1, num_workers=2, mode=ps_pb2.ASYNC, staleness=-1),
        CODE.FAILED_PRECONDITION,
        ("this shard runs ('ASYNC', 4, -1)",),
    ),
    (
        "restore-missing-directory",
        "Restore",
        lambda w, tmp: ps_pb2.RestoreRequest(
            directories=[str(tmp / "no_checkpoint_here")], num_shards=1, shard_index=0
        ),
        CODE.FAILED_PRECONDITION,
        ("no_checkpoint_here",),
    ),
]


@pytest.mark.parametrize(
    "rpc, build, code, words", [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED]
)
def test_malformed_request_is_rejected_and_changes_nothing(raw, tmp_path, rpc, build, code, words):
    request = build(raw, tmp_path)
    before = raw.snapshot()
    errors_before = _method_stats(raw.stub).get(rpc, ps_pb2.MethodStats()).errors

    with pytest.raises(grpc.RpcError) as info:
        getattr(raw.stub, rpc)(request, timeout=10)

    details = info.value.details()
    assert info.value.code() == code, details
    for word in words:
        assert word in details, details
    assert raw.snapshot() == before
    assert _method_stats(raw.stub)[rpc].errors == errors_before + 1
    # Still serving: Health, and a valid pull returning the exported rows.
    assert raw.stub.Health(ps_pb2.HealthRequest(), timeout=10).serving
    exported = raw.stub.ExportRows(ps_pb2.ExportRowsRequest(table=raw.tables[0]), timeout=10)
    keys = np.frombuffer(exported.keys, "<i8")
    values = np.frombuffer(exported.values, "<f4").reshape(len(keys), raw.dim)
    assert set(keys.tolist()) == set(raw.keys.tolist())
    reply = raw.stub.Pull(raw.pull(raw.keys), timeout=10)
    pulled = np.frombuffer(reply.tables[0].values, "<f4").reshape(len(raw.keys), raw.dim)
    order = np.argsort(keys)
    np.testing.assert_array_equal(pulled, values[order][np.searchsorted(keys[order], raw.keys)])


def test_ranges_calls_answer_as_their_parts_would_one_by_one(raw):
    """PullRanges and PushRanges (a server's ranges in one call): the same answers, the
    same effect, as the parts sent one by one."""
    pulls = [raw.pull(raw.keys[:10]), raw.pull(raw.keys[5:])]
    batched = raw.stub.PullRanges(ps_pb2.PullRangesRequest(parts=pulls), timeout=10)
    assert [p.SerializeToString() for p in batched.parts] == [
        raw.stub.Pull(p, timeout=10).SerializeToString() for p in pulls
    ]
    before = raw.stub.ExportRows(ps_pb2.ExportRowsRequest(table=raw.tables[0]), timeout=10)
    first, again = raw.push([raw.entry(0)]), raw.push([raw.entry(0)], step=raw.step + 2)
    answer = raw.stub.PushRanges(ps_pb2.PushRangesRequest(parts=[first]), timeout=10)
    raw.step += 1
    assert [p.step for p in answer.parts] == [raw.step]
    after = raw.stub.ExportRows(ps_pb2.ExportRowsRequest(table=raw.tables[0]), timeout=10)
    assert after.iterations == before.iterations + 1
    # A step sent again within a batch is applied once, as alone (its own step is next).
    both = ps_pb2.PushRangesRequest(parts=[first, again])
    raw.stub.PushRanges(both, timeout=10)
    raw.step += 1
    final = raw.stub.ExportRows(ps_pb2.ExportRowsRequest(table=raw.tables[0]), timeout=10)
    assert final.iterations == after.iterations + 1


def test_a_push_sent_again_is_acknowledged_and_applied_once(raw):
    """(worker, step) identifies a push: a worker re-sending it after a failover changes nothing."""
    before = raw.snapshot()
    raw.stub.Push(raw.push([raw.entry(0)], step=raw.step), timeout=10)
    assert raw.snapshot() == before
    raw.stub.Push(raw.push([raw.entry(0)], step=raw.step + 1), timeout=10)
    raw.step += 1
    assert raw.snapshot() != before


def test_worker_continues_at_its_next_step_after_rejected_pushes(raw):
    """Rejected pushes did not advance the worker: its next push is still last + 1."""
    before = raw.stub.ExportRows(ps_pb2.ExportRowsRequest(table=raw.tables[0]), timeout=10)
    reply = raw.stub.Push(raw.push([raw.entry(0)]), timeout=10)
    raw.step += 1
    assert reply.step >= raw.step
    after = raw.stub.ExportRows(ps_pb2.ExportRowsRequest(table=raw.tables[0]), timeout=10)
    assert after.iterations == before.iterations + 1
    assert after.values != before.values
    rejoined = raw.stub.Join(
        ps_pb2.JoinRequest(
            worker=RAW_WORKER, num_workers=NUM_WORKERS, mode=ps_pb2.ASYNC, staleness=-1
        ),
        timeout=10,
    )
    assert rejoined.step == raw.step


def test_create_tables_with_the_same_config_is_idempotent(raw):
    before = raw.snapshot()
    reply = raw.stub.CreateTables(
        ps_pb2.CreateTablesRequest(tables=[_spec(_config(raw.tables[0]))]), timeout=10
    )
    assert [t.name for t in reply.tables] == [raw.tables[0]]
    assert reply.tables[0].rows == len(raw.keys)
    assert raw.snapshot() == before
    # An empty table, named twice in one request and again in another: one table.
    empty = _spec(_config(_name("empty")))
    for specs in ([empty, empty], [empty]):
        reply = raw.stub.CreateTables(ps_pb2.CreateTablesRequest(tables=specs), timeout=10)
        assert [(t.name, t.rows) for t in reply.tables] == [(empty.name, 0)] * len(specs)
    described = raw.stub.DescribeTables(ps_pb2.DescribeTablesRequest(), timeout=10)
    assert [t.name for t in described.tables].count(empty.name) == 1


# 2. Unreachable PS.


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_ps_raises_connection_error_naming_it(cluster):
    closed = f"127.0.0.1:{_closed_port()}"
    for ps in ([closed], [cluster[0].address, closed]):
        start = time.monotonic()
        try:
            with pytest.raises(ConnectionError) as info:
                ee.init(ps=ps, connect_timeout=1)
        finally:
            ee.shutdown()
        assert time.monotonic() - start < 20  # a hang guard
        assert closed in str(info.value)
        assert cluster[0].address not in str(info.value)
        assert placement.current_cluster() is None


# 3. Keys spread over shards.


def test_keys_spread_evenly_and_as_shard_of_says(cluster, stubs):
    rng = np.random.default_rng(3)
    keys = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, 30_000, dtype=np.int64)
    assert len(np.unique(keys)) == len(keys)
    name = _name("spread")
    with _connected([s.address for s in cluster]):
        table = ee.Table(2, name=name)
        table.pull(keys, train=True)
        assert len(table) == len(keys)
    counts = [
        stubs[i]
        .DescribeTables(ps_pb2.DescribeTablesRequest(names=[name]), timeout=10)
        .tables[0]
        .rows
        for i in range(3)
    ]
    expected = np.bincount(sharding.shard_of(keys, 3), minlength=3)
    assert counts == expected.tolist()
    for count in counts:
        assert abs(count - 10_000) <= 1_000, counts


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 4096])
def test_even_ranges_are_the_slots_shard_of_assigns(n):
    slots = np.arange(sharding.NUM_SLOTS)
    by_formula = slots * n // sharding.NUM_SLOTS  # shard_of's rule, on the slots themselves
    ranges = sharding.even_ranges(n)
    assert ranges[0][0] == 0 and ranges[-1][1] == sharding.NUM_SLOTS
    for i, (begin, end) in enumerate(ranges):
        assert (by_formula[begin:end] == i).all() and begin < end
    keys = np.random.default_rng(n).integers(-(2**62), 2**62, 5000)
    starts = np.array([b for b, _ in ranges])
    even, explicit = sharding.split_by_shard(keys, n), sharding.split_by_shard(keys, n, starts)
    for i in range(n):
        np.testing.assert_array_equal(even[i], explicit[i])
        assert (sharding.shard_of(keys[even[i]], n) == i).all()


def test_split_by_explicit_slot_ranges():
    keys = np.random.default_rng(0).integers(-(2**62), 2**62, 20_000)
    starts = np.array([0, 100, 3000])  # uneven: [0, 100), [100, 3000), [3000, 4096)
    parts = sharding.split_by_shard(keys, 3, starts)
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(keys)))
    for part, (begin, end) in zip(parts, [(0, 100), (100, 3000), (3000, 4096)], strict=True):
        slots = sharding.slot_of(keys[part])
        assert ((slots >= begin) & (slots < end)).all()
        assert (np.diff(keys[part].view(np.uint64).astype(np.float64)) > 0).all()  # ascending


def test_split_gives_an_empty_range_no_keys():
    keys = np.random.default_rng(2).integers(-(2**62), 2**62, 5000)
    starts = np.array([0, 100, 100, 3000])  # range 1 is [100, 100): empty
    parts = sharding.split_by_shard(keys, 4, starts)
    expected = np.searchsorted(starts, sharding.slot_of(keys), side="right") - 1
    assert len(parts[1]) == 0
    for i, part in enumerate(parts):
        assert (expected[part] == i).all() and len(part) == (expected == i).sum()


def test_split_keeps_equal_keys_in_input_order():
    keys = np.random.default_rng(1).integers(-50, 50, 3000)
    for part in sharding.split_by_shard(keys, 3):
        k, pos = keys[part].view(np.uint64), part
        assert ((k[1:] > k[:-1]) | ((k[1:] == k[:-1]) & (pos[1:] > pos[:-1]))).all()
    assert sorted(np.concatenate(sharding.split_by_shard(keys, 3)).tolist()) == list(range(3000))


# 4. Wire encodings.


def _special_floats() -> np.ndarray:
    f32 = np.finfo(np.float32)
    values = [0.0, -0.0, 1.0, -1.0, 1.5, -2.75, 1e-3, -1e-3, 65504.0, 65520.0, 7e4, -7e4,
              1e-5, 6e-8, 2e-8, -3e-8, 1e-40, -1e-40, f32.tiny, f32.max, -f32.max,
              3e38, np.inf, -np.inf]  # fmt: skip
    # bfloat16 ties (8 significant bits): halfway cases round to the even neighbour.
    values += [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), -(1 + 3 * 2**-8), 1 + 2**-8 + 2**-20]
    # float16 ties (11 significant bits).
    values += [1 + 2**-11, 1 + 3 * 2**-11, -(1 + 3 * 2**-11), 2048 + 1, 2048 + 3]
    rng = np.random.default_rng(0)
    random_bits = rng.integers(0, 2**32, 20_000, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([np.array(values, np.float32), random_bits.view(np.float32)])


def test_float16_encoding_is_numpys_float16():
    values = _special_floats()
    finite = values[~np.isnan(values)]
    with np.errstate(over="ignore"):  # values beyond 65504 become inf
        raw = wire.encode_floats(finite.reshape(-1, 1), ps_pb2.FLOAT16)
    assert len(raw) == 2 * len(finite)
    with np.errstate(over="ignore"):
        expected = finite.astype(np.float16)
    assert raw == expected.astype("<f2").tobytes()
    decoded = wire.decode_floats(raw, ps_pb2.FLOAT16, len(finite), 1)
    assert decoded.dtype == np.float32 and decoded.shape == (len(finite), 1)
    np.testing.assert_array_equal(decoded[:, 0], expected.astype(np.float32))
    nan = wire.decode_floats(wire.encode_floats(np.float32([[np.nan]]), ps_pb2.FLOAT16), 1, 1, 1)
    assert np.isnan(nan).all()


def test_bfloat16_encoding_is_ml_dtypes_rounding():
    values = _special_floats()
    nan = np.isnan(values)
    raw = wire.encode_floats(values.reshape(-1, 2), ps_pb2.BFLOAT16)
    assert len(raw) == 2 * len(values)
    got_bits = np.frombuffer(raw, "<u2")
    with np.errstate(invalid="ignore"):  # NaNs
        expected = values.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got_bits[~nan], expected.view(np.uint16)[~nan])
    # The ties listed above, by hand: 1 + 2^-8 -> 1.0, 1 + 3 * 2^-8 -> 1 + 2^-6.
    assert got_bits[np.flatnonzero(values == np.float32(1 + 2**-8))[0]] == 0x3F80
    assert got_bits[np.flatnonzero(values == np.float32(1 + 3 * 2**-8))[0]] == 0x3F82
    max_at = np.flatnonzero(values == np.finfo(np.float32).max)[0]
    assert got_bits[max_at] == 0x7F80  # float32's largest rounds up to bfloat16's inf
    decoded = wire.decode_floats(raw, ps_pb2.BFLOAT16, len(values) // 2, 2).reshape(-1)
    assert decoded.dtype == np.float32
    assert np.isnan(decoded[nan]).all()  # NaNs stay NaN (never inf)
    np.testing.assert_array_equal(decoded[~nan], expected[~nan].astype(np.float32))
    # The bits of the random NaNs keep their sign.
    assert (np.signbit(decoded[nan]) == np.signbit(values[nan])).all()


@pytest.mark.parametrize(
    "enc, itemsize", [(ps_pb2.FLOAT32, 4), (ps_pb2.FLOAT16, 2), (ps_pb2.BFLOAT16, 2)]
)
def test_decode_rejects_wrong_lengths(enc, itemsize):
    values = np.arange(12, dtype=np.float32).reshape(3, 4) / 8
    raw = wire.encode_floats(values, enc)
    assert len(raw) == 12 * itemsize
    np.testing.assert_array_equal(wire.decode_floats(raw, enc, 3, 4), values)
    for bad, n, dim in [(raw[:-1], 3, 4), (raw + b"\0" * itemsize, 3, 4), (raw, 3, 5), (raw, 2, 4)]:
        with pytest.raises(wire.WireError, match="bytes"):
            wire.decode_floats(bad, enc, n, dim)
    assert wire.decode_floats(b"", enc, 0, 4).shape == (0, 4)


KEY_CASES = [
    np.zeros(0, np.int64),
    np.array([0, 1, -1, 127, 128, 2**63 - 1, -(2**63)], np.int64),
    np.random.default_rng(5).integers(-(2**63), 2**63 - 1, 1000),  # unsorted: wraps
    np.repeat(np.arange(5, dtype=np.int64), 3),  # duplicates: zero deltas
]


@pytest.mark.parametrize("keys", KEY_CASES, ids=["empty", "edges", "random", "duplicates"])
def test_varint_keys_round_trip(keys):
    raw = wire.encode_keys(keys, ps_pb2.KEYS_DELTA_VARINT)
    np.testing.assert_array_equal(
        wire.decode_keys(raw, key_encoding=ps_pb2.KEYS_DELTA_VARINT), keys
    )
    compact, encoding = wire.encode_keys_compact(keys)
    assert len(compact) <= 8 * len(keys)
    np.testing.assert_array_equal(wire.decode_keys(compact, key_encoding=encoding), keys)


def _numpy_delta_varint(keys: np.ndarray) -> bytes:
    """The reference encoding, in NumPy: deltas modulo 2^64, LEB128 (low 7 bits first)."""
    u = keys.astype(np.int64).view(np.uint64)
    deltas = np.diff(u, prepend=np.uint64(0))  # modulo 2^64
    out = bytearray()
    for d in deltas.tolist():
        while d >= 0x80:
            out.append((d & 0x7F) | 0x80)
            d >>= 7
        out.append(d)
    return bytes(out)


@pytest.mark.parametrize("keys", KEY_CASES, ids=["empty", "edges", "random", "duplicates"])
def test_varint_keys_match_a_reference_encoder(keys):
    assert wire.encode_keys(keys, ps_pb2.KEYS_DELTA_VARINT) == _numpy_delta_varint(keys)


def test_ascending_keys_take_few_bytes():
    keys = np.unique(np.random.default_rng(6).integers(1, 1_000_000, 4000))
    raw, encoding = wire.encode_keys_compact(keys)
    assert encoding == ps_pb2.KEYS_DELTA_VARINT
    # Gaps average 250 < 2^14: at most two bytes a key.
    assert len(raw) <= 2 * len(keys)


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"\x80", "truncated"),
        (b"\xff" * 9 + b"\x02", "beyond 64 bits"),
        (b"\xff" * 11, "truncated"),
        (b"\xff" * 10 + b"\x01", "beyond 64 bits"),
        (b"\x05\x80\x80", "truncated"),
    ],
)
def test_malformed_varints_are_rejected(raw, message):
    with pytest.raises(wire.WireError, match=message):
        wire.decode_keys(raw, key_encoding=ps_pb2.KEYS_DELTA_VARINT)


def test_gradient_exponent_keeps_tiny_float16_gradients_precise():
    grads = np.random.default_rng(7).normal(size=(500, 16)).astype(np.float32) * 3e-6
    exponent = wire.gradient_exponent(grads, ps_pb2.FLOAT16)
    assert 2**14 <= np.abs(wire.scale(grads, exponent)).max() < 2**15
    raw = wire.encode_floats(wire.scale(grads, exponent), ps_pb2.FLOAT16)
    back = wire.scale(wire.decode_floats(raw, ps_pb2.FLOAT16, 500, 16), -exponent)
    # Rounding to float16's 11 significant bits, down to 2^-24 of the largest value.
    tolerance = 2.0**-11 * np.abs(grads) + 2.0**-24 * np.abs(grads).max()
    assert (np.abs(back - grads) <= tolerance).all()
    # Without the exponent most of them would be float16 subnormals, far less precise.
    plain = np.frombuffer(wire.encode_floats(grads, ps_pb2.FLOAT16), "<f2").astype(np.float32)
    relative = [
        np.median(np.abs(x.reshape(grads.shape) - grads) / np.abs(grads)) for x in (plain, back)
    ]
    assert relative[0] > 10 * relative[1]
    assert wire.gradient_exponent(grads, ps_pb2.BFLOAT16) == 0


def test_wire_rejects_unknown_encodings_and_truncated_keys():
    with pytest.raises(wire.WireError, match="Unknown encoding 7"):
        wire.decode_floats(b"\0" * 8, 7, 1, 2)
    with pytest.raises(wire.WireError, match="7"):
        wire.encode_floats(np.zeros((1, 2), np.float32), 7)
    with pytest.raises(ValueError, match="wire_dtype"):
        wire.encoding("float64")
    keys = np.array([1, -2, 2**62], np.int64)
    np.testing.assert_array_equal(wire.decode_keys(_keys(keys)), keys)
    with pytest.raises(wire.WireError, match="23 bytes"):
        wire.decode_keys(_keys(keys)[:-1])


# 5. Float16 and bfloat16 on the wire, end to end.

DIM, LR, STEPS = 16, 0.05, 4


def _workload(table: ee.Table, round_grads: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """A few pull/push steps on distinct keys; returns everything pulled, in order."""
    rng = np.random.default_rng(42)
    pulled = []
    for _ in range(STEPS):
        keys = rng.choice(400, 200, replace=False).astype(np.int64)
        pulled.append(table.pull(keys))
        grads = rng.normal(0, 1, (len(keys), DIM)).astype(np.float32)
        table.push(keys, round_grads(grads))
    pulled.append(table.pull(np.arange(400), train=False))
    return np.concatenate(pulled)


def _adagrad() -> ee.optimizers.Adagrad:
    return ee.optimizers.Adagrad(learning_rate=LR)


def _remote_run(addresses: list[str], wire_dtype: str) -> tuple[np.ndarray, int]:
    """(pulled values, bytes sent and received over all shards) of the workload."""
    with _connected(addresses, wire_dtype=wire_dtype) as cluster:
        table = ee.Table(DIM, optimizer=_adagrad(), seed=5, name=_name(wire_dtype))
        cluster.reset_stats()  # the workload only, not the table's creation
        pulled = _workload(table, lambda g: g)
        stats = cluster.stats()
    assert [s["address"] for s in stats] == addresses
    return pulled, sum(s["bytes_sent"] + s["bytes_received"] for s in stats)


def _local_run(round_grads: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    table = ee.Table(DIM, optimizer=_adagrad(), seed=5, name=_name("local"))
    try:
        return _workload(table, round_grads)
    finally:
        del table
        gc.collect()


def _via(dtype: Any) -> Callable[[np.ndarray], np.ndarray]:
    return lambda a: np.asarray(a, np.float32).astype(dtype).astype(np.float32)


def _significand_bits(bits: int) -> Callable[[np.ndarray], np.ndarray]:
    """Rounds to `bits` significant bits, half to even, at any exponent.

    What float16 gradients get on the wire: they are scaled by a power of two
    into float16's normal range first, so no subnormal rounding happens.
    """

    def round_(a: np.ndarray) -> np.ndarray:
        mantissa, exponent = np.frexp(np.asarray(a, np.float64))
        return np.ldexp(np.round(mantissa * 2.0**bits) / 2.0**bits, exponent).astype(np.float32)

    return round_


@pytest.mark.parametrize(
    "wire_dtype, dtype, round_grads",
    [
        ("float16", np.float16, _significand_bits(11)),
        ("bfloat16", ml_dtypes.bfloat16, _via(ml_dtypes.bfloat16)),
    ],
)
def test_half_precision_wire_matches_in_process_training(cluster, wire_dtype, dtype, round_grads):
    addresses = [s.address for s in cluster]
    remote32, bytes32 = _remote_run(addresses, "float32")
    remote16, bytes16 = _remote_run(addresses, wire_dtype)
    local = _local_run(lambda g: g)

    # float32 on the wire is exactly the in-process table.
    np.testing.assert_array_equal(remote32, local)

    # With half-precision gradients the PS runs the same float32 optimizer, so an
    # in-process table fed the same rounded gradients holds identical rows, and
    # the pulled values are exactly those rows rounded by NumPy / ml_dtypes.
    np.testing.assert_array_equal(remote16, _via(dtype)(_local_run(round_grads)))

    # Against float32 training. With unit roundoff u (2^-11 float16, 2^-8
    # bfloat16): a pulled value is the PS row rounded once, |error| <= u |v|;
    # each Adagrad update lr * g / sqrt(acc) with g rounded (and acc built from
    # rounded g) moves by at most 2 u lr (|update| < lr, relative error <= 2u on
    # distinct keys), so after STEPS pushes rows differ by <= STEPS * 2u * lr.
    # rtol = 2u (1e-3 for float16) leaves a factor 2 on the first term.
    u = 2.0**-11 if wire_dtype == "float16" else 2.0**-8
    np.testing.assert_allclose(remote16, local, rtol=2 * u, atol=STEPS * 2 * u * LR + 1e-7)
    assert not np.array_equal(remote16, local)  # the rounding did happen

    # Keys cost the same either way; values and gradients take 2 bytes instead
    # of 4, so at most (8 + 2 * 16) / (8 + 4 * 16) = 0.56 of the bytes.
    assert bytes16 <= 0.6 * bytes32, (bytes16, bytes32)


# 6. The `health` command and SIGTERM checkpoints.


def _cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*serve_command(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_health_command(cluster):
    closed = f"127.0.0.1:{_closed_port()}"
    start = time.monotonic()
    # Both at once, to save time.
    ok, down = _cli("health", cluster[1].address), _cli("health", closed, "--timeout", "2")
    ok_out, ok_err = ok.communicate(timeout=120)
    _, down_err = down.communicate(timeout=120)
    assert ok.returncode == 0, ok_err
    assert cluster[1].address in ok_out and "serving" in ok_out
    assert down.returncode != 0
    assert closed in down_err and "not serving" in down_err
    assert time.monotonic() - start < 120  # a hang guard


def test_a_second_server_on_a_port_in_use_exits_and_the_first_keeps_serving(cluster):
    """gRPC's default SO_REUSEPORT would let both listen and split the traffic."""
    port = cluster[0].address.rsplit(":", 1)[1]
    second = subprocess.run(
        [*serve_command(), "serve", "--host", "127.0.0.1", "--port", port],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert second.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in second.stdout + second.stderr
    ok = _cli("health", cluster[0].address)
    assert ok.communicate(timeout=120)[0].count("serving") == 1 and ok.returncode == 0


def test_sigterm_saves_a_checkpoint_restorable_in_process(tmp_path):
    final = tmp_path / "final"
    name = _name("final")
    with shards(1, ["--checkpoint-dir", str(final)]) as (shard,):
        with _connected([shard.address], num_workers=1):
            table = ee.Table(8, optimizer=_adagrad(), seed=9, name=name)
            rng = np.random.default_rng(1)
            pulled = set(range(1000, 1010))
            for _ in range(3):
                keys = rng.integers(0, 300, 100)
                pulled |= set(keys.tolist())
                table.pull(keys)
                table.push(keys, rng.normal(size=(100, 8)).astype(np.float32))
            table.pull(np.arange(1000, 1010))  # rows never pushed
            saved = table.export_state()
            assert saved.iterations == 3
        del table
        gc.collect()
        assert not final.exists()
        returncode = shard.stop()
        assert returncode == 0, "".join(shard.output)

    restored = ee.restore(final)
    try:
        table = restored[name]
        assert not isinstance(table, RemoteTable)
        state = table.export_state()
        assert state.iterations == saved.iterations
        a, b = np.argsort(saved.keys), np.argsort(state.keys)
        np.testing.assert_array_equal(state.keys[b], saved.keys[a])
        for field in ("values", "slots", "last_step", "update_count"):
            np.testing.assert_array_equal(getattr(state, field)[b], getattr(saved, field)[a])
        assert set(state.keys.tolist()) == pulled  # every row pulled, nothing else
    finally:
        restored.clear()
        gc.collect()


# 7. Stats.


def test_stats_count_the_calls_and_bytes_the_client_sent(cluster, stubs):
    dim = 4
    candidates = np.arange(100_000, dtype=np.int64)
    only_shard0 = candidates[sharding.shard_of(candidates, 3) == 0][:50]
    rng = np.random.default_rng(7)
    pulls = [rng.integers(0, 10**9, 120) for _ in range(3)] + [only_shard0, only_shard0[:10]]
    pushes = [rng.integers(0, 10**9, 60) for _ in range(2)]

    with _connected([s.address for s in cluster]) as client:
        table = ee.Table(dim, name=_name("stats"))
        client.reset_stats()
        before = [_method_stats(s) for s in stubs]
        for keys in pulls:
            table.pull(keys)
        for keys in pushes:
            table.push(keys, np.ones((len(keys), dim), np.float32))
        sent = client.stats()
        after = [_method_stats(s) for s in stubs]

    def delta(shard: int, method: str, field: str) -> int:
        old = before[shard].get(method, ps_pb2.MethodStats())
        return getattr(after[shard][method], field) - getattr(old, field)

    for shard in range(3):
        # What this shard should have received, from the keys alone.
        pulled = [np.unique(k)[sharding.shard_of(np.unique(k), 3) == shard] for k in pulls]
        pushed = [k[sharding.shard_of(k, 3) == shard] for k in pushes]
        assert delta(shard, "Pull", "calls") == sum(len(k) > 0 for k in pulled)
        assert delta(shard, "Push", "calls") == len(pushes)  # every shard hears every step
        assert delta(shard, "Pull", "errors") == delta(shard, "Push", "errors") == 0

        # Payloads: keys in their compact coding (ascending, delta + varint, or raw
        # if smaller); 4 bytes a float. Message framing adds < 64 bytes a call.
        def key_bytes(keys: np.ndarray) -> int:
            ascending = np.sort(keys.view(np.uint64)).view(np.int64)
            return len(wire.encode_keys_compact(ascending)[0])

        n_pull = sum(len(k) for k in pulled)
        n_push = sum(len(k) for k in pushed)
        calls = delta(shard, "Pull", "calls") + delta(shard, "Push", "calls")
        request = delta(shard, "Pull", "request_bytes") + delta(shard, "Push", "request_bytes")
        response = delta(shard, "Pull", "response_bytes") + delta(shard, "Push", "response_bytes")
        payload_sent = sum(map(key_bytes, pulled + pushed)) + 4 * dim * n_push
        assert payload_sent <= request <= payload_sent + 64 * calls
        assert 4 * dim * n_pull <= response <= 4 * dim * n_pull + 64 * calls
        # And exactly what the client counted.
        assert sent[shard]["rpcs"] == calls
        assert sent[shard]["bytes_sent"] == request
        assert sent[shard]["bytes_received"] == response
    assert delta(0, "Pull", "calls") == len(pulls)
    assert delta(1, "Pull", "calls") == delta(2, "Pull", "calls") == len(pulls) - 2
