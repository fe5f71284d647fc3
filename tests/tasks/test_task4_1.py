"""Task 4.1: send/recv of activations and gradients between two ranks.

Graded on two real processes (``pl.distributed.launch``, gloo): rank 0 runs the learner's
``first_stage_step`` on the first half of a small MLP, rank 1 ``last_stage_step`` on the
second half.  The reference is plain autograd on one device, in this process:
``loss_fn(model(x), y).backward()`` on the whole batch.  Both ranks' gradients and the
loss must equal it, for m = 1, for equal and uneven micro-batches, and for activations
of three dimensions.

Starting two ranks costs seconds, so one launch per implementation runs every case (the
fixture ``two_rank_step``), and the tests below read its results; while a step function
is still the stub, no rank is started.  A deadlock is stopped by the wait timeout (or the
launch's deadline) and reported as one: "your ranks deadlocked".
"""

from __future__ import annotations

import ast
import importlib.machinery
import inspect
import re
import sys
import textwrap

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch import nn

import pipelab as pl

pytestmark = pytest.mark.task4_1

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
DEADLINE_SECONDS = 30  # the whole step on both ranks (the work itself takes milliseconds)
WAIT_SECONDS = 10  # one wait for one message: a blocked receive fails after this
WIDTH = 6  # features of the activation between the two stages

# name -> (shape of one sample of x, micro-batch sizes)
CASES = {
    "m=1": ((4,), [4]),
    "m=2": ((4,), [3, 3]),
    "m=3 uneven": ((4,), [3, 2, 2]),
    "m=4 one sample each": ((4,), [1, 1, 1, 1]),
    "m=5 uneven 3-d": ((2, 4), [2, 2, 2, 2, 1]),
}


def model_and_batch(case: str) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """The whole model (its first two modules are rank 0's stage, the rest rank 1's) and
    one batch; the same on every rank and in this process."""
    sample_shape, sizes = CASES[case]
    torch.manual_seed(len(case))
    model = nn.Sequential(nn.Linear(4, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 5), nn.Tanh(), nn.Linear(5, 3))
    x = torch.randn(sum(sizes), *sample_shape)
    y = torch.randn(sum(sizes), *sample_shape[:-1], 3)
    return model, x, y


def run_cases_on_this_rank(first_stage_step, last_stage_step) -> dict:
    """What each rank runs: every case, each on a fresh model.  Returns, per case, what the
    learner's function returned, the stage's gradients, and whether the inputs survived."""
    rank = dist.get_rank()
    results = {}
    for case, (_, sizes) in CASES.items():
        model, x, y = model_and_batch(case)
        stage = model[:2] if rank == 0 else model[2:]
        inputs = list((x if rank == 0 else y).split(sizes))
        shapes = [(*microbatch.shape[:-1], WIDTH) for microbatch in x.split(sizes)]
        copies, shapes_copy = [t.clone() for t in inputs], list(shapes)
        if rank == 0:
            returned = first_stage_step(stage, inputs, shapes)
        else:
            returned = last_stage_step(stage, inputs, shapes, nn.functional.mse_loss)
        in_stage = {id(p) for p in stage.parameters()}
        unchanged = shapes == shapes_copy and len(inputs) == len(copies) and all(
            torch.equal(a, b) for a, b in zip(inputs, copies)
        )
        results[case] = {
            "returned": returned.detach().clone() if isinstance(returned, torch.Tensor) else returned,
            "returned_requires_grad": isinstance(returned, torch.Tensor) and returned.requires_grad,
            "grads": {n: p.grad for n, p in model.named_parameters() if id(p) in in_stage},
            "inputs_unchanged": unchanged,
        }
    return results


@pytest.fixture(scope="session")
def two_rank_step(impl):
    """The learner's step on two ranks, every case in one launch: (the learner's module,
    [rank 0's results, rank 1's] or the DistributedError that ended the launch, or the
    stub that keeps the step from running at all)."""
    learner = impl("send_recv")
    functions = (learner.post_receives, learner.first_stage_step, learner.last_stage_step)
    stubs = [function for function in functions if still_a_stub(function)]
    if learner.first_stage_step in stubs or learner.last_stage_step in stubs:
        return learner, stubs[0]  # no need to start ranks (seconds) to meet a stub
    # The ranks are new processes that unpickle the functions they run.  exercises/ and
    # solutions/ are imported there by name; a mutant's directory, and this test file, are
    # not importable there, so they travel by value.
    if importlib.machinery.PathFinder.find_spec(learner.__name__.partition(".")[0]) is None:
        cloudpickle.register_pickle_by_value(learner)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        per_rank = pl.distributed.launch(
            run_cases_on_this_rank, 2, learner.first_stage_step, learner.last_stage_step,
            timeout_seconds=DEADLINE_SECONDS, wait_timeout_seconds=WAIT_SECONDS,
        )
    except pl.DistributedError as error:
        return learner, error
    return learner, per_rank


def still_a_stub(function) -> bool:
    """True when the function's body, after its docstring, is only ``raise NotImplementedError(...)``."""
    body = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0])


def results_of(two_rank_step) -> list[dict]:
    """Both ranks' results, or the reason there are none, as a failure that teaches."""
    learner, outcome = two_rank_step
    if callable(outcome):  # a stub: it raises its NotImplementedError before reading its arguments
        outcome(*[None] * len(inspect.signature(outcome).parameters))
    if not isinstance(outcome, pl.DistributedError):
        return outcome
    where = where_in_learner_code(outcome.details, learner)
    if outcome.message.startswith("NotImplementedError"):
        raise_stub_error_here(learner, outcome)
    if "timed out" in outcome.message.lower():
        raise AssertionError(
            "the two ranks exchange every activation and gradient without a deadlock\n"
            f"your ranks deadlocked: rank {outcome.rank} waited{where} for a message that never "
            f"came.\n  rank {outcome.rank}: {outcome.message}\n"
            "Each rank was waiting for a message the other had not sent.  Post the receives "
            "first (dist.irecv), send without blocking (dist.isend), and let rank 0 send every "
            "activation before it waits for a gradient."
        )
    if "SIGABRT" in outcome.message:
        raise AssertionError(
            "the message of micro-batch k has tag k and shape activation_shapes[k], both ways\n"
            f"rank {outcome.rank} was aborted by gloo: most likely a message arrived in a receive "
            "buffer too small for it, posted with the same tag.  The message of micro-batch k "
            "has tag k and shape activation_shapes[k], both ways.\n"
            f"  rank {outcome.rank}: {outcome.message}"
        )
    raise AssertionError(f"both ranks finish the step without an error\n"
                         f"rank {outcome.rank} failed{where}: {outcome.message}")


def where_in_learner_code(details: str, learner) -> str:
    """' (in first_stage_step, send_recv.py:52)': the learner's innermost line in a rank's
    traceback (or, after the deadline, in the stack where it was waiting)."""
    file = re.escape(str(learner.__file__))
    frames = re.findall(rf'File "{file}", line (\d+), in (\w+)', details)
    if not frames:
        return ""
    line, function = frames[-1]
    return f" (in {function}, send_recv.py:{line})"


def raise_stub_error_here(learner, outcome: pl.DistributedError) -> None:
    """A rank met a NotImplementedError (a stub of post_receives): raise it again here, from
    the same function, so that ``pipelab grade`` names it."""
    names = re.findall(r", in (\w+)\n", outcome.details)
    function = next((getattr(learner, n) for n in reversed(names) if callable(getattr(learner, n, None))), None)
    if function is not None:
        try:
            function(*[None] * len(inspect.signature(function).parameters))
        except NotImplementedError:
            raise
        except Exception:
            pass
    raise NotImplementedError(f"rank {outcome.rank}: {outcome.message}")


def reference(case: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The single-device step: the loss and every parameter's gradient."""
    model, x, y = model_and_batch(case)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", CASES)
def test_gradients_equal_the_single_device_step(two_rank_step, case):
    first, last = (rank_results[case] for rank_results in results_of(two_rank_step))
    _, expected = reference(case)
    for rank, seen in enumerate((first, last)):
        names = [n for n in expected if (n.startswith("0.") if rank == 0 else not n.startswith("0."))]
        for name in names:
            grad = seen["grads"].get(name)
            assert grad is not None, (
                f"each rank's parameters get the gradients of the single-device step\n"
                f"{case}: parameter {name} of rank {rank}'s stage has no gradient after the step"
            )
            torch.testing.assert_close(
                grad, expected[name], **TOLERANCE,
                msg=lambda text: "each rank's parameters get the gradients of the single-device step\n"
                f"{case}: rank {rank}'s gradient of {name} differs from the "
                f"single-device step's:\n{text}",
            )


def test_last_rank_returns_the_batch_loss_and_first_rank_none(two_rank_step):
    per_rank = results_of(two_rank_step)
    for case in CASES:
        first, last = per_rank[0][case], per_rank[1][case]
        assert first["returned"] is None, f"first_stage_step returns None\n{case}: it returned {first['returned']!r}"
        loss = last["returned"]
        assert isinstance(loss, torch.Tensor) and loss.dim() == 0, (
            "last_stage_step returns the batch loss, a detached 0-dim tensor\n"
            f"{case}: it returned {loss!r}"
        )
        assert not last["returned_requires_grad"], (
            f"last_stage_step returns the batch loss, a detached 0-dim tensor\n{case}: it requires grad"
        )
        expected, _ = reference(case)
        torch.testing.assert_close(
            loss, expected, **TOLERANCE,
            msg=lambda text: "last_stage_step returns the batch loss, sum_k (B_k / B) * loss_k\n"
            f"{case}: the loss should be the whole batch's, "
            f"sum_k (B_k / B) * loss_k:\n{text}",
        )


def test_inputs_are_unchanged(two_rank_step):
    per_rank = results_of(two_rank_step)
    for rank, function in enumerate(("first_stage_step", "last_stage_step")):
        changed = [case for case, seen in per_rank[rank].items() if not seen["inputs_unchanged"]]
        assert not changed, (
            f"{function} leaves its arguments unchanged\n"
            f"{function} changed its list of micro-batches or shapes in {changed}"
        )
