"""Interleaved 1F1B (several stages per rank), zero bubble (W actions) and asynchronous PipeDream on the
distributed engine (gloo).

Reference: the plain single-device step in the test process (plain autograd), as in
tests/test_distributed.py; and the local engine's counted memory for the same schedule (the
counted rule depends only on each device's order of actions, not on their timing).
PipeDream: the sequential stale-weight reference of tests/test_pipedream_run.py (an update
every k backwards), over the run's (uneven) minibatches.  One launch per rank count runs every case: starting the ranks
costs seconds.
"""

import pytest
import torch

import pipelab as pl
from distributed_cases import BATCH, make_model
from pipelab import schedules

import distributed_beyond_cases as cases
from test_pipedream_run import sequential_reference

TOLERANCE = dict(rtol=1e-5, atol=1e-6)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

CASES = {
    2: [("mlp", schedules.interleaved_1f1b(2, 4, 2), "never"),
        ("gpt", schedules.interleaved_1f1b(2, 2, 4), "except_last"),
        ("mlp", schedules.zero_bubble_h1(2, 3), "always"),
        ("gpt", schedules.zero_bubble_h1(2, 4), "never"),
        ("gpt", schedules.torch_schedule("ZBVZeroBubble", 2, 4), "never")],
    4: [("mlp", schedules.interleaved_1f1b(4, 8, 2), "never"),
        ("gpt", schedules.interleaved_1f1b(4, 4, 2), "always"),
        ("mlp", schedules.zero_bubble_h1(4, 5), "except_last"),
        ("gpt", schedules.zero_bubble_h1(4, 8), "never"),
        ("mlp", schedules.torch_schedule("InterleavedZeroBubble", 4, 8, n_chunks=2), "never")],
}
ASYNCHRONOUS = {2: [("mlp", schedules.pipedream_async(2, 5), "never")],
                4: [("gpt", schedules.pipedream_async(4, 8), "except_last"), ("mlp", schedules.pipedream_async(4, 9, 2),
                                                                               "never")]}


def reference(kind):
    model = make_model(kind)
    x, y = pl.models.sample_batch(model, BATCH, seed=2)
    loss = pl.models.default_loss(model)(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def level_at(trace, device, what, t):
    times, levels = trace.memory_curve(device, what)
    return [level for time_, level in zip(times, levels) if time_ <= t][-1]


def local_counted_peaks(kind, schedule, checkpoint):
    model = make_model(kind)
    x, y = pl.models.sample_batch(model, BATCH, seed=2)
    pipe = pl.Pipeline(model, n_stages=schedule.n_stages, n_microbatches=schedule.n_microbatches, schedule=schedule,
                       loss_fn=pl.models.default_loss(model),
                       devices="cpu", checkpoint=checkpoint)
    return pipe.step(x, y).trace.peak_memory


def check_asynchronous(kind, schedule, seen, where):
    """PipeDream on the ranks against the sequential stale-weight reference (an update every k backwards)."""
    model = make_model(kind)
    x, y = pl.models.sample_batch(model, BATCH, seed=2)
    m, loss_fn = schedule.n_microbatches, pl.models.default_loss(model)
    losses = sequential_reference(model, schedule.n_stages, pl.microbatch.split(x, m), pl.microbatch.split(y, m),
                                  loss_fn, cases.momentum_sgd, schedule.update_every)
    want = dict(model.named_parameters())
    owners = set()
    for found in seen:
        torch.testing.assert_close(torch.tensor(found["losses"]), torch.tensor(losses), rtol=1e-6, atol=1e-7,
                                   msg=lambda e: f"{where}: minibatch losses {e}")
        if m % schedule.update_every == 0:  # else the last backwards' gradients wait for an update
            assert not found["grads"], f"{where}: gradients left after the updates"
        for name, weight in found["weights"].items():
            owners.add(name)
            torch.testing.assert_close(weight, want[name].detach(), rtol=1e-6, atol=1e-7,
                                       msg=lambda e: f"{where} {name}: {e}")
    assert owners == set(want), f"{where}: weights no rank returned"


@pytest.mark.parametrize("n_ranks", sorted(CASES))
def test_interleaved_zero_bubble_and_pipedream_on_ranks_equal_their_references(n_ranks):
    grid = CASES[n_ranks] + ASYNCHRONOUS[n_ranks]
    per_rank = pl.distributed.launch(cases.run_cases, n_ranks, grid, timeout_seconds=240)
    references = {kind: reference(kind) for kind in ("mlp", "gpt")}
    for k, (kind, schedule, checkpoint) in enumerate(grid):
        if schedule.asynchronous:
            check_asynchronous(kind, schedule, [rank[k] for rank in per_rank],
                               f"{kind} {schedule.name} on {n_ranks} ranks, checkpoint={checkpoint}")
            continue
        where = f"{kind} {schedule.name} on {n_ranks} ranks, checkpoint={checkpoint}"
        ref_loss, ref_grads = references[kind]
        seen = [rank[k] for rank in per_rank]
        device_of_stage = schedule.device_of_stage()
        owners = {}
        for rank, found in enumerate(seen):
            torch.testing.assert_close(torch.tensor(found["loss"], dtype=ref_loss.dtype), ref_loss, **TOLERANCE,
                                       msg=lambda e: f"{where}: loss\n{e}")
            assert found["stages"] == sorted(s for s, d in device_of_stage.items() if d == rank), where
            for name, grad in found["grads"].items():
                assert name not in owners, f"{where}: {name} has a gradient on ranks {owners[name]} and {rank}"
                owners[name] = rank
                torch.testing.assert_close(grad, ref_grads[name], **TOLERANCE, msg=lambda e: f"{where} {name}: {e}")
        assert set(owners) == set(ref_grads), f"{where}: parameters without a gradient"
        trace = seen[0]["trace"]
        assert trace.source == "measured" and trace.n_devices == n_ranks and trace.n_stages == schedule.n_stages
        for device, row in enumerate(schedule.actions):  # each rank ran its own list, in order
            events = sorted((e for e in trace.events if e.device == device), key=lambda e: e.start)
            assert [e.action for e in events] == row, where
        # messages: only between stages on different ranks (interleaved: 2 m (p v - 1), Megatron SC21)
        assert len(trace.messages) == schedule.message_count(), where
        assert trace.peak_memory == local_counted_peaks(kind, schedule, checkpoint), where
        for device in range(n_ranks):
            assert trace.memory_curve(device, "observed")[1][-1] == 0, f"{where}: device {device} kept memory"
            if checkpoint == "never":  # real lifetimes hold at least the counted rule (a split: W's part after I)
                for t in trace.memory_curve(device)[0]:
                    assert level_at(trace, device, "observed", t) >= level_at(trace, device, "counted", t), where
