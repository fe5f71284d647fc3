"""The closed forms of a GPT-like transformer the planner uses: parameters, FLOPs, activation bytes.

A model is `TransformerSpec(layers=L, hidden=h, heads=a, seq=s, vocab=V)`; b is the micro-batch
size (sequences), t the tensor-parallel size.  Nothing here is measured.

Parameters (Narayanan et al., SC21, §5.1, eq. 2):

    P = 12·L·h²·(1 + 13/(12h) + (V + s)/(12·L·h))  =  L·(12h² + 13h) + V·h + s·h

the leading terms 12·L·h² + V·h; a layer's 12h² are attention's four h×h projections and the
MLP's h×4h and 4h×h, its 13h the biases and two layer norms; V·h the word embedding (tied with
the output layer), s·h the position embedding.  (The table's 145.6B, 310.1B, 529.6B, 1008.0B
come out of it: tests/test_planner.py.)

FLOPs of one forward through one layer, b sequences (SC21 §5.1; matrix multiplies only):

    24·b·s·h² + 4·b·s²·h  =  24·b·s·h²·(1 + s/(6h)),     the output layer: 2·b·s·h·V

a backward is twice a forward.  One iteration of batch B over all L layers, as SC21 eq. 3 counts it:

    without recomputation   72·B·s·L·h²·(1 + s/(6h) + V/(12·h·L))   (forward + backward = 3 forwards)
    full recomputation      96·B·s·L·h²·(1 + s/(6h) + V/(16·h·L))   (one more forward of the layers)

so about 6·N FLOPs per token for training (N parameters), 8·N with full recomputation.  Selective
recomputation re-runs only attention's s² part, 4·b·s²·h per layer (Korthikanti et al. 2022, §4.2).

Activation bytes one layer keeps per micro-batch from its forward to its backward, 16-bit values,
1-byte dropout masks (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", §4 and Table 2), without / with t-way tensor parallelism (Megatron: the
layer norms, dropouts and the layer's input replicated on the t ranks, the rest split):

    no recomputation         s·b·h·(34 + 5·a·s/h)      s·b·h·(10 + 24/t + 5·a·s/(h·t))
    selective recomputation  s·b·h·34                   s·b·h·(10 + 24/t)
    full recomputation       2·s·b·h  (the layer's input only)
    with sequence parallelism every term is divided by t: s·b·h·(34/t + 5·a·s/(h·t)), s·b·h·34/t, 2·s·b·h/t

Full recomputation also rebuilds one layer's activations at a time during the backward: one layer's
"no recomputation" bytes are added once (`working_bytes`).  The embedding's dropout and the output
layer's logits (4·s·b·V/t at the last stage, Korthikanti §4.3) are left out: < 2% for these models.
Other value sizes than 2 bytes scale the formula by bytes_per_value/2 (the masks included, roughly).

A schedule multiplies these: `pipeline_seconds` (the step's pipeline part from one micro-batch's
T_F, T_B, T_W) and `microbatches_in_flight` (how many micro-batches' activations a stage holds),
the closed forms of CURRICULUM.md, which live in closed_forms.py with every schedule's others.
"""

from __future__ import annotations

from dataclasses import dataclass

from .budget import format_bytes
from .closed_forms import microbatches_in_flight, pipeline_seconds  # noqa: F401 (the planner's, kept here too)

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")

# Narayanan et al., SC21, Table 1, the four largest rows: (name, layers, hidden, heads, t, p, GPUs, batch); s = 2048,
# V = 51200.
SC21_TABLE_1 = (("145.6B", 80, 12288, 96, 8, 8, 1536, 2304), ("310.1B", 96, 16384, 128, 8, 16, 1920, 2160),
                ("529.6B", 105, 20480, 128, 8, 35, 2520, 2520), ("1008.0B", 128, 25600, 160, 8, 64, 3072, 3072))
# Its cluster (SC21 §5): DGX A100 nodes of 8 A100-80GB (80 GiB, 312 TFLOP/s bf16), NVLink 3 inside a node
# (300 GB/s each way), 8 × 200 Gb/s InfiniBand per node (25 GB/s per GPU); the latencies are our assumption.
SC21_CLUSTER = {"devices_per_node": 8, "memory_bytes": 80 * 2**30, "inside": (5e-6, 300e9), "between": (10e-6, 25e9),
                    "peak_flops_per_second": 312e12}
SC21_OPTIONS = {"schedules": ("gpipe", "1f1b", "interleaved"), "recompute": ("none", "full")}  # what 2021 had


@dataclass(frozen=True)
class TransformerSpec:
    """A GPT-like decoder stack: L layers of width h with a heads, sequences of s tokens, V words."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    bytes_per_value: int = 2  # 16-bit parameters, gradients and activations (mixed precision)

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab", "bytes_per_value"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TransformerSpec.{name} must be a positive int, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"TransformerSpec: hidden={self.hidden} must be a multiple of heads={self.heads} "
                             "(each head has hidden/heads dimensions)")

    @property
    def layer_parameters(self) -> int:
        """12h² + 13h: attention and MLP weights, their biases, two layer norms."""
        return 12 * self.hidden**2 + 13 * self.hidden

    @property
    def embedding_parameters(self) -> int:
        """V·h: the word embedding, which the output layer reuses (tied)."""
        return self.vocab * self.hidden

    @property
    def parameters(self) -> int:
        """L·(12h² + 13h) + V·h + s·h + 2h (SC21 eq. 2, with the final layer norm's 2h)."""
        return (self.layers * self.layer_parameters + self.embedding_parameters + self.seq * self.hidden
                + 2 * self.hidden)

    def layer_forward_flops(self, micro_batch: int) -> float:
        """24·b·s·h² + 4·b·s²·h: one layer's forward matrix multiplies for b sequences (SC21 §5.1)."""
        b, s, h = micro_batch, self.seq, self.hidden
        return 24 * b * s * h * h + 4 * b * s * s * h

    def attention_core_flops(self, micro_batch: int) -> float:
        """4·b·s²·h: Q·Kᵀ and scores·V, what selective recomputation runs again (Korthikanti §4.2)."""
        return 4 * micro_batch * self.seq**2 * self.hidden

    def logits_forward_flops(self, micro_batch: int) -> float:
        """2·b·s·h·V: the output layer's forward."""
        return 2 * micro_batch * self.seq * self.hidden * self.vocab

    def iteration_flops(self, global_batch: int, recompute: str = "none") -> float:
        """FLOPs of one training iteration of B sequences, SC21 eq. 3 (module docstring):
        72·B·s·L·h²·(1 + s/(6h) + V/(12hL)) without recomputation, 96·B·s·L·h²·(1 + s/(6h) + V/(16hL)) with
        full recomputation, the attention core once more with selective."""
        _check_recompute(recompute)
        layer = self.layer_forward_flops(global_batch)
        passes = {"none": 3 * layer, "selective": 3 * layer + self.attention_core_flops(global_batch),
                  "full": 4 * layer}[recompute]
        return self.layers * passes + 3 * self.logits_forward_flops(global_batch)

    def boundary_bytes(self, micro_batch: int) -> float:
        """b·s·h·bytes: a micro-batch's activation where two layers meet (what a stage sends, what TP all-reduces)."""
        return micro_batch * self.seq * self.hidden * self.bytes_per_value

    def layer_activation_bytes(self, micro_batch: int, tp: int = 1, recompute: str = "none",
                               sequence_parallel: bool = False) -> float:
        """Bytes one layer keeps per micro-batch on one of t ranks (Korthikanti et al. 2022, Table 2)."""
        _check_recompute(recompute)
        s, b, h, a, t = self.seq, micro_batch, self.hidden, self.heads, tp
        if recompute == "full":
            per_sbh = 2 / t if sequence_parallel else 2
        else:
            replicated = 34 / t if sequence_parallel else 10 + 24 / t
            per_sbh = replicated + (5 * a * s / (h * t) if recompute == "none" else 0)
        return s * b * h * per_sbh * self.bytes_per_value / 2

    def working_bytes(self, micro_batch: int, tp: int = 1, recompute: str = "none",
                      sequence_parallel: bool = False) -> float:
        """What recomputation rebuilds at a time during the backward: one layer's full activations with
        full recomputation, 0 otherwise (selective rebuilds only attention's scores, inside the bytes kept)."""
        if recompute != "full":
            return 0.0
        return self.layer_activation_bytes(micro_batch, tp, "none", sequence_parallel)


@dataclass(frozen=True)
class DeviceBytes:
    """What the busiest device holds in one step, in bytes."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations

    def __str__(self) -> str:
        return (f"parameters {format_bytes(self.parameters)}, gradients {format_bytes(self.gradients)}, "
                f"optimizer {format_bytes(self.optimizer)}, activations {format_bytes(self.activations)}")


def _check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE} (activation checkpointing: none, only attention's "
                         f"s² part, or whole layers), got {recompute!r}")
