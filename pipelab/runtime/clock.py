"""Time each action: `time.perf_counter` on the CPU, CUDA events on a GPU (read after the step)."""

from __future__ import annotations

import time

import torch

from ..schedules.action import Action


class ActionClock:
    """Start and end of every action, in seconds of this host's `perf_counter`.

    On a CUDA device the work is asynchronous, so each action is bracketed by CUDA events
    and read after the step: an origin event is recorded at a known host time (right after
    a synchronize), and an action's start is that host time plus the events' elapsed time.
    There the allocator is read too: `torch.cuda.memory_allocated` when an action ends
    ("allocated") and `torch.cuda.max_memory_allocated` during it ("allocated_peak"), its
    peak statistic reset when the action begins, so after a step `max_memory_allocated`
    holds the peak of its last action, no longer the caller's peak from before the step.
    """

    def __init__(self, devices: list[torch.device]):
        self.began: dict[Action, float] = {}
        self.ended: dict[Action, float] = {}
        self.events: dict[Action, tuple] = {}
        self.allocated: dict[Action, int] = {}  # CUDA: torch.cuda.memory_allocated after each action
        self.allocated_peak: dict[Action, int] = {}  # CUDA: torch.cuda.max_memory_allocated during each action
        self.origin: dict[torch.device, tuple[float, torch.cuda.Event]] = {}
        for device in set(devices):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                event = torch.cuda.Event(enable_timing=True)
                event.record(torch.cuda.current_stream(device))
                self.origin[device] = (time.perf_counter(), event)

    def begin(self, action: Action, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)  # the peak of this action alone
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            self.events[action] = (device, event)
        else:
            self.began[action] = time.perf_counter()

    def end(self, action: Action, device: torch.device) -> None:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            self.events[action] += (event,)
            self.allocated[action] = torch.cuda.memory_allocated(device)
            self.allocated_peak[action] = torch.cuda.max_memory_allocated(device)
        else:
            self.ended[action] = time.perf_counter()

    def intervals(self) -> dict[Action, tuple[float, float]]:
        """action -> (start, end) in host seconds (waits for the GPUs first)."""
        if self.events:
            torch.cuda.synchronize()
        found = {a: (self.began[a], end) for a, end in self.ended.items()}
        for action, (device, begin, end) in self.events.items():
            host, origin = self.origin[device]
            start = host + origin.elapsed_time(begin) / 1e3
            found[action] = (start, start + begin.elapsed_time(end) / 1e3)
        return found
