"""What this machine offers the course: torch build, CPU threads, GPUs."""

from __future__ import annotations

import platform

import torch

__version__ = "0.1.0"


def about() -> dict:
    """A summary of the installation, as a dict (printed by lesson 00 and `pipelab run`)."""
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {
        "pipelab": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda build": torch.version.cuda or "none (CPU-only build)",
        "gpus": gpus,
        "cpu threads": torch.get_num_threads(),
        "stages will run on": "one GPU per stage (or shared GPUs)" if gpus else "the CPU (timings replayed per stage)",
    }


def describe() -> str:
    """`about()` as aligned text lines."""
    info = about()
    width = max(len(k) for k in info)
    return "\n".join(f"{key:<{width}}  {value if value != [] else 'none'}" for key, value in info.items())
