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
    times: dict[Action, tuple[float, float]] = {}
    next_index = [0] * len(actions)  # the position of each device's next action
    device_free = [0.0] * len(actions)  # when each device finishes its last action
    remaining = sum(len(row) for row in actions)
    while remaining:
        progressed = False
        for device, row in enumerate(actions):  # run each device as far as it can go
            while next_index[device] < len(row):
                action = row[next_index[device]]
                needed = _dependencies(action, n_stages)
                if any(dependency not in times for dependency in needed):
                    break  # wait; another device has to run first
                start = max([device_free[device]] + [times[dependency][1] for dependency in needed])
                end = start + duration(action)
                times[action] = (start, end)
                device_free[device] = end
                next_index[device] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # a whole sweep and nobody moved: nobody ever will
            raise ValueError("deadlock: " + "; ".join(_waits(actions, next_index, times, n_stages)))
    return times


def _dependencies(action: Action, n_stages: int) -> list[Action]:
    kind, stage, microbatch = action
    if kind == "F":
        return [("F", stage - 1, microbatch)] if stage > 0 else []
    if stage < n_stages - 1:
        return [("F", stage, microbatch), ("B", stage + 1, microbatch)]
    return [("F", stage, microbatch)]


def _waits(actions, next_index, times, n_stages) -> list[str]:
    """'device 0 is stuck at ('B', 0, 0), waiting for ('B', 1, 0)' for every stuck device."""
    waits = []
    for device, row in enumerate(actions):
        if next_index[device] < len(row):
            action = tuple(row[next_index[device]])
            missing = [tuple(d) for d in _dependencies(action, n_stages) if d not in times]
            waits.append(f"device {device} is stuck at {action!r}, waiting for {missing[0]!r}")
    return waits
