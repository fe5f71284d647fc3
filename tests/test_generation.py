"""Pipelined greedy generation with a key/value cache per lane: the single device's text, and the replay's
closed form."""

import pytest
import torch

import pipelab as pl
from pipelab.model.kv_cache import cached_forward


def model():
    return pl.models.tiny_gpt(n_layers=4, d_model=32, n_heads=4, vocab_size=50, seq_len=24, seed=3).eval()


def greedy_without_cache(gpt, prompts, new_tokens):
    """The independent reference: the whole sequence through the whole model at every step."""
    tokens = prompts
    with torch.no_grad():
        for _ in range(new_tokens):
            tokens = torch.cat([tokens, gpt(tokens)[:, -1:].argmax(dim=-1)], dim=1)
    return tokens


def test_cached_stages_give_the_full_forwards_rows():
    gpt = model()
    ids = torch.randint(0, 50, (3, 12))
    stages = pl.split(gpt, 3).stages
    caches = [{} for _ in stages]

    def run(x, start):
        for cache, stage in zip(caches, stages):
            x = cached_forward(stage, x, cache, start)
        return x

    with torch.no_grad():
        got = torch.cat([run(ids[:, :5], 0)] + [run(ids[:, i:i + 1], i) for i in range(5, 12)], dim=1)
        torch.testing.assert_close(got, gpt(ids), rtol=0, atol=1e-5)
    assert caches[1][0][0].shape == (3, 4, 12, 8)  # keys: batch, heads, tokens seen, head_dim


@pytest.mark.parametrize("p, lanes", [(1, 1), (2, 1), (2, 2), (4, 3), (4, 5)])
def test_generation_gives_the_single_devices_greedy_text(p, lanes):
    gpt = model()
    prompts = torch.randint(0, 50, (5, 6), generator=torch.Generator().manual_seed(p * 10 + lanes))
    pipe = pl.Pipeline(gpt, n_stages=p, n_microbatches=lanes, loss_fn=pl.models.default_loss(gpt), devices="cpu")
    result = pipe.generate(prompts, new_tokens=8)
    assert torch.equal(result.tokens, greedy_without_cache(gpt, prompts, 8))
    trace = result.trace
    assert len(trace.events) == p * 8 * lanes and trace.n_microbatches == 8 * lanes
    end = {(e.stage, e.microbatch): e.end for e in trace.events}
    for e in trace.events:  # stage 0 waits for the lane's previous token from the last stage
        if e.stage == 0 and e.microbatch >= lanes:
            assert e.start >= end[p - 1, e.microbatch - lanes]
    assert result.tokens_per_second == pytest.approx(5 * 8 / trace.makespan)


@pytest.mark.parametrize("p, lanes, rounds", [(4, 1, 3), (4, 2, 5), (4, 4, 5), (4, 6, 2), (1, 3, 4)])
def test_equal_stage_times_give_the_closed_form(p, lanes, rounds):
    """Stage time t: a lane comes back to stage 0 after p·t; with m lanes stage 0 has m in a round.  So the
    whole run lasts (rounds · max(m, p) + min(m, p) − 1)·t: m ≥ p keeps every stage busy, fewer lanes leave
    p − m of every p slots idle."""
    t = 0.5
    trace = pl.simulate(pl.schedules.generation(p, lanes, rounds), pl.Costs(forward=t, backward=0.0))
    assert trace.makespan == pytest.approx((rounds * max(lanes, p) + min(lanes, p) - 1) * t)


def test_bad_arguments_are_named():
    gpt = model()
    pipe = pl.Pipeline(gpt, n_stages=2, n_microbatches=2, loss_fn=pl.models.default_loss(gpt), devices="cpu")
    with pytest.raises(TypeError, match="token ids"):
        pipe.generate(torch.randn(2, 3), 4)
    with pytest.raises(ValueError, match="new_tokens"):
        pipe.generate(torch.zeros(2, 3, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="3 lanes need at least 3 prompts"):
        pipe.generate(torch.zeros(2, 3, dtype=torch.long), 4, lanes=3)
    with pytest.raises(ValueError, match="seq_len"):
        pipe.generate(torch.zeros(2, 20, dtype=torch.long), 8)


def test_a_token_outside_the_vocabulary_is_named_before_any_work():
    """As `infer` names it (the embedding's check), not nn.Embedding's bare IndexError from inside a stage."""
    gpt = model()
    pipe = pl.Pipeline(gpt, n_stages=2, n_microbatches=2, loss_fn=pl.models.default_loss(gpt), devices="cpu")
    for wrong, seen in ((50, "1..50"), (-1, "-1..7")):
        prompts = torch.tensor([[1, 2, 3], [4, 5, 7]])
        prompts[1, 0] = wrong
        with pytest.raises(ValueError) as caught:
            pipe.generate(prompts, 4)
        assert str(caught.value) == (f"the prompts' token ids must lie in 0..49 (vocab_size 50), got {seen}: encode "
                                     "them with the model's vocabulary, or build the model with a larger vocab_size")
    with pytest.raises(pl.PipelineError, match=r"ValueError: token ids must lie in 0\.\.49 \(vocab_size 50\), got "
                                               r"4\.\.50: encode them"):  # infer's: micro-batch 1's ids, in E
        pipe.infer(torch.tensor([[1, 2, 3], [4, 5, 50]]))


def generate_on_every_rank(cases):
    """On each rank: for (p-independent) cases (lanes, prompts seed), a DistributedPipeline's generation."""
    found = []
    for lanes, seed in cases:
        gpt = model()
        prompts = torch.randint(0, 50, (5, 6), generator=torch.Generator().manual_seed(seed))
        pipe = pl.DistributedPipeline(gpt, n_microbatches=lanes, loss_fn=pl.models.default_loss(gpt))
        result = pipe.generate(prompts, new_tokens=8)
        found.append((result.tokens, [(e.stage, e.microbatch, e.start, e.end) for e in result.trace.events],
                      result.tokens_per_second))
    try:
        hybrid = pl.DistributedPipeline(model(), n_microbatches=2, loss_fn=pl.models.default_loss(model()),
                                        layout=pl.Layout(dp=torch.distributed.get_world_size()))
        hybrid.generate(torch.zeros(2, 3, dtype=torch.long), 2)
        refused = ""
    except ValueError as error:
        refused = str(error)
    return found, refused


@pytest.mark.parametrize("n_ranks", [2, 3])
def test_generation_on_ranks_gives_the_single_devices_greedy_text(n_ranks):
    """One stage per process: the hidden states go rank to rank, each token from the last rank back to rank 0."""
    cases = [(1, 1), (2, 2), (5, 3)]
    per_rank = pl.distributed.launch(generate_on_every_rank, n_ranks, cases, timeout_seconds=120)
    for c, (lanes, seed) in enumerate(cases):
        prompts = torch.randint(0, 50, (5, 6), generator=torch.Generator().manual_seed(seed))
        expected = greedy_without_cache(model(), prompts, 8)
        for found, _ in per_rank:  # every rank returns the same tokens and the same whole trace
            tokens, events, rate = found[c]
            assert torch.equal(tokens, expected)
            assert events == per_rank[0][0][c][1] and rate > 0
        events = per_rank[0][0][c][1]
        assert sorted((s, i) for s, i, _, _ in events) == sorted(
            (s, i) for s in range(n_ranks) for i in range(8 * lanes))
        end = {(s, i): e for s, i, _, e in events}
        for s, i, start, _ in events:  # each stage after the one before on the same lane and round
            if s > 0:
                assert start >= end[s - 1, i] - 0.05  # each rank's clock starts as it leaves one barrier
    assert all("one stage per rank" in refused for _, refused in per_rank)
