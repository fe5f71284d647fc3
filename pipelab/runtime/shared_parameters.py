"""A parameter stages on several ranks use (a tied input/output embedding), in the distributed engine.

Each rank keeps only its own stages' tensors (`keep_own_stages`), parameter by parameter, so a
parameter that one of its stages uses stays, even when another rank's stage uses it too.  Such
a parameter then lives on several ranks, each copy receiving the gradient of its own uses only.
After the step's last backward, `SharedParameters.all_reduce_gradients` sums the copies'
gradients over a process group of exactly the ranks that hold one (Megatron-LM's "embedding
group"): every copy gets the whole gradient

    dL/dw = sum over the ranks r that use w of (dL/dw through r's uses),

the optimizers of those ranks take the same step from the same values, and the copies stay equal.
A global gradient norm (clipping) counts such a parameter once, on the lowest rank that holds it
(`counted_here`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from . import comm_count
from .hybrid import local_shard
from .step import shared_parameters


class SharedParameters:
    """The shared parameters this rank holds, each with its group.  Built on every rank of `group` (the groups are
    created collectively, in the same order everywhere)."""

    def __init__(self, stages: list[nn.Module], model: nn.Module, device_of_stage: dict[int, int], group,
                 rank: int, pipelines: list[list[int]] | None = None):
        """`pipelines`: the global ranks of every pipeline in the world, in stage order, the same list on every
        rank (a hybrid layout's "pp" lines: `HybridMesh.pipelines`); default the one pipeline of `group`.  A
        process group is made by every rank of the world together, so each rank makes every pipeline's."""
        pipelines = pipelines if pipelines is not None else [dist.get_process_group_ranks(group)]
        mine = dist.get_process_group_ranks(group)
        self.rank = rank
        params = dict(model.named_parameters())
        self.entries: list[tuple[str, nn.Parameter, object]] = []  # (name, parameter, group of its ranks)
        self.ranks: dict[str, list[int]] = {}  # name -> the pipeline ranks that hold it
        for name, users in sorted(shared_parameters(stages, model).items()):
            ranks = sorted({device_of_stage[s] for s in users})
            if len(ranks) < 2:  # stages of one rank: one tensor, autograd sums its uses
                continue
            self.ranks[name] = ranks
            for line in pipelines:
                subgroup = dist.new_group([line[r] for r in ranks])
                if line == mine and rank in ranks:
                    self.entries.append((name, params[name], subgroup))

    def use(self, parameters: dict[str, nn.Parameter]) -> None:
        """The shared parameters are now these tensors ({name in the model: parameter}): FSDP's sharded ones."""
        self.entries = [(name, parameters[name], group) for name, _, group in self.entries]

    def counted_here(self, parameters: list[torch.Tensor]) -> list[torch.Tensor]:
        """`parameters` (this rank's) less the shared ones a lower rank also holds: what this rank adds to a
        global gradient norm.  After `all_reduce_gradients` every copy holds the whole gradient, so the norm
        counts it once, on the lowest rank that holds it (Megatron-LM leaves the second copy of the shared
        embedding out of the norm the same way)."""
        elsewhere = {id(parameter) for name, parameter, _ in self.entries if self.ranks[name][0] != self.rank}
        return [p for p in parameters if id(p) not in elsewhere]

    def all_reduce_gradients(self) -> None:
        """Sum each shared parameter's gradient over the ranks that hold it (a rank whose uses got no gradient
        adds zeros).  Under shard="fsdp" each copy holds its replica's shard (rows i·P/d to (i+1)·P/d of every
        copy alike): the shards are summed, and the sum of the shards is the shard of the sum."""
        for _name, parameter, group in self.entries:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            with comm_count.label("tied"):
                dist.all_reduce(local_shard(parameter.grad), group=group)


def keep_own_stages(model: nn.Module, stages: list[nn.Module], own: list[int], device: torch.device) -> None:
    """Move this rank's stages to `device`, and every other tensor of the other stages to the "meta" device
    (freed), in `model` and in the stages: tensor by tensor, so a parameter or buffer one of this rank's stages
    uses stays, whoever else uses it."""
    mine = set()
    for s in own:
        stages[s].to(device)
        mine |= {id(t) for t in stages[s].parameters()} | {id(t) for t in stages[s].buffers()}
    freed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (the tensor, its meta twin): both kept
    # alive until the end, so that no id is reused meanwhile; one twin per tensor keeps shared references one

    def meta(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in freed:
            empty = torch.empty_like(tensor, device="meta")
            twin = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
            freed[id(tensor)] = (tensor, twin)
        return freed[id(tensor)][1]

    others = [m for s, stage in enumerate(stages) if s not in own for m in stage.modules()]
    theirs = {id(t) for m in others for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]} - mine
    modules = list({id(m): m for m in [*model.modules(), *others]}.values())  # the stages of a split by names
    for module in modules:                                                   # hold the model's tensors too
        for table in (module._parameters, module._buffers):
            for name, tensor in list(table.items()):
                if tensor is not None and id(tensor) in theirs:
                    table[name] = meta(tensor)
