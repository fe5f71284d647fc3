"""PP × FSDP2 on a DeviceMesh (gloo, 4 ranks: dp=2 × pp=2): exact against one device.

Reference: the plain single-device step on the whole batch, `loss_fn(model(x), y).backward()`, then
one AdamW step, in the test process (no pipelab code).  Every rank returns its stage's gradients
and parameters gathered from their shards (`DTensor.full_tensor()`); each replica must hold the
single-device values of every parameter of its stage, for GPipe, 1F1B and ZB-H1 (the split
backward: W after FSDP's hooks ran at I), with and without `reshard_after_forward`.  The batch of
19 samples gives the two replicas uneven shares (10 and 9), so a replica's gradients must be
weighted by its share before the reduce-scatter.  The all-gathers and reduce-scatters each rank
counted equal the closed forms of `predict/fsdp_formulas.py`.  All cases run in one launch of 4 ranks.
"""

import pytest
import torch

import pipelab as pl
from pipelab.predict.fsdp_formulas import fsdp_communication

import fsdp_cases as cases
from fsdp_cases import BATCH, LAYOUT, make_model

TOLERANCE = dict(rtol=1e-5, atol=1e-6)
pytestmark = pytest.mark.usefixtures("one_torch_thread")
GRID = [("mlp", "gpipe", 4, True), ("mlp", "1f1b", 4, False), ("mlp", "1f1b", 3, True), ("mlp", "zb-h1", 4, True),
        ("mlp", "zb-h1", 2, False), ("gpt", "zb-h1", 4, True)]  # gpt: its W reads gathered weights


def reference(kind):
    model = make_model(kind)
    x, y = pl.models.sample_batch(model, BATCH, seed=2)
    loss = pl.models.default_loss(model)(model(x), y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    cases.adamw(model.parameters()).step()
    return loss.detach(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_pp2_fsdp2_equals_one_device_for_gpipe_1f1b_and_zb_h1():
    per_rank = pl.distributed.launch(cases.run_sharded, LAYOUT.world_size, GRID, timeout_seconds=240)
    assert {found["pipelab"] for found in per_rank} == {pl.__file__}
    references = {kind: reference(kind) for kind in ("mlp", "gpt")}
    for c, (kind, schedule, m, reshard) in enumerate(GRID):
        where = f"{kind} {schedule} m={m} reshard_after_forward={reshard}"
        ref_loss, ref_grads, ref_after = references[kind]
        holders = {}  # parameter -> the ranks holding its gradient
        for rank, found in enumerate(per_rank):
            case = found["cases"][c]
            assert case["coordinates"] == LAYOUT.coordinates(rank), where
            torch.testing.assert_close(torch.tensor(case["loss"], dtype=ref_loss.dtype), ref_loss, **TOLERANCE,
                                       msg=lambda e: f"{where} rank {rank} loss: {e}")
            assert set(case["grads"]) == set(case["after"]), where
            for name, grad in case["grads"].items():
                holders.setdefault(name, []).append(rank)
                torch.testing.assert_close(grad, ref_grads[name], **TOLERANCE,
                                           msg=lambda e: f"{where} rank {rank} {name} gradient: {e}")
                if kind == "mlp":  # gpt's key bias has a zero gradient up to rounding, which AdamW's g/√v
                    # turns into steps of ±lr: its parameters after the step are compared on the mlp only
                    torch.testing.assert_close(case["after"][name], ref_after[name], **TOLERANCE,
                                               msg=lambda e: f"{where} rank {rank} {name} after AdamW: {e}")
        assert set(holders) == set(ref_grads), f"{where}: parameters without a gradient"
        assert all(len(ranks) == LAYOUT.dp for ranks in holders.values()), where  # both replicas of its stage
        # each replica holds half of its stage's parameters (the first dimensions here split evenly)
        for rank, found in enumerate(per_rank):
            stage = LAYOUT.coordinates(rank)[1]
            whole = sum(4 * ref_grads[n].numel() for n in ref_grads if n in found["cases"][c]["grads"])
            assert found["cases"][c]["parameter_bytes"] * LAYOUT.dp == whole, f"{where} rank {rank} stage {stage}"
    check_counts(per_rank)
    message = per_rank[0]["bad_shard"]
    assert "shard='zero4'" in message and 'shard="fsdp"' in message and "shard=None" in message
    for found in per_rank:
        assert "shard, reshard_after_forward" in found["disagreeing"], found["disagreeing"]


def check_counts(per_rank):
    """The all-gathers and reduce-scatters each rank's counter recorded in a step equal `fsdp_communication`:
    per block with parameters, 1 or 2m gathers (3m on the second stage of ZB-H1: F, I and W each gather), one
    reduce-scatter; each gather given the rank's half of the block, each reduce-scatter the whole gradient."""
    for c, (kind, schedule, m, reshard) in enumerate(GRID):
        blocks = list(make_model(kind))
        bounds = pl.split(make_model(kind), LAYOUT.pp, "uniform").bounds
        for rank, found in enumerate(per_rank):
            stage = LAYOUT.coordinates(rank)[1]
            a, b = bounds[stage]
            actions = 3 if schedule == "zb-h1" and stage > 0 else 2
            expected = fsdp_communication(blocks[a:b], LAYOUT.dp, m, reshard, actions)
            for kind in ("fsdp_gather", "fsdp_reduce_scatter"):
                seen = [size for k, _, size in found["cases"][c]["records"] if k == kind]
                got = {"messages": len(seen), "bytes": sum(seen)}
                want = {key: expected[kind][key] for key in got}
                assert got == want, f"{kind} {schedule} m={m} reshard_after_forward={reshard} rank {rank} {kind}: " \
                                    f"counted {got}, formula {want}"
    # by hand, stage 0 (4 blocks of 16·16 + 16 = 272 float32 parameters, 1088 bytes; a rank holds 544), 1F1B m=3
    # resharding: 4 blocks · 2 · 3 = 24 gathers of 544 bytes; 4 reduce-scatters given 1088 bytes each
    assert fsdp_communication(list(make_model())[:4], 2, 3, True) == {
        "fsdp_gather": {"messages": 24, "bytes": 24 * 544, "wire_bytes": 24 * 544},
        "fsdp_reduce_scatter": {"messages": 4, "bytes": 4 * 1088, "wire_bytes": 4 * 544}}


@pytest.mark.parametrize("settings, error, words", [
    (dict(shard="zero4"), ValueError, "shard='zero4' is not a sharding"),
    (dict(shard="fsdp", reshard_after_forward="yes"), TypeError, "reshard_after_forward must be True or False"),
])
def test_a_bad_shard_is_named_before_any_rank_starts(settings, error, words):
    with pytest.raises(error, match=words):
        pl.DistributedPipeline(make_model(), n_microbatches=2, loss_fn=torch.nn.MSELoss(), **settings)
