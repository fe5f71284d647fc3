"""pipelab: understand pipeline parallelism by running it.

    import pipelab as pl
    model = pl.models.mlp(depth=8, width=256, seed=0)
    pipe = pl.Pipeline(model, n_stages=4, n_microbatches=8, schedule="1f1b", loss_fn=torch.nn.MSELoss())
    result = pipe.step(x, y)        # result.loss, result.trace
    pl.plot.timeline(result.trace)
"""

from . import microbatch, models, schedules
from .about import about, describe
from .actions import Action, Schedule
from .errors import PipelineError, ScheduleError
from .costs import Costs
from .layout import Layout
from .partition import Partition, split
from .reference import max_gradient_difference, single_device_gradients
from .runtime.local import Pipeline, StepResult
from .runtime.distributed import DistributedPipeline
from .runtime.processes import DistributedError
from .runtime.checkpoint import CheckpointError
from .simulate import simulate
from .trace import Event, MemorySample, Message, Trace, Wait

__version__ = "0.1.0"


def __getattr__(name):  # matplotlib and ipywidgets are imported only when asked for
    if name in ("plot", "widgets", "distributed", "compare_engines", "quiz", "balance", "communication", "fastest",
                "gradients", "phases", "pipedream", "split_backward", "warmup_depth", "pipedream_run", "sync_async",
                "hybrid_costs", "hybrid_lesson"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'pipelab' has no attribute {name!r}")


__all__ = [
    "Action", "CheckpointError", "Costs", "Layout", "DistributedError", "DistributedPipeline", "Event", "Message", "Wait", "compare_engines", "distributed", "simulate", "about", "describe", "max_gradient_difference", "single_device_gradients", "MemorySample", "Partition", "Pipeline", "PipelineError", "Schedule", "ScheduleError",
    "StepResult", "Trace", "microbatch", "models", "plot", "quiz", "schedules", "split",
]
