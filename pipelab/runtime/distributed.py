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
from .checkpoints import checkpoint
from .driver import StepDriver
from .hybrid import full_gradients, local_shard, resolve_layout
from .options import PipelineOptions, RankPlacementArgs, engine_signature
from .rank_placement import RankPlacement
from .step import GenerationResult, InferenceResult, StepResult


class DistributedPipeline:
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
        hybrid = (layout is not None or where.tensor_parallel_plan is not None
                  or (where.data_parallel, where.tensor_parallel) != (1, 1))
        if hybrid and dist.is_available() and dist.is_initialized():
            if group is not None:
                raise ValueError("a hybrid layout spans the whole world (its mesh); group= is for a plain pipeline")
            layout = resolve_layout(dist.get_world_size(), layout, where.data_parallel, where.tensor_parallel)
        self.placement = RankPlacement(self.options, devices, group, layout, where.tensor_parallel_plan, hybrid)
        self.driver = StepDriver(model, self.options, self.placement)
        placement = self.placement
        self.model, self.loss_fn, self.n_microbatches = model, self.options.loss_fn, self.options.n_microbatches
        self.schedule, self.n_stages, self.partition = self.driver.schedule, self.driver.n_stages, self.driver.partition
        self.workers, self.stages, self.layout = self.driver.workers, placement.stages, placement.layout
        self.device, self.threads, self.backend = placement.device, placement.threads, placement.backend
        self.group, self.rank, self.world_size = placement.group, placement.rank, placement.world_size
        self.hybrid, self.row_orders, self.shared = placement.hybrid, placement.row_orders, placement.shared
        self.mesh = None if self.hybrid is None else self.hybrid.mesh
        self.dp_index, self.pp_index, self.tp_index = ((0, self.rank, 0) if self.hybrid is None else
                                                       (self.hybrid.dp_index, self.hybrid.pp_index, self.hybrid.tp_index))
        self.clock_offset, self.clock_error = placement.clock_offset, placement.clock_error

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, each once (give them to the optimizer; DTensors under tensor parallelism).
        A parameter stages on several ranks use (a tied embedding) is on each of them, kept equal."""
        return self.placement.parameters()

    def parameter_bytes(self) -> int:
        """Bytes of the parameters this rank holds (its shards under tensor parallelism)."""
        return sum(local_shard(p).numel() * p.element_size() for p in self.parameters())

    def gradients(self) -> dict[str, torch.Tensor]:
        """{parameter name in `model`: its full gradient} for this rank's stage(s), on the CPU; under tensor
        parallelism gathered over "tp" (a collective: call it on every rank), rows in the model's order."""
        return full_gradients(self.model, self.row_orders)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the gradients by their global norm over the whole model (every stage and rank, tensor-parallel
        shards combined, data-parallel replicas once), as `torch.nn.utils.clip_grad_norm_` on the single-device
        model does; call it on every rank.  Returns the norm before clipping (`runtime/clipping.py`)."""
        return self.placement.clip_grad_norm_(max_norm, norm_type)

    def count_communication(self) -> comm_count.CommunicationCounter:
        """A counter of this rank's communication: `with pipe.count_communication() as c: pipe.step(x, y)`,
        then `c.totals()` ({kind: messages, bytes, elements}; `runtime/comm_count.py`)."""
        groups = [("other", self.group)]
        if self.hybrid is not None:
            groups += [("dp", self.hybrid.group("dp")), ("tp", self.hybrid.group("tp"))]
        ranks = {kind: frozenset(dist.get_process_group_ranks(group)) for kind, group in groups}
        return comm_count.CommunicationCounter({members: kind for kind, members in ranks.items()})

    def save_checkpoint(self, path, optimizer: torch.optim.Optimizer | None = None, overwrite: bool = False) -> None:
        """Save this rank's stage (and `optimizer`'s state) with torch.distributed.checkpoint; call on every rank.

        The checkpoint appears at `path` whole, once every rank's share is written, or not at all; an existing
        one is replaced only with `overwrite=True` (`runtime/checkpoints/checkpoint.py`).  Any layout reads it back:
        `load_checkpoint` on a pipeline of another depth, or `pl.distributed.load_checkpoint(model, path,
        optimizer)` into one plain model.
        """
        checkpoint.save(self, path, optimizer, overwrite=overwrite)

    def load_checkpoint(self, path, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Load this rank's parameters (and `optimizer`'s state for them) from `path`; call on every rank."""
        checkpoint.load(self, path, optimizer)

    def step(self, inputs: Any, targets: Any = None) -> StepResult:
        """One training step; call it on every rank with the same whole batch.

        Gradients of the mean loss over the batch are *added* to this rank's parameters' `.grad` (the other
        blocks' `.grad` stay None).  Returns the same `loss` and the same complete `trace` ("measured", one row
        per rank of the pipeline) on every rank; `wall_seconds` is this rank's time for the step.  With data
        parallelism, replica r runs its share n_r of the batch, then the gradients are all-reduced over "dp",
        each weighted n_r / N, and the loss is the global mean (`runtime/hybrid.py`)."""
        return self.driver.step(inputs, targets)

    def infer(self, inputs: Any) -> InferenceResult:
        """Forward only, pipelined (inference); call it on every rank with the same whole batch.  Each micro-batch
        goes through every stage once under `torch.no_grad()` (E actions, `pl.schedules.forward_only_like` of
        this pipeline's schedule); nothing is kept for a backward, nothing sent back.  Returns the merged
        outputs (what `model(inputs)` returns) on the rank of the last stage, None on the others, and the
        same complete trace on every rank (`trace.latencies`, `trace.throughput`)."""
        if self.hybrid is not None:
            raise ValueError("infer runs a plain pipeline; with tensor or data parallelism, build a "
                             "DistributedPipeline without them for inference")
        return self.driver.infer(inputs)

    def generate(self, prompts: torch.Tensor, new_tokens: int, lanes: int | None = None) -> GenerationResult:
        """Greedy generation through this pipeline's stages (a `pl.models.tiny_gpt`), as `pl.Pipeline.generate`:
        `lanes` groups of prompts in flight (default: the pipeline's m), a key/value cache per lane on every
        rank, each token from the last stage's rank back to the first's (G actions, `pl.schedules.generation`).
        Call it on every rank with the same prompts; every rank gets the prompts with their new tokens and the
        measured Trace."""
        if self.hybrid is not None:
            raise ValueError("generate runs a plain pipeline (one stage per rank, or an interleaved schedule's "
                             "several), without tensor or data parallelism; build a DistributedPipeline without them")
        return self.driver.generate(prompts, new_tokens, lanes)


DistributedPipeline.__init__.__signature__ = engine_signature(RankPlacementArgs)
