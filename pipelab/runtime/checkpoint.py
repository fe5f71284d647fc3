"""Checkpoints in PyTorch's own format, `torch.distributed.checkpoint` (DCP).

A checkpoint is a directory: `path/.metadata` (every key, its shape and dtype, and where its
bytes are; rank 0 writes it) and one `.distcp` file per rank (`path/__0_0.distcp` ...), all
ranks writing at once.  Its keys are names in the *full* model, never a stage or a rank
(`model.<name>`, `optim.state.<name>.<key>`, `optim.param_groups.<name>.<key>`: torch's
flattened optimizer state dict), so any layout reads it back: each rank asks for the names
of its own blocks, one process with the whole model for all of them.

Details (the keys with examples, why DCP rather than gathering to rank 0): docs/distributed.md,
"Checkpoints".
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..common.errors import PipelineError

# hyper-parameters that name the parameters of a group: they belong to one layout, so they are not saved
_GROUP_KEYS_NOT_SAVED = ("params", "param_names")


def _dcp():
    """torch.distributed.checkpoint, imported when first used: it adds about a second to `import pipelab`."""
    import torch.distributed.checkpoint

    return torch.distributed.checkpoint


def _is_tensor_entry(entry) -> bool:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return isinstance(entry, TensorStorageMetadata)


class CheckpointError(PipelineError):
    """A checkpoint that does not fit: written for another model, or without the optimizer state asked for."""


def save(pipe, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write this rank's share of the model (and of `optimizer`'s state) to the checkpoint directory `path`.

    Call it on every rank of the pipeline, with the same `path`; each rank writes its own
    file at the same time.  `optimizer` holds this rank's parameters (`pipe.parameters()`).
    """
    _check_pipeline(pipe, "save")
    state = {"model": _owned(pipe.model)}
    if optimizer is not None:
        state["optim"] = _flat_optimizer_state(pipe.model, optimizer)
    _dcp().save(state, checkpoint_id=Path(path), process_group=pipe.group)


def load(pipe, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Read the checkpoint at `path` into this rank's blocks (and `optimizer`): each rank reads only its keys.

    Call it on every rank, with the same `path`.  The checkpoint may come from any number
    of stages, or from one process; the model must be the same (same names and shapes).
    """
    _check_pipeline(pipe, "load")
    _load(pipe.model, path, optimizer, pipe.group)


def load_into_model(model: nn.Module, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Read the checkpoint at `path` into a whole model on one device (and its `optimizer`); no process group needed."""
    freed = [name for name, tensor in model.state_dict().items() if tensor.device.type == "meta"]
    if freed:
        raise CheckpointError(f"the model has tensors on the meta device ({freed[0]}, ...): it is a pipeline rank's "
                              "copy; use checkpoint.load(pipe, path) on every rank, or build a whole model")
    _load(model, path, optimizer, None)


def _load(model: nn.Module, path, optimizer, group) -> None:
    saved = _read_metadata(path).state_dict_metadata
    _check_model(model, saved, path)  # on every key, not only this rank's: all ranks fail alike, before communicating
    state = {"model": _owned(model)}  # this rank's tensors: DCP copies the saved values into them, in place
    if optimizer is not None:
        state["optim"] = _empty_optimizer_state(model, optimizer, saved, path)
    with warnings.catch_warnings():  # no_dist=True still warns that there is no process group: that is the point
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        _dcp().load(state, checkpoint_id=Path(path), process_group=group, no_dist=group is None)
    if optimizer is not None:
        optimizer.load_state_dict(_unflatten(model, optimizer, state["optim"]))


# ---- the model ---------------------------------------------------------------------------------------------

def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict with each tensor once, under its first name: a tied weight (GPT-2's `lm_head.weight`
    is `transformer.wte.weight`) is saved and loaded once."""
    seen: set[int] = set()
    first = [name for name, t in model.state_dict(keep_vars=True).items() if not (id(t) in seen or seen.add(id(t)))]
    state = model.state_dict()
    return {name: state[name] for name in first}


def _owned(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors without the blocks other ranks keep (those are on the meta device here)."""
    return {name: tensor for name, tensor in _state(model).items() if tensor.device.type != "meta"}


def _check_model(model: nn.Module, saved: dict, path) -> None:
    expected = _state(model)  # the meta tensors too: every rank knows every name and shape
    missing = [name for name in expected if f"model.{name}" not in saved]
    if missing:
        mine = sum(expected[name].device.type != "meta" for name in missing)
        raise CheckpointError(f"the checkpoint at {path} has no '{missing[0]}' ({len(missing)} of the model's "
                              f"{len(expected)} tensors are missing, {mine} of them held by this process). "
                              "Was it saved from another model?")
    for name, tensor in expected.items():
        entry = saved[f"model.{name}"]
        if not _is_tensor_entry(entry) or tuple(entry.size) != tuple(tensor.shape):
            found = f"shape {tuple(entry.size)}" if _is_tensor_entry(entry) else "no tensor"
            raise CheckpointError(f"'{name}' has shape {tuple(tensor.shape)} in the model but {found} in the "
                                  f"checkpoint at {path}: it was saved from another model")


# ---- the optimizer: state keyed by parameter name -------------------------------------------------------

def _names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[dict, list[str]]]:
    """For each of the optimizer's param groups: the group and the names of its parameters in `model`."""
    name_of = {param: name for name, param in model.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        names = []
        for param in group["params"]:
            if param not in name_of:
                raise CheckpointError(f"the optimizer holds a parameter of shape {tuple(param.shape)} that is "
                                      "not in the model; build it from the model's (or the pipeline's) parameters")
            if param.device.type == "meta":
                raise CheckpointError(f"the optimizer holds {name_of[param]}, a parameter this rank does not keep; "
                                      "build it from pipe.parameters()")
            names.append(name_of[param])
        groups.append((group, names))
    return groups


def _flat_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    flat = {}
    for group, names in _names(model, optimizer):
        hyper = {key: value for key, value in group.items() if key not in _GROUP_KEYS_NOT_SAVED}
        for name, param in zip(names, group["params"]):
            for key, value in optimizer.state.get(param, {}).items():
                if not isinstance(value, (torch.Tensor, int, float)) or "." in str(key):
                    raise TypeError(f"optimizer state {key!r} of {name} is a {type(value).__name__}; checkpoints hold "
                                    "tensor and number states under plain keys (Adam, AdamW, SGD with momentum, ...)")
                flat[f"state.{name}.{key}"] = value
            flat.update({f"param_groups.{name}.{key}": value for key, value in hyper.items()})
    return flat


def _empty_optimizer_state(model: nn.Module, optimizer, saved: dict, path) -> dict[str, Any]:
    """What DCP fills in: this rank's optimizer keys, with empty tensors of the saved shapes."""
    saved_by_name = _by_name(key[len("optim."):] for key in saved if key.startswith("optim."))
    if not saved_by_name:
        raise CheckpointError(f"the checkpoint at {path} holds no optimizer state (saved without optimizer=); "
                              "load it without an optimizer")
    wanted = {}
    for _group, names in _names(model, optimizer):
        for name in names:
            if ("param_groups", name) not in saved_by_name:
                raise CheckpointError(f"the checkpoint at {path} has no optimizer state for {name}: was that "
                                      "parameter left out of the optimizer when it was saved?")
            for key in saved_by_name[("param_groups", name)] + saved_by_name.get(("state", name), []):
                entry = saved[f"optim.{key}"]
                wanted[key] = (torch.empty(entry.size, dtype=entry.properties.dtype)
                               if _is_tensor_entry(entry) else None)  # (None: a number, read as such)
    return wanted


def _unflatten(model: nn.Module, optimizer, flat: dict[str, Any]) -> dict:
    """The loaded name-keyed state as `optimizer.load_state_dict` wants it (parameters numbered in group order)."""
    loaded = {section_and_name: {key.rpartition(".")[2]: flat[key] for key in keys}
              for section_and_name, keys in _by_name(flat).items()}
    state, groups, index = {}, [], 0
    for group, names in _names(model, optimizer):
        hyper = loaded[("param_groups", names[0])] if names else {}
        for name in names:
            if not _same(loaded[("param_groups", name)], hyper):
                raise CheckpointError(f"{name} was saved with other hyper-parameters than {names[0]}, its group's "
                                      "first parameter: build the optimizer's param groups as when it was saved")
            if ("state", name) in loaded:  # (a parameter never stepped has no state)
                state[index] = loaded[("state", name)]
            index += 1
        groups.append({**group, **hyper, "params": list(range(index - len(names), index))})
    return {"state": state, "param_groups": groups}


def _by_name(keys) -> dict[tuple[str, str], list[str]]:
    """Flat optimizer keys by section and parameter: "state.3.0.weight.exp_avg" -> ("state", "3.0.weight")."""
    found = {}
    for key in keys:
        section, _, rest = key.partition(".")
        name = rest.rpartition(".")[0]  # the last part, the state's or hyper-parameter's own key, has no dot
        found.setdefault((section, name), []).append(key)
    return found


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
        for k in a)


# ---- checks --------------------------------------------------------------------------------------------------

def _check_pipeline(pipe, verb: str) -> None:
    if isinstance(pipe, nn.Module) or not hasattr(pipe, "group"):
        hint = ("for a whole model in one process use load_into_model(model, path)" if verb == "load" else
                "a whole model in one process can be a 1-stage pipeline, under pl.distributed.launch(fn, 1)")
        raise TypeError(f"checkpoint.{verb} takes a DistributedPipeline, got {type(pipe).__name__}; {hint}")


def _read_metadata(path):
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} is not a pipelab checkpoint (a torch.distributed.checkpoint directory): it "
                              "has no .metadata file (rank 0 writes it last: did the save finish?)")
    return _dcp().FileSystemReader(path).read_metadata()
