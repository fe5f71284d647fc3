"""Pipeline × tensor × data parallelism on one `DeviceMesh` ("dp", "pp", "tp"): the pieces
`DistributedPipeline` uses when given tensor_parallel=, data_parallel=, tensor_parallel_plan= or layout=.

Every rank builds `init_device_mesh(device, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))`
(ranks laid out as `pl.Layout` says).  PP: the plain distributed engine on the rank's "pp"
sub-group.  TP: each block of the stage parallelized over "tp" with `parallelize_module` and
its plan (`model/tp_plans.py`).  The stage boundary under TP (Megatron-LM's scatter/gather,
Narayanan et al. 2021, §4.1): each rank sends its 1/t slice and the receivers all-gather it
over "tp" (`ScatterGatherTransport`), so the boundary carries b·s·h elements once per TP
group.  DP: gradients all-reduced over "dp" once per step, after the last backward, each
replica's weighted by its share n_r / N.

Details (the sub-groups, the slices, why not DDP or FSDP2): docs/hybrid.md, "The pieces of a
hybrid layout".
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from ..common.errors import PipelineError
from ..model import tp_plans
from ..model.partition import Partition
from ..predict.layout import DIMENSIONS, Layout
from . import comm_count


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (a view of its storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor behind an AsyncCollectiveTensor (DTensor's not-yet-waited all-reduce result)."""
    return tensor.wait() if isinstance(tensor, AsyncCollectiveTensor) else tensor


def resolve_layout(world_size: int, layout: Layout | None, data_parallel: int, tensor_parallel: int) -> Layout:
    if layout is None:
        return Layout.for_world(world_size, data_parallel=data_parallel, tensor_parallel=tensor_parallel)
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a pl.Layout, got {type(layout).__name__}")
    if (data_parallel, tensor_parallel) not in ((1, 1), (layout.dp, layout.tp)):
        raise ValueError(f"layout={layout} disagrees with data_parallel={data_parallel}, tensor_parallel={tensor_parallel}")
    if layout.world_size != world_size:
        raise ValueError(f"layout {layout} needs {layout.world_size} ranks, the world has {world_size}")
    return layout


class ScatterGatherTransport:
    """The point-to-point transport with Megatron's scatter/gather at each stage boundary (module docstring)."""

    def __init__(self, inner, group, tp_size: int, tp_index: int):
        self.inner, self.group, self.tp_size, self.tp_index = inner, group, tp_size, tp_index

    def send(self, action, tensor: torch.Tensor | None) -> None:
        if isinstance(tensor, torch.Tensor):
            tensor = _plain(tensor)
            if tensor.dim() == 0 or tensor.shape[-1] % self.tp_size:
                raise PipelineError(f"{action.describe()}: the tensor leaving the stage has shape {tuple(tensor.shape)}; "
                                    f"its last dimension must be divisible by tensor_parallel={self.tp_size} "
                                    "(each tensor-parallel rank sends one slice of it)")
            tensor = tensor.chunk(self.tp_size, dim=-1)[self.tp_index]
        self.inner.send(action, tensor)

    def receive(self, action) -> Any:
        piece = self.inner.receive(action)
        if not isinstance(piece, torch.Tensor):
            return piece
        piece = piece.contiguous()
        pieces = [torch.empty_like(piece) for _ in range(self.tp_size)]
        with comm_count.label("pp_gather"):
            dist.all_gather(pieces, piece, group=self.group)
        return torch.cat(pieces, dim=-1)


@dataclasses.dataclass
class HybridMesh:
    """This rank's place on the ("dp", "pp", "tp") DeviceMesh of a layout, and its sub-groups."""

    layout: Layout
    mesh: Any  # torch's DeviceMesh
    dp_index: int
    pp_index: int
    tp_index: int

    @classmethod
    def build(cls, layout: Layout, backend: str) -> "HybridMesh":
        return cls(layout, _mesh(layout.shape, "cuda" if backend == "nccl" else "cpu"),
                   *layout.coordinates(dist.get_rank()))

    def group(self, dimension: str):
        return self.mesh[dimension].get_group()

    def pipelines(self) -> list[list[int]]:
        """The global ranks of every pipeline ("pp" line) of the mesh, stage by stage, in one order everywhere."""
        lines = self.mesh.mesh.permute(0, 2, 1).reshape(-1, self.layout.pp)  # (dp, tp, pp) -> a line per (dp, tp)
        return [[int(rank) for rank in line] for line in lines]


_MESHES: dict[tuple, tuple[Any, Any]] = {}  # (shape, device type) -> (the default group it was made in, the mesh)


def _mesh(shape: tuple[int, int, int], device_type: str):
    """The ("dp", "pp", "tp") DeviceMesh of `shape`, made once per process group: each new mesh makes new
    process groups, whose threads stay until the process ends (a script building many pipelines of one
    layout would pile them up).  A mesh is a set of groups, no state of a pipeline's, so pipelines share it;
    the cache holds the default group it was made in, so a re-initialised world makes a new mesh."""
    world = dist.distributed_c10d._get_default_group()  # private; kept as an object, compared with `is`
    made_in, mesh = _MESHES.get((shape, device_type), (None, None))
    if made_in is not world:
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=DIMENSIONS)
        _MESHES[shape, device_type] = (world, mesh)
    return mesh


def check_plans(partition: Partition, plan_fn: Callable | None, tp: int) -> None:
    """Every stage's plans checked against `tensor_parallel=tp` (`tp_plans.check`), on every rank alike: a width
    that tp does not divide is a ValueError on all of them, before any block is parallelized."""
    for s, blocks in enumerate(partition.stages):
        first, _ = partition.bounds[s]
        blocks = list(blocks)
        for k, (block, plan) in enumerate(zip(blocks, tp_plans.plans_for_stage(blocks, plan_fn))):
            tp_plans.check(block, plan, tp, f"block {first + k} (stage {s})")


def parallelize(stages: list[int], partition: Partition, plan_fn: Callable | None, tp_mesh) -> dict[str, torch.Tensor]:
    """Split every block of this rank's stages over "tp" with its plan (`model/tp_plans.py`); returns
    {parameter name in the model: the row order tp_plans gave it}."""
    row_orders: dict[str, torch.Tensor] = {}
    for s in stages:
        first, _ = partition.bounds[s]
        blocks = list(partition.stages[s])
        for k, (block, plan) in enumerate(zip(blocks, tp_plans.plans_for_stage(blocks, plan_fn))):
            orders = tp_plans.apply(block, plan, tp_mesh, f"block {first + k} (stage {s})")
            row_orders.update({f"{first + k}.{name}": order for name, order in orders.items()})
    return row_orders


def all_reduce_gradients(parameters: list[nn.Parameter], weight: float, group) -> None:
    """grad ← Σ_r (n_r / N) · grad_r over the replicas: one all-reduce per dtype of all local gradients."""
    grads = [local_shard(p.grad) for p in parameters if p.grad is not None]
    for dtype in sorted({g.dtype for g in grads}, key=str):
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same]) * weight
        dist.all_reduce(flat, group=group)
        offset = 0
        with torch.no_grad():
            for g in same:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


def full_gradients(model: nn.Module, row_orders: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{parameter name in `model`: its full gradient} of the parameters this rank holds, gathered over "tp"
    (a collective under tensor parallelism: call it on every rank); on the CPU, rows in the model's order."""
    found = {}
    for name, p in model.named_parameters():
        if p.device.type == "meta" or p.grad is None:
            continue
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grad = _plain(grad).detach().cpu()
        if name in row_orders:
            ordered = torch.empty_like(grad)
            ordered[row_orders[name]] = grad
            grad = ordered
        found[name] = grad.clone()
    return found
