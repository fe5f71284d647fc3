"""A tiny GPT's forward with a key/value cache: the new tokens only, attending to every earlier one.

Generation runs a model once per new token.  Without a cache each run recomputes the whole
prefix; with one, each transformer block keeps the keys and values of the tokens it has seen
(per layer: batch × heads × tokens × head_dim, twice) and computes only the new token's
(Pope et al. 2022, "Efficiently Scaling Transformer Inference", §2.2).  `cached_forward` runs
a stage of `pl.models.tiny_gpt` (an `nn.Sequential` of its blocks) that way; a stage holds the
cache of its own blocks only, one cache per sequence group (a pipeline's *lane*).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .models import Embedding, LMHead, TransformerBlock


def check_prompts(first_stage: nn.Module, prompts: torch.Tensor, new_tokens: int) -> None:
    """Refuse, before any work, prompts with a token id outside the vocabulary, or a generation whose last token
    would sit past the model's positions: the last new token is made from position prompt_length + new_tokens − 2,
    the last one fed in."""
    embedding = _embedding(first_stage)
    embedding.check_vocabulary(prompts, "the prompts' token ids")
    needed, positions = prompts.shape[1] + new_tokens - 1, embedding.position.num_embeddings
    if needed > positions:
        raise ValueError(f"generating {new_tokens} new tokens after prompts of {prompts.shape[1]} feeds {needed} "
                         f"positions, past the model's seq_len ({positions} positions): at most "
                         f"{positions - prompts.shape[1] + 1} new tokens")


def _embedding(first_stage: nn.Module) -> Embedding:
    blocks = list(first_stage) if isinstance(first_stage, nn.Sequential) else [first_stage]
    embedding = next((b for b in blocks if isinstance(b, Embedding)), None)
    if embedding is None:
        raise TypeError("cached generation runs pl.models.tiny_gpt's blocks; its first stage has no "
                        f"{Embedding.__name__} (it starts with {type(blocks[0]).__name__ if blocks else 'nothing'})")
    return embedding


def cached_forward(stage: nn.Module, x: torch.Tensor, cache: dict, start: int) -> torch.Tensor:
    """The output of `stage` for the tokens at positions start, start + 1, ... (x: their ids on the first stage,
    else the hidden states (batch, new tokens, d_model)), reading and extending `cache` ({block index: (keys,
    values)}); equals the rows of a full forward over all tokens so far at those positions."""
    blocks = list(stage) if isinstance(stage, nn.Sequential) else [stage]
    for k, block in enumerate(blocks):
        if isinstance(block, Embedding):
            positions = torch.arange(start, start + x.shape[1], device=x.device)
            if start + x.shape[1] > block.position.num_embeddings:
                raise ValueError(f"generating past the model's seq_len ({block.position.num_embeddings} positions)")
            x = block.token(x) + block.position(positions)
        elif isinstance(block, TransformerBlock):
            x = _block(block, x, cache, k, start)
        elif isinstance(block, LMHead):
            x = block(x)
        else:
            raise TypeError(f"cached generation runs pl.models.tiny_gpt's blocks; got {type(block).__name__}")
    return x


def _block(block: TransformerBlock, x: torch.Tensor, cache: dict, key: int, start: int) -> torch.Tensor:
    batch, new, _ = x.shape
    q, k, v = block.qkv(block.ln1(x)).chunk(3, dim=-1)
    q, k, v = (t.view(batch, new, -1, block.head_dim).transpose(1, 2) for t in (q, k, v))
    if key in cache:
        past_k, past_v = cache[key]
        k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
    cache[key] = (k, v)
    scores = q @ k.transpose(-2, -1) / math.sqrt(block.head_dim)
    # new token i (position start + i) sees positions 0 .. start + i
    later = torch.arange(k.shape[2], device=x.device)[None, :] > torch.arange(start, start + new, device=x.device)[:, None]
    attention = scores.masked_fill(later, float("-inf")).softmax(dim=-1) @ v
    x = x + block.proj(attention.transpose(1, 2).reshape(batch, new, -1))
    return x + block.mlp(block.ln2(x))
