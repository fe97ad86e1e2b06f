"""`drain_then_cutover`: a receiver is caught up and cut over, whether or not changes keep
coming as fast as they are sent."""

import threading

from elastic_emb._proto import ps_pb2
from elastic_emb.ps.server.catch_up import FEW_CHANGES, ChangeBuffers, drain_then_cutover


def _change(sequence: int) -> ps_pb2.ReplicateRequest:
    return ps_pb2.ReplicateRequest(sequence=sequence)


def _catch_up(arrivals_per_send: int) -> tuple[list[int], int]:
    """Sequences sent to the receiver, in order, and the rounds sent before the cutover,
    while each send sees `arrivals_per_send` new changes made (by the workers)."""
    buffers: ChangeBuffers[str] = ChangeBuffers(threading.Condition(), lambda: None)
    buffers.open("r")
    made = iter(range(1, 10**6))
    for _ in range(100):  # made during the snapshot
        buffers.add(_change(next(made)), "r")
    sent: list[int] = []
    rounds = [0]

    def send(changes: list[ps_pb2.ReplicateRequest]) -> None:
        sent.extend(c.sequence for c in changes)
        rounds[0] += 1
        for _ in range(arrivals_per_send):
            buffers.add(_change(next(made)), "r")

    def cutover() -> int:
        return len(sent)

    (at_cutover, _) = drain_then_cutover(threading.Lock(), buffers, "r", send, cutover)
    assert at_cutover == len(sent)
    return sent, rounds[0]


def test_every_change_is_sent_once_in_order_before_the_cutover():
    for arrivals in (0, 5, FEW_CHANGES, 100, 1000):
        sent, _ = _catch_up(arrivals)
        assert sent == list(range(1, len(sent) + 1))  # none lost, none twice, in order


def test_the_cutover_comes_when_changes_stop_getting_fewer():
    """Changes that come as fast as they are sent would never fall under FEW_CHANGES: the
    cutover sends the rest while changes wait, instead of catching up forever."""
    assert _catch_up(1000)[1] <= 3
    assert _catch_up(5)[1] == 3  # 100, then 5 < FEW_CHANGES, then the last 5 under the lock
