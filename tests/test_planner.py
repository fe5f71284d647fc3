"""pl.plan against its formulas, the simulator, its stated properties and Megatron-LM SC21's Table 1."""

import math
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import pipelab as pl
from pipelab.predict.planner import plan
from pipelab.predict.transformer_memory import (
    SC21_CLUSTER,
    SC21_OPTIONS,
    SC21_TABLE_1,
    TransformerSpec,
    microbatches_in_flight,
    pipeline_seconds,
)

NVLINK, INFINIBAND = (5e-6, 300e9), (10e-6, 25e9)
GPT2_SMALL = TransformerSpec(layers=12, hidden=768, heads=12, seq=1024, vocab=50257)  # 124M parameters
GIB = 2**30


def sc21_spec(layers, hidden, heads):
    return TransformerSpec(layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=51200)


# --- the formulas ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, layers, hidden, heads", [row[:4] for row in SC21_TABLE_1])
def test_parameters_are_sc21_table_1s(name, layers, hidden, heads):
    billions = float(name.rstrip("B"))
    assert sc21_spec(layers, hidden, heads).parameters / 1e9 == pytest.approx(billions, abs=0.05)


def test_parameters_lead_with_12_l_h2_plus_v_h():
    spec = sc21_spec(80, 12288, 96)
    assert spec.parameters - (12 * 80 * 12288**2 + 51200 * 12288) == 80 * 13 * 12288 + 2048 * 12288 + 2 * 12288


def test_iteration_flops_are_sc21_eq_3():
    spec, B = sc21_spec(128, 25600, 160), 3072
    s, L, h, V = 2048, 128, 25600, 51200
    assert spec.iteration_flops(B, "full") == pytest.approx(96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * h * L)))
    assert spec.iteration_flops(B, "none") == pytest.approx(72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * h * L)))
    assert spec.iteration_flops(B, "selective") == pytest.approx(spec.iteration_flops(B) + L * 4 * B * s * s * h)
    tokens = B * s  # 6·N per token for training, 8·N with full recomputation (within the s/6h and V terms)
    assert spec.iteration_flops(B) / tokens == pytest.approx(6 * spec.parameters, rel=0.03)
    assert spec.iteration_flops(B, "full") / tokens == pytest.approx(8 * spec.parameters, rel=0.03)


def test_activation_bytes_are_korthikantis_table_2():
    spec = sc21_spec(80, 12288, 96)
    s, b, h, a = 2048, 2, 12288, 96
    sbh = s * b * h
    assert spec.layer_activation_bytes(b) == sbh * (34 + 5 * a * s / h)
    assert spec.layer_activation_bytes(b, recompute="selective") == sbh * 34
    assert spec.layer_activation_bytes(b, recompute="full") == 2 * sbh
    assert spec.layer_activation_bytes(b, tp=8) == pytest.approx(sbh * (10 + 24 / 8 + 5 * a * s / (h * 8)))
    assert spec.layer_activation_bytes(b, tp=8, recompute="selective") == pytest.approx(sbh * (10 + 24 / 8))
    assert spec.layer_activation_bytes(b, tp=8, sequence_parallel=True) == pytest.approx(sbh * (34 / 8 + 5 * a * s / (h * 8)))
    assert spec.layer_activation_bytes(b, tp=8, recompute="full", sequence_parallel=True) == pytest.approx(2 * sbh / 8)
    assert spec.working_bytes(b, tp=8, recompute="full") == spec.layer_activation_bytes(b, tp=8)
    assert spec.working_bytes(b, tp=8, recompute="selective") == 0


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (4, 4, 2), (4, 8, 4), (3, 6, 2), (8, 16, 2)])
def test_pipeline_closed_forms_equal_the_simulator(p, m, v):
    costs = pl.Costs(forward=1.0, backward=2.0, memory_bytes=1.0)
    for name in ("gpipe", "1f1b"):
        trace = pl.simulate(pl.schedules.by_name(name, p, m), costs)
        assert pipeline_seconds(name, p, m, 1.0, 2.0) == pytest.approx(trace.makespan)
        first, last = microbatches_in_flight(name, p, m)
        assert (first, last) == (trace.peak_memory[0], trace.peak_memory[-1])
    chunk = pl.Costs(forward=1.0 / v, backward=2.0 / v, memory_bytes=1.0)  # each chunk 1/v of a stage
    trace = pl.simulate(pl.schedules.interleaved_1f1b(p, m, v), chunk)
    assert pipeline_seconds("interleaved", p, m, 1.0, 2.0, chunks=v) == pytest.approx(trace.makespan)
    first, last = microbatches_in_flight("interleaved", p, m, v)
    assert (first * v, last * v) == (trace.peak_memory[0], trace.peak_memory[-1])  # chunk-micro-batches
    for backward, weight in ((1.0, 1.0), (2.0, 1.0), (1.5, 0.5)):  # T_W <= T_F: the closed form's domain
        split = pl.Costs(forward=1.0, backward=backward, weight=weight, memory_bytes=1.0)
        trace = pl.simulate(pl.schedules.zero_bubble_h1(p, m), split)
        assert pipeline_seconds("zb-h1", p, m, 1.0, backward, weight) == pytest.approx(trace.makespan)
        assert microbatches_in_flight("zb-h1", p, m)[0] == trace.peak_memory[0]


# --- the properties --------------------------------------------------------------------------------------------

@st.composite
def scenarios(draw):
    heads = draw(st.sampled_from([1, 2, 4, 6, 8, 12]))
    spec = TransformerSpec(layers=draw(st.integers(1, 24)), hidden=heads * draw(st.sampled_from([16, 64, 128])),
                           heads=heads, seq=draw(st.sampled_from([64, 512, 2048])), vocab=draw(st.integers(100, 50000)))
    return {"model": spec, "n_devices": draw(st.sampled_from([1, 2, 4, 6, 8, 12, 16, 24])),
                "devices_per_node": draw(st.sampled_from([1, 2, 4, 8])),
                "memory_bytes": draw(st.floats(1e6, 1e10)), "global_batch": draw(st.integers(1, 96)),
                "inside": (draw(st.floats(0, 1e-5)), draw(st.floats(1e9, 1e12))),
                "between": (draw(st.floats(0, 1e-4)), draw(st.floats(1e8, 1e11))),
                "peak_flops_per_second": draw(st.floats(1e12, 1e15)), "achieved_fraction": draw(st.floats(0.1, 1.0))}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
@example({"model": GPT2_SMALL, "n_devices": 12, "devices_per_node": 8, "memory_bytes": 4 * GIB, "global_batch": 30,
              "inside": NVLINK, "between": INFINIBAND, "peak_flops_per_second": 312e12, "achieved_fraction": 0.5})
def test_plan_properties(kwargs):
    found = plan(**kwargs)
    B, limit = kwargs["global_batch"], kwargs["memory_bytes"]
    # never recommends a layout over the memory limit; what is over is listed apart, with the reason
    assert all(row.memory.total <= limit and not row.reason for row in found.rows)
    assert all(row.memory.total > limit and "needs" in row.reason for row in found.over_limit)
    # lists every divisor layout: ranked, over the limit, or impossible with a reason
    listed = {r.layout for r in found.rows} | {r.layout for r in found.over_limit} | {l for l, _ in found.impossible}
    assert listed == set(pl.Layout.all_for(kwargs["n_devices"]))
    assert all(why for _, why in found.impossible)
    # respects the global batch: m = B / (b·d) whole micro-batches; a d that does not divide B is impossible
    for row in found.rows + found.over_limit:
        assert row.micro_batch_size * row.n_microbatches * row.layout.dp == B
    for layout, why in found.impossible:
        if B % layout.dp:
            assert f"dp={layout.dp}" in why
    # ranked by step time, each row's parts add up
    times = [row.step_seconds for row in found.rows]
    assert times == sorted(times)
    for row in found.rows[:5]:
        assert sum(row.seconds.values()) == pytest.approx(row.step_seconds)
        assert row.memory.total == pytest.approx(row.memory.parameters + row.memory.gradients + row.memory.optimizer
                                                 + row.memory.activations)


def test_the_pipeline_message_under_tensor_parallelism_is_a_over_t_then_the_gather():
    """A stage boundary under tensor parallelism t (Megatron's scatter/gather, Narayanan et al. SC21 §4.1): each
    rank sends its 1/t of the activation A = b·s·h·2 bytes on the "pp" link, then the t ranks all-gather it:
    message = lat_pp + (A/t)/bw_pp + (t−1)/t·A/bw_tp + (t−1)·lat_tp, and a step sends 2·m·v of them (F and B).
    Worked by hand for b=1, s=1024, h=768 (A = 1.57 MB), t=2, m=8, v=1, every link inside one node.

    Planted bug it catches: `planner._row`'s message carrying the whole activation on the "pp" link
    (`boundary / links["pp"].bandwidth`, not `boundary / t / ...`)."""
    latency, bandwidth = 1e-6, 1e10
    found = plan(GPT2_SMALL, n_devices=4, devices_per_node=4, memory_bytes=1000 * GIB, global_batch=8,
                 inside=(latency, bandwidth), between=INFINIBAND, peak_flops_per_second=312e12,
                 micro_batch_sizes=(1,), schedules=("1f1b",), recompute=("none",))
    row = next(r for r in found.rows if r.layout == pl.Layout(pp=2, tp=2))
    activation = 1 * 1024 * 768 * 2
    message = latency + activation / 2 / bandwidth + activation / 2 / bandwidth + latency
    assert row.n_microbatches == 8
    assert row.seconds["pp"] == pytest.approx(2 * 8 * message, rel=1e-12)


def test_pure_data_parallelism_when_the_model_fits_and_links_are_fast():
    found = plan(GPT2_SMALL, n_devices=8, devices_per_node=8, memory_bytes=80 * GIB, global_batch=64,
                 inside=NVLINK, between=INFINIBAND, peak_flops_per_second=312e12)
    assert found.best.layout == pl.Layout(dp=8)
    assert found.best.recompute == "none" and found.best.bubble_fraction == 0
    assert found.best.memory.optimizer == 12 * found.best.memory.parameters / 2  # 16 bytes per parameter in all


def test_pipelining_rather_than_tensor_parallelism_across_a_slow_link():
    spec = TransformerSpec(layers=40, hidden=5120, heads=64, seq=2048, vocab=51200)  # 12.7B: needs several devices
    kwargs = {"n_devices": 16, "devices_per_node": 8, "memory_bytes": 80 * GIB, "global_batch": 64, "inside": NVLINK,
                  "peak_flops_per_second": 312e12}
    slow = plan(spec, between=(10e-6, 12.5e9), **kwargs)
    assert slow.best.layout.tp <= 8 and slow.best.layout.pp >= 2
    assert slow.rank_of(pl.Layout(pp=2, tp=8)) < slow.rank_of(pl.Layout(tp=16))
    assert slow.rank_of(pl.Layout(pp=16)) < slow.rank_of(pl.Layout(tp=16))
    assert pl.Layout(dp=1, pp=1, tp=16) not in {r.layout for r in slow.rows[:10]}
    # the same cluster with NVLink-fast links between the nodes: 16-way tensor parallelism catches up
    fast = plan(spec, between=NVLINK, **kwargs)
    best_tp16 = lambda found: next(r.step_seconds for r in found.rows if r.layout == pl.Layout(tp=16))
    assert best_tp16(fast) < 0.5 * best_tp16(slow)


def test_over_the_limit_rows_say_why_and_the_table_shows_them():
    spec = TransformerSpec(layers=40, hidden=5120, heads=64, seq=2048, vocab=51200)
    found = plan(spec, n_devices=16, devices_per_node=8, memory_bytes=40 * GIB, global_batch=48, inside=NVLINK,
                 between=INFINIBAND, peak_flops_per_second=312e12)
    alone = next(r for r in found.layouts_over_limit() if r.layout == pl.Layout(dp=16))
    assert "model states dominate" in alone.reason and "more stages" in alone.reason
    gpipe = next(r for r in found.over_limit if r.schedule == "gpipe" and r.recompute == "none"
                 and r.memory.activations > r.memory.total / 2)
    assert "activations dominate" in gpipe.reason and "1F1B instead of GPipe" in gpipe.reason
    text = found.table(n_rows=8)
    assert "step s" in text and "over the memory limit" in text and "dp=16 pp=1 tp=1" in text
    assert len(re.findall(r"^ +\d+ ", text, flags=re.MULTILINE)) == 8  # the ranked rows


def test_impossible_layouts_say_why():
    found = plan(GPT2_SMALL, n_devices=16, devices_per_node=8, memory_bytes=80 * GIB, global_batch=24, inside=NVLINK,
                 between=INFINIBAND, peak_flops_per_second=312e12)
    why = dict(found.impossible)
    assert why[pl.Layout(tp=16)] == "tp=16 does not divide the 12 attention heads"
    assert why[pl.Layout(pp=16)] == "pp=16 stages for 12 layers would leave a stage empty"
    assert why[pl.Layout(dp=16)] == "the global batch of 24 sequences does not split over dp=16 replicas"
    assert "impossible (" in found.table()


def test_rejects_bad_input_with_a_clear_message():
    with pytest.raises(ValueError, match="multiple of heads"):
        TransformerSpec(layers=2, hidden=100, heads=3, seq=8, vocab=10)
    base = {"model": GPT2_SMALL, "n_devices": 8, "devices_per_node": 8, "memory_bytes": GIB, "global_batch": 8, "inside": NVLINK,
                "between": INFINIBAND, "peak_flops_per_second": 1e12}
    for change, message in (({"n_devices": 0}, "n_devices"), ({"memory_bytes": -1}, "memory_bytes"),
                            ({"achieved_fraction": 1.5}, "achieved_fraction"), ({"schedules": ("1f2b",)}, "1f2b"),
                            ({"chunks": (1,)}, "chunks"), ({"inside": (0, 0)}, "inside")):
        with pytest.raises(ValueError, match=message):
            plan(**{**base, **change})
    with pytest.raises(TypeError, match="TransformerSpec"):
        plan(**{**base, "model": pl.Costs()})


def test_achieved_fraction_per_micro_batch_size_trades_bubble_against_small_multiplies():
    """SC21 §3.4: with one speed for every b the planner takes the smallest micro-batches (least bubble); when
    b = 1 reaches a quarter of the speed of b = 8, the step's compute time says so, and b = 1 is no longer best."""
    base = {"model": GPT2_SMALL, "n_devices": 4, "devices_per_node": 4, "memory_bytes": 80 * GIB, "global_batch": 32,
            "inside": NVLINK, "between": INFINIBAND, "peak_flops_per_second": 1e14, "micro_batch_sizes": (1, 8),
            "schedules": ("1f1b",), "recompute": ("none",)}
    flat = plan(**base, achieved_fraction=0.5)
    pipelined = [r for r in flat.rows if r.layout == pl.Layout(pp=4)]
    assert min(pipelined, key=lambda r: r.step_seconds).micro_batch_size == 1
    graded = plan(**base, achieved_fraction={1: 0.125, 8: 0.5})
    by_b = {r.micro_batch_size: r for r in graded.rows if r.layout == pl.Layout(pp=4)}
    same = {r.micro_batch_size: r for r in pipelined}
    assert by_b[1].seconds["compute"] == pytest.approx(4 * same[1].seconds["compute"])
    assert by_b[8].seconds["compute"] == pytest.approx(same[8].seconds["compute"])
    assert by_b[8].step_seconds < by_b[1].step_seconds
    with pytest.raises(ValueError, match=r"no share for the micro-batch sizes \[8\]"):
        plan(**base, achieved_fraction={1: 0.5})


# --- against the paper -----------------------------------------------------------------------------------------

SC21_CASES = [pytest.param(*row, id=row[0]) for row in SC21_TABLE_1]


@pytest.mark.parametrize("name, layers, hidden, heads, t, p, n, batch", SC21_CASES)
def test_sc21_table_1_layout_is_in_the_top_three(name, layers, hidden, heads, t, p, n, batch):
    """Megatron-LM SC21 Table 1: the published (t, p) ranks among the planner's three best layouts, with the
    options of 2021 (GPipe, 1F1B, interleaved; no or full recomputation) on its cluster."""
    found = plan(sc21_spec(layers, hidden, heads), n_devices=n, global_batch=batch, achieved_fraction=0.6,
                 **SC21_CLUSTER, **SC21_OPTIONS)
    rank = found.rank_of(pl.Layout(dp=n // (p * t), pp=p, tp=t))
    assert rank is not None and rank <= 3, found.table(n_rows=5)
    assert math.isfinite(found.best.step_seconds)


def test_pipelab_plan_prints_the_ranked_table(capsys):
    from pipelab.commands import cli

    assert cli.main(["plan", "--layers", "12", "--hidden", "768", "--heads", "12", "--seq", "1024", "--devices", "8",
                     "--batch", "64", "--rows", "3"]) == 0
    out = capsys.readouterr().out
    assert "on 8 devices, 8 per node; global batch 64" in out and "  1 " in out
    assert cli.main(["plan", "--hidden", "770", "--heads", "12"]) == 2  # heads must divide the hidden size
    assert "pipelab plan:" in capsys.readouterr().err


def test_layouts_come_from_the_device_counts_divisors_for_any_count(capsys):
    """Every (dp, pp, tp) with dp·pp·tp = n, as trying every number would list them (small n), and for a
    trillion devices (2^12·5^12: 91² = 8281 layouts) at once: `pipelab plan` answers instead of hanging."""
    from pipelab.commands import cli

    for n in (1, 7, 12, 36, 97, 360):
        brute = {(dp, n // (dp * tp), tp) for dp in range(1, n + 1) for tp in range(1, n + 1) if n % (dp * tp) == 0}
        assert {(x.dp, x.pp, x.tp) for x in pl.Layout.all_for(n)} == brute
    assert len(pl.Layout.all_for(10**12)) == 91 ** 2
    assert cli.main(["plan", "--devices", str(10**12)]) == 1  # it answers: nothing fits (exit status 1)
    assert "of the 8281 layouts of 1000000000000 devices" in capsys.readouterr().out
