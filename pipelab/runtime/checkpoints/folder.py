"""A folder of numbered checkpoints, the newest intact one found: what a resumable training run reads and writes.

    folder = CheckpointFolder(path)
    done = folder.resume(pipe, optimizer, extra)   # 0, or the steps held by the newest checkpoint that loads
    ... one step ...
    folder.save(pipe, optimizer, done, extra)      # step-NNNNNN, written whole or not at all; the two newest kept

`step-000012/` is a checkpoint after 12 steps (`checkpoint.save`: a directory renamed into place once
complete, its files checksummed in its manifest).  A newest checkpoint that does not load (a file
truncated or damaged since: `CheckpointError`) is set aside as `step-000012.damaged-<id>` with a
warning naming what is wrong, and the one before it is read instead: a run killed while its disk
failed goes on from the last good state rather than failing at every restart.  On ranks, every rank
makes the same choice (the load fails on all of them alike: `checkpoint.py`).  A folder whose checkpoints
were all set aside (nothing intact) is an error naming the folder, never a silent start from scratch; so is a
whole checkpoint of another model or optimizer (`CheckpointMismatchError`: not set aside, it is not damaged).
"""

from __future__ import annotations

import re
import shutil
import uuid
import warnings
from pathlib import Path

import torch.distributed as dist

from .checkpoint import CheckpointError, CheckpointMismatchError
from .sharded import group_of

NAME = re.compile(r"^step-(\d{6})$")
DAMAGED = re.compile(r"^step-(\d{6})\.damaged-")
KEEP = 2


class CheckpointFolder:
    """Numbered checkpoints in one folder every rank sees (one machine, or a shared file system)."""

    def __init__(self, folder, keep: int = KEEP):
        self.folder, self.keep = Path(folder).absolute(), keep

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(steps done, path) of every complete checkpoint, oldest first (one being written is named
        step-NNNNNN.tmp-... until it is whole)."""
        return sorted((int(m.group(1)), p) for p in self.folder.glob("step-*") if (m := NAME.match(p.name)))

    def newest(self) -> tuple[int, Path] | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def resume(self, pipe, optimizer, extra: dict | None = None) -> int:
        """Load the newest checkpoint that loads into `pipe`, `optimizer` and `extra`; the steps it holds (0:
        none).  A damaged one is set aside, with a warning, and the one before it read; none intact (all set
        aside) or one of another model is a `CheckpointError` naming the folder and what to do."""
        while True:
            found, damaged = self._agreed_newest(pipe)
            if found is None:
                if damaged:
                    raise CheckpointError(
                        f"no checkpoint in {self.folder} is intact: {', '.join(damaged)} did not load and were set "
                        "aside (the warnings said why); move an intact checkpoint there as step-NNNNNN to resume "
                        "from it, or delete the set-aside ones (or give another folder) to start the run afresh")
                return 0
            steps, path = found
            try:
                pipe.load_checkpoint(path, optimizer, extra=extra)
                return steps
            except CheckpointMismatchError as error:
                raise CheckpointMismatchError(
                    f"cannot resume from the checkpoints in {self.folder}: {error}. It is whole, not set aside: "
                    "resume with the model and optimizer it was saved from, or give another folder (or empty this "
                    "one) to start afresh") from error
            except CheckpointError as error:
                self._set_aside(pipe, path, error)

    def save(self, pipe, optimizer, steps: int, extra: dict | None = None) -> Path:
        """Save after `steps` steps as step-NNNNNN (replacing one of that number), then keep only the newest
        `keep`."""
        path = self.folder / f"step-{steps:06d}"
        pipe.save_checkpoint(path, optimizer, overwrite=True, extra=extra)
        if _lead(pipe):
            for _, old in self.checkpoints()[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        return path

    def damaged(self) -> list[str]:
        """The names of the checkpoints set aside as damaged, oldest first."""
        return sorted(p.name for p in self.folder.glob("step-*") if DAMAGED.match(p.name))

    def _agreed_newest(self, pipe) -> tuple[tuple[int, Path] | None, list[str]]:
        """The newest checkpoint and the damaged ones, as rank 0 sees them (every rank then reads the same)."""
        found = [(self.newest(), self.damaged()) if _lead(pipe) else None]
        if group_of(pipe) is not None:
            dist.broadcast_object_list(found, group=group_of(pipe), group_src=0)
        return found[0]

    def _set_aside(self, pipe, path: Path, error: CheckpointError) -> None:
        """Rename a checkpoint that does not load out of the numbered ones, saying why."""
        if _lead(pipe):
            aside = path.with_name(f"{path.name}.damaged-{uuid.uuid4().hex[:6]}")
            path.rename(aside)
            warnings.warn(f"the newest checkpoint does not load ({error}); set aside as {aside.name}, reading the one "
                          "before it", stacklevel=3)
        if group_of(pipe) is not None:
            dist.barrier(group=group_of(pipe))


def _lead(pipe) -> bool:
    """Rank 0 of the ranks that write the pipeline's checkpoints (one, under a hybrid layout's several replicas)."""
    group = group_of(pipe)
    return group is None or dist.get_rank(group) == 0
