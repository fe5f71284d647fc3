"""The `pipelab` command: train with a pipeline, open the course, grade exercises.

    pipelab run --model mlp --stages 4 --microbatches 8 --schedule 1f1b [--steps N] [--device cpu|cuda]
    pipelab simulate --stages 8 --microbatches 32 --schedule 1f1b
    pipelab lab [jupyter-lab options]
    pipelab grade [task]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipelab", description="Understand pipeline parallelism by running it.")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="train a model with a pipeline schedule and report what happened")
    run.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    run.add_argument("--stages", type=_positive, default=4, help="pipeline stages p")
    run.add_argument("--microbatches", type=_positive, default=8, help="micro-batches per step m")
    run.add_argument("--schedule", default="1f1b", help="gpipe or 1f1b")
    run.add_argument("--steps", type=_positive, default=10)
    run.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    run.add_argument("--batch-size", type=_positive, default=64)
    run.add_argument("--depth", type=_positive, default=8, help="blocks of the MLP / transformer layers of the GPT")
    run.add_argument("--width", type=_positive, default=256, help="MLP width / GPT d_model")
    run.add_argument("--split", choices=["uniform", "params", "time"], default="uniform")
    run.add_argument("--lr", type=float, default=1e-3)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--out", type=Path, default=Path("pipelab-out"), help="folder for the PNG and the Chrome trace")

    sim = commands.add_parser("simulate", help="predict a schedule's timeline from a cost model")
    sim.add_argument("--stages", type=_positive, default=4)
    sim.add_argument("--microbatches", type=_positive, default=8)
    sim.add_argument("--schedule", default="1f1b")
    sim.add_argument("--forward", type=float, default=1.0, help="seconds of one micro-batch's forward per stage")
    sim.add_argument("--backward", type=float, default=2.0, help="seconds of one micro-batch's backward per stage")
    sim.add_argument("--latency", type=float, default=0.0, help="seconds per message between stages")
    sim.add_argument("--out", type=Path, default=Path("pipelab-out"))

    commands.add_parser("lab", help="open the course (lessons/) in JupyterLab; other options go to jupyter lab",
                        add_help=False)

    commands.add_parser("grade", help="grade your exercises, task by task (pipelab grade --help)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["grade"]:  # everything after "grade" (options included) belongs to the grader
        from .grade import main as grade_main

        return grade_main(argv[1:])
    if argv[:1] == ["lab"]:  # ... and after "lab" to jupyter lab (e.g. --no-browser --port 8899)
        return lab(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "run":
        return run(args)
    return simulate(args)


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    import pipelab as pl

    if args.model == "mlp":
        model = pl.models.mlp(depth=args.depth, width=args.width, seed=args.seed)
    else:
        model = pl.models.tiny_gpt(n_layers=args.depth, d_model=args.width, n_heads=4, seed=args.seed)
    inputs, targets = pl.models.sample_batch(model, args.batch_size, seed=args.seed)
    try:
        pipe = pl.Pipeline(model, args.stages, args.microbatches, args.schedule, pl.models.default_loss(model),
                           devices=args.device, split_method=args.split, sample=inputs)
    except (ValueError, TypeError) as error:
        print(f"pipelab run: {error}", file=sys.stderr)
        return 2
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses, step_seconds = [], []
    bar = tqdm(range(args.steps), desc=f"{pipe.schedule.name} p={args.stages} m={args.microbatches}", unit="step")
    for _ in bar:
        optimizer.zero_grad(set_to_none=True)
        result = pipe.step(inputs, targets)
        optimizer.step()
        losses.append(result.loss)
        step_seconds.append(result.wall_seconds)
        bar.set_postfix(loss=f"{result.loss:.4f}")
    trace = result.trace
    print(report(pipe, trace, losses, step_seconds))
    stem = f"{pipe.schedule.name}_p{args.stages}_m{args.microbatches}"
    write_outputs(trace, args.out / f"timeline_{stem}.png", args.out / f"trace_{stem}.json")
    return 0


def write_outputs(trace, png: Path, chrome: Path) -> None:
    """Save the timeline PNG and the Chrome trace, and say where they are."""
    import pipelab as pl

    png.parent.mkdir(parents=True, exist_ok=True)
    pl.plot.timeline(trace).savefig(png, dpi=120)
    trace.to_chrome_trace(chrome)
    print(f"\ntimeline: {png}\nChrome trace (open in Perfetto or chrome://tracing): {chrome}")


def simulate(args: argparse.Namespace) -> int:
    import pipelab as pl

    try:
        schedule = pl.schedules.by_name(args.schedule, args.stages, args.microbatches)
        trace = pl.simulate(schedule, pl.Costs(forward=args.forward, backward=args.backward, latency=args.latency))
    except (ValueError, TypeError) as error:
        print(f"pipelab simulate: {error}", file=sys.stderr)
        return 2
    p, m = args.stages, args.microbatches
    print(schedule.to_text() if p * m <= 512 else f"(grid of {p} x {2 * (m + p - 1)} steps not printed)")
    print(f"\n{schedule.name}: p={p}, m={m}, t_F={args.forward}, t_B={args.backward}, latency={args.latency}")
    print(f"makespan {trace.makespan:.4g}   bubble fraction {trace.bubble_fraction:.2%}   "
          f"(formula (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.2%}, without communication)")
    print(f"peak in-flight micro-batches per stage: {trace.peak_inflight}")
    stem = f"simulated_{schedule.name}_p{p}_m{m}"
    write_outputs(trace, args.out / f"{stem}.png", args.out / f"{stem}.json")
    return 0


def report(pipe, trace, losses: list[float], step_seconds: list[float]) -> str:
    """The run's summary table: the last step's trace, per stage, and the training curve."""
    busy, inflight, peak = trace.busy_time, trace.peak_inflight, trace.peak_memory
    device_of = pipe.schedule.device_of_stage()
    lines = [
        "",
        f"model {type(pipe.model).__name__} split {pipe.partition.bounds} ({pipe.partition.method}), "
        f"devices {[str(d) for d in pipe.devices]}",
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps; "
        f"median step {statistics.median(step_seconds) * 1e3:.1f} ms (wall clock, engine included)",
        f"last step: makespan {trace.makespan * 1e3:.1f} ms, bubble fraction {trace.bubble_fraction:.1%}  "
        f"[{trace.source_label}]",
        "",
        f"{'stage':>5} {'blocks':>9} {'busy ms':>9} {'peak in-flight':>15} {'peak activations':>17}",
    ]
    for s in range(pipe.n_stages):
        a, b = pipe.partition.bounds[s]
        lines.append(f"{s:>5} {f'{a}..{b - 1}':>9} {busy[device_of[s]] * 1e3:>9.2f} {inflight[s]:>15} "
                     f"{_bytes(peak[device_of[s]]):>17}")
    return "\n".join(lines)


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def lab(jupyter_args: list[str]) -> int:
    """Open JupyterLab on the course's lessons folder."""
    lessons = REPO_ROOT / "lessons"
    if not lessons.is_dir():
        print(f"pipelab lab: no lessons folder at {lessons}; install pipelab from a clone of the course "
              "(`pip install -e .` in the repository)", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={lessons}", *jupyter_args]
    if hasattr(os, "geteuid") and os.geteuid() == 0 and "--allow-root" not in command:
        command.append("--allow-root")  # containers and cloud machines often run as root; JupyterLab refuses otherwise
    print("Opening the course:", " ".join(command))
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
