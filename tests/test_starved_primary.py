"""A live primary starved of CPU is not failed over while it answers within its lease.

The primary's process is put in a cgroup (v1 `cpu` controller) whose quota gives it a
small share of one core for several leases; its backup and etcd run free. It answers
pings and renews its lease late but in time, so the backup must not take over: the group
keeps its primary and epoch, pushes slow down and recover, and the history checker proves
every acknowledged push is in the rows once, the backup equal to the primary bit for bit.
The harness is checked too: the process really got no more CPU than its quota.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _history import RecordingWorker, check, history_table
from _replicas import export
from _states import assert_same_state

import elastic_emb as ee
from elastic_emb.ps.coord.local_cluster import LocalCluster

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


@contextlib.contextmanager
def cpu_quota(pid: int, share: float) -> Iterator[None]:
    """Process `pid` (all its threads) limited to `share` of one core until exit."""
    group = CPU_CGROUP / f"elastic-emb-test-{os.getpid()}-{pid}"
    try:
        group.mkdir()
    except OSError as e:
        pytest.skip(f"no cgroup v1 cpu controller to write here ({CPU_CGROUP}): {e}")
    try:
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(int(share * PERIOD_US)))
        (group / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        with contextlib.suppress(OSError):  # (gone already if the process ended)
            (CPU_CGROUP / "cgroup.procs").write_text(str(pid))
        group.rmdir()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rate(worker: RecordingWorker, seconds: float) -> float:
    before = len(worker.history.acknowledged)
    time.sleep(seconds)
    return (len(worker.history.acknowledged) - before) / seconds


def test_a_primary_starved_of_cpu_answering_within_its_lease_keeps_its_place(tmp_path):
    share, seconds = 0.03, 10.0  # 3 % of a core for 5 leases of 2 s
    with LocalCluster(1, 2, tmp_path / "cluster") as cluster:
        cluster.wait_until(cluster.complete, 60, "a group of 2")
        (group,) = cluster.map().groups
        a, (b,) = group.primary, group.members
        try:
            ee.init(coordinator=cluster.coordinator, mode="async")
            worker = RecordingWorker(history_table("h"))
            cluster.wait_until(lambda: len(worker.history.acknowledged) >= 20, 60, "20 pushes")
            free = _rate(worker, 2)
            pid = cluster.servers[a].pid
            used = _cpu_seconds(pid)
            with cpu_quota(pid, share):
                starved = _rate(worker, seconds)
                used = _cpu_seconds(pid) - used
            again = _rate(worker, 2)
            history = worker.stop()
        finally:
            ee.shutdown()
        (after,) = cluster.map().groups
        print(
            f"pushes/s: {free:.1f} free, {starved:.1f} at {share:.0%} of a core "
            f"(it used {used:.2f} CPU s in {seconds:g} s), {again:.1f} after"
        )
        assert used <= 1.5 * share * seconds + 0.1  # the quota held it
        assert (after.primary, after.epoch) == (a, group.epoch)  # no failover
        rows = export(a, "h")
        assert check(history, rows["keys"], rows["values"]) == []
        assert_same_state(rows, export(b, "h"))
