"""Choose a device for every stage: one GPU each when there are enough, shared GPUs when fewer, else CPU."""

from __future__ import annotations

import torch


def assign_devices(devices, stages: int | list[int]) -> list[torch.device]:
    """Resolve `devices` ("auto", "cpu", "cuda", "cuda:1" or a list, one per stage) to one device per stage.

    `stages`: the number of stages, one per schedule device, or the schedule's device of each
    stage (`Schedule.device_of_stage`; interleaved 1F1B puts stage s on device s mod p).
    "auto" with g GPUs and D schedule devices: schedule device d runs on cuda:d when g >= D,
    else on cuda:floor(d * g / D) (neighbouring devices share a GPU); CPU when there is no GPU.
    """
    device_of_stage = list(range(stages)) if isinstance(stages, int) else list(stages)
    n_stages, n_devices = len(device_of_stage), max(device_of_stage, default=-1) + 1
    if isinstance(devices, str) and devices == "auto":
        n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n_gpus == 0:
            return [torch.device("cpu")] * n_stages
        return [torch.device("cuda", d if n_gpus >= n_devices else d * n_gpus // n_devices) for d in device_of_stage]
    if isinstance(devices, (str, torch.device)):
        chosen = [_parse(devices)] * n_stages
    elif isinstance(devices, (list, tuple)):
        if len(devices) != n_stages:
            raise ValueError(f"devices lists {len(devices)} devices for {n_stages} stages; give one per stage")
        chosen = [_parse(d) for d in devices]
    else:
        raise TypeError(f"devices must be 'auto', a device name or a list of them, got {type(devices).__name__}")
    for device in chosen:
        _check_available(device)
    return chosen


def _parse(name) -> torch.device:
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{name!r} is not a device name (try 'cpu', 'cuda' or 'cuda:0'): {error}") from None
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    return device


def _check_available(device: torch.device) -> None:
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise ValueError(f"pipelab runs stages on 'cpu' or 'cuda' devices, not {device.type!r}")
    if not torch.cuda.is_available():
        raise ValueError(
            f"{device} was asked for, but this torch sees no CUDA GPU (torch.cuda.is_available() is False); "
            "use devices='cpu' or devices='auto'"
        )
    if device.index >= torch.cuda.device_count():
        raise ValueError(f"{device} was asked for, but only {torch.cuda.device_count()} GPU(s) are visible")
