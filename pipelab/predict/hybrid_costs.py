"""Predict a hybrid layout's step: the simulator with TP collectives inside F and B, DP after the drain.

    links = pl.hybrid_costs.cluster_links(pl.Layout(dp=1, pp=2, tp=8), gpus_per_node=8,
                                          inside=(2e-6, 300e9), between=(10e-6, 25e9))
    prediction = pl.hybrid_costs.predict(pl.Layout(dp=1, pp=2, tp=8), model_costs, links, n_microbatches=8)

For a layout (d, p, t) a stage's F = forward / (p·t) + (L/p) · 2 · all_reduce(A, t) on the
"tp" link, its B the same with the backward (Megatron-LM: 2 all-reduces forward, 2 backward
per layer); a message carries A / t on the "pp" link; one all-reduce of Ψ / (p·t) bytes over
"dp" (ZeRO §7.1) follows the drain.  all_reduce(N, n) on a ring (Patarasuk & Yuan 2009):
2·(n−1)/n · N / bandwidth + 2·(n−1) · latency.

Details (`ModelCosts`, which link a dimension uses, the assumptions): docs/hybrid.md,
"Predicting a layout's step".
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedules import by_name
from .communication import pipeline_sent, ring_allreduce_elements_per_device, tensor_parallel_sent
from .costs import Costs
from .layout import Layout
from .simulate import simulate


@dataclass(frozen=True)
class Link:
    latency: float  # seconds per message
    bandwidth: float  # bytes per second


@dataclass(frozen=True)
class ModelCosts:
    forward_seconds: float  # one micro-batch through the whole model, one device
    backward_seconds: float
    activation_bytes: float  # one micro-batch's activation at a layer boundary: b·s·h·bytes
    n_layers: int  # transformer layers (2 + 2 TP all-reduces each)
    parameter_bytes: float  # the whole model's


@dataclass(frozen=True)
class Prediction:
    step_seconds: float
    pipeline_seconds: float  # the simulated makespan (F and B with their TP collectives, the messages)
    dp_seconds: float  # the gradient all-reduce after the drain
    parameter_bytes_per_device: float
    bytes_per_device: dict  # {"pp", "tp", "dp"}: bytes the busiest device sends per step (ring algorithms)


def all_reduce_seconds(payload_bytes: float, n_ranks: int, link: Link) -> float:
    """Ring all-reduce: 2·(n−1)/n · N / bandwidth + 2·(n−1) · latency (2(n−1) steps); 0 for one rank."""
    if n_ranks <= 1:
        return 0.0
    wire = ring_allreduce_elements_per_device(payload_bytes, n_ranks)  # bytes each rank sends
    return wire / link.bandwidth + 2 * (n_ranks - 1) * link.latency


def cluster_links(layout: Layout, gpus_per_node: int, inside: tuple[float, float],
                  between: tuple[float, float]) -> dict[str, Link]:
    """{"tp", "pp", "dp"}: the (latency, bandwidth) `inside` a node or `between` nodes, for each dimension."""
    fast, slow = Link(*inside), Link(*between)
    spans = {"tp": layout.tp, "pp": layout.pp * layout.tp, "dp": layout.world_size}
    return {dim: fast if span <= gpus_per_node else slow for dim, span in spans.items()}


def predict(layout: Layout, model: ModelCosts, links: dict[str, Link], n_microbatches: int,
            schedule: str = "1f1b") -> Prediction:
    """The predicted step of `model` on `layout` (module docstring)."""
    d, p, t = layout.shape
    if model.n_layers % p:
        raise ValueError(f"{model.n_layers} layers cannot be cut into pp={p} equal stages")
    layers = model.n_layers // p
    tp_one = all_reduce_seconds(model.activation_bytes, t, links["tp"])
    forward = model.forward_seconds / (p * t) + layers * 2 * tp_one
    backward = model.backward_seconds / (p * t) + layers * 2 * tp_one
    costs = Costs(forward=forward, backward=backward, latency=links["pp"].latency, bandwidth=links["pp"].bandwidth,
                  activation_bytes=model.activation_bytes / t)
    pipeline = simulate(by_name(schedule, p, n_microbatches), costs).makespan
    rank_parameters = model.parameter_bytes / (p * t)
    dp = all_reduce_seconds(rank_parameters, d, links["dp"])
    sent = {"pp": n_microbatches * pipeline_sent(model.activation_bytes / t, p),
            "tp": n_microbatches * tensor_parallel_sent(model.activation_bytes, layers, t),
            "dp": ring_allreduce_elements_per_device(rank_parameters, d)}
    return Prediction(pipeline + dp, pipeline, dp, rank_parameters, sent)
