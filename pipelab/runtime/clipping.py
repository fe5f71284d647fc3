"""Clip gradients by their global norm, as `torch.nn.utils.clip_grad_norm_` on the whole model would.

The norm is over every parameter of the model once: ||g|| = (Σ_p Σ |g_p|^q)^(1/q) (q = 2 by
default; max |g| for q = inf).  A pipeline holds the parameters on several stages and ranks, so
each rank adds up its own part and the parts are summed over the pipeline's ranks; under tensor
parallelism a sharded gradient's part is summed over the "tp" ranks too, while a replicated one
(a LayerNorm's weight, held whole by every tp rank) counts on tp rank 0 only; data-parallel
replicas hold the same gradients after their all-reduce, so they are counted once (under shard="fsdp"
each holds its shard, as FSDP2's own clipping sums them over "dp"; a gradient's DTensor placements
say, per mesh dimension, whether it is sharded or held alike), and so is a
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


def _sharded_over(grad: torch.Tensor) -> set[str]:
    """The mesh dimensions ("tp", "dp") whose ranks hold different pieces of `grad` (a DTensor's Shard
    placements; FSDP over a tensor-parallel block shards on both); none for a plain tensor."""
    if not isinstance(grad, DTensor):
        return set()
    names = grad.device_mesh.mesh_dim_names or ()
    # not replicated: Shard, or FSDP's _StridedShard over a tensor-parallel shard (whose is_shard() is False)
    return {name for name, placement in zip(names, grad.placements) if not placement.is_replicate()}


def local_part(parameters: list[torch.Tensor], norm_type: float, coordinates: dict[str, int]) -> float:
    """This rank's contribution, a sum of |g|^q (or a max): each gradient counted on this rank when, along
    every dimension of `coordinates` (this rank's index on "tp", and on "dp" under shard="fsdp"), it is
    sharded or this rank is the first (index 0) of those that hold it alike."""
    parts = [_part(p.grad, norm_type) for p in parameters if p.grad is not None
             and all(index == 0 for dim, index in coordinates.items() if dim not in _sharded_over(p.grad))]
    return max(parts, default=0.0) if math.isinf(norm_type) else sum(parts)


def reduce_norm(part: float, norm_type: float, groups: list, device: torch.device) -> float:
    """The global norm from every rank's part, reduced over `groups` (the pipeline's, and "tp" and "dp" where
    their ranks hold different pieces; None: left out): a sum, or a max for q = inf."""
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    total = torch.tensor([part], dtype=torch.float64, device=device)
    for group in groups:
        if group is not None:
            dist.all_reduce(total, op=op, group=group)
    return float(total.item()) if math.isinf(norm_type) else float(total.item()) ** (1.0 / norm_type)


def scale(parameters: list[torch.Tensor], max_norm: float, norm: float) -> None:
    """Scale every gradient by torch's factor when it is below 1."""
    coefficient = clip_coefficient(max_norm, norm)
    if coefficient < 1.0:
        with torch.no_grad():
            for p in parameters:
                if p.grad is not None:
                    p.grad.mul_(coefficient)
