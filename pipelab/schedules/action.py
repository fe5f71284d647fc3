"""`Action`: one unit of work of a schedule, and the table of what each kind of action does.

An action is printed as ``2F0`` (stage 2, forward, micro-batch 0): the same text is the log
line, the Chrome-trace name and, without the stage when it is the row's own, the cell of
`Schedule.to_text()`.  Everything that depends on an action's kind — what it needs, where
its result goes, whether the stage is then done with the micro-batch, what it costs — is
read from `KIND_SPECS`, so a new kind of action is one row there (plus the worker's handler
that runs it, `runtime/loop.py`).  Which kinds one stage runs for every micro-batch is the row's
`profiles`: a stage's *profile* (whole backward, split backward, forward only, generation) is
the set of kinds it runs, and `PROFILES` collects them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from ..common.errors import ScheduleError


class Kind(str, Enum):
    """What an action does with one micro-batch on one stage (a `str`: ``Kind.F == "F"``)."""

    F = "F"  # forward: the stage's output from its input
    B = "B"  # backward, whole: the gradients of the stage's input and of its weights
    I = "I"  # noqa: E741  input-gradient half of a split backward (what the previous stage waits for)
    W = "W"  # weight-gradient half of a split backward (which nobody waits for)
    E = "E"  # forward only (inference, evaluation): the stage's output, nothing kept for a backward
    G = "G"  # generation: forward only with a key/value cache; the last stage's token goes back to stage 0

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


GRADIENT = "gradient"
"""In `KindSpec.needs`: the action that makes a stage's input gradient — its B, or its I when the
stage splits its backward (`Schedule.gradient_kind`)."""


WHOLE, SPLIT, FORWARD_ONLY, GENERATION = "whole backward", "split backward", "forward only", "generation"
"""The stage profiles: the kinds one stage runs for every micro-batch (`KindSpec.profiles`)."""


@dataclass(frozen=True)
class KindSpec:
    """What every action of one kind does (DESIGN.md's rules, in one place)."""

    name: str  # in words, for messages and legends
    needs: tuple[tuple[Kind | str, int], ...]  # (kind, or GRADIENT; stage offset) of the same micro-batch
    sends: int  # +1: its result goes to the next stage (an activation); -1: to the previous (a gradient); 0: nowhere
    releases: bool  # the stage is done with the micro-batch once it has run
    cost: str  # the `Costs` field that times it
    profiles: tuple[str, ...]  # the stage profiles that run it (WHOLE, SPLIT, FORWARD_ONLY, GENERATION)
    color: str  # in every picture
    holds: bool = False  # once it has run, the stage keeps the micro-batch's activations for its backward (F)
    leaves_for_w: bool = False  # once it has run, the micro-batch keeps only what its W needs (I)
    wraps: bool = False  # stage 0's need comes from the last stage, `lanes` micro-batches earlier (generation)


KIND_SPECS: dict[Kind, KindSpec] = {
    Kind.F: KindSpec("forward", ((Kind.F, -1),), +1, False, "forward", (WHOLE, SPLIT), "#4C72B0", holds=True),
    Kind.B: KindSpec("backward", ((Kind.F, 0), (GRADIENT, +1)), -1, True, "backward", (WHOLE,), "#DD8452"),
    Kind.I: KindSpec("input gradient", ((Kind.F, 0), (GRADIENT, +1)), -1, False, "backward", (SPLIT,), "#E3A04F",
                     leaves_for_w=True),
    Kind.W: KindSpec("weight gradient", ((Kind.I, 0),), 0, True, "weight", (SPLIT,), "#55A868"),
    Kind.E: KindSpec("forward only", ((Kind.E, -1),), +1, False, "forward", (FORWARD_ONLY,), "#8172B3"),
    Kind.G: KindSpec("generation", ((Kind.G, -1),), +1, False, "forward", (GENERATION,), "#937860", wraps=True),
}
"""F(s, i) needs F(s-1, i); B(s, i) and I(s, i) need F(s, i) and the gradient stage s+1 sends back
for micro-batch i; W(s, i) needs I(s, i); E(s, i) needs E(s-1, i) and keeps nothing (no backward
follows); G(s, i) needs G(s-1, i), and G(0, i) the token G(p-1, i - lanes) made (lane i mod lanes,
one round earlier; `schedule.meta["lanes"]`).  A need whose stage falls outside 0..p-1 does not
exist (stage 0 has no F before it, the last stage no gradient after it: it starts from the loss)."""

KINDS = tuple(KIND_SPECS)
NEEDS = {kind: spec.needs for kind, spec in KIND_SPECS.items()}
GRADIENT_KINDS = frozenset(kind for kind, spec in KIND_SPECS.items() if spec.sends < 0)  # B, I: start a backward
RELEASING_KINDS = frozenset(kind for kind, spec in KIND_SPECS.items() if spec.releases)  # B, W: end a micro-batch
NARROWING_KINDS = frozenset(kind for kind, spec in KIND_SPECS.items() if spec.leaves_for_w)  # I: keep W's part only
HOLDING_KINDS = frozenset(kind for kind, spec in KIND_SPECS.items() if spec.holds)  # F: keeps until the backward
PROFILES: dict[str, tuple[Kind, ...]] = {
    profile: tuple(kind for kind, spec in KIND_SPECS.items() if profile in spec.profiles)
    for profile in dict.fromkeys(p for spec in KIND_SPECS.values() for p in spec.profiles)}
"""Stage profile -> the kinds a stage of that profile runs for every micro-batch, in the order it runs them."""
PROFILE_OF_KINDS = {frozenset(kinds): profile for profile, kinds in PROFILES.items()}
TRAINING_PROFILES = frozenset(p for p, kinds in PROFILES.items() if any(k in GRADIENT_KINDS for k in kinds))


def goes_forward(kind: Kind) -> bool:
    """Whether `kind` waits on the stage before it (F, E, G): a one-micro-batch pass runs these in stage order,
    the others (B, I, W) in reverse stage order."""
    return any(offset < 0 for _, offset in KIND_SPECS[kind].needs)
_ACTION_RE = re.compile(r"^(\d+)?([" + "".join(KINDS) + r"])(\d+)$")


class _Fields(NamedTuple):
    kind: Kind
    stage: int
    microbatch: int


class Action(_Fields):
    """One unit of work: `kind` (a `Kind`, or its letter) of `microbatch` through `stage`."""

    __slots__ = ()

    def __new__(cls, kind: Kind | str, stage: int, microbatch: int) -> "Action":
        if kind.__class__ is Kind:  # the common case, made by the engine itself: no lookup
            return tuple.__new__(cls, (kind, stage, microbatch))
        try:
            kind = Kind(kind)
        except ValueError:
            raise ScheduleError(f"unknown kind {kind!r}; kinds are " + ", ".join(
                f"{k.value} ({spec.name})" for k, spec in KIND_SPECS.items())) from None
        return tuple.__new__(cls, (kind, stage, microbatch))

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return str(self)

    @property
    def spec(self) -> KindSpec:
        return KIND_SPECS[self.kind]

    def describe(self) -> str:
        """``"B(stage 2, mb 3)"`` — the form error messages use."""
        return f"{self.kind.value}(stage {self.stage}, mb {self.microbatch})"

    @classmethod
    def from_str(cls, text: str, stage: int | None = None) -> "Action":
        """Parse ``"2F0"``; ``"F0"`` is accepted when `stage` is given (a grid cell)."""
        match = _ACTION_RE.match(text.strip())
        if not match or (match.group(1) is None and stage is None):
            raise ScheduleError(
                f"cannot read {text!r} as an action: write stage, kind, micro-batch like '2F0' "
                "(kinds: " + ", ".join(f"{k.value} = {spec.name}" for k, spec in KIND_SPECS.items()) + ")"
            )
        found_stage = int(match.group(1)) if match.group(1) is not None else stage
        return cls(match.group(2), found_stage, int(match.group(3)))
