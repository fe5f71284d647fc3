"""Memory budgets: what each device holds in a training step, and a refusal before it runs out.

Per device d, over the stages the schedule puts on it (`Schedule.device_of_stage`; an interleaved
schedule puts several there), each tensor counted once per device:

    parameters   P_d = sum of numel · element_size over the device's parameters
    gradients    G_d = the same over those that require grad (a `.grad` has its parameter's dtype)
    optimizer    O_d = the rule `optimizer` names (below), or a real optimizer's state
    activations  A_d = simulate(schedule, costs, checkpoint).peak_memory[d]   (the counted rule, memory.py)
    stashed      S_d = sum over its stages s of (v_s - 1) · P_s: the extra weight versions asynchronous
                       PipeDream keeps (v_s = `versions_in_flight`, Narayanan et al. SOSP 2019, §3.3)
    buffers      the stages' buffers (BatchNorm statistics, ...)

    needs_d = P_d + G_d + O_d + A_d + S_d + buffers   <=   limit_d

Optimizer rules, for Ψ trainable elements of b bytes each (`OPTIMIZER_RULES`):

    "sgd"            0
    "momentum"       b·Ψ              one buffer (SGD's momentum_buffer)
    "adam", "adamw"  2·b·Ψ            exp_avg and exp_avg_sq: 8 bytes per parameter at fp32
    "mixed-adam"     12·Ψ             ZeRO's K = 12 (Rajbhandari et al. SC20, §3.1): an fp32 copy of the
                                      parameters, momentum and variance; with 16-bit parameters and
                                      gradients, 2Ψ + 2Ψ + 12Ψ = 16Ψ bytes of model states

A torch optimizer: the bytes of the state it holds for each parameter (Adam after a step: exp_avg,
exp_avg_sq and its 4-byte `step`); for a parameter without state yet, the rule for its class and group
(`_class_buffers`: Adam 2 buffers, 3 with amsgrad, SGD 1 with momentum, ...).  A class or a callable
`optimizer(params)` (the engines' `optimizer=`) is built on each device's parameters to find them
(torch's optimizers allocate their state at the first step, Adagrad excepted).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..model.partition import Partition
from ..schedules import one_f_one_b
from ..schedules.pipedream import versions_in_flight
from ..schedules.action import Kind
from ..schedules.schedule import Schedule
from .costs import Costs
from .fsdp_formulas import sharded_bytes, step_state_bytes
from .memory import checkpoint_plan
from .simulate import simulate

OPTIMIZER_RULES = {  # name -> (buffers of the parameter's dtype, bytes per element on top)
    "sgd": (0, 0), "momentum": (1, 0), "adam": (2, 0), "adamw": (2, 0), "mixed-adam": (0, 12),
}


class MemoryBudgetError(ValueError):
    """A step that would not fit its memory limit, refused before it runs; `needs`: every device's `DeviceMemory`."""

    def __init__(self, message: str, needs: list[DeviceMemory], limits: list[float]):
        super().__init__(message)
        self.needs, self.limits = needs, limits


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes device `device` holds for `stages` during one training step (the formulas above)."""

    device: int
    stages: tuple[int, ...]
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int | None  # None: not predicted (no costs given)
    stashed_weight_bytes: int = 0
    buffer_bytes: int = 0
    optimizer_rule: str = ""

    @property
    def model_state_bytes(self) -> int:
        """Everything but the activations: what more stages would share out."""
        return (self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes + self.stashed_weight_bytes
                + self.buffer_bytes)

    @property
    def total_bytes(self) -> int:
        return self.model_state_bytes + (self.activation_bytes or 0)

    @property
    def who(self) -> str:
        """"stage 2", or "device 0 (stages 0 and 2)" when the device holds several."""
        if len(self.stages) == 1:
            return f"stage {self.stages[0]}" + ("" if self.stages[0] == self.device else f" (device {self.device})")
        names = ", ".join(map(str, self.stages[:-1])) + f" and {self.stages[-1]}"
        return f"device {self.device} (stages {names})"

    def parts(self) -> str:
        """"parameters 1.0 MiB, gradients 1.0 MiB, optimizer 2.0 MiB (adam), activations 3.0 MiB"."""
        rule = f" ({self.optimizer_rule})" if self.optimizer_rule else ""
        activations = ("not predicted (no costs given)" if self.activation_bytes is None
                       else format_bytes(self.activation_bytes))
        parts = [f"parameters {format_bytes(self.parameter_bytes)}", f"gradients {format_bytes(self.gradient_bytes)}",
                 f"optimizer {format_bytes(self.optimizer_bytes)}{rule}", f"activations {activations}"]
        if self.stashed_weight_bytes:
            parts.append(f"stashed weights {format_bytes(self.stashed_weight_bytes)}")
        if self.buffer_bytes:
            parts.append(f"buffers {format_bytes(self.buffer_bytes)}")
        return ", ".join(parts)

    def __str__(self) -> str:
        return f"{self.who} needs {format_bytes(self.total_bytes)} ({self.parts()})"


def format_bytes(n: float) -> str:
    """Human units, powers of 1024: 512 B, 1.5 KiB, 3.0 MiB, 2.0 GiB, 1.0 TiB."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def check_limit(limit_bytes: Any, n_devices: int) -> list[float]:
    """`limit_bytes` as one positive, finite number of bytes per device (a number applies to all)."""
    def one(value, where: str) -> float:
        if isinstance(value, str):
            raise TypeError(f"memory limit{where} must be a number of bytes (16 GiB: 16 * 2**30), got {value!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"memory limit{where} must be a number of bytes, got {type(value).__name__} {value!r}")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"memory limit{where} must be a positive, finite number of bytes (None: no limit), "
                             f"got {value!r}")
        return float(value)

    if isinstance(limit_bytes, (list, tuple)):
        if len(limit_bytes) != n_devices:
            raise ValueError(f"memory limit lists {len(limit_bytes)} values for {n_devices} devices; give one per "
                             "device, or one number for all")
        return [one(v, f" of device {d}") for d, v in enumerate(limit_bytes)]
    return [one(limit_bytes, "")] * n_devices


def device_memory(partition: Partition | Sequence[nn.Module], schedule: Schedule,
                  activations: Costs | float | Sequence[float] | None = None, optimizer: Any = "adam",
                  checkpoint: str | list[bool] = "never", sharded_over: int = 1,
                  reshard_after_forward: bool = True) -> list[DeviceMemory]:
    """What each device of `schedule` holds in one training step (module docstring), one `DeviceMemory` each.

    `partition`: a `pl.split` result (or its stages), one stage per stage of `schedule`.  `activations`:
    a `pl.Costs` (e.g. `Costs.from_profile`), or the bytes a micro-batch keeps on each stage from F to B
    (`Costs.memory_bytes`: a number, or one per stage), or None (not predicted, counted as 0).
    `optimizer`: a rule name (`OPTIMIZER_RULES`), a torch optimizer, its class, or `optimizer(params)`.
    `checkpoint`: as in `pl.Pipeline` ("never", "always", "except_last" or one bool per stage).
    `sharded_over=d` (shard="fsdp" over d replicas): parameters, gradients and optimizer state as a rank holds
    them during a step (`fsdp_formulas.step_state_bytes`: P/d + what is gathered, the whole gradient, 1/d of
    the optimizer's state).
    """
    stages = list(partition.stages if isinstance(partition, Partition) else partition)
    _check_schedule(schedule)
    if len(stages) != schedule.n_stages:
        raise ValueError(f"the partition has {len(stages)} stages, the schedule {schedule.n_stages}")
    plan = checkpoint_plan(checkpoint, schedule.n_stages)
    peaks = _activation_peaks(schedule, activations, plan)
    training = not schedule.forward_only
    versions = versions_in_flight(schedule) if schedule.asynchronous else [1] * schedule.n_stages
    device_of = schedule.device_of_stage()
    needs = []
    for device in range(schedule.n_devices):
        own = tuple(sorted(s for s, d in device_of.items() if d == device))
        params = _unique([p for s in own for p in stages[s].parameters()])
        trainable = [p for p in params if p.requires_grad] if training else []
        state, rule = _optimizer_bytes(optimizer, trainable) if training else (0, "")
        stashed = sum((versions[s] - 1) * _nbytes(_unique(list(stages[s].parameters()))) for s in own)
        held = _nbytes(params), _nbytes(trainable), state
        if sharded_over > 1:
            held = _sharded(held, [stages[s] for s in own], sharded_over, reshard_after_forward, schedule)
        needs.append(DeviceMemory(device, own, *held,
                                  None if peaks is None else int(peaks[device]), stashed,
                                  _nbytes(_unique([b for s in own for b in stages[s].buffers()])), rule))
    return needs


def check_memory_budget(partition: Partition | Sequence[nn.Module], schedule: Schedule, limit_bytes: Any,
                        activations: Costs | float | Sequence[float] | None = None, optimizer: Any = "adam",
                        checkpoint: str | list[bool] = "never", **sharding) -> list[DeviceMemory]:
    """Raise `MemoryBudgetError` (a ValueError) when a device needs more than its limit; else return the needs.

    The message names the device most over its limit (by needs / limit), each part, the limit, and what
    to try, the remedy for the largest part first: activations -> checkpointing, fewer micro-batches in
    flight (1F1B instead of GPipe); parameters, gradients, optimizer -> more stages.  `sharding`: device_memory's
    `sharded_over` and `reshard_after_forward` (shard="fsdp").
    """
    _check_schedule(schedule)
    limits = check_limit(limit_bytes, schedule.n_devices)
    needs = device_memory(partition, schedule, activations, optimizer, checkpoint, **sharding)
    over = sorted((n for n in needs if n.total_bytes > limits[n.device]),
                  key=lambda n: n.total_bytes / limits[n.device], reverse=True)
    if not over:
        return needs
    worst = over[0]
    total, limit = _apart(worst.total_bytes, limits[worst.device])
    tips = _suggestions(worst, schedule, activations, checkpoint_plan(checkpoint, schedule.n_stages))
    message = f"{worst.who} needs {total} ({worst.parts()}), the limit is {limit}; try: {', '.join(tips)}"
    if over[1:]:
        message += "; over the limit too: " + ", ".join(
            "{} ({} of {})".format(n.who, *_apart(n.total_bytes, limits[n.device])) for n in over[1:])
    raise MemoryBudgetError(message, needs, limits)


def _apart(need: float, limit: float) -> tuple[str, str]:
    """Both in human units, or in bytes when those units print them alike."""
    shown = format_bytes(need), format_bytes(limit)
    return shown if shown[0] != shown[1] else (f"{int(need)} bytes", f"{int(limit)} bytes")


def _check_schedule(schedule) -> None:
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a pl.Schedule (pl.schedules.gpipe(...), ...), got {type(schedule).__name__}")


def _activation_peaks(schedule: Schedule, activations, plan: list[bool]) -> list[int] | None:
    """The simulator's counted peak per device, or None when no costs are given."""
    if activations is None:
        return None
    costs = _as_costs(activations)
    for s in range(schedule.n_stages):
        if (plan[s] and costs.per_stage("memory_bytes", s, schedule.n_stages) > 0
                and costs.per_stage("input_bytes", s, schedule.n_stages) == 0):
            raise ValueError(f"stage {s} is checkpointed, which keeps only its input, but the costs give no "
                             "input_bytes: pass a pl.Costs with input_bytes (Costs.from_profile measures them)")
    return simulate(schedule, costs, plan).peak_memory


def _as_costs(activations) -> Costs:
    if isinstance(activations, Costs):
        return activations
    if isinstance(activations, (int, float, list, tuple)) and not isinstance(activations, bool):
        return Costs(memory_bytes=activations)  # checks the numbers
    raise TypeError("activations must be a pl.Costs, the bytes a micro-batch keeps per stage (a number or a "
                    f"list), or None; got {type(activations).__name__}")


def _suggestions(need: DeviceMemory, schedule: Schedule, activations, plan: list[bool]) -> list[str]:
    """What to try, the remedy for the largest part first, with the predicted activations where computable."""
    more_stages = "more stages (each holds fewer parameters, gradients and optimizer state)"
    if not need.activation_bytes:
        return [more_stages]
    costs, d = _as_costs(activations), need.device
    for_activations = []
    if not all(plan[s] for s in need.stages):
        always = [True] * schedule.n_stages
        if not all(costs.per_stage("input_bytes", s, schedule.n_stages) > 0 for s in need.stages):
            for_activations.append("checkpointing (checkpoint='always')")
        elif (after := simulate(schedule, costs, always).peak_memory[d]) < need.activation_bytes:  # one in flight:
            for_activations.append(f"checkpointing (checkpoint='always': activations {format_bytes(after)})")  # no gain
    if schedule.name == "gpipe":
        after = format_bytes(simulate(one_f_one_b(schedule.n_stages, schedule.n_microbatches), costs, plan)
                             .peak_memory[d])
        for_activations.append(f"fewer micro-batches in flight (1F1B instead of GPipe: activations {after})")
    else:
        for_activations.append("smaller micro-batches (the batch cut into more of them: each one in flight keeps less)")
    if need.activation_bytes >= need.model_state_bytes:
        return for_activations + [more_stages]
    return [more_stages] + for_activations


def _sharded(held: tuple[int, int, int], stages: list[nn.Module], d: int, reshard_after_forward: bool,
             schedule: Schedule) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer) of a rank's `stages` under shard="fsdp" over d replicas, from the
    whole `held` (`fsdp_formulas.step_state_bytes`; the optimizer's state scaled by the shards' share)."""
    parameters, gradients, optimizer = held
    splits = any(a.kind == Kind.W for row in schedule.actions for a in row)
    steps = [step_state_bytes(stage, d, reshard_after_forward, splits, states=0) for stage in stages]
    shard = sum(sharded_bytes(stage, d) for stage in stages)
    return (sum(x["parameters"] for x in steps), sum(x["gradients"] for x in steps) if gradients else 0,
            round(optimizer * shard / parameters) if parameters else 0)


def _optimizer_bytes(optimizer: Any, params: list[torch.Tensor]) -> tuple[int, str]:
    """(bytes of optimizer state for `params`, the rule's name for the message)."""
    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZER_RULES:
            raise ValueError(f"unknown optimizer rule {optimizer!r}; choose one of {sorted(OPTIMIZER_RULES)}, "
                             "or pass a torch optimizer (its state is measured)")
        buffers, per_element = OPTIMIZER_RULES[optimizer]
        return buffers * _nbytes(params) + per_element * sum(p.numel() for p in params), optimizer
    if not params:
        return 0, ""
    if isinstance(optimizer, torch.optim.Optimizer):
        instance, measured = optimizer, True
    elif callable(optimizer):
        instance, measured = optimizer(params), False
        if not isinstance(instance, torch.optim.Optimizer):
            raise TypeError(f"optimizer(params) must build a torch.optim.Optimizer, got {type(instance).__name__}")
    else:
        raise TypeError(f"optimizer must be a rule name {sorted(OPTIMIZER_RULES)}, a torch optimizer, its class "
                        f"or optimizer(params); got {type(optimizer).__name__}")
    group_of = {id(p): g for g in instance.param_groups for p in g["params"]}
    total, any_state = 0, False
    for p in params:
        state = instance.state.get(p) if measured else None
        if state:
            any_state = True
            total += _nbytes(_unique([t for t in state.values() if isinstance(t, torch.Tensor)]))
            continue
        buffers = _class_buffers(instance, group_of.get(id(p), instance.defaults))
        if buffers is None:
            raise TypeError(f"no rule for {type(instance).__name__} before its first step: pass optimizer= one of "
                            f"{sorted(OPTIMIZER_RULES)}, or the optimizer after a step (its state is measured)")
        total += buffers * _nbytes([p])
    return total, type(instance).__name__ + (", measured" if any_state else "")


def _class_buffers(optimizer: torch.optim.Optimizer, group: dict) -> int | None:
    """Buffers of the parameter's shape and dtype a torch optimizer keeps for it (torch/optim/*.py); None: unknown."""
    optim = torch.optim
    if isinstance(optimizer, optim.SGD):
        return int(group.get("momentum", 0) != 0)
    if isinstance(optimizer, (optim.Adam, optim.AdamW)):
        return 2 + int(bool(group.get("amsgrad")))  # exp_avg, exp_avg_sq (, max_exp_avg_sq)
    if isinstance(optimizer, optim.RMSprop):
        return 1 + int(group.get("momentum", 0) > 0) + int(bool(group.get("centered")))
    if isinstance(optimizer, (optim.Adamax, optim.NAdam, optim.RAdam, optim.Adadelta, optim.Rprop, optim.SparseAdam)):
        return 2
    if isinstance(optimizer, (optim.Adagrad, optim.ASGD)):
        return 1
    return None


def _unique(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor once (a tied parameter two stages of one device use is one tensor)."""
    seen: set[int] = set()
    return [t for t in tensors if not (id(t) in seen or seen.add(id(t)))]


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
