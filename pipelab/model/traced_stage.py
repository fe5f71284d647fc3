"""One stage of a model split by names (`named_split.py`): its pieces of the traced graphs, and the user's tensors.

A `TracedStage` holds one `Piece` per trace of the model (one per set of micro-batch shapes,
`traced_shapes.py`) and one set of tensors: the user's own parameters and buffers its pieces read (the very
tensors, under their names in the model), whichever trace reads them, so that gradients land in the user's
model, a parameter two stages use (a tied embedding) is one tensor, and the stage stays the same object, with
the same parameters, whatever the shape.  What crosses a boundary is a dict of the graph's values that later
stages need, the micro-batch's own inputs included (the labels, for the loss), and the index of the graph that
made it (`GRAPH`): stage 0 picks the first graph that accepts the micro-batch (`accepts.py`), the later stages
the piece of the same trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.fx._pytree import tree_flatten_spec
from torch.utils._pytree import TreeSpec, tree_unflatten

from ..common.errors import PipelineError
from .accepts import Accepts, shapes_of
from .fused_accumulation import route_weight_multiplies

GRAPH = "(graph)"
"""The key, in every message between traced stages, of the graph that made it (its index in each stage's
`pieces`): a stage after the first picks its piece of the same trace by it, without the micro-batch."""


@dataclass
class Piece:
    """One stage's share of one trace: its graph, what it reads (("value", name in the message),
    ("tensor", name in the model) or ("constant", name in the trace)), what it gives and passes on; on stage 0
    how a micro-batch becomes its values (`inputs`: spec, placeholder names, extra keyword arguments, and the
    shapes the graph accepts, `Accepts`), on the last stage the model's output and its type (`outputs`)."""

    graph_module: fx.GraphModule
    arguments: list[tuple[str, str]]
    gives: list[str]
    passes: list[str]
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # tensors the trace made (not the model's)
    inputs: tuple[TreeSpec, list[str], dict, "Accepts"] | None = None
    outputs: tuple[list, TreeSpec] | None = None


class TracedStage(nn.Module):
    """One stage of a traced split: `forward(message)` -> the message for the next stage (a dict of values), or
    on the last stage the model's own output (a `ModelOutput`, a tuple...).  Stage 0's message is the
    micro-batch: the model's keyword arguments.  It holds one `Piece` per trace (per set of micro-batch shapes,
    `traced_shapes.py`) and one set of tensors: the user's own parameters and buffers its pieces read (the same
    objects, whichever trace reads them)."""

    def __init__(self, index: int, first_module: str, last_module: str):
        super().__init__()
        self.index, self.first_module, self.last_module = index, first_module, last_module
        self.graph_modules = nn.ModuleList()  # pieces[g].graph_module, registered
        self.pieces: list[Piece] = []
        self.tensors = nn.Module()  # the user's own parameters and buffers this stage reads, and trace constants
        self.routed_weights: list[nn.Parameter] = []  # multiplies a `with FusedAccumulation` can fuse

    def add(self, piece: Piece, model: nn.Module) -> None:
        """Take the piece of a new trace: its tensors read from `model` (the user's), or, after the first piece,
        from those this stage already holds: a later trace may not need a tensor the first did not (on ranks,
        the tensors of other stages are freed, and an optimizer holds the first pieces' parameters)."""
        g = len(self.pieces)
        keys = []
        for kind, name in piece.arguments:
            key = name.replace(".", "/") if kind == "tensor" else f"trace{g}/{name}".replace(".", "/")
            if kind == "tensor" and not hasattr(self.tensors, key):
                if g > 0:
                    raise PipelineError(f"stage {self.index} traced for a new micro-batch shape reads {name}, which "
                                        "its first trace did not: the model's forward uses other weights for this "
                                        "shape; build the pipeline with a sample of this shape")
                self._register(key, attribute(model, name))
            elif kind == "constant" and not hasattr(self.tensors, key):
                self._register(key, piece.constants[name].to(self._device()))
            keys.append((kind, key))
        piece.arguments = [(kind, key if kind != "value" else name) for (kind, name), (_, key) in
                           zip(piece.arguments, keys)]
        placeholders = [n.name for n in piece.graph_module.graph.nodes if n.op == "placeholder"]
        weights = {placeholder: getattr(self.tensors, key) for placeholder, (kind, key) in
                   zip(placeholders, piece.arguments) if kind == "tensor"}
        weights = {p: w for p, w in weights.items() if isinstance(w, nn.Parameter)}
        for p in dict.fromkeys(route_weight_multiplies(piece.graph_module, set(weights))):
            if not any(weights[p] is w for w in self.routed_weights):
                self.routed_weights.append(weights[p])
        self.graph_modules.append(piece.graph_module)
        self.pieces.append(piece)
        piece.constants = {}  # registered in `tensors`, moved with the stage

    def missing(self, piece: Piece) -> list[str]:
        """The model's tensors `piece` reads that this stage does not hold yet (`add` refuses them after the
        first piece)."""
        return [name for kind, name in piece.arguments
                if kind == "tensor" and not hasattr(self.tensors, name.replace(".", "/"))] if self.pieces else []

    def _register(self, key: str, tensor: torch.Tensor) -> None:
        if isinstance(tensor, nn.Parameter):
            self.tensors.register_parameter(key, tensor)
        else:
            self.tensors.register_buffer(key, tensor)

    def _device(self) -> torch.device:
        """Where this stage's tensors are (a rank's device), for a new trace's constants."""
        held = [t.device for t in [*self.tensors.parameters(), *self.tensors.buffers()] if t.device.type != "meta"]
        return held[0] if held else torch.device("cpu")

    def forward(self, message: dict) -> Any:
        if self.index == 0:
            if not isinstance(message, dict):
                raise TypeError(f"a model split by names takes its micro-batch as a dict of its keyword arguments, "
                                f"got {type(message).__name__}")
            g = self.graph_for(message)
            if g is None:
                raise PipelineError(f"stage 0 has no graph traced for a micro-batch of shapes "
                                    f"{shapes_of(message)}: the engines trace each new shape before the step; "
                                    "called by hand, trace it first: partition.traced_for.prepare([micro_batch])")
            values = self._values_of(message, g)
        else:
            values = dict(message)
            g = values.pop(GRAPH, None)
            if not isinstance(g, int) or not 0 <= g < len(self.pieces):
                raise PipelineError(f"stage {self.index} received a message without the graph that made it "
                                    f"({GRAPH!r}: {g!r}); it takes what stage {self.index - 1} of this split sends")
        piece = self.pieces[g]
        missing = [name for kind, name in piece.arguments if kind == "value" and name not in values]
        if missing:
            raise PipelineError(f"stage {self.index} needs {missing} and did not receive them (it received "
                                f"{sorted(values)})")
        args = [values[name] if kind == "value" else getattr(self.tensors, name) for kind, name in piece.arguments]
        output = piece.graph_module(*args)
        values.update(zip(piece.gives, output if isinstance(output, (tuple, list)) else (output,)))
        if piece.outputs is not None:
            names, spec = piece.outputs
            return tree_unflatten([values[n] if isinstance(n, str) else n.value for n in names], spec)
        return {**{name: values[name] for name in [*piece.passes, *piece.gives]}, GRAPH: g}

    def graph_for(self, batch: Any) -> int | None:
        """Stage 0: the first of its pieces whose graph accepts the micro-batch `batch`, or None."""
        for g, piece in enumerate(self.pieces):
            spec, names, extra, accepts = piece.inputs
            try:
                flat = tree_flatten_spec(((), {**batch, **extra}), spec)
            except Exception:  # noqa: BLE001 - other keys: not this graph's micro-batch
                continue
            if accepts(flat):
                return g
        return None

    def _values_of(self, message: dict, g: int) -> dict:
        spec, names, extra, _ = self.pieces[g].inputs
        return dict(zip(names, tree_flatten_spec(((), {**message, **extra}), spec)))

    def extra_repr(self) -> str:
        return f"stage {self.index}: {self.first_module} .. {self.last_module}, {len(self.pieces)} traced graph(s)"


def attribute(module: nn.Module, target: str) -> Any:
    """The tensor at `target` ("transformer.wte.weight") in `module`; AttributeError where there is none."""
    owner, _, leaf = target.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, leaf)
