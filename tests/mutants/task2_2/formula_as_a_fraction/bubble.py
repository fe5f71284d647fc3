"""Mutant of Task 2.2: the closed form as an exact ``Fraction``.

``Fraction(p - 1, m + p - 1)``: exact, and ``Fraction(3, 11) == 3 / 11`` is even True
(and pytest.approx agrees), but the docstring promises a float; a Fraction leaks into
every sum and plot label it meets.
"""

from __future__ import annotations

from fractions import Fraction

from solutions.bubble import bubble_fraction_from_events  # noqa: F401  (correct)


def bubble_fraction_formula(n_stages: int, n_microbatches: int) -> float:
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError("bad counts")
    return Fraction(n_stages - 1, n_microbatches + n_stages - 1)  # BUG: a Fraction, not a float
