"""Lesson 06's functions: one step simulated, replayed and measured on real processes (gloo).

Three launches in all (each starts fresh ranks: seconds), on a small model so the steps
themselves are quick.  Timing figures are not asserted here (a shared CI machine makes
them noisy); what is asserted is exact: losses, gradients, which actions ran, the
structure of the traces, the arithmetic of the speed-up.
"""

import argparse
import shlex

import pytest
import torch

import pipelab as pl
from pipelab import compare_engines as ce
from pipelab.commands.training import add_run_arguments

SMALL = dict(width=64, depth=4, batch_size=32)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def three():
    return ce.three_ways(n_processes=2, n_microbatches=4, schedule="1f1b", steps=3, **SMALL)


def test_three_ways_are_the_same_step(three):
    schedule = pl.schedules.one_f_one_b(2, 4)
    assert [t.source for t in three.traces.values()] == ["simulated", "replayed", "measured"]
    for trace in three.traces.values():
        assert sorted(map(str, (e.action for e in trace.events))) == sorted(map(str, schedule.all_actions()))
        assert (trace.n_stages, trace.n_microbatches, trace.n_devices) == (2, 4, 2)
    assert three.measured.n_processes == 2 and "2 processes" in three.measured.source_label
    assert len(three.real.traces) == 2  # 3 steps, the first a warm-up
    assert three.measured is three.real.fastest
    assert three.measured.makespan == min(t.makespan for t in three.real.traces)


def test_every_rank_computes_the_single_device_step(three):
    real = three.real
    model = pl.models.mlp(depth=SMALL["depth"], width=SMALL["width"], seed=0)
    x, y = pl.models.sample_batch(model, SMALL["batch_size"], seed=0)
    expected = torch.nn.MSELoss()(model(x), y).item()
    assert real.single_device_loss == pytest.approx(expected, abs=1e-6)
    assert len(real.losses) == 2 and real.losses[0] == real.losses[1]
    assert real.losses[0] == pytest.approx(expected, abs=1e-5)
    assert three.replayed_loss == pytest.approx(expected, abs=1e-5)
    assert all(d < 1e-6 for d in real.gradient_differences)
    assert [len(w) for w in real.wall_seconds] == [3, 3]
    assert real.clock_errors[0] == 0.0 and 0 < real.clock_errors[1] < 0.05  # rank 0's clock is the reference
    assert real.clock_error == 2 * real.clock_errors[1]


def test_the_measured_step_shows_its_waits_and_messages(three):
    trace = three.measured
    assert len(trace.waits) == len(trace.messages) == 2 * 4  # one per activation and per gradient received
    first = [w for w in trace.waits if w.action == pl.Action("F", 1, 0)]
    assert len(first) == 1  # rank 1 cannot start before stage 0's first activation arrives
    text = ce.why_waited(trace, first[0])
    assert text.startswith("rank 1 waited") and "activation of F(stage 0, mb 0)" in text and "rank 0" in text
    gradient = next(w for w in trace.waits if w.action.kind == "B")
    assert "gradient of B(stage 1" in ce.why_waited(trace, gradient)
    slack = three.real.clock_error
    assert all(m.sent <= m.received + slack for m in trace.messages)  # none arrives before it was sent
    rows = ce.time_per_rank(trace)
    for device, row in enumerate(rows):
        assert row["busy"] == pytest.approx(trace.busy_time[device])
        assert row["busy"] + row["waiting"] + row["other"] == pytest.approx(trace.makespan)
        assert row["waiting"] > 0


def test_the_speedup_is_one_process_over_the_pipeline(three):
    real = three.real
    assert real.one_process_seconds > 0 and real.whole_batch_seconds > 0
    assert real.speedup == pytest.approx(real.one_process_seconds / real.fastest.makespan)
    assert real.speedup_over_whole_batch == pytest.approx(real.whole_batch_seconds / real.fastest.makespan)
    assert real.formula_speedup == pytest.approx(2 * 4 / 5)
    assert real.op_slowdown == pytest.approx(sum(real.fastest.busy_time) / real.one_process_seconds)
    assert real.ops_ran_slower == (real.op_slowdown >= ce.SLOW_OPS)
    assert "speed-up" in real.summary and "formula" in real.summary
    assert ("competed for the machine" in real.summary) == real.ops_ran_slower


def test_the_prediction_uses_the_profiled_costs(three):
    assert len(three.costs.forward) == len(three.costs.backward) == 2
    assert three.predicted.makespan == pytest.approx(pl.simulate(pl.schedules.one_f_one_b(2, 4), three.costs).makespan)


def test_the_widget_runs_for_real_on_one_process():
    box = ce.processes_widget(steps=3, **SMALL)
    controls = box.controls
    assert controls["n_processes"].max == 4 and controls["n_microbatches"].max == 16
    controls["schedule"].value, controls["n_microbatches"].value, controls["n_processes"].value = "gpipe", 2, 1
    result = box.run()
    assert result is box.result and result.n_processes == 1 and result.schedule == "gpipe"
    trace = result.fastest
    assert trace.source == "measured" and trace.n_devices == 1 and len(trace.events) == 4
    assert trace.waits == [] and trace.messages == []  # one process: nothing to send
    assert result.formula_speedup == 1.0
    assert result.losses[0] == pytest.approx(result.single_device_loss, abs=1e-5)
    assert bytes(box.children[2].value).startswith(b"\x89PNG") and "speed-up" in box.children[1].value
    assert "gpipe on 1 process," in result.summary


def test_a_failing_rank_ends_the_run_with_its_own_message():
    with pytest.raises(pl.DistributedError) as caught:
        pl.distributed.launch(ce.step_with_wrong_targets, 2, timeout_seconds=60)
    error = caught.value
    assert error.rank == 1  # the last stage, the only one that reads the targets
    assert "F(stage 1, mb 0) failed on stage 1" in error.message and "rank 1" in error.message
    assert "but the output has shape (4, 64) and the target shape (4, 32)" in error.message


def test_limits_of_a_real_run():
    for bad, match in [((5, 8), "n_processes <= 4"), ((2, 17), "n_microbatches <= 16"),
                       ((0, 8), "positive int"), ((2, True), "positive int")]:
        with pytest.raises(ValueError, match=match):
            ce.check_process_run(*bad)
    with pytest.raises(ValueError, match="steps must be at least 2"):
        ce.run_on_processes(2, 8, steps=1)


def test_formula_speedup():
    assert ce.formula_speedup(1, 8) == 1.0
    assert ce.formula_speedup(2, 8) == pytest.approx(16 / 9)
    assert ce.formula_speedup(4, 1) == 1.0  # one micro-batch: no overlap at all


def test_one_process_seconds_leaves_no_gradients():
    model = pl.models.mlp(depth=2, width=16, seed=0)
    x, y = pl.models.sample_batch(model, 8, seed=0)
    assert ce.one_process_seconds(model, x, y, torch.nn.MSELoss(), 4, steps=2) > 0
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="steps must be at least 1"):
        ce.one_process_seconds(model, x, y, torch.nn.MSELoss(), 4, steps=0)


def _parse_torchrun(command: str):
    """Split a command into torchrun's own options and pipelab.launch's, each parsed by its real parser."""
    from torch.distributed.run import get_args_parser

    words = shlex.split(command)
    if words[0].startswith("GLOO_SOCKET_IFNAME="):  # the environment of the command, for gloo
        words = words[1:]
    assert words[0] == "torchrun"
    split_at = words.index("-m")
    assert words[split_at + 1] == "pipelab.launch"
    torchrun = get_args_parser().parse_args(words[1:split_at + 2])  # "-m module" is torchrun's too
    program = argparse.ArgumentParser()
    add_run_arguments(program)
    return torchrun, program.parse_args(words[split_at + 2:])


def test_torchrun_command_for_two_machines_parses_with_torchrun_and_pipelab():
    for machine in (0, 1):
        command = ce.torchrun_command(2, 1, machine, host="10.0.0.1", interface="ens5")
        assert command.startswith("GLOO_SOCKET_IFNAME=ens5,ens5 torchrun ")  # a connection per direction
        torchrun, args = _parse_torchrun(command)
        assert (torchrun.nnodes, torchrun.nproc_per_node, torchrun.node_rank) == ("2", "1", machine)
        assert torchrun.rdzv_backend == "c10d" and torchrun.rdzv_endpoint == "10.0.0.1:29500"
        assert (args.stages, args.microbatches, args.schedule, args.width, args.batch_size) == (2, 8, "1f1b", ce.WIDTH, ce.BATCH_SIZE)


def test_torchrun_command_on_one_machine_and_its_checks():
    command = ce.torchrun_command(1, 4, schedule="gpipe", n_microbatches=16)
    assert command.startswith("torchrun --nproc-per-node 4 -m pipelab.launch") and "rdzv" not in command
    torchrun, args = _parse_torchrun(command)
    assert torchrun.nproc_per_node == "4" and (args.stages, args.microbatches, args.schedule) == (4, 16, "gpipe")
    assert ce.torchrun_command(3, 2, 2).count("--stages 6") == 1
    with pytest.raises(ValueError, match="machine_rank must lie in 0..1"):
        ce.torchrun_command(2, 1, 2)
    with pytest.raises(ValueError, match="n_machines must be a positive int"):
        ce.torchrun_command(0)
