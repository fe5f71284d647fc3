"""This rank's stages of a pipeline that runs one process per device (`pl.DistributedPipeline`).

Every rank builds the same full model (from its seed), keeps only the blocks of its own
stage(s) (the others moved to the "meta" device, `shared_parameters.keep_own_stages`), and runs
device d's list, `schedule.actions[d]`, with the `torch.distributed` transport (`p2p.py`).  Each
rank's wall clock is put on rank 0's by `clock_sync.estimate_offset`; at the end of each step
the ranks exchange their rows (`exchange.py`), so every rank returns the same complete Trace
and the same loss.  A hybrid layout adds tensor and data parallelism around it on a ("dp",
"pp", "tp") DeviceMesh (`hybrid.py`): the stages' blocks parallelized over "tp", a
scatter/gather transport at the boundaries, each replica's share of the batch, and the
gradients all-reduced over "dp".

Details: docs/distributed.md, "How a rank runs a step".
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..common.errors import PipelineError
from ..common.gc_pause import gc_paused
from ..common.threads import intra_op_threads
from ..model import microbatch
from ..model.named_split import repeated_blocks
from ..model.partition import Partition, balanced_bounds, named_block_costs, points_at, points_for, split
from ..predict.budget import check_memory_budget
from ..predict.layout import Layout
from ..schedules.action import Action, Kind
from ..schedules.schedule import Schedule
from . import auto_choice, clipping, comm_count, engine_costs, fingerprint, peers
from .clock import ActionClock
from .clock_sync import estimate_offset
from .exchange import StepExchange, StepRecord
from .fsdp_stages import ShardedStages
from .launcher import progress
from .link_probe import measure_link
from .hybrid import HybridMesh, ScatterGatherTransport, all_reduce_gradients, check_plans, local_shard, parallelize
from .loop import StageWorker, Transport
from .memory_observer import MemoryObserver
from .options import PipelineOptions
from .p2p import PointToPointTransport
from .shared_parameters import SharedParameters, keep_own_stages
from .step import batch_size, build_partition, make_workers, resolve_schedule, unique_parameters
from .trace_builder import PlaceObserved, action_row, readings


class RankPlacement:
    """Rank d of the pipeline's group runs device d of the schedule (module docstring)."""

    def __init__(self, options: PipelineOptions, devices: Any, group, layout: Layout | None,
                 tensor_parallel_plan: Callable | None, hybrid: bool, shard: str | None = None,
                 reshard_after_forward: bool = True):
        if not (dist.is_available() and dist.is_initialized()):
            raise PipelineError("DistributedPipeline runs inside a process group: start it with torchrun "
                                "(torchrun --nproc-per-node 2 -m pipelab.launch ...) or pl.distributed.launch(fn, 2)")
        self.options, self.plan_fn, self.hybrid, self.on_mesh = options, tensor_parallel_plan, None, hybrid
        self.shard, self.reshard_after_forward, self.sharded = shard, reshard_after_forward, None
        agreeing = group if group is not None else dist.group.WORLD  # the ranks that compare their configuration
        # a plain pipeline is the layout (dp, pp, tp) = (1, world, 1), without a mesh
        self.layout = layout if layout is not None else Layout(pp=dist.get_world_size(agreeing))
        self.agreeing, self.group = agreeing, group
        self.backend = dist.get_backend(agreeing)
        self.device = self._resolve_device(devices)
        self.devices = [self.device]
        self.threads = options.threads if self.device.type == "cpu" else None
        self._transports: dict[int, tuple[Schedule, Any, PointToPointTransport, StepExchange | None]] = {}

    # -- building -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def context(self):
        """Where this rank's work runs: its intra-op threads on a CPU, its GPU as the current device on CUDA
        (NCCL's calls use it); both restored on exit, so the caller's settings are never changed for good.  A
        collective that times out because a rank stalled names that rank (`peers.naming_the_stalled`)."""
        where = torch.cuda.device(self.device) if self.device.type == "cuda" else intra_op_threads(self.threads)
        with where, peers.naming_the_stalled(dist.get_rank() if dist.is_initialized() else 0):
            yield

    def resolve_schedule(self, n_microbatches: int | None = None) -> Schedule:
        """The options' schedule for this placement (for `n_microbatches`, default the options')."""
        m = self.options.n_microbatches if n_microbatches is None else n_microbatches
        return resolve_schedule(self.options.schedule, m, n_devices=self.layout.pp)

    def twin(self, options: PipelineOptions) -> "RankPlacement":
        """A plain placement on the same ranks and device for other options (`engine_costs.py` runs one)."""
        return RankPlacement(options, self.device, self.group, None, None, False)

    def decide(self, model: nn.Module, engine: Callable[..., dict]):
        """split_method="auto" / schedule="auto": what the engine adds to each action and message measured by
        running it over tiny blocks (`engine(p, families)`, `engine_costs.py`), the link's bandwidth between
        ranks 0 and 1 (`link_probe.py`), then every rank measures the model at once (each core timed under the
        others' load, as in a step: ranks sharing a machine share its memory bandwidth) and decides
        (`auto_choice.py`, interleaved schedules included); every rank receives rank 0's plan and applies its
        choice, so all build the same pipeline.  A failure on rank 0 is raised on every rank with its words."""
        if self.layout.tp > 1 or self.layout.dp > 1:
            raise ValueError("split_method='auto' and schedule='auto' decide for a plain pipeline (one stage per rank, "
                             "or two with an interleaved schedule); with tensor or data parallelism give the cut "
                             "('uniform', 'params' or a Partition) and a schedule name")
        measured = engine(self.layout.pp, engine_costs.FAMILIES)  # the engine's own costs, over tiny blocks
        latency, bandwidth = measure_link(self.agreeing, self.device)
        decided: list = [None, None]
        failure = None
        try:
            decided[0] = auto_choice.decide_options(model, self.options, self.layout.pp, interleave=True,
                                                    latency=latency, bandwidth=bandwidth, engine=measured)
        except Exception as error:  # the other ranks wait for rank 0's plan: tell them, then raise it here
            failure, decided[1] = error, f"{type(error).__name__}: {error}"
        dist.broadcast_object_list(decided, group_src=0, group=self.agreeing)
        if failure is not None:
            raise failure
        if decided[1] is not None:
            raise ValueError(f"rank 0 could not decide the cut and schedule: {decided[1]}")
        plan, choice = decided[0]
        self.options = auto_choice.apply(choice, model, self.options)
        return plan, self.options

    def build(self, model: nn.Module, schedule: Schedule,
              checkpoint: list[bool]) -> tuple[Partition, dict[int, StageWorker]]:
        """Agree with the other ranks, cut the model, keep this rank's stages, parallelize them under TP; their
        workers."""
        options = self.options
        # the first communication: the ranks agree on the configuration (`fingerprint.py`)
        sharding = {"shard, reshard_after_forward": f"{self.shard!r}, {self.reshard_after_forward}"}
        fingerprint.agree({**fingerprint.fields(schedule, options.n_microbatches, self.layout, model,
                                                options.loss_normalization), **sharding}, self.agreeing, self.device)
        if self.on_mesh:
            self.hybrid = HybridMesh.build(self.layout, dist.get_backend())
            self.group = self.hybrid.group("pp")
        self.group = self.group if self.group is not None else dist.group.WORLD
        peers.start()  # a heartbeat the other ranks read, to name this one if it stalls (peers.py)
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.schedule, self.n_stages = schedule, schedule.n_stages
        self.partition = partition = self._partition(model, schedule)
        if self.layout.tp > 1:  # every stage's plans, on every rank: a width tp does not divide fails on all alike
            check_plans(partition, self.plan_fn, self.layout.tp)
        fingerprint.agree(fingerprint.cut_fields(partition, model), self.agreeing, self.device)
        device_of_stage = schedule.device_of_stage()
        self.stages = sorted(s for s, d in device_of_stage.items() if d == self.rank)
        self.shared = SharedParameters(partition.stages, model, device_of_stage, self.group, self.rank,
                                       None if self.hybrid is None else self.hybrid.pipelines())
        keep_own_stages(model, partition.stages, self.stages, self.device)  # the other ranks' tensors: freed
        workers = make_workers(schedule, partition, self.stages, options, checkpoint, lambda s: self.device,
                               rank=self.rank)
        if schedule.asynchronous and self.hybrid is not None:
            raise ValueError("an asynchronous schedule (PipeDream) updates each stage's weights inside its "
                             "backwards; it does not run with tensor or data parallelism")
        self.row_orders: dict[str, torch.Tensor] = {}  # parameter name -> the row order tp_plans gave it
        if self.layout.tp > 1:
            self.row_orders = parallelize(self.stages, partition, self.plan_fn, self.hybrid.mesh["tp"])
            for s in self.stages:  # the worker leaves its parameters' storages out of the activation bytes: the shards
                workers[s].use_parameters([local_shard(p) for p in partition.stages[s].parameters()])
        if self.shard == "fsdp":
            self.sharded = shard_stages(model, partition, self.stages, workers, self.hybrid, self.shared,
                                        self.reshard_after_forward)
        self.clock_offset, self.clock_error = estimate_offset(self.group, self.rank, self.world_size, self.device)
        return partition, workers

    def _partition(self, model: nn.Module, schedule: Schedule) -> Partition:
        options, n_stages = self.options, schedule.n_stages
        timed = options.split_method == "time" and options.split_points is None
        if self.hybrid is not None:
            if options.split_points is not None and self.layout.tp > 1:
                raise ValueError("split_points (a model split by names) runs with data parallelism, not tensor "
                                 "parallelism: that needs pl.models' blocks and their plans")
            if options.split_method == "time":
                raise ValueError('split_method="time" is not supported with a hybrid layout (each pipeline would '
                                 'time its own blocks and could cut elsewhere); use "uniform", "params" or a Partition')
        if timed and options.sample is None:
            raise ValueError('split_method="time" measures each block, so pass sample=<an input batch>')
        split_points = options.split_points
        if timed and isinstance(model, nn.Sequential):
            split(model, n_stages, "uniform")  # the same checks on every rank, before any communication
            costs = self._costs_from_rank_0(len(model),
                                            lambda: split(model, n_stages, "time", options.sample).block_costs)
            bounds = balanced_bounds(costs, n_stages)
            partition = Partition(bounds, [model[a:b] for a, b in bounds], "time", costs)
        else:
            if timed:  # a model split by names: its repeated blocks timed on rank 0 on the first micro-batch
                name, blocks = repeated_blocks(model)
                points_for(model, n_stages, "uniform")  # the same checks on every rank, before any communication
                first = microbatch.split(options.sample, options.n_microbatches)[0]
                costs = self._costs_from_rank_0(len(blocks), lambda: named_block_costs(model, first, self.threads))
                split_points = points_at(name, balanced_bounds(costs, n_stages))
            partition = build_partition(model, n_stages, options.n_microbatches, options.split_method, split_points,
                                        options.sample, self.threads)
        if len(partition) != n_stages:
            raise ValueError(f"the partition has {len(partition)} stages, the schedule {n_stages}")
        return partition

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

    def check_plain(self, what: str) -> None:
        """Forward only and generation run a plain pipeline: no tensor or data parallelism."""
        if self.hybrid is not None:
            raise ValueError(f"{what} runs a plain pipeline (one stage per rank, or an interleaved schedule's several), "
                             "without tensor or data parallelism; build a DistributedPipeline without them for it")

    def parameters(self) -> list[nn.Parameter]:
        return unique_parameters([self.partition.stages[s] for s in self.stages])

    # -- a step -----------------------------------------------------------------------------------
    def share(self, inputs: Any, targets: Any, count_tokens) -> tuple[Any, Any, float]:
        """This replica's share of the batch under data parallelism, and its weight n_r / N (or C_r / C); first,
        the ranks check that they were given the same batch (`fingerprint.batch_fields`)."""
        report = progress.reporter()
        if report is not None:  # a rank that never comes is named with where this one waited
            report.set("waiting", f"the start of step {report.steps + 1}", "the other ranks, to compare the batch")
        fingerprint.agree_quickly(fingerprint.batch_fields(inputs, targets), self.agreeing, self.device,
                                  fingerprint.BATCH_ADVICE)
        d, m = self.layout.dp, self.options.n_microbatches
        if d == 1:
            return inputs, targets, 1.0
        total = batch_size(inputs, targets)
        if total < d * m:
            raise ValueError(f"a batch of {total} samples cannot give each of data_parallel={d} replicas "
                             f"{m} micro-batches")
        share = self.hybrid.dp_index
        mine = microbatch.split(inputs, d)[share]
        my_targets = None if targets is None else microbatch.split(targets, d)[share]
        weight = microbatch.sizes(total, d)[share] / total
        if count_tokens is not None:  # every rank has the whole batch: the global count needs no message
            weight = count_tokens(mine, my_targets) / count_tokens(inputs, targets)
        return mine, my_targets, weight

    def combine(self, result, weight: float):
        """Data parallelism: grad <- Σ_r w_r · grad_r (all-reduced, or reduce-scattered into the shards under
        FSDP) and the loss Σ_r w_r · loss_r over the replicas."""
        if self.sharded is not None:  # then a tied weight's shards summed over the ranks that hold it
            self.sharded.reduce_gradients(weight)
            self.shared.all_reduce_gradients()
        if self.layout.dp == 1:
            return result
        dp_group = self.hybrid.group("dp")
        if self.sharded is None:
            all_reduce_gradients(self.parameters(), weight, dp_group)
        loss = torch.tensor([result.loss * weight], dtype=torch.float64, device=self.device)
        with comm_count.label("other"):
            dist.all_reduce(loss, group=dp_group)
        return dataclasses.replace(result, loss=float(loss.item()))

    def transport(self, schedule: Schedule, observer: MemoryObserver | None, signatures: list) -> Transport:
        """`schedule`'s transport (its own tags and receives: one per schedule this pipeline runs), started."""
        _, outer, p2p, _ = self._for(schedule)
        p2p.observer = observer  # before start_step, which posts the first receives
        p2p.start_step(signatures)
        return outer

    def _for(self, schedule: Schedule) -> tuple[Schedule, Any, PointToPointTransport, StepExchange]:
        found = self._transports.get(id(schedule))
        if found is None or found[0] is not schedule:
            p2p = PointToPointTransport(schedule, self.rank, self.group, self.device)
            outer = p2p if self.layout.tp == 1 else ScatterGatherTransport(p2p, self.hybrid.group("tp"),
                                                                           self.layout.tp, self.hybrid.tp_index)
            exchange = StepExchange(self.group, self.rank, self.world_size, self.device, self.backend,
                                    p2p.exchange_tag, n_rows=max(map(len, schedule.actions)))
            found = self._transports[id(schedule)] = (schedule, outer, p2p, exchange)
        return found

    def order(self, schedule: Schedule) -> list[Action]:
        return schedule.actions[self.rank]

    def running(self, schedule: Schedule) -> contextlib.AbstractContextManager:
        """The end-of-step exchange's receives posted now, before the first action (gloo); the garbage collector
        paused: a full collection (~25 ms with torch loaded) on one rank would stall the others."""
        self._for(schedule)[3].post()
        return gc_paused()

    def finish(self, schedule: Schedule, transport: Transport, training: bool) -> None:
        """Every send gone; a tied weight's gradient summed over the ranks that hold it (a training step)."""
        self._for(schedule)[2].finish()
        if training and self.sharded is None:  # sharded: after the reduce-scatter (`combine`)
            self.shared.all_reduce_gradients()
        elif not training and self.sharded is not None:  # the warm-up's gradients never count
            self.sharded.drop_gradients()

    def gather(self, schedule: Schedule, clock: ActionClock, observer: MemoryObserver, transport: Transport,
               workers: dict[int, StageWorker]) -> tuple[dict[Action, list[float]], PlaceObserved]:
        """Every rank's rows, on every rank, on rank 0's clock."""
        _, _, p2p, exchange = self._for(schedule)
        intervals, offset = clock.intervals(), self.clock_offset
        nan = float("nan")
        mine = [action_row(a, workers[a.stage], (*intervals[a], *p2p.waits.get(a, (nan, nan)), p2p.sent_at.get(a, nan)),
                           readings(a, clock, observer), offset)
                for a in schedule.actions[self.rank]]
        records = exchange.gather(StepRecord(mine, self._place_observed(observer, clock)))
        rows = {a: records[d].rows[k] for d, row in enumerate(schedule.actions) for k, a in enumerate(row)}
        observed = [change for record in records for change in record.observed]
        # before the first action (receives posted at the start of the step): at the step's start
        return rows, lambda start, end, origin: [(max(t - origin, 0.0), *rest) for t, *rest in observed]

    def _place_observed(self, observer: MemoryObserver, clock: ActionClock) -> list[tuple]:
        """This rank's observed memory changes on rank 0's clock: its own clock shifted on a CPU, else placed in
        the actions' CUDA-event intervals (rules in `runtime/memory_observer.py`)."""
        if self.device.type != "cuda":
            return observer.place({}, {}, shift=self.clock_offset)
        intervals = clock.intervals()
        start = {a: begin + self.clock_offset for a, (begin, _) in intervals.items()}
        end = {a: finish + self.clock_offset for a, (_, finish) in intervals.items()}
        return observer.place(start, end)

    def trace_labels(self) -> dict:
        return {"replayed": False, "device_names": [f"rank {d} ({self.device.type})" for d in range(self.world_size)],
                "n_processes": self.world_size}

    def activation_budgets(self, driver, inputs: Any, targets: Any) -> dict[int, float]:
        """Before the first step: this rank's parameters, gradients and optimizer state against its limit (a rank
        holds only its own stages, so activations are not predicted); what its activations may then take."""
        limits = driver.memory_limits
        sharding = {} if self.sharded is None else dict(sharded_over=self.layout.dp,
                                                        reshard_after_forward=self.reshard_after_forward)
        needs = check_memory_budget(self.partition, driver.schedule, limits, None, driver.memory_optimizer,
                                    driver.checkpoint, **sharding)
        return {self.rank: limits[self.rank] - needs[self.rank].model_state_bytes}

    def from_last_stage(self, tokens: torch.Tensor | None, rows: int, width: int) -> torch.Tensor:
        """The generated tokens, from the rank of the last stage to every rank."""
        last = dist.get_global_rank(self.group, self.schedule.device_of_stage()[self.n_stages - 1])
        buffer = tokens if tokens is not None else torch.empty(rows, width, dtype=torch.int64)
        buffer = buffer.to(device=self.device, dtype=torch.int64)  # NCCL broadcasts GPU tensors only
        dist.broadcast(buffer, last, group=self.group)
        return buffer.cpu()

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> float:
        """The global norm over the whole model (every stage and rank, tensor-parallel and FSDP shards combined,
        replicated data-parallel replicas once, a parameter several ranks hold once: `SharedParameters.counted_here`), as
        `torch.nn.utils.clip_grad_norm_` on the single-device model (`runtime/clipping.py`); call it on every rank."""
        parameters = self.parameters()
        hybrid = self.hybrid
        coordinates = {} if hybrid is None else {"tp": hybrid.tp_index}
        if self.sharded is not None:  # each replica its shards (replicated DP holds the same: counted once)
            coordinates["dp"] = hybrid.dp_index
        with self.context():
            part = clipping.local_part(self.shared.counted_here(parameters), norm_type, coordinates)
            groups = [self.group] + [hybrid.group(dim) for dim in coordinates if getattr(self.layout, dim) > 1]
            norm = clipping.reduce_norm(part, norm_type, groups, self.device)
        clipping.scale(parameters, max_norm, norm)
        return norm


def shard_stages(model: nn.Module, partition: Partition, stages: list[int], workers: dict[int, StageWorker],
                 hybrid: HybridMesh, shared: SharedParameters, reshard_after_forward: bool) -> ShardedStages:
    """shard="fsdp": this rank's stages fully sharded over "dp" (`fsdp_stages.py`); each worker differentiates
    (split backward) and leaves out of its activation bytes the gathered weights (the tensors FSDP gathers into,
    DTensors under tensor parallelism: their own `.grad` is what FSDP reduce-scatters), runs W with them gathered, and
    fuses no accumulation (FSDP accumulates into the gathered weights' `.grad` itself)."""
    sharded = ShardedStages([partition.stages[s] for s in stages], hybrid.mesh["dp"], reshard_after_forward, model)
    shared.use(dict(model.named_parameters(remove_duplicate=False)))
    for s in stages:
        worker = workers[s]
        worker.use_parameters(sharded.gathered_parameters(partition.stages[s]))
        worker.fusion = None
        worker.run[Kind.W] = sharded.gathered_for(partition.stages[s], worker.run[Kind.W])
    return sharded
