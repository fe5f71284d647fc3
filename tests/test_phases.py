"""pipelab.course.phases: GPipe's fill / steady state / drain against the simulator's trace."""

import pytest

import pipelab as pl
from pipelab.course.phases import busy_devices, fill_drain_phases


@pytest.mark.parametrize("p, m, t_f, t_b", [(4, 8, 1.0, 2.0), (2, 2, 1.0, 1.0), (3, 7, 0.5, 1.5), (4, 4, 1.0, 3.0)])
def test_steady_state_keeps_every_device_busy_fill_and_drain_do_not(p, m, t_f, t_b):
    trace = pl.simulate(pl.schedules.gpipe(p, m), pl.Costs(forward=t_f, backward=t_b))
    phases = fill_drain_phases(p, m, t_f, t_b)
    assert [(ph.pass_name, ph.name) for ph in phases] == [
        (pass_name, name) for pass_name in ("forward", "backward") for name in ("fill", "steady state", "drain")]
    assert phases[-1].end == pytest.approx(trace.makespan)
    for phase in phases:
        fewest, most = busy_devices(trace, phase.start, phase.end)
        if phase.name == "steady state":
            assert fewest == most == p
        else:
            assert most < p and fewest >= 1


def test_busy_devices_is_exact_between_event_boundaries():
    trace = pl.simulate(pl.schedules.gpipe(2, 1), pl.Costs(forward=1.0, backward=2.0))  # F0 | F1 | B1 | B0
    assert busy_devices(trace, 0.0, 6.0) == (1, 1)
    assert busy_devices(trace, 0.0, 0.001) == (1, 1)
    with pytest.raises(ValueError, match="end > start"):
        busy_devices(trace, 1.0, 1.0)


def test_phases_need_a_steady_state():
    with pytest.raises(ValueError, match="n_microbatches >= n_stages"):
        fill_drain_phases(4, 3)
