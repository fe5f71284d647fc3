"""The exceptions pipelab raises on purpose.

Every error a learner can cause names the problem in plain words.  They subclass
`ValueError` too, so code that already catches bad values keeps working.
"""


class PipelineError(ValueError):
    """A pipeline that cannot run as asked (bad settings, a schedule the engine cannot execute)."""


class ScheduleError(PipelineError):
    """A schedule that is not valid: a missing or repeated action, or a dependency that can never be met."""
