"""Task 1.2: split a nested batch into micro-batches along dim 0, and merge them back.

The reference (``reference_split``) walks the structure and uses ``torch.tensor_split``.
Besides the rows, every answer is checked for what ``==`` and ``torch.equal`` do not see:
container types, the dtype of every tensor (float64, bfloat16 and int64 as well as
float32), that gradients still flow back to a batch that requires grad, that a
non-tensor leaf is the caller's very object (a mutable one, like ``object()``, shows a
copy), and that the batch and the chunks are left unchanged.  Where the chunks given to merge
hold different non-tensor leaves, the first chunk's leaf is the one merged.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from contract import assert_type, assert_unchanged, picture

pytestmark = pytest.mark.task1_2

SPLIT = "split cuts every tensor leaf as torch.tensor_split does and passes other leaves unchanged"
SAME_OBJECT = "split and merge pass every non-tensor leaf on as the same object, not a copy"
DTYPE = "split and merge keep each tensor's dtype"
GRADIENT = "gradients flow back through split and merge to the tensors they were given"
ROUND_TRIP = "merge(split(batch, n)) equals batch"
FIRST_WINS = "where the chunks' non-tensor leaves differ, merge takes the first chunk's leaf"


class Opaque:
    """A non-tensor leaf that a copy cannot pass for (unlike None, ints and strings)."""

    def __repr__(self) -> str:
        return f"<Opaque {id(self):#x}>"


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


def assert_same(actual, expected, where="batch", clause=SPLIT):
    """Same containers, same keys in the same order, tensors with the same rows, dtype and
    need for grad, and the very same non-tensor leaves."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{clause}\n{where} should be a tensor, got {actual!r}"
        assert actual.dtype == expected.dtype, (
            f"{DTYPE} (got {actual.dtype})\n{where} is {actual.dtype}, the batch's tensor is {expected.dtype}"
        )
        assert actual.shape == expected.shape, (
            f"{clause}\n{where} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
        )
        assert torch.equal(actual, expected), f"{clause}\n{where} holds the wrong rows: {actual}"
        assert actual.requires_grad == expected.requires_grad, (
            f"{GRADIENT}\n{where}: requires_grad is {actual.requires_grad}, but the tensor it "
            f"comes from {'requires' if expected.requires_grad else 'does not require'} grad"
        )
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and list(actual) == list(expected), (
            f"{clause}\n{where} should be a dict with keys {list(expected)}, got {actual!r}"
        )
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]", clause)
    elif isinstance(expected, (tuple, list)):
        assert type(actual) is type(expected) and len(actual) == len(expected), (
            f"{clause}\n{where} should be a {type(expected).__name__} of {len(expected)} items, "
            f"got {actual!r}"
        )
        for index, (item, expected_item) in enumerate(zip(actual, expected)):
            assert_same(item, expected_item, f"{where}[{index}]", clause)
    else:
        assert actual is expected, (
            f"{SAME_OBJECT}\n{where} should be the caller's leaf {expected!r} itself, got {actual!r}"
        )


def assert_split_like_reference(split, batch, n):
    before = picture(batch)
    chunks = split(batch, n)
    assert_unchanged(before, batch, "the batch", f"split(batch, {n})")
    expected = reference_split(batch, n)
    assert_type(chunks, list, "split returns a list of n micro-batches", f"split(batch, {n})")
    assert len(chunks) == n, (
        f"split returns a list of n micro-batches\nsplit(batch, {n}) returned {len(chunks)}"
    )
    for k, (chunk, expected_chunk) in enumerate(zip(chunks, expected)):
        assert_same(chunk, expected_chunk, f"micro-batch {k}")
    return chunks


def assert_round_trip(microbatch, batch, n):
    chunks = microbatch.split(batch, n)
    before = picture(chunks)
    merged = microbatch.merge(chunks)
    assert_unchanged(before, chunks, "the chunks", "merge(chunks)")
    assert_same(merged, batch, f"merge(split(batch, {n}))", ROUND_TRIP)


def test_uneven_sizes_differ_by_at_most_one_larger_first(impl):
    chunks = impl("microbatch").split(torch.arange(10), 4)
    sizes = [len(chunk) for chunk in chunks]
    assert sizes == [3, 3, 2, 2], (
        f"micro-batch k gets B // n + 1 rows if k < B % n, else B // n rows\n"
        f"split(torch.arange(10), 4) gave sizes {sizes}, expected [3, 3, 2, 2]"
    )
    assert_split_like_reference(impl("microbatch").split, torch.arange(10), 4)


def test_as_many_microbatches_as_asked(impl):
    # torch.chunk(torch.arange(5), 4) returns only 3 chunks (sizes 2, 2, 1).
    assert_split_like_reference(impl("microbatch").split, torch.arange(5), 4)


def test_one_microbatch_and_one_row_each(impl):
    split = impl("microbatch").split
    assert_split_like_reference(split, torch.arange(6.0).reshape(3, 2), 1)
    assert_split_like_reference(split, torch.arange(6.0).reshape(3, 2), 3)
    assert_split_like_reference(split, torch.ones(1, 4), 1)


def test_nested_batch_with_non_tensor_leaves(impl):
    batch = {
        "tokens": torch.arange(12).reshape(6, 2),
        "extras": (torch.ones(6, 3), [None, "causal", torch.zeros(6)]),
        "step": 7,
    }
    assert_split_like_reference(impl("microbatch").split, batch, 4)


def test_mutable_leaves_are_passed_as_the_same_object(impl):
    microbatch = impl("microbatch")
    batch = {"x": torch.randn(5, 2), "tokenizer": Opaque(), "extras": (object(), {"ids": {1, 2}})}
    chunks = assert_split_like_reference(microbatch.split, batch, 3)
    for k, chunk in enumerate(chunks):
        assert chunk["tokenizer"] is batch["tokenizer"], (
            f"{SAME_OBJECT}\nmicro-batch {k}['tokenizer'] is a copy of the caller's object"
        )
    assert_round_trip(microbatch, batch, 3)


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.bfloat16, torch.int64, torch.bool], ids=lambda d: str(d)[6:]
)
def test_other_dtypes_are_kept(impl, dtype):
    microbatch = impl("microbatch")
    batch = ((torch.arange(14) % 3).to(dtype).reshape(7, 2), [torch.arange(7).to(dtype)])
    assert_split_like_reference(microbatch.split, batch, 3)
    assert_round_trip(microbatch, batch, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_gradients_flow_back_through_split_and_merge(impl, dtype):
    microbatch = impl("microbatch")
    leaf = torch.arange(10.0, dtype=dtype).reshape(5, 2).requires_grad_()
    chunks = assert_split_like_reference(microbatch.split, {"x": leaf, "mode": "train"}, 2)
    for k, chunk in enumerate(chunks):
        (chunk["x"] * (k + 1)).sum().backward()
    expected = torch.tensor([[1.0, 1.0]] * 3 + [[2.0, 2.0]] * 2, dtype=dtype)
    assert leaf.grad is not None and torch.equal(leaf.grad, expected), (
        f"{GRADIENT}\nthe batch's gradient after a backward through each micro-batch is "
        f"{leaf.grad}, expected {expected}"
    )
    outputs = [torch.ones(2, 3, dtype=dtype, requires_grad=True), torch.ones(1, 3, dtype=dtype, requires_grad=True)]
    merged = microbatch.merge(outputs)
    assert merged.requires_grad, f"{GRADIENT}\nmerge of chunks that require grad does not"
    (merged * 3).sum().backward()
    assert outputs[1].grad is not None and torch.equal(outputs[1].grad, torch.full((1, 3), 3.0, dtype=dtype)), (
        f"{GRADIENT}\nno gradient (or a wrong one) reached a merged chunk: {outputs[1].grad}"
    )


def test_merge_is_the_inverse_of_split(impl):
    batch = {"x": torch.randn(5, 3), "mode": "train", "pair": (torch.arange(5), None)}
    assert_round_trip(impl("microbatch"), batch, 3)


def test_merge_concatenates_stage_outputs(impl):
    outputs = [torch.tensor([[0.0], [1.0], [2.0]]), torch.tensor([[3.0], [4.0]])]
    before = picture(outputs)
    merged = impl("microbatch").merge(outputs)
    assert_unchanged(before, outputs, "the chunks", "merge(chunks)")
    assert_same(merged, torch.arange(5.0).reshape(5, 1), "merge(outputs)", "merge joins tensor leaves with torch.cat(..., dim=0)")


def test_merge_takes_the_first_chunks_leaf_where_they_differ(impl):
    tags = [Opaque(), Opaque(), Opaque()]
    chunks = [
        {"x": torch.arange(2.0), "rows": 2, "meta": (tags[0], ["a", None]), "y": [torch.zeros(2, 1, dtype=torch.int64)]},
        {"x": torch.arange(2.0, 4.0), "rows": 2, "meta": (tags[1], ["b", 7]), "y": [torch.ones(2, 1, dtype=torch.int64)]},
        {"x": torch.arange(4.0, 5.0), "rows": 1, "meta": (tags[2], ["c", 8]), "y": [torch.ones(1, 1, dtype=torch.int64)]},
    ]
    before = picture(chunks)
    merged = impl("microbatch").merge(chunks)
    assert_unchanged(before, chunks, "the chunks", "merge(chunks)")
    expected = {"x": torch.arange(5.0), "rows": 2, "meta": (tags[0], ["a", None]),
                "y": [torch.tensor([[0], [0], [1], [1], [1]])]}
    assert_same(merged, expected, "merge(chunks)", FIRST_WINS)
    assert merged["meta"][0] is tags[0], f"{FIRST_WINS}\nmerge(chunks)['meta'][0] is not chunk 0's object"


@pytest.mark.parametrize(
    ("batch", "n", "why"),
    [
        (torch.arange(4), 0, "n < 1"),
        (torch.arange(4), -2, "n < 1"),
        (torch.arange(4), 5, "n > B (a micro-batch would be empty)"),
        ((torch.zeros(4), torch.zeros(3)), 2, "tensor leaves disagree on the batch size"),
        ({"x": torch.zeros(4), "extras": [torch.zeros(3)]}, 2,
         "tensor leaves, at any depth of the nesting, disagree on the batch size"),
        ([[torch.zeros(2, 1)], {"y": (torch.zeros(5),)}], 1,
         "tensor leaves, at any depth of the nesting, disagree on the batch size"),
        ({"mode": "train"}, 1, "the batch holds no tensor"),
        (((), [None]), 1, "the batch holds no tensor"),
        ("tokens", 1, "the batch holds no tensor"),
        ((torch.zeros(4), torch.tensor(1.0)), 2, "a 0-d tensor has no batch size"),
        ({"x": torch.zeros(4), "extras": [torch.tensor(1.0)]}, 2, "a 0-d tensor has no batch size"),
    ],
    ids=["zero", "negative", "more_than_batch", "sizes_disagree", "nested_sizes_disagree",
         "deeply_nested_sizes_disagree", "no_tensor", "no_tensor_nested", "no_tensor_at_all", "zero_dim_tensor",
         "nested_zero_dim_tensor"],
)
def test_split_rejects_bad_arguments(impl, batch, n, why):
    with pytest.raises(ValueError):
        impl("microbatch").split(batch, n)
        pytest.fail(f"split raises ValueError if {why}\nsplit({batch!r}, {n}) returned without raising")


def test_merge_rejects_no_chunks(impl):
    with pytest.raises(ValueError):
        impl("microbatch").merge([])
        pytest.fail("merge raises ValueError if chunks is empty\nmerge([]) returned without raising")


non_tensor_leaf = (
    st.none() | st.integers(-5, 5) | st.sampled_from(["causal", "train", ""]) | st.builds(Opaque)
)
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64]


@st.composite
def batches(draw):
    """(batch, n): a random nesting of tuples, lists and dicts with batch size B."""
    batch_size = draw(st.integers(1, 9))

    def tensor_leaf(trailing_shape, dtype, requires_grad):
        numel = batch_size * math.prod(trailing_shape)
        tensor = torch.arange(numel).reshape(batch_size, *trailing_shape).to(dtype)
        return tensor.requires_grad_(requires_grad and dtype.is_floating_point)

    tensors = st.builds(tensor_leaf, st.lists(st.integers(1, 3), max_size=2), st.sampled_from(DTYPES), st.booleans())
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


EXAMPLES = [
    (torch.arange(1.0).reshape(1, 1), 1),  # B = 1
    ((torch.arange(8, dtype=torch.float64), [Opaque(), torch.ones(8, 2)]), 3),  # remainder 2
    ({"b": torch.zeros(5, dtype=torch.bfloat16), "a": (None, {"c": torch.arange(5)})}, 5),  # n = B
    ([torch.arange(6.0).requires_grad_(), "mode"], 4),  # a leaf that requires grad
]


def with_examples(test):
    for case in EXAMPLES:
        test = example(case)(test)
    return test


@settings(max_examples=60, deadline=None)
@with_examples
@given(batches())
def test_split_matches_tensor_split_on_every_leaf(impl, case):
    batch, n = case
    assert_split_like_reference(impl("microbatch").split, batch, n)


@settings(max_examples=60, deadline=None)
@with_examples
@given(batches())
def test_merge_split_round_trip(impl, case):
    batch, n = case
    assert_round_trip(impl("microbatch"), batch, n)
