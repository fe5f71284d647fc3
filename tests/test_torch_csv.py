"""PyTorch's compute-only schedule CSV: written and read by pipelab, and run by PyTorch's own runtime.

The runtime test builds, on 2 gloo ranks, a `torch.distributed.pipelining.PipelineStage` per rank
and PyTorch's `_PipelineScheduleRuntime`, loads the CSV pipelab wrote with its `_load_csv(path,
format="compute_only")`, runs one step, and compares each rank's gradients with the plain
single-device step.  `_PipelineScheduleRuntime` and `_load_csv` are PRIVATE PyTorch API (the
leading underscore; torchtitan uses them the same way for `pipeline_parallel_schedule_csv`): they
may change in any release.  They are pinned by pyproject.toml's `torch==2.13.0`, and
`test_torch_is_the_pinned_version` fails first, with this explanation, if another torch is installed.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch

import pipelab as pl
from pipelab import schedules
from pipelab.schedules.action import Action

PINNED_TORCH = "2.13"
TOLERANCE = dict(rtol=1e-5, atol=1e-6)
BATCH, WIDTH, DEPTH = 12, 16, 4
pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEDULES = [schedules.gpipe(2, 3), schedules.one_f_one_b(3, 5), schedules.zero_bubble_h1(4, 6),
             schedules.interleaved_1f1b(2, 4, 2), schedules.torch_schedule("ZBVZeroBubble", 2, 4)]


def test_torch_is_the_pinned_version():
    pinned = re.search(r'"torch==([\d.]+)"', (Path(__file__).parents[1] / "pyproject.toml").read_text()).group(1)
    assert pinned.startswith(PINNED_TORCH), f"pyproject pins torch {pinned}; this test was written for {PINNED_TORCH}"
    assert torch.__version__.startswith(PINNED_TORCH), (
        f"torch {torch.__version__} is installed, pipelab pins {PINNED_TORCH}: the runtime test below uses PyTorch's "
        "private _PipelineScheduleRuntime and _load_csv, check them before changing the pin")


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
@pytest.mark.parametrize("aligned", [False, True])
def test_write_then_read_gives_the_same_schedule(schedule, aligned, tmp_path):
    text = schedules.to_torch_csv(schedule, tmp_path / "s.csv", aligned=aligned)
    assert (tmp_path / "s.csv").read_text() == text
    back = schedules.from_torch_csv(tmp_path / "s.csv")
    assert back.actions == schedule.actions and back.n_microbatches == schedule.n_microbatches
    assert back.n_stages == schedule.n_stages
    schedules.validate(back)


def test_rows_are_the_devices_lists_in_pytorchs_action_text():
    from torch.distributed.pipelining.schedules import _Action

    schedule = schedules.zero_bubble_h1(2, 2)
    text = schedules.to_torch_csv(schedule)
    assert text.splitlines()[0] == "0F0,0F1,0I0,0W0,0I1,0W1"
    for row, cells in zip(schedule.actions, text.splitlines()):
        assert [str(_Action.from_str(cell)) for cell in cells.split(",")] == [str(a) for a in row]
    aligned = schedules.to_torch_csv(schedule, aligned=True).splitlines()
    assert aligned[1].startswith(",1F0,1I0,")  # device 1 idles in step 0


def test_pytorchs_own_tables_read_from_their_csv_equal_from_torch(tmp_path):
    order = schedules.torch_table("InterleavedZeroBubble", 2, 4, n_chunks=2)
    path = tmp_path / "torch.csv"
    with open(path, "w", newline="") as file:  # as PyTorch's _dump_csv writes it: str() of each entry, "" for None
        for rank in sorted(order):
            file.write(",".join("" if a is None else str(a) for a in order[rank]) + "\n")
    assert schedules.from_torch_csv(path).actions == schedules.from_torch(order, 4).actions


def test_communication_cells_are_dropped_and_a_split_stages_b_becomes_i_then_w():
    text = "0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1I0,1SEND_B0,1W0\n"
    schedule = schedules.from_torch_csv(io.StringIO(text))
    assert schedule.actions == [[Action("F", 0, 0), Action("B", 0, 0)],
                                [Action("F", 1, 0), Action("I", 1, 0), Action("W", 1, 0)]]
    mixed = schedules.from_torch_csv(io.StringIO("0F0,0B0\n1F0,1B0\n1W0\n"))  # row 2: a third rank's W of stage 1
    assert mixed.actions[1] == [Action("F", 1, 0), Action("I", 1, 0), Action("W", 1, 0)]


def test_bad_input_is_named():
    with pytest.raises(pl.ScheduleError, match="no rows"):
        schedules.from_torch_csv(io.StringIO("\n"))
    with pytest.raises(pl.ScheduleError, match="row|rank|2X0"):
        schedules.from_torch_csv(io.StringIO("0F0,2X0\n"))
    with pytest.raises(TypeError, match="path or an open text file"):
        schedules.from_torch_csv(42)
    with pytest.raises(ValueError, match="forward-only"):
        schedules.to_torch_csv(schedules.inference(2, 2))
    with pytest.raises(ValueError, match="asynchronous"):
        schedules.to_torch_csv(schedules.pipedream_async(2, 2))
    written_wrong = schedules.from_torch_csv(io.StringIO("0F0,0B0\n1B0,1F0\n"))
    with pytest.raises(pl.ScheduleError, match="needs"):
        schedules.validate(written_wrong)


# -- PyTorch's runtime runs what pipelab wrote ------------------------------------------------------------


def run_csv_on_pytorch(csv_text: str, n_microbatches: int) -> dict:
    """On each of 2 ranks: this rank's stage of the mlp, PyTorch's runtime loading `csv_text`, one step;
    returns {parameter name: gradient} of this rank's stage (the names of the unsplit model)."""
    import tempfile

    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime  # private: pinned, see module doc

    rank, p = dist.get_rank(), dist.get_world_size()
    model = pl.models.mlp(depth=DEPTH, width=WIDTH, seed=0)
    x, y = pl.models.sample_batch(model, BATCH, seed=1)
    a, b = pl.split(model, p).bounds[rank]
    submod = model[a:b]
    mb = BATCH // n_microbatches
    stage = PipelineStage(submod, rank, p, torch.device("cpu"),
                          input_args=torch.empty(mb, WIDTH, requires_grad=rank > 0),
                          output_args=torch.empty(mb, WIDTH, requires_grad=True))
    runtime = _PipelineScheduleRuntime([stage], n_microbatches, loss_fn=torch.nn.MSELoss(), scale_grads=True)
    with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as file:
        file.write(csv_text)
    runtime._load_csv(file.name, format="compute_only")
    if rank == 0:
        runtime.step(x)
    else:
        runtime.step(target=y, losses=[])
    names = dict(model.named_parameters())
    return {name: param.grad.clone() for name, param in names.items()
            if any(param is q for q in submod.parameters())}


@pytest.mark.parametrize("found", [False, True], ids=["zb-h1 written", "searched"])
def test_pytorch_runtime_runs_pipelabs_csv_with_the_single_device_gradients(found):
    m = 4
    if found:
        schedule = pl.search_schedule(2, m, pl.Costs(forward=1.0, backward=1.0, weight=0.5, latency=0.1),
                                      memory_limit=3)
        assert schedule.gradient_kind == [pl.schedules.action.Kind.I] * 2  # split: I and W actions
    else:
        schedule = schedules.zero_bubble_h1(2, m)
    text = schedules.to_torch_csv(schedule)
    model = pl.models.mlp(depth=DEPTH, width=WIDTH, seed=0)
    x, y = pl.models.sample_batch(model, BATCH, seed=1)
    torch.nn.MSELoss()(model(x), y).backward()
    reference = {name: param.grad for name, param in model.named_parameters()}
    per_rank = pl.distributed.launch(run_csv_on_pytorch, 2, text, m, timeout_seconds=120)
    got = {name: grad for grads in per_rank for name, grad in grads.items()}
    assert set(got) == set(reference)
    for name, grad in reference.items():
        torch.testing.assert_close(got[name], grad, **TOLERANCE, msg=lambda msg, name=name: f"{name}: {msg}")
