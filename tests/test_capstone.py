"""Lesson 14's helpers (pipelab/course/capstone.py).  `run_scaled`, which launches ranks, runs in the
lesson under nbval (its engine is tested in tests/test_hybrid.py, its prediction in test_hybrid_costs.py)."""

import math

import matplotlib.pyplot as plt
import pytest

import pipelab as pl
from pipelab.course import capstone
from pipelab.predict.transformer_memory import microbatches_in_flight


@pytest.fixture(scope="module")
def planned():
    return capstone.plan_run()


def rows_of_every_kind(found):
    seen, picked = set(), []
    for row in found.rows + found.over_limit:
        key = (row.schedule, row.recompute, row.layout.pp > 1, row.layout.tp > 1)
        if key not in seen:
            seen.add(key)
            picked.append(row)
    return picked


def test_the_defaults_are_the_lessons_model(planned):
    spec, found = planned
    assert round(spec.parameters / 1e9, 1) == 12.9
    assert found.best is not None and found.rank_of(pl.Layout(dp=64, pp=1, tp=1)) is None  # 16 bytes a parameter


def test_the_timeline_of_a_row_is_its_step(planned):
    """simulate(schedule, costs) + the dp all-reduce = the closed form, for every schedule and recomputation."""
    spec, found = planned
    picked = rows_of_every_kind(found)
    assert {r.schedule for r in picked} == {"gpipe", "1f1b", "interleaved", "zb-h1"}
    assert {r.recompute for r in picked} == {"none", "selective", "full"}
    for row in picked:
        schedule, costs = capstone.row_timeline(spec, row)
        trace = pl.simulate(schedule, costs)
        assert trace.makespan + row.seconds["dp"] == pytest.approx(row.step_seconds, rel=1e-9), row


def test_the_timelines_memory_is_the_rows_activations(planned):
    """Device 0 holds the first stage's in-flight micro-batches × its layers' bytes (planner.py)."""
    spec, found = planned
    for row in rows_of_every_kind(found):
        _, p, t = row.layout.shape
        trace = pl.simulate(*capstone.row_timeline(spec, row))
        first, _ = microbatches_in_flight(row.schedule, p, row.n_microbatches, row.chunks)
        layers = math.ceil(spec.layers / p)
        per_microbatch = layers * spec.layer_activation_bytes(row.micro_batch_size, t, row.recompute)
        assert trace.peak_memory[0] == pytest.approx(first * per_microbatch, rel=1e-9), row


def test_show_plan_draws_and_returns_the_best(planned, capsys):
    spec, found = planned
    assert capstone.show_plan(spec, found, n_rows=4) is found.best
    assert "configurations of" in capsys.readouterr().out
    plt.close("all")


def test_show_plan_when_nothing_fits(capsys):
    spec, found = capstone.plan_run(n_devices=8, memory_gib=1.0)
    assert capstone.show_plan(spec, found) is None
    assert "nothing fits" in capsys.readouterr().out


@pytest.mark.parametrize(("shape", "n_ranks", "expected"), [
    ((16, 2, 2), 2, (1, 2, 1)), ((16, 2, 2), 4, (1, 2, 2)), ((8, 8, 1), 4, (2, 2, 1)), ((64, 1, 1), 2, (2, 1, 1)),
    ((8, 1, 8), 2, (1, 1, 2)), ((1, 1, 1), 4, (4, 1, 1)), ((2, 4, 8), 4, (1, 2, 2)),
])
def test_scale_down(shape, n_ranks, expected):
    assert capstone.scale_down(pl.Layout(*shape), n_ranks).shape == expected


def test_scale_down_refuses_other_rank_counts():
    with pytest.raises(ValueError):
        capstone.scale_down(pl.Layout(1, 2, 1), 3)


COSTS = pl.Costs(forward=1.0, backward=2.0, weight=1.0, latency=0.1, memory_bytes=1.0)


@pytest.mark.parametrize("limit", [3, 4, 6, 8])
def test_the_search_is_never_worse_than_a_named_schedule_that_fits(limit):
    result = capstone.search_against_named(4, 8, COSTS, limit)
    assert result.fits["search"]
    assert result.traces["search"].makespan == pytest.approx(result.found.meta["makespan"])
    for name in capstone.NAMED:  # the search's own record of the named ones agrees
        assert (result.found.meta["candidates"][name] is not None) == result.fits[name], name
        if result.fits[name]:
            assert result.traces[name].makespan == pytest.approx(result.found.meta["candidates"][name])
            assert result.traces["search"].makespan <= result.traces[name].makespan + 1e-9
    if limit == 3:
        assert result.best_named is None and result.gain is None
    if limit == 6:
        assert result.best_named == "zb-h1" and result.gain > 0.01


def test_plot_search_by_limit():
    by_limit = capstone.search_by_limit(4, 8, COSTS, (3, 4))
    ax = capstone.plot_search_by_limit(by_limit, title="t")
    assert {line.get_label() for line in ax.get_lines()} == {"search", "1f1b", "zb-h1"}
    plt.close("all")


def test_scaled_table_lines_up():
    runs = [capstone.ScaledRun(pl.Layout(1, 2, 1), 0.1, 0.125, 1e-7, 5.5, 5.5)]
    assert runs[0].error == pytest.approx(0.2)
    lines = capstone.scaled_table(runs).splitlines()
    assert len(lines) == 2 and "100.0" in lines[1] and "125.0" in lines[1] and "20%" in lines[1]


@pytest.mark.parametrize("name", list(capstone.MODELS))
def test_the_widgets_models_are_named_by_their_size(name):
    layers, hidden, heads = capstone.MODELS[name]
    spec, _ = capstone.plan_run(layers=layers, hidden=hidden, heads=heads, n_devices=8)
    size = name.split(" B")[0]
    digits = len(size.partition(".")[2])
    assert round(spec.parameters / 1e9, digits) == float(size)


def test_model_state_reproduces_zero_figure_1():
    # Rajbhandari et al. 2020, Figure 1: Ψ = 7.5 B, N_d = 64, K = 12 -> 120, 31.4, 16.6, 1.88 GB a device
    found = [capstone.model_state_bytes(7.5e9, how, 64) / 1e9 for how in ("whole", "zero-1", "zero-2", "zero-3")]
    assert [round(x, 2) for x in found] == [120.0, 31.41, 16.64, 1.88]
    assert capstone.model_state_bytes(7.5e9, "pp", 64) == capstone.model_state_bytes(7.5e9, "zero-3", 64)
    with pytest.raises(ValueError, match="how must be one of"):
        capstone.model_state_bytes(1e9, "zero-4", 8)
    with pytest.raises(ValueError, match="devices must be a positive int"):
        capstone.model_state_bytes(1e9, "pp", 0)


def test_sharding_table_lines_up():
    spec = pl.TransformerSpec(layers=40, hidden=5120, heads=40, seq=2048, vocab=51200)
    text = capstone.sharding_table({"12.9 B": spec}, devices=8)
    lines = text.splitlines()
    assert len(lines) == 2 and "ZeRO-3/FSDP d = 8" in lines[0]
    assert f"{16 * spec.parameters / 2**30:.1f}" in lines[1] and f"{2 * spec.parameters / 2**30:.1f}" in lines[1]
