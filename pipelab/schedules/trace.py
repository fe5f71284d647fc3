"""`Trace`: what ran when (and how much memory it held) in one pipelined step.

Every interpreter — the simulator, the local engine, the distributed engine — returns a
Trace, so metrics, plots and exports are written once.  `source` says where the times came
from: "simulated" (a cost model), "measured" (wall clock, one device per stage) or
"replayed" (every op really ran and was timed, then replayed on one virtual clock per
stage).  Memory is kept as `MemorySample`s, one curve per device and per `what`
(MEMORY_KINDS): "counted" (the rule of `pipelab.predict.memory.activation_samples`),
"observed" (`pipelab/runtime/memory_observer.py`), and on CUDA "allocated" /
"allocated_peak".

Details (each source and each kind of memory): docs/simulator.md, "What a Trace holds".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from .action import HOLDING_KINDS, RELEASING_KINDS, Action, Kind

SOURCE_LABELS = {
    "simulated": "simulated (cost model)",
    "measured": "measured (wall clock, one device per stage)",
    "replayed": "measured op times, replayed on one virtual clock per stage",
}


class Event(NamedTuple):
    """One action as it ran: its fields first, in `Action`'s order, then when and where."""

    kind: Kind
    stage: int
    microbatch: int
    start: float  # seconds from the start of the step
    end: float
    device: int

    @property
    def action(self) -> Action:
        return Action(self.kind, self.stage, self.microbatch)

    @property
    def duration(self) -> float:
        return self.end - self.start


MEMORY_KINDS = ("counted", "observed", "allocated", "allocated_peak")


class MemorySample(NamedTuple):
    device: int
    time: float  # seconds
    bytes: int  # bytes held on `device` from `time` on
    what: str = "counted"  # one of MEMORY_KINDS (see the module docstring)


def memory_kind(what: str) -> str:
    """`what` checked against MEMORY_KINDS."""
    if what not in MEMORY_KINDS:
        raise ValueError(f"memory samples are one of {list(MEMORY_KINDS)}, got {what!r}")
    return what


class Wait(NamedTuple):
    """A device idle because its next action's message had not arrived (distributed engine)."""

    device: int
    start: float
    end: float
    action: Action  # the action that waited


class Message(NamedTuple):
    """An activation or a gradient travelling between devices (distributed engine).

    `sent`: when the sender posted it (right after computing it); `received`: when the
    receiving action had it in hand (the end of its wait; if it arrived earlier, the
    moment the receiver asked for it).
    """

    source_device: int
    target_device: int
    sent: float
    received: float
    action: Action  # the action that produced it: 1F3 is an activation, 2B3 a gradient


@dataclass
class Trace:
    events: list[Event]
    memory: list[MemorySample]
    source: str
    n_stages: int
    n_microbatches: int
    n_devices: int
    schedule_name: str = "custom"
    device_names: list[str] = field(default_factory=list)
    waits: list[Wait] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    n_processes: int = 1
    observed_peak_parts: list[dict[str, int]] = field(default_factory=list)  # per device: bytes by reason
    # (runtime.memory_observer.REASONS) at the device's observed peak; empty unless an engine's step

    def __post_init__(self) -> None:
        if self.source not in SOURCE_LABELS:
            raise ValueError(f"Trace.source must be one of {sorted(SOURCE_LABELS)}, got {self.source!r}")
        for sample in self.memory:
            memory_kind(sample.what)

    @property
    def source_label(self) -> str:
        if self.source == "measured" and self.n_processes > 1:
            return f"measured (wall clock, {self.n_processes} processes)"
        return SOURCE_LABELS[self.source]

    @property
    def makespan(self) -> float:
        """Seconds from the first action's start to the last action's end."""
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    @property
    def busy_time(self) -> list[float]:
        """Seconds each device spends computing."""
        busy = [0.0] * self.n_devices
        for e in self.events:
            busy[e.device] += e.duration
        return busy

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the step: 1 - sum(busy) / (devices x makespan).

        For GPipe and 1F1B with uniform stages and no communication this is
        (p-1)/(m+p-1) (GPipe §2.3; Megatron-LM SC21 §2.2.1).
        """
        if self.makespan == 0:
            return 0.0
        return 1.0 - sum(self.busy_time) / (self.n_devices * self.makespan)

    @property
    def latencies(self) -> list[float]:
        """Per micro-batch, seconds from the start of its first action to the end of its last, any stage (the
        time one request spends in the pipeline; for a forward-only schedule, from entering stage 0 to leaving
        the last stage: p·t for p equal stages of time t, whatever m)."""
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        for e in self.events:
            first[e.microbatch] = min(first.get(e.microbatch, e.start), e.start)
            last[e.microbatch] = max(last.get(e.microbatch, e.end), e.end)
        return [last[i] - first[i] for i in sorted(first)]

    @property
    def throughput(self) -> float:
        """Micro-batches per second over the step: m / makespan (m / ((m + p − 1)·t) for p equal stages)."""
        return self.n_microbatches / self.makespan if self.makespan else 0.0

    @property
    def speedup(self) -> float:
        """Work done / makespan = n_devices x (1 - bubble_fraction): how many devices' worth were busy.

        Equals the speed-up over one device running the same actions back to back (no
        communication); p·m/(m+p-1) for GPipe/1F1B with uniform stages.
        """
        return sum(self.busy_time) / self.makespan if self.makespan else 0.0

    @property
    def peak_inflight(self) -> list[int]:
        """Most micro-batches whose activations a stage holds at once (forward started, backward not done).

        A micro-batch enters at the start of its F and leaves at the end of the action that
        releases it (`KindSpec.releases`: B, or W when the backward is split).
        """
        last_backward: dict[tuple[int, int], Event] = {}
        for e in self.events:
            if e.kind in RELEASING_KINDS:
                key = (e.stage, e.microbatch)
                if key not in last_backward or e.end > last_backward[key].end:
                    last_backward[key] = e
        changes: list[tuple[float, int, int]] = []  # (time, +1/-1, stage); leaving sorts first at ties
        for e in self.events:
            if e.kind in HOLDING_KINDS:
                changes.append((e.start, 1, e.stage))
        for (stage, _), e in last_backward.items():
            changes.append((e.end, -1, stage))
        held, peak = [0] * self.n_stages, [0] * self.n_stages
        for _, delta, stage in sorted(changes):
            held[stage] += delta
            peak[stage] = max(peak[stage], held[stage])
        return peak

    def memory_curve(self, device: int, what: str = "counted") -> tuple[list[float], list[int]]:
        """(times, bytes) of one device's memory samples of kind `what`, in time order (ties: as recorded)."""
        what = memory_kind(what)
        samples = sorted((s for s in self.memory if s.device == device and s.what == what), key=lambda s: s.time)
        return [s.time for s in samples], [s.bytes for s in samples]

    @property
    def memory_kinds(self) -> list[str]:
        """The kinds of memory samples this trace holds, in MEMORY_KINDS order."""
        present = {s.what for s in self.memory}
        return [what for what in MEMORY_KINDS if what in present]

    def peak_memory_by(self, what: str) -> list[int]:
        """Peak bytes on each device of the samples of kind `what` ("counted", "observed", "allocated", ...).

        Asking for a kind the trace does not hold is an error (a simulated trace has only
        "counted"; "observed" comes from an engine's step, "allocated" from CUDA), except
        "counted", which is all zeros when there is no memory model.
        """
        what = memory_kind(what)
        if what != "counted" and what not in self.memory_kinds:
            raise ValueError(f"this {self.source} trace has no {what!r} memory samples (it has "
                             f"{self.memory_kinds or 'none'}): 'observed' comes from an engine's step, "
                             "'allocated' from one on CUDA")
        peak = [0] * self.n_devices
        for s in self.memory:
            if s.what == what:
                peak[s.device] = max(peak[s.device], s.bytes)
        return peak

    @property
    def peak_memory(self) -> list[int]:
        """Peak activation bytes on each device by the counting rule: `peak_memory_by("counted")`.

        For an engine's trace compare predictions with `peak_memory_observed` too: the
        counted curve is built by the simulator's own rule.
        """
        return self.peak_memory_by("counted")

    @property
    def peak_memory_observed(self) -> list[int]:
        """Peak bytes each device really kept for activations (an engine's trace): `peak_memory_by("observed")`."""
        return self.peak_memory_by("observed")

    def durations(self) -> dict[Action, float]:
        """Seconds each action took: feed them back to the simulator to replay this step."""
        return {e.action: e.duration for e in self.events}

    def to_chrome_trace(self, path: str | Path) -> Path:
        """Write the trace as Chrome trace-event JSON (open in Perfetto or chrome://tracing).

        One track per device ("X" complete events, microseconds) plus a counter track per
        device and memory kind ("counted", "observed", ...).
        """
        origin = min((e.start for e in self.events), default=0.0)
        records = []
        for device in range(self.n_devices):
            name = self.device_names[device] if device < len(self.device_names) else f"device {device}"
            records.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": device,
                            "args": {"name": f"device {device} ({name})"}})
        for e in self.events:
            records.append({
                "name": f"{e.kind}{e.microbatch}", "cat": e.kind, "ph": "X", "pid": 0, "tid": e.device,
                "ts": (e.start - origin) * 1e6, "dur": e.duration * 1e6,
                "args": {"stage": e.stage, "microbatch": e.microbatch, "action": str(e.action)},
            })
        for w in self.waits:
            records.append({"name": f"wait for {w.action}", "cat": "wait", "ph": "X", "pid": 0, "tid": w.device,
                            "ts": (w.start - origin) * 1e6, "dur": (w.end - w.start) * 1e6})
        for k, m in enumerate(self.messages):  # flow arrows from the sender's track to the receiver's
            common = {"name": f"message {m.action}", "cat": "message", "pid": 0, "id": k}
            records.append({**common, "ph": "s", "tid": m.source_device, "ts": (m.sent - origin) * 1e6})
            records.append({**common, "ph": "f", "bp": "e", "tid": m.target_device,
                            "ts": (m.received - origin) * 1e6})
        for s in sorted(self.memory, key=lambda s: s.time):
            records.append({"name": f"{s.what} bytes, device {s.device}", "ph": "C", "pid": 0,
                            "ts": (s.time - origin) * 1e6, "args": {"bytes": s.bytes}})
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"source": self.source_label, "schedule": self.schedule_name, "n_stages": self.n_stages,
                "n_microbatches": self.n_microbatches, "makespan_s": self.makespan,
                "bubble_fraction": self.bubble_fraction}
        path.write_text(json.dumps({"traceEvents": records, "displayTimeUnit": "ms", "otherData": meta}))
        return path
