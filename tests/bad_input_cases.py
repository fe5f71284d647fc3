"""What the ranks run in tests/test_bad_inputs.py (functions given to pl.distributed.launch)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import pipelab as pl
from pipelab.predict.layout import Layout


def parameter_free_first_stage() -> nn.Sequential:
    """Two blocks: a ReLU (stage 0: no parameters, and its input, the batch, needs no gradient), then an MLP."""
    torch.manual_seed(3)
    return nn.Sequential(nn.ReLU(), nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)))


def batch(width: int = 16, n: int = 8, seed: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=generator), torch.randn(n, width, generator=generator)


def _error_text(make) -> str:
    try:
        make()
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def uneven_tensor_parallel_model() -> nn.Sequential:
    """A Megatron pair whose hidden width, 15, tensor_parallel=2 does not divide (ranks hold 8 and 7 features)."""
    torch.manual_seed(5)
    return nn.Sequential(nn.Sequential(nn.Linear(16, 15), nn.GELU()), nn.Linear(15, 16))


def mistakes_and_a_parameter_free_stage() -> dict:
    """On every rank: the message of a configuration the ranks disagree on (m), the loss and full gradients of a
    tensor-parallel width 2 does not divide, then the gradients of one step per schedule of a model whose stage 0
    has nothing to differentiate."""
    rank = dist.get_rank()
    found = {}
    found["other m"] = _error_text(lambda: pl.DistributedPipeline(
        pl.models.mlp(depth=4, width=16, seed=1), n_microbatches=4 if rank == 0 else 8, schedule="1f1b",
        loss_fn=nn.MSELoss()))
    uneven = pl.DistributedPipeline(uneven_tensor_parallel_model(), n_microbatches=2, schedule="gpipe",
                                    loss_fn=nn.MSELoss(), layout=Layout(1, 1, 2))
    found["tp width"] = (uneven.step(*batch()).loss, uneven.gradients(),
                         {n: p.to_local().shape for n, p in uneven.model.named_parameters()})
    x, y = batch()
    for schedule in ("1f1b", "zb-h1"):
        model = parameter_free_first_stage()
        pipe = pl.DistributedPipeline(model, n_microbatches=4, schedule=schedule, loss_fn=nn.MSELoss())
        result = pipe.step(x, y)
        found[schedule] = (result.loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return found


def nan_on_the_last_stage() -> None:
    """Block 2 (on rank 1, stage 1) makes NaN: the first step's check names where."""
    model = pl.models.mlp(depth=4, width=16, seed=1)
    with torch.no_grad():
        model[2][0].weight[3, 5] = float("nan")
    pipe = pl.DistributedPipeline(model, n_microbatches=2, schedule="1f1b", loss_fn=nn.MSELoss())
    pipe.step(*batch())
