"""The explorer's functions, and the widget driven from the kernel (no browser)."""

import asyncio
import io
import time

import numpy as np
import pytest
from PIL import Image

import pipelab as pl
from pipelab.show.throttle import Throttle
from pipelab.show.widgets import ExplorerPanels, _png, explorer, explorer_figures, explorer_view, run_for_real


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


def _find(widget, kind, description):
    """The widget of type `kind` with that description, anywhere in `widget`'s tree."""
    if isinstance(widget, kind) and getattr(widget, "description", None) == description:
        return widget
    for child in getattr(widget, "children", ()):
        found = _find(child, kind, description)
        if found is not None:
            return found
    return None


def test_the_run_for_real_button_runs_the_engine_and_shows_its_timeline():
    import ipywidgets as w

    box = explorer(n_devices=2, n_microbatches=2)
    button = _find(box, w.Button, "run it for real (CPU)")
    image = next(c for c in box.children if isinstance(c, w.Image) and c.layout.display == "none")
    assert button is not None and box.real is None
    button.click()
    predicted, measured = box.real
    assert (predicted.source, measured.source) == ("simulated", "replayed")
    assert (measured.n_devices, measured.n_microbatches, len(measured.events)) == (2, 2, 8)
    assert box.real_for == (2, 2, "1f1b") and image.layout.display is None
    assert bytes(image.value).startswith(b"\x89PNG")


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


def pixels(png: bytes):
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def test_kept_figures_draw_exactly_what_new_ones_draw():
    """The explorer empties and redraws two kept figures over a pasted backdrop; any leftover (a line,
    a colour bar, stale limits, a tick) or a backdrop fault would show against new pyplot figures
    drawn once from nothing, without the panels (`explorer_figures`)."""
    kept = ExplorerPanels(cached=0)  # every picture drawn (the same p twice in a row: over the backdrop)
    for p, m, budget in [(16, 64, None), (16, 63, None), (4, 8, None), (12, 32, 3.0), (12, 31, 3.0), (4, 8, 2.0),
                         (4, 5, None), (1, 1, None), (16, 63, 5.0), (16, 64, None)]:
        view = explorer_view(p, m, memory_budget=budget)
        for again, anew in zip(kept.pictures(view), [_png(figure) for figure in explorer_figures(view)]):
            assert np.array_equal(pixels(again), pixels(anew)), (p, m, budget)


def test_a_slider_change_redraws_both_pictures_and_the_bubble_text():
    box = explorer(n_devices=4, n_microbatches=8)
    timeline, memory = box.children[4], box.children[5]
    for p, m in [(16, 64), (16, 63), (1, 5), (7, 1)]:
        before = (bytes(timeline.value), bytes(memory.value))
        box.controls["n_devices"].value, box.controls["n_microbatches"].value = p, m
        assert bytes(timeline.value) != before[0] and bytes(memory.value) != before[1]
        assert f"formula (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.1%}" in box.children[3].value
        assert f"simulated bubble {(p - 1) / (m + p - 1):.1%}" in box.children[3].value  # 1F1B, no latency
        assert bytes(timeline.value) == ExplorerPanels().timeline(explorer_view(p, m))


def test_a_budget_change_redraws_the_memory_only():
    box = explorer(n_devices=4, n_microbatches=16, schedule="gpipe")
    timeline, memory = bytes(box.children[4].value), bytes(box.children[5].value)
    draws = box.pictures.draws
    box.controls["memory_budget"].value = 8
    assert box.pictures.draws == draws + 1
    assert bytes(box.children[4].value) == timeline and bytes(box.children[5].value) != memory


def test_the_summary_counts_in_the_singular():
    assert "peak activations on device 0: 1 micro-batch" in explorer_view(1, 1).summary
    assert "OUT OF MEMORY on device 0" in explorer_view(4, 16, memory_budget=3).summary


def test_a_real_run_is_hidden_and_said_out_of_date_when_the_sliders_move():
    box = explorer(n_devices=2, n_microbatches=2)
    message, image = box.children[6], box.children[7]
    box.children[1].children[-1].click()
    assert box.real_for == (2, 2, "1f1b") and image.layout.display is None
    assert "p=2, m=2" in message.value and "out of date" not in message.value
    box.controls["n_microbatches"].value = 3
    assert image.layout.display == "none"
    assert "for p=2, m=2, 1f1b (out of date" in message.value
    box.controls["n_microbatches"].value = 2  # back to the values it ran for
    assert image.layout.display is None and "out of date" not in message.value


def test_throttle_draws_at_once_outside_an_event_loop():
    seen = []
    throttle = Throttle(lambda: seen.append(len(seen)))
    for _ in range(3):
        throttle()
    assert seen == [0, 1, 2]


def test_throttle_shows_frames_during_a_drag_and_ends_on_the_last_value():
    """40 changes 5 ms apart, each draw 20 ms: a debounce would draw once, after the drag; drawing
    every change would lag.  The throttle draws some frames during the drag, and the last value."""
    state, drawn, drawn_at = {"value": 0}, [], []

    def draw():
        time.sleep(0.020)
        drawn.append(state["value"])
        drawn_at.append(time.perf_counter())

    async def drag():
        throttle = Throttle(draw, gap_seconds=0.02)
        for value in range(1, 41):
            state["value"] = value
            throttle()
            await asyncio.sleep(0.005)
        released = time.perf_counter()
        await asyncio.sleep(0.3)
        return released

    released = asyncio.run(drag())
    during = [at for at in drawn_at if at < released]
    assert drawn[0] == 1 and drawn[-1] == 40
    assert len(during) >= 3, f"only {len(during)} frames during the drag: {drawn}"
    assert len(drawn) < 40 / 2, f"drew {len(drawn)} of 40 changes: {drawn}"
    assert drawn == sorted(set(drawn))  # never an older value after a newer one


def test_explorer_dragged_inside_a_running_event_loop_ends_on_the_last_values():
    box = explorer(n_devices=16, n_microbatches=1)

    async def drag():
        for m in range(2, 65):
            box.controls["n_microbatches"].value = m
            assert box.view.trace.n_microbatches == m  # the numbers follow at once
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.5)

    draws = box.pictures.draws
    asyncio.run(drag())
    assert 1 < box.pictures.draws - draws < 63
    assert bytes(box.children[4].value) == ExplorerPanels().timeline(explorer_view(16, 64))
