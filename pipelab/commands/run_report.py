"""What `pipelab run` shows when it is done: the summary table, the timeline PNG, the Chrome trace and the JSON.

`RunSummary` is what a run (`training.py`, either engine, one batch or a loader) hands over;
`finish(summary, args)` prints `report(summary)` and writes the files; `figures(summary)` is the JSON.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ..schedules.trace import Trace


@dataclass
class RunSummary:
    schedule: str
    n_stages: int
    n_microbatches: int
    bounds: list[tuple[int, int]]
    stage_names: list[str]  # what each stage holds: "blocks 0..3", or "transformer.h.0 .. transformer.h.3"
    split_method: str
    devices: list[str]
    backend: str  # "local" or "distributed"
    world_size: int  # processes that ran the pipeline
    losses: list[float]  # every step's, in order (a loader's resumed run: its earlier steps' too)
    step_seconds: list[float]  # wall clock per step run in this call, engine included
    trace: Trace  # the last step's
    eval_losses: dict[int, float] = field(default_factory=dict)  # held-out loss after step k (a loader's run)
    decision: str | None = None  # --split auto / --schedule auto: the candidates priced, the chosen one first


def finish(summary: RunSummary, args) -> None:
    """Print the table; write the timeline PNG, the Chrome trace and (with --json) the figures."""
    print(report(summary))
    stem = f"{summary.schedule}_p{summary.n_stages}_m{summary.n_microbatches}"
    write_outputs(summary.trace, args.out / f"timeline_{stem}.png", args.out / f"trace_{stem}.json")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures(summary), indent=1))
        print(f"figures (JSON): {args.json}")


def figures(summary: RunSummary) -> dict:
    """The run's figures, for scripts and benchmarks."""
    trace = summary.trace
    return {
        "schedule": summary.schedule, "n_stages": summary.n_stages, "n_microbatches": summary.n_microbatches,
        "backend": summary.backend, "world_size": summary.world_size, "devices": summary.devices,
        "bounds": summary.bounds, "stages": summary.stage_names, "split": summary.split_method,
        "decision": summary.decision,
        "losses": summary.losses, "step_seconds": summary.step_seconds,
        "eval_losses": {str(step): loss for step, loss in summary.eval_losses.items()},
        "trace_source": trace.source, "trace_source_label": trace.source_label,
        "makespan_seconds": trace.makespan, "bubble_fraction": trace.bubble_fraction,
        "busy_seconds": trace.busy_time, "peak_inflight": trace.peak_inflight,
        "peak_activation_bytes": trace.peak_memory,
    }


def write_outputs(trace: Trace, png: Path, chrome: Path) -> None:
    """Save the timeline PNG and the Chrome trace, and say where they are."""
    from ..show import plot  # matplotlib loads only when a picture is written

    png.parent.mkdir(parents=True, exist_ok=True)
    plot.timeline(trace).savefig(png, dpi=120)
    trace.to_chrome_trace(chrome)
    print(f"\ntimeline: {png}\nChrome trace (open in Perfetto or chrome://tracing): {chrome}")


def report(summary: RunSummary) -> str:
    """The run's summary table: the last step's trace, per stage, and the training curve."""
    trace, losses = summary.trace, summary.losses
    busy, inflight, peak = trace.busy_time, trace.peak_inflight, trace.peak_memory
    device_of = {e.stage: e.device for e in trace.events}
    where = (f"devices {summary.devices}" if summary.backend == "local"
             else f"{summary.world_size} processes (torch.distributed), devices {summary.devices}")
    lines = [
        "",
        f"split ({summary.split_method}): {len(summary.stage_names)} stages, {where}",
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps; "
        f"median step {statistics.median(summary.step_seconds) * 1e3:.1f} ms (wall clock, engine included)",
    ]
    if summary.decision is not None:
        lines += ["", summary.decision, ""]
    if summary.eval_losses:
        last = max(summary.eval_losses)
        lines.append(f"held-out loss {summary.eval_losses[last]:.4f} after step {last}")
    lines += [
        f"last step: makespan {trace.makespan * 1e3:.1f} ms, bubble fraction {trace.bubble_fraction:.1%}  "
        f"[{trace.source_label}]",
        "",
        f"{'stage':>5} {'busy ms':>9} {'peak in-flight':>15} {'peak activations':>17}   holds",
    ]
    for s in range(summary.n_stages):
        lines.append(f"{s:>5} {busy[device_of[s]] * 1e3:>9.2f} {inflight[s]:>15} {_bytes(peak[device_of[s]]):>17}   "
                     f"{summary.stage_names[s]}")
    return "\n".join(lines)


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)
