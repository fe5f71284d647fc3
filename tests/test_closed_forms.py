"""Every schedule's closed form (pipelab/predict/closed_forms.py) against the simulator.

References: `pl.simulate` on equal stages and free links, an independent interpreter (the dependency
loop on virtual clocks), for each schedule on a grid of p, m and costs; the formulas' sources are in
the module's docstring (GPipe §2.3, Megatron-LM SC21 §2.2.1 and §2.2.2, Zero Bubble PP Table 2).
ZB-H1's form is exact only for m >= p and t_W <= t_F, t_B: outside, the test checks the bound.
"""

import itertools

import pytest

import pipelab as pl
from pipelab.predict.closed_forms import SCHEDULES, closed_form, schedule_key

GRID = [(1, 1), (1, 4), (2, 1), (2, 5), (3, 3), (4, 2), (4, 8), (5, 12), (8, 16)]
TIMES = [(1.0, 2.0), (0.5, 0.5), (2.0, 1.0), (1.0, 3.5)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "pipedream-async"])
@pytest.mark.parametrize("p, m", GRID)
def test_fill_and_drain_schedules_equal_the_simulator(name, p, m):
    for t_f, t_b in TIMES:
        costs = pl.Costs(forward=t_f, backward=t_b, weight=0.5)  # whole backwards: W is not theirs, ignored
        form = closed_form(name, p, m, costs)
        trace = pl.simulate(pl.schedules.by_name(name, p, m), costs)
        assert form.exact and form.schedule == name and form.bubble_text == "(p-1)/(m+p-1)"
        assert form.makespan == pytest.approx(trace.makespan) == (m + p - 1) * (t_f + t_b)
        assert form.bubble_fraction == pytest.approx(trace.bubble_fraction)


@pytest.mark.parametrize("p, m, v", [(1, 3, 2), (2, 4, 2), (2, 6, 3), (4, 8, 2), (4, 4, 4), (3, 9, 2), (8, 16, 2)])
def test_interleaved_equals_the_simulator(p, m, v):
    for t_f, t_b in TIMES:
        chunk = pl.Costs(forward=t_f / v, backward=t_b / v)  # a chunk is 1/v of a stage
        form = closed_form("interleaved-1f1b", p, m, chunk, n_chunks=v)
        trace = pl.simulate(pl.schedules.interleaved_1f1b(p, m, v), chunk)
        assert form.exact and form.bubble_text == "(p-1)/(vm+p-1)"
        assert form.makespan == pytest.approx(trace.makespan)
        assert form.bubble_fraction == pytest.approx(trace.bubble_fraction) == pytest.approx((p - 1) / (v * m + p - 1))
        ideal = m * (t_f + t_b)
        assert (form.makespan - ideal) / ideal == pytest.approx((p - 1) / (v * m))  # SC21 §2.2.2, of the ideal time
    per_chunk = pl.Costs(forward=[1.0] * (p * v), backward=[2.0] * (p * v))  # one value per chunk-stage, all equal
    assert closed_form("interleaved", p, m, per_chunk, n_chunks=v).makespan == pytest.approx(
        pl.simulate(pl.schedules.interleaved_1f1b(p, m, v), per_chunk).makespan)


def test_interleaved_says_it_needs_m_a_multiple_of_p():
    form = closed_form("interleaved-1f1b", 4, 6, n_chunks=2)
    assert not form.exact and form.caveat == "exact only for m a multiple of p"


@pytest.mark.parametrize("p, m", [(p, m) for p, m in GRID if m >= p])
def test_zero_bubble_h1_equals_the_simulator_inside_its_domain(p, m):
    for t_f, t_b, t_w in [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.5, 0.5), (2.0, 1.0, 1.0), (1.0, 2.0, 0.0)]:
        costs = pl.Costs(forward=t_f, backward=t_b, weight=t_w)
        form = closed_form("zb-h1", p, m, costs)
        trace = pl.simulate(pl.schedules.zero_bubble_h1(p, m), costs)
        assert form.exact and form.bubble_text == "(p-1)(t_F+t_B-t_W) / makespan"
        assert form.makespan == pytest.approx(trace.makespan)
        assert form.makespan == pytest.approx(m * (t_f + t_b + t_w) + (p - 1) * (t_f + t_b - t_w))  # Table 2
        assert form.bubble_fraction == pytest.approx(trace.bubble_fraction)


def test_zero_bubble_h1_is_a_lower_bound_outside_its_domain():
    outside = 0
    for (p, m), (t_f, t_b), t_w in itertools.product(GRID, TIMES, [0.0, 0.5, 1.0, 3.0]):
        costs = pl.Costs(forward=t_f, backward=t_b, weight=t_w)
        form = closed_form("zb-h1", p, m, costs)
        trace = pl.simulate(pl.schedules.zero_bubble_h1(p, m), costs)
        assert form.makespan <= trace.makespan + 1e-9 and form.bubble_fraction <= trace.bubble_fraction + 1e-9
        if form.exact:
            assert form.makespan == pytest.approx(trace.makespan)
        else:
            outside += 1
            assert form.lower_bound and "here a lower bound" in form.caveat and "makespan ≥" in form.describe()
    assert outside > 20  # the bound was tested, not only the equality
    assert not closed_form("zb-h1", 4, 8, pl.Costs(1.0, 2.0, 3.0)).exact  # t_W > t_F: the simulated makespan is more
    assert pl.simulate(pl.schedules.zero_bubble_h1(4, 8), pl.Costs(1.0, 2.0, 3.0)).makespan > 48


def test_every_schedule_of_the_menu_names_its_source():
    for name in SCHEDULES:
        form = closed_form(name, 4, 8)
        assert form.source and form.makespan_text and form.bubble_text and schedule_key(name) == name
    assert "Huang" in closed_form("gpipe", 4, 8).source and "§2.2.2" in closed_form("interleaved", 4, 8).source
    assert "Zero Bubble" in closed_form("zb-h1", 4, 8).source


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="no closed form for schedule 'zigzag'.*gpipe"):
        closed_form("zigzag", 4, 8)
    with pytest.raises(ValueError, match="equal stages.*Costs.forward"):
        closed_form("1f1b", 2, 4, pl.Costs(forward=[1.0, 2.0]))
    with pytest.raises(ValueError, match="n_microbatches must be a positive int"):
        closed_form("gpipe", 4, 0)
    with pytest.raises(TypeError, match="pl.Costs"):
        closed_form("gpipe", 4, 8, {"forward": 1.0})
