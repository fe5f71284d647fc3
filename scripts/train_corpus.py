"""Train a character-level GPT on the standard library's docstrings, pipelined and on one device, then fine-tune it
on the Zen of Python with its first stage frozen.  Nothing is downloaded (pipelab/course/corpus.py).

    .venv/bin/python scripts/train_corpus.py [--stages 4] [--microbatches 4] [--epochs 6] [--fine-tune-epochs 12]
                                             [--out pipelab-out/corpus] [--every 31]

About 5 minutes on 2 busy cores with the defaults (2 minutes 42 s of CPU).  What it does:

1. The corpus (125,367 characters, 95 % to train on, 5 % held out) cut into windows of 64 characters (inputs)
   and the 64 that follow each by one (targets), shuffled batches of 32 (the last, partial one dropped); a
   `pl.models.tiny_gpt` of 4 blocks of width 128 (826 K parameters) over the 96-symbol alphabet; AdamW (lr 3e-3,
   cosine decay), clipping at 1.0.
2. The same training twice from the same weights: `pl.train` on a 1F1B pipeline of `--stages` stages and
   `--microbatches` micro-batches (split by parameters, all stages in this process), and `one_device.train`,
   the same loop on the plain model.  They alternate epoch by epoch (each epoch seeded alike, so the loader
   gives both the same batches), so a busy neighbour on the CPU slows both alike.  Printed: the losses side by
   side every `--every` steps, and per epoch the held-out loss of each (pipelined / one device) and the
   tokens per second of one device, of the pipeline in this process (its stages take turns on the CPU), and
   on p devices (the last step's measured ops replayed on one clock per stage).  Every step's loss must equal
   the single device's to 1e-5 relative.  Every op runs on one thread (`torch.set_num_threads(1)`).
3. `pipe.save_checkpoint(<out>/pretrained, optimizer)`; a new model of other weights (seed 1) reads it back
   (`load_checkpoint`), and must then equal the trained one.
4. The fine-tune: its first stage (the embedding and the first block) frozen with `requires_grad_(False)`,
   `--fine-tune-epochs` epochs of the Zen (857 characters, windows every 8 characters, batches of 16), again
   pipelined and on one device; the frozen parameters must be bit for bit unchanged.  Printed: the losses, the
   held-out corpus loss before and after, and the text `pipe.generate` writes from the same prompts before
   and after (checked against plain greedy decoding).  Saved to <out>/fine-tuned.

Exit status 1 when a check fails (a loss that differs, a frozen parameter that moved, a checkpoint that does
not read back).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

import torch

import pipelab as pl
from pipelab.course import char_lm, one_device
from pipelab.course.applications import greedy_text
from pipelab.course.corpus import corpus_text, zen_text

SEQ_LEN, BATCH, LR, CLIP = 64, 32, 3e-3, 1.0
PROMPTS = ["Beautiful is", "Errors shoul", "If the imple", "Return the n", "The default "]
NEW_TOKENS = 48


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=6, help="passes over the corpus (58 steps each)")
    parser.add_argument("--fine-tune-epochs", type=int, default=12, help="passes over the Zen (6 steps each)")
    parser.add_argument("--max-steps", type=int, default=None, help="stop each epoch after this many steps (tests)")
    parser.add_argument("--every", type=int, default=31, help="print the two losses every this many steps")
    parser.add_argument("--out", type=Path, default=Path("pipelab-out/corpus"))
    args = parser.parse_args(argv)
    # every op of both runs on one thread, as the engine runs a stage's: pl.train's optimizer step and clipping run
    # outside the engine, on PyTorch's default of a thread per core, which collapses on a busy CPU
    torch.set_num_threads(1)
    tokenizer = char_lm.CharTokenizer()
    train_ids, held_ids = char_lm.held_out_split(tokenizer.encode(corpus_text()), 0.05)
    corpus = char_lm.windows_loader(train_ids, SEQ_LEN, BATCH, drop_last=True)
    held_out = char_lm.windows_loader(held_ids, SEQ_LEN, BATCH, shuffle=False, drop_last=True)
    model = pl.models.tiny_gpt(n_layers=4, d_model=128, n_heads=4, vocab_size=tokenizer.vocab_size,
                               seq_len=SEQ_LEN, seed=0)
    print(f"corpus: {len(corpus_text()):,} characters ({len(train_ids):,} to train on, {len(held_ids):,} held out), "
          f"{len(corpus.dataset)} windows of {SEQ_LEN}, {len(corpus)} batches of {BATCH} an epoch; model: "
          f"{sum(p.numel() for p in model.parameters()):,} parameters, {len(model)} blocks")
    ok = pretrain(model, corpus, held_out, args)
    ok &= fine_tune(model, tokenizer, held_out, args)
    print("all checks passed" if ok else "A CHECK FAILED")
    return 0 if ok else 1


def _pipeline(model, args) -> pl.Pipeline:
    return pl.Pipeline(model, n_stages=args.stages, n_microbatches=args.microbatches, schedule="1f1b",
                       loss_fn=pl.models.lm_loss, devices="cpu", split_method="params")


def _held_out_loss(pipe, held_out) -> float:
    """`pipe.evaluate` over the held-out batches (forward only), weighed by their windows."""
    total = sum(pipe.evaluate(inputs, targets) * len(inputs) for inputs, targets in held_out)
    return total / sum(len(inputs) for inputs, _ in held_out)


def _side_by_side(pipe, reference, batches, held_out, epochs: int, args, phase: str, cosine_steps: int | None):
    """`epochs` epochs of `pl.train` on `pipe` and of `one_device.train` on `reference`, alternating, printed; the
    pipeline's losses, its optimizer, and whether every loss equals the single device's (1e-5 relative)."""
    optimizer = torch.optim.AdamW([p for p in pipe.parameters() if p.requires_grad], lr=LR)
    reference_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR)
    schedulers = [None if cosine_steps is None else torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=cosine_steps)
                  for o in (optimizer, reference_optimizer)]
    losses, reference_losses = [], []
    print(f"\n{phase}\n  {'step':>5} {'pipelined':>10} {'one device':>11} {'relative gap':>13}")
    for epoch in range(epochs):
        run = pl.train(pipe, batches, optimizer, epochs=1, seed=epoch, clip=CLIP, scheduler=schedulers[0],
                       max_steps=args.max_steps, progress=False)
        one = one_device.train(reference, batches, reference_optimizer, epochs=1, seed=epoch, clip=CLIP,
                               scheduler=schedulers[1], max_steps=args.max_steps, loss_fn=pl.models.lm_loss)
        for k, (a, b) in enumerate(zip(run.losses, one.losses), start=len(losses) + 1):
            if k % args.every == 1 or args.every == 1:
                print(f"  {k:5} {a:10.5f} {b:11.5f} {abs(a - b) / b:13.1e}")
        losses += run.losses
        reference_losses += one.losses
        last = run.last.trace
        held = "" if held_out is None else (
            f"held-out loss {_held_out_loss(pipe, held_out):.4f} / "
            f"{one_device.evaluate(reference, held_out, pl.models.lm_loss):.4f}; ")
        print(f"  epoch {epoch + 1}: {len(run.losses)} steps; {held}tokens/s: one device {one.tokens_per_second:,.0f}, "
              f"pipelined {one.tokens / run.seconds:,.0f} (its {args.stages} stages in this one process), "
              f"{one.tokens / len(one.losses) / last.makespan:,.0f} on {args.stages} devices (the last step's ops "
              f"replayed: {last.makespan * 1e3:.0f} ms, {last.speedup:.2f} stages at work)")
    gap = one_device.relative_gap(losses, reference_losses)
    print(f"  {len(losses)} steps: largest relative gap between the logged losses {gap:.1e} "
          f"({'equal to 1e-5' if gap <= 1e-5 else 'NOT EQUAL'}); loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return losses, optimizer, gap <= 1e-5


def pretrain(model, corpus, held_out, args) -> bool:
    reference = copy.deepcopy(model)
    pipe = _pipeline(model, args)
    steps = args.epochs * (len(corpus) if args.max_steps is None else min(args.max_steps, len(corpus)))
    begin = time.perf_counter()
    _, optimizer, ok = _side_by_side(pipe, reference, corpus, held_out, args.epochs, args,
                                     f"pretraining ({args.stages} stages, m = {args.microbatches}, 1F1B)", steps)
    print(f"  both runs: {time.perf_counter() - begin:.0f} s")
    path = args.out / "pretrained"
    path.parent.mkdir(parents=True, exist_ok=True)
    pipe.save_checkpoint(path, optimizer, overwrite=True)
    other = pl.models.tiny_gpt(n_layers=4, d_model=128, n_heads=4, vocab_size=96, seq_len=SEQ_LEN, seed=1)
    _pipeline(other, args).load_checkpoint(path)
    read_back = all(torch.equal(a, b) for a, b in zip(other.parameters(), model.parameters()))
    print(f"saved {path} (pipe.save_checkpoint); read back into a model of other weights: "
          f"{'equal' if read_back else 'DIFFERENT'}")
    return ok and read_back


def fine_tune(model, tokenizer, held_out, args) -> bool:
    zen = char_lm.windows_loader(tokenizer.encode(zen_text()), SEQ_LEN, 16, stride=8, drop_last=True)
    pipe = _pipeline(model, args)
    first = pipe.partition.stages[0]
    first.requires_grad_(False)
    model.zero_grad(set_to_none=True)  # the pretraining's last gradients: a frozen parameter would keep its own
    reference = copy.deepcopy(model)
    frozen = {name: p.detach().clone() for name, p in first.named_parameters()}
    prompts = char_lm.prompts_tensor(tokenizer, PROMPTS)
    before = pipe.generate(prompts, NEW_TOKENS).tokens
    corpus_before = one_device.evaluate(model, held_out, pl.models.lm_loss)
    print(f"\nfine-tune on the Zen of Python ({len(zen_text())} characters, {len(zen.dataset)} windows, {len(zen)} "
          f"batches of 16): stage 0 ({', '.join(type(b).__name__ for b in first)}, "
          f"{sum(p.numel() for p in first.parameters()):,} parameters) frozen")
    _, _, ok = _side_by_side(pipe, reference, zen, None, args.fine_tune_epochs, args, "fine-tune", None)
    model.eval()
    untouched = all(torch.equal(p, frozen[name]) for name, p in first.named_parameters())
    after = pipe.generate(prompts, NEW_TOKENS).tokens
    plain = torch.equal(after, greedy_text(model, prompts, NEW_TOKENS))
    corpus_after = one_device.evaluate(model, held_out, pl.models.lm_loss)
    print(f"  the frozen stage's {len(frozen)} parameters bit for bit unchanged: {untouched}; held-out corpus loss "
          f"{corpus_before:.4f} -> {corpus_after:.4f}")
    print(f"\ngenerated ({NEW_TOKENS} characters, greedy, pipe.generate; equal to plain greedy decoding: {plain}):")
    width = max(map(len, PROMPTS))
    for prompt, was, now in zip(PROMPTS, char_lm.continuations(tokenizer, before, width),
                                char_lm.continuations(tokenizer, after, width)):
        print(f"  {prompt!r}\n      before: {was}\n      after:  {now}")
    path = args.out / "fine-tuned"
    pipe.save_checkpoint(path, overwrite=True)
    print(f"saved {path}")
    return ok and untouched and plain and math.isfinite(corpus_after)


if __name__ == "__main__":
    sys.exit(main())
