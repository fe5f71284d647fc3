"""A training run's data, its single-device reference, and what the ranks run in tests/test_training_run.py."""

from __future__ import annotations

import copy

import torch
from torch.utils.data import DataLoader

import pipelab as pl
from your_model_cases import VOCAB, make_model

LENGTHS = [7, 3, 12, 5, 9, 2, 11, 4, 8, 6, 10, 3, 7, 12, 2, 5, 9, 4, 6, 11, 8]  # 21 sequences: batches 6, 6, 6, 3
SPLITS = {"gpt2": ["transformer.h.1", "transformer.h.2"], "llama": ["model.layers.1", "model.layers.2"]}


def sequences(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in LENGTHS]


def pad(rows: list[torch.Tensor]) -> dict:
    """A padding collator, as Hugging Face's: each batch padded to its own longest row, the padding labelled
    -100 and masked out."""
    longest = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for k, row in enumerate(rows):
        ids[k, :len(row)], mask[k, :len(row)] = row, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def loader(batch_size: int = 6) -> DataLoader:
    """Shuffled, right-padded, the last batch partial: every batch's rows and length differ."""
    return DataLoader(sequences(), batch_size=batch_size, shuffle=True, collate_fn=pad)


def single_device_run(model, epochs: int, clip: float, lr: float = 1e-2,
                      optimizer_class=torch.optim.AdamW) -> tuple[list[float], dict]:
    """The reference: the same loop on one device (`pl.train` seeds each epoch with torch.manual_seed(epoch))."""
    model = copy.deepcopy(model)
    optimizer = optimizer_class(model.parameters(), lr=lr)
    losses = []
    for epoch in range(epochs):
        torch.manual_seed(epoch)
        for batch in loader():
            optimizer.zero_grad(set_to_none=True)
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def pipelined_run(pipe, model, epochs: int, clip: float, lr: float = 1e-2) -> tuple[list[float], dict]:
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=lr)
    run = pl.train(pipe, loader(), optimizer, epochs=epochs, clip=clip, progress=False)
    return run.losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.device.type != "meta"}


def held_out() -> list[dict]:
    """Six other sequences in two padded batches of 4 and 2 rows."""
    rows = sequences(seed=1)[:6]
    return [pad(rows[:4]), pad(rows[4:])]


def cli_loader_factory():
    """For `pipelab run --model training_run_cases:cli_loader_factory`: the tied GPT-2, the shuffled, padded
    loader (its own loss: no loss_fn) and the held-out batches."""
    return make_model("gpt2"), loader(), None, held_out()


def train_on_ranks(kind: str, schedule: str) -> dict:
    """On every rank: two epochs of the padded loader, AdamW with clipping, the tied model split over the ranks."""
    import torch.distributed as dist

    model = make_model(kind)
    pipe = pl.DistributedPipeline(model, n_microbatches=3, schedule=schedule,
                                  split_points=SPLITS[kind][:dist.get_world_size() - 1], sample=pad(sequences()[:6]))
    losses, parameters = pipelined_run(pipe, model, epochs=2, clip=0.5)
    return {"losses": losses, "parameters": parameters}


def disagreeing(what: str) -> None:
    """On every rank: a pipeline whose rank 1 was given another cut, other initial weights, or another batch."""
    import torch.distributed as dist

    other = dist.get_rank() == 1
    model = make_model("gpt2", seed=1 if other and what == "weights" else 0)
    points = ["transformer.h.2"] if other and what == "cut" else ["transformer.h.1"]
    batch = pad(sequences()[:6])
    pipe = pl.DistributedPipeline(model, n_microbatches=3, split_points=points, sample=batch)
    if other and what == "batch":  # the same rows padded to another length: only the padding differs
        batch = {k: torch.cat([v, torch.zeros(6, 2, dtype=v.dtype).fill_(-100 if k == "labels" else 0)], dim=1)
                 for k, v in batch.items()}
    pipe.step(batch)
