"""Hugging Face models (GPT-2, Llama tied and untied, BERT, ResNet, ViT) built from small configs, split by module
names and pipelined, against the single-device step written by hand: the model's own loss on the whole batch (or,
where that is the rule, on each micro-batch) and `torch.autograd.grad`."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import pipelab as pl
from your_model_cases import (SEQ, SPLITS, gradients_of, make_batch, make_model, reference_gradients,
                              run_tied_training)

pytest.importorskip("transformers")

TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def pipeline(model, batch, n_stages=3, schedule="1f1b", normalization="tokens", **options):
    points = SPLITS[type_kind(model)][0][:n_stages - 1]
    return pl.Pipeline(model, n_stages=n_stages, n_microbatches=3, schedule=schedule, split_points=points,
                       sample=batch, loss_normalization=normalization, devices="cpu", **options)


def type_kind(model) -> str:
    name = type(model).__name__.lower()
    kind = next(k for k in ("gpt2", "llama", "bert", "resnet", "vit") if name.startswith(k))
    return kind if kind != "llama" or model.config.tie_word_embeddings else "llama-untied"


def assert_same_gradients(model, reference, **tolerance):
    found = gradients_of(model)
    assert set(found) == set(reference)
    for name, grad in reference.items():
        torch.testing.assert_close(found[name], grad, **(tolerance or TOLERANCE), msg=name)


@pytest.mark.parametrize("n_stages, schedule", [(3, "1f1b"), (2, "zb-h1")])
@pytest.mark.parametrize("kind", list(SPLITS))
def test_each_model_split_by_names_gives_the_single_device_gradients(kind, n_stages, schedule):
    """Padded text with loss_normalization='tokens' (images: 'samples'): the whole batch's own loss, exactly."""
    model, batch = make_model(kind), make_batch(kind, padded=True)
    loss, reference = reference_gradients(model, batch)
    pipe = pipeline(model, batch, n_stages, schedule, "samples" if SPLITS[kind][1] == "image" else "tokens")
    result = pipe.step(batch)
    assert result.loss == pytest.approx(loss, rel=1e-5)
    assert_same_gradients(model, reference)
    assert [s.first_module for s in pipe.partition.stages][1:] == SPLITS[kind][0][:n_stages - 1]


@pytest.mark.parametrize("schedule, n_stages", [("gpipe", 2), ("gpipe", 3), ("zb-h1", 3), ("interleaved", 4)])
def test_gpt2_under_every_schedule(schedule, n_stages):
    model, batch = make_model("gpt2"), make_batch("gpt2", padded=True)
    loss, reference = reference_gradients(model, batch)
    if schedule == "interleaved":  # two devices, two stages each: one per block
        pipe = pl.Pipeline(model, n_stages=4, n_microbatches=2, schedule=pl.schedules.interleaved_1f1b(2, 2, 2),
                           split_points=["transformer.h.1", "transformer.h.2", "transformer.h.3"], sample=batch,
                           loss_normalization="tokens", devices="cpu")
    else:
        pipe = pipeline(model, batch, n_stages, schedule)
    assert pipe.step(batch).loss == pytest.approx(loss, rel=1e-5)
    assert_same_gradients(model, reference)


def test_the_tied_embedding_is_one_parameter_whose_gradient_sums_both_uses():
    model, batch = make_model("gpt2"), make_batch("gpt2")
    pipe = pipeline(model, batch)
    wte = model.transformer.wte.weight
    assert model.lm_head.weight is wte
    users = [s for s, stage in enumerate(pipe.partition.stages) if any(p is wte for p in stage.parameters())]
    assert users == [0, 2]
    assert sum(p is wte for p in pipe.parameters()) == 1
    pipe.step(batch)
    _, reference = reference_gradients(model, batch)
    torch.testing.assert_close(wte.grad, reference["transformer.wte.weight"], **TOLERANCE)


def test_padding_weighted_by_samples_is_the_mean_of_micro_batch_losses_and_by_tokens_the_model_loss():
    model, batch = make_model("gpt2"), make_batch("gpt2", padded=True)
    whole, _ = reference_gradients(model, batch)
    per_microbatch, reference = reference_gradients(model, batch, n_microbatches=3)
    assert abs(whole - per_microbatch) > 1e-3  # the padded rows make the two rules differ on this batch
    by_samples = pipeline(model, batch, normalization="samples").step(batch)
    assert by_samples.loss == pytest.approx(per_microbatch, rel=1e-5)
    assert_same_gradients(model, reference)
    model.zero_grad(set_to_none=True)
    assert pipeline(model, batch, normalization="tokens").step(batch).loss == pytest.approx(whole, rel=1e-5)


def test_resnet_in_train_mode_updates_batch_norm_as_three_micro_batches_would_and_warns():
    """In float64: BatchNorm over two samples amplifies float32 rounding in the backward to ~1e-5 (not a rule)."""
    model, batch = make_model("resnet").train().double(), make_batch("resnet")
    batch["pixel_values"] = batch["pixel_values"].double()
    twin = copy.deepcopy(model)
    _, reference = reference_gradients(twin, batch, n_microbatches=3)  # three forwards: three BatchNorm updates
    with pytest.warns(UserWarning, match="BatchNorm"):
        pipe = pipeline(model, batch, normalization="samples")
        pipe.step(batch)
    assert_same_gradients(model, reference, rtol=1e-12, atol=1e-12)
    for (name, mine), theirs in zip(model.named_buffers(), twin.buffers()):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12, msg=name)


def test_the_trace_leaves_the_model_its_random_state_and_its_buffers():
    model, batch = make_model("resnet").train(), make_batch("resnet")
    buffers = [b.clone() for b in model.buffers()]
    state = torch.random.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipeline(model, batch, normalization="samples", warm_up=False)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers()))


def test_points_chosen_for_you_cut_the_repeated_blocks():
    model, batch = make_model("llama", n_layers=6), make_batch("llama")
    parts = pl.split(model, 3, sample=batch)
    assert [s.first_module for s in parts.stages][1:] == ["model.layers.2", "model.layers.4"]
    pipe = pl.Pipeline(model, n_stages=3, n_microbatches=3, sample=batch, devices="cpu")
    assert [s.first_module for s in pipe.partition.stages][1:] == ["model.layers.2", "model.layers.4"]


class HeavyHead(torch.nn.Module):
    """Six equal blocks in a ModuleList, then a head of four more Linears of the same size outside it."""

    def __init__(self, width: int = 384):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(6))
        self.head = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x).pow(2).mean()  # its own loss


def test_time_counts_what_runs_after_the_blocks_on_the_last_one():
    """Block costs [1, 1, 1, 1, 1, 1 + 4] (the head is four blocks' work): two balanced stages cut before
    the last block (5 against 5), where counting blocks cuts at the middle and a time split blind to the
    head would too."""
    model, batch = HeavyHead(), {"x": torch.randn(512, 384, generator=torch.Generator().manual_seed(1))}
    assert [s.first_module for s in pl.split(model, 2, sample=batch).stages][1:] == ["blocks.3"]
    parts = pl.split(model, 2, method="time", sample=batch, repeats=3)
    assert [s.first_module for s in parts.stages][1:] == ["blocks.5"]
    assert all(p.grad is None for p in model.parameters())  # timing leaves the model's .grad as it was
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=2, split_method="time", sample=batch, devices="cpu")
    assert [s.first_module for s in pipe.partition.stages][1:] == ["blocks.5"]
    assert pipe.step(batch).loss == pytest.approx(float(HeavyHead()(**batch)), rel=1e-6)


def time_split_on_ranks() -> dict:
    model, batch = HeavyHead(), {"x": torch.randn(1024, 384, generator=torch.Generator().manual_seed(1))}
    pipe = pl.DistributedPipeline(model, n_microbatches=2, schedule="1f1b", split_method="time", sample=batch)
    # the same shape as an nn.Sequential (its own timing path): five Linear + tanh blocks, then five Linears
    torch.manual_seed(0)
    sequential = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(384, 384), torch.nn.Tanh()) for _ in range(5)],
                                     torch.nn.Sequential(*[torch.nn.Linear(384, 384) for _ in range(5)]))
    cut = pl.DistributedPipeline(sequential, n_microbatches=2, schedule="1f1b", split_method="time",
                                 sample=batch["x"], loss_fn=torch.nn.functional.mse_loss).partition.bounds
    # split_method="auto", schedule="auto": rank 0 measures and decides, every rank gets its plan
    auto = pl.DistributedPipeline(HeavyHead(), n_microbatches=2, split_method="auto", schedule="auto", sample=batch)
    # the StepResult itself, its trace not read yet: pickled back with the trace
    return {"first": [pipe.partition.stages[s].first_module for s in pipe.stages], "result": pipe.step(batch),
            "sequential": cut, "plan": auto.plan, "auto": auto.step(batch).loss,
            "auto_first": [auto.partition.stages[s].first_module for s in auto.stages]}


@pytest.mark.slow
def test_a_time_split_is_timed_on_rank_0_and_the_same_on_every_rank():
    first, second = pl.distributed.launch(time_split_on_ranks, 2, timeout_seconds=120)
    assert first["first"] == ["blocks.0"] and second["first"] == ["blocks.5"]
    assert first["sequential"] == second["sequential"] == [(0, 5), (5, 6)]  # costs [1, 1, 1, 1, 1, 5]
    batch = {"x": torch.randn(1024, 384, generator=torch.Generator().manual_seed(1))}
    assert first["result"].loss == second["result"].loss == pytest.approx(float(HeavyHead()(**batch)), rel=1e-6)
    assert first["result"].trace.events == second["result"].trace.events
    assert len(second["result"].trace.events) == 2 * 2 * 2  # F and B of 2 micro-batches on 2 stages
    # the decision: made on rank 0, the same plan on both ranks, the stages it chose, the loss of one device
    plan = first["plan"]
    assert str(plan) == str(second["plan"]) and plan.chosen.bounds == second["plan"].chosen.bounds
    assert plan.link[0] > 0 and plan.link[1] > 0  # the link between the ranks, measured
    starts = ["blocks.0", *plan.split_points()]
    assert sorted(first["auto_first"] + second["auto_first"]) == sorted(starts)
    assert first["auto"] == second["auto"] == pytest.approx(float(HeavyHead()(**batch)), rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("kind, n_ranks, schedule", [("gpt2", 3, "1f1b"), ("llama", 2, "zb-h1")])
def test_tied_weights_across_ranks_train_as_on_one_device_and_checkpoint_into_the_plain_model(
        kind, n_ranks, schedule, tmp_path):
    """Three SGD steps on the ranks and on one device (not Adam: it turns the zero gradient of attention's key bias,
    float noise, into whole steps); the tied embedding is all-reduced between the two ranks
    that use it (one message of its size per step); the ranks' checkpoint loads into a model built as usual."""
    path = str(tmp_path / "ckpt") if kind == "gpt2" else None
    per_rank = pl.distributed.launch(run_tied_training, n_ranks, kind, schedule, 3, path, timeout_seconds=240)
    model, batch = make_model(kind), make_batch(kind, padded=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        loss, grads = reference_gradients(model, batch)
        for name, param in model.named_parameters():
            param.grad = grads.get(name)
        losses.append(loss)
        optimizer.step()
    for rank in per_rank:
        assert rank["losses"] == pytest.approx(losses, rel=1e-5)
        for name, param in rank["params"].items():
            torch.testing.assert_close(param, dict(model.named_parameters())[name], rtol=1e-4, atol=1e-5, msg=name)
    tied = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is tied
    ends = (per_rank[0], per_rank[-1])
    assert [r["tied"]["messages"] for r in ends] == [1, 1]
    assert [r["tied"]["bytes"] for r in ends] == [tied.numel() * 4] * 2
    assert all(r["tied"]["messages"] == 0 for r in per_rank[1:-1])  # the middle stage does not use it
    if path is not None:
        fresh = make_model(kind, seed=7)
        pl.distributed.load_checkpoint(fresh, path)
        for name, param in fresh.named_parameters():
            torch.testing.assert_close(param, dict(model.named_parameters())[name], rtol=1e-4, atol=1e-5, msg=name)


# ---- mistakes, each with a message that names it ---------------------------------------------------------------


@pytest.mark.parametrize("points, sample, error, match", [
    (["transformer.h.9"], None, ValueError, "does not have: \\['transformer.h.9'\\]"),
    (["transformer.h.2", "transformer.h.1"], None, ValueError, "in the order the model's forward runs"),
    (["transformer.h.1", "transformer.h.1"], None, ValueError, r"names \['transformer.h.1'\] more than once \(duplicate"),
    (["transformer"], None, ValueError, "stage 0 would be empty: 'transformer' begins with the model's first"),
    (["transformer.h.1", "transformer.h.1.ln_1"], None, ValueError,
     "stage 1 would be empty: 'transformer.h.1.ln_1' begins at the first operation of 'transformer.h.1'"),
    (["transformer.h.1"], "ids", TypeError, "as a dict"),
])
def test_bad_split_points_or_samples_are_named(points, sample, error, match):
    model, batch = make_model("gpt2"), make_batch("gpt2")
    sample = batch["input_ids"] if sample == "ids" else batch
    with pytest.raises(error, match=match):
        pl.Pipeline(model, n_stages=len(points) + 1, n_microbatches=3, split_points=points, sample=sample,
                    devices="cpu")


def test_a_batch_of_another_shape_steps_and_another_mode_is_refused():
    """Shapes may change from step to step (tests/test_any_shape.py); the mode is fixed in the graph."""
    model, batch = make_model("gpt2"), make_batch("gpt2")
    pipe = pipeline(model, batch)
    longer = {k: torch.cat([v, v], dim=1) for k, v in batch.items()}
    loss, reference = reference_gradients(model, longer)
    assert pipe.step(longer).loss == pytest.approx(loss, rel=1e-5)
    assert_same_gradients(model, reference)
    model.train()
    with pytest.raises(ValueError, match="traced in eval mode"):
        pipe.step(batch)


def test_a_split_point_at_the_first_module_says_stage_0_would_be_empty():
    model, batch = make_model("llama"), make_batch("llama")
    with pytest.raises(ValueError, match="stage 0 would be empty: 'model.embed_tokens' begins with the model's first"):
        pl.Pipeline(model, n_stages=2, n_microbatches=3, split_points=["model.embed_tokens"], sample=batch,
                    devices="cpu")


def test_loss_fn_none_needs_a_model_with_its_own_loss():
    with pytest.raises(TypeError, match="loss_fn=None .* is for a model split by names"):
        pl.Pipeline(pl.models.mlp(depth=4, width=8), n_stages=2, n_microbatches=2, loss_fn=None)


def test_loss_normalization_is_checked_and_tokens_need_labels():
    model, batch = make_model("gpt2"), make_batch("gpt2")
    with pytest.raises(ValueError, match="loss_normalization is one of"):
        pipeline(model, batch, normalization="words")
    pipe = pl.Pipeline(pl.models.mlp(depth=4, width=8), n_stages=2, n_microbatches=2, loss_fn=torch.nn.MSELoss(),
                       loss_normalization="tokens", devices="cpu")
    with pytest.raises(ValueError, match="counts the labels"):
        pipe.step(torch.randn(4, 8), None)


def test_a_micro_batch_without_counted_tokens_is_refused_before_its_loss_is_nan():
    model, batch = make_model("gpt2"), make_batch("gpt2")
    batch["labels"][:2] = -100
    with pytest.raises(ValueError, match="micro-batch 0 has no counted token"):
        pipeline(model, batch).step(batch)


class _ReadsItsParent(torch.nn.Module):
    """A head that keeps a reference to the whole model (not registered) and reads block 0's weight."""

    def __init__(self, parent):
        super().__init__()
        self.__dict__["parent"] = parent

    def forward(self, x):
        return x @ self.parent.blocks[0].weight


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.head = _ReadsItsParent(self)

    def forward(self, x, y):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return torch.nn.functional.mse_loss(self.head(x), y)


def test_a_module_that_reads_another_stages_parameter_shares_it_like_a_tied_weight():
    """The trace finds every parameter a stage reads, wherever it is registered: block 0's weight, read by the head
    through its parent, is used by stages 0 and 3 and gets both uses' gradients."""
    model = _Net()
    batch = {"x": torch.randn(6, 8), "y": torch.randn(6, 8)}
    params = dict(model.named_parameters())
    reference = dict(zip(params, torch.autograd.grad(model(**batch), list(params.values()))))
    pipe = pl.Pipeline(model, n_stages=4, n_microbatches=3, split_points=["blocks.1", "blocks.2", "blocks.3"],
                       sample=batch, devices="cpu")
    shared = model.blocks[0].weight
    assert [s for s, stage in enumerate(pipe.partition.stages) if any(p is shared for p in stage.parameters())] == [0, 3]
    pipe.step(batch)
    assert_same_gradients(model, reference)


def test_a_loss_fn_receives_the_model_output_and_the_targets():
    """ViT without labels in the batch: loss_fn(ModelOutput, targets), the mean cross-entropy of its logits."""
    model, batch = make_model("vit"), make_batch("vit")
    labels = batch.pop("labels")
    loss_fn = lambda output, target: torch.nn.functional.cross_entropy(output.logits, target)  # noqa: E731
    params = dict(model.named_parameters())
    loss = loss_fn(model(**batch), labels)
    reference = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=3, split_points=["vit.layers.2"], sample=batch,
                       loss_fn=loss_fn, devices="cpu")
    assert pipe.step(batch, labels).loss == pytest.approx(loss.item(), rel=1e-5)
    assert_same_gradients(model, reference)


def test_a_model_whose_tensors_were_freed_by_another_pipeline_says_so():
    model, batch = make_model("gpt2"), make_batch("gpt2")
    model.transformer.h[3].to("meta")  # what a DistributedPipeline does to the blocks other ranks keep
    with pytest.raises(ValueError, match="meta device .*build a fresh model"):
        pipeline(model, batch)


def test_stage_costs_are_profiled_for_a_model_split_by_names():
    """Costs.from_profile runs the traced stages as the engine does: seconds per stage, and the bytes of the
    structure each stage sends (the hidden states and what later stages need of the batch)."""
    model, batch = make_model("gpt2"), make_batch("gpt2")
    micro = {k: v[:2] for k, v in batch.items()}
    parts = pl.split(model, split_points=SPLITS["gpt2"][0], sample=micro)  # traced for one micro-batch
    costs = pl.Costs.from_profile(model, parts, (micro, None), None, repeats=2)
    assert len(costs.forward) == 3 and all(t > 0 for t in [*costs.forward, *costs.backward])
    message = parts.stages[0](micro)
    assert costs.activation_bytes[0] == sum(t.numel() * t.element_size() for t in message.values()
                                            if isinstance(t, torch.Tensor))
    assert costs.activation_bytes[0] >= 2 * SEQ * 32 * 4  # at least the hidden states: 2 samples x SEQ x 32 floats
    assert all(p.grad is None for p in model.parameters())  # the profile leaves the model's .grad as it was
