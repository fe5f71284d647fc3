"""Lesson 14's "let pipelab decide": a Hugging Face GPT-2 (from a config) cut and scheduled by
`split_method="auto", schedule="auto"`, then its best candidates built and measured, predicted beside measured.

    plan, rows = auto_decision.decide_and_measure()     # the plan (`pipe.plan`) and one row per candidate run
    auto_decision.show(rows)                            # predicted and measured step of each candidate

Each candidate is its own `pl.Pipeline` on a fresh copy of the model (the same seed), the cut given as
split points and the schedule as chosen; its measured step is the median makespan of `steps` steps after
a warm-up step (the local engine replays each action's measured time on one clock per stage:
docs/engines.md).  The gradients of the chosen pipeline are compared with the single device's.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import matplotlib.pyplot as plt
import torch

from ..predict.auto_plan import NAMED
from ..runtime.local import Pipeline


@dataclass
class CandidateRun:
    cut: str
    schedule: str
    predicted: float  # seconds
    measured: float  # seconds, median makespan
    chosen: bool


def gpt2(n_layers: int = 4, width: int = 128, seq: int = 64, vocab: int = 1024, seed: int = 0):
    """A GPT-2 built from its config (no download), in eval mode (no dropout: every cut computes the same)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=n_layers, n_embd=width, n_head=4, n_positions=seq, vocab_size=vocab,
                                     use_cache=False)
    return transformers.GPT2LMHeadModel(config).eval()


def batch_for(vocab: int = 1024, rows: int = 16, seq: int = 64) -> dict:
    ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def decide_and_measure(n_stages: int = 2, n_microbatches: int = 4, top: int = 4, steps: int = 3, **model):
    """(the plan, one `CandidateRun` per candidate among the `top` best), and the largest gradient difference
    of the chosen pipeline from the single-device step."""
    net = gpt2(**model)
    batch = batch_for(net.config.vocab_size, 16, net.config.n_positions)
    pipe = Pipeline(net, n_stages=n_stages, n_microbatches=n_microbatches, sample=batch, split_method="auto",
                    schedule="auto", devices="cpu")
    plan = pipe.plan
    rows = []
    for k, candidate in enumerate(plan.candidates[:top]):
        if k > 0:
            schedule = candidate.schedule_name if candidate.schedule_name in NAMED else candidate.schedule
            pipe = Pipeline(gpt2(**model), n_stages=n_stages, n_microbatches=n_microbatches, sample=batch,
                            split_points=plan.split_points(candidate), schedule=schedule, devices="cpu")
        pipe.step(batch)  # warm: the first step pays for allocations
        spans = [pipe.step(batch).trace.makespan for _ in range(steps)]
        rows.append(CandidateRun(", ".join(plan.split_points(candidate)), candidate.schedule_name,
                                 candidate.predicted, statistics.median(spans), k == 0))
    return plan, rows, _gradient_gap(model, batch, n_stages, n_microbatches)


def _gradient_gap(model: dict, batch: dict, n_stages: int, n_microbatches: int) -> float:
    """Largest |g_pipeline - g_one_device| / max |g_one_device| of the auto pipeline after one step."""
    net, plain = gpt2(**model), gpt2(**model)
    Pipeline(net, n_stages=n_stages, n_microbatches=n_microbatches, sample=batch, split_method="auto",
             schedule="auto", devices="cpu").step(batch)
    plain(**batch).loss.backward()
    return max(float((a.grad - b.grad).abs().max() / b.grad.abs().max().clamp_min(1e-30))
               for a, b in zip(net.parameters(), plain.parameters()))


def show(rows: list[CandidateRun]):
    """Predicted and measured step of each candidate, the chosen one first."""
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(rows)))
    names = [f"{r.schedule} @ {r.cut}" + ("  (chosen)" if r.chosen else "") for r in rows]
    y = range(len(rows))
    ax.barh([k + 0.2 for k in y], [r.predicted * 1e3 for r in rows], 0.4, label="predicted")
    ax.barh([k - 0.2 for k in y], [r.measured * 1e3 for r in rows], 0.4, label="measured")
    ax.set_yticks(list(y), names)
    ax.invert_yaxis()
    ax.set_xlabel("step (ms)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def table(rows: list[CandidateRun]) -> str:
    lines = [f"{'schedule':<30} {'cut before':<26} {'predicted':>10} {'measured':>10} {'ratio':>6}"]
    for r in rows:
        lines.append(f"{r.schedule:<30} {r.cut:<26} {r.predicted * 1e3:8.1f}ms {r.measured * 1e3:8.1f}ms "
                     f"{r.predicted / r.measured:6.2f}" + ("  <- chosen" if r.chosen else ""))
    return "\n".join(lines)
