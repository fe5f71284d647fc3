"""Who sends what to whom in a schedule: derived once from `KIND_SPECS` and each stage's backward kind.

An action's result crosses to another stage when its kind sends (`KindSpec.sends`): an F's
output to the next stage, a B's or I's input gradient to the previous one.  The action that
receives it is the one whose cross-stage need it is (`KindSpec.needs`): F(s+1, i) for F(s, i);
for the gradient of stage s, the B or I of stage s - 1, whichever that stage runs.
"""

from __future__ import annotations

from .action import GRADIENT, KIND_SPECS, Action, Kind


class Routes:
    """The messages of one schedule: `producer(action)`, `consumer(action)` and `consumer_stage(action)`."""

    def __init__(self, schedule: "Schedule"):
        self.n_stages = schedule.n_stages
        self.gradient_kind = schedule.gradient_kind  # per stage: B, or I where it splits its backward
        self.forward_only = schedule.forward_only  # inference: E on every stage, nothing else

    def producer(self, action: Action) -> Action | None:
        """The action on another stage whose result `action` receives (an activation for F, a gradient for
        B or I), or None (stage 0's F, the last stage's backward, a W)."""
        for need, offset in action.spec.needs:
            stage = action.stage + offset
            if offset and 0 <= stage < self.n_stages:
                kind = self.gradient_kind[stage] if need == GRADIENT else need
                return Action(kind, stage, action.microbatch)
        return None

    def consumer(self, action: Action) -> Action | None:
        """The action on another stage that receives what `action` produces, or None."""
        target = self.consumer_stage(action)
        if target is None:
            return None
        return next(candidate for candidate in (Action(kind, target, action.microbatch) for kind in KIND_SPECS)
                    if self.runs(candidate.kind, target) and self.producer(candidate) == action)

    def runs(self, kind: Kind, stage: int) -> bool:
        """Whether `stage` runs actions of `kind`: F, and B or else I and W; or only E (`STAGE_KINDS`)."""
        if self.forward_only or kind is Kind.E:
            return self.forward_only and kind is Kind.E
        if kind is Kind.F:
            return True
        splits = self.gradient_kind[stage] is Kind.I
        return kind in ((Kind.I, Kind.W) if splits else (Kind.B,))

    def consumer_stage(self, action: Action) -> int | None:
        """The stage that receives what `action` produces, or None: nothing is sent (a W; stage 0's
        backward; the last stage's forward, whose output goes to the loss)."""
        sends = action.spec.sends
        target = action.stage + sends
        return target if sends and 0 <= target < self.n_stages else None
