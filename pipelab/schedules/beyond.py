"""Schedules beyond 1F1B: interleaved 1F1B (virtual stages), zero bubble (B/W split), asynchronous PipeDream.

Same data as every other schedule (`pipelab.schedules.action`): a `Schedule` whose `actions[d]`
is device d's list.  Interleaving gives a device several stages (its model chunks); zero
bubble uses the third kind, W, the weight-gradient half of a backward whose B then
computes only the input gradient.  `pl.schedules` re-exports these generators.
"""

from __future__ import annotations

from ..common.checks import check_counts
from .action import Action
from .schedule import Schedule


def interleaved_1f1b(n_devices: int, n_microbatches: int, n_chunks: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., SC21, §2.2.2; the order of Megatron-LM's `schedules.py`).

    The model is cut into p·v stages (p = `n_devices`, v = `n_chunks`); virtual stage k
    runs on device k mod p, so device d holds chunks d, d + p, d + 2p, ...  Each device
    walks its m·v chunk-micro-batches in rounds of p micro-batches: forward number k
    (k = 0 .. m·v - 1) is micro-batch (k // (p v)) p + k mod p through its chunk
    (k mod p v) // p; backward number k the same micro-batch through chunk v - 1 - that.
    Device d first runs w_d = min(2 (p - d - 1) + (v - 1) p, m v) forwards (Megatron's
    warm-up count), then alternates one forward and one backward, then drains.  v = 1 is
    plain 1F1B (warm-up p - d - 1).  m must be a multiple of p.

    Uniform chunks (each 1/v of a stage): the bubble is (p - 1)/(v m) of the ideal time
    m (t_F + t_B), v times smaller than 1F1B's, and every micro-batch crosses p v - 1
    boundaries each way instead of p - 1 (about v times the messages).  Device 0 holds at
    most min(w_0 + 1, m v) = min(v p + p - 1, m v) chunk-micro-batches at once (v ≥ 2): its
    warm-up plus the forward it runs before its first backward; in whole-stage units
    (a chunk keeps 1/v of a stage's activations) p (1 + (p - 1)/(p v)) micro-batches, a
    little more than 1F1B's p.  p=2, m=4, v=2, every action one time step (on row 0,
    cell 2F0 is stage 2, the second chunk of device 0):

        device 0 | F0  F1  2F0 2F1 F2  2B0 F3  2B1 2F2 B0  2F3 B1  .   2B2 .   2B3 B2  B3
        device 1 | .   F0  F1  3F0 3B0 3F1 3B1 F2  B0  F3  B1  3F2 3B2 3F3 3B3 B2  B3  .
    """
    check_counts(n_devices=n_devices, n_microbatches=n_microbatches, n_chunks=n_chunks)
    p, m, v = n_devices, n_microbatches, n_chunks
    if m % p:
        lower, upper = (m // p) * p, (m // p + 1) * p
        options = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(f"interleaved 1F1B needs n_microbatches to be a multiple of n_devices={p} "
                         f"(rounds of {p} micro-batches); got {m}, use {options}")
    total = m * v

    def microbatch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def chunk(k: int) -> int:
        return (k % (p * v)) // p

    actions = []
    for d in range(p):
        warmup = min(p - d - 1 if v == 1 else 2 * (p - d - 1) + (v - 1) * p, total)
        forwards = [Action("F", chunk(k) * p + d, microbatch(k)) for k in range(total)]
        backwards = [Action("B", (v - 1 - chunk(k)) * p + d, microbatch(k)) for k in range(total)]
        row = forwards[:warmup]
        for k in range(total - warmup):  # steady state: one forward, one backward
            row += [forwards[warmup + k], backwards[k]]
        row += backwards[total - warmup:]  # cool-down
        actions.append(row)
    return Schedule(p * v, m, actions, name=f"interleaved-1f1b (v={v})", meta={"n_chunks": v})


def zero_bubble_h1(n_stages: int, n_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §3.1, Figure 3 top).

    The backward is split in two: I(s, i) computes only the gradient of stage s's input
    (what stage s - 1 waits for; the paper's B), W(s, i) only the gradient of stage s's
    weights (which nobody waits for).  Stage s runs 1F1B's order with I for the backward,
    w = min(p - s - 1, m) forwards first, and defers W's: for its first s steady-state pairs
    it runs no W, afterwards each I is followed by the W of the oldest micro-batch whose W
    is still owed; the owed W's run at the end.  The deferred W's fill the idle slots 1F1B
    leaves at the end of each stage, so with the same costs on every stage the idle time per
    stage drops from (p - 1)(T_F + T_B + T_W) (1F1B, whole backwards) to
    (p - 1)(T_F + T_B - T_W) (Zero Bubble PP, Table 2), for m >= p and T_W <= T_F, T_B
    (the paper's setting, T_F ~ T_B ~ T_W; the tests sweep both sides of that bound).
    A micro-batch stays in flight until its W: every stage holds min(p, m) micro-batches
    at its peak, stage 0 as many as in 1F1B, so the peak over stages is 1F1B's, p M_B.
    p=4, m=8, every action one time step:

        device 0 | F0 F1 F2 F3 .  .  .  I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7
        device 1 | .  F0 F1 F2 .  .  I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 F6 I4 W3 F7 I5 W4 I6 W5 I7 W6 W7
        device 2 | .  .  F0 F1 .  I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 F6 I5 W3 F7 I6 W4 I7 W5 W6 W7
        device 3 | .  .  .  F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7
    """
    check_counts(n_stages=n_stages, n_microbatches=n_microbatches)
    p, m = n_stages, n_microbatches
    actions = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        row = [Action("F", s, i) for i in range(warmup)]
        owed = 0  # W's are run oldest first; `owed` is the next micro-batch whose W has not run
        for k in range(m):
            if warmup + k < m:
                row.append(Action("F", s, warmup + k))
            row.append(Action("I", s, k))
            if k >= s:  # the first s backwards leave their W for later
                row.append(Action("W", s, owed))
                owed += 1
        row += [Action("W", s, i) for i in range(owed, m)]
        actions.append(row)
    return Schedule(p, m, actions, name="zb-h1")


def count_messages(schedule: Schedule) -> int:
    """Messages one step sends between devices: `Schedule.message_count()` (kept under this name
    for the lessons).  1F1B: 2 m (p - 1); interleaved: 2 m (p v - 1)."""
    return schedule.message_count()
