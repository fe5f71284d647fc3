"""PyTorch's schedule tables read into pipelab: built without a process group, validated, compared.

The independent reference here is PyTorch itself: its `pipeline_order` for GPipe,
Interleaved1F1B and (one chunk per rank) InterleavedZeroBubble must be, action for
action, pipelab's own gpipe, interleaved_1f1b and zero_bubble_h1.
"""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import _Action, _ComputationType

import pipelab as pl
from pipelab import schedules
from pipelab.schedules.action import Action

SHAPES = [(4, 8), (2, 4), (8, 16)]


@pytest.mark.parametrize("name", [n for n in schedules.TORCH_NAMES if n != "1F1B"])
@pytest.mark.parametrize("p, m", SHAPES)
def test_pytorch_tables_validate_and_simulate(name, p, m):
    sched = schedules.validate(schedules.torch_schedule(name, p, m))
    chunks = 1 if name == "GPipe" else 2
    assert (sched.n_stages, sched.n_devices, sched.n_microbatches) == (p * chunks, p, m)
    kinds = "FIW" if name in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV") else "FB"
    assert sorted(sched.all_actions()) == sorted(Action(k, s, i) for k in kinds for s in range(p * chunks)
                                                 for i in range(m))
    trace = pl.simulate(sched, pl.Costs(1.0, 1.0, 1.0 if "W" in kinds else 0.0))
    assert 0.0 <= trace.bubble_fraction < 1.0


def test_pytorch_1f1b_table_skips_f0_on_its_last_rank_and_validate_says_so():
    """DESIGN.md's pitfall, checked on the pinned torch (2.13): Schedule1F1B's last rank runs F1 .. Fm, not
    F0 .. Fm-1, while its backwards are B0 .. Bm-1 and every other rank is pipelab's 1F1B.  pipelab does
    not patch it: validate names the entry.  (A torch that fixes it fails here: then say so in the lesson.)"""
    for p, m in SHAPES:
        sched = schedules.torch_schedule("1F1B", p, m)
        last = sched.actions[p - 1]
        assert [a.microbatch for a in last if a.kind == "F"] == list(range(1, m + 1))
        assert [a.microbatch for a in last if a.kind == "B"] == list(range(m))
        assert sched.actions[:p - 1] == schedules.one_f_one_b(p, m).actions[:p - 1]
        with pytest.raises(pl.ScheduleError, match=f"{p - 1}F{m} names micro-batch {m}, but the schedule has {m} "):
            schedules.validate(sched)


def test_pytorch_builds_pipelabs_tables_action_for_action():
    for p in range(1, 7):
        for m in range(1, 13):
            assert schedules.torch_schedule("GPipe", p, m).actions == schedules.gpipe(p, m).actions
            if m % max(1, m // p) == 0:  # the m PyTorch's zero-bubble schedule accepts
                zb = schedules.torch_schedule("InterleavedZeroBubble", p, m, n_chunks=1)
                assert zb.actions == schedules.zero_bubble_h1(p, m).actions, (p, m)
        for v in (2, 3):
            for m in (p, 2 * p, 3 * p):
                torch_table = schedules.torch_schedule("Interleaved1F1B", p, m, n_chunks=v)
                assert torch_table.actions == schedules.interleaved_1f1b(p, m, v).actions, (p, m, v)


def test_pytorch_interleaved_with_one_chunk_keeps_its_double_warmup():
    """With v = 1 PyTorch still warms up 2 (p - r - 1) forwards (more memory than 1F1B's
    p - r - 1, same time); pipelab's interleaved_1f1b(p, m, 1) is plain 1F1B."""
    torch_table = schedules.validate(schedules.torch_schedule("Interleaved1F1B", 4, 8, n_chunks=1))
    assert pl.simulate(torch_table, pl.Costs(1, 2)).makespan == pl.simulate(schedules.one_f_one_b(4, 8)).makespan
    assert pl.simulate(torch_table).peak_inflight == [7, 5, 3, 1]


def test_translation_of_pytorch_actions():
    """I -> I, W -> W, a full B on a stage that splits elsewhere -> I then W, OVERLAP_F_B -> its parts, comms
    dropped."""
    order = {
        0: ["0F0", None, "0SEND_F0", "0RECV_B0", "0I0", "0W0", "0REDUCE_GRAD"],
        1: ["1RECV_F0", _Action(1, _ComputationType.OVERLAP_F_B, None, (_Action(1, _ComputationType.FORWARD, 0),
                                                                         _Action(1, _ComputationType.FULL_BACKWARD, 0))),
            "1SEND_B0"],
    }
    sched = schedules.from_torch(order, n_microbatches=1, name="by hand")
    assert [[str(a) for a in row] for row in sched.actions] == [["0F0", "0I0", "0W0"], ["1F0", "1B0"]]
    assert schedules.validate(sched).name == "by hand"


def test_bad_requests_are_named():
    with pytest.raises(ValueError, match="unknown PyTorch schedule 'Zigzag'"):
        schedules.torch_table("Zigzag", 4, 8)
    with pytest.raises(ValueError, match="one stage per rank; n_chunks must be 1"):
        schedules.torch_table("GPipe", 4, 8, n_chunks=2)
    with pytest.raises(ValueError, match="exactly two stages per rank"):
        schedules.torch_table("ZBVZeroBubble", 4, 8, n_chunks=3)
    with pytest.raises(ValueError, match="PyTorch's InterleavedZeroBubble refused p=4, m=9"):
        schedules.torch_table("InterleavedZeroBubble", 4, 9)
    with pytest.raises(pl.ScheduleError, match="ranks must be 0..1"):
        schedules.from_torch({0: ["0F0"], 2: ["1F0"]}, 1)
    with pytest.raises(TypeError, match="pipeline_order must be a non-empty dict"):
        schedules.from_torch([["0F0"]], 1)
