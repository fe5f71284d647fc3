"""`pipelab.model.microbatch`: split a batch into micro-batches and merge them back."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import pipelab as pl
from pipelab import microbatch

Pair = namedtuple("Pair", "x y")


def assert_same(a, b):
    """Structure, types and values equal; tensors compared exactly."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            assert_same(u, v)
    else:
        assert a is b


def rows(n, *rest, dtype=torch.float32):
    """A tensor whose row r holds the value r, so a chunk shows which rows it got."""
    return torch.arange(n, dtype=dtype).reshape(n, *([1] * len(rest))).expand(n, *rest).contiguous()


# --------------------------------------------------------------------------- sizes


@settings(max_examples=60, deadline=None)
@given(total=st.integers(1, 64), data=st.data())
def test_chunk_sizes_differ_by_at_most_one_larger_first_and_sum_to_the_batch(total, data):
    n = data.draw(st.integers(1, total))
    chunks = microbatch.split(rows(total, 3), n)
    sizes = [c.shape[0] for c in chunks]
    assert len(sizes) == n and sum(sizes) == total
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    assert microbatch.sizes(total, n) == sizes
    # contiguous, in order: the rows of chunk k follow those of chunk k-1
    assert torch.equal(torch.cat([c[:, 0] for c in chunks]), torch.arange(total, dtype=torch.float32))


def test_the_documented_example():
    assert [c.shape[0] for c in microbatch.split(torch.zeros(10, 2), 4)] == [3, 3, 2, 2]
    assert microbatch.sizes(10, 4) == [3, 3, 2, 2]
    assert microbatch.sizes(8, 8) == [1] * 8


# --------------------------------------------------------------------------- round trips


def test_tensor_round_trip_and_chunk_contents():
    x = rows(7, 2)
    chunks = microbatch.split(x, 3)
    assert [c[:, 0].tolist() for c in chunks] == [[0, 1, 2], [3, 4], [5, 6]]
    assert_same(microbatch.merge(chunks), x)


def test_nested_structures_round_trip_and_keep_their_types():
    flag, name = object(), "run-1"
    batch = {
        "x": rows(6, 4),
        "pair": Pair(rows(6, dtype=torch.int64), [rows(6, 2, 2), (rows(6), name)]),
        "ordered": OrderedDict(b=rows(6, 1), a=None),
        "flag": flag,
    }
    chunks = microbatch.split(batch, 4)
    assert len(chunks) == 4
    for k, chunk in enumerate(chunks):
        size = [2, 2, 1, 1][k]
        first = [0, 2, 4, 5][k]
        assert type(chunk) is dict and list(chunk) == ["x", "pair", "ordered", "flag"]
        assert type(chunk["pair"]) is Pair and type(chunk["pair"].y) is list and type(chunk["pair"].y[1]) is tuple
        assert type(chunk["ordered"]) is OrderedDict and list(chunk["ordered"]) == ["b", "a"]
        assert chunk["x"].shape == (size, 4) and chunk["x"][0, 0].item() == first
        assert chunk["pair"].x.dtype == torch.int64 and chunk["pair"].x.tolist() == list(range(first, first + size))
        assert chunk["pair"].y[0].shape == (size, 2, 2)
        # non-tensor leaves are passed through, the very same object
        assert chunk["flag"] is flag and chunk["pair"].y[1][1] is name and chunk["ordered"]["a"] is None
    assert_same(microbatch.merge(chunks), batch)


def test_tuple_and_list_batches():
    x, y = rows(5, 3), rows(5, 1)
    for batch in [(x, y), [x, y], Pair(x, y)]:
        chunks = microbatch.split(batch, 2)
        assert all(type(c) is type(batch) for c in chunks)
        assert [c[0].shape[0] for c in chunks] == [3, 2]
        assert_same(microbatch.merge(chunks), batch)


def test_split_keeps_autograd_history():
    x = torch.randn(4, 3, requires_grad=True)
    chunks = microbatch.split(x * 2, 2)
    (chunks[0].sum() + 3 * chunks[1].sum()).backward()
    assert torch.equal(x.grad, torch.tensor([[2.0] * 3, [2.0] * 3, [6.0] * 3, [6.0] * 3]))


leaves = st.one_of(
    st.builds(lambda w: ("tensor", w), st.integers(1, 3)),
    st.sampled_from([None, "text", 3, True]).map(lambda v: ("leaf", v)),
)


def structures(leaf):
    return st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.lists(inner, min_size=1, max_size=3),
            st.lists(inner, min_size=1, max_size=3).map(tuple),
            st.dictionaries(st.sampled_from("abcd"), inner, min_size=1, max_size=3),
            st.tuples(inner, inner).map(lambda t: Pair(*t)),
        ),
        max_leaves=6,
    )


def build(spec, batch_size, counter):
    if isinstance(spec, tuple) and len(spec) == 2 and spec[0] in ("tensor", "leaf") and not isinstance(spec, Pair):
        if spec[0] == "leaf":
            return spec[1]
        counter[0] += 1
        return torch.randn(batch_size, spec[1]) + 100 * counter[0]
    if isinstance(spec, dict):
        return {k: build(v, batch_size, counter) for k, v in spec.items()}
    if isinstance(spec, Pair):
        return Pair(build(spec.x, batch_size, counter), build(spec.y, batch_size, counter))
    return type(spec)(build(v, batch_size, counter) for v in spec)


def has_tensor(batch):
    if isinstance(batch, torch.Tensor):
        return True
    if isinstance(batch, dict):
        return any(has_tensor(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return any(has_tensor(v) for v in batch)
    return False


def flatten(batch):
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in flatten(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in flatten(v)]
    return []


def has_list_without_tensor(batch):
    """A list or tuple (not a namedtuple) holding no tensor: `split` refuses it."""
    if isinstance(batch, dict):
        return any(has_list_without_tensor(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        own = not isinstance(batch, Pair) and not has_tensor(batch)
        return own or any(has_list_without_tensor(v) for v in batch)
    return False


@settings(max_examples=60, deadline=None)
@given(spec=structures(leaves), batch_size=st.integers(1, 9), data=st.data())
@example(spec={"x": ("tensor", 2), "labels": [("leaf", 3), ("leaf", 3)]}, batch_size=2, data=None)
def test_any_nesting_round_trips(spec, batch_size, data):
    batch = build(spec, batch_size, [0])
    if not has_tensor(batch):
        with pytest.raises(ValueError, match="no tensor"):
            microbatch.split(batch, 1)
        return
    if has_list_without_tensor(batch):  # never handed whole to every micro-batch
        with pytest.raises(TypeError, match="holds no tensor: micro-batches are cut from tensors"):
            microbatch.split(batch, 1)
        return
    n = data.draw(st.integers(1, batch_size))
    chunks = microbatch.split(batch, n)
    assert len(chunks) == n
    expected = microbatch.sizes(batch_size, n)
    for chunk, size in zip(chunks, expected):
        assert all(t.shape[0] == size for t in flatten(chunk))
    # chunk k's leaves are rows [offset_k, offset_k + size_k) of the original leaves
    offset = 0
    for chunk, size in zip(chunks, expected):
        for original, part in zip(flatten(batch), flatten(chunk)):
            assert torch.equal(part, original[offset: offset + size])
        offset += size
    assert_same(microbatch.merge(chunks), batch)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("n", [0, -2])
def test_n_below_one(n):
    with pytest.raises(ValueError, match=rf"at least 1, got {n}"):
        microbatch.split(torch.zeros(4, 2), n)


@pytest.mark.parametrize("n", [2.0, True, "2", None])
def test_n_not_an_int(n):
    with pytest.raises(TypeError, match="must be an int"):
        microbatch.split(torch.zeros(4, 2), n)


def test_more_micro_batches_than_samples():
    with pytest.raises(ValueError, match=r"batch of 3 samples into 5 micro-batches"):
        microbatch.split(torch.zeros(3, 2), 5)


def test_disagreeing_batch_sizes_name_both_paths():
    batch = {"x": torch.zeros(4, 2), "extra": [torch.zeros(4), torch.zeros(5, 1)]}
    with pytest.raises(ValueError, match=r"disagree") as info:
        microbatch.split(batch, 2)
    message = str(info.value)
    assert "batch['x'] has 4" in message and "batch['extra'][1] has 5" in message


def test_no_tensor_in_the_batch():
    for batch in [{"a": 1, "b": [None, "x"]}, [], 3.0]:
        with pytest.raises(ValueError, match="no tensor"):
            microbatch.split(batch, 1)


@pytest.mark.parametrize("value, kind", [([1, 0, 1, 1], "list of 4 values (int)"),
                                         (("a", "b", "c", "d"), "tuple of 4 values (str)"),
                                         ([[1, 2], [3], [4], [5]], "list of 4 values (list)")])
def test_a_list_without_a_tensor_is_refused_naming_its_key_and_type_never_copied_whole(value, kind):
    """Labels or texts as a Python list would otherwise reach every micro-batch whole (4 labels for 2 samples)."""
    batch = {"input_ids": torch.zeros(4, 3, dtype=torch.long), "labels": value}
    with pytest.raises(TypeError) as caught:
        microbatch.split(batch, 2)
    assert str(caught.value) == (f"batch['labels'] is a {kind} and holds no tensor: micro-batches are cut from "
                                 f"tensors (along dimension 0), and each would get the whole {type(value).__name__}; "
                                 "make it a tensor (torch.tensor(...) of its numbers, text tokenized first), or leave "
                                 "it out of the batch")
    model = pl.models.mlp(depth=2, width=3)
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=2, loss_fn=torch.nn.MSELoss(), devices="cpu")
    with pytest.raises(TypeError, match=r"^batch\['labels'\] is a "):  # the engine's cut says the same
        pipe.step({"x": torch.zeros(4, 3), "labels": value}, torch.zeros(4, 3))


def test_zero_dim_tensor_is_named():
    with pytest.raises(ValueError, match=r"batch\['scale'\] is a 0-d tensor"):
        microbatch.split({"x": torch.zeros(4, 2), "scale": torch.tensor(2.0)}, 2)


def test_merge_errors():
    with pytest.raises(ValueError, match="non-empty list"):
        microbatch.merge([])
    with pytest.raises(ValueError, match="non-empty list"):
        microbatch.merge(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="dict keys"):
        microbatch.merge([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}])
    with pytest.raises(ValueError, match="structures"):
        microbatch.merge([(torch.zeros(1), torch.zeros(1)), (torch.zeros(1),)])
    with pytest.raises(TypeError, match="hold a tensor where others do not"):
        microbatch.merge([torch.zeros(1), 3])


def test_batch_size_helper():
    assert microbatch.batch_size({"a": torch.zeros(7, 1), "b": (torch.zeros(7), "s")}) == 7
