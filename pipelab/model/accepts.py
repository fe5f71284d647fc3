"""Which micro-batches a traced graph accepts: the shapes `torch.export` recorded for its inputs.

A graph traced with dynamic dimensions (`Dim.AUTO`) records each input dimension as a number (a
size export specialised: a hidden width, a dimension of size 1) or as a symbol of the trace (the
batch, the sequence length), with the range export found the graph valid for (2 and up, where the
forward treats size 1 apart), or as an expression of symbols.  A micro-batch fits when its sizes
bind each symbol to one value inside its range, match every number, and satisfy every expression;
its other values (flags) must equal the traced ones.  The same rule as torch.export's own input
check (`torch._export.utils._check_input_constraints_for_graph`), kept as plain numbers and
sympy expressions so that a stage does not hold the whole model's graph to apply it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx


class Accepts:
    """`accepts(flat)`: whether a graph with these input `placeholders` (and the trace's symbol `ranges`,
    `ExportedProgram.range_constraints`) runs the flat inputs `flat` as the model would."""

    def __init__(self, placeholders: list[fx.Node], ranges: dict):
        self.expected = [_expected(node.meta.get("val")) for node in placeholders]
        self.ranges = {symbol: (_bound(r.lower), _bound(r.upper)) for symbol, r in ranges.items()}

    def __call__(self, flat: list) -> bool:
        bound: dict = {}
        later = []
        for (kind, want), value in zip(self.expected, flat):
            if kind == "value":
                if type(value) is not type(want) or value != want:
                    return False
                continue
            if not isinstance(value, torch.Tensor) or len(want) != value.dim():
                return False
            for dim, size in zip(want, value.shape):
                if isinstance(dim, int):
                    if dim != size:
                        return False
                elif dim.is_Symbol:
                    if bound.setdefault(dim, size) != size:
                        return False
                else:
                    later.append((dim, size))
        for symbol, size in bound.items():
            low, high = self.ranges.get(symbol, (None, None))
            if (low is not None and size < low) or (high is not None and size > high):
                return False
        return all(not dim.free_symbols - set(bound) and int(dim.subs(bound)) == size for dim, size in later)

    @property
    def dynamic(self) -> bool:
        """Whether any input dimension is a symbol (the graph runs more than one shape)."""
        return any(kind == "tensor" and not all(isinstance(d, int) for d in want) for kind, want in self.expected)


def _expected(val: Any) -> tuple[str, Any]:
    if isinstance(val, torch.Tensor):
        return "tensor", tuple(_dimension(d) for d in val.shape)
    return "value", val


def _dimension(dim):
    if isinstance(dim, torch.SymInt):
        expr = dim.node.expr
        return int(expr) if expr.is_number else expr
    return int(dim)


def _bound(value) -> int | None:
    """A range's end as an int; None where it is unbounded."""
    try:
        return int(value)
    except Exception:  # noqa: BLE001 - sympy's infinity (int_oo) refuses int() in several ways
        return None


def shapes_of(batch: Any) -> dict:
    """{key: shape} of a micro-batch's tensors (its other values as they are), for messages."""
    if isinstance(batch, dict):
        return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return batch
