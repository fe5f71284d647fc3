"""Clip gradients by their global norm, as `torch.nn.utils.clip_grad_norm_` on the whole model would.

The norm is over every parameter of the model once: ||g|| = (Σ_p Σ |g_p|^q)^(1/q) (q = 2 by
default; max |g| for q = inf).  A pipeline holds the parameters on several stages and ranks, so
each rank adds up its own part and the parts are summed over the pipeline's ranks; under tensor
parallelism a sharded gradient's part is summed over the "tp" ranks too, while a replicated one
(a LayerNorm's weight, held whole by every tp rank) counts on tp rank 0 only; data-parallel
replicas hold the same gradients after their all-reduce, so they are counted once (under shard="fsdp"
each holds its shard, as FSDP2's own clipping sums them over "dp"), and so is a
parameter several pipeline ranks hold (a tied embedding, whole on each after its all-reduce: counted on
the lowest of them, `SharedParameters.counted_here`).  Then every
gradient is scaled by min(1, max_norm / (norm + 1e-6)), torch's own rule.  Clipping stage by
stage instead (each its own norm) silently changes training (torchtitan and Megatron-LM both
reduce over the pipeline for this).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_coefficient(max_norm: float, norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: the gradients are scaled by it when it is below 1."""
    return max_norm / (norm + 1e-6)


def _part(grad: torch.Tensor, norm_type: float) -> float:
    """Σ |g|^q of this rank's values of `grad` (its shard of a DTensor), or max |g| for q = inf."""
    local = (grad.to_local() if isinstance(grad, DTensor) else grad).detach().to(torch.float64)
    if local.numel() == 0:
        return 0.0
    if math.isinf(norm_type):
        return float(local.abs().max())
    return float(local.abs().pow(norm_type).sum())


def local_part(parameters: list[torch.Tensor], norm_type: float, counts_whole: bool = True) -> tuple[float, float]:
    """This rank's contribution: (over sharded gradients, over whole ones it counts): a sum of |g|^q, or a max;
    a whole (replicated) gradient counts on one rank of those that hold it alike (`counts_whole`)."""
    sharded, whole = [], []
    for p in parameters:
        if p.grad is None:
            continue
        is_shard = isinstance(p.grad, DTensor) and any(placement.is_shard() for placement in p.grad.placements)
        if is_shard:
            sharded.append(_part(p.grad, norm_type))
        elif counts_whole:
            whole.append(_part(p.grad, norm_type))
    def combine(values: list[float]) -> float:
        return max(values, default=0.0) if math.isinf(norm_type) else sum(values)

    return combine(sharded), combine(whole)


def reduce_norm(parts: tuple[float, float], norm_type: float, groups: list, device: torch.device) -> float:
    """The global norm from every rank's (sharded, whole) parts, reduced over the groups whose ranks hold
    different shards (tensor-parallel "tp"; data-parallel "dp" under shard="fsdp": shards add up, a whole
    gradient counted on one rank of them), then over the pipeline's (`groups`: [pp, then any others or None])."""
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    pp_group, *shard_groups = groups
    both = torch.tensor(parts, dtype=torch.float64, device=device)
    for group in shard_groups:
        if group is not None:
            dist.all_reduce(both, op=op, group=group)
    dist.all_reduce(both, op=op, group=pp_group)
    if math.isinf(norm_type):
        return float(both.max())
    return float(both.sum()) ** (1.0 / norm_type)


def scale(parameters: list[torch.Tensor], max_norm: float, norm: float) -> None:
    """Scale every gradient by torch's factor when it is below 1."""
    coefficient = clip_coefficient(max_norm, norm)
    if coefficient < 1.0:
        with torch.no_grad():
            for p in parameters:
                if p.grad is not None:
                    p.grad.mul_(coefficient)
