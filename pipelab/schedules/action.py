"""`Action`: one unit of work of a schedule, and what each kind of action needs (`NEEDS`).

A schedule is a table of actions (`pipelab.schedules.schedule.Schedule`).  An action is printed as ``2F0`` (stage 2, forward, micro-batch 0): the
same text is the log line, the Chrome-trace name and, without the stage when it is the
row's own, the cell of `Schedule.to_text()`.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from ..common.errors import ScheduleError

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


NEEDS = {"F": (("F", -1),), "B": (("F", 0), ("B", +1)), "W": (("B", 0),)}
"""What an action of each kind needs, as (kind, stage offset), same micro-batch (DESIGN.md):
F(s, i) needs F(s-1, i); B(s, i) needs F(s, i) and B(s+1, i); W(s, i) needs B(s, i).
A need whose stage falls outside 0..p-1 does not exist (stage 0 has no F before it,
the last stage no B after it)."""
