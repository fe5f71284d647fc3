"""The schedules beyond 1F1B on the local engine: same loss and gradients as the single-device step.

Reference: `loss_fn(model(x), y).backward()` on the whole batch, plain autograd, as in
tests/test_equivalence.py.  Interleaved 1F1B puts several stages on one device: the
engine runs any valid table, so the Pipeline has p·v stages and the Schedule p devices.
Zero-bubble tables split each backward into B and W: "no gradient computed twice" is
checked against the whole-backward step by counting the ATen kernels both run.
"""

import dataclasses
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import pipelab as pl
from pipelab import schedules
from pipelab.schedules.action import Action

BATCH = 19  # prime: uneven micro-batches for every m > 1
TOLERANCE = dict(rtol=1e-5, atol=1e-6)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_model(kind, n_blocks):
    if kind == "mlp":
        return pl.models.mlp(depth=n_blocks, width=16, seed=1)
    return pl.models.tiny_gpt(n_layers=max(n_blocks - 2, 1), d_model=16, n_heads=2, vocab_size=32, seq_len=6, seed=1)


def reference(model, x, y, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def assert_step_matches(model, schedule, x, y, loss_fn, where, checkpoint="never"):
    ref_loss, ref_grads = reference(model, x, y, loss_fn)
    pipe = pl.Pipeline(model, n_stages=schedule.n_stages, n_microbatches=schedule.n_microbatches, schedule=schedule,
                       loss_fn=loss_fn, devices="cpu",
                       checkpoint=checkpoint)
    result = pipe.step(x, y)
    torch.testing.assert_close(torch.tensor(result.loss, dtype=ref_loss.dtype), ref_loss, **TOLERANCE,
                               msg=lambda m: f"{where}: loss differs\n{m}")
    for (name, p), g in zip(model.named_parameters(), ref_grads):
        assert p.grad is not None, f"{where}: {name} got no gradient"
        torch.testing.assert_close(p.grad, g, **TOLERANCE, msg=lambda m: f"{where}: grad of {name}\n{m}")
    return result


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("p, v", [(1, 2), (2, 2), (2, 3), (3, 2), (4, 2)])
def test_interleaved_equals_single_device_step(kind, p, v):
    model = make_model(kind, max(p * v, 3))
    loss_fn = pl.models.default_loss(model)
    x, y = pl.models.sample_batch(model, BATCH, seed=2)
    for m in (p, 2 * p, 3 * p):
        sched = schedules.interleaved_1f1b(p, m, v)
        result = assert_step_matches(model, sched, x, y, loss_fn, f"{kind} interleaved p={p} v={v} m={m}")
        trace = result.trace
        assert trace.n_devices == p and len(trace.events) == 2 * p * v * m
        assert {e.device for e in trace.events if e.stage % p == 1 % p} == {1 % p}


def test_pytorch_interleaved_tables_run_exactly_too():
    model = make_model("mlp", 8)
    loss_fn = pl.models.default_loss(model)
    x, y = pl.models.sample_batch(model, BATCH, seed=2)
    for name in ("Interleaved1F1B", "LoopedBFS"):
        sched = schedules.validate(schedules.torch_schedule(name, 4, 8, n_chunks=2))
        assert_step_matches(model, sched, x, y, loss_fn, f"torch {name}")


# -- zero bubble: B and W as separate actions -------------------------------------------------
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
def test_zero_bubble_h1_equals_single_device_step(kind, checkpoint):
    for p in (1, 2, 3, 4):
        model = make_model(kind, max(p, 3))
        loss_fn = pl.models.default_loss(model)
        x, y = pl.models.sample_batch(model, BATCH, seed=2)
        for m in sorted({1, p, 2 * p + 1}):
            sched = schedules.zero_bubble_h1(p, m)
            where = f"{kind} zb-h1 p={p} m={m} checkpoint={checkpoint}"
            trace = assert_step_matches(model, sched, x, y, loss_fn, where, checkpoint).trace
            assert sorted(map(str, (e.action for e in trace.events))) == sorted(map(str, sched.all_actions()))
            for e in trace.events:  # W ran after its own B, in the replay
                if e.kind == "W":
                    b = next(f for f in trace.events if f.action == Action("I", e.stage, e.microbatch))
                    assert e.start >= b.end, where


TORCH_ZERO_BUBBLE = [("InterleavedZeroBubble", 1), ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2),
                     ("DualPipeV", 2)]


@pytest.mark.parametrize("name, chunks", TORCH_ZERO_BUBBLE)
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_pytorch_zero_bubble_tables_run_exactly(name, chunks, kind):
    for p, m, checkpoint in ((2, 4, "never"), (4, 8, "always"), (2, 5, "except_last")):
        try:
            sched = schedules.validate(schedules.torch_schedule(name, p, m, n_chunks=chunks))
        except ValueError as error:  # PyTorch refuses some m for its zero-bubble tables
            assert "refused" in str(error) and name == "InterleavedZeroBubble", error
            continue
        assert any(a.kind == "W" for a in sched.all_actions())
        model = make_model(kind, max(sched.n_stages, 3))
        loss_fn = pl.models.default_loss(model)
        x, y = pl.models.sample_batch(model, BATCH, seed=2)
        assert_step_matches(model, sched, x, y, loss_fn, f"{kind} torch {name} x{chunks} p={p} m={m} {checkpoint}",
                            checkpoint)


class KernelCount(TorchDispatchMode):
    """Counts every ATen op run; for LayerNorm's backward, which of its three gradients each call computed."""

    def __init__(self):
        super().__init__()
        self.ops, self.layer_norm_outputs = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops[name] += 1
        if name == "aten.native_layer_norm_backward":  # output_mask: (d input, d weight, d bias)
            self.layer_norm_outputs.update(k for k, wanted in enumerate(args[-1]) if wanted)
        return func(*args, **(kwargs or {}))


BOOKKEEPING = {"aten.clone", "aten.detach", "aten.view", "aten.native_layer_norm_backward"}
"""No arithmetic: aliases, and the copy of a first gradient into `.grad`.  LayerNorm's backward is
one node on the boundary of the input path: B calls it for d input, W for d weight and d bias (counted
per gradient instead)."""


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_split_backward_computes_no_gradient_twice(kind):
    """ZB-H1's step runs every kernel (matrix products, activation and softmax backwards, ...) exactly as
    often as 1F1B's whole-backward step, and LayerNorm's backward computes each of its gradients as often."""
    p, m = 3, 4
    counts = {}
    for sched in (schedules.one_f_one_b(p, m), schedules.zero_bubble_h1(p, m)):
        model = make_model(kind, 6)
        x, y = pl.models.sample_batch(model, BATCH, seed=2)
        # autograd's own accumulation for 1F1B: the reference is a plain whole backward (the fused one runs
        # addmm_ instead of mm + add_, tests/test_fused_accumulation.py); a split backward never fuses
        pipe = pl.Pipeline(model, n_stages=p, n_microbatches=m, schedule=sched, loss_fn=pl.models.default_loss(model),
                           devices="cpu", fused_accumulation=False)
        pipe.step(x, y)  # the first step also warms up (runs one plain backward)
        model.zero_grad(set_to_none=True)
        with KernelCount() as counted:
            pipe.step(x, y)
        counts[sched.name] = counted
    whole, split = counts["1f1b"], counts["zb-h1"]
    arithmetic = {op: n for op, n in whole.ops.items() if op not in BOOKKEEPING}
    assert {op: split.ops[op] for op in arithmetic} == arithmetic
    assert set(split.ops) - BOOKKEEPING == set(arithmetic)
    assert whole.ops["aten.mm"] > 0 and whole.ops["aten.gelu_backward"] > 0
    assert split.layer_norm_outputs == whole.layer_norm_outputs
    if kind == "gpt":
        assert whole.layer_norm_outputs[0] > 0 and split.ops["aten.native_layer_norm_backward"] > whole.ops[
            "aten.native_layer_norm_backward"]  # the node ran twice, each time for other gradients


# -- what a stage holds between B and W --------------------------------------------------------
FP32 = 4
N, IN, HIDDEN, OUT = 5, 8, 16, 4


def two_stage_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU()), nn.Linear(HIDDEN, OUT))


def level_at(trace, device, what, t):
    times, levels = trace.memory_curve(device, what)
    return [level for time_, level in zip(times, levels) if time_ <= t][-1]


def linear_inputs_and_output_gradients(stage: nn.Module, x: torch.Tensor) -> int:
    """What W needs on an MLP stage, found without pipelab: each Linear's input and the gradient of its output
    (its output's size), from forward hooks on one plain forward (Zero Bubble PP, Table 1's M_W)."""
    found = []
    hooks = [m.register_forward_hook(lambda _, inp, out: found.append(inp[0].nbytes + out.nbytes))
             for m in stage.modules() if isinstance(m, nn.Linear)]
    with torch.no_grad():
        stage(x)
    for hook in hooks:
        hook.remove()
    return sum(found)


def test_what_waits_for_w_is_each_linears_input_and_output_gradient():
    """Counted from I to W on an MLP stage with an input gradient: exactly each Linear's input and its output's
    gradient (found with module hooks), the GELU inputs gone; the observed curve holds at least that."""
    p, m = 4, 4
    model = make_model("mlp", 8)
    x, y = pl.models.sample_batch(model, 8)
    pipe = pl.Pipeline(model, n_stages=p, n_microbatches=m, schedule=schedules.zero_bubble_h1(p, m),
                       loss_fn=pl.models.default_loss(model), devices="cpu")
    trace = pipe.step(x, y).trace
    activation = x[:2]
    end = {e.action: e.end for e in trace.events}
    for s, stage in enumerate(pipe.partition.stages):
        worker = pipe.workers[s]
        if s > 0:  # stage 0 has no input gradient: its W runs the whole backward, nothing leaves at I
            assert set(worker.for_w_bytes.values()) == {linear_inputs_and_output_gradients(stage, activation)}
        i_end = end[Action("I", s, 0)]
        assert level_at(trace, s, "observed", i_end) >= level_at(trace, s, "counted", i_end)
        with torch.no_grad():
            activation = stage(activation)


def test_zero_bubble_attention_leaves_at_i():
    """A GPT with long sequences (5·a·s/h = 60 against 34 in Table 1's M_B): the attention scores and softmax
    leave at I, so every stage with an input gradient holds less than min(p, m) whole micro-batches at its
    peak, observed too; the simulator, given the profiled bytes W keeps, predicts the counted curve
    (a consistency check: the profile counts as the engine does)."""
    p, m = 3, 6
    model = pl.models.tiny_gpt(n_layers=4, d_model=16, n_heads=4, vocab_size=32, seq_len=48, seed=1)
    x, y = pl.models.sample_batch(model, 12)
    pipe = pl.Pipeline(model, n_stages=p, n_microbatches=m, schedule=schedules.zero_bubble_h1(p, m),
                       loss_fn=pl.models.default_loss(model), devices="cpu")
    trace = pipe.step(x, y).trace
    model.zero_grad(set_to_none=True)
    workers = [pipe.workers[s] for s in range(p)]
    for s in (1, 2):
        held = max(workers[s].saved_bytes.values())
        assert max(workers[s].for_w_bytes.values()) < 0.8 * held
        assert trace.peak_memory[s] < min(p, m) * held <= trace.peak_memory[s] + held
        assert trace.peak_memory_observed[s] >= trace.peak_memory[s]
    costs = pl.Costs.from_profile(model, pipe.partition, (x[:2], y[:2]), pl.models.default_loss(model), repeats=1)
    assert costs.weight_memory_bytes == [float(max(w.for_w_bytes.values())) for w in workers]
    assert costs.memory_bytes == [max(w.saved_bytes.values()) for w in workers]
    predicted = pl.simulate(schedules.zero_bubble_h1(p, m), costs)
    assert predicted.peak_memory == trace.peak_memory
    whole = pl.simulate(schedules.zero_bubble_h1(p, m), dataclasses.replace(costs, weight_memory_bytes=None))
    assert whole.peak_memory[1:] == [min(p, m) * c for c in costs.memory_bytes[1:]]


def test_observed_memory_between_b_and_w_by_hand():
    x_, h_, o_ = N * IN * FP32, N * HIDDEN * FP32, N * OUT * FP32
    x, y = torch.randn(N, IN), torch.randn(N, OUT)
    pipe = pl.Pipeline(two_stage_model(), n_stages=2, n_microbatches=1, schedule=schedules.zero_bubble_h1(2, 1),
                       loss_fn=nn.MSELoss(), devices="cpu")
    trace = pipe.step(x, y).trace
    # counted: stage 0 saves x and Z (GELU's input), then from I to W also holds the gradient it received
    # (no input gradient to compute: W runs its whole backward); stage 1 its input h, its output and the target
    assert trace.peak_memory == [x_ + h_ + h_, h_ + o_ + o_]
    end = {e.action: e.end for e in trace.events}
    # after I, until W: stage 1 keeps what W needs, its Linear's input (h_) and the gradient of its output
    # recorded at the Linear (o_); the loss node's saved output and target are freed at I (nothing holds it);
    # stage 0 (no input gradient to compute) what it saved and the gradient it received
    assert level_at(trace, 1, "observed", end[Action("I", 1, 0)]) == h_ + o_
    assert level_at(trace, 0, "observed", end[Action("I", 0, 0)]) == x_ + h_ + h_
    # the peak of stage 1: at the end of I, also the gradient of its input, about to be sent
    assert trace.peak_memory_observed[1] == h_ + o_ + o_ + o_ + h_
    assert trace.observed_peak_parts[1] == {"saved": h_ + o_ + o_, "gradient": o_ + h_}
    # the counted rule (Zero Bubble PP, Table 1: what W needs waits for W, the rest leaves at I) agrees there
    for device in range(2):
        i_end = end[Action("I", device, 0)]
        assert level_at(trace, device, "counted", i_end) == level_at(trace, device, "observed", i_end)
        assert trace.memory_curve(device, "observed")[1][-1] == 0 == trace.memory_curve(device)[1][-1]


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_observed_holds_what_autograd_saved_until_w(kind):
    """The counted rule releases a micro-batch at the end of its W; the observed curve (real lifetimes)
    is never below it where the counted curve changes: nothing B was to keep for W is freed early."""
    p, m = 4, 8
    model = make_model(kind, 8)
    x, y = pl.models.sample_batch(model, 16)
    for checkpoint in ("never", "except_last"):
        pipe = pl.Pipeline(model, n_stages=p, n_microbatches=m, schedule=schedules.zero_bubble_h1(p, m),
                           loss_fn=pl.models.default_loss(model),
                           devices="cpu", checkpoint=checkpoint)
        trace = pipe.step(x, y).trace
        model.zero_grad(set_to_none=True)
        for device in range(p):
            assert trace.memory_curve(device, "observed")[1][-1] == 0
            if checkpoint == "never":  # (checkpointed, the counted rule adds the recomputation at B's start)
                for t in trace.memory_curve(device)[0]:
                    assert level_at(trace, device, "observed", t) >= level_at(trace, device, "counted", t), (device, t)
            assert trace.peak_memory_observed[device] >= trace.peak_memory[device]
        # counted per stage: at most min(p, m) micro-batches' whole activations at the peak, 1F1B's p M_B
        # (Zero Bubble PP, Table 2), though ZB-H1 has min(p, m) in flight on every stage
        held = [max(w.saved_bytes.values()) for w in sorted(pipe.workers.values(), key=lambda w: w.index)]
        if checkpoint == "never":
            assert trace.peak_inflight == [min(p, m)] * p
            # (stage 0, without an input gradient, also keeps each gradient it received until its W; a GPT with
            # sequences this short keeps more for W than its F saved: the gradients of the 3h and 4h outputs)
            if kind == "mlp":
                assert all(trace.peak_memory[s] <= min(p, m) * held[s] for s in range(1, p))

