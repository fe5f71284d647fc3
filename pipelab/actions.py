"""`Action` and `Schedule`: a pipeline schedule is a table of data.

`Schedule.actions[d]` is the ordered list of actions device `d` performs in one
training step.  An action is printed as ``2F0`` (stage 2, forward, micro-batch 0): the
same text is the log line, the Chrome-trace name and, without the stage when it is the
row's own, the cell of `Schedule.to_text()`.
"""

from __future__ import annotations

import re
from operator import itemgetter
from dataclasses import dataclass, field
from typing import NamedTuple

from .errors import ScheduleError

KINDS = ("F", "B", "W")
_ACTION_RE = re.compile(r"^(\d+)?([FBW])(\d+)$")


class Action(NamedTuple):
    """One unit of work: `kind` ("F", "B" or "W") of `microbatch` through `stage`."""

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    def __repr__(self) -> str:
        return str(self)

    def describe(self) -> str:
        """``"B(stage 2, mb 3)"`` — the form error messages use."""
        return f"{self.kind}(stage {self.stage}, mb {self.microbatch})"

    @classmethod
    def from_str(cls, text: str, stage: int | None = None) -> "Action":
        """Parse ``"2F0"``; ``"F0"`` is accepted when `stage` is given (a grid cell)."""
        match = _ACTION_RE.match(text.strip())
        if not match or (match.group(1) is None and stage is None):
            raise ScheduleError(
                f"cannot read {text!r} as an action: write stage, kind, micro-batch like '2F0' "
                "(kind F = forward, B = backward, W = weight gradient)"
            )
        found_stage = int(match.group(1)) if match.group(1) is not None else stage
        return cls(match.group(2), found_stage, int(match.group(3)))


def check_counts(**counts) -> None:
    """Raise a TypeError/ValueError naming any count (n_stages=4, ...) that is not a positive int."""
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")


NEEDS = {"F": (("F", -1),), "B": (("F", 0), ("B", +1)), "W": (("B", 0),)}
"""What an action of each kind needs, as (kind, stage offset), same micro-batch (DESIGN.md):
F(s, i) needs F(s-1, i); B(s, i) needs F(s, i) and B(s+1, i); W(s, i) needs B(s, i).
A need whose stage falls outside 0..p-1 does not exist (stage 0 has no F before it,
the last stage no B after it)."""


@dataclass
class Schedule:
    """What each device does, in order, in one training step.

    `actions[d]` lists device d's actions.  For the schedules of the foundation each
    stage has its own device (`actions[s]` holds stage s's actions); the format also
    allows several stages on one device.
    """

    n_stages: int
    n_microbatches: int
    actions: list[list[Action]]
    name: str = "custom"
    meta: dict = field(default_factory=dict)

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
        from .timing import unit_time_grid

        return unit_time_grid(self)

    def grid(self) -> list[list[str]]:
        """The cells of `to_text()`: ``grid()[d][t]`` is device d's cell in time step t (``"."`` = idle)."""
        return [line.split("|", 1)[1].split() for line in self.to_text().splitlines()]

    def message_count(self) -> int:
        """Messages one step sends between devices: each F of a stage > 0 receives its activation, each B
        of a stage < p-1 its gradient, when the neighbouring stage is on another device; 2·m·(p-1)
        for one stage per device, whatever the order of the actions."""
        device = self.device_of_stage()
        count = 0
        for action in self.all_actions():
            neighbour = action.stage - 1 if action.kind == "F" else action.stage + 1 if action.kind == "B" else None
            if neighbour is not None and neighbour in device and device[neighbour] != device[action.stage]:
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
