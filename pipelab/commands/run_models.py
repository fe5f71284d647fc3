"""The models `pipelab run` (and `python -m pipelab.launch`) trains, from the `--model` flag.

    --model mlp | gpt                          pipelab's own (`pl.models`): an nn.Sequential of blocks
    --model transformers:gpt2 [--config n_layer=8,n_embd=512]
                                               a Hugging Face causal language model built from its config
                                               (random weights; nothing is downloaded), on random tokens
    --model package.module:factory             factory() -> (model, batch, loss_fn or None): with a loss_fn,
                                               batch is (inputs, targets); with None, the model's keyword
                                               arguments, labels included (the model returns its own loss)

Any model but pipelab's own is split by module names: `--split-points a,b` (where stages 1, 2 begin),
or `--stages p` cuts its repeated blocks by `--split` (`model/partition.py: points_for`).  Every rank
builds the same model: the seed is set before the model is made.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..model import models

OWN = ("mlp", "gpt")


@dataclass
class RunModel:
    model: nn.Module
    inputs: Any
    targets: Any  # None: the labels are in `inputs` and the model computes its own loss
    loss_fn: Callable | None
    loss_normalization: str  # "tokens" for a language model's own loss (padding-exact), else "samples"


def build(args) -> RunModel:
    """The model, batch and loss of `args.model` (module docstring), made after `torch.manual_seed(args.seed)`."""
    torch.manual_seed(args.seed)
    if args.model in OWN:
        if args.config:
            raise ValueError(f"--config is for a Hugging Face model (--model transformers:<type>); {args.model} "
                             "takes --depth and --width")
        model = (models.mlp(depth=args.depth, width=args.width, seed=args.seed) if args.model == "mlp" else
                 models.tiny_gpt(n_layers=args.depth, d_model=args.width, n_heads=4, seed=args.seed))
        inputs, targets = models.sample_batch(model, args.batch_size, seed=args.seed)
        return RunModel(model, inputs, targets, models.default_loss(model), "samples")
    if args.model.startswith("transformers:"):
        return _hugging_face(args.model.split(":", 1)[1], parse_config(args.config), args)
    if ":" in args.model:
        return _factory(args.model)
    raise ValueError(f"--model is one of {list(OWN)}, transformers:<model type> (e.g. transformers:gpt2) or "
                     f"package.module:factory; got {args.model!r}")


def parse_config(text: str | None) -> dict:
    """'n_layer=8,n_embd=512,tie_word_embeddings=false' -> {'n_layer': 8, 'n_embd': 512, 'tie_...': False}."""
    config = {}
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--config takes key=value pairs separated by commas, got {item!r}")
        config[key.strip()] = _value(value.strip())
    return config


def _value(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _hugging_face(model_type: str, config: dict, args) -> RunModel:
    try:
        import transformers
    except ImportError as error:
        raise ImportError("--model transformers:... needs Hugging Face transformers: pip install transformers "
                          "(the dev extra pins the tested version)") from error
    try:
        hf_config = transformers.AutoConfig.for_model(model_type, **config)
    except ValueError as error:
        raise ValueError(f"transformers has no model type {model_type!r} ({error})") from error
    try:
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    except ValueError as error:
        raise ValueError(f"--model transformers:{model_type} builds a causal language model, and {model_type} has "
                         "none; write a factory (--model package.module:factory) for other kinds") from error
    model.eval()  # dropout off: the pipelined step can be compared with the plain one
    ids = torch.randint(0, hf_config.vocab_size, (args.batch_size, args.seq_len),
                        generator=torch.Generator().manual_seed(args.seed))
    return RunModel(model, {"input_ids": ids, "labels": ids.clone()}, None, None, "tokens")


def _factory(spec: str) -> RunModel:
    module_name, _, function_name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--model {spec}: cannot find {function_name} in module {module_name} ({error})") from error
    made = factory()
    if not (isinstance(made, tuple) and len(made) == 3 and isinstance(made[0], nn.Module)):
        raise TypeError(f"--model {spec}: the factory returns (model, batch, loss_fn or None), got "
                        f"{type(made).__name__}")
    model, batch, loss_fn = made
    if loss_fn is None:
        return RunModel(model, batch, None, None, "samples")
    if not (isinstance(batch, tuple) and len(batch) == 2):
        raise TypeError(f"--model {spec}: with a loss_fn, the batch is (inputs, targets), got {type(batch).__name__}")
    return RunModel(model, batch[0], batch[1], loss_fn, "samples")
