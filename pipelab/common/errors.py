"""The exceptions pipelab raises on purpose.

Every error a learner can cause names the problem in plain words.  They subclass
`ValueError` too, so code that already catches bad values keeps working.
"""


class PipelineError(ValueError):
    """A pipeline that cannot run as asked (bad settings, a schedule the engine cannot execute)."""


class ScheduleError(PipelineError):
    """A schedule that is not valid: a missing or repeated action, or a dependency that can never be met."""


class LostRankError(PipelineError):
    """This rank's message exchange with rank `lost_rank` failed: that rank died, or timed out first."""

    def __init__(self, message: str, lost_rank: int | None):
        super().__init__(message)
        self.lost_rank = lost_rank
