"""A training run that survives its ranks: numbered checkpoints, the newest one found, a loss log.

    run = Resumable(folder, every=1)
    start = run.resume(pipe, optimizer)          # 0, or the step of the newest complete checkpoint
    for k in range(start, steps):
        ...one step...
        run.after_step(pipe, optimizer, k, loss, steps)   # logs the loss; saves at every `every`-th step

Used by `pipelab run --checkpoint DIR` (one process, or one per stage) and by `pipelab.launch --checkpoint DIR`
under torchrun's elasticity (`--nnodes MIN:MAX`): when a host
leaves or joins, torchrun restarts every rank in a new world; each builds the pipeline at the depth the new
world holds and reads the newest checkpoint (`runtime/checkpoints/checkpoint.py` reshards it to any depth, optimizer
state included), so training goes on from the step it saved, on the same batch, with the same Adam moments.

Layout of `folder` (it must be one folder every rank sees: one machine, or a shared file system):
    step-000012/   a checkpoint after 12 steps (written whole or not at all; the two newest are kept)
    losses.jsonl   one line per step run: {"step": k (1-based), "loss": ..., "stages": p, "world": n};
                   a step run again after a restart appears again: the last line of a step is the one kept
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from ..runtime.checkpoints.folder import CheckpointFolder


class Resumable:
    def __init__(self, folder: str | Path, every: int = 1):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"checkpoint every must be a positive number of steps, got {every!r}")
        self.folder, self.every = Path(folder).absolute(), every
        self.checkpoints = CheckpointFolder(self.folder)

    def newest(self) -> tuple[int, Path] | None:
        """(steps done, folder) of the newest checkpoint, or None."""
        return self.checkpoints.newest()

    def resume(self, pipe, optimizer) -> int:
        """Load the newest checkpoint that loads into `pipe` and `optimizer` on every rank (a damaged one set
        aside: `CheckpointFolder.resume`); the number of steps it holds."""
        return self.checkpoints.resume(pipe, optimizer)

    def after_step(self, pipe, optimizer, step: int, loss: float, n_steps: int) -> None:
        """Log step `step` (0-based) and save after every `every`-th step and after the last."""
        done = step + 1
        ranks = pipe.group is not None  # a DistributedPipeline's (one process: None)
        if not ranks or dist.get_rank() == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / "losses.jsonl", "a") as log:
                log.write(json.dumps({"step": done, "loss": loss, "stages": pipe.n_stages,
                                      "world": dist.get_world_size() if ranks else 1}) + "\n")
        if done % self.every and done != n_steps:
            return
        self.checkpoints.save(pipe, optimizer, done)


def logged_losses(folder: str | Path) -> dict[int, dict]:
    """{step (1-based): its last logged line} from `folder`/losses.jsonl."""
    found = {}
    for line in (Path(folder) / "losses.jsonl").read_text().splitlines():
        entry = json.loads(line)
        found[entry["step"]] = entry
    return found
