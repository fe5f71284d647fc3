"""Task 4.2: column- and row-parallel linear layers, graded on two gloo ranks.

Each rank gets its shard of a Linear's weight (rows for the column-parallel layer, columns
for the row-parallel one) and runs the learner's layer; the reference is plain
`torch.nn.functional.linear` on one device, in this process.  Checked, for a 2-d and a
3-d input:

- the column-parallel layer alone: its output is this rank's slice of x Wᵀ + b, and after
  a backward of a loss spread over the ranks, x.grad is the *whole* input gradient
  (the all-reduce of the backward) and the shards' gradients are the reference's slices;
- the row-parallel layer alone: its output is the whole x Wᵀ + b on every rank (the
  all-reduce of the forward, b added once), and the gradients are the reference's slices;
- fc1 column-parallel, GELU, fc2 row-parallel (an MLP): output, loss and every gradient;
- both layers with bias=None: the same outputs, without b.

One launch per implementation runs every case (`two_ranks`); while a function is still a
stub, no rank is started.  A deadlock is stopped by the wait timeout and reported as one.
"""

from __future__ import annotations

import ast
import importlib.machinery
import inspect
import sys
import textwrap

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

import pipelab as pl

pytestmark = pytest.mark.task4_2

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
RANKS = 2
DEADLINE_SECONDS = 40
WAIT_SECONDS = 10
IN, HIDDEN, OUT = 4, 6, 5
CASES = {"2-d input": (3,), "3-d input": (2, 3)}  # leading (batch) dimensions of x


def tensors(case: str) -> dict[str, torch.Tensor]:
    """The whole weights, input and loss weights of a case: the same on every rank and here."""
    generator = torch.Generator().manual_seed(len(case))
    lead = CASES[case]
    shapes = {"x": (*lead, IN), "w1": (HIDDEN, IN), "b1": (HIDDEN,), "w2": (OUT, HIDDEN), "b2": (OUT,),
              "c1": (*lead, HIDDEN), "h": (*lead, HIDDEN), "c2": (*lead, OUT), "target": (*lead, OUT)}
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone().requires_grad_(True)


def on_each_rank(column_parallel_linear, row_parallel_linear) -> dict:
    """Every case on this rank: outputs and gradients, as plain tensors."""
    rank, t = dist.get_rank(), dist.get_world_size()
    found = {}
    for case in CASES:
        v = tensors(case)
        rows = slice(rank * HIDDEN // t, (rank + 1) * HIDDEN // t)  # this rank's hidden features
        # column-parallel alone: loss = sum over ranks of <y_r, c1_r>
        x, w, b = leaf(v["x"]), leaf(v["w1"][rows]), leaf(v["b1"][rows])
        y = column_parallel_linear(x, w, b)
        (y * v["c1"][..., rows]).sum().backward()
        column = {"y": y.detach(), "x": x.grad, "w": w.grad, "b": b.grad}
        # row-parallel alone: loss = <y, c2>, the same on every rank
        h, w, b = leaf(v["h"][..., rows]), leaf(v["w2"][:, rows]), leaf(v["b2"])
        y = row_parallel_linear(h, w, b)
        (y * v["c2"]).sum().backward()
        row = {"y": y.detach(), "h": h.grad, "w": w.grad, "b": b.grad}
        # an MLP: fc1 column-parallel, GELU, fc2 row-parallel
        x, w1, b1 = leaf(v["x"]), leaf(v["w1"][rows]), leaf(v["b1"][rows])
        w2, b2 = leaf(v["w2"][:, rows]), leaf(v["b2"])
        y = row_parallel_linear(F.gelu(column_parallel_linear(x, w1, b1)), w2, b2)
        loss = F.mse_loss(y, v["target"])
        loss.backward()
        mlp = {"y": y.detach(), "loss": loss.detach(), "x": x.grad, "w1": w1.grad, "b1": b1.grad, "w2": w2.grad,
               "b2": b2.grad}
        # bias=None: the outputs of both layers without b
        no_bias = {"column": column_parallel_linear(v["x"], v["w1"][rows], None).detach(),
                   "row": row_parallel_linear(v["h"][..., rows], v["w2"][:, rows], None).detach()}
        found[case] = {"column": column, "row": row, "mlp": mlp, "no bias": no_bias, "rows": (rows.start, rows.stop)}
    return found


def still_a_stub(function) -> bool:
    """True when the function's body, after its docstring, is only ``raise NotImplementedError(...)``."""
    body = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0])


@pytest.fixture(scope="session")
def two_ranks(impl):
    """(per-rank results) or the DistributedError that ended the launch, or a stub to call."""
    learner = impl("tensor_parallel")
    pieces = [learner.column_parallel_linear, learner.row_parallel_linear,
              learner.CopyToParallelRegion.forward, learner.CopyToParallelRegion.backward,
              learner.ReduceFromParallelRegion.forward, learner.ReduceFromParallelRegion.backward]
    stubs = [piece for piece in pieces if still_a_stub(piece)]
    if stubs:
        return stubs[0]  # no need to start ranks (seconds) to meet a stub
    if importlib.machinery.PathFinder.find_spec(learner.__name__.partition(".")[0]) is None:
        cloudpickle.register_pickle_by_value(learner)  # a mutant's directory is not importable on the ranks
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        return pl.distributed.launch(on_each_rank, RANKS, learner.column_parallel_linear,
                                     learner.row_parallel_linear, timeout_seconds=DEADLINE_SECONDS,
                                     wait_timeout_seconds=WAIT_SECONDS)
    except pl.DistributedError as error:
        return error


def results(two_ranks) -> list[dict]:
    if callable(two_ranks):  # a stub raises its NotImplementedError before reading its arguments
        two_ranks(*[None] * len(inspect.signature(two_ranks).parameters))
    if isinstance(two_ranks, pl.DistributedError):
        if two_ranks.message.startswith("NotImplementedError"):
            raise NotImplementedError(f"rank {two_ranks.rank}: {two_ranks.message}")
        if "timed out" in two_ranks.message.lower():
            raise AssertionError(f"your ranks deadlocked: rank {two_ranks.rank} waited for a collective the "
                                 f"other rank never joined ({two_ranks.message}).  Every rank must call the same "
                                 "all-reduces in the same order.")
        raise AssertionError(f"rank {two_ranks.rank} failed: {two_ranks.message}")
    return two_ranks


def close(got, expected, what: str) -> None:
    assert got is not None, f"{what}: no gradient (was the input used, with requires_grad kept?)"
    torch.testing.assert_close(got, expected, **TOLERANCE, msg=lambda text: f"{what}:\n{text}")


def reference_layers(case: str) -> dict:
    v = tensors(case)
    x, w1, b1, h, w2, b2 = (leaf(v[n]) for n in ("x", "w1", "b1", "h", "w2", "b2"))
    y1 = F.linear(x, w1, b1)
    (y1 * v["c1"]).sum().backward()
    y2 = F.linear(h, w2, b2)
    (y2 * v["c2"]).sum().backward()
    return {"column": {"y": y1.detach(), "x": x.grad, "w": w1.grad, "b": b1.grad},
            "row": {"y": y2.detach(), "h": h.grad, "w": w2.grad, "b": b2.grad}}


def reference_mlp(case: str) -> dict:
    v = tensors(case)
    x, w1, b1, w2, b2 = (leaf(v[n]) for n in ("x", "w1", "b1", "w2", "b2"))
    y = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    loss = F.mse_loss(y, v["target"])
    loss.backward()
    return {"y": y.detach(), "loss": loss.detach(), "x": x.grad, "w1": w1.grad, "b1": b1.grad, "w2": w2.grad,
            "b2": b2.grad}


@pytest.mark.parametrize("case", CASES)
def test_column_parallel_output_is_this_ranks_slice_and_input_gradient_is_whole(two_ranks, case):
    expected = reference_layers(case)["column"]
    for rank, found in enumerate(results(two_ranks)):
        seen, rows = found[case]["column"], slice(*found[case]["rows"])
        close(seen["y"], expected["y"][..., rows], f"{case}, rank {rank}: column_parallel_linear's output "
                                                   "should be this rank's slice of x Wᵀ + b")
        close(seen["x"], expected["x"], f"{case}, rank {rank}: x.grad after the column-parallel layer should be the "
                                        "whole gradient, the sum of every rank's part (all-reduce in the backward)")
        close(seen["w"], expected["w"][rows], f"{case}, rank {rank}: the gradient of this rank's rows of W")
        close(seen["b"], expected["b"][rows], f"{case}, rank {rank}: the gradient of this rank's slice of b")


@pytest.mark.parametrize("case", CASES)
def test_row_parallel_output_is_whole_with_the_bias_once(two_ranks, case):
    expected = reference_layers(case)["row"]
    for rank, found in enumerate(results(two_ranks)):
        seen, cols = found[case]["row"], slice(*found[case]["rows"])
        close(seen["y"], expected["y"], f"{case}, rank {rank}: row_parallel_linear's output should be the whole "
                                        "x Wᵀ + b: the sum of the ranks' partial products (all-reduce in the "
                                        "forward), plus b once")
        close(seen["h"], expected["h"][..., cols], f"{case}, rank {rank}: the gradient of this rank's input slice")
        close(seen["w"], expected["w"][:, cols], f"{case}, rank {rank}: the gradient of this rank's columns of W")
        close(seen["b"], expected["b"], f"{case}, rank {rank}: the gradient of b")


@pytest.mark.parametrize("case", CASES)
def test_column_then_row_parallel_mlp_equals_one_device(two_ranks, case):
    expected = reference_mlp(case)
    for rank, found in enumerate(results(two_ranks)):
        seen, rows = found[case]["mlp"], slice(*found[case]["rows"])
        close(seen["y"], expected["y"], f"{case}, rank {rank}: the MLP's output")
        close(seen["loss"], expected["loss"], f"{case}, rank {rank}: the MLP's loss")
        close(seen["x"], expected["x"], f"{case}, rank {rank}: the MLP's input gradient")
        for name, part in (("w1", rows), ("b1", rows), ("w2", (slice(None), rows)), ("b2", slice(None))):
            close(seen[name], expected[name][part], f"{case}, rank {rank}: the gradient of {name}'s shard")


@pytest.mark.parametrize("case", CASES)
def test_without_a_bias(two_ranks, case):
    v = tensors(case)
    for rank, found in enumerate(results(two_ranks)):
        seen, rows = found[case]["no bias"], slice(*found[case]["rows"])
        close(seen["column"], F.linear(v["x"], v["w1"])[..., rows], f"{case}, rank {rank}: column_parallel_linear "
                                                                     "with bias=None should be this rank's slice of x Wᵀ")
        close(seen["row"], F.linear(v["h"], v["w2"]), f"{case}, rank {rank}: row_parallel_linear with bias=None "
                                                      "should be the whole x Wᵀ")
