"""The local engine's trace, memory accounting and error messages."""

import dataclasses
import inspect
import pickle

import pytest
import torch
from torch import nn

import pipelab as pl
from pipelab.runtime.options import LOCAL_PLACEMENT, RANK_PLACEMENT
from reference_timing import reference_times


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run(schedule="1f1b", n_stages=4, n_microbatches=8, batch=32, width=32):
    model = pl.models.mlp(depth=8, width=width, seed=0)
    x, y = pl.models.sample_batch(model, batch)
    pipe = pl.Pipeline(model, n_stages=n_stages, n_microbatches=n_microbatches, schedule=schedule,
                       loss_fn=nn.MSELoss(), devices="cpu")
    return pipe, pipe.step(x, y)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_trace_on_cpu_is_replayed_and_complete(schedule):
    pipe, result = run(schedule)
    trace = result.trace
    assert trace.source == "replayed" and "virtual clock" in trace.source_label
    actions = sorted(str(e.action) for e in trace.events)
    assert actions == sorted(str(a) for a in pipe.schedule.all_actions())
    assert all(e.duration > 0 for e in trace.events)
    # Each device runs its actions in the schedule's order, never two at once.
    for device, row in enumerate(pipe.schedule.actions):
        events = sorted((e for e in trace.events if e.device == device), key=lambda e: e.start)
        assert [e.action for e in events] == row
        assert all(a.end <= b.start + 1e-12 for a, b in zip(events, events[1:]))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_replayed_trace_is_the_reference_timeline_of_the_measured_durations(schedule):
    """The replay against an independent reference (`tests/reference_timing.py`: a naive sweep of DESIGN.md's
    rules, not the engine's dependency loop): every action starts and ends where the rules put it."""
    pipe, result = run(schedule)
    durations = result.trace.durations()
    start, end = reference_times(pipe.schedule, durations.__getitem__)
    assert len(result.trace.events) == len(start) == 2 * 4 * 8
    for e in result.trace.events:
        assert (e.start, e.end) == pytest.approx((start[e.action], end[e.action]), rel=1e-9, abs=1e-12), e
    # and the host really ran every op: the step's wall time covers the summed op times
    assert result.wall_seconds >= result.op_seconds


@pytest.mark.parametrize("n_stages,n_microbatches", [(4, 8), (4, 2), (3, 7)])
def test_peak_inflight_matches_theory(n_stages, n_microbatches):
    _, gpipe = run("gpipe", n_stages, n_microbatches)
    _, ofob = run("1f1b", n_stages, n_microbatches)
    assert gpipe.trace.peak_inflight == [n_microbatches] * n_stages
    assert ofob.trace.peak_inflight == [min(n_stages - s, n_microbatches) for s in range(n_stages)]


def test_activation_memory_counts_saved_tensors_and_frees_them():
    _, gpipe = run("gpipe", 4, 8, batch=32, width=32)
    _, ofob = run("1f1b", 4, 8, batch=32, width=32)
    # Stage 0 holds two blocks of Linear(32,32) + GELU: autograd saves each Linear's input and
    # each GELU's input, four (4 samples x 32) fp32 tensors per micro-batch.
    per_microbatch = 4 * (4 * 32 * 4)
    assert ofob.trace.peak_memory[0] == 4 * per_microbatch  # min(p, m) = 4 micro-batches
    assert gpipe.trace.peak_memory[0] == 8 * per_microbatch  # all m = 8
    for trace in (gpipe.trace, ofob.trace):
        for device in range(trace.n_devices):
            assert trace.memory_curve(device)[1][-1] == 0  # everything freed by the end of the step


def test_memory_excludes_parameters():
    class SquaredWeight(nn.Module):  # W ** 2 saves W itself for backward: a parameter, not an activation
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(64, 64))

        def forward(self, x):
            return x + (self.weight ** 2).sum()

    model = nn.Sequential(SquaredWeight(), nn.Linear(8, 8))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    trace = pl.Pipeline(model, n_stages=2, n_microbatches=2, schedule="gpipe", loss_fn=nn.MSELoss(),
                        devices="cpu").step(x, y).trace
    assert trace.peak_memory[0] == 0
    assert trace.peak_memory[1] > 0  # stage 1 saves its input (and MSE its operands)


def test_chrome_trace_and_timeline_from_a_real_step(tmp_path):
    _, result = run()
    path = result.trace.to_chrome_trace(tmp_path / "step.json")
    import json

    data = json.loads(path.read_text())
    names = {e["name"] for e in data["traceEvents"] if e["ph"] == "X"}
    assert {"F0", "B7"} <= names
    fig = pl.plot.timeline(result.trace)
    assert "replayed" in fig.axes[0].get_title()


def test_a_step_result_pickles_with_its_trace():
    _, result = run()
    copy = pickle.loads(pickle.dumps(result))
    assert copy.loss == result.loss and copy.microbatch_losses == result.microbatch_losses
    assert copy.trace.events == result.trace.events and copy.trace.memory == result.trace.memory


def test_bad_inputs_get_clear_errors():
    model = pl.models.mlp(depth=4, width=8)
    x, y = pl.models.sample_batch(model, 6)
    with pytest.raises(TypeError, match="loss_fn"):
        pl.Pipeline(model, n_stages=2, n_microbatches=2, schedule="1f1b", loss_fn=None)
    with pytest.raises(ValueError, match="reduction='mean'"):
        pl.Pipeline(model, n_stages=2, n_microbatches=2, schedule="1f1b", loss_fn=nn.MSELoss(reduction="sum"))
    with pytest.raises(ValueError, match="n_microbatches"):
        pl.Pipeline(model, n_stages=2, n_microbatches=0, schedule="1f1b", loss_fn=nn.MSELoss())
    with pytest.raises(ValueError, match="cannot cut 4 blocks into 5 stages"):
        pl.Pipeline(model, n_stages=5, n_microbatches=2, schedule="1f1b", loss_fn=nn.MSELoss())
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        pl.Pipeline(model, n_stages=2, n_microbatches=2, schedule="zigzag", loss_fn=nn.MSELoss())
    with pytest.raises(ValueError, match="3 stages x 2 micro-batches"):
        pl.Pipeline(model, n_stages=2, n_microbatches=2, schedule=pl.schedules.gpipe(3, 2), loss_fn=nn.MSELoss())
    broken = pl.schedules.gpipe(2, 2)
    broken.actions[1].remove(pl.Action("B", 1, 1))
    with pytest.raises(pl.ScheduleError, match="1B1"):
        pl.Pipeline(model, n_stages=2, n_microbatches=2, schedule=broken, loss_fn=nn.MSELoss())
    split_backward = pl.schedules.gpipe(2, 1)
    split_backward.actions[1].append(pl.Action("W", 1, 0))  # a stage that splits its backward needs I and W
    split_backward = pl.Schedule(2, 1, split_backward.actions)  # its 1B0 is read as 1I0
    split_backward.actions[1].remove(pl.Action("W", 1, 0))
    with pytest.raises(pl.ScheduleError, match="missing action 1W0"):
        pl.Pipeline(model, n_stages=2, n_microbatches=1, schedule=split_backward, loss_fn=nn.MSELoss())
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=8, schedule="1f1b", loss_fn=nn.MSELoss(), devices="cpu")
    with pytest.warns(UserWarning, match="a batch of 6 samples, fewer than the pipeline's 8 micro-batches"):
        assert len(pipe.step(x, y).microbatch_losses) == 6  # an epoch's partial last batch: m = 6 for it
    hand_made = pl.Pipeline(model, n_stages=2, n_microbatches=8, schedule=pl.schedules.gpipe(2, 8),
                            loss_fn=nn.MSELoss(), devices="cpu")
    with pytest.raises(ValueError, match="a batch of 6 samples cannot fill the schedule's 8 micro-batches"):
        hand_made.step(x, y)
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=2, schedule="1f1b", loss_fn=nn.MSELoss(), devices="cpu")
    with pytest.raises(ValueError, match="targets hold 5"):
        pipe.step(x, y[:5])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error shown when there is no GPU")
def test_asking_for_cuda_without_a_gpu_says_so():
    model = pl.models.mlp(depth=4, width=8)
    with pytest.raises(ValueError, match="no CUDA GPU"):
        pl.Pipeline(model, n_stages=2, n_microbatches=2, schedule="1f1b", loss_fn=nn.MSELoss(), devices="cuda")


class Fork(nn.Module):
    """Returns a structure: a float tensor, a boolean mask, a dict with a tensor and an int, and None."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x):
        h = self.linear(x)
        return h, x[:, :1] > 0, {"scale": h.sum(-1, keepdim=True), "n": 3}, None


class Join(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, parts):
        h, mask, extra, nothing = parts
        assert nothing is None and extra["n"] == 3 and mask.dtype == torch.bool
        return self.linear(h * mask + extra["scale"])


def structured_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), Fork(), Join(), nn.GELU(), nn.Linear(6, 2))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_structures_cross_stage_boundaries_with_gradients_for_their_float_tensors(schedule, checkpoint):
    """A tuple holding a float tensor, a boolean mask, a dict and None crosses from Fork's stage to Join's; the
    loss and every gradient equal the plain step (the float tensors carry gradients back, the mask none)."""
    model = structured_model()
    x, y = torch.randn(10, 6), torch.randn(10, 2)
    reference_loss, reference = pl.single_device_gradients(model, x, y, nn.MSELoss())
    partition = pl.Partition([(0, 2), (2, 5)], [model[0:2], model[2:5]], "by hand", [1.0] * 5)
    result = pl.Pipeline(model, n_stages=2, n_microbatches=3, schedule=schedule, loss_fn=nn.MSELoss(),
                         devices="cpu", split_method=partition, checkpoint=checkpoint).step(x, y)
    assert result.loss == pytest.approx(float(reference_loss), rel=1e-6)
    assert pl.max_gradient_difference(model, reference) < 1e-6
    assert result.trace.peak_memory[1] > 0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_an_error_inside_a_stage_names_the_stage_its_blocks_the_action_and_what_the_block_expected(schedule):
    model = pl.models.mlp(depth=8, width=16, seed=0)
    pipe = pl.Pipeline(model, n_stages=4, n_microbatches=2, schedule=schedule, loss_fn=nn.MSELoss(), devices="cpu")
    with pytest.raises(pl.PipelineError) as caught:
        pipe.step(torch.randn(8, 7), torch.randn(8, 16))
    text = str(caught.value)
    assert text.startswith("F(stage 0, mb 0) failed on stage 0 (blocks 0..1): RuntimeError: mat1 and mat2")
    assert "received the input batch of shape (4, 7)" in text and "block 0 (Sequential) expects 16 features" in text

    # a stage whose input does not fit what the previous stage sends: both stages and both sizes
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(16, 4))
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=2, schedule=schedule, loss_fn=nn.MSELoss(), devices="cpu",
                       warm_up=False)  # the failure as the step itself meets it (the warm-up reports it the same way)
    with pytest.raises(pl.PipelineError) as caught:
        pipe.step(torch.randn(8, 16), torch.randn(8, 4))
    text = str(caught.value)
    assert text.startswith("F(stage 1, mb 0) failed on stage 1 (blocks 1..1)")
    assert "stage 1 received stage 0's output of shape (4, 32)" in text
    assert "block 1 (Linear) expects 16 features" in text
    row = " ".join(f">>{a}<<" if str(a) == "1F0" else str(a) for a in pipe.schedule.actions[1])
    assert text.endswith(f"\ndevice 1 runs: {row} (action 1 of 4)"), text
    assert isinstance(caught.value, RuntimeError) and isinstance(caught.value.__cause__, RuntimeError)

    # ... or whose dtype differs from what the previous stage sends
    model = nn.Sequential(nn.Linear(16, 16).double(), nn.Linear(16, 4))
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=2, schedule=schedule, loss_fn=nn.MSELoss(), devices="cpu",
                       warm_up=False)
    with pytest.raises(pl.PipelineError) as caught:
        pipe.step(torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 4))
    assert "stage 1 received stage 0's output of shape (4, 16) (torch.float64)" in str(caught.value)
    assert "block 1 (Linear) computes in torch.float32" in str(caught.value)


class ReturnsAPair(nn.Module):
    """A block that returns (output, a summary): the next block's Linear gets a tuple."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        y = self.linear(x)
        return y, y.sum(-1)


@pytest.mark.parametrize("where, expected", [
    (2, "block 2 (ReturnsAPair) returns a tuple of 2 (tensor (4, 8), tensor (4,)), but block 3 (Linear) expects one "
        "tensor of 8 features in the last dimension: have block 2 return one tensor (e.g. its output[0]), or have "
        "block 3 take the tuple apart"),  # inside stage 1
    (1, "block 1, the last of stage 0, returns a tuple of 2 (tensor (4, 8), tensor (4,)), but block 2 (Linear) "
        "expects one tensor of 8 features"),  # across the boundary: what stage 1 received
])
def test_a_block_that_returns_a_tuple_into_the_next_linear_is_named_with_what_the_next_expects(where, expected):
    """Not linear()'s own TypeError alone ("must be Tensor, not tuple"): which block returned what, which expects what."""
    blocks = [nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)]
    blocks[where] = ReturnsAPair()
    pipe = pl.Pipeline(nn.Sequential(*blocks), n_stages=2, n_microbatches=2, loss_fn=nn.MSELoss(), devices="cpu")
    with pytest.raises(pl.PipelineError) as caught:
        pipe.step(torch.randn(8, 8), torch.randn(8, 4))
    text = str(caught.value)
    assert text.startswith("F(stage 1, mb 0) failed on stage 1 (blocks 2..3): TypeError: linear(): argument 'input'")
    assert f"\n  {expected}" in text, text


def test_both_engines_take_every_option_and_their_own_placement_only():
    """An option exists in both engines or in neither: each engine's keywords are exactly the options' fields
    (`pl.PipelineOptions`) plus its own placement parameters, all keyword-only, the options in the same order,
    so a call moved from one engine to the other cannot misroute an argument by its position."""
    options = [field.name for field in dataclasses.fields(pl.PipelineOptions)]
    assert {"warm_up", "memory_limit_bytes", "check_finite", "split_points"} <= set(options)
    for engine, placement in ((pl.Pipeline, LOCAL_PLACEMENT), (pl.DistributedPipeline, RANK_PLACEMENT)):
        parameters = inspect.signature(engine).parameters
        assert all(p.kind is p.KEYWORD_ONLY for name, p in parameters.items() if name != "model")
        assert set(parameters) == {"model", "options", *placement, *options}, engine
        assert [name for name in parameters if name in options] == options
        for name in options:  # the defaults are the options' own
            default = parameters[name].default
            field = next(f for f in dataclasses.fields(pl.PipelineOptions) if f.name == name)
            assert default is inspect.Parameter.empty if field.default is dataclasses.MISSING else default == field.default
    with pytest.raises(TypeError, match="positional"):
        pl.Pipeline(pl.models.mlp(depth=2, width=4), 2, 2)
    with pytest.raises(TypeError, match="unknown option 'warmup' .did you mean warm_up"):
        pl.Pipeline(pl.models.mlp(depth=2, width=4), n_stages=2, n_microbatches=2, loss_fn=nn.MSELoss(), warmup=False)


def test_an_options_object_runs_like_its_keywords_and_keywords_beside_it_win():
    model = pl.models.mlp(depth=4, width=8, seed=0)
    x, y = pl.models.sample_batch(model, 8)
    options = pl.PipelineOptions(n_microbatches=4, schedule="gpipe", loss_fn=nn.MSELoss(), warm_up=False)
    by_object = pl.Pipeline(model, n_stages=2, options=options, schedule="1f1b")
    assert by_object.schedule.name == "1f1b" and by_object.options.warm_up is False and options.schedule == "gpipe"
    loss, grads = pl.single_device_gradients(model, x, y, nn.MSELoss())
    assert by_object.step(x, y).loss == pytest.approx(loss, rel=1e-6)
    assert pl.max_gradient_difference(model, grads) < 1e-6
    with pytest.raises(ValueError, match="n_microbatches must be a positive int"):
        pl.PipelineOptions(n_microbatches=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.schedule = "gpipe"


def test_a_stage_out_of_memory_stays_an_out_of_memory_error():
    """Wrapped with the stage's context like any failure, and still caught by `except torch.OutOfMemoryError`."""
    class Greedy(nn.Module):
        def forward(self, x):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")

    pipe = pl.Pipeline(nn.Sequential(nn.Linear(4, 4), Greedy()), n_stages=2, n_microbatches=2, schedule="1f1b",
                       loss_fn=nn.MSELoss(), devices="cpu")
    with pytest.raises(torch.OutOfMemoryError) as caught:
        pipe.step(torch.randn(4, 4), torch.randn(4, 4))
    assert isinstance(caught.value, pl.PipelineError)
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError) and "(simulated)" in str(caught.value.__cause__)
    assert str(caught.value).startswith("F(stage 1, mb 0) failed on stage 1 (blocks 1..1): OutOfMemoryError:")


def test_error_types_say_configuration_or_failure():
    assert issubclass(pl.ScheduleError, ValueError) and not issubclass(pl.ScheduleError, pl.PipelineError)
    assert issubclass(pl.PipelineError, RuntimeError) and not issubclass(pl.PipelineError, ValueError)
    with pytest.raises(ValueError, match="3 stages x 2 micro-batches"):
        pl.Pipeline(pl.models.mlp(depth=4, width=8), n_stages=2, n_microbatches=2, schedule=pl.schedules.gpipe(3, 2),
                    loss_fn=nn.MSELoss())


def test_checkpointing_keeps_only_stage_inputs_between_f_and_b():
    model = pl.models.mlp(depth=8, width=32, seed=0)
    x, y = pl.models.sample_batch(model, 32)
    plain = pl.Pipeline(model, n_stages=4, n_microbatches=8, schedule="1f1b", loss_fn=nn.MSELoss(),
                        devices="cpu").step(x, y).trace
    model.zero_grad()
    pipe = pl.Pipeline(model, n_stages=4, n_microbatches=8, schedule="1f1b", loss_fn=nn.MSELoss(), devices="cpu",
                       checkpoint="always")
    ckpt = pipe.step(x, y).trace
    input_bytes = 4 * 32 * 4  # one micro-batch of 4 samples x 32 features, fp32
    full = 4 * input_bytes  # stage 0 saves two Linear inputs and two GELU inputs per micro-batch
    # Between F and B stage 0 keeps 4 inputs (1F1B: 4 in flight); its backward recomputes the rest of
    # one micro-batch: peak = 4 inputs + 3 more tensors, against 4 full micro-batches without checkpointing.
    assert plain.peak_memory[0] == 4 * full
    assert ckpt.peak_memory[0] == 4 * input_bytes + (full - input_bytes)
    assert all(curve_end == 0 for curve_end in (ckpt.memory_curve(d)[1][-1] for d in range(4)))


def test_checkpoint_recompute_replays_the_random_state():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    grads = []
    for checkpoint in ("never", "always"):
        model.zero_grad(set_to_none=True)
        pipe = pl.Pipeline(model, n_stages=3, n_microbatches=4, schedule="1f1b", loss_fn=nn.MSELoss(), devices="cpu",
                           checkpoint=checkpoint, warm_up=False)  # keep the random stream identical between the runs
        torch.manual_seed(0)
        pipe.step(x, y)
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_checkpoint_option_is_checked():
    model = pl.models.mlp(depth=4, width=8)
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        pl.Pipeline(model, n_stages=2, n_microbatches=2, schedule="1f1b", loss_fn=nn.MSELoss(), checkpoint="sometimes")
    with pytest.raises(ValueError, match="one boolean per stage"):
        pl.Pipeline(model, n_stages=2, n_microbatches=2, schedule="1f1b", loss_fn=nn.MSELoss(), checkpoint=[True])


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("n_microbatches", [4, 8, 16])
def test_stage0_peak_gpipe_over_1f1b_is_m_over_p(kind, n_microbatches):
    """GPipe keeps m micro-batches on stage 0, 1F1B keeps p: the measured bytes divide to m / p."""
    if kind == "mlp":
        model = pl.models.mlp(depth=8, width=32, seed=0)
    else:
        model = pl.models.tiny_gpt(n_layers=2, d_model=16, n_heads=2, vocab_size=32, seq_len=8, seed=0)
    loss_fn = pl.models.default_loss(model)
    x, y = pl.models.sample_batch(model, 2 * n_microbatches)
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        model.zero_grad(set_to_none=True)
        peaks[schedule] = pl.Pipeline(model, n_stages=4, n_microbatches=n_microbatches, schedule=schedule,
                                      loss_fn=loss_fn, devices="cpu").step(x, y).trace.peak_memory[0]
    assert peaks["gpipe"] / peaks["1f1b"] == pytest.approx(n_microbatches / 4, rel=0.10)


def test_clip_grad_norm_is_the_whole_models():
    model = pl.models.mlp(depth=8, width=16, seed=3)
    x, y = pl.models.sample_batch(model, 16)
    reference = pl.models.mlp(depth=8, width=16, seed=3)
    nn.MSELoss()(reference(x), y).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01))
    pipe = pl.Pipeline(model, n_stages=4, n_microbatches=4, loss_fn=nn.MSELoss(), devices="cpu")
    pipe.step(x, y)
    assert pipe.clip_grad_norm_(0.01) == pytest.approx(norm, rel=1e-5) and norm > 0.01
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
