"""The closed forms of FSDP's communication inside a pipeline stage (shard="fsdp"), per rank and step.

ZeRO-3 (Rajbhandari et al. 2020, §5.3 and §7.2.2; FSDP2 is its PyTorch form): a block whose
parameters hold P bytes, sharded over d replicas, keeps P/d on each rank (each parameter's
first dimension padded to a multiple of d); the block is all-gathered before it computes and
its gradient reduce-scattered.  In a pipeline stage with m micro-batches, per block and step:

    all-gathers      1          reshard_after_forward=False (gathered at the first forward, kept
                                until the step's reduce-scatter)
                     k · m      True: once per action that computes with the block, k = 2 (F, B),
                                3 with a split backward (F, I, W), 2 on the first stage of a split
                                backward (its input needs no gradient: I computes nothing)
    reduce-scatters  1          (pipelab accumulates the m micro-batches' full gradients first)

Bytes: an all-gather is given the rank's shard, P/d (what `runtime/comm_count.py` records) and
receives the other ranks' shards, P·(d−1)/d; a reduce-scatter is given the full gradient, P,
and sends P·(d−1)/d of it.
"""

from __future__ import annotations

from torch import nn


def sharded_bytes(block: nn.Module, d: int) -> int:
    """P/d: the bytes of `block`'s parameters one of d ranks holds, each parameter's first dimension padded to a
    multiple of d (FSDP2's `Shard(0)`)."""
    total = 0
    for p in block.parameters():
        rows = p.shape[0] if p.dim() else 1
        total += -(-rows // d) * (p.numel() // max(rows, 1)) * p.element_size()
    return total


def fsdp_communication(blocks: list[nn.Module], d: int, n_microbatches: int, reshard_after_forward: bool,
                       computing_actions: int = 2) -> dict[str, dict[str, int]]:
    """{"fsdp_gather", "fsdp_reduce_scatter": {"messages", "bytes" (given to the calls), "wire_bytes"}} of one
    rank in one step, for the stage's `blocks` with parameters (module docstring); `computing_actions` is k."""
    blocks = [b for b in blocks if any(True for _ in b.parameters())]
    gathers = computing_actions * n_microbatches if reshard_after_forward else 1
    shards = sum(sharded_bytes(b, d) for b in blocks)
    return {"fsdp_gather": {"messages": gathers * len(blocks), "bytes": gathers * shards,
                            "wire_bytes": gathers * shards * (d - 1)},
            "fsdp_reduce_scatter": {"messages": len(blocks), "bytes": d * shards, "wire_bytes": shards * (d - 1)}}
