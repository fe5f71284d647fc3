"""Checkpoints in PyTorch's own format, `torch.distributed.checkpoint` (DCP).

A checkpoint is a directory: `path/.metadata` (every key, its shape and dtype, and where its
bytes are; rank 0 writes it) and one `.distcp` file per rank (`path/__0_0.distcp` ...), all
ranks writing at once.  Its keys are names in the *full* model, never a stage or a rank
(`model.<name>`, `optim.state.<name>.<key>`, `optim.param_groups.<name>.<key>`: torch's
flattened optimizer state dict), so any layout reads it back: each rank asks for the names
of its own blocks, one process with the whole model for all of them.  Under a hybrid layout every rank of
the mesh writes together, and a `shard="fsdp"` rank writes and reads only its rows of each tensor (`sharded.py`).

A checkpoint is whole or refused.  A save writes into a new directory beside `path`
(`<path>.tmp-<id>`, the id chosen by rank 0), and once every rank's files are complete rank 0
adds the manifest (the size and checksums of every file, the optimizer's class:
checkpoint_manifest.py) and renames the directory into place; a rank that dies before leaves
`path` as it was.  An existing `path` is replaced only with `overwrite=True`, and only once the
new checkpoint is complete.  Loading checks the files against the manifest (a checkpoint of an
older pipelab, without one, loads with a warning) and the optimizer against the one it was
saved from.  Every failure, DCP's own included, is a `CheckpointError` whose message begins
with the cause and names the path; the original exception is its `__cause__`.

Details (the keys with examples, why DCP rather than gathering to rank 0): docs/distributed.md,
"Checkpoints".
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import traceback
import uuid
import warnings
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...common.errors import PipelineError
from ...predict.budget import format_bytes
from . import manifest as checkpoint_manifest
from . import sharded
from .manifest import DamagedCheckpoint

# an optimizer built from the model's parameters before the pipeline sharded them
_REPLACED = (" (shard=\"fsdp\" and tensor parallelism replace the model's parameters with sharded ones, DTensors: "
             "build the optimizer after the pipeline, from pipe.parameters())")

# hyper-parameters that name the parameters of a group: they belong to one layout, so they are not saved
_GROUP_KEYS_NOT_SAVED = ("params", "param_names")


def _dcp():
    """torch.distributed.checkpoint, imported when first used: it adds about a second to `import pipelab`."""
    import torch.distributed.checkpoint

    return torch.distributed.checkpoint


def _is_tensor_entry(entry) -> bool:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return isinstance(entry, TensorStorageMetadata)


def _dcp_exception() -> type:
    """DCP's CheckpointException: a BaseException, not an Exception (so `except Exception` misses it)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


class CheckpointError(PipelineError):
    """A checkpoint that cannot be written or read: it does not fit (another model, another optimizer), it is
    damaged, it exists already, or the file system failed (the cause first in the message, and as `__cause__`)."""


class CheckpointMismatchError(CheckpointError):
    """A whole checkpoint that does not fit what it is loaded into: another model (a name or a shape), another
    optimizer, or extra state it was saved without.  Not damage: setting it aside would not help."""


def save(pipe, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
         overwrite: bool = False, extra: dict[str, Any] | None = None) -> None:
    """Write this rank's share of the model (and of `optimizer`'s state) to the checkpoint directory `path`.

    Call it on every rank of the pipeline, with the same `path`; each rank writes its own
    file at the same time.  `optimizer` holds this rank's parameters (`pipe.parameters()`).
    The checkpoint appears at `path` whole, once every rank's file is complete, or not at all.
    A checkpoint already at `path` is refused unless `overwrite=True`; then it stays, loadable,
    until the new one is complete.  Any failure raises the same `CheckpointError` on every rank.
    `extra`: more state saved with it, the same on every rank (a training run's place in its data, a
    scheduler's state, the random state: {name: a number, a string or a tensor}).  A pipeline in one process
    (`pl.Pipeline`, its `group` None) writes the same checkpoint alone.
    """
    _check_pipeline(pipe, "save")
    target, group = Path(os.path.abspath(path)), sharded.group_of(pipe)
    lead, made, committed = _rank(group) == 0, [], False
    state: dict[str, Any] = {}

    def prepare():  # on every rank; rank 0 also claims a new directory beside the target
        state["model"] = _owned(pipe.model)
        if optimizer is not None:
            state["optim"] = _flat_optimizer_state(pipe.model, optimizer)
        if extra is not None:
            state["extra"] = dict(extra)
        if lead:
            made.append(_claim(target, overwrite))
        return made[0] if lead else None, _class_name(optimizer)

    try:
        shared = _together(group, prepare, "saving", path)
        (tmp, replacing), classes = shared[0][0], [name for _, name in shared]
        tmp = Path(tmp)
        if len(set(classes)) > 1:
            held = ", ".join(f"{name or 'none'} on rank {rank}" for rank, name in enumerate(classes))
            raise CheckpointError(f"the ranks hold different optimizers ({held}): each rank passes its own "
                                  f"optimizer of one kind, or none (while saving the checkpoint at {path})")
        with warnings.catch_warnings():  # no_dist=True warns that there is no process group: that is the point
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            _dcp_call(lambda: _dcp().save(state, storage_writer=_dcp().FileSystemWriter(tmp), process_group=group,
                                          no_dist=group is None), "saving", path, group)

        def describe():  # each rank checksums its share of the files, rank 0 writes the manifest
            metadata = _dcp().FileSystemReader(tmp).read_metadata()
            files = checkpoint_manifest.files_of(metadata)
            return checkpoint_manifest.describe(tmp, files[_rank(group)::_world(group)], metadata)

        records = {name: record for part in _together(group, describe, "saving", path) for name, record in part.items()}
        manifest = checkpoint_manifest.make(dict(sorted(records.items())), classes[0])
        _together(group, lambda: _commit(tmp, target, replacing, manifest) if lead else None, "saving", path)
        committed = True
    finally:
        if lead and made and not committed:
            shutil.rmtree(made[0][0], ignore_errors=True)


def load(pipe, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
         extra: dict[str, Any] | None = None) -> None:
    """Read the checkpoint at `path` into this rank's blocks (and `optimizer`): each rank reads only its keys.

    Call it on every rank, with the same `path`.  The checkpoint may come from any number
    of stages, or from one process; the model must be the same (same names and shapes).
    `extra`: {name: a value of the kind saved}, filled in place with what `save(..., extra=)` wrote.
    """
    _check_pipeline(pipe, "load")
    _load(pipe.model, path, optimizer, sharded.group_of(pipe), extra)


def load_into_model(model: nn.Module, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Read the checkpoint at `path` into a whole model on one device (and its `optimizer`); no process group needed."""
    freed = [name for name, tensor in model.state_dict().items() if tensor.device.type == "meta"]
    if freed:
        raise CheckpointError(f"the model has tensors on the meta device ({freed[0]}, ...): it is a pipeline rank's "
                              "copy; use checkpoint.load(pipe, path) on every rank, or build a whole model")
    _load(model, path, optimizer, None)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _load(model: nn.Module, path, optimizer, group, extra: dict | None = None) -> None:
    # the checks before reading look at every key and file, not only this rank's: all ranks fail alike, before
    # communicating; an item's checksum, checked as DCP reads it, fails inside DCP, which tells every rank
    manifest = _read_manifest(path)
    metadata = _read_metadata(path)
    saved = metadata.state_dict_metadata
    _check_model(model, saved, path)
    state = {"model": _owned(model)}  # this rank's tensors: DCP copies the saved values into them, in place
    if optimizer is not None:
        _check_optimizer_class(optimizer, manifest, path)
        state["optim"] = _empty_optimizer_state(model, optimizer, saved, path)
    if extra is not None:
        missing = [key for key in extra if f"extra.{key}" not in saved]
        if missing:
            raise CheckpointMismatchError(f"the checkpoint at {path} holds no {missing[0]!r} among its extra state "
                                          "(it was saved without it: by another version, or not by a training run)")
        state["extra"] = extra
    reader = (_dcp().FileSystemReader(path) if manifest is None else
              checkpoint_manifest.verifying_reader(path, manifest, metadata))
    with warnings.catch_warnings():  # no_dist=True still warns that there is no process group: that is the point
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        _dcp_call(lambda: _dcp().load(state, storage_reader=reader, process_group=group, no_dist=group is None),
                  "loading", path, group)
    if optimizer is not None:
        optimizer.load_state_dict(_unflatten(model, optimizer, state["optim"]))


# ---- writing whole or not at all -------------------------------------------------------------------------

def _claim(target: Path, overwrite: bool) -> tuple[str, bool]:
    """On rank 0, before anything is written: may `target` be written (replaced: the bool)?  A new empty
    directory beside it for the ranks to write into."""
    replacing = False
    if target.is_dir() and any(target.iterdir()):
        if not (target / checkpoint_manifest.METADATA).is_file():
            raise CheckpointError(f"{target} exists and is not a checkpoint (it has files but no .metadata): "
                                  "not writing over it; save to another path")
        if not overwrite:
            raise CheckpointError(f"there is already a checkpoint at {target}: pass overwrite=True to replace it "
                                  "(the old one stays until the new one is complete), or save to another path")
        replacing = True
    elif target.exists() and not target.is_dir():
        raise CheckpointError(f"{target} exists and is a file, not a checkpoint directory: save to another path")
    tmp = target.with_name(f"{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    return str(tmp), replacing  # (an empty directory at target is replaced by the rename)


def _commit(tmp: Path, target: Path, replacing: bool, manifest: dict) -> None:
    """On rank 0, once every rank's files are complete: the manifest, then the rename that makes it a checkpoint.
    The old checkpoint is renamed aside first and deleted after: a crash between the two renames leaves it
    whole at `<target>.old-<id>`."""
    with open(tmp / checkpoint_manifest.NAME, "w") as file:
        json.dump(manifest, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    _sync_directory(tmp)
    old = target.with_name(f"{target.name}.old-{tmp.name.rpartition('-')[2]}") if replacing else None
    if old is not None:
        os.rename(target, old)
    try:
        os.rename(tmp, target)
    except BaseException:
        if old is not None:
            os.rename(old, target)
        raise
    _sync_directory(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _sync_directory(directory: Path) -> None:
    """Make a directory's entries (new files, a rename) durable; a file system that cannot is left as it is."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _class_name(optimizer) -> str | None:
    return None if optimizer is None else f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


# ---- failures: the same on every rank, the cause first ----------------------------------------------------

def _together(group, local: Callable[[], Any], doing: str, path) -> list:
    """`local()` on every rank of `group`, and every rank's result on every rank; if it raised anywhere, the
    same CheckpointError on every rank (the first failing rank's error), so that no rank waits for another."""
    try:
        mine = (True, local())
    except Exception as error:  # (a BaseException such as KeyboardInterrupt ends this rank, and the run)
        mine = (False, error)
    if group is None:  # one process
        if mine[0]:
            return [mine[1]]
        raise _failure(mine[1], doing, path)
    results = [None] * dist.get_world_size(group)
    dist.all_gather_object(results, mine if mine[0] else (False, _portable(mine[1])), group=group)
    failed = [rank for rank, (ok, _) in enumerate(results) if not ok]
    if not failed:
        return [value for _, value in results]
    first = failed[0]
    error = mine[1] if first == dist.get_rank(group) else results[first][1]
    raise _failure(error, doing, path, on=f"rank {first}" if dist.get_world_size(group) > 1 else None)


def _portable(error: Exception) -> Exception:
    """`error`, or its type and words if it would not cross to another rank (pickled and rebuilt)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def _dcp_call(call: Callable[[], Any], doing: str, path, group) -> Any:
    """A call into DCP, whose failures (its CheckpointException is a BaseException) become a CheckpointError."""
    try:
        return call()
    except BaseException as error:
        if not isinstance(error, (Exception, _dcp_exception())):
            raise
        raise _failure(error, doing, path, several=group is not None and dist.get_world_size(group) > 1)


def _failure(error: BaseException, doing: str, path, on: str | None = None, several: bool = False) -> CheckpointError:
    """The CheckpointError for `error`: its cause first (type and words), then what failed and where.
    DCP's CheckpointException is unwrapped to its first failing rank's exception, which becomes `__cause__`."""
    if isinstance(error, _dcp_exception()) and error.failures:
        first = min(error.failures)
        error, stack = error.failures[first]
        on = f"rank {first}" if several else on
        if error.__traceback__ is None and stack:  # it came from another rank: keep where, for whoever reads it
            error.add_note(f"(raised in DCP on rank {first}, at:\n{''.join(traceback.format_list(stack))})")
    if isinstance(error, CheckpointError):  # (pipelab's own words already: a refusal, or a failure said once)
        return error
    where = f" on {on}" if on else ""
    if isinstance(error, DamagedCheckpoint):
        failure = CheckpointError(f"the checkpoint at {path} is damaged: {error}")
    elif _short_write(error):
        failure = CheckpointError(f"the disk holding {path} is full, or refused a write ({_free(path)} free there "
                                  f"as it failed): free space or save elsewhere; the checkpoint that was at the "
                                  f"path, if any, is kept ({type(error).__name__}: {error}, while {doing} it{where})")
    else:
        words = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        failure = CheckpointError(f"{words} (while {doing} the checkpoint at {path}{where})")
    failure.__cause__ = error
    failure.__suppress_context__ = True
    return failure


def _short_write(error: BaseException) -> bool:
    """A write the disk did not take: ENOSPC (or a quota's EDQUOT) anywhere in the chain, or torch's zip writer
    finding its file shorter than it wrote ("unexpected pos", inline_container.cc), which is how a full disk
    shows through `torch.save` (an fwrite that came up short; errno is not kept)."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            return True
        if "unexpected pos" in str(error) or "No space left on device" in str(error):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _free(path) -> str:
    """The free bytes on the file system that holds `path` (or its nearest existing parent), in words."""
    where = Path(path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        return format_bytes(shutil.disk_usage(where).free)
    except OSError:
        return "unknown bytes"


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
    """Every tensor of the model, by name and shape, in the checkpoint (else a `CheckpointMismatchError` saying
    what differs, and what to do: build the model it was saved from)."""
    expected = _state(model)  # the meta tensors too: every rank knows every name and shape
    fix = "build the model it was saved from (the same blocks and widths), or load another checkpoint"
    missing = [name for name in expected if f"model.{name}" not in saved]
    if missing:
        mine = sum(expected[name].device.type != "meta" for name in missing)
        raise CheckpointMismatchError(f"the checkpoint at {path} has no '{missing[0]}' ({len(missing)} of the "
                                      f"model's {len(expected)} tensors are missing, {mine} of them held by this "
                                      f"process): it was saved from another model; {fix}")
    for name, tensor in expected.items():
        entry = saved[f"model.{name}"]
        if not _is_tensor_entry(entry) or tuple(entry.size) != tuple(tensor.shape):
            found = f"shape {tuple(entry.size)}" if _is_tensor_entry(entry) else "no tensor"
            raise CheckpointMismatchError(f"'{name}' has shape {tuple(tensor.shape)} in the model but {found} in the "
                                          f"checkpoint at {path}: it was saved from another model; {fix}")


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
                                      "not in the model; build it from the model's (or the pipeline's) parameters"
                                      + _REPLACED * (not isinstance(param, DTensor) and sharded.is_sharded(model)))
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


def _check_optimizer_class(optimizer, manifest: dict | None, path) -> None:
    """The optimizer's class against the one the checkpoint was saved from (in its manifest; an older checkpoint
    has none, and only its state keys are checked, by `_empty_optimizer_state`)."""
    if manifest is None or manifest.get("optimizer") is None:
        return  # (saved without an optimizer: `_empty_optimizer_state` says so)
    was, here = manifest["optimizer"], _class_name(optimizer)
    if was != here:
        raise CheckpointMismatchError(f"the checkpoint at {path} holds the state of {_a(was)} optimizer ({was}), "
                                      f"not of {_a(here)} ({here}): build the optimizer it was saved with (the "
                                      "saved hyper-parameters replace its own), or load without optimizer=")


def _a(class_name: str) -> str:
    """"an Adam", "a SGD": the class's own name, after its article."""
    short = class_name.rpartition(".")[2]
    return f"{'an' if short[:1] in 'AEIOU' else 'a'} {short}"


def _empty_optimizer_state(model: nn.Module, optimizer, saved: dict, path) -> dict[str, Any]:
    """What DCP fills in: this rank's optimizer keys, with empty tensors of the saved shapes.

    The state keys are the target optimizer's own (`_state_keys`): a checkpoint whose state for a parameter
    has other keys (Adam's exp_avg, exp_avg_sq and step, loaded into an SGD that keeps momentum_buffer) is
    refused before anything is read.  A parameter saved without state (never stepped) loads none."""
    saved_by_name = _by_name(key[len("optim."):] for key in saved if key.startswith("optim."))
    if not saved_by_name:
        raise CheckpointMismatchError(f"the checkpoint at {path} holds no optimizer state (saved without "
                                      "optimizer=); load it without an optimizer")
    expected = _state_keys(model, optimizer)
    wanted = {}
    for group, names in _names(model, optimizer):
        for name, param in zip(names, group["params"]):
            if ("param_groups", name) not in saved_by_name:
                raise CheckpointMismatchError(f"the checkpoint at {path} has no optimizer state for {name}: was "
                                              "that parameter left out of the optimizer when it was saved?")
            was = sorted(key.rpartition(".")[2] for key in saved_by_name.get(("state", name), []))
            keeps = expected[name]
            if keeps is None:  # (an optimizer that could not be asked: the saved keys, as they are)
                keeps = was
            elif was and was != keeps:
                raise CheckpointMismatchError(f"the checkpoint at {path} holds the optimizer state {was} for {name}, "
                                              f"but this {type(optimizer).__name__} keeps {keeps}: it was saved from "
                                              "another optimizer (or with other options); build the optimizer it was "
                                              "saved with")
            state_keys = [f"state.{name}.{key}" for key in keeps] if was else []
            for key in saved_by_name[("param_groups", name)] + state_keys:
                entry = saved[f"optim.{key}"]
                # (None: a number, read as such)
                wanted[key] = _target(entry, param, name, key, path) if _is_tensor_entry(entry) else None
    return wanted


def _target(entry, param: torch.Tensor, name: str, key: str, path) -> torch.Tensor:
    """The empty tensor DCP fills with the saved optimizer state `key` of the parameter `name` (a DTensor laid out
    as the parameter where it is sharded: `sharded.empty_like_saved`)."""
    found = sharded.empty_like_saved(entry.size, entry.properties.dtype, param)
    if found is None:
        raise CheckpointError(f"the optimizer state {key.rpartition('.')[2]!r} of {name} in the checkpoint at {path} "
                              f"has shape {tuple(entry.size)}, neither its sharded parameter's {tuple(param.shape)} "
                              "nor a number's: pipelab cannot lay it out over the replicas; use an optimizer whose "
                              "state has its parameters' shapes (Adam, AdamW, SGD with momentum), or shard=None")
    return found


def _state_keys(model: nn.Module, optimizer) -> dict[str, list[str] | None]:
    """The state keys `optimizer` keeps for each of its parameters, by name: those it holds, or, for a parameter
    it has not stepped yet, those one step of a throwaway copy creates on a tiny tensor of the parameter's
    kind (number of dimensions, dtype, device) and group; None where that step fails (an optimizer that needs a
    closure, say)."""
    keys, asked = {}, {}
    for index, (group, names) in enumerate(_names(model, optimizer)):
        for name, param in zip(names, group["params"]):
            if optimizer.state.get(param):
                keys[name] = sorted(optimizer.state[param])
                continue
            kind = (index, param.dim(), param.dtype, param.device)
            if kind not in asked:
                asked[kind] = _probe(optimizer, group, param)
            keys[name] = asked[kind]
    return keys


def _probe(optimizer, group: dict, param: torch.Tensor) -> list[str] | None:
    """The state keys one step of `optimizer`'s class creates for a tiny parameter like `param` in `group`, on a
    copy that shares nothing it changes (its state, groups and hooks are new; `optimizer` is left as it was)."""
    tiny = torch.zeros([1] * param.dim(), dtype=param.dtype, device=param.device, requires_grad=True)
    tiny.grad = torch.zeros_like(tiny)
    probe = object.__new__(type(optimizer))
    fresh = {key: OrderedDict() for key, value in vars(optimizer).items()
             if key.startswith("_optimizer_") and key.endswith("_hooks")}
    vars(probe).update({key: value for key, value in vars(optimizer).items() if key != "step"},  # (an LR scheduler
                       **fresh, state=defaultdict(dict), param_groups=[{**group, "params": [tiny]}])  # wraps step)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            type(optimizer).step(probe)
    except Exception:
        return None
    return sorted(probe.state.get(tiny, {}))


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
    if isinstance(pipe, nn.Module) or not hasattr(pipe, "group") or not hasattr(pipe, "model"):
        hint = ("for a whole model in one process use load_into_model(model, path)" if verb == "load" else
                "a whole model in one process can be a 1-stage pipeline, under pl.distributed.launch(fn, 1)")
        raise TypeError(f"checkpoint.{verb} takes a DistributedPipeline, got {type(pipe).__name__}; {hint}")


def _read_manifest(path) -> dict | None:
    """The checkpoint's manifest, once its files are checked against it (None, with a warning, if it has none)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}{_leftovers(path)}")
    if not (path / checkpoint_manifest.METADATA).is_file():
        raise CheckpointError(f"{path} is not a pipelab checkpoint (a torch.distributed.checkpoint directory): it "
                              "has no .metadata file (rank 0 writes it last: did the save finish?)")
    try:
        manifest = checkpoint_manifest.read(path)
        if manifest is not None:
            checkpoint_manifest.check_files(path, manifest)
    except (DamagedCheckpoint, OSError) as error:
        raise _failure(error, "checking", path) from error
    if manifest is None:
        warnings.warn(f"the checkpoint at {path} has no manifest ({checkpoint_manifest.NAME}): it was saved by "
                      "an older pipelab (or without it), and its files cannot be checked for damage", stacklevel=4)
    return manifest


def _leftovers(path: Path) -> str:
    """What an interrupted save left beside `path`, said in the error of a missing checkpoint."""
    if not path.parent.is_dir():
        return ""
    for found in sorted(path.parent.iterdir()):
        if found.name.startswith(f"{path.name}.old-"):
            return f" (but {found} is the checkpoint that was there, whole: a save replacing it stopped " \
                   f"between its two renames; rename it back)"
    unfinished = [found.name for found in sorted(path.parent.iterdir()) if found.name.startswith(f"{path.name}.tmp-")]
    return f" ({', '.join(unfinished)} beside it: a save that did not finish; delete it)" if unfinished else ""


def _read_metadata(path):
    try:
        return _dcp().FileSystemReader(path).read_metadata()
    except Exception as error:  # (checked against the manifest first, when there is one)
        raise _failure(error, "reading the .metadata of", path) from error
