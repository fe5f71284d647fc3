"""Bad inputs named where they are made (issue 23, items 4-5).

A loss given a target of another shape, ranks built with different arguments, a tensor-parallel
width that does not divide, junk in a schedule table, NaN or inf in a step, and a stage with
nothing to differentiate: each is a message that names the mistake and where it is, or (the
last) a step that runs, exact against the single-device step.  The distributed cases run on 2
gloo ranks, two launches in all (`bad_input_cases.py`).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import bad_input_cases as cases
import pipelab as pl
from pipelab.model import tp_plans
from pipelab.predict.layout import Layout
from pipelab.runtime import fingerprint

TOLERANCE = dict(rtol=1e-5, atol=1e-6)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def mlp_pipeline(loss_fn, **options) -> tuple[nn.Module, pl.Pipeline]:
    model = pl.models.mlp(depth=4, width=16, seed=1)
    return model, pl.Pipeline(model, n_stages=2, n_microbatches=2, loss_fn=loss_fn, warm_up=False, **options)


# 1. The loss's output and target shapes

@pytest.mark.parametrize("loss_fn", [nn.MSELoss(), nn.L1Loss(), nn.SmoothL1Loss(), nn.HuberLoss(),
                                     nn.BCEWithLogitsLoss()])
def test_a_target_that_would_broadcast_is_refused_with_both_shapes(loss_fn):
    _, pipe = mlp_pipeline(loss_fn)
    with pytest.raises(ValueError) as caught:
        pipe.step(torch.randn(8, 16), torch.rand(8, 1))
    text = str(caught.value)
    assert "output has shape (4, 16) and the target shape (4, 1): it would broadcast both to (4, 16)" in text
    assert "wrap the loss in a function to broadcast on purpose" in text
    assert isinstance(caught.value, pl.PipelineError) and "F(stage 1, mb 0) failed on stage 1" in text


def test_the_classic_column_against_vector_mistake_is_refused():
    """An output of shape (B, 1) against targets of shape (B,) broadcasts to (B, B)."""
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 1))
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=2, loss_fn=nn.MSELoss(), warm_up=False)
    with pytest.raises(ValueError, match=r"output has shape \(4, 1\) and the target shape \(4,\): it would "
                                         r"broadcast both to \(4, 4\)"):
        pipe.step(torch.randn(8, 16), torch.randn(8))


def test_a_loss_wrapped_in_a_function_broadcasts_on_purpose():
    _, pipe = mlp_pipeline(lambda output, target: nn.functional.mse_loss(output, target.expand_as(output)))
    assert pipe.step(torch.randn(8, 16), torch.randn(8, 1)).loss > 0


def test_a_target_that_makes_the_loss_fail_names_both_shapes():
    _, pipe = mlp_pipeline(nn.L1Loss())
    with pytest.raises(ValueError, match=r"output has shape \(4, 16\) and the target shape \(4, 3\)"):
        pipe.step(torch.randn(8, 16), torch.randn(8, 3))
    _, pipe = mlp_pipeline(nn.CrossEntropyLoss())
    with pytest.raises(pl.PipelineError) as caught:
        pipe.step(torch.randn(8, 16), torch.randint(0, 16, (8, 2)))
    assert "the loss failed on the output of shape (4, 16) and the target of shape (4, 2)" in str(caught.value)


# 2. The ranks agree on the configuration

def test_the_first_rank_that_differs_from_rank_0_is_named_with_every_field_it_differs_on():
    same = {"n_microbatches": "4", "schedule": "1f1b", "layout": "dp=1 pp=3 tp=1"}
    other = {**same, "n_microbatches": "8", "schedule": "gpipe"}
    assert fingerprint.disagreement([same, same, same]) is None
    message = fingerprint.disagreement([same, same, other])
    assert message.startswith("ranks 0 and 2 disagree on n_microbatches: 4 vs 8; schedule: 1f1b vs gpipe.")


def test_the_model_structure_is_its_parameter_names_and_shapes():
    one, same, wider = (pl.models.mlp(depth=2, width=w, seed=s) for w, s in ((16, 1), (16, 2), (17, 1)))
    assert fingerprint.model_structure(one) == fingerprint.model_structure(same)
    assert fingerprint.model_structure(one) != fingerprint.model_structure(wider)


# 3. Tensor-parallel widths, checked before DTensor sees them

def test_a_width_tensor_parallel_does_not_divide_is_refused_only_where_dtensor_would_not_split_it_exactly():
    """An uneven Linear runs (on ranks: `test_on_two_ranks_..._an_uneven_tp_width_...`), unless its ColwiseParallel
    hands a plain tensor to the next block: then the RowwiseParallel after it would rebuild a DTensor of the
    wrong global shape, and the message says so."""
    colwise, rowwise = tp_plans._styles()
    block = nn.Sequential(nn.Linear(16, 15), nn.GELU())
    with pytest.raises(ValueError) as caught:
        tp_plans.check(block, {"0": colwise()}, 2, "block 3 (stage 1)")
    assert str(caught.value) == (
        "block 3 (stage 1): tensor_parallel=2 does not divide the 15 output features of its Linear 0, and its "
        "ColwiseParallel hands on each rank's share as a plain tensor (use_local_output=True): the RowwiseParallel "
        "after it rebuilds the DTensor as if every share held 15 / 2 features (DTensor.from_local without the "
        "global shape), and fails; pass ColwiseParallel(use_local_output=False) (pl.models' plans do), make them a "
        "multiple of 2, or leave the block replicated (its plan None)")
    tp_plans.check(block, {"0": colwise(use_local_output=False)}, 2, "block 3 (stage 1)")  # a DTensor goes on
    tp_plans.check(block, {"0": colwise()}, 3, "block 3 (stage 1)")  # 15 = 3 x 5
    tp_plans.check(nn.Linear(15, 16), rowwise(), 2, "block 4 (stage 1)")  # its input: the DTensor above
    default = tp_plans.default_plans([block, nn.Linear(15, 16)])
    for b, plan in zip([block, nn.Linear(15, 16)], default):
        tp_plans.check(b, plan, 2, "block 0 (stage 0)")  # pl.models' pairs: run unevenly
    with pytest.raises(ValueError, match="the 10 embedding dimensions of its Embedding emb,"):  # a pattern, as torch's
        tp_plans.check(nn.ModuleDict({"emb": nn.Embedding(8, 10)}), {"e*": colwise()}, 4, "block 0 (stage 0)")
    gpt_block = pl.models.tiny_gpt(n_layers=1, d_model=12, n_heads=3)[1]
    with pytest.raises(ValueError, match="tensor_parallel=2 must divide the block's 3 attention heads"):
        tp_plans.check(gpt_block, tp_plans.transformer_block_plan(), 2, "block 1 (stage 0)")
    tp_plans.check(block, None, 2, "block 3 (stage 1)")  # replicated: nothing split


# 4. Schedule inputs

@pytest.mark.parametrize("order, error, pattern", [
    ({0: [1, 2]}, TypeError, r"rank 0, position 0: 1 \(int\) is not a PyTorch action"),
    ({0: ["0F0"], 1: None}, TypeError, "rank 1's row of pipeline_order must be a list of actions, got NoneType"),
    ({0: ["0F0", "zzz"]}, pl.ScheduleError, "rank 0, position 1: cannot read 'zzz' as a PyTorch action"),
    ({0: ["0F0", 3.5]}, TypeError, r"rank 0, position 1: 3.5 \(float\)"),
    ({"0": ["0F0"]}, TypeError, "pipeline_order's keys are ranks"),
])
def test_junk_in_a_torch_table_is_named(order, error, pattern):
    with pytest.raises(error, match=pattern):
        pl.schedules.from_torch(order, 1)


@pytest.mark.parametrize("field, value", [("update_every", 0), ("update_every", -2), ("update_every", 1.5),
                                          ("update_every", True), ("asynchronous", 1), ("asynchronous", "yes")])
def test_a_schedule_with_a_bad_field_fails_when_made_and_when_validated(field, value):
    with pytest.raises(pl.ScheduleError, match=f"the schedule's {field}"):
        pl.Schedule(2, 2, pl.schedules.gpipe(2, 2).actions, **{field: value})
    schedule = pl.schedules.pipedream_async(2, 2)
    setattr(schedule, field, value)
    with pytest.raises(pl.ScheduleError, match=f"the schedule's {field}"):
        pl.schedules.validate(schedule)


# 5. NaN and inf, where they first appear

def test_nan_made_by_a_stage_is_reported_with_its_stage_action_and_microbatch_in_the_first_step_only():
    model, pipe = mlp_pipeline(nn.MSELoss())
    with torch.no_grad():  # the last block's bias: only an addition, so the count holds on every BLAS kernel
        model[3].bias[3] = float("nan")
    x, y = cases.batch()
    with pytest.raises(pl.PipelineError) as caught:
        pipe.step(x, y)
    text = str(caught.value)
    assert "F(stage 1, mb 0) failed on stage 1 (blocks 2..3): NonFiniteError" in text
    assert "holds 4 NaN of its 64 values, the first at index (0, 3)" in text and "its input is finite" in text
    assert math.isnan(pipe.step(x, y).loss)  # "first": the next step runs unchecked


def test_check_finite_true_checks_every_step_and_false_none():
    model, pipe = mlp_pipeline(nn.MSELoss(), check_finite=True)
    x, y = cases.batch()
    pipe.step(x, y)
    # Written where no matrix product follows (the last block's bias, added elementwise): inf - inf and inf * 0
    # inside a product turn into NaN or not depending on the CPU's BLAS kernel, an addition does not.
    with torch.no_grad():
        model[3].bias[0], model[3].bias[1] = float("nan"), float("inf")
    with pytest.raises(pl.PipelineError, match=r"F\(stage 1, mb 0\) failed on stage 1 .*NonFiniteError: the "
                                               r"stage's output \(shape \(4, 16\)\) holds 4 NaN and 4 inf of its "
                                               r"64 values, the first at index \(0, 0\)"):
        pipe.step(x, y)
    _, quiet = mlp_pipeline(nn.MSELoss(), check_finite=False)
    x[5, 0] = float("nan")
    assert math.isnan(quiet.step(x, y).loss)  # unreported
    with pytest.raises(ValueError, match='check_finite must be "first"'):
        mlp_pipeline(nn.MSELoss(), check_finite="always")


def test_nan_in_the_batch_and_inf_in_the_loss_are_told_apart():
    _, pipe = mlp_pipeline(nn.MSELoss())
    x, y = cases.batch()
    x[6, 2] = float("nan")  # micro-batch 1
    with pytest.raises(pl.PipelineError, match=r"F\(stage 0, mb 1\).*its input already holds NaN or inf"):
        pipe.step(x, y)
    _, pipe = mlp_pipeline(lambda output, target: ((output - target) ** 2).mean() / 0.0)
    with pytest.raises(pl.PipelineError, match=r"F\(stage 1, mb 0\).*the loss is inf though the stage's output "
                                               "is finite"):
        pipe.step(*cases.batch())


# 6. A stage with nothing to differentiate

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_parameter_free_first_stage_runs_and_the_gradients_are_the_single_device_ones(schedule, checkpoint):
    model = cases.parameter_free_first_stage()
    x, y = cases.batch()
    ref_loss, ref_grads = pl.single_device_gradients(model, x, y, nn.MSELoss())
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=4, schedule=schedule, loss_fn=nn.MSELoss(),
                       checkpoint=checkpoint)
    result = pipe.step(x, y)
    assert result.loss == pytest.approx(ref_loss, rel=1e-6)
    assert pl.max_gradient_difference(model, ref_grads) < 1e-6


def test_a_parameter_free_stage_of_an_asynchronous_schedule_has_no_weights_to_stash():
    """One minibatch (m = 1): the update is plain SGD on the single-device gradients."""
    model = cases.parameter_free_first_stage()
    x, y = cases.batch()
    _, grads = pl.single_device_gradients(model, x, y, nn.MSELoss())
    expected = {name: p.detach() - 0.1 * grads[name] for name, p in model.named_parameters()}
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=1, schedule="pipedream-async", loss_fn=nn.MSELoss(),
                       optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    pipe.step(x, y)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], **TOLERANCE)


# The distributed engine: 2 gloo ranks

def test_on_two_ranks_a_disagreement_is_named_an_uneven_tp_width_is_exact_and_a_parameter_free_stage_too():
    per_rank = pl.distributed.launch(cases.mistakes_and_a_parameter_free_stage, 2, timeout_seconds=120)
    for found in per_rank:  # every rank gets the same message
        assert found["other m"].startswith("ValueError: ranks 0 and 1 disagree on n_microbatches: 4 vs 8")
    # 15 hidden features over tensor_parallel=2: ranks hold 8 and 7 of them, and the step is the single device's
    model = cases.uneven_tensor_parallel_model()
    ref_loss, ref_grads = pl.single_device_gradients(model, *cases.batch(), nn.MSELoss())
    for rank, found in enumerate(per_rank):
        loss, grads, shards = found["tp width"]
        assert shards["0.0.weight"] == ((8, 16) if rank == 0 else (7, 16)) and shards["1.weight"] == (16, 8 - rank)
        assert loss == pytest.approx(ref_loss, rel=1e-6) and set(grads) == set(ref_grads)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], **TOLERANCE, msg=lambda e: f"rank {rank} {name}: {e}")
    model = cases.parameter_free_first_stage()
    x, y = cases.batch()
    ref_loss, ref_grads = pl.single_device_gradients(model, x, y, nn.MSELoss())
    for schedule in ("1f1b", "zb-h1"):
        (loss, grads_0), (_, grads_1) = (found[schedule] for found in per_rank)
        assert loss == pytest.approx(ref_loss, rel=1e-6) and grads_0 == {}  # stage 0: nothing to differentiate
        assert set(grads_1) == set(ref_grads)
        for name, grad in grads_1.items():
            torch.testing.assert_close(grad, ref_grads[name], **TOLERANCE)


def test_on_two_ranks_nan_is_reported_by_the_rank_and_stage_that_made_it():
    with pytest.raises(pl.DistributedError) as caught:
        pl.distributed.launch(cases.nan_on_the_last_stage, 2, timeout_seconds=120)
    assert caught.value.rank == 1
    assert "F(stage 1, mb 0) failed on stage 1 (blocks 2..3, rank 1): NonFiniteError" in str(caught.value)


def test_the_layout_is_part_of_the_fingerprint():
    assert "layout" in fingerprint.fields(pl.schedules.gpipe(2, 2), 2, Layout(pp=2), nn.Linear(2, 2), "samples")
