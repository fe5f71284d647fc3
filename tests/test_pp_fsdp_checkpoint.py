"""Checkpoints of a PP2 × FSDP2 pipeline (gloo, 4 ranks): each rank writes its shards of the parameters and
of AdamW's moments with DCP, under the full model's names, and any layout reads them back.

One launch (`fsdp_checkpoint_cases.save_and_load`, links A to E of its docstring) saves a sharded
checkpoint after 2 AdamW steps and reads it into a fresh sharded pipeline, into a plain 4-stage
pipeline and into a replicated PP2 × DP2 one, and the 4-stage pipeline's own checkpoint back into a
sharded one; two optimizers are refused with words that say what to do.  The tests below
compare what the ranks gathered (`DTensor.full_tensor()`) with the checkpoint read into one plain
model (`load_into_model`), with one another (exactly: the same arithmetic), and with plain torch
on one device (the whole batch at once, no pipelab: within rounding).
"""

from collections import defaultdict

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import pipelab as pl
from pipelab.runtime.checkpoints import checkpoint

import fsdp_checkpoint_cases as cases
from fsdp_checkpoint_cases import LAYOUT, SAVED_AFTER

TOLERANCE = dict(rtol=1e-5, atol=1e-6)
# AdamW's step is lr·m/(√v + eps): where a gradient is near zero, its rounding (one device sums the batch in
# another order) moves the step by up to lr·1e-4; a wrong shard or state would be off by about lr = 1e-2
AFTER_ADAMW = dict(rtol=1e-5, atol=1e-3 * cases.LR)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp-checkpoints")
    ranks = pl.distributed.launch(cases.save_and_load, LAYOUT.world_size, str(root), timeout_seconds=120)
    assert [r["coordinates"] for r in ranks] == [LAYOUT.coordinates(rank)[:2] for rank in range(LAYOUT.world_size)]
    return ranks, root


@pytest.fixture(scope="module")
def reference():
    """Plain torch on one device, from the same weights and batches: the state after SAVED_AFTER AdamW steps,
    then each later step's loss and the parameters after it."""
    model = cases.make_model()
    optimizer = cases.adamw(model.parameters())
    found = {"losses": [], "after": []}
    for k, (x, y) in enumerate(cases.batches()):
        if k == SAVED_AFTER:
            found["saved"] = state(model, optimizer)
        optimizer.zero_grad()
        loss = torch.nn.MSELoss()(model(x), y)
        loss.backward()
        optimizer.step()
        found["losses"].append(loss.item())
        found["after"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    return found


def state(model, optimizer) -> dict:
    return {"parameters": {n: p.detach().clone() for n, p in model.named_parameters()},
            "optimizer": {n: {k: v.clone() for k, v in optimizer.state[p].items()} for n, p in model.named_parameters()}}


def merged(ranks, key: str) -> dict:
    """The whole model's gathered state from every rank's part; both replicas of a stage must hold the same."""
    whole = {"parameters": {}, "optimizer": {}}
    for rank, found in enumerate(ranks):
        for part in whole:
            for name, value in found[key][part].items():
                if name in whole[part]:
                    assert_equal(value, whole[part][name], f"{key}: rank {rank}'s {name} differs from its other replica's")
                whole[part][name] = value
    assert set(whole["parameters"]) == {n for n, _ in cases.make_model().named_parameters()}, key
    return whole


def assert_equal(found, expected, where: str):
    """Equal exactly: tensors, or {key: tensor} of the optimizer state."""
    if isinstance(expected, dict):
        assert set(found) == set(expected), where
        for key in expected:
            assert torch.equal(found[key], expected[key]), f"{where} {key}"
    else:
        assert torch.equal(found, expected), where


def assert_state_equal(found: dict, expected: dict, where: str):
    for part in ("parameters", "optimizer"):
        assert set(found[part]) == set(expected[part]), f"{where} {part}"
        for name in expected[part]:
            assert_equal(found[part][name], expected[part][name], f"{where}: {name}")


def assert_close_to(found: dict, expected: dict, where: str, tolerance: dict = AFTER_ADAMW):
    assert set(found) == set(expected), where
    for name in expected:
        torch.testing.assert_close(found[name], expected[name], **tolerance, msg=lambda e: f"{where} {name}: {e}")


def parameters_after(ranks, key: str) -> dict:
    return {name: value for found in ranks for name, value in found[key].items()}


def test_a_sharded_checkpoint_loads_into_the_unmodified_model_as_the_gathered_state(run, reference):
    ranks, root = run
    saved = merged(ranks, "saved")
    model = cases.make_model(seed=99)
    optimizer = cases.adamw(model.parameters(), lr=5.0)
    checkpoint.load_into_model(model, root / "sharded", optimizer)
    assert_state_equal(state(model, optimizer), saved, "read into one model")
    assert optimizer.param_groups[0]["lr"] == cases.LR  # the saved lr, not the 5.0 it was built with
    assert_close_to(saved["parameters"], reference["saved"]["parameters"], "saved vs one device")
    for name, moments in saved["optimizer"].items():
        assert_close_to(moments, reference["saved"]["optimizer"][name], f"saved AdamW state of {name} vs one device",
                        TOLERANCE)


def test_a_fresh_sharded_pipeline_resumes_with_the_uninterrupted_step(run, reference):
    ranks, _ = run
    assert_state_equal(merged(ranks, "resumed loaded"), merged(ranks, "saved"), "loaded by a fresh PP2 × FSDP2")
    assert all(found["resumed lr"] == cases.LR for found in ranks)
    for rank, found in enumerate(ranks):  # the same layout: the same arithmetic, exactly
        assert found["resumed"] == found["uninterrupted"], f"rank {rank}"
    resumed = parameters_after(ranks, "resumed after")
    assert_state_equal({"parameters": resumed, "optimizer": {}},
                       {"parameters": parameters_after(ranks, "uninterrupted after"), "optimizer": {}}, "after AdamW")
    assert ranks[0]["resumed"] == pytest.approx(reference["losses"][SAVED_AFTER], rel=1e-6)
    assert_close_to(resumed, reference["after"][SAVED_AFTER], "resumed vs one device, after AdamW")


def test_a_plain_four_stage_pipeline_reads_the_sharded_checkpoint(run, reference):
    ranks, _ = run
    loaded = {part: {n: v for found in ranks for n, v in found["p=4 loaded"][part].items()}
              for part in ("parameters", "optimizer")}
    assert_state_equal(loaded, merged(ranks, "saved"), "loaded by plain PP4")
    assert all(found["p=4"] == ranks[0]["p=4"] for found in ranks)
    assert ranks[0]["p=4"] == pytest.approx(reference["losses"][SAVED_AFTER], rel=1e-6)
    after = {n: v for found in ranks for n, v in found["p=4 saved"]["parameters"].items()}
    assert_close_to(after, reference["after"][SAVED_AFTER], "PP4 vs one device, after AdamW")


def test_a_sharded_pipeline_reads_a_plain_pipelines_checkpoint(run, reference):
    ranks, _ = run
    plain = {part: {n: v for found in ranks for n, v in found["p=4 saved"][part].items()}
             for part in ("parameters", "optimizer")}
    assert_state_equal(merged(ranks, "from plain loaded"), plain, "PP4's checkpoint loaded by PP2 × FSDP2")
    assert all(found["from plain"] == ranks[0]["from plain"] for found in ranks)
    assert ranks[0]["from plain"] == pytest.approx(reference["losses"][SAVED_AFTER + 1], rel=1e-6)
    assert_close_to(parameters_after(ranks, "from plain after"), reference["after"][SAVED_AFTER + 1],
                    "PP2 × FSDP2 from PP4's checkpoint vs one device, after AdamW")


def test_each_rank_writes_its_replicas_rows_under_the_full_models_names(run):
    """The sharded checkpoint's keys are the plain one's; each model and AdamW-moment tensor is in the files of its
    stage's two replicas, rows 0-63 in one and 64-126 in the other; so each file holds about 1/d of its stage."""
    _, root = run
    sharded, plain = (FileSystemReader(root / name).read_metadata() for name in ("sharded", "plain"))
    assert set(sharded.state_dict_metadata) == set(plain.state_dict_metadata)

    rows = {0: (0, 64), 1: (64, 63)}  # replica -> (first row, rows): torch.chunk's split of 127
    stage_of = {name: stage for stage, (a, b) in enumerate(pl.split(cases.make_model(), 2).bounds)
                for name, _ in cases.make_model()[a:b].named_parameters(prefix="")}
    elements, data_bytes, items = defaultdict(int), defaultdict(int), defaultdict(int)
    for index, where in sharded.storage_data.items():
        name, key = tensor_of(index.fqn)
        if name is None:
            continue  # hyper-parameters and AdamW's step: numbers, written once (by one replica)
        rank = int(where.relative_path.split("_")[2])
        replica, stage = LAYOUT.coordinates(rank)[:2]
        assert stage == stage_of[name], f"{index.fqn} is in {where.relative_path}, of another stage"
        chunk = next(c for c in sharded.state_dict_metadata[index.fqn].chunks if c.offsets == index.offset)
        assert (chunk.offsets[0], chunk.sizes[0]) == rows[replica], f"{index.fqn} in {where.relative_path}"
        elements[where.relative_path] += chunk.sizes.numel()
        data_bytes[where.relative_path] += where.length
        items[where.relative_path] += 1
    for rank in range(LAYOUT.world_size):
        file = f"__{rank}_0.distcp"
        replica, stage = LAYOUT.coordinates(rank)[:2]
        stage_elements = sum(p.numel() for n, p in cases.make_model().named_parameters() if stage_of[n] == stage)
        share = 3 * stage_elements * rows[replica][1] // cases.WIDTH  # parameters, exp_avg, exp_avg_sq
        assert elements[file] == share, file
        # the bytes: its shards' float32 data plus what DCP adds to each item (torch.save's header, under 2 KiB);
        # the file, with the numbers one replica writes, is well under the stage's whole state
        assert 4 * share <= data_bytes[file] <= 4 * share + 2048 * items[file], file
        assert (root / "sharded" / file).stat().st_size < 4 * 3 * stage_elements, file


def tensor_of(key: str) -> tuple[str | None, str | None]:
    """"model.3.0.weight" -> ("3.0.weight", "model"); "optim.state.3.0.weight.exp_avg" -> ("3.0.weight",
    "exp_avg"); (None, None) for the numbers (hyper-parameters, step)."""
    if key.startswith("model."):
        return key[len("model."):], "model"
    if key.startswith("optim.state.") and key.rpartition(".")[2] in ("exp_avg", "exp_avg_sq"):
        name, _, moment = key[len("optim.state."):].rpartition(".")
        return name, moment
    return None, None


def test_an_optimizer_built_before_the_pipeline_sharded_the_model_is_refused(run):
    ranks, root = run
    for found in ranks:  # every rank, alike, before anything is written
        message = found["stale optimizer"]
        assert "the optimizer holds a parameter of shape (127, 127) that is not in the model" in message, message
        assert "build the optimizer after the pipeline, from pipe.parameters()" in message, message
    assert not any(path.name.startswith("stale") for path in root.iterdir())


def test_a_replicated_pipeline_reads_it_and_writes_its_own_once(run, reference):
    """PP2 × DP2 without sharding: every rank reads its stage whole; its checkpoint, written by all four ranks
    over the mesh, holds each tensor once and reads back into one model."""
    ranks, root = run
    assert_state_equal(merged(ranks, "replicated loaded"), merged(ranks, "saved"), "loaded by PP2 × DP2")
    assert all(found["replicated"] == ranks[0]["replicated"] for found in ranks)
    assert ranks[0]["replicated"] == pytest.approx(reference["losses"][SAVED_AFTER], rel=1e-6)
    saved = merged(ranks, "replicated saved")
    assert_close_to(saved["parameters"], reference["after"][SAVED_AFTER], "PP2 × DP2 vs one device, after AdamW")

    metadata = FileSystemReader(root / "replicated").read_metadata()
    assert all(len(entry.chunks) == 1 for entry in metadata.state_dict_metadata.values()
               if hasattr(entry, "chunks")), "a replicated tensor written twice"
    model = cases.make_model(seed=99)
    optimizer = cases.adamw(model.parameters(), lr=5.0)
    checkpoint.load_into_model(model, root / "replicated", optimizer)
    assert_state_equal(state(model, optimizer), saved, "PP2 × DP2's checkpoint read into one model")


def test_an_optimizer_state_not_shaped_like_its_sharded_parameter_is_refused(run):
    ranks, _ = run
    for found in ranks:  # each rank names the first weight of its stage
        message, first = found["row norms"], {0: "0.0.weight", 1: "4.0.weight"}[found["coordinates"][1]]
        assert f"the optimizer state 'row_norms' of {first}" in message, message
        assert "has shape (127,), neither its sharded parameter's (127, 127) nor a number's" in message, message
        assert "use an optimizer whose state has its parameters' shapes" in message, message
