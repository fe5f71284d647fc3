"""Task 5.3: zero-bubble ZB-H1, the backward split into B and W, as a table of actions (lesson 11)."""

from __future__ import annotations


def zero_bubble_h1_schedule(n_stages: int, n_microbatches: int) -> list[list[tuple[str, int, int]]]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §3.1).

    Three kinds of action: F (forward), B (the gradient of the stage's *input* only, which
    stage s - 1 waits for) and W (the gradient of the stage's *weights*, which nobody waits
    for; W(s, i) needs B(s, i)).  Row s is device s's list of actions
    ``(kind, stage, microbatch)``, each a tuple of a ``str`` and two ``int`` (Task 2.1's
    format, not lists); the table is a list of lists, new at each call (the caller may
    change it).  Stage s runs 1F1B's order with B as its backward,

    - warm-up w = min(p - s - 1, m) forwards; then for k = 0 .. m - 1: the forward
      F(s, w + k) if there is one left, then B(s, k);
    - its first s backwards are not followed by a W; every later B is followed by the W
      of the oldest micro-batch whose W has not run yet;
    - the W's still owed run at the end, oldest first.

    The delay is s even when m < p cuts the warm-up short (not p - 1 - w):

    >>> [" ".join(f"{kind}{mb}" for kind, _, mb in row) for row in zero_bubble_h1_schedule(4, 2)]
    ['F0 F1 B0 W0 B1 W1', 'F0 F1 B0 B1 W0 W1', 'F0 F1 B0 B1 W0 W1', 'F0 B0 F1 B1 W0 W1']

    Deferring W fills the idle slots 1F1B leaves: with the same T_F, T_B, T_W on every
    stage (m >= p, T_W <= T_F, T_B) each stage idles (p - 1)(T_F + T_B - T_W) instead of
    1F1B's (p - 1)(T_F + T_B + T_W) (Zero Bubble PP, Table 2), and no stage holds more
    than min(p, m) micro-batches (a micro-batch leaves at its W), 1F1B's peak.  p=4, m=8,
    every action one time step:

        device 0 | F0 F1 F2 F3 .  .  .  B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7
        device 1 | .  F0 F1 F2 .  .  B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7
        device 2 | .  .  F0 F1 .  B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7
        device 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7

    Raises:
        ValueError: if ``n_stages < 1`` or ``n_microbatches < 1`` (zero or negative).
    """
    # TODO: Implement for Task 5.3.
    raise NotImplementedError("Task 5.3")
