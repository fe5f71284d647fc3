"""The training run behind `pipelab run` and `python -m pipelab.launch`, for either engine.

`train_local(args)` runs in this process (`pl.Pipeline`); `train_rank(args)` runs on each
rank of an initialised process group (`pl.DistributedPipeline`).  Both train the same
model on the same batch and return a `RunSummary`; `finish(summary, args)` prints the
table, writes the timeline PNG, the Chrome trace and, with `--json`, the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from . import run_models
from ..runtime.distributed import DistributedPipeline
from ..runtime.local import Pipeline
from .resume import Resumable
from ..schedules import by_name
from ..schedules.trace import Trace


@dataclass
class RunSummary:
    schedule: str
    n_stages: int
    n_microbatches: int
    bounds: list[tuple[int, int]]
    stage_names: list[str]  # what each stage holds: "blocks 0..3", or "transformer.h.0 .. transformer.h.3"
    split_method: str
    devices: list[str]
    backend: str  # "local" or "distributed"
    world_size: int  # processes that ran the pipeline
    losses: list[float]
    step_seconds: list[float]  # wall clock per step, engine included
    trace: Trace  # the last step's


def add_run_arguments(run: argparse.ArgumentParser) -> None:
    """The flags of `pipelab run`, shared with `python -m pipelab.launch`."""
    run.add_argument("--model", default="mlp",
                     help="mlp, gpt, transformers:<model type> (e.g. transformers:gpt2) or package.module:factory")
    run.add_argument("--config", default=None,
                     help="transformers: the config's key=value pairs, e.g. n_layer=8,n_embd=512,n_head=8")
    run.add_argument("--split-points", default=None,
                     help="a model split by names: the modules where stages 1, 2, ... begin, comma-separated "
                          "(default: its repeated blocks cut evenly into --stages)")
    run.add_argument("--seq-len", type=positive, default=64, help="transformers: tokens per sample")
    run.add_argument("--stages", type=stages_or_auto, default=4,
                     help="pipeline stages p; distributed: auto = the world size (what torchrun's elasticity gives)")
    run.add_argument("--microbatches", type=positive, default=8, help="micro-batches per step m")
    run.add_argument("--schedule", default="1f1b", help="gpipe or 1f1b")
    run.add_argument("--steps", type=positive, default=10)
    run.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (distributed: auto, cpu or cuda)")
    run.add_argument("--batch-size", type=positive, default=64)
    run.add_argument("--depth", type=positive, default=8, help="blocks of the MLP / transformer layers of the GPT")
    run.add_argument("--width", type=positive, default=256, help="MLP width / GPT d_model")
    run.add_argument("--split", choices=["uniform", "params", "time"], default="uniform")
    run.add_argument("--lr", type=float, default=1e-3)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--out", type=Path, default=Path("pipelab-out"), help="folder for the PNG and the Chrome trace")
    run.add_argument("--json", type=Path, default=None, help="also write the run's figures to this JSON file")
    run.add_argument("--checkpoint", type=Path, default=None,
                     help="distributed: a folder every rank sees; resume from its newest checkpoint, save into it "
                          "every --checkpoint-every steps and log each step's loss (commands/resume.py)")
    run.add_argument("--checkpoint-every", type=positive, default=1, help="steps between checkpoints")
    run.add_argument("--timeout-seconds", type=float, default=60,
                     help="distributed: a rank waiting longer than this for another ends the run")


def stages_or_auto(text: str) -> int | str:
    """A positive int, or "auto" (the distributed engine: as many stages as ranks)."""
    return "auto" if text == "auto" else positive(text)


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _pipeline_options(args, made: run_models.RunModel) -> dict:
    """The keywords both engines take from the flags and the model."""
    points = [name.strip() for name in args.split_points.split(",")] if args.split_points else None
    if points is not None and isinstance(made.model, torch.nn.Sequential):
        raise ValueError("--split-points is for a model split by module names; pipelab's own models are cut "
                         "by --split")
    return dict(loss_fn=made.loss_fn, loss_normalization=made.loss_normalization, split_method=args.split,
                split_points=points, sample=made.inputs)


def _stage_names(partition) -> list[str]:
    if partition.method == "names" or not isinstance(partition.stages[0], torch.nn.Sequential):
        return [f"{stage.first_module} .. {stage.last_module}" for stage in partition.stages]
    return [f"blocks {a}..{b - 1}" for a, b in partition.bounds]


def _train(pipe, parameters, inputs, targets, args, show_progress: bool,
           resumable: Resumable | None = None) -> tuple[list[float], list[float], Trace]:
    optimizer = torch.optim.Adam(parameters, lr=args.lr)
    start = resumable.resume(pipe, optimizer) if resumable is not None else 0
    losses, step_seconds = [], []
    bar = tqdm(range(start, args.steps), desc=f"{pipe.schedule.name} p={pipe.n_stages} m={pipe.n_microbatches}",
               unit="step", disable=not show_progress, initial=start, total=args.steps)
    result = None
    for k in bar:
        optimizer.zero_grad(set_to_none=True)
        result = pipe.step(inputs, targets)
        optimizer.step()
        losses.append(result.loss)
        step_seconds.append(result.wall_seconds)
        bar.set_postfix(loss=f"{result.loss:.4f}")
        if resumable is not None:
            resumable.after_step(pipe, optimizer, k, result.loss, args.steps)
    if result is None:
        raise ValueError(f"nothing to run: the checkpoint in {args.checkpoint} already holds all {args.steps} "
                         "steps; give more --steps or another --checkpoint folder")
    return losses, step_seconds, result.trace


def train_local(args) -> RunSummary:
    if args.stages == "auto" or args.checkpoint is not None:
        raise ValueError("--stages auto and --checkpoint are for the distributed engine (torchrun ... -m "
                         "pipelab.launch, or pipelab run --backend distributed); give --stages a number")
    made = run_models.build(args)
    pipe = Pipeline(made.model, n_stages=args.stages, n_microbatches=args.microbatches, schedule=args.schedule,
                    devices=args.device, **_pipeline_options(args, made))
    losses, seconds, trace = _train(pipe, pipe.parameters(), made.inputs, made.targets, args, show_progress=True)
    return RunSummary(pipe.schedule.name, pipe.n_stages, pipe.n_microbatches, pipe.partition.bounds,
                      _stage_names(pipe.partition), pipe.partition.method, [str(d) for d in pipe.devices], "local", 1,
                      losses, seconds, trace)


def train_rank(args) -> RunSummary:
    """Train on this rank of the current process group (rank 0 shows the progress bar)."""
    made = run_models.build(args)
    device = None if args.device == "auto" else args.device
    pipe = DistributedPipeline(made.model, n_microbatches=args.microbatches, schedule=_schedule(args),
                               devices=device, **_pipeline_options(args, made))
    resumable = None if args.checkpoint is None else Resumable(args.checkpoint, args.checkpoint_every)
    losses, seconds, trace = _train(pipe, pipe.parameters(), made.inputs, made.targets, args,
                                    show_progress=dist.get_rank() == 0, resumable=resumable)
    return RunSummary(pipe.schedule.name, pipe.n_stages, pipe.n_microbatches, pipe.partition.bounds,
                      _stage_names(pipe.partition), pipe.partition.method, [str(pipe.device)], "distributed",
                      pipe.world_size, losses, seconds, trace)


def _schedule(args):
    """The named schedule for --stages devices, so that a world size that differs is named as such."""
    stages = dist.get_world_size() if args.stages == "auto" else args.stages
    return by_name(args.schedule, stages, args.microbatches)


def finish(summary: RunSummary, args) -> None:
    """Print the table; write the timeline PNG, the Chrome trace and (with --json) the figures."""
    print(report(summary))
    stem = f"{summary.schedule}_p{summary.n_stages}_m{summary.n_microbatches}"
    write_outputs(summary.trace, args.out / f"timeline_{stem}.png", args.out / f"trace_{stem}.json")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures(summary), indent=1))
        print(f"figures (JSON): {args.json}")


def figures(summary: RunSummary) -> dict:
    """The run's figures, for scripts and benchmarks."""
    trace = summary.trace
    return {
        "schedule": summary.schedule, "n_stages": summary.n_stages, "n_microbatches": summary.n_microbatches,
        "backend": summary.backend, "world_size": summary.world_size, "devices": summary.devices,
        "bounds": summary.bounds, "stages": summary.stage_names, "split": summary.split_method,
        "losses": summary.losses, "step_seconds": summary.step_seconds,
        "trace_source": trace.source, "trace_source_label": trace.source_label,
        "makespan_seconds": trace.makespan, "bubble_fraction": trace.bubble_fraction,
        "busy_seconds": trace.busy_time, "peak_inflight": trace.peak_inflight,
        "peak_activation_bytes": trace.peak_memory,
    }


def write_outputs(trace: Trace, png: Path, chrome: Path) -> None:
    """Save the timeline PNG and the Chrome trace, and say where they are."""
    from ..show import plot  # matplotlib loads only when a picture is written

    png.parent.mkdir(parents=True, exist_ok=True)
    plot.timeline(trace).savefig(png, dpi=120)
    trace.to_chrome_trace(chrome)
    print(f"\ntimeline: {png}\nChrome trace (open in Perfetto or chrome://tracing): {chrome}")


def report(summary: RunSummary) -> str:
    """The run's summary table: the last step's trace, per stage, and the training curve."""
    trace, losses = summary.trace, summary.losses
    busy, inflight, peak = trace.busy_time, trace.peak_inflight, trace.peak_memory
    device_of = {e.stage: e.device for e in trace.events}
    where = (f"devices {summary.devices}" if summary.backend == "local"
             else f"{summary.world_size} processes (torch.distributed), devices {summary.devices}")
    lines = [
        "",
        f"split ({summary.split_method}): {len(summary.stage_names)} stages, {where}",
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps; "
        f"median step {statistics.median(summary.step_seconds) * 1e3:.1f} ms (wall clock, engine included)",
        f"last step: makespan {trace.makespan * 1e3:.1f} ms, bubble fraction {trace.bubble_fraction:.1%}  "
        f"[{trace.source_label}]",
        "",
        f"{'stage':>5} {'busy ms':>9} {'peak in-flight':>15} {'peak activations':>17}   holds",
    ]
    for s in range(summary.n_stages):
        lines.append(f"{s:>5} {busy[device_of[s]] * 1e3:>9.2f} {inflight[s]:>15} {_bytes(peak[device_of[s]]):>17}   "
                     f"{summary.stage_names[s]}")
    return "\n".join(lines)


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)
