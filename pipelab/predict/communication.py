"""Bytes a transformer's training step sends per device: pipeline stages vs tensor parallelism, from the formulas.

For one micro-batch of b sequences of s tokens, hidden size h (Narayanan et al., SC21, §3):
a pipeline stage sends at most 2·b·s·h elements per micro-batch (the activation forward, its
gradient back), *whatever the number of layers*; tensor parallelism over t devices (Shoeybi
et al. 2019, §3) sends 8·b·s·h·(t−1)/t per device and transformer layer (2 ring all-reduces
forward and 2 backward, 2·(t−1)/t·N each), L times that for L layers.  A transformer layer
has 12·h² parameters, so models of the same size trade depth for width: L₁·h₁² = L₂·h₂².

Nothing here is measured: these are the formulas.  Derivation: docs/hybrid.md, "Pipeline
against tensor-parallel bytes".
"""

from __future__ import annotations

from dataclasses import dataclass


def transformer_layer_parameters(hidden: int) -> int:
    """12·h²: attention's four h×h projections and the MLP's h×4h and 4h×h (biases and norms left out)."""
    return 12 * _positive(hidden, "hidden")**2


def pipeline_elements_per_device(batch: int, seq_len: int, hidden: int, n_stages: int) -> int:
    """Elements one device sends per micro-batch: b·s·h forward (not the last stage) + b·s·h backward (not the first).

    The most any stage sends: 2·b·s·h for a middle stage when p >= 3, b·s·h when p = 2, 0 when p = 1.
    """
    elements = _positive(batch, "batch") * _positive(seq_len, "seq_len") * _positive(hidden, "hidden")
    return pipeline_sent(elements, n_stages)


def pipeline_sent(activation: float, n_stages: int) -> float:
    """What the busiest of p stages sends per micro-batch, A the activation at a boundary (elements or
    bytes, the same unit out): A·min(2, p−1), the activation forward and its gradient back."""
    return activation * min(2, _positive(n_stages, "n_stages") - 1)


def tensor_parallel_elements_per_device(batch: int, seq_len: int, hidden: int, n_layers: int, tp: int) -> float:
    """Elements one device sends per micro-batch: 4 all-reduces of b·s·h per layer, 2·(t−1)/t of each: 8·b·s·h·L·(t−1)/t."""
    elements = _positive(batch, "batch") * _positive(seq_len, "seq_len") * _positive(hidden, "hidden")
    return tensor_parallel_sent(elements, _positive(n_layers, "n_layers"), tp)


def tensor_parallel_sent(activation: float, n_layers: int, tp: int) -> float:
    """What each of t ranks sends per micro-batch for L Megatron layers, A the activation (elements or
    bytes, the same unit out): 4 ring all-reduces of A per layer (2 forward, 2 backward), 4·L·2·(t−1)/t·A."""
    return 4 * n_layers * ring_allreduce_elements_per_device(activation, _positive(tp, "tp"))


def ring_allreduce_elements_per_device(n_elements: int, n_devices: int) -> float:
    """A ring all-reduce (reduce-scatter, then all-gather) sends 2·(n−1)/n·N elements from each device
    (Patarasuk & Yuan 2009; ZeRO, Rajbhandari et al. 2020, §7.1); linear in N, so bytes in give bytes out."""
    return 2 * (n_devices - 1) / n_devices * n_elements


@dataclass(frozen=True)
class LayoutBytes:
    """One model on n_devices, split into pipeline stages or tensor-parallel shards: what each device sends."""

    name: str
    n_layers: int
    hidden: int
    parameters: int           # 12·L·h²
    pipeline_bytes: float     # per device, per micro-batch
    tensor_parallel_bytes: float

    @property
    def ratio(self) -> float:
        """Tensor-parallel bytes over pipeline bytes: 4·L·(t−1)/t for p = t >= 3."""
        return self.tensor_parallel_bytes / self.pipeline_bytes


def layout_bytes(name: str, n_layers: int, hidden: int, n_devices: int, batch: int, seq_len: int,
                 bytes_per_element: int = 2) -> LayoutBytes:
    """Per-device bytes per micro-batch for `n_devices` pipeline stages vs `n_devices`-way tensor parallelism (bf16 default)."""
    return LayoutBytes(
        name, n_layers, hidden, n_layers * transformer_layer_parameters(hidden),
        bytes_per_element * pipeline_elements_per_device(batch, seq_len, hidden, n_devices),
        bytes_per_element * tensor_parallel_elements_per_device(batch, seq_len, hidden, n_layers, n_devices))


def _positive(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value
