"""`Schedule`: what each device does, in order, in one training step — a table of `Action`s.

`Schedule.actions[d]` is the ordered list of actions device `d` performs.  This module also
holds what makes a table well formed (`check_structure`: every action once, in range, each
stage on one device) and its drawing (`to_text`: every action one time step long, run by
the dependency loop); `validate` adds that the dependencies can all be met.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter

from ..common.checks import check_counts
from ..common.errors import ScheduleError
from .action import GRADIENT_KINDS, KIND_SPECS, PROFILE_OF_KINDS, PROFILES, TRAINING_PROFILES, Action, Kind
from .dependencies import run_dependencies
from .routes import Routes

STAGE_KINDS = tuple(set(kinds) for kinds in PROFILES.values())
"""What one stage runs for every micro-batch, one set per stage profile (`action.PROFILES`): a forward and a
whole backward, a forward and a split one, one forward that keeps nothing (inference), or generation's."""


def profile_of(kinds: set) -> str:
    """The stage profile of a stage that runs `kinds`: the one they make up, else (a table being written, or
    wrong) the one sharing most of them, the later on a tie (F, B and I: "split backward")."""
    exact = PROFILE_OF_KINDS.get(frozenset(kinds))
    if exact is not None:
        return exact
    return max(reversed(list(PROFILES)), key=lambda profile: len(kinds & set(PROFILES[profile])))


@dataclass
class Schedule:
    """What each device does, in order, in one training step.

    `actions[d]` lists device d's actions.  For the schedules of the foundation each
    stage has its own device (`actions[s]` holds stage s's actions); the format also
    allows several stages on one device.  A stage either runs whole backwards (B) or splits
    them (I, then W); a table written with B and W for a stage (the zero-bubble papers'
    notation) is read as I and W.  `asynchronous` (PipeDream: no flush, each stage updates
    its weights after every `update_every` of its backwards) changes how the engines run it.
    """

    n_stages: int
    n_microbatches: int
    actions: list[list[Action]]
    name: str = "custom"
    meta: dict = field(default_factory=dict)  # what a generator wants to remember (e.g. "n_chunks")
    asynchronous: bool = False
    update_every: int = 1

    def __post_init__(self) -> None:
        check_fields(self)
        split = {a.stage for row in self.actions if isinstance(row, list) for a in row
                 if isinstance(a, Action) and a.kind is Kind.W}
        if split:  # B on a stage with W's is its input-gradient half: say so with I
            self.actions = [[Action(Kind.I, a.stage, a.microbatch) if isinstance(a, Action) and a.kind is Kind.B
                             and a.stage in split else a for a in row] if isinstance(row, list) else row
                            for row in self.actions]

    @property
    def profiles(self) -> list[str]:
        """Per stage, its profile (`action.PROFILES`): "whole backward" (F, B), "split backward" (F, I, W),
        "forward only" (E) or "generation" (G), read from the kinds it runs."""
        kinds: dict[int, set] = {}
        for row in self.actions:
            for action in row:
                if isinstance(action, Action):
                    kinds.setdefault(action.stage, set()).add(action.kind)
        return [profile_of(kinds.get(stage, set())) for stage in range(self.n_stages)]

    @property
    def gradient_kind(self) -> list[Kind]:
        """Per stage, the kind of action that makes its input gradient: I where it splits its backward, else B
        (also where its profile has no backward)."""
        return [next((k for k in PROFILES[profile] if k in GRADIENT_KINDS), Kind.B) for profile in self.profiles]

    @property
    def forward_only(self) -> bool:
        """No stage runs a backward: inference (E, `pl.schedules.inference`) or generation (G)."""
        return not TRAINING_PROFILES.intersection(self.profiles)

    @property
    def n_devices(self) -> int:
        return len(self.actions)

    def all_actions(self) -> list[Action]:
        return [a for row in self.actions for a in row]

    def device_of_stage(self) -> dict[int, int]:
        """Map each stage to the device that runs it (from where its actions are)."""
        found: dict[int, int] = {}
        for device, row in enumerate(self.actions):
            for stage in set(map(itemgetter(1), row)):  # itemgetter(1) of an Action is its stage
                found.setdefault(stage, device)
        return found

    def to_text(self) -> str:
        """The schedule as a grid: one row per device, one column per time step.

        Every action takes one time step and starts as soon as its inputs are ready; a
        ``.`` is a step in which that device idles (the bubble).  A cell names the stage
        only when it is not the row's own (``F3`` on row 2 means ``2F3``).
        """
        grid = self.grid()
        width = max((len(cell) for line in grid for cell in line), default=1)
        label_width = len(str(self.n_devices - 1))
        lines = []
        for device, cells in enumerate(grid):
            body = " ".join(cell.ljust(width) for cell in cells).rstrip()
            lines.append(f"device {device:>{label_width}} | {body}".rstrip())
        return "\n".join(lines)

    def grid(self) -> list[list[str]]:
        """The cells of `to_text()`: ``grid()[d][t]`` is device d's cell in time step t (``"."`` = idle)."""
        check_structure(self)  # names a missing, repeated or out-of-range action
        timing = run_dependencies(self, duration=lambda a: 1.0)
        if timing.stuck:
            stuck = ", ".join(f"device {d} at {a} (waits for {n})" for d, (a, n) in sorted(timing.stuck.items()))
            raise ScheduleError(f"cannot draw a schedule that deadlocks: {stuck}; run pl.schedules.validate for details")
        grid = [["."] * int(round(timing.makespan)) for _ in range(self.n_devices)]
        for event in timing.events:
            own = event.stage == event.device
            grid[event.device][int(round(event.start))] = f"{event.kind.value}{event.microbatch}" if own else str(event.action)
        return grid

    def message_count(self) -> int:
        """Messages one step sends between devices: every result whose consumer stage is on another device
        (`routes.Routes`); 2·m·(p-1) for one stage per device, whatever the order of the actions."""
        device, routes = self.device_of_stage(), Routes(self)
        count = 0
        for action in self.all_actions():
            target = routes.consumer_stage(action)
            if target is not None and device.get(target) != device[action.stage]:
                count += 1
        return count

    @classmethod
    def from_text(cls, text: str, name: str = "custom") -> "Schedule":
        """Parse `to_text()` (or a hand-written grid) back into a Schedule.

        Each non-empty line is one device, ``device 0 | F0 F1 . B0``; the part before
        ``|`` is ignored, ``.`` cells are idle steps and are skipped.
        """
        rows = []
        for line in text.strip("\n").splitlines():
            if not line.strip():
                continue
            cells = line.split("|", 1)[-1].split()
            device = len(rows)
            rows.append([Action.from_str(c, stage=device) for c in cells if c != "."])
        if not rows:
            raise ScheduleError("the text holds no rows: write one line per device, like 'device 0 | F0 B0'")
        all_actions = [a for row in rows for a in row]
        n_stages = max((a.stage for a in all_actions), default=-1) + 1
        n_microbatches = max((a.microbatch for a in all_actions), default=-1) + 1
        return cls(max(n_stages, len(rows)), n_microbatches, rows, name=name)


def check_fields(schedule: Schedule) -> None:
    """`asynchronous` a bool and `update_every` a positive int (checked when a Schedule is made, and by
    `validate`: a field set afterwards)."""
    if not isinstance(schedule.asynchronous, bool):
        raise ScheduleError(f"the schedule's asynchronous must be True or False, got "
                            f"{type(schedule.asynchronous).__name__} {schedule.asynchronous!r}")
    every = schedule.update_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ScheduleError(f"the schedule's update_every (backwards between two weight updates of an asynchronous "
                            f"schedule) must be a positive int, got {type(every).__name__} {every!r}")


def check_structure(schedule: Schedule) -> None:
    """Everything `validate` checks except the dependencies (which need a run of `run_dependencies`)."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"validate expects a pipelab Schedule, got {type(schedule).__name__}")
    check_counts(n_stages=schedule.n_stages, n_microbatches=schedule.n_microbatches)
    check_fields(schedule)
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
    kinds_of: dict[int, set] = {}
    for kind, stage in set(map(itemgetter(0, 1), flat)):
        kinds_of.setdefault(stage, set()).add(kind)
    if any(kinds not in STAGE_KINDS for kinds in kinds_of.values()) or len(kinds_of) != schedule.n_stages:
        return False
    if _mixed_profiles({stage: profile_of(kinds) for stage, kinds in kinds_of.items()}):
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
    return len(set(flat)) == len(flat) == schedule.n_microbatches * sum(map(len, kinds_of.values()))


def _check_entries(schedule: Schedule) -> None:
    seen: dict[Action, tuple[int, int]] = {}
    for device, row in enumerate(schedule.actions):
        if not isinstance(row, (list, tuple)):
            raise ScheduleError(f"device {device}'s actions must be a list, got {type(row).__name__}")
        for position, action in enumerate(row):
            where = f"device {device}, position {position}"
            if not isinstance(action, Action):
                raise ScheduleError(f"{where}: {action!r} is not an Action (build one with Action('F', stage, mb))")
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


def _mixed_profiles(profiles: dict[int, str]) -> bool:
    """Stages of a training profile beside others, or two profiles without a backward: one schedule trains,
    infers or generates (whole and split backwards may mix)."""
    kinds = {p if p not in TRAINING_PROFILES else "training" for p in profiles.values()}
    return len(kinds) > 1


def _check_complete(schedule: Schedule) -> None:
    present = set(schedule.all_actions())
    kinds_of: dict[int, set] = {stage: set() for stage in range(schedule.n_stages)}
    for action in present:
        kinds_of[action.stage].add(action.kind)
    profiles = {stage: profile_of(kinds) for stage, kinds in kinds_of.items()}
    if _mixed_profiles(profiles):
        by_profile: dict[str, list[int]] = {}
        for stage, profile in profiles.items():
            by_profile.setdefault(profile, []).append(stage)
        listed = "; ".join(f"{profile} ({', '.join(k.value for k in PROFILES[profile])}) on stages {stages}"
                           for profile, stages in by_profile.items())
        raise ScheduleError(f"a schedule trains, runs forward only (inference: E, pl.schedules.inference) or "
                            f"generates (G) on every stage alike; this one mixes {listed}: a forward-only "
                            "schedule runs E and nothing else on every stage")
    for stage, kinds in kinds_of.items():
        wanted = PROFILES[profiles[stage]]
        foreign = sorted(k.value for k in kinds - set(wanted))
        if foreign:
            raise ScheduleError(f"stage {stage} runs whole backwards (B) and split ones (I, W); a stage does one "
                                f"or the other for every micro-batch (it runs {', '.join(sorted(k.value for k in kinds))})")
        for mb in range(schedule.n_microbatches):
            for kind in wanted:
                if (kind, stage, mb) not in present:
                    action = Action(kind, stage, mb)
                    raise ScheduleError(f"missing action {action} ({action.describe()}): {_why(profiles[stage], stage)}")


def _why(profile: str, stage: int) -> str:
    kinds = PROFILES[profile]
    if not TRAINING_PROFILES.intersection([profile]):
        return f"every micro-batch goes through every stage once ({KIND_SPECS[kinds[0]].name})"
    if Kind.W in kinds:
        return (f"stage {stage} splits its backward, so every micro-batch needs its input-gradient I and its "
                "weight-gradient W there")
    return "every micro-batch needs a forward and a backward on every stage"
