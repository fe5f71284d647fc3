"""The distributed engine: one process per device, talking point to point with `torch.distributed`.

`pl.DistributedPipeline` is a façade: it builds the options (`runtime/options.py`) and a
`RankPlacement` (this rank's stages on its device, `runtime/rank_placement.py`), and the step
driver (`runtime/driver.py`) does the rest, as for every engine.  Every rank returns the same
complete Trace and the same loss.  A hybrid layout adds tensor and data parallelism around it
on a ("dp", "pp", "tp") DeviceMesh (`runtime/hybrid.py`).

Details: docs/distributed.md, "How a rank runs a step".
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import comm_count
from .engine import Engine
from .hybrid import full_gradients, local_shard, resolve_layout
from .options import PipelineOptions, RankPlacementArgs, engine_signature
from .rank_placement import RankPlacement


class DistributedPipeline(Engine):
    """Pipeline-parallel training with one rank per device, inside an initialised process group.

    Create it on every rank with the same arguments (under `torchrun`, or in a function given to
    `pl.distributed.launch`): the ranks compare p, m, the schedule, the layout, the model's structure and
    the loss normalization at start-up, and a difference is a ValueError on every rank naming the ranks and
    the field (`runtime/fingerprint.py`).  Rank d runs device d of the schedule: for "gpipe" and "1f1b"
    that is stage d, so n_stages = the group's size; a rank may run several stages (interleaved 1F1B:
    `schedule.device_of_stage()`).  The full model is built identically on every rank (same seed); the blocks
    of other ranks' stages are moved to the "meta" device (freed), this rank's stay and receive the
    gradients, under their names in `model`.  A parameter stages on two ranks use (a tied embedding) is kept
    on both, its gradient summed over them after the step (`runtime/shared_parameters.py`).

    Everything after `model` is a keyword: the parameters below say where this rank's stages run; every other
    keyword is an option that `pl.Pipeline` takes too, documented once in `pl.PipelineOptions` (or give
    `options=` whole).  split_method="time" is measured on rank 0 and broadcast, so every rank cuts alike.

    Args:
        model: the full model (an `nn.Sequential` of blocks, or any module with `split_points`).
        devices: this rank's device; None picks cuda:LOCAL_RANK with NCCL, else the CPU.  (`device=`, its name
            before, still works and warns.)
        group: the process group of the pipeline (default: the whole world).
        tensor_parallel: t, ranks per tensor-parallel group (consecutive ranks) of a hybrid layout.
        data_parallel: d, pipeline replicas.  The pipeline depth is world / (d·t).
        tensor_parallel_plan: fn(block) -> a plan for `parallelize_module` (or None to replicate the block);
            default: pl.models' plans (`model/tp_plans.py`).
        layout: a `pl.Layout(dp=, pp=, tp=)` instead of the two numbers.
        shard: None (each replica holds its stages whole; gradients all-reduced over "dp" after the step) or
            "fsdp": each block of a stage wrapped with torch's `fully_shard` (FSDP2) on "dp", a replica keeping
            1/d of the parameters, gradients and optimizer state; gradients reduce-scattered once per step
            (`runtime/fsdp_stages.py`).  Not yet with tensor parallelism or tied parameters across stages.
        reshard_after_forward: with shard="fsdp": True frees a block's gathered weights after each forward and
            backward (gathered again for each micro-batch: 2m all-gathers per block per step); False keeps them
            from the step's first forward to its end (one all-gather per block per step, the stage held whole).
        options: a `pl.PipelineOptions`; the keywords given beside it replace its fields.
        **settings: the options, by name: n_microbatches, schedule, loss_fn, ...  With a memory limit, a rank
            holds only its own stages, so the check before the first step counts parameters, gradients and
            optimizer state (activations not predicted), and every step's observed activations and messages
            are held to what the limit leaves.
    """

    def __init__(self, model: nn.Module, *, options: PipelineOptions | None = None, **settings: Any):
        self.options, where = PipelineOptions.build("DistributedPipeline", RankPlacementArgs, options, settings)
        devices, layout, group = where.devices, where.layout, where.group
        if where.device is not None:
            warnings.warn("DistributedPipeline(device=...) is now devices=..., as in pl.Pipeline", DeprecationWarning,
                          stacklevel=2)
            devices = where.device if devices is None else devices
        hybrid = (layout is not None or where.tensor_parallel_plan is not None or where.shard is not None
                  or (where.data_parallel, where.tensor_parallel) != (1, 1))
        if hybrid and dist.is_available() and dist.is_initialized():
            if group is not None:
                raise ValueError("a hybrid layout spans the whole world (its mesh); group= is for a plain pipeline")
            layout = resolve_layout(dist.get_world_size(), layout, where.data_parallel, where.tensor_parallel)
        self._start(model, self.options, RankPlacement(self.options, devices, group, layout, where.tensor_parallel_plan,
                                                       hybrid, where.shard, where.reshard_after_forward))
        placement = self.placement
        self.stages, self.layout = placement.stages, placement.layout
        self.device, self.threads, self.backend = placement.device, placement.threads, placement.backend
        self.group, self.rank, self.world_size = placement.group, placement.rank, placement.world_size
        self.hybrid, self.row_orders, self.shared = placement.hybrid, placement.row_orders, placement.shared
        self.mesh = None if self.hybrid is None else self.hybrid.mesh
        self.dp_index, self.pp_index, self.tp_index = ((0, self.rank, 0) if self.hybrid is None else
                                                       (self.hybrid.dp_index, self.hybrid.pp_index, self.hybrid.tp_index))
        self.clock_offset, self.clock_error = placement.clock_offset, placement.clock_error

    def parameter_bytes(self) -> int:
        """Bytes of the parameters this rank holds (its shards under tensor parallelism or shard="fsdp")."""
        return sum(local_shard(p).numel() * p.element_size() for p in self.parameters())

    def accumulating_parameters(self) -> list[torch.Tensor]:
        """The tensors a step's backwards accumulate gradients into: under shard="fsdp" the gathered (whole)
        parameters FSDP computes with, whose `.grad` holds the stage's whole gradient until the step's one
        reduce-scatter (`runtime/fsdp_stages.py`); otherwise the parameters themselves."""
        sharded = self.placement.sharded
        if sharded is None:
            return self.parameters()
        return [p for found in sharded.gathered.values() for p in found]

    def gradients(self) -> dict[str, torch.Tensor]:
        """{parameter name in `model`: its full gradient} for this rank's stage(s), on the CPU; under tensor
        parallelism gathered over "tp", under shard="fsdp" over "dp" (a collective: call it on every rank), rows
        in the model's order."""
        return full_gradients(self.model, self.row_orders)

    def count_communication(self) -> comm_count.CommunicationCounter:
        """A counter of this rank's communication: `with pipe.count_communication() as c: pipe.step(x, y)`,
        then `c.totals()` ({kind: messages, bytes, elements}; `runtime/comm_count.py`)."""
        groups = [("other", self.group)]
        if self.hybrid is not None:
            groups += [("dp", self.hybrid.group("dp")), ("tp", self.hybrid.group("tp"))]
        ranks = {kind: frozenset(dist.get_process_group_ranks(group)) for kind, group in groups}
        return comm_count.CommunicationCounter({members: kind for kind, members in ranks.items()})


DistributedPipeline.__init__.__signature__ = engine_signature(RankPlacementArgs)
