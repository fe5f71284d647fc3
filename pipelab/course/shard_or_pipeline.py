"""Lesson 08's last question, "pipeline it, or shard it?": PP × FSDP2, PP × DP and a deeper pipeline, measured.

    found = pl_shard.run(kind="mlp", n_microbatches=4, sweep=(1, 2, 4, 8))   # one launch of 4 gloo ranks
    print(pl_shard.state_table(found)); print(pl_shard.bytes_table(found)); pl_shard.plot_gathers(found)
    pl_shard.answer(found)                                                   # the sentence, from the numbers

On 4 local ranks, one `pl.distributed.launch` runs every layout of `LAYOUTS` on the same model
(1F1B, m micro-batches, AdamW): PP2 × FSDP2 with and without `reshard_after_forward`, PP2 × DP2
(shard=None) and PP4.  Per layout each rank does one warm-up step (and an AdamW step: its state
exists), then one step inside `pipe.count_communication()` followed by an AdamW step, and reports

- **model state, observed**: the bytes this rank holds after the step, of its parameters, their
  gradients and AdamW's state (exp_avg, exp_avg_sq and a step count per parameter), each a
  DTensor's local shard (`to_local()`) under FSDP, beside `predict.fsdp_formulas.state_bytes_per_rank`
  (ZeRO stage 3 for FSDP, 0 for DP and PP; Rajbhandari et al. 2020, §5, Figure 1):

      ZeRO-0 (DP, PP):  P + P + 2P            ZeRO-3 (FSDP2):  P/d + P/d + 2P/d

  with P the bytes of the rank's stage.  Also the most gradient bytes held *during* the step
  (a hook after every accumulation): pipelab accumulates the micro-batches' full gradients
  and reduce-scatters once at the end, so a FSDP rank holds P of gradients until then;
- **bytes per kind**: what each call was handed ("pp": the stages' sends; "dp": DP's all-reduce;
  "fsdp_gather", "fsdp_reduce_scatter"), summed over the ranks, beside the closed forms
  (`predict.comm_formulas.step_bytes` for "pp" and "dp" without sharding,
  `predict.fsdp_formulas.fsdp_communication` for FSDP: per block 2m all-gathers of P/d when
  resharding, 1 when not, one reduce-scatter of P);
- **step time**: `rounds` training steps (pipe.step and AdamW's step), each from a barrier to the
  slowest rank's return; the median.  Rounds alternate the layouts' order.

Then, per m of `sweep`, FSDP's gathered bytes per step with and without resharding (a fresh
pipeline each, one step counted after one uncounted): 2m·P/d a block against P/d.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..model import models
from ..model.partition import split
from ..predict.comm_formulas import STEP_KINDS, step_bytes
from ..predict.fsdp_formulas import fsdp_communication, state_bytes_per_rank
from ..predict.layout import Layout
from ..runtime.distributed import DistributedPipeline
from ..runtime.hybrid import local_shard
from ..runtime.launcher.processes import launch

N_RANKS, BATCH, LR = 4, 16, 1e-3
STATE_PARTS = ("parameters", "gradients", "optimizer")
BYTE_KINDS = ("pp", "dp", "fsdp_gather", "fsdp_reduce_scatter")


class Choice(NamedTuple):
    """One way to lay the 4 ranks out: (dp, pp), shard (None or "fsdp") and FSDP's reshard_after_forward."""

    name: str
    dp: int
    pp: int
    shard: str | None = None
    reshard_after_forward: bool = True

    @property
    def layout(self) -> Layout:
        return Layout(dp=self.dp, pp=self.pp)

    @property
    def zero(self) -> int:
        """The ZeRO stage this layout is: 3 for FSDP2 (parameters, gradients, optimizer state sharded), else 0."""
        return 3 if self.shard == "fsdp" else 0


LAYOUTS = (Choice("PP2×FSDP2", 2, 2, "fsdp", True), Choice("PP2×FSDP2 kept", 2, 2, "fsdp", False),
           Choice("PP2×DP2", 2, 2), Choice("PP4", 1, 4))


def make_model(kind: str, width: int | None = None):
    """The lesson's models: an MLP of 8 blocks of `width` (256: 263 KB a block), or a tiny GPT of 4 layers of
    d_model = `width` (64), 16 tokens."""
    if kind == "mlp":
        return models.mlp(depth=8, width=width or 256, seed=0)
    if kind == "gpt":
        return models.tiny_gpt(n_layers=4, d_model=width or 64, n_heads=4, vocab_size=128, seq_len=16, seed=0)
    raise ValueError(f"kind={kind!r}: the lesson's models are 'mlp' and 'gpt'")


def _bytes(tensors) -> int:
    return sum(local_shard(t).numel() * t.element_size() for t in tensors)


def observed_state(pipe: DistributedPipeline, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """{"parameters", "gradients", "optimizer"}: the bytes this rank holds, a DTensor counted by its local shard."""
    parameters = pipe.parameters()
    states = [v for p in parameters for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return {"parameters": _bytes(parameters), "gradients": _bytes(p.grad for p in parameters if p.grad is not None),
            "optimizer": _bytes(states)}


class _PeakGradients:
    """The most gradient bytes held at once during a step: after every accumulation, all holders' .grad summed."""

    def __init__(self, holders: list[torch.Tensor]):
        self.peak = 0

        def seen(_):
            self.peak = max(self.peak, sum(p.grad.numel() * p.grad.element_size() for p in holders
                                           if p.grad is not None))

        self.handles = [p.register_post_accumulate_grad_hook(seen) for p in holders]

    def remove(self) -> int:
        for handle in self.handles:
            handle.remove()
        return self.peak


def _pipeline(kind: str, width: int | None, choice: Choice, n_microbatches: int):
    model = make_model(kind, width)
    pipe = DistributedPipeline(model, n_microbatches=n_microbatches, schedule="1f1b",
                               loss_fn=models.default_loss(model), layout=choice.layout, shard=choice.shard,
                               reshard_after_forward=choice.reshard_after_forward)
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=LR)


def _train_step(pipe, optimizer, batch):
    optimizer.zero_grad(set_to_none=True)
    result = pipe.step(*batch)
    optimizer.step()
    return result


def on_each_rank(kind: str, width: int | None, n_microbatches: int, sweep: tuple[int, ...], rounds: int) -> dict:
    """What one rank measures (module docstring): per layout its counts, state and step times; the m sweep."""
    import torch.distributed as dist

    batch = models.sample_batch(make_model(kind, width), BATCH, seed=1)
    runs, found = {}, {"layouts": {}, "sweep": {}}
    for choice in LAYOUTS:
        pipe, optimizer = _pipeline(kind, width, choice, n_microbatches)
        _train_step(pipe, optimizer, batch)  # warm-up, shape headers, AdamW's state
        optimizer.zero_grad(set_to_none=True)
        peak = _PeakGradients(pipe.accumulating_parameters())
        with pipe.count_communication() as counter:
            result = pipe.step(*batch)
        in_step = peak.remove()
        optimizer.step()
        runs[choice.name] = (pipe, optimizer)
        found["layouts"][choice.name] = {"loss": result.loss, "counts": counter.totals(),
                                         "state": observed_state(pipe, optimizer), "gradients_in_step": in_step,
                                         "bounds": pipe.partition.bounds, "stage": pipe.pp_index, "times": []}
    for r in range(rounds):
        for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            dist.barrier()
            begin = time.perf_counter()
            _train_step(*runs[name], batch)
            took = torch.tensor([time.perf_counter() - begin], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            found["layouts"][name]["times"].append(took.item())
    fsdp = [c for c in LAYOUTS if c.shard == "fsdp"]
    for choice in fsdp:
        for m in sweep:
            if m == n_microbatches:  # counted above
                found["sweep"][choice.reshard_after_forward, m] = found["layouts"][choice.name]["counts"]
                continue
            pipe, optimizer = _pipeline(kind, width, choice, m)
            _train_step(pipe, optimizer, batch)
            optimizer.zero_grad(set_to_none=True)
            with pipe.count_communication() as counter:
                pipe.step(*batch)
            found["sweep"][choice.reshard_after_forward, m] = counter.totals()
    return found


@dataclass
class LayoutResult:
    """One layout's figures: state per rank (the fullest rank's, observed and predicted), bytes of one step
    summed over the ranks (counted and formula), the median step time."""

    choice: Choice
    state_observed: dict[str, int]
    state_predicted: dict[str, int]
    gradients_in_step: int  # the fullest rank's peak of gradient bytes during the step
    bytes_counted: dict[str, int]
    bytes_formula: dict[str, int]
    step_seconds: float
    loss: float

    @property
    def state_bytes(self) -> int:
        return sum(self.state_observed.values())

    def worst_state_ratio(self) -> float:
        """The largest |observed / predicted − 1| over parameters, gradients and optimizer state."""
        return max(abs(self.state_observed[k] / self.state_predicted[k] - 1) for k in STATE_PARTS)


@dataclass
class Found:
    kind: str
    width: int | None
    n_microbatches: int
    layouts: dict[str, LayoutResult]
    sweep: dict[bool, list[tuple[int, int, int]]]  # reshard_after_forward -> [(m, counted, formula)]: gathered bytes


def predict_layout(kind: str, choice: Choice, n_microbatches: int, bounds: list[tuple[int, int]] | None = None,
                   width: int | None = None) -> tuple[dict[str, int], dict[str, int]]:
    """From the formulas alone, before any run: (the model state of the fullest rank, `state_bytes_per_rank`;
    the bytes of one step per kind of BYTE_KINDS summed over the 4 ranks: "pp" and "dp" by `step_bytes`, none
    of "dp" under FSDP, whose gathers and reduce-scatters are `fsdp_communication`'s)."""
    model, layout = make_model(kind, width), choice.layout
    bounds = split(make_model(kind, width), layout.pp, "uniform").bounds if bounds is None else bounds
    blocks = [list(model[a:b]) for a, b in bounds]
    state = max((state_bytes_per_rank(stage, choice.dp, choice.zero) for stage in blocks),
                key=lambda found: sum(found.values()))
    nothing = [{k: {"bytes": 0} for k in STEP_KINDS}] * layout.world_size  # step_bytes' counted side, unused
    _, formula = step_bytes(nothing, model, layout, BATCH, n_microbatches, bounds)
    moved = {"pp": formula["pp"], "dp": 0 if choice.shard else formula["dp"], "fsdp_gather": 0,
             "fsdp_reduce_scatter": 0}
    if choice.shard == "fsdp":
        for rank in range(layout.world_size):
            expected = fsdp_communication(blocks[layout.coordinates(rank)[1]], choice.dp, n_microbatches,
                                          choice.reshard_after_forward)
            for k in ("fsdp_gather", "fsdp_reduce_scatter"):
                moved[k] += expected[k]["bytes"]
    return state, moved


def prediction_table(kind: str = "mlp", n_microbatches: int = 4, width: int | None = None) -> str:
    """Per layout, what the formulas say before the run: model state per rank; bytes of one step per kind, summed
    over the 4 ranks."""
    lines = [f"{'layout':15} {'params':>9} {'grads':>9} {'AdamW':>9} {'state/rank':>10} | "
             + " ".join(f"{k:>{max(len(k), 9)}}" for k in BYTE_KINDS) + f" {'moved':>10}"]
    for choice in LAYOUTS:
        state, moved = predict_layout(kind, choice, n_microbatches, width=width)
        lines.append(f"{choice.name:15} " + " ".join(f"{_kb(state[k]):>9}" for k in STATE_PARTS)
                     + f" {_kb(sum(state.values())):>10} | "
                     + " ".join(f"{_kb(moved[k]):>{max(len(k), 9)}}" for k in BYTE_KINDS)
                     + f" {_kb(sum(moved.values())):>10}")
    return "\n".join(lines)


def run(kind: str = "mlp", n_microbatches: int = 4, sweep: tuple[int, ...] = (1, 2, 4, 8), rounds: int = 5,
        width: int | None = None, timeout_seconds: float = 240) -> Found:
    """Every layout of LAYOUTS and the m sweep on one launch of 4 gloo ranks (module docstring)."""
    if n_microbatches not in sweep:
        raise ValueError(f"n_microbatches={n_microbatches} must be one of sweep={sweep}: its counts are reused")
    per_rank = launch(on_each_rank, N_RANKS, kind, width, n_microbatches, tuple(sweep), rounds,
                      timeout_seconds=timeout_seconds)
    ranks = [found["layouts"] for found in per_rank]
    layouts = {}
    for choice in LAYOUTS:
        first = ranks[0][choice.name]
        predicted, formula = predict_layout(kind, choice, n_microbatches, first["bounds"], width)
        counted = {k: sum(rank[choice.name]["counts"][k]["bytes"] for rank in ranks) for k in BYTE_KINDS}
        fullest = max((rank[choice.name]["state"] for rank in ranks), key=lambda state: sum(state.values()))
        layouts[choice.name] = LayoutResult(choice, fullest, predicted,
                                            max(rank[choice.name]["gradients_in_step"] for rank in ranks), counted,
                                            formula, statistics.median(first["times"]), first["loss"])
    sweep_rows = {choice.reshard_after_forward: [
        (m, sum(found["sweep"][choice.reshard_after_forward, m]["fsdp_gather"]["bytes"] for found in per_rank),
         predict_layout(kind, choice, m, width=width)[1]["fsdp_gather"]) for m in sweep]
        for choice in LAYOUTS if choice.shard}
    return Found(kind, width, n_microbatches, layouts, sweep_rows)


def _kb(n: int) -> str:
    return f"{n / 1e3:,.0f} KB" if n >= 1e4 else f"{n:,} B"


def state_table(found: Found) -> str:
    """Per layout, the fullest rank's model state: observed / predicted, and the gradients held during the step."""
    lines = [f"{'layout':15} " + " ".join(f"{k + ' obs/pred':>24}" for k in STATE_PARTS)
             + f" {'total':>9} {'grads in step':>13}"]
    for row in found.layouts.values():
        cells = " ".join(f"{_kb(row.state_observed[k]):>11}/{_kb(row.state_predicted[k]):<12}" for k in STATE_PARTS)
        lines.append(f"{row.choice.name:15} {cells} {_kb(row.state_bytes):>9} {_kb(row.gradients_in_step):>13}")
    return "\n".join(lines)


def bytes_table(found: Found) -> str:
    """Per layout, the bytes of one step summed over the ranks per kind (counted / formula), and the step time."""
    lines = [f"{'layout':15} " + " ".join(f"{k + ' counted/formula':>28}" for k in BYTE_KINDS) + f" {'step ms':>8}"]
    for row in found.layouts.values():
        cells = " ".join(f"{_kb(row.bytes_counted[k]):>13}/{_kb(row.bytes_formula[k]):<14}" for k in BYTE_KINDS)
        lines.append(f"{row.choice.name:15} {cells} {row.step_seconds * 1e3:8.1f}")
    return "\n".join(lines)


def plot_gathers(found: Found):
    """FSDP's gathered bytes per step against m: the formula as a line, the counted points, with and without
    reshard_after_forward."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    for reshard, style in ((True, "C0"), (False, "C1")):
        ms, counted, formula = zip(*found.sweep[reshard])
        label = f"reshard_after_forward={reshard}"
        ax.plot(ms, [f / 1e6 for f in formula], color=style, label=f"{label}: formula")
        ax.scatter(ms, [c / 1e6 for c in counted], color=style, marker="o", zorder=3, label=f"{label}: counted")
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("MB gathered per step")
    ax.set_ylim(bottom=0)
    ax.set_xticks(ms)
    ax.set_title("FSDP's all-gathers, summed over the 4 ranks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def answer(found: Found) -> str:
    """The lesson's answer, from this run's numbers: model state per rank, bytes moved and step time of the deeper
    pipeline against the sharded one, each beside PP2 × DP2; the verdict is the fastest of PP4 and the two FSDP
    rows (the ways to shrink the state)."""
    rows = found.layouts
    dp, deep, fsdp, kept = rows["PP2×DP2"], rows["PP4"], rows["PP2×FSDP2"], rows["PP2×FSDP2 kept"]
    moved = {name: sum(row.bytes_counted.values()) for name, row in rows.items()}
    faster = min((deep, fsdp, kept), key=lambda row: row.step_seconds)
    verdict = "pipeline it" if faster is deep else "shard it"
    return (f"Model state per rank: PP2×DP2 {_kb(dp.state_bytes)}, PP4 {_kb(deep.state_bytes)} "
            f"({deep.state_bytes / dp.state_bytes:.2f}×), PP2×FSDP2 {_kb(fsdp.state_bytes)} "
            f"({fsdp.state_bytes / dp.state_bytes:.2f}×). Bytes moved per step: PP4 {_kb(moved['PP4'])}, PP2×FSDP2 "
            f"{_kb(moved['PP2×FSDP2'])} ({moved['PP2×FSDP2'] / moved['PP4']:.0f}× PP4's; "
            f"{_kb(moved['PP2×FSDP2 kept'])} with the weights kept gathered, the whole stage held during the step). "
            f"Step time: PP4 {deep.step_seconds * 1e3:.0f} ms, PP2×FSDP2 {fsdp.step_seconds * 1e3:.0f} ms "
            f"({kept.step_seconds * 1e3:.0f} ms kept), PP2×DP2 {dp.step_seconds * 1e3:.0f} ms. "
            f"On this machine, {verdict}: {faster.choice.name} is the fastest of the layouts that shrink the state.")


__all__ = ["BYTE_KINDS", "LAYOUTS", "STATE_PARTS", "Choice", "Found", "LayoutResult", "answer", "bytes_table",
           "make_model", "observed_state", "on_each_rank", "plot_gathers", "predict_layout", "prediction_table", "run",
           "state_table"]
