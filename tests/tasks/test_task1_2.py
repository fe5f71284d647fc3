"""Task 1.2: split a nested batch into micro-batches along dim 0, and merge them back.

The reference (``reference_split``) walks the structure and uses ``torch.tensor_split``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

# Hypothesis's explain phase costs seconds per failing property, more than it tells here.
PHASES = tuple(phase for phase in Phase if phase is not Phase.explain)

pytestmark = pytest.mark.task1_2


def reference_split(batch, n):
    def take(value, k):
        if isinstance(value, torch.Tensor):
            return torch.tensor_split(value, n)[k]
        if isinstance(value, dict):
            return {key: take(item, k) for key, item in value.items()}
        if isinstance(value, (tuple, list)):
            return type(value)(take(item, k) for item in value)
        return value

    return [take(batch, k) for k in range(n)]


def assert_same(actual, expected, where="batch"):
    """Same containers, same keys, equal tensors, and the very same non-tensor leaves."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where} should be a tensor, got {actual!r}"
        assert actual.shape == expected.shape, (
            f"{where} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
        )
        assert torch.equal(actual, expected), f"{where} holds the wrong rows: {actual}"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), (
            f"{where} should be a dict with keys {sorted(expected)}, got {actual!r}"
        )
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (tuple, list)):
        assert type(actual) is type(expected) and len(actual) == len(expected), (
            f"{where} should be a {type(expected).__name__} of {len(expected)} items, "
            f"got {actual!r}"
        )
        for index, (item, expected_item) in enumerate(zip(actual, expected)):
            assert_same(item, expected_item, f"{where}[{index}]")
    else:
        assert actual is expected, (
            f"{where} should be the non-tensor leaf {expected!r} passed through unchanged, "
            f"got {actual!r}"
        )


def assert_split_like_reference(split, batch, n):
    chunks = split(batch, n)
    expected = reference_split(batch, n)
    assert isinstance(chunks, list) and len(chunks) == n, (
        f"split(batch, {n}) should return a list of {n} micro-batches, got "
        f"{len(chunks) if isinstance(chunks, list) else type(chunks).__name__}"
    )
    for k, (chunk, expected_chunk) in enumerate(zip(chunks, expected)):
        assert_same(chunk, expected_chunk, f"micro-batch {k}")


def test_uneven_sizes_differ_by_at_most_one_larger_first(impl):
    chunks = impl("microbatch").split(torch.arange(10), 4)
    sizes = [len(chunk) for chunk in chunks]
    assert sizes == [3, 3, 2, 2], f"split(torch.arange(10), 4) gave sizes {sizes}"
    assert_split_like_reference(impl("microbatch").split, torch.arange(10), 4)


def test_as_many_microbatches_as_asked(impl):
    # torch.chunk(torch.arange(5), 4) returns only 3 chunks (sizes 2, 2, 1).
    assert_split_like_reference(impl("microbatch").split, torch.arange(5), 4)


def test_nested_batch_with_non_tensor_leaves(impl):
    batch = {
        "tokens": torch.arange(12).reshape(6, 2),
        "extras": (torch.ones(6, 3), [None, "causal", torch.zeros(6)]),
        "step": 7,
    }
    assert_split_like_reference(impl("microbatch").split, batch, 4)


def test_merge_is_the_inverse_of_split(impl):
    microbatch = impl("microbatch")
    batch = {"x": torch.randn(5, 3), "mode": "train", "pair": (torch.arange(5), None)}
    merged = microbatch.merge(microbatch.split(batch, 3))
    assert_same(merged, batch, "merge(split(batch, 3))")


def test_merge_concatenates_stage_outputs(impl):
    outputs = [torch.tensor([[0.0], [1.0], [2.0]]), torch.tensor([[3.0], [4.0]])]
    assert_same(impl("microbatch").merge(outputs), torch.arange(5.0).reshape(5, 1), "merge")


@pytest.mark.parametrize(
    ("batch", "n", "why"),
    [
        (torch.arange(4), 0, "n < 1"),
        (torch.arange(4), 5, "n > batch size: a micro-batch would be empty"),
        ((torch.zeros(4), torch.zeros(3)), 2, "tensor leaves disagree on the batch size"),
        ({"mode": "train"}, 1, "no tensor in the batch"),
        ((torch.zeros(4), torch.tensor(1.0)), 2, "a 0-d tensor has no batch dimension"),
    ],
    ids=["zero", "more_than_batch", "sizes_disagree", "no_tensor", "zero_dim_tensor"],
)
def test_split_rejects_bad_arguments(impl, batch, n, why):
    with pytest.raises(ValueError):
        impl("microbatch").split(batch, n)
        pytest.fail(f"split should raise ValueError: {why}")


def test_merge_rejects_no_chunks(impl):
    with pytest.raises(ValueError):
        impl("microbatch").merge([])
        pytest.fail("merge([]) should raise ValueError: there is nothing to merge")


non_tensor_leaf = st.none() | st.integers(-5, 5) | st.sampled_from(["causal", "train", ""])


@st.composite
def batches(draw):
    """(batch, n): a random nesting of tuples, lists and dicts with batch size B."""
    batch_size = draw(st.integers(1, 9))

    def tensor_leaf(trailing_shape):
        numel = batch_size * math.prod(trailing_shape)
        return torch.arange(numel, dtype=torch.float32).reshape(batch_size, *trailing_shape)

    tensors = st.lists(st.integers(1, 3), max_size=2).map(tensor_leaf)
    structure = st.recursive(
        tensors | non_tensor_leaf,
        lambda children: st.lists(children, max_size=3)
        | st.tuples(children, children)
        | st.dictionaries(st.sampled_from("abcd"), children, max_size=3),
        max_leaves=6,
    )
    batch = draw(structure)
    if not _holds_tensor(batch):
        batch = [draw(tensors), batch]
    return batch, draw(st.integers(1, batch_size))


def _holds_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        value = list(value.values())
    return isinstance(value, (tuple, list)) and any(_holds_tensor(item) for item in value)


@settings(max_examples=60, deadline=None, phases=PHASES)
@given(batches())
def test_split_matches_tensor_split_on_every_leaf(impl, case):
    batch, n = case
    assert_split_like_reference(impl("microbatch").split, batch, n)


@settings(max_examples=60, deadline=None, phases=PHASES)
@given(batches())
def test_merge_split_round_trip(impl, case):
    batch, n = case
    microbatch = impl("microbatch")
    assert_same(microbatch.merge(microbatch.split(batch, n)), batch, f"merge(split(batch, {n}))")
