"""Task 2.3: the core of the event simulator: when does each action start and end? (lesson 03)"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Action = tuple[str, int, int]  # (kind, stage, microbatch), kind "F" or "B"


def simulate_core(
    actions: Sequence[Sequence[Action]], n_stages: int, duration: Callable[[Action], float]
) -> dict[Action, tuple[float, float]]:
    """Time every action of a schedule: ``{action: (start, end)}`` in seconds from 0.

    ``actions[d]`` is device d's ordered list of actions ``(kind, stage, microbatch)``
    (the tables of Tasks 2.1 and 3.1; a device may also run several stages), and
    ``duration(action)`` says how many seconds an action takes.  The rules:

    - each device runs its own list in order, one action at a time;
    - an action needs the results of its dependencies:
      F(s, i) needs F(s-1, i) (its input; stage 0 needs nothing);
      B(s, i) needs F(s, i) and B(s+1, i) (its gradient; the last stage needs only F);
    - so an action starts as soon as its device is free *and* its dependencies have ended:

        start(a) = max(end of the previous action on a's device (0 for the first),
                       end(d) for every dependency d of a)
        end(a)   = start(a) + duration(a)

    The devices' lists may be processed in any order (a device often has to wait for
    one listed after it), and the result must not depend on that order.  If no device
    can run its next action while some actions are left, the schedule deadlocks (say a
    device's next action waits for something later in its own list, or two devices wait
    for each other, or a dependency is in no list at all): raise ValueError, and let its
    message name a stuck action as its tuple, e.g. ``('B', 0, 0)``.  Never loop forever.

    ``actions`` (lists or tuples) is left unchanged.  Returns a new dict whose values
    are ``(start, end)`` tuples of ``float``, even when ``duration`` returns ints.

    Two stages, one micro-batch, forwards of 1 s and backwards of 2 s:

    >>> table = [[("F", 0, 0), ("B", 0, 0)], [("F", 1, 0), ("B", 1, 0)]]
    >>> times = simulate_core(table, 2, lambda action: 1.0 if action[0] == "F" else 2.0)
    >>> [times[a] for a in [("F", 0, 0), ("F", 1, 0), ("B", 1, 0), ("B", 0, 0)]]
    [(0.0, 1.0), (1.0, 2.0), (2.0, 4.0), (4.0, 6.0)]

    Raises:
        ValueError: on a deadlock, naming a stuck action (see above).
    """
    # TODO: Implement for Task 2.3.
    raise NotImplementedError("Task 2.3")
