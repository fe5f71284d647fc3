"""Split any `nn.Module` by the names of the modules where a new stage begins.

`split_by_names(model, ["transformer.h.4"], sample)` traces the model's own forward on one
micro-batch with PyTorch's `torch.distributed.pipelining.pipeline` (torch.export underneath,
as PyTorch's `SplitPoint.BEGINNING`), which cuts the graph at those modules.  Each stage is
a `TracedStage`: its piece of the graph, with the user's own parameters and buffers bound back
in by name (the trace copies some, tied ones among them), so gradients land in the user's
model, parameter names stay the user's, and a parameter two stages use (a tied embedding) is
one tensor.  What crosses a boundary is a dict of the graph's values a later stage needs,
the micro-batch's own inputs included (the labels, for the last stage's loss).  The trace is
for one micro-batch shape: the batch must cut into equal micro-batches.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx, nn

from ..common.errors import PipelineError


class TracedStage(nn.Module):
    """One stage of a traced split: `forward(message)` -> the message for the next stage (a dict of values), or
    on the last stage the model's output (its loss first, when it computes one)."""

    def __init__(self, graph_module: fx.GraphModule, takes: list[str], gives: list[str], passes: list[str],
                 last: bool, index: int, first_module: str, last_module: str):
        super().__init__()
        self.graph_module = graph_module
        self.takes, self.gives, self.passes, self.last = takes, gives, passes, last
        self.index, self.first_module, self.last_module = index, first_module, last_module

    def forward(self, message: dict) -> Any:
        missing = [name for name in self.takes if name not in message]
        if missing:
            raise PipelineError(f"stage {self.index} needs {missing} and did not receive them (it received "
                                f"{sorted(message)})")
        output = self.graph_module(*[message[name] for name in self.takes])
        if self.last:
            return output
        values = output if isinstance(output, tuple) else (output,)
        return {**{name: message[name] for name in self.passes}, **dict(zip(self.gives, values))}

    def extra_repr(self) -> str:
        return f"stage {self.index}: {self.first_module} .. {self.last_module}"


def split_by_names(model: nn.Module, split_points: list[str], sample: dict) -> list[TracedStage]:
    """The stages of `model` cut before each module named in `split_points` (module docstring).  `sample`: one
    micro-batch, as the keyword arguments of `model`."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    names = dict(model.named_modules())
    unknown = [name for name in split_points if name not in names]
    if unknown:
        raise ValueError(f"split_points names modules the model does not have: {unknown}; names look like "
                         f"{[n for n in list(names)[1:6]]}")
    if not isinstance(sample, dict):
        raise TypeError("split_points traces the model with a micro-batch of its keyword arguments: pass the batch "
                        f"as a dict, e.g. {{'input_ids': ..., 'labels': ...}}, got {type(sample).__name__}")
    kwargs = dict(sample)
    if getattr(getattr(model, "config", None), "use_cache", None) is not None:
        kwargs["use_cache"] = False  # a key-value cache is for generation; the trace cannot return one
    try:
        pipe = pipeline(model, mb_args=(), mb_kwargs=kwargs,
                        split_spec={name: SplitPoint.BEGINNING for name in split_points})
    except Exception as error:  # noqa: BLE001  (export's own errors say what broke the trace)
        raise PipelineError(f"PyTorch could not trace the model to split it at {split_points}: "
                            f"{type(error).__name__}: {str(error)[:600]}") from error
    stages = _stages(pipe.split_gm, [pipe.get_stage_module(i) for i in range(pipe.num_stages)], split_points, names)
    for stage in stages:
        bind_to(stage.graph_module, model)
    return stages


def _stages(split_gm: fx.GraphModule, modules: list[fx.GraphModule], split_points: list[str],
            names: dict) -> list[TracedStage]:
    """Who needs which value: each stage takes its submodule's arguments, gives its outputs, and passes on what a
    later stage needs that it does not consume itself (a mask computed on stage 0, the labels)."""
    graph = split_gm.graph
    calls = [node for node in graph.nodes if node.op == "call_module"]
    outputs_of: dict[str, list[str]] = {}  # submodule call -> the value names its outputs get
    for node in graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            source, k = node.args
            outputs_of.setdefault(source.name, []).append((k, node.name))
    takes = [[arg.name for arg in call.args] for call in calls]
    gives = [[name for _, name in sorted(outputs_of[call.name])] if call.name in outputs_of else [call.name]
             for call in calls]
    ordered = list(names)
    bounds = [ordered.index(p) for p in split_points]
    incoming = {node.name for node in graph.nodes if node.op == "placeholder"}  # stage 0 gets the micro-batch
    stages = []
    for s, (call, module) in enumerate(zip(calls, modules)):
        later = {name for t in takes[s + 1:] for name in t}
        passes = sorted((later & incoming) - set(gives[s]))
        first = ordered[bounds[s - 1]] if s > 0 else ordered[1]
        last = ordered[bounds[s] - 1] if s < len(bounds) else ordered[-1]
        stages.append(TracedStage(module, takes[s], gives[s], passes, s == len(calls) - 1, s, first, last))
        incoming = set(passes) | set(gives[s])
    return stages


def bind_to(graph_module: nn.Module, model: nn.Module) -> None:
    """Put `model`'s own parameters and buffers into `graph_module` under the same names (the trace holds copies of
    some: a tied weight appears once per use)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    for name, _ in list(graph_module.named_parameters(remove_duplicate=False)):
        if name in params:
            owner, _, leaf = name.rpartition(".")
            setattr(graph_module.get_submodule(owner) if owner else graph_module, leaf, params[name])
    for name, _ in list(graph_module.named_buffers(remove_duplicate=False)):
        if name in buffers:
            owner, _, leaf = name.rpartition(".")
            (graph_module.get_submodule(owner) if owner else graph_module).register_buffer(leaf, buffers[name])


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
