"""`pl.search_schedule`: valid, within the memory limit, never worse than the named schedules, exact on tiny
sizes, and run with the single-device step's gradients by both engines.

Expectations from outside the search: the named generators simulated here, a brute force over every
pair of device orders (p = 2, m = 2), the lower bound (p - 1) t_F + m (t_F + t_B + t_W) (the last stage
cannot start before p - 1 forwards, then has m micro-batches of work), and plain autograd.
"""

from __future__ import annotations

import itertools
import time

import distributed_beyond_cases as distributed_cases
import pytest
import torch

import pipelab as pl
from pipelab import schedules
from pipelab.schedules.action import Action, Kind

TOLERANCE = dict(rtol=1e-5, atol=1e-6)
BATCH = 19
pytestmark = pytest.mark.usefixtures("one_torch_thread")

COSTS = [pl.Costs(forward=1.0, backward=1.0, weight=1.0),
         pl.Costs(forward=1.0, backward=2.0, weight=0.5, latency=0.3),
         pl.Costs(forward=[1.0, 1.5, 0.5, 1.0], backward=[2.0, 2.5, 1.0, 2.0], weight=[1.0, 0.5, 0.5, 1.0],
                  latency=0.1),
         pl.Costs(forward=1.0, backward=2.0, latency=0.2)]  # no weight: whole backwards


def per_stage(costs: pl.Costs, p: int) -> pl.Costs:
    """`costs` with list fields cut to p stages."""
    fields = {name: (value[:p] if isinstance(value, list) else value)
              for name, value in vars(costs).items()}
    return pl.Costs(**fields)


def named_fitting(p, m, costs, limit):
    """{name: makespan} of GPipe, 1F1B (B costs backward + weight) and ZB-H1 that keep at most `limit`
    micro-batches on every device."""
    whole = pl.Costs(forward=costs.forward, backward=[b + w for b, w in zip(*(
        [costs.per_stage(f, s, p) for s in range(p)] for f in ("backward", "weight")))], latency=costs.latency,
        memory_bytes=1)
    split = pl.Costs(forward=costs.forward, backward=costs.backward, weight=costs.weight, latency=costs.latency,
                     memory_bytes=1)
    runs = [(schedules.gpipe(p, m), whole), (schedules.one_f_one_b(p, m), whole)]
    if any(costs.per_stage("weight", s, p) for s in range(p)):
        runs.append((schedules.zero_bubble_h1(p, m), split))
    found = {}
    for schedule, c in runs:
        trace = pl.simulate(schedule, c)
        if limit is None or max(trace.peak_memory) <= limit:
            found[schedule.name] = trace.makespan
    return found


@pytest.mark.parametrize("costs", COSTS, ids=["1:1:1", "1:2:0.5 latency", "uneven", "whole backward"])
def test_found_schedules_are_valid_fit_and_beat_or_equal_every_named_one(costs):
    for p, m in [(1, 1), (1, 3), (2, 1), (2, 5), (3, 3), (4, 4), (4, 9)]:
        c = per_stage(costs, p)
        for limit in (1, p, 2 * p, None):
            found = pl.search_schedule(p, m, c, memory_limit=limit, exact=False)
            where = f"p={p} m={m} limit={limit}"
            schedules.validate(found)
            assert (found.n_stages, found.n_microbatches, found.n_devices) == (p, m, p), where
            trace = pl.simulate(found, found.meta["costs"])
            assert trace.makespan == pytest.approx(found.meta["makespan"]), where
            if limit is not None:
                assert max(trace.peak_memory) <= limit, where
            kinds = {a.kind for a in found.all_actions()}
            assert kinds == ({Kind.F, Kind.I, Kind.W} if any(c.per_stage("weight", s, p) for s in range(p))
                             else {Kind.F, Kind.B}), where
            for name, makespan in named_fitting(p, m, c, limit).items():
                assert found.meta["makespan"] <= makespan + 1e-9, (where, name)


def test_strictly_better_than_the_named_schedules_where_memory_allows_more_warm_up():
    costs = pl.Costs(forward=1.0, backward=2.0, weight=1.0, latency=0.2)
    found = pl.search_schedule(4, 8, costs, memory_limit=8)
    assert found.meta["makespan"] < min(named_fitting(4, 8, costs, 8).values()) - 1e-9
    assert found.meta["found_by"].startswith("list")


def test_the_docstring_draws_what_the_search_finds():
    lines = [line.strip() for line in pl.search_schedule.__doc__.splitlines() if line.strip().startswith("device ")]
    drawn = [line.split("|", 1)[1].split() for line in lines]
    found = pl.search_schedule(4, 8, pl.Costs(forward=1.0, backward=1.0, weight=1.0), memory_limit=8)
    width = len(found.grid()[0])
    assert found.grid() == [row + ["."] * (width - len(row)) for row in drawn]  # the drawing leaves off trailing dots


@pytest.mark.parametrize("p, m", [(4, 8), (4, 12), (6, 12)])
def test_unit_costs_and_room_for_2p_reach_zb_h2s_zero_bubble(p, m):
    found = pl.search_schedule(p, m, pl.Costs(forward=1.0, backward=1.0, weight=1.0), memory_limit=2 * p)
    assert found.meta["makespan"] == pytest.approx((p - 1) + 3 * m)  # the lower bound: (p-1) t_F + m (t_F+t_B+t_W)
    assert found.meta["idle_inside"] == [0.0] * p  # every device busy from its first action to its last
    assert max(found.meta["peak_memory"]) <= 2 * p


def linear_extensions(actions):
    """Every order of `actions` in which each micro-batch's F comes before its I (or B), and I before W."""
    rank = {Kind.F: 0, Kind.I: 1, Kind.B: 1, Kind.W: 2}
    for order in itertools.permutations(actions):
        seen = {}
        if all(seen.setdefault(a.microbatch, -1) < rank[a.kind] and not seen.update({a.microbatch: rank[a.kind]})
               for a in order):
            yield list(order)


@pytest.mark.parametrize("costs, limit", [(pl.Costs(forward=1.0, backward=2.0, weight=1.0, latency=0.5), None),
                                          (pl.Costs(forward=1.0, backward=1.0, weight=1.5), 1),
                                          (pl.Costs(forward=2.0, backward=1.0, latency=0.3), None)])
def test_the_exact_search_equals_a_brute_force_over_every_pair_of_orders(costs, limit):
    p, m = 2, 2
    kinds = "FIW" if costs.weight else "FB"
    best = float("inf")
    memory = pl.Costs(**{**vars(costs), "memory_bytes": 1})
    for rows in itertools.product(*(linear_extensions([Action(k, s, i) for k in kinds for i in range(m)])
                                    for s in range(p))):
        schedule = pl.Schedule(p, m, [list(r) for r in rows])
        try:
            schedules.validate(schedule)
        except pl.ScheduleError:
            continue
        trace = pl.simulate(schedule, memory)
        if limit is None or max(trace.peak_memory) <= limit:
            best = min(best, trace.makespan)
    found = pl.search_schedule(p, m, costs, memory_limit=limit, exact=True)
    assert found.meta["optimal"] is True
    assert found.meta["makespan"] == pytest.approx(best)


def test_the_exact_search_is_never_worse_than_the_heuristic_and_says_when_it_stopped_early():
    costs = pl.Costs(forward=1.0, backward=2.0, weight=0.5, latency=0.3)
    heuristic = pl.search_schedule(2, 3, costs, memory_limit=2, exact=False)
    exact = pl.search_schedule(2, 3, costs, memory_limit=2, exact=True)
    assert exact.meta["optimal"] and exact.meta["makespan"] <= heuristic.meta["makespan"] + 1e-9
    assert not heuristic.meta["optimal"]
    cut = pl.search_schedule(3, 3, costs, exact=True, max_nodes=50)
    assert cut.meta["optimal"] is False and schedules.validate(cut)


def test_weight_memory_bytes_let_more_micro_batches_in():
    costs = pl.Costs(forward=1.0, backward=1.0, weight=1.0, memory_bytes=10.0, weight_memory_bytes=4.0)
    found = pl.search_schedule(4, 8, costs, memory_limit=40)
    assert max(pl.simulate(found, costs).peak_memory) <= 40
    assert found.meta["makespan"] <= pl.search_schedule(4, 8, pl.Costs(forward=1.0, backward=1.0, weight=1.0),
                                                        memory_limit=4).meta["makespan"]


def test_chunks_give_an_interleaved_layout_at_least_as_good_as_interleaved_1f1b():
    costs = pl.Costs(forward=2.0, backward=3.0, weight=1.0, memory_bytes=2)
    found = pl.search_schedule(4, 4, costs, memory_limit=16, n_chunks=(1, 2))
    assert found.n_stages == 8 and found.n_devices == 4 and found.meta["found_by"].endswith("(v=2)")
    for device, row in enumerate(found.actions):
        assert {a.stage % 4 for a in row} == {device}
    chunk = pl.Costs(forward=1.0, backward=2.0, memory_bytes=1)  # a chunk: half a stage, whole backward B
    assert found.meta["makespan"] < pl.simulate(schedules.interleaved_1f1b(4, 4, 2), chunk).makespan
    assert pl.simulate(found, found.meta["costs"]).makespan == pytest.approx(found.meta["makespan"])


def test_eight_stages_thirty_two_microbatches_take_under_two_seconds():
    costs = pl.Costs(forward=1.0, backward=2.0, weight=1.0, latency=0.1)
    began = time.perf_counter()
    found = pl.search_schedule(8, 32, costs, memory_limit=16)
    assert time.perf_counter() - began < 2.0 * 3  # 2 s on an idle core (benchmarks/schedule_search.py); 3x for a busy CI
    schedules.validate(found)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="below what stage 0 keeps for one micro-batch"):
        pl.search_schedule(2, 2, pl.Costs(memory_bytes=10), memory_limit=5)
    for bad in (0, -1, True, "4"):
        with pytest.raises(ValueError, match="memory_limit must be a positive number"):
            pl.search_schedule(2, 2, memory_limit=bad)
    with pytest.raises(TypeError, match="pl.Costs"):
        pl.search_schedule(2, 2, {"forward": 1})
    with pytest.raises(ValueError, match="weight_memory_bytes needs Costs.memory_bytes"):
        pl.search_schedule(2, 2, pl.Costs(weight=1.0, weight_memory_bytes=1.0))
    with pytest.raises(ValueError, match="n_stages must be at least 1"):
        pl.search_schedule(0, 2)
    with pytest.raises(TypeError, match="n_microbatches must be an int"):
        pl.search_schedule(2, 2.0)


# -- the engines run what the search found --------------------------------------------------------------


def assert_local_step_matches(model, schedule, where):
    loss_fn = pl.models.default_loss(model)
    x, y = pl.models.sample_batch(model, BATCH, seed=2)
    _, reference = pl.single_device_gradients(model, x, y, loss_fn)
    pipe = pl.Pipeline(model, n_stages=schedule.n_stages, n_microbatches=schedule.n_microbatches,
                       schedule=schedule, loss_fn=loss_fn, devices="cpu")
    pipe.step(x, y)
    assert pl.max_gradient_difference(model, reference) < 1e-5, where


@pytest.mark.parametrize("p, m, costs, limit, chunks", [
    (2, 3, pl.Costs(forward=1.0, backward=2.0, weight=1.0, latency=0.3), 2, 1),
    (3, 5, pl.Costs(forward=1.0, backward=1.0, weight=1.0), 6, 1),
    (4, 6, pl.Costs(forward=1.0, backward=2.0), 4, 1),
    (2, 4, pl.Costs(forward=2.0, backward=3.0, weight=1.0), None, (1, 2)),
])
def test_the_local_engine_runs_a_found_schedule_with_the_single_device_gradients(p, m, costs, limit, chunks):
    found = pl.search_schedule(p, m, costs, memory_limit=limit, n_chunks=chunks)
    model = pl.models.mlp(depth=max(found.n_stages, 3), width=16, seed=1)
    assert_local_step_matches(model, found, f"p={p} m={m} found by {found.meta['found_by']}")


def test_the_distributed_engine_runs_a_found_schedule_on_two_ranks():
    found = pl.search_schedule(2, 4, pl.Costs(forward=1.0, backward=2.0, weight=1.0, latency=0.2), memory_limit=3)
    model = distributed_cases.make_model("mlp")
    x, y = pl.models.sample_batch(model, distributed_cases.BATCH, seed=2)
    _, reference = pl.single_device_gradients(model, x, y, pl.models.default_loss(model))
    per_rank = pl.distributed.launch(distributed_cases.run_cases, 2, [("mlp", found, "never")], timeout_seconds=120)
    grads = {name: grad for rank in per_rank for name, grad in rank[0]["grads"].items()}
    assert set(grads) == set(reference)
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], **TOLERANCE, msg=lambda msg, name=name: f"{name}: {msg}")


def test_pipelab_search_prints_the_found_table_beside_the_named_ones(capsys):
    from pipelab.commands import cli

    assert cli.main(["search", "--stages", "3", "--microbatches", "6", "--memory-limit", "4"]) == 0
    out = capsys.readouterr().out
    assert "device 2 |" in out and "found by" in out and "1f1b" in out and "makespan" in out
    assert cli.main(["search", "--stages", "3", "--microbatches", "6", "--memory-limit", "0"]) == 2
    assert "pipelab search:" in capsys.readouterr().err
