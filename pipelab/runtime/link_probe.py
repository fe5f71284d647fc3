"""The link between two ranks, measured: its latency and bandwidth, for pricing messages (`Costs`).

    latency   = (round trip of a 1-element message) / 2
    bandwidth = N / (round trip of an N-byte message answered by a 1-element one - that round trip)

each round trip the best of `repeats` tries (other work only ever adds time), after one untimed
exchange of each (the first message on a pair sets up its connection's buffers).  Ranks 0 and 1 of the group
exchange; every rank of the group calls it (the others only take part in the closing broadcast, so
every rank returns the same numbers).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

PROBE_BYTES = 1 << 20


def measure_link(group, device: torch.device, nbytes: int = PROBE_BYTES, repeats: int = 5) -> tuple[float, float]:
    """(latency seconds, bandwidth bytes/second) between ranks 0 and 1 of `group` (module docstring)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    found = torch.zeros(2, dtype=torch.float64, device=device)
    if size > 1 and rank < 2:
        small = torch.zeros(1, device=device)
        large = torch.zeros(max(nbytes // 4, 1), device=device)
        trips = {"small": [], "large": []}
        for _ in range(repeats + 1):
            for name, message in (("small", small), ("large", large)):
                begin = time.perf_counter()
                if rank == 0:
                    dist.send(message, group_dst=1, group=group)
                    dist.recv(small, group_src=1, group=group)
                else:
                    dist.recv(message, group_src=0, group=group)
                    dist.send(small, group_dst=0, group=group)
                trips[name].append(time.perf_counter() - begin)
        small_trip, large_trip = min(trips["small"][1:]), min(trips["large"][1:])
        latency, spent = small_trip / 2, large_trip - small_trip
        found = torch.tensor([latency, large.numel() * 4 / spent if spent > 0 else math.inf], dtype=torch.float64,
                             device=device)
    dist.broadcast(found, group_src=0, group=group)
    latency, bandwidth = found.tolist()
    return latency, bandwidth
