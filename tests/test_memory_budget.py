"""Memory budgets (`pipelab/predict/budget.py`): each part against a count made another way, and the refusal."""

import math
import re

import pytest
import torch
from torch import nn

import pipelab as pl
from pipelab.predict.budget import OPTIMIZER_RULES, check_limit, format_bytes

F32 = 4  # bytes per float32 element


def linear_bytes(fan_in, fan_out, element_bytes=F32):
    return (fan_in * fan_out + fan_out) * element_bytes


@pytest.fixture
def small():
    """mlp(depth=4, width=16, in 8, out 4) cut in two: blocks (0, 1) and (2, 3)."""
    model = pl.models.mlp(depth=4, width=16, seed=0, in_features=8, out_features=4)
    return model, pl.split(model, 2)


def profiled(model, parts, batch=4):
    x, y = torch.randn(batch, model[0][0].in_features), torch.randn(batch, model[-1].out_features)
    return pl.Costs.from_profile(model, parts, (x, y), nn.MSELoss(), repeats=1)


def test_parameters_and_gradients_are_counted_exactly(small):
    model, parts = small
    needs = pl.device_memory(parts, pl.schedules.one_f_one_b(2, 4), optimizer="sgd")
    first = linear_bytes(8, 16) + linear_bytes(16, 16)  # by hand: weights and biases, 4 bytes each
    second = linear_bytes(16, 16) + linear_bytes(16, 4)
    assert [n.parameter_bytes for n in needs] == [first, second]
    assert [n.gradient_bytes for n in needs] == [first, second]
    assert [n.optimizer_bytes for n in needs] == [0, 0]
    assert [n.activation_bytes for n in needs] == [None, None]  # no costs: not predicted
    assert all(type(n.parameter_bytes) is int for n in needs)
    assert sum(n.parameter_bytes for n in needs) == sum(p.numel() * 4 for p in model.parameters())


def test_a_frozen_parameter_has_no_gradient_and_no_optimizer_state(small):
    model, parts = small
    model[0][0].weight.requires_grad_(False)
    need = pl.device_memory(parts, pl.schedules.one_f_one_b(2, 4), optimizer="adam")[0]
    assert need.parameter_bytes == linear_bytes(8, 16) + linear_bytes(16, 16)
    assert need.gradient_bytes == need.parameter_bytes - 8 * 16 * F32
    assert need.optimizer_bytes == 2 * need.gradient_bytes


def test_the_optimizer_rules(small):
    _, parts = small
    schedule = pl.schedules.one_f_one_b(2, 4)
    params = pl.device_memory(parts, schedule, optimizer="sgd")[0].parameter_bytes
    assert pl.device_memory(parts, schedule, optimizer="momentum")[0].optimizer_bytes == params
    assert pl.device_memory(parts, schedule, optimizer="adam")[0].optimizer_bytes == 2 * params  # 8 bytes/param
    sgd_momentum = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # the engines' optimizer(params)
    assert pl.device_memory(parts, schedule, optimizer=sgd_momentum)[0].optimizer_bytes == params
    assert pl.device_memory(parts, schedule, optimizer=torch.optim.SGD)[0].optimizer_bytes == 0
    amsgrad = lambda ps: torch.optim.Adam(ps, amsgrad=True)
    assert pl.device_memory(parts, schedule, optimizer=amsgrad)[0].optimizer_bytes == 3 * params


def test_a_real_adam_after_one_step_holds_what_the_rule_says(small):
    model, parts = small
    schedule = pl.schedules.one_f_one_b(2, 4)
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = pl.device_memory(parts, schedule, optimizer=adam)  # no state yet: Adam's rule
    assert [n.optimizer_bytes for n in before] == [2 * n.parameter_bytes for n in before]
    nn.MSELoss()(model(torch.randn(4, 8)), torch.randn(4, 4)).backward()
    adam.step()
    after = pl.device_memory(parts, schedule, optimizer=adam)
    rule = pl.device_memory(parts, schedule, optimizer="adam")
    for need, by_rule, stage in zip(after, rule, parts.stages):
        states = [adam.state[p] for p in stage.parameters()]
        # independently: the bytes of the storages the optimizer really holds
        held = sum(t.untyped_storage().nbytes() for state in states for t in state.values())
        moments = sum(state[k].untyped_storage().nbytes() for state in states for k in ("exp_avg", "exp_avg_sq"))
        assert need.optimizer_bytes == held
        assert moments == by_rule.optimizer_bytes == 2 * need.parameter_bytes
        assert held - moments == 4 * len(states)  # one float32 `step` per parameter tensor, outside the rule
        assert need.optimizer_rule == "Adam, measured"


def test_mixed_adam_is_16_bytes_per_parameter_at_16_bits(small):
    model, parts = small
    model.to(torch.bfloat16)
    n_params = [sum(p.numel() for p in stage.parameters()) for stage in parts.stages]
    needs = pl.device_memory(parts, pl.schedules.one_f_one_b(2, 4), optimizer="mixed-adam")
    assert [n.model_state_bytes for n in needs] == [16 * k for k in n_params]  # ZeRO §3.1: 2 + 2 + 12
    assert [(n.parameter_bytes, n.gradient_bytes, n.optimizer_bytes) for n in needs] == [
        (2 * k, 2 * k, 12 * k) for k in n_params]
    model.to(torch.float32)  # fp32 parameters: the same 12 bytes of state on top of 4 + 4
    assert pl.device_memory(parts, pl.schedules.one_f_one_b(2, 4), optimizer="mixed-adam")[0].model_state_bytes == (
        20 * n_params[0])


def test_activations_are_the_simulators_peak(small):
    model, parts = small
    costs = profiled(model, parts)
    p, m = 2, 6
    found = {}
    for name, schedule in (("gpipe", pl.schedules.gpipe(p, m)), ("1f1b", pl.schedules.one_f_one_b(p, m))):
        for checkpoint in ("never", "always"):
            needs = pl.device_memory(parts, schedule, costs, optimizer="sgd", checkpoint=checkpoint)
            found[name, checkpoint] = [n.activation_bytes for n in needs]
            assert found[name, checkpoint] == pl.simulate(schedule, costs, checkpoint).peak_memory
    assert found["gpipe", "never"][0] == m * costs.memory_bytes[0]  # GPipe keeps all m micro-batches
    assert found["1f1b", "never"][0] == p * costs.memory_bytes[0]  # 1F1B min(p - s, m) on stage s
    for name in ("gpipe", "1f1b"):
        assert all(c <= n for c, n in zip(found[name, "always"], found[name, "never"]))
    # smaller wherever more than one micro-batch is in flight; 1F1B's last stage holds one, and its backward
    # holds the recomputed activations again: input + (memory - input) = memory
    assert all(c < n for c, n in zip(found["gpipe", "always"], found["gpipe", "never"]))
    assert found["1f1b", "always"][0] < found["1f1b", "never"][0]
    assert found["1f1b", "always"][1] == found["1f1b", "never"][1] == costs.memory_bytes[1]
    assert all(g > f for g, f in zip(found["gpipe", "never"], found["1f1b", "never"]))


def test_activations_from_plain_bytes_per_microbatch(small):
    _, parts = small
    needs = pl.device_memory(parts, pl.schedules.gpipe(2, 5), [1000, 3000], optimizer="sgd")
    assert [n.activation_bytes for n in needs] == [5000, 15000]
    with pytest.raises(ValueError, match="input_bytes"):  # checkpointing keeps the inputs: their size is needed
        pl.device_memory(parts, pl.schedules.gpipe(2, 5), 1000, checkpoint="always")
    with pytest.raises(ValueError, match="Costs.memory_bytes"):
        pl.device_memory(parts, pl.schedules.gpipe(2, 5), -1.0)
    with pytest.raises(TypeError, match="activations must be"):
        pl.device_memory(parts, pl.schedules.gpipe(2, 5), "1 MiB")


def test_interleaved_sums_the_stages_of_a_device():
    model = pl.models.mlp(depth=4, width=16, seed=0)
    parts = pl.split(model, 4)
    schedule = pl.schedules.interleaved_1f1b(2, 4, 2)  # device 0: stages 0 and 2, device 1: 1 and 3
    costs = pl.Costs(memory_bytes=[100, 200, 300, 400], input_bytes=10)
    needs = pl.device_memory(parts, schedule, costs, optimizer="adam")
    one_each = [pl.device_memory(parts, pl.schedules.one_f_one_b(4, 4), optimizer="adam")[s] for s in range(4)]
    assert [n.stages for n in needs] == [(0, 2), (1, 3)]
    for need, (a, b) in zip(needs, [(0, 2), (1, 3)]):
        for part in ("parameter_bytes", "gradient_bytes", "optimizer_bytes"):
            assert getattr(need, part) == getattr(one_each[a], part) + getattr(one_each[b], part)
    assert [n.activation_bytes for n in needs] == pl.simulate(schedule, costs).peak_memory
    assert needs[0].who == "device 0 (stages 0 and 2)"


def test_a_tensor_two_stages_of_one_device_share_counts_once():
    shared, other = nn.Linear(8, 8), nn.Linear(8, 8)
    parts = pl.split(nn.Sequential(shared, other, shared, nn.Linear(8, 8)), 4)
    needs = pl.device_memory(parts, pl.schedules.interleaved_1f1b(2, 2, 2), optimizer="sgd")
    assert needs[0].parameter_bytes == linear_bytes(8, 8)  # stages 0 and 2 hold the same Linear
    assert needs[1].parameter_bytes == 2 * linear_bytes(8, 8)


def test_a_budget_that_fits_returns_the_needs(small):
    model, parts = small
    costs = profiled(model, parts)
    schedule = pl.schedules.one_f_one_b(2, 4)
    needs = pl.device_memory(parts, schedule, costs)
    assert pl.check_memory_budget(parts, schedule, max(n.total_bytes for n in needs), costs) == needs
    assert pl.check_memory_budget(parts, schedule, [n.total_bytes for n in needs], costs) == needs


def test_the_refusal_names_every_part_the_limit_and_what_to_try(small):
    model, parts = small
    costs = profiled(model, parts, batch=4096)  # activations dominate
    schedule = pl.schedules.gpipe(2, 8)
    needs = pl.device_memory(parts, schedule, costs)
    limit = 0.8 * needs[0].total_bytes
    with pytest.raises(pl.MemoryBudgetError) as caught:
        pl.check_memory_budget(parts, schedule, limit, costs)
    message = str(caught.value)
    assert isinstance(caught.value, ValueError) and caught.value.needs == needs
    worst = max(needs, key=lambda n: n.total_bytes)
    assert message.startswith(f"stage {worst.device} needs {format_bytes(worst.total_bytes)} (")
    for part in ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "activation_bytes"):
        assert format_bytes(getattr(worst, part)) in message
    assert re.search(r"\(parameters .+, gradients .+, optimizer .+ \(adam\), activations .+\), the limit is "
                     + re.escape(format_bytes(limit)) + "; try: ", message)
    tips = message.split("; try: ")[1]
    assert tips.index("checkpointing") < tips.index("1F1B instead of GPipe") < tips.index("more stages")
    assert "MiB" in message or "KiB" in message


def test_when_parameters_dominate_more_stages_comes_first(small):
    _, parts = small
    schedule = pl.schedules.one_f_one_b(2, 4)
    with pytest.raises(pl.MemoryBudgetError, match=r"; try: more stages .*checkpointing") as caught:
        pl.check_memory_budget(parts, schedule, 1024, pl.Costs(memory_bytes=8, input_bytes=4))
    assert "over the limit too: stage" in str(caught.value)  # both stages are over 1 KiB
    with pytest.raises(pl.MemoryBudgetError, match=r"activations not predicted .*; try: more stages"):
        pl.check_memory_budget(parts, schedule, 1024)  # no costs: the model states alone are too much


def test_pipedream_counts_its_stashed_weight_versions(small):
    _, parts = small
    schedule = pl.schedules.pipedream_async(2, 8)
    needs = pl.device_memory(parts, schedule, optimizer="sgd")
    versions = pl.pipedream.versions_in_flight(schedule)
    assert [n.stashed_weight_bytes for n in needs] == [(v - 1) * n.parameter_bytes for v, n in zip(versions, needs)]
    assert needs[0].stashed_weight_bytes > 0 and "stashed weights" in str(needs[0])


def test_a_forward_only_schedule_needs_no_gradients_or_optimizer_state(small):
    _, parts = small
    needs = pl.device_memory(parts, pl.schedules.inference(2, 4), [100, 100], optimizer="adam")
    assert [(n.gradient_bytes, n.optimizer_bytes, n.activation_bytes) for n in needs] == [(0, 0, 0)] * 2


@pytest.mark.parametrize("limit, error, words", [
    (0, ValueError, "positive"), (-5, ValueError, "positive"), (math.nan, ValueError, "finite"),
    (math.inf, ValueError, "None: no limit"), (True, TypeError, "number of bytes"),
    ("16GiB", TypeError, r"16 \* 2\*\*30"), (None, TypeError, "NoneType"), ([1e9], ValueError, "1 values for 2"),
    ([1e9, -1], ValueError, "of device 1"), ([1e9, "x"], TypeError, "of device 1"),
])
def test_bad_limits_are_refused_clearly(small, limit, error, words):
    _, parts = small
    with pytest.raises(error, match=words):
        pl.check_memory_budget(parts, pl.schedules.one_f_one_b(2, 4), limit)


def test_bad_arguments_are_refused_clearly(small):
    _, parts = small
    schedule = pl.schedules.one_f_one_b(2, 4)
    with pytest.raises(ValueError, match="unknown optimizer rule 'adamm'.*mixed-adam"):
        pl.device_memory(parts, schedule, optimizer="adamm")
    with pytest.raises(TypeError, match="no rule for LBFGS"):
        pl.device_memory(parts, schedule, optimizer=torch.optim.LBFGS)
    with pytest.raises(TypeError, match="optimizer must be"):
        pl.device_memory(parts, schedule, optimizer=3)
    with pytest.raises(ValueError, match="the partition has 2 stages, the schedule 4"):
        pl.device_memory(parts, pl.schedules.one_f_one_b(4, 4))
    with pytest.raises(TypeError, match="pl.Schedule"):
        pl.check_memory_budget(parts, "1f1b", 1e9)
    assert check_limit(2**30, 3) == [2.0**30] * 3 and set(OPTIMIZER_RULES) >= {"sgd", "momentum", "adam", "mixed-adam"}


def test_format_bytes():
    assert [format_bytes(n) for n in (0, 1023, 1024, 1536, 3 * 2**20, 2**31, 2**40)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 KiB", "3.0 MiB", "2.0 GiB", "1.0 TiB"]


def test_stages_freed_to_meta_count_the_same(small):
    """The distributed engine keeps only its own stages and leaves the others' tensors on "meta": shapes and
    dtypes stay, so every rank computes the same needs (and refuses alike)."""
    _, parts = small
    schedule = pl.schedules.one_f_one_b(2, 4)
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-3)  # what the engines take as optimizer=
    before = pl.device_memory(parts, schedule, [100, 100], optimizer=adam)
    parts.stages[1].to("meta")
    assert pl.device_memory(parts, schedule, [100, 100], optimizer=adam) == before


@pytest.mark.parametrize("schedule, reshard", [("1f1b", True), ("1f1b", False), ("zb-h1", True)])
def test_a_sharded_stage_holds_its_shards_what_it_gathers_and_the_whole_gradient(schedule, reshard):
    """shard="fsdp" over d = 2: by hand for stage 0 of mlp(depth=8, width=16) (4 blocks of 16·16 + 16 floats,
    B = 1088 bytes each, P = 4B, a rank's shard P/2): parameters P/2 + the two blocks gathered (computing and
    prefetched), or the whole stage kept gathered or under a split backward (W runs with it gathered);
    gradients the whole accumulated P + the reduce-scatter's P/2; AdamW's two moments of the shard, P."""
    model = pl.models.mlp(depth=8, width=16, seed=1)
    block = linear_bytes(16, 16)
    whole, shard = 4 * block, 2 * block
    sched = pl.schedules.by_name(schedule, n_stages=2, n_microbatches=4)
    sharded = pl.device_memory(pl.split(model, 2), sched, optimizer="adamw", sharded_over=2,
                               reshard_after_forward=reshard)[0]
    gathered = 2 * block if reshard and schedule == "1f1b" else whole
    assert (sharded.parameter_bytes, sharded.gradient_bytes, sharded.optimizer_bytes) == (
        shard + gathered, whole + shard, 2 * shard)
    plain = pl.device_memory(pl.split(model, 2), sched, optimizer="adamw")[0]
    assert (plain.parameter_bytes, plain.gradient_bytes, plain.optimizer_bytes) == (whole, whole, 2 * whole)
