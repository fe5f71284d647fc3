"""The order point-to-point receives are posted in: each sender's, for every schedule `validate` accepts.

NCCL matches the messages between two ranks by their order (gloo by tag), so a rank that posted
its receives in its *own* order of need would hang on NCCL wherever the two orders differ.  They
do in a V-shaped table (PyTorch's ZBVZeroBubble: rank r holds stages r and 2p - 1 - r, so two
ranks exchange activations and gradients of two stages each, interleaved differently on each side).
Checked here without processes: `p2p.incoming` is what `PointToPointTransport` posts from.
"""

from __future__ import annotations

import pytest

from pipelab import schedules
from pipelab.runtime.p2p import incoming
from pipelab.schedules.routes import Routes

TABLES = {
    "ZBVZeroBubble": lambda: schedules.torch_schedule("ZBVZeroBubble", 4, 8),
    "interleaved": lambda: schedules.interleaved_1f1b(4, 8, 2),
    "zb-h1": lambda: schedules.zero_bubble_h1(4, 8),
    "1f1b": lambda: schedules.one_f_one_b(4, 8),
}


def sender_order(schedule, sender: int, receiver: int) -> list:
    """What `sender` sends to `receiver`, in the order its own list produces it (written out again)."""
    routes, device = Routes(schedule), schedule.device_of_stage()
    return [a for a in schedule.actions[sender]
            if routes.consumer_stage(a) is not None and device[routes.consumer_stage(a)] == receiver]


@pytest.mark.parametrize("name", TABLES)
def test_receives_are_posted_in_each_senders_order(name):
    schedule = schedules.validate(TABLES[name]())
    for receiver in range(schedule.n_devices):
        for sender, messages in incoming(schedule, receiver).items():
            assert [source for source, _ in messages] == sender_order(schedule, sender, receiver)
            for source, consumer in messages:  # each consumer is the action of the receiver that needs it
                assert Routes(schedule).producer(consumer) == source and consumer in schedule.actions[receiver]


def test_the_v_shaped_table_needs_it_the_receivers_own_order_differs():
    """Without this difference the test above could not tell the two orders apart."""
    schedule = schedules.validate(TABLES["ZBVZeroBubble"]())
    differ = []
    for receiver in range(schedule.n_devices):
        position = {a: k for k, a in enumerate(schedule.actions[receiver])}
        for sender, messages in incoming(schedule, receiver).items():
            by_need = sorted(messages, key=lambda message: position[message[1]])
            if by_need != messages:
                differ.append((sender, receiver))
    assert differ, "no pair of ranks whose orders differ: the table is not the case this test needs"
