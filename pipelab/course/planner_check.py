"""Is `pl.plan` right on a real run?  Its choice against every layout measured on 4 local gloo ranks.

    results = planner_check.check(planner_check.SCENARIOS)     # calibrate, plan, run, compare
    print(planner_check.table(results))

One `launch` of the ranks does everything, so that the planner's inputs are measured where it runs:

1. Calibration, per scenario (the planner's inputs; the ranks share this machine's cores, so each is
   measured while every rank works, as a cluster's devices would be profiled under their own load):
   - X_b, FLOPs per second per rank: the engine's step of one micro-batch of b sequences through the
     whole model on one stage (`pl.Pipeline`, its per-action work included, as a profile taken with the
     framework one trains with), on every rank at once; FLOPs as SC21 eq. 3 counts them
     (`TransformerSpec.iteration_flops`).
   - The link: ring all-reduces between two ranks, T(A) = 2(t − 1)·latency + 2(t − 1)/t·A/bandwidth at
     t = 2 (the planner's formula): bandwidth = (4 MiB − 4 B)/(T(4 MiB) − T(4 B)); latency from an
     all-reduce of one boundary activation right after a layer-sized multiply, both pairs at once, the
     transfer subtracted.  On 2 shared cores that latency is 2–10× the idle one (printed): a collective
     waits until its partner, descheduled by another rank's work, runs again.
   - X_b,t for t = 2, 4: the engine's step of one micro-batch on one stage with t-way tensor parallelism
     (4/t replicas at once), less the all-reduces the planner adds itself (its "tp" and "dp" seconds for
     that step); what is left (sharded multiplies, DTensor's work, the waits beyond the formula) sets the
     speed of a sharded layer.  Those one-stage, one-micro-batch steps are the probes; the rows checked
     are the scenario's (other m, other depths).
   The planner gets peak = max X and achieved_fraction = {b: X_b/peak, (b, t): X_b,t/peak}, one node of 4.
2. The plan.  `plan(spec, 4, ...)` with what the engine runs: GPipe, 1F1B, interleaved (v = 2), ZB-H1,
   with no or full recomputation (`checkpoint="always"`), fp32 values and fp32 Adam (16 bytes per parameter).
3. The runs.  For every layout that fits, its fastest row runs as the planner describes it: a
   `DistributedPipeline` with that layout, schedule, m and checkpointing, cut as the planner assumes
   (⌈L/p⌉ layers a stage; the embedding on the first, the output layer on the last).  The step measured
   is the median over `repeats` steps (after one warm-up) of the slowest rank's wall time.

A scenario's figures: the planner's choice (its top layout), predicted / measured − 1; the choice's rank
among the measured layouts; its regret, measured(choice) / best measured − 1.  Each run's loss is
compared with the single-device loss of the same batch (`loss_error`), so a fast wrong run shows.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from ..model import models
from ..model.partition import Partition
from ..predict.layout import Layout
from ..predict.planner import PlanRow, plan
from ..predict.transformer_memory import TransformerSpec
from ..runtime.distributed import DistributedPipeline
from ..runtime.local import Pipeline
from ..runtime.launcher.processes import launch
from ..schedules import interleaved_1f1b

MIB = 2**20
N_RANKS = 4
ENGINE_OPTIONS = {"schedules": ("gpipe", "1f1b", "interleaved", "zb-h1"), "chunks": (2,), "recompute": ("none", "full")}


@dataclass(frozen=True)
class Scenario:
    """A model (a `tiny_gpt` of these shapes), a global batch, a memory limit per rank."""

    name: str
    spec: TransformerSpec
    global_batch: int
    memory_bytes: float
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)


def _spec(layers: int, hidden: int, heads: int, seq: int = 64, vocab: int = 512) -> TransformerSpec:
    return TransformerSpec(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab, bytes_per_value=4)


WIDE, DEEP, LONG = _spec(8, 256, 4), _spec(8, 192, 4, vocab=2048), _spec(4, 256, 8, seq=128)
# limits from roomy (every layout fits) to tight (only deep pipelines or tensor parallelism fit); the model
# states take 16 bytes per parameter: WIDE 6.5 M parameters (99 MiB whole), DEEP 4.0 M, LONG 3.3 M
SCENARIOS = (
    Scenario("wide, roomy", WIDE, 32, 1024 * MIB),
    Scenario("wide, 80 MiB", WIDE, 32, 80 * MIB),
    Scenario("wide, 40 MiB", WIDE, 32, 40 * MIB),
    Scenario("wide, batch 8, 60 MiB", WIDE, 8, 60 * MIB),
    Scenario("deep, roomy", DEEP, 32, 1024 * MIB),
    Scenario("deep, 36 MiB", DEEP, 32, 36 * MIB),
    Scenario("long, roomy", LONG, 16, 1024 * MIB),
    Scenario("long, 40 MiB", LONG, 16, 40 * MIB),
)


@dataclass
class Run:
    row: PlanRow
    measured_seconds: float
    loss_error: float  # |pipelined loss − single-device loss|

    @property
    def error(self) -> float:
        """predicted / measured − 1."""
        return self.row.step_seconds / self.measured_seconds - 1


@dataclass
class Outcome:
    scenario: Scenario
    runs: list[Run]  # one per fitting layout, in the planner's order (runs[0]: its choice)
    calibration: dict = field(default_factory=dict)  # {"flops": {b: X_b}, "latency": s, "bandwidth": B/s}
    n_over_limit: int = 0  # layouts the planner found over the limit

    @property
    def choice(self) -> Run:
        return self.runs[0]

    @property
    def best(self) -> Run:
        return min(self.runs, key=lambda r: r.measured_seconds)

    @property
    def regret(self) -> float:
        """measured(choice) / best measured − 1: 0 when the planner picked the fastest layout."""
        return self.choice.measured_seconds / self.best.measured_seconds - 1

    @property
    def measured_rank(self) -> int:
        """Where the planner's choice ranks among the layouts measured (1: the fastest)."""
        return 1 + sum(r.measured_seconds < self.choice.measured_seconds for r in self.runs)


def make_model(spec: TransformerSpec):
    return models.tiny_gpt(n_layers=spec.layers, d_model=spec.hidden, n_heads=spec.heads, vocab_size=spec.vocab,
                           seq_len=spec.seq, seed=0)


def planner_partition(model, n_layers: int, n_stages: int) -> Partition:
    """The planner's cut of a `tiny_gpt` (embedding, n_layers blocks, output layer) into n_stages: equal
    runs of layers, the embedding with the first, the output layer with the last."""
    if n_layers % n_stages:
        raise ValueError(f"{n_layers} layers do not split into {n_stages} equal stages")
    per = n_layers // n_stages
    bounds = [(0 if s == 0 else 1 + s * per, 1 + (s + 1) * per + (1 if s == n_stages - 1 else 0))
              for s in range(n_stages)]
    return Partition(bounds, [model[a:b] for a, b in bounds], "planner", [1.0] * len(model))


def plan_for(scenario: Scenario, calibration: dict):
    """`plan` on the calibrated machine (module docstring, step 2)."""
    flops = calibration["flops"]
    peak = max(flops.values())
    link = (calibration["latency"], calibration["bandwidth"])
    return plan(scenario.spec, N_RANKS, N_RANKS, scenario.memory_bytes, scenario.global_batch, inside=link,
                between=link, peak_flops_per_second=peak, achieved_fraction={b: x / peak for b, x in flops.items()},
                micro_batch_sizes=scenario.micro_batch_sizes, **ENGINE_OPTIONS)


def _all_reduce_seconds(n_values: int, group, between: tuple | None = None, repeats: int = 12) -> float:
    """Seconds per all-reduce of n float32 values in `group`, the fastest of three runs of `repeats`; with
    `between` = (a, w), each all-reduce follows a multiply a @ w, and the multiplies alone are subtracted."""
    def per_call(communicate: bool) -> float:
        torch.distributed.barrier()
        begin = time.perf_counter()
        for _ in range(repeats):
            if between is not None:
                between[0] @ between[1]
            if communicate:
                torch.distributed.all_reduce(buffer, group=group)
        return (time.perf_counter() - begin) / repeats

    buffer = torch.zeros(n_values)
    alone = 0.0 if between is None else min(per_call(False) for _ in range(3))
    return min(per_call(True) for _ in range(3)) - alone


def _flops_per_second(spec: TransformerSpec, b: int, repeats: int = 3) -> float:
    """X_b on this rank while every rank runs the same (module docstring, step 1): the engine's own step of
    one stage and one micro-batch (`pl.Pipeline`, so that its per-action work counts, as a profile with the
    framework one trains with would)."""
    model = make_model(spec)
    x, y = models.sample_batch(model, b, seed=1)
    engine = Pipeline(model, n_stages=1, n_microbatches=1, schedule="gpipe", loss_fn=models.lm_loss, devices="cpu")
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        for q in engine.parameters():
            q.grad = None
        torch.distributed.barrier()
        times.append(engine.step(x, y).wall_seconds)
    return spec.iteration_flops(b) / statistics.median(times[1:])


def _calibrate(spec: TransformerSpec, sizes, pair) -> dict:
    """X_b (and X_b,t), and the link as the ranks see it while they compute (module docstring, step 1)."""
    flops = {b: _flops_per_second(spec, b) for b in sizes}
    small, large = _all_reduce_seconds(1, pair), _all_reduce_seconds(MIB, pair)
    b = max(sizes)
    layer = (torch.randn(b * spec.seq, spec.hidden), torch.randn(spec.hidden, spec.hidden))
    loaded = _all_reduce_seconds(b * spec.seq * spec.hidden, pair, between=layer)
    found = torch.tensor([[flops[b] for b in sizes] + [small, large, loaded]], dtype=torch.float64)
    torch.distributed.all_reduce(found)  # the ranks agree: the mean over them
    mean = (found / torch.distributed.get_world_size())[0].tolist()
    small, large, loaded = mean[-3:]
    bandwidth = (4 * MIB - 4) / max(large - small, 1e-9)
    transfer = b * spec.seq * spec.hidden * 4 / bandwidth
    calibration = {"flops": dict(zip(sizes, mean[:-3])), "idle_latency": small / 2, "bandwidth": bandwidth,
                   "latency": max(small, loaded - transfer) / 2}
    for t in (2, 4):
        if spec.heads % t == 0:
            calibration["flops"].update({(b, t): _sharded_flops_per_second(spec, b, t, calibration) for b in sizes})
    return calibration


def _sharded_flops_per_second(spec: TransformerSpec, b: int, t: int, calibration: dict, repeats: int = 2) -> float:
    """X_b,t: the engine's step of one micro-batch of b on one stage, t-way tensor parallel (4/t replicas at
    once), less the all-reduces the planner adds itself (its "tp" and "dp" seconds for that step)."""
    layout = Layout(dp=N_RANKS // t, pp=1, tp=t)
    model = make_model(spec)
    pipe = DistributedPipeline(model, n_microbatches=1, schedule="gpipe", loss_fn=models.lm_loss, layout=layout)
    step = _median_step(pipe, models.sample_batch(model, b * layout.dp, seed=1), repeats)[0]
    link = (calibration["latency"], calibration["bandwidth"])
    peak = 1e12  # any speed: the row's compute seconds scale as 1/X
    row = next(r for r in plan(spec, N_RANKS, N_RANKS, 1e30, b * layout.dp, inside=link, between=link,
                               peak_flops_per_second=peak, achieved_fraction=1.0, micro_batch_sizes=(b,),
                               schedules=("gpipe",), recompute=("none",)).rows if r.layout == layout)
    computing = step - row.seconds["tp"] - row.seconds["dp"]
    return peak * row.seconds["compute"] / max(computing, row.seconds["compute"])


def _median_step(pipe, batch, repeats: int) -> tuple[float, float]:
    """(the median over `repeats` steps, after one warm-up, of the slowest rank's wall seconds, the loss)."""
    walls = []
    for _ in range(repeats + 1):
        for q in pipe.parameters():
            q.grad = None
        torch.distributed.barrier()
        result = pipe.step(*batch)
        took = torch.tensor([result.wall_seconds], dtype=torch.float64)
        torch.distributed.all_reduce(took, op=torch.distributed.ReduceOp.MAX)
        walls.append(took.item())
    return statistics.median(walls[1:]), result.loss


def _measure(row: PlanRow, spec: TransformerSpec, batch, repeats: int) -> tuple[float, float]:
    """(median slowest-rank step seconds, the loss) of the row on the ranks (module docstring, step 3)."""
    model = make_model(spec)
    p, v, m = row.layout.pp, row.chunks, row.n_microbatches
    schedule = interleaved_1f1b(p, m, v) if row.schedule == "interleaved" else row.schedule
    pipe = DistributedPipeline(model, n_microbatches=m, schedule=schedule, loss_fn=models.lm_loss,
                               layout=row.layout, split_method=planner_partition(model, spec.layers, p * v),
                               checkpoint="always" if row.recompute == "full" else "never")
    return _median_step(pipe, batch, repeats)


def _on_each_rank(scenarios, repeats: int) -> list[dict]:
    pairs = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]
    pair = pairs[torch.distributed.get_rank() // 2]  # every rank in a pair: both pairs run at once
    found = []
    for scenario in scenarios:
        calibration = _calibrate(scenario.spec, scenario.micro_batch_sizes, pair)
        rows = plan_for(scenario, calibration).by_layout()
        model = make_model(scenario.spec)
        batch = models.sample_batch(model, scenario.global_batch, seed=1)
        with torch.no_grad():
            reference = float(models.lm_loss(model(batch[0]), batch[1]))
        runs = [_measure(row, scenario.spec, batch, repeats) for row in rows]
        found.append({"calibration": calibration, "runs": runs, "reference": reference})
    return found


def check(scenarios=SCENARIOS, repeats: int = 3, timeout_seconds: float = 1800) -> list[Outcome]:
    """Every scenario calibrated, planned and run on `N_RANKS` local gloo ranks (module docstring)."""
    per_rank = launch(_on_each_rank, N_RANKS, tuple(scenarios), repeats, timeout_seconds=timeout_seconds)
    outcomes = []
    for scenario, result in zip(scenarios, per_rank[0]):
        found = plan_for(scenario, result["calibration"])  # the same plan the ranks ran (same inputs)
        runs = [Run(row, seconds, abs(loss - result["reference"]))
                for row, (seconds, loss) in zip(found.by_layout(), result["runs"])]
        outcomes.append(Outcome(scenario, runs, result["calibration"], len(found.layouts_over_limit())))
    return outcomes


def describe(row: PlanRow) -> str:
    d, p, t = row.layout.shape
    extra = "" if row.recompute == "none" else f" {row.recompute} recompute"
    return f"{d}·{p}·{t} {row.schedule_name} b={row.micro_batch_size} m={row.n_microbatches}{extra}"


def table(outcomes: list[Outcome]) -> str:
    """One line per scenario: the choice, predicted and measured, its rank and regret, the fastest measured."""
    lines = [f"{'scenario':<22} {'fit':>3} {'planner choice (dp·pp·tp)':<34} {'pred ms':>8} {'meas ms':>8} "
             f"{'error':>6} {'rank':>4} {'regret':>6}  {'fastest measured':<34} {'max|Δloss|':>10}"]
    for o in outcomes:
        c, best = o.choice, o.best
        worst_loss = max(r.loss_error for r in o.runs)
        lines.append(f"{o.scenario.name:<22} {len(o.runs):>3} {describe(c.row):<34} {c.row.step_seconds * 1e3:>8.0f} "
                     f"{c.measured_seconds * 1e3:>8.0f} {c.error:>+6.0%} {o.measured_rank:>4} {o.regret:>6.1%}  "
                     f"{describe(best.row) + f' {best.measured_seconds * 1e3:.0f} ms':<34} {worst_loss:>10.1e}")
    return "\n".join(lines)


def detail(outcome: Outcome) -> str:
    """Every layout of one scenario: the planner's prediction beside the measured step."""
    lines = [f"{outcome.scenario.name}: {len(outcome.runs)} layouts fit, {outcome.n_over_limit} over the limit"]
    lines += [f"  {k:>2}. {describe(r.row):<38} predicted {r.row.step_seconds * 1e3:7.0f} ms  measured "
              f"{r.measured_seconds * 1e3:7.0f} ms  ({r.error:+.0%})" for k, r in enumerate(outcome.runs, 1)]
    return "\n".join(lines)
