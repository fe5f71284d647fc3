"""Lesson 12's loader: token sequences of different lengths, batched as Hugging Face's collators batch them.

    sequences = random_sequences(22, vocab_size=512, lengths=(3, 16), seed=0)
    loader = padded_loader(sequences, batch_size=6)   # shuffled: batches of 6, 6, 6 and 4 rows
    [batch["input_ids"].shape for batch in loader]     # (rows, that batch's longest row): every step its own shape

`pad(rows)` pads each batch on the right to its own longest row (dynamic padding), masks the padding out
(`attention_mask` 0) and labels it -100, so that a causal LM's own loss leaves it out: what
`DataCollatorForLanguageModeling(tokenizer, mlm=False)` gives, with the batch's longest row as its length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import DataLoader

PAD_ID = 0  # the padding's token id; `random_sequences` draws the others from 1 .. vocab_size - 1
IGNORED = -100  # the label PyTorch's cross_entropy and Hugging Face's losses leave out


def random_sequences(n: int, vocab_size: int, lengths: tuple[int, int], seed: int = 0) -> list[torch.Tensor]:
    """`n` rows of random token ids (1 .. vocab_size − 1), each of a length drawn from lengths[0] .. lengths[1]."""
    low, high = lengths
    if not 1 <= low <= high or n < 1 or vocab_size < 2:
        raise ValueError(f"need n >= 1, vocab_size >= 2 and 1 <= lengths[0] <= lengths[1], got n={n}, "
                         f"vocab_size={vocab_size}, lengths={lengths}")
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(low, high + 1, (n,), generator=generator).tolist()
    return [torch.randint(1, vocab_size, (size,), generator=generator) for size in sizes]


def pad(rows: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """One batch: `input_ids` padded on the right with `PAD_ID` to the longest row, `attention_mask` 1 on the real
    tokens, `labels` the ids with the padding -100."""
    longest = max(len(row) for row in rows)
    ids = torch.full((len(rows), longest), PAD_ID, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for k, row in enumerate(rows):
        ids[k, :len(row)], mask[k, :len(row)] = row, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORED)}


def padded_loader(sequences: Sequence[torch.Tensor], batch_size: int, shuffle: bool = True) -> DataLoader:
    """A `DataLoader` over `sequences` with `pad` as its collator: shuffled (the order drawn when an epoch begins,
    which `pl.train` seeds), the last batch partial."""
    return DataLoader(list(sequences), batch_size=batch_size, shuffle=shuffle, collate_fn=pad)


__all__ = ["IGNORED", "PAD_ID", "pad", "padded_loader", "random_sequences"]
