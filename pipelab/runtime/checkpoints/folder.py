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
makes the same choice (the load fails on all of them alike: `checkpoint.py`).
"""

from __future__ import annotations

import re
import shutil
import uuid
import warnings
from pathlib import Path

import torch.distributed as dist

from .checkpoint import CheckpointError

NAME = re.compile(r"^step-(\d{6})$")
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
        none).  A damaged one is set aside, with a warning, and the one before it read."""
        while True:
            found = self._agreed_newest(pipe)
            if found is None:
                return 0
            steps, path = found
            try:
                pipe.load_checkpoint(path, optimizer, extra=extra)
                return steps
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

    def _agreed_newest(self, pipe) -> tuple[int, Path] | None:
        """The newest checkpoint, as rank 0 sees it (every rank then reads the same one)."""
        found = [self.newest() if _lead(pipe) else None]
        if pipe.group is not None:
            dist.broadcast_object_list(found, group=pipe.group, group_src=0)
        return found[0]

    def _set_aside(self, pipe, path: Path, error: CheckpointError) -> None:
        """Rename a checkpoint that does not load out of the numbered ones, saying why."""
        if _lead(pipe):
            aside = path.with_name(f"{path.name}.damaged-{uuid.uuid4().hex[:6]}")
            path.rename(aside)
            warnings.warn(f"the newest checkpoint does not load ({error}); set aside as {aside.name}, reading the one "
                          "before it", stacklevel=3)
        if pipe.group is not None:
            dist.barrier(group=pipe.group)


def _lead(pipe) -> bool:
    return pipe.group is None or dist.get_rank(pipe.group) == 0
