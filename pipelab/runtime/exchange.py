"""The end of a distributed step: every rank's record of it, on every rank, in one exchange.

A rank's `StepRecord` holds one row per action of its list (`COLUMNS`, on rank 0's clock; NaN
where a value does not apply) and its observed memory changes (time, device, bytes, reason).
It travels as one float64 tensor (`to_tensor` / `from_tensor`): the rows, padded to the longest
list of any rank; room for `room` changes; and how many this rank has.  `StepExchange` moves
it: on gloo each rank sends its tensor straight to every other, into receives posted before
the step's first action (one hop after the last rank finishes, where gloo's ring all_gather
takes p - 1); on NCCL, where posting both directions at once could deadlock, one all_gather.
The room is the most changes any rank had in an earlier step; when a rank has more (the first
step, new shapes), a second exchange sends the changes padded to the new most.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..common.errors import PipelineError
from . import comm_count
from .p2p import wait

from .trace_builder import COLUMNS
CHANGE = 4  # values per observed memory change: time, device, bytes (+ or -), reason


@dataclass
class StepRecord:
    """What one rank did in a step: `rows[k]` for the k-th action of its list (`COLUMNS`), and `observed`."""

    rows: list[list[float]]
    observed: list[tuple[float, int, int, int]]

    @staticmethod
    def numel(n_rows: int, room: int) -> int:
        return n_rows * len(COLUMNS) + room * CHANGE + 1

    def to_tensor(self, n_rows: int, room: int) -> torch.Tensor:
        """The rows padded to `n_rows`, then `room` changes (all of them, or none if they do not fit), then
        how many changes there are."""
        table = torch.full((n_rows, len(COLUMNS)), math.nan, dtype=torch.float64)
        if self.rows:
            table[:len(self.rows)] = torch.tensor(self.rows, dtype=torch.float64)
        return torch.cat([table.flatten(), _padded(self.observed, room), torch.tensor([float(len(self.observed))],
                                                                                   dtype=torch.float64)])

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, n_rows: int, room: int) -> tuple["StepRecord", int]:
        """The record in `tensor` (its changes when they fit the room), and how many changes its rank had."""
        rows = tensor[:n_rows * len(COLUMNS)].view(n_rows, len(COLUMNS)).tolist()
        count = int(tensor[-1])
        changes = tensor[n_rows * len(COLUMNS):-1].view(room, CHANGE)[:count] if count <= room else []
        return cls(rows, _changes(changes)), count


def _padded(observed: list[tuple], room: int) -> torch.Tensor:
    rows = torch.full((room, CHANGE), math.nan, dtype=torch.float64)
    if observed and len(observed) <= room:
        rows[:len(observed)] = torch.tensor(observed, dtype=torch.float64)
    return rows.flatten()


def _changes(rows) -> list[tuple[float, int, int, int]]:
    return [(t, int(device), int(delta), int(why)) for t, device, delta, why in (rows.tolist() if len(rows) else [])]


class StepExchange:
    """Every rank's `StepRecord`, on every rank (module docstring)."""

    def __init__(self, group, rank: int, world_size: int, device: torch.device, backend: str, tag: int, n_rows: int):
        self.group, self.rank, self.world_size, self.device = group, rank, world_size, device
        self.backend, self.tag, self.n_rows = backend, tag, n_rows
        self.room = 0  # observed changes each rank's tensor has room for
        self.posted: dict[int, tuple[torch.Tensor, object]] = {}  # peer -> (buffer, receive work)

    def post(self) -> None:
        """gloo: post the receives of this step's exchange now, before the step's first action."""
        if self.backend == "gloo":
            self.posted = self._post(StepRecord.numel(self.n_rows, self.room))

    def gather(self, record: StepRecord) -> list[StepRecord]:
        """Every rank's record, by rank."""
        gathered = self._all_gather(record.to_tensor(self.n_rows, self.room))
        found = [StepRecord.from_tensor(t, self.n_rows, self.room) for t in gathered]
        most = max(count for _, count in found)
        if most > self.room:  # a rank had more changes than there was room for: send them all again
            self.room = most
            changes = self._all_gather(_padded(record.observed, most))
            return [StepRecord(r.rows, _changes(c.view(most, CHANGE)[:count]))
                    for (r, count), c in zip(found, changes)]
        return [r for r, _ in found]

    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if self.backend != "gloo":
            local = tensor.to(self.device)
            gathered = [torch.empty_like(local) for _ in range(self.world_size)]
            dist.all_gather(gathered, local, group=self.group)
            return [t.cpu() for t in gathered]
        receives, self.posted = self.posted or self._post(tensor.numel()), {}
        if any(buffer.numel() != tensor.numel() for buffer, _ in receives.values()):
            raise PipelineError(f"an exchange of {tensor.numel()} values into receives posted for another size")
        tensor = tensor.contiguous()
        with comm_count.label("other"):  # the trace's, not the pipeline's messages
            sends = [dist.isend(tensor, group=self.group, group_dst=peer, tag=self.tag)
                     for peer in range(self.world_size) if peer != self.rank]
        for peer, (_, work) in receives.items():
            wait(work, self.rank, peer, "exchanging the step's trace", self.group)
        for work in sends:
            wait(work, self.rank, None, "sending its part of the step's trace")
        return [tensor if peer == self.rank else receives[peer][0] for peer in range(self.world_size)]

    def _post(self, numel: int) -> dict[int, tuple[torch.Tensor, object]]:
        with comm_count.label("other"):
            return {peer: (buffer, dist.irecv(buffer, group=self.group, group_src=peer, tag=self.tag))
                    for peer in range(self.world_size) if peer != self.rank
                    for buffer in [torch.empty(numel, dtype=torch.float64)]}
