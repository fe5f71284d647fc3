"""Activation memory over a step, from the events and the bytes each micro-batch holds; checkpointing plans.

The "counted" rule.  The engines (bytes counted by autograd's saved-tensor hooks) and the
simulator (bytes from the cost model) build their "counted" curve the same way:

- F(s, i) ends:   + held(s, i)       (what stage s keeps for micro-batch i until its backward)
- B(s, i) or I(s, i) starts: + transient(s, i)  (a checkpointed stage recomputing its forward)
- B(s, i) ends:   - held(s, i) - transient(s, i)
- a split backward: I(s, i) ends: - held(s, i) - transient(s, i) + for_w(s, i);  W(s, i) ends: - for_w(s, i)

for_w(s, i) is what W still needs (`KindSpec.leaves_for_w`): the inputs of the layers with weights and the
gradients of their outputs, the Zero Bubble paper's M_W (Qi et al. 2024, Table 1: 32·b·s·h bytes per
transformer layer at 16 bits, against M_B = 34·b·s·h + 5·a·s²·b for the whole backward).  Without a
for_w (None) nothing leaves before W: for_w = held + transient.

It is a rule, not a measurement: a prediction from `Costs.from_profile` (the same counts)
equals the engine's counted curve by construction.  The engines' "observed" curve
(`pipelab/runtime/memory_observer.py`) measures instead when each storage a stage keeps is
really freed, and includes what the rule leaves out (inputs received before their F,
outputs until sent, gradients until used).
"""

from __future__ import annotations

from typing import Callable

from ..schedules.action import GRADIENT_KINDS, HOLDING_KINDS, NARROWING_KINDS, RELEASING_KINDS
from ..schedules.trace import Event, MemorySample

Bytes = Callable[[int, int], float]  # (stage, microbatch) -> bytes
COUNTED_KINDS = HOLDING_KINDS | GRADIENT_KINDS | NARROWING_KINDS | RELEASING_KINDS  # all but E and G


def activation_samples(events: list[Event], held: Bytes, transient: Bytes, n_devices: int,
                       for_w: Bytes | None = None) -> list[MemorySample]:
    """"counted" memory samples (one per change, plus a zero at t=0 per device) following the rule above."""
    changes = []  # (time, 0 for a release so it sorts first at equal times, then the events' order, device, delta)
    split = {(e.stage, e.microbatch) for e in events if e.kind in NARROWING_KINDS}
    for n, e in enumerate(events):
        if e.kind not in COUNTED_KINDS:  # a forward-only E or G keeps nothing
            continue
        stage, mb = e.stage, e.microbatch
        whole = held(stage, mb) + transient(stage, mb)  # what F and a recomputation added
        left = whole if for_w is None or (stage, mb) not in split else for_w(stage, mb)  # what waits for W
        if e.kind in HOLDING_KINDS:
            changes.append((e.end, 1, n, e.device, held(stage, mb)))
        if e.kind in GRADIENT_KINDS and transient(stage, mb):
            changes.append((e.start, 1, n, e.device, transient(stage, mb)))
        if e.kind in NARROWING_KINDS and left != whole:
            changes.append((e.end, 0, n, e.device, left - whole))
        if e.kind in RELEASING_KINDS:
            changes.append((e.end, 0, n, e.device, -(left if (stage, mb) in split else whole)))
    level = [0.0] * n_devices
    samples = [MemorySample(d, 0.0, 0, "counted") for d in range(n_devices)]
    for time, _, _, device, delta in sorted(changes):
        level[device] += delta
        samples.append(MemorySample(device, time, round(level[device]), "counted"))
    return samples


def checkpoint_plan(checkpoint, n_stages: int) -> list[bool]:
    """Resolve the `checkpoint` option to one boolean per stage."""
    if isinstance(checkpoint, str):
        plans = {"never": [False] * n_stages, "always": [True] * n_stages,
                 "except_last": [True] * (n_stages - 1) + [False]}
        if checkpoint not in plans:
            raise ValueError(f"checkpoint must be one of {sorted(plans)} or a list of booleans, got {checkpoint!r}")
        return plans[checkpoint]
    if isinstance(checkpoint, (list, tuple)) and len(checkpoint) == n_stages and all(isinstance(c, bool) for c in checkpoint):
        return list(checkpoint)
    raise ValueError(f"checkpoint as a list needs one boolean per stage ({n_stages}), got {checkpoint!r}")
