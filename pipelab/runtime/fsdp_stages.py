"""Fully sharded data parallelism (FSDP2) inside a pipeline stage: `pl.DistributedPipeline(..., shard="fsdp")`.

Each block of this rank's stages (after tensor parallelism split it over "tp", if any: FSDP2
then shards the tensor-parallel shards, a 2-D placement), then the stage itself, is wrapped with
torch's own `fully_shard` on the "dp" dimension of the ("dp", "pp", "tp") DeviceMesh: a replica keeps 1/d
of each parameter, FSDP all-gathers a block's parameters before its forward and its backward
and frees them after (`reshard_after_forward=True`), or keeps them gathered from the step's
first forward to its end (`False`: one all-gather per block per step, the whole stage held).

A step's m micro-batches meet FSDP's per-backward hooks.  Reduce-scattering in each backward
would move the gradients m times, and under a split backward (I, then W later: zero-bubble
schedules) the hooks fire at I, before W has computed any weight gradient.  So every backward
of the step only accumulates the full (unsharded) gradients (`set_requires_gradient_sync(False)`),
and after the stage's last action `reduce_gradients` reduce-scatters them once: FSDP's own
post-backward, run by hand, as torch's pipelining does in its REDUCE_GRAD action
(`torch/distributed/pipelining/stage.py`, `perform_reduce_grad`).  Replicas may hold uneven
shares of the batch: each one's gradients are scaled by its weight n_r / N before a summing
reduce-scatter, so the result is the whole batch's gradient exactly.

Under a split backward the graph's weights are the *gathered* parameters, not the sharded ones
the module holds between steps: `gathered_parameters` finds them (stable tensors FSDP reuses
for every gather) for W to differentiate, and W runs with them gathered (`gathered_for`).

All-gathers per block and step: 1 with reshard_after_forward=False (kept from the first
forward to the reduce-scatter); with True, one per forward, per backward (B or I) and per W:
2m, or 3m on a stage with a split backward whose input needs a gradient (the first stage's I
computes nothing, its W the whole backward: 2m).  One reduce-scatter per block and step.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from ..predict.fsdp_formulas import sharding_units

SHARDINGS = (None, "fsdp")


def check_shard(shard, reshard_after_forward) -> None:
    """`shard` is None (each replica holds the whole model) or "fsdp"; `reshard_after_forward` a bool."""
    if shard not in SHARDINGS:
        raise ValueError(f"shard={shard!r} is not a sharding pipelab knows: shard=None replicates each stage over the "
                         'data-parallel replicas (gradients all-reduced), shard="fsdp" shards its parameters, '
                         "gradients and optimizer state over them with torch's fully_shard (FSDP2, ZeRO-3)")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be True or False, got {reshard_after_forward!r}")


def _point_at(model: nn.Module, sharded: dict[int, nn.Parameter]) -> None:
    """Every place in `model` that held a parameter now sharded (id of the old tensor -> its sharded
    parameter) holds the sharded one: fully_shard replaces the parameters of the modules it wraps, which for a
    model split by names are the stage's own (`TracedStage.tensors`), not the user's model's; a tied weight is
    replaced under each of its names."""
    for module in model.modules():
        for name, tensor in list(module._parameters.items()):
            if tensor is not None and id(tensor) in sharded:
                module._parameters[name] = sharded[id(tensor)]


def _fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


class ShardedStages:
    """This rank's stages, fully sharded over `dp_mesh` (module docstring)."""

    def __init__(self, stages: list[nn.Module], dp_mesh, reshard_after_forward: bool, model: nn.Module):
        self.stages, self.reshard_after_forward = stages, reshard_after_forward
        self.gathered: dict[int, list[nn.Parameter]] = {}  # id(stage) -> its gathered parameters
        held = [(module, name, p) for stage in stages for module in stage.modules()
                for name, p in module._parameters.items() if p is not None]
        for stage in stages:
            blocks = [block for block in sharding_units(stage) if any(True for _ in block.parameters())]
            for block in blocks:
                fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
            fully_shard(stage, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
            for k, block in enumerate(blocks):
                # a backward gathers the block before, of the same micro-batch: FSDP's default looks it up in the
                # order of every forward since the last reduce, where another micro-batch's block may come first
                block.set_modules_to_backward_prefetch([blocks[k - 1] if k else block])
            for module in _fsdp_modules(stage):
                module.set_force_sum_reduction_for_comms(True)  # a plain sum: each replica scales its own part
                module.set_gradient_divide_factor(1.0)
            self._accumulating(stage)
        _point_at(model, {id(p): module._parameters[name] for module, name, p in held})

    def _accumulating(self, stage: FSDPModule) -> None:
        """Backwards that accumulate full gradients, not reduced, not the step's last (module docstring)."""
        stage.set_requires_gradient_sync(False)
        stage.set_reshard_after_backward(self.reshard_after_forward)
        stage.set_is_last_backward(False)

    def gathered_for(self, stage: FSDPModule, run: Callable) -> Callable:
        """`run` (a W action) with `stage`'s weights gathered, then freed again (reshard_after_forward): the
        graph I left holds the gathered tensors, whose storage a reshard since (after I, or a forward between
        I and W) has freed."""
        modules = _fsdp_modules(stage)

        def run_gathered(*args):
            for module in modules:
                module.unshard()
            try:
                return run(*args)
            finally:
                if self.reshard_after_forward:
                    for module in modules:
                        module.reshard()

        return run_gathered

    def gathered_parameters(self, stage: FSDPModule) -> list[nn.Parameter]:
        """The tensors `stage`'s weights are gathered into (what its autograd graph holds): every FSDP module of
        the stage unsharded once, its parameters read, and resharded.  FSDP reuses these tensors for every later
        gather (only their storage is freed and refilled)."""
        modules = _fsdp_modules(stage)
        for module in modules:
            module.unshard()
        found = list(stage.parameters())
        for module in modules:
            module.reshard()
        self.gathered[id(stage)] = found
        return found

    def reduce_gradients(self, weight: float) -> None:
        """After the step's last backward: every stage's accumulated full gradients times `weight` (this replica's
        n_r / N), reduce-scattered once (summed) into the sharded parameters' `.grad`; the parameters resharded."""
        for stage in self.stages:
            states = fully_shard.state(stage)  # torch's pipelining reaches the same state (module docstring)
            groups = [group for state in states._state_ctx.all_states for group in state._fsdp_param_groups]
            with torch.no_grad():
                for p in self.gathered[id(stage)]:
                    if p.grad is not None:
                        p.grad.mul_(weight)
            stage.set_requires_gradient_sync(True)
            stage.set_reshard_after_backward(True)
            stage.set_is_last_backward(True)
            try:
                for group in groups:
                    group.post_backward()
                states._root_post_backward_final_callback()
            finally:
                self._accumulating(stage)

    def drop_gradients(self) -> None:
        """After a pass whose gradients must not count (the warm-up): the accumulated full gradients dropped, the
        parameters resharded."""
        for stage in self.stages:
            for p in self.gathered.get(id(stage), []):
                p.grad = None
            for module in _fsdp_modules(stage):
                module.reshard()
