"""Cut a sequence of blocks into contiguous pipeline stages.

Three ways to weigh a block: "uniform" (every block counts one), "params" (its parameter
count) and "time" (its measured forward + backward seconds on a sample batch).  For
"params" and "time" the cut is the optimal contiguous partition, the one that minimises
the cost of the most expensive stage — in a pipeline the slowest stage sets the pace:

    minimise over cuts 0 = b_0 < b_1 < ... < b_p = n   of   max_s  sum_{b_s <= i < b_{s+1}} c_i

solved exactly by dynamic programming in O(p n^2) (a greedy fill can be far off).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from ..common.checks import check_repeats
from ..common.threads import intra_op_threads
from .named_split import repeated_blocks, split_by_names
from .named_timing import block_times
from .stage import buffers_kept, copy_of, starts_in_place
from .traced_shapes import TracedShapes

METHODS = ("uniform", "params", "time")


@dataclass
class Partition:
    """The stages of a split model.  `stages[s]` holds blocks `bounds[s][0]` up to (not incl.) `bounds[s][1]`."""

    bounds: list[tuple[int, int]]
    stages: list[nn.Sequential]
    method: str
    block_costs: list[float]
    traced_for: Any = None  # split by names: its traces, one per set of shapes (`traced_shapes.TracedShapes`)

    @property
    def stage_costs(self) -> list[float]:
        return [sum(self.block_costs[a:b]) for a, b in self.bounds]

    def __len__(self) -> int:
        return len(self.stages)


def balanced_bounds(costs: Sequence[float], n_stages: int) -> list[tuple[int, int]]:
    """The contiguous cut of `costs` into `n_stages` non-empty stages with the smallest maximum stage cost.

    best[k][j] = min over i < j of max(best[k-1][i], cost(i..j)): the cheapest way to put
    blocks 0..j-1 on k stages.  Ties are broken deterministically (the first cut found).
    """
    costs = [float(c) for c in costs]
    n = len(costs)
    _check_stage_count(n_stages, n)
    if not all(math.isfinite(c) and c >= 0 for c in costs):
        raise ValueError(f"costs must be finite and non-negative, got {costs}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for j in range(k, n - (n_stages - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    bounds, end = [], n
    for k in range(n_stages, 0, -1):
        start = cut[k][end]
        bounds.append((start, end))
        end = start
    return bounds[::-1]


def uniform_bounds(n_blocks: int, n_stages: int) -> list[tuple[int, int]]:
    """Equal block counts; when they do not divide, the first stages get one block more."""
    _check_stage_count(n_stages, n_blocks)
    bounds, start = [], 0
    for s in range(n_stages):
        size = n_blocks // n_stages + (1 if s < n_blocks % n_stages else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def _check_stage_count(n_stages, n_blocks: int) -> None:
    if isinstance(n_stages, bool) or not isinstance(n_stages, int):
        raise TypeError(f"n_stages must be an int, got {type(n_stages).__name__}")
    if n_stages < 1:
        raise ValueError(f"n_stages must be at least 1, got {n_stages}")
    if n_stages > n_blocks:
        raise ValueError(
            f"cannot cut {n_blocks} blocks into {n_stages} stages: every stage needs at least one block"
        )


def parameter_counts(model: nn.Sequential) -> list[float]:
    return [float(sum(p.numel() for p in block.parameters())) for block in model]


def measured_times(model: nn.Sequential, sample: Any, repeats: int = 5) -> list[float]:
    """Forward + backward seconds of each block on `sample` (inputs of the first block), the best
    (minimum) of `repeats` runs: other work on the machine only ever adds time."""
    check_repeats(repeats)
    times: list[list[float]] = [[] for _ in model]
    first = next(model.parameters(), None)
    on_cuda = first.is_cuda if first is not None else (isinstance(sample, torch.Tensor) and sample.is_cuda)
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    copies = [starts_in_place(block) for block in model]
    with buffers_kept(model.buffers()):  # timing forwards leave BatchNorm's statistics alone
        for _ in range(repeats):
            _time_blocks(model, sample, copies, times, sync)
    return [min(t) for t in times]


def _time_blocks(model: nn.Sequential, sample: Any, copies: list[bool], times: list[list[float]], sync) -> None:
    x = sample
    for index, block in enumerate(model):
        inp = x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
        sync()
        begin = time.perf_counter()
        out = block(copy_of(inp) if copies[index] else inp)
        wrt = [t for t in [inp, *block.parameters()] if isinstance(t, torch.Tensor) and t.requires_grad]
        if wrt:  # autograd.grad leaves the model's .grad untouched
            torch.autograd.grad(out, wrt, torch.ones_like(out), allow_unused=True)
        sync()
        times[index].append(time.perf_counter() - begin)
        x = out.detach()


def split(model: nn.Module, n_stages: int | None = None, method: str = "uniform", sample: Any = None,
          threads: int | None = 1, repeats: int = 5, *, split_points: list[str] | None = None) -> Partition:
    """Split `model` (an `nn.Sequential` of blocks) into `n_stages` contiguous stages.

    The stages are slices of `model`: they share its parameters, so gradients computed
    through the stages land in `model.parameters()`.  method="time" needs `sample`, an
    input batch for the first block, and times the blocks on `threads` intra-op threads
    (default 1; None: the caller's setting), each block's cost the best of `repeats` runs.

    Any other module: `sample`, one micro-batch as the model's keyword arguments, and either
    `split_points`, the names of the modules where a new stage begins (`model.named_modules()`),
    or `n_stages` with method "uniform", "params" or "time" over its repeated blocks (`points_for`): the
    model's own forward is traced and cut there (`named_split.py`).
    """
    if split_points is None and not isinstance(model, nn.Sequential) and sample is not None:
        split_points = points_for(model, n_stages, method, sample, threads, repeats)  # between its repeated blocks
    if split_points is not None:
        return _split_by_names(model, split_points, sample, n_stages)
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"pl.split cuts an nn.Sequential between its blocks, and any other module ({type(model).__name__}) "
            "by tracing its forward on sample= (one micro-batch, as its keyword arguments): between its repeated "
            "blocks, or before the modules you name, split_points=['transformer.h.4']"
        )
    if len(model) == 0:
        raise ValueError("the model has no blocks to split")
    if method not in METHODS:
        raise ValueError(f"unknown split method {method!r}; choose one of {METHODS}")
    _check_stage_count(n_stages, len(model))
    if method == "uniform":
        costs = [1.0] * len(model)
        bounds = uniform_bounds(len(model), n_stages)
    else:
        if method == "params":
            costs = parameter_counts(model)
        else:
            if sample is None:
                raise ValueError('method="time" measures each block, so pass sample=<an input batch>')
            was_training = model.training
            with intra_op_threads(threads):
                costs = measured_times(model, sample, repeats)
            model.train(was_training)
        bounds = balanced_bounds(costs, n_stages)
    stages = [model[a:b] for a, b in bounds]
    return Partition(bounds, stages, method, costs)


def points_for(model: nn.Module, n_stages: int, method: str, sample: Any = None, threads: int | None = 1,
               repeats: int = 5) -> list[str]:
    """Split points that cut the repeated blocks (`repeated_blocks`) into `n_stages` runs: the same number of
    blocks each ("uniform"), balanced parameter counts ("params", the blocks' own parameters: an embedding
    before them counts on the first stage's side of the scale not at all), or balanced forward + backward
    seconds on `sample` ("time", with what runs before and after the blocks counted on the first and the
    last: `named_timing.py`; on `threads` intra-op threads, each the best of `repeats` runs)."""
    name, blocks = repeated_blocks(model)
    _check_stage_count(n_stages, len(blocks))
    if method == "uniform":
        bounds = uniform_bounds(len(blocks), n_stages)
    elif method == "params":
        bounds = balanced_bounds([sum(p.numel() for p in block.parameters()) for block in blocks], n_stages)
    elif method == "time":
        bounds = balanced_bounds(named_block_costs(model, sample, threads, repeats), n_stages)
    else:
        raise ValueError(f"unknown split method {method!r}; choose one of {METHODS}, or name the modules: "
                         "split_points=[...]")
    return points_at(name, bounds)


def named_block_costs(model: nn.Module, sample: Any, threads: int | None = 1, repeats: int = 5) -> list[float]:
    """Forward + backward seconds of each repeated block of `model` on `sample` (`named_timing.py`)."""
    check_repeats(repeats)
    name, blocks = repeated_blocks(model)
    with intra_op_threads(threads):
        return block_times(model, name, len(blocks), sample, repeats)


def points_at(name: str, bounds: list[tuple[int, int]]) -> list[str]:
    """The split points of `bounds` over the blocks of the `nn.ModuleList` called `name`."""
    return [f"{name}.{a}" for a, _ in bounds[1:]]


def _split_by_names(model: nn.Module, split_points: list[str], sample: Any, n_stages: int | None) -> Partition:
    if isinstance(split_points, str) or not all(isinstance(name, str) for name in split_points):
        raise TypeError(f"split_points is a list of module names, like ['transformer.h.4'], got {split_points!r}")
    if n_stages is not None and n_stages != len(split_points) + 1:
        raise ValueError(f"{len(split_points)} split points make {len(split_points) + 1} stages, not n_stages={n_stages}")
    if sample is None:
        raise ValueError("split_points traces the model's forward on one micro-batch: pass sample=<one micro-batch, "
                         "as the model's keyword arguments>")
    stages = split_by_names(model, list(split_points), sample)  # the sample's shapes; others: `traced_shapes.py`
    return Partition([(s, s + 1) for s in range(len(stages))], stages, "names", [1.0] * len(stages),
                     traced_for=TracedShapes(model, split_points, stages, sample))
