"""Task 6.2: the forward-only schedule (inference), and its latency and throughput from a trace (lesson 13)."""

from __future__ import annotations

from collections.abc import Sequence

Event = tuple[str, int, int, float, float]  # (kind, stage, microbatch, start, end): an action, then when it ran


def forward_only(n_stages: int, n_microbatches: int) -> list[list[tuple[str, int, int]]]:
    """The forward-only schedule (inference, evaluation): each micro-batch through every stage once.

    Same format as Task 2.1's ``gpipe_schedule``: row s is the ordered list of actions
    ``(kind, stage, microbatch)`` (a ``str`` and two ``int``, a tuple, not a list) of
    device s, which runs stage s; the table is a list of lists, new at each call (the
    caller may change it).  The one kind is "E", *forward only*: E(s, i) needs E(s - 1, i)
    and keeps nothing, as no backward follows.  So a stage has nothing to hold and nothing
    to wait for but the stage before it: device s runs E(s, 0), E(s, 1), ..., E(s, m - 1),
    in micro-batch order.  p=4, m=8, every action one time step:

        device 0 | E0 E1 E2 E3 E4 E5 E6 E7 .  .  .
        device 1 | .  E0 E1 E2 E3 E4 E5 E6 E7 .  .
        device 2 | .  .  E0 E1 E2 E3 E4 E5 E6 E7 .
        device 3 | .  .  .  E0 E1 E2 E3 E4 E5 E6 E7

    It is GPipe's forward half, fill then drain (GPipe, Huang et al. 2019, §2.3, without
    the backward): with p equal stages of time t the step lasts (m + p - 1)·t.

    >>> forward_only(2, 3)  # doctest: +NORMALIZE_WHITESPACE
    [[('E', 0, 0), ('E', 0, 1), ('E', 0, 2)],
     [('E', 1, 0), ('E', 1, 1), ('E', 1, 2)]]

    Raises:
        ValueError: if ``n_stages < 1`` or ``n_microbatches < 1`` (zero or negative).
    """
    # TODO: Implement for Task 6.2.
    raise NotImplementedError("Task 6.2")


def latency_and_throughput(events: Sequence[Event], n_microbatches: int) -> tuple[list[float], float]:
    """Each micro-batch's latency, and the step's throughput, measured from a trace.

    ``events`` is a trace: one ``(kind, stage, microbatch, start, end)`` per action that
    ran, the action as in :func:`forward_only`'s table followed by when it started and
    ended (seconds, int or float), in any order, as a list or a tuple; it is left
    unchanged.  Every kind counts alike (E; or F and B, a training step's).  With
    m = ``n_microbatches``:

    - the latency of micro-batch i is the time it spends in the pipeline, from the start
      of its first action to the end of its last, whatever their stages:
      latency_i = max(end) - min(start) over the events of micro-batch i;
    - the throughput is micro-batches per second over the whole step, m / makespan, with
      makespan = max(end) - min(start) over all events (the step begins at its first
      start, which need not be 0; time spent idle counts, not only time computing).

    With p equal stages of time t and free links, the forward-only schedule gives every
    micro-batch the latency p·t, whatever m (a pipeline does not make one request faster),
    and a makespan of (m + p - 1)·t, so a throughput of m / ((m + p - 1)·t): towards one
    micro-batch every t as m grows, p times one device's 1 / (p·t) (GPipe, Huang et al.
    2019, §2.3, its fill-drain arithmetic without the backward).  With unequal stages the
    slowest sets the pace, and micro-batches queue in front of it: latency grows with i.

    Returns ``(latencies, throughput)``, a tuple: a list of m ``float``, ``latencies[i]``
    for micro-batch i, and a ``float`` (from int times too).

    >>> trace = [("E", 0, 0, 0.0, 1.0), ("E", 1, 0, 1.0, 2.0),   # micro-batch 0: from 0 to 2
    ...          ("E", 0, 1, 1.0, 2.0), ("E", 1, 1, 2.0, 3.0)]   # micro-batch 1: from 1 to 3
    >>> latency_and_throughput(trace, 2)  # 2 micro-batches in 3 s
    ([2.0, 2.0], 0.6666666666666666)

    Raises:
        ValueError: if ``n_microbatches < 1``; if an event's micro-batch is not one of
            0 .. m - 1; if an event ends before it starts; if a micro-batch has no event
            (the message names the first, "micro-batch i"); if the makespan is 0 (every
            event starts and ends at one instant: no throughput).
    """
    # TODO: Implement for Task 6.2.
    raise NotImplementedError("Task 6.2")
