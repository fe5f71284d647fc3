"""Task 5.2: weight stashing in asynchronous PipeDream: which weight version each action uses (lesson 10)."""

from __future__ import annotations


def weight_versions(table: list[list[tuple[str, int, int]]], update_every: int = 1) -> dict[tuple[str, int, int], int]:
    """The weight version every F and B of `table` runs with (PipeDream, SOSP 2019, §3.3).

    `table[d]` is device d's ordered list of ``(kind, stage, microbatch)`` with kinds "F"
    and "B" (one training run without a flush, e.g. 1F1B's order).  For each stage s, in
    the order of its device's list:

    - the stage's live weights start at version 0;
    - F(s, i) runs with the live version and stashes it;
    - B(s, i) runs with the version F(s, i) stashed (not the live one: weight stashing);
    - after every `update_every`-th B of stage s, its optimizer updates the live weights:
      the version goes up by one.

    Several stages may share a device (one list, e.g. interleaved 1F1B's): each counts its
    own backwards and moves its own live weights, so a B of stage 1 neither updates stage
    0's weights nor counts towards stage 0's `update_every`, even where it comes before a
    later F of stage 0.

    Returns {(kind, stage, microbatch): version} for every action; the table is not changed.

    >>> weight_versions([[("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1), ("B", 0, 2)]])
    {('F', 0, 0): 0, ('F', 0, 1): 0, ('B', 0, 0): 0, ('F', 0, 2): 1, ('B', 0, 1): 0, ('B', 0, 2): 1}

    Raises:
        ValueError: if ``update_every < 1`` (zero or negative), or a B comes before its F
            in its list.
    """
    # TODO: Implement for Task 5.2.
    raise NotImplementedError("Task 5.2")


def versions_in_flight(table: list[list[tuple[str, int, int]]], update_every: int = 1) -> list[int]:
    """Per stage, the most weight versions it must keep at once: its live weights plus every
    version stashed by a micro-batch whose F has run and whose B has not, counted after each
    action of its list.  1F1B's order with update_every=1 and m >= 2p - 1 micro-batches:
    p - s on stage s (PipeDream's p - s stashed versions).  The table is not changed; it
    raises ValueError where :func:`weight_versions` does (``update_every < 1``, a B before
    its F).

    >>> versions_in_flight([[("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1), ("B", 0, 2)],
    ...                     [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("F", 1, 2), ("B", 1, 2)]])
    [2, 1]
    """
    # TODO: Implement for Task 5.2.
    raise NotImplementedError("Task 5.2")
