"""Task 2.1: the GPipe schedule as a table of actions, one row per device (lesson 03)."""

from __future__ import annotations


def gpipe_schedule(n_stages: int, n_microbatches: int) -> list[list[tuple[str, int, int]]]:
    """GPipe (fill-drain): every forward, then every backward (Huang et al. 2019, §2.3).

    A schedule is data: row d is the ordered list of actions device d runs in one training
    step.  An action is a tuple ``(kind, stage, microbatch)`` of a ``str`` and two
    ``int``: ``("F", 2, 0)`` is the forward of micro-batch 0 through stage 2, ``("B", 2,
    0)`` its backward.  The table is a list of lists, new at each call (the caller may
    change it).  Device s runs
    stage s (p = ``n_stages`` devices), and its row is

        F(s, 0), F(s, 1), ..., F(s, m-1),   B(s, 0), B(s, 1), ..., B(s, m-1)

    with m = ``n_microbatches``: all m forwards first (fill), then all m backwards in the
    same micro-batch order (drain).  Stage s therefore keeps the activations of all m
    micro-batches at once.  Run with every action one time step long and each action as
    soon as its inputs are ready (F(s, i) needs F(s-1, i); B(s, i) needs F(s, i) and
    B(s+1, i)), p=4 and m=8 look like this (``.`` = idle, the bubble):

        device 0 | F0 F1 F2 F3 F4 F5 F6 F7 .  .  .  .  .  .  B0 B1 B2 B3 B4 B5 B6 B7
        device 1 | .  F0 F1 F2 F3 F4 F5 F6 F7 .  .  .  .  B0 B1 B2 B3 B4 B5 B6 B7 .
        device 2 | .  .  F0 F1 F2 F3 F4 F5 F6 F7 .  .  B0 B1 B2 B3 B4 B5 B6 B7 .  .
        device 3 | .  .  .  F0 F1 F2 F3 F4 F5 F6 F7 B0 B1 B2 B3 B4 B5 B6 B7 .  .  .

    >>> gpipe_schedule(2, 2)  # doctest: +NORMALIZE_WHITESPACE
    [[('F', 0, 0), ('F', 0, 1), ('B', 0, 0), ('B', 0, 1)],
     [('F', 1, 0), ('F', 1, 1), ('B', 1, 0), ('B', 1, 1)]]

    Raises:
        ValueError: if ``n_stages < 1`` or ``n_microbatches < 1``.
    """
    # TODO: Implement for Task 2.1.
    raise NotImplementedError("Task 2.1")
