"""What the ranks run in tests/test_checkpoint.py (functions given to pl.distributed.launch).

One launch of 4 ranks does it all, since starting ranks costs seconds: ranks 0 and 1 form a
2-stage pipeline (a subgroup), train, save and resume; then all 4 ranks read the same
checkpoint into a 4-stage pipeline.  tests/test_checkpoint_faults.py: one launch of 2 ranks
(`save_faults`) for every way a save is refused or fails, ending with a rank killed mid-save.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

import pipelab as pl
from pipelab.runtime.checkpoints import checkpoint

BATCH = 19  # prime: uneven micro-batches
STEPS = 3  # Adam steps before the checkpoint
MICROBATCHES = 4
LR = 1e-2


UNEVEN = [(0, 1), (1, 6), (6, 8)]  # a 3-stage cut that no equal split gives


def make_model(seed: int = 1, depth: int = 8, width: int = 16):
    return pl.models.mlp(depth=depth, width=width, seed=seed)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A new batch for each step (so that a step's loss depends on the optimizer's state, not only on the weights)."""
    model = make_model()
    return [pl.models.sample_batch(model, BATCH, seed=10 + step) for step in range(STEPS + 2)]


def train(pipe, optimizer, steps) -> list[float]:
    losses = []
    for x, y in steps:
        optimizer.zero_grad(set_to_none=True)
        losses.append(pipe.step(x, y).loss)
        optimizer.step()
    return losses


def fresh(schedule: str, group=None, depth: int = 8):
    """A pipeline on another seed, with an Adam of another lr: whatever matches afterwards came from the checkpoint."""
    model = make_model(seed=99, depth=depth)
    pipe = pl.DistributedPipeline(model, n_microbatches=MICROBATCHES, schedule=schedule, loss_fn=torch.nn.MSELoss(),
                                  group=group)
    return pipe, torch.optim.Adam(pipe.parameters(), lr=5.0)


def save_resume_and_reshard(path: str, model_only_path: str) -> dict:
    """On 4 ranks; what this rank saw (losses, what it saved, the error of a wrong load)."""
    data, found = batches(), {}
    pair = dist.new_group([0, 1])  # every rank takes part in creating them
    trio = dist.new_group([0, 1, 2])
    if dist.get_rank() < 2:
        model = make_model()  # the reference: STEPS + 2 steps without interruption
        pipe = pl.DistributedPipeline(model, n_microbatches=MICROBATCHES, schedule="1f1b", loss_fn=torch.nn.MSELoss(),
                                      group=pair)
        optimizer = torch.optim.Adam(pipe.parameters(), lr=LR)
        found["uninterrupted"] = train(pipe, optimizer, data)

        model = make_model()  # an independent run, saved after STEPS steps
        pipe = pl.DistributedPipeline(model, n_microbatches=MICROBATCHES, schedule="1f1b", loss_fn=torch.nn.MSELoss(),
                                      group=pair)
        optimizer = torch.optim.Adam(pipe.parameters(), lr=LR)
        train(pipe, optimizer, data[:STEPS])
        checkpoint.save(pipe, path, optimizer)
        checkpoint.save(pipe, model_only_path)
        found["parameters"] = {n: p.detach().clone() for n, p in model.named_parameters() if p.device.type != "meta"}
        found["adam"] = {n: {k: v.clone() for k, v in optimizer.state[p].items()}
                         for n, p in model.named_parameters() if p in optimizer.state}

        pipe, optimizer = fresh("1f1b", pair)  # resume on the same 2 stages
        checkpoint.load(pipe, path, optimizer)
        found["resumed p=2"] = train(pipe, optimizer, data[STEPS:])
    dist.barrier()  # the checkpoint is complete before the 4-stage pipeline reads it

    pipe, optimizer = fresh("gpipe")  # 4 stages (and another schedule) read the 2-stage checkpoint
    checkpoint.load(pipe, path, optimizer)
    found["resumed p=4"] = train(pipe, optimizer, data[STEPS:])
    found["stages"] = (pipe.stages, pipe.partition.bounds)

    if dist.get_rank() < 3:  # 3 stages of an uneven cut (1, 5 and 2 blocks) read the 2-stage checkpoint
        model = make_model(seed=99)
        partition = pl.Partition(UNEVEN, [model[a:b] for a, b in UNEVEN], "by hand", [1.0] * len(model))
        pipe = pl.DistributedPipeline(model, n_microbatches=MICROBATCHES, schedule="1f1b",
                                      loss_fn=torch.nn.MSELoss(), split_method=partition, group=trio)
        optimizer = torch.optim.Adam(pipe.parameters(), lr=5.0)
        checkpoint.load(pipe, path, optimizer)
        found["p=3 parameters"] = {n: p.detach().clone() for n, p in model.named_parameters() if p.device.type != "meta"}
        found["p=3 adam"] = {n: {k: v.clone() for k, v in optimizer.state[p].items()}
                             for n, p in model.named_parameters() if p in optimizer.state}
        found["p=3 lr"] = optimizer.param_groups[0]["lr"]
        found["resumed p=3"] = train(pipe, optimizer, data[STEPS:])

    pipe, _ = fresh("gpipe", depth=9)  # another model: every rank refuses it alike, before communicating
    try:
        checkpoint.load(pipe, path)
    except checkpoint.CheckpointError as error:
        found["wrong model"] = str(error)
    return found


# ---- tests/test_checkpoint_faults.py: saves that must be whole or refused ---------------------------------

def snapshot(model, optimizer) -> dict:
    """This rank's parameters and optimizer state, by parameter name."""
    return {"parameters": {n: p.detach().clone() for n, p in model.named_parameters() if p.device.type != "meta"},
            "optimizer": {n: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[p].items()}
                          for n, p in model.named_parameters() if p in optimizer.state}}


def refusal(call) -> dict:
    """What `call()` raised, caught the way a user would, with `except Exception` (DCP's own CheckpointException
    is a BaseException: were it to escape, it would end the rank and the launch)."""
    try:
        call()
    except Exception as error:
        return {"type": type(error).__name__, "message": str(error), "checkpoint error": isinstance(
            error, pl.CheckpointError), "cause": type(error.__cause__).__name__}
    return {"type": None, "message": "", "checkpoint error": False, "cause": None}


@contextlib.contextmanager
def writes_on(rank: int, replacement):
    """DCP's writer of one item replaced on `rank` (torch.distributed.checkpoint.filesystem._write_item)."""
    from torch.distributed.checkpoint import filesystem

    original = filesystem._write_item
    if dist.get_rank() == rank:
        filesystem._write_item = replacement
    try:
        yield
    finally:
        filesystem._write_item = original


def denied(transforms, stream, *args, **kwargs):
    raise PermissionError(13, "Permission denied", getattr(stream, "name", "?"))


def dies_writing(transforms, stream, *args, **kwargs):
    stream.write(b"half a tensor")
    stream.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def as_nobody(call):
    """`call()` as a user without write permission where the mode bits deny it (root ignores them)."""
    if os.geteuid() != 0:
        return call()
    try:
        os.seteuid(65534)  # ("nobody"; the saved uid stays 0, to come back)
    except OSError as error:
        return {"skipped": f"root cannot become another user here ({error})"}
    try:
        return call()
    finally:
        os.seteuid(0)


def save_faults(root: str, read_only: str) -> None:
    """On 2 ranks: every way a save is refused or fails, then a save that rank 1 dies in (so the launch fails:
    what each rank saw is in root/seen-<rank>.pt, written before)."""
    root, rank, data, seen = Path(root), dist.get_rank(), batches(), {}
    model = make_model()
    pipe = pl.DistributedPipeline(model, n_microbatches=MICROBATCHES, schedule="1f1b", loss_fn=torch.nn.MSELoss())
    adam = torch.optim.Adam(pipe.parameters(), lr=LR)
    train(pipe, adam, data[:2])
    checkpoint.save(pipe, root / "adam", adam)
    seen["adam"] = snapshot(model, adam)
    seen["again"] = refusal(lambda: checkpoint.save(pipe, root / "adam", adam))  # without overwrite=True

    train(pipe, adam, data[2:3])
    checkpoint.save(pipe, root / "adam", adam, overwrite=True)
    seen["overwritten"] = snapshot(model, adam)
    seen["files after overwrite"] = sorted(p.name for p in root.iterdir())
    dist.barrier()  # (both ranks looked before rank 0 adds a directory)

    (root / "notes").mkdir(exist_ok=True)
    (root / "notes" / "todo.txt").write_text("not a checkpoint")
    seen["not a checkpoint"] = refusal(lambda: checkpoint.save(pipe, root / "notes", adam, overwrite=True))

    sgd = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=0.9)
    train(pipe, sgd, data[3:4])
    checkpoint.save(pipe, root / "sgd", sgd)
    seen["sgd"] = snapshot(model, sgd)

    with writes_on(1, denied):  # DCP fails on rank 1: every rank gets DCP's CheckpointException
        seen["write denied"] = refusal(lambda: checkpoint.save(pipe, root / "denied", adam))
    dist.barrier()  # (rank 0 removes what the failed save wrote while rank 1 may already be here)
    seen["files after denied"] = sorted(p.name for p in root.iterdir())
    seen["read-only"] = as_nobody(lambda: refusal(lambda: checkpoint.save(pipe, Path(read_only) / "ckpt", adam)))
    seen["files in read-only"] = sorted(p.name for p in Path(read_only).iterdir())
    torch.save(seen, root / f"seen-{rank}.pt")
    dist.barrier()

    train(pipe, adam, data[4:5])
    with writes_on(1, dies_writing):  # rank 1 is killed halfway through its file
        checkpoint.save(pipe, root / "adam", adam, overwrite=True)
