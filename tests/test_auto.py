"""split_method="auto" and schedule="auto": the decision against closed forms, every decision exact against
the single-device step, the plan readable afterwards, and bad requests named."""

import math

import pytest
import torch

import pipelab as pl
from pipelab.predict.auto_plan import balanced_cuts, decide
from pipelab.predict.closed_forms import closed_form
from pipelab.predict.piece_costs import PieceCosts


def equal_pieces(n: int, forward=1.0, backward=2.0, input_gradient=1.0, weight=1.0) -> PieceCosts:
    whole = pl.Costs(forward=[forward] * n, backward=[backward] * n, activation_bytes=[0.0] * n,
                     memory_bytes=[1.0] * n, input_bytes=[0.0] * n)
    split = pl.Costs(forward=[forward] * n, backward=[input_gradient] * n, weight=[weight] * n,
                     weight_memory_bytes=[0.5] * n)
    return PieceCosts([f"p{k}" for k in range(1, n)], whole, split)


def test_equal_pieces_are_cut_evenly_and_priced_as_the_closed_forms():
    """8 equal pieces (t_F 1, t_B 2) on p = 2, m = 4: 1F1B and GPipe cut at the middle, (m+p-1)(t_F+t_B) =
    5 x 12 = 60; interleaved (v = 2) cuts four stages of two pieces, (vm+p-1)(t_F+t_B) per chunk = 9 x 6 = 54,
    and wins (Megatron-LM SC21 §2.2.2)."""
    pieces = equal_pieces(8)
    one = decide(pieces, 2, 4, schedules=("1f1b",))
    assert one.chosen.bounds == ((0, 4), (4, 8)) and one.split_points() == ["p4"]
    stage = pl.Costs(forward=4.0, backward=8.0)
    assert one.chosen.predicted == pytest.approx(closed_form("1f1b", 2, 4, stage).makespan) == 60
    both = decide(pieces, 2, 4, schedules=("gpipe", "1f1b", "interleaved"), interleave=True)
    assert both.chosen.schedule_name == "interleaved (v=2)"
    assert both.chosen.bounds == ((0, 2), (2, 4), (4, 6), (6, 8))
    chunk = pl.Costs(forward=2.0, backward=4.0)
    assert both.chosen.predicted == pytest.approx(closed_form("interleaved", 2, 4, chunk, n_chunks=2).makespan) == 54
    assert [c.predicted for c in both.candidates] == sorted(c.predicted for c in both.candidates)
    tie = decide(pieces, 2, 4, schedules=("gpipe", "1f1b"))  # the same step predicted: 1F1B holds less
    assert [c.schedule_name for c in tie.candidates] == ["1f1b", "gpipe"]
    assert tie.candidates[0].predicted == tie.candidates[1].predicted and tie.chosen.peak < tie.candidates[1].peak
    assert "interleaved (v=2)" in both.table() and "p2, p4, p6" in both.table()


def test_the_cuts_priced_are_every_cut_near_the_most_balanced_one():
    """Weights [1, 1, 1, 1]: the balanced cut into 2 has a largest stage of 2; within 20 % only (0,2),(2,4)
    (every other cut has a stage of 3); within 50 % the two cuts with a stage of 3 join, most balanced first."""
    assert balanced_cuts([1, 1, 1, 1], 2) == [((0, 2), (2, 4))]
    assert balanced_cuts([1, 1, 1, 1], 2, slack=0.5) == [((0, 2), (2, 4)), ((0, 1), (1, 4)), ((0, 3), (3, 4))]
    with pytest.raises(ValueError, match="cannot cut 2 pieces into 3 stages"):
        balanced_cuts([1, 1], 3)


def test_a_memory_limit_rules_out_the_candidates_that_would_not_fit():
    """GPipe keeps m micro-batches on every stage, 1F1B at most p - s: with room for two micro-batches'
    activations GPipe is over the limit and marked so, and the choice fits."""
    pieces = equal_pieces(4)

    def needs(bounds, schedule, costs):
        trace = pl.simulate(schedule, costs)
        return [pl.DeviceMemory(d, (d,), 0, 0, 0, int(peak)) for d, peak in enumerate(trace.peak_memory)]

    plan = decide(pieces, 2, 8, schedules=("gpipe", "1f1b"), needs=needs, limits=[4.0, 4.0])
    gpipe = next(c for c in plan.candidates if c.schedule_name == "gpipe")
    assert not gpipe.fits and gpipe.needs[0].activation_bytes == 16  # 8 micro-batches x 2 pieces x 1 byte
    assert plan.chosen.fits and plan.chosen.schedule_name == "1f1b"
    assert max(n.total_bytes for n in plan.chosen.needs) <= 4
    assert "(over the memory limit)" in plan.table()


def tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, n_positions=16, vocab_size=256, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("kind, options", [
    ("sequential", dict(split_method="auto", schedule="auto")),
    ("sequential", dict(schedule="auto", split_method="params")),
    ("gpt2", dict(split_method="auto", schedule="auto")),
    ("gpt2", dict(split_method="auto", schedule="zb-h1")),
])
def test_every_decision_steps_exactly_as_one_device_and_explains_itself(kind, options):
    if kind == "sequential":
        model = pl.models.tiny_gpt(n_layers=4, d_model=32, n_heads=2, vocab_size=64, seq_len=8, seed=1)
        x, y = pl.models.sample_batch(model, 8, seed=2)
        loss_fn = pl.models.default_loss(model)
        pipe = pl.Pipeline(model, n_stages=2, n_microbatches=4, loss_fn=loss_fn, sample=(x, y), **options)
        result = pipe.step(x, y)
        reference = loss_fn(model(x), y)
    else:
        model, batch = tiny_gpt2()
        pipe = pl.Pipeline(model, n_stages=2, n_microbatches=4, sample=batch, **options)
        result = pipe.step(batch)
        reference = model(**batch).loss
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    reference.backward()
    assert result.loss == pytest.approx(reference.item(), rel=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    plan, chosen = pipe.plan, pipe.plan.chosen
    fastest = min(c.predicted for c in plan.candidates if c.fits)
    level = [c for c in plan.candidates if c.fits and c.predicted <= fastest * 1.005]
    assert chosen.predicted <= fastest * 1.005 and chosen.peak == min(c.peak for c in level)
    assert pipe.schedule.name == (chosen.schedule_name if chosen.schedule_name in ("gpipe", "1f1b", "zb-h1")
                                  else "search")
    if options.get("split_method") == "auto":
        if kind == "gpt2":  # cut before the chosen piece, which may be a part inside a block
            assert [s.first_module for s in pipe.partition.stages][1:] == plan.split_points()
        else:
            assert tuple(pipe.partition.bounds) == chosen.bounds
    else:
        assert plan.decided == "schedule" and pipe.partition.bounds == pl.split(model, 2, "params").bounds
    if "schedule" in options and options["schedule"] != "auto":
        assert {c.schedule_name for c in plan.candidates} == {options["schedule"]}
    assert plan.trace().makespan == pytest.approx(chosen.predicted)
    assert str(plan).startswith(f"decided: the {plan.decided}")


def test_the_places_to_cut_include_the_parts_inside_blocks_and_the_head():
    from pipelab.model.cut_points import cut_points
    model, batch = tiny_gpt2()
    assert cut_points(model, batch) == [
        "transformer.h.0.attn", "transformer.h.0.mlp", "transformer.h.1", "transformer.h.1.attn",
        "transformer.h.1.mlp", "transformer.h.2", "transformer.h.2.attn", "transformer.h.2.mlp", "lm_head"]


def test_zb_h1_cut_inside_a_block_gives_the_single_device_gradients():
    """A stage from a block's attention to its MLP sends the residual stream and its normed copy, one computed
    from the other: the split backward (I, then W) walks that graph once (a fixed bug: a KeyError in I)."""
    model, batch = tiny_gpt2()
    pipe = pl.Pipeline(model, n_stages=4, n_microbatches=2, sample=batch, schedule="zb-h1",
                       split_points=["transformer.h.0.attn", "transformer.h.0.mlp", "transformer.h.1"])
    result = pipe.step(batch)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    reference = model(**batch).loss
    reference.backward()
    assert result.loss == pytest.approx(reference.item(), rel=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("options, match", [
    (dict(split_method="auto"), "measure the model on a batch: pass sample="),
    (dict(split_method="auto", sample="batch", split_points=["x"]), "split_points names where to cut"),
    (dict(split_method="auto", sample="batch", schedule="pipedream-async"), "prices synchronous schedules"),
])
def test_bad_requests_are_named(options, match):
    model = pl.models.mlp(depth=4, width=8)
    x, y = pl.models.sample_batch(model, 8)
    options = {k: ((x, y) if v == "batch" else v) for k, v in options.items()}
    with pytest.raises((ValueError, TypeError), match=match):
        pl.Pipeline(model, n_stages=2, n_microbatches=4, loss_fn=torch.nn.functional.mse_loss, **options)


def test_a_pipeline_without_auto_has_no_plan():
    model = pl.models.mlp(depth=4, width=8)
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=2, loss_fn=torch.nn.functional.mse_loss)
    assert pipe.plan is None
    assert math.isfinite(decide(equal_pieces(2), 2, 2, schedules=("gpipe",)).chosen.predicted)


def test_the_engines_own_costs_are_measured_and_a_latency_is_fitted_back():
    """`engine_costs`: each family's per-action cost on the local engine is a positive fraction of a millisecond,
    and the local pipeline prices its in-process messages at 0; the fit inverts
    the simulator (a consistency check: a makespan simulated with latency 0.3 gives 0.3 back)."""
    from pipelab.runtime import engine_costs
    from pipelab.runtime.driver import StepDriver
    from pipelab.runtime.placement import LocalPlacement
    options = pl.PipelineOptions(n_microbatches=2)
    place = LocalPlacement(options, 2, "cpu")
    found = engine_costs.measure(lambda m, o: StepDriver(m, o, place.twin(o)), 2, ("whole", "split"), steps=3)
    assert set(found) == {"whole", "split"} and all(0 < overhead < 0.05 for overhead, _ in found.values())
    model = pl.models.mlp(depth=4, width=8)
    x, y = pl.models.sample_batch(model, 8)
    plan = pl.Pipeline(model, n_stages=2, n_microbatches=2, loss_fn=torch.nn.functional.mse_loss, sample=(x, y),
                       schedule="auto").plan
    assert {latency for _, latency in plan.engine.values()} == {0.0}
    schedule = pl.schedules.one_f_one_b(2, 8)
    span = pl.simulate(schedule, pl.Costs(forward=0.1, backward=0.1, latency=0.3)).makespan
    assert engine_costs.fitted_latency(schedule, 0.1, span) == pytest.approx(0.3, rel=1e-6)
    assert engine_costs.fitted_latency(schedule, 0.1, 0.0) == 0.0
