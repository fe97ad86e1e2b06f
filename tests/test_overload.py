"""Overload on a real `elastic-emb serve`: what its data plane refuses (RESOURCE_EXHAUSTED
with a retry hint, before anything is done) the client sends again after the hint, so
every push is applied exactly once however many times it was refused.

The reference is the rows: each push trains a key of its own with gradient 1 and SGD at
learning rate 1 from a zero row, so a row of -1 says it was applied once. The server's
count of refusals must equal the client's count of calls it sent again.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import numpy as np
from _cluster import metrics_url, scrape, shards

import elastic_emb as ee
from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.ps.client.shard_client import ShardClient
from elastic_emb.ps.wire import security

WORKERS, DIM = 32, 4


def _push(worker: int) -> ps_pb2.PushRequest:
    entry = ps_pb2.TableGradients(
        table="rows",
        keys=np.asarray([worker], "<i8").tobytes(),
        gradients=np.ones(DIM, "<f4").tobytes(),
    )
    return ps_pb2.PushRequest(worker=worker, step=1, tables=[entry])


def test_pushes_an_overloaded_server_refused_are_sent_again_and_applied_once():
    with shards(1, ["--max-requests-per-connection", "4", "--metrics-port", "0"]) as (ps,):
        stub = ps_pb2_grpc.ParameterServerStub(security.channel(ps.address, [], None))
        table = ee.Table(DIM, ee.optimizers.SGD(1.0), initializer="zeros", name="rows")
        spec = ps_pb2.TableSpec(name="rows", config_json=json.dumps(table.config()))
        stub.CreateTables(ps_pb2.CreateTablesRequest(tables=[spec]), timeout=10)
        for w in range(WORKERS):
            join = ps_pb2.JoinRequest(
                worker=w, num_workers=WORKERS, mode=ps_pb2.ASYNC, staleness=-1
            )
            stub.Join(join, timeout=10)
        client = ShardClient([ps.address], timeout=60)
        client.connect_data_plane()
        assert client.data_plane_addresses() == [ps.address]
        # Paused, the server reads nothing: once it goes on, it finds every push on its one
        # connection at once, takes 4 and refuses the rest.
        os.kill(ps.process.pid, signal.SIGSTOP)
        try:
            with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
                calls = [pool.submit(client.call, 0, "Push", _push(w)) for w in range(WORKERS)]
                while not all(c.running() for c in calls):
                    time.sleep(0.01)
                time.sleep(1.0)  # (each sends without waiting: its bytes wait in the socket)
                os.kill(ps.process.pid, signal.SIGCONT)
                answers = [c.result(timeout=120) for c in calls]
        finally:
            os.kill(ps.process.pid, signal.SIGCONT)
        assert all(isinstance(a, bytes) for a in answers)  # every push acknowledged
        rows = stub.ExportRows(ps_pb2.ExportRowsRequest(table="rows"), timeout=10)
        keys = np.frombuffer(rows.keys, "<i8")
        values = np.frombuffer(rows.values, "<f4").reshape(-1, DIM)
        assert sorted(keys) == list(range(WORKERS))
        np.testing.assert_array_equal(values, -np.ones((WORKERS, DIM), "f4"))  # once each
        sent_again = sum(s["overloaded"] for s in client.stats())
        refused = scrape(metrics_url(ps))[("elastic_emb_data_plane_overloaded_total", ())]
        assert refused == sent_again > 0
        client.close()
