"""The `pipelab` command: train with a pipeline, open the course, grade exercises.

    pipelab run --model mlp --stages 4 --microbatches 8 --schedule 1f1b [--steps N] [--device cpu|cuda] [--json F]
    pipelab run --backend distributed --nproc 4 ...      (one process per stage, torch.distributed)
    pipelab simulate --stages 8 --microbatches 32 --schedule 1f1b [--forward 1 --backward 2 --weight 0 --latency 0]
    pipelab lab [jupyter-lab options]
    pipelab grade [task]
    pipelab plan --sc21 145.6B | --layers L --hidden H --heads A --devices N --batch B ...   (rank every layout)
    pipelab search --stages 4 --microbatches 8 --weight 1 --memory-limit 6               (find a schedule)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

from ..common.errors import PipelineError
from .planning import add_plan_arguments, add_search_arguments, plan_command, search_command
from ..course.grade import main as grade_main
from ..predict.closed_forms import closed_form
from ..predict.costs import Costs
from ..predict.simulate import simulate as run_simulation
from ..runtime.launcher import torchrun
from ..runtime.launcher.processes import DistributedError, Interrupted, launch
from ..schedules import by_name
from ..schedules.action import Kind
from .run_report import finish, write_outputs
from .training import add_run_arguments, positive, train_local, train_rank

REPO_ROOT = Path(__file__).resolve().parents[2]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipelab", description="Understand pipeline parallelism by running it.")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="train a model with a pipeline schedule and report what happened")
    add_run_arguments(run)
    run.add_argument("--backend", choices=["local", "distributed"], default="local",
                     help="local: one process (pl.Pipeline); distributed: one process per stage (torch.distributed)")
    run.add_argument("--nproc", type=positive, default=None,
                     help="distributed: processes to start on this machine (default: --stages)")

    sim = commands.add_parser("simulate", help="predict a schedule's timeline from a cost model")
    sim.add_argument("--stages", type=positive, default=4)
    sim.add_argument("--microbatches", type=positive, default=8)
    sim.add_argument("--schedule", default="1f1b")
    sim.add_argument("--forward", type=float, default=1.0, help="seconds of one micro-batch's forward per stage")
    sim.add_argument("--backward", type=float, default=2.0,
                     help="seconds of one micro-batch's backward per stage (zb-h1: its input-gradient half)")
    sim.add_argument("--weight", type=float, default=0.0,
                     help="seconds of one micro-batch's weight-gradient half W per stage (zb-h1, which splits the "
                          "backward; the other schedules run whole backwards: add it to --backward)")
    sim.add_argument("--latency", type=float, default=0.0, help="seconds per message between stages")
    sim.add_argument("--out", type=Path, default=Path("pipelab-out"))

    commands.add_parser("lab", help="open the course (lessons/) in JupyterLab; other options go to jupyter lab",
                        add_help=False)

    commands.add_parser("grade", help="grade your exercises, task by task (pipelab grade --help)", add_help=False)
    commands.add_parser("torchrun", help="torchrun with its own arguments (pipelab torchrun --nproc-per-node 2 -m "
                                         "pipelab.launch ...); Ctrl-C says 'interrupted' and exits 130", add_help=False)

    planner = commands.add_parser("plan", help="rank every (dp, pp, tp) layout of a transformer on a cluster")
    add_plan_arguments(planner)
    search = commands.add_parser("search", help="find a schedule for a memory limit, beside the named ones")
    add_search_arguments(search)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["grade"]:  # everything after "grade" (options included) belongs to the grader
        return grade_main(argv[1:])
    if argv[:1] == ["lab"]:  # ... and after "lab" to jupyter lab (e.g. --no-browser --port 8899)
        return lab(argv[1:])
    if argv[:1] == ["torchrun"]:  # ... and after "torchrun" to torch's torchrun (runtime/launcher/torchrun.py)
        return torchrun.run(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "run":
        return run(args)
    if args.command == "plan":
        return plan_command(args)
    if args.command == "search":
        return search_command(args)
    return simulate(args)


def run(args: argparse.Namespace) -> int:
    try:
        if args.backend == "local":
            summary = train_local(args)
        else:
            if args.stages == "auto" and args.nproc is None:
                raise ValueError("--stages auto takes as many stages as ranks: give --nproc")
            nproc = args.stages if args.nproc is None else args.nproc
            gpus = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
            if gpus:
                args.device = "auto"  # each rank takes cuda:LOCAL_RANK
            summary = launch(train_rank, nproc, args, timeout_seconds=None, wait_timeout_seconds=args.timeout_seconds,
                             backend="nccl" if gpus else "gloo", threads=None)[0]
    except (ValueError, TypeError) as error:  # a usage error: exit code 2, as argparse's
        print(f"pipelab run: {error}", file=sys.stderr)
        return 2
    except (PipelineError, DistributedError) as error:  # a failure while it ran
        print(f"pipelab run: {error}", file=sys.stderr)
        return 2 if getattr(error, "usage_error", False) else 1
    except KeyboardInterrupt as interrupted:  # Ctrl-C (or SIGTERM to the launcher): every rank stopped; one line
        print(f"pipelab run: {interrupted or 'interrupted'}", file=sys.stderr)
        return 128 + (interrupted.signal if isinstance(interrupted, Interrupted) else 2)
    finish(summary, args)
    return 0


def simulate(args: argparse.Namespace) -> int:
    """Simulate the schedule on equal stages and print it beside its own closed form (predict/closed_forms.py)."""
    try:
        schedule = by_name(args.schedule, args.stages, args.microbatches)
        splits = Kind.W in {action.kind for action in schedule.all_actions()}
        if args.weight and not splits:
            raise ValueError(f"--weight is the weight-gradient half W of a split backward, and {schedule.name} "
                             "runs whole backwards: add t_W to --backward, or choose --schedule zb-h1")
        costs = Costs(forward=args.forward, backward=args.backward, weight=args.weight, latency=args.latency)
        trace = run_simulation(schedule, costs)
        form = closed_form(schedule.name, args.stages, args.microbatches, costs)
    except (ValueError, TypeError) as error:
        print(f"pipelab simulate: {error}", file=sys.stderr)
        return 2
    p, m = args.stages, args.microbatches
    print(schedule.to_text() if p * m <= 512 else f"(grid of {p} x {2 * (m + p - 1)} steps not printed)")
    times = f"t_F={args.forward}, t_B={args.backward}" + (f", t_W={args.weight}" if splits else "")
    print(f"\n{schedule.name}: p={p}, m={m}, {times}, latency={args.latency}")
    print(f"makespan {trace.makespan:.4g}   bubble fraction {trace.bubble_fraction:.2%}")
    print(f"formula ({form.source}), without communication: {form.describe()}")
    print(f"peak in-flight micro-batches per stage: {trace.peak_inflight}")
    stem = f"simulated_{schedule.name}_p{p}_m{m}"
    write_outputs(trace, args.out / f"{stem}.png", args.out / f"{stem}.json")
    return 0


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
