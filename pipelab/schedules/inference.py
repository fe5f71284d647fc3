"""Forward-only schedules (inference): each micro-batch goes through every stage once, and nothing is kept.

    device 0 | E0 E1 E2 E3 .  .  .
    device 1 | .  E0 E1 E2 E3 .  .          p = 4, m = 4, every action one time step
    device 2 | .  .  E0 E1 E2 E3 .
    device 3 | .  .  .  E0 E1 E2 E3

With p equal stages of time t, micro-batch i leaves the last stage at (i + p)·t: the first
micro-batch's latency is p·t whatever m (a pipeline does not make one request faster), the
step lasts (m + p − 1)·t, so the throughput is m / ((m + p − 1)·t) micro-batches per second,
approaching one every t as m grows — p times one device's 1/(p·t) (GPipe's fill-drain
arithmetic, Huang et al. 2019, §2.3, without the backward).
"""

from __future__ import annotations

from ..common.checks import check_counts
from .action import Action, Kind
from .schedule import Schedule


def inference(n_stages: int, n_microbatches: int) -> Schedule:
    """The forward-only schedule: stage s on device s runs E(s, 0), E(s, 1), ... in order."""
    check_counts(n_stages=n_stages, n_microbatches=n_microbatches)
    actions = [[Action(Kind.E, s, i) for i in range(n_microbatches)] for s in range(n_stages)]
    return Schedule(n_stages, n_microbatches, actions, name="inference")


def forward_only_like(schedule: Schedule) -> Schedule:
    """A forward-only schedule with `schedule`'s stages, micro-batches and placement (an interleaved one's
    several stages per device included): each device runs its E's by micro-batch, then stage, an order no
    device can wait on another in a cycle (every action waits only for ones earlier in that order)."""
    device_of = schedule.device_of_stage()
    rows = [[Action(Kind.E, s, i) for i in range(schedule.n_microbatches)
             for s in sorted(st for st, d in device_of.items() if d == device)]
            for device in range(schedule.n_devices)]
    return Schedule(schedule.n_stages, schedule.n_microbatches, rows, name="inference")


def generation(n_stages: int, lanes: int, rounds: int, device_of_stage: dict[int, int] | None = None) -> Schedule:
    """Greedy generation as a schedule: `rounds` new tokens for each of `lanes` groups of sequences in flight.

    Micro-batch k = r·lanes + j is lane j's round r: G(s, k) runs stage s's blocks on it with lane j's
    key/value cache; G(0, k) needs the token G(p − 1, k − lanes) chose (`KindSpec.wraps`), so a lane
    goes round the ring once per token.  Each device runs its G's by round, lane, then stage, an order in
    which every action waits only for earlier ones.  With lanes ≥ p every device has work once the ring
    is full; with one lane, p − 1 of the p devices idle at every token.  Two rounds, p = 2 with two
    lanes, then p = 3 with one:

        device 0 | G0 G1 G2 G3            device 0 | G0 .  .  G1 .  .
        device 1 | .  G0 G1 G2 G3         device 1 | .  G0 .  .  G1 .
                                          device 2 | .  .  G0 .  .  G1

    `device_of_stage` places the stages (default: stage s on device s)."""
    check_counts(n_stages=n_stages, n_microbatches=lanes * rounds)
    where = device_of_stage if device_of_stage is not None else {s: s for s in range(n_stages)}
    rows = [[Action(Kind.G, s, r * lanes + j) for r in range(rounds) for j in range(lanes)
             for s in sorted(st for st, d in where.items() if d == device)]
            for device in range(max(where.values()) + 1)]
    return Schedule(n_stages, lanes * rounds, rows, name="generation", meta={"lanes": lanes})
