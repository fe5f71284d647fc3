"""One stage's work on one micro-batch: its forward, then its backward, whole (B) or split (I, then W).

A stage makes what it receives a leaf that requires grad (`as_input`), so that its backward
stops at the boundary and leaves the gradient to send back in `input.grad`; the backward
accumulates into the parameters' `.grad`, which is how the micro-batches' gradients add up.
Between F and its backward a micro-batch holds a `Held`: the input and the output's
`GradientEdge` (the output's values are dropped once sent; Megatron-LM's
`deallocate_output_tensor` does the same by shrinking `output.data`), or, on a checkpointed
stage, what it takes to run the forward again (Chen et al. 2016: keep the input, recompute at
the backward with the first run's random state).  A split backward (`split_backward.py`)
holds a `HeldForW` from its I to its W.  `SavedTensors` counts the bytes autograd saves for
backward (the "counted" activation memory), and tells an observer of each storage.
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


class SavedTensors:
    """`with saved:` counts the bytes autograd saves inside the block, once per storage, leaving out
    `excluded` storages (a stage's parameters; a recomputing stage's input, already held), and hands each
    storage counted to `observe` (the engine's memory observer).  `bytes` restarts at each entry."""

    def __init__(self, excluded: list[torch.Tensor] = (), observe: Callable[[torch.Tensor], None] | None = None):
        self.excluded = {_storage_key(plain) for t in excluded for plain in plain_tensors(t)}
        self.observe = observe
        self.bytes, self.seen, self.also_excluded = 0, set(), set()

    def exclude(self, *tensors: Any) -> None:
        """Leave these tensors' storages out until the block ends."""
        self.also_excluded |= {_storage_key(p) for t in tensors if isinstance(t, torch.Tensor) for p in plain_tensors(t)}

    def __enter__(self) -> "SavedTensors":
        self.bytes, self.seen, self.also_excluded = 0, set(), set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        for plain in plain_tensors(tensor):
            key = _storage_key(plain)
            if key not in self.excluded and key not in self.also_excluded and key not in self.seen:
                self.seen.add(key)
                self.bytes += plain.untyped_storage().nbytes()
                if self.observe is not None:
                    self.observe(plain)
        # detached: the saved object must not hold the tensor itself, else a node that saves its own output
        # (softmax, exp) and that output hold each other, and a graph kept past its backward (retain_graph,
        # a split backward's I) is never freed (torch.autograd.graph.saved_tensors_hooks, warning)
        return tensor.detach()


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


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
