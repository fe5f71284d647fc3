"""Weight versions of asynchronous PipeDream (`pl.schedules.pipedream_async`): which version each action uses.

The rule (PipeDream, Narayanan et al. SOSP 2019, §3.3, weight stashing), per stage s,
walking stage s's list in order: the live weights start at version 0 and go up by one
after every `update_every`-th B; F(s, i) uses the live version and stashes it; B(s, i)
uses the version stashed by F(s, i).  A stage must keep every version some in-flight
micro-batch (F done, B not yet) still needs, plus its live weights: with update_every = 1
that is p - s versions on stage s in the steady state (each in-flight micro-batch saw a
different one), so stashing costs stage s (p - s - 1) extra copies of its weights.  The
warm-up's w = p - s - 1 forwards share version 0, so with few micro-batches a stage may
hold fewer; m >= 2 w + 1 is enough for stage s to reach p - s.
"""

from __future__ import annotations

from .action import Action, Kind
from .schedule import Schedule


def check_update_every(update_every) -> int:
    """`update_every`, the backwards between two weight updates of a stage, is a positive int (1: an update after
    every backward); anything else is a TypeError or ValueError saying so."""
    if isinstance(update_every, bool) or not isinstance(update_every, int) or update_every < 1:
        error = ValueError if isinstance(update_every, int) and not isinstance(update_every, bool) else TypeError
        raise error(f"update_every (PipeDream's asynchronous schedule: each stage updates its weights after every "
                    f"update_every-th backward) must be a positive int, 1 for an update after every backward; got "
                    f"{type(update_every).__name__} {update_every!r}")
    return update_every


def _update_every(schedule: Schedule, update_every: int | None) -> int:
    return check_update_every(schedule.update_every if update_every is None else update_every)


def weight_versions(schedule: Schedule, update_every: int | None = None) -> dict[Action, int]:
    """{action: the weight version of its stage it runs with}, for every F and B (rule above).

    `update_every` defaults to the schedule's own (`Schedule.update_every`, 1 unless set).  The
    live version of a stage is (B's run so far on it) // update_every.
    """
    every = _update_every(schedule, update_every)
    versions: dict[Action, int] = {}
    for row in schedule.actions:
        backwards: dict[int, int] = {}  # stage -> B's run so far
        for action in row:
            stage = action.stage
            if action.kind is Kind.F:
                versions[action] = backwards.get(stage, 0) // every
            elif action.kind is Kind.B:
                versions[action] = versions[Action("F", stage, action.microbatch)]
                backwards[stage] = backwards.get(stage, 0) + 1
    return versions


def versions_in_flight(schedule: Schedule, update_every: int | None = None) -> list[int]:
    """Per stage, the most weight versions it holds at once: the live one plus every other
    version an in-flight micro-batch (its F done, its B not yet) stashed.  Counted after
    each action, in the stage's list order."""
    every = _update_every(schedule, update_every)
    peak = [0] * schedule.n_stages
    for row in schedule.actions:
        backwards: dict[int, int] = {}  # stage -> B's run so far
        stashed: dict[int, dict[int, int]] = {}  # stage -> {micro-batch: version} in flight
        for action in row:
            stage, mb = action.stage, action.microbatch
            held = stashed.setdefault(stage, {})
            if action.kind is Kind.F:
                held[mb] = backwards.get(stage, 0) // every
            elif action.kind is Kind.B:
                del held[mb]
                backwards[stage] = backwards.get(stage, 0) + 1
            peak[stage] = max(peak[stage], len(set(held.values()) | {backwards.get(stage, 0) // every}))
    return peak
