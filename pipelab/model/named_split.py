"""Split any `nn.Module` by the names of the modules where a new stage begins.

`split_by_names(model, ["transformer.h.4"], sample)` traces the model's own forward on one
micro-batch with `torch.export` (one graph of ATen ops, each node tagged with the module that
ran it: its `nn_module_stack`), then cuts the graph with `torch.fx`'s `split_module`: stage s
holds the operations from the first one run inside split point s up to the first one run inside
split point s + 1 (as PyTorch's `SplitPoint.BEGINNING`).  Each stage is a `TracedStage`
(`traced_stage.py`): its piece of the graph and the user's own parameters and buffers it reads.
A trace is for one mode (train or eval) and, traced with dynamic dimensions, for every micro-batch
shape export found its graph valid for; other shapes get traces of their own (`traced_shapes.py`).

Why not `torch.distributed.pipelining.pipeline()`, which does the same cut: it leaves its
wrappers on the user's modules, and its stage modules fail on a `torch.no_grad()` region
(Llama's rotary embedding) in torch 2.13; `split_module` over the exported graph does not.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module
from torch.utils._pytree import tree_map

from ..common.errors import PipelineError
from .accepts import Accepts
from .experts import check_traceable_experts
from .stage import buffers_kept
from .traced_stage import Piece, TracedStage, attribute


class _Literal:
    """An output of the model that is not a traced value (a constant the graph returns)."""

    def __init__(self, value: Any):
        self.value = value


def split_by_names(model: nn.Module, split_points: list[str], sample: dict, dynamic: bool = False) -> list[TracedStage]:
    """The stages of `model` cut before each module named in `split_points` (module docstring).  `sample`: one
    micro-batch, as the keyword arguments of `model`; `dynamic`: its dimensions traced as torch.export's
    `Dim.AUTO` (the graph then accepts other sizes where export found it general: `traced_shapes.py`)."""
    freed = next((name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"),
                 None)
    if freed is not None:
        raise ValueError(f"the model has tensors on the meta device ({freed}, ...): a DistributedPipeline already "
                         "split it and freed the other ranks' stages; build a fresh model for another pipeline")
    check_points(model, split_points)
    check_traceable_experts(model)  # an eager loop over MoE experts: refused with its fix, before export tries
    if not isinstance(sample, dict):
        raise TypeError("split_points traces the model with a micro-batch of its keyword arguments: pass the batch "
                        f"as a dict, e.g. {{'input_ids': ..., 'labels': ...}}, got {type(sample).__name__}")
    with buffers_kept(model.buffers()):  # the trace changes nothing of the user's
        pieces, firsts, lasts = trace(model, split_points, sample, dynamic)
    stages = [TracedStage(s, firsts[s], lasts[s]) for s in range(len(pieces))]
    for stage, piece in zip(stages, pieces):
        stage.add(piece, model)
    return stages


def check_points(model: nn.Module, split_points: list[str]) -> None:
    """Split points are modules of `model`, each named once (whether every stage runs something, the trace
    tells: `_check_bounds`)."""
    names = [name for name, _ in model.named_modules()]
    unknown = [name for name in split_points if name not in names]
    if unknown:
        raise ValueError(f"split_points names modules the model does not have: {unknown}; names look like "
                         f"{names[1:6]}")
    repeated = sorted({name for name in split_points if split_points.count(name) > 1})
    if repeated:
        raise ValueError(f"split_points names {repeated} more than once (duplicate split points): each module "
                         f"starts one stage; give {list(dict.fromkeys(split_points))}")


def trace(model: nn.Module, split_points: list[str], sample: dict, dynamic: bool) -> tuple[list[Piece], list, list]:
    """One trace of `model` on the micro-batch `sample`, cut into one `Piece` per stage; with each stage's first
    and last module.  The model's tensors are named, not read (`TracedStage.add` reads them)."""
    extra = {}
    if getattr(getattr(model, "config", None), "use_cache", None) is not None:
        extra["use_cache"] = False  # a key-value cache is for generation; the trace cannot return one
    kwargs = {**sample, **extra}
    program = _export(model, kwargs, split_points, dynamic)
    graph_module = program.module()
    graph = graph_module.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":  # export's input checks: `Accepts` checks
            graph.erase_node(node)
    graph._codegen = fx.graph.CodeGen()  # flat inputs and outputs: the engine keeps the structures
    graph_module.recompile()
    nodes = list(graph.nodes)
    bounds = [_first_node(nodes, name, split_points) for name in split_points]
    _check_bounds(nodes, bounds, split_points)
    position = {node: k for k, node in enumerate(nodes)}
    inputs = [node for node in nodes if node.op == "placeholder"]
    accepts = Accepts(inputs, program.range_constraints)
    pieces = split_module(graph_module, graph_module, lambda node: sum(position[node] >= b for b in bounds),
                          keep_original_order=True)
    names = [name for name, _ in model.named_modules()]
    first_leaf = next(name for name, module in model.named_modules() if name and not any(module.children()))
    firsts = [first_leaf] + list(split_points)
    lasts = [names[names.index(p) - 1] for p in split_points] + [names[-1]]
    stages = _pieces(pieces, model, graph_module)
    placeholders = [node.name for node in pieces.graph.nodes if node.op == "placeholder"]
    stages[0].inputs = (program.call_spec.in_spec, placeholders, extra, accepts)
    output = next(node for node in pieces.graph.nodes if node.op == "output")
    flat = output.args[0] if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    stages[-1].outputs = ([n.name if isinstance(n, fx.Node) else _Literal(n) for n in flat],
                          program.call_spec.out_spec)
    return stages, firsts, lasts


def _first_node(nodes: list[fx.Node], name: str, split_points: list[str]) -> int:
    """Where the first operation run inside module `name` is in the graph."""
    for k, node in enumerate(nodes):
        stack = node.meta.get("nn_module_stack") or {}
        if node.op == "call_function" and any(path == name or path.startswith(name + ".") for path, _ in stack.values()):
            return k
    raise ValueError(f"split point {name!r} runs no operation in the model's forward on this sample (of "
                     f"{split_points}): name a module the forward calls")


def _export(model: nn.Module, kwargs: dict, split_points: list[str], dynamic: bool) -> torch.export.ExportedProgram:
    """`torch.export` of the model's forward on `kwargs`: with every dimension `Dim.AUTO` when `dynamic` (and
    for the exact shapes where that fails), in the random state and grad mode of a training step."""
    shapes = tree_map(lambda v: {d: torch.export.Dim.AUTO for d in range(v.dim())} or None
                      if isinstance(v, torch.Tensor) else None, kwargs)
    with torch.random.fork_rng(devices=[]), torch.enable_grad(), _quiet("torch._export.non_strict_utils"):
        if dynamic:  # its warnings say which sizes of 1 it fixed: `accepts.py` keeps them
            try:
                return torch.export.export(model, (), kwargs, dynamic_shapes=shapes, strict=False)
            except Exception:  # noqa: BLE001 - a model that guards on its sizes: this shape alone
                pass
        try:  # fresh inputs: the dynamic attempt marked its own as dynamic
            return torch.export.export(model, (), _copies(kwargs), strict=False)
        except Exception as error:
            raise PipelineError(f"torch.export could not trace the model to split it at {split_points}: "
                                f"{_meaning(error)}{type(error).__name__}: {str(error)[:800]}") from error


def _meaning(error: Exception) -> str:
    """What an export error says in a user's words, where it is a known kind ("" otherwise)."""
    if "data-dependent" in str(error):
        return ("the forward branches or loops on a tensor's values (data-dependent control flow, as a loop over "
                "the items a mask or a router picked), which a trace cannot follow; write that part without it (a "
                "mask or one batched operation over all items) or move it out of the model's forward.  ")
    return ""


def _copies(kwargs: dict) -> dict:
    """Each tensor its own copy: export merges inputs that are one tensor (input_ids passed as labels too)."""
    return tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, kwargs)


@contextlib.contextmanager
def _quiet(logger: str):
    """The logger's warnings left out inside the block."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _check_bounds(nodes: list[fx.Node], bounds: list[int], split_points: list[str]) -> None:
    """The split points in the order the forward runs them, and every stage running at least one operation."""
    if bounds != sorted(bounds):
        raise ValueError(f"split_points {split_points} must be in the order the model's forward runs them "
                         f"(it runs their first operations at {bounds})")
    calls = [k for k, node in enumerate(nodes) if node.op == "call_function"]
    for s, (begin, end) in enumerate(zip([0, *bounds], [*bounds, len(nodes)])):
        if not any(begin <= k < end for k in calls) and s == 0:
            raise ValueError(f"stage 0 would be empty: {split_points[0]!r} begins with the model's first operation, "
                             "so nothing runs before it; the first stage begins at the model's start by itself: name "
                             "only the modules where the later stages begin")
        if not any(begin <= k < end for k in calls):
            raise ValueError(f"stage {s} would be empty: {split_points[s]!r} begins at the first operation of "
                             f"{split_points[s - 1]!r}; cut at modules that run one after the other")


def _pieces(pieces: fx.GraphModule, model: nn.Module, root: fx.GraphModule) -> list[Piece]:
    """Who needs which value: each stage takes its piece's arguments (messages, the model's tensors, read
    where the stage runs, or the trace's constants), gives its outputs, and passes on what a later stage or the
    model's output needs that it does not compute itself (a mask computed on stage 0, the labels)."""
    graph = pieces.graph
    calls = [node for node in graph.nodes if node.op == "call_module"]
    outputs_of: dict[str, list[tuple[int, str]]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in calls:
            outputs_of.setdefault(node.args[0].name, []).append((node.args[1], node.name))
    attrs = {node.name: node.target for node in graph.nodes if node.op == "get_attr"}
    arguments = [[(_owner(model, attrs[a.name]), attrs[a.name]) if a.name in attrs else ("value", a.name)
                  for a in call.args] for call in calls]
    gives = [[name for _, name in sorted(outputs_of[call.name])] if call.name in outputs_of else [call.name]
             for call in calls]
    output = next(node for node in graph.nodes if node.op == "output")
    returned = {n.name for n in _nodes_in(output.args)}
    incoming = {node.name for node in graph.nodes if node.op == "placeholder"}  # stage 0 gets the micro-batch
    stages = []
    for s, call in enumerate(calls):
        later = {name for args in arguments[s + 1:] for kind, name in args if kind == "value"} | returned
        passes = sorted((later & incoming) - set(gives[s])) if s < len(calls) - 1 else []
        constants = {target: attribute(root, target) for kind, target in arguments[s] if kind == "constant"}
        stages.append(Piece(getattr(pieces, call.target), arguments[s], gives[s], passes, constants))
        incoming = set(passes) | set(gives[s])
    return stages


def _owner(model: nn.Module, target: str) -> str:
    """"tensor" for a tensor of the model (a parameter or buffer of the user's), "constant" for one the trace made."""
    try:
        attribute(model, target)
        return "tensor"
    except AttributeError:
        return "constant"


def _nodes_in(args: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(args, lambda n: found.append(n) or n)
    return found


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
