"""PP × TP × DP on a DeviceMesh (gloo): exact against one device, and its communication counted.

Reference: the plain single-device step on the whole batch, `loss_fn(model(x), y).backward()`
in the test process (no pipelab code).  Every rank returns its stage's full gradients
(`pipe.gradients()`, gathered over "tp"); each replica and each TP rank must hold the
single-device gradient of every parameter of its stage.

Communication: the counts come from the real calls (a dispatch mode sees every c10d and
DTensor collective, `runtime/comm_count.py`); they are compared with the closed forms of
`predict/comm_formulas.py` (Megatron-LM, ZeRO), written from the model's dimensions, and
for three cases with numbers worked out by hand below.  Three launches (2, 4, 8 ranks).
"""

import pytest
import torch

import pipelab as pl
from pipelab.predict.layout import Layout
from pipelab.predict.comm_formulas import expected_communication

import hybrid_cases as cases
from hybrid_cases import BATCH, make_model

TOLERANCE = dict(rtol=1e-5, atol=1e-6)
pytestmark = pytest.mark.usefixtures("one_torch_thread")
COUNTED = ("pp", "pp_received", "pp_gather", "tp", "dp")


def reference(kind):
    model = make_model(kind)
    x, y = pl.models.sample_batch(model, BATCH, seed=2)
    loss = pl.models.default_loss(model)(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def check_exact(grid, per_rank):
    references = {kind: reference(kind) for kind in ("mlp", "gpt")}
    for c, (kind, shape, schedule, m) in enumerate(grid):
        layout = Layout(*shape)
        where = f"{kind} {layout} {schedule} m={m}"
        ref_loss, ref_grads = references[kind]
        holders = {}  # parameter -> the ranks holding its gradient
        for rank in range(layout.world_size):
            found = per_rank[rank][c]
            assert found["coordinates"] == layout.coordinates(rank), where
            torch.testing.assert_close(torch.tensor(found["loss"], dtype=ref_loss.dtype), ref_loss, **TOLERANCE,
                                       msg=lambda e: f"{where} rank {rank} loss: {e}")
            for name, grad in found["grads"].items():
                holders.setdefault(name, []).append(rank)
                torch.testing.assert_close(grad, ref_grads[name], **TOLERANCE,
                                           msg=lambda e: f"{where} rank {rank} {name}: {e}")
        assert set(holders) == set(ref_grads), f"{where}: parameters without a gradient"
        # each parameter lives on one stage: on all dp · tp ranks of that stage
        assert all(len(ranks) == layout.dp * layout.tp for ranks in holders.values()), where


def check_counts(grid, per_rank):
    for c, (kind, shape, schedule, m) in enumerate(grid):
        layout = Layout(*shape)
        model = make_model(kind)
        bounds = pl.split(model, layout.pp, "uniform").bounds
        for rank in range(layout.world_size):
            counted = per_rank[rank][c]["counts"]
            expected = expected_communication(model, layout, rank, BATCH, m, bounds)
            for kind_of in COUNTED:
                got = {key: counted[kind_of][key] for key in ("messages", "elements")}
                assert got == expected[kind_of], f"{kind} {layout} {schedule} rank {rank} {kind_of}: " \
                                                 f"counted {got}, formula {expected[kind_of]}"
                assert counted[kind_of]["bytes"] == 4 * counted[kind_of]["elements"]  # float32
            if layout.dp > 1:  # the all-reduce carries what the rank holds
                assert counted["dp"]["bytes"] == per_rank[rank][c]["parameter_bytes"]


def expected_saved_bytes(layout: Layout, stage: int, rows: int, width: int = 16, depth: int = 8) -> int:
    """What autograd keeps for one micro-batch of `rows` on `stage` of pl.models.mlp under tensor parallelism t,
    by Megatron's split (Korthikanti et al. 2022, §4.1): in each column/row-parallel pair of Linear + GELU
    blocks the pair's input and its output (GELU's input) are whole on every rank, the two tensors inside
    (the first Linear's output, GELU's output) are split by t: (2 + 2/t)·n·h; the model's last pair ends with
    a plain Linear, whose output the loss keeps instead: (1 + 2/t)·n·h; the last stage's MSE keeps its output
    and target, 2·n·h.  fp32: 4 bytes each.  Not weights: they are the model's state, not activations."""
    t = layout.tp
    a, b = pl.split(pl.models.mlp(depth=depth, width=width), layout.pp, "uniform").bounds[stage]
    units = sum((1 if last == depth - 1 else 2) + 2 / t for last in range(a + 1, b, 2))
    units += 2 if b == depth else 0
    return round(units * rows * width * 4)


def check_saved_bytes(grid, per_rank):
    """Counted activation bytes of every micro-batch of every mlp stage equal `expected_saved_bytes`."""
    for c, (kind, shape, _, m) in enumerate(grid):
        if kind != "mlp":
            continue
        layout = Layout(*shape)
        for rank in range(layout.world_size):
            dp_index = layout.coordinates(rank)[0]
            share = pl.microbatch.sizes(BATCH, layout.dp)[dp_index]
            for stage, saved in per_rank[rank][c]["saved"].items():
                rows = pl.microbatch.sizes(share, m)
                assert saved == {i: expected_saved_bytes(layout, stage, n) for i, n in enumerate(rows)}, \
                    f"{layout} rank {rank} stage {stage}: counted {saved}"


def test_tensor_parallel_alone_and_a_plain_pipeline_on_two_ranks():
    grid = [(kind, shape, schedule, m) for kind in ("mlp", "gpt") for shape in ((1, 1, 2), (1, 2, 1))
            for schedule, m in (("gpipe", 4), ("1f1b", 1))]
    per_rank = pl.distributed.launch(cases.run_layouts, 2, grid, True, timeout_seconds=240)
    check_exact(grid, per_rank)
    check_counts(grid, per_rank)
    check_saved_bytes(grid, per_rank)
    # by hand, mlp (8 Linears 16 -> 16) TP2, one stage, 19 samples in m = 4 micro-batches: pairs (0,1) (2,3)
    # (4,5) (6,7); forward one all-reduce of b·16 per pair, backward one per pair but the first (its input is
    # the data): 4 · 4 + 3 · 4 = 28 messages, (4 + 3) · 19 · 16 = 2128 elements, on each rank
    mlp_tp = grid.index(("mlp", (1, 1, 2), "gpipe", 4))
    for rank in range(2):
        assert per_rank[rank][mlp_tp]["counts"]["tp"] == {"messages": 28, "bytes": 4 * 2128, "elements": 2128}


def test_pp_tp_and_pp_dp_and_tp_dp_on_four_ranks():
    grid = [(kind, shape, schedule, 4) for kind in ("mlp", "gpt") for shape in ((1, 2, 2), (2, 2, 1), (2, 1, 2))
            for schedule in ("gpipe", "1f1b")]
    per_rank = pl.distributed.launch(cases.run_layouts, 4, grid, True, timeout_seconds=300)
    check_exact(grid, per_rank)
    check_counts(grid, per_rank)
    check_saved_bytes(grid, per_rank)  # the activations TP splits, and only those (no weight shard among them)
    # one DeviceMesh per layout in a process, shared by its pipelines (each new mesh would add process groups
    # and their threads for good): the twelve pipelines exact above ran on three meshes
    for rank in per_rank:
        meshes = {}
        for (_, shape, _, _), found in zip(grid, rank):
            assert meshes.setdefault(shape, found["mesh"]) == found["mesh"]
        assert len(set(meshes.values())) == 3
    # by hand, tiny GPT (s=6, h=16) PP2 × TP2, rank 0 (stage 0: embedding + 2 layers), 19 samples:
    # pp: 4 activations of b·6·16/2 = 19·48 = 912 elements; tp: 2 layers · 4 all-reduces of b·96 = 8·19·96
    gpt_pp_tp = grid.index(("gpt", (1, 2, 2), "1f1b", 4))
    assert per_rank[0][gpt_pp_tp]["counts"]["pp"]["elements"] == 912
    assert per_rank[0][gpt_pp_tp]["counts"]["tp"] == {"messages": 32, "bytes": 4 * 14592, "elements": 14592}


SHARDED = [("mlp", "1f1b", 4, True), ("gpt", "gpipe", 2, False), ("gpt", "zb-h1", 4, True)]
MAX_NORM = 0.05  # below every case's norm: clipping scales


def test_pp_tp_dp_on_eight_ranks():
    grid = [("mlp", (2, 2, 2), "gpipe", 4), ("gpt", (2, 2, 2), "1f1b", 4), ("gpt", (2, 2, 2), "gpipe", 2)]
    launched = pl.distributed.launch(cases.eight_ranks, 8, grid, SHARDED, MAX_NORM, timeout_seconds=300)
    per_rank = [found["layouts"] for found in launched]
    check_sharded_over_tensor_parallel([found["sharded"] for found in launched])
    check_exact(grid, per_rank)
    check_counts(grid, per_rank)
    # parameter memory: a replica's ranks together hold the model once, plus (t-1) copies of what TP replicates
    replica = sum(per_rank[rank][1]["parameter_bytes"] for rank in range(4))
    assert replica == 4 * gpt_replica_elements()


def check_sharded_over_tensor_parallel(per_rank):
    """PP2 × TP2 × FSDP2 (FSDP over the tensor-parallel shards, a 2-D placement): the loss, torch's clipped norm
    and the clipped gradients of the single device on every rank, GPipe, 1F1B and ZB-H1; the 8 ranks together
    hold what one unsharded replica's 4 do (FSDP halves every rank's tensor-parallel share)."""
    for c, (kind, schedule, m, reshard) in enumerate(SHARDED):
        model = make_model(kind)
        x, y = pl.models.sample_batch(model, BATCH, seed=2)
        loss = pl.models.default_loss(model)(model(x), y)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        where = f"{kind} {schedule} m={m} reshard_after_forward={reshard}"
        holders = {}
        for rank, found in enumerate(per_rank):
            case = found[c]
            assert case["loss"] == pytest.approx(loss.item(), rel=1e-5), f"{where} rank {rank} loss"
            assert case["norm"] == pytest.approx(norm, rel=1e-5), f"{where} rank {rank}: the clipped norm"
            for name, grad in case["grads"].items():
                holders.setdefault(name, []).append(rank)
                torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad, **TOLERANCE,
                                           msg=lambda e: f"{where} rank {rank} {name}: {e}")
        assert set(holders) == {n for n, _ in model.named_parameters()}, where
        assert all(len(ranks) == 4 for ranks in holders.values()), where  # dp · tp ranks of the stage
        if kind == "gpt":  # all 8 ranks hold what one unsharded replica's 4 ranks hold (test above): FSDP halves it
            assert sum(found[c]["parameter_bytes"] for found in per_rank) == 4 * gpt_replica_elements(), where


def gpt_replica_elements() -> int:
    """The elements one replica's ranks (pp · tp) hold of the GPT under TP2: the model once, plus a second copy
    of what TP replicates (all but the split projections)."""
    model = make_model("gpt")
    total = sum(p.numel() for p in model.parameters())
    sharded = sum(p.numel() for n, p in model.named_parameters()
                  if any(n.endswith(s) for s in ("qkv.weight", "qkv.bias", "proj.weight", "mlp.0.weight",
                                                 "mlp.0.bias", "mlp.2.weight")))
    return total + (2 - 1) * (total - sharded)


def test_layout_coordinates_and_errors():
    layout = Layout(dp=2, pp=2, tp=2)
    assert [layout.coordinates(r) for r in (0, 1, 2, 5, 7)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 1), (1, 1, 1)]
    assert all(layout.rank(*layout.coordinates(r)) == r for r in range(8))
    assert Layout.for_world(8, data_parallel=2, tensor_parallel=2) == layout
    assert {str(x) for x in Layout.all_for(4)} == {"dp=1 pp=4 tp=1", "dp=1 pp=2 tp=2", "dp=1 pp=1 tp=4",
                                                   "dp=2 pp=2 tp=1", "dp=2 pp=1 tp=2", "dp=4 pp=1 tp=1"}
    with pytest.raises(ValueError, match="dp · tp must divide"):
        Layout.for_world(6, tensor_parallel=4)
    with pytest.raises(ValueError, match="Layout.tp must be a positive int"):
        Layout(tp=0)


def test_clip_grad_norm_is_the_whole_models_on_every_layout():
    """`pipe.clip_grad_norm_` against `torch.nn.utils.clip_grad_norm_` on the single-device model: the same
    norm on every rank, and the same clipped gradients (tensor-parallel shards combined, replicas once)."""
    layouts = [("gpt", (1, 2, 2)), ("gpt", (2, 2, 1)), ("mlp", (1, 4, 1))]
    per_rank = pl.distributed.launch(cases.clipped, 4, layouts, 0.05, timeout_seconds=240)
    for c, (kind, _) in enumerate(layouts):
        model = make_model(kind)
        x, y = pl.models.sample_batch(model, BATCH, seed=2)
        pl.models.default_loss(model)(model(x), y).backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
        assert norm > 0.05  # the case clips
        for rank in per_rank:
            assert rank[c]["norm"] == pytest.approx(norm, rel=1e-5), (kind, layouts[c])
            for name, grad in rank[c]["grads"].items():
                torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad, rtol=1e-5, atol=1e-6)


def test_token_weights_span_the_replicas_so_padding_gives_the_model_loss():
    """dp = 2, pp = 2, padded targets: each replica's micro-batches weigh c_i / C with C counted over the whole
    batch, so every rank's loss and gradients are the single-device token-mean step's (the loss ignores -100)."""
    x, y = cases.padded_tokens()
    model = make_model("gpt")
    loss = pl.models.lm_loss(model(x), y)
    loss.backward()
    per_rank = pl.distributed.launch(cases.tokens_over_replicas, 4, (2, 2, 1), timeout_seconds=120)
    seen = set()
    for rank in per_rank:
        assert rank["loss"] == pytest.approx(loss.item(), rel=1e-5)
        for name, grad in rank["grads"].items():
            seen.add(name)
            torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad, **TOLERANCE, msg=name)
    assert seen == {name for name, _ in model.named_parameters()}
