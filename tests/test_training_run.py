"""A whole training run over real data (`pl.train`): a shuffled loader whose batches change rows and length at every
step (dynamic padding, a partial last batch), AdamW with clipping, a tied causal LM split by names; every step's
loss and the parameters at the end equal the same loop on one device, locally (1F1B, ZB-H1) and on 2 gloo ranks.
A run killed mid-epoch resumes with the uninterrupted run's losses; ranks given another cut, other weights or
another batch are refused, the field named."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import pipelab as pl
import training_run_cases as cases
from your_model_cases import make_model

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def assert_run_equal(found: tuple, reference: tuple, where: str) -> None:
    (losses, parameters), (ref_losses, ref_parameters) = found, reference
    assert len(losses) == len(ref_losses) == 8, where  # two epochs of 6, 6, 6, 3 rows
    assert losses == pytest.approx(ref_losses, rel=1e-5), where
    for name, value in parameters.items():
        torch.testing.assert_close(value, ref_parameters[name], rtol=1e-4, atol=1e-4, msg=lambda e: f"{where} {name}: {e}")


@pytest.mark.parametrize("kind, schedule", [("gpt2", "1f1b"), ("llama", "zb-h1")])
def test_two_epochs_of_changing_shapes_with_clipping_equal_one_device(kind, schedule):
    model = make_model(kind)
    reference = cases.single_device_run(model, epochs=2, clip=0.5)
    pipe = pl.Pipeline(model, n_stages=3, n_microbatches=3, schedule=schedule, split_points=cases.SPLITS[kind],
                       sample=cases.pad(cases.sequences()[:6]), devices="cpu")
    assert pipe.driver.count_tokens is not None  # the default "auto": the model's own loss weighs by tokens
    assert_run_equal(cases.pipelined_run(pipe, model, epochs=2, clip=0.5), reference, f"{kind} {schedule}")


@pytest.mark.slow
def test_two_epochs_on_two_ranks_equal_one_device_and_keep_the_tied_copies_equal():
    per_rank = pl.distributed.launch(cases.train_on_ranks, 2, "gpt2", "1f1b", timeout_seconds=300)
    reference = cases.single_device_run(make_model("gpt2"), epochs=2, clip=0.5)
    for rank, found in enumerate(per_rank):
        assert_run_equal((found["losses"], found["parameters"]), reference, f"rank {rank}")
    tied = "transformer.wte.weight"  # the input embedding and the LM head: on both ranks
    torch.testing.assert_close(per_rank[0]["parameters"][tied], per_rank[1]["parameters"][tied], rtol=0, atol=0)


@pytest.mark.parametrize("what, field", [("cut", "the cut"), ("weights", "the parameters' values at start"),
                                         ("batch", "the step's batch")])
def test_ranks_that_disagree_are_refused_naming_the_field(what, field):
    with pytest.raises(pl.DistributedError) as caught:
        pl.distributed.launch(cases.disagreeing, 2, what, timeout_seconds=120)
    assert f"ranks 0 and 1 disagree on {field}" in str(caught.value), str(caught.value)


def test_evaluate_is_the_whole_batchs_loss_forward_only():
    model = make_model("gpt2")
    batch = cases.pad(cases.sequences()[:5])  # 5 rows in 3 micro-batches, padded unevenly
    pipe = pl.Pipeline(model, n_stages=3, n_microbatches=3, split_points=cases.SPLITS["gpt2"], sample=batch)
    with torch.no_grad():
        expected = model(**batch).loss.item()
    assert pipe.evaluate(batch) == pytest.approx(expected, rel=1e-6)
    assert all(p.grad is None for p in model.parameters())


def test_samples_meeting_ignored_labels_warn_once_and_auto_picks_by_the_loss():
    model = make_model("gpt2")
    batch = cases.pad(cases.sequences()[:6])
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=3, split_points=["transformer.h.2"], sample=batch,
                       loss_normalization="samples")
    with pytest.warns(UserWarning, match='loss_normalization="samples" weighs each micro-batch by its samples'):
        pipe.step(batch)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.step(batch)  # once
    from pipelab.model.token_weights import resolved
    assert resolved(None, "auto") == "tokens" and resolved(nn.CrossEntropyLoss(), "auto") == "tokens"
    assert resolved(nn.MSELoss(), "auto") == "samples"


RESUMABLE = textwrap.dedent("""
    import sys, time, torch, pipelab as pl
    from torch.utils.data import DataLoader, TensorDataset
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(45, 16, generator=g), torch.randn(45, 16, generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)          # 6 batches, the last of 5
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.2))
                                  for _ in range(4)])
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=3, loss_fn=torch.nn.MSELoss(), devices="cpu")
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 4, 0.5)
    slow = sys.argv[2] == "slow"

    class Slow:  # a loader whose batches come slowly: the test kills the run between two of them
        def __len__(self): return len(loader)
        def __iter__(self):
            for batch in loader:
                time.sleep(0.3 if slow else 0)
                yield batch

    run = pl.train(pipe, Slow(), optimizer, epochs=3, clip=1.0, scheduler=scheduler, checkpoint_dir=sys.argv[1],
                   checkpoint_every=1, progress=False)
    print(" ".join(repr(v) for v in run.losses))
""")


def test_a_killed_run_resumes_mid_epoch_with_the_uninterrupted_runs_losses(tmp_path):
    """SIGKILL in the middle of the second epoch (dropout on, a shuffled loader, a scheduler): started again on
    the same folder, the run goes on from its newest checkpoint and its losses are the uninterrupted run's."""
    script = tmp_path / "run.py"
    script.write_text(RESUMABLE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def run(folder: Path, speed: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), str(folder), speed], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    uninterrupted = run(tmp_path / "whole", "fast").communicate(timeout=240)[0].split()
    killed = run(tmp_path / "killed", "slow")
    deadline = time.monotonic() + 180
    while not any(p.name >= "step-000008" for p in (tmp_path / "killed").glob("step-*")):  # into epoch 2
        assert killed.poll() is None and time.monotonic() < deadline, killed.communicate()
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    done = {p.name for p in (tmp_path / "killed").glob("step-*") if ".tmp" not in p.name}
    assert done and max(done) < "step-000018"  # 18 steps in all: killed before the end
    resumed = run(tmp_path / "killed", "fast").communicate(timeout=240)[0].split()
    assert len(uninterrupted) == 18 and resumed == uninterrupted
