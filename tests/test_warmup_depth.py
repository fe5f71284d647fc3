"""1F1B with a deeper warm-up: valid, 1F1B at extra=0, in-flight counts and makespans against closed forms."""

import pytest

import pipelab as pl
from pipelab.schedules.warmup_depth import one_f_one_b_with_warmup

GRID = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 8, 16)]


@pytest.mark.parametrize("p,m", GRID)
@pytest.mark.parametrize("extra", [0, 1, 2, 5, 20])
def test_valid_and_in_flight_as_the_formula(p, m, extra):
    schedule = pl.schedules.validate(one_f_one_b_with_warmup(p, m, extra))
    trace = pl.simulate(schedule, pl.Costs(forward=1.0, backward=2.0))
    expected = [min(p - s + extra, m) for s in range(p - 1)] + [1]
    assert trace.peak_inflight == expected
    # free links, equal stages: the same makespan as GPipe and 1F1B, (m + p - 1)(t_F + t_B)
    assert trace.makespan == pytest.approx((m + p - 1) * 3.0, abs=1e-9)


@pytest.mark.parametrize("p,m", GRID)
def test_extra_zero_is_one_f_one_b(p, m):
    assert one_f_one_b_with_warmup(p, m, 0).actions == pl.schedules.one_f_one_b(p, m).actions


def test_the_lesson_case_recovers_the_gpipe_makespan_with_latency():
    """p=4, m=8, t_F=1, t_B=2, latency 0.5: 1F1B 41; two more warm-up forwards reach GPipe's closed form."""
    p, m, latency = 4, 8, 0.5
    costs = pl.Costs(forward=1.0, backward=2.0, latency=latency)
    gpipe_closed_form = (m + p - 1) * 3.0 + 2 * (p - 1) * latency  # fill and drain each cross p-1 links
    makespans = [pl.simulate(one_f_one_b_with_warmup(p, m, e), costs).makespan for e in range(4)]
    assert makespans[0] == pytest.approx(41.0) and makespans[0] > gpipe_closed_form
    assert all(a >= b for a, b in zip(makespans, makespans[1:]))
    assert makespans[2] == pytest.approx(gpipe_closed_form) == makespans[3]


@pytest.mark.parametrize("bad,error", [((4, 8, -1), ValueError), ((4, 8, 1.5), TypeError), ((0, 8, 1), ValueError),
                                       ((4, 0, 1), ValueError), ((4, 8, True), TypeError)])
def test_bad_counts_are_named(bad, error):
    with pytest.raises(error, match="n_stages|n_microbatches|extra"):
        one_f_one_b_with_warmup(*bad)
