"""The models `pipelab run` (and `python -m pipelab.launch`) trains, from the `--model` flag.

    --model mlp | gpt                          pipelab's own (`pl.models`): an nn.Sequential of blocks
    --model transformers:gpt2 [--config n_layer=8,n_embd=512]
                                               a Hugging Face causal language model built from its config
                                               (random weights; nothing is downloaded), on random tokens
    --model package.module:factory             your model and your data (below)

A factory is a function without arguments that returns one of:

    (model, batch, loss_fn)                    one batch, trained on for --steps steps
    (model, loader, loss_fn)                   a training run over the loader's batches for --epochs epochs
    (model, loader, loss_fn, held_out)         ... and the held-out batches evaluated (forward only) at the
                                               end and every --eval-every steps

`loss_fn` None: the model computes its own loss, and a batch is a dict of its keyword arguments, labels
included (what Hugging Face's collators give).  With a `loss_fn`, a batch is an (inputs, targets) pair.
A *batch* is a dict, a tensor or a tuple; anything else that iterates (a `torch.utils.data.DataLoader`,
a list of batches) is a *loader*, and must start over each time it is iterated (a DataLoader does; a
generator does not, so it is refused).  Its batches may change size and length from step to step
(dynamic padding, a partial last batch): the run is `pl.train`'s (`runtime/training_run.py`), which
seeds each epoch with `--seed` + epoch, so every rank draws the same shuffled order.

Any model but pipelab's own is split by module names: `--split-points a,b` (where stages 1, 2 begin),
or `--stages p` cuts its repeated blocks by `--split` (`model/partition.py: points_for`).  Every rank
builds the same model and data: the seed is set before the factory is called.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..model import models

OWN = ("mlp", "gpt")


@dataclass
class RunModel:
    model: nn.Module
    inputs: Any  # one batch's inputs; with a loader, its first batch's (what a split by names is traced on)
    targets: Any  # None: the labels are in `inputs` and the model computes its own loss
    loss_fn: Callable | None
    batches: Iterable | None = None  # a loader: train over it (`pl.train`); None: the one batch, --steps times
    held_out: Iterable | None = None  # batches to evaluate on (a factory's fourth element)


def build(args) -> RunModel:
    """The model, data and loss of `args.model` (module docstring), made after `torch.manual_seed(args.seed)`."""
    torch.manual_seed(args.seed)
    if args.model in OWN:
        if args.config:
            raise ValueError(f"--config is for a Hugging Face model (--model transformers:<type>); {args.model} "
                             "takes --depth and --width")
        model = (models.mlp(depth=args.depth, width=args.width, seed=args.seed) if args.model == "mlp" else
                 models.tiny_gpt(n_layers=args.depth, d_model=args.width, n_heads=4, seed=args.seed))
        inputs, targets = models.sample_batch(model, args.batch_size, seed=args.seed)
        return RunModel(model, inputs, targets, models.default_loss(model))
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


# What every config takes besides its fields (PreTrainedConfig pops them): how to run, not what to build.
COMMON_KEYS = ("attn_implementation", "experts_implementation", "output_attentions", "torch_dtype", "num_labels",
               "rope_scaling", "rope_theta", "name_or_path")


def hugging_face_config(transformers, model_type: str, config: dict):
    """`model_type`'s config built from `config`, each key checked against its config class first: a misspelt key
    (which transformers would keep as a stray attribute, building the default model) or a value of the wrong type
    is a ValueError naming the key and the class's closest keys, before any model is built or traced."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=3)
        raise ValueError(f"transformers has no model type {model_type!r}" +
                         (f" (did you mean {', '.join(close)}?)" if close else ""))
    cls = CONFIG_MAPPING[model_type]
    known = _config_keys(cls)
    for key in config:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = (f"did you mean {' or '.join(close)}?" if close
                    else f"its keys include {', '.join(sorted(known)[:12])}")
            raise ValueError(f"--config {key}: {cls.__name__} has no key {key!r} ({hint})")
    try:
        return transformers.AutoConfig.for_model(model_type, **config)
    except Exception as error:  # noqa: BLE001 - huggingface_hub's StrictDataclassError is no ValueError
        field = getattr(error, "field", None)
        said = f"{field}={config[field]}" if field in config else ",".join(f"{k}={v}" for k, v in config.items())
        reason = str(error).strip().splitlines()[-1].strip()  # "TypeError: Field 'n_layer' expected int, got str ..."
        raise ValueError(f"--config {said}: {cls.__name__} refuses it: {reason}") from error


def _config_keys(cls: type) -> set[str]:
    """The keys a config class takes: its fields (its __init__'s parameters before transformers 5), their
    aliases (`attribute_map`: GPT-2's num_hidden_layers is n_layer) and `COMMON_KEYS`."""
    try:
        own = {f.name for f in fields(cls)}
    except TypeError:  # not a dataclass
        own = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
    return own | set(getattr(cls, "attribute_map", {})) | set(COMMON_KEYS)


def _hugging_face(model_type: str, config: dict, args) -> RunModel:
    try:
        import transformers
    except ImportError as error:
        raise ImportError("--model transformers:... needs Hugging Face transformers: pip install transformers "
                          "(the dev extra pins the tested version)") from error
    hf_config = hugging_face_config(transformers, model_type, config)
    try:
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    except ValueError as error:
        raise ValueError(f"--model transformers:{model_type} builds a causal language model, and {model_type} has "
                         "none; write a factory (--model package.module:factory) for other kinds") from error
    model.eval()  # dropout off: the pipelined step can be compared with the plain one
    ids = torch.randint(0, hf_config.vocab_size, (args.batch_size, args.seq_len),
                        generator=torch.Generator().manual_seed(args.seed))
    return RunModel(model, {"input_ids": ids, "labels": ids.clone()}, None, None)


def _factory(spec: str) -> RunModel:
    module_name, _, function_name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--model {spec}: cannot find {function_name} in module {module_name} ({error})") from error
    contract = "returns (model, batch or loader, loss_fn or None[, held-out batches])"
    if not callable(factory):
        raise TypeError(f"--model {spec}: {function_name} is a {type(factory).__name__}, not a factory: a function "
                        f"called with no arguments that {contract}")
    try:
        inspect.signature(factory).bind()
    except TypeError as error:
        raise TypeError(f"--model {spec}: {function_name}() cannot be called with no arguments ({error}): a factory "
                        f"takes none and {contract}") from None
    except ValueError:  # a builtin without a signature: call it and see
        pass
    made = factory()
    if not (isinstance(made, tuple) and len(made) in (3, 4) and isinstance(made[0], nn.Module)):
        raise TypeError(f"--model {spec}: the factory returns (model, batch or loader, loss_fn or None[, held-out "
                        f"batches]), got {_described(made)}")
    model, data, loss_fn = made[:3]
    held_out = made[3] if len(made) == 4 else None
    if is_batch(data):
        if held_out is not None:
            raise TypeError(f"--model {spec}: held-out batches come with a loader; this factory returns one batch "
                            f"({type(data).__name__}) as its second element")
        return _one_batch(spec, model, data, loss_fn)
    loader = _reiterable(spec, data, "second")
    if held_out is not None:
        _reiterable(spec, held_out, "fourth (the held-out batches)")
    first = next(iter(loader), None)
    if first is None:
        raise ValueError(f"--model {spec}: the factory's loader gives no batch")
    made = _one_batch(spec, model, first, loss_fn)
    made.batches, made.held_out = loader, held_out
    return made


def is_batch(data: Any) -> bool:
    """A batch (a dict, a tensor, a tuple), not a loader of batches."""
    return isinstance(data, (dict, torch.Tensor, tuple))


def _reiterable(spec: str, data: Any, which: str) -> Iterable:
    try:
        iterator = iter(data)
    except TypeError:
        raise TypeError(f"--model {spec}: the factory's {which} element is neither a batch (a dict, a tensor, an "
                        f"(inputs, targets) tuple) nor a loader of batches, got {type(data).__name__}") from None
    if iterator is data:
        raise TypeError(f"--model {spec}: the factory's {which} element is a one-pass iterator "
                        f"({type(data).__name__}): a loader must start over for every epoch (return a DataLoader, a "
                        "list of batches, or an object whose __iter__ starts again)")
    return data


def _one_batch(spec: str, model: nn.Module, batch: Any, loss_fn: Callable | None) -> RunModel:
    if loss_fn is None:
        return RunModel(model, batch, None, None)
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise TypeError(f"--model {spec}: with a loss_fn, a batch is (inputs, targets), got {_described(batch)}")
    return RunModel(model, batch[0], batch[1], loss_fn)


def _described(value: Any) -> str:
    return f"{type(value).__name__}{f' of {len(value)}' if isinstance(value, (tuple, list)) else ''}"
