"""`pipelab.runtime.devices.assign_devices`: one device per stage, or a clear error."""

from __future__ import annotations

import pytest
import torch

import pipelab as pl
from pipelab.runtime import placement
from pipelab.runtime.devices import assign_devices

CPU = torch.device("cpu")


@pytest.fixture
def fake_gpus(monkeypatch):
    """Pretend this torch sees `n` CUDA GPUs (0 means none)."""

    def set_count(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return set_count


def test_cpu_for_every_stage():
    assert assign_devices("cpu", 3) == [CPU, CPU, CPU]
    assert assign_devices(CPU, 2) == [CPU, CPU]
    assert assign_devices(["cpu", torch.device("cpu")], 2) == [CPU, CPU]
    assert assign_devices(("cpu",), 1) == [CPU]


def test_auto_without_cuda_is_cpu(fake_gpus):
    fake_gpus(0)
    assert assign_devices("auto", 4) == [CPU] * 4


@pytest.mark.parametrize("n_gpus, n_stages", [(1, 3), (2, 4), (3, 4), (2, 5), (4, 4), (8, 3), (3, 7)])
def test_auto_spreads_stages_over_the_gpus(fake_gpus, n_gpus, n_stages):
    fake_gpus(n_gpus)
    devices = assign_devices("auto", n_stages)
    indices = [d.index for d in devices]
    assert all(d.type == "cuda" for d in devices) and len(devices) == n_stages
    if n_gpus >= n_stages:
        assert indices == list(range(n_stages))  # one GPU each
    else:
        # neighbouring stages share: contiguous runs, every GPU used, run lengths differ by at most one
        assert indices == sorted(indices) and set(indices) == set(range(n_gpus))
        runs = [indices.count(g) for g in range(n_gpus)]
        assert max(runs) - min(runs) <= 1
    assert indices == [s * n_gpus // n_stages if n_gpus < n_stages else s for s in range(n_stages)]


def test_named_cuda_devices_with_fake_gpus(fake_gpus):
    fake_gpus(2)
    assert assign_devices("cuda", 2) == [torch.device("cuda", 0)] * 2  # a bare "cuda" means cuda:0
    assert assign_devices(["cuda:1", "cuda:0", "cpu"], 3) == [torch.device("cuda", 1), torch.device("cuda", 0), CPU]
    with pytest.raises(ValueError, match=r"cuda:2 was asked for, but only 2 GPU\(s\) are visible"):
        assign_devices(["cuda:0", "cuda:2"], 2)


def test_a_list_of_the_wrong_length():
    with pytest.raises(ValueError, match="devices lists 2 devices for 3 stages"):
        assign_devices(["cpu", "cpu"], 3)
    with pytest.raises(ValueError, match="devices lists 4 devices for 3 stages"):
        assign_devices(["cpu"] * 4, 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_says_so():
    with pytest.raises(ValueError, match=r"torch\.cuda\.is_available\(\) is False"):
        assign_devices("cuda", 2)
    with pytest.raises(ValueError, match=r"cuda:1 was asked for.*torch\.cuda\.is_available"):
        assign_devices(["cpu", "cuda:1"], 2)


def test_cuda_without_a_gpu_says_so_even_where_one_exists(fake_gpus):
    fake_gpus(0)
    with pytest.raises(ValueError, match=r"torch\.cuda\.is_available\(\) is False.*devices='cpu'"):
        assign_devices("cuda:0", 1)


@pytest.mark.parametrize("name", ["tpu", "nonsense", "gpu", "cuda:x", ""])
def test_unknown_device_names(name):
    with pytest.raises(ValueError, match=rf"'{name}' is not a device name.*'cpu'"):
        assign_devices(name, 2)
    with pytest.raises(ValueError, match=rf"'{name}' is not a device name"):
        assign_devices(["cpu", name], 2)


@pytest.mark.parametrize("name", ["meta", "mps", "xpu:0"])
def test_device_types_pipelab_cannot_run_on(name):
    kind = name.split(":")[0]
    with pytest.raises(ValueError, match=rf"'cpu' or 'cuda' devices, not '{kind}'"):
        assign_devices(name, 1)


@pytest.mark.parametrize("bad", [3, None, {"cpu": 1}])
def test_devices_of_the_wrong_type(bad):
    with pytest.raises(TypeError, match=r"devices must be 'auto', a device name or a list"):
        assign_devices(bad, 2)


def test_auto_places_interleaved_stages_where_the_schedule_puts_them(fake_gpus):
    """Interleaved 1F1B puts stage s on device s mod p: with "auto", stage s goes to that device's GPU, not to
    a contiguous block of stages (which would move every chunk's message across GPUs the schedule did not plan)."""
    schedule = pl.schedules.interleaved_1f1b(2, 4, 2)  # 4 stages on 2 devices: 0, 1, 0, 1
    where = schedule.device_of_stage()
    stages = [where[s] for s in range(schedule.n_stages)]
    for n_gpus in (2, 4):
        fake_gpus(n_gpus)
        assert assign_devices("auto", stages) == [torch.device("cuda", d) for d in (0, 1, 0, 1)]
    fake_gpus(1)
    assert assign_devices("auto", stages) == [torch.device("cuda", 0)] * 4
    fake_gpus(4)  # 8 schedule devices on 4 GPUs: neighbours share
    assert [d.index for d in assign_devices("auto", list(range(8)))] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_the_local_engine_places_stages_by_the_schedules_devices(monkeypatch):
    seen = []

    def record(devices, stages):
        seen.append(stages)
        return [torch.device("cpu")] * len(stages)

    monkeypatch.setattr(placement, "assign_devices", record)
    model = pl.models.mlp(depth=8, width=8)
    pl.Pipeline(model, n_stages=4, n_microbatches=4, schedule=pl.schedules.interleaved_1f1b(2, 4, 2),
                loss_fn=torch.nn.MSELoss())
    assert seen == [[0, 1, 0, 1]]
