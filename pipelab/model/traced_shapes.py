"""A model split by names, stepping on micro-batches of any shape: the traced graphs it has, and a new one when
a micro-batch fits none.

A training run's batches change shape from step to step (the smaller last batch of an epoch, each batch padded
to its own longest row, a batch of 5 rows cut into 2, 2 and 1), while `torch.export` traces one micro-batch.
The sample is traced for its own shapes (what a pipeline that sees one shape needs, at the lowest cost); every
later trace is made with dynamic dimensions (`Dim.AUTO` on every dimension of every input): export keeps a
dimension symbolic where the forward works for any size, with the range it is valid for, and fixes the
others.  Each stage keeps one `Piece` per trace, and stage 0 runs a micro-batch with the first graph that
accepts its shapes (`accepts.py`); a micro-batch no graph accepts is traced anew, before the step, by
`prepare`.  A model export cannot trace with dynamic dimensions is traced for the micro-batch's exact shapes:
one graph per shape, the cache then keyed by the shapes alone.

Why, measured (`benchmarks/new_shapes.py`, the tests' 4-layer GPT-2 / Llama, hidden 32, 3 stages, 1F1B,
m = 3, one thread, on a shared 2-core machine): a dynamic trace costs 0.97 / 1.47 s against 0.34 / 0.62 s for
fixed shapes, but one covers every micro-batch of 2 rows or more and 2 tokens or more: an epoch of 40
dynamically padded batches (8 rows of 2..64 tokens, the last batch of 3 rows) traced 3 times (the sample;
the first other shape; the first micro-batches of 1 row, since export fixes sizes 0 and 1, where
broadcasting differs), where a cache of fixed shapes would trace 37 times (~13 / ~23 s).  A step on a shape
already traced takes 0.016 / 0.023 s, on a fixed or a dynamic graph alike (0.016 / 0.025 s); the first step
of a shape that traces takes 1.2 / 1.7 s (dynamic) or 0.84 / 1.2 s (1 row), and the steps after it cost
nothing more.  The graphs run the same operations: losses and gradients equal the single device's for every
shape (tests/test_any_shape.py).

Every rank of a distributed pipeline is given the same whole batch, so every rank prepares the same traces in
the same order: a graph's index is the same everywhere, and travels in each message (`traced_stage.GRAPH`), from
which a later stage picks its piece without the micro-batch; the receivers learn each message's layout per
(boundary, input signature) as before (`runtime/p2p.py`).  On a rank, the tensors of other ranks' stages were
freed (the "meta" device) and its own moved to its device: a new trace runs on stand-ins where the first trace
saw them (uninitialised, never read: export traces shapes), and the stages read the user's tensors as before.
Only shapes may change: a batch with other keys or dtypes than the sample is refused, naming the key.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import keystr, tree_flatten_with_path

from ..common.errors import PipelineError
from .accepts import shapes_of
from .named_split import trace
from .stage import buffers_kept
from .traced_stage import TracedStage


class TracedShapes:
    """The traces of a split by names (`traces`: how many), its stages (`stages`, the same objects whatever the
    shape), the sample it was first traced with and the mode (`training`) the graphs hold."""

    def __init__(self, model: nn.Module, split_points: list[str], stages: list[TracedStage], sample: dict):
        self.model, self.split_points, self.stages = model, list(split_points), stages
        self.training = model.training
        self.sample = _described(sample)
        self.sample_shapes = shapes_of(sample)
        self.devices = {(id(module), name): tensor.device for module in model.modules()
                        for table in (module._parameters, module._buffers)
                        for name, tensor in table.items() if tensor is not None}
        self.traces = 1

    def prepare(self, chunks: list) -> None:
        """Check that each micro-batch has the sample's keys and dtypes, and trace the shapes no graph accepts
        (call it with the same micro-batches on every rank)."""
        for i, chunk in enumerate(chunks):
            self._check_like_sample(chunk, i)
            if self.stages[0].graph_for(chunk) is None:
                self._trace(chunk, i)

    def _trace(self, chunk: dict, i: int) -> None:
        try:
            with buffers_kept(self.model.buffers()), _stand_ins(self.model, self.devices):
                pieces, _, _ = trace(self.model, self.split_points, chunk, dynamic=True)
        except (PipelineError, ValueError) as error:
            raise PipelineError(f"tracing the model for micro-batch {i}, of shapes {shapes_of(chunk)} (the sample's: "
                                f"{self.sample_shapes}), failed: {error}") from error
        missing = {stage.index: stage.missing(piece) for stage, piece in zip(self.stages, pieces) if stage.missing(piece)}
        if missing:  # (a later piece may not read a tensor the first did not: `TracedStage.add`)
            raise PipelineError(f"the model traced for micro-batch {i}, of shapes {shapes_of(chunk)}, reads tensors "
                                f"its first trace did not ({missing}, by stage): build the pipeline with a sample of "
                                "this shape")
        for stage, piece in zip(self.stages, pieces):
            stage.add(piece, self.model)
        self.traces += 1

    def _check_like_sample(self, chunk: Any, i: int) -> None:
        """Other keys, or other dtypes, than the sample's: a ValueError naming the key and both values."""
        mine = _described(chunk)
        for key in sorted(set(self.sample) | set(mine)):
            if key not in mine:
                raise ValueError(f"{key} is missing from micro-batch {i}; the sample the model was traced with has it "
                                 f"({', '.join(self.sample[key])}): give every batch the sample's keys")
            if key not in self.sample:
                raise ValueError(f"micro-batch {i} has {key} ({', '.join(mine[key])}), which the sample the model "
                                 "was traced with does not have: give every batch the sample's keys")
            if mine[key][0] != self.sample[key][0]:
                raise ValueError(f"{key} is {mine[key][0]} in micro-batch {i}, but {self.sample[key][0]} in the "
                                 "sample the model was traced with: a batch may change its shapes, not its dtypes "
                                 "(cast it as the sample)")


def _described(batch: Any) -> dict[str, tuple[str, ...]]:
    """{key path ("batch['input_ids']"): (its dtype, or its type), its shape}: what must match the sample."""
    flat, _ = tree_flatten_with_path(batch)
    return {f"batch{keystr(path)}": (str(leaf.dtype), f"shape {tuple(leaf.shape)}") if isinstance(leaf, torch.Tensor)
            else (type(leaf).__name__, f"value {leaf!r}") for path, leaf in flat}


def _sharded(tensor: torch.Tensor) -> bool:
    """A DTensor: a shard of the parameter (shard="fsdp"), which export cannot mix with the inputs' tensors."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


@contextlib.contextmanager
def _stand_ins(model: nn.Module, devices: dict):
    """Inside the block, each parameter or buffer of `model` that is no longer where `devices` saw it (moved to
    a rank's device, or freed to "meta") or is now sharded (a DTensor, of its whole shape) is replaced by an uninitialised tensor of its shape and dtype there
    (one per tensor: a tied weight stays one); on leaving, the model's own are back."""
    swapped, made = [], {}
    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, tensor in list(table.items()):
                    device = devices.get((id(module), name))
                    if tensor is None or device is None or (tensor.device == device and not _sharded(tensor)):
                        continue
                    if id(tensor) not in made:
                        empty = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                        made[id(tensor)] = (nn.Parameter(empty, tensor.requires_grad)
                                            if isinstance(tensor, nn.Parameter) else empty)
                    swapped.append((table, name, tensor))
                    table[name] = made[id(tensor)]
        yield
    finally:
        for table, name, tensor in reversed(swapped):
            table[name] = tensor
