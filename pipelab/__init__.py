"""pipelab: understand pipeline parallelism by running it.

    import pipelab as pl
    model = pl.models.mlp(depth=8, width=256, seed=0)
    pipe = pl.Pipeline(model, n_stages=4, n_microbatches=8, schedule="1f1b", loss_fn=torch.nn.MSELoss())
    result = pipe.step(x, y)        # result.loss, result.trace
    pl.plot.timeline(result.trace)

This file is the public face: it re-exports, nothing else.  The flow lives in the
subpackages (docs/architecture.md): schedules (the IR) → predict → runtime → show, with
model (what a stage computes) beside prediction, course (the lessons' helpers) on top, and
common at the bottom.
"""

import importlib

from . import schedules
from .about import __version__, about, describe
from .common.errors import PipelineError, ScheduleError
from .model import microbatch, models
from .model.partition import Partition, split
from .model.reference import max_gradient_difference, single_device_gradients
from .predict.budget import DeviceMemory, MemoryBudgetError, check_memory_budget, device_memory
from .predict.costs import Costs
from .predict.layout import Layout
from .predict.planner import Plan, PlanRow, TransformerSpec, plan
from .predict.profiled_model import ProfiledModel
from .predict.schedule_search import search_schedule
from .predict.simulate import simulate
from .runtime.checkpoints.checkpoint import CheckpointError
from .runtime.distributed import DistributedPipeline
from .runtime.local import Pipeline
from .runtime.step import StepResult
from .runtime.options import PipelineOptions
from .runtime.training_run import TrainingRun, TrainOptions, train
from .runtime.launcher.processes import DistributedError
from .schedules.action import Action
from .schedules.schedule import Schedule
from .schedules.trace import Event, MemorySample, Message, Trace, Wait

LAZY = {  # pl.<name> -> its module, imported when first asked for (matplotlib and ipywidgets are slow to load)
    "plot": "show.plot", "widgets": "show.widgets",
    "distributed": "distributed",
    "closed_forms": "predict.closed_forms", "communication": "predict.communication",
    "hybrid_costs": "predict.hybrid_costs",
    "pipedream": "schedules.pipedream", "warmup_depth": "schedules.warmup_depth",
    "split_backward": "model.split_backward", "threads": "common.threads",
    **{name: f"course.{name}" for name in ("applications", "balance", "capstone", "compare_engines", "fastest",
                                           "glossary", "grade", "gradients", "hybrid_lesson", "phases", "pipedream_run",
                                           "quiz", "sync_async")},
}


def __getattr__(name):
    if name in LAZY:
        return importlib.import_module(f"{__name__}.{LAZY[name]}")
    raise AttributeError(f"module 'pipelab' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(LAZY))


__all__ = [
    "__version__", "Action", "CheckpointError", "Costs", "DeviceMemory", "DistributedError", "DistributedPipeline",
    "Event", "Layout", "MemoryBudgetError", "MemorySample", "Message", "Partition", "Pipeline", "PipelineError",
    "PipelineOptions", "TrainOptions", "TrainingRun", "train",
    "Schedule", "ScheduleError", "StepResult", "Trace", "Wait", "about", "check_memory_budget", "describe",
    "device_memory", "max_gradient_difference", "microbatch", "models",
    "Plan", "PlanRow", "ProfiledModel", "TransformerSpec", "plan",
    "schedules", "search_schedule", "simulate", "single_device_gradients", "split", *LAZY,
]
