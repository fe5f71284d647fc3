"""`pl.distributed`: one process per pipeline device, on `torch.distributed`.

    outs = pl.distributed.launch(fn, 2, *args, timeout_seconds=120)   # fn(*args) on 2 local ranks
    pipe = pl.DistributedPipeline(model, n_microbatches=8, schedule="1f1b", loss_fn=loss)  # inside fn

`launch` is for notebooks and tests; `torchrun --nproc-per-node N -m pipelab.launch ...`
and `pipelab run --backend distributed --nproc N ...` run the same engine from a shell.
"""

from .runtime.checkpoints.checkpoint import load_into_model as load_checkpoint
from .runtime.distributed import DistributedPipeline
from .runtime.launcher.processes import DistributedError, Interrupted, launch

__all__ = ["DistributedError", "DistributedPipeline", "Interrupted", "launch", "load_checkpoint"]
