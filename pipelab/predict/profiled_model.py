"""A model `pl.plan` knows by measurement: each block's seconds and bytes for one micro-batch.

    profile = pl.ProfiledModel.measure(model, (inputs, targets), loss_fn)   # b = len(inputs)
    found = pl.plan(profile, n_devices=4, devices_per_node=4, memory_bytes=..., global_batch=32,
                    inside=(latency, bandwidth), between=(latency, bandwidth))

`measure` runs `Costs.from_profile` on the model split into one stage per block, so every number is what
the engine runs: per block, forward and backward seconds, the activation bytes it keeps from its forward
to its backward, the bytes of its output (what a stage boundary sends), and its parameters.

For a layout with p stages (p·v with interleaving), the planner cuts the blocks where forward + backward
seconds balance best (`balanced_bounds`); the busiest device (the largest sum of its stages) gives

    T_F = Σ forward,   T_B = Σ backward (+ Σ forward with full recomputation: the stage's forward again)
    kept per micro-batch on a device = Σ kept bytes of its blocks (full recomputation: the bytes its
    stages receive, plus the largest stage's kept bytes rebuilt at a time during a backward)
    parameters = Σ over the blocks of the first and of the last device (and of the busiest, with its
    count of blocks and the largest block of the first and of the last: ZeRO-3's gathers, sharding.py)

and the rest (bubbles, messages, data-parallel all-reduce, memory per schedule) is the planner's
closed forms.  Only tp = 1 (a profiled block has no tensor-parallel plan) and the profiled micro-batch
size b; selective recomputation needs attention's own split and is not offered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from ..model.partition import balanced_bounds, split
from .costs import Costs
from .stage_work import StageWork


@dataclass(frozen=True)
class ProfiledModel:
    """One micro-batch of `micro_batch_size` samples, measured per block (module docstring)."""

    micro_batch_size: int
    forward: tuple[float, ...]  # seconds per block
    backward: tuple[float, ...]
    kept_bytes: tuple[float, ...]  # activation bytes a block keeps from its forward to its backward
    output_bytes: tuple[float, ...]  # its output's bytes: what a cut after it sends
    input_bytes: float  # the model's input bytes (what the first stage receives)
    parameters: tuple[int, ...]
    bytes_per_value: int = 4  # of the parameters and gradients (fp32 Adam: 8 more per parameter)

    def __post_init__(self) -> None:
        n = len(self.forward)
        if n == 0 or any(len(values) != n for values in (self.backward, self.kept_bytes, self.output_bytes,
                                                         self.parameters)):
            raise ValueError("ProfiledModel needs one forward, backward, kept_bytes, output_bytes and parameters "
                             f"value per block, got {[len(v) for v in (self.forward, self.backward, self.kept_bytes, self.output_bytes, self.parameters)]}")
        if isinstance(self.micro_batch_size, bool) or not isinstance(self.micro_batch_size, int) \
                or self.micro_batch_size < 1:
            raise ValueError(f"ProfiledModel.micro_batch_size must be a positive int, got {self.micro_batch_size!r}")

    @property
    def n_blocks(self) -> int:
        return len(self.forward)

    @classmethod
    def measure(cls, model: nn.Sequential, sample_batch: tuple[Any, Any], loss_fn: Callable,
                repeats: int = 5) -> "ProfiledModel":
        """Profile `model` (an `nn.Sequential`) block by block on one micro-batch `sample_batch` = (inputs,
        targets); its size is the micro-batch size the planner will use."""
        if not isinstance(model, nn.Sequential):
            raise TypeError(f"ProfiledModel.measure profiles an nn.Sequential block by block, got "
                            f"{type(model).__name__}")
        n = len(model)
        costs = Costs.from_profile(model, split(model, n), sample_batch, loss_fn, repeats=repeats)
        per = lambda name: tuple(costs.per_stage(name, s, n) for s in range(n))
        value = next(model.parameters())
        return cls(micro_batch_size=len(sample_batch[0]), forward=per("forward"), backward=per("backward"),
                   kept_bytes=per("memory_bytes"), output_bytes=per("activation_bytes"),
                   input_bytes=costs.per_stage("input_bytes", 0, n),
                   parameters=tuple(sum(q.numel() for q in block.parameters()) for block in model),
                   bytes_per_value=value.element_size())

    def cut(self, n_stages: int) -> list[tuple[int, int]]:
        """Block bounds of `n_stages` stages whose forward + backward seconds balance best."""
        return balanced_bounds([f + b for f, b in zip(self.forward, self.backward)], n_stages)

    def stage_work(self, n_devices: int, chunks: int, recompute: str, weight_share: float,
                   split_weight: bool) -> StageWork:
        """The busiest device's work for one micro-batch and the first and last device's bytes (module
        docstring); `split_weight`: the backward's W share is `weight_share` of its multiplies (ZB-H1)."""
        bounds = self.cut(n_devices * chunks)
        devices = [[bounds[s] for s in range(d, len(bounds), n_devices)] for d in range(n_devices)]
        total = lambda values, stages: sum(sum(values[a:b]) for a, b in stages)
        forward = [total(self.forward, stages) for stages in devices]
        backward = [total(self.backward, stages) for stages in devices]
        busiest = max(range(n_devices), key=lambda d: forward[d] + backward[d])
        again = forward[busiest] if recompute == "full" else 0.0

        def kept(stages) -> float:
            if recompute != "full":
                return total(self.kept_bytes, stages)
            return sum(self.input_bytes if a == 0 else self.output_bytes[a - 1] for a, _ in stages)

        working = 0.0 if recompute != "full" else max(total(self.kept_bytes, [stage]) for stage in bounds)
        sent = max(self.output_bytes[b - 1] for _, b in bounds[:-1]) if len(bounds) > 1 else 0.0
        return StageWork(forward=forward[busiest], backward=backward[busiest] + again,
                         weight=weight_share * backward[busiest] if split_weight else 0.0,
                         all_reduces_forward=0, all_reduces_backward=0, boundary_bytes=sent,
                         parameters=(total(self.parameters, devices[0]), total(self.parameters, devices[-1])),
                         kept_bytes=(kept(devices[0]), kept(devices[-1])), working_bytes=working,
                         bytes_per_value=self.bytes_per_value,
                         busiest_parameters=total(self.parameters, devices[busiest]),
                         busiest_blocks=max(1, sum(1 for a, b in devices[busiest] for k in range(a, b)
                                                   if self.parameters[k])),
                         largest_block=tuple(max((self.parameters[k] for a, b in devices[i] for k in range(a, b)),
                                                 default=0) for i in (0, -1)))
