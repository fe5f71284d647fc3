"""Task 2.2: the pipeline bubble, from the closed form and from a trace of events (lesson 03)."""

from __future__ import annotations

from collections.abc import Sequence


def bubble_fraction_formula(n_stages: int, n_microbatches: int) -> float:
    """The idle share of a GPipe (or 1F1B) step with equal stages and free communication.

    With p = ``n_stages`` and m = ``n_microbatches``, and every stage taking t_F per
    forward and t_B per backward, the step lasts (m + p - 1)(t_F + t_B), of which each
    device computes m (t_F + t_B); the rest, (p - 1)(t_F + t_B), is the bubble (filling
    and draining the pipeline).  As a share of the step:

        bubble fraction = (p - 1) / (m + p - 1)

    (GPipe, Huang et al. 2019, §2.3; Megatron-LM, Narayanan et al. SC21, §2.2.1, which
    also writes it relative to the ideal time m (t_F + t_B) as (p - 1) / m: that is
    another number, not the share of the step asked for here).  Returns a ``float``
    (``0.0``, not ``0``, for one stage; not a ``Fraction`` or a numpy float).

    >>> bubble_fraction_formula(4, 8)  # 3 / 11
    0.2727272727272727
    >>> bubble_fraction_formula(1, 8)  # one stage: no bubble
    0.0

    Raises:
        ValueError: if ``n_stages < 1`` or ``n_microbatches < 1``.
    """
    # TODO: Implement for Task 2.2.
    raise NotImplementedError("Task 2.2")


def bubble_fraction_from_events(events: Sequence[tuple[int, float, float]], n_devices: int) -> float:
    """The idle share of a step, measured from what each device did and when.

    ``events`` lists every computation of the step as ``(device, start, end)`` (seconds,
    int or float; a device's own events do not overlap), in any order, as a list or a
    tuple; it is left unchanged.  The step lasts from the first start to the
    last end, makespan = max(end) - min(start), during which the ``n_devices`` devices
    could have computed for n_devices x makespan; they computed for sum(end - start):

        bubble fraction = 1 - sum(end - start) / (n_devices x makespan)

    A device with no event at all was idle for the whole step and counts too.  When the
    makespan is 0 (every event starts and ends at the same instant) the answer is 0.0.
    Returns a ``float``, as :func:`bubble_fraction_formula` does.

    >>> # device 0 computes in [0, 1] and [3, 4], device 1 in [1, 3]: 4 s of 2 x 4 s
    >>> bubble_fraction_from_events([(0, 0.0, 1.0), (1, 1.0, 3.0), (0, 3.0, 4.0)], 2)
    0.5

    Raises:
        ValueError: if ``n_devices < 1``; if ``events`` is empty; if an event ends before
            it starts; if an event's device is not one of 0 .. n_devices - 1.
    """
    # TODO: Implement for Task 2.2.
    raise NotImplementedError("Task 2.2")
