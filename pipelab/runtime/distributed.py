"""The distributed engine: one process per device, talking point to point with `torch.distributed`.

Every rank builds the same full model (from its seed), keeps only the blocks of its own
stage(s) (the others moved to the "meta" device), then runs device d's list,
`schedule.actions[d]`, through the loop both engines share (`runtime/loop.py`) with the
`torch.distributed` transport (`runtime/p2p.py`).  Each rank's wall clock is put on rank 0's
by `clock_sync.estimate_offset`; at the end of each step the ranks exchange what they
recorded (`runtime/exchange.py`), so **every rank returns the same complete Trace and the
same loss**.  A hybrid layout adds tensor and data parallelism around it (`runtime/hybrid.py`).

Details: docs/distributed.md, "How a rank runs a step".
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..common.errors import PipelineError
from ..common.gc_pause import gc_paused
from ..common.threads import check_threads, intra_op_threads
from ..model import loss_check, microbatch
from ..model.batch_norm import warn_if_batch_norm
from ..model.finite import FiniteChecks
from ..model.token_weights import token_counter
from ..model.named_split import repeated_blocks
from ..model.partition import Partition, balanced_bounds, named_block_costs, points_at, points_for, split
from ..predict.budget import check_limit, check_memory_budget
from ..predict.layout import Layout
from ..predict.memory import activation_samples, checkpoint_plan
from ..schedules.action import GRADIENT_KINDS, NARROWING_KINDS, Action, Kind
from ..schedules.inference import forward_only_like
from ..schedules.schedule import Schedule
from ..schedules.trace import Event, Message, Trace, Wait
from . import checkpoint, clipping, comm_count, fingerprint
from .clock import ActionClock
from .clock_sync import estimate_offset
from .exchange import COLUMNS, StepExchange, StepRecord
from .generation import GenerationResult, generate_on_ranks
from .hybrid import (
    HybridMesh,
    ScatterGatherTransport,
    all_reduce_gradients,
    check_plans,
    full_gradients,
    local_shard,
    parallelize,
    resolve_layout,
)
from .loop import run_actions
from .memory_observer import MemoryObserver, observed_breakdown, observed_samples
from .p2p import PointToPointTransport
from .step import (
    InferenceResult,
    StepResult,
    batch_size,
    build_partition,
    check_loss_fn,
    check_traced,
    check_microbatch_count,
    cut_batch,
    make_workers,
    merged_outputs,
    resolve_schedule,
    step_loss,
    unique_parameters,
)
from .shared_parameters import SharedParameters, keep_own_stages


class DistributedPipeline:
    """Pipeline-parallel training with one rank per device, inside an initialised process group.

    Create it on every rank with the same arguments (under `torchrun`, or in a function
    given to `pl.distributed.launch`): the ranks compare p, m, the schedule, the layout, the
    model's structure and the loss normalization at start-up, and a difference is a ValueError
    on every rank naming the ranks and the field (`runtime/fingerprint.py`).  Rank d runs
    device d of the schedule: for "gpipe" and "1f1b" that is stage d, so n_stages = the
    group's size.

    Everything after `model` is a keyword, in the same order as `pl.Pipeline`'s.

    Args:
        model: the full model (an `nn.Sequential` of blocks, or any module with `split_points`), built
            identically on every rank (same seed).
            The blocks of other ranks' stages are moved to the "meta" device (freed); this
            rank's blocks stay and receive the gradients, under their names in `model`.
        n_microbatches: m.
        schedule: "gpipe", "1f1b", "zb-h1" or a `Schedule` whose number of devices is the group's size:
            a rank may run several stages (interleaved 1F1B: `schedule.device_of_stage()`), and W
            actions split the backward as in `pl.Pipeline`.
        loss_fn: loss(output, target) returning the mean over a micro-batch; None for a model split by names
            that computes its own loss (`output.loss`, with labels in the batch).
        loss_normalization: "samples" (micro-batch i counts n_i / N) or "tokens" (c_i / C, its counted tokens:
            labels other than -100; exact for a token-mean loss with padding; `model/token_weights.py`).
        devices: this rank's device; None picks cuda:LOCAL_RANK with NCCL, else the CPU.  (`device=`,
            its name before, still works and warns.)
        split_method: "uniform", "params", "time" or a ready `Partition` (the same on every rank).
            "time" needs `sample` (an input batch); rank 0 measures the blocks and sends the
            costs to the others, so that every rank cuts the model at the same places.
        split_points: any `nn.Module`, cut before each named module (`model/named_split.py`), as in
            `pl.Pipeline`; a parameter stages on two ranks use (a tied embedding) is kept on both, its
            gradient summed over them after the step (`runtime/shared_parameters.py`).
        sample: an input batch, for split_method="time" and for split_points.
        checkpoint: activation checkpointing per stage, as in `pl.Pipeline`.
        threads: intra-op threads while a step runs on a CPU (default 1, so that ranks sharing
            a machine's cores really run in parallel; the caller's setting restored after); None
            leaves PyTorch's setting.
        optimizer: for an asynchronous schedule ("pipedream-async") only, and needed there, as in
            `pl.Pipeline`: `optimizer(params)` builds each of this rank's stages its own optimizer.
        fused_accumulation: Linear weight gradients added into `.grad` inside the multiply, as in
            `pl.Pipeline` (default True).
        check_finite: NaN and inf in a stage's output or the loss raise, naming the stage, action,
            micro-batch and rank where they first appear, as in `pl.Pipeline`: "first" (the first step, the
            default), True (every step) or False.
        group: the process group of the pipeline (default: the whole world).

    A hybrid layout on a ("dp", "pp", "tp") DeviceMesh (`runtime/hybrid.py`), with any of:
        tensor_parallel: t, ranks per tensor-parallel group (consecutive ranks).
        data_parallel: d, pipeline replicas.  The pipeline depth is world / (d·t).
        tensor_parallel_plan: fn(block) -> a plan for `parallelize_module` (or None to replicate
            the block); default: pl.models' plans (`model/tp_plans.py`).
        layout: a `pl.Layout(dp=, pp=, tp=)` instead of the two numbers.
        memory_limit_bytes, memory_optimizer: as in `pl.Pipeline`, for this rank's device; a rank holds only its
            own stages, so the check before the first step counts parameters, gradients and optimizer state
            (activations not predicted; `pl.check_memory_budget` with `Costs.from_profile` on one process does),
            and every step's observed activations and messages are held to what the limit leaves.
    """

    def __init__(self, model: nn.Module, *, n_microbatches: int, schedule: str | Schedule = "1f1b",
                 loss_fn: Callable | None = None, loss_normalization: str = "samples", devices: Any = None,
                 split_method: str | Partition = "uniform", split_points: list[str] | None = None, sample: Any = None,
                 checkpoint: str | list[bool] = "never", threads: int | None = 1, optimizer: Callable | None = None,
                 fused_accumulation: bool = True, check_finite: bool | str = "first", group=None,
                 tensor_parallel: int = 1, data_parallel: int = 1, tensor_parallel_plan: Callable | None = None,
                 layout: Layout | None = None, device: Any = None, memory_limit_bytes: float | list[float] | None = None,
                 memory_optimizer: Any = "adam"):
        if device is not None:
            warnings.warn("DistributedPipeline(device=...) is now devices=..., as in pl.Pipeline", DeprecationWarning,
                          stacklevel=2)
            devices = device if devices is None else devices
        if not (dist.is_available() and dist.is_initialized()):
            raise PipelineError("DistributedPipeline runs inside a process group: start it with torchrun "
                                "(torchrun --nproc-per-node 2 -m pipelab.launch ...) or pl.distributed.launch(fn, 2)")
        # every check below needs no communication, so a bad launch fails the same way on every rank
        check_loss_fn(loss_fn, traced=split_points is not None or not isinstance(model, nn.Sequential))
        check_microbatch_count(n_microbatches)
        self.count_tokens = token_counter(model, loss_fn, loss_normalization)  # None: weights by samples
        self.finite_checks = FiniteChecks(check_finite)
        self.hybrid = None  # the ("dp", "pp", "tp") mesh of a hybrid layout (`runtime/hybrid.py`)
        hybrid_layout = None
        if layout is not None or tensor_parallel_plan is not None or (data_parallel, tensor_parallel) != (1, 1):
            if group is not None:
                raise ValueError("a hybrid layout spans the whole world (its mesh); group= is for a plain pipeline")
            if split_points is not None:
                raise ValueError("split_points (a model split by names) runs as a plain pipeline: tensor and data "
                                 "parallelism need pl.models' blocks and their plans")
            if split_method == "time":
                raise ValueError('split_method="time" is not supported with a hybrid layout (each pipeline would '
                                    'time its own blocks and could cut elsewhere); use "uniform", "params" or a Partition')
            hybrid_layout = resolve_layout(dist.get_world_size(), layout, data_parallel, tensor_parallel)
        # where this rank sits: a plain pipeline is the layout (dp, pp, tp) = (1, world, 1), without a mesh
        agreeing = group if group is not None else dist.group.WORLD  # the ranks that compare their configuration
        self.layout = Layout(pp=dist.get_world_size(agreeing)) if hybrid_layout is None else hybrid_layout
        self.backend = dist.get_backend(agreeing)
        self.model, self.loss_fn, self.n_microbatches = model, loss_fn, n_microbatches
        self.schedule = resolve_schedule(schedule, n_microbatches, n_devices=self.layout.pp)
        self.n_stages = self.schedule.n_stages
        self.checkpoint = checkpoint_plan(checkpoint, self.n_stages)
        self.device = self._resolve_device(devices)
        self.threads = check_threads(threads) if self.device.type == "cpu" else None
        with self._context():  # the first communication: the ranks agree on the configuration (`fingerprint.py`)
            fingerprint.agree(fingerprint.fields(self.schedule, n_microbatches, self.layout, model, loss_normalization),
                              agreeing, self.device)
        if hybrid_layout is not None:
            self.hybrid = HybridMesh.build(hybrid_layout, dist.get_backend())
            group = self.hybrid.group("pp")
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.mesh = None if self.hybrid is None else self.hybrid.mesh
        self.dp_index, self.pp_index, self.tp_index = ((0, self.rank, 0) if self.hybrid is None else
                                                       (self.hybrid.dp_index, self.hybrid.pp_index, self.hybrid.tp_index))
        with self._context():
            self._build(model, loss_fn, split_method, split_points, sample, optimizer, fused_accumulation,
                        tensor_parallel_plan)
        self.activation_budgets = None  # {this rank's device: bytes its activations may take}
        if memory_limit_bytes is not None:  # the same numbers on every rank: every rank refuses alike
            limits = check_limit(memory_limit_bytes, self.schedule.n_devices)
            needs = check_memory_budget(self.partition, self.schedule, limits, None,
                                        optimizer if optimizer is not None else memory_optimizer, self.checkpoint)
            self.activation_budgets = {self.rank: limits[self.rank] - needs[self.rank].model_state_bytes}

    def _context(self):
        """Where this rank's work runs: its intra-op threads on a CPU, its GPU as the current device on CUDA
        (NCCL's calls use it); both restored on exit, so the caller's settings are never changed for good."""
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return intra_op_threads(self.threads)

    def _build(self, model, loss_fn, split_method, split_points, sample, optimizer, fused_accumulation,
               tensor_parallel_plan):
        timed = split_method == "time" and split_points is None
        if timed and sample is None:
            raise ValueError('split_method="time" measures each block, so pass sample=<an input batch>')
        if timed and isinstance(model, nn.Sequential):
            self.partition = self._split_by_time(model, sample)
        else:
            if timed:
                split_points = self._points_by_time(model, sample)
            self.partition = build_partition(model, self.n_stages, self.n_microbatches, split_method, split_points,
                                             sample, self.threads)
        if len(self.partition) != self.n_stages:
            raise ValueError(f"the partition has {len(self.partition)} stages, the schedule {self.n_stages}")
        if self.layout.tp > 1:  # every stage's plans, on every rank: a width tp does not divide fails on all alike
            check_plans(self.partition, tensor_parallel_plan, self.layout.tp)

        device_of_stage = self.schedule.device_of_stage()
        self.stages = sorted(s for s, d in device_of_stage.items() if d == self.rank)
        self.shared = SharedParameters(self.partition.stages, model, device_of_stage, self.group, self.rank)
        keep_own_stages(model, self.partition.stages, self.stages, self.device)  # the other ranks' tensors: freed
        self.workers = make_workers(self.schedule, self.partition, self.stages, loss_fn, self.checkpoint,
                                    lambda s: self.device, rank=self.rank, optimizer=optimizer,
                                    fused_accumulation=fused_accumulation)
        self.asynchronous = self.schedule.asynchronous
        if self.asynchronous and self.hybrid is not None:
            raise ValueError("an asynchronous schedule (PipeDream) updates each stage's weights inside its "
                                "backwards; it does not run with tensor or data parallelism")
        self.p2p = PointToPointTransport(self.schedule, self.rank, self.group, self.device)
        self.forward_p2p: PointToPointTransport | None = None  # inference's own (`infer`), made on first use
        self.transport = self.p2p  # what the loop sends and receives through (the same, or scatter/gather over it)
        self.row_orders: dict[str, torch.Tensor] = {}  # parameter name -> the row order tp_plans gave it
        if self.layout.tp > 1:
            self.row_orders = parallelize(self.stages, self.partition, tensor_parallel_plan, self.mesh["tp"])
            for s in self.stages:  # the worker leaves its parameters' storages out of the activation bytes: the shards
                self.workers[s].parameters = [local_shard(p) for p in self.partition.stages[s].parameters()]
            self.transport = ScatterGatherTransport(self.p2p, self.hybrid.group("tp"), self.layout.tp, self.tp_index)
        self.clock_offset, self.clock_error = estimate_offset(self.group, self.rank, self.world_size, self.device)
        self.exchange = StepExchange(self.group, self.rank, self.world_size, self.device, self.backend,
                                     self.p2p.exchange_tag, n_rows=max(map(len, self.schedule.actions)))

    def _split_by_time(self, model: nn.Module, sample: Any) -> Partition:
        """An `nn.Sequential`: its blocks' costs timed on rank 0 (`_costs_from_rank_0`), cut alike on every rank."""
        split(model, self.n_stages, "uniform")  # the same checks on every rank, before any communication
        costs = self._costs_from_rank_0(len(model), lambda: split(model, self.n_stages, "time", sample).block_costs)
        bounds = balanced_bounds(costs, self.n_stages)
        return Partition(bounds, [model[a:b] for a, b in bounds], "time", costs)

    def _points_by_time(self, model: nn.Module, sample: Any) -> list[str]:
        """A model split by names: its repeated blocks timed on rank 0 on the first micro-batch, cut alike on
        every rank."""
        name, blocks = repeated_blocks(model)
        points_for(model, self.n_stages, "uniform")  # the same checks on every rank, before any communication
        first = microbatch.split(sample, self.n_microbatches)[0]
        costs = self._costs_from_rank_0(len(blocks), lambda: named_block_costs(model, first, self.threads))
        return points_at(name, balanced_bounds(costs, self.n_stages))

    def _costs_from_rank_0(self, n_blocks: int, measure: Callable[[], list[float]]) -> list[float]:
        """Rank 0's `measure()` of the blocks' costs, broadcast: every rank then computes the same cut."""
        costs = torch.zeros(n_blocks, dtype=torch.float64)
        if self.rank == 0:
            costs = torch.tensor(measure(), dtype=torch.float64)
        costs = costs.to(self.device)
        dist.broadcast(costs, group_src=0, group=self.group)
        return costs.tolist()

    def _resolve_device(self, device) -> torch.device:
        if device is None:
            if self.backend == "nccl":
                return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            return torch.device("cpu")
        device = torch.device(device)
        if device.type == "cuda":
            if self.backend != "nccl":
                raise ValueError(f"device {device} needs the NCCL backend; this group uses {self.backend}")
        elif self.backend == "nccl":
            raise ValueError("the NCCL backend moves CUDA tensors only; use gloo for device='cpu'")
        return device

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, each once (give them to the optimizer; DTensors under tensor parallelism).
        A parameter stages on several ranks use (a tied embedding) is on each of them, kept equal."""
        return unique_parameters([self.partition.stages[s] for s in self.stages])

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
        parameters = self.parameters()
        with self._context():
            parts = clipping.local_part(self.shared.counted_here(parameters), norm_type, self.tp_index)
            tp_group = self.hybrid.group("tp") if self.layout.tp > 1 else None
            norm = clipping.reduce_norm(parts, norm_type, [self.group, tp_group], self.device)
        clipping.scale(parameters, max_norm, norm)
        return norm

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
        one is replaced only with `overwrite=True` (`runtime/checkpoint.py`).  Any layout reads it back:
        `load_checkpoint` on a pipeline of another depth, or `pl.distributed.load_checkpoint(model, path,
        optimizer)` into one plain model.
        """
        checkpoint.save(self, path, optimizer, overwrite=overwrite)

    def load_checkpoint(self, path, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Load this rank's parameters (and `optimizer`'s state for them) from `path`; call on every rank."""
        checkpoint.load(self, path, optimizer)

    def step(self, inputs: Any, targets: Any = None) -> StepResult:
        """One training step; call it on every rank with the same whole batch.

        Gradients of the mean loss over the batch are *added* to this rank's parameters'
        `.grad` (the other blocks' `.grad` stay None).  Returns the same `loss` and the
        same complete `trace` ("measured", one row per rank of the pipeline) on every rank;
        `wall_seconds` is this rank's time for the step.  With data parallelism, replica r
        runs its share n_r of the batch, then the gradients are all-reduced over "dp",
        each weighted n_r / N, and the loss is the global mean (`runtime/hybrid.py`).
        """
        warn_if_batch_norm(self.model, self.n_microbatches)
        with self._context():
            return self._step(inputs, targets)

    def _step(self, inputs: Any, targets: Any) -> StepResult:
        total = batch_size(inputs, targets)
        d = self.layout.dp
        if d == 1:
            return self._pipeline_step(inputs, targets)
        if total < d * self.n_microbatches:
            raise ValueError(f"a batch of {total} samples cannot give each of data_parallel={d} replicas "
                             f"{self.n_microbatches} micro-batches")
        share = self.dp_index
        my_inputs = microbatch.split(inputs, d)[share]
        my_targets = None if targets is None else microbatch.split(targets, d)[share]
        weight = microbatch.sizes(total, d)[share] / total  # n_r / N, or with token normalisation C_r / C
        if self.count_tokens is not None:  # every rank has the whole batch: the global count needs no message
            weight = self.count_tokens(my_inputs, my_targets) / self.count_tokens(inputs, targets)
        result = self._pipeline_step(my_inputs, my_targets)
        dp_group = self.hybrid.group("dp")
        all_reduce_gradients(self.parameters(), weight, dp_group)
        loss = torch.tensor([result.loss * weight], dtype=torch.float64, device=self.device)
        with comm_count.label("other"):
            dist.all_reduce(loss, group=dp_group)
        return dataclasses.replace(result, loss=float(loss.item()))

    def _pipeline_step(self, inputs: Any, targets: Any) -> StepResult:
        """One step of this rank's pipeline on `inputs` (its replica's share under data parallelism)."""
        input_chunks, target_chunks, weights = cut_batch(inputs, targets, self.n_microbatches, self.asynchronous,
                                                         self.count_tokens)
        check_traced(self.partition, self.model, input_chunks)
        records, wall_seconds = self._run(self.schedule, self.p2p, self.transport, input_chunks, target_chunks, weights)
        losses = self._losses(records)
        op_seconds = sum(row[1] - row[0] for record in records for row in record.rows if not math.isnan(row[0]))
        schedule, p2p = self.schedule, self.p2p
        return StepResult(step_loss(weights, losses, self.asynchronous), losses, wall_seconds, op_seconds,
                          lambda: self._trace(records, schedule, p2p))

    def infer(self, inputs: Any) -> InferenceResult:
        """Forward only, pipelined (inference); call it on every rank with the same whole batch.  Each micro-batch
        goes through every stage once under `torch.no_grad()` (E actions, `pl.schedules.forward_only_like` of
        this pipeline's schedule); nothing is kept for a backward, nothing sent back.  Returns the merged
        outputs (what `model(inputs)` returns) on the rank of the last stage, None on the others, and the
        same complete trace on every rank (`trace.latencies`, `trace.throughput`)."""
        if self.hybrid is not None:
            raise ValueError("infer runs a plain pipeline; with tensor or data parallelism, build a "
                             "DistributedPipeline without them for inference")
        schedule = forward_only_like(self.schedule)
        if self.forward_p2p is None:  # its own receives, tags and shapes: the training transport's stay as they were
            self.forward_p2p = PointToPointTransport(schedule, self.rank, self.group, self.device)
        with self._context(), torch.no_grad():
            chunks = microbatch.split(inputs, self.n_microbatches)
            check_traced(self.partition, self.model, chunks)
            m = len(chunks)
            records, wall_seconds = self._run(schedule, self.forward_p2p, self.forward_p2p, chunks, [None] * m, [1.0] * m)
            trace = self._trace(records, schedule, self.forward_p2p)
        last = self.workers.get(self.n_stages - 1)
        output = None if last is None else merged_outputs([last.outputs[i] for i in range(m)])
        return InferenceResult(output, trace, wall_seconds)

    def generate(self, prompts: torch.Tensor, new_tokens: int, lanes: int | None = None) -> GenerationResult:
        """Greedy generation through this pipeline's stages (a `pl.models.tiny_gpt`, one stage per rank, no
        tensor or data parallelism), as `pl.Pipeline.generate`: `lanes` groups of prompts in flight (default:
        the pipeline's m), a key/value cache per lane on every rank, the last rank's tokens sent back to rank 0
        (`runtime/generation.py: generate_on_ranks`).  Call it on every rank with the same prompts; every rank
        gets the prompts with their new tokens and the measured Trace."""
        if self.hybrid is not None or len(self.stages) != 1:
            raise ValueError("generate runs a plain pipeline with one stage per rank; build a DistributedPipeline "
                             "without tensor or data parallelism and with a non-interleaved schedule")
        with self._context():
            return generate_on_ranks(self.partition.stages[self.stages[0]], self.stages[0], self.n_stages, self.group,
                                     self.device, prompts, new_tokens, self.n_microbatches if lanes is None else lanes)

    def _run(self, schedule: Schedule, p2p: PointToPointTransport, transport, input_chunks: list, target_chunks: list,
             weights: list[float]) -> tuple[list[StepRecord], float]:
        """Run this rank's list of `schedule` on the chunks; every rank's records of it, and this rank's seconds."""
        observer = MemoryObserver(schedule.device_of_stage(), self.parameters(), self.activation_budgets)
        for worker in self.workers.values():
            worker.start_step(input_chunks, target_chunks, weights, observer)
        p2p.observer = observer  # before start_step, which posts the first receives
        p2p.start_step([microbatch.signature(chunk) for chunk in input_chunks])
        clock = ActionClock([self.device])
        self.exchange.post()  # gloo: the end-of-step exchange's receives, posted now

        step_begin = time.perf_counter()
        # gc: a full collection (~25 ms with torch loaded) on one rank would stall the others
        with gc_paused(), self.finite_checks.step(), loss_check.usage_errors():
            run_actions(schedule, schedule.actions[self.rank], self.workers, transport, clock, observer)
            p2p.finish()
            if not schedule.forward_only:
                self.shared.all_reduce_gradients()  # a tied weight: the sum of its uses on every rank that has it
        observer.close()
        records = self.exchange.gather(StepRecord(self._record(clock, schedule, p2p),
                                                  self._place_observed(observer, clock)))
        return records, time.perf_counter() - step_begin

    def _record(self, clock: ActionClock, schedule: Schedule, p2p: PointToPointTransport) -> list[list[float]]:
        """This rank's rows of the step: one per action of its list (`exchange.COLUMNS`), on rank 0's clock."""
        intervals, waits, sent = clock.intervals(), p2p.waits, p2p.sent_at
        offset = self.clock_offset
        rows = []
        for action in schedule.actions[self.rank]:
            worker, i = self.workers[action.stage], action.microbatch
            start, end = intervals[action]
            wait = waits.get(action, (math.nan, math.nan))
            loss = worker.losses[i] if action.kind is Kind.F and worker.is_last else math.nan
            rows.append([start + offset, end + offset, wait[0] + offset, wait[1] + offset,
                         sent.get(action, math.nan) + offset,
                         worker.saved_bytes[i] if action.kind is Kind.F else math.nan,
                         worker.recomputed_bytes.get(i, 0) if action.kind in GRADIENT_KINDS else math.nan,
                         worker.for_w_bytes[i] if action.kind in NARROWING_KINDS else math.nan, float(loss)])
        return rows

    def _place_observed(self, observer: MemoryObserver, clock: ActionClock) -> list[tuple]:
        """This rank's observed memory changes on rank 0's clock: its own clock shifted on a CPU, else
        placed in the actions' CUDA-event intervals (rules in `runtime/memory_observer.py`)."""
        if self.device.type != "cuda":
            return observer.place({}, {}, shift=self.clock_offset)
        intervals = clock.intervals()
        start = {a: begin + self.clock_offset for a, (begin, _) in intervals.items()}
        end = {a: finish + self.clock_offset for a, (_, finish) in intervals.items()}
        return observer.place(start, end)

    def _losses(self, records: list[StepRecord]) -> list[float]:
        """The last stage's micro-batch losses, from the records of the rank that runs it."""
        last = self.n_stages - 1
        rank = self.schedule.device_of_stage()[last]
        column = COLUMNS.index("loss")
        at = {a: k for k, a in enumerate(self.schedule.actions[rank])}
        return [records[rank].rows[at[Action(Kind.F, last, i)]][column] for i in range(self.n_microbatches)]

    def _trace(self, records: list[StepRecord], schedule: Schedule, p2p: PointToPointTransport) -> Trace:
        """The step's Trace from every rank's records."""
        rows = schedule.actions
        values = {a: records[d].rows[k] for d, row in enumerate(rows) for k, a in enumerate(row)}
        observed = [change for record in records for change in record.observed]
        device_of = {a: d for d, row in enumerate(rows) for a in row}
        origin = min(v[0] for v in values.values())
        events, waits, messages = [], [], []
        for action, (start, end, wait_start, wait_end, *_rest) in values.items():
            device = device_of[action]
            events.append(Event(action.kind, action.stage, action.microbatch, start - origin, end - origin, device))
            if not math.isnan(wait_start):
                waits.append(Wait(device, wait_start - origin, wait_end - origin, action))
                source = p2p.routes.producer(action)
                messages.append(Message(device_of[source], device, values[source][4] - origin, wait_end - origin, source))
        events.sort(key=lambda e: (e.start, e.device))
        column = {name: k for k, name in enumerate(COLUMNS)}
        gradient_kind = schedule.gradient_kind
        memory = activation_samples(
            events, lambda s, i: values[Action(Kind.F, s, i)][column["saved_bytes"]],
            lambda s, i: values[Action(gradient_kind[s], s, i)][column["recomputed_bytes"]], schedule.n_devices,
            lambda s, i: values[Action(Kind.I, s, i)][column["for_w_bytes"]])
        # before the first action (receives posted at the start of the step): at the step's start
        observed = [(max(t - origin, 0.0), *rest) for t, *rest in observed]
        memory += observed_samples(observed, schedule.n_devices)
        names = [f"rank {d} ({self.device.type})" for d in range(self.world_size)]
        trace = Trace(events, memory, "measured", self.n_stages, self.n_microbatches, schedule.n_devices,
                      schedule.name, names, waits, messages, n_processes=self.world_size,
                      observed_peak_parts=observed_breakdown(observed, schedule.n_devices))
        return trace

