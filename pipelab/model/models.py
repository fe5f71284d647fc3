"""Reference models: `nn.Sequential`s of blocks, deterministic from a seed, no BatchNorm.

A pipeline cuts a model between blocks, so each model here is a flat sequence of blocks
(`pl.split` cuts it).  BatchNorm is avoided on purpose: its statistics depend on the
micro-batch, so a pipelined step would not equal the full-batch step.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


def _check_positive(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def mlp(depth: int = 8, width: int = 256, seed: int = 0, in_features: int | None = None,
        out_features: int | None = None) -> nn.Sequential:
    """`depth` blocks of Linear + GELU (the last block is a plain Linear) — the source text's "8 layers"."""
    in_features = width if in_features is None else in_features
    out_features = width if out_features is None else out_features
    _check_positive(depth=depth, width=width, in_features=in_features, out_features=out_features)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return _mlp_blocks(depth, width, in_features, out_features)


def _mlp_blocks(depth: int, width: int, in_features: int, out_features: int) -> nn.Sequential:
    blocks = []
    for i in range(depth):
        fan_in = in_features if i == 0 else width
        fan_out = out_features if i == depth - 1 else width
        linear = nn.Linear(fan_in, fan_out)
        blocks.append(linear if i == depth - 1 else nn.Sequential(linear, nn.GELU()))
    return nn.Sequential(*blocks)


class Embedding(nn.Module):
    """Token plus learned position embeddings: (batch, seq) ids -> (batch, seq, d_model)."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int):
        super().__init__()
        self.token = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(seq_len, d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"tiny_gpt expects integer token ids, got a {ids.dtype} tensor")
        if ids.dim() != 2:
            raise ValueError(f"tiny_gpt expects token ids shaped (batch, seq), got shape {tuple(ids.shape)}")
        if ids.shape[1] > self.position.num_embeddings:
            raise ValueError(f"the sequence has {ids.shape[1]} tokens but the model's seq_len is {self.position.num_embeddings}")
        self.check_vocabulary(ids)
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.token(ids) + self.position(positions)

    def check_vocabulary(self, ids: torch.Tensor, what: str = "token ids") -> None:
        """A ValueError when an id lies outside the vocabulary (nn.Embedding would raise a bare IndexError)."""
        vocab = self.token.num_embeddings
        if ids.numel() and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(f"{what} must lie in 0..{vocab - 1} (vocab_size {vocab}), got {int(ids.min())}.."
                             f"{int(ids.max())}: encode them with the model's vocabulary, or build the model with "
                             "a larger vocab_size")


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: x + attention(LN(x)), then x + MLP(LN(x)); causal attention."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # heads counted from qkv's output (3 · heads · head_dim), not from n_heads: the same code runs
        # the H/t heads a tensor-parallel rank holds (`model/tp_plans.py`)
        batch, seq, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        attention = scores.masked_fill(causal, float("-inf")).softmax(dim=-1) @ v
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, seq, -1))
        return x + self.mlp(self.ln2(x))


class LMHead(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits."""

    def __init__(self, d_model: int, vocab_size: int):
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def tiny_gpt(n_layers: int = 4, d_model: int = 64, n_heads: int = 4, vocab_size: int = 128,
             seq_len: int = 32, seed: int = 0) -> nn.Sequential:
    """A GPT-style language model as n_layers + 2 blocks: embedding, transformer blocks, LM head.

    Input (batch, seq) token ids, output (batch, seq, vocab) logits; train with `lm_loss`.
    """
    _check_positive(n_layers=n_layers, d_model=d_model, n_heads=n_heads, vocab_size=vocab_size, seq_len=seq_len)
    with torch.random.fork_rng():  # seed the model without touching the caller's random state
        torch.manual_seed(seed)
        blocks = [Embedding(vocab_size, seq_len, d_model)]
        blocks += [TransformerBlock(d_model, n_heads) for _ in range(n_layers)]
        blocks.append(LMHead(d_model, vocab_size))
        return nn.Sequential(*blocks)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token: logits (batch, seq, vocab), targets (batch, seq)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def sample_batch(model: nn.Sequential, batch_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random (inputs, targets) pair that fits `model` (an `mlp` or a `tiny_gpt`)."""
    generator = torch.Generator().manual_seed(seed)
    first = model[0]
    if isinstance(first, Embedding):
        vocab, seq = first.token.num_embeddings, first.position.num_embeddings
        ids = torch.randint(vocab, (batch_size, seq + 1), generator=generator)
        return ids[:, :-1], ids[:, 1:]
    first_linear = first if isinstance(first, nn.Linear) else next(m for m in first.modules() if isinstance(m, nn.Linear))
    last = model[-1] if isinstance(model[-1], nn.Linear) else [m for m in model[-1].modules() if isinstance(m, nn.Linear)][-1]
    x = torch.randn(batch_size, first_linear.in_features, generator=generator)
    y = torch.randn(batch_size, last.out_features, generator=generator)
    return x, y


def default_loss(model: nn.Sequential):
    """The loss that goes with a reference model: `lm_loss` for tiny_gpt, MSE otherwise."""
    return lm_loss if isinstance(model[0], Embedding) else nn.MSELoss()
