"""`pipelab.schedules.trace.Trace`: metrics of hand-built traces, checked against hand-computed values."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelab import schedules
from pipelab.schedules.action import Action
from pipelab.schedules.dependencies import run_dependencies
from pipelab.schedules.trace import Event, MemorySample, Trace


def trace(events, memory=(), n_stages=2, n_microbatches=2, n_devices=None, **kw):
    return Trace(list(events), list(memory), kw.pop("source", "simulated"), n_stages, n_microbatches,
                 n_stages if n_devices is None else n_devices, **kw)


def ev(stage, kind, mb, start, end, device=None):
    return Event(kind, stage, mb, start, end, stage if device is None else device)


# Two stages, two micro-batches, GPipe by hand (t_F = 1, t_B = 2), starting at t = 10, with one
# second of slack before device 0's backwards (so the numbers are not the closed form's):
#   device 0: F0 [10,11] F1 [11,12]                         B0 [16,18] B1 [18,20]
#   device 1:            F0 [11,12] F1 [12,13] B0 [13,15] B1 [15,17]
GPIPE_2x2 = [
    ev(0, "F", 0, 10, 11), ev(0, "F", 1, 11, 12), ev(1, "F", 0, 11, 12), ev(1, "F", 1, 12, 13),
    ev(1, "B", 0, 13, 15), ev(1, "B", 1, 15, 17), ev(0, "B", 0, 16, 18), ev(0, "B", 1, 18, 20),
]


def test_event_properties():
    e = ev(1, "B", 3, 2.5, 4.0)
    assert e.action == Action("B", 1, 3) and str(e.action) == "1B3"
    assert e.duration == 1.5


def test_metrics_of_a_hand_built_gpipe_trace():
    t = trace(GPIPE_2x2)
    assert t.makespan == 10.0  # 10 .. 20
    assert t.busy_time == [6.0, 6.0]
    assert t.bubble_fraction == pytest.approx(0.4)  # 1 - 12 busy / (2 devices x 10 s)
    assert t.peak_inflight == [2, 2]
    assert t.durations() == {Action(k, s, i): (1.0 if k == "F" else 2.0) for k in "FB" for s in (0, 1) for i in (0, 1)}


def test_bubble_fraction_of_a_tight_uniform_trace_is_the_closed_form():
    # build the unit-cost GPipe trace from the closed-form start times, p = 3, m = 4
    p, m = 3, 4
    events = [ev(s, "F", i, s + i, s + i + 1) for s in range(p) for i in range(m)]
    events += [ev(s, "B", i, (m + p - 1) + (p - 1 - s) + i, (m + p - 1) + (p - 1 - s) + i + 1)
               for s in range(p) for i in range(m)]
    t = trace(events, n_stages=p, n_microbatches=m)
    assert t.makespan == 2 * (m + p - 1)
    assert t.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert t.peak_inflight == [m] * p


def test_empty_trace():
    t = trace([])
    assert t.makespan == 0.0 and t.bubble_fraction == 0.0 and t.busy_time == [0.0, 0.0]
    assert t.peak_inflight == [0, 0] and t.peak_memory == [0, 0] and t.durations() == {}


def test_busy_time_is_counted_per_device_not_per_stage():
    # two stages on one device, back to back, then an idle second device
    events = [ev(0, "F", 0, 0, 1, device=0), ev(1, "F", 0, 1, 3, device=0),
              ev(1, "B", 0, 3, 4, device=0), ev(0, "B", 0, 4, 6, device=0)]
    t = trace(events, n_stages=2, n_microbatches=1, n_devices=2)
    assert t.busy_time == [6.0, 0.0]
    assert t.bubble_fraction == pytest.approx(0.5)


def test_peak_inflight_ties_leaving_and_entering_at_the_same_time_do_not_overlap():
    # stage 0: mb 0 held [0, 2]; mb 1 enters at exactly 2 -> never two at once
    t = trace([ev(0, "F", 0, 0, 1), ev(0, "B", 0, 1, 2), ev(0, "F", 1, 2, 3), ev(0, "B", 1, 3, 4)],
              n_stages=1)
    assert t.peak_inflight == [1]
    # a hair of overlap makes it two
    t = trace([ev(0, "F", 0, 0, 1), ev(0, "B", 0, 1, 2.001), ev(0, "F", 1, 2, 3), ev(0, "B", 1, 3, 4)],
              n_stages=1)
    assert t.peak_inflight == [2]


def test_peak_inflight_with_split_backward_waits_for_w():
    # mb 0 is held until its W ends at 6; mb 1 enters at 3 -> 2 in flight
    held_until_w = [ev(0, "F", 0, 0, 1), ev(0, "B", 0, 1, 2), ev(0, "F", 1, 3, 4),
                    ev(0, "W", 0, 5, 6), ev(0, "B", 1, 6, 7), ev(0, "W", 1, 7, 8)]
    assert trace(held_until_w, n_stages=1).peak_inflight == [2]
    # W of mb 0 ends exactly when mb 1 enters -> 1
    freed_at_entry = [ev(0, "F", 0, 0, 1), ev(0, "B", 0, 1, 2), ev(0, "W", 0, 2, 3),
                      ev(0, "F", 1, 3, 4), ev(0, "B", 1, 4, 5), ev(0, "W", 1, 5, 6)]
    assert trace(freed_at_entry, n_stages=1).peak_inflight == [1]
    # a W listed before its B (events in any order) still counts the later end
    shuffled = [held_until_w[i] for i in (5, 3, 1, 0, 4, 2)]
    assert trace(shuffled, n_stages=1).peak_inflight == [2]


def test_peak_inflight_is_per_stage():
    events = [ev(0, "F", i, i, i + 1) for i in range(3)] + [ev(0, "B", i, 5 + i, 6 + i) for i in range(3)]
    events += [ev(1, "F", 0, 1, 2), ev(1, "B", 0, 2, 3), ev(1, "F", 1, 3, 4), ev(1, "B", 1, 4, 5)]
    assert trace(events, n_microbatches=3).peak_inflight == [3, 1]


def brute_peak(events, n_stages):
    """Sample every interval between event times: which micro-batches are held there?"""
    times = sorted({e.start for e in events} | {e.end for e in events})
    peak = [0] * n_stages
    for lo, hi in zip(times, times[1:]):
        mid = (lo + hi) / 2
        for s in range(n_stages):
            held = 0
            for e in events:
                if e.stage == s and e.kind == "F" and e.start <= mid:
                    leave = max((b.end for b in events if b.stage == s and b.microbatch == e.microbatch
                                 and b.kind in "BW"), default=float("inf"))
                    held += mid < leave
            peak[s] = max(peak[s], held)
    return peak


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["gpipe", "1f1b"]), p=st.integers(1, 4), m=st.integers(1, 6),
       t_f=st.integers(1, 3), t_b=st.integers(1, 3))
def test_peak_inflight_of_simulated_schedules(name, p, m, t_f, t_b):
    sched = schedules.by_name(name, p, m)
    timing = run_dependencies(sched, lambda a: float(t_f if a.kind == "F" else t_b))
    events = [ev(a.stage, a.kind, a.microbatch, timing.start[a], timing.end[a]) for a in timing.order]
    t = trace(events, n_stages=p, n_microbatches=m)
    theory = [m] * p if name == "gpipe" else [min(p - s, m) for s in range(p)]
    assert t.peak_inflight == theory == brute_peak(events, p)
    assert t.makespan == (m + p - 1) * (t_f + t_b)
    assert t.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


def test_peak_memory_and_memory_curve():
    memory = [
        MemorySample(0, 0.0, 0), MemorySample(0, 2.0, 300), MemorySample(0, 1.0, 100), MemorySample(0, 3.0, 50),
        MemorySample(1, 1.5, 70),
        MemorySample(1, 2.0, 10_000, what="allocated"),  # not activations: ignored by peak_memory
    ]
    t = trace(GPIPE_2x2, memory)
    assert t.peak_memory == [300, 70]
    assert t.memory_curve(0) == ([0.0, 1.0, 2.0, 3.0], [0, 100, 300, 50])
    assert t.memory_curve(1) == ([1.5], [70])
    assert t.memory_curve(1, what="allocated") == ([2.0], [10_000])


def test_bad_source_is_named():
    with pytest.raises(ValueError, match=r"source.*'guessed'"):
        trace([], source="guessed")
    for source in ("simulated", "measured", "replayed"):
        assert trace([], source=source).source_label


def test_chrome_trace_export(tmp_path):
    memory = [MemorySample(0, 10.5, 128), MemorySample(1, 12.0, 64), MemorySample(0, 11.0, 0, what="allocated")]
    t = trace(GPIPE_2x2, memory, schedule_name="gpipe", device_names=["cpu", "cpu"])
    path = t.to_chrome_trace(tmp_path / "sub" / "step.json")
    assert path.exists()
    data = json.loads(path.read_text())
    records = data["traceEvents"]
    complete = [r for r in records if r["ph"] == "X"]
    counters = [r for r in records if r["ph"] == "C"]
    assert len(complete) == len(GPIPE_2x2) and len(counters) == len(memory)
    by_action = {r["args"]["action"]: r for r in complete}
    # microseconds, counted from the first event's start (t = 10 s)
    expected = {
        "0F0": (0, 1e6, 0), "0F1": (1e6, 1e6, 0), "1F0": (1e6, 1e6, 1), "1F1": (2e6, 1e6, 1),
        "1B0": (3e6, 2e6, 1), "1B1": (5e6, 2e6, 1), "0B0": (6e6, 2e6, 0), "0B1": (8e6, 2e6, 0),
    }
    assert set(by_action) == set(expected)
    for action, (ts, dur, tid) in expected.items():
        record = by_action[action]
        assert record["ts"] == pytest.approx(ts) and record["dur"] == pytest.approx(dur)
        assert record["tid"] == tid and record["cat"] == action[1]
        assert record["args"]["stage"] == int(action[0]) and record["args"]["microbatch"] == int(action[2])
    assert sorted((c["ts"], c["args"]["bytes"]) for c in counters) == [
        (pytest.approx(0.5e6), 128), (pytest.approx(1e6), 0), (pytest.approx(2e6), 64)]
    assert all(isinstance(c["name"], str) and c["name"] for c in counters)
    assert data["otherData"]["makespan_s"] == 10.0 and data["otherData"]["schedule"] == "gpipe"


def test_chrome_trace_of_an_empty_trace(tmp_path):
    data = json.loads(trace([]).to_chrome_trace(tmp_path / "empty.json").read_text())
    assert [r for r in data["traceEvents"] if r["ph"] in ("X", "C")] == []
