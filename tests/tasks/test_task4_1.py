"""Task 4.1: send/recv of activations and gradients between two ranks.

Graded on two real processes (``pl.distributed.launch``, gloo): rank 0 runs the learner's
``first_stage_step`` on the first half of a small MLP, rank 1 ``last_stage_step`` on the
second half.  The reference is plain autograd on one device, in this process:
``loss_fn(model(x), y).backward()`` on the whole batch.  Both ranks' gradients and the
loss must equal it, for m = 1, for equal and uneven micro-batches, and for activations
of three dimensions.  Beyond the values: every ``dist.isend`` work is waited for before the
step returns (the ranks' ``dist.isend`` hands out works that note their ``wait()``), the
caller's tensors keep their ``requires_grad`` and get no ``.grad``, and on three ranks,
where rank 2 sends messages of its own to ranks 0 and 1 with the same tags, each receive
takes only its peer's message (a receive without ``src`` takes rank 2's).

Starting ranks costs seconds, so one launch per implementation runs every case (the
fixture ``two_rank_step``; one more, ``three_rank_step``, runs one case on three ranks),
and the tests below read their results; while a step function is still the stub, no rank
is started.  A deadlock is stopped by the wait timeout (or the launch's deadline) and
reported as one: "your ranks deadlocked".
"""

from __future__ import annotations

import ast
import contextlib
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
    learner's function returned, the stage's gradients, whether the inputs survived, and
    the sends it left unwaited."""
    return {case: run_case(case, first_stage_step, last_stage_step) for case in CASES}


def run_case(case: str, first_stage_step, last_stage_step) -> dict:
    """One case on this rank (0: the first stage, 1: the last), on a fresh model."""
    rank = dist.get_rank()
    _, sizes = CASES[case]
    model, x, y = model_and_batch(case)
    stage = model[:2] if rank == 0 else model[2:]
    inputs = list((x if rank == 0 else y).split(sizes))
    shapes = [(*microbatch.shape[:-1], WIDTH) for microbatch in x.split(sizes)]
    copies, shapes_copy = [t.clone() for t in inputs], list(shapes)
    with sends_watched() as sends:
        if rank == 0:
            returned = first_stage_step(stage, inputs, shapes)
        else:
            returned = last_stage_step(stage, inputs, shapes, nn.functional.mse_loss)
        unwaited = [(send.dst, send.tag) for send in sends if not send.waited]  # as the function returned
    in_stage = {id(p) for p in stage.parameters()}
    unchanged = shapes == shapes_copy and len(inputs) == len(copies) and all(
        torch.equal(a, b) for a, b in zip(inputs, copies)
    )
    return {
        "returned": returned.detach().clone() if isinstance(returned, torch.Tensor) else returned,
        "returned_requires_grad": isinstance(returned, torch.Tensor) and returned.requires_grad,
        "grads": {n: p.grad for n, p in model.named_parameters() if id(p) in in_stage},
        "inputs_unchanged": unchanged,
        # the caller's tensors (none requires grad): (k, requires_grad, has a .grad) of those changed
        "inputs_autograd": [(k, t.requires_grad, t.grad is not None) for k, t in enumerate(inputs)
                            if t.requires_grad or t.grad is not None],
        "sends": len(sends),
        "unwaited_sends": unwaited,
    }


class WatchedSend:
    """The work object of one ``dist.isend``, as the learner gets it: it passes every call
    on to the real one, and notes whether ``wait()`` was called."""

    def __init__(self, work, dst, tag):
        self._work, self.dst, self.tag, self.waited = work, dst, tag, False

    def wait(self, *args, **kwargs):
        self.waited = True
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextlib.contextmanager
def sends_watched():
    """While inside, ``dist.isend`` returns :class:`WatchedSend` objects, listed in the
    list this yields (the learner's module calls it as ``dist.isend``)."""
    real = dist.isend
    sends = []

    def isend(*args, **kwargs):
        work = real(*args, **kwargs)  # first: a wrong call fails as it would unwatched
        bound = inspect.signature(real).bind(*args, **kwargs)
        bound.apply_defaults()
        sends.append(WatchedSend(work, bound.arguments.get("dst"), bound.arguments.get("tag")))
        return sends[-1]

    dist.isend = isend
    try:
        yield sends
    finally:
        dist.isend = real


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


THIRD_RANK_CASE = "m=3 uneven"


def run_with_a_third_rank(first_stage_step, last_stage_step):
    """Rank 2 sends too, before the step starts: to rank 0 and to rank 1, one message per
    micro-batch, with the step's tags (0 .. m-1) and bigger than any of the step's messages,
    then a "sent" message (tag m) on the same links.  Ranks 0 and 1 wait for that, run the
    case, and only then receive rank 2's messages.  A receive that names its source never
    meets them; a receive from any source takes them first (gloo aborts the rank: they do
    not fit its buffer)."""
    rank = dist.get_rank()
    sizes = CASES[THIRD_RANK_CASE][1]
    size = 1 + max(sizes) * WIDTH  # elements: more than any activation (or gradient) of the case
    if rank == 2:
        works = [dist.isend(torch.full((size,), 1e6), dst=peer, tag=k) for peer in (0, 1) for k in range(len(sizes))]
        for peer in (0, 1):
            dist.send(torch.zeros(1), dst=peer, tag=len(sizes))
        for work in works:
            work.wait()
        return None
    dist.recv(torch.zeros(1), src=2, tag=len(sizes))
    found = run_case(THIRD_RANK_CASE, first_stage_step, last_stage_step)
    for k in range(len(sizes)):
        dist.recv(torch.empty(size), src=2, tag=k)
    return found


@pytest.fixture(scope="session")
def three_rank_step(two_rank_step):
    """THIRD_RANK_CASE on three ranks, rank 2 sending messages of its own: [rank 0's result,
    rank 1's, None], or the DistributedError that ended the launch; None when the step did
    not run on two ranks (test_receives_only_from_the_peer reports why)."""
    learner, outcome = two_rank_step
    if not isinstance(outcome, list):
        return None
    try:
        return pl.distributed.launch(
            run_with_a_third_rank, 3, learner.first_stage_step, learner.last_stage_step,
            timeout_seconds=DEADLINE_SECONDS, wait_timeout_seconds=WAIT_SECONDS,
        )
    except pl.DistributedError as error:
        return error


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


def test_every_send_is_waited_for(two_rank_step):
    per_rank = results_of(two_rank_step)
    for rank, function in enumerate(("first_stage_step", "last_stage_step")):
        for case, seen in per_rank[rank].items():
            unwaited = seen["unwaited_sends"]
            assert not unwaited, (
                f"{function} waits for every send before it returns\n"
                f"{case}: {function} returned with {len(unwaited)} of its {seen['sends']} sends never waited for "
                f"(dst, tag: {unwaited}).  A send has completed only once its work.wait() has returned: until "
                "then its tensor must stay alive and unchanged.  Keep each work dist.isend returns, and wait for "
                "every one."
            )


def test_callers_tensors_keep_requires_grad_and_get_no_grad(two_rank_step):
    per_rank = results_of(two_rank_step)
    for rank, (function, what) in enumerate((("first_stage_step", "micro-batch"), ("last_stage_step", "target"))):
        for case, seen in per_rank[rank].items():
            for k, requires_grad, has_grad in seen["inputs_autograd"]:
                changes = [change for change, happened in (("now requires grad", requires_grad),
                                                           ("got a .grad", has_grad)) if happened]
                raise AssertionError(
                    f"{function} leaves its arguments unchanged: the caller's tensors keep their requires_grad "
                    f"and get no .grad\n{case}: the caller's {what} {k} did not require grad, and after "
                    f"{function} it {' and '.join(changes)}.  The caller's tensors are not this step's leaves: "
                    "only the stage's parameters (and, on rank 1, the received activations) get gradients."
                )


def test_receives_only_from_the_peer_when_a_third_rank_sends_too(two_rank_step, three_rank_step):
    results_of(two_rank_step)  # right on two ranks first
    learner, _ = two_rank_step
    clause = "each receive is from the peer only (src=peer), even when a third rank sends too"
    if isinstance(three_rank_step, pl.DistributedError):
        where = where_in_learner_code(three_rank_step.details, learner)
        first = three_rank_step.message.splitlines()[0].split("; then ")[0]  # not the other ranks' lost links
        raise AssertionError(
            f"{clause}\non three ranks, where rank 2 also sends to ranks 0 and 1 (with tags 0 .. m-1, and bigger "
            f"messages), rank {three_rank_step.rank} failed{where}: {first}\n"
            "Most likely one of your receives took rank 2's message: dist.irecv without src receives from any "
            "rank.  post_receives receives from rank `peer` only: dist.irecv(buffer, src=peer, tag=k)."
        )
    expected_loss, expected = reference(THIRD_RANK_CASE)
    for rank in (0, 1):
        grads = three_rank_step[rank]["grads"]
        for name in (n for n in expected if n.startswith("0.") == (rank == 0)):
            assert grads.get(name) is not None, (
                f"{clause}\non three ranks, parameter {name} of rank {rank}'s stage has no gradient after the step"
            )
            torch.testing.assert_close(
                grads[name], expected[name], **TOLERANCE,
                msg=lambda text: f"{clause}\non three ranks (rank 2 sending to ranks 0 and 1 too), rank {rank}'s "
                f"gradient of {name} differs from the single-device step's:\n{text}",
            )
    loss = three_rank_step[1]["returned"]
    assert isinstance(loss, torch.Tensor), f"{clause}\non three ranks, last_stage_step returned {loss!r}"
    torch.testing.assert_close(
        loss, expected_loss, **TOLERANCE,
        msg=lambda text: f"{clause}\non three ranks (rank 2 sending to ranks 0 and 1 too), the loss differs from "
        f"the single-device step's:\n{text}",
    )
