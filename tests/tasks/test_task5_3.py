"""Task 5.3: zero_bubble_h1_schedule, the backward split into B and W.

References written out here: the docstring's drawing of p=4, m=8 (unit-time run of the
dependencies, ``beyond_tables.run``), and for p <= 6, m <= 12 the properties: each action
once; W after its B; without the W's the table is 1F1B; the idle time per stage is
Zero Bubble PP's (p - 1)(T_F + T_B - T_W) for several T_F, T_B, T_W (m >= p); no stage
holds more than min(p, m) micro-batches (a micro-batch leaves at its W).  The rows of cases with
m < p written out (the W's still deferred by s there, where the idle-time formula says nothing);
and what ``==`` does not see: each action a (str, int, int) tuple (not a list), a new table at
each call, ValueError for every count below 1 (zero or negative).
"""

from __future__ import annotations

import math

import pytest

from beyond_tables import cells, draw, peak_held, run
from schedule_tables import assert_new_table_at_each_call, assert_rows_of_tuples, one_f_one_b_table, rows_of

pytestmark = pytest.mark.task5_3

GRID = [(p, m) for p in range(1, 7) for m in range(1, 13)]

P4_M8 = """
device 0 | F0 F1 F2 F3 .  .  .  B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7
device 1 | .  F0 F1 F2 .  .  B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7
device 2 | .  .  F0 F1 .  B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7
device 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7
"""


def schedule(impl, *args):
    return impl("zero_bubble").zero_bubble_h1_schedule(*args)


def test_four_stages_eight_microbatches_as_drawn(impl):
    assert cells(draw(schedule(impl, 4, 8), 4)) == cells(P4_M8)


def test_every_action_once_and_each_w_after_its_b(impl):
    for p, m in GRID:
        table = schedule(impl, p, m)
        assert isinstance(table, list) and len(table) == p
        for s, row in enumerate(table):
            actions = [tuple(a) for a in row]
            assert sorted(actions) == sorted((k, s, i) for k in "FBW" for i in range(m)), (
                f"zero_bubble_h1_schedule({p}, {m}): stage {s} should run F, B and W of each micro-batch once")
            assert all(actions.index(("W", s, i)) > actions.index(("B", s, i)) for i in range(m))


def test_without_the_ws_it_is_1f1b(impl):
    for p, m in GRID:
        table = [[tuple(a) for a in row if a[0] != "W"] for row in schedule(impl, p, m)]
        assert table == one_f_one_b_table(p, m), f"({p}, {m}): F and B should keep 1F1B's order"


@pytest.mark.parametrize("t_f, t_b, t_w", [(1.0, 1.0, 1.0), (2.0, 3.0, 1.0), (3.0, 2.0, 1.0), (1.0, 1.0, 0.5)])
def test_idle_time_is_zero_bubble_table_2(impl, t_f, t_b, t_w):
    seconds = {"F": t_f, "B": t_b, "W": t_w}
    for p, m in GRID:
        if m >= p:
            times = run(schedule(impl, p, m), p, lambda a: seconds[a[0]])
            makespan = max(end for _, end in times.values())
            idle = makespan - m * (t_f + t_b + t_w)
            assert math.isclose(idle, (p - 1) * (t_f + t_b - t_w), abs_tol=1e-9), (
                f"zero_bubble_h1_schedule({p}, {m}) idles {idle:g} per stage with T_F={t_f}, T_B={t_b}, "
                f"T_W={t_w}; ZB-H1's is (p-1)(T_F+T_B-T_W) = {(p - 1) * (t_f + t_b - t_w):g}")


def test_peak_memory_is_1f1bs(impl):
    for p, m in GRID:
        for s, row in enumerate(schedule(impl, p, m)):
            assert peak_held(row, "W") <= min(p, m), (
                f"({p}, {m}): stage {s} holds {peak_held(row, 'W')} micro-batches (until their W); ZB-H1 keeps "
                f"1F1B's peak, min(p, m)")


def test_bad_counts(impl):
    with pytest.raises(ValueError):
        schedule(impl, 0, 4)
    with pytest.raises(ValueError):
        schedule(impl, 4, 0)


# Each stage's list in order (not a drawing in time): stage s defers its W's by s backwards,
# also when m < p cuts its warm-up w = min(p - s - 1, m) short (a delay of p - 1 - w is not ZB-H1's).
FEWER_MICROBATCHES_THAN_STAGES = {
    (4, 2): """
        stage 0 | F0 F1 B0 W0 B1 W1
        stage 1 | F0 F1 B0 B1 W0 W1
        stage 2 | F0 F1 B0 B1 W0 W1
        stage 3 | F0 B0 F1 B1 W0 W1
    """,
    (5, 3): """
        stage 0 | F0 F1 F2 B0 W0 B1 W1 B2 W2
        stage 1 | F0 F1 F2 B0 B1 W0 B2 W1 W2
        stage 2 | F0 F1 F2 B0 B1 B2 W0 W1 W2
        stage 3 | F0 F1 B0 F2 B1 B2 W0 W1 W2
        stage 4 | F0 B0 F1 B1 F2 B2 W0 W1 W2
    """,
    (3, 1): """
        stage 0 | F0 B0 W0
        stage 1 | F0 B0 W0
        stage 2 | F0 B0 W0
    """,
}


@pytest.mark.parametrize(("p", "m"), list(FEWER_MICROBATCHES_THAN_STAGES), ids=lambda n: str(n))
def test_fewer_microbatches_than_stages_rows(impl, p, m):
    expected = rows_of(FEWER_MICROBATCHES_THAN_STAGES[(p, m)])
    table = schedule(impl, p, m)
    assert table == expected, (
        f"stage s's first s backwards are not followed by a W, also when m < p\n"
        f"zero_bubble_h1_schedule({p}, {m}) returned\n  {table}\nexpected\n  {expected}")


def test_actions_are_tuples_of_a_str_and_two_ints(impl):
    for p, m in [(1, 1), (2, 3), (4, 8), (4, 2)]:
        assert_rows_of_tuples(schedule(impl, p, m), p, "zero_bubble_h1_schedule", f"zero_bubble_h1_schedule({p}, {m})")


def test_a_new_table_at_each_call(impl):
    assert_new_table_at_each_call(lambda p, m: schedule(impl, p, m), "zero_bubble_h1_schedule", (3, 4))
    assert_new_table_at_each_call(lambda p, m: schedule(impl, p, m), "zero_bubble_h1_schedule", (2, 1))


@pytest.mark.parametrize("counts", [(0, 4), (-1, 4), (-3, 2), (4, 0), (4, -1), (1, -5), (0, 0), (-2, -2)],
                         ids=lambda counts: "p={},m={}".format(*counts))
def test_every_count_below_1_is_refused(impl, counts):
    with pytest.raises(ValueError):
        table = schedule(impl, *counts)
        pytest.fail(f"zero_bubble_h1_schedule raises ValueError if n_stages < 1 or n_microbatches < 1 (zero or "
                    f"negative)\nzero_bubble_h1_schedule{counts} returned {table}")
