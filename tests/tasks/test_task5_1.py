"""Task 5.1: interleaved_1f1b_schedule, v model chunks per device.

References written out here: the drawing of p=2, m=4, v=2 (the docstring's), checked by a
unit-time run of the dependencies (``beyond_tables.run``); Megatron's closed forms for
every p <= 5, v <= 3, m in {p, 2p, 3p}: the bubble (p - 1)/(v m) of the ideal time when a
chunk costs 1/v of a stage, and the peak of min(v p + p - 1, v m) chunk-micro-batches on
device 0; v = 1 is 1F1B.  And what ``==`` does not see: each action a (str, int, int) tuple
(not a list), a new table at each call, ValueError for every count below 1 (zero or negative)
and for m not a multiple of p at every chunk count, v = 1 included.
"""

from __future__ import annotations

import math

import pytest

from beyond_tables import cells, draw, peak_held, run
from schedule_tables import assert_new_table_at_each_call, assert_rows_of_tuples, one_f_one_b_table

pytestmark = pytest.mark.task5_1

GRID = [(p, m, v) for p in range(1, 6) for v in range(1, 4) for m in (p, 2 * p, 3 * p)]

P2_M4_V2 = """
device 0 | F0  F1  2F0 2F1 F2  2B0 F3  2B1 2F2 B0  2F3 B1  .   2B2 .   2B3 B2  B3
device 1 | .   F0  F1  3F0 3B0 3F1 3B1 F2  B0  F3  B1  3F2 3B2 3F3 3B3 B2  B3  .
"""


def schedule(impl, *args):
    return impl("interleaved").interleaved_1f1b_schedule(*args)


def test_two_devices_four_microbatches_two_chunks_as_drawn(impl):
    table = schedule(impl, 2, 4, 2)
    assert cells(draw(table, 4)) == cells(P2_M4_V2)


def test_every_action_once_with_stage_k_on_device_k_mod_p(impl):
    for p, m, v in GRID:
        table = schedule(impl, p, m, v)
        assert isinstance(table, list) and len(table) == p, f"({p}, {m}, {v}): one row per device"
        for device, row in enumerate(table):
            expected = {(kind, c * p + device, i) for kind in "FB" for c in range(v) for i in range(m)}
            actions = [tuple(a) for a in row]
            assert len(actions) == len(set(actions)) and set(actions) == expected, (
                f"interleaved_1f1b_schedule({p}, {m}, {v}): device {device} should run F and B of every "
                f"micro-batch through its stages {sorted({c * p + device for c in range(v)})}, each once")


def test_bubble_is_p_minus_1_over_v_m_of_the_ideal_time(impl):
    for p, m, v in GRID:
        times = run(schedule(impl, p, m, v), p * v, lambda a: (1.0 if a[0] == "F" else 2.0) / v)
        makespan = max(end for _, end in times.values())
        ideal = 3.0 * m
        assert math.isclose((makespan - ideal) / ideal, (p - 1) / (v * m), abs_tol=1e-12), (
            f"interleaved_1f1b_schedule({p}, {m}, {v}) takes {makespan:.3f} with chunks of 1/v; "
            f"Megatron's bubble gives {ideal + 3.0 * (p - 1) / v:.3f}")


def test_device_0_holds_v_p_plus_p_minus_1_chunk_micro_batches(impl):
    for p, m, v in GRID:
        if v >= 2:
            peak = peak_held(schedule(impl, p, m, v)[0], "B")
            assert peak == min(v * p + p - 1, v * m), (
                f"({p}, {m}, {v}): device 0 holds {peak} at once; Megatron's warm-up gives {min(v * p + p - 1, v * m)}")


def test_one_chunk_is_1f1b(impl):
    for p in range(1, 6):
        for m in (p, 2 * p):
            assert [[tuple(a) for a in row] for row in schedule(impl, p, m, 1)] == one_f_one_b_table(p, m)


def test_microbatches_not_a_multiple_of_devices_are_refused(impl):
    with pytest.raises(ValueError):
        schedule(impl, 4, 6, 2)
    with pytest.raises(ValueError):
        schedule(impl, 4, 8, 0)


def test_actions_are_tuples_of_a_str_and_two_ints(impl):
    for p, m, v in [(1, 1, 1), (2, 4, 2), (3, 6, 3), (4, 4, 1)]:
        assert_rows_of_tuples(schedule(impl, p, m, v), p, "interleaved_1f1b_schedule",
                              f"interleaved_1f1b_schedule({p}, {m}, {v})")


def test_a_new_table_at_each_call(impl):
    assert_new_table_at_each_call(lambda p, m, v: schedule(impl, p, m, v), "interleaved_1f1b_schedule", (2, 4, 2))
    assert_new_table_at_each_call(lambda p, m, v: schedule(impl, p, m, v), "interleaved_1f1b_schedule", (3, 3, 1))


@pytest.mark.parametrize("counts", [
    (0, 4, 2), (-1, 4, 2), (-4, 8, 2),  # n_devices
    (4, 0, 2), (4, -4, 2), (2, -2, 1),  # n_microbatches (multiples of n_devices)
    (4, 8, -1), (2, 4, -2), (1, 1, 0),  # n_chunks
], ids=lambda counts: "p={},m={},v={}".format(*counts))
def test_every_count_below_1_is_refused(impl, counts):
    with pytest.raises(ValueError):
        table = schedule(impl, *counts)
        pytest.fail(f"interleaved_1f1b_schedule raises ValueError if a count is below 1 (zero or negative)\n"
                    f"interleaved_1f1b_schedule{counts} returned {table}")


@pytest.mark.parametrize("n_chunks", [1, 2, 3, 4])
def test_microbatches_not_a_multiple_of_devices_are_refused_at_every_chunk_count(impl, n_chunks):
    for p, m in [(4, 6), (2, 3), (3, 4), (4, 2), (3, 1)]:
        with pytest.raises(ValueError):
            table = schedule(impl, p, m, n_chunks)
            pytest.fail(f"interleaved_1f1b_schedule raises ValueError if n_microbatches is not a multiple of "
                        f"n_devices, whatever n_chunks (v = 1 included)\n"
                        f"interleaved_1f1b_schedule({p}, {m}, {n_chunks}) returned {table}")
