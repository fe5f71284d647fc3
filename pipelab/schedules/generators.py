"""The classic schedule generators — GPipe, 1F1B, asynchronous PipeDream — and `by_name`.

A schedule is data (`schedule.Schedule`): a generator only builds the table; `validate`
checks it (`validate.py`), the simulator and the engines run it.
"""

from __future__ import annotations

from ..common.checks import check_counts
from .action import Action, Kind
from .beyond import zero_bubble_h1
from .pipedream import check_update_every
from .schedule import Schedule


def gpipe(n_stages: int, n_microbatches: int) -> Schedule:
    """GPipe (fill-drain): every forward, then every backward (Huang et al. 2019, §2.3).

    Each stage keeps the activations of all m micro-batches until its backwards start, so
    peak in-flight micro-batches = m on every stage.  With uniform costs the idle share
    of the step is (p-1)/(m+p-1).  p=4, m=8, every action one time step:

        device 0 | F0 F1 F2 F3 F4 F5 F6 F7 .  .  .  .  .  .  B0 B1 B2 B3 B4 B5 B6 B7
        device 1 | .  F0 F1 F2 F3 F4 F5 F6 F7 .  .  .  .  B0 B1 B2 B3 B4 B5 B6 B7 .
        device 2 | .  .  F0 F1 F2 F3 F4 F5 F6 F7 .  .  B0 B1 B2 B3 B4 B5 B6 B7 .  .
        device 3 | .  .  .  F0 F1 F2 F3 F4 F5 F6 F7 B0 B1 B2 B3 B4 B5 B6 B7 .  .  .
    """
    check_counts(n_stages=n_stages, n_microbatches=n_microbatches)
    actions = [
        [Action(Kind.F, s, i) for i in range(n_microbatches)] + [Action(Kind.B, s, i) for i in range(n_microbatches)]
        for s in range(n_stages)
    ]
    return Schedule(n_stages, n_microbatches, actions, name="gpipe")


def one_f_one_b(n_stages: int, n_microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush; Narayanan et al. 2021, PipeDream-2BW §3.2): warm-up, steady state, cool-down.

    Stage s first runs w = min(p - s - 1, m) forwards (warm-up), then alternates one
    forward and one backward (steady state), then runs the remaining backwards
    (cool-down).  A micro-batch's activations are freed at its backward, so stage s
    never holds more than min(p - s, m) micro-batches (DeepSpeed's `num_pipe_buffers`).
    Same bubble as GPipe, (p-1)/(m+p-1), with far less memory.  p=4, m=8, one step each:

        device 0 | F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7
        device 1 | .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .
        device 2 | .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 .  .
        device 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  .
    """
    check_counts(n_stages=n_stages, n_microbatches=n_microbatches)
    warmups = [min(n_stages - s - 1, n_microbatches) for s in range(n_stages)]
    return Schedule(n_stages, n_microbatches, _one_f_one_b_rows(n_microbatches, warmups), name="1f1b")


def _one_f_one_b_rows(n_microbatches: int, warmups: list[int]) -> list[list[Action]]:
    """Stage s's 1F1B list for each s: warmups[s] forwards, then one forward and one backward
    in turn (steady state), then the remaining backwards (cool-down)."""
    actions = []
    for s, warmup in enumerate(warmups):
        row = [Action(Kind.F, s, i) for i in range(warmup)]
        for i in range(n_microbatches - warmup):  # steady state: one forward, one backward
            row += [Action(Kind.F, s, warmup + i), Action(Kind.B, s, i)]
        row += [Action(Kind.B, s, i) for i in range(n_microbatches - warmup, n_microbatches)]  # cool-down
        actions.append(row)
    return actions


def pipedream_async(n_stages: int, n_microbatches: int, update_every: int = 1) -> Schedule:
    """Asynchronous PipeDream with weight stashing (Narayanan et al., SOSP 2019, §3.3): no flush.

    The whole training run is one schedule: each of the m micro-batches is one of
    PipeDream's minibatches, and the table is 1F1B's order (stage s admits p - s before
    its first backward, then alternates: "1F1B-RR" with one worker per stage), so the
    warm-up and the drain happen once per run, not once per optimizer step.  The weights
    move while micro-batches are in flight, under this exact rule per stage s:

    - stage s's weights start at version 0; after every `update_every`-th B in its list
      it applies one optimizer step to its live weights with the gradients of those
      backwards (summed), and the version goes up by one;
    - F(s, i) runs with the live version at that moment (the number of updates earlier
      in stage s's list) and stashes it;
    - B(s, i) computes its gradients with the version F(s, i) stashed (weight stashing),
      and they update the live weights;
    - stages do not agree on versions: micro-batch i may see version 3 on stage 0 and 5 on
      stage 2 (PipeDream's optional "vertical sync" is not modelled).

    `pl.pipedream.weight_versions` gives each action's version; a stage keeps p - s
    versions at once in the steady state (update_every = 1).  The schedule says
    `asynchronous=True` and its `update_every`.  p=4, m=8 (1F1B's table; stage 0 runs
    F0..F3 with version 0, then F4 with version 1, F5 with 2, ...):

        device 0 | F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7
        device 1 | .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .
        device 2 | .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 .  .
        device 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  .
    """
    check_update_every(update_every)
    table = one_f_one_b(n_stages, n_microbatches)
    return Schedule(n_stages, n_microbatches, table.actions, name="pipedream-async", asynchronous=True,
                    update_every=update_every)


GENERATORS = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zero_bubble_h1, "pipedream-async": pipedream_async}
"""The schedules `by_name` builds from (n_stages, n_microbatches) alone (interleaved 1F1B needs a
chunk count: call `interleaved_1f1b`)."""


def by_name(name: str, n_stages: int, n_microbatches: int) -> Schedule:
    """Build the schedule called `name` ("gpipe", "1f1b", "zb-h1", "pipedream-async")."""
    if not isinstance(name, str):
        raise TypeError(f"a schedule name must be a string like 'gpipe' or '1f1b', got {type(name).__name__}")
    key = name.lower().replace("-", "").replace("_", "")
    aliases = {"gpipe": "gpipe", "1f1b": "1f1b", "onefoneb": "1f1b", "pipedreamflush": "1f1b",
               "zbh1": "zb-h1", "zerobubbleh1": "zb-h1", "pipedreamasync": "pipedream-async",
               "pipedream": "pipedream-async"}
    if key not in aliases:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(GENERATORS)} "
                         "(interleaved 1F1B: pl.schedules.interleaved_1f1b(p, m, n_chunks))")
    return GENERATORS[aliases[key]](n_stages, n_microbatches)
