"""The schedule IR: a schedule is data.  `Action` and `Schedule`, the generators (GPipe, 1F1B,
interleaved, zero bubble, PipeDream), PyTorch's tables, `validate`, the dependency loop every
interpreter shares, and the `Trace` every interpreter returns.  Imports only `pipelab.common`."""

from .action import KINDS, NEEDS, Action
from .beyond import count_messages, interleaved_1f1b, zero_bubble_h1
from .generators import GENERATORS, by_name, gpipe, one_f_one_b, pipedream_async
from .inference import forward_only_like, generation, inference
from .schedule import Schedule, check_structure
from .torch_csv import from_torch_csv, to_torch_csv
from .torch_tables import TORCH_NAMES, from_torch, torch_schedule, torch_table
from .validate import explain_stuck, validate

__all__ = [
    "KINDS", "NEEDS", "Action", "Schedule", "GENERATORS", "TORCH_NAMES", "by_name", "check_structure",
    "count_messages", "explain_stuck", "forward_only_like", "from_torch", "generation", "gpipe", "inference", "interleaved_1f1b",
    "one_f_one_b",
    "pipedream_async", "from_torch_csv", "to_torch_csv", "torch_schedule", "torch_table", "validate",
    "zero_bubble_h1",
]
