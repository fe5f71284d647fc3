"""Task 5.1: interleaved 1F1B, v model chunks per device, as a table of actions (lesson 11)."""

from __future__ import annotations


def interleaved_1f1b_schedule(n_devices: int, n_microbatches: int,
                              n_chunks: int) -> list[list[tuple[str, int, int]]]:
    """Interleaved 1F1B (Narayanan et al., SC21, §2.2.2; Megatron-LM's order).

    The model is cut into p·v stages (p = ``n_devices``, v = ``n_chunks``); stage k runs on
    device k mod p, so device d holds the chunks d, d + p, d + 2p, ...  Row d of the result
    is device d's ordered list of actions ``(kind, stage, microbatch)``, each a tuple of a
    ``str`` and two ``int`` (Task 2.1's format, not lists); the table is a list of lists,
    new at each call (the caller may change it).  Device d walks its m·v
    chunk-micro-batches (m = ``n_microbatches``) in rounds of p micro-batches:

    - forward number k (k = 0 .. m·v - 1) is micro-batch (k // (p·v))·p + k mod p through
      chunk c = (k mod (p·v)) // p, that is stage c·p + d;
    - backward number k is the same micro-batch through chunk v - 1 - c (backwards go
      through the chunks in reverse);
    - warm-up: the first w_d = min(2 (p - d - 1) + (v - 1) p, m v) forwards (v = 1: plain
      1F1B's w_d = min(p - d - 1, m)); then pairs "forward number w_d + k, backward number
      k"; then the remaining backwards.

    With each chunk costing 1/v of a stage, the bubble is (p - 1)/(v m) of the ideal
    time.  p=2, m=4, v=2, every action one time step (cell 2F0 on row 0 is stage 2):

        device 0 | F0  F1  2F0 2F1 F2  2B0 F3  2B1 2F2 B0  2F3 B1  .   2B2 .   2B3 B2  B3
        device 1 | .   F0  F1  3F0 3B0 3F1 3B1 F2  B0  F3  B1  3F2 3B2 3F3 3B3 B2  B3  .

    Raises:
        ValueError: if a count is below 1 (zero or negative), or ``n_microbatches`` is
            not a multiple of ``n_devices``, whatever ``n_chunks`` (v = 1 included; say
            which multiples would work).
    """
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
        backwards = [("B", (v - 1 - chunk(k)) * p + d, microbatch(k)) for k in range(total)]
        row = forwards[:warmup]
        for k in range(total - warmup):
            row += [forwards[warmup + k], backwards[k]]
        table.append(row + backwards[total - warmup:])
    return table
