"""Count the communication of a step from the real calls, per kind of parallelism.

`CommunicationCounter` is a `TorchDispatchMode` (the mechanism of torch's own `CommDebugMode`,
which counts collectives but not their bytes): every `torch.distributed` call reaches the
dispatcher as a `c10d` op and every DTensor collective as a `_c10d_functional` op, so the
mode sees each one with its tensors and its process group.  A call is put in a kind by its
group (and op): "pp", "pp_received", "pp_gather", "tp", "dp", "fsdp_gather" and
"fsdp_reduce_scatter" (an all-gather or reduce-scatter on the data-parallel group: FSDP's,
shard="fsdp"), "tied" (a shared parameter's gradient) or "other"; `label(kind)` puts every
call inside it in `kind`.  The loop runs each action inside `during(action)`, so a record also
says the action, and the micro-batch, that issued it (`per_microbatch`).  A record's bytes are the payload the call was given, not
what the algorithm puts on the wire.

Details (what each kind holds, payload against wire bytes): docs/hybrid.md, "Counting
communication".
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = ("pp", "pp_received", "pp_gather", "tp", "dp", "fsdp_gather", "fsdp_reduce_scatter", "tied", "other")
_labels = threading.local()

# ops whose payload is their second argument (the first is the output)
_INPUT_SECOND = {"allgather_", "_allgather_base_", "_reduce_scatter_base_", "reduce_scatter_", "allgather_into_tensor_coalesced_"}
_IGNORED = {"wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_"}
# on the data-parallel group, what FSDP calls (the plain data parallelism all-reduces)
_ON_DP = {**dict.fromkeys(("allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_",
                             "all_gather_into_tensor"), "fsdp_gather"),
          **dict.fromkeys(("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor"), "fsdp_reduce_scatter")}


@contextlib.contextmanager
def _marked(key: str, value):
    """This thread's `key` mark set to `value` inside the block, then restored."""
    previous = getattr(_labels, key, None)
    setattr(_labels, key, value)
    try:
        yield
    finally:
        setattr(_labels, key, previous)


def label(kind: str):
    """Put the communication issued inside in `kind` (whatever its group or op)."""
    return _marked("kind", kind)


def during(action):
    """Mark the communication issued inside as `action`'s (the loop runs each action in one): a record then
    says which action and micro-batch it was issued in (`Record.action`, `Record.microbatch`)."""
    return _marked("action", action)


@dataclass(frozen=True)
class Record:
    kind: str
    op: str
    bytes: int
    elements: int
    group: frozenset | None = None  # its global ranks
    action: str | None = None  # the action it was issued in ("1F3"), None outside every action (after the step)
    microbatch: int | None = None  # that action's micro-batch


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _group_ranks(args) -> frozenset[int] | None:
    """The global ranks of the process group a c10d op (a ProcessGroup argument) or a functional
    collective (the group's name, its last string argument) runs on."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroup
    from torch.distributed.distributed_c10d import _resolve_process_group

    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                return frozenset(dist.get_process_group_ranks(ProcessGroup.unbox(arg)))
            except (RuntimeError, ValueError):
                continue
    strings = [a for a in args if isinstance(a, str)]
    if not strings:
        return None
    try:
        return frozenset(dist.get_process_group_ranks(_resolve_process_group(strings[-1])))
    except (RuntimeError, ValueError, KeyError):
        return None


class CommunicationCounter(TorchDispatchMode):
    """Records every communication op run inside `with counter:`; `group_kinds` maps the global ranks of
    a group (a frozenset) to a kind; a group of one rank moves nothing and counts as "other"."""

    def __init__(self, group_kinds: dict[frozenset, str]):
        from torch.distributed.tensor import DTensor  # once per counter (not per op), and only when counting

        super().__init__()
        self.group_kinds = dict(group_kinds)
        self.records: list[Record] = []
        self._dtensor = DTensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, self._dtensor) for t in types):
            return NotImplemented  # let DTensor turn the op into local ops and collectives, seen next
        namespace = getattr(func, "namespace", "")
        if namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            self._record(func._overloadpacket.__name__, args)
        return func(*args, **kwargs)

    def _record(self, op: str, args) -> None:
        if op in _IGNORED:
            return
        payload = _tensors(args[1] if op in _INPUT_SECOND and len(args) > 1 else args[0])
        size = sum(t.numel() * t.element_size() for t in payload)
        elements = sum(t.numel() for t in payload)
        group = _group_ranks(args)
        kind = getattr(_labels, "kind", None)
        if kind is None and op == "send":
            kind = "pp"
        elif kind is None and op.startswith("recv"):
            kind = "pp_received"
        elif kind is None:
            kind = self.group_kinds.get(group, "other") if group and len(group) > 1 else "other"
            kind = _ON_DP.get(op, kind) if kind == "dp" else kind
        action = getattr(_labels, "action", None)
        self.records.append(Record(kind, op, size, elements, group, None if action is None else str(action),
                                   None if action is None else action.microbatch))

    def totals(self) -> dict[str, dict[str, int]]:
        """{kind: {"messages", "bytes", "elements"}} for every kind (zeros where nothing was seen)."""
        found = {kind: defaultdict(int) for kind in KINDS}
        for record in self.records:
            found[record.kind]["messages"] += 1
            found[record.kind]["bytes"] += record.bytes
            found[record.kind]["elements"] += record.elements
        return {kind: {key: found[kind][key] for key in ("messages", "bytes", "elements")} for kind in KINDS}


    def per_microbatch(self, kind: str) -> dict[int | None, dict[str, int]]:
        """{micro-batch: {"messages", "bytes"}} of `kind`'s records, by the micro-batch of the action that issued
        them (None: outside every action, e.g. FSDP's reduce-scatter after the step's last backward)."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is not one of {KINDS}")
        found: dict[int | None, dict[str, int]] = {}
        for record in self.records:
            if record.kind == kind:
                entry = found.setdefault(record.microbatch, {"messages": 0, "bytes": 0})
                entry["messages"] += 1
                entry["bytes"] += record.bytes
        return found
