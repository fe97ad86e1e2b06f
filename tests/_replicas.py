"""Helpers of the tests of replicated groups: a server's rows, training, the reference."""

import gc

import grpc
import numpy as np
from _states import sorted_state

import elastic_emb as ee
from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.ps.coord.local_cluster import LocalCluster
from elastic_emb.ps.wire import protocol
from elastic_emb.tables.table import TableState


def export(address: str, table: str, security=None) -> dict[str, np.ndarray]:
    """A replica's rows, optimizer slots and metadata (all its ranges), sorted by key;
    `security`: a `ClientSecurity` for a server with TLS or tokens."""
    secured = security is not None
    with security.channel(address, []) if secured else grpc.insecure_channel(address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        states = []
        for range_id in stub.Health(ps_pb2.HealthRequest(), timeout=10).ranges:
            info = stub.DescribeTables(
                ps_pb2.DescribeTablesRequest(names=[table], range=range_id), timeout=10
            )
            response = stub.ExportRows(
                ps_pb2.ExportRowsRequest(table=table, with_state=True, range=range_id), timeout=10
            )
            t = info.tables[0]
            states.append(protocol.read_state(response, t.dim, t.num_slots))
    return sorted_state(TableState.concatenate(states))


def health(address: str) -> ps_pb2.HealthResponse:
    with grpc.insecure_channel(address) as channel:
        return ps_pb2_grpc.ParameterServerStub(channel).Health(ps_pb2.HealthRequest(), timeout=5)


def role(address: str) -> str:
    """The server's role, or "" while it does not answer (starting)."""
    try:
        return health(address).role
    except grpc.RpcError:
        return ""


def make_table(name: str) -> ee.Table:
    return ee.Table(8, optimizer=ee.optimizers.Adam(0.01), name=name, seed=3)


def train(table: ee.Table, steps: range, on_step=None) -> None:
    """Deterministic steps: pull 64 keys of 500, push a gradient made from the rows."""
    for step in steps:
        rng = np.random.default_rng(step)
        keys = np.unique(rng.integers(0, 500, 64))
        rows = table.pull(keys)
        table.push(keys, (rows * 0.5 + rng.normal(size=rows.shape)).astype(np.float32))
        if on_step is not None:
            on_step(step)


def local_state(table: ee.Table) -> dict[str, np.ndarray]:
    return sorted_state(table.export_state())


def reference_state(steps: range) -> dict[str, np.ndarray]:
    """The state of an in-process table trained with `steps` (gone afterwards)."""
    reference = make_table("t")
    train(reference, steps)
    state = local_state(reference)
    del reference
    gc.collect()
    return state


def cluster_state(c: LocalCluster, name: str) -> dict[str, np.ndarray]:
    """The table over the primaries of the groups holding slots (rows sorted by key)."""
    m = c.map()
    parts = [export(g.primary, name) for g in m.groups if m.ranges_of(g.id)]
    merged = {f: np.concatenate([p[f] for p in parts]) for f in parts[0] if f != "iterations"}
    order = np.argsort(merged["keys"])
    out = {f: v[order] for f, v in merged.items()}
    iterations = {int(p["iterations"]) for p in parts}
    assert len(iterations) == 1, iterations
    out["iterations"] = np.array(iterations.pop())
    return out
