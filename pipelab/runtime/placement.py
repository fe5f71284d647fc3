"""Where a pipeline's stages run: the one thing the engines do differently.

The step driver (`runtime/driver.py`) does everything a step, an inference pass or generation
does, the same way for every engine; it asks its *placement* only where things are:

| asked                         | `LocalPlacement` (`pl.Pipeline`)        | `RankPlacement` (`pl.DistributedPipeline`) |
|-------------------------------|-----------------------------------------|--------------------------------------------|
| which stages, on which device | every stage, one device each            | this rank's stages, on its device          |
| the schedule                  | for p stages                            | one device per rank of the group           |
| the actions, in which order   | all of them, in a dependency order      | this rank's list                           |
| the transport                 | an in-process copy                      | point to point (`p2p.py`), scatter/gather under TP |
| the rows of every action      | here already                            | exchanged (`exchange.py`)                  |
| their times                   | replayed, or measured with a GPU each   | measured, on rank 0's clock                |
| the batch, the gradients      | as given                                | a replica's share; all-reduced over "dp"   |

`Placement` below lists the methods; each placement is one class.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Protocol

import torch
from torch import nn

from ..common.threads import intra_op_threads
from ..model.partition import Partition
from ..predict.budget import check_memory_budget
from ..predict.costs import Costs
from ..schedules.action import Action
from ..schedules.dependencies import run_dependencies
from ..schedules.schedule import Schedule
from .clock import ActionClock
from . import auto_choice
from .devices import assign_devices
from .loop import InProcessTransport, StageWorker, Transport
from .memory_observer import MemoryObserver
from .options import PipelineOptions
from .step import build_partition, check_shared_devices, make_workers, resolve_schedule, unique_parameters
from .trace_builder import PlaceObserved, action_row, readings


class Placement(Protocol):
    """What the step driver asks of where the stages run (module docstring)."""

    stages: list[int]  # the stages this process runs
    devices: list[torch.device]  # the devices its clock times

    def context(self) -> contextlib.AbstractContextManager: ...
    def resolve_schedule(self, n_microbatches: int | None = None) -> Schedule: ...
    def decide(self, model: nn.Module, engine: Callable[..., dict]) -> tuple[Any, PipelineOptions]: ...
    def twin(self, options: PipelineOptions) -> "Placement": ...
    def build(self, model: nn.Module, schedule: Schedule,
              checkpoint: list[bool]) -> tuple[Partition, dict[int, StageWorker]]: ...
    def check_plain(self, what: str) -> None: ...
    def parameters(self) -> list[nn.Parameter]: ...
    def share(self, inputs: Any, targets: Any, count_tokens) -> tuple[Any, Any, float]: ...
    def combine(self, result, weight: float): ...
    def transport(self, schedule: Schedule, observer: MemoryObserver | None, signatures: list) -> Transport: ...
    def order(self, schedule: Schedule) -> list[Action]: ...
    def running(self, schedule: Schedule) -> contextlib.AbstractContextManager: ...
    def finish(self, schedule: Schedule, transport: Transport, training: bool) -> None: ...
    def gather(self, schedule: Schedule, clock: ActionClock, observer: MemoryObserver, transport: Transport,
               workers: dict[int, StageWorker]) -> tuple[dict[Action, list[float]], PlaceObserved]: ...
    def trace_labels(self) -> dict: ...
    def activation_budgets(self, driver, inputs: Any, targets: Any) -> dict[int, float]: ...
    def from_last_stage(self, tokens: torch.Tensor | None, rows: int, width: int) -> torch.Tensor: ...
    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> float: ...


class LocalPlacement:
    """Every stage in this process, stage s on `devices[s]` (one engine: `pl.Pipeline`)."""

    def __init__(self, options: PipelineOptions, n_stages: int, devices: Any = "auto"):
        self.options, self.n_stages, self.requested = options, n_stages, devices
        self.threads = options.threads
        self.stages = list(range(n_stages)) if isinstance(n_stages, int) else []
        self._orders: dict[int, tuple[Schedule, list[Action]]] = {}

    def context(self) -> contextlib.AbstractContextManager:
        return intra_op_threads(self.threads)

    def resolve_schedule(self, n_microbatches: int | None = None) -> Schedule:
        """The options' schedule for this placement (for `n_microbatches`, default the options')."""
        m = self.options.n_microbatches if n_microbatches is None else n_microbatches
        return resolve_schedule(self.options.schedule, m, n_stages=self.n_stages)

    def decide(self, model: nn.Module, engine: Callable[..., dict]) -> tuple[Any, PipelineOptions]:
        """split_method="auto" / schedule="auto": the engine's own cost per action measured (`engine(p, families)`,
        `engine_costs.py`), the model measured here, decided for one device per stage (in-process hand-overs:
        free links), and the choice taken (`auto_choice.py`)."""
        measured = engine(self.n_stages, ("whole", "split"))  # in-process hand-overs: no message latency
        plan, choice = auto_choice.decide_options(model, self.options, self.n_stages, interleave=False,
                                                  engine={family: (o, 0.0) for family, (o, _) in measured.items()})
        self.options = auto_choice.apply(choice, model, self.options)
        return plan, self.options

    def twin(self, options: PipelineOptions) -> "LocalPlacement":
        """A placement of the same stages and devices for other options (`engine_costs.py` runs one)."""
        return LocalPlacement(options, self.n_stages, self.requested)

    def build(self, model: nn.Module, schedule: Schedule,
              checkpoint: list[bool]) -> tuple[Partition, dict[int, StageWorker]]:
        """The stages cut, each moved to its device; their workers."""
        options = self.options
        partition = build_partition(model, self.n_stages, options.n_microbatches, options.split_method,
                                    options.split_points, options.sample, options.threads)
        where = schedule.device_of_stage()
        self.devices = assign_devices(self.requested, [where[s] for s in range(self.n_stages)])
        check_shared_devices(partition, self.devices)
        for stage, device in zip(partition.stages, self.devices):
            stage.to(device)
        self.partition = partition
        # one CUDA device per stage, one stage per schedule device: the events time the stages running at once
        self.wall_clock = (all(d.type == "cuda" for d in self.devices) and len(set(self.devices)) == self.n_stages
                           and sorted(where.values()) == list(range(self.n_stages)))
        workers = make_workers(schedule, partition, self.stages, options, checkpoint, self.devices.__getitem__)
        return partition, workers

    def check_plain(self, what: str) -> None:
        """Every local pipeline is plain: it infers and generates."""

    def parameters(self) -> list[nn.Parameter]:
        return unique_parameters(self.partition.stages)

    def share(self, inputs: Any, targets: Any, count_tokens) -> tuple[Any, Any, float]:
        return inputs, targets, 1.0

    def combine(self, result, weight: float):
        return result

    def transport(self, schedule: Schedule, observer: MemoryObserver | None, signatures: list) -> Transport:
        return InProcessTransport(self.devices, schedule, observer)

    def order(self, schedule: Schedule) -> list[Action]:
        """Every action, in the order a dependency run with unit times starts them (one host issues them all)."""
        cached = self._orders.get(id(schedule))
        if cached is None or cached[0] is not schedule:
            cached = (schedule, run_dependencies(schedule, duration=lambda a: 1.0).time_order())
            self._orders[id(schedule)] = cached
        return cached[1]

    def running(self, schedule: Schedule) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def finish(self, schedule: Schedule, transport: Transport, training: bool) -> None:
        """Nothing: every message is in place, a shared parameter is one tensor."""

    def gather(self, schedule: Schedule, clock: ActionClock, observer: MemoryObserver, transport: Transport,
               workers: dict[int, StageWorker]) -> tuple[dict[Action, list[float]], PlaceObserved]:
        intervals = clock.intervals()
        # on a CPU the observer's own host time inside an action is not the step's; on CUDA the events time the
        # GPU, which the host runs ahead of, so that time is not in their intervals
        counted = observer if all(d.type == "cpu" for d in self.devices) else None
        rows = {a: action_row(a, workers[a.stage], intervals[a], readings(a, clock, counted))
                for a in self.order(schedule)}
        return rows, lambda start, end, origin: observer.place(start, end)

    def trace_labels(self) -> dict:
        return {"replayed": not self.wall_clock, "device_names": [str(d) for d in self.devices], "n_processes": 1}

    def activation_budgets(self, driver, inputs: Any, targets: Any) -> dict[int, float]:
        """Before the first step: each device's parameters, gradients, optimizer state and the schedule's predicted
        activations (one micro-batch profiled: `Costs.from_profile`) against the limit (refused with each part
        named, `predict/budget.py`); returns what each device's activations may take."""
        costs = Costs.from_profile(driver.model, self.partition, (inputs, targets), driver.options.loss_fn, repeats=1,
                                   threads=self.threads)
        limits = driver.memory_limits
        needs = check_memory_budget(self.partition, driver.schedule, limits, costs, driver.memory_optimizer,
                                    driver.checkpoint)
        return {n.device: limits[n.device] - n.model_state_bytes for n in needs}

    def from_last_stage(self, tokens: torch.Tensor, rows: int, width: int) -> torch.Tensor:
        return tokens

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> float:
        """`torch.nn.utils.clip_grad_norm_` on every stage's parameters: they all live in this process."""
        return float(torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type))
