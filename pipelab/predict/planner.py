"""`pl.plan(...)`: every (dp, pp, tp) layout of a transformer on a cluster, ranked by predicted step time.

    spec = pl.TransformerSpec(layers=80, hidden=12288, heads=96, seq=2048, vocab=51200)
    found = pl.plan(spec, n_devices=1536, devices_per_node=8, memory_bytes=80e9, global_batch=2304,
                    inside=(5e-6, 300e9), between=(10e-6, 25e9), peak_flops_per_second=312e12)
    print(found.table())            # the fastest rows, then the layouts over the limit and why
    found.best, found.rank_of(pl.Layout(dp=24, pp=8, tp=8))

For every layout with d·p·t = n devices (`Layout.all_for`), every micro-batch size b with
m = B/(b·d) whole micro-batches, every schedule, every recomputation option and every ZeRO stage asked
for (`sharding`, where d > 1; none by default), a closed form
predicts one step (no simulation: a 3072-device plan has some 50,000 rows).  On the busiest
stage (⌈L/p⌉ layers plus the output layer, which the last stage runs), per micro-batch:

    T_F = F/(t·X) + 2·(L/p)·AR + v·msg                     F: forward FLOPs (transformer_memory.py)
    T_B = (2F + R)/(t·X) + (2 or 4)·(L/p)·AR + v·msg       R: recomputed FLOPs; full recomputation runs
                                                             the 2 forward all-reduces again
    X = peak_flops_per_second · achieved_fraction(b, t)   a number, or one per micro-batch size b (and t)
                                                             (small multiplies reach less of the peak, SC21 §3.4)
    AR = ring all-reduce of b·s·h values over t on the "tp" link: 2(t−1)/t·A/bw + 2(t−1)·latency
         (Megatron-LM: 2 forward, 2 backward per layer; Shoeybi et al. 2019 §3, comm_formulas.py)
    msg = latency + (A/t)/bw on the "pp" link, then an all-gather of it over t (SC21 §4.1's
          scatter/gather); v messages per direction with v chunks (interleaved), none when p = 1

and the pipeline, closed forms of CURRICULUM.md (closed_forms.py, each checked against `simulate`):

    GPipe, 1F1B   (m + p − 1)·(T_F + T_B)                     bubble (p−1)/m of the ideal time
    interleaved   m·(T_F + T_B) + (p−1)·(T_F + T_B)/v          bubble (p−1)/(v·m)   (m a multiple of p,
                                                                 L a multiple of p·v; SC21 §2.2.2)
    ZB-H1         m·(T_F + T_B) + (p−1)·(T_F + T_I − T_W)      T_W = weight_share · 2F/(t·X), T_I = T_B − T_W
                                                                 (Zero Bubble PP, Table 2; m ≥ p)

ZB-H1's assumption: the weight-gradient half W is `weight_share` = 1/2 of the backward's
multiplies (T_W ≈ T_F, the paper's T_F ≈ T_B ≈ T_W) and carries no communication; recomputation
belongs to the input-gradient half I.  Then the data-parallel all-reduce of the stage's
gradients (ZeRO §7.1: 2(d−1)/d·Ψ_rank bytes on the "dp" link) follows the drain, not overlapped
(as in Megatron-LM at SC21):  step = pipeline + all_reduce(Ψ_rank·bytes, d).

Links: the "tp", "pp" and "dp" groups use the link inside a node when each group lies in one node
(tp groups are t consecutive ranks, pp groups lie in blocks of p·t, dp spans all n), else the link between.

Memory per device, the larger of the first and the last stage (ZeRO §3 for the model states):

    parameters   (⌈L/p⌉·(12h² + 13h) + V·h)/t, + s·h on the first stage (position embedding), at 16-bit
    gradients    the same bytes;  optimizer 12 bytes per parameter (fp32 copy, momentum, variance:
                 16 bytes in all with the 2 + 2), 8 for bytes_per_value=4 (fp32 Adam);  ZeRO below
    activations  in-flight micro-batches × ⌈L/p⌉ × one layer's bytes (Korthikanti et al. 2022, Table 2)
                 + one layer rebuilt at a time with full recomputation; in flight on the first stage:
                 GPipe m, 1F1B and ZB-H1 min(p, m), interleaved min(v·p + p − 1, v·m)/v whole-stage
                 micro-batches = p·(1 + (p−1)/(p·v)) (Megatron's warm-up count); on the last stage
                 GPipe m, 1F1B 1, interleaved ((v−1)·p + 1)/v

ZeRO over the dp replicas (`sharding=(0, 1, 2, 3)`; sharding.py has the formulas and sources): each zero stage
tried is a row where dp > 1.  During the step a device holds its parameters whole (ZeRO-3: 1/d and the largest
block gathered), its gradients *whole* (a pipeline accumulates them over the micro-batches and reduce-scatters
once after the drain, so ZeRO-2 saves nothing here: it equals ZeRO-1), and 1/d of the optimizer states
(ZeRO §5, Figure 1).  ZeRO-1 and -2 move an all-reduce's bytes (ZeRO §7.1); ZeRO-3 (FSDP2, resharding after
forward) all-gathers the stage's blocks before every action that computes, k·m times a step (k = 2, 3 for
ZB-H1), each g = (d−1)/d·s·Ψ/bw + blocks·(d−1)·latency added to T_F and T_B, then reduce-scatters once
(ZeRO §7.2.2's 3Ψ against 2Ψ, m-fold in a pipeline).  Rows tie-break on the lower zero stage.

Left out: GEMM efficiency that grows with b unless `achieved_fraction` gives it per b (SC21 §3.4; with
one number larger micro-batches only add bubble and memory), overlap of communication with compute (FSDP's
prefetch included), the tied-embedding all-reduce between first and last stage, the optimizer step's time.

A `ProfiledModel` (profiled_model.py) replaces the closed forms of the busiest stage by its measured
blocks: the same pipeline, message, all-reduce and memory formulas take its seconds and bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .budget import format_bytes
from .closed_forms import microbatches_in_flight, pipeline_seconds
from .communication import pipeline_sent, ring_allreduce_elements_per_device
from .hybrid_costs import Link, all_reduce_seconds
from .layout import Layout
from .profiled_model import ProfiledModel
from .sharding import (after_drain_bytes, after_drain_seconds, check_sharding, computing_actions, gather_seconds,
                       state_bytes)
from .stage_work import StageWork
from .transformer_memory import RECOMPUTE, SCHEDULES, DeviceBytes, TransformerSpec


@dataclass(frozen=True)
class PlanRow:
    """One way to run the step: a layout, a micro-batch size, a schedule, a recomputation option."""

    layout: Layout
    schedule: str  # one of SCHEDULES
    chunks: int  # v: model chunks per device (interleaved), else 1
    recompute: str  # "none", "selective", "full"
    micro_batch_size: int  # b
    n_microbatches: int  # m = B / (b·d)
    step_seconds: float
    bubble_fraction: float  # of the ideal time m·(T_F + T_B), the closed form
    memory: DeviceBytes
    bytes_per_kind: dict  # {"pp", "pp_gather", "tp", "dp", "dp_gather"}: bytes the busiest device sends per step
    seconds: dict  # {"compute", "tp", "pp", "dp_gather", "bubble", "dp"}: where the step's time goes (they add up)
    reason: str = ""  # why it is over the memory limit ("" when it fits)
    zero: int = 0  # the ZeRO stage sharding the dp replicas' model states: 0 none, 1, 2, 3 (FSDP2); sharding.py

    @property
    def schedule_name(self) -> str:
        return f"interleaved(v={self.chunks})" if self.schedule == "interleaved" else self.schedule


@dataclass
class Plan:
    """`plan`'s answer: `rows` fit and are ranked (fastest first), `over_limit` do not (each with its
    reason), `impossible` are the layouts the model or the batch cannot take (layout, reason)."""

    rows: list[PlanRow]
    over_limit: list[PlanRow]
    impossible: list[tuple[Layout, str]]
    memory_bytes: float
    n_devices: int
    settings: dict = field(default_factory=dict)

    @property
    def best(self) -> PlanRow | None:
        return self.rows[0] if self.rows else None

    def by_layout(self) -> list[PlanRow]:
        """The fastest fitting row of each layout, fastest first."""
        seen, best = set(), []
        for row in self.rows:
            if row.layout not in seen:
                seen.add(row.layout)
                best.append(row)
        return best

    def rank_of(self, layout: Layout) -> int | None:
        """1 for the fastest layout (its best row against the others' best rows); None: nothing of it fits."""
        for rank, row in enumerate(self.by_layout(), 1):
            if row.layout == layout:
                return rank
        return None

    def layouts_over_limit(self) -> list[PlanRow]:
        """For each layout with no fitting row, its row that needs the least memory (with the reason)."""
        fitting = {row.layout for row in self.rows}
        least: dict[Layout, PlanRow] = {}
        for row in self.over_limit:
            if row.layout not in fitting and (row.layout not in least
                                              or row.memory.total < least[row.layout].memory.total):
                least[row.layout] = row
        return sorted(least.values(), key=lambda r: r.memory.total)

    def table(self, n_rows: int = 10, per_layout: bool = True) -> str:
        """The fastest `n_rows` (one per layout unless per_layout=False), then what does not fit and why."""
        gib = 2**30
        shown = (self.by_layout() if per_layout else self.rows)[:n_rows]
        head = (f"{'#':>3} {'dp':>4} {'pp':>3} {'tp':>3} {'zero':>4} {'schedule':<16} {'recompute':<9} {'b':>2} "
                f"{'m':>5} {'step s':>9} {'bubble':>7} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} {'total':>7} "
                f"{'pp GiB':>7} {'tp GiB':>7} {'dp GiB':>7}")
        n_layouts = len(Layout.all_for(self.n_devices))
        lines = [(f"{len(self.rows)} configurations of {len(self.by_layout())} of the {n_layouts} layouts of "
                 f"{self.n_devices} devices fit in {format_bytes(self.memory_bytes)} per device; memory per device "
                 "in GiB, bytes the busiest device sends per step in GiB (tp: all-reduces and pp_gather; dp: "
                 "all-reduce, or ZeRO-3's gathers and reduce-scatter); zero: the ZeRO stage over dp"), head]
        for rank, r in enumerate(shown, 1):
            d, p, t = r.layout.shape
            mem, sent = r.memory, r.bytes_per_kind
            lines.append(f"{rank:>3} {d:>4} {p:>3} {t:>3} {r.zero:>4} {r.schedule_name:<16} {r.recompute:<9} "
                         f"{r.micro_batch_size:>2} {r.n_microbatches:>5} {r.step_seconds:>9.4g} {r.bubble_fraction:>7.1%} "
                         f"{mem.parameters / gib:>7.2f} {mem.gradients / gib:>7.2f} {mem.optimizer / gib:>7.2f} "
                         f"{mem.activations / gib:>7.2f} {mem.total / gib:>7.2f} {sent['pp'] / gib:>7.2f} "
                         f"{(sent['tp'] + sent['pp_gather']) / gib:>7.2f} "
                         f"{(sent['dp'] + sent['dp_gather']) / gib:>7.2f}")
        over = self.layouts_over_limit()
        if over:
            lines.append(f"over the memory limit ({len(over)} layouts; the configuration needing least memory):")
            lines += [f"  {r.layout}: {r.schedule_name}, recompute={r.recompute}, b={r.micro_batch_size}"
                      f"{f', zero={r.zero}' if r.zero else ''}: {r.reason}"
                      for r in over[:n_rows]]
            if len(over) > n_rows:
                lines.append(f"  ... and {len(over) - n_rows} more")
        if self.impossible:
            lines.append(f"impossible ({len(self.impossible)} layouts):")
            lines += [f"  {layout}: {why}" for layout, why in self.impossible[:n_rows]]
            if len(self.impossible) > n_rows:
                lines.append(f"  ... and {len(self.impossible) - n_rows} more")
        return "\n".join(lines)


def plan(model: TransformerSpec | ProfiledModel, n_devices: int, devices_per_node: int, memory_bytes: float,
         global_batch: int, inside: Link | tuple[float, float], between: Link | tuple[float, float],
         peak_flops_per_second: float | None = None, achieved_fraction: float | Mapping = 0.5,
         micro_batch_sizes: Sequence[int] = (1, 2, 4, 8), schedules: Sequence[str] = SCHEDULES,
         chunks: Sequence[int] = (2, 4), recompute: Sequence[str] = RECOMPUTE, sequence_parallel: bool = False,
         weight_share: float = 0.5, sharding: Sequence[int] = (0,)) -> Plan:
    """Every layout of `model` on `n_devices`, ranked by predicted step time (module docstring).

    `model`: a `TransformerSpec` (closed forms; needs `peak_flops_per_second`) or a `ProfiledModel` (its
    blocks measured: seconds instead of FLOPs, tp = 1, its own micro-batch size, no selective recomputation;
    `profiled_model.py`).  `inside`, `between`: the (latency seconds, bandwidth bytes/s) of a link inside a
    node and between nodes, per device (nominal or measured: a `hybrid_costs.Link` or a pair).
    `micro_batch_sizes`: the b to try, those that divide B/d.  `achieved_fraction`: the share of the peak
    the multiplies reach, one number, or {b: share} for every b tried, or {(b, t): share} (a t-way sharded
    layer's multiplies are smaller; measured per micro-batch size and tensor-parallel degree, as
    `course/planner_check.py` does).  `chunks`: the v to try for the interleaved schedule.  `sharding`: the
    ZeRO stages to try where dp > 1 (0 none, 1 optimizer states, 2 + gradients, 3 + parameters: FSDP2 with
    reshard_after_forward=True; sharding.py), each a row; (0,) by default, as before sharding was planned.
    """
    if isinstance(model, ProfiledModel):
        micro_batch_sizes, recompute = (model.micro_batch_size,), [r for r in recompute if r != "selective"]
        peak_flops_per_second, achieved_fraction = 1.0, 1.0  # unused: the profile gives seconds
    elif not isinstance(model, TransformerSpec):
        raise TypeError(f"model must be a TransformerSpec(layers, hidden, heads, seq, vocab) or a "
                        f"pl.ProfiledModel (pl.ProfiledModel.measure(model, sample, loss_fn)), got "
                        f"{type(model).__name__}")
    elif peak_flops_per_second is None:
        raise ValueError("a TransformerSpec's step is FLOPs over a speed: give peak_flops_per_second (and "
                         "achieved_fraction)")
    for name, value in (("n_devices", n_devices), ("devices_per_node", devices_per_node),
                        ("global_batch", global_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name, value in (("memory_bytes", memory_bytes), ("peak_flops_per_second", peak_flops_per_second)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"{name} must be a positive, finite number, got {value!r}")
    fractions = (dict(achieved_fraction) if isinstance(achieved_fraction, Mapping)
                 else {b: achieved_fraction for b in micro_batch_sizes})
    tp_degrees = sorted({layout.tp for layout in Layout.all_for(n_devices)})
    missing = [b for b in micro_batch_sizes if b not in fractions and any((b, t) not in fractions for t in tp_degrees)]
    if missing:
        raise ValueError(f"achieved_fraction gives no share for the micro-batch sizes {missing} (it covers "
                         f"{sorted(fractions, key=str)}); give one for every size in micro_batch_sizes, as b or as "
                         f"(b, tp) for every tp in {tp_degrees}")
    if not all(isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f <= 1 for f in fractions.values()):
        raise ValueError(f"achieved_fraction is the share of the peak FLOP/s the multiplies reach, in (0, 1]; "
                         f"got {achieved_fraction!r}")
    if not 0 <= weight_share <= 0.5:
        raise ValueError(f"weight_share (ZB-H1's T_W over the backward's multiplies) must lie in [0, 0.5] for the "
                         f"closed form (T_W <= T_F), got {weight_share!r}")
    unknown = [s for s in schedules if s not in SCHEDULES] + [r for r in recompute if r not in RECOMPUTE]
    if unknown:
        raise ValueError(f"unknown schedule or recompute option {unknown}; schedules: {SCHEDULES}, recompute: "
                         f"{RECOMPUTE}")
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in micro_batch_sizes):
        raise ValueError(f"micro_batch_sizes must be positive ints (sequences per micro-batch), got "
                         f"{list(micro_batch_sizes)}")
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 2 for v in chunks):
        raise ValueError(f"chunks (interleaved's v) must be ints >= 2, got {list(chunks)}")
    zero_stages = check_sharding(sharding)
    inside, between = _pair(inside, "inside"), _pair(between, "between")
    speed = {key: peak_flops_per_second * fraction for key, fraction in fractions.items()}
    rows, impossible = [], []
    for layout in Layout.all_for(n_devices):
        why = _impossible(model, layout, global_batch)
        if why:
            impossible.append((layout, why))
            continue
        links = _links(layout, devices_per_node, inside, between)
        zeros = [z for z in zero_stages if layout.dp > 1 or z == 0] or [0]  # dp = 1: sharding is no sharding
        found = [_row(work, layout, b, global_batch // (b * layout.dp), name, v, rc, links, memory_bytes, zero)
                 for b in micro_batch_sizes if (global_batch // layout.dp) % b == 0
                 for name, v in _schedules(model, layout, global_batch // (b * layout.dp), schedules, chunks)
                 for rc in recompute
                 for work in [_work(model, layout, b, name, v, rc, speed, sequence_parallel, weight_share)]
                 for zero in zeros]
        if not found:
            impossible.append((layout, (f"none of the schedules {list(schedules)} applies with micro-batches of "
                                       f"{list(micro_batch_sizes)} (interleaved needs m a multiple of pp and layers a "
                                       "multiple of pp·v; ZB-H1 needs m >= pp >= 2)")))
        rows += found
    key = lambda r: (r.step_seconds, r.memory.total, r.layout.pp * r.layout.tp, r.zero)
    settings = {"global_batch": global_batch, "devices_per_node": devices_per_node, "inside": inside,
                "between": between, "flops_per_second": speed, "sharding": zero_stages}
    return Plan(sorted((r for r in rows if not r.reason), key=key), sorted((r for r in rows if r.reason), key=key),
                impossible, float(memory_bytes), n_devices, settings)


def _pair(link, name: str) -> tuple[float, float]:
    latency, bandwidth = (link.latency, link.bandwidth) if isinstance(link, Link) else tuple(link)
    if not (latency >= 0 and bandwidth > 0):
        raise ValueError(f"{name} must be (latency seconds >= 0, bandwidth bytes/s > 0), got {link!r}")
    return float(latency), float(bandwidth)


def _links(layout: Layout, per_node: int, inside: tuple[float, float], between: tuple[float, float]) -> dict:
    """{"tp", "pp", "dp"}: the link inside a node when every group of that dimension lies in one node.

    Ranks are row-major over (dp, pp, tp) (layout.py): a tp group is t consecutive ranks, a pp group lies in a
    block of p·t, the dp groups span all n.  Unlike `hybrid_costs.cluster_links` (span <= node), a group that
    straddles two nodes (t=6 on nodes of 8: ranks 6..11) takes the link between them."""
    n = layout.world_size

    def one_node(span: int) -> bool:
        return all(k // per_node == (k + span - 1) // per_node for k in range(0, n, span))

    spans = {"tp": layout.tp, "pp": layout.pp * layout.tp, "dp": n}
    return {dim: Link(*(inside if one_node(span) else between)) for dim, span in spans.items()}


def _impossible(model: TransformerSpec | ProfiledModel, layout: Layout, global_batch: int) -> str:
    d, p, t = layout.shape
    if global_batch % d:
        return f"the global batch of {global_batch} sequences does not split over dp={d} replicas"
    if isinstance(model, ProfiledModel):
        if t > 1:
            return f"tp={t}: a profiled model's blocks have no tensor-parallel plan (tp=1 only)"
        if p > model.n_blocks:
            return f"pp={p} stages for {model.n_blocks} profiled blocks would leave a stage empty"
        return ""
    if model.heads % t:
        return f"tp={t} does not divide the {model.heads} attention heads"
    if p > model.layers:
        return f"pp={p} stages for {model.layers} layers would leave a stage empty"
    return ""


def _schedules(model: TransformerSpec | ProfiledModel, layout: Layout, m: int, names: Sequence[str],
               chunks: Sequence[int]):
    """(name, v) pairs whose closed form applies to this layout and m (a profiled model: p·v <= its blocks)."""
    p = layout.pp
    fits = ((lambda v: p * v <= model.n_blocks) if isinstance(model, ProfiledModel)
            else (lambda v: model.layers % (p * v) == 0))
    for name in names:
        if name in ("gpipe", "1f1b") or (name == "zb-h1" and p > 1 and m >= p):
            yield name, 1
        elif name == "interleaved" and p > 1 and m % p == 0:
            yield from ((name, v) for v in chunks if fits(v))


def _work(model, layout: Layout, b: int, schedule: str, v: int, recompute: str, speed: dict,
          sequence_parallel: bool, weight_share: float) -> StageWork:
    if isinstance(model, ProfiledModel):
        return model.stage_work(layout.pp, v, recompute, weight_share, split_weight=schedule == "zb-h1")
    return _transformer_work(model, layout, b, schedule, recompute, speed.get((b, layout.tp), speed.get(b)),
                             sequence_parallel, weight_share)


def _transformer_work(model: TransformerSpec, layout: Layout, b: int, schedule: str, recompute: str, speed: float,
                      sequence_parallel: bool, weight_share: float) -> StageWork:
    """The busiest stage of a `TransformerSpec` (module docstring): ⌈L/p⌉ layers and the output layer."""
    _, p, t = layout.shape
    layers = math.ceil(model.layers / p)
    forward_flops = layers * model.layer_forward_flops(b) + model.logits_forward_flops(b)
    again = {"none": 0.0, "selective": layers * model.attention_core_flops(b),
             "full": layers * model.layer_forward_flops(b)}[recompute]
    h = model.hidden
    body = layers * model.layer_parameters / t + model.embedding_parameters / t
    kept = layers * model.layer_activation_bytes(b, t, recompute, sequence_parallel)
    return StageWork(forward=forward_flops / (t * speed), backward=(2 * forward_flops + again) / (t * speed),
                     weight=weight_share * 2 * forward_flops / (t * speed) if schedule == "zb-h1" else 0.0,
                     all_reduces_forward=2 * layers,
                     all_reduces_backward=2 * layers + (2 * layers if recompute == "full" else 0),
                     boundary_bytes=model.boundary_bytes(b),
                     parameters=(body + model.seq * h + (2 * h if p == 1 else 0), body + 2 * h),
                     kept_bytes=(kept, kept), working_bytes=model.working_bytes(b, t, recompute, sequence_parallel),
                     bytes_per_value=model.bytes_per_value,
                     busiest_parameters=body + (model.seq * h + 2 * h if p == 1 else 2 * h), busiest_blocks=layers + 1,
                     largest_block=(max(model.layer_parameters / t, model.embedding_parameters / t + model.seq * h),
                                    max(model.layer_parameters / t, model.embedding_parameters / t + 2 * h)))


def _row(work: StageWork, layout: Layout, b: int, m: int, schedule: str, v: int, recompute: str,
         links: dict[str, Link], limit: float, zero: int = 0) -> PlanRow:
    d, p, t = layout.shape
    boundary, size = work.boundary_bytes, work.bytes_per_value
    one_ar = all_reduce_seconds(boundary, t, links["tp"])
    ar_f, ar_b = work.all_reduces_forward, work.all_reduces_backward
    gather = 0.0 if t == 1 else ((t - 1) / t * boundary / links["tp"].bandwidth + (t - 1) * links["tp"].latency)
    message = 0.0 if p == 1 else links["pp"].latency + boundary / t / links["pp"].bandwidth + gather
    # ZeRO-3: each action that computes first all-gathers the stage's blocks over dp (sharding.py)
    k = computing_actions(schedule)
    fsdp = gather_seconds(work.busiest_parameters, d, work.busiest_blocks, size, links["dp"]) if zero == 3 else 0.0
    weight = work.weight + (fsdp if k == 3 else 0.0)
    t_f = work.forward + ar_f * one_ar + v * message + fsdp
    t_b = work.backward + ar_b * one_ar + v * message + (k - 1) * fsdp
    pipeline = pipeline_seconds(schedule, p, m, t_f, t_b - weight, weight, v)
    per = t_f + t_b
    bubble_seconds = pipeline - m * per
    memory = _memory(work, d, p, m, schedule, v, zero)
    drained = work.busiest_parameters if zero == 3 else work.parameters[0]
    dp_seconds = after_drain_seconds(drained, d, zero, work.busiest_blocks, size, links["dp"])
    sent = {"pp": m * v * pipeline_sent(boundary / t, p),
            "pp_gather": 0.0 if p == 1 else m * v * min(2, p - 1) * (t - 1) / t * boundary,
            "tp": m * (ar_f + ar_b) * ring_allreduce_elements_per_device(boundary, t),
            "dp": after_drain_bytes(drained, d, zero, size),
            "dp_gather": m * k * (d - 1) / d * work.busiest_parameters * size if zero == 3 else 0.0}
    seconds = {"compute": m * (work.forward + work.backward), "tp": m * (ar_f + ar_b) * one_ar,
               "pp": m * 2 * v * message, "dp_gather": m * k * fsdp, "bubble": bubble_seconds, "dp": dp_seconds}
    reason = "" if memory.total <= limit else _reason(memory, limit, layout, schedule, recompute, zero)
    return PlanRow(layout, schedule, v, recompute, b, m, pipeline + dp_seconds, bubble_seconds / (m * per), memory,
                   sent, seconds, reason, zero)


def _memory(work: StageWork, d: int, p: int, m: int, schedule: str, v: int, zero: int) -> DeviceBytes:
    """The busier of the first and the last stage's device (module docstring; ZeRO's sharding: sharding.py)."""
    size = work.bytes_per_value
    in_flight = microbatches_in_flight(schedule, p, m, v)
    optimizer = 8 if size == 4 else 12  # fp32 Adam's two moments; mixed precision's fp32 copy and both moments
    stages = [DeviceBytes(*state_bytes(n, d, zero, size, optimizer, block), k * kept + work.working_bytes)
              for n, k, kept, block in zip(work.parameters, in_flight, work.kept_bytes, work.largest_block)]
    return max(stages, key=lambda s: s.total)


def _reason(memory: DeviceBytes, limit: float, layout: Layout, schedule: str, recompute: str, zero: int = 0) -> str:
    """Why a row does not fit, and what would help most (the largest part first)."""
    states = memory.parameters + memory.gradients + memory.optimizer
    if memory.activations > states:
        tips = [t for t, ok in (("full recomputation", recompute != "full"),
                                ("1F1B instead of GPipe", schedule == "gpipe"),
                                ("smaller micro-batches", True)) if ok]
        tip = "activations dominate: try " + ", ".join(tips)
    else:
        tip = f"model states dominate ({format_bytes(states)}): more stages or tensor parallelism"
        if layout.dp > 1 and zero < 3:
            tip += f", or ZeRO-3 over the dp={layout.dp} replicas (sharding=(0, 1, 2, 3))"
    return f"needs {format_bytes(memory.total)} > {format_bytes(limit)} ({memory}); {tip}"
