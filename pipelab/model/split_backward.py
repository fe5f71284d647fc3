"""A stage's backward split in two (Zero Bubble PP): I, the input gradient, now; W, the weight gradient, later.

I runs autograd from the stage output to the stage input only, keeping the graph, and
records the gradient arriving at each node where a weight hangs off the input path (for a
Linear, the matrix multiply whose other input is the weight).  W later starts from those
nodes with those gradients and runs only the branches that lead to the weights, so every
gradient is computed once.  The idea is PyTorch's (`torch/distributed/pipelining/_backward.py`);
this is written anew.  A stage whose input needs no gradient has no input path: its I
computes nothing and its W the whole backward (nothing either, without weights that require grad).

Details (the boundary nodes, the output given as its `GradientEdge`): docs/engines.md,
"The split backward".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class WeightWork:
    """What I leaves for W: per group, the boundary nodes, the gradients recorded at them, and
    the weights their branches reach."""

    groups: list[tuple[list[Node], list[tuple], list[torch.Tensor]]] = field(default_factory=list)
    whole: tuple[list[GradientEdge], list] | None = None  # (the outputs' edges, their grads) without an input path
    parameters: list[torch.Tensor] = field(default_factory=list)
    nodes: set[Node] | None = None  # the nodes W runs (None: the whole graph); the rest of the graph W never reads

    def recorded_gradients(self) -> list[torch.Tensor]:
        """The gradients I recorded for W (memory a stage holds from I to W, with the graph's saved tensors)."""
        found = [g for _, recorded, _ in self.groups for grads in recorded for g in grads if g is not None]
        if self.whole is not None:
            found += [g for g in self.whole[1] if g is not None]
        return found


def _graph_of(roots: list[Node]) -> list[Node]:
    """Every node reachable from `roots`, parents before children (a reverse post-order).  A root may be
    reachable from another (a stage cut inside a block sends the residual stream and a function of it): it is
    then visited from there, as any node, so it still comes after its parents."""
    order, seen = [], set()
    for root in roots:
        if root not in seen:
            seen.add(root)
            _visit(root, seen, order)
    return order[::-1]


def _visit(root: Node, seen: set, order: list) -> None:
    stack = [(root, iter(root.next_functions))]
    while stack:
        node, children = stack[-1]
        for child, _ in children:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append((child, iter(child.next_functions)))
                break
        else:
            stack.pop()
            order.append(node)


def backward_input(outputs, grad_outputs, inputs, parameters: list[torch.Tensor]):
    """I: return d loss / d each of `inputs` (those that require grad; None where a gradient does not reach)
    and the `WeightWork` W needs.

    `outputs` are the stage's output tensors (or their GradientEdges) the backward starts from, with
    `grad_outputs` (None for a scalar output).  Without an input that requires grad, I computes nothing.
    One tensor each (output, its gradient, input) gives the input's gradient as one tensor; lists give a list.
    """
    if isinstance(inputs, torch.Tensor):  # one output, one input: the plain form lessons use
        found, work = backward_input([outputs], [grad_outputs], [inputs], parameters)
        return (found[0] if found else None), work
    edges = []
    for output in outputs:
        if isinstance(output, torch.Tensor):
            if output.grad_fn is None:
                raise ValueError("the stage output has no graph to differentiate (does any input or weight "
                                 "require grad?)")
            output = get_gradient_edge(output)
        edges.append(output)
    grads = list(grad_outputs)
    trainable = [p for p in parameters if p.requires_grad]
    work = WeightWork(parameters=trainable)
    inputs = [t for t in inputs if t.requires_grad]
    if not inputs:
        work.whole = (edges, grads)
        return [], work
    targets = {get_gradient_edge(t).node for t in inputs}
    weight_nodes = {get_gradient_edge(p).node: p for p in trainable}
    nodes = [node for node in _graph_of([edge.node for edge in edges])]
    to_input, to_weights = {}, {}  # node -> reaches the input / the set of weights it reaches
    for node in reversed(nodes):  # children first
        children = [c for c, _ in node.next_functions if c is not None]
        to_input[node] = node in targets or any(to_input[c] for c in children)
        reached = {id(weight_nodes[node])} if node in weight_nodes else set()
        for c in children:
            reached |= to_weights[c]
        to_weights[node] = reached
    groups: list[tuple[set[Node], set[int]]] = []
    for node in nodes:  # boundary: on the input path, with a child off it that reaches weights
        if not to_input[node]:
            continue
        reached = set().union(*(to_weights[c] for c, _ in node.next_functions
                                if c is not None and not to_input[c]))
        if reached:
            overlapping = [g for g in groups if g[1] & reached]
            merged = ({node}.union(*(g[0] for g in overlapping)), reached.union(*(g[1] for g in overlapping)))
            groups = [g for g in groups if not g[1] & reached] + [merged]
    recorded: dict[Node, tuple] = {}
    handles = [node.register_prehook(lambda grads, node=node: recorded.__setitem__(node, grads))
               for members, _ in groups for node in members]
    try:
        grad_inputs = torch.autograd.grad(edges, inputs, grads, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    by_id = {id(p): p for p in trainable}
    work.nodes = set()
    for members, reached in groups:
        members = [n for n in members if n in recorded]
        work.groups.append((members, [recorded[n] for n in members], [by_id[i] for i in sorted(reached)]))
        work.nodes |= _weight_branches(members, reached, to_weights)
    return list(grad_inputs), work


def _weight_branches(members: list[Node], reached: set[int], to_weights: dict[Node, set[int]]) -> set[Node]:
    """The nodes W's call for one group runs: autograd runs a node only on a path from a root (a member) to a
    requested weight (one of `reached`)."""
    found, stack = set(members), list(members)
    while stack:
        for child, _ in stack.pop().next_functions:
            if child is not None and child not in found and to_weights[child] & reached:
                found.add(child)
                stack.append(child)
    return found


def backward_weight(work: WeightWork) -> None:
    """W: add d loss / d weights into each weight's `.grad`, from what I recorded."""
    if work.whole is not None:
        edges, grads = work.whole
        work.whole = None
        if edges and work.parameters:  # else nothing to differentiate: a stage without weights, its input constant
            found = torch.autograd.grad(edges, work.parameters, grads, allow_unused=True)
            _accumulate(work.parameters, found)
        return
    for members, recorded, weights in work.groups:
        roots, grads = [], []
        for node, node_grads in zip(members, recorded):
            for i, g in enumerate(node_grads):
                if g is not None:
                    roots.append(GradientEdge(node, i))
                    grads.append(g)
        # a boundary node below another in the same group gets exactly what I recorded there
        handles = ([node.register_prehook(lambda _, saved=saved: saved) for node, saved in zip(members, recorded)]
                   if len(members) > 1 else [])
        try:
            found = torch.autograd.grad(roots, [get_gradient_edge(w) for w in weights], grads,
                                        retain_graph=True, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        _accumulate(weights, found)
    work.groups.clear()


def _accumulate(weights: list[torch.Tensor], grads) -> None:
    for weight, g in zip(weights, grads):
        if g is not None:
            weight.grad = g.detach().clone() if weight.grad is None else weight.grad.add_(g)
