"""What a message between stages looks like, sent once per input shape so that the receiver can allocate.

A message is any structure (`model/boundary.py`); its `MessageLayout` is the structure's `TreeSpec` and,
for each leaf in pytree order, a tensor's dtype and shape, or the value itself (an int, a string,
None).  The receiver allocates one buffer per tensor leaf and rebuilds the structure around them.
The layout travels as pickled bytes (a length, then the bytes), the first time a micro-batch
input of a new shape reaches the boundary; later micro-batches of that shape send tensors only.
A gradient's layout needs no header: it is the activation's, each differentiable tensor kept
and every other leaf None.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import (
    TreeSpec,
    tree_flatten,
    tree_unflatten,
    treespec_dumps,
    treespec_loads,
)


@dataclass(frozen=True)
class MessageLayout:
    """How one message's leaves are laid out: its structure and, per leaf, a tensor's dtype and shape or a value.
    (Not `pl.Layout`, the (dp, pp, tp) layout of ranks in predict/layout.py.)"""

    spec: TreeSpec
    leaves: tuple  # per leaf: ("tensor", dtype, shape) or ("value", the value)

    @classmethod
    def of(cls, message: Any) -> "MessageLayout":
        flat, spec = tree_flatten(message)
        return cls(spec, tuple(("tensor", leaf.dtype, tuple(leaf.shape)) if isinstance(leaf, torch.Tensor)
                               else ("value", leaf) for leaf in flat))

    def of_gradient(self) -> "MessageLayout":
        """The layout of the gradient that comes back for a message of this layout."""
        return MessageLayout(self.spec, tuple(
            leaf if leaf[0] == "tensor" and (leaf[1].is_floating_point or leaf[1].is_complex) else ("value", None)
            for leaf in self.leaves))

    def rebuild(self, tensors: list[torch.Tensor]) -> Any:
        """The message: this layout's structure with `tensors` at its tensor leaves, in order."""
        given = iter(tensors)
        return tree_unflatten([next(given) if leaf[0] == "tensor" else leaf[1] for leaf in self.leaves], self.spec)

    def empty(self, device: torch.device) -> list[torch.Tensor]:
        """A buffer for each tensor leaf."""
        return [torch.empty(leaf[2], dtype=leaf[1], device=device) for leaf in self.leaves if leaf[0] == "tensor"]

    def encode(self) -> torch.Tensor:
        try:  # torch's own serialisation of a structure; a node type it cannot name is pickled instead
            spec = ("json", treespec_dumps(self.spec))
        except Exception:  # noqa: BLE001
            spec = ("pickle", self.spec)
        return torch.frombuffer(bytearray(pickle.dumps((spec, self.leaves))), dtype=torch.uint8)

    @classmethod
    def decode(cls, data: torch.Tensor) -> "MessageLayout":
        (how, spec), leaves = pickle.loads(data.numpy().tobytes())
        return cls(treespec_loads(spec) if how == "json" else spec, leaves)


def gradient_leaves(layout: MessageLayout, gradient: Any, device: torch.device) -> list[torch.Tensor]:
    """The tensors to send back for a message of `layout`: each differentiable leaf's gradient, zeros where it got
    none (the receiver allocated a buffer for it; a zero gradient changes nothing)."""
    grads = [None] * len(layout.leaves) if gradient is None else tree_flatten(gradient)[0]
    found = []
    for leaf, grad in zip(layout.of_gradient().leaves, grads):
        if leaf[0] == "tensor":
            found.append(grad if grad is not None else torch.zeros(leaf[2], dtype=leaf[1], device=device))
    return found

