"""Task 3.1: the 1F1B schedule (PipeDream-Flush) as a table of actions (lesson 04)."""

from __future__ import annotations


def one_f_one_b_schedule(n_stages: int, n_microbatches: int) -> list[list[tuple[str, int, int]]]:
    """1F1B (PipeDream-Flush; Narayanan et al. 2021, PipeDream-2BW §3.2).

    Same format as Task 2.1's ``gpipe_schedule``: row s is the ordered list of actions
    ``(kind, stage, microbatch)`` (a ``str`` and two ``int``) of device s, which runs
    stage s; the table is a list of lists, new at each call.  With p = ``n_stages`` and
    m = ``n_microbatches`` (m < p included), stage s runs

    - warm-up:   w = min(p - s - 1, m) forwards, F(s, 0) .. F(s, w-1);
    - steady:    m - w pairs "one forward, then one backward":
                 F(s, w), B(s, 0), F(s, w+1), B(s, 1), ..., F(s, m-1), B(s, m-w-1);
    - cool-down: the remaining backwards B(s, m-w) .. B(s, m-1).

    A stage frees a micro-batch's activations at its backward, so stage s never holds
    more than min(p - s, m) micro-batches at once (GPipe holds m on every stage), and
    the bubble stays GPipe's, (p-1)/(m+p-1).  With every action one time step long and
    each action run as soon as its inputs are ready, p=4 and m=8 look like this:

        device 0 | F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7
        device 1 | .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .
        device 2 | .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 .  .
        device 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  .

    >>> one_f_one_b_schedule(2, 3)  # doctest: +NORMALIZE_WHITESPACE
    [[('F', 0, 0), ('F', 0, 1), ('B', 0, 0), ('F', 0, 2), ('B', 0, 1), ('B', 0, 2)],
     [('F', 1, 0), ('B', 1, 0), ('F', 1, 1), ('B', 1, 1), ('F', 1, 2), ('B', 1, 2)]]

    Raises:
        ValueError: if ``n_stages < 1`` or ``n_microbatches < 1``.
    """
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError(
            f"need at least one stage and one micro-batch, got n_stages={n_stages}, "
            f"n_microbatches={n_microbatches}"
        )
    schedule = []
    for stage in range(n_stages):
        warmup = min(n_stages - stage - 1, n_microbatches)
        row = [("F", stage, mb) for mb in range(warmup)]
        for k in range(n_microbatches - warmup):  # steady state: one forward, one backward
            row += [("F", stage, warmup + k), ("B", stage, k)]
        row += [("B", stage, mb) for mb in range(n_microbatches - warmup, n_microbatches)]
        schedule.append(row)
    return schedule
