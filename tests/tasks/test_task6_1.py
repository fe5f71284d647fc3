"""Task 6.1: token_weights, micro-batch i's loss weight c_i / C (counted tokens).

The references are independent of the learner's code and of pipelab: the counts c_i
written out by hand for small label tensors (right padding, masked prompts, a classifier's
1-D labels, another ignore_index); and the real thing, a loss: random logits,
``torch.nn.functional.cross_entropy(..., ignore_index=-100)`` per micro-batch on labels
shifted by one (a causal language model) or not (a token classifier), padded in uneven
amounts, whose weighted sum must equal the loss of the whole batch at once, where the
samples' shares n_i / N do not; a property test over random labels and cuts (weights
exact, summing to 1, the loss of the whole batch, or a ValueError naming the first
micro-batch with no counted token); and a tiny Hugging Face GPT-2 built from a config,
whose own loss per micro-batch, so weighted, must be its loss on the whole batch.

When an answer is wrong, the message says which common mistake it matches (weights by
samples, every label counted, the shift forgotten or taken at the wrong end, float32).
"""

from __future__ import annotations

import itertools
import logging
import math
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from contract import assert_type, call_with_lists_then_tuples

pytestmark = pytest.mark.task6_1

IGNORE = -100
WEIGHTS = "token_weights returns c_i / C, c_i the labels of micro-batch i other than ignore_index"
A_LIST_OF_FLOATS = "token_weights returns a list of float, one per micro-batch"
SUM_TO_ONE = "the weights sum to 1"
FULL_LOSS = "sum_i w_i * L_i is the full batch's token-mean loss (L_i: micro-batch i's mean loss)"
EMPTY = 'a micro-batch with no counted token raises ValueError naming it ("micro-batch i")'
NOTHING = "no counted token at all raises ValueError"


# ---- independent references: counts by plain Python, losses by cross_entropy ----------


def reference_counts(labels, ignore_index=IGNORE, shift=False, end="first") -> list[int]:
    """c_i by plain Python over each sequence (the last dimension); ``end="last"`` drops the
    last label instead of the first (a mistake, for the messages)."""
    counts = []
    for micro in labels:
        rows = micro.reshape(-1, micro.shape[-1]).tolist() if micro.dim() > 0 else [[micro.item()]]
        if shift:
            rows = [row[1:] if end == "first" else row[:-1] for row in rows]
        counts.append(sum(label != ignore_index for row in rows for label in row))
    return counts


def shares(counts) -> list[float]:
    total = sum(counts)
    return [count / total for count in counts] if total else []


def diagnosis(got, labels, ignore_index, shift) -> str:
    """Which common mistake ``got`` matches, as a hint ('' when none)."""
    if not isinstance(got, (list, tuple)) or len(got) != len(labels):
        return ""
    mistakes = [
        ([len(micro) for micro in labels],
         "these are the samples' shares n_i / N: count the labels other than ignore_index instead"),
        ([micro[..., 1:].numel() if shift else micro.numel() for micro in labels],
         "every label was counted, ignore_index ones too: count only labels != ignore_index"),
        (reference_counts(labels, ignore_index, shift=not shift),
         ("each sequence's first label was counted: with shift=True count labels[..., 1:] only "
          "(position t predicts token t + 1, so the first token is never a target)")
         if shift else "counted as with shift=True: with shift=False every label counts"),
        (reference_counts(labels, IGNORE, shift),
         f"the labels other than -100 were counted: leave out ignore_index={ignore_index} instead"),
    ]
    if shift:
        mistakes.append((reference_counts(labels, ignore_index, shift=True, end="last"),
                         "labels[..., :-1] was counted: the label never predicted is each sequence's first, "
                         "so count labels[..., 1:]"))
    expected = shares(reference_counts(labels, ignore_index, shift))
    try:
        values = [float(value) for value in got]
    except (TypeError, ValueError):
        return ""
    if values == expected:
        return ""
    hints = [hint for counts, hint in mistakes if shares(counts) and shares(counts) != expected
             and all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(values, shares(counts)))]
    if hints:  # several when the mistakes agree here (samples and every label, on rows of one length)
        return "\nor: ".join(hints)
    if all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(values, expected)):
        return "right to float32's precision only: divide the Python ints (c / C), not a float32 tensor"
    return ""


def mean_token_loss(logits, labels, shift, ignore_index=IGNORE):
    """The loss of a batch (or a micro-batch): the mean over its counted tokens."""
    if shift:  # position t predicts token t + 1
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index)


def padded_batch(lengths, seq_len, vocab=7, seed=0):
    """Labels of len(lengths) samples, sample k's first lengths[k] labels counted and the rest
    padding (-100); float64 logits."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (len(lengths), seq_len), generator=g)
    labels[torch.arange(seq_len)[None, :] >= torch.tensor(lengths)[:, None]] = IGNORE
    logits = torch.randn(len(lengths), seq_len, vocab, generator=g, dtype=torch.float64)
    return logits, labels


def cut(tensor, cuts):
    bounds = [0, *cuts, len(tensor)]
    return [tensor[a:b] for a, b in itertools.pairwise(bounds)]


# ---- calling the learner ------------------------------------------------------------


def describe(labels) -> str:
    return "[" + ", ".join(f"tensor({micro.tolist()})" for micro in labels) + "]"


def weights(impl, labels, ignore_index=IGNORE, shift=False):
    """The learner's answer for ``labels`` as a list, checked to be a list of float, to leave
    the labels as they were, and to be the same for them as a tuple."""
    call = f"token_weights({describe(labels)}, ignore_index={ignore_index}, shift={shift})"
    labels = list(labels)

    def check(got):
        assert_type(got, list, A_LIST_OF_FLOATS, call)
        assert len(got) == len(labels), f"{A_LIST_OF_FLOATS}\n{call} returned {len(got)} weights for {len(labels)}"
        for i, value in enumerate(got):
            assert_type(value, float, A_LIST_OF_FLOATS, f"{call} returned {got!r}; weight {i}")

    return call_with_lists_then_tuples(
        lambda ls: impl("token_weights").token_weights(ls, ignore_index, shift), (labels,), (tuple(labels),),
        watched=labels, what="labels", call=call, check=check,
        differs=lambda got, again: f"{WEIGHTS}\n{call} returned {got!r} for a list, {again!r} for a tuple",
    )


def assert_weights(impl, labels, counts, ignore_index=IGNORE, shift=False):
    """The answer is exactly c_i / C for the counts written out by hand (and sums to 1)."""
    got = weights(impl, labels, ignore_index, shift)
    expected = [count / sum(counts) for count in counts]
    if got != expected:
        hint = diagnosis(got, labels, ignore_index, shift)
        raise AssertionError(
            f"{WEIGHTS}\nreturned {got!r}; the counted tokens are {counts}, so {expected!r}"
            + (f"\n{hint}" if hint else "")
            + f"\nfor token_weights({describe(labels)}, ignore_index={ignore_index}, shift={shift})"
        )
    assert math.isclose(sum(got), 1.0, rel_tol=1e-12), f"{SUM_TO_ONE}\n{got!r} sums to {sum(got)!r}"
    return got


def assert_raises_naming(impl, labels, index, shift=False, ignore_index=IGNORE, why=""):
    call = f"token_weights({describe(labels)}, ignore_index={ignore_index}, shift={shift})"
    try:
        got = impl("token_weights").token_weights(list(labels), ignore_index, shift)
    except ValueError as error:
        if index is not None:
            assert re.search(rf"micro-batch {index}\b", str(error)), (
                f"{EMPTY}\n{call} raised ValueError({str(error)!r}), which does not name micro-batch {index}"
            )
        return
    raise AssertionError(
        f"{EMPTY if index is not None else NOTHING}\n{call} returned {got!r} instead of raising ValueError{why}: "
        "a micro-batch's mean loss over no token is 0/0, NaN, and so would be every gradient"
    )


# ---- the counts, by hand ------------------------------------------------------------


RIGHT_PADDED = [
    torch.tensor([[11, 12, IGNORE, IGNORE]]),
    torch.tensor([[13, 14, 15, 16], [17, IGNORE, IGNORE, IGNORE]]),
    torch.tensor([[18, 19, 20, IGNORE], [21, 22, IGNORE, IGNORE], [23, 24, 25, 26]]),
]
MASKED_PROMPTS = [  # supervised fine-tuning: the prompt's labels are -100, the answer's counted
    torch.tensor([[IGNORE, IGNORE, 31, 32, 33]]),
    torch.tensor([[IGNORE, 34, 35, 36, 37], [IGNORE, IGNORE, IGNORE, IGNORE, 38]]),
]


def test_right_padded_tokens_by_hand(impl):
    assert_weights(impl, RIGHT_PADDED, [2, 5, 9])


def test_right_padded_shifted_by_hand(impl):
    # with shift: each sequence's first label is never a target: 1 | 3 + 0 | 2 + 1 + 3
    assert_weights(impl, RIGHT_PADDED, [1, 3, 6], shift=True)


def test_masked_prompts_shifted_by_hand(impl):
    # the first labels are -100 already: shifting drops nothing counted, but dropping the
    # last label (the wrong end) would: 2 | 3 + 0
    assert_weights(impl, MASKED_PROMPTS, [3, 5], shift=True)
    assert_weights(impl, MASKED_PROMPTS, [3, 5], shift=False)


def test_a_classifiers_labels_one_per_sample(impl):
    labels = [torch.tensor([0, IGNORE, 2, 1]), torch.tensor([IGNORE, 3])]
    assert_weights(impl, labels, [3, 1])


def test_labels_of_any_shape(impl):
    labels = [torch.tensor([[[1, IGNORE], [2, 3]], [[IGNORE, IGNORE], [4, 5]]]), torch.tensor([[[6, 7], [8, IGNORE]]])]
    assert_weights(impl, labels, [5, 3])


@pytest.mark.parametrize("shift, counts", [(False, [3, 2]), (True, [1, 2])], ids=["no_shift", "shift"])
def test_another_ignore_index(impl, shift, counts):
    # ignore_index=0: zeros are padding; -1 and -100 are labels like any other here
    labels = [torch.tensor([[5, 0, 0], [-1, 3, 0]]), torch.tensor([[0, 7, IGNORE]])]
    assert_weights(impl, labels, counts, ignore_index=0, shift=shift)


# ---- the real thing: the loss of the whole batch ----------------------------------------


def assert_full_batch_loss(impl, logits, labels, cuts, shift, ignore_index=IGNORE, what=""):
    """sum_i w_i * L_i equals the loss of the whole batch; returns (weights, per-micro-batch losses, full loss)."""
    micro_labels = cut(labels, cuts)
    got = weights(impl, micro_labels, ignore_index, shift)
    losses = [mean_token_loss(lg, lb, shift, ignore_index) for lg, lb in zip(cut(logits, cuts), micro_labels)]
    full = mean_token_loss(logits, labels, shift, ignore_index)
    pipelined = sum(w * loss for w, loss in zip(got, losses))
    hint = diagnosis(got, micro_labels, ignore_index, shift)
    assert math.isclose(float(pipelined), float(full), rel_tol=1e-10), (
        f"{FULL_LOSS}\nthe micro-batches' losses {[round(float(x), 6) for x in losses]} weighted by "
        f"{got!r} give {float(pipelined)!r}, the whole batch's loss is {float(full)!r}"
        + (f"\n{hint}" if hint else "") + f"\n({what})"
    )
    return got, losses, full


CAUSAL_LENGTHS, CAUSAL_CUTS = [6, 2, 6, 3, 4, 6, 5], [1, 4]  # micro-batches of 1, 3, 3 samples


def test_causal_language_model_loss_is_the_full_batch_loss(impl):
    logits, labels = padded_batch(CAUSAL_LENGTHS, 6, seed=1)
    assert_full_batch_loss(impl, logits, labels, CAUSAL_CUTS, shift=True,
                           what="a causal LM's loss (labels shifted by one), padded samples in 3 micro-batches")


def test_token_classifier_loss_is_the_full_batch_loss(impl):
    logits, labels = padded_batch([5, 1, 2, 5, 3], 5, seed=2)
    assert_full_batch_loss(impl, logits, labels, [2, 3], shift=False,
                           what="a token classifier's loss (no shift), padded samples in 3 micro-batches")


def test_another_ignore_index_in_the_loss(impl):
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(1, 5, (5, 4), generator=g)
    labels[torch.tensor([[0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1], [1, 1, 1, 1]]) == 1] = 0
    logits = torch.randn(5, 4, 5, generator=g, dtype=torch.float64)
    assert_full_batch_loss(impl, logits, labels, [1, 3], shift=True, ignore_index=0,
                           what="padding labelled 0, cross_entropy(ignore_index=0)")


def test_sample_weights_are_not_the_answer_on_a_padded_batch(impl):
    """On an unevenly padded batch n_i / N gives another loss (the reference's own check),
    and the answer must not be n_i / N."""
    logits, labels = padded_batch(CAUSAL_LENGTHS, 6, seed=1)
    got, losses, full = assert_full_batch_loss(impl, logits, labels, CAUSAL_CUTS, shift=True,
                                               what="a causal LM's padded batch")
    sizes = [len(micro) for micro in cut(labels, CAUSAL_CUTS)]
    by_samples = [n / sum(sizes) for n in sizes]
    assert not math.isclose(float(sum(w * loss for w, loss in zip(by_samples, losses))), float(full), rel_tol=1e-6)
    assert got != by_samples, (
        f"{WEIGHTS}\nthe weights {got!r} are the samples' shares n_i / N, which give another loss "
        "than the whole batch's when the micro-batches are padded unevenly"
    )


# ---- no counted token --------------------------------------------------------------------


def test_a_microbatch_with_no_counted_token_raises_naming_it(impl):
    labels = [torch.tensor([[1, 2]]), torch.tensor([[3, IGNORE]]), torch.tensor([[IGNORE, IGNORE], [IGNORE, IGNORE]])]
    assert_raises_naming(impl, labels, 2)


def test_shifted_away_tokens_leave_a_microbatch_empty(impl):
    # each sample of micro-batch 1 counts only its first label, never a target with shift=True
    labels = [torch.tensor([[1, 2, 3]]), torch.tensor([[7, IGNORE, IGNORE], [8, IGNORE, IGNORE]])]
    assert_raises_naming(impl, labels, 1, shift=True, why=" (with shift=True its only labels are not targets)")
    assert_weights(impl, labels, [3, 2], shift=False)


def test_a_microbatch_without_samples_raises_naming_it(impl):
    labels = [torch.tensor([[1, 2]]), torch.zeros((0, 2), dtype=torch.long), torch.tensor([[3, 4]])]
    assert_raises_naming(impl, labels, 1)


def test_no_counted_token_at_all_raises(impl):
    assert_raises_naming(impl, [], None, why=" (no micro-batch)")
    assert_raises_naming(impl, [torch.full((2, 3), IGNORE), torch.full((1, 3), IGNORE)], 0)
    assert_raises_naming(impl, [torch.tensor([[0, 0]])], 0, ignore_index=0)


# ---- any labels, any cut -----------------------------------------------------------------


@st.composite
def batches(draw):
    """(rows, cuts, shift): the label rows of a batch (-100 anywhere: padding, prompts), cut
    into micro-batches at ``cuts``."""
    seq_len, n = draw(st.integers(2, 5)), draw(st.integers(1, 7))
    label = st.one_of(st.just(IGNORE), st.integers(0, 4))
    rows = draw(st.lists(st.lists(label, min_size=seq_len, max_size=seq_len), min_size=n, max_size=n))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else []
    return rows, cuts, draw(st.booleans())


@settings(max_examples=20, deadline=None)
@example(case=([[1, 2, 3, IGNORE], [4, IGNORE, IGNORE, IGNORE], [0, 1, 2, 3]], [1], True))  # 2 | 0 + 3
@example(case=([[IGNORE, 1, 2, 3], [IGNORE, IGNORE, 4, IGNORE], [0, 1, 2, 3], [2, 2, IGNORE, 1]], [1, 3], False))
@example(case=([[1, 2, 3], [5, IGNORE, IGNORE]], [1], True))  # micro-batch 1: nothing counted after the shift
@given(batches())
def test_any_batch_any_cut(impl, case):
    rows, cuts, shift = case
    labels = torch.tensor(rows)
    micro_labels = cut(labels, cuts)
    counts = reference_counts(micro_labels, IGNORE, shift)
    if 0 in counts:
        assert_raises_naming(impl, micro_labels, counts.index(0), shift=shift)
        return
    assert_weights(impl, micro_labels, counts, shift=shift)
    logits = torch.randn(*labels.shape, 5, generator=torch.Generator().manual_seed(len(rows)), dtype=torch.float64)
    assert_full_batch_loss(impl, logits, labels, cuts, shift, what=f"labels {rows}, cut at {cuts}, shift={shift}")


# ---- a Hugging Face model's own loss ------------------------------------------------------


def test_hugging_face_gpt2_own_loss(impl):
    """model(**micro_batch).loss, weighted with shift=True (ForCausalLMLoss shifts the labels),
    adds up to model(**whole_batch).loss."""
    g = torch.Generator().manual_seed(4)
    lengths = torch.tensor([8, 2, 8, 3, 5, 8])
    ids = torch.randint(1, 32, (6, 8), generator=g)
    mask = (torch.arange(8)[None, :] < lengths[:, None]).long()
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE)}
    micro_batches = [{key: value[a:b] for key, value in batch.items()} for a, b in [(0, 1), (1, 4), (4, 6)]]
    got = weights(impl, [mb["labels"] for mb in micro_batches], IGNORE, True)

    hf = pytest.importorskip("transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)  # a tiny vocabulary makes it warn about token ids
    torch.manual_seed(0)
    model = hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8)).eval()
    with torch.no_grad():
        full = model(**batch).loss
        losses = [model(**mb).loss for mb in micro_batches]
    pipelined = sum(w * loss for w, loss in zip(got, losses))
    hint = diagnosis(got, [mb["labels"] for mb in micro_batches], IGNORE, True)
    assert math.isclose(float(pipelined), float(full), rel_tol=1e-5), (  # its loss is computed in float32
        f"{FULL_LOSS}\na GPT-2's own loss on 3 micro-batches of padded text, weighted by {got!r}, gives "
        f"{float(pipelined)!r}; on the whole batch {float(full)!r}" + (f"\n{hint}" if hint else "")
    )

