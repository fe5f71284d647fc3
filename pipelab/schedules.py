"""Schedule generators and `validate`.

A schedule is data (see `pipelab.actions`): the generators below only build tables, and
`validate` checks any table — generated or written by hand — by running its dependencies.
"""

from __future__ import annotations

from itertools import chain
from operator import itemgetter

from .actions import KINDS, Action, Schedule, check_counts
from .errors import ScheduleError
from .schedules_beyond import count_messages, interleaved_1f1b, zero_bubble_h1
from .schedules_torch import TORCH_NAMES, from_torch, torch_schedule, torch_table
from .timing import run_dependencies


def gpipe(n_stages: int, n_microbatches: int) -> Schedule:
    """GPipe (fill-drain): every forward, then every backward (Huang et al. 2019, §2.3).

    Each stage keeps the activations of all m micro-batches until its backwards start, so
    peak in-flight micro-batches = m on every stage.  With uniform costs the idle share
    of the step is (p-1)/(m+p-1).  p=4, m=8, every action one time step:

        device 0 | F0 F1 F2 F3 F4 F5 F6 F7 .  .  .  .  .  .  B0 B1 B2 B3 B4 B5 B6 B7
        device 1 | .  F0 F1 F2 F3 F4 F5 F6 F7 .  .  .  .  B0 B1 B2 B3 B4 B5 B6 B7 .
        device 2 | .  .  F0 F1 F2 F3 F4 F5 F6 F7 .  .  B0 B1 B2 B3 B4 B5 B6 B7 .  .
        device 3 | .  .  .  F0 F1 F2 F3 F4 F5 F6 F7 B0 B1 B2 B3 B4 B5 B6 B7 .  .  .
    """
    check_counts(n_stages=n_stages, n_microbatches=n_microbatches)
    actions = [
        [Action("F", s, i) for i in range(n_microbatches)] + [Action("B", s, i) for i in range(n_microbatches)]
        for s in range(n_stages)
    ]
    return Schedule(n_stages, n_microbatches, actions, name="gpipe")


def one_f_one_b(n_stages: int, n_microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush; Narayanan et al. 2021, PipeDream-2BW §3.2): warm-up, steady state, cool-down.

    Stage s first runs w = min(p - s - 1, m) forwards (warm-up), then alternates one
    forward and one backward (steady state), then runs the remaining backwards
    (cool-down).  A micro-batch's activations are freed at its backward, so stage s
    never holds more than min(p - s, m) micro-batches (DeepSpeed's `num_pipe_buffers`).
    Same bubble as GPipe, (p-1)/(m+p-1), with far less memory.  p=4, m=8, one step each:

        device 0 | F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7
        device 1 | .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .
        device 2 | .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 .  .
        device 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  .
    """
    check_counts(n_stages=n_stages, n_microbatches=n_microbatches)
    warmups = [min(n_stages - s - 1, n_microbatches) for s in range(n_stages)]
    return Schedule(n_stages, n_microbatches, _one_f_one_b_rows(n_microbatches, warmups), name="1f1b")


def _one_f_one_b_rows(n_microbatches: int, warmups: list[int]) -> list[list[Action]]:
    """Stage s's 1F1B list for each s: warmups[s] forwards, then one forward and one backward
    in turn (steady state), then the remaining backwards (cool-down)."""
    actions = []
    for s, warmup in enumerate(warmups):
        row = [Action("F", s, i) for i in range(warmup)]
        for i in range(n_microbatches - warmup):  # steady state: one forward, one backward
            row += [Action("F", s, warmup + i), Action("B", s, i)]
        row += [Action("B", s, i) for i in range(n_microbatches - warmup, n_microbatches)]  # cool-down
        actions.append(row)
    return actions


def pipedream_async(n_stages: int, n_microbatches: int, update_every: int = 1) -> Schedule:
    """Asynchronous PipeDream with weight stashing (Narayanan et al., SOSP 2019, §3.3): no flush.

    The whole training run is one schedule: each of the m micro-batches is one of
    PipeDream's minibatches, and the table is 1F1B's order (stage s admits p - s before
    its first backward, then alternates: "1F1B-RR" with one worker per stage), so the
    warm-up and the drain happen once per run, not once per optimizer step.  The weights
    move while micro-batches are in flight, under this exact rule per stage s:

    - stage s's weights start at version 0; after every `update_every`-th B in its list
      it applies one optimizer step to its live weights with the gradients of those
      backwards (summed), and the version goes up by one;
    - F(s, i) runs with the live version at that moment (the number of updates earlier
      in stage s's list) and stashes it;
    - B(s, i) computes its gradients with the version F(s, i) stashed (weight stashing),
      and they update the live weights;
    - stages do not agree on versions: micro-batch i may see version 3 on stage 0 and 5 on
      stage 2 (PipeDream's optional "vertical sync" is not modelled).

    `pl.pipedream.weight_versions` gives each action's version; a stage keeps p - s
    versions at once in the steady state (update_every = 1).  `meta` carries
    {"update_every": k, "asynchronous": True}.  p=4, m=8 (1F1B's table; stage 0 runs
    F0..F3 with version 0, then F4 with version 1, F5 with 2, ...):

        device 0 | F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7
        device 1 | .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .
        device 2 | .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 .  .
        device 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  .
    """
    check_counts(update_every=update_every)
    table = one_f_one_b(n_stages, n_microbatches)
    return Schedule(n_stages, n_microbatches, table.actions, name="pipedream-async",
                    meta={"update_every": update_every, "asynchronous": True})


GENERATORS = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zero_bubble_h1, "pipedream-async": pipedream_async}
"""The schedules `by_name` builds from (n_stages, n_microbatches) alone (interleaved 1F1B needs a
chunk count: call `interleaved_1f1b`)."""


def by_name(name: str, n_stages: int, n_microbatches: int) -> Schedule:
    """Build the schedule called `name` ("gpipe", "1f1b", "zb-h1", "pipedream-async")."""
    if not isinstance(name, str):
        raise TypeError(f"a schedule name must be a string like 'gpipe' or '1f1b', got {type(name).__name__}")
    key = name.lower().replace("-", "").replace("_", "")
    aliases = {"gpipe": "gpipe", "1f1b": "1f1b", "onefoneb": "1f1b", "pipedreamflush": "1f1b",
               "zbh1": "zb-h1", "zerobubbleh1": "zb-h1", "pipedreamasync": "pipedream-async",
               "pipedream": "pipedream-async"}
    if key not in aliases:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(GENERATORS)} "
                         "(interleaved 1F1B: pl.schedules.interleaved_1f1b(p, m, n_chunks))")
    return GENERATORS[aliases[key]](n_stages, n_microbatches)


def validate(schedule: Schedule) -> Schedule:
    """Check `schedule` and return it, or raise `ScheduleError` naming the first problem.

    Checked in order: every entry is an Action with a known kind, stage and micro-batch;
    no action appears twice; each stage runs on one device; every F and B (and W, when
    the schedule splits the backward) is present; and the dependencies can all be met —
    found by running them (`pipelab.timing`): a device whose next action waits for
    something later in its own list, or a cycle of devices waiting on each other.
    """
    check_structure(schedule)
    explain_stuck(schedule, run_dependencies(schedule, duration=lambda a: 1.0))
    return schedule


def check_structure(schedule: Schedule) -> None:
    """Everything `validate` checks except the dependencies (which need a run of `pipelab.timing`)."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"validate expects a pipelab Schedule, got {type(schedule).__name__}")
    check_counts(n_stages=schedule.n_stages, n_microbatches=schedule.n_microbatches)
    if schedule.n_devices < 1:
        raise ScheduleError("the schedule has no devices: actions must be a list with one list per device")
    if not _looks_valid(schedule):  # fast path for the common case; the checks below name the problem
        _check_entries(schedule)
        _check_stage_placement(schedule)
        _check_complete(schedule)


def _looks_valid(schedule: Schedule) -> bool:
    """True when the structure is certainly right, checked with set operations (no messages)."""
    rows = schedule.actions
    if not all(isinstance(row, (list, tuple)) for row in rows):
        return False
    flat = list(chain.from_iterable(rows))
    if not flat or set(map(type, flat)) != {Action}:
        return False
    kinds = set(map(itemgetter(0), flat))
    if not kinds <= set(KINDS) or not kinds >= {"F", "B"}:
        return False
    stages_per_row = [set(map(itemgetter(1), row)) for row in rows]
    stages = set().union(*stages_per_row)
    if sum(map(len, stages_per_row)) != len(stages):
        return False  # a stage on two devices
    microbatches = set(map(itemgetter(2), flat))
    if {type(n) for n in stages | microbatches} != {int}:
        return False
    if not stages <= set(range(schedule.n_stages)) or not microbatches <= set(range(schedule.n_microbatches)):
        return False
    # every entry in range and none repeated: complete exactly when the count is right
    return len(set(flat)) == len(flat) == schedule.n_stages * schedule.n_microbatches * len(kinds)


def _check_entries(schedule: Schedule) -> None:
    seen: dict[Action, tuple[int, int]] = {}
    for device, row in enumerate(schedule.actions):
        if not isinstance(row, (list, tuple)):
            raise ScheduleError(f"device {device}'s actions must be a list, got {type(row).__name__}")
        for position, action in enumerate(row):
            where = f"device {device}, position {position}"
            if not isinstance(action, Action):
                raise ScheduleError(f"{where}: {action!r} is not an Action (build one with Action('F', stage, mb))")
            if action.kind not in KINDS:
                raise ScheduleError(f"{where}: unknown kind {action.kind!r}; kinds are F, B and W")
            if type(action.stage) is not int or type(action.microbatch) is not int:
                raise ScheduleError(f"{where}: {action!r} must name its stage and micro-batch with integers, "
                                    f"got {action.stage!r} and {action.microbatch!r}")
            if not 0 <= action.stage < schedule.n_stages:
                raise ScheduleError(
                    f"{where}: {action} names stage {action.stage}, but the schedule has "
                    f"{schedule.n_stages} stages (0..{schedule.n_stages - 1})"
                )
            if not 0 <= action.microbatch < schedule.n_microbatches:
                raise ScheduleError(
                    f"{where}: {action} names micro-batch {action.microbatch}, but the schedule has "
                    f"{schedule.n_microbatches} micro-batches (0..{schedule.n_microbatches - 1})"
                )
            if action in seen:
                first = seen[action]
                raise ScheduleError(
                    f"{action} ({action.describe()}) appears twice: device {first[0]} position {first[1]} "
                    f"and {where}; each action runs exactly once"
                )
            seen[action] = (device, position)


def _check_stage_placement(schedule: Schedule) -> None:
    devices_of: dict[int, set[int]] = {}
    for device, row in enumerate(schedule.actions):
        for action in row:
            devices_of.setdefault(action.stage, set()).add(device)
    for stage, devices in sorted(devices_of.items()):
        if len(devices) > 1:
            raise ScheduleError(
                f"stage {stage}'s actions are on devices {sorted(devices)}; a stage's weights live on one "
                "device, so all its actions must be in that device's list"
            )


def _check_complete(schedule: Schedule) -> None:
    present = set(schedule.all_actions())
    kinds = ("F", "B", "W") if any(a.kind == "W" for a in present) else ("F", "B")
    for stage in range(schedule.n_stages):
        for mb in range(schedule.n_microbatches):
            for kind in kinds:
                if (kind, stage, mb) not in present:
                    action = Action(kind, stage, mb)
                    why = (
                        "the schedule has W actions, so every B needs its W"
                        if kind == "W"
                        else "every micro-batch needs a forward and a backward on every stage"
                    )
                    raise ScheduleError(f"missing action {action} ({action.describe()}): {why}")


def explain_stuck(schedule: Schedule, timing) -> None:
    """Raise ScheduleError explaining why the run `timing` of `schedule` got stuck (no-op if it finished)."""
    if not timing.stuck:
        return
    device_of = {a: d for d, row in enumerate(schedule.actions) for a in row}
    position = {a: i for row in schedule.actions for i, a in enumerate(row)}
    # Each stuck device waits on an action of a stuck device: follow the waits to a cycle.
    device, path = min(timing.stuck), []
    while device not in path:
        path.append(device)
        device = device_of[timing.stuck[device][1]]
    cycle = path[path.index(device):]
    if len(cycle) == 1:
        action, needed = timing.stuck[device]
        raise ScheduleError(
            f"device {device} runs {action} ({action.describe()}) at position {position[action]}, but it needs "
            f"{needed} ({needed.describe()}), which comes later in the same list (position {position[needed]}): "
            f"{_why(action, needed)}"
        )
    waits = []
    for d in cycle:
        action, needed = timing.stuck[d]
        other = device_of[needed]
        before = schedule.actions[other][_first_unrun(schedule, timing, other)]
        waits.append(
            f"device {d} waits at {action} for {needed} from device {other}, which is still stuck at {before}"
        )
    raise ScheduleError("deadlock, a cycle of waits between devices: " + "; ".join(waits))


def _first_unrun(schedule: Schedule, timing, device: int) -> int:
    """Position of the first action of `device` that never ran."""
    return next(i for i, a in enumerate(schedule.actions[device]) if a not in timing.end)


def _why(action: Action, needed: Action) -> str:
    if action.kind == "B" and needed.kind == "F":
        return "a backward needs its own forward first"
    if action.kind == "F":
        return "a forward needs the previous stage's forward of the same micro-batch (its input)"
    if action.kind == "B":
        return "a backward needs the next stage's backward of the same micro-batch (its gradient)"
    return "a weight-gradient step needs its backward first"
