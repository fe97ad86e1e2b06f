"""Recovery from each kind of fault, repeated: what training sees, and that nothing is lost.

Real etcd and `elastic-emb serve --coordinator` processes on 127.0.0.1: 2 groups x R=2,
lease 2 s, two light async workers (tests/_light_workers.py: real clients, no
TensorFlow; SGD lr 1/8, gradients of 1) stepping throughout. Each scenario injects its
fault --repeats times, waits for the cluster to be whole again, and ends with the exact
check: every row is -count/8 and every backup bit-identical to its primary.

- kill-primary: SIGKILL of group 0's primary (the baseline); a new server joins after.
- kill-backup: SIGKILL of a backup of group 0; a new server joins after.
- pause-primary: SIGSTOP of group 0's primary for 3 leases, then SIGCONT; it is
  replaced by its backup and rejoins as a backup (copied again).
- pause-backup: SIGSTOP of a backup of group 0 for 3 leases, then SIGCONT; dropped once
  its lease ends, copied again once woken.
- etcd-restart: etcd SIGKILLed for 3 leases, restarted from its data directory.
- etcd-down-kill: etcd SIGKILLed, group 0's primary SIGKILLed 1 s later, etcd
  restarted 3 leases after its kill: the failover waits for etcd.
- etcd-member: etcd of 3 members; the leader is SIGKILLed, restarted 5 s later.

Figures: "recovery" is the injection (for etcd-down-kill: etcd's restart) until every
worker completed a step begun after it; "slowest step" is the longest step that ended
during the fault; "rejoined" is SIGCONT (or the new server) until every group has R
replicas again.

    python bench/fault_bench.py [--repeats 10] [--scenarios kill-primary,...]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import command_line, machine, markdown_table
from _light_workers import Training, check_rows

from elastic_emb.ps.coord.etcd_process import EtcdCluster, start_etcd_cluster
from elastic_emb.ps.coord.local_cluster import LocalCluster

BATCH = 32

# One repetition: (recovery s, slowest step s, rejoined s or None).
Repetition = tuple[float, float, float | None]


def _whole(cluster: LocalCluster) -> float:
    began = time.monotonic()
    cluster.wait_until(cluster.complete, 120, "every group has R replicas")
    return time.monotonic() - began


def kill_primary(cluster: LocalCluster, training: Training) -> Repetition:
    at = time.monotonic()
    cluster.kill(cluster.map().group(0).primary)
    recovery = training.recovered(at)
    cluster.start_server()
    rejoined = _whole(cluster)
    return recovery, training.slowest_step(at, time.monotonic()), rejoined


def kill_backup(cluster: LocalCluster, training: Training) -> Repetition:
    at = time.monotonic()
    cluster.kill(cluster.map().group(0).members[0])
    recovery = training.recovered(at)
    cluster.start_server()
    rejoined = _whole(cluster)
    return recovery, training.slowest_step(at, time.monotonic()), rejoined


def _pause(cluster: LocalCluster, training: Training, address: str) -> Repetition:
    process = cluster.servers[address]
    at = time.monotonic()
    process.send_signal(signal.SIGSTOP)
    try:
        recovery = training.recovered(at)
        time.sleep(max(0.0, at + 3 * cluster.lease_seconds - time.monotonic()))
    finally:
        process.send_signal(signal.SIGCONT)
    slowest = training.slowest_step(at, time.monotonic())
    return recovery, slowest, _whole(cluster)


def pause_primary(cluster: LocalCluster, training: Training) -> Repetition:
    return _pause(cluster, training, cluster.map().group(0).primary)


def pause_backup(cluster: LocalCluster, training: Training) -> Repetition:
    return _pause(cluster, training, cluster.map().group(0).members[0])


def etcd_restart(cluster: LocalCluster, training: Training) -> Repetition:
    assert cluster.etcd is not None
    at = time.monotonic()
    cluster.etcd.kill()
    recovery = training.recovered(at)
    time.sleep(3 * cluster.lease_seconds)
    cluster.etcd.start()
    training.wait_for(5)
    return recovery, training.slowest_step(at, time.monotonic()), None


def etcd_down_kill(cluster: LocalCluster, training: Training) -> Repetition:
    assert cluster.etcd is not None
    primary = cluster.map().group(0).primary
    at = time.monotonic()
    cluster.etcd.kill()
    time.sleep(1.0)
    cluster.kill(primary)
    time.sleep(max(0.0, at + 3 * cluster.lease_seconds - time.monotonic()))
    back = time.monotonic()
    cluster.etcd.start()
    recovery = training.recovered(back)
    cluster.start_server()
    rejoined = _whole(cluster)
    return recovery, training.slowest_step(at, time.monotonic()), rejoined


def etcd_member(cluster: LocalCluster, training: Training, members: EtcdCluster) -> Repetition:
    leader = members.leader()
    at = time.monotonic()
    leader.kill()
    recovery = training.recovered(at)
    time.sleep(5.0)
    slowest = training.slowest_step(at, time.monotonic())
    began = time.monotonic()
    leader.start()
    return recovery, slowest, time.monotonic() - began


INJECT: dict[str, Callable[..., Repetition]] = {
    "kill-primary": kill_primary,
    "kill-backup": kill_backup,
    "pause-primary": pause_primary,
    "pause-backup": pause_backup,
    "etcd-restart": etcd_restart,
    "etcd-down-kill": etcd_down_kill,
    "etcd-member": etcd_member,
}


def run(name: str, repeats: int, directory: Path) -> dict:
    """One scenario on a cluster of its own: its repetitions and the exact check."""
    members = start_etcd_cluster(3, directory / "etcd") if name == "etcd-member" else None
    extra = [members] if members else []
    try:
        url = members.url if members else None
        with LocalCluster(2, 2, directory / "cluster", coordinator=url) as cluster:
            training = Training(cluster.coordinator, "async", BATCH)
            training.wait_for(20)
            repetitions = []
            for i in range(repeats):
                repetitions.append(INJECT[name](cluster, training, *extra))
                training.wait_for(10)
                print(f"{name} {i + 1}/{repeats}: recovery {repetitions[-1][0]:.3f} s",
                      flush=True)  # fmt: skip
            reports = training.finish()
            rows = check_rows(cluster.map().groups, "t", reports, BATCH)
            steps = sum(r["steps"] for r in reports)
    finally:
        if members is not None:
            members.stop()
    return {"name": name, "repetitions": repetitions, "rows": rows, "steps": steps}


def _summary(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--scenarios", default=",".join(INJECT))
    parser.add_argument("--directory", help="keep etcd's data and the servers' logs here")
    args = parser.parse_args()
    unknown = set(args.scenarios.split(",")) - set(INJECT)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; known: {list(INJECT)}")
    results = []
    with tempfile.TemporaryDirectory(prefix="ee-faults-") as tmp:
        for name in args.scenarios.split(","):
            results.append(run(name, args.repeats, Path(args.directory or tmp) / name))
    rows = []
    for r in results:
        recovery, slowest, rejoined = zip(*r["repetitions"], strict=True)
        rows.append([
            r["name"], len(r["repetitions"]), _summary(list(recovery)), _summary(list(slowest)),
            _summary([x for x in rejoined if x is not None]), f"{r['steps']:,}",
            f"exact ({r['rows']:,} rows)",
        ])  # fmt: skip
    print()
    print(f"`{command_line()}` on {machine()}")
    print("(seconds: min / median / max)")
    print(markdown_table(
        ["fault", "repeats", "recovery", "slowest step", "rejoined", "worker steps", "rows"],
        rows,
    ))  # fmt: skip


if __name__ == "__main__":
    main()
