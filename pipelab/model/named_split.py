"""Split any `nn.Module` by the names of the modules where a new stage begins.

`split_by_names(model, ["transformer.h.4"], sample)` traces the model's own forward on one
micro-batch with `torch.export` (one graph of ATen ops, each node tagged with the module that
ran it: its `nn_module_stack`), then cuts the graph with `torch.fx`'s `split_module`: stage s
holds the operations from the first one run inside split point s up to the first one run inside
split point s + 1 (as PyTorch's `SplitPoint.BEGINNING`).  Each stage is a `TracedStage`: its
piece of the graph and the user's own parameters and buffers it reads (the very tensors, under
their names in the model), so gradients land in the user's model and a parameter two stages
use (a tied embedding) is one tensor.  What crosses a boundary is a dict of the graph's values
that later stages need, the micro-batch's own inputs included (the labels, for the loss).  The
trace is for one micro-batch shape and one mode (train or eval).

Why not `torch.distributed.pipelining.pipeline()`, which does the same cut: it leaves its
wrappers on the user's modules, and its stage modules fail on a `torch.no_grad()` region
(Llama's rotary embedding) in torch 2.13; `split_module` over the exported graph does not.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx, nn
from torch.fx._pytree import tree_flatten_spec
from torch.fx.passes.split_module import split_module
from torch.utils._pytree import TreeSpec, tree_map, tree_unflatten

from ..common.errors import PipelineError
from .fused_accumulation import route_weight_multiplies
from .stage import buffers_kept


class TracedStage(nn.Module):
    """One stage of a traced split: `forward(message)` -> the message for the next stage (a dict of values), or
    on the last stage the model's own output (a `ModelOutput`, a tuple...).  Stage 0's message is the
    micro-batch: the model's keyword arguments."""

    def __init__(self, graph_module: fx.GraphModule, arguments: list[tuple[str, str]], gives: list[str],
                 passes: list[str], index: int, first_module: str, last_module: str, tensors: dict[str, Any]):
        super().__init__()
        self.graph_module = graph_module
        self.arguments = arguments  # ("value", name in the message) or ("tensor", name in the model), in order
        self.gives, self.passes, self.index = gives, passes, index
        self.first_module, self.last_module = first_module, last_module
        self.tensors = nn.Module()  # the user's own parameters and buffers this stage reads (the same objects)
        for name, tensor in tensors.items():
            key = name.replace(".", "/")
            if isinstance(tensor, nn.Parameter):
                self.tensors.register_parameter(key, tensor)
            else:
                self.tensors.register_buffer(key, tensor)
        # its multiplies by a parameter, routed so that a `with FusedAccumulation` can fuse them (as traced otherwise)
        placeholders = [n.name for n in graph_module.graph.nodes if n.op == "placeholder"]
        weights = {placeholder: tensors[name] for placeholder, (kind, name) in zip(placeholders, arguments)
                   if kind == "tensor" and isinstance(tensors[name], nn.Parameter)}
        self.routed_weights = [weights[p] for p in dict.fromkeys(route_weight_multiplies(graph_module, set(weights)))]
        self.inputs: tuple[TreeSpec, list[str], dict] | None = None  # stage 0: how a micro-batch becomes values
        self.outputs: tuple[list, TreeSpec] | None = None  # the last stage: the model's output, and its type

    def forward(self, message: dict) -> Any:
        values = self._values_of(message)
        missing = [name for kind, name in self.arguments if kind == "value" and name not in values]
        if missing:
            raise PipelineError(f"stage {self.index} needs {missing} and did not receive them (it received "
                                f"{sorted(values)})")
        args = [values[name] if kind == "value" else getattr(self.tensors, name.replace(".", "/"))
                for kind, name in self.arguments]
        output = self.graph_module(*args)
        values.update(zip(self.gives, output if isinstance(output, (tuple, list)) else (output,)))
        if self.outputs is not None:
            names, spec = self.outputs
            return tree_unflatten([values[n] if isinstance(n, str) else n.value for n in names], spec)
        return {name: values[name] for name in [*self.passes, *self.gives]}

    def _values_of(self, message: dict) -> dict:
        if self.inputs is None:
            return dict(message)
        spec, names, extra = self.inputs
        if not isinstance(message, dict):
            raise TypeError(f"a model split by names takes its micro-batch as a dict of its keyword arguments, "
                            f"got {type(message).__name__}")
        try:
            flat = tree_flatten_spec(((), {**message, **extra}), spec)
        except Exception as error:
            raise ValueError(f"the micro-batch has keys {sorted(message)}, but the model was traced with "
                             f"{sorted(set(spec.children_specs[1].context) - set(extra))}: {error}") from error
        return dict(zip(names, flat))

    def extra_repr(self) -> str:
        return f"stage {self.index}: {self.first_module} .. {self.last_module}"


class _Literal:
    """An output of the model that is not a traced value (a constant the graph returns)."""

    def __init__(self, value: Any):
        self.value = value


def split_by_names(model: nn.Module, split_points: list[str], sample: dict) -> list[TracedStage]:
    """The stages of `model` cut before each module named in `split_points` (module docstring).  `sample`: one
    micro-batch, as the keyword arguments of `model`."""
    freed = next((name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"),
                 None)
    if freed is not None:
        raise ValueError(f"the model has tensors on the meta device ({freed}, ...): a DistributedPipeline already "
                         "split it and freed the other ranks' stages; build a fresh model for another pipeline")
    names = [name for name, _ in model.named_modules()]
    unknown = [name for name in split_points if name not in names]
    if unknown:
        raise ValueError(f"split_points names modules the model does not have: {unknown}; names look like "
                         f"{names[1:6]}")
    if not isinstance(sample, dict):
        raise TypeError("split_points traces the model with a micro-batch of its keyword arguments: pass the batch "
                        f"as a dict, e.g. {{'input_ids': ..., 'labels': ...}}, got {type(sample).__name__}")
    extra = {}
    if getattr(getattr(model, "config", None), "use_cache", None) is not None:
        extra["use_cache"] = False  # a key-value cache is for generation; the trace cannot return one
    # each tensor its own copy: export merges inputs that are one tensor (input_ids passed as labels too)
    kwargs = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, {**sample, **extra})
    with torch.random.fork_rng(devices=[]), buffers_kept(model.buffers()):  # the trace changes nothing of the user's
        try:
            program = torch.export.export(model, (), kwargs, strict=False)
        except Exception as error:
            raise PipelineError(f"torch.export could not trace the model to split it at {split_points}: "
                                f"{type(error).__name__}: {str(error)[:800]}") from error
    graph_module = program.module()  # reads the user's own parameters and buffers
    graph = graph_module.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":  # export's input checks: the engine checks
            graph.erase_node(node)
    graph._codegen = fx.graph.CodeGen()  # flat inputs and outputs: the engine keeps the structures
    graph_module.recompile()
    nodes = list(graph.nodes)
    bounds = [_first_node(nodes, name, split_points) for name in split_points]
    if bounds != sorted(bounds) or len(set(bounds)) != len(bounds):
        raise ValueError(f"split_points {split_points} must be in the order the model's forward runs them "
                         f"(it runs their first operations at {bounds})")
    position = {node: k for k, node in enumerate(nodes)}
    pieces = split_module(graph_module, graph_module, lambda node: sum(position[node] >= b for b in bounds),
                          keep_original_order=True)
    first_leaf = next(name for name, module in model.named_modules() if name and not any(module.children()))
    firsts = [first_leaf] + list(split_points)
    lasts = [names[names.index(p) - 1] for p in split_points] + [names[-1]]
    stages = _stages(pieces, model, graph_module, firsts, lasts)
    placeholders = [node.name for node in pieces.graph.nodes if node.op == "placeholder"]
    stages[0].inputs = (program.call_spec.in_spec, placeholders, extra)
    output = next(node for node in pieces.graph.nodes if node.op == "output")
    flat = output.args[0] if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    stages[-1].outputs = ([n.name if isinstance(n, fx.Node) else _Literal(n) for n in flat],
                          program.call_spec.out_spec)
    return stages


def _first_node(nodes: list[fx.Node], name: str, split_points: list[str]) -> int:
    """Where the first operation run inside module `name` is in the graph."""
    for k, node in enumerate(nodes):
        stack = node.meta.get("nn_module_stack") or {}
        if node.op == "call_function" and any(path == name or path.startswith(name + ".") for path, _ in stack.values()):
            return k
    raise ValueError(f"split point {name!r} runs no operation in the model's forward on this sample (of "
                     f"{split_points}): name a module the forward calls")


def _stages(pieces: fx.GraphModule, model: nn.Module, root: fx.GraphModule, firsts: list[str],
            lasts: list[str]) -> list[TracedStage]:
    """Who needs which value: each stage takes its piece's arguments (messages, or the model's tensors, read
    where the stage runs), gives its outputs, and passes on what a later stage or the model's output needs that
    it does not compute itself (a mask computed on stage 0, the labels)."""
    graph = pieces.graph
    calls = [node for node in graph.nodes if node.op == "call_module"]
    outputs_of: dict[str, list[tuple[int, str]]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in calls:
            outputs_of.setdefault(node.args[0].name, []).append((node.args[1], node.name))
    attrs = {node.name: node.target for node in graph.nodes if node.op == "get_attr"}
    arguments = [[("tensor", attrs[a.name]) if a.name in attrs else ("value", a.name) for a in call.args]
                 for call in calls]
    gives = [[name for _, name in sorted(outputs_of[call.name])] if call.name in outputs_of else [call.name]
             for call in calls]
    output = next(node for node in graph.nodes if node.op == "output")
    returned = {n.name for n in _nodes_in(output.args)}
    incoming = {node.name for node in graph.nodes if node.op == "placeholder"}  # stage 0 gets the micro-batch
    stages = []
    for s, call in enumerate(calls):
        later = {name for args in arguments[s + 1:] for kind, name in args if kind == "value"} | returned
        passes = sorted((later & incoming) - set(gives[s])) if s < len(calls) - 1 else []
        tensors = {target: _attr(model, target, root) for kind, target in arguments[s] if kind == "tensor"}
        stages.append(TracedStage(getattr(pieces, call.target), arguments[s], gives[s], passes, s, firsts[s],
                                  lasts[s], tensors))
        incoming = set(passes) | set(gives[s])
    return stages


def _nodes_in(args: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(args, lambda n: found.append(n) or n)
    return found


def _attr(model: nn.Module, target: str, root: nn.Module) -> Any:
    """The tensor the graph reads at `target`: the user's own (a parameter or buffer of `model`), else the
    trace's (a constant it made)."""
    for module in (model, root):
        owner, _, leaf = target.rpartition(".")
        try:
            return getattr(module.get_submodule(owner) if owner else module, leaf)
        except AttributeError:
            continue
    raise PipelineError(f"the traced graph reads {target!r}, which neither the model nor the trace holds")


def repeated_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's repeated blocks: its longest `nn.ModuleList` (GPT-2's `transformer.h`, Llama's
    `model.layers`; the first of equal length), with its name."""
    lists = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of repeated blocks to cut between: name "
                         "the modules where stages begin, split_points=['...']")
    return max(lists, key=lambda item: len(item[1]))


def model_loss(output: Any) -> torch.Tensor:
    """The loss a model computed itself: `output.loss`, the first element of a tuple, or a scalar tensor."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, (tuple, list)) and output:
        loss = output[0]
    if loss is None and isinstance(output, torch.Tensor):
        loss = output
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError("loss_fn=None takes the model's own loss (`output.loss`, or the first element of its tuple "
                        f"output), but the model returned {type(output).__name__} without one: pass labels= in the "
                        "batch, or give a loss_fn")
    return loss
