"""A training run that survives its ranks: numbered checkpoints, the newest one found, a loss log.

    run = Resumable(folder, every=1)
    start = run.resume(pipe, optimizer)          # 0, or the step of the newest complete checkpoint
    for k in range(start, steps):
        ...one step...
        run.after_step(pipe, optimizer, k, loss, steps)   # logs the loss; saves at every `every`-th step

Used by `pipelab.launch --checkpoint DIR` under torchrun's elasticity (`--nnodes MIN:MAX`): when a host
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
import re
import shutil
from pathlib import Path

import torch.distributed as dist

NAME = re.compile(r"^step-(\d{6})$")
KEEP = 2


class Resumable:
    def __init__(self, folder: str | Path, every: int = 1):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"checkpoint every must be a positive number of steps, got {every!r}")
        self.folder, self.every = Path(folder).absolute(), every

    def newest(self) -> tuple[int, Path] | None:
        """(steps done, folder) of the newest checkpoint, or None (one being written is named
        step-NNNNNN.tmp-... until it is whole: `checkpoint.save`)."""
        found = sorted((int(m.group(1)), p) for p in self.folder.glob("step-*") if (m := NAME.match(p.name)))
        return found[-1] if found else None

    def resume(self, pipe, optimizer) -> int:
        """Load the newest checkpoint into `pipe` and `optimizer` on every rank; the number of steps it holds
        (rank 0 picks it, so that every rank reads the same one)."""
        found = [self.newest() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(found, src=0)
        if found[0] is None:
            return 0
        steps, path = found[0]
        pipe.load_checkpoint(path, optimizer)
        return steps

    def after_step(self, pipe, optimizer, step: int, loss: float, n_steps: int) -> None:
        """Log step `step` (0-based) and save after every `every`-th step and after the last."""
        done = step + 1
        if dist.get_rank() == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / "losses.jsonl", "a") as log:
                log.write(json.dumps({"step": done, "loss": loss, "stages": pipe.n_stages,
                                      "world": dist.get_world_size()}) + "\n")
        if done % self.every and done != n_steps:
            return
        pipe.save_checkpoint(self.folder / f"step-{done:06d}", optimizer, overwrite=True)
        if dist.get_rank() == 0:
            saved = sorted(p for p in self.folder.glob("step-*") if NAME.match(p.name))
            for old in saved[:-KEEP]:
                shutil.rmtree(old, ignore_errors=True)


def logged_losses(folder: str | Path) -> dict[int, dict]:
    """{step (1-based): its last logged line} from `folder`/losses.jsonl."""
    found = {}
    for line in (Path(folder) / "losses.jsonl").read_text().splitlines():
        entry = json.loads(line)
        found[entry["step"]] = entry
    return found
