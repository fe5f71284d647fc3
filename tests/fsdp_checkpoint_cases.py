"""What the ranks run in tests/test_pp_fsdp_checkpoint.py (one function given to pl.distributed.launch).

One launch of 4 ranks does it all, in a chain whose every link starts from a checkpoint:

    A  PP2 × FSDP2 (seed 1): 2 AdamW steps, saved as "sharded", then its 3rd step (uninterrupted)
    B  PP2 × FSDP2 (seed 99, lr 5.0): loads "sharded", its 3rd step
    C  plain PP4 (seed 99, lr 5.0): loads "sharded", its 3rd step, saved as "plain"
    D  PP2 × FSDP2 (seed 99, lr 5.0): loads "plain", its 4th step; then an optimizer built over the model's
       parameters before the pipeline sharded them is refused, and so is loading the state of an optimizer
       not shaped like its parameters (`RowNorms`)
    E  PP2 × DP2 replicated (seed 99, lr 5.0): loads "sharded", its 3rd step, saved as "replicated" (both
       replicas hold every tensor of their stage: it is written once)

Each rank returns its stage's parameters and AdamW state gathered whole (`DTensor.full_tensor()`);
the test compares them with the checkpoint read into one plain model and with plain torch.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

import pipelab as pl
from pipelab.predict.layout import Layout

BATCH = 19  # prime: the replicas' shares and the micro-batches are uneven
LAYOUT = Layout(dp=2, pp=2)
WIDTH = 127  # odd: each parameter's rows split unevenly over the two replicas (64 and 63); wide enough that
# the bytes of the tensors outweigh what DCP adds to each item in a file
SAVED_AFTER = 2  # AdamW steps before the sharded checkpoint
MICROBATCHES = 2
LR = 1e-2


def make_model(seed: int = 1):
    return pl.models.mlp(depth=8, width=WIDTH, seed=seed)


def adamw(parameters, lr: float = LR):
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=0.1)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A new batch for each step (so that a step's loss depends on the optimizer's state, not only on the weights)."""
    return [pl.models.sample_batch(make_model(), BATCH, seed=10 + step) for step in range(SAVED_AFTER + 2)]


class RowNorms(torch.optim.Optimizer):
    """A toy optimizer whose state is not shaped like its parameter: a matrix's row norms (it changes nothing)."""

    def __init__(self, parameters):
        super().__init__(parameters, {"lr": LR})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["row_norms"] = p.norm(dim=-1) if p.dim() > 1 else p.abs()


def pipeline(model, **layout):
    return pl.DistributedPipeline(model, n_microbatches=MICROBATCHES, schedule="1f1b", loss_fn=torch.nn.MSELoss(),
                                  **layout)


def sharded(model):
    return pipeline(model, layout=LAYOUT, shard="fsdp")


def step(pipe, optimizer, batch) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = pipe.step(*batch).loss
    optimizer.step()
    return loss


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered from its shards (a collective over its mesh), or a plain tensor copied."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def gathered(model, optimizer) -> dict:
    """This rank's parameters and AdamW state, whole, by name in the model."""
    held = [(name, p) for name, p in model.named_parameters() if p.device.type != "meta"]
    return {"parameters": {name: whole(p) for name, p in held},
            "optimizer": {name: {key: whole(value) for key, value in optimizer.state[p].items()} for name, p in held}}


def parameters(model) -> dict:
    return {name: whole(p) for name, p in model.named_parameters() if p.device.type != "meta"}


def save_and_load(root: str) -> dict:
    """On 4 ranks: links A to D of the module docstring; what this rank saw."""
    root, data, found = Path(root), batches(), {}

    model = make_model()  # A
    pipe = sharded(model)
    optimizer = adamw(pipe.parameters())
    for batch in data[:SAVED_AFTER]:
        step(pipe, optimizer, batch)
    pipe.save_checkpoint(root / "sharded", optimizer)
    found["coordinates"] = (pipe.dp_index, pipe.pp_index)
    found["saved"] = gathered(model, optimizer)
    found["uninterrupted"] = step(pipe, optimizer, data[SAVED_AFTER])
    found["uninterrupted after"] = parameters(model)

    model = make_model(seed=99)  # B
    pipe = sharded(model)
    optimizer = adamw(pipe.parameters(), lr=5.0)
    pipe.load_checkpoint(root / "sharded", optimizer)
    found["resumed loaded"] = gathered(model, optimizer)
    found["resumed lr"] = optimizer.param_groups[0]["lr"]
    found["resumed"] = step(pipe, optimizer, data[SAVED_AFTER])
    found["resumed after"] = parameters(model)

    model = make_model(seed=99)  # C
    pipe = pipeline(model)
    optimizer = adamw(pipe.parameters(), lr=5.0)
    pipe.load_checkpoint(root / "sharded", optimizer)
    found["p=4 loaded"] = gathered(model, optimizer)
    found["p=4"] = step(pipe, optimizer, data[SAVED_AFTER])
    found["p=4 saved"] = gathered(model, optimizer)
    pipe.save_checkpoint(root / "plain", optimizer)

    model = make_model(seed=99)  # D
    stale = adamw(model.parameters())  # built before the pipeline replaced the parameters with DTensors
    pipe = sharded(model)
    optimizer = adamw(pipe.parameters(), lr=5.0)
    pipe.load_checkpoint(root / "plain", optimizer)
    found["from plain loaded"] = gathered(model, optimizer)
    found["from plain"] = step(pipe, optimizer, data[SAVED_AFTER + 1])
    found["from plain after"] = parameters(model)
    try:
        pipe.save_checkpoint(root / "stale", stale)
    except pl.CheckpointError as error:
        found["stale optimizer"] = str(error)
    norms = RowNorms(pipe.parameters())
    norms.step()
    pipe.save_checkpoint(root / "row-norms", norms)  # (DCP writes any DTensor)
    try:
        pipe.load_checkpoint(root / "row-norms", RowNorms(pipe.parameters()))
    except pl.CheckpointError as error:
        found["row norms"] = str(error)

    model = make_model(seed=99)  # E
    pipe = pipeline(model, layout=LAYOUT)
    optimizer = adamw(pipe.parameters(), lr=5.0)
    pipe.load_checkpoint(root / "sharded", optimizer)
    found["replicated loaded"] = gathered(model, optimizer)
    found["replicated"] = step(pipe, optimizer, data[SAVED_AFTER])
    pipe.save_checkpoint(root / "replicated", optimizer)
    found["replicated saved"] = gathered(model, optimizer)
    return found
