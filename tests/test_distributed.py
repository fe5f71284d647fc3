"""The distributed engine on real processes (gloo): exact, measured, and failing cleanly.

Reference: the plain single-device step, `loss_fn(model(x), y).backward()` on the whole
batch, computed here in the test process with plain autograd (no pipelab code).  Each
launch runs many cases, since starting the ranks costs seconds.
"""

import os
import time

import pytest
import torch
from torch import nn

import pipelab as pl
from distributed_cases import BATCH, make_model, no_children_left, unusual_schedules

import distributed_cases as cases
from pipelab.schedules.routes import Routes

TOLERANCE = dict(rtol=1e-5, atol=1e-6)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reference(kind):
    model = make_model(kind)
    x, y = pl.models.sample_batch(model, BATCH, seed=2)
    loss = pl.models.default_loss(model)(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("n_stages", [2, 3, 4])
def test_every_gradient_equals_the_single_device_step(n_stages):
    grid = [(kind, schedule, m) for kind in ("mlp", "gpt") for schedule in ("gpipe", "1f1b") for m in (1, 4, 8)]
    if n_stages in unusual_schedules():
        grid.append(("mlp", unusual_schedules()[n_stages], unusual_schedules()[n_stages].n_microbatches))
    per_rank = pl.distributed.launch(cases.run_cases, n_stages, grid, timeout_seconds=240)
    references = {kind: reference(kind) for kind in ("mlp", "gpt")}
    for k, (kind, schedule, m) in enumerate(grid):
        where = f"{kind} {getattr(schedule, 'name', schedule)} p={n_stages} m={m}"
        ref_loss, ref_grads = references[kind]
        seen = [rank[k] for rank in per_rank]
        for rank, found in enumerate(seen):
            assert found["loss"] == seen[0]["loss"], f"{where}: rank {rank} reports another loss"
            torch.testing.assert_close(torch.tensor(found["loss"], dtype=ref_loss.dtype), ref_loss, **TOLERANCE)
        # every parameter got its gradient on exactly one rank, and it is the single-device one
        owners = {}
        for rank, found in enumerate(seen):
            for name, grad in found["grads"].items():
                assert name not in owners, f"{where}: {name} has a gradient on ranks {owners[name]} and {rank}"
                owners[name] = rank
                torch.testing.assert_close(grad, ref_grads[name], **TOLERANCE, msg=lambda e: f"{where} {name}: {e}")
            # what a rank does not own is freed (on the meta device), and only that
            assert set(found["freed"]) == set(ref_grads) - set(found["grads"]), where
        assert set(owners) == set(ref_grads), f"{where}: parameters without a gradient"


def test_the_trace_is_measured_on_every_rank_and_shows_the_waits():
    schedule = unusual_schedules()[2]
    per_rank = pl.distributed.launch(cases.run_cases, 2, [("mlp", "1f1b", 8), ("mlp", schedule, 3)])
    for k, sched in enumerate([pl.schedules.one_f_one_b(2, 8), schedule]):
        traces = [rank[k]["trace"] for rank in per_rank]
        trace = traces[0]
        slack = max(rank[k]["offset"][1] for rank in per_rank) * 2  # times of two ranks compare to within this
        assert traces[1].events == trace.events  # every rank returns the same complete trace
        # summed from the records before the (lazily built) trace exists: the same as the trace's durations
        assert per_rank[0][k]["op_seconds"] == pytest.approx(sum(trace.durations().values()), rel=1e-9)
        assert trace.source == "measured" and trace.n_processes == 2
        assert "2 processes" in trace.source_label
        assert sorted(map(str, (e.action for e in trace.events))) == sorted(map(str, sched.all_actions()))
        for device, row in enumerate(sched.actions):
            events = sorted((e for e in trace.events if e.device == device), key=lambda e: e.start)
            assert [e.action for e in events] == row  # each rank ran its own list, in order
            assert all(a.end <= b.start for a, b in zip(events, events[1:]))  # one action at a time
        # real dependencies hold on the wall clock: a consumer starts after its producer ended
        end = {e.action: e.end for e in trace.events}
        for e in trace.events:
            if e.kind == "F" and e.stage > 0:
                assert e.start >= end[pl.Action("F", e.stage - 1, e.microbatch)] - slack
            if e.kind == "B" and e.stage < 1:
                assert e.start >= end[pl.Action("B", e.stage + 1, e.microbatch)] - slack
        # one wait and one message per received activation or gradient: 2 per micro-batch here
        assert len(trace.waits) == len(trace.messages) == 2 * sched.n_microbatches
        for message in trace.messages:
            assert message.sent <= message.received + slack
            assert message.source_device != message.target_device
    assert trace.peak_inflight == [3, 1]  # stage 0 keeps all 3 micro-batches, stage 1 one at a time


def test_clock_offsets_are_within_their_error_of_zero_on_one_machine():
    # one machine: every process reads the same monotonic clock, so the true offset is 0
    per_rank = pl.distributed.launch(cases.run_cases, 3, [("mlp", "gpipe", 2)])
    offsets = [rank[0]["offset"] for rank in per_rank]
    assert offsets[0] == (0.0, 0.0)
    for offset, error in offsets[1:]:
        assert 0 < error < 0.01 and abs(offset) <= error


def test_a_rank_whose_clock_runs_a_second_ahead_still_gives_a_trace_that_keeps_every_dependency():
    """On one machine the offsets are ~0, so a sign error would go unseen: shift rank 1's clock by a second.
    The estimate must find -1 s, and on rank 0's clock every action that receives a message starts after
    its producer ended (within the estimate's error), every message arrives after it was sent."""
    shifted = pl.distributed.launch(cases.shifted_clock, 2, 1.0, timeout_seconds=120)[1]
    assert shifted["offset"] == pytest.approx(-1.0, abs=0.01)
    slack = 2 * shifted["error"] + 1e-6
    end = {e.action: e.end for e in shifted["events"]}
    routes = Routes(pl.schedules.one_f_one_b(2, 4))
    checked = 0
    for e in shifted["events"]:
        source = routes.producer(e.action)
        if source is not None:
            assert e.start >= end[source] - slack, (e, source, end[source])
            checked += 1
    assert checked == 2 * 4
    assert all(m.received >= m.sent - slack for m in shifted["messages"])


@pytest.mark.parametrize("mistake,expected", [
    ("world size", "the schedule has 3 devices but the process group has 2 ranks"),
    ("other m", "the schedule is for 8 micro-batches, but n_microbatches=4"),
    ("m < 1", "n_microbatches must be a positive int, got 0"),
])
def test_a_bad_launch_fails_on_every_rank_alike_before_any_communication(mistake, expected):
    messages = pl.distributed.launch(cases.bad_launch, 2, mistake, timeout_seconds=60)
    assert messages[0] == messages[1] and expected in messages[0]


def test_a_stage_error_names_the_rank_stage_blocks_action_and_the_block_that_expected_another_size():
    with pytest.raises(pl.DistributedError) as caught:
        pl.distributed.launch(cases.wrong_feature_size, 2, timeout_seconds=60)
    error = caught.value
    assert error.rank == 0
    assert "F(stage 0, mb 0) failed on stage 0 (blocks 0..3, rank 0)" in str(error)
    assert "block 0 (Sequential) expects 16 features" in str(error) and "(4, 7)" in str(error)
    assert "mat1 and mat2" in str(error)  # the original message too


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_rank_that_raises_ends_the_run_fast_with_its_own_message(failing_rank):
    begin = time.monotonic()
    with pytest.raises(pl.DistributedError) as caught:
        pl.distributed.launch(cases.one_rank_fails, 2, failing_rank, "raise", timeout_seconds=120)
    assert time.monotonic() - begin < 30
    assert caught.value.rank == failing_rank
    assert caught.value.message == f"RuntimeError: rank {failing_rank} gives up on purpose"
    assert "one_rank_fails" in caught.value.details  # that rank's traceback
    assert no_children_left() == []


def test_a_killed_rank_ends_the_run_naming_it_with_no_process_left():
    begin = time.monotonic()
    with pytest.raises(pl.DistributedError) as caught:
        pl.distributed.launch(cases.one_rank_fails, 2, 1, "kill", timeout_seconds=120)
    assert time.monotonic() - begin < 60
    assert caught.value.rank == 1 and "SIGKILL" in str(caught.value)
    assert no_children_left() == []


def test_forked_ranks_get_the_launchers_environment_and_output_as_they_are_at_each_launch(monkeypatch, capfd):
    """The ranks fork from a server started at the first launch (runtime/launcher/forkserver.py), yet a variable
    set or removed since reaches them as it would a spawned rank, and what they print lands in this test's
    capture; PIPELAB_START_METHOD=spawn gives the same, from ranks that are the launcher's own children."""
    from pipelab.runtime.launcher import forkserver

    pl.distributed.launch(cases.report_pid, 2)  # the server runs from here on
    monkeypatch.setenv("PIPELAB_TEST_PROBE", "set after the server started")
    found = pl.distributed.launch(cases.environment_and_output, 2, "PIPELAB_TEST_PROBE")
    assert [value for value, _ in found] == ["set after the server started"] * 2
    assert {parent for _, parent in found} == {forkserver.server()[0]}  # forked, not spawned
    out, err = capfd.readouterr()
    assert "rank 0 says on stdout" in out and "rank 1 says on stdout" in out, out
    assert "rank 0 says on stderr" in err and "rank 1 says on stderr" in err, err
    monkeypatch.delenv("PIPELAB_TEST_PROBE")
    assert [value for value, _ in pl.distributed.launch(cases.environment_and_output, 2, "PIPELAB_TEST_PROBE")] \
        == [None, None]
    monkeypatch.setenv("PIPELAB_START_METHOD", "spawn")
    monkeypatch.setenv("PIPELAB_TEST_PROBE", "spawned")
    spawned = pl.distributed.launch(cases.environment_and_output, 2, "PIPELAB_TEST_PROBE")
    assert [value for value, _ in spawned] == ["spawned"] * 2 and {parent for _, parent in spawned} == {os.getpid()}
    assert "rank 1 says on stdout" in capfd.readouterr().out
    assert no_children_left() == []


def test_a_deadlock_ends_at_the_deadline_and_says_so():
    begin = time.monotonic()
    with pytest.raises(pl.DistributedError) as caught:
        pl.distributed.launch(cases.both_receive_first, 2, timeout_seconds=5)
    assert time.monotonic() - begin < 30
    # whichever deadline passes first says so: the launcher's ("timed out: still running after 5 s") or
    # gloo's own on the receive ("Timed out waiting 5000ms for recv"), which a loaded machine can make first
    assert "timed out" in str(caught.value).lower()
    assert no_children_left() == []


def test_launch_runs_a_function_defined_at_run_time_and_returns_every_rank_result():
    offset = 10

    def add_rank(base):  # a closure: plain pickle could not send it to a new process
        import torch.distributed as dist

        return base + offset + dist.get_rank() + 100 * dist.get_world_size()

    assert pl.distributed.launch(add_rank, 3, 1) == [311, 312, 313]


def test_activations_and_gradients_have_tags_of_their_own_parity_and_every_message_its_own_tag():
    from pipelab.runtime.p2p import _tag

    from pipelab.runtime.p2p import SLOTS

    n_stages, m = 3, 5
    forward = [_tag(pl.Action("F", s, i), m, slot) for s in range(n_stages) for i in range(m) for slot in range(SLOTS)]
    backward = [_tag(pl.Action(kind, s, i), m, slot) for kind in "BI" for s in range(n_stages) for i in range(m)
                for slot in range(SLOTS)]
    assert all(tag % 2 == 0 for tag in forward) and all(tag % 2 == 1 for tag in backward)
    assert len(set(forward)) == len(forward) and len(set(backward)) == len(backward) // 2  # B and I: one each
    assert not set(forward) & set(backward)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads threads and sockets in Linux's /proc")
def test_local_gloo_ranks_get_two_connections_per_pair_unless_the_user_chose(monkeypatch):
    from pipelab.runtime.p2p import loopback_interface

    loopback = loopback_interface()
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    payload = 200 * 1000 * 4  # 200 messages of 1000 float32
    for interfaces, threads, bursts in pl.distributed.launch(cases.gloo_connections, 2, True):
        assert (interfaces, threads) == (f"{loopback},{loopback}", 2)
        # measured, not derived from the tags: the bytes each socket carried (the kernel's count, whatever the
        # load): the 200 activations on one connection, the 200 gradients on the other
        busy = [max(burst, key=burst.get) for burst in bursts]
        assert busy[0] != busy[1], bursts
        for burst, socket in zip(bursts, busy):
            assert burst[socket] >= payload, bursts
            assert all(moved * 20 < burst[socket] for other, moved in burst.items() if other != socket), bursts
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", loopback)
    assert pl.distributed.launch(cases.gloo_connections, 2) == [(loopback, 1, [])] * 2


def test_launch_checks_its_arguments():
    with pytest.raises(ValueError, match="nproc must be a positive int"):
        pl.distributed.launch(cases.report_pid, 0)
    with pytest.raises(TypeError, match="runs a function"):
        pl.distributed.launch("not a function", 2)


def test_outside_a_process_group_the_pipeline_says_how_to_start_one():
    with pytest.raises(pl.PipelineError, match="torchrun"):
        pl.DistributedPipeline(make_model("mlp"), n_microbatches=4, schedule="1f1b", loss_fn=torch.nn.MSELoss())


@pytest.mark.parametrize("n_ranks, schedule", [(2, "gpipe"), (3, "1f1b")])
def test_structures_cross_ranks_with_gradients_for_their_float_tensors(n_ranks, schedule):
    """Every boundary carries (float tensor, boolean mask, {tensor, int}, None); uneven micro-batches (19 samples
    in 4) give two input shapes, so two layouts are sent before tensors alone travel."""
    per_rank = pl.distributed.launch(cases.run_structured, n_ranks, schedule, 4, timeout_seconds=120)
    model = cases.structured_model()
    x, y = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(4)), torch.randn(
        BATCH, 2, generator=torch.Generator().manual_seed(5))
    loss, reference = pl.single_device_gradients(model, x, y, torch.nn.MSELoss())
    grads = {name: grad for rank in per_rank for name, grad in rank["grads"].items()}
    assert set(grads) == set(reference)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[name], **TOLERANCE)
    assert all(rank["loss"] == pytest.approx(loss, rel=1e-6) for rank in per_rank)


@pytest.fixture(scope="module")
def sums_on_two_ranks():
    """One launch for the sums below (`distributed_cases.sums_on_two_ranks`)."""
    return pl.distributed.launch(cases.sums_on_two_ranks, 2, timeout_seconds=60)


def test_the_warm_up_on_ranks_adds_nothing_to_existing_gradients(sums_on_two_ranks):
    """The distributed engine warms up too (the same one-micro-batch schedule through its transport): gradients
    already in `.grad` come out as the plain sums."""
    assert max(rank["existing"] for rank in sums_on_two_ranks) < 1e-6


def test_a_weight_tied_across_two_ranks_gets_the_sum_of_both_uses_on_both(sums_on_two_ranks):
    """The embedding's weight, used by stage 0 (the lookup) and stage 1 (the output projection), is all-reduced
    between the two ranks: each copy holds dL/dw through both uses, the single device's gradient.

    Planted bug it catches: `SharedParameters.all_reduce_gradients` averaging instead of summing (dividing the
    all-reduced gradient by the number of ranks that hold it): half the gradient on both ranks.  Until now only
    tests marked slow (a tied Llama) saw it; this launch is shared with the warm-up test above."""
    model = cases.tied_model()
    _, reference = pl.single_device_gradients(model, *cases.tied_batch(), nn.MSELoss())
    assert all(rank["shared"] == {"0.weight": [0, 1]} for rank in sums_on_two_ranks)
    for rank, found in enumerate(sums_on_two_ranks):
        assert "0.weight" in found["tied"], rank
        for name, grad in found["tied"].items():
            torch.testing.assert_close(grad, reference[name], **TOLERANCE, msg=lambda e: f"rank {rank} {name}: {e}")
