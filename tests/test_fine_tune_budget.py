"""Fine-tuning past one device: `memory_limit_bytes` refuses a plan that does not fit (before the first step, each
part named) and holds every step to it; a model over one device's budget trains on 4 stages with checkpointing,
its losses those of plain single-device training without a limit."""

import pytest
import torch

import pipelab as pl

LIMIT = 2**20  # 1 MiB a device
STEPS = 3


def setting():
    model = pl.models.mlp(depth=8, width=128, seed=0)
    x, y = pl.models.sample_batch(model, 512)
    return model, x, y


def pipeline(model, p, checkpoint="never", limit=LIMIT):
    return pl.Pipeline(model, n_stages=p, n_microbatches=8, schedule="gpipe", loss_fn=torch.nn.MSELoss(),
                       devices="cpu", checkpoint=checkpoint, memory_limit_bytes=limit, memory_optimizer="sgd")


def test_over_budget_plans_are_refused_with_every_part_named():
    model, x, y = setting()
    with pytest.raises(pl.MemoryBudgetError) as one_device:
        pipeline(model, 1).step(x, y)
    message = str(one_device.value)
    for part in ("stage 0 needs", "parameters 516.0 KiB", "gradients 516.0 KiB", "optimizer 0 B (sgd)", "activations",
                 "the limit is 1.0 MiB", "more stages"):
        assert part in message, (part, message)
    with pytest.raises(pl.MemoryBudgetError, match=r"try: checkpointing"):  # 4 stages: activations dominate
        pipeline(model, 4).step(x, y)
    assert all(p.grad is None for p in model.parameters())  # refused before anything ran


def test_a_model_over_one_devices_budget_fine_tunes_on_four_with_checkpointing():
    model, x, y = setting()
    reference = pl.models.mlp(depth=8, width=128, seed=0)  # the same weights, one device, no limit
    plain_sgd = torch.optim.SGD(reference.parameters(), lr=0.05)
    pipe = pipeline(model, 4, checkpoint="always")
    sgd = torch.optim.SGD(pipe.parameters(), lr=0.05)
    for _ in range(STEPS):
        result = pipe.step(x, y)
        sgd.step()
        sgd.zero_grad(set_to_none=True)
        expected = torch.nn.MSELoss()(reference(x), y)
        expected.backward()
        plain_sgd.step()
        plain_sgd.zero_grad(set_to_none=True)
        assert result.loss == pytest.approx(float(expected.detach()), rel=1e-5)
        model_state = 2 * max(sum(p.numel() * 4 for p in stage.parameters()) for stage in pipe.partition.stages)
        assert max(result.trace.peak_memory_observed) + model_state <= LIMIT  # held to the limit, observed
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


def test_a_step_that_overruns_its_limit_stops_in_the_action_that_overran():
    """The prediction counts saved activations only; messages waiting take room too.  A limit at the predicted
    need passes the check before the step and is overrun during it: the step stops there, naming the action."""
    model, x, y = setting()
    pipe = pipeline(model, 4, checkpoint="always")
    costs = pl.Costs.from_profile(model, pipe.partition, (x[:64], y[:64]), torch.nn.MSELoss(), repeats=1)
    needs = pl.device_memory(pipe.partition, pipe.schedule, costs, "sgd", "always")
    tight = pipeline(model, 4, checkpoint="always", limit=[n.total_bytes for n in needs])
    with pytest.raises(pl.PipelineError, match=r"failed on stage \d.*MemoryBudgetError.*activations and messages"):
        tight.step(x, y)


def test_bad_limits_are_named():
    model, _, _ = setting()
    with pytest.raises(ValueError, match="positive, finite"):
        pipeline(model, 2, limit=0)
    with pytest.raises(ValueError, match="2 devices"):
        pipeline(model, 2, limit=[LIMIT])


def ranks_with_limit(limit: float) -> float:
    model, x, y = setting()
    pipe = pl.DistributedPipeline(model, n_microbatches=8, schedule="gpipe", loss_fn=torch.nn.MSELoss(),
                                  checkpoint="always", memory_limit_bytes=limit, memory_optimizer="sgd")
    return pipe.step(x, y).loss


def test_ranks_are_held_to_their_limit_too():
    model, x, y = setting()
    with pytest.raises(pl.DistributedError, match=r"needs .*parameters .*the limit is 256.0 KiB"):
        pl.distributed.launch(ranks_with_limit, 2, 2**18, timeout_seconds=60)
    losses = pl.distributed.launch(ranks_with_limit, 2, 4 * LIMIT, timeout_seconds=60)
    assert losses[0] == pytest.approx(float(torch.nn.MSELoss()(model(x), y).detach()), rel=1e-5)
