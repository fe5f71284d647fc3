"""One stage's work on one micro-batch: its forward, then its backward, whole (B) or split (I, then W).

A stage makes what it receives a leaf that requires grad (`as_input`), so that its backward
stops at the boundary and leaves the gradient to send back in `input.grad`; the backward
accumulates into the parameters' `.grad`, which is how the micro-batches' gradients add up.
Between F and its backward a micro-batch holds a `Held`: the input and the output's
`GradientEdge` (the output's values are dropped once sent; Megatron-LM's
`deallocate_output_tensor` does the same by shrinking `output.data`), or, on a checkpointed
stage, what it takes to run the forward again (Chen et al. 2016: keep the input, recompute at
the backward with the first run's random state).  A split backward (`split_backward.py`)
holds a `HeldForW` from its I to its W, and `keep_only_for_w` drops, after I, every saved tensor
W will not read (Zero Bubble PP, Table 1: only the layers' inputs and the output gradients wait for W).
`SavedTensors` counts the bytes autograd saves for backward (the "counted" activation memory), and
tells an observer of each storage.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from . import boundary, finite, split_backward


class Kept:
    """One tensor autograd saved for backward, as the graph holds it (what the pack hook returns): `tensor`
    until dropped (None), and the keys of the storages it was counted under."""

    __slots__ = ("tensor", "keys")

    def __init__(self, tensor: torch.Tensor, keys: list[tuple]):
        self.tensor, self.keys = tensor, keys


_reading: set[int] | None = None  # while `saved_read_by` runs: the ids of the `Kept` it unpacked
_SAVED_NAMES: dict[type, list[str]] = {}  # an autograd node's type -> the names of its saved fields


class SavedTensors:
    """`with saved:` counts the bytes autograd saves inside the block, once per storage, leaving out
    `excluded` storages (a stage's parameters; a recomputing stage's input, already held), and hands each
    storage counted to `observe` (the engine's memory observer).  `bytes` restarts at each entry;
    `take()`, inside the block, hands over the saved tensors (`Kept`) and counted sizes so far."""

    def __init__(self, excluded: list[torch.Tensor] = (), observe: Callable[[torch.Tensor], None] | None = None):
        self.excluded = {_storage_key(plain) for t in excluded for plain in plain_tensors(t)}
        self.observe = observe
        self.bytes, self.seen, self.also_excluded = 0, set(), set()
        self.kept, self.sizes = [], {}

    def exclude(self, *tensors: Any) -> None:
        """Leave these tensors' storages out until the block ends."""
        self.also_excluded |= {_storage_key(p) for t in tensors if isinstance(t, torch.Tensor) for p in plain_tensors(t)}

    def take(self) -> tuple[list[Kept], dict[tuple, int]]:
        """The saved tensors holding counted storages, and {storage key: bytes}, since entry or the last take."""
        taken = self.kept, self.sizes
        self.kept, self.sizes = [], {}
        return taken

    def __enter__(self) -> "SavedTensors":
        self.bytes, self.seen, self.also_excluded = 0, set(), set()
        self.kept, self.sizes = [], {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self.kept, self.sizes = [], {}  # not taken inside the block: the graph alone holds them

    def _pack(self, tensor: torch.Tensor) -> Kept:
        keys = []
        for plain in plain_tensors(tensor):
            key = _storage_key(plain)
            if key in self.excluded or key in self.also_excluded:
                continue
            keys.append(key)
            if key not in self.seen:
                self.seen.add(key)
                self.sizes[key] = plain.untyped_storage().nbytes()
                self.bytes += self.sizes[key]
                if self.observe is not None:
                    self.observe(plain)
        # detached: the saved object must not hold the tensor itself, else a node that saves its own output
        # (softmax, exp) and that output hold each other, and a graph kept past its backward (retain_graph,
        # a split backward's I) is never freed (torch.autograd.graph.saved_tensors_hooks, warning)
        kept = Kept(tensor.detach(), keys)
        if keys:
            self.kept.append(kept)
        return kept


def _unpack(kept: Kept) -> torch.Tensor:
    if _reading is not None:
        _reading.add(id(kept))
    if kept.tensor is None:
        raise RuntimeError("pipelab dropped a saved tensor after I that W reads: please report this model "
                           "(pipelab/model/stage.py, keep_only_for_w)")
    return kept.tensor


def saved_read_by(nodes) -> set[int] | None:
    """The ids of the `Kept` the autograd `nodes` hold (their `_saved_*` fields, a custom Function's
    `saved_tensors`), read as PyTorch's autograd notes describe ("Saved tensors"); None if one cannot be read."""
    global _reading
    _reading = set()
    try:
        for node in nodes:
            names = _SAVED_NAMES.get(type(node))
            if names is None:
                names = _SAVED_NAMES[type(node)] = [n for n in dir(node) if n.startswith("_saved_") or n == "saved_tensors"]
            for name in names:
                getattr(node, name)
        return _reading
    except RuntimeError:
        return None
    finally:
        _reading = None


def keep_only_for_w(held: "HeldForW", kept: list[Kept], sizes: dict[tuple, int]) -> int:
    """After I: drop every saved tensor of `kept` that no node W runs (`WeightWork.nodes`) reads, which frees
    its storage unless something else holds it; return the bytes of `sizes` still held (a storage stays
    while one of its saved tensors does)."""
    nodes = held.work.nodes
    read = None if nodes is None else saved_read_by(nodes)
    if read is not None:
        for k in kept:
            if id(k) not in read:
                k.tensor = None
    alive = {key for k in kept if k.tensor is not None for key in k.keys}
    return sum(size for key, size in sizes.items() if key in alive)


def held_for_w_bytes(held: "HeldForW", kept: list[Kept], sizes: dict[tuple, int]) -> int:
    """`keep_only_for_w`, plus the gradients I recorded for W (once per storage): the bytes a micro-batch
    holds from its I to its W ("counted")."""
    recorded = {_storage_key(t): t.untyped_storage().nbytes()
                for g in held.work.recorded_gradients() for t in plain_tensors(g)}
    return keep_only_for_w(held, kept, sizes) + sum(size for key, size in recorded.items() if key not in sizes)


def plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding `tensor`'s memory: a wrapper subclass (a DTensor under tensor
    parallelism) has no storage of its own, only the tensors it wraps."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        inner = [getattr(tensor, name) for name in names]
        return [t for value in inner if isinstance(value, torch.Tensor) for t in plain_tensors(value)]
    return [tensor]


def _storage_key(tensor: torch.Tensor) -> tuple:
    return (tensor.device, tensor.untyped_storage().data_ptr())


def stage_function(module: Callable, fusion: Any = None, loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   copy_input: bool = False) -> Callable[[Any], tuple]:
    """What a stage computes: `run(inp)` -> (the blocks' output, and on the last stage `loss(output)`, the
    micro-batch's mean loss, else None).  `fusion` (a `FusedAccumulation`) is entered around the blocks;
    `copy_input` for a stage that starts in place (`starts_in_place`).  In a step checked for NaN and inf,
    the output and the loss are checked (`finite.py`)."""

    def run(inp: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if copy_input:
            inp = copy_of(inp)
        with fusion if fusion is not None else contextlib.nullcontext():
            output = module(inp)
        checked = finite.checking()
        if checked:
            finite.check_output(output, inp)
        if loss is None:
            return output, None
        value = loss(output)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            raise TypeError("loss_fn must return a scalar tensor (the mean loss of the micro-batch)")
        if checked:
            finite.check_loss(value)
        return output, value

    return run


def as_input(received: Any, is_first: bool) -> Any:
    """What the stage computes from: every received float tensor becomes a leaf that requires grad (its
    gradient is what goes back, `boundary.py`); the first stage's micro-batch, and integer tensors (token
    ids, masks), stay as they are."""
    return received if is_first else boundary.as_leaves(received)


@dataclass
class Held:
    """What a micro-batch holds on a stage from its F to its backward."""

    input: Any
    edges: list = field(default_factory=list)  # where the backward starts: (position, GradientEdge) per output tensor
    rebuild: Callable[[], Any] | None = None  # a checkpointed stage: runs the forward again


@dataclass
class HeldForW:
    """What a micro-batch holds on a stage from its I to its W."""

    work: split_backward.WeightWork


def forward(run: Callable[[Any], torch.Tensor], inp: Any, checkpoint: bool = False,
            buffers: list[torch.Tensor] = ()) -> tuple[torch.Tensor, Held]:
    """`run(inp)` (the stage's blocks, and on the last stage its weighted loss): (output, what it holds).

    Checkpointed, it runs without building a graph and holds only the input and the random state, to
    run again with the graph at the backward (`Held.rebuild`), which leaves the stage's `buffers`
    (BatchNorm's running statistics) as the first run left them: one real forward, one update."""
    if not checkpoint:
        output = run(inp)
        return output, Held(inp, edges=[(k, get_gradient_edge(t)) for k, t in boundary.roots(output)])
    state = _rng_state(inp)
    with torch.no_grad():
        output = run(inp)

    def rebuild() -> torch.Tensor:
        with torch.random.fork_rng(devices=state[1]), buffers_kept(buffers):
            _set_rng_state(state)
            return run(inp)

    return output, Held(inp, rebuild=rebuild)


@contextlib.contextmanager
def buffers_kept(buffers):
    """Inside the block the forwards run as usual; on leaving, every buffer holds its value from before
    (the engine's own extra forwards: the warm-up, a recomputation, a profile)."""
    buffers = list(buffers)
    saved = [b.detach().clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in zip(buffers, saved):
                b.copy_(value)


def starts_in_place(module: nn.Module) -> bool:
    """Whether `module`'s first leaf module works in place on its input (`ReLU(inplace=True)`): a received
    activation is a leaf that requires grad, which an in-place op may not change, so such a stage computes
    from a copy of it (the gradient still reaches the leaf, through the copy)."""
    first = next((m for m in module.modules() if not list(m.children())), None)
    return bool(getattr(first, "inplace", False))


def copy_of(inp: Any) -> Any:
    """`inp` with every tensor that requires grad copied (the copies carry the gradient back to it)."""
    return tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) and v.requires_grad else v, inp)


def _starts(held: Held, grad_output: Any) -> tuple[list, list]:
    """Where the backward starts and with which gradients: the output tensors (or their edges) that require grad
    and got a gradient back; on the last stage (`grad_output` None) the weighted loss, with no gradient."""
    pairs = boundary.roots(held.rebuild()) if held.rebuild is not None else held.edges
    grads = boundary.at(grad_output, [k for k, _ in pairs])
    chosen = [(root, g) for (_, root), g in zip(pairs, grads) if g is not None or grad_output is None]
    return [root for root, _ in chosen], [g for _, g in chosen]


def backward(held: Held, grad_output: Any) -> Any:
    """B: backpropagate through the stage (accumulating the parameters' grads); return the input's gradients
    (the input's structure, None where nothing goes back)."""
    starts, grads = _starts(held, grad_output)
    if starts:  # an output with no tensor that requires grad sends nothing back
        torch.autograd.backward(starts, None if grad_output is None else grads)
    return boundary.input_gradients(held.input)


def input_gradient(held: Held, grad_output: Any, parameters: list[torch.Tensor]) -> tuple[Any, HeldForW]:
    """I: the input's gradients only (its structure, as `backward` returns them; None where nothing goes back),
    and what W needs."""
    starts, grads = _starts(held, grad_output)
    flat, spec = tree_flatten(held.input)
    wanted = [k for k, leaf in enumerate(flat) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
    found, work = split_backward.backward_input(starts, grads, [flat[k] for k in wanted], parameters)
    if not any(g is not None for g in found):
        return None, HeldForW(work)
    leaves = [None] * len(flat)
    for k, g in zip(wanted, found):
        leaves[k] = g
    return tree_unflatten(leaves, spec), HeldForW(work)


def weight_gradient(held: HeldForW) -> None:
    """W: add the weight gradients I left into the parameters' `.grad`."""
    split_backward.backward_weight(held.work)


def _rng_state(inp: Any) -> tuple:
    devices = [inp.device.index] if isinstance(inp, torch.Tensor) and inp.is_cuda else []
    return torch.get_rng_state(), devices, [torch.cuda.get_rng_state(d) for d in devices]


def _set_rng_state(state: tuple) -> None:
    cpu_state, devices, cuda_states = state
    torch.set_rng_state(cpu_state)
    for device, cuda_state in zip(devices, cuda_states):
        torch.cuda.set_rng_state(cuda_state, device)
