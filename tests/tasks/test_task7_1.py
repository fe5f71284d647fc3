"""Task 7.1: stage_memory (what a device of one stage holds) and fits (the planner's check).

References: cases computed by hand here (the closed forms written out with their numbers); pipelab's
own ``pl.TransformerSpec`` methods (``layer_parameters``, ``embedding_parameters``,
``layer_activation_bytes``, ``working_bytes``: Korthikanti et al. 2022, Table 2) for every stage, t,
b, k and recomputation drawn by a property test; and the planner itself, ``pl.plan``, whose every row
carries the busier of its first and last stage's memory and is over the limit exactly when that does
not fit.  The learner's code gets a plain object with the spec's six fields, so it must write the
formulas.  And what ``==`` does not see: a dict of exactly four float values, a bool from fits, the
in-flight counts unchanged and the same as a list or a tuple, ValueError for what cannot be.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import pipelab as pl
from contract import assert_type, call_with_lists_then_tuples
from pipelab.predict.transformer_memory import microbatches_in_flight

pytestmark = pytest.mark.task7_1

KEYS = ("parameters", "gradients", "optimizer", "activations")
TYPES = 'returns a new dict with exactly the keys "parameters", "gradients", "optimizer", "activations", each a float'
PARAMETERS = ("parameters = gradients = n·B bytes, n = ⌈L/p⌉·(12h² + 13h)/t, + V·h/t on the first and the last "
              "stage, + s·h on the first, + 2h on the last")
OPTIMIZER = "optimizer = n·12 bytes (16 a parameter with the 2 + 2), n·8 when B = 4"
ACTIVATIONS = ("activations = k·⌈L/p⌉·A + W, A = s·b·h·(10 + 24/t + 5·a·s/(h·t))·B/2 (none), s·b·h·(10 + 24/t)·B/2 "
               "(selective), 2·s·b·h·B/2 (full); W = one layer's 'none' bytes with full, else 0")
FITS = "a device fits when the sum of its four parts is at most memory_bytes (equal fits), every stage's"


@dataclass(frozen=True)
class Spec:
    """The six fields and nothing else: the learner writes the formulas."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    bytes_per_value: int = 2

    def reference(self) -> pl.TransformerSpec:
        return pl.TransformerSpec(self.layers, self.hidden, self.heads, self.seq, self.vocab, self.bytes_per_value)


TINY = Spec(layers=2, hidden=4, heads=2, seq=8, vocab=10)  # a layer: 12·16 + 13·4 = 244 parameters
FOUR = Spec(layers=4, hidden=4, heads=2, seq=8, vocab=10)


def memory(impl, spec, p, t, stage, b, k, recompute="none"):
    """The learner's stage_memory, checked for its types."""
    call = f"stage_memory({spec}, {p}, {t}, {stage}, {b}, {k}, {recompute!r})"
    got = impl("plan_memory").stage_memory(spec, p, t, stage, b, k, recompute)
    assert_type(got, dict, TYPES, f"{call}'s result")
    assert tuple(sorted(got)) == tuple(sorted(KEYS)), f"{TYPES}\n{call} returned the keys {sorted(got)}"
    for key in KEYS:
        assert_type(got[key], float, TYPES, f"{call}[{key!r}]")
    return got


def assert_memory(impl, spec, p, t, stage, b, k, recompute, expected, what):
    got = memory(impl, spec, p, t, stage, b, k, recompute)
    call = f"stage_memory({spec}, {p}, {t}, {stage}, {b}, {k}, {recompute!r})"
    for key, clause in (("parameters", PARAMETERS), ("gradients", PARAMETERS), ("optimizer", OPTIMIZER),
                        ("activations", ACTIVATIONS)):
        assert math.isclose(got[key], expected[key], rel_tol=1e-9), (
            f"{clause}\n{what}: {call}[{key!r}] is {got[key]!r}, expected {expected[key]!r}")


def reference(spec: Spec, p, t, stage, b, k, recompute):
    """The rules of the docstring, on pipelab's TransformerSpec methods."""
    model = spec.reference()
    layers = math.ceil(spec.layers / p)
    n = layers * model.layer_parameters / t
    n += (model.embedding_parameters / t if stage in (0, p - 1) else 0) + (spec.seq * spec.hidden if stage == 0 else 0)
    n += 2 * spec.hidden if stage == p - 1 else 0
    size = spec.bytes_per_value
    return {"parameters": n * size, "gradients": n * size, "optimizer": n * (8 if size == 4 else 12),
            "activations": k * layers * model.layer_activation_bytes(b, t, recompute)
            + model.working_bytes(b, t, recompute)}


# ---- stage_memory: cases worked by hand -----------------------------------------------------

HAND = {  # name: (spec, p, t, stage, b, k, recompute, expected)
    "one device, the docstring's": (TINY, 1, 1, 0, 1, 1, "none", {
        # n = 2·244 + 10·4 + 8·4 + 2·4 = 568; A = 8·1·4·(10 + 24 + 5·2·8/4) = 32·54 = 1728, 2 layers
        "parameters": 1136.0, "gradients": 1136.0, "optimizer": 6816.0, "activations": 3456.0}),
    "first of 2 stages, t=2, selective": (TINY, 2, 2, 0, 2, 2, "selective", {
        # n = 244/2 + 40/2 + 32 = 174; A = 8·2·4·(10 + 12) = 1408, 1 layer, k = 2
        "parameters": 348.0, "gradients": 348.0, "optimizer": 2088.0, "activations": 2816.0}),
    "last of 2 stages, t=2, selective": (TINY, 2, 2, 1, 2, 1, "selective", {
        # n = 122 + 20 + 8 = 150
        "parameters": 300.0, "gradients": 300.0, "optimizer": 1800.0, "activations": 1408.0}),
    "a middle stage: its layers only": (FOUR, 4, 1, 1, 1, 3, "none", {
        # n = 244; A = 1728, 1 layer, k = 3
        "parameters": 488.0, "gradients": 488.0, "optimizer": 2928.0, "activations": 5184.0}),
    "a middle stage, t=2": (FOUR, 4, 2, 2, 1, 2, "none", {
        # n = 122; A = 8·4·(10 + 12 + 5·2·8/8) = 32·32 = 1024
        "parameters": 244.0, "gradients": 244.0, "optimizer": 1464.0, "activations": 2048.0}),
    "full recomputation: inputs, plus one layer rebuilt": (TINY, 1, 1, 0, 1, 3, "full", {
        # 3 micro-batches × 2 layers × 2·8·1·4 = 384, + W = 1728
        "parameters": 1136.0, "gradients": 1136.0, "optimizer": 6816.0, "activations": 2112.0}),
    "3 layers on 2 stages: ⌈3/2⌉ = 2 each": (Spec(3, 4, 2, 8, 10), 2, 1, 1, 1, 1, "none", {
        # n = 2·244 + 40 + 8 = 536
        "parameters": 1072.0, "gradients": 1072.0, "optimizer": 6432.0, "activations": 3456.0}),
    "fp32: 4 bytes a value, 8 for Adam's moments": (Spec(2, 4, 2, 8, 10, 4), 1, 1, 0, 1, 1, "none", {
        # n = 568; activations twice the 16-bit ones
        "parameters": 2272.0, "gradients": 2272.0, "optimizer": 4544.0, "activations": 6912.0}),
    "nothing in flight": (TINY, 2, 1, 0, 1, 0, "none", {
        # n = 244 + 40 + 32 = 316
        "parameters": 632.0, "gradients": 632.0, "optimizer": 3792.0, "activations": 0.0}),
    "a fraction in flight (interleaved)": (FOUR, 2, 1, 0, 1, 1.75, "selective", {
        # n = 2·244 + 40 + 32 = 560; A = 32·34 = 1088, 2 layers × 1.75
        "parameters": 1120.0, "gradients": 1120.0, "optimizer": 6720.0, "activations": 3808.0}),
}


@pytest.mark.parametrize("case", list(HAND))
def test_cases_worked_by_hand(impl, case):
    spec, p, t, stage, b, k, recompute, expected = HAND[case]
    assert reference(spec, p, t, stage, b, k, recompute) == pytest.approx(expected)  # the reference agrees
    assert_memory(impl, spec, p, t, stage, b, k, recompute, expected, case)


def test_16_bytes_a_parameter(impl):
    """Mixed-precision Adam: 2 + 2 + 12 bytes a parameter (ZeRO §3.1), whatever the layout."""
    for p, t, stage in [(1, 1, 0), (2, 2, 0), (2, 2, 1), (4, 1, 2)]:
        got = memory(impl, FOUR, p, t, stage, 1, 1)
        n = got["parameters"] / 2
        total = got["parameters"] + got["gradients"] + got["optimizer"]
        assert math.isclose(total, 16 * n), f"{OPTIMIZER}\np={p}, t={t}, stage {stage}: {got}"


# ---- stage_memory: against pipelab's TransformerSpec --------------------------------------------


@settings(max_examples=60, deadline=None)
@example(layers=5, hidden=8, heads=4, seq=16, vocab=32, size=2, p=3, t=2, stage=1, b=2, k=2.0, recompute="full")
@example(layers=4, hidden=8, heads=2, seq=8, vocab=16, size=4, p=2, t=4, stage=1, b=1, k=1.0, recompute="none")
@given(layers=st.integers(1, 12), hidden=st.sampled_from([4, 8, 16]), heads=st.sampled_from([1, 2, 4]),
       seq=st.sampled_from([4, 8, 32]), vocab=st.integers(1, 64), size=st.sampled_from([2, 4]),
       p=st.integers(1, 6), t=st.sampled_from([1, 2, 4, 8]), stage=st.integers(0, 5), b=st.integers(1, 4),
       k=st.sampled_from([0, 1, 2, 3, 1.5, 5]), recompute=st.sampled_from(["none", "selective", "full"]))
def test_any_stage_against_pipelabs_formulas(impl, layers, hidden, heads, seq, vocab, size, p, t, stage, b, k,
                                             recompute):
    p = min(p, layers)
    stage = stage % p
    spec = Spec(layers, hidden, heads, seq, vocab, size)
    assert_memory(impl, spec, p, t, stage, b, k, recompute, reference(spec, p, t, stage, b, k, recompute),
                  f"{spec}, p={p}, t={t}, stage {stage}, b={b}, k={k}, {recompute}")


# ---- against the planner -------------------------------------------------------------------------

PLANS = {  # name: (spec, devices, global batch)
    "a 4-layer GPT on 8 devices": (Spec(layers=4, hidden=64, heads=4, seq=32, vocab=128), 8, 16),
    "6 layers on 12 devices, fp32": (Spec(layers=6, hidden=32, heads=4, seq=16, vocab=100, bytes_per_value=4), 12, 24),
    "a 12.9 B GPT on 64 devices": (Spec(layers=40, hidden=5120, heads=40, seq=2048, vocab=51200), 64, 512),
}


def planned(name, limit_quantile=0.5):
    spec, n, batch = PLANS[name]
    unlimited = pl.plan(spec.reference(), n, 4, 1e30, batch, inside=(1e-6, 1e11), between=(1e-5, 1e10),
                        peak_flops_per_second=1e12)
    totals = sorted(r.memory.total for r in unlimited.rows)
    limit = totals[int(limit_quantile * (len(totals) - 1))]
    return spec, pl.plan(spec.reference(), n, 4, limit, batch, inside=(1e-6, 1e11), between=(1e-5, 1e10),
                         peak_flops_per_second=1e12), limit


def in_flight_by_stage(row) -> list[float]:
    _, p, _ = row.layout.shape
    first, last = microbatches_in_flight(row.schedule, p, row.n_microbatches, row.chunks)
    return [first] if p == 1 else [first] + [last] * (p - 1)  # middle stages: at most stage 0's


@pytest.mark.parametrize("name", list(PLANS))
def test_the_planners_rows(impl, name):
    """Each row's memory is the busier of its first and last stage; it is over the limit exactly when
    fits says no."""
    spec, found, limit = planned(name)
    rows = found.rows + found.over_limit
    assert found.rows and found.over_limit
    for row in rows:
        _, p, t = row.layout.shape
        k = in_flight_by_stage(row)
        what = f"{spec}: pl.plan's row {row.layout}, {row.schedule_name}, b={row.micro_batch_size}, {row.recompute}"
        ends = [memory(impl, spec, p, t, s, row.micro_batch_size, k[s], row.recompute) for s in sorted({0, p - 1})]
        busier = max(ends, key=lambda parts: sum(parts.values()))
        for key, clause in zip(KEYS, (PARAMETERS, PARAMETERS, OPTIMIZER, ACTIVATIONS)):
            assert math.isclose(busier[key], getattr(row.memory, key), rel_tol=1e-9), (
                f"{clause}\n{what}: the busier end stage holds {key} {busier[key]!r}, the planner says "
                f"{getattr(row.memory, key)!r}")
        got = impl("plan_memory").fits(spec, p, t, row.micro_batch_size, k, row.recompute, limit)
        assert_type(got, bool, "returns a bool", f"fits(...) for {what}")
        assert got == (not row.reason), (f"{FITS}\n{what}: fits returned {got}, the planner says "
                                         f"{row.reason or 'it fits'} (limit {limit} bytes)")


# ---- fits ------------------------------------------------------------------------------------------


def check_fits(impl, spec, p, t, b, in_flight, recompute, limit):
    call = f"fits({spec}, {p}, {t}, {b}, {in_flight!r}, {recompute!r}, {limit})"
    in_flight = list(in_flight)

    def check(got):
        assert_type(got, bool, "returns a bool", call)

    return call_with_lists_then_tuples(
        lambda k: impl("plan_memory").fits(spec, p, t, b, k, recompute, limit), (in_flight,), (tuple(in_flight),),
        watched=in_flight, what="microbatches_in_flight", call=call, check=check,
        differs=lambda got, again: f"microbatches_in_flight may be a list or a tuple\n{call} returned {got}, "
                                   f"for a tuple {again}")


def test_fits_at_the_limit_exactly(impl):
    total = 1136 + 1136 + 6816 + 3456  # the docstring's device
    assert check_fits(impl, TINY, 1, 1, 1, [1], "none", total) is True, f"{FITS}: {total} bytes fit in {total}"
    assert check_fits(impl, TINY, 1, 1, 1, [1], "none", total - 1) is False, f"{FITS}: {total} > {total - 1}"


def test_fits_looks_at_every_stage(impl):
    """The last stage is the fullest when it holds the most micro-batches: every stage counts."""
    k = [0, 0, 0, 6]
    totals = [sum(memory(impl, FOUR, 4, 1, s, 1, k[s]).values()) for s in range(4)]
    assert totals[3] == max(totals) > totals[0]
    assert check_fits(impl, FOUR, 4, 1, 1, k, "none", totals[3]) is True, f"{FITS}: the fullest holds {totals[3]}"
    assert check_fits(impl, FOUR, 4, 1, 1, k, "none", totals[3] - 1) is False, (
        f"{FITS}: stage 3 holds {totals[3]} bytes, over {totals[3] - 1}")
    k = [0, 5, 0, 0]
    middle = sum(memory(impl, FOUR, 4, 1, 1, 1, 5).values())
    assert check_fits(impl, FOUR, 4, 1, 1, k, "none", middle - 1) is False, f"{FITS}: stage 1 holds {middle} bytes"


# ---- what cannot be ----------------------------------------------------------------------------

BAD_STAGES = {  # name: (p, t, stage, b, k, recompute)
    "n_stages=0": (0, 1, 0, 1, 1, "none"),
    "tensor_parallel=0": (1, 0, 0, 1, 1, "none"),
    "micro_batch_size=0": (1, 1, 0, 0, 1, "none"),
    "more stages than layers": (3, 1, 0, 1, 1, "none"),
    "stage p": (2, 1, 2, 1, 1, "none"),
    "stage -1": (2, 1, -1, 1, 1, "none"),
    "a negative count in flight": (1, 1, 0, 1, -1, "none"),
    "an unknown recomputation": (1, 1, 0, 1, 1, "some"),
}


@pytest.mark.parametrize("case", list(BAD_STAGES))
def test_what_cannot_be_is_refused(impl, case):
    p, t, stage, b, k, recompute = BAD_STAGES[case]
    with pytest.raises(ValueError):
        got = impl("plan_memory").stage_memory(TINY, p, t, stage, b, k, recompute)
        pytest.fail(f"stage_memory raises ValueError ({case})\nstage_memory(TINY, {p}, {t}, {stage}, {b}, {k}, "
                    f"{recompute!r}) returned {got}")


@pytest.mark.parametrize("in_flight", [[1], [1, 1, 1], []], ids=str)
def test_fits_needs_one_count_per_stage(impl, in_flight):
    with pytest.raises(ValueError):
        got = impl("plan_memory").fits(TINY, 2, 1, 1, in_flight, "none", 1e9)
        pytest.fail(f"fits raises ValueError when microbatches_in_flight does not have n_stages numbers\n"
                    f"fits(TINY, 2, 1, 1, {in_flight}, 'none', 1e9) returned {got}")
