"""`PipelineOptions`: what a pipeline does, the same for every engine — written once, checked once.

Both engines take these options as keywords (`pl.Pipeline(model, n_stages=4, n_microbatches=8,
schedule="1f1b", ...)`) or whole (`options=pl.PipelineOptions(...)`, keywords given beside it
override its fields); what differs between them is only *where* the stages run, their
placement parameters (`LocalPlacementArgs`, `RankPlacementArgs`).  A new option is one field here: its
default, its check and its docstring line, and every engine has it.  What can be checked
without the model is checked when the options are made; the rest (a loss function for a model
split by names, checkpointing for p stages, a memory limit for d devices) where the pipeline
is assembled (`runtime/driver.py` and the placements).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
from typing import Any, Callable

from ..common.threads import check_threads
from ..model.finite import check_mode
from ..model.partition import Partition
from ..model.token_weights import NORMALIZATIONS
from ..predict.layout import Layout
from ..schedules.schedule import Schedule
from .fsdp_stages import check_shard
from .step import check_loss_fn, check_microbatch_count

@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalPlacementArgs:
    """`pl.Pipeline`'s own parameters: p stages, and their devices ("auto", "cpu", "cuda", or one per stage)."""

    n_stages: int
    devices: Any = "auto"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankPlacementArgs:
    """`pl.DistributedPipeline`'s own parameters: this rank's device, its process group, and a hybrid layout on a
    ("dp", "pp", "tp") DeviceMesh (`device` is `devices`' old name); `shard="fsdp"` shards each stage over the
    data-parallel replicas with FSDP2, gathering a block's weights for each forward and backward
    (`reshard_after_forward=True`) or once per step (`False`; `runtime/fsdp_stages.py`)."""

    devices: Any = None
    group: Any = None
    tensor_parallel: int = 1
    data_parallel: int = 1
    tensor_parallel_plan: Callable | None = None
    layout: Layout | None = None
    device: Any = None
    shard: str | None = None
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        check_shard(self.shard, self.reshard_after_forward)


LOCAL_PLACEMENT = tuple(f.name for f in dataclasses.fields(LocalPlacementArgs))
RANK_PLACEMENT = tuple(f.name for f in dataclasses.fields(RankPlacementArgs))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineOptions:
    """The options every engine shares.

    Attributes:
        n_microbatches: m.
        schedule: "gpipe", "1f1b", "zb-h1", "interleaved", "pipedream-async" or a `Schedule` (validated).  A stage
            with I and W actions splits each backward: I computes the input gradient only, W the weight gradients
            (`pipelab.model.split_backward`), and a micro-batch is held until its W.
        loss_fn: loss(output, target) returning the *mean* over a micro-batch; None for a model split by names that
            computes its own loss (`output.loss`, with labels in the batch).
        loss_normalization: "samples" (micro-batch i counts n_i / N), "tokens" (c_i / C, its counted tokens: labels
            other than -100; exact for a token-mean loss with padding; `model/token_weights.py`) or "auto" (the
            default: tokens for the model's own loss, loss_fn=None, or a loss with an ignore_index such as
            cross-entropy; samples otherwise).  Samples meeting -100 labels warn, once.
        split_method: "uniform", "params", "time" (needs `sample`) or a ready `Partition`.
        split_points: any `nn.Module` instead of an `nn.Sequential`: the names of the modules where stages begin
            (`model/named_split.py`); `sample` is then a whole batch, as the model's keyword arguments.
        sample: an input batch, for split_method="time" and for split_points.
        checkpoint: activation checkpointing per stage: "never", "always", "except_last" (the last stage runs B
            right after F in 1F1B, so recomputing there saves little) or a list of booleans, one per stage.
        threads: PyTorch intra-op threads while a step runs on a CPU (default 1: timings that hold when something
            else uses a core, and ranks sharing a machine really run in parallel; restored after the step); None
            keeps the caller's.
        optimizer: for an asynchronous schedule ("pipedream-async") only, and needed there: `optimizer(params)`
            builds each stage's own optimizer.  A step is then a PipeDream run: each micro-batch is one minibatch
            with its own mean loss and update, under the weight-stashing rule of `runtime/weight_stash.py`.
        fused_accumulation: each Linear adds its weight gradient into `.grad` inside its multiply instead of
            computing it and adding it after, one pass over the weights fewer per micro-batch
            (`model/fused_accumulation.py`; not with a split backward or weight stashing).  False: autograd's own.
        warm_up: before the first step (and the first forward-only pass), run one micro-batch through every stage,
            untimed, through the same loop and transports (`schedules/warm_up.py`), its gradients, buffers and
            random state left as they were: PyTorch initialises kernels lazily, and the first backward of some ops
            costs hundreds of milliseconds.
        check_finite: NaN and inf in a stage's output or in the loss raise a `PipelineError` naming the stage,
            action, micro-batch (and rank) where they first appear (`model/finite.py`): "first" checks the first
            step (the default), True every step, False none.
        memory_limit_bytes: bytes each device may hold (a number, or one per device; None: no limit).  Before the
            first step each device's parameters, gradients, optimizer state (`memory_optimizer`) and, where every
            stage is in this process, the schedule's predicted activations are added up and a step that would not
            fit is refused, each part named (`pl.check_memory_budget`, docs/memory_budget.md); during every step
            the observed activations and messages are held to what the limit leaves (a `MemoryBudgetError`).
        memory_optimizer: the optimizer whose state counts: "adam" (default), "adamw", "sgd", "momentum",
            "mixed-adam" (ZeRO's 16 bytes per parameter), or a torch optimizer (its real state).
    """

    n_microbatches: int
    schedule: str | Schedule = "1f1b"
    loss_fn: Callable | None = None
    loss_normalization: str = "auto"
    split_method: str | Partition = "uniform"
    split_points: list[str] | None = None
    sample: Any = None
    checkpoint: str | list[bool] = "never"
    threads: int | None = 1
    optimizer: Callable | None = None
    fused_accumulation: bool = True
    warm_up: bool = True
    check_finite: bool | str = "first"
    memory_limit_bytes: float | list[float] | None = None
    memory_optimizer: Any = "adam"

    def __post_init__(self) -> None:
        check_microbatch_count(self.n_microbatches)
        if not isinstance(self.schedule, (str, Schedule)):
            raise TypeError(f"schedule must be a name or a pipelab Schedule, got {type(self.schedule).__name__}")
        check_loss_fn(self.loss_fn, traced=True)  # None is checked against the model when the pipeline is built
        if self.loss_normalization not in NORMALIZATIONS:
            raise ValueError(f"loss_normalization is one of {list(NORMALIZATIONS)}, got {self.loss_normalization!r}")
        if not isinstance(self.split_method, (str, Partition)):
            raise TypeError(f"split_method is a name or a Partition, got {type(self.split_method).__name__}")
        check_threads(self.threads)
        check_mode(self.check_finite)
        for name in ("fused_accumulation", "warm_up"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def traced(self) -> bool:
        """Whether the model is split by module names (its graph traced): `split_points` given."""
        return self.split_points is not None

    @classmethod
    def build(cls, engine: str, placement: type, options: "PipelineOptions | None", settings: dict[str, Any]):
        """A façade's call, read: its `placement` parameters (a `LocalPlacementArgs` or `RankPlacementArgs`), and
        `options` (or the defaults) with the other keywords over them.  A keyword that is neither is a TypeError
        naming the closest one."""
        own = {f.name for f in dataclasses.fields(placement)}
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [key for key in settings if key not in names and key not in own]
        if unknown:
            close = difflib.get_close_matches(unknown[0], [*own, *names], n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise TypeError(f"{engine} got an unknown option {unknown[0]!r}{hint}; its options are "
                            f"{', '.join(names)}, and where it runs: {', '.join(sorted(own))}")
        try:
            where = placement(**{key: value for key, value in settings.items() if key in own})
        except TypeError as error:  # a missing placement parameter (n_stages)
            said = re.sub(r"^[\w.]*__init__[(][)] ", "", str(error))  # "missing 1 required ... 'n_stages'"
            raise TypeError(f"{engine}: {said}") from None
        chosen = {key: value for key, value in settings.items() if key not in own}
        if options is None:
            return cls(**chosen), where
        if not isinstance(options, cls):
            raise TypeError(f"options must be a pl.PipelineOptions, got {type(options).__name__}")
        return (dataclasses.replace(options, **chosen) if chosen else options), where


def engine_signature(placement: type) -> inspect.Signature:
    """A façade's signature: `model`, its `placement` parameters, every option as a keyword with its default, and
    `options` (what `help(pl.Pipeline)` and an editor show; the façade itself takes them as keywords)."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                  inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="nn.Module")]
    for field in [*dataclasses.fields(placement), *dataclasses.fields(PipelineOptions)]:
        default = inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default
        parameters.append(inspect.Parameter(field.name, keyword, default=default, annotation=field.type))
    parameters.append(inspect.Parameter("options", keyword, default=None, annotation="PipelineOptions | None"))
    return inspect.Signature(parameters)
