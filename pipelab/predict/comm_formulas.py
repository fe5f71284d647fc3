"""The closed forms of a hybrid step's communication, per rank and kind, for pl.models' models.

For one rank at pipeline stage s of a layout (d, p, t), with micro-batches of b_i samples
and E_in, E_out the elements per sample entering and leaving stage s, in elements per step:
"pp" sends Σ_i b_i·E_out/t forward if s < p−1 and Σ_i b_i·E_in/t back if s > 0 (Narayanan et
al. 2021 §4.1: each TP rank sends 1/t); "pp_gather" all-gathers each received message; "tp"
is 2 all-reduces forward and 2 backward of b_i·s·h per transformer layer and micro-batch
(Shoeybi et al. 2019 §3); "dp" is one all-reduce of Ψ_rank, the parameter elements this rank
holds (ZeRO, Rajbhandari et al. 2020 §7.1).

Every term, the MLP's pairs and "pp_received": docs/hybrid.md, "The closed forms".
"""

from __future__ import annotations

from torch import nn

from ..model import microbatch, tp_plans
from ..model.models import Embedding, TransformerBlock
from .layout import Layout

STEP_KINDS = ("pp", "pp_gather", "tp", "dp")  # what a step moves (receives mirror "pp"); lesson 08, the benchmark
SHARDED_IN_TRANSFORMER = ("qkv.weight", "qkv.bias", "proj.weight", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight")


def _linear(block: nn.Module) -> nn.Linear:
    return block if isinstance(block, nn.Linear) else block[0]


def _boundary_elements(model: nn.Sequential, boundary: int) -> int:
    """Elements per sample that cross the boundary before block `boundary`."""
    if isinstance(model[0], Embedding):
        return model[0].position.num_embeddings * model[0].token.embedding_dim
    return _linear(model[boundary - 1]).out_features


def _pair_list(plans: list, blocks: list[nn.Module]) -> list[tuple[int, int]]:
    """The (column-parallel, row-parallel) block pairs `tp_plans.default_plans` forms in a stage."""
    pairs, k = [], 0
    while k < len(blocks):
        if not isinstance(blocks[k], TransformerBlock) and plans[k] is not None:
            pairs.append((k, k + 1))
            k += 2
        else:
            k += 1
    return pairs


def _rank_parameters(blocks: list[nn.Module], t: int) -> int:
    """Ψ_rank: the stage's parameter elements, the Megatron-sharded ones divided by t (a column-parallel
    Linear's weight and bias, a row-parallel one's weight; its bias is replicated)."""
    pairs = _pair_list(tp_plans.default_plans(blocks), blocks) if t > 1 else []
    column, row = {a for a, _ in pairs}, {z for _, z in pairs}
    total = 0
    for k, block in enumerate(blocks):
        for name, p in block.named_parameters():
            if isinstance(block, TransformerBlock):
                sharded = t > 1 and name in SHARDED_IN_TRANSFORMER
            else:
                sharded = k in column or (k in row and name.endswith("weight"))
            total += p.numel() // t if sharded else p.numel()
    return total


def expected_communication(model: nn.Sequential, layout: Layout, rank: int, batch_size: int, n_microbatches: int,
                           bounds: list[tuple[int, int]]) -> dict[str, dict[str, int]]:
    """{kind: {"messages", "elements"}} for `rank`'s step (module docstring), for an `mlp` or a `tiny_gpt`."""
    r, s, _ = layout.coordinates(rank)
    d, p, t = layout.shape
    share = microbatch.sizes(batch_size, d)[r]
    b = microbatch.sizes(share, n_microbatches)
    first, last = bounds[s]
    blocks = list(model[first:last])
    e_in = _boundary_elements(model, first) if s > 0 else 0
    e_out = _boundary_elements(model, last) if s < p - 1 else 0
    found = {kind: {"messages": 0, "elements": 0} for kind in ("pp", "pp_received", "pp_gather", "tp", "dp")}

    def add(kind: str, per_sample: int) -> None:
        if per_sample:
            found[kind]["messages"] += n_microbatches
            found[kind]["elements"] += sum(b) * per_sample

    add("pp", e_out // t)
    add("pp", e_in // t)
    add("pp_received", e_in // t)
    add("pp_received", e_out // t)
    if t > 1:
        add("pp_gather", e_in // t)
        add("pp_gather", e_out // t)
        for block in blocks:
            if isinstance(block, TransformerBlock):
                width = block.proj.out_features * model[0].position.num_embeddings
                for _ in range(4):  # 2 forward, 2 backward
                    add("tp", width)
        for a, z in _pair_list(tp_plans.default_plans(blocks), blocks):
            add("tp", _linear(blocks[z]).out_features)  # forward, after the row-parallel Linear
            if not (s == 0 and a == 0):
                add("tp", _linear(blocks[a]).in_features)  # backward, the column-parallel input's gradient
    if d > 1:
        found["dp"] = {"messages": 1, "elements": _rank_parameters(blocks, t)}
    return found


def step_bytes(counts_per_rank: list[dict], model: nn.Sequential, layout: Layout, batch_size: int,
               n_microbatches: int, bounds: list[tuple[int, int]]) -> tuple[dict[str, int], dict[str, int]]:
    """(counted, formula): bytes of one step per kind of STEP_KINDS, summed over the ranks.

    `counts_per_rank[r]` is rank r's `CommunicationCounter.totals()`; the formula is
    `expected_communication`'s elements times the bytes of the model's dtype (4 for float32)."""
    size = next(model.parameters()).element_size()
    counted = {k: sum(counts[k]["bytes"] for counts in counts_per_rank) for k in STEP_KINDS}
    formula = {k: 0 for k in STEP_KINDS}
    for rank in range(layout.world_size):
        expected = expected_communication(model, layout, rank, batch_size, n_microbatches, bounds)
        formula = {k: formula[k] + size * expected[k]["elements"] for k in STEP_KINDS}
    return counted, formula
