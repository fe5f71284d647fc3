"""Who sends what to whom in a schedule: derived once from `KIND_SPECS` and each stage's profile.

An action's result crosses to another stage when its kind sends (`KindSpec.sends`): an F's
output to the next stage, a B's or I's input gradient to the previous one.  The action that
receives it is the one whose cross-stage need it is (`KindSpec.needs`): F(s+1, i) for F(s, i);
for the gradient of stage s, the B or I of stage s - 1, whichever that stage runs.  A kind that
`wraps` (generation's G) closes the ring: the last stage's result goes to stage 0, for the
micro-batch `lanes` later (the same lane's next round, `schedule.meta["lanes"]`).
"""

from __future__ import annotations

from .action import GRADIENT, KIND_SPECS, PROFILES, Action, Kind


class Routes:
    """The messages of one schedule: `producer(action)`, `consumer(action)` and `consumer_stage(action)`."""

    def __init__(self, schedule: "Schedule"):
        self.n_stages, self.n_microbatches = schedule.n_stages, schedule.n_microbatches
        self.profiles = schedule.profiles  # per stage: "whole backward", "split backward", ...
        self.gradient_kind = schedule.gradient_kind  # per stage: B, or I where it splits its backward
        self.lanes = schedule.meta.get("lanes", 0)  # a wrapping kind: micro-batches per round

    def producer(self, action: Action) -> Action | None:
        """The action on another stage whose result `action` receives (an activation for F, a gradient for
        B or I, the previous round's token for G on stage 0), or None (stage 0's F, the last stage's backward,
        a W)."""
        for need, offset in action.spec.needs:
            stage = action.stage + offset
            if offset and 0 <= stage < self.n_stages:
                kind = self.gradient_kind[stage] if need == GRADIENT else need
                return Action(kind, stage, action.microbatch)
            if offset and action.spec.wraps and stage == -1 and action.microbatch >= self.lanes > 0:
                return Action(need, self.n_stages - 1, action.microbatch - self.lanes)
        return None

    def consumer(self, action: Action) -> Action | None:
        """The action on another stage that receives what `action` produces, or None."""
        target = self.consumer_stage(action)
        if target is None:
            return None
        wrapped = action.spec.wraps and action.stage + action.spec.sends >= self.n_stages
        microbatch = action.microbatch + (self.lanes if wrapped else 0)
        return next(candidate for candidate in (Action(kind, target, microbatch) for kind in KIND_SPECS)
                    if self.runs(candidate.kind, target) and self.producer(candidate) == action)

    def runs(self, kind: Kind, stage: int) -> bool:
        """Whether `stage` runs actions of `kind`: those of its profile (`action.PROFILES`)."""
        return kind in PROFILES[self.profiles[stage]]

    def consumer_stage(self, action: Action) -> int | None:
        """The stage that receives what `action` produces, or None: nothing is sent (a W; stage 0's
        backward; the last stage's forward, whose output goes to the loss; the last round's token)."""
        sends = action.spec.sends
        target = action.stage + sends
        if sends and 0 <= target < self.n_stages:
            return target
        if action.spec.wraps and target == self.n_stages and action.microbatch + self.lanes < self.n_microbatches:
            return 0
        return None
