"""`pl.plan(..., sharding=(0, 1, 2, 3))`: ZeRO's stages beside dp, pp and tp (pipelab/predict/sharding.py).

A model too big for one device is placed by sharding (ZeRO-3 over dp) or by pipelining, whichever the prediction
says is faster: one case each, with the reason the rows give (bubble seconds against gather seconds).  The
expected seconds and bytes are ZeRO's closed forms written out here (Rajbhandari et al. 2020, §7.1, §7.2.2),
and the memory is checked against `fsdp_formulas.state_bytes_per_rank` on a real small model (a consistency
check: both follow ZeRO's Figure 1, and the planner adds what a pipeline holds during the step).
"""

from __future__ import annotations

import math

import pytest
import torch

import pipelab as pl
from pipelab.course import capstone, sharding_lesson
from pipelab.predict.fsdp_formulas import state_bytes_per_rank

# four equal blocks: 0.01 s forward, 0.02 s backward per micro-batch of one sample; 10^8 fp32 parameters each
# (4 + 4 bytes + fp32 Adam's 8 a parameter: 6.4 GB of model state in all, too big for a 4 GB device)
BLOCK_PARAMETERS, FORWARD, BACKWARD = 10**8, 0.01, 0.02
MODEL = pl.ProfiledModel(micro_batch_size=1, forward=(FORWARD,) * 4, backward=(BACKWARD,) * 4,
                         kept_bytes=(1e6,) * 4, output_bytes=(1e3,) * 4, input_bytes=1e3,
                         parameters=(BLOCK_PARAMETERS,) * 4, bytes_per_value=4)
LIMIT = 4e9
FAST, SLOW = (5e-6, 300e9), (10e-6, 10e9)  # (latency s, bytes/s): inside a node, a slow network between nodes


def planned(devices_per_node: int, global_batch: int, link) -> pl.Plan:
    return pl.plan(MODEL, n_devices=4, devices_per_node=devices_per_node, memory_bytes=LIMIT,
                   global_batch=global_batch, inside=link, between=link, sharding=(0, 1, 2, 3))


def zero3_alone(found: pl.Plan) -> pl.PlanRow:
    return next(r for r in found.rows if r.layout.shape == (4, 1, 1) and r.zero == 3)


def gather_seconds_by_hand(d: int, parameters: int, n_blocks: int, link) -> float:
    """One all-gather of each of n blocks of `parameters` fp32 values in all over a ring of d: each rank receives
    the other d − 1 shards, (d−1)/d·4Ψ bytes, in d − 1 steps of one latency per block (ZeRO §7.2.2)."""
    latency, bandwidth = link
    return (d - 1) / d * 4 * parameters / bandwidth + n_blocks * (d - 1) * latency


def test_too_big_for_one_device_and_for_zero_1_on_four():
    found = planned(4, 4, FAST)
    over = {(r.layout.shape, r.zero) for r in found.over_limit}
    fits = {(r.layout.shape, r.zero) for r in found.rows}
    assert 16 * 4 * BLOCK_PARAMETERS > LIMIT
    # ZeRO-1 and -2 on dp = 4 keep whole parameters and gradients (8 bytes a parameter: 3.2 GB) + 8/4: over
    assert {((4, 1, 1), 0), ((4, 1, 1), 1), ((4, 1, 1), 2)} <= over
    assert ((4, 1, 1), 3) in fits and ((1, 4, 1), 0) in fits


def test_fast_link_few_microbatches_sharding_wins_because_the_bubble_costs_more_than_the_gathers():
    found = planned(4, 4, FAST)  # one node: every group on the fast link; B = 4: m = 1 on dp = 4, m = 2 on dp = 2
    best, pipelined = found.best, next(r for r in found.rows if r.layout.pp > 1)
    assert (best.layout.shape, best.zero) == ((4, 1, 1), 3)
    assert best.step_seconds < pipelined.step_seconds
    # the same compute a device (m·(T_F + T_B)): the difference is the pipeline's idle time against FSDP's traffic
    assert best.seconds["compute"] == pytest.approx(pipelined.seconds["compute"])
    assert pipelined.seconds["bubble"] > best.seconds["dp_gather"] + best.seconds["dp"]
    assert best.seconds["bubble"] == 0


def test_slow_link_many_microbatches_pipelining_wins_because_the_gathers_cost_more_than_the_bubble():
    found = planned(1, 32, SLOW)  # one device a node: every group crosses the slow network; m = 8 to 32
    best, sharded = found.best, zero3_alone(found)
    assert best.layout.pp > 1 and best.step_seconds < sharded.step_seconds
    assert sharded.seconds["dp_gather"] > best.seconds["bubble"] + best.seconds["pp"] + best.seconds["dp"]
    assert sharded.seconds["dp_gather"] > 10 * best.seconds["bubble"]


@pytest.mark.parametrize(("devices_per_node", "global_batch", "link"), [(4, 4, FAST), (1, 32, SLOW)])
def test_zero3_row_against_zero_3_written_out(devices_per_node, global_batch, link):
    """dp = 4, pp = 1, all four blocks on the device, m = B/4, GPipe/1F1B: k = 2 gathers a micro-batch (F, B)."""
    row = zero3_alone(planned(devices_per_node, global_batch, link))
    d, m, psi = 4, global_batch // 4, 4 * BLOCK_PARAMETERS
    g = gather_seconds_by_hand(d, psi, 4, link)
    assert row.n_microbatches == m and row.schedule in ("gpipe", "1f1b")
    assert row.bytes_per_kind["dp_gather"] == pytest.approx(2 * m * (d - 1) / d * 4 * psi, rel=1e-12)
    assert row.bytes_per_kind["dp"] == pytest.approx((d - 1) / d * 4 * psi, rel=1e-12)  # the reduce-scatter
    assert row.seconds["dp_gather"] == pytest.approx(2 * m * g, rel=1e-12)
    again = 4 * FORWARD if row.recompute == "full" else 0.0
    assert row.step_seconds == pytest.approx(m * (4 * FORWARD + 4 * BACKWARD + again + 2 * g) + g, rel=1e-12)
    # ZeRO §7.2.2: (2m + 1)·Ψ of traffic against data parallelism's 2Ψ
    plain = 2 * (d - 1) / d * 4 * psi
    assert (row.bytes_per_kind["dp_gather"] + row.bytes_per_kind["dp"]) / plain == pytest.approx((2 * m + 1) / 2)


def test_zero3_gathers_of_a_transformer_stage_written_out():
    """ZB-H1 gathers before F, I and W (k = 3) the last stage's ⌈L/p⌉ layers of 12h² + 13h and the tied output
    layer V·h + 2h (SC21 eq. 2's terms), at 2 bytes, over d = 2."""
    L, h, V, s = 8, 512, 1000, 128
    spec = pl.TransformerSpec(layers=L, hidden=h, heads=8, seq=s, vocab=V)
    found = pl.plan(spec, 4, 4, 1e12, 16, inside=(5e-6, 100e9), between=(5e-6, 100e9), peak_flops_per_second=1e14,
                    micro_batch_sizes=(2,), schedules=("zb-h1",), recompute=("none",), sharding=(3,))
    row = next(r for r in found.rows if r.layout.shape == (2, 2, 1))
    d, m, last_stage = 2, 4, math.ceil(L / 2) * (12 * h * h + 13 * h) + V * h + 2 * h
    assert row.zero == 3 and row.n_microbatches == m
    assert row.bytes_per_kind["dp_gather"] == pytest.approx(3 * m * (d - 1) / d * 2 * last_stage, rel=1e-12)
    g = (d - 1) / d * 2 * last_stage / 100e9 + (L // 2 + 1) * (d - 1) * 5e-6
    assert row.seconds["dp_gather"] == pytest.approx(3 * m * g, rel=1e-12)


def test_zero_1_and_2_move_an_all_reduces_bytes_and_shard_only_the_optimizer_during_the_step():
    """ZeRO §7.1: reduce-scatter + all-gather = the all-reduce's 2(d−1)/d·Ψ; in a pipeline the gradients
    accumulate whole until the step's reduce-scatter, so ZeRO-2 holds what ZeRO-1 holds."""
    found = pl.plan(MODEL, 4, 4, 1e12, 8, inside=FAST, between=FAST, sharding=(0, 1, 2, 3))
    key = lambda r: (r.layout, r.schedule, r.chunks, r.recompute, r.micro_batch_size)
    by_zero = {z: {key(r): r for r in found.rows if r.zero == z} for z in range(4)}
    assert by_zero[1].keys() == by_zero[2].keys() == by_zero[3].keys() and by_zero[1]
    for k, plain in by_zero[0].items():
        if k[0].dp == 1:
            assert k not in by_zero[1]  # dp = 1: sharding is no sharding, one row
            continue
        for z in (1, 2):
            row = by_zero[z][k]
            assert row.step_seconds == plain.step_seconds and row.bytes_per_kind == plain.bytes_per_kind
            assert row.memory.optimizer == pytest.approx(plain.memory.optimizer / k[0].dp)
            assert (row.memory.parameters, row.memory.gradients) == (plain.memory.parameters, plain.memory.gradients)


def test_zero_memory_is_consistent_with_fsdp_formulas_on_a_real_model():
    """Consistency check, not an independent one: the planner's model states of dp = 4 on a measured MLP against
    `state_bytes_per_rank` (ZeRO's Figure 1 between steps, FSDP2's padding: none at width 64 over 4).  During
    the step the gradients are whole, and ZeRO-3 holds one block gathered besides its shard."""
    torch.manual_seed(0)
    model = pl.models.mlp(depth=4, width=64)
    x, y = torch.randn(2, 64), torch.randn(2, 64)
    profile = pl.ProfiledModel.measure(model, (x, y), torch.nn.MSELoss(), repeats=1)
    found = pl.plan(profile, 4, 4, 1e12, 8, inside=FAST, between=FAST, schedules=("1f1b",), recompute=("none",),
                    sharding=(0, 1, 2, 3))
    blocks = list(model)
    block_bytes = max(sum(q.numel() * 4 for q in b.parameters()) for b in blocks)
    whole = state_bytes_per_rank(blocks, 4, 0)
    for zero in range(4):
        row = next(r for r in found.rows if r.layout.shape == (4, 1, 1) and r.zero == zero)
        between_steps = state_bytes_per_rank(blocks, 4, zero)
        assert row.memory.optimizer == between_steps["optimizer"]
        assert row.memory.parameters == between_steps["parameters"] + (block_bytes if zero == 3 else 0)
        assert row.memory.gradients == whole["gradients"]
        if zero >= 2:
            assert row.memory.gradients == 4 * between_steps["gradients"]  # ZeRO-2's saving waits for the step's end


def test_the_default_plans_no_sharding_and_the_settings_say_which():
    kwargs = dict(inside=FAST, between=FAST)
    default = pl.plan(MODEL, 4, 4, LIMIT, 8, **kwargs)
    explicit = pl.plan(MODEL, 4, 4, LIMIT, 8, sharding=(0,), **kwargs)
    assert {r.zero for r in default.rows + default.over_limit} == {0}
    assert default.settings["sharding"] == (0,) and planned(4, 8, FAST).settings["sharding"] == (0, 1, 2, 3)
    assert [r.step_seconds for r in default.rows] == [r.step_seconds for r in explicit.rows]
    table = planned(4, 4, FAST).table(3)
    assert " zero " in table.splitlines()[1] and table.splitlines()[2].split()[:5] == ["1", "4", "1", "1", "3"]


@pytest.mark.parametrize("bad", [(4,), (0, -1), 3, (), ("zero3",), (True,)])
def test_a_bad_sharding_is_refused_naming_zero_stages(bad):
    with pytest.raises(ValueError, match="ZeRO"):
        pl.plan(MODEL, 4, 4, LIMIT, 8, inside=FAST, between=FAST, sharding=bad)


def test_a_state_bound_row_suggests_zero_3():
    row = next(r for r in planned(4, 4, FAST).over_limit if r.layout.shape == (4, 1, 1) and r.zero == 1)
    assert "ZeRO-3 over the dp=4 replicas" in row.reason


def test_the_timeline_of_a_zero3_row_is_its_step():
    """capstone.row_timeline charges ZeRO-3's gathers to each action: simulated + the reduce-scatter = the row."""
    spec, found = sharding_lesson.plan_placements(400)
    rows = [r for r in found.rows + found.over_limit if r.zero == 3]
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1"):
        row = next(r for r in rows if r.schedule == name and r.layout.pp > 1)
        trace = pl.simulate(*capstone.row_timeline(spec, row))
        assert trace.makespan + row.seconds["dp"] == pytest.approx(row.step_seconds, rel=1e-9), row


def test_the_lessons_two_cases():
    """Lesson 14: on a fast link ZeRO-3 beats pipelining (its bubble costs more than the gathers); on a slow one
    pipelining wins (the gathers cost more than the bubble); plain data parallelism fits neither."""
    fast = sharding_lesson.best_by_placement(sharding_lesson.plan_placements(400)[1])
    slow = sharding_lesson.best_by_placement(sharding_lesson.plan_placements(25)[1])
    assert fast["ZeRO-0"] is None and slow["ZeRO-0"] is None
    assert fast["ZeRO-3"].step_seconds < fast["pipelining"].step_seconds
    assert fast["pipelining"].seconds["bubble"] > fast["ZeRO-3"].seconds["dp_gather"]
    assert slow["pipelining"].step_seconds < slow["ZeRO-3"].step_seconds
    assert slow["ZeRO-3"].seconds["dp_gather"] > slow["pipelining"].seconds["bubble"]
    assert "nothing of it fits" in sharding_lesson.placement_table(sharding_lesson.plan_placements(25)[1])


def test_pipelab_plan_tries_every_zero_stage_unless_told(capsys):
    from pipelab.commands import cli

    args = ["plan", "--layers", "24", "--hidden", "2048", "--heads", "16", "--devices", "8", "--memory-gib", "40",
            "--batch", "8", "--rows", "3"]
    assert cli.main(args) == 0
    first = capsys.readouterr().out.splitlines()[3].split()
    assert first[4] == "1"  # ZeRO-1 on the best row: whole model states do not beat it here
    assert cli.main(args + ["--sharding", "0"]) == 0
    assert {line.split()[4] for line in capsys.readouterr().out.splitlines()[3:6]} == {"0"}
    with pytest.raises(SystemExit) as exit_:
        cli.main(args + ["--sharding", "0,4"])
    assert exit_.value.code == 2 and "ZeRO stages 0..3" in capsys.readouterr().err
