"""`pipelab.model.models`: the reference models are deterministic, BatchNorm-free, shaped as documented."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pipelab import models

SMALL_GPT = dict(n_layers=2, d_model=16, n_heads=2, vocab_size=13, seq_len=7)


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def same(a, b):
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("build", [
    lambda seed: models.mlp(depth=3, width=8, seed=seed),
    lambda seed: models.tiny_gpt(seed=seed, **SMALL_GPT),
], ids=["mlp", "tiny_gpt"])
def test_deterministic_from_seed(build):
    torch.manual_seed(123)  # the global RNG state before the call must not matter
    a = params(build(0))
    torch.rand(100)
    b = params(build(0))
    c = params(build(1))
    assert same(a, b)
    assert not same(a, c)


def test_mlp_blocks_and_shapes():
    model = models.mlp(depth=4, width=12, seed=0)
    assert isinstance(model, nn.Sequential) and len(model) == 4
    for block in model[:-1]:
        assert isinstance(block, nn.Sequential)
        assert isinstance(block[0], nn.Linear) and isinstance(block[1], nn.GELU)
        assert (block[0].in_features, block[0].out_features) == (12, 12)
    assert isinstance(model[-1], nn.Linear) and (model[-1].in_features, model[-1].out_features) == (12, 12)
    assert model(torch.randn(5, 12)).shape == (5, 12)


def test_mlp_in_and_out_features():
    model = models.mlp(depth=3, width=10, in_features=4, out_features=2)
    assert model[0][0].in_features == 4 and model[0][0].out_features == 10
    assert model[1][0].in_features == 10
    assert model[-1].in_features == 10 and model[-1].out_features == 2
    assert model(torch.randn(3, 4)).shape == (3, 2)
    one = models.mlp(depth=1, width=10, in_features=4, out_features=2)
    assert len(one) == 1 and isinstance(one[0], nn.Linear) and (one[0].in_features, one[0].out_features) == (4, 2)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == (4 * 10 + 10) + (10 * 10 + 10) + (10 * 2 + 2)


def test_tiny_gpt_blocks_and_output_shape():
    for n_layers in (1, 3):
        model = models.tiny_gpt(**{**SMALL_GPT, "n_layers": n_layers})
        assert isinstance(model, nn.Sequential) and len(model) == n_layers + 2
        assert isinstance(model[0], models.Embedding) and isinstance(model[-1], models.LMHead)
        assert all(isinstance(b, models.TransformerBlock) for b in model[1:-1])
        ids = torch.randint(13, (3, 7))
        assert model(ids).shape == (3, 7, 13)
        assert model(ids[:, :4]).shape == (3, 4, 13)  # shorter sequences are fine


@pytest.mark.parametrize("build", [lambda: models.mlp(depth=3, width=8), lambda: models.tiny_gpt(**SMALL_GPT),
                                   models.mlp, models.tiny_gpt], ids=["mlp", "gpt", "mlp-default", "gpt-default"])
def test_no_batch_norm_anywhere(build):
    model = build()
    norms = (nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm, nn.modules.instancenorm._InstanceNorm)
    assert not any(isinstance(m, norms) for m in model.modules())


def test_micro_batches_give_the_full_batch_result():
    # the point of avoiding BatchNorm: a row's output does not depend on the other rows
    for model in (models.mlp(depth=3, width=8), models.tiny_gpt(**SMALL_GPT)):
        model.train()
        x, _ = models.sample_batch(model, 6)
        full = model(x)
        torch.testing.assert_close(torch.cat([model(x[:2]), model(x[2:])]), full, rtol=1e-5, atol=1e-6)


def test_tiny_gpt_is_causal():
    model = models.tiny_gpt(**SMALL_GPT)
    ids = torch.randint(13, (2, 7), generator=torch.Generator().manual_seed(0))
    base = model(ids)
    for t in range(7):
        changed = ids.clone()
        changed[:, t] = (changed[:, t] + 1) % 13
        out = model(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=0)
        assert not torch.allclose(out[:, t], base[:, t])  # the token itself does matter


def test_transformer_block_attention_matches_a_reference():
    torch.manual_seed(0)
    block = models.TransformerBlock(d_model=8, n_heads=2)
    x = torch.randn(2, 5, 8)
    ln = block.ln1(x)
    q, k, v = block.qkv(ln).split(8, dim=-1)
    heads = lambda t: t.view(2, 5, 2, 4).transpose(1, 2)  # noqa: E731
    attn = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
    h = x + block.proj(attn.transpose(1, 2).reshape(2, 5, 8))
    expected = h + block.mlp(block.ln2(h))
    torch.testing.assert_close(block(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs, name", [
    (dict(depth=0), "depth"), (dict(depth=-1), "depth"), (dict(width=0), "width"),
    (dict(depth=2.0), "depth"), (dict(width=True), "width"), (dict(depth="3"), "depth"),
])
def test_mlp_bad_args(kwargs, name):
    with pytest.raises(ValueError, match=rf"{name} must be a positive int"):
        models.mlp(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(in_features=0), dict(in_features=-1), dict(out_features=0),
                                    dict(out_features=2.5)])
def test_mlp_bad_feature_counts(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        models.mlp(depth=2, width=4, **kwargs)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(n_layers=0), "n_layers must be a positive int"),
    (dict(d_model=-4), "d_model must be a positive int"),
    (dict(n_heads=0), "n_heads must be a positive int"),
    (dict(vocab_size=1.5), "vocab_size must be a positive int"),
    (dict(seq_len=False), "seq_len must be a positive int"),
    (dict(d_model=10, n_heads=4), r"d_model \(10\) must be divisible by n_heads \(4\)"),
])
def test_tiny_gpt_bad_args(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        models.tiny_gpt(**kwargs)


def test_tiny_gpt_rejects_float_inputs():
    with pytest.raises(TypeError, match="integer token ids"):
        models.tiny_gpt(**SMALL_GPT)(torch.zeros(2, 7))


def test_tiny_gpt_rejects_sequences_longer_than_seq_len():
    model = models.tiny_gpt(**SMALL_GPT)
    with pytest.raises(ValueError, match=r"seq_len|7"):
        model(torch.zeros(2, 8, dtype=torch.long))


def test_tiny_gpt_rejects_token_ids_outside_the_vocabulary():
    model = models.tiny_gpt(**SMALL_GPT)
    with pytest.raises(ValueError, match=r"vocab"):
        model(torch.full((2, 7), 13))


def test_sample_batch_fits_an_mlp():
    model = models.mlp(depth=3, width=8, in_features=5, out_features=3)
    x, y = models.sample_batch(model, 4)
    assert x.shape == (4, 5) and y.shape == (4, 3) and x.dtype == y.dtype == torch.float32
    assert model(x).shape == y.shape
    models.default_loss(model)(model(x), y).backward()  # MSE fits
    assert isinstance(models.default_loss(model), nn.MSELoss)
    x2, y2 = models.sample_batch(model, 4)
    x3, _ = models.sample_batch(model, 4, seed=1)
    assert torch.equal(x, x2) and torch.equal(y, y2) and not torch.equal(x, x3)


def test_sample_batch_fits_a_tiny_gpt():
    model = models.tiny_gpt(**SMALL_GPT)
    ids, targets = models.sample_batch(model, 3)
    assert ids.shape == targets.shape == (3, 7)
    assert ids.dtype == targets.dtype == torch.int64
    assert int(ids.min()) >= 0 and int(ids.max()) < 13 and int(targets.max()) < 13
    assert torch.equal(ids[:, 1:], targets[:, :-1])  # next-token targets
    logits = model(ids)
    assert logits.shape == (3, 7, 13)
    assert models.default_loss(model) is models.lm_loss
    loss = models.lm_loss(logits, targets)
    manual = torch.stack([
        -torch.log_softmax(logits[b, t], dim=-1)[targets[b, t]] for b in range(3) for t in range(7)
    ]).mean()
    torch.testing.assert_close(loss, manual, rtol=1e-5, atol=1e-6)
