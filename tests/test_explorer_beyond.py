"""The explorer's schedules beyond 1F1B: interleaved (chunks v), ZB-H1 (the W share), asynchronous PipeDream.

References: the closed forms (Megatron-LM SC21 §2.2.2 for interleaving, Zero Bubble PP
Table 2 for ZB-H1, PipeDream's weight versions p - s and the version m - p + s the last
micro-batch's forward uses on stage s, derived from 1F1B's order in the test), and the
widget driven from the kernel (no browser).
"""

import pytest

import pipelab as pl
from pipelab.show.widgets import SCHEDULES, UNIT, explorer, explorer_figures, explorer_view, run_for_real
from test_figures_fit import assert_texts_inside


@pytest.mark.parametrize("p, m, v", [(4, 8, 2), (4, 8, 4), (2, 6, 3), (8, 16, 2), (1, 3, 2)])
def test_interleaved_view_is_the_formula(p, m, v):
    view = explorer_view(p, m, "interleaved-1f1b", n_chunks=v)
    assert view.trace.n_devices == p and view.trace.n_stages == p * v
    assert view.trace.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    assert view.formula_bubble == pytest.approx((p - 1) / (v * m + p - 1))
    # device 0 holds min(v p + p - 1, v m) chunk-micro-batches, each 1/v of a stage's activations
    assert view.trace.peak_memory[0] == pytest.approx(min(v * p + p - 1, v * m) / v * UNIT, abs=1)
    assert f"p={p}, m={m}" in view.summary and "(p-1)/(vm+p-1)" in view.summary


def test_interleaved_refuses_m_not_a_multiple_of_p_and_says_which_m_would_work():
    with pytest.raises(ValueError, match="use 4 or 8"):
        explorer_view(4, 6, "interleaved-1f1b")


@pytest.mark.parametrize("share", [0.25, 0.5])
@pytest.mark.parametrize("p, m", [(4, 8), (3, 3), (2, 7)])
def test_zero_bubble_view_follows_the_w_share(p, m, share):
    ratio = 2.0
    view = explorer_view(p, m, "zb-h1", backward_ratio=ratio, weight_share=share)
    t_f, t_b, t_w = 1.0, ratio * (1 - share), ratio * share
    idle = (p - 1) * (t_f + t_b - t_w)  # Zero Bubble PP, Table 2 (m >= p, t_W <= t_F, t_B)
    assert view.trace.makespan == pytest.approx(m * (t_f + t_b + t_w) + idle)
    assert view.trace.bubble_fraction == pytest.approx(idle / (m * (t_f + t_b + t_w) + idle))
    assert view.formula_bubble == pytest.approx(view.trace.bubble_fraction)
    assert view.trace.peak_inflight == [min(p, m)] * p
    whole = explorer_view(p, m, "1f1b", backward_ratio=ratio)
    assert view.trace.bubble_fraction < whole.trace.bubble_fraction


def test_zero_bubble_formula_is_not_claimed_past_its_bound():
    view = explorer_view(4, 8, "zb-h1", backward_ratio=2.0, weight_share=0.75)  # t_W = 1.5 > t_B = 0.5
    assert view.formula_bubble is None and "holds only for" in view.summary
    assert explorer_view(4, 3, "zb-h1").formula_bubble is None  # m < p


@pytest.mark.parametrize("p, m", [(4, 8), (3, 10), (2, 2)])
def test_pipedream_view_shows_the_weight_versions(p, m):
    view = explorer_view(p, m, "pipedream-async")
    # stage s holds p - s versions (PipeDream, SOSP 2019, §3.3); in 1F1B's order stage s runs the
    # last forward after m - 1 - (p - s - 1) backwards, so with that version
    assert view.weight_versions == [p - s for s in range(p)]
    assert view.last_versions == [m - p + s for s in range(p)]
    assert f"weight versions held per stage: {[p - s for s in range(p)]}" in view.summary
    assert explorer_view(p, m, "1f1b").weight_versions is None


def test_the_menu_and_the_sliders_only_their_schedule_reads():
    box = explorer()
    controls = box.controls
    assert list(controls["schedule"].options) == list(SCHEDULES)
    assert all(c.style.description_width == "initial" for c in controls.values())  # whole descriptions
    assert controls["n_chunks"].disabled and controls["weight_share"].disabled  # 1F1B reads neither
    summary, timeline = box.children[3], box.children[4]
    controls["schedule"].value = "interleaved-1f1b"
    assert not controls["n_chunks"].disabled and controls["weight_share"].disabled
    assert box.view.trace.n_stages == 8
    controls["n_chunks"].value = 3
    assert box.view.trace.n_stages == 12 and "(v=3)" in summary.value
    controls["n_microbatches"].value = 6  # not a multiple of p = 4
    assert "use 4 or 8" in summary.value and timeline.layout.display == "none"
    controls["n_microbatches"].value = 8
    assert "simulated bubble" in summary.value and timeline.layout.display is None
    controls["schedule"].value = "zb-h1"
    assert controls["n_chunks"].disabled and not controls["weight_share"].disabled
    before = bytes(timeline.value)
    controls["weight_share"].value = 0.25
    assert bytes(timeline.value) != before  # W's are shorter: another timeline
    controls["schedule"].value = "pipedream-async"
    assert "weight versions held per stage: [4, 3, 2, 1]" in summary.value


def test_real_runs_of_the_new_schedules():
    predicted, measured = run_for_real(2, 2, "zb-h1", width=32, samples_per_microbatch=4, weight_share=0.5)
    assert sorted(e.kind for e in measured.events) == sorted(e.kind for e in predicted.events) == ["F"] * 4 + [
        "I"] * 4 + ["W"] * 4
    predicted, measured = run_for_real(2, 2, "interleaved-1f1b", width=32, samples_per_microbatch=4, n_chunks=2)
    assert measured.n_stages == predicted.n_stages == 4 and measured.n_devices == 2
    predicted, measured = run_for_real(2, 3, "pipedream-async", width=32, samples_per_microbatch=4)
    assert measured.schedule_name == "pipedream-async" and len(measured.events) == len(predicted.events) == 12
    box = explorer(n_devices=2, n_microbatches=2, schedule="interleaved-1f1b")
    box.children[1].children[-1].click()
    assert box.real_for == (2, 2, "interleaved-1f1b (v=2)") and box.children[7].layout.display is None
    box.controls["n_chunks"].value = 1
    assert box.children[7].layout.display == "none" and "out of date" in box.children[6].value
    box.controls["schedule"].value = "pipedream-async"
    box.children[1].children[-1].click()
    assert box.real_for == (2, 2, "pipedream-async") and box.children[7].layout.display is None


@pytest.mark.parametrize("schedule, p, m", [("interleaved-1f1b", 4, 8), ("interleaved-1f1b", 16, 64),
                                            ("zb-h1", 4, 8), ("zb-h1", 16, 64), ("pipedream-async", 8, 16)])
def test_the_new_schedules_pictures_fit(drawn_texts, schedule, p, m):
    for fig in explorer_figures(explorer_view(p, m, schedule, memory_budget=2.0, n_chunks=4)):
        assert_texts_inside(fig, drawn_texts)
