"""Mixture-of-Experts layers that torch.export cannot trace, found before the trace and named with their fix.

Hugging Face's MoE models (Mixtral, Qwen2-MoE, ... in transformers 5) keep each layer's experts as 3-D
weight tensors and choose how to run them with the config's `experts_implementation`:

- "eager" loops in Python over the experts the router picked (`for expert_idx in expert_hit:`): the
  loop's length is a tensor's value, and torch.export stops on it ("Could not guard on data-dependent
  expression Eq(u0, 0)");
- "grouped_mm" (transformers' default where it can dispatch, the CPU included) and "batched_mm" run
  every expert in one multiply: traced, split and exact like any other layer (tests/test_experts.py).

So a model built or switched to "eager" is refused here, naming the module and the one-line switch,
rather than with export's words after it tried.  Any other forward that branches on a tensor's
values fails in the trace itself; `named_split.py` adds what that error means.
"""

from __future__ import annotations

from torch import nn

TRACEABLE = ("grouped_mm", "batched_mm")


def eager_experts(model: nn.Module) -> list[str]:
    """The names of `model`'s experts modules that loop over their experts in Python: transformers'
    `@use_experts_implementation` classes (their forward dispatches on `config._experts_implementation`) set to
    "eager"."""
    return [name for name, module in model.named_modules()
            if hasattr(type(module).forward, "__wrapped__") and hasattr(module, "has_gate")
            and getattr(getattr(module, "config", None), "_experts_implementation", None) == "eager"]


def check_traceable_experts(model: nn.Module) -> None:
    """A ValueError naming the first eager experts module and the switch to a traceable implementation."""
    found = eager_experts(model)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise ValueError(
            f"{found[0]}{more} runs its experts as a Python loop over the experts the router picked "
            "(experts_implementation='eager'): the loop's length is a tensor's value, which torch.export cannot "
            "trace.  Run them as one batched multiply instead (the same numbers): "
            "model.set_experts_implementation('grouped_mm') (or 'batched_mm'), or build the config with "
            "experts_implementation='grouped_mm' (pipelab run: --config experts_implementation=grouped_mm)")
