"""PP × FSDP2 on a DeviceMesh (gloo, 4 ranks: dp=2 × pp=2): exact against one device.

Reference: the plain single-device step on the whole batch (`loss_fn(model(x), y).backward()`, or a Hugging
Face model's own loss), torch's `clip_grad_norm_`, then one AdamW step, in the test process (no pipelab
code).  Every rank returns its stage's clipped gradients and parameters gathered from their shards
(`DTensor.full_tensor()`); each replica must hold the single-device values of every parameter of its stage,
for GPipe, 1F1B and ZB-H1 (the split backward: W after FSDP's hooks ran at I), with and without
`reshard_after_forward`, on pipelab's MLP and GPT and on a Hugging Face GPT-2 split by names (its tied
embedding on both stages: the two copies' shards summed).  The batch of 19 samples (of pipelab's models) gives
the two replicas uneven shares (10 and 9), so a replica's gradients must be weighted by its share before the reduce-scatter.
The all-gathers and reduce-scatters each rank counted equal the closed forms of `predict/fsdp_formulas.py`,
per step and per micro-batch; the parameter, gradient and optimizer bytes each rank holds after the step are
within 10 % of ZeRO-3's (`state_bytes_per_rank`).  All cases run in one launch of 4 ranks.
"""

import pytest
import torch
from torch import nn

import pipelab as pl
from pipelab.predict.fsdp_formulas import fsdp_communication, sharded_bytes, state_bytes_per_rank

import fsdp_cases as cases
from fsdp_cases import BATCH, LAYOUT, MAX_NORM, make_batch, make_model

TOLERANCE = dict(rtol=1e-5, atol=1e-6)
pytestmark = pytest.mark.usefixtures("one_torch_thread")
GRID = [("mlp", "gpipe", 4, True), ("mlp", "1f1b", 4, False), ("mlp", "1f1b", 3, True), ("mlp", "zb-h1", 4, True),
        ("mlp", "zb-h1", 2, False), ("gpt", "zb-h1", 4, True),  # gpt: its W reads gathered weights
        ("gpt2", "gpipe", 2, True), ("gpt2", "1f1b", 2, True), ("gpt2", "zb-h1", 2, False)]


def reference(kind):
    model = make_model(kind)
    inputs, targets = make_batch(kind, model)
    loss = model(**inputs).loss if kind == "gpt2" else pl.models.default_loss(model)(model(inputs), targets)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    cases.adamw(model.parameters()).step()
    return loss.detach(), float(norm), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_pp2_fsdp2_equals_one_device_for_gpipe_1f1b_and_zb_h1():
    per_rank = pl.distributed.launch(cases.run_sharded, LAYOUT.world_size, GRID, timeout_seconds=240)
    assert {found["pipelab"] for found in per_rank} == {pl.__file__}
    references = {kind: reference(kind) for kind in ("mlp", "gpt", "gpt2")}
    for c, (kind, schedule, m, reshard) in enumerate(GRID):
        where = f"{kind} {schedule} m={m} reshard_after_forward={reshard}"
        ref_loss, ref_norm, ref_grads, ref_after = references[kind]
        holders = {}  # parameter -> the ranks holding its gradient
        for rank, found in enumerate(per_rank):
            case = found["cases"][c]
            assert case["coordinates"] == LAYOUT.coordinates(rank), where
            torch.testing.assert_close(torch.tensor(case["loss"], dtype=ref_loss.dtype), ref_loss, **TOLERANCE,
                                       msg=lambda e: f"{where} rank {rank} loss: {e}")
            assert case["norm"] == pytest.approx(ref_norm, rel=1e-5), f"{where} rank {rank}: the clipped norm"
            assert set(case["grads"]) == set(case["after"]), where
            for name, grad in case["grads"].items():
                holders.setdefault(name, []).append(rank)
                torch.testing.assert_close(grad, ref_grads[name], **TOLERANCE,
                                           msg=lambda e: f"{where} rank {rank} {name} gradient: {e}")
                if kind == "mlp":  # a zero gradient up to rounding (gpt's key bias) AdamW's g/√v turns into
                    # steps of ±lr: the parameters after the step are compared on the mlp only
                    torch.testing.assert_close(case["after"][name], ref_after[name], **TOLERANCE,
                                               msg=lambda e: f"{where} rank {rank} {name} after AdamW: {e}")
        assert set(holders) == set(ref_grads), f"{where}: parameters without a gradient"
        assert all(len(ranks) % LAYOUT.dp == 0 for ranks in holders.values()), where  # both replicas of a stage
        if kind == "gpt2":  # the tied embedding on both stages, each copy whole after its shards were summed
            assert len(holders["transformer.wte.weight"]) == 2 * LAYOUT.dp, where
    check_state_bytes(per_rank)
    check_counts(per_rank)
    for rank, found in enumerate(per_rank):  # stage 0: P/2 + 2 blocks = 4.25 KiB, P + P/2 = 6.38 KiB, P = 4.25 KiB
        assert "parameters 4.2 KiB, gradients 6.4 KiB, optimizer 4.2 KiB" in found["over_limit"], found["over_limit"]
    message = per_rank[0]["bad_shard"]
    assert "shard='zero4'" in message and 'shard="fsdp"' in message and "shard=None" in message
    for found in per_rank:
        assert "shard, reshard_after_forward" in found["disagreeing"], found["disagreeing"]


def _stage_of(kind: str, names) -> list[nn.Module]:
    """The reference model's parameters of one stage (those named), as one module (a unit of padding per parameter)."""
    params = dict(make_model(kind).named_parameters())
    return [nn.ParameterList([params[n] for n in sorted(names)])]


def check_state_bytes(per_rank):
    """What each rank holds after the AdamW step against ZeRO-3 (`state_bytes_per_rank`, zero=3, AdamW's two
    moments): parameters and gradients exactly its padded shards, the optimizer within 10 % (its step counts).
    Half of the stage's whole bytes on each replica is checked by hand where the first dimensions split evenly."""
    for c, (kind, schedule, m, reshard) in enumerate(GRID):
        for rank, found in enumerate(per_rank):
            case = found["cases"][c]
            predicted = state_bytes_per_rank(_stage_of(kind, case["grads"]), LAYOUT.dp, zero=3)
            held = case["held"]
            where = f"{kind} {schedule} rank {rank}: held {held}, predicted {predicted}"
            assert held["parameters"] == predicted["parameters"] == case["parameter_bytes"], where
            assert held["gradients"] == predicted["gradients"], where
            assert abs(held["optimizer"] / predicted["optimizer"] - 1) <= 0.10, where
            if kind == "mlp":  # 16-wide layers: every first dimension splits evenly over 2 replicas
                whole = sum(4 * p.numel() for p in _stage_of(kind, case["grads"])[0])
                assert predicted["parameters"] * LAYOUT.dp == whole, where


def check_counts(per_rank):
    """The all-gathers and reduce-scatters each rank's counter recorded in a step equal `fsdp_communication`:
    per block with parameters (a stage split by names is one unit), 1 or 2m gathers (3m on the second stage of
    ZB-H1: F, I and W each gather), one reduce-scatter; each gather given the rank's shard, each reduce-scatter
    the whole gradient.  Per micro-batch: resharding, every micro-batch gathers its share (k per block); kept,
    the first forward gathers once per block; the reduce-scatters come after the step, outside every action."""
    for c, (kind, schedule, m, reshard) in enumerate(GRID):
        for rank, found in enumerate(per_rank):
            case = found["cases"][c]
            stage = LAYOUT.coordinates(rank)[1]
            if kind == "gpt2":
                blocks = _stage_of(kind, case["grads"])
            else:
                a, b = pl.split(make_model(kind), LAYOUT.pp, "uniform").bounds[stage]
                blocks = list(make_model(kind))[a:b]
            actions = 3 if schedule == "zb-h1" and stage > 0 else 2
            expected = fsdp_communication(blocks, LAYOUT.dp, m, reshard, actions)
            where = f"{kind} {schedule} m={m} reshard_after_forward={reshard} rank {rank}"
            for kind_ in ("fsdp_gather", "fsdp_reduce_scatter"):
                seen = [(size, mb) for k, size, mb in case["records"] if k == kind_]
                got = {"messages": len(seen), "bytes": sum(size for size, _ in seen)}
                want = {key: expected[kind_][key] for key in got}
                assert got == want, f"{where} {kind_}: counted {got}, formula {want}"
            shard = sum(sharded_bytes(b, LAYOUT.dp) for b in blocks)
            gathers = {}
            for k, size, mb in case["records"]:
                if k == "fsdp_gather":
                    gathers[mb] = gathers.get(mb, 0) + size
            want = {i: actions * shard for i in range(m)} if reshard else {0: shard}
            assert gathers == want, f"{where}: gathered bytes per micro-batch {gathers}, formula {want}"
            per_microbatch = {mb: entry["bytes"] for mb, entry in case["gathers_per_microbatch"].items()}
            assert per_microbatch == want, f"{where}: counter.per_microbatch {per_microbatch}, formula {want}"
            assert {mb for k, _, mb in case["records"] if k == "fsdp_reduce_scatter"} == {None}, where
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
