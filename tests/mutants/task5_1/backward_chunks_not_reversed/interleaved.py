"""Mutant of Task 5.1: backwards walk the chunks in forward order (chunk c instead of v - 1 - c):
the first backward waits for a gradient that comes last.
"""

from __future__ import annotations


def interleaved_1f1b_schedule(n_devices: int, n_microbatches: int,
                              n_chunks: int) -> list[list[tuple[str, int, int]]]:
    p, m, v = n_devices, n_microbatches, n_chunks
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"counts must be at least 1, got n_devices={p}, n_microbatches={m}, n_chunks={v}")
    if m % p:
        raise ValueError(f"n_microbatches={m} is not a multiple of n_devices={p}; use {(m // p + 1) * p}"
                         + (f" or {(m // p) * p}" if m > p else ""))
    total = m * v

    def microbatch(k):
        return (k // (p * v)) * p + k % p

    def chunk(k):
        return (k % (p * v)) // p

    table = []
    for d in range(p):
        warmup = min(p - d - 1 if v == 1 else 2 * (p - d - 1) + (v - 1) * p, total)
        forwards = [("F", chunk(k) * p + d, microbatch(k)) for k in range(total)]
        backwards = [("B", chunk(k) * p + d, microbatch(k)) for k in range(total)]
        row = forwards[:warmup]
        for k in range(total - warmup):
            row += [forwards[warmup + k], backwards[k]]
        table.append(row + backwards[total - warmup:])
    return table
