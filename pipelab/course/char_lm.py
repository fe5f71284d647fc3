"""A character-level language model over `corpus.py`'s texts: the tokenizer, the windows, the prompts.

    tokenizer = CharTokenizer()                          # 96 symbols: the newline and printable ASCII
    ids = tokenizer.encode(corpus_text())                # a LongTensor, one id per character
    train_ids, held_ids = held_out_split(ids, 0.05)      # the last 5 % held out
    batches = windows_loader(train_ids, seq_len=64, batch_size=32)   # shuffled (inputs, next-token targets)
    model = pl.models.tiny_gpt(vocab_size=tokenizer.vocab_size, seq_len=64, ...)
    pl.train(pipe, batches, optimizer, ...)              # pipelined
    one_device.train(copy_of_model, batches, optimizer, loss_fn=pl.models.lm_loss)   # the reference
    pipe.generate(prompts_tensor(tokenizer, ["Beautiful is"]), 40)

A window of `seq_len + 1` characters gives the inputs (its first `seq_len`) and the targets (its last `seq_len`):
position t learns to predict character t + 1 (`pl.models.lm_loss`, the mean over every position).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from .corpus import ALPHABET


class CharTokenizer:
    """One id per character of `alphabet` (default: the newline and printable ASCII, 96 symbols)."""

    def __init__(self, alphabet: str = ALPHABET):
        if len(set(alphabet)) != len(alphabet) or not alphabet:
            raise ValueError("the alphabet must be a non-empty string of distinct characters")
        self.alphabet = alphabet
        self.ids = {c: i for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> torch.Tensor:
        """The ids of `text`'s characters, a 1-D LongTensor; a character outside the alphabet is a ValueError
        naming it and where it is."""
        try:
            return torch.tensor([self.ids[c] for c in text], dtype=torch.long)
        except KeyError as missing:
            where = text.index(missing.args[0])
            context = text[max(0, where - 20):where + 1]
            raise ValueError(f"character {missing.args[0]!r} at position {where} ({context!r}) is not in the "
                             f"tokenizer's alphabet of {self.vocab_size}") from None

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str | list[str]:
        """The text of `ids` (a 1-D tensor or a list); a 2-D tensor: one string per row."""
        if isinstance(ids, torch.Tensor):
            if ids.dim() == 2:
                return [self.decode(row) for row in ids]
            ids = ids.tolist()
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"ids must lie in 0..{self.vocab_size - 1}, got {min(ids)}..{max(ids)}")
        return "".join(self.alphabet[i] for i in ids)


class TextWindows(Dataset):
    """Window k: `ids[k·stride : k·stride + seq_len + 1]` as (inputs, targets), the targets one character on.

    With `stride = seq_len` (the default) the windows tile the text; `len` = (len(ids) − 1 − seq_len) // stride + 1.
    """

    def __init__(self, ids: torch.Tensor, seq_len: int, stride: int | None = None):
        stride = seq_len if stride is None else stride
        for name, value in (("seq_len", seq_len), ("stride", stride)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if ids.dim() != 1 or len(ids) < seq_len + 1:
            raise ValueError(f"the ids must be 1-D and at least seq_len + 1 = {seq_len + 1} long, got shape "
                             f"{tuple(ids.shape)}")
        self.ids, self.seq_len, self.stride = ids, seq_len, stride

    def __len__(self) -> int:
        return (len(self.ids) - 1 - self.seq_len) // self.stride + 1

    def __getitem__(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= k < len(self):
            raise IndexError(f"window {k} of {len(self)}")
        start = (k % len(self)) * self.stride
        window = self.ids[start:start + self.seq_len + 1]
        return window[:-1], window[1:]


def held_out_split(ids: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the first 1 − fraction of `ids`, the rest): held-out text the model never trains on."""
    if not 0 < fraction < 1:
        raise ValueError(f"fraction must lie strictly between 0 and 1, got {fraction!r}")
    cut = round(len(ids) * (1 - fraction))
    return ids[:cut], ids[cut:]


def windows_loader(ids: torch.Tensor, seq_len: int, batch_size: int, stride: int | None = None,
                   shuffle: bool = True, drop_last: bool = False) -> DataLoader:
    """A `DataLoader` of (inputs, targets) batches of `TextWindows`; shuffled, its order drawn from torch's random
    state when an epoch begins (`pl.train` seeds it), the last batch partial unless `drop_last`."""
    return DataLoader(TextWindows(ids, seq_len, stride), batch_size=batch_size, shuffle=shuffle, drop_last=drop_last)


def prompts_tensor(tokenizer: CharTokenizer, prompts: Sequence[str]) -> torch.Tensor:
    """Equally long prompts as a (len(prompts), length) tensor of ids (`pipe.generate` takes one length)."""
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        raise ValueError(f"prompts must be equally long to go through generate() as one batch, got lengths "
                         f"{[len(p) for p in prompts]}")
    return torch.stack([tokenizer.encode(p) for p in prompts])


def continuations(tokenizer: CharTokenizer, tokens: torch.Tensor, prompt_length: int) -> list[str]:
    """What `generate` wrote after each prompt (the rows of `tokens` past `prompt_length`), a newline shown as ⏎."""
    return [text[prompt_length:].replace("\n", "⏎") for text in tokenizer.decode(tokens)]


__all__ = ["CharTokenizer", "TextWindows", "continuations", "held_out_split", "prompts_tensor", "windows_loader"]
