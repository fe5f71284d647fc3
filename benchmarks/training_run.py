"""A training run over a loader of varying shapes against the same tokens in fixed shapes.

    .venv/bin/python benchmarks/training_run.py [--epochs 2] [--sequences 157] [--batch 8] [--width 64]

About 20 seconds on 2 shared cores with the defaults.  The work: a GPT-2 built from a small config
(`GPT2Config(n_layer=4, n_embd=--width, n_head=4, vocab_size=256, n_positions=128)`, eval mode, the same
initial weights for every run), cut into 2 stages by names (`transformer.h.2`), 1F1B, m = 3, one intra-op
thread, `pl.train` with AdamW and clipping at 1.0 for `--epochs` epochs over a corpus of `--sequences` token
sequences whose lengths are drawn log-normally (median about 27 tokens, clamped to 4..128), the data shuffled
per epoch.  Three loaders of the same tokens:

- dynamic padding: batches of `--batch` sequences, each padded to its own longest row (what Hugging Face's
  `DataCollatorWithPadding` does), the last batch partial (157 = 19 x 8 + 5): the shapes change every step;
- padded to one length: the same batches, every row padded to 128 tokens (only the partial last batch
  differs, in its rows);
- packed: the sequences concatenated and cut into rows of 128 tokens (the last row padded), `--batch` rows a
  batch: no padding, one shape but for the last batch.

Printed for each: the run's seconds (steps, clipping and the optimizer; traces made during steps included, the
pipeline's first trace of its sample not: that is built before the run), the corpus's tokens per second
(the same tokens in every run: padding is work that counts for nothing), and without the traces (each traced
step counted at the median step's cost: what a longer run tends to), the share of computed positions that
are padding, the traces the run made, and the steps that paid one.  Then, as ratios measured in this one
run: each layout's tokens/s over dynamic padding's, and the cost of a new shape, the first step of a shape
that traces against the median step of a shape already known (what `model/traced_shapes.py`'s dynamic
dimensions keep to a few steps a run).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
from torch.utils.data import DataLoader

import pipelab as pl

VOCAB, LONGEST, MICRO = 256, 128, 3


def corpus(n: int, seed: int = 0) -> list[torch.Tensor]:
    """`n` token sequences, their lengths log-normal (median e^3.3, about 27), 4..128 tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(3.3 + 0.7 * torch.randn(n, generator=g)).round().clamp(4, LONGEST).long()
    return [torch.randint(1, VOCAB, (int(k),), generator=g) for k in lengths]


def padded(rows: list[torch.Tensor], length: int | None = None) -> dict:
    """Rows right-padded to `length` (None: the longest row), the padding masked out and labelled -100."""
    length = length or max(len(r) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for k, row in enumerate(rows):
        ids[k, :len(row)], mask[k, :len(row)] = row, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def packed_rows(sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """The sequences end to end, cut into rows of LONGEST tokens (the last row shorter)."""
    stream = torch.cat(sequences)
    return list(stream.split(LONGEST))


def loaders(sequences: list[torch.Tensor], batch: int) -> dict[str, DataLoader]:
    return {
        "dynamic padding": DataLoader(sequences, batch_size=batch, shuffle=True, collate_fn=padded),
        "padded to 128": DataLoader(sequences, batch_size=batch, shuffle=True,
                                    collate_fn=lambda rows: padded(rows, LONGEST)),
        "packed rows of 128": DataLoader(packed_rows(sequences), batch_size=batch, shuffle=True,
                                         collate_fn=lambda rows: padded(rows, LONGEST)),
    }


class Watched:
    """A loader whose batches are timed as the run asks for them: the seconds from handing a batch to the loop
    to its asking for the next (the step, clipping, the optimizer), and whether the step traced."""

    def __init__(self, loader: DataLoader, traced_for):
        self.loader, self.traced_for = loader, traced_for
        self.steps: list[tuple[float, bool]] = []  # (seconds, traced) per step
        self.positions = self.real = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            self.positions += batch["input_ids"].numel()
            self.real += int(batch["attention_mask"].sum())
            traces, begin = self.traced_for.traces, time.perf_counter()
            yield batch
            self.steps.append((time.perf_counter() - begin, self.traced_for.traces > traces))


def model(width: int):
    import transformers as hf

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    config = hf.GPT2Config(n_layer=4, n_embd=width, n_head=4, vocab_size=VOCAB, n_positions=LONGEST)
    return hf.GPT2LMHeadModel(config).eval()


def run(loader: DataLoader, width: int, epochs: int) -> dict:
    gpt = model(width)
    pipe = pl.Pipeline(gpt, n_stages=2, n_microbatches=MICRO, split_points=["transformer.h.2"],
                       sample=next(iter(loader)), devices="cpu")
    watched = Watched(loader, pipe.partition.traced_for)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    traces_before = pipe.partition.traced_for.traces
    begin = time.perf_counter()
    pl.train(pipe, watched, optimizer, epochs=epochs, clip=1.0, progress=False)
    seconds = time.perf_counter() - begin
    traced = [s for s, t in watched.steps if t]
    known = [s for s, t in watched.steps if not t]
    return {"seconds": seconds, "tokens": watched.real, "padding": 1 - watched.real / watched.positions,
            "traces": pipe.partition.traced_for.traces - traces_before, "steps": len(watched.steps),
            "traced_steps": traced, "known_step": statistics.median(known)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--sequences", type=int, default=157)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sequences = corpus(args.sequences)
    print(f"{len(sequences)} sequences, {sum(len(s) for s in sequences)} tokens (median length "
          f"{int(statistics.median(len(s) for s in sequences))}), batches of {args.batch}, {args.epochs} epochs; "
          f"GPT-2 n_embd={args.width}, 2 stages, 1F1B, m={MICRO}, one thread\n")
    found = {name: run(loader, args.width, args.epochs) for name, loader in loaders(sequences, args.batch).items()}
    print(f"{'layout':<20} {'run s':>6} {'tokens/s':>9} {'w/o traces':>10} {'padding':>8} {'traces':>7} "
          f"{'steps that traced':>18} {'known step ms':>14} {'traced step s':>14}")
    rate, steady = {}, {}
    for name, f in found.items():
        excess = sum(f["traced_steps"]) - len(f["traced_steps"]) * f["known_step"]  # the traces' share of the run
        rate[name], steady[name] = f["tokens"] / f["seconds"], f["tokens"] / (f["seconds"] - excess)
        traced = f"{statistics.median(f['traced_steps']):.2f}" if f["traced_steps"] else "-"
        print(f"{name:<20} {f['seconds']:>6.1f} {rate[name]:>9.0f} {steady[name]:>10.0f} {f['padding']:>8.0%} "
              f"{f['traces']:>7} {len(f['traced_steps']):>8} of {f['steps']:<7} {f['known_step'] * 1e3:>14.1f} "
              f"{traced:>14}")
    print("\nratios, measured in this run:")
    for name in found:
        if name != "dynamic padding":
            print(f"  tokens/s, {name} / dynamic padding: {rate[name] / rate['dynamic padding']:.2f} "
                  f"(without the traces: {steady[name] / steady['dynamic padding']:.2f})")
    dynamic = found["dynamic padding"]
    if dynamic["traced_steps"]:
        cost = statistics.median(dynamic["traced_steps"]) / dynamic["known_step"]
        share = 1 - rate["dynamic padding"] / steady["dynamic padding"]
        print(f"  dynamic padding: the first step of a shape that traces / a step of a known shape: {cost:.0f}x; "
              f"{len(dynamic['traced_steps'])} of {dynamic['steps']} steps "
              f"({len(dynamic['traced_steps']) / dynamic['steps']:.0%}) paid it, {share:.0%} of the run's time")


if __name__ == "__main__":
    main()
