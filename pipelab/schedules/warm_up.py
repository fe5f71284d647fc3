"""The warm-up: one micro-batch through every stage of a schedule, with each stage's own kinds.

PyTorch initialises kernels lazily: the first backward of some ops costs hundreds of
milliseconds.  Before its first timed step an engine runs this one-micro-batch schedule,
untimed, through the same loop and transports as a step: every stage's kinds in its profile's
order (`action.PROFILES`: F then B; F, I then W; E), the ones that wait on the previous stage
(`goes_forward`: F, E) in stage order, the others in reverse.  Every device's list is then a
piece of one global order in which each action's needs come first, so it cannot deadlock.

    device 0 | F0 .  .  B0              a 1F1B or GPipe step's warm-up, p = 2
    device 1 | .  F0 B0 .
"""

from __future__ import annotations

from .action import PROFILES, Action, goes_forward
from .schedule import Schedule


def warm_up_like(schedule: Schedule) -> Schedule:
    """One micro-batch of `schedule`'s stages, profiles and placement (module docstring)."""
    profiles, device_of = schedule.profiles, schedule.device_of_stage()
    stages = range(schedule.n_stages)
    order = ([Action(k, s, 0) for s in stages for k in PROFILES[profiles[s]] if goes_forward(k)]
             + [Action(k, s, 0) for s in reversed(stages) for k in PROFILES[profiles[s]] if not goes_forward(k)])
    rows = [[a for a in order if device_of[a.stage] == device] for device in range(schedule.n_devices)]
    return Schedule(schedule.n_stages, 1, rows, name=f"warm-up of {schedule.name}", meta=dict(schedule.meta))
