"""The local engine: run any valid Schedule in one process, on GPUs or on the CPU.

`pl.Pipeline` is a façade: it builds the options (`runtime/options.py`) and a
`LocalPlacement` (every stage here, one device each: `runtime/placement.py`), and the step
driver (`runtime/driver.py`) does the rest, as for every engine.  "Sending" is a copy to the next
stage's device.  With one CUDA device per stage, CUDA events time each action ("measured");
when stages share a device, the measured durations are replayed on one virtual clock per
stage ("replayed").  The trace holds the "counted" and "observed" memory curves
(`runtime/memory_observer.py`), plus on CUDA "allocated" and "allocated_peak".

Details: docs/engines.md, "Replayed and measured".
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from ..model.partition import Partition
from ..schedules.schedule import Schedule
from .engine import Engine
from .options import LocalPlacementArgs, PipelineOptions, engine_signature
from .placement import LocalPlacement


class Pipeline(Engine):
    """Pipeline-parallel training of a model on local devices: an `nn.Sequential`, or any module with split_points.

    `pl.Pipeline(model, n_stages=4, n_microbatches=8, schedule="1f1b", loss_fn=nn.MSELoss())`.  Everything after
    `model` is a keyword: `n_stages` and `devices` say where the stages run; every other keyword is an option that
    `pl.DistributedPipeline` takes too, documented once in `pl.PipelineOptions` (or give `options=` whole).  The
    methods every engine has (`step`, `evaluate`, `infer`, `generate`, checkpoints) are `runtime/engine.py`'s.

    Args:
        model: an `nn.Sequential` of blocks (see `pl.models`), or any module with `split_points`; its parameters
            receive the gradients.
        n_stages: p.
        devices: "auto", "cpu", "cuda", a device name, or a list with one device per stage.
        options: a `pl.PipelineOptions`; the keywords given beside it replace its fields.
        **settings: the options, by name (`pl.PipelineOptions`): n_microbatches, schedule, loss_fn, ...
    """

    def __init__(self, model: nn.Module, *, options: PipelineOptions | None = None, **settings: Any):
        options, where = PipelineOptions.build("Pipeline", LocalPlacementArgs, options, settings)
        self.requested_devices = where.devices
        self._start(model, options, LocalPlacement(options, where.n_stages, where.devices))
        self.devices, self.threads = self.placement.devices, options.threads

    def restage(self, n_stages: int, schedule: str | Schedule | None = None, devices: Any = None,
                split_points: list[str] | None = None) -> None:
        """Cut the same model into `n_stages` stages between two steps (devices came or went): the same
        parameters, their `.grad` and so any optimizer over them go on as before, so training continues as
        if uninterrupted.  `schedule`: for the new depth (default: this one's name, e.g. "1f1b"); `devices`:
        for the new stages (default: as before, when that was a name like "cpu").  A model split by names is
        traced again: at `split_points` (the modules where the new stages 1, 2, ... begin), or, without them,
        its repeated blocks cut by this pipeline's `split_method` (as `pl.split` cuts a model given no points:
        `model/partition.py: points_for`)."""
        if schedule is None:
            if not isinstance(self.options.schedule, str):
                raise ValueError("this pipeline runs a hand-made Schedule: give restage(n, schedule=...) for the "
                                 f"new depth of {n_stages} stages")
            schedule = self.options.schedule
        if devices is None:
            if not isinstance(self.requested_devices, str):
                raise ValueError("this pipeline has one device per stage: give restage(n, devices=[...]) with "
                                 f"one for each of the {n_stages} new stages")
            devices = self.requested_devices
        if isinstance(self.options.split_method, Partition):
            raise ValueError("this pipeline was given a Partition: build a new one for the new depth")
        if split_points is not None and self.options.sample is None:
            raise ValueError("split_points cut a model by names, traced on sample=; this pipeline was built without "
                             "one (an nn.Sequential cut between its blocks): restage(n) re-cuts it by its split_method")
        by_names = self.options.split_points is not None or split_points is not None
        options = dataclasses.replace(self.options, schedule=schedule)
        if by_names:  # the old points made the old depth: the new ones, or the method's cut for the new depth
            options = dataclasses.replace(options, split_points=None if split_points is None else list(split_points))
        self.__init__(self.model, n_stages=n_stages, devices=devices, options=options)


Pipeline.__init__.__signature__ = engine_signature(LocalPlacementArgs)
