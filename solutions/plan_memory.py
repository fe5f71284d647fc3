"""Task 7.1: the planner's memory check for one layout: bytes per device of each stage, and whether they fit."""

from __future__ import annotations

import math
from collections.abc import Sequence

RECOMPUTE = ("none", "selective", "full")


def stage_memory(spec, n_stages: int, tensor_parallel: int, stage: int, micro_batch_size: int,
                 microbatches_in_flight: float, recompute: str = "none") -> dict[str, float]:
    """Bytes one device of pipeline stage ``stage`` holds at its peak in a training step.

    ``spec`` is a GPT-like transformer: an object with the int fields ``layers`` (L),
    ``hidden`` (h), ``heads`` (a), ``seq`` (s, tokens a sequence), ``vocab`` (V) and
    ``bytes_per_value`` (2 for 16-bit values), as ``pl.TransformerSpec`` has (the grader
    passes an object with only these fields: write the formulas, do not call its methods).
    The model is cut into p = ``n_stages`` stages, each split t = ``tensor_parallel`` ways
    (Megatron-LM); b = ``micro_batch_size`` sequences a micro-batch, k =
    ``microbatches_in_flight`` micro-batches whose activations the stage holds at its peak
    (an int or a float: the schedule's count, lesson 04).  Data parallelism changes none of
    it (each replica holds its whole stage; no ZeRO sharding).  The rules are the planner's
    (``pipelab/predict/planner.py``), with B = ``bytes_per_value``:

    - every stage is charged ⌈L/p⌉ layers (the busiest stage's count), each layer
      12h² + 13h parameters (attention's four h×h, the MLP's h×4h and 4h×h, biases, two layer
      norms), split t ways;
    - the word embedding, V·h parameters, split t ways, is on the first stage (stage 0) and,
      tied to the output layer, again on the last (p − 1); the position embedding s·h, not
      split, on the first stage only; the final layer norm's 2h, not split, on the last only;
      a middle stage holds only its layers.  So with n that parameter count:
      ``parameters`` = n·B, ``gradients`` = n·B, ``optimizer`` = n·12 (mixed-precision
      Adam's fp32 copy, momentum and variance: 16 bytes a parameter with the 2 + 2; ZeRO,
      Rajbhandari et al. 2020, §3.1), n·8 when B = 4 (fp32 Adam: its two moments);
    - ``activations`` = k·⌈L/p⌉·A + W, where A is what one layer keeps per micro-batch on
      one of the t ranks (Korthikanti et al. 2022, Table 2, without sequence parallelism:
      the layer norms, dropouts and the layer's input are replicated on the t ranks):

          recompute "none"       A = s·b·h·(10 + 24/t + 5·a·s/(h·t))·B/2
          recompute "selective"  A = s·b·h·(10 + 24/t)·B/2        (attention's s² part rebuilt)
          recompute "full"       A = 2·s·b·h·B/2                  (the layer's input only)

      and W, with "full" only, is one layer's "none" bytes: the layer being rebuilt during
      the backward (W = 0 otherwise).

    Returns a new ``dict`` with exactly the keys "parameters", "gradients", "optimizer",
    "activations", each a ``float``.

    >>> class Tiny:
    ...     layers, hidden, heads, seq, vocab, bytes_per_value = 2, 4, 2, 8, 10, 2
    >>> stage_memory(Tiny(), 1, 1, 0, 1, 1)  # n = 2·244 + 40 + 32 + 8; A = 8·1·4·(34 + 20)
    {'parameters': 1136.0, 'gradients': 1136.0, 'optimizer': 6816.0, 'activations': 3456.0}

    Raises:
        ValueError: if ``n_stages``, ``tensor_parallel`` or ``micro_batch_size`` is below
            1; if ``n_stages`` > L (a stage without a layer); if ``stage`` is not one of
            0 .. p − 1; if ``microbatches_in_flight`` < 0; if ``recompute`` is not one of
            "none", "selective", "full".
    """
    p, t, b, k = n_stages, tensor_parallel, micro_batch_size, microbatches_in_flight
    _check(spec, p, t, b, recompute)
    if not 0 <= stage < p:
        raise ValueError(f"stage must be one of 0 .. {p - 1} (n_stages={p}), got {stage}")
    if k < 0:
        raise ValueError(f"microbatches_in_flight must be >= 0, got {k}")
    L, h, a, s, V, size = spec.layers, spec.hidden, spec.heads, spec.seq, spec.vocab, spec.bytes_per_value
    layers = math.ceil(L / p)
    n = layers * (12 * h * h + 13 * h) / t
    if stage == 0 or stage == p - 1:
        n += V * h / t  # the word embedding, tied with the output layer
    if stage == 0:
        n += s * h  # the position embedding
    if stage == p - 1:
        n += 2 * h  # the final layer norm
    optimizer = 8 if size == 4 else 12
    per_layer = {"none": 10 + 24 / t + 5 * a * s / (h * t), "selective": 10 + 24 / t, "full": 2}[recompute]
    working = (10 + 24 / t + 5 * a * s / (h * t)) if recompute == "full" else 0
    activations = (k * layers * per_layer + working) * s * b * h * size / 2
    return {"parameters": float(n * size), "gradients": float(n * size), "optimizer": float(n * optimizer),
            "activations": float(activations)}


def fits(spec, n_stages: int, tensor_parallel: int, micro_batch_size: int,
         microbatches_in_flight: Sequence[float], recompute: str, memory_bytes: float) -> bool:
    """Whether every stage's device holds at most ``memory_bytes`` (the planner's check).

    ``microbatches_in_flight[s]`` is stage s's k (a list or a tuple of p numbers, left
    unchanged; e.g. 1F1B's min(p − s, m)); the other arguments as in :func:`stage_memory`.
    A device fits when the sum of its four parts is at most ``memory_bytes`` (equal fits).
    Returns a ``bool``.

    >>> class Tiny:
    ...     layers, hidden, heads, seq, vocab, bytes_per_value = 2, 4, 2, 8, 10, 2
    >>> fits(Tiny(), 1, 1, 1, [1], "none", 1136 + 1136 + 6816 + 3456)
    True
    >>> fits(Tiny(), 1, 1, 1, [1], "none", 1136 + 1136 + 6816 + 3455)
    False

    Raises:
        ValueError: as :func:`stage_memory`; if ``microbatches_in_flight`` does not have
            ``n_stages`` numbers.
    """
    _check(spec, n_stages, tensor_parallel, micro_batch_size, recompute)
    if len(microbatches_in_flight) != n_stages:
        raise ValueError(f"microbatches_in_flight needs one number per stage ({n_stages}), got "
                         f"{len(microbatches_in_flight)}")
    totals = [sum(stage_memory(spec, n_stages, tensor_parallel, s, micro_batch_size, k, recompute).values())
              for s, k in enumerate(microbatches_in_flight)]
    return max(totals) <= memory_bytes


def _check(spec, p: int, t: int, b: int, recompute: str) -> None:
    for name, value in (("n_stages", p), ("tensor_parallel", t), ("micro_batch_size", b)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if p > spec.layers:
        raise ValueError(f"n_stages={p} stages for {spec.layers} layers would leave a stage without a layer")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
