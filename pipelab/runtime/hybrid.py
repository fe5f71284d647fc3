"""Pipeline × tensor × data parallelism on one `DeviceMesh` ("dp", "pp", "tp").

    pipe = pl.DistributedPipeline(model, n_microbatches=4, schedule="1f1b", loss_fn=loss,
                                  tensor_parallel=2, data_parallel=2)   # 8 ranks: pp = 8 / (2·2) = 2

Every rank builds the mesh `init_device_mesh(device, (dp, pp, tp), mesh_dim_names=("dp",
"pp", "tp"))` (ranks laid out as `pl.Layout` says), then:

- **PP**: the plain distributed engine runs on the rank's "pp" sub-group (`group=` of
  `DistributedPipeline`): stage d is the rank with pp coordinate d in its (dp, tp) row, so
  point-to-point messages stay on the "pp" dimension (torch translates the sub-group's ranks
  to global ones).
- **TP**: each block of this rank's stage is parallelized over the "tp" sub-group with
  PyTorch's `parallelize_module` and the block's plan (`runtime/tp_plans.py`).  Parameters
  become DTensors holding this rank's shard; DTensor issues the all-reduces.
- **The stage boundary under TP** (Megatron-LM's scatter/gather, Narayanan et al. 2021,
  §4.1): what leaves a stage is replicated on its t ranks, so sending it whole from each
  would cross the boundary t times.  Instead each rank sends its 1/t slice (along the last
  dimension) to its peer of the same tp index on the next stage, and the receiving ranks
  all-gather the slices over "tp" (`ScatterGatherTransport`): the boundary carries
  b·s·h elements once per TP group, as t messages of b·s·h/t, plus an all-gather inside
  the group (inside a node, on the fast links).  Gradients go back the same way.
- **DP**: each replica takes its share of the global batch (`microbatch.split` into dp
  contiguous shares); after the step's last backward every rank all-reduces its gradients
  over "dp", once, in one flat bucket per dtype, each replica's weighted by its share
  n_r / N so that the result is the gradient of the global mean loss even for unequal
  shares.  Written by hand rather than with DDP: DDP all-reduces inside every backward
  (m times per step under a pipeline, unless all but the last are wrapped in `no_sync`,
  which the schedule's order makes awkward) and weights replicas equally; FSDP2 would
  also shard the parameters (ZeRO-3), another trade-off than plain DP.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from .. import microbatch
from ..actions import Schedule
from ..errors import PipelineError
from ..layout import DIMENSIONS, Layout
from ..partition import Partition
from . import comm_count, tp_plans
from .distributed import DistributedPipeline
from .local import StepResult


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (a view of its storage), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor behind an AsyncCollectiveTensor (DTensor's not-yet-waited all-reduce result)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return tensor.wait() if isinstance(tensor, AsyncCollectiveTensor) else tensor


def resolve_layout(world_size: int, layout: Layout | None, data_parallel: int, tensor_parallel: int) -> Layout:
    if layout is None:
        return Layout.for_world(world_size, data_parallel=data_parallel, tensor_parallel=tensor_parallel)
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a pl.Layout, got {type(layout).__name__}")
    if (data_parallel, tensor_parallel) not in ((1, 1), (layout.dp, layout.tp)):
        raise ValueError(f"layout={layout} disagrees with data_parallel={data_parallel}, tensor_parallel={tensor_parallel}")
    if layout.world_size != world_size:
        raise PipelineError(f"layout {layout} needs {layout.world_size} ranks, the world has {world_size}")
    return layout


class ScatterGatherTransport:
    """The point-to-point transport with Megatron's scatter/gather at each stage boundary (module docstring)."""

    def __init__(self, inner, group, tp_size: int, tp_index: int):
        self.inner, self.group, self.tp_size, self.tp_index = inner, group, tp_size, tp_index

    def __getattr__(self, name: str) -> Any:  # start_step, finish, waits, sent_at: the inner transport's
        return getattr(self.inner, name)

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


class HybridPipeline(DistributedPipeline):
    """`DistributedPipeline` on a ("dp", "pp", "tp") mesh; made by `pl.DistributedPipeline(...,
    tensor_parallel=, data_parallel=, tensor_parallel_plan=, layout=)` (module docstring).

    Extra args:
        tensor_parallel: t, ranks per tensor-parallel group (consecutive ranks).
        data_parallel: d, pipeline replicas.  The pipeline depth is world / (d·t).
        tensor_parallel_plan: fn(block) -> a plan for `parallelize_module` (or None to replicate
            the block); default: pl.models' plans (`runtime/tp_plans.py`).
        layout: a `pl.Layout(dp=, pp=, tp=)` instead of the two numbers.
    """

    def __init__(self, model: nn.Module, n_microbatches: int, schedule: str | Schedule = "1f1b",
                 loss_fn: Callable | None = None, device: Any = None, group=None,
                 checkpoint: str | list[bool] = "never", split_method: str | Partition = "uniform",
                 sample: Any = None, threads: int | None = 1, *, tensor_parallel: int = 1, data_parallel: int = 1,
                 tensor_parallel_plan: Callable | None = None, layout: Layout | None = None):
        if not (dist.is_available() and dist.is_initialized()):
            raise PipelineError("a hybrid layout runs inside a process group: start it with torchrun or "
                                "pl.distributed.launch(fn, n)")
        if group is not None:
            raise PipelineError("a hybrid layout spans the whole world (its mesh); group= is for a plain pipeline")
        if split_method == "time":
            raise PipelineError('split_method="time" is not supported with a hybrid layout (each pipeline would time '
                                'its own blocks and could cut elsewhere); use "uniform", "params" or a Partition')
        self.layout = resolve_layout(dist.get_world_size(), layout, data_parallel, tensor_parallel)
        from torch.distributed.device_mesh import init_device_mesh

        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        self.mesh = init_device_mesh(device_type, self.layout.shape, mesh_dim_names=DIMENSIONS)
        self.dp_index, self.pp_index, self.tp_index = self.layout.coordinates(dist.get_rank())
        self.dp_group, self.tp_group = self.mesh["dp"].get_group(), self.mesh["tp"].get_group()
        super().__init__(model, n_microbatches, schedule, loss_fn, device, self.mesh["pp"].get_group(), checkpoint,
                         split_method, sample, threads)
        self.row_orders: dict[str, torch.Tensor] = {}  # parameter name -> the row order tp_plans gave it
        if self.layout.tp > 1:
            self._parallelize(tensor_parallel_plan)
            self.transport = ScatterGatherTransport(self.transport, self.tp_group, self.layout.tp, self.tp_index)

    def _parallelize(self, plan_fn: Callable | None) -> None:
        for s in self.stages:
            first, last = self.partition.bounds[s]
            blocks = list(self.partition.stages[s])
            for k, (block, plan) in enumerate(zip(blocks, tp_plans.plans_for_stage(blocks, plan_fn))):
                orders = tp_plans.apply(block, plan, self.mesh["tp"], f"block {first + k} (stage {s})")
                self.row_orders.update({f"{first + k}.{name}": order for name, order in orders.items()})
            # the worker excludes its parameters' storages from the activation bytes: the local shards now
            self.workers[s].parameters = [_local(p) for p in self.partition.stages[s].parameters()]

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (DTensors under tensor parallelism; give them to the optimizer)."""
        return [p for s in self.stages for p in self.partition.stages[s].parameters()]

    def parameter_bytes(self) -> int:
        """Bytes of the parameters this rank holds (its shards)."""
        return sum(_local(p).numel() * p.element_size() for p in self.parameters())

    def step(self, inputs: Any, targets: Any) -> StepResult:
        """One step on the global batch (the same on every rank): replica r runs its share through its
        pipeline, then gradients are all-reduced over "dp".  Returns the global mean loss on every rank;
        the trace is this rank's pipeline's."""
        total = microbatch.batch_size(inputs)
        if microbatch.batch_size(targets) != total:
            raise ValueError(f"inputs hold {total} samples but targets hold {microbatch.batch_size(targets)}")
        d = self.layout.dp
        if total < d * self.n_microbatches:
            raise ValueError(f"a batch of {total} samples cannot give each of data_parallel={d} replicas "
                             f"{self.n_microbatches} micro-batches")
        shares = microbatch.sizes(total, d)
        weight = shares[self.dp_index] / total
        result = super().step(microbatch.split(inputs, d)[self.dp_index], microbatch.split(targets, d)[self.dp_index])
        if d == 1:
            return result
        self._all_reduce_gradients(weight)
        loss = torch.tensor([result.loss * weight], dtype=torch.float64, device=self.device)
        with comm_count.label("other"):
            dist.all_reduce(loss, group=self.dp_group)
        return dataclasses.replace(result, loss=float(loss.item()))

    def _all_reduce_gradients(self, weight: float) -> None:
        """grad ← Σ_r (n_r / N) · grad_r over the replicas: one all-reduce per dtype of all local gradients."""
        grads = [_local(p.grad) for p in self.parameters() if p.grad is not None]
        for dtype in sorted({g.dtype for g in grads}, key=str):
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same]) * weight
            dist.all_reduce(flat, group=self.dp_group)
            offset = 0
            with torch.no_grad():
                for g in same:
                    g.copy_(flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()

    def gradients(self) -> dict[str, torch.Tensor]:
        """{parameter name in `model`: its full gradient} for this rank's stage(s), gathered over "tp"
        (a collective: call it on every rank); on the CPU, rows in the model's order."""
        from torch.distributed.tensor import DTensor

        found = {}
        for name, p in self.model.named_parameters():
            if p.device.type == "meta" or p.grad is None:
                continue
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grad = _plain(grad).detach().cpu()
            if name in self.row_orders:
                ordered = torch.empty_like(grad)
                ordered[self.row_orders[name]] = grad
                grad = ordered
            found[name] = grad.clone()
        return found

    def count_communication(self) -> comm_count.CommunicationCounter:
        """A counter of this rank's communication: `with pipe.count_communication() as c: pipe.step(x, y)`,
        then `c.totals()` ({kind: messages, bytes, elements}; `runtime/comm_count.py`)."""
        ranks = {kind: frozenset(dist.get_process_group_ranks(group))
                 for kind, group in (("other", self.group), ("dp", self.dp_group), ("tp", self.tp_group))}
        return comm_count.CommunicationCounter({members: kind for kind, members in ranks.items()})
