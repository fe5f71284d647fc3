"""Interleaved 1F1B, ZB-H1 and asynchronous PipeDream: tables, validation, closed forms.

Expectations come from outside the code under test: the papers' formulas (Megatron SC21
§2.2.2, Zero Bubble PP Table 2, PipeDream §3.3), counts taken by walking the action
lists here, the drawings in the docstrings, and PyTorch's own tables (test_schedules_torch).
Costs are uniform per stage; an interleaved chunk costs 1/v of a whole stage.
"""

from __future__ import annotations

import itertools
import math

import pytest

import pipelab as pl
from pipelab import schedules
from pipelab.schedules.action import Action
from pipelab.schedules.pipedream import versions_in_flight, weight_versions

GRID = [(p, m) for p in range(1, 7) for m in range(1, 13)]
INTERLEAVED_GRID = [(p, m, v) for p in range(1, 7) for v in range(1, 5) for m in (p, 2 * p, 3 * p)]


def docstring_grid(func) -> str:
    lines = [line.strip() for line in func.__doc__.splitlines() if line.strip().startswith("device ")]
    assert lines, f"{func.__name__}'s docstring draws no grid"
    return "\n".join(lines)


def normalised(text: str) -> list[list[str]]:
    """A drawn grid's cells, as `Schedule.grid()` gives a schedule's."""
    return [line.split("|", 1)[1].split() for line in text.strip().splitlines()]


# ----------------------------------------------------------------- drawings and structure


@pytest.mark.parametrize("func, args", [(schedules.interleaved_1f1b, (2, 4, 2)), (schedules.zero_bubble_h1, (4, 8)),
                                        (schedules.pipedream_async, (4, 8))])
def test_docstring_draws_the_table_the_generator_builds(func, args):
    assert func(*args).grid() == normalised(docstring_grid(func))


def test_interleaved_tables_validate_with_stage_k_on_device_k_mod_p():
    for p, m, v in INTERLEAVED_GRID:
        sched = schedules.validate(schedules.interleaved_1f1b(p, m, v))
        assert (sched.n_stages, sched.n_devices, sched.n_microbatches) == (p * v, p, m)
        expected = sorted(Action(k, s, i) for k in "FB" for s in range(p * v) for i in range(m))
        assert sorted(sched.all_actions()) == expected
        for device, row in enumerate(sched.actions):
            assert {a.stage % p for a in row} == {device}, (p, m, v, device)


def test_interleaved_with_one_chunk_is_1f1b():
    for p, m in GRID:
        if m % p == 0:
            assert schedules.interleaved_1f1b(p, m, 1).actions == schedules.one_f_one_b(p, m).actions


def test_interleaved_names_the_micro_batch_counts_that_would_work():
    with pytest.raises(ValueError, match=r"multiple of n_devices=4.*got 6, use 4 or 8"):
        schedules.interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match=r"got 3, use 4$"):
        schedules.interleaved_1f1b(4, 3, 2)
    with pytest.raises(ValueError, match="n_chunks must be at least 1"):
        schedules.interleaved_1f1b(4, 8, 0)
    with pytest.raises(TypeError, match="n_chunks must be an int"):
        schedules.interleaved_1f1b(4, 8, 2.0)


def test_zero_bubble_tables_validate_with_every_w_after_its_i():
    for p, m in GRID:
        sched = schedules.validate(schedules.zero_bubble_h1(p, m))
        expected = sorted(Action(k, s, i) for k in "FIW" for s in range(p) for i in range(m))
        assert sorted(sched.all_actions()) == expected
        for row in sched.actions:
            position = {a: k for k, a in enumerate(row)}
            assert all(position[Action("W", a.stage, a.microbatch)] > k for k, a in enumerate(row) if a.kind == "I")


def test_zero_bubble_without_its_w_actions_is_1f1b():
    for p, m in GRID:
        forward_and_input = [[a._replace(kind="B") if a.kind == "I" else a for a in row if a.kind != "W"]
                             for row in schedules.zero_bubble_h1(p, m).actions]
        assert forward_and_input == schedules.one_f_one_b(p, m).actions


def test_a_w_before_its_b_is_explained():
    sched = schedules.zero_bubble_h1(2, 2)
    row = sched.actions[1]
    b, w = row.index(Action("I", 1, 0)), row.index(Action("W", 1, 0))
    row[b], row[w] = row[w], row[b]
    with pytest.raises(pl.ScheduleError, match="weight gradient needs its own input gradient first"):
        schedules.validate(sched)


def test_by_name_knows_the_new_schedules():
    assert schedules.by_name("ZB-H1", 4, 8).actions == schedules.zero_bubble_h1(4, 8).actions
    assert schedules.by_name("pipedream", 4, 8).asynchronous is True
    with pytest.raises(ValueError, match="interleaved_1f1b"):
        schedules.by_name("interleaved", 4, 8)


# ----------------------------------------------------------------- closed forms (item 4)


def test_interleaved_bubble_is_p_minus_1_over_v_m_of_the_ideal_time():
    """Megatron SC21 §2.2.2: t_pb / t_id = (p - 1)/(v m); chunks cost t_F/v and t_B/v."""
    t_f, t_b = 1.0, 2.0
    for p, m, v in INTERLEAVED_GRID:
        trace = pl.simulate(schedules.interleaved_1f1b(p, m, v), pl.Costs(forward=t_f / v, backward=t_b / v))
        ideal = m * (t_f + t_b)
        assert math.isclose((trace.makespan - ideal) / ideal, (p - 1) / (v * m), abs_tol=1e-12), (p, m, v)


def test_interleaved_sends_v_times_the_messages_of_1f1b_and_a_little_more():
    """Every boundary between virtual stages crosses devices: 2 m (p v - 1) messages against
    1F1B's 2 m (p - 1), a ratio of v + (v - 1)/(p - 1) (Megatron's "v times", rounded)."""
    for p, m, v in INTERLEAVED_GRID:
        if p == 1:
            continue
        sched = schedules.interleaved_1f1b(p, m, v)
        device_of = {a.stage: d for d, row in enumerate(sched.actions) for a in row}
        walked = sum(2 for a in sched.all_actions() if a.kind == "F" and a.stage > 0
                     and device_of[a.stage] != device_of[a.stage - 1])
        assert schedules.count_messages(sched) == walked == sched.message_count() == 2 * m * (p * v - 1)
        plain = schedules.count_messages(schedules.one_f_one_b(p, m))
        assert plain == 2 * m * (p - 1)
        assert math.isclose(walked / plain, v + (v - 1) / (p - 1))


def test_interleaved_peak_on_device_0_in_chunk_micro_batches():
    """min(v p + p - 1, v m): Megatron's warm-up on rank 0, 2 (p - 1) + (v - 1) p, plus the
    forward before its first backward (CURRICULUM.md's formula table)."""
    for p, m, v in INTERLEAVED_GRID:
        if v < 2:
            continue
        trace = pl.simulate(schedules.interleaved_1f1b(p, m, v), pl.Costs(1 / v, 2 / v, memory_bytes=1.0))
        assert trace.peak_memory[0] == min(v * p + p - 1, v * m), (p, m, v, trace.peak_memory)


BOUNDED = [(1.0, 1.0, 1.0), (2.0, 3.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.0, 0.5), (3.0, 2.0, 1.0), (2.0, 2.0, 1.9)]


@pytest.mark.parametrize("t_f, t_b, t_w", BOUNDED)
def test_split_backward_bubbles_zero_bubble_table_2(t_f, t_b, t_w):
    """Zero Bubble PP, Table 2: 1F1B (p - 1)(T_F + T_B + T_W), ZB-H1 (p - 1)(T_F + T_B - T_W) of
    idle time per stage (m >= p, T_W <= T_F and T_W <= T_B)."""
    for p, m in GRID:
        if m < p:
            continue
        work = m * (t_f + t_b + t_w)
        one = pl.simulate(schedules.one_f_one_b(p, m), pl.Costs(forward=t_f, backward=t_b + t_w))
        zb = pl.simulate(schedules.zero_bubble_h1(p, m), pl.Costs(forward=t_f, backward=t_b, weight=t_w))
        assert math.isclose(one.makespan - work, (p - 1) * (t_f + t_b + t_w), abs_tol=1e-9), (p, m)
        assert math.isclose(zb.makespan - work, (p - 1) * (t_f + t_b - t_w), abs_tol=1e-9), (p, m)


def test_zero_bubble_formula_needs_w_no_longer_than_f_and_b():
    """Past the bound the formula is optimistic: at T_W = 1.5 T_F the W's no longer fit the gaps."""
    zb = pl.simulate(schedules.zero_bubble_h1(4, 8), pl.Costs(forward=1.0, backward=1.0, weight=1.5))
    assert zb.makespan - 8 * 3.5 > 3 * (1.0 + 1.0 - 1.5) + 0.1


def test_zero_bubble_h1_peak_activations_equal_1f1b():
    """Zero Bubble PP, Table 2: ZB-H1 keeps p M_B at its peak, as 1F1B.  Here a micro-batch
    leaves at its W: every stage holds min(p, m); stage 0, the peak, exactly 1F1B's."""
    for p, m in GRID:
        zb = pl.simulate(schedules.zero_bubble_h1(p, m), pl.Costs(1, 1, 1, memory_bytes=1.0))
        one = pl.simulate(schedules.one_f_one_b(p, m), pl.Costs(1, 2, memory_bytes=1.0))
        assert zb.peak_inflight == [min(p, m)] * p
        assert max(zb.peak_memory) == max(one.peak_memory) == zb.peak_memory[0] == one.peak_memory[0] == min(p, m)


# ----------------------------------------------------------------- PipeDream's weight versions


def test_pipedream_versions_follow_the_stashing_rule():
    """F(s, i) sees the backwards before it in stage s's 1F1B list: none in the warm-up of
    w = p - s - 1 forwards, then one per steady-state pair, max(0, i - w), and one update per
    k of them, version max(0, i - w) // k (the closed form tests/test_pipedream_run.py's
    reference uses); B(s, i) reuses F(s, i)'s version."""
    for (p, m), k in itertools.product(GRID, (1, 2, 3)):
        versions = weight_versions(schedules.pipedream_async(p, m, k))
        for s in range(p):
            w = p - s - 1
            for i in range(m):
                assert versions[Action("F", s, i)] == versions[Action("B", s, i)] == max(0, i - w) // k, (p, m, k, s, i)


def test_pipedream_holds_p_minus_s_versions_on_stage_s():
    """PipeDream §3.3: a stage stashes a version per in-flight minibatch; in the steady
    state stage s holds p - s, its live weights included.  Its warm-up of w = p - s - 1
    forwards all use version 0, so the count reaches p - s only after w steady-state pairs,
    when m >= 2 w + 1 (stage 0: m >= 2p - 1); before that it holds fewer."""
    for p, m in GRID:
        expected = [p - s if m >= 2 * (p - s) - 1 else None for s in range(p)]
        found = versions_in_flight(schedules.pipedream_async(p, m))
        assert all(e is None or f == e for f, e in zip(found, expected)), (p, m, found)
        assert all(f <= p - s for s, f in enumerate(found))
        if m >= 2 * p - 1:
            assert versions_in_flight(schedules.pipedream_async(p, m)) == [p - s for s in range(p)], (p, m)


def test_pipedream_updating_every_k_backwards_holds_fewer_versions():
    sched = schedules.pipedream_async(4, 12, update_every=2)
    versions = weight_versions(sched)
    assert [versions[Action("F", 0, i)] for i in range(12)] == [0, 0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4]
    assert versions_in_flight(sched) == [3, 2, 2, 1]
    with pytest.raises(ValueError, match="update_every"):
        weight_versions(sched, update_every=0)
    with pytest.raises(TypeError, match="update_every"):
        versions_in_flight(sched, update_every=1.5)
