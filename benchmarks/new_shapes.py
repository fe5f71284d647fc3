"""What does a new batch shape cost a model split by names?

A tiny GPT-2 and Llama (4 layers, hidden 32, vocabulary 64, as tests/your_model_cases.py builds them), cut in 3
stages, 1F1B, m = 3, right-padded batches.  Printed, in seconds (one intra-op thread, best or median of a few):

- one trace of the whole model: fixed shapes vs dynamic dimensions (`Dim.AUTO`, what `traced_shapes.py` uses);
- a step on a shape already run (the sample's, its graph traced for its shapes); the first step of another shape
  (a trace with dynamic dimensions); a step of a third shape (no trace); the first step of micro-batches of 1 row
  (a new trace) and the step after it;
- a step with the fixed-shape graph against the dynamic graph, same shape (what a dynamic graph costs to run);
- an epoch of dynamic padding (40 batches of 8 rows of 2..64 tokens, the last of 3 rows): the traces it took,
  against the distinct micro-batch shapes a cache of fixed shapes would have traced.

    python benchmarks/new_shapes.py [--model gpt2|llama]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

import pipelab as pl
from pipelab.model import microbatch
from pipelab.model.named_split import split_by_names, trace
from pipelab.model.partition import Partition
from pipelab.model.traced_shapes import TracedShapes

VOCAB = 64


def build(kind: str):
    import transformers as hf

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    if kind == "gpt2":
        model = hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=128))
        return model.eval(), ["transformer.h.1", "transformer.h.2"]
    config = hf.LlamaConfig(num_hidden_layers=4, num_key_value_heads=1, vocab_size=VOCAB, hidden_size=32,
                            intermediate_size=64, num_attention_heads=2, max_position_embeddings=128)
    return hf.LlamaForCausalLM(config).eval(), ["model.layers.1", "model.layers.2"]


def batch(lengths: list[int], seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), max(lengths)), generator=g)
    mask = (torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def seconds(work, repeats: int = 1) -> list[float]:
    found = []
    for _ in range(repeats):
        begin = time.perf_counter()
        work()
        found.append(time.perf_counter() - begin)
    return found


def pipeline(model, points, sample, partition=None):
    return pl.Pipeline(model, n_stages=3, n_microbatches=3, split_points=None if partition else points,
                       split_method=partition or "uniform", sample=sample, loss_normalization="tokens",
                       devices="cpu", loss_fn=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2", choices=["gpt2", "llama"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, points = build(args.model)
    sample = batch([16, 5, 16, 9, 16, 12])
    micro = microbatch.split(sample, 3)[0]
    fixed = min(seconds(lambda: trace(model, points, micro, dynamic=False), 3))
    dynamic = min(seconds(lambda: trace(model, points, micro, dynamic=True), 3))
    print(f"one trace: fixed shapes {fixed:.2f} s, dynamic dimensions {dynamic:.2f} s")

    pipe = pipeline(model, points, sample)  # the sample's shape, traced as it is
    step = lambda b: (model.zero_grad(set_to_none=True), pipe.step(b))  # noqa: E731
    step(sample)
    repeated = statistics.median(seconds(lambda: step(sample), 5))
    first_new = seconds(lambda: step(batch([23, 5, 16, 9, 20, 12], seed=1)))[0]
    second_new = seconds(lambda: step(batch([30, 5, 7, 9, 20, 3, 4, 4], seed=2)))[0]
    one_row = seconds(lambda: step(batch([16, 5, 12], seed=3)))[0]
    one_row_again = seconds(lambda: step(batch([16, 5, 31], seed=4)))[0]
    print(f"a step: repeated shape {repeated:.3f} s; first new shape, traced (dynamic) {first_new:.3f} s; "
          f"another new shape, no trace {second_new:.3f} s; micro-batches of 1 row, traced {one_row:.3f} s, "
          f"then {one_row_again:.3f} s")

    stages = split_by_names(model, points, micro, dynamic=True)
    dynamic_first = Partition([(s, s + 1) for s in range(3)], stages, "names", [1.0] * 3,
                              traced_for=TracedShapes(model, points, stages, micro))
    dynamic_pipe = pipeline(model, points, sample, dynamic_first)
    dynamic_pipe.step(sample)
    on_dynamic = statistics.median(seconds(lambda: dynamic_pipe.step(sample), 5))
    print(f"a step on the same shape: fixed-shape graph {repeated:.3f} s, dynamic graph {on_dynamic:.3f} s")

    g = torch.Generator().manual_seed(5)
    epoch = [batch(torch.randint(2, 65, (8 if k < 39 else 3,), generator=g).tolist(), k) for k in range(40)]
    fresh = pipeline(model, points, epoch[0])
    shapes = {microbatch.signature(c) for b in epoch for c in microbatch.split(b, 3)}
    begin = time.perf_counter()
    for b in epoch:
        fresh.step(b)
    print(f"an epoch of 40 padded batches: {fresh.partition.traced_for.traces} traces in "
          f"{time.perf_counter() - begin:.1f} s; a cache of fixed shapes: {len(shapes)} traces "
          f"(~{len(shapes) * fixed:.0f} s of tracing)")


if __name__ == "__main__":
    main()
