"""Observed activation memory (runtime/memory_observer.py) against figures computed by hand.

The "counted" curve is the saved-bytes rule the simulator uses too; these tests check the
"observed" one, which comes from when PyTorch really frees each storage a stage keeps,
against byte counts enumerated by hand from the ops of tiny models (which tensors Linear,
GELU and MSELoss save, what a stage receives and sends), and against the counted curve
only as an inequality (observed keeps at least what autograd saved).
"""

import math
import time

import pytest
import torch
from torch import nn

import pipelab as pl
from pipelab.schedules.action import Action
from pipelab.runtime.memory_observer import REASONS, MemoryObserver, observed_breakdown, observed_samples
from pipelab.schedules.trace import MemorySample, Trace

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FP32 = 4


# -- the observer itself ---------------------------------------------------------------------
def test_a_storage_counts_until_pytorch_frees_it_once_per_device_parameters_left_out():
    weight = nn.Parameter(torch.ones(10))
    observer = MemoryObserver({0: 0, 1: 1}, [weight])
    a = torch.zeros(25)  # 100 bytes
    observer.keep(0, a)
    observer.keep(0, a[5:])  # a view: the same storage, counted once
    observer.keep(0, weight)  # a parameter: not an activation
    observer.keep(1, a)  # another device's stage keeps it too: counted there as well
    observer.keep(0, torch.empty(0))  # no bytes
    assert [delta for _, _, delta, _ in observer.changes] == [100, 100]
    view = a[:3]
    del a
    assert observer.still_kept == 200  # the view keeps the storage alive
    del view
    assert sorted((device, delta) for _, device, delta, _ in observer.changes[2:]) == [(0, -100), (1, -100)]
    assert observer.still_kept == 0


def test_a_stronger_reason_moves_the_bytes_without_changing_the_level():
    observer = MemoryObserver({0: 0})
    message = torch.zeros(8)  # 32 bytes
    observer.keep(0, message, "received")
    observer.keep(0, message, "saved")  # autograd saved the activation received: now "saved"
    observer.keep(0, message, "received")  # weaker: no change
    placed = [(float(k), *rest) for k, (_, *rest) in enumerate(observer.changes)]
    assert [s.bytes for s in observed_samples(placed, 1)] == [0, 32, 0, 32]
    assert observed_breakdown(placed, 1) == [{"received": 32}]  # the peak was first reached as "received"
    del message
    placed = [(float(k), *rest) for k, (_, *rest) in enumerate(observer.changes)]
    assert observed_samples(placed, 1)[-1].bytes == 0
    assert REASONS.index("saved") < REASONS.index("received")


def test_changes_are_placed_at_their_offset_into_an_action_or_at_the_end_of_the_last_one():
    observer = MemoryObserver({0: 0, 1: 1})
    f, b = Action("F", 0, 0), Action("B", 0, 0)
    observer.windows = [(10.0, 12.0, f), (20.0, 21.0, b)]  # host seconds, in the order they ran
    changes = [(9.0, 0, 1, 0), (10.5, 0, 2, 0), (15.0, 1, 3, 4), (20.25, 0, -2, 0), (30.0, 0, -1, 0)]
    observer.times, observer.devices, observer.deltas, observer.reasons = map(list, zip(*changes))
    observer.spent_at = [0.0] * len(changes)  # the observer's own time so far at each change
    start, end = {f: 0.0, b: 5.0}, {f: 2.0, b: 5.5}  # the trace's clock (a replay, say)
    placed = observer.place(start, end)
    assert [t for t, *_ in placed] == [0.0,  # before the first action: at its start
                                       0.5,  # 0.5 s into F
                                       2.0,  # between F and B: at F's end
                                       5.25,  # 0.25 s into B
                                       5.5]  # after B: at its end
    end_short = {f: 0.2, b: 5.1}  # a trace action shorter than its host window (CUDA): clamped into it
    assert [t for t, *_ in observer.place(start, end_short)][1:4] == [0.2, 0.2, 5.1]
    assert [t for t, *_ in observer.place({}, {}, shift=100.0)] == [109.0, 110.5, 115.0, 120.25, 130.0]
    # 0.1 s of the observer's own work before the change in B: windows are on the clock without it,
    # so the change is 0.15 s into B (the shifted wall clock keeps it)
    observer.spent_at = [0.0, 0.0, 0.0, 0.1, 0.1]
    assert observer.place(start, end)[3][0] == pytest.approx(5.15)
    assert observer.place({}, {}, shift=100.0)[3][0] == 120.25


# -- one step, enumerated by hand ------------------------------------------------------------
N, IN, HIDDEN, OUT = 5, 8, 16, 4  # samples, and the widths of a two-stage model


def two_stage_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU()), nn.Linear(HIDDEN, OUT))


def one_step(model, schedule="gpipe", n_microbatches=1, checkpoint="never"):
    x, y = torch.randn(N * n_microbatches, IN), torch.randn(N * n_microbatches, OUT)
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=n_microbatches, schedule=schedule, loss_fn=nn.MSELoss(),
                       devices="cpu", checkpoint=checkpoint)
    return pipe.step(x, y).trace


def test_observed_peaks_of_a_two_stage_step_by_hand():
    x_ = N * IN * FP32  # 160: stage 0's input
    h_ = N * HIDDEN * FP32  # 320: stage 0's Linear output Z (GELU saves it), its output Y, the gradient of Y
    o_ = N * OUT * FP32  # 80: stage 1's output and the target (MSELoss saves both)
    trace = one_step(two_stage_model())
    # counted: stage 0 saves x and Z; stage 1 saves its input (Linear) and output and target (MSELoss)
    assert trace.peak_memory == [x_ + h_, h_ + o_ + o_]
    # observed, stage 0: x, Z and its output Y while F runs; Y is freed once sent (only its GradientEdge is
    # kept; kept whole, Y would stay until B and the peak be 320 bytes more), then the gradient of Y
    # arrives (as big as Y) and waits for B: both moments hold x + Z + 320 bytes.
    # stage 1: during F its input, output, target and the weighted loss (4 bytes, held until F ends);
    # at the end of B its input and the input's gradient, about to be sent: 320 + 320.
    assert trace.peak_memory_observed == [x_ + h_ + h_, h_ + h_]
    assert trace.observed_peak_parts == [{"saved": x_ + h_, "output": h_}, {"saved": h_, "gradient": h_}]
    for device in range(2):
        assert trace.memory_curve(device, "observed")[1][-1] == 0  # everything freed by the end


def test_checkpointed_stage_holds_its_input_then_the_recomputation_inside_the_backward():
    x_, h_ = N * IN * FP32, N * HIDDEN * FP32
    trace = one_step(two_stage_model(), checkpoint=[True, False])
    # stage 0 keeps only x between F and B; counted: x, plus the recomputation's Z from B's start.
    # observed: during F x and Y (the output, until sent); in B x, the gradient of Y, and the
    # recomputed Z and Y (the output again, the backward's starting point)
    assert trace.peak_memory[0] == x_ + h_
    assert trace.peak_memory_observed[0] == x_ + 3 * h_
    assert trace.observed_peak_parts[0] == {"input": x_, "saved": h_, "output": h_, "received": h_}
    times, levels = trace.memory_curve(0, "observed")
    f_end = next(e.end for e in trace.events if e.action == Action("F", 0, 0))
    between = [level for t, level in zip(times, levels) if t == f_end]
    assert between[-1] == x_  # after F: the input only


# -- against the counted curve and the schedules ---------------------------------------------
def level_at(trace: Trace, device: int, what: str, t: float) -> int:
    times, levels = trace.memory_curve(device, what)
    return [level for time_, level in zip(times, levels) if time_ <= t][-1]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("kind", ["mlp", "tiny_gpt"])
def test_observed_holds_at_least_what_autograd_saved(kind, schedule):
    model = pl.models.mlp(depth=8, width=32, seed=0) if kind == "mlp" else pl.models.tiny_gpt(
        n_layers=4, d_model=16, n_heads=2, vocab_size=32, seq_len=6, seed=0)
    x, y = pl.models.sample_batch(model, 16)
    for checkpoint in ("never", "except_last"):
        pipe = pl.Pipeline(model, n_stages=4, n_microbatches=4, schedule=schedule,
                           loss_fn=pl.models.default_loss(model), devices="cpu", checkpoint=checkpoint)
        trace = pipe.step(x, y).trace
        assert all(o >= c for o, c in zip(trace.peak_memory_observed, trace.peak_memory))
        for device in range(4):
            assert trace.memory_curve(device, "observed")[1][-1] == 0
            if checkpoint == "never":  # then at every moment the counted curve changes
                for t in trace.memory_curve(device)[0]:
                    assert level_at(trace, device, "observed", t) >= level_at(trace, device, "counted", t)
        model.zero_grad(set_to_none=True)


def test_stage0_observed_memory_follows_m_micro_batches_for_gpipe_and_min_p_m_for_1f1b():
    p, m, samples, width = 4, 8, 4, 32
    u = samples * width * FP32  # one (4 x 32) fp32 activation: 512 bytes
    saved = 4 * u  # stage 0 = two Linear + GELU blocks: each Linear's and each GELU's input
    model = pl.models.mlp(depth=8, width=width, seed=0)
    x, y = pl.models.sample_batch(model, m * samples)
    for schedule, in_flight in (("gpipe", m), ("1f1b", min(p, m))):
        pipe = pl.Pipeline(model, n_stages=p, n_microbatches=m, schedule=schedule, loss_fn=nn.MSELoss(),
                           devices="cpu")
        trace = pipe.step(x, y).trace
        model.zero_grad(set_to_none=True)
        # the forward that fills the pipeline: stage 0's in_flight-th (no B of stage 0 has run yet)
        last = next(e for e in trace.events if e.action == Action("F", 0, in_flight - 1))
        times, levels = trace.memory_curve(0, "observed")
        during = max(level for t, level in zip(times, levels) if last.start < t < last.end)
        # gradients already back from stage 1 wait for their B (none, unless this forward's measured
        # duration was long enough for a micro-batch to go down the pipeline and back)
        waiting = [sum(e.kind == "B" and e.stage == 1 and e.end < t for e in trace.events) * u
                   for t in (last.end, math.nextafter(last.end, math.inf))]
        # during it: the saved tensors of all in flight, and its output until sent
        assert during == in_flight * saved + u + waiting[0]
        # once it is sent: the saved tensors only
        assert level_at(trace, 0, "observed", last.end) == in_flight * saved + waiting[1]
        peak, parts = trace.peak_memory_observed[0], trace.observed_peak_parts[0]
        assert peak >= during
        # never more saved than the micro-batches in flight; outputs freed once sent, at most the one being
        # sent (gradients received and waiting for their B come on top: how many depends on the
        # measured durations the step is replayed with)
        assert parts["saved"] <= in_flight * saved
        assert parts.get("output", 0) <= u


# -- the Trace's API -------------------------------------------------------------------------
def test_peak_memory_by_kind():
    memory = [MemorySample(0, 0.0, 0), MemorySample(0, 1.0, 300, "observed"), MemorySample(0, 1.0, 100),
              MemorySample(1, 2.0, 50, "counted")]
    trace = Trace([], memory, "replayed", 2, 1, 2)
    assert trace.memory_kinds == ["counted", "observed"]
    assert trace.peak_memory == trace.peak_memory_by("counted") == [100, 50]
    assert trace.peak_memory_observed == [300, 0]
    assert trace.memory_curve(1, "counted") == ([2.0], [50])
    with pytest.raises(ValueError, match="memory samples are one of"):
        Trace([], [MemorySample(0, 0.0, 0, "activations")], "replayed", 1, 1, 1)
    with pytest.raises(ValueError, match="no 'allocated' memory samples"):
        trace.peak_memory_by("allocated")
    with pytest.raises(ValueError, match="one of"):
        trace.peak_memory_by("bytes")
    simulated = pl.simulate(pl.schedules.gpipe(2, 2), pl.Costs(forward=1.0, backward=2.0, memory_bytes=10.0))
    assert simulated.memory_kinds == ["counted"] and simulated.peak_memory == [20, 20]
    with pytest.raises(ValueError, match="'observed' comes from an engine's step"):
        simulated.peak_memory_observed


# -- on real processes and on CUDA -----------------------------------------------------------
def two_stage_on_ranks() -> tuple:
    """On each of 2 ranks: two steps of the two-stage model (the second with every shape known)."""
    model = two_stage_model()
    x, y = torch.randn(N, IN), torch.randn(N, OUT)
    pipe = pl.DistributedPipeline(model, n_microbatches=1, schedule="gpipe", loss_fn=nn.MSELoss())
    traces = [pipe.step(x, y).trace for _ in range(2)]
    return [t.peak_memory for t in traces], [t.peak_memory_observed for t in traces], traces[-1].observed_peak_parts


def test_distributed_engine_observes_the_same_step_and_its_pending_send():
    x_, h_, o_ = N * IN * FP32, N * HIDDEN * FP32, N * OUT * FP32
    counted, observed, parts = pl.distributed.launch(two_stage_on_ranks, 2, timeout_seconds=120)[0]
    assert counted == [[x_ + h_, h_ + 2 * o_]] * 2
    # as in the local engine, except that stage 0's output stays until the end of the step: gloo's
    # send keeps the tensor until the send is waited for (in the transport's finish), so when the
    # gradient's receive buffer is posted stage 0 holds x, Z, Y and the gradient
    assert observed == [[x_ + h_ + 2 * h_, 2 * h_]] * 2
    assert parts == [{"saved": x_ + h_, "output": h_, "received": h_}, {"saved": h_, "gradient": h_}]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_allocator_figures_beside_the_observed_curve():
    model = pl.models.mlp(depth=8, width=256, seed=0)
    x, y = pl.models.sample_batch(model, 64)
    pipe = pl.Pipeline(model, n_stages=4, n_microbatches=8, schedule="1f1b", loss_fn=nn.MSELoss(), devices="cuda")
    pipe.step(x, y)  # the first step allocates the .grad tensors
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    trace = pipe.step(x, y).trace
    assert {"counted", "observed", "allocated", "allocated_peak"} <= set(trace.memory_kinds)
    assert all(o >= c for o, c in zip(trace.peak_memory_observed, trace.peak_memory))
    for device in range(trace.n_devices):
        assert trace.memory_curve(device, "observed")[1][-1] == 0
    # every storage observed is an allocation of the caching allocator, on top of what was there before
    assert max(trace.peak_memory_by("allocated_peak")) - before >= max(trace.peak_memory_observed)
    peak_during = {(s.device, s.time): s.bytes for s in trace.memory if s.what == "allocated_peak"}
    for e in trace.events:
        end_level = next(s.bytes for s in trace.memory if s.what == "allocated" and s.device == e.device
                         and s.time == e.end)
        assert peak_during[e.device, e.start] >= end_level


def test_the_observers_own_time_is_not_in_the_replayed_durations(monkeypatch):
    from pipelab.runtime import memory_observer

    model = two_stage_model()
    x, y = torch.randn(4 * N, IN), torch.randn(4 * N, OUT)
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=4, schedule="1f1b", loss_fn=nn.MSELoss(), devices="cpu")
    quick = pipe.step(x, y)
    slow_keep = memory_observer.MemoryObserver._keep

    def keep_slowly(self, *args):  # an observer 20 ms slower per storage
        time.sleep(0.02)
        slow_keep(self, *args)

    monkeypatch.setattr(memory_observer.MemoryObserver, "_keep", keep_slowly)
    slow = pipe.step(x, y)
    assert slow.wall_seconds > 16 * 0.02  # the 8 actions keep 2 or more storages each: 0.32 s at least
    assert slow.op_seconds < quick.op_seconds + 0.1  # none of it in the actions' times (0.1 s: noise)
