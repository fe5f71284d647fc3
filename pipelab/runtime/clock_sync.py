"""A common time origin for the ranks: each rank's clock offset from rank 0, estimated by round trips.

Cristian's algorithm (F. Cristian, "Probabilistic clock synchronization", Distributed
Computing 3, 1989): rank r notes its time t1 and sends a message to rank 0, which answers
with its own time t2; the answer arrives at t3 on rank r's clock.  Rank 0 read t2
somewhere between t1 and t3, so

    offset = t2 - (t1 + t3) / 2        (rank 0's clock = rank r's clock + offset)
    |error| <= (t3 - t1) / 2           (half the round trip)

Of several rounds the one with the shortest round trip is kept.  On one machine every
process reads the same monotonic clock, so the true offset is 0 and the estimate stays
within its error bound of it (a test checks that); across machines this removes the
clocks' different origins, and the error is half a round trip (tens of microseconds on
a local network, a few on loopback).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def estimate_offset(group, rank: int, world_size: int, device: torch.device, rounds: int = 16) -> tuple[float, float]:
    """(offset, error bound) in seconds of this rank's `perf_counter` against rank 0's (0, 0 on rank 0)."""
    message = torch.zeros(1, dtype=torch.float64, device=device)
    if rank == 0:
        for other in range(1, world_size):
            for _ in range(rounds):
                dist.recv(message, group=group, group_src=other)
                message.fill_(time.perf_counter())
                dist.send(message, group=group, group_dst=other)
        return 0.0, 0.0
    best = (float("inf"), 0.0)
    for _ in range(rounds):
        t1 = time.perf_counter()
        dist.send(message, group=group, group_dst=0)
        dist.recv(message, group=group, group_src=0)
        t3 = time.perf_counter()
        round_trip, t2 = t3 - t1, float(message.item())
        if round_trip < best[0]:
            best = (round_trip, t2 - (t1 + t3) / 2)
    return best[1], best[0] / 2
