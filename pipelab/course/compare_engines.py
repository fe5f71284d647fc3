"""One pipelined step three ways: simulated, replayed in one process, measured on real processes.

Lesson 06 calls these functions; each is tested in tests/test_compare_engines.py.

    run   = three_ways(n_processes=2, n_microbatches=8, schedule="1f1b")
    run.predicted   # pl.simulate on costs profiled in this process          ("simulated")
    run.replayed    # pl.Pipeline(devices="cpu"): real ops, virtual clocks    ("replayed")
    run.measured    # pl.DistributedPipeline on 2 processes, wall clock      ("measured")
    run.real.speedup, run.real.formula_speedup   # against one process running the whole model

The speed-up formula, from the bubble of GPipe §2.3 and Megatron-LM SC21 §2.2.1: with p equal stages, m
micro-batches and free links, S = p·m / (m + p - 1).  How the real run is timed (a warm-up
step, then the fastest of the others): docs/course.md, "Lesson 06: three ways".
"""

from __future__ import annotations

import html
import math
import shlex
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..common.threads import intra_op_threads
from ..model import microbatch, models
from ..model.reference import max_gradient_difference, single_device_gradients
from ..predict.costs import Costs
from ..predict.simulate import simulate
from ..runtime.distributed import DistributedPipeline
from ..runtime.local import Pipeline
from ..runtime.launcher.processes import DistributedError, launch
from ..schedules.action import GRADIENT, GRADIENT_KINDS, Action
from ..schedules.trace import Trace, Wait

# The lesson's model: eight Linear+GELU blocks of width 512, a batch of 1024 samples.  With
# 8 micro-batches of 128 samples one forward of a 4-block stage takes about 4 ms on one CPU
# core, its backward about twice that: long beside what a message costs between two local
# processes (from tens of microseconds up to a few milliseconds when the receiving process
# must first be scheduled), so the pipeline's overlap shows in the wall clock.
WIDTH, DEPTH, BATCH_SIZE = 512, 8, 1024
# Ranks whose ops together take this many times the one-process step or more competed for the
# machine (other programs, more processes than cores, or more data than the caches hold): their
# wall-clock speed-up then says as much about the machine as about the pipeline.  On a quiet
# machine two ranks of the lesson's 1F1B step take about 1.0-1.2x.
SLOW_OPS = 1.25
PROCESS_LIMITS = {"n_processes": 4, "n_microbatches": 16}


def formula_speedup(n_stages: int, n_microbatches: int) -> float:
    """p·m / (m + p - 1): the speed-up of p equal stages over one device, free links (from GPipe's bubble, §2.3)."""
    return n_stages * n_microbatches / (n_microbatches + n_stages - 1)


def _workload(width: int, depth: int, batch_size: int, seed: int = 0):
    model = models.mlp(depth=depth, width=width, seed=seed)
    inputs, targets = models.sample_batch(model, batch_size, seed=seed)
    return model, inputs, targets, torch.nn.MSELoss()


def one_process_seconds(model, inputs, targets, loss_fn, n_microbatches: int, steps: int = 5) -> float:
    """Seconds of the fastest of `steps` plain training steps of the whole model in this process, one thread.

    Forward and backward of each of the `n_microbatches` micro-batches in turn, the loss of
    micro-batch i weighted by n_i / N (the same work as the pipeline's, on one device, back to
    back); n_microbatches=1 is the whole batch at once.  One untimed step first (lazy
    initialisation).  The model's `.grad` is left as None.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    total = microbatch.batch_size(inputs)
    chunks = list(zip(microbatch.split(inputs, n_microbatches), microbatch.split(targets, n_microbatches),
                      microbatch.sizes(total, n_microbatches)))
    seconds = []
    with intra_op_threads(1):
        for _ in range(steps + 1):
            model.zero_grad(set_to_none=True)
            begin = time.perf_counter()
            for x, y, size in chunks:
                (loss_fn(model(x), y) * (size / total)).backward()
            seconds.append(time.perf_counter() - begin)
    model.zero_grad(set_to_none=True)
    return min(seconds[1:])


def rank_steps(n_microbatches: int, schedule: str, width: int = WIDTH, depth: int = DEPTH,
               batch_size: int = BATCH_SIZE, steps: int = 6, seed: int = 0) -> dict:
    """What every rank runs (give it to `pl.distributed.launch`): `steps` steps of a DistributedPipeline.

    Returns this rank's first-step loss, the largest difference between the gradients it
    computed and the plain single-device ones (its own parameters only; the rest of the
    model is freed on this rank), its wall-clock seconds per step and the error bound of its
    clock offset from rank 0 (`pipe.clock_error`); rank 0 also returns every step's Trace
    (the same complete Trace on every rank).
    """
    model = models.mlp(depth=depth, width=width, seed=seed)  # the same model, from the same seed, on every rank
    inputs, targets = models.sample_batch(model, batch_size, seed=seed)  # and the same batch
    loss_fn = torch.nn.MSELoss()
    _, reference = single_device_gradients(model, inputs, targets, loss_fn)  # the plain step, to compare with
    pipe = DistributedPipeline(model, n_microbatches=n_microbatches, schedule=schedule,
                               loss_fn=loss_fn)  # keeps this rank's stage, frees the rest
    mine = {name for name, p in model.named_parameters() if p.device.type != "meta"}
    results, difference = [], math.inf
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        results.append(pipe.step(inputs, targets))
        if step == 0:
            difference = max_gradient_difference(model, {n: g for n, g in reference.items() if n in mine})
    rank = dist.get_rank()
    return {"rank": rank, "loss": results[0].loss, "gradient_difference": difference, "own_parameters": len(mine),
            "wall_seconds": [r.wall_seconds for r in results], "clock_error": pipe.clock_error,
            "traces": [r.trace for r in results] if rank == 0 else []}


@dataclass
class ProcessRun:
    """A step measured on `n_processes` real processes, beside one process running the whole model."""

    n_processes: int
    n_microbatches: int
    schedule: str
    traces: list[Trace]  # the timed steps (the warm-up step left out), "measured"
    losses: list[float]  # per rank: the first step's loss
    gradient_differences: list[float]  # per rank: max |pipeline grad - single-device grad| of its parameters
    wall_seconds: list[list[float]]  # per rank, per step (the warm-up included)
    clock_errors: list[float]  # per rank: bound on the error of its clock offset from rank 0 (seconds)
    single_device_loss: float
    one_process_seconds: float  # fastest plain step of the whole model, same micro-batches, one thread
    whole_batch_seconds: float  # the same with the whole batch at once (m = 1)
    launch_seconds: float  # starting the ranks, running them, bringing the results back

    @property
    def fastest(self) -> Trace:
        """The timed step with the shortest makespan (noise only adds time)."""
        return min(self.traces, key=lambda t: t.makespan)

    @property
    def step_seconds(self) -> float:
        return self.fastest.makespan

    @property
    def clock_error(self) -> float:
        """Times on two ranks compare to within this many seconds (the ranks' clocks meet on rank 0's
        through offsets estimated by round trips; see `runtime/clock_sync.py`)."""
        return 2 * max(self.clock_errors)

    @property
    def speedup(self) -> float:
        """One process's step time over the pipeline's: the speed-up the formula predicts."""
        return self.one_process_seconds / self.step_seconds

    @property
    def speedup_over_whole_batch(self) -> float:
        """Against one process running the whole batch at once (big matrix products are more efficient)."""
        return self.whole_batch_seconds / self.step_seconds

    @property
    def formula_speedup(self) -> float:
        return formula_speedup(self.n_processes, self.n_microbatches)

    @property
    def op_slowdown(self) -> float:
        """The ranks' compute time in the fastest step, all ranks together, over the one-process step.

        About 1 when every rank had a core to itself (the same ops, spread over the ranks);
        well above 1 when the ranks competed for the machine — more processes than cores,
        other programs running, or so much data in flight that it no longer fits the caches.
        """
        return sum(self.fastest.busy_time) / self.one_process_seconds

    @property
    def ops_ran_slower(self) -> bool:
        """True when the ranks' ops took `SLOW_OPS` times the one-process step or more (see `op_slowdown`)."""
        return self.op_slowdown >= SLOW_OPS

    @property
    def summary(self) -> str:
        """The run in three or four lines: the step, the speed-up against the formula, the whole-batch baseline."""
        t, p = self.fastest, self.n_processes
        lines = [f"{self.schedule} on {p} process{'es' if p > 1 else ''}, m={self.n_microbatches}: step "
                 f"{t.makespan * 1e3:.1f} ms (fastest of {len(self.traces)}), bubble {t.bubble_fraction:.1%}",
                 f"one process, the same micro-batches: {self.one_process_seconds * 1e3:.1f} ms -> speed-up "
                 f"{self.speedup:.2f}x (formula p·m/(m+p-1) = {self.formula_speedup:.2f}x)",
                 f"one process, the whole batch at once: {self.whole_batch_seconds * 1e3:.1f} ms -> speed-up "
                 f"{self.speedup_over_whole_batch:.2f}x"]
        if self.ops_ran_slower:
            lines.append(f"the ranks' ops took {self.op_slowdown:.2f}x the one-process time: they competed for the machine "
                         "(more processes than cores, other programs, or more data than the caches hold)")
        return "\n".join(lines)


def check_process_run(n_processes: int, n_microbatches: int) -> None:
    """The widget's limits: a real run on a laptop CPU stays small and quick."""
    for name, value in (("n_processes", n_processes), ("n_microbatches", n_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
        if value > PROCESS_LIMITS[name]:
            raise ValueError(f"a real run here is limited to {name} <= {PROCESS_LIMITS[name]} (got {value}); "
                             "the simulator has no limit")


def run_on_processes(n_processes: int = 2, n_microbatches: int = 8, schedule: str = "1f1b", width: int = WIDTH,
                     depth: int = DEPTH, batch_size: int = BATCH_SIZE, steps: int = 6,
                     timeout_seconds: float = 120) -> ProcessRun:
    """Run `steps` steps on `n_processes` fresh local ranks (one launch), and time one process beside them.

    The one-process baseline runs here, after the launch, on one thread; so does the
    single-device loss the ranks' loss is compared with.
    """
    check_process_run(n_processes, n_microbatches)
    if steps < 2:
        raise ValueError(f"steps must be at least 2 (the first is a warm-up), got {steps}")
    begin = time.perf_counter()
    per_rank = launch(rank_steps, n_processes, n_microbatches, schedule, width, depth, batch_size, steps,
                      timeout_seconds=timeout_seconds)
    launch_seconds = time.perf_counter() - begin
    model, inputs, targets, loss_fn = _workload(width, depth, batch_size)
    with intra_op_threads(1):
        single_loss, _ = single_device_gradients(model, inputs, targets, loss_fn)
    return ProcessRun(
        n_processes, n_microbatches, schedule, per_rank[0]["traces"][1:], [r["loss"] for r in per_rank],
        [r["gradient_difference"] for r in per_rank], [r["wall_seconds"] for r in per_rank],
        [r["clock_error"] for r in per_rank], single_loss,
        one_process_seconds(model, inputs, targets, loss_fn, n_microbatches, steps=steps - 1),
        one_process_seconds(model, inputs, targets, loss_fn, 1, steps=steps - 1), launch_seconds)


@dataclass
class ThreeWays:
    """The same step predicted, replayed in one process and measured on real processes."""

    predicted: Trace  # pl.simulate on the costs of each stage, profiled on one micro-batch
    replayed: Trace  # pl.Pipeline(devices="cpu"): the fastest of its timed steps
    real: ProcessRun  # pl.DistributedPipeline on n processes
    replayed_loss: float
    costs: Costs
    traces: dict[str, Trace] = field(init=False)

    def __post_init__(self) -> None:
        self.traces = {"predicted": self.predicted, "replayed": self.replayed, "measured": self.measured}

    @property
    def measured(self) -> Trace:
        return self.real.fastest


def three_ways(n_processes: int = 2, n_microbatches: int = 8, schedule: str = "1f1b", width: int = WIDTH,
               depth: int = DEPTH, batch_size: int = BATCH_SIZE, steps: int = 6) -> ThreeWays:
    """Predict, replay and measure one step of the same model, batch and schedule.

    predicted: `Costs.from_profile` times each stage on one micro-batch in this process,
    `simulate` runs the schedule on those costs.  replayed: the local engine runs every op
    here, one after another, and replays the measured durations on one virtual clock per
    stage.  measured: `run_on_processes` (one launch of `n_processes` ranks).
    """
    real = run_on_processes(n_processes, n_microbatches, schedule, width, depth, batch_size, steps)
    model, inputs, targets, loss_fn = _workload(width, depth, batch_size)
    with intra_op_threads(1):
        pipe = Pipeline(model, n_stages=n_processes, n_microbatches=n_microbatches, schedule=schedule,
                        loss_fn=loss_fn, devices="cpu")
        results = []
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            results.append(pipe.step(inputs, targets))
        model.zero_grad(set_to_none=True)
        size = microbatch.sizes(batch_size, n_microbatches)[0]
        costs = Costs.from_profile(model, pipe.partition, (inputs[:size], targets[:size]), loss_fn, repeats=5)
    replayed = min((r.trace for r in results[1:]), key=lambda t: t.makespan)
    return ThreeWays(simulate(pipe.schedule, costs), replayed, real, results[0].loss, costs)


def why_waited(trace: Trace, wait: Wait) -> str:
    """Why a rank sat waiting: which action on which rank produced the message, and when it was sent.

    F(s, i) waits for the activation of F(s-1, i), B(s, i) for the gradient of stage s+1's
    backward of micro-batch i (`KIND_SPECS`); the message's `sent` is when the producer had it ready.
    """
    source = _producer_in(trace, wait.action)
    what = "activation" if wait.action.spec.sends > 0 else "gradient"
    message = next((m for m in trace.messages if m.action == source), None)
    if source is None or message is None:
        return f"rank {wait.device} waited {(wait.end - wait.start) * 1e3:.2f} ms before {wait.action.describe()}"
    origin = min(e.start for e in trace.events)
    producing = next(e for e in trace.events if e.action == source)
    return (f"rank {wait.device} waited {(wait.end - wait.start) * 1e3:5.2f} ms before {wait.action.describe()}: it needs "
            f"the {what} of {source.describe()}, which rank {message.source_device} ran from "
            f"{(producing.start - origin) * 1e3:.2f} to {(producing.end - origin) * 1e3:.2f} ms and sent at "
            f"{(message.sent - origin) * 1e3:.2f} ms; it arrived at {(message.received - origin) * 1e3:.2f} ms")


def _producer_in(trace: Trace, action: Action) -> Action | None:
    """The action of `trace` on another stage whose result `action` received, or None."""
    for need, offset in action.spec.needs:
        if offset:
            kinds = GRADIENT_KINDS if need == GRADIENT else {need}
            return next((e.action for e in trace.events if e.stage == action.stage + offset
                         and e.microbatch == action.microbatch and e.kind in kinds), None)
    return None


def time_per_rank(trace: Trace) -> list[dict[str, float]]:
    """Per rank, seconds computing, waiting for messages, and the rest of the step (engine, sending, idle at the ends)."""
    rows = []
    for device in range(trace.n_devices):
        busy = trace.busy_time[device]
        waiting = sum(w.end - w.start for w in trace.waits if w.device == device)
        rows.append({"busy": busy, "waiting": waiting, "other": trace.makespan - busy - waiting})
    return rows


def step_with_wrong_targets(width: int = 64, depth: int = 4, batch_size: int = 16, n_microbatches: int = 4) -> None:
    """A bug only the last rank meets (give it to `pl.distributed.launch`): targets of the wrong width.

    Every rank builds the pipeline and runs one good step; the second step's targets have
    half the model's output width.  Only the last stage reads the targets, so only the last
    rank fails, in its loss; the other ranks are left waiting for a gradient that never
    comes, and the launcher stops them and reports the last rank's error.
    """
    model, inputs, targets, loss_fn = _workload(width, depth, batch_size)
    pipe = DistributedPipeline(model, n_microbatches=n_microbatches, schedule="1f1b", loss_fn=loss_fn)
    pipe.step(inputs, targets)
    pipe.step(inputs, targets[:, : width // 2])  # the loss check names both shapes, on rank 1


def torchrun_command(n_machines: int = 2, processes_per_machine: int = 1, machine_rank: int = 0,
                     host: str = "HOST", port: int = 29500, schedule: str = "1f1b", n_microbatches: int = 8,
                     steps: int = 20, width: int = WIDTH, depth: int = DEPTH, batch_size: int = BATCH_SIZE,
                     interface: str = "eth0") -> str:
    """The `torchrun` command that runs this lesson's pipeline, one stage per process, on machine `machine_rank`.

    Stages = n_machines x processes_per_machine.  One machine needs no rendezvous address;
    several meet at `host:port` (the first machine's address, reachable from the others;
    c10d rendezvous) and each runs the same command with its own --node-rank, prefixed by
    `GLOO_SOCKET_IFNAME=<interface>,<interface>`: the network interface that reaches the
    other machines, twice, so activations and gradients get a connection each
    (`runtime/p2p.py`; on one machine `pipelab.launch` sets it to the loopback interface).
    """
    for name, value in (("n_machines", n_machines), ("processes_per_machine", processes_per_machine)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not 0 <= machine_rank < n_machines:
        raise ValueError(f"machine_rank must lie in 0..{n_machines - 1}, got {machine_rank}")
    stages = n_machines * processes_per_machine
    if n_machines == 1:
        launcher = ["torchrun", "--nproc-per-node", str(processes_per_machine)]
    else:
        launcher = [f"GLOO_SOCKET_IFNAME={interface},{interface}", "torchrun", "--nnodes", str(n_machines),
                    "--nproc-per-node", str(processes_per_machine), "--node-rank", str(machine_rank),
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{port}"]
    program = ["-m", "pipelab.launch", "--model", "mlp", "--depth", str(depth), "--width", str(width),
               "--batch-size", str(batch_size), "--stages", str(stages), "--microbatches", str(n_microbatches),
               "--schedule", schedule, "--steps", str(steps)]
    return shlex.join(launcher + program)


def processes_widget(n_processes: int = 2, n_microbatches: int = 8, schedule: str = "1f1b", **workload):
    """Pick the schedule, m and the number of processes, press the button: a real run on local processes.

    Returns an `ipywidgets.VBox`; `box.controls` holds the controls, `box.run()` does what the
    button does (launch, time one process beside it, draw the measured timeline, print the
    bubble and the speed-up) and returns the `ProcessRun`, also kept in `box.result`.
    `workload`: width, depth, batch_size, steps of `run_on_processes` (default: the lesson's).
    """
    import ipywidgets as w

    from ..show import plot

    labelled = dict(style={"description_width": "initial"})
    controls = {
        "schedule": w.Dropdown(options=["gpipe", "1f1b"], value=schedule, description="schedule", **labelled),
        "n_microbatches": w.IntSlider(value=n_microbatches, min=1, max=PROCESS_LIMITS["n_microbatches"],
                                      description="micro-batches m", **labelled),
        "n_processes": w.IntSlider(value=n_processes, min=1, max=PROCESS_LIMITS["n_processes"],
                                   description="processes p", **labelled),
    }
    button = w.Button(description="run on real processes", icon="play", layout=w.Layout(width="auto"))
    summary, image = w.HTML(), w.Image(format="png")
    image.layout.display = "none"  # until there is a run to show
    box = w.VBox([w.HBox([*controls.values(), button]), summary, image])
    box.controls, box.result = controls, None

    def run(_=None) -> ProcessRun:
        p = controls["n_processes"].value
        summary.value = f"<i>starting {p} process{'es' if p > 1 else ''} (a few seconds each)…</i>"
        try:
            box.result = run_on_processes(p, controls["n_microbatches"].value, controls["schedule"].value, **workload)
        except DistributedError as error:  # e.g. a rank ran out of time on a very busy machine
            summary.value = f"<b>the run failed: {html.escape(str(error))}</b>"
            raise
        summary.value = "<b>" + html.escape(box.result.summary).replace("\n", "<br>") + "</b>"
        image.value = _png(plot.timeline(box.result.fastest))
        image.layout.display = None
        return box.result

    box.run = run
    button.on_click(run)
    return box


def _png(fig) -> bytes:
    """The figure as PNG bytes, then closed (a widget shows bytes, whatever the notebook's plot backend)."""
    import io

    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80)
    plt.close(fig)
    return buffer.getvalue()
