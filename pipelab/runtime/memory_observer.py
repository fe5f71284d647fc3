"""Observed activation memory: when each storage a stage keeps is really allocated and freed.

The "counted" curve (`pipelab.predict.memory.activation_samples`) applies a rule: a micro-batch's
saved bytes appear when its F ends and go when its B ends.  This module measures instead,
without that rule: `MemoryObserver.keep` notes a kept storage's bytes and host time and puts a
weak reference with a callback on it, which runs when PyTorch frees the storage, whoever held
it last.  A storage counts once per device, for its strongest reason (REASONS).

`MemoryObserver.place` puts each change on the trace's time axis: inside the host window
[h0, h1] of an action A, t' = start'(A) + min(t - h0, end'(A) - start'(A)); outside every
window, at end'(P), P the last action before it; with `shift=c`, t' = t + c.

Details (what a stage keeps, what is left out, the time axis, the observer's own time):
docs/memory.md, "Observed memory".
"""

from __future__ import annotations

import bisect
import time
import weakref
from typing import Any

import torch

from ..model.stage import plain_tensors
from ..predict.budget import MemoryBudgetError, format_bytes
from ..schedules.action import Action
from ..schedules.trace import MemorySample

REASONS = ("saved", "input", "output", "gradient", "received")
"""Why a stage keeps a storage, strongest first: saved by autograd for backward; the stage's input
(the micro-batch, an activation received); its output until sent; a gradient it computed until
sent; a message (activation or gradient) arrived or its receive buffer posted, not yet used."""
REASON_INDEX = {why: k for k, why in enumerate(REASONS)}


class MemoryObserver:
    """Lifetimes of the storages the stages of one process keep during one step."""

    def __init__(self, device_of_stage: dict[int, int], excluded: list[torch.Tensor] = (),
                 budgets: dict[int, float] | None = None):
        self.device_of_stage = device_of_stage
        # a memory limit held during the step: {device: bytes its activations may take (the limit less its model
        # state)}; a storage kept past it raises `MemoryBudgetError` in the action that kept it
        self.budgets, self.level = budgets, {}
        # parameters: not activations (autograd's saved tensors come already without them, `stage.SavedBytesCounter`)
        self.excluded = {plain.untyped_storage().data_ptr() for t in excluded for plain in plain_tensors(t)}
        # the changes, in four flat lists of numbers (nothing for the cyclic GC to track and collect
        # in the middle of an action): host seconds, device, +bytes or -bytes, reason index
        self.times: list[float] = []
        self.spent_at: list[float] = []  # the observer's own time so far, when each change happened
        self.devices: list[int] = []
        self.deltas: list[int] = []
        self.reasons: list[int] = []
        # what is alive: key (data_ptr, device) -> its weakref, reason index, bytes.  Data pointers are
        # unique across devices (CUDA's unified virtual addressing) while the storage lives.
        self.refs: dict[tuple[int, int], weakref.ref] = {}
        self.reason: dict[tuple[int, int], int] = {}
        self.size: dict[tuple[int, int], int] = {}
        self.key_of: dict[int, tuple[int, int]] = {}  # id(weakref) -> key
        self.freed_callback = self._freed  # one bound method for every weakref
        self.windows: list[tuple[float, float, Action]] = []  # (h0, h1, action), in the order run
        self.own: dict[Action, float] = {}  # seconds the observer itself spent inside each action
        self.spent = 0.0  # seconds spent in `keep` and in the callbacks, so far
        self._began: tuple[float, float] = (0.0, 0.0)

    # -- recording ---------------------------------------------------------------------
    def keep(self, stage: int, tensor: Any, why: str = "saved") -> None:
        """Count `tensor`'s storage on `stage`'s device, for reason `why`, from now until PyTorch frees it.

        Once per device: a storage kept again only moves to a stronger reason.  The time this
        takes is added to `spent` (and, on CPUs, taken out of the action's measured time by the local engine).
        """
        began = time.perf_counter()
        self._keep(stage, tensor, why, began)
        self.spent += time.perf_counter() - began

    def _keep(self, stage: int, tensor: Any, why: str, now: float) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        device, reason = self.device_of_stage[stage], REASON_INDEX[why]
        for plain in plain_tensors(tensor):  # a DTensor: its memory is the tensors it wraps
            storage = plain.untyped_storage()
            pointer = storage.data_ptr()
            if pointer == 0 or pointer in self.excluded:  # no bytes (empty, or on the meta device), or a parameter
                continue
            key = (pointer, device)
            if key in self.refs:
                old = self.reason[key]
                if reason < old:  # the same bytes, now for a stronger reason
                    self._change(now, device, -self.size[key], old)
                    self._change(now, device, self.size[key], reason)
                    self.reason[key] = reason
                continue
            nbytes = storage.nbytes()
            self._change(now, device, nbytes, reason)
            ref = weakref.ref(storage, self.freed_callback)
            self.refs[key], self.reason[key], self.size[key], self.key_of[id(ref)] = ref, reason, nbytes, key

    def _change(self, now: float, device: int, delta: int, reason: int) -> None:
        if self.budgets is not None:
            level = self.level[device] = self.level.get(device, 0) + delta
            if delta > 0 and level > self.budgets[device]:
                raise MemoryBudgetError(
                    f"device {device} holds {format_bytes(level)} of activations and messages, over the "
                    f"{format_bytes(self.budgets[device])} its memory limit leaves beside its parameters, gradients "
                    "and optimizer state (the prediction counts activations only; messages waiting also take room); "
                    "try: a higher limit, checkpointing, fewer micro-batches in flight", [], [])
        self.times.append(now)
        self.spent_at.append(self.spent)
        self.devices.append(device)
        self.deltas.append(delta)
        self.reasons.append(reason)

    def _freed(self, ref: weakref.ref) -> None:
        """Called by Python when PyTorch frees a storage kept."""
        began = time.perf_counter()
        key = self.key_of.pop(id(ref), None)
        if key is not None and self.refs.pop(key, None) is not None:
            self._change(began, key[1], -self.size.pop(key), self.reason.pop(key))
        self.spent += time.perf_counter() - began

    @property
    def changes(self) -> list[tuple[float, int, int, int]]:
        """(host seconds, device, +bytes or -bytes, reason index) of every change, in order."""
        return list(zip(self.times, self.devices, self.deltas, self.reasons))

    def begin(self, action: Action) -> None:
        """`action`'s host window opens."""
        self._began = (time.perf_counter(), self.spent)

    def end(self, action: Action) -> None:
        began, spent = self._began
        self.windows.append((began - spent, time.perf_counter() - self.spent, action))  # on the observer-free clock
        self.own[action] = self.spent - spent

    def close(self) -> None:
        """Stop observing: storages still alive are left alone (their callbacks find nothing to note)."""
        for table in (self.refs, self.reason, self.size, self.key_of):
            table.clear()

    @property
    def still_kept(self) -> int:
        """Bytes still alive of what was kept (0 after a step that freed everything)."""
        return sum(self.deltas)

    # -- the trace's time axis -----------------------------------------------------------
    def place(self, start: dict[Action, float], end: dict[Action, float],
              shift: float | None = None) -> list[tuple[float, int, int, int]]:
        """The changes as (trace time, device, delta, reason index), by the rules of the module docstring."""
        if shift is not None:
            return [(t + shift, *rest) for t, *rest in self.changes]
        if not self.windows:
            return []
        opens = [h0 for h0, _, _ in self.windows]
        placed = []
        for (t, *rest), spent in zip(self.changes, self.spent_at):
            t -= spent  # on the clock without the observer's own time, as the windows
            k = bisect.bisect_right(opens, t) - 1  # the last action that began at or before t
            if k < 0:
                where = start[self.windows[0][2]]
            else:
                h0, h1, action = self.windows[k]
                if t <= h1:
                    where = start[action] + min(t - h0, end[action] - start[action])
                else:
                    where = end[action]
            placed.append((where, *rest))
        return placed


def observed_samples(placed: list[tuple], n_devices: int) -> list[MemorySample]:
    """"observed" samples: a zero at t=0 per device, then the level after each change (ties: in order)."""
    level = [0] * n_devices
    samples = [MemorySample(d, 0.0, 0, "observed") for d in range(n_devices)]
    for time_, device, delta, *_ in sorted(placed, key=lambda change: change[0]):
        level[device] += delta
        samples.append(MemorySample(device, time_, level[device], "observed"))
    return samples


def observed_breakdown(placed: list[tuple], n_devices: int) -> list[dict[str, int]]:
    """Per device, the bytes of each reason (REASONS) at the device's observed peak (its first moment)."""
    level = [0] * n_devices
    by_reason = [[0] * len(REASONS) for _ in range(n_devices)]
    peak, at_peak = [0] * n_devices, [[0] * len(REASONS) for _ in range(n_devices)]
    for _, device, delta, reason in sorted(placed, key=lambda change: change[0]):
        level[device] += delta
        by_reason[device][reason] += delta
        if level[device] > peak[device]:
            peak[device], at_peak[device] = level[device], list(by_reason[device])
    return [{why: b for why, b in zip(REASONS, parts) if b} for parts in at_peak]

