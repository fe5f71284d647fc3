"""Lesson 14's "sharding or pipelining": a model too big for one device, placed by whichever `pl.plan` predicts faster.

    spec, found = sharding_lesson.plan_placements(link_gb_per_s=400)   # 8 GPUs of 40 GiB, ZeRO 0..3 tried
    best = sharding_lesson.best_by_placement(found)   # {"pipelining", "ZeRO-0", "ZeRO-1", "ZeRO-3"}: PlanRow | None
    print(sharding_lesson.placement_table(found))

The placements, without tensor parallelism (the plan has it, and `found.best` may use it; the table sets the two
apart): "pipelining" is the fastest fitting row with pp > 1 and tp = 1 (any ZeRO stage over its dp); "ZeRO-z" the
fastest fitting row with pp = tp = 1, ZeRO stage z over all the devices.  ZeRO-2 is left out of the
table: inside a pipeline it equals ZeRO-1 (the gradients accumulate whole until the step's reduce-scatter;
`pipelab/predict/sharding.py`).
"""

from __future__ import annotations

from ..predict.planner import Plan, PlanRow, plan
from ..predict.transformer_memory import TransformerSpec

GIB = 2**30
# GPT-3 6.7B's shape (32 layers of 4096, 32 heads): 6.7 B parameters, 16 bytes each with mixed-precision Adam, 100 GiB
PLACEMENT_MODEL = {"layers": 32, "hidden": 4096, "heads": 32, "seq": 2048, "vocab": 51200}
PLACEMENTS = ("pipelining", "ZeRO-0", "ZeRO-1", "ZeRO-3")


def plan_placements(link_gb_per_s: float, n_devices: int = 8, memory_gib: float = 40.0, global_batch: int = 8,
                    latency_seconds: float = 10e-6, peak_flops_per_second: float = 312e12) -> tuple:
    """(spec, plan): the 6.7 B model on `n_devices` GPUs of `memory_gib` joined by one kind of link,
    `link_gb_per_s` GB/s a GPU (400: NVLink-class; 25: a node's InfiniBand share), A100 peak FLOP/s at half
    achieved, every ZeRO stage tried (`sharding=(0, 1, 2, 3)`)."""
    spec = TransformerSpec(**PLACEMENT_MODEL)
    link = (latency_seconds, link_gb_per_s * 1e9)
    found = plan(spec, n_devices, 1, memory_gib * GIB, global_batch, inside=link, between=link,
                 peak_flops_per_second=peak_flops_per_second, sharding=(0, 1, 2, 3))
    return spec, found


def best_by_placement(found: Plan) -> dict[str, PlanRow | None]:
    """The fastest fitting row of each placement (module docstring); None where none fits."""
    def first(keep) -> PlanRow | None:
        return next((r for r in found.rows if keep(r)), None)

    best = {"pipelining": first(lambda r: r.layout.pp > 1 and r.layout.tp == 1)}
    best.update({f"ZeRO-{z}": first(lambda r, z=z: r.layout.shape == (r.layout.dp, 1, 1) and r.zero == z)
                 for z in (0, 1, 3)})
    return best


def placement_table(found: Plan) -> str:
    """Each placement's best row: its layout, schedule, step and where the step goes (compute, bubble, ZeRO-3's
    gathers, the dp communication after the drain), its memory a device; "-" where nothing of it fits."""
    lines = [f"{'placement':11} {'dp·pp·tp':>9} {'schedule':<16} {'recompute':<9} {'step s':>7} {'compute':>8} "
             f"{'bubble':>7} {'gathers':>8} {'dp':>6} {'GiB':>6}"]
    for name, row in best_by_placement(found).items():
        if row is None:
            lines.append(f"{name:11} {'-':>9}   nothing of it fits in {found.memory_bytes / GIB:.0f} GiB")
            continue
        s = row.seconds
        lines.append(f"{name:11} {'·'.join(map(str, row.layout.shape)):>9} {row.schedule_name:<16} "
                     f"{row.recompute:<9} {row.step_seconds:7.3f} {s['compute']:8.3f} {s['bubble']:7.3f} "
                     f"{s['dp_gather']:8.3f} {s['dp']:6.3f} {row.memory.total / GIB:6.1f}")
    return "\n".join(lines)
