"""Lesson 08 §4: one transformer layer written by hand, Megatron-style, and the bytes it saves for its backward.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §4.1 and
Table 2) count what one layer keeps from its forward to its backward: s tokens, b sequences, width h,
a heads, 16-bit values (2 bytes each) and 1-byte dropout masks.  In bytes:

    layer-norm inputs                      2 × 2sbh    = 4sbh     whole on every TP rank
    inputs of the column-parallel Linears  2 × 2sbh    = 4sbh     (QKV and fc1: the layer norms' outputs)
    dropout masks after g                  2 × sbh     = 2sbh
    Q, K, V                                3 × 2sbh    = 6sbh     split over the t ranks
    attention scores                       2as²b + as²b + 2as²b   (softmax output, its dropout mask and output)
    the projection's input                 2sbh
    GELU's input and fc2's input           2 × 8sbh    = 16sbh    (the MLP is 4h wide)
                                           ─────────────────────
    without tensor parallelism             sbh·(34 + 5as/h)
    t-way tensor parallelism               sbh·(10 + 24/t + 5as/(ht))

Tensor parallelism splits what lies between Megatron's f and g (Shoeybi et al. 2019, §3): the heads and
the MLP's hidden units, 24·sbh + 5as²b, divided by t.  The other 10·sbh stay whole on every rank;
sequence parallelism (Korthikanti §4.2.2) splits them along the sequence, sbh·(34/t + 5as/(ht)).

`layer_forward` is that layer on one of t ranks, written by hand with no DTensor: a column-parallel QKV
and fc1, a row-parallel projection and fc2, Megatron's f before each column-parallel Linear and g after
each row-parallel one, passed in as functions (`f(x)`, `g(partial)`; task 4.2 writes them as autograd
functions over `dist.all_reduce`).  Dropout is `torch.native_dropout`, which keeps a 1-byte mask as
Megatron's fused kernels do (a CPU's plain `dropout` keeps a mask of the input's dtype).

f is the identity forward and g an all-reduce: neither saves anything for the backward, so one process
can count what a rank keeps.  `count_saved` runs rank r's layer in bfloat16 with g adding the other
ranks' partial sums, computed here from their shards without a graph (`OtherRanks`), inside
`SavedTensors` (the engine's saved-tensor counter: storages once, parameters left out); it names each
storage by its tensor (`PARTS`) and checks with a `MemoryObserver` that every counted storage is freed
when the backward ends.  `split_difference` checks in float64 that the t ranks' shards, their partial
sums added, compute the whole layer.  tests/test_megatron_layer.py runs the same layer with task 4.2's
reference f and g on 2 gloo ranks: the same bytes, and the whole layer's output and gradients.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from typing import Callable

import torch
import torch.nn.functional as F

from ..model.stage import SavedTensors, _storage_key
from ..runtime.memory_observer import MemoryObserver


class LayerShape(NamedTuple):
    """One layer's shape: s tokens, b sequences, width h (the MLP 4h wide), a heads; dropout probability."""

    seq: int = 64
    batch: int = 2
    hidden: int = 128
    heads: int = 4
    dropout: float = 0.1

    @property
    def sbh(self) -> int:
        return self.seq * self.batch * self.hidden


LESSON = LayerShape()  # 5as/h = 10: the attention scores weigh about as much as a third of the rest

# Korthikanti et al.'s terms, in units of s·b·h bytes at tensor-parallel size t (module docstring)
PARTS = ("layer-norm inputs", "column-parallel inputs", "dropout masks after g", "Q, K, V", "attention scores",
         "projection input", "GELU and fc2 inputs")


def formula_parts(shape: LayerShape, tp: int = 1) -> dict[str, float]:
    """Each part's bytes over s·b·h on one of t ranks (Korthikanti et al. 2022, §4.1)."""
    scores = 5 * shape.heads * shape.seq / shape.hidden
    return {"layer-norm inputs": 4, "column-parallel inputs": 4, "dropout masks after g": 2, "Q, K, V": 6 / tp,
            "attention scores": scores / tp, "projection input": 2 / tp, "GELU and fc2 inputs": 16 / tp}


def formula_bytes(shape: LayerShape, tp: int = 1, sequence_parallel: bool = False) -> float:
    """sbh·(10 + 24/t + 5as/(ht)); with sequence parallelism sbh·(34/t + 5as/(ht)) (Korthikanti, Table 2)."""
    scores = 5 * shape.heads * shape.seq / (shape.hidden * tp)
    return shape.sbh * ((34 / tp if sequence_parallel else 10 + 24 / tp) + scores)


# ---- the layer, one rank of t --------------------------------------------------------------------------


def column_parallel(x, weight, bias, f: Callable):
    """This rank's output features: f(x)·weightᵀ + bias, weight the rank's rows (no communication forward)."""
    return f(x) @ weight.t() + bias


def row_parallel(x, weight, bias, g: Callable):
    """The whole output from this rank's input features: g(x·weightᵀ) + bias, weight the rank's columns."""
    return g(x @ weight.t()) + bias


def _identity(x):
    return x


def whole_layer(shape: LayerShape, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """The weights of one layer (nn.Linear's layout, out × in), the same from the same seed on every rank."""
    generator = torch.Generator().manual_seed(seed)
    h = shape.hidden

    def draw(*size, scale=1.0):
        return (torch.randn(*size, generator=generator, dtype=torch.float64) * scale).to(dtype)

    return {"ln1_w": 1 + draw(h, scale=0.1), "ln1_b": draw(h, scale=0.1), "qkv_w": draw(3 * h, h, scale=h ** -0.5),
            "qkv_b": draw(3 * h, scale=0.1), "proj_w": draw(h, h, scale=h ** -0.5), "proj_b": draw(h, scale=0.1),
            "ln2_w": 1 + draw(h, scale=0.1), "ln2_b": draw(h, scale=0.1), "fc1_w": draw(4 * h, h, scale=h ** -0.5),
            "fc1_b": draw(4 * h, scale=0.1), "fc2_w": draw(h, 4 * h, scale=(4 * h) ** -0.5), "fc2_b": draw(h, scale=0.1)}


def shard(weights: dict[str, torch.Tensor], shape: LayerShape, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s part of a layer split t ways (Megatron): QKV by heads (rows), fc1 by rows, the projection
    and fc2 by columns; layer norms and the row-parallel biases whole.  Leaf tensors that require grad."""
    h, heads = shape.hidden, shape.heads
    if heads % tp or h % tp:
        raise ValueError(f"tensor-parallel size {tp} must divide the {heads} heads and the width {h}")
    d = h // heads
    # QKV's rows are laid out head by head ([q | k | v] of head 0, then head 1, ...): rank r keeps its heads
    qkv_w = weights["qkv_w"].view(heads, 3 * d, h).chunk(tp)[rank].reshape(-1, h)
    qkv_b = weights["qkv_b"].view(heads, 3 * d).chunk(tp)[rank].reshape(-1)
    part = {"ln1_w": weights["ln1_w"], "ln1_b": weights["ln1_b"], "qkv_w": qkv_w, "qkv_b": qkv_b,
            "proj_w": weights["proj_w"].chunk(tp, dim=1)[rank], "proj_b": weights["proj_b"],
            "ln2_w": weights["ln2_w"], "ln2_b": weights["ln2_b"],
            "fc1_w": weights["fc1_w"].chunk(tp)[rank], "fc1_b": weights["fc1_b"].chunk(tp)[rank],
            "fc2_w": weights["fc2_w"].chunk(tp, dim=1)[rank], "fc2_b": weights["fc2_b"]}
    return {name: w.detach().clone().requires_grad_() for name, w in part.items()}


def _dropout(x, p, notes, name):
    out, mask = torch.native_dropout(x, p, True)  # a bool mask: 1 byte a value
    notes.setdefault(name, []).append(mask)
    return out


def attention_partial(h1, w, shape: LayerShape, tp: int, p: float, f: Callable = _identity, notes=None):
    """A rank's heads: f, the column-parallel QKV, softmax(Q·Kᵀ/√d), dropout, ·V, and its partial sum of the
    row-parallel projection (before g and the bias).  h1 (s, b, h): the first layer norm's output."""
    notes = {} if notes is None else notes
    s, b, _ = h1.shape
    heads, d = shape.heads // tp, shape.hidden // shape.heads
    qkv = column_parallel(h1, w["qkv_w"], w["qkv_b"], f).view(s, b, heads, 3 * d)
    q, k, v = qkv.split(d, dim=-1)
    q = q.permute(1, 2, 0, 3).reshape(b * heads, s, d)  # views of QKV's output: one storage for Q, K and V
    k = k.permute(1, 2, 3, 0).reshape(b * heads, d, s)
    v = v.permute(1, 2, 0, 3).reshape(b * heads, s, d)
    scores = torch.baddbmm(q.new_empty(b * heads, s, s), q, k, beta=0.0, alpha=1 / math.sqrt(d))  # as Megatron
    probabilities = torch.softmax(scores, dim=-1)
    dropped = _dropout(probabilities, p, notes, "attention scores")
    context = torch.bmm(dropped, v).view(b, heads, s, d).permute(2, 0, 1, 3).contiguous().view(s, b, heads * d)
    for name, tensors in (("column-parallel inputs", [h1]), ("Q, K, V", [q, k, v]),
                          ("attention scores", [probabilities, dropped]), ("projection input", [context])):
        notes.setdefault(name, []).extend(tensors)
    return context @ w["proj_w"].t()


def mlp_partial(h2, w, f: Callable = _identity, notes=None):
    """A rank's hidden units: f, the column-parallel fc1, GELU, and its partial sum of the row-parallel fc2."""
    notes = {} if notes is None else notes
    up = column_parallel(h2, w["fc1_w"], w["fc1_b"], f)
    activated = F.gelu(up)
    notes.setdefault("column-parallel inputs", []).append(h2)
    notes.setdefault("GELU and fc2 inputs", []).extend([up, activated])
    return activated @ w["fc2_w"].t()


def layer_forward(x, w: dict[str, torch.Tensor], shape: LayerShape, tp: int = 1, f: Callable = _identity,
                  g: Callable = _identity, dropout: float | None = None, notes: dict | None = None):
    """One pre-norm transformer layer on one of t ranks; x (s, b, h) is the whole residual stream, as on every
    rank; `f` and `g` are Megatron's (identities for t = 1).  `notes`, if given, collects each tensor the
    backward needs under its part's name (`PARTS`)."""
    notes = {} if notes is None else notes
    p = shape.dropout if dropout is None else dropout
    h = x.shape[-1]
    h1 = F.layer_norm(x, (h,), w["ln1_w"], w["ln1_b"])
    attention = g(attention_partial(h1, w, shape, tp, p, f, notes)) + w["proj_b"]
    middle = x + _dropout(attention, p, notes, "dropout masks after g")
    h2 = F.layer_norm(middle, (h,), w["ln2_w"], w["ln2_b"])
    mlp = g(mlp_partial(h2, w, f, notes)) + w["fc2_b"]
    notes.setdefault("layer-norm inputs", []).extend([x, middle])
    return middle + _dropout(mlp, p, notes, "dropout masks after g")


class OtherRanks:
    """g for one rank of t in one process: its partial sum plus the other ranks' partial sums, each computed from
    that rank's shards on the same input without a graph (on t processes, g's all-reduce brings them).  Called
    by `layer_forward` twice: after the attention, then after the MLP."""

    def __init__(self, others: list[dict[str, torch.Tensor]], shape: LayerShape, tp: int, dropout: float):
        self.others, self.shape, self.tp, self.dropout = others, shape, tp, dropout
        self.inputs: list[torch.Tensor] = []  # the layer norms' outputs, noted by `f` as the layer runs

    def f(self, x):
        self.inputs.append(x.detach())
        return x

    def g(self, partial):
        with torch.no_grad():
            given = self.inputs[-1]
            if len(self.inputs) == 1:
                rest = sum(attention_partial(given, w, self.shape, self.tp, self.dropout) for w in self.others)
            else:
                rest = sum(mlp_partial(given, w) for w in self.others)
        return partial + rest  # an add: nothing saved, as an all-reduce saves nothing


# ---- counting what it saves ------------------------------------------------------------------------------


class LayerCount(NamedTuple):
    """What one rank's layer kept for its backward: bytes per part (`PARTS`, and "other": the layer norms'
    means and reciprocal deviations, a value per token), their total, and whether every counted storage was
    freed when the backward ended (observed by weak references, `MemoryObserver`)."""

    tp: int
    parts: dict[str, int]
    total: int
    freed_after_backward: bool


def _input(shape: LayerShape, seed: int, dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + 1)
    return torch.randn(shape.seq, shape.batch, shape.hidden, generator=generator, dtype=torch.float64).to(dtype)


def count_saved(shape: LayerShape = LESSON, tp: int = 1, rank: int = 0, seed: int = 0, dtype=torch.bfloat16,
                f: Callable | None = None, g: Callable | None = None) -> LayerCount:
    """Run rank `rank`'s layer of t once, forward and backward, and count what autograd saved in its forward.

    Without `f` and `g` the other ranks' partial sums come from this process (`OtherRanks`); with them (a
    launch's real f and g over a process group) from the other ranks."""
    whole = whole_layer(shape, seed, dtype)
    weights = shard(whole, shape, tp, rank)
    if f is None or g is None:
        others = [shard(whole, shape, tp, q) for q in range(tp) if q != rank]
        ranks = OtherRanks(others, shape, tp, shape.dropout)
        f, g = ranks.f, ranks.g
        del ranks
    x = _input(shape, seed, dtype).requires_grad_()
    observer = MemoryObserver({0: 0}, excluded=list(weights.values()))
    counter = SavedTensors(list(weights.values()), observe=lambda t: observer.keep(0, t))
    notes: dict[str, list[torch.Tensor]] = {}
    with counter:
        out = layer_forward(x, weights, shape, tp, f, g, notes=notes)
        kept, sizes = counter.take()
    del kept, f, g  # the saved tensors themselves (only the graph holds them now), and g's copies of the inputs
    owner = {_storage_key(t): name for name, tensors in notes.items() for t in tensors}
    parts = dict.fromkeys(PARTS, 0) | {"other": 0}
    for key, size in sizes.items():
        parts[owner.get(key, "other")] += size
    del notes, owner
    out.backward(torch.ones_like(out))
    del out, x  # what the caller held: the layer's input and output
    return LayerCount(tp, parts, sum(sizes.values()), observer.still_kept == 0)


def split_difference(shape: LayerShape, tp: int, seed: int = 0) -> float:
    """The largest |difference| (float64, no dropout) between the whole layer's output and rank 0's split layer's,
    whose g adds the partial sums of the t ranks' shards: the split computes the layer."""
    whole = whole_layer(shape, seed, torch.float64)
    x = _input(shape, seed, torch.float64)
    expected = layer_forward(x, shard(whole, shape, 1, 0), shape, dropout=0.0)
    ranks = OtherRanks([shard(whole, shape, tp, q) for q in range(1, tp)], shape, tp, 0.0)
    found = layer_forward(x, shard(whole, shape, tp, 0), shape, tp, ranks.f, ranks.g, dropout=0.0)
    return float((found - expected).detach().abs().max())


def table(counts: dict[int, LayerCount], shape: LayerShape = LESSON) -> str:
    """Per part (`PARTS`), bytes over s·b·h counted on one rank beside Korthikanti's, for each t of `counts`."""
    sizes = sorted(counts)
    lines = [f"{'bytes / (s·b·h)':24}" + "".join(f"{f't = {t}: counted':>17}{'formula':>9}" for t in sizes)]
    for part in (*PARTS, "other"):
        cells = "".join(f"{counts[t].parts[part] / shape.sbh:17.2f}{formula_parts(shape, t).get(part, 0):9.2f}"
                        for t in sizes)
        lines.append(f"{part:24}{cells}")
    lines.append(f"{'the layer':24}" + "".join(f"{counts[t].total / shape.sbh:17.2f}"
                                                f"{formula_bytes(shape, t) / shape.sbh:9.2f}" for t in sizes))
    return "\n".join(lines)
