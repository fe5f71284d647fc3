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
- both layers with bias=None: the same outputs, without b;
- each rank in a group of its own (`dist.new_group([r])`, passed as `group=`): both layers
  whole, as on one device, and f and g the identity; an all-reduce over the default group
  would add the other rank's tensors;
- f and g called directly, on tensors that differ per rank: f the identity forward and the
  sum backward, g the sum forward and the identity backward; neither changes a tensor its
  caller still holds (its input, the gradient given to backward), as an all-reduce in place
  would; and a residual f(x) + x, where autograd hands the same gradient to both paths of
  the +, gets x.grad = sum of the gradients + this rank's own.

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


def on_each_rank(column_parallel_linear, row_parallel_linear, f, g) -> dict:
    """Every case on this rank: outputs and gradients, as plain tensors (f and g are the
    learner's two Functions, called alone too)."""
    rank, t = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group([r]) for r in range(t)]  # every rank makes every group, in the same order
    found = {}
    for case in CASES:
        v = tensors(case)
        rows = slice(rank * HIDDEN // t, (rank + 1) * HIDDEN // t)  # this rank's hidden features
        column, row = layers_alone(column_parallel_linear, row_parallel_linear, v, rows)
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
        # f and g alone, over the world; then everything in a group of one rank (this rank's
        # own): the layers are whole, and no all-reduce may mix in the other rank
        alone = groups[rank]
        column_alone, row_alone = layers_alone(column_parallel_linear, row_parallel_linear, v, slice(0, HIDDEN),
                                               group=alone)
        found[case] = {"column": column, "row": row, "mlp": mlp, "no bias": no_bias, "rows": (rows.start, rows.stop),
                       "f and g": f_and_g_alone(f, g, v, rank, group=None),
                       "group of one": {"column": column_alone, "row": row_alone,
                                        "f and g": f_and_g_alone(f, g, v, rank, group=alone)}}
    return found


def layers_alone(column_parallel_linear, row_parallel_linear, v: dict, rows: slice, **group) -> tuple[dict, dict]:
    """Each layer alone on this rank's shard (``rows`` of the hidden features): output and gradients."""
    # column-parallel alone: loss = sum over ranks of <y_r, c1_r>
    x, w, b = leaf(v["x"]), leaf(v["w1"][rows]), leaf(v["b1"][rows])
    y = column_parallel_linear(x, w, b, **group)
    (y * v["c1"][..., rows]).sum().backward()
    column = {"y": y.detach(), "x": x.grad, "w": w.grad, "b": b.grad}
    # row-parallel alone: loss = <y, c2>, the same on every rank
    h, w, b = leaf(v["h"][..., rows]), leaf(v["w2"][:, rows]), leaf(v["b2"])
    y = row_parallel_linear(h, w, b, **group)
    (y * v["c2"]).sum().backward()
    row = {"y": y.detach(), "h": h.grad, "w": w.grad, "b": b.grad}
    return column, row


def f_and_g_alone(f, g, v: dict, rank: int, group) -> dict:
    """f and g called directly on tensors the caller keeps, rank r's scaled by r + 1 (so that
    a sum over the ranks differs from any one of them): each output, each input's gradient,
    and the caller's tensors (input, and the gradient given to backward) afterwards."""
    scale = rank + 1
    found = {}
    # g on an input that requires grad, then backward with the caller's gradient
    x, gradient = leaf(v["h"] * scale), v["c1"] * scale
    y = g.apply(x, group)
    y.backward(gradient)
    found["g"] = {"y": y.detach(), "x.grad": x.grad, "x after": x.detach().clone(), "gradient after": gradient}
    # g on an input that does not require grad
    x = v["h"] * scale
    found["g, no grad"] = {"y": g.apply(x, group), "x after": x}
    # f, then backward with the caller's gradient
    x, gradient = leaf(v["h"]), v["c1"] * scale
    y = f.apply(x, group)
    y.backward(gradient)
    found["f"] = {"y": y.detach(), "x.grad": x.grad, "x after": x.detach().clone(), "gradient after": gradient}
    # a residual: z = f(x) + x, loss <z, c1·(r + 1)>; the gradient of z (a tensor of
    # autograd's own, not the caller's) reaches x along both paths of the +
    x = leaf(v["h"])
    ((f.apply(x, group) + x) * (v["c1"] * scale)).sum().backward()
    found["f(x) + x"] = {"x.grad": x.grad}
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
                                     learner.row_parallel_linear, learner.CopyToParallelRegion,
                                     learner.ReduceFromParallelRegion, timeout_seconds=DEADLINE_SECONDS,
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


def expected_f_and_g(case: str, rank: int, members: range) -> dict:
    """What f_and_g_alone should find on ``rank`` in a group of ``members``: rank r's input
    and gradient are h·(r + 1) and c1·(r + 1), so a sum over the group is that times
    sum(r + 1 for r in members)."""
    v = tensors(case)
    scale, total = rank + 1, sum(r + 1 for r in members)
    return {"g": {"y": v["h"] * total, "x.grad": v["c1"] * scale, "x after": v["h"] * scale,
                  "gradient after": v["c1"] * scale},
            "g, no grad": {"y": v["h"] * total, "x after": v["h"] * scale},
            "f": {"y": v["h"], "x.grad": v["c1"] * total, "x after": v["h"], "gradient after": v["c1"] * scale},
            "f(x) + x": {"x.grad": v["c1"] * total + v["c1"] * scale}}


@pytest.mark.parametrize("case", CASES)
def test_the_group_passed_in_is_the_one_used(two_ranks, case):
    """Each rank in a group of its own (dist.new_group([r])): its layers hold the whole W and
    b, and every all-reduce is over that rank alone.  One over the default group would add
    the other rank's tensors."""
    clause = "the all-reduces run over the group passed in, not the whole world"
    expected = reference_layers(case)
    for rank, found in enumerate(results(two_ranks)):
        seen = found[case]["group of one"]
        where = f"{case}, rank {rank}, in a group of one rank (group=dist.new_group([{rank}]))"
        for layer, names in (("column", ("y", "x", "w", "b")), ("row", ("y", "h", "w", "b"))):
            for name in names:
                what = "output" if name == "y" else f"gradient of {name}"
                close(seen[layer][name], expected[layer][name],
                      f"{clause}\n{where}: {layer}_parallel_linear's {what} should be the whole layer's, as on one "
                      "device (was an all-reduce run over the default group, the whole world?)")
        wanted = expected_f_and_g(case, rank, range(rank, rank + 1))
        for function, name in (("g", "y"), ("g", "x.grad"), ("f", "y"), ("f", "x.grad")):
            what = "output" if name == "y" else "input's gradient"
            close(seen["f and g"][function][name], wanted[function][name],
                  f"{clause}\n{where}: {function}'s {what} (was an all-reduce run over the default group, or "
                  "over a group not kept for the backward?)")


@pytest.mark.parametrize("case", CASES)
def test_f_and_g_alone(two_ranks, case):
    """f and g called directly, rank r's tensors scaled by r + 1: f is the identity forward
    and sums the gradients backward; g sums forward and passes the gradient on backward."""
    for rank, found in enumerate(results(two_ranks)):
        seen, wanted = found[case]["f and g"], expected_f_and_g(case, rank, range(RANKS))
        for function, name, what in (
            ("f", "y", "f (copy_to_parallel_region) is the identity forward: its output is its input"),
            ("f", "x.grad", "f's backward is the sum over the group of the incoming gradients (all-reduce)"),
            ("g", "y", "g (reduce_from_parallel_region) forward is the sum over the group of its inputs (all-reduce)"),
            ("g", "x.grad", "g's backward is the identity: the incoming gradient, not summed again"),
            ("g, no grad", "y", "g's forward is the sum over the group, on an input that does not require grad too"),
        ):
            close(seen[function][name], wanted[function][name], f"{what}\n{case}, rank {rank}")


@pytest.mark.parametrize("case", CASES)
def test_f_and_g_leave_the_callers_tensors_unchanged(two_ranks, case):
    """dist.all_reduce works in place: on the caller's input (g's forward) or on the gradient
    autograd hands over (f's backward: here the caller's own, given to backward) it changes
    a tensor the caller still holds."""
    for rank, found in enumerate(results(two_ranks)):
        seen, wanted = found[case]["f and g"], expected_f_and_g(case, rank, range(RANKS))
        for function, name, what in (
            ("g", "x after", "g's input, which requires grad"),
            ("g, no grad", "x after", "g's input, which does not require grad"),
            ("f", "x after", "f's input"),
            ("g", "gradient after", "the gradient given to backward through g"),
            ("f", "gradient after", "the gradient given to backward through f"),
        ):
            close(seen[function][name], wanted[function][name],
                  f"f and g leave the caller's tensors unchanged (all_reduce works in place: reduce a copy)\n"
                  f"{case}, rank {rank}: {what} changed")


@pytest.mark.parametrize("case", CASES)
def test_a_residual_through_f_gets_both_gradients(two_ranks, case):
    """z = f(x) + x: x.grad is f's backward (the sum over the ranks of dz) plus dz itself.
    Autograd hands the same gradient tensor, dz, to both paths of the +: an all-reduce in
    place in f's backward changes the other path's gradient too."""
    for rank, found in enumerate(results(two_ranks)):
        seen, wanted = found[case]["f and g"], expected_f_and_g(case, rank, range(RANKS))
        close(seen["f(x) + x"]["x.grad"], wanted["f(x) + x"]["x.grad"],
              "f's backward leaves the incoming gradient unchanged: in z = f(x) + x, x.grad is the all-reduced "
              f"gradient plus this rank's own\n{case}, rank {rank}: the gradient of x in f(x) + x (is the incoming "
              "gradient all-reduced in place? autograd passes the same tensor along the other path)")
