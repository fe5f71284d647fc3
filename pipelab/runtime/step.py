"""What a training step is, whatever carries its messages: written once for the local and distributed engines.

Preparation (the schedule validated for p and m, one `StageWorker` per stage this process
runs, the batch cut into micro-batches), the loss weights, and the finish (the step's loss,
as a `StepResult`).  Micro-batch i's mean loss counts n_i / N, so the summed gradients are
those of the mean loss over the whole batch:

    mean over N samples = sum_i (n_i / N) * (mean over micro-batch i)

or, with loss_normalization="tokens", c_i / C over counted tokens (`model/token_weights.py`).

An asynchronous schedule (PipeDream) gives each micro-batch weight 1: its own minibatch.
Each engine supplies devices, a transport and a clock (`runtime/local.py`,
`runtime/distributed.py`).  Details: docs/engines.md, "What a step is".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

import torch
from torch import nn

from ..model import loss_check, microbatch
from ..model.named_split import model_loss
from ..model.partition import Partition, split
from ..model.token_weights import token_weights
from ..schedules import by_name, validate
from ..schedules.action import Kind
from ..schedules.schedule import Schedule
from ..schedules.trace import Trace
from .loop import StagePolicy, StageWorker
from .weight_stash import WeightStash


@dataclass
class StepResult:
    """One training step's outcome.  `trace` is built from the step's records when first read, off the
    step's own path (`benchmarks/vs_torch_pipelining.py` times steps that never read it); a pickled
    result carries the trace itself."""

    loss: float  # mean loss over the whole batch
    microbatch_losses: list[float]
    wall_seconds: float  # host time for the whole step, engine overhead included
    op_seconds: float  # sum of the measured durations of all actions
    build_trace: Callable[[], Trace] = field(repr=False, compare=False)

    @cached_property
    def trace(self) -> Trace:
        return self.build_trace()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "trace": self.trace, "build_trace": None}


@dataclass
class InferenceResult:
    output: Any  # the last stage's outputs, merged in micro-batch order: what model(inputs) returns
    trace: Trace  # E actions only; `trace.latencies`, `trace.throughput`
    wall_seconds: float  # host time for the whole pass


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # the prompts followed by the new tokens: (batch, prompt length + new_tokens)
    trace: Trace  # one G per (stage, round, lane); micro-batch index round * lanes + lane
    new_tokens: int  # per sequence

    @property
    def tokens_per_second(self) -> float:
        """New tokens of every sequence over the trace's time: batch · new_tokens / makespan."""
        return self.tokens.shape[0] * self.new_tokens / self.trace.makespan if self.trace.makespan else 0.0


def check_generation(prompts: Any, new_tokens: int, lanes: int) -> None:
    """Token ids shaped (batch, prompt length), and positive counts of new tokens and lanes (at most one lane
    per prompt)."""
    if not isinstance(prompts, torch.Tensor) or prompts.dim() != 2 or prompts.dtype not in (torch.int32, torch.int64):
        raise TypeError("prompts are token ids shaped (batch, prompt length), an integer tensor")
    for name, value in (("new_tokens", new_tokens), ("lanes", lanes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if lanes > prompts.shape[0]:
        raise ValueError(f"{lanes} lanes need at least {lanes} prompts, got {prompts.shape[0]}")


def merged_outputs(outputs: list) -> Any:
    """The micro-batches' outputs of a forward-only pass joined along the batch (`microbatch.merge`)."""
    try:
        return microbatch.merge(outputs)
    except RuntimeError as error:
        raise ValueError(f"cannot join the micro-batches' outputs into one batch ({error}): does the model return a "
                         "scalar per micro-batch, such as a loss? For inference, build the pipeline with a sample "
                         "without labels, so that the model returns only its outputs") from error


def check_loss_fn(loss_fn, traced: bool = False) -> None:
    """`loss_fn` is a callable(output, target) with a mean reduction, or None for a `traced` model (split by
    names) that computes its own loss (`model_loss`: output.loss)."""
    if loss_fn is None and not traced:
        raise TypeError("a pipeline needs loss_fn=<callable(output, target) -> mean loss of the micro-batch>; "
                        "loss_fn=None (the model's own output.loss) is for a model split by names")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError("loss_fn is a callable(output, target) -> the mean loss of the micro-batch, or None when "
                        f"the model computes its own loss (output.loss), got {type(loss_fn).__name__}")
    if getattr(loss_fn, "reduction", "mean") != "mean":
        raise ValueError(
            f"loss_fn has reduction={loss_fn.reduction!r}; pipelab weights each micro-batch's mean loss by its "
            "size, so the loss must use reduction='mean'"
        )


def check_microbatch_count(n_microbatches) -> None:
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"n_microbatches must be a positive int, got {n_microbatches!r}")


def resolve_schedule(schedule: str | Schedule, n_microbatches: int, *, n_stages: int | None = None,
                     n_devices: int | None = None) -> Schedule:
    """A schedule name built for the pipeline (n_stages stages, or one per device of n_devices), or a given
    `Schedule` checked against what the pipeline has (its stages, its devices, its micro-batches), then
    validated."""
    if isinstance(schedule, str):
        schedule = by_name(schedule, n_stages if n_stages is not None else n_devices, n_microbatches)
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a name or a pipelab Schedule, got {type(schedule).__name__}")
    if n_stages is not None and (schedule.n_stages, schedule.n_microbatches) != (n_stages, n_microbatches):
        raise ValueError(f"the schedule is for {schedule.n_stages} stages x {schedule.n_microbatches} "
                            f"micro-batches, but the pipeline has {n_stages} x {n_microbatches}")
    if n_devices is not None and schedule.n_devices != n_devices:
        raise ValueError(f"the schedule has {schedule.n_devices} devices but the process group has "
                            f"{n_devices} ranks; start one rank per device ({schedule.n_devices} processes)")
    if schedule.n_microbatches != n_microbatches:
        raise ValueError(f"the schedule is for {schedule.n_microbatches} micro-batches, but "
                            f"n_microbatches={n_microbatches}")
    return validate(schedule)


def make_workers(schedule: Schedule, partition: Partition, stages: list[int], options, checkpoint: list[bool],
                 device_of: Callable[[int], Any], rank: int | None = None) -> dict[int, StageWorker]:
    """One `StageWorker` for each of `stages`, its backward policy read from the schedule: split where the
    stage runs I and W, a `WeightStash` on every stage with parameters of an asynchronous schedule
    (`options.optimizer` builds each stage's own optimizer, and is needed exactly then).  The loss's output and
    target shapes are checked where it is taken (`model/loss_check.py`)."""
    optimizer = options.optimizer
    if not schedule.asynchronous and optimizer is not None:
        every = f" (and its update_every={schedule.update_every})" if schedule.update_every != 1 else ""
        raise ValueError(f"optimizer={every} is for asynchronous schedules (pipedream-async), whose stages update "
                         f"during the step, but the schedule {schedule.name!r} is synchronous: for PipeDream pass "
                         "schedule=pl.schedules.pipedream_async(p, m, update_every=k); with this schedule, step your "
                         "optimizer after pipe.step()")
    if schedule.asynchronous and (optimizer is None or not callable(optimizer)):
        raise TypeError("an asynchronous schedule updates each stage's weights during the step: pass "
                        "optimizer=<callable(params) -> torch.optim.Optimizer>, e.g. lambda ps: torch.optim.SGD(ps, lr=0.1)")
    splits = [kind is Kind.I for kind in schedule.gradient_kind]
    if schedule.asynchronous and any(splits):
        raise ValueError("an asynchronous schedule with W actions: weight stashing runs whole backwards only")

    loss_fn = _own_loss if options.loss_fn is None else loss_check.checked(options.loss_fn)

    def stash(module: nn.Module) -> WeightStash | None:  # a stage without parameters has no versions to keep
        has_parameters = next(iter(module.parameters()), None) is not None
        if not (schedule.asynchronous and has_parameters):
            return None
        return WeightStash(module, optimizer, schedule.update_every)

    def policy(s: int) -> StagePolicy:
        return StagePolicy(loss_fn, checkpoint[s], splits[s], stash(partition.stages[s]), options.fused_accumulation)

    return {s: StageWorker(s, partition.stages[s], partition.bounds[s], schedule.n_stages, device_of(s), policy(s),
                           rank=rank)
            for s in stages}


def _own_loss(output: Any, target: Any):
    return model_loss(output)


def build_partition(model: nn.Module, n_stages: int, n_microbatches: int, split_method: str | Partition,
                    split_points: list[str] | None, sample: Any, threads: int | None) -> Partition:
    """The stages: a given `Partition`, a split by names traced on the first micro-batch of `sample` (the
    whole batch), or `split(model, n_stages, split_method)` of an `nn.Sequential`."""
    if isinstance(split_method, Partition):
        if split_points is not None:
            raise ValueError("give either a Partition or split_points, not both")
        partition = split_method
    elif split_points is not None or not isinstance(model, nn.Sequential):
        if sample is None:
            raise ValueError("split_points traces the model's forward: pass sample=<a whole batch, as the model's "
                             "keyword arguments>, e.g. {'input_ids': ..., 'labels': ...}; its first micro-batch is traced")
        partition = split(model, n_stages, split_method, microbatch.split(sample, n_microbatches)[0], threads=threads,
                          split_points=split_points)
    else:
        partition = split(model, n_stages, split_method, sample, threads=threads)
    if len(partition) != n_stages:
        raise ValueError(f"the partition has {len(partition)} stages, not n_stages={n_stages}")
    return partition


def unique_parameters(modules: list[nn.Module]) -> list[nn.Parameter]:
    """The parameters of `modules`, in order, each once (a parameter several stages use is one tensor)."""
    seen: set[int] = set()
    return [p for module in modules for p in module.parameters() if not (id(p) in seen or seen.add(id(p)))]


def shared_parameters(stages: list[nn.Module], model: nn.Module) -> dict[str, list[int]]:
    """{name in `model`: the stages that use it} for every parameter more than one stage uses (a tied
    embedding: the input embedding on the first stage, the output projection on the last)."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    users: dict[int, list[int]] = {}
    for s, stage in enumerate(stages):
        for p in stage.parameters():
            users.setdefault(id(p), []).append(s)
    return {name_of.get(key, "?"): sorted(set(found)) for key, found in users.items() if len(set(found)) > 1}


def check_shared_devices(partition: Partition, devices: list) -> None:
    """One process holds a shared parameter once: the stages that use it must be on one device."""
    seen: dict[int, tuple[int, Any]] = {}
    for s, stage in enumerate(partition.stages):
        for name, p in stage.named_parameters():
            first = seen.setdefault(id(p), (s, devices[s]))
            if first[1] != devices[s]:
                raise ValueError(f"stages {first[0]} and {s} share the parameter {name} (a tied weight) but run on "
                                 f"{first[1]} and {devices[s]}: one process keeps it once, so put them on one device, "
                                 "or run one rank per device with pl.DistributedPipeline, which keeps a synchronised "
                                 "copy on each")


def check_traced(partition: Partition, model: nn.Module, input_chunks: list) -> None:
    """A split by names runs graphs traced in one mode (train or eval), on micro-batches with the sample's keys
    and dtypes: the model must be in that mode, and a step's micro-batches of shapes no graph accepts are traced
    now, before any action (`model/traced_shapes.py`; every rank is given the same batch, so every rank traces
    the same)."""
    if partition.traced_for is None:
        return
    if model.training != partition.traced_for.training:
        mode = "train" if partition.traced_for.training else "eval"
        raise ValueError(f"the stages were traced in {mode} mode (dropout and BatchNorm are fixed in the graph), "
                         f"but the model is now in {'train' if model.training else 'eval'} mode: build the "
                         "pipeline again after model.train() / model.eval()")
    partition.traced_for.prepare(input_chunks)


def batch_size(inputs: Any, targets: Any) -> int:
    """The samples in one step's batch, the same in its inputs and its targets (if any: None when the model
    takes its labels among its inputs)."""
    total = microbatch.batch_size(inputs)
    if targets is not None and microbatch.batch_size(targets) != total:
        raise ValueError(f"inputs hold {total} samples but targets hold {microbatch.batch_size(targets)}")
    return total


def cut_batch(inputs: Any, targets: Any, n_microbatches: int, asynchronous: bool,
              count_tokens: Callable | None = None) -> tuple[list, list, list[float]]:
    """(input chunks, target chunks, loss weights) of one step's batch (module docstring); with `count_tokens`
    (loss_normalization="tokens") the weights are c_i / C (`model/token_weights.py`)."""
    total = batch_size(inputs, targets)
    input_chunks = microbatch.split(inputs, n_microbatches)
    target_chunks = [None] * n_microbatches if targets is None else microbatch.split(targets, n_microbatches)
    weights = [size / total for size in microbatch.sizes(total, n_microbatches)]
    if count_tokens is not None:
        weights = token_weights([count_tokens(x, y) for x, y in zip(input_chunks, target_chunks)])
    if asynchronous:  # each micro-batch is one of PipeDream's minibatches: its own mean loss
        weights = [1.0] * n_microbatches
    return input_chunks, target_chunks, weights


def step_loss(weights: list[float], losses: list[float], asynchronous: bool) -> float:
    """The step's loss: Σ_i w_i · loss_i (the batch mean), or the minibatches' mean when asynchronous."""
    return sum(w * loss for w, loss in zip(weights, losses)) / (len(losses) if asynchronous else 1)
