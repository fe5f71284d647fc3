"""The explorer's functions, and the widget driven from the kernel (no browser)."""

import pytest

import pipelab as pl
from pipelab.widgets import explorer, explorer_view, run_for_real


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_view_matches_the_formula_without_communication(schedule):
    view = explorer_view(8, 32, schedule, backward_ratio=3.0)
    assert view.trace.bubble_fraction == pytest.approx(7 / 39)
    assert view.formula_bubble == pytest.approx(7 / 39)
    assert "formula" in view.summary


def test_latency_grows_the_bubble_beyond_the_formula():
    assert explorer_view(4, 8, latency=0.5).trace.bubble_fraction > explorer_view(4, 8).formula_bubble


def test_sliders_redraw_the_view():
    box = explorer()
    box.controls["n_devices"].value = 4
    box.controls["n_microbatches"].value = 1
    assert box.view.trace.bubble_fraction == pytest.approx(3 / 4)
    box.controls["n_microbatches"].value = 64
    assert box.view.trace.bubble_fraction == pytest.approx(3 / 67)
    box.controls["schedule"].value = "gpipe"
    assert box.view.trace.peak_inflight == [64] * 4
    assert box.controls["n_devices"].max == 16 and box.controls["n_microbatches"].max == 64


def test_real_run_returns_prediction_and_measurement():
    predicted, measured = run_for_real(2, 2, "1f1b", width=32, samples_per_microbatch=4)
    assert predicted.source == "simulated" and measured.source == "replayed"
    assert len(predicted.events) == len(measured.events) == 8
    with pytest.raises(ValueError, match="limited to p <= 8"):
        run_for_real(9, 2)


def test_button_runs_for_real():
    box = explorer(n_devices=2, n_microbatches=2)
    button = box.children[1].children[-1]
    button.click()
    assert box.real is not None and box.real[1].n_microbatches == 2


def test_memory_panel_checkpointing_and_budget():
    gpipe = explorer_view(4, 16, "gpipe")
    ofob = explorer_view(4, 16, "1f1b")
    assert gpipe.trace.peak_memory[0] == 16 * pl.widgets.UNIT  # GPipe keeps all m micro-batches
    assert ofob.trace.peak_memory[0] == 4 * pl.widgets.UNIT  # 1F1B at most p
    ckpt = explorer_view(4, 16, "1f1b", checkpoint="always")
    share = pl.widgets.INPUT_SHARE
    assert ckpt.trace.peak_memory[0] == pytest.approx((4 * share + (1 - share)) * pl.widgets.UNIT)
    assert explorer_view(4, 16, "gpipe", memory_budget=8).out_of_memory == [0, 1, 2, 3]
    assert explorer_view(4, 16, "1f1b", memory_budget=3).out_of_memory == [0]  # stage 0 holds 4 > 3
    box = explorer(n_devices=4, n_microbatches=16, schedule="gpipe")
    box.controls["memory_budget"].value = 8
    assert "OUT OF MEMORY" in box.view.summary
    box.controls["schedule"].value = "1f1b"
    assert box.view.out_of_memory == []


def test_pictures_are_pngs_that_follow_the_sliders():
    box = explorer(n_devices=2, n_microbatches=2)
    timeline, memory = box.children[4], box.children[5]
    before = bytes(timeline.value)
    assert before.startswith(b"\x89PNG") and bytes(memory.value).startswith(b"\x89PNG")
    box.controls["n_devices"].value = 6
    after = bytes(timeline.value)
    assert after.startswith(b"\x89PNG") and after != before
