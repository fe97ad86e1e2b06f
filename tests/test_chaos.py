"""The chaos soak (bench/chaos.py) in short, and the faults it found, one test each."""

import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from _light_workers import DIM, LEARNING_RATE, Training, check_rows, keys_of
from test_partitions import LinksIn

from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.ps.client.cluster import Cluster, ClusterOptions
from elastic_emb.ps.client.routing import Routing
from elastic_emb.ps.coord import membership
from elastic_emb.ps.coord.etcd import Etcd
from elastic_emb.ps.coord.etcd_process import start_etcd
from elastic_emb.ps.coord.local_cluster import LocalCluster
from elastic_emb.ps.server.replication import Replica
from elastic_emb.ps.server.shard import Ranges
from elastic_emb.ps.wire import protocol
from elastic_emb.tables import sharding
from elastic_emb.tables.policies.optimizers import SGD
from elastic_emb.tables.table import TableConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import chaos

BATCH = 64


def test_the_fault_schedule_is_a_function_of_the_seed():
    weights = {k: 1.0 for k in chaos.KINDS}
    a = chaos.make_schedule(7, 300, 10, weights, 2, 4, "async")
    assert a == chaos.make_schedule(7, 300, 10, weights, 2, 4, "async")
    assert a != chaos.make_schedule(8, 300, 10, weights, 2, 4, "async")
    assert {f.kind for f in a} == set(chaos.KINDS)
    # Sync kills no worker; the other faults keep their times and targets.
    s = chaos.make_schedule(7, 300, 10, weights, 2, 4, "sync")
    assert [f.at for f in s] == [f.at for f in a]
    assert "kill-worker" not in {f.kind for f in s}
    assert all(f.pause <= chaos.WORKER_PAUSE["sync"][1] for f in s if f.kind == "pause-worker")
    # The link faults' own draws.
    long = chaos.make_schedule(7, 1000, 10, weights, 2, 4, "async")
    assert {f.direction for f in long if f.kind == "cut-server"} == set(chaos.CUT_DIRECTIONS)
    assert all(f.flap_seed for f in a if f.kind == "flap-server-etcd")
    assert all(f.direction == "" for f in a if f.kind != "cut-server")


def test_without_the_link_faults_a_seed_gives_the_schedule_it_gave_before_them():
    """With the link kinds at weight 0, the schedule of seed 7 is the one the soak drew
    before they existed (its first faults, as that version drew them)."""
    weights = {k: 1.0 for k in ("kill-server", "pause-server", "kill-worker", "pause-worker")}
    a = chaos.make_schedule(7, 300, 10, weights, 2, 4, "async")
    assert a[:4] == [
        chaos.Fault(7.075, "pause-worker", 3, "", 5.3),
        chaos.Fault(7.173, "pause-worker", 3, "", 2.17),
        chaos.Fault(10.294, "pause-server", 1, "primary", 3.54),
        chaos.Fault(28.577, "kill-worker", 3, "", 0.0),
    ]
    # The link kinds change which kinds are drawn, not when.
    b = chaos.make_schedule(7, 300, 10, {k: 1.0 for k in chaos.KINDS}, 2, 4, "async")
    assert [f.at for f in b] == [f.at for f in a] and b != a


def _worker(coordinator: str, index: int) -> Cluster:
    options = ClusterOptions(mode="async", worker_index=index, connect_timeout=20)
    cluster = Cluster([], options, Routing(coordinator, connect_timeout=20))
    cluster.create_tables([TableConfig.make(DIM, SGD(LEARNING_RATE), "zeros", "t", 0).to_dict()])
    return cluster


def _step(cluster: Cluster, worker: int, step: int) -> None:
    keys = keys_of(worker, step, BATCH)
    cluster.pull([("t", DIM, keys)], True)
    cluster.push({"t": (DIM, keys, np.ones((len(keys), DIM), np.float32))})


@pytest.mark.slow
def test_an_async_worker_that_died_mid_push_resumes_and_applies_each_step_once(tmp_path):
    """A worker dies while its push of step 4 has reached one range and not the other. Its
    restart finds the ranges at steps 4 and 3: it resumes at 3, and its step 4 (the same
    keys) is applied by the range that lacks it and skipped by the other."""
    with LocalCluster(2, 1, tmp_path) as cluster:
        first = _worker(cluster.coordinator, 0)
        for step in (1, 2, 3):
            _step(first, 0, step)
        m = cluster.map()
        part = m.by_slot()[0]
        keys = keys_of(0, 4, BATCH)
        slots = sharding.slot_of(keys)
        keys = keys[(slots >= part.slot_begin) & (slots < part.slot_end)]
        push = protocol.push_request(
            0, 4, ps_pb2.FLOAT32, [("t", keys, np.ones((len(keys), DIM), np.float32))]
        )
        push.range = part.id
        with grpc.insecure_channel(m.group(part.group).primary) as channel:
            ps_pb2_grpc.ParameterServerStub(channel).Push(push, timeout=10)
        first.close()  # (async: a worker that leaves keeps its steps)

        again = _worker(cluster.coordinator, 0)
        assert again.step == 3
        for step in (4, 5, 6):
            _step(again, 0, step)
        again.close()
        check_rows(cluster.map().groups, "t", [{"worker": 0, "steps": 6}], BATCH)


def test_concurrent_rejoins_leave_the_server_key_under_the_servers_lease(tmp_path, monkeypatch):
    """A paused server that wakes up rejoins twice at once (its lease ended, and the map
    dropped it). The second registration must not revoke the lease the server key is under
    (else the server lives on unregistered and, as a primary, can change nothing): here
    the first one is slow to go on after writing its key, and the second one runs then."""
    etcd = start_etcd(tmp_path / "etcd")
    try:
        with Etcd(etcd.url) as client:
            replica = Replica(Ranges(), lambda method, request: None, client, "127.0.0.1:9", 2)
            replica._register(fresh=True)
            key = membership.server_key(membership.DEFAULT_PREFIX, replica.address)
            put, first_put = client.put, threading.Event()

            def slow_put(*args, **kwargs):
                revision = put(*args, **kwargs)
                if not first_put.is_set():
                    first_put.set()
                    time.sleep(0.5)
                return revision

            monkeypatch.setattr(client, "put", slow_put)
            first = threading.Thread(target=replica._register)
            first.start()
            assert first_put.wait(10)
            replica._register()
            first.join()
            held = client.get(key)
            assert held is not None and held.lease == replica._state.lease
    finally:
        etcd.stop()


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["both", "out"])
def test_a_backup_its_primary_cannot_reach_is_dropped_after_a_lease(tmp_path, direction):
    """Found by the soak (`bench/chaos.py --seed 1`, `cut-server` of backups): the ways
    into the backup B cut (both ways, or only what B answers), B's link to etcd up, so its
    lease lives on. Its primary A used to wait FORWARD_TIMEOUT (30 s) for B on every
    change, acknowledging nothing; now it drops a backup silent for a lease (2 s) and goes
    on without it. Healed, B is copied again; every row is exact on both replicas."""
    cluster = LocalCluster(1, 2, tmp_path / "cluster")
    b = training = None
    try:
        cluster.start(servers=False)
        a = cluster.start_server()
        cluster.wait_until(lambda: cluster.primaries() == [a], 60, "A is the primary")
        b = LinksIn(cluster, "B")
        cluster.wait_until(cluster.complete, 60, "B is A's backup")
        training = Training(cluster.coordinator, "async", BATCH, workers=1)
        training.wait_for(20)
        b.cut(direction)
        cut_at = time.monotonic()
        cluster.wait_until(lambda: b.address not in cluster.map().group(0).members, 10, "A drops B")
        dropped = time.monotonic() - cut_at
        training.wait_for(10, timeout=10)  # B still cut (it may be joining again)
        b.heal()
        cluster.wait_until(cluster.complete, 60, "B copied again")
        training.wait_for(10)
        reports, training = training.finish(), None
        assert cluster.primaries() == [a]
        assert check_rows(cluster.map().groups, "t", reports, BATCH) > 100
        print(f"{direction}: B dropped {dropped:.2f} s after the cut")
    finally:
        if training is not None:
            training.finish()
        cluster.stop()
        if b is not None:
            b.close()


@pytest.mark.slow
def test_a_short_chaos_soak_loses_nothing(tmp_path):
    """60 s of seeded faults, of processes and of links (every kind), on 2 groups x R=2 + a
    spare, each server behind its proxies, with 2 async workers: every fault recovers, and
    every row is exact on every replica (nothing acknowledged lost, nothing applied twice).
    """
    config = chaos.Config(duration=60, seed=185, workers=2, fault_interval=5, batch=BATCH)
    faults = chaos.make_schedule(
        config.seed, config.duration, config.fault_interval, config.weights, config.groups,
        config.workers, config.mode,
    )  # fmt: skip
    assert {f.kind for f in faults} == set(chaos.KINDS), faults
    result = chaos.run(config, tmp_path)
    assert result["passed"], chaos.markdown(result)
    injected = [f for f in result["faults"] if f["injected"] is not None]
    assert len(injected) == len(faults)
    assert all(f["recovery"] is not None or f["unmeasured"] for f in injected)
    assert result["check"]["rows"] > 0 and result["check"]["replicas compared"] == 2
    # One primary per epoch (the audit logs), the failovers' epochs included.
    assert result["check"]["epochs"] > config.groups
    # The links were the servers' own: a primary nobody reached for over a lease (3.1 s)
    # and one cut from etcd for 5.2 s were both failed over.
    cut = [f for f in injected if f["role"] == "primary" and f["pause"] > chaos.LEASE_SECONDS + 1]
    cut = [f for f in cut if f["kind"] in ("cut-server", "cut-server-etcd")]
    assert {f["kind"] for f in cut} == {"cut-server", "cut-server-etcd"}, cut
    assert all(f["displaced"] for f in cut), chaos.markdown(result)
