"""Hugging Face models built from small configs (no weights are downloaded), their batches and split points,
and what the ranks run in tests/test_your_model.py."""

from __future__ import annotations

import logging

import torch

import pipelab as pl

BATCH, SEQ, VOCAB = 6, 8, 64

# kind -> (the module names where stages 1 and 2 begin, the batch kind)
SPLITS = {
    "gpt2": (["transformer.h.1", "transformer.h.2"], "text"),
    "llama": (["model.layers.1", "model.layers.2"], "text"),
    "llama-untied": (["model.layers.1", "model.layers.2"], "text"),
    "bert": (["bert.encoder.layer.1", "bert.encoder.layer.2"], "masked"),
    "resnet": (["resnet.encoder.stages.1", "resnet.encoder.stages.2"], "image"),
    "vit": (["vit.layers.1", "vit.layers.2"], "image"),
}


def make_model(kind: str, seed: int = 0, n_layers: int = 4):
    """A small model of `kind` (SPLITS), initialised from `seed`, in eval mode (no dropout) unless ResNet."""
    import transformers as hf

    logging.getLogger("transformers").setLevel(logging.ERROR)  # small vocabularies make it warn about token ids
    torch.manual_seed(seed)
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                max_position_embeddings=32)
    if kind == "gpt2":
        model = hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=n_layers, n_embd=32, n_head=2, vocab_size=VOCAB,
                                                 n_positions=32))
    elif kind in ("llama", "llama-untied"):
        model = hf.LlamaForCausalLM(hf.LlamaConfig(num_hidden_layers=n_layers, num_key_value_heads=1,
                                                   tie_word_embeddings=kind == "llama", **text))
    elif kind == "bert":
        model = hf.BertForMaskedLM(hf.BertConfig(num_hidden_layers=n_layers, **text))
    elif kind == "resnet":
        model = hf.ResNetForImageClassification(hf.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 16, 32],
                                                                 depths=[1, 1, 1, 1], num_labels=5))
    elif kind == "vit":
        model = hf.ViTForImageClassification(hf.ViTConfig(num_hidden_layers=n_layers, hidden_size=32,
                                                          intermediate_size=64, num_attention_heads=2,
                                                          image_size=16, patch_size=4, num_labels=5))
    else:
        raise ValueError(kind)
    return model.eval()


def make_batch(kind: str, padded: bool = False, seed: int = 1) -> dict:
    """BATCH samples for `kind`'s model; `padded`: text rows of different lengths, padding labelled -100."""
    g = torch.Generator().manual_seed(seed)
    batch_kind = SPLITS[kind][1]
    if batch_kind == "image":
        size = 32 if kind == "resnet" else 16  # ResNet: 2 x 2 pixels left in its last stage, not 1 (BatchNorm over 2)
        return {"pixel_values": torch.randn(BATCH, 3, size, size, generator=g),
                "labels": torch.randint(0, 5, (BATCH,), generator=g)}
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    lengths = torch.tensor([SEQ, 2, SEQ, 3, SEQ, SEQ]) if padded else torch.full((BATCH,), SEQ)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    if batch_kind == "masked":  # BERT predicts a few tokens; the rest are not counted
        labels = labels.masked_fill(torch.rand(BATCH, SEQ, generator=g) > 0.5, -100)
        labels[:, 0] = ids[:, 0].masked_fill(mask[:, 0] == 0, -100)  # every sample counts at least one token
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def reference_gradients(model, batch: dict, n_microbatches: int = 1) -> tuple[float, dict]:
    """The single-device step, by hand: the mean of the model's own loss over `n_microbatches` equal chunks
    (1: the whole batch at once); the loss and a copy of every gradient."""
    cut = [i * BATCH // n_microbatches for i in range(n_microbatches + 1)]
    chunks = [{k: v[a:b] for k, v in batch.items()} for a, b in zip(cut, cut[1:])]
    params = dict(model.named_parameters())
    total = sum(model(**chunk).loss for chunk in chunks) / len(chunks)
    grads = torch.autograd.grad(total, list(params.values()), allow_unused=True)
    return total.item(), {n: g.clone() for n, g in zip(params, grads) if g is not None}


def gradients_of(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run_tied_training(kind: str, schedule: str, n_steps: int, path: str | None) -> dict:
    """On every rank: `n_steps` SGD steps of `kind` split over the ranks by SPLITS; the loss, this rank's
    gradients of the last step and parameters after it, the bytes of the 'tied' all-reduce; then, with `path`,
    a checkpoint saved by every rank."""
    import torch.distributed as dist

    n = dist.get_world_size()
    model, batch = make_model(kind), make_batch(kind, padded=True)
    pipe = pl.DistributedPipeline(model, n_microbatches=3, schedule=schedule, split_points=SPLITS[kind][0][:n - 1],
                                  sample=batch, loss_normalization="tokens")
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(n_steps):
        optimizer.zero_grad(set_to_none=True)
        with pipe.count_communication() as counter:
            losses.append(pipe.step(batch).loss)
        grads = gradients_of(model)
        optimizer.step()
    if path is not None:
        pipe.save_checkpoint(path, optimizer)
    return {"losses": losses, "grads": grads, "tied": counter.totals()["tied"],
            "params": {n: p.detach().clone() for n, p in model.named_parameters() if p.device.type != "meta"}}


def cli_factory():
    """For `pipelab run --model your_model_cases:cli_factory`: an untied Llama, a padded batch, its own loss."""
    return make_model("llama-untied"), make_batch("llama-untied", padded=True), None
