"""`Costs`: the cost model the simulator runs a schedule on.

Per stage s (a number applies to every stage, a list gives one value per stage):

- `forward[s]`, `backward[s]`, `weight[s]`: seconds for one micro-batch's F, B and W
  (W only for schedules that split the backward into B and W);
- `activation_bytes[s]`: bytes stage s sends to stage s+1 per micro-batch (its output);
  the gradient sent back has the same size;
- `memory_bytes[s]`: activation bytes stage s keeps per micro-batch from F to B;
- `input_bytes[s]`: bytes of stage s's input per micro-batch, all a checkpointed stage keeps;
- `weight_memory_bytes[s]`: of a split backward (I, then W), the bytes a micro-batch still holds from
  its I to its W: the inputs of the layers with weights and the gradients of their outputs (Zero
  Bubble PP's M_W, Qi et al. 2024, Table 1); None: all it held, nothing leaves before W;
- `latency` (seconds) and `bandwidth` (bytes/second) of every link.

A message between stages s and s+1 takes  latency + activation_bytes[s] / bandwidth.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

import torch

from ..common.checks import check_repeats
from ..common.threads import intra_op_threads
from ..model import boundary
from ..model import stage as stage_ops
from ..model.named_split import model_loss
from ..model.fused_accumulation import FusedAccumulation

PerStage = float | Sequence[float]


@dataclass(frozen=True)
class Costs:
    forward: PerStage = 1.0
    backward: PerStage = 2.0
    weight: PerStage = 0.0
    latency: float = 0.0
    bandwidth: float = math.inf
    activation_bytes: PerStage = 0.0
    memory_bytes: PerStage = 0.0
    input_bytes: PerStage = 0.0
    weight_memory_bytes: PerStage | None = None

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "weight", "activation_bytes", "memory_bytes", "input_bytes",
                     "weight_memory_bytes"):
            values = getattr(self, name)
            if values is None and name == "weight_memory_bytes":
                continue
            values = list(values) if isinstance(values, (list, tuple)) else [values]
            if not values or any(not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0
                                 for v in values):
                raise ValueError(f"Costs.{name} must be a non-negative number or a list of them, got {getattr(self, name)!r}")
        if not (isinstance(self.latency, (int, float)) and self.latency >= 0 and math.isfinite(self.latency)):
            raise ValueError(f"Costs.latency must be a non-negative number of seconds, got {self.latency!r}")
        if not (isinstance(self.bandwidth, (int, float)) and self.bandwidth > 0):
            raise ValueError(f"Costs.bandwidth must be positive (bytes per second), got {self.bandwidth!r}")

    def per_stage(self, name: str, stage: int, n_stages: int) -> float:
        """The value of `name` for `stage` (checks that a list has one value per stage)."""
        values = getattr(self, name)
        if isinstance(values, (list, tuple)):
            if len(values) != n_stages:
                raise ValueError(f"Costs.{name} lists {len(values)} values for {n_stages} stages; give one per stage")
            return float(values[stage])
        return float(values)

    def message_seconds(self, stage: int, n_stages: int) -> float:
        """Time to send stage `stage`'s output (or the gradient of it) across one link."""
        return self.latency + self.per_stage("activation_bytes", stage, n_stages) / self.bandwidth

    @classmethod
    def from_profile(cls, model, parts, sample_batch: tuple[Any, Any], loss_fn: Callable | None,
                     repeats: int = 5, latency: float = 0.0, bandwidth: float = math.inf,
                     threads: int | None = 1, fused_accumulation: bool = True,
                     split_backward: bool = False) -> "Costs":
        """Measure forward/backward seconds, bytes sent and kept, per stage.

        `parts` is a `pl.split` result of `model`; `sample_batch` = (inputs, targets) of ONE
        micro-batch (for a model split by names: (its keyword arguments, None) with `loss_fn` None, the
        model's own loss; what a stage sends may be any structure, its tensors' bytes counted).  Uses the engine's own stage forward/backward, so what is measured is
        what the engine runs.  The model's `.grad` is restored afterwards.  The ops run on
        `threads` intra-op threads (default 1, like the engine's step; None: the caller's setting),
        with the weight gradients accumulated as the engines do by default (`fused_accumulation`,
        `model/fused_accumulation.py`; False for a pipeline built with it off).  `split_backward`: time each
        backward as a schedule with W actions runs it, I then W (`backward` then holds I's seconds and `weight`
        W's, Zero Bubble PP's T_B and T_W; no fused accumulation, which a split backward does not use); the W's
        run after every stage's I, deferred as such a schedule defers them.

        Each stage's forward and backward seconds are the best (minimum) of `repeats` runs:
        other work on the machine, a cold cache or a page fault only ever add time, so the
        fastest run is the closest to what the ops cost.
        """
        check_repeats(repeats)
        with intra_op_threads(threads), stage_ops.buffers_kept(model.buffers()):  # no BatchNorm update of its own
            return cls._profile(model, parts, sample_batch, loss_fn, repeats, latency, bandwidth,
                                fused_accumulation and not split_backward, split_backward)

    @classmethod
    def _profile(cls, model, parts, sample_batch, loss_fn, repeats, latency, bandwidth, fused, split) -> "Costs":
        inputs, targets = sample_batch
        saved_grads = [p.grad for p in model.parameters()]
        for p in model.parameters():  # profile into fresh .grad tensors, then put the caller's back
            p.grad = None
        n = len(parts.stages)
        forward = [[] for _ in range(n)]
        backward = [[] for _ in range(n)]
        weight = [[] for _ in range(n)]
        sent, kept, received = [0.0] * n, [0.0] * n, [0.0] * n
        fusions = [FusedAccumulation(stage, list(stage.parameters())) if fused else None for stage in parts.stages]
        counters = [stage_ops.SavedTensors(list(stage.parameters())) for stage in parts.stages]
        devices = [next(stage.parameters(), torch.empty(0)).device for stage in parts.stages]
        for _ in range(repeats):
            activation, held = inputs, []
            for s, stage in enumerate(parts.stages):
                inp = stage_ops.as_input(_move(activation, devices[s]), s == 0)
                loss = partial(_loss_of, loss_fn, target=_move(targets, devices[s])) if s == n - 1 else None
                run = _as_the_engine_runs(stage_ops.stage_function(stage, fusions[s], loss,
                                                                   stage_ops.starts_in_place(stage)))
                begin = _now(devices[s])
                with counters[s]:  # what the engine counts: the bytes autograd saves during the forward
                    output, kept_here = stage_ops.forward(run, inp)
                forward[s].append(_now(devices[s]) - begin)
                held.append(kept_here)
                received[s] = (inp.untyped_storage().nbytes() if isinstance(inp, torch.Tensor)
                               else boundary.nbytes(inp))
                kept[s] = counters[s].bytes
                if s < n - 1:
                    activation = boundary.detached(output)
                    sent[s] = boundary.nbytes(activation)
            gradient, owed = None, {}
            for s in range(n - 1, -1, -1):
                begin = _now(devices[s])
                if split:
                    gradient, owed[s] = stage_ops.input_gradient(held[s],
                                                                 boundary.moved(gradient, devices[s], copy=False),
                                                                 list(parts.stages[s].parameters()))
                else:
                    gradient = stage_ops.backward(held[s], boundary.moved(gradient, devices[s], copy=False))
                backward[s].append(_now(devices[s]) - begin)
            for s, work in owed.items():  # each W after every I, as a schedule defers them (its inputs gone cold)
                begin = _now(devices[s])
                stage_ops.weight_gradient(work)
                weight[s].append(_now(devices[s]) - begin)
        for_w = _held_for_w(parts, inputs, targets, loss_fn, devices, counters)
        for p, g in zip(model.parameters(), saved_grads):
            p.grad = g
        return cls(forward=[min(t) for t in forward], backward=[min(t) for t in backward],
                   weight=[min(t) for t in weight] if split else 0.0, latency=latency, bandwidth=bandwidth, activation_bytes=sent, memory_bytes=kept,
                   input_bytes=received, weight_memory_bytes=for_w)


def _held_for_w(parts, inputs, targets, loss_fn, devices, counters) -> list[float]:
    """Per stage, the bytes a micro-batch holds from its I to its W when the backward is split, from one
    untimed forward and I then W, as the engine runs them (`stage.held_for_w_bytes`)."""
    n = len(parts.stages)
    activation, held, saved = inputs, [], []
    for s, stage in enumerate(parts.stages):
        inp = stage_ops.as_input(_move(activation, devices[s]), s == 0)
        loss = partial(_loss_of, loss_fn, target=_move(targets, devices[s])) if s == n - 1 else None
        run = _as_the_engine_runs(stage_ops.stage_function(stage, None, loss, stage_ops.starts_in_place(stage)))
        with counters[s]:
            output, kept_here = stage_ops.forward(run, inp)
            saved.append(counters[s].take())
        held.append(kept_here)
        if s < n - 1:
            activation = boundary.detached(output)
    found, gradient = [0.0] * n, None
    for s in range(n - 1, -1, -1):
        parameters = list(parts.stages[s].parameters())
        gradient, for_w = stage_ops.input_gradient(held[s], boundary.moved(gradient, devices[s], copy=False), parameters)
        found[s] = float(stage_ops.held_for_w_bytes(for_w, *saved[s]))
        stage_ops.weight_gradient(for_w)
    return found


def _loss_of(loss_fn: Callable | None, output: Any, target: Any) -> torch.Tensor:
    """`loss_fn(output, target)`, or the model's own loss (`output.loss`) when `loss_fn` is None."""
    return model_loss(output) if loss_fn is None else loss_fn(output, target)


def _as_the_engine_runs(compute: Callable) -> Callable:
    """The stage's output, or on the last stage its loss times a weight (n_i / N in the engines; 1 here)."""
    def run(inp):
        output, loss = compute(inp)
        return output if loss is None else loss * 1.0
    return run


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _move(batch: Any, device: torch.device) -> Any:
    """A copy on `device`, owning its storage (so its bytes are counted as one micro-batch's)."""
    return batch.to(device, copy=True) if isinstance(batch, torch.Tensor) else boundary.moved(batch, device, True)
