"""Checkpoints on torch.distributed.checkpoint: saved from a 2-stage pipeline after some Adam
steps of 1F1B, they resume on 2 stages, on 4 stages and in one plain model with the losses of
uninterrupted training.

Everything distributed happens in one launch of 4 ranks (`checkpoint_cases.save_resume_and_reshard`);
the tests below read what it returned and the files it wrote.
"""

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

import pipelab as pl
from pipelab.runtime.checkpoints import checkpoint
import checkpoint_cases as cases
from checkpoint_cases import STEPS

# a pipeline of any depth repeats the uninterrupted run's arithmetic exactly (same blocks, same
# micro-batches); one device computes the whole batch at once, which rounds otherwise
ONE_DEVICE = dict(rel=1e-6, abs=1e-6)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    path, model_only = root / "step3", root / "step3-model-only"
    ranks = pl.distributed.launch(cases.save_resume_and_reshard, 4, str(path), str(model_only), timeout_seconds=180)
    return ranks, path, model_only


def expected(ranks) -> list[float]:
    uninterrupted = ranks[0]["uninterrupted"]
    assert uninterrupted == ranks[1]["uninterrupted"] and len(uninterrupted) == STEPS + 2
    return uninterrupted[STEPS:]


def test_resuming_on_the_same_two_stages_gives_the_uninterrupted_losses(run):
    ranks, _, _ = run
    assert ranks[0]["resumed p=2"] == ranks[1]["resumed p=2"]
    assert ranks[0]["resumed p=2"] == expected(ranks)  # exactly


def test_a_four_stage_pipeline_reads_the_two_stage_checkpoint(run):
    ranks, _, _ = run
    assert [r["stages"][0] for r in ranks] == [[0], [1], [2], [3]]
    assert ranks[0]["stages"][1] == [(0, 2), (2, 4), (4, 6), (6, 8)]  # not the (0, 4), (4, 8) it was saved from
    assert all(r["resumed p=4"] == ranks[0]["resumed p=4"] for r in ranks)
    assert ranks[0]["resumed p=4"] == expected(ranks)  # exactly


def test_three_uneven_stages_read_every_parameter_and_adam_state_by_name(run):
    """Re-staging from 2 stages of (0, 4), (4, 8) to 3 of (0, 1), (1, 6), (6, 8): a key mapped by position
    in an equal cut would land on the wrong block; here every parameter and Adam state is compared by name."""
    ranks, _, _ = run
    saved = {**ranks[0]["parameters"], **ranks[1]["parameters"]}
    adam = {**ranks[0]["adam"], **ranks[1]["adam"]}
    loaded = {name: tensor for rank in ranks[:3] for name, tensor in rank["p=3 parameters"].items()}
    loaded_adam = {name: state for rank in ranks[:3] for name, state in rank["p=3 adam"].items()}
    assert set(loaded) == set(saved) == set(loaded_adam) == set(adam)
    assert sorted({name.split(".")[0] for name in ranks[1]["p=3 parameters"]}, key=int) == ["1", "2", "3", "4", "5"]
    for name in saved:
        assert torch.equal(loaded[name], saved[name]), name
        for key, value in adam[name].items():
            assert torch.equal(loaded_adam[name][key], value), f"{name} {key}"
    assert all(rank["p=3 lr"] == cases.LR for rank in ranks[:3])
    assert ranks[0]["resumed p=3"] == ranks[2]["resumed p=3"] == expected(ranks)  # exactly


def test_a_plain_model_and_its_adam_read_it_in_one_process(run, one_torch_thread):
    ranks, path, _ = run
    model = cases.make_model(seed=99)
    optimizer = torch.optim.Adam(model.parameters(), lr=5.0)
    checkpoint.load_into_model(model, path, optimizer)

    saved = {**ranks[0]["parameters"], **ranks[1]["parameters"]}
    adam = {**ranks[0]["adam"], **ranks[1]["adam"]}
    assert set(saved) == {name for name, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        assert torch.equal(param, saved[name]), name
        for key, value in adam[name].items():
            assert torch.equal(optimizer.state[param][key], value), f"{name} {key}"
    assert optimizer.param_groups[0]["lr"] == cases.LR  # the saved lr, not the 5.0 it was built with

    losses = []
    for x, y in cases.batches()[STEPS:]:
        optimizer.zero_grad()
        loss = torch.nn.MSELoss()(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses == pytest.approx(expected(ranks), **ONE_DEVICE)


def test_the_files_are_plain_dcp_one_per_rank_keyed_by_names_in_the_full_model(run, tmp_path):
    _, path, _ = run
    # DCP's files, and pipelab's manifest of them (checkpoint_manifest.py); nothing left beside it
    assert sorted(p.name for p in path.iterdir()) == [".metadata", ".pipelab-manifest.json", "__0_0.distcp",
                                                      "__1_0.distcp"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["step3", "step3-model-only"]
    dcp_to_torch_save(path, tmp_path / "whole.pt")  # torch's own converter reads it, without pipelab
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    model = cases.make_model()
    assert set(whole["model"]) == set(model.state_dict())
    # the optimizer part is torch's flattened optimizer state dict, keyed by parameter name
    optimizer = torch.optim.Adam(model.parameters(), lr=5.0)
    checkpoint.load_into_model(model, path, optimizer)
    flat = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    assert set(whole["optim"]) == set(flat)
    assert whole["optim"]["param_groups.3.0.weight.lr"] == cases.LR
    assert torch.equal(whole["optim"]["state.7.weight.exp_avg"], flat["state.7.weight.exp_avg"])


def test_a_checkpoint_that_does_not_fit_is_refused_in_plain_words(run, tmp_path):
    ranks, path, model_only = run
    messages = [r["wrong model"] for r in ranks]  # a depth-9 model, on 4 ranks: every rank refuses it
    for rank, message in enumerate(messages):
        held = 4 if rank == 3 else 0  # blocks 7 and 8 (4 tensors the checkpoint lacks) are on the last stage
        assert f"has no '7.0.weight' (4 of the model's 18 tensors are missing, {held} of them held by this " \
               "process)" in message, message

    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        checkpoint.load_into_model(cases.make_model(), tmp_path / "nothing here")
    with pytest.raises(pl.PipelineError, match="not a pipelab checkpoint"):
        checkpoint.load_into_model(cases.make_model(), tmp_path)  # a directory without .metadata
    with pytest.raises(pl.PipelineError, match=r"'0\.0\.weight' has shape \(8, 8\) in the model but shape \(16, 16\)"):
        checkpoint.load_into_model(cases.make_model(width=8), path)
    with pytest.raises(pl.PipelineError, match="holds no optimizer state"):
        model = cases.make_model()
        checkpoint.load_into_model(model, model_only, torch.optim.Adam(model.parameters()))
    model = cases.make_model(seed=99)
    checkpoint.load_into_model(model, model_only)  # without the optimizer it loads
    assert torch.equal(model[0][0].weight, ranks[0]["parameters"]["0.0.weight"])

    freed = cases.make_model()
    freed[4:].to("meta")  # a pipeline rank's copy
    with pytest.raises(pl.PipelineError, match="meta device"):
        checkpoint.load_into_model(freed, path)
    with pytest.raises(TypeError, match="takes a DistributedPipeline"):
        checkpoint.save(cases.make_model(), tmp_path / "x")
