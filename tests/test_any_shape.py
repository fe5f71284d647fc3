"""A model split by names steps on batches of any shape, as a training run gives them: the smaller last batch of an
epoch, each batch right-padded to its own longest row (labels -100 on the padding), uneven micro-batches (5 rows
in 2, 2 and 1).  Every step's loss and gradients equal the plain single-device step's on the whole batch
(`pl.single_device_gradients`), on the local engine (1F1B, ZB-H1) and on 2 gloo ranks; a new shape is traced
once, before its step (`model/traced_shapes.py`)."""

from __future__ import annotations

import pytest
import torch

import pipelab as pl
from your_model_cases import VOCAB, make_model

pytest.importorskip("transformers")

TOLERANCE = dict(rtol=1e-5, atol=1e-6)
SPLITS = {"gpt2": ["transformer.h.1", "transformer.h.2"], "llama": ["model.layers.1", "model.layers.2"]}
# (rows, each row's length): the batch is padded to its longest row; 6 rows of 8 is the sample's shape
RUN = [(6, [8, 2, 8, 3, 8, 8]), (6, [11, 4, 9, 2, 5, 7]), (5, [3, 6, 2, 6, 4]), (4, [9, 2, 13, 5]),
       (3, [4, 7, 2]), (6, [2, 3, 2, 2, 3, 2]), (3, [10, 3, 5]), (5, [8, 2, 8, 3, 8])]


def padded_batch(lengths: list[int], seed: int = 0) -> dict:
    """Rows of these lengths, right-padded to the longest; the padding masked out and labelled -100."""
    g = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), longest), generator=g)
    mask = (torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def training_run() -> list[dict]:
    return [padded_batch(lengths, seed) for seed, (_, lengths) in enumerate(RUN)]


class Keywords:
    """The model called as the pipeline calls it, with the batch as its keyword arguments: what
    `pl.single_device_gradients` runs for the plain step (the model's own loss over the whole batch)."""

    def __init__(self, model):
        self.model = model

    def named_parameters(self):
        return self.model.named_parameters()

    def __call__(self, batch: dict):
        return self.model(**batch)


def single_device(model, batch: dict) -> tuple[float, dict]:
    return pl.single_device_gradients(Keywords(model), batch, None, lambda output, _: output.loss)


def pipeline(model, batch: dict, schedule: str = "1f1b", **options):
    return pl.Pipeline(model, n_stages=3, n_microbatches=3, schedule=schedule, split_points=SPLITS[kind_of(model)],
                       sample=batch, loss_normalization="tokens", devices="cpu", **options)


def kind_of(model) -> str:
    return "gpt2" if type(model).__name__.startswith("GPT2") else "llama"


def assert_step_exact(model, result, batch: dict) -> None:
    loss, reference = single_device(model, batch)
    assert result.loss == pytest.approx(loss, rel=1e-5)
    found = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert set(found) == set(reference)
    for name, grad in reference.items():
        torch.testing.assert_close(found[name], grad, **TOLERANCE, msg=name)


@pytest.mark.parametrize("kind, schedule", [("gpt2", "1f1b"), ("llama", "zb-h1")])
def test_every_step_of_a_run_of_changing_shapes_equals_the_single_device(kind, schedule):
    """The run's batches change rows and length at every step (5 rows: micro-batches of 2, 2 and 1; 3 rows: of 1);
    the stages stay the same objects holding the user's own tensors, the tied embedding one parameter."""
    model, batches = make_model(kind), training_run()
    pipe = pipeline(model, batches[0], schedule)
    stages, parameters = list(pipe.partition.stages), pipe.parameters()
    for batch in batches:
        model.zero_grad(set_to_none=True)
        assert_step_exact(model, pipe.step(batch), batch)
    assert all(a is b for a, b in zip(stages, pipe.partition.stages))
    assert all(a is b for a, b in zip(parameters, pipe.parameters()))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert sum(p is model.get_input_embeddings().weight for p in pipe.parameters()) == 1


def test_a_new_shape_is_traced_once_and_only_where_the_graphs_do_not_reach():
    """The sample's own shape is traced as it is; the first other shape with dynamic rows and length (2 and up), so
    that further lengths and row counts need no trace; a micro-batch of 1 row (export fixes sizes of 1) is traced
    on its first step, not on the next."""
    model = make_model("gpt2")
    pipe = pipeline(model, padded_batch([8, 2, 8, 3, 8, 8]))
    shapes = pipe.partition.traced_for
    assert shapes.traces == 1
    pipe.step(padded_batch([8, 2, 8, 3, 8, 5], seed=1))  # the sample's shape
    assert shapes.traces == 1
    pipe.step(padded_batch([11, 4, 9, 2, 5, 7]))  # another length: traced with dynamic dimensions
    assert shapes.traces == 2
    pipe.step(padded_batch([3, 3, 2, 6, 4, 5, 2, 2]))  # another length and 8 rows: that graph accepts them
    assert shapes.traces == 2
    pipe.step(padded_batch([4, 7, 2]))  # micro-batches of 1 row
    assert shapes.traces == 3
    pipe.step(padded_batch([9, 3, 5], seed=1))  # 1 row again, another length
    assert shapes.traces == 3
    assert [len(stage.pieces) for stage in pipe.partition.stages] == [3, 3, 3]


class SizedOnlyInt(torch.nn.Module):
    """A model whose forward needs its sequence length as a plain int (it refuses a dynamic dimension), so that
    each shape has its own graph: the cache then works by shapes alone."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids, labels):
        if not isinstance(input_ids.shape[1], int):
            raise TypeError("this model wants fixed sizes")
        x = self.embed(input_ids)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_a_model_export_cannot_trace_with_dynamic_sizes_gets_one_graph_per_shape():
    model = SizedOnlyInt()
    batches = [{"input_ids": ids, "labels": ids} for ids in
               (torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(k))
                for k, shape in enumerate([(6, 8), (6, 5), (5, 8), (6, 8)]))]
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=3, split_points=["blocks.2"], sample=batches[0],
                       devices="cpu")
    for batch in batches:
        model.zero_grad(set_to_none=True)
        result = pipe.step(batch)
        loss, reference = pl.single_device_gradients(Keywords(model), batch, None, lambda output, _: output)
        assert result.loss == pytest.approx(loss, rel=1e-5)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, reference[name], **TOLERANCE, msg=name)
    assert pipe.partition.traced_for.traces == 3  # 2 rows x 8; 2 x 5; 1 x 8 (5 rows: 2, 2, 1); the first again: none


@pytest.mark.parametrize("change, match", [
    (lambda b: b.pop("attention_mask"),
     r"batch\['attention_mask'\] is missing from micro-batch 0; .* has it \(torch.int64, shape \(2, 8\)\)"),
    (lambda b: b.update(token_type_ids=torch.zeros_like(b["input_ids"])),
     r"micro-batch 0 has batch\['token_type_ids'\] \(torch.int64, shape \(2, 8\)\), which the sample .* does not"),
    (lambda b: b.update(attention_mask=b["attention_mask"].float()),
     r"batch\['attention_mask'\] is torch.float32 in micro-batch 0, but torch.int64 in the sample"),
])
def test_a_batch_with_other_keys_or_dtypes_than_the_sample_is_refused_naming_the_key(change, match):
    model, batch = make_model("gpt2"), padded_batch([8, 2, 8, 3, 8, 8])
    pipe = pipeline(model, batch)
    other = dict(batch)
    change(other)
    with pytest.raises(ValueError, match=match):
        pipe.step(other)


def test_a_model_in_another_mode_than_its_trace_is_refused():
    model, batch = make_model("gpt2"), padded_batch([8, 2, 8, 3, 8, 8])
    pipe = pipeline(model, batch)
    model.train()
    with pytest.raises(ValueError, match="traced in eval mode"):
        pipe.step(batch)


def changing_shapes_on_ranks() -> dict:
    """On every rank: the run's steps, 1F1B over the ranks (GPT-2 cut once, its tied embedding on both); the
    losses, this rank's gradients at each step, and the number of traces."""
    model, batches = make_model("gpt2"), training_run()
    pipe = pl.DistributedPipeline(model, n_microbatches=3, schedule="1f1b", split_points=["transformer.h.2"],
                                  sample=batches[0], loss_normalization="tokens")
    losses, grads = [], []
    for batch in batches:
        model.zero_grad(set_to_none=True)
        losses.append(pipe.step(batch).loss)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return {"losses": losses, "grads": grads, "traces": pipe.partition.traced_for.traces}


@pytest.mark.slow
def test_changing_shapes_on_two_ranks_equal_the_single_device():
    """Each rank traces the same new shapes before the step; the receivers learn each message's layout per input
    signature (`runtime/p2p.py`); the tied embedding's gradient is the whole one on both ranks."""
    per_rank = pl.distributed.launch(changing_shapes_on_ranks, 2, timeout_seconds=120)
    model = make_model("gpt2")
    for step, batch in enumerate(training_run()):
        loss, reference = single_device(model, batch)
        held = {}
        for rank in per_rank:
            assert rank["losses"][step] == pytest.approx(loss, rel=1e-5)
            for name, grad in rank["grads"][step].items():
                torch.testing.assert_close(grad, reference[name], **TOLERANCE, msg=f"step {step}: {name}")
                held[name] = grad
        assert set(held) == set(reference)
    assert [rank["traces"] for rank in per_rank] == [3, 3]  # the sample; 6 x 11 (dynamic); 5 rows (2, 2, 1)
