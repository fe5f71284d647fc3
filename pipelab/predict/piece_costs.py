"""`PieceCosts`: a model cut at every place it may be cut, each piece measured once; any cut's stage costs
are then sums over its pieces, with no new measurement.

    stage [a, b) of pieces:  F = sum F_k,  B = sum B_k  (or I = sum I_k and W = sum W_k),
                             memory = sum M_k,  sends = out_(b-1),  receives = in_a

except the first stage split: its input needs no gradient, so its I is piece 0's (nothing to compute
past it) and its W the whole backward of the rest, sum B_k - I_0, one pass as the engine runs it.

The pieces are the blocks of an `nn.Sequential`, or a model split by names before every cut point
(`model/cut_points.py`).  Each is profiled as the engines run a stage (`Costs.from_profile`): once with
whole backwards (fused weight-gradient accumulation, as GPipe and 1F1B run them) and once split into I
and W (as a schedule with W actions runs them, Zero Bubble PP's T_B and T_W).  Each piece also pays a
hand-over that a stage of several pieces does not, so the pieces are scaled to add up to the whole
model measured as one stage (`calibrated`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

from torch import nn

from ..model import microbatch
from ..model.cut_points import cut_points
from ..model.named_split import split_by_names
from ..model.partition import Partition
from .costs import Costs

@dataclass(frozen=True)
class PieceCosts:
    """Per piece k of a model: `whole` (a `Costs` with F and whole B) and `split` (I as `backward`, W as
    `weight`, and the bytes kept from I to W).  `points[k]` is the module where piece k + 1 begins."""

    points: list[str]
    whole: Costs
    split: Costs

    @property
    def n_pieces(self) -> int:
        return len(self.points) + 1

    def stage_costs(self, bounds: list[tuple[int, int]], split: bool, latency: float = 0.0,
                    bandwidth: float = math.inf, overhead: float = 0.0) -> Costs:
        """The costs of the stages `bounds` (pieces a up to, not incl., b), whole or split backwards, each action
        `overhead` seconds longer (what the engine adds to every action: `runtime/engine_costs.py`)."""
        def total(costs: Costs, name: str) -> list[float]:
            values = getattr(costs, name)
            return [float(sum(values[a:b])) for a, b in bounds]

        backward, weight = total(self.split if split else self.whole, "backward"), 0.0
        if split:
            weight = total(self.split, "weight")
            if bounds[0][0] == 0:  # the first stage's input needs no gradient: its I is piece 0's, W all the rest
                first = bounds[0][1]
                backward[0] = float(self.split.backward[0])
                weight[0] = float(sum(self.whole.backward[:first])) - backward[0]
        def more(values):
            return [v + overhead for v in values] if isinstance(values, list) else values

        return Costs(forward=more(total(self.whole, "forward")), backward=more(backward),
                     weight=more(weight), latency=latency,
                     bandwidth=bandwidth,
                     activation_bytes=[float(self.whole.activation_bytes[b - 1]) for _, b in bounds],
                     memory_bytes=total(self.whole, "memory_bytes"),
                     input_bytes=[float(self.whole.input_bytes[a]) for a, _ in bounds],
                     weight_memory_bytes=total(self.split, "weight_memory_bytes"))

    def step_seconds(self) -> list[float]:
        """Per piece, F + B (whole): its share of the work, the weight a balanced cut evens out."""
        return [f + b for f, b in zip(self.whole.forward, self.whole.backward)]


def pieces_and_points(model: nn.Module, sample: Any) -> tuple[list[str], bool]:
    """(the cut points, whether the model is split by names): an `nn.Sequential`'s block indices, or the names
    `cut_points` finds (`sample`: one micro-batch as the model's keyword arguments)."""
    if isinstance(model, nn.Sequential):
        if len(model) < 2:
            raise ValueError("split_method='auto' chooses where to cut, and this nn.Sequential has one block")
        return [str(k) for k in range(1, len(model))], False
    return cut_points(model, sample), True


def measure_stages(model: nn.Module, partition: Partition, sample_batch: tuple[Any, Any], loss_fn: Callable | None,
                   threads: int | None = 1, repeats: int = 3) -> PieceCosts:
    """The stages of a given cut, each profiled as one piece (schedule="auto" on the user's own cut);
    `sample_batch` is one micro-batch (inputs, targets), for a model split by names (its keyword arguments, None)."""
    was_training = model.training
    whole = Costs.from_profile(model, partition, sample_batch, loss_fn, repeats=repeats, threads=threads)
    split = Costs.from_profile(model, partition, sample_batch, loss_fn, repeats=repeats, threads=threads,
                               split_backward=True)
    model.train(was_training)
    return PieceCosts([f"stage {s}" for s in range(1, len(partition))], whole, split)


def measure_pieces(model: nn.Module, points: list[str], named: bool, sample_batch: tuple[Any, Any],
                   loss_fn: Callable | None, threads: int | None = 1,
                   repeats: int = 3) -> tuple[PieceCosts, list[nn.Module]]:
    """Every piece of `model` cut at all of `points` (module docstring), profiled: the costs, and the pieces
    (modules sharing the model's parameters: what a cut's stages hold)."""
    if named:
        pieces = split_by_names(model, points, sample_batch[0])
    else:
        pieces = [model[k:k + 1] for k in range(len(model))]
    parts = Partition([(k, k + 1) for k in range(len(pieces))], pieces, "pieces", [1.0] * len(pieces))
    costs = measure_stages(model, parts, sample_batch, loss_fn, threads, repeats)
    one = Costs.from_profile(model, Partition([(0, 1)], [_Whole(model)], "whole", [1.0]), sample_batch, loss_fn,
                             repeats=repeats, threads=threads)
    return calibrated(PieceCosts(list(points), costs.whole, costs.split), one), pieces


def calibrated(pieces: PieceCosts, one: Costs) -> PieceCosts:
    """`pieces` scaled so that their F and B add up to the whole model's, measured as one stage (`one`).

    Each piece pays a hand-over a stage of several pieces does not (its input made a leaf, its output
    detached, its own autograd graph: 5-10 % of B for GPT-2's pieces of 4 x 64 tokens, measured); scaling
    by sum_whole / sum_pieces, F and B apart (I by B's factor: the hand-over is on the input's path; W, which
    only reads what I kept, as measured), takes that out of every cut alike."""
    def scale(costs: Costs, **factors: float) -> Costs:
        return replace(costs, **{name: [v * factor for v in getattr(costs, name)] for name, factor in factors.items()})

    def factor(name: str) -> float:
        total = sum(getattr(pieces.whole, name))
        return float(getattr(one, name)[0]) / total if total > 0 else 1.0

    f, b = factor("forward"), factor("backward")
    return PieceCosts(pieces.points, scale(pieces.whole, forward=f, backward=b),
                      scale(pieces.split, forward=f, backward=b))


class _Whole(nn.Module):
    """The model as one stage: its keyword arguments from a dict batch, as a stage split by names takes them."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: Any) -> Any:
        return self.model(**inputs) if isinstance(inputs, dict) else self.model(inputs)


def first_microbatch(sample: Any, targets: Any, n_microbatches: int) -> tuple[Any, Any]:
    """One micro-batch of a whole batch: (its inputs, its targets or None)."""
    inputs = microbatch.split(sample, n_microbatches)[0]
    return inputs, (None if targets is None else microbatch.split(targets, n_microbatches)[0])
