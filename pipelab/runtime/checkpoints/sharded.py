"""Checkpoints of pipelines whose tensors are DTensors: a hybrid layout's mesh (`shard="fsdp"` over "dp").

Under `shard="fsdp"` a parameter is a DTensor sharded over the data-parallel replicas
(`Shard(0)`: replica r keeps rows r·n/d onwards), and so are the AdamW moments FSDP2's
optimizer keeps for it.  DCP writes DTensors natively: each rank writes its own shard under the
full model's key (`model.3.0.weight`, of the whole weight's shape), and reads back only the rows
its target DTensor holds, whatever layout wrote them.  Two things make that work:

- the ranks that write one checkpoint are every rank of the mesh, not one pipeline's "pp"
  group: replica 0's pipeline holds only half of each of its stages' rows (`group_of`);
- what DCP fills on loading must be laid out as the parameter is, a DTensor of the same mesh
  and placements, or each rank would read (and the optimizer keep) whole tensors (`empty_like_saved`).

A tensor the replicas hold whole (a replicated pipeline's parameters, AdamW's `step`) is written
once: DCP's planner keeps one copy of a key several ranks save alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def group_of(pipe):
    """The process group whose ranks write and read `pipe`'s checkpoint together: the pipeline's own group, or,
    under a hybrid layout (data or tensor parallelism, `shard="fsdp"`), the whole world its mesh spans (each "pp"
    group is one replica; the replicas' shards make the whole).  None for one process."""
    mesh = getattr(pipe, "mesh", None)
    if mesh is None:
        return pipe.group
    if mesh.size() != dist.get_world_size():
        raise ValueError(f"the pipeline's mesh spans {mesh.size()} of the world's {dist.get_world_size()} ranks: a "
                         "checkpoint of a hybrid layout is written by the whole world")
    return dist.group.WORLD


def empty_like_saved(size, dtype: torch.dtype, param: torch.Tensor) -> torch.Tensor | None:
    """An empty tensor for DCP to fill with a saved optimizer state of `param`, of the saved `size`: a DTensor on
    the parameter's mesh and placements where the parameter is a DTensor of that shape (AdamW's moments under
    shard="fsdp": this rank reads only its rows), a whole tensor for a plain parameter or a number (the step);
    None for a DTensor parameter's state of another shape, which pipelab cannot lay out (the caller refuses it)."""
    if not isinstance(param, DTensor):
        return torch.empty(size, dtype=dtype)
    if tuple(size) == tuple(param.shape):
        return torch.distributed.tensor.empty(tuple(size), dtype=dtype, device_mesh=param.device_mesh,
                                              placements=param.placements)
    if len(size) == 0:
        return torch.empty(size, dtype=dtype)
    return None


def is_sharded(model) -> bool:
    """Whether any of `model`'s parameters is a DTensor (shard="fsdp", or tensor parallelism)."""
    return any(isinstance(p, DTensor) for p in model.parameters())
