"""What the planner needs of a model for one layout: the busiest device's work for one micro-batch.

A `TransformerSpec` gives it from closed forms (planner.py), a `ProfiledModel` from measured blocks
(profiled_model.py); the planner turns it into a step time and memory per device either way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageWork:
    forward: float  # seconds of compute of one micro-batch's forward on the busiest device (all its chunks)
    backward: float  # the same for its backward, recomputation included (W included)
    weight: float  # the part of `backward` that is the weight gradient W (ZB-H1), else 0
    all_reduces_forward: int  # tensor-parallel all-reduces of a boundary activation per forward
    all_reduces_backward: int
    boundary_bytes: float  # one micro-batch's activation where two stages meet (before slicing over tp)
    parameters: tuple[float, float]  # parameter counts on a device of the first and of the last stage
    kept_bytes: tuple[float, float]  # activation bytes one micro-batch leaves on the first / last device
    working_bytes: float  # rebuilt at a time during a backward with full recomputation
    bytes_per_value: int  # of parameters and gradients
    # for ZeRO-3 (sharding.py): the busiest device's parameters and blocks (each gathered before it computes),
    # and the largest block's parameters on the first / last device (held gathered at a time)
    busiest_parameters: float
    busiest_blocks: int
    largest_block: tuple[float, float]
