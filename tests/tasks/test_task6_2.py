"""Task 6.2: forward_only (the inference schedule) and latency_and_throughput (from a trace).

References for the table: the docstring's drawing of p=4, m=8 (printed by pipelab's
``Schedule.to_text()``, every action one time step), small tables written out here, and
pipelab's own ``pl.schedules.inference(p, m)``, as (str, int, int) tuples, for p <= 6,
m <= 12; the learner's table, run by ``pl.simulate``, must run as pipelab's does on equal and
unequal stages.  References for the measurements: GPipe §2.3's fill-drain arithmetic without
the backward, for p equal stages of time t on traces written out here (every latency p·t,
a makespan of (m + p - 1)·t); and the simulator's traces (``pl.simulate``: unequal
``pl.Costs(forward=[...])``, slow links, a training step's F and B, a step that starts
late), whose ``Trace.latencies`` and ``Trace.throughput`` are the answer, also over random
costs (a property test).  And what ``==`` does not see: each action a tuple, a new table
at each call, floats from int times, the events unchanged and the same as a list or a tuple,
ValueError for every count below 1 and for a trace that does not fit its micro-batches.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import pipelab as pl
from contract import assert_type, call_with_lists_then_tuples
from schedule_tables import assert_new_table_at_each_call, assert_rows_of_tuples, rows_of

pytestmark = pytest.mark.task6_2

GRID = [(p, m) for p in range(1, 7) for m in range(1, 13)]
TABLE = "device s runs E(s, 0), E(s, 1), ..., E(s, m - 1): stage s, every micro-batch, in order"
LATENCY = "latency_i = max(end) - min(start) over the events of micro-batch i"
THROUGHPUT = "throughput = m / makespan, makespan = max(end) - min(start) over all events"
TYPES = "returns (latencies, throughput): a tuple of a list of m float and a float"

P4_M8 = """
device 0 | E0 E1 E2 E3 E4 E5 E6 E7 .  .  .
device 1 | .  E0 E1 E2 E3 E4 E5 E6 E7 .  .
device 2 | .  .  E0 E1 E2 E3 E4 E5 E6 E7 .
device 3 | .  .  .  E0 E1 E2 E3 E4 E5 E6 E7
"""


# ---- the references: pipelab's schedule and simulator, and GPipe's arithmetic ----------


def schedule(impl, *args):
    return impl("forward_only").forward_only(*args)


def pipelab_table(p, m) -> list[list[tuple[str, int, int]]]:
    """``pl.schedules.inference(p, m)`` as the task's tuples."""
    return [[(a.kind.value, a.stage, a.microbatch) for a in row] for row in pl.schedules.inference(p, m).actions]


def as_schedule(table, p, m) -> pl.Schedule:
    """A table of (kind, stage, microbatch) as pipelab's Schedule ("2E3" is E(2, 3))."""
    return pl.Schedule(p, m, [[pl.Action.from_str(f"{s}{kind}{i}") for kind, s, i in row] for row in table])


def events_of(trace: pl.Trace) -> list[tuple[str, int, int, float, float]]:
    """A trace's events as (kind, stage, microbatch, start, end), shuffled (any order is allowed)."""
    events = [(e.kind.value, e.stage, e.microbatch, e.start, e.end) for e in trace.events]
    random.Random(len(events)).shuffle(events)
    return events


def equal_stage_events(p, m, t, offset=0.0):
    """GPipe §2.3 without the backward, written out: E(s, i) runs from offset + (s + i)·t to offset + (s + i + 1)·t."""
    events = [("E", s, i, offset + (s + i) * t, offset + (s + i + 1) * t) for s in range(p) for i in range(m)]
    random.Random(p * 100 + m).shuffle(events)
    return events


def hints(what, value, expected, events, m) -> str:
    """Which common mistake ``value`` (the latencies, or [the throughput]) matches, when it is
    not ``expected`` ('' when none)."""
    of = [[e for e in events if e[2] == i] for i in range(m)]
    step_start, step_end = min(e[3] for e in events), max(e[4] for e in events)
    busy = sum(e[4] - e[3] for e in events)
    candidates = {
        "latencies": [
            ([max(e[4] for e in mb) - step_start for mb in of],
             "each latency was measured from the step's start: measure it from micro-batch i's own first start"),
            ([sum(e[4] - e[3] for e in mb) for mb in of],
             ("each latency is the sum of its actions' durations: the waits between them count too "
              "(from its first start to its last end)")),
        ],
        "throughput": [
            ([m / busy] if busy else [],
             "the throughput divides by the time spent computing (sum of durations): divide by the makespan"),
            ([m / step_end] if step_end else [],
             "the makespan was measured from 0: it is max(end) - min(start), from the step's first start"),
        ],
    }[what]

    def same(a, b):
        return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-9) for x, y in zip(a, b))

    found = [hint for wrong, hint in candidates if same(value, wrong) and not same(wrong, expected)]
    return ("\n" + "\nor: ".join(found)) if found else ""


def measure(impl, events, m):
    """The learner's answer for ``events``, checked for its types, to leave the events as they
    were, and to be the same for the events as a tuple."""
    call = f"latency_and_throughput({events!r}, {m})" if len(events) <= 8 else (
        f"latency_and_throughput(<{len(events)} events>, {m})")
    events = list(events)

    def check(got):
        assert_type(got, tuple, TYPES, f"{call}'s result")
        assert len(got) == 2, f"{TYPES}\n{call} returned {got!r}"
        latencies, throughput = got
        assert_type(latencies, list, TYPES, f"{call}: the latencies")
        assert len(latencies) == m, f"{TYPES}\n{call} returned {len(latencies)} latencies for m={m}"
        for i, value in enumerate(latencies):
            assert_type(value, float, TYPES, f"{call}: latency {i}")
        assert_type(throughput, float, TYPES, f"{call}: the throughput")

    return call_with_lists_then_tuples(
        lambda es: impl("forward_only").latency_and_throughput(es, m), (events,), (tuple(events),),
        watched=events, what="events", call=call, check=check,
        differs=lambda got, again: f"events may be a list or a tuple\n{call} returned {got!r}, for a tuple {again!r}",
    )


def assert_measures(impl, events, m, latencies, throughput, what):
    got = measure(impl, events, m)
    assert all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) for a, b in zip(got[0], latencies)), (
        f"{LATENCY}\n{what}: got the latencies {got[0]}, expected {latencies}"
        + hints("latencies", got[0], latencies, events, m))
    assert math.isclose(got[1], throughput, rel_tol=1e-9), (
        f"{THROUGHPUT}\n{what}: got the throughput {got[1]!r}, expected {throughput!r}"
        + hints("throughput", [got[1]], [throughput], events, m))


# ---- forward_only: the table ------------------------------------------------------------


def test_four_stages_eight_microbatches_as_drawn(impl):
    table = schedule(impl, 4, 8)
    assert_rows_of_tuples(table, 4, "forward_only", "forward_only(4, 8)")
    try:
        drawn = as_schedule(table, 4, 8).to_text()
    except pl.ScheduleError as error:
        pytest.fail(f"{TABLE}\nforward_only(4, 8) returned\n  {table}\nwhich pipelab cannot run: {error}", pytrace=False)
    assert drawn.split() == P4_M8.split(), (
        f"{TABLE}\nforward_only(4, 8), every action one time step, runs as\n{drawn}\nexpected\n{P4_M8.strip()}")


SMALL_TABLES = {
    (1, 1): "device 0 | E0",
    (1, 3): "device 0 | E0 E1 E2",
    (3, 1): """
        device 0 | E0
        device 1 | E0
        device 2 | E0
    """,
    (2, 4): """
        device 0 | E0 E1 E2 E3
        device 1 | E0 E1 E2 E3
    """,
}


@pytest.mark.parametrize(("p", "m"), list(SMALL_TABLES), ids=str)
def test_small_tables_written_out(impl, p, m):
    expected = rows_of(SMALL_TABLES[(p, m)])
    table = schedule(impl, p, m)
    assert table == expected, f"{TABLE}\nforward_only({p}, {m}) returned\n  {table}\nexpected\n  {expected}"


def test_the_table_is_pipelabs_inference(impl):
    for p, m in GRID:
        table = schedule(impl, p, m)
        expected = pipelab_table(p, m)
        assert table == expected, (
            f"{TABLE}\nforward_only({p}, {m}) returned\n  {table}\npl.schedules.inference({p}, {m}) is\n  {expected}")


@pytest.mark.parametrize("forward", [1.0, 0.5, [1.0, 3.0, 2.0], [2.0, 1.0, 1.0, 4.0]], ids=str)
def test_your_table_runs_as_pipelabs(impl, forward):
    """Simulated on pipelab's cost model, the table takes as long, and holds each micro-batch as
    long, as pl.schedules.inference; with equal stages, (m + p - 1)·t and p·t (GPipe §2.3)."""
    for m in (1, 3, 8):
        p = len(forward) if isinstance(forward, list) else 4
        costs = pl.Costs(forward=forward)
        yours = pl.simulate(as_schedule(schedule(impl, p, m), p, m), costs)
        reference = pl.simulate(pl.schedules.inference(p, m), costs)
        assert yours.makespan == pytest.approx(reference.makespan) and yours.latencies == pytest.approx(
            reference.latencies), (
            f"{TABLE}\nforward_only({p}, {m}) on stages of {forward} s: makespan {yours.makespan:g}, latencies "
            f"{yours.latencies}; pl.schedules.inference: {reference.makespan:g}, {reference.latencies}")
        if not isinstance(forward, list):
            assert yours.makespan == pytest.approx((m + p - 1) * forward), (
                f"{TABLE}\nwith equal stages of t = {forward} s the step lasts (m + p - 1)·t (GPipe §2.3)")
            assert yours.latencies == pytest.approx([p * forward] * m)


def test_actions_are_tuples_of_a_str_and_two_ints(impl):
    for p, m in [(1, 1), (2, 3), (4, 8), (5, 2)]:
        assert_rows_of_tuples(schedule(impl, p, m), p, "forward_only", f"forward_only({p}, {m})")


def test_a_new_table_at_each_call(impl):
    assert_new_table_at_each_call(lambda p, m: schedule(impl, p, m), "forward_only", (3, 4))
    assert_new_table_at_each_call(lambda p, m: schedule(impl, p, m), "forward_only", (2, 1))


@pytest.mark.parametrize("counts", [(0, 4), (-1, 4), (4, 0), (4, -1), (1, -5), (0, 0), (-2, -2)],
                         ids=lambda counts: "p={},m={}".format(*counts))
def test_every_count_below_1_is_refused(impl, counts):
    with pytest.raises(ValueError):
        table = schedule(impl, *counts)
        pytest.fail(f"forward_only raises ValueError if n_stages < 1 or n_microbatches < 1 (zero or negative)\n"
                    f"forward_only{counts} returned {table}")


# ---- latency_and_throughput: measured from a trace ----------------------------------------


def test_docstring_example(impl):
    trace = [("E", 0, 0, 0.0, 1.0), ("E", 1, 0, 1.0, 2.0), ("E", 0, 1, 1.0, 2.0), ("E", 1, 1, 2.0, 3.0)]
    assert_measures(impl, trace, 2, [2.0, 2.0], 2 / 3, "the docstring's trace: 2 micro-batches in 3 s")


@pytest.mark.parametrize(("p", "m", "t"), [(4, 8, 1.0), (2, 3, 0.5), (3, 1, 2.0), (1, 4, 1.5), (6, 12, 0.25)])
def test_equal_stages_give_gpipes_closed_forms(impl, p, m, t):
    """Latency p·t for every micro-batch, whatever m; throughput m / ((m + p - 1)·t) (GPipe §2.3)."""
    assert_measures(impl, equal_stage_events(p, m, t), m, [p * t] * m, m / ((m + p - 1) * t),
                    f"p={p} equal stages of t={t} s, m={m}: every latency p·t, throughput m / ((m + p - 1)·t)")


SIMULATED = {  # name: (schedule, costs)
    "unequal stages [1, 3, 2], m=5": (pl.schedules.inference(3, 5), pl.Costs(forward=[1.0, 3.0, 2.0])),
    "unequal stages [2, 1, 1, 4], m=8": (pl.schedules.inference(4, 8), pl.Costs(forward=[2.0, 1.0, 1.0, 4.0])),
    "a slow first stage [3, 1], m=4": (pl.schedules.inference(2, 4), pl.Costs(forward=[3.0, 1.0])),
    "links of 0.5 s, m=4": (pl.schedules.inference(3, 4), pl.Costs(forward=1.0, latency=0.5)),
    "unequal stages and links of 0.25 s": (pl.schedules.inference(3, 6), pl.Costs(forward=[1.0, 2.0, 0.5],
                                                                                      latency=0.25)),
}


@pytest.mark.parametrize("case", list(SIMULATED))
def test_the_simulators_traces(impl, case):
    """On unequal stages the slowest sets the pace and later micro-batches queue in front of it;
    over slow links each hop adds its latency: Trace.latencies and Trace.throughput say how much."""
    inference, costs = SIMULATED[case]
    trace = pl.simulate(inference, costs)
    assert_measures(impl, events_of(trace), trace.n_microbatches, trace.latencies, trace.throughput,
                    f"pl.simulate(pl.schedules.inference({trace.n_stages}, {trace.n_microbatches}), {case})")


@pytest.mark.parametrize("name", ["gpipe", "one_f_one_b"])
def test_a_training_step_counts_every_kind(impl, name):
    """F and B count alike: a micro-batch is in the pipeline from its first forward to its last backward."""
    trace = pl.simulate(getattr(pl.schedules, name)(3, 5), pl.Costs(forward=[1.0, 2.0, 1.0], backward=2.0))
    assert_measures(impl, events_of(trace), 5, trace.latencies, trace.throughput,
                    f"a {name} training step (F and B), p=3, m=5, simulated")


def test_a_step_that_starts_late(impl):
    """Timestamps from a real clock rarely start at 0: the step begins at its first start."""
    p, m, t = 4, 8, 1.0
    assert_measures(impl, equal_stage_events(p, m, t, offset=100.0), m, [p * t] * m, m / ((m + p - 1) * t),
                    "p=4 equal stages of 1 s, m=8, the step starting at t=100 s: the same as from 0")


def test_int_times_give_floats(impl):
    trace = [("E", 0, 0, 0, 2), ("E", 1, 0, 2, 3), ("E", 0, 1, 2, 4), ("E", 1, 1, 4, 5)]
    got = measure(impl, trace, 2)  # checks the types
    assert got == ([3.0, 3.0], 0.4), f"{LATENCY}; {THROUGHPUT}\nlatency_and_throughput({trace}, 2) returned {got!r}"


BAD_TRACES = {  # name: (events, n_microbatches)
    "n_microbatches=0": ([("E", 0, 0, 0.0, 1.0)], 0),
    "n_microbatches=-1": ([("E", 0, 0, 0.0, 1.0)], -1),
    "no event at all": ([], 2),
    "micro-batch 1 has no event": ([("E", 0, 0, 0.0, 1.0), ("E", 0, 2, 1.0, 2.0)], 3),
    "the last micro-batch has no event": ([("E", 0, 0, 0.0, 1.0), ("E", 1, 0, 1.0, 2.0)], 2),
    "a micro-batch of m": ([("E", 0, 0, 0.0, 1.0), ("E", 0, 1, 1.0, 2.0)], 1),
    "a negative micro-batch": ([("E", 0, 0, 0.0, 1.0), ("E", 0, -1, 1.0, 2.0)], 1),
    "an event that ends before it starts": ([("E", 0, 0, 0.0, 1.0), ("E", 1, 0, 2.0, 1.5)], 1),
    "a makespan of 0": ([("E", 0, 0, 1.0, 1.0), ("E", 1, 0, 1.0, 1.0)], 1),
}


@pytest.mark.parametrize("case", list(BAD_TRACES))
def test_a_trace_that_does_not_fit_is_refused(impl, case):
    events, m = BAD_TRACES[case]
    with pytest.raises(ValueError):
        got = impl("forward_only").latency_and_throughput(events, m)
        pytest.fail(f"latency_and_throughput raises ValueError for a trace that does not fit its micro-batches "
                    f"({case})\nlatency_and_throughput({events}, {m}) returned {got!r}")


# ---- any stages, any links --------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@example(forward=[1.0, 3.0, 2.0], m=5, link_s=0.25, offset_s=100.0)  # queueing, links and a late start
@example(forward=[0.5, 0.5], m=3, link_s=0.0, offset_s=0.0)  # equal stages
@given(forward=st.lists(st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0]), min_size=1, max_size=5),
       m=st.integers(1, 8), link_s=st.sampled_from([0.0, 0.25, 1.0]), offset_s=st.sampled_from([0.0, 7.5]))
def test_any_stages_any_links(impl, forward, m, link_s, offset_s):
    p = len(forward)
    trace = pl.simulate(pl.schedules.inference(p, m), pl.Costs(forward=forward, latency=link_s))
    events = [(kind, s, i, start + offset_s, end + offset_s) for kind, s, i, start, end in events_of(trace)]
    assert_measures(impl, events, m, trace.latencies, trace.throughput,
                    f"p={p} stages of {forward} s, links of {link_s} s, m={m}, starting at {offset_s} s")
