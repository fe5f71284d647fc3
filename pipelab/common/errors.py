"""The exceptions pipelab raises on purpose.

A configuration mistake (a bad argument, a schedule that cannot run) is a `ValueError` or a
`TypeError` that names the problem; `ScheduleError` is the `ValueError` of an invalid schedule.
A failure while a pipeline runs is a `PipelineError` (a `RuntimeError`): the stage, the action
and the rank added to the original exception, which stays its `__cause__`.  A CUDA
out-of-memory inside a stage stays a `torch.OutOfMemoryError` too (`StageOutOfMemoryError`).
"""

import torch


class PipelineError(RuntimeError):
    """A pipeline failed while it ran: where (stage, blocks, action, rank), and why (`__cause__`)."""


class StageOutOfMemoryError(PipelineError, torch.OutOfMemoryError):
    """A stage ran out of device memory: a `PipelineError` that `except torch.OutOfMemoryError` also catches."""


class ScheduleError(ValueError):
    """A schedule that is not valid: a missing or repeated action, or a dependency that can never be met."""


class LostRankError(PipelineError):
    """This rank's message exchange with rank `lost_rank` failed: that rank died, or timed out first."""

    def __init__(self, message: str, lost_rank: int | None):
        super().__init__(message)
        self.lost_rank = lost_rank


def failure(error: BaseException, message: str) -> PipelineError:
    """The `PipelineError` to raise `from error`: a `StageOutOfMemoryError` for an out-of-memory."""
    return (StageOutOfMemoryError if isinstance(error, torch.OutOfMemoryError) else PipelineError)(message)
