"""The training run behind `pipelab run` and `python -m pipelab.launch`, for either engine.

`train_local(args)` runs in this process (`pl.Pipeline`); `train_rank(args)` runs on each
rank of an initialised process group (`pl.DistributedPipeline`).  Both build the model and
its data (`run_models.py`), then train it one of two ways:

- one batch (pipelab's models, `transformers:<type>`, a factory returning a batch): the same
  batch for `--steps` steps, with `--checkpoint` through `resume.py` (numbered checkpoints and
  a loss log, what torchrun's elasticity restarts from);
- a loader (a factory returning one): `pl.train` over it for `--epochs` (`runtime/training_run.py`:
  any batch shape, clipping, held-out evaluation, checkpoints it resumes from mid-epoch).

Both return a `RunSummary`; `finish(summary, args)` (`run_report.py`) prints the table and writes
the timeline PNG, the Chrome trace and, with `--json`, the figures.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from . import run_models
from ..runtime.distributed import DistributedPipeline
from ..runtime.local import Pipeline
from ..runtime.training_run import train
from .resume import Resumable
from .run_report import RunSummary
from ..schedules import by_name

ONE_BATCH_STEPS = 10  # --steps when it is not given and the model trains on one batch
OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def add_run_arguments(run: argparse.ArgumentParser) -> None:
    """The flags of `pipelab run`, shared with `python -m pipelab.launch`."""
    run.add_argument("--model", default="mlp",
                     help="mlp, gpt, transformers:<model type> (e.g. transformers:gpt2) or package.module:factory "
                          "(returning (model, batch or loader, loss_fn or None[, held-out batches]): docs/cli.md)")
    run.add_argument("--config", default=None,
                     help="transformers: the config's key=value pairs, e.g. n_layer=8,n_embd=512,n_head=8")
    run.add_argument("--split-points", default=None,
                     help="a model split by names: the modules where stages 1, 2, ... begin, comma-separated "
                          "(default: its repeated blocks cut evenly into --stages)")
    run.add_argument("--seq-len", type=positive, default=64, help="transformers: tokens per sample")
    run.add_argument("--stages", type=stages_or_auto, default=4,
                     help="pipeline stages p; distributed: auto = the world size (what torchrun's elasticity gives)")
    run.add_argument("--microbatches", type=positive, default=8, help="micro-batches per step m")
    run.add_argument("--schedule", default="1f1b",
                     help="gpipe, 1f1b, zb-h1, or auto (chosen with the cut by simulating each on measured costs)")
    run.add_argument("--steps", type=positive, default=None,
                     help=f"one batch: steps to train on it (default {ONE_BATCH_STEPS}); a loader: stop after this "
                          "many steps (default: every epoch)")
    run.add_argument("--epochs", type=positive, default=None, help="a factory's loader: passes over it (default 1)")
    run.add_argument("--loss-normalization", choices=["auto", "samples", "tokens"], default="auto",
                     help="how micro-batches' losses are weighed: samples, tokens (counted labels, exact with padding)"
                          " or auto (tokens for the model's own loss or a loss with an ignore_index, else samples)")
    run.add_argument("--clip", type=positive_float, default=None,
                     help="clip the gradients' global norm to this (as torch.nn.utils.clip_grad_norm_ on one device)")
    run.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam",
                     help="sgd moves each parameter by --lr times its gradient (what the tests compare)")
    run.add_argument("--eval-every", type=positive, default=None,
                     help="a factory's held-out batches: evaluate every this many steps (default: at the end)")
    run.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (distributed: auto, cpu or cuda)")
    run.add_argument("--batch-size", type=positive, default=64)
    run.add_argument("--depth", type=positive, default=8, help="blocks of the MLP / transformer layers of the GPT")
    run.add_argument("--width", type=positive, default=256, help="MLP width / GPT d_model")
    run.add_argument("--split", choices=["uniform", "params", "time", "auto"], default="uniform",
                     help="where to cut: equal blocks, parameters, measured time, or auto (the predicted fastest "
                          "step among every cut and schedule, inside blocks too)")
    run.add_argument("--lr", type=float, default=1e-3)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--out", type=Path, default=Path("pipelab-out"), help="folder for the PNG and the Chrome trace")
    run.add_argument("--json", type=Path, default=None, help="also write the run's figures to this JSON file")
    run.add_argument("--checkpoint", type=Path, default=None,
                     help="a folder every rank sees: resume from its newest checkpoint and save into it every "
                          "--checkpoint-every steps (one batch: with a log of each step's loss, commands/resume.py)")
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


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def train_local(args) -> RunSummary:
    if args.stages == "auto":
        raise ValueError("--stages auto is for the distributed engine (torchrun ... -m pipelab.launch, or pipelab "
                         "run --backend distributed): give --stages a number")
    made = _built(args)
    pipe = Pipeline(made.model, n_stages=args.stages, n_microbatches=args.microbatches, schedule=args.schedule,
                    devices=args.device, **_pipeline_options(args, made))
    return _summary(pipe, _run(pipe, made, args, show_progress=True), "local", [str(d) for d in pipe.devices], 1)


def train_rank(args) -> RunSummary:
    """Train on this rank of the current process group (rank 0 shows the progress bar)."""
    made = _built(args)
    device = None if args.device == "auto" else args.device
    pipe = DistributedPipeline(made.model, n_microbatches=args.microbatches, schedule=_schedule(args),
                               devices=device, **_pipeline_options(args, made))
    ran = _run(pipe, made, args, show_progress=dist.get_rank() == 0)
    return _summary(pipe, ran, "distributed", [str(pipe.device)], pipe.world_size)


def _built(args) -> run_models.RunModel:
    """The model and its data, the flags checked against them: --epochs and --eval-every need a loader."""
    made = run_models.build(args)
    if made.batches is None:
        wrong = [flag for flag, value in (("--epochs", args.epochs), ("--eval-every", args.eval_every)) if value]
        if wrong:
            raise ValueError(f"{wrong[0]} is for a factory that returns a loader (docs/cli.md); {args.model} trains "
                             "on one batch, for --steps steps")
    elif args.eval_every is not None and made.held_out is None:
        raise ValueError("--eval-every evaluates the held-out batches a factory returns as its fourth element; "
                         f"{args.model} returns none")
    return made


def _pipeline_options(args, made: run_models.RunModel) -> dict:
    """The keywords both engines take from the flags and the model."""
    points = [name.strip() for name in args.split_points.split(",")] if args.split_points else None
    if points is not None and isinstance(made.model, torch.nn.Sequential):
        raise ValueError("--split-points is for a model split by module names; pipelab's own models are cut "
                         "by --split")
    deciding = "auto" in (args.split, args.schedule)
    sample = (made.inputs, made.targets) if deciding and made.targets is not None else made.inputs
    return dict(loss_fn=made.loss_fn, loss_normalization=args.loss_normalization, split_method=args.split,
                split_points=points, sample=sample)


def _run(pipe, made: run_models.RunModel, args, show_progress: bool) -> tuple:
    """(losses, step seconds, last step's result, held-out losses) of the run the model's data asks for."""
    optimizer = OPTIMIZERS[args.optimizer](pipe.parameters(), lr=args.lr)
    if made.batches is not None:
        return _over_loader(pipe, made, optimizer, args, show_progress)
    resumable = None if args.checkpoint is None else Resumable(args.checkpoint, args.checkpoint_every)
    return _on_one_batch(pipe, made, optimizer, args, show_progress, resumable)


def _on_one_batch(pipe, made, optimizer, args, show_progress: bool, resumable: Resumable | None) -> tuple:
    steps = ONE_BATCH_STEPS if args.steps is None else args.steps
    start = resumable.resume(pipe, optimizer) if resumable is not None else 0
    losses, step_seconds = [], []
    bar = tqdm(range(start, steps), desc=f"{pipe.schedule.name} p={pipe.n_stages} m={pipe.n_microbatches}",
               unit="step", disable=not show_progress, initial=start, total=steps)
    result = None
    for k in bar:
        optimizer.zero_grad(set_to_none=True)
        result = pipe.step(made.inputs, made.targets)
        if args.clip is not None:
            pipe.clip_grad_norm_(args.clip)
        optimizer.step()
        losses.append(result.loss)
        step_seconds.append(result.wall_seconds)
        bar.set_postfix(loss=f"{result.loss:.4f}")
        if resumable is not None:
            resumable.after_step(pipe, optimizer, k, result.loss, steps)
    if result is None:
        raise ValueError(f"nothing to run: the checkpoint in {args.checkpoint} already holds all {steps} "
                         "steps; give more --steps or another --checkpoint folder")
    return losses, step_seconds, result, {}


def _over_loader(pipe, made, optimizer, args, show_progress: bool) -> tuple:
    """`pl.train` over the factory's loader: its checkpoints (which hold where the run was) let a run started again
    go on mid-epoch with the losses of one never stopped."""
    seconds = []
    step = pipe.step

    def timed_step(inputs, targets=None):
        result = step(inputs, targets)
        seconds.append(result.wall_seconds)
        return result

    # each step's wall clock, as one batch's run reports it: `TrainingRun` keeps the losses but not the results,
    # so this pipeline's own `step` notes them for the duration of the run
    pipe.step = timed_step
    try:
        run = train(pipe, made.batches, optimizer, epochs=args.epochs or 1, clip=args.clip, held_out=made.held_out,
                    eval_every=args.eval_every, checkpoint_dir=args.checkpoint,
                    checkpoint_every=args.checkpoint_every if args.checkpoint is not None else None,
                    seed=args.seed, max_steps=args.steps, progress=show_progress)
    finally:
        del pipe.step
    if run.last is None:
        raise ValueError(f"nothing to run: the checkpoint in {args.checkpoint} already holds all {run.steps} steps "
                         "of the run; give more --epochs or --steps, or another --checkpoint folder")
    return run.losses, seconds, run.last, run.eval_losses


def _summary(pipe, ran: tuple, backend: str, devices: list[str], world_size: int) -> RunSummary:
    losses, seconds, last, eval_losses = ran
    partition = pipe.partition
    return RunSummary(pipe.schedule.name, pipe.n_stages, pipe.n_microbatches, partition.bounds,
                      _stage_names(partition), partition.method, devices, backend, world_size, losses, seconds,
                      last.trace, eval_losses, None if pipe.plan is None else pipe.plan.table(5))


def _stage_names(partition) -> list[str]:
    if partition.method == "names" or not isinstance(partition.stages[0], torch.nn.Sequential):
        return [f"{stage.first_module} .. {stage.last_module}" for stage in partition.stages]
    return [f"blocks {a}..{b - 1}" for a, b in partition.bounds]


def _schedule(args):
    """The schedule's name where --stages is the world size (the engine then rebuilds it for a batch smaller than
    m, an epoch's partial last batch); else the named schedule for --stages devices, so that a world size that
    differs is named as such."""
    if args.stages == "auto" or args.stages == dist.get_world_size():
        return args.schedule
    if args.schedule == "auto":
        raise ValueError(f"--schedule auto decides for one stage per process: give --stages {dist.get_world_size()} "
                         "(the world size) or --stages auto")
    return by_name(args.schedule, args.stages, args.microbatches)

