"""Checks that every graded task shares: exact return types, and inputs left as they were.

``Fraction(3, 11) == 3 / 11``, ``numpy.int64(2) == 2`` and ``True == 1`` all pass ``==``;
a list sorted in place still holds the same items.  So a task's tests check the type the
docstring promises (``type(x) is float``, not only ``x == 0.27``) and that the caller's
input is unchanged after the call, given as a list and as a tuple.

An assertion message starts with the contract line it checks, in the docstring's words;
``pipelab grade`` shows that first line as the property that failed.  (No torch here:
tasks whose tests do not need it are graded without importing it.)
"""

from __future__ import annotations


def type_name(value) -> str:
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def assert_type(value, expected: type, clause: str, what: str) -> None:
    """``type(value) is expected``: a subclass (numpy.float64 of float, bool of int) fails
    too.  ``what`` names the value: "balanced_bounds([1, 2], 2) returned [(0, 1), (1, 2)];
    stage 0's start"."""
    article = "an" if expected.__name__[0] in "aeiou" else "a"
    assert type(value) is expected, (
        f"{clause} (got {type_name(value)})\n"
        f"{what} is {value!r}, a {type_name(value)}, not {article} {expected.__name__}"
    )


def picture(value):
    """What a caller could see change in ``value``: containers with their types and order,
    and each leaf's type and repr (tensors and arrays: dtype, shape and values)."""
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(picture(item) for item in value))
    if isinstance(value, dict):
        return (dict, tuple((key, picture(item)) for key, item in value.items()))
    if hasattr(value, "dtype") and hasattr(value, "tolist"):
        return (type(value), str(value.dtype), tuple(value.shape), value.tolist())
    return (type(value), repr(value))


def assert_unchanged(before, value, what: str, call: str) -> None:
    """``before`` is ``picture(value)`` taken before the call."""
    assert picture(value) == before, (
        f"{call.split('(')[0]} leaves its arguments unchanged ({what}: changed in place)\n"
        f"after {call}, {what} is {value!r}"
    )


def call_with_lists_then_tuples(function, arguments: tuple, as_tuples: tuple, *, watched, what: str,
                                call: str, check, differs):
    """``function(*arguments)``, checked to leave ``watched`` (the arguments it may change,
    named ``what`` in the message) as it was, and by ``check(result)``; then
    ``function(*as_tuples)``, the same arguments with tuples for lists, must give an equal
    result (else the message ``differs(result, again)``).  Returns the result."""
    before = picture(watched)
    got = function(*arguments)
    assert_unchanged(before, watched, what, call)
    check(got)
    again = function(*as_tuples)
    assert again == got, differs(got, again)
    return got
