"""The ranks of a distributed pipeline agree on its configuration, or every one of them says where they differ.

Every rank builds `DistributedPipeline` with its own arguments; ranks given different ones
(another m, another schedule, another model) would otherwise fail later, with a message about
a tensor's size or a tag, hang, or worse, run and give another loss.  The ranks all-gather a
few short fields and compare them:

- at start-up, before any other communication: the pipeline depth p, the micro-batches m, the
  schedule's name and a hash of its action table, the layout, a hash of the model's parameter
  names and shapes, and the loss normalization (`fields`);
- once the model is cut: the cut (each stage's first and last module) and a hash of the
  parameters' values (models built from different seeds would train apart for good: a tied
  embedding's copies would never agree) (`cut_fields`);
- at every step: the batch each rank was given, its shapes and a checksum of its values (a
  batch that differs only in padding would weigh the micro-batches otherwise on each rank)
  (`batch_fields`; one 8-byte all-gather when they agree, `agree_quickly`).

A difference raises, on every rank alike:

    ValueError: ranks 0 and 1 disagree on n_microbatches: 4 vs 8 (...)
"""

from __future__ import annotations

import hashlib
import json
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from ..model import microbatch
from ..schedules.schedule import Schedule
from . import comm_count

SIZE = 1024  # bytes per rank in the all-gather: the fields as JSON, zero-padded
_LONGEST = 120  # characters kept of one field's value


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def model_structure(model: nn.Module) -> str:
    """The model's parameter names, shapes and dtypes, as a count and a hash."""
    described = [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()]
    count = sum(p.numel() for p in model.parameters())
    return f"{len(described)} tensors, {count} values, hash {_digest(repr(described))}"


def schedule_table(schedule: Schedule) -> str:
    """A hash of the schedule's action table (with `asynchronous` and `update_every`)."""
    table = [[str(a) for a in row] for row in schedule.actions]
    return _digest(repr((schedule.n_stages, schedule.n_microbatches, table, schedule.asynchronous,
                         schedule.update_every)))


def fields(schedule: Schedule, n_microbatches: int, layout, model: nn.Module, loss_normalization: str) -> dict:
    """What the ranks must agree on, by name, as short strings."""
    return {
        "n_stages": str(schedule.n_stages),
        "n_microbatches": str(n_microbatches),
        "schedule": str(schedule.name),
        "the schedule's action table": schedule_table(schedule),
        "layout": str(layout),
        "model structure (parameter names and shapes)": model_structure(model),
        "loss_normalization": str(loss_normalization),
    }


def cut_fields(partition, model: nn.Module) -> dict:
    """The cut (each stage's first and last module, or its blocks) and a hash of the parameters' values, taken
    before a rank frees the other ranks' stages."""
    if hasattr(partition.stages[0], "first_module"):  # a split by names
        cut = "; ".join(f"{stage.first_module} .. {stage.last_module}" for stage in partition.stages)
    else:
        cut = "; ".join(f"blocks {a}..{b - 1}" for a, b in partition.bounds)
    return {"the cut (each stage's first and last module)": f"hash {_digest(cut)}: {cut}",
            "the parameters' values at start (a hash)": values_hash(model)}


def values_hash(model: nn.Module) -> str:
    """A hash of every parameter's and buffer's values (on the CPU), in the model's order; not taken when part of
    the model is on the "meta" device (a second pipeline over a model a first one already cut: each rank then
    holds its own stages only)."""
    named = [*model.named_parameters(), *model.named_buffers()]
    if any(tensor.device.type == "meta" for _, tensor in named):
        return "not compared (part of the model is on the meta device)"
    digest = hashlib.sha256()
    for name, tensor in named:
        digest.update(name.encode())
        digest.update(_bytes(tensor))
    return digest.hexdigest()[:12]


def _bytes(tensor: torch.Tensor):
    """The tensor's values as a buffer of bytes (a view where the tensor is already contiguous on the CPU)."""
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


def batch_fields(inputs: Any, targets: Any) -> dict:
    """The batch's structure and shapes, and a checksum of its values (CRC-32, chained over its tensors: every
    step's check, and about three times faster than SHA-256; it finds a batch that differs by accident, which is
    what it is for)."""
    checksum = 0
    for part in (inputs, targets):
        for leaf in tree_flatten(part)[0]:
            checksum = zlib.crc32(_bytes(leaf) if isinstance(leaf, torch.Tensor) else repr(leaf).encode(), checksum)
    shapes = repr((microbatch.signature(inputs), None if targets is None else microbatch.signature(targets)))
    return {"the step's batch (its shapes and a checksum of its values)": f"values CRC-32 {checksum:08x}, shapes "
            f"hash {_digest(shapes)}"}


BATCH_ADVICE = ("Every rank must be given the same whole batch at every step: the same data in the same order, padded "
                "alike (seed the data loader's shuffling the same on every rank)")
SETUP_ADVICE = "Every rank must build the pipeline with the same arguments and the same model (same seed)"


def _encode(found: dict) -> torch.Tensor:
    data = json.dumps({k: str(v)[:_LONGEST] for k, v in found.items()}).encode()
    if len(data) > SIZE:  # never with these fields; cut the values further rather than fail
        data = json.dumps({k: str(v)[:20] for k, v in found.items()}).encode()[:SIZE]
    buffer = torch.zeros(SIZE, dtype=torch.uint8)
    buffer[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buffer


def _decode(buffer: torch.Tensor) -> dict:
    data = bytes(buffer.cpu().tolist()).rstrip(b"\0")
    try:
        return json.loads(data.decode())
    except ValueError:
        return {"(unreadable)": data[:40].decode(errors="replace")}


def disagreement(per_rank: list[dict], advice: str = "") -> str | None:
    """The message naming the first rank that differs from rank 0 and every field it differs on, or None."""
    first = per_rank[0]
    for rank, other in enumerate(per_rank[1:], start=1):
        differ = [(name, first.get(name), other.get(name)) for name in {**first, **other}
                  if first.get(name) != other.get(name)]
        if differ:
            listed = "; ".join(f"{name}: {mine} vs {theirs}" for name, mine, theirs in differ)
            return f"ranks 0 and {rank} disagree on {listed}. {advice or SETUP_ADVICE}"
    return None


def agree_quickly(found: dict, group, device: torch.device, advice: str = "") -> None:
    """`agree`, with one 8-byte all-gather when the ranks agree (every step's check): the fields' hash; only a
    difference sends the fields themselves, to name it."""
    mine = torch.tensor([int(_digest(json.dumps(found, sort_keys=True)), 16)], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    with comm_count.label("other"):  # not the pipeline's messages
        dist.all_gather(gathered, mine, group=group)
    if any(int(other) != int(mine) for other in gathered):
        agree(found, group, device, advice)


def agree(found: dict, group, device: torch.device, advice: str = "") -> None:
    """All-gather `found` (`fields`) over `group` and raise a ValueError on every rank if two ranks differ."""
    mine = _encode(found).to(device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    with comm_count.label("other"):
        dist.all_gather(gathered, mine, group=group)
    message = disagreement([_decode(buffer) for buffer in gathered], advice)
    if message is not None:
        raise ValueError(message)
