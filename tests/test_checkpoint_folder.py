"""A folder of numbered checkpoints (`runtime/checkpoints/folder.py`), resumed in one process: a damaged newest
checkpoint is set aside, named, and the one before it read; a folder with nothing intact, or with checkpoints of
another model, is an error naming the folder and what to do (issue 35, item 4)."""

import os

import pytest
import torch

import pipelab as pl
from pipelab.runtime.checkpoints.folder import CheckpointFolder


def pipeline(width: int = 8, seed: int = 0):
    model = pl.models.mlp(depth=2, width=width, seed=seed)
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=2, loss_fn=torch.nn.MSELoss(), devices="cpu",
                       warm_up=False)
    return model, pipe, torch.optim.SGD(pipe.parameters(), lr=0.1)


def saved_folder(path):
    """Checkpoints after 1 and 2 steps of SGD; the parameters each holds."""
    model, pipe, optimizer = pipeline()
    folder, held = CheckpointFolder(path), {}
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    for steps in (1, 2):
        optimizer.zero_grad()
        pipe.step(x, y)
        optimizer.step()
        folder.save(pipe, optimizer, steps)
        held[steps] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return folder, held


def truncate_a_shard(checkpoint):
    shard = next(checkpoint.glob("*.distcp"))
    os.truncate(shard, shard.stat().st_size // 2)


def test_a_damaged_newest_checkpoint_is_set_aside_named_and_the_one_before_read(tmp_path):
    folder, held = saved_folder(tmp_path)
    truncate_a_shard(tmp_path / "step-000002")
    model, pipe, optimizer = pipeline(seed=5)
    with pytest.warns(UserWarning, match=r"the newest checkpoint does not load \(the checkpoint at .*step-000002 is "
                                         r"damaged: .*\); set aside as step-000002\.damaged-\w+, reading the one "
                                         "before it"):
        assert folder.resume(pipe, optimizer) == 1
    for name, param in model.named_parameters():
        assert torch.equal(param, held[1][name]), name
    assert [steps for steps, _ in folder.checkpoints()] == [1] and len(folder.damaged()) == 1


def test_a_folder_with_nothing_intact_is_an_error_naming_the_folder_and_the_fix(tmp_path):
    folder, _ = saved_folder(tmp_path)
    for checkpoint in ("step-000001", "step-000002"):
        truncate_a_shard(tmp_path / checkpoint)
    _, pipe, optimizer = pipeline()
    with pytest.warns(UserWarning, match="set aside"):
        with pytest.raises(pl.CheckpointError) as caught:
            folder.resume(pipe, optimizer)  # not 0: that would start the run afresh, silently
    message = str(caught.value)
    assert message.startswith(f"no checkpoint in {tmp_path} is intact: step-000001.damaged-")
    assert "move an intact checkpoint there as step-NNNNNN" in message and "to start the run afresh" in message
    with pytest.raises(pl.CheckpointError, match=f"no checkpoint in {tmp_path} is intact"):  # and at every restart
        folder.resume(pipe, optimizer)


def test_checkpoints_of_another_width_are_refused_naming_the_parameter_folder_and_fix_and_kept(tmp_path):
    folder, _ = saved_folder(tmp_path)
    _, pipe, optimizer = pipeline(width=12)
    with pytest.raises(pl.CheckpointError) as caught:
        folder.resume(pipe, optimizer)
    message = str(caught.value)
    assert message.startswith(f"cannot resume from the checkpoints in {tmp_path}: '0.0.weight' has shape (12, 12) "
                              "in the model but shape (8, 8) in the checkpoint at ")
    assert "resume with the model and optimizer it was saved from, or give another folder" in message
    assert [steps for steps, _ in folder.checkpoints()] == [1, 2] and folder.damaged() == []  # not damage
