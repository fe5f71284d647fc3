"""What the ranks run in tests/test_distributed.py (functions given to pl.distributed.launch)."""

from __future__ import annotations

import os
import signal
import time

import psutil
import torch
import torch.distributed as dist

import pipelab as pl
from pipelab.runtime.launcher import forkserver

BATCH = 19  # prime: most m give uneven micro-batches


def running_children() -> list[int]:
    """Processes this test started that still run (multiprocessing's resource tracker and the server that ranks
    are forked from aside: both live as long as this process, runtime/launcher/forkserver.py)."""
    found = []
    server = forkserver.server()
    for child in psutil.Process().children(recursive=True):
        try:
            if (child.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(child.cmdline())
                    and (server is None or child.pid != server[0])):
                found.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def launched_ranks(parent_pid: int) -> list[psutil.Process]:
    """The ranks `pl.distributed.launch` started under process `parent_pid`, oldest first: forked from a
    forkserver (the ranks are the server's children, with its command line), or spawned."""
    found, forked = [], "multiprocessing.forkserver"
    for child in psutil.Process(parent_pid).children(recursive=True):
        try:
            line = " ".join(child.cmdline())
            if "multiprocessing.spawn" in line or (forked in line and forked in " ".join(child.parent().cmdline())):
                found.append(child)
        except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
            pass
    return sorted(found, key=lambda p: (p.create_time(), p.pid))


def no_children_left() -> list[int]:
    deadline = time.monotonic() + 10
    while running_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    return running_children()


def make_model(kind: str):
    if kind == "mlp":
        return pl.models.mlp(depth=8, width=16, seed=1)
    return pl.models.tiny_gpt(n_layers=6, d_model=16, n_heads=2, vocab_size=32, seq_len=6, seed=1)


def unusual_schedules() -> dict[int, pl.Schedule]:
    """Valid schedules whose receivers take messages in another order than their senders send them."""
    two = pl.Schedule.from_text("""
        device 0 | F0 F1 F2 B0 B1 B2
        device 1 | F1 B1 F2 B2 F0 B0
    """)
    three = pl.Schedule.from_text("""
        device 0 | F1 F0 B0 B1
        device 1 | F0 F1 B1 B0
        device 2 | F1 B1 F0 B0
    """)
    return {2: two, 3: three}


def run_cases(cases: list[tuple]) -> list[dict]:
    """On every rank: one step per case (model kind, schedule, m); what this rank saw."""
    found = []
    for kind, schedule, n_microbatches in cases:
        model = make_model(kind)
        x, y = pl.models.sample_batch(model, BATCH, seed=2)
        pipe = pl.DistributedPipeline(model, n_microbatches=n_microbatches, schedule=schedule,
                                      loss_fn=pl.models.default_loss(model))
        result = pipe.step(x, y)
        found.append({
            "loss": result.loss,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            "freed": sorted(n for n, p in model.named_parameters() if p.device.type == "meta"),
            "trace": result.trace,
            "op_seconds": result.op_seconds,
            "offset": (pipe.clock_offset, pipe.clock_error),
        })
    return found


def bad_launch(kind_of_mistake: str) -> str:
    """Make a mistake every rank makes alike; return the message each rank got (none may communicate)."""
    model = make_model("mlp")
    loss_fn = torch.nn.MSELoss()
    try:
        if kind_of_mistake == "world size":
            pl.DistributedPipeline(model, n_microbatches=4, schedule=pl.schedules.one_f_one_b(3, 4), loss_fn=loss_fn)
        elif kind_of_mistake == "other m":
            pl.DistributedPipeline(model, n_microbatches=4, schedule=pl.schedules.gpipe(dist.get_world_size(), 8),
                                   loss_fn=loss_fn)
        elif kind_of_mistake == "m < 1":
            pl.DistributedPipeline(model, n_microbatches=0, schedule="1f1b", loss_fn=loss_fn)
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def same_batch(*shapes: tuple) -> list[torch.Tensor]:
    """Random tensors of `shapes`, the same on every rank (every rank is given the same whole batch)."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def wrong_feature_size() -> None:
    model = make_model("mlp")
    pipe = pl.DistributedPipeline(model, n_microbatches=2, schedule="1f1b", loss_fn=torch.nn.MSELoss())
    pipe.step(*same_batch((8, 7), (8, 16)))


def one_rank_fails(failing_rank: int, how: str) -> None:
    """One good step, then `failing_rank` raises or kills itself ("raise" / "kill"); the others wait for it."""
    model = make_model("mlp")
    pipe = pl.DistributedPipeline(model, n_microbatches=4, schedule="1f1b", loss_fn=torch.nn.MSELoss())
    x, y = same_batch((8, 16), (8, 16))
    pipe.step(x, y)
    if dist.get_rank() == failing_rank:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"rank {failing_rank} gives up on purpose")
    pipe.step(x, y)


def stops_itself(stopped_rank: int) -> None:
    """Two 1F1B steps of a small MLP; in the second, `stopped_rank` stops itself with SIGSTOP as its stage's
    last block begins the forward of micro-batch 2 (rank 1: at 1F2), and never resumes."""
    model = pl.models.mlp(depth=4, width=8, seed=0)
    pipe = pl.DistributedPipeline(model, n_microbatches=4, schedule="1f1b", loss_fn=torch.nn.MSELoss())
    x, y = same_batch((8, 8), (8, 8))
    pipe.step(x, y)
    if dist.get_rank() == stopped_rank:
        calls = []

        def stop_at_the_third(module, inputs):
            calls.append(1)
            if len(calls) == 3:
                os.kill(os.getpid(), signal.SIGSTOP)

        (model[-1] if stopped_rank == 1 else model[0]).register_forward_pre_hook(stop_at_the_third)
    pipe.step(x, y)


def hangs_before_a_step(seconds: float) -> str:
    """Rank 1 builds the pipeline, then hangs for `seconds` without beating (its peer heartbeat stopped, as in a
    process stopped or holding the GIL); rank 0 starts a step, whose batch check (a collective) times out.  What
    rank 0 was told."""
    from pipelab.runtime import peers

    model = pl.models.mlp(depth=4, width=8, seed=0)
    pipe = pl.DistributedPipeline(model, n_microbatches=4, schedule="1f1b", loss_fn=torch.nn.MSELoss())
    x, y = same_batch((8, 8), (8, 8))
    if dist.get_rank() == 1:
        peers._beating["stop"].set()
        time.sleep(seconds)
        return ""
    try:
        pipe.step(x, y)
    except pl.PipelineError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def returns_early(early_rank: int, steps: int) -> int:
    """`steps` 1F1B steps of a small MLP, but `early_rank` returns before its last one; each rank's count."""
    model = pl.models.mlp(depth=4, width=8, seed=0)
    pipe = pl.DistributedPipeline(model, n_microbatches=4, schedule="1f1b", loss_fn=torch.nn.MSELoss())
    x, y = same_batch((8, 8), (8, 8))
    for step in range(steps):
        if dist.get_rank() == early_rank and step == steps - 1:
            return step
        pipe.step(x, y)
    return steps


def waits_forever(folder: str) -> None:
    """Each rank leaves a file in `folder` ("rank0", "rank1"), then waits for a message no rank sends."""
    open(os.path.join(folder, f"rank{dist.get_rank()}"), "w").close()
    dist.recv(torch.zeros(1), src=1 - dist.get_rank())


def both_receive_first() -> None:
    """A deadlock: each rank waits for the other's message before sending its own."""
    buffer = torch.zeros(1)
    dist.recv(buffer, src=1 - dist.get_rank())


def report_pid() -> int:
    time.sleep(0.1)
    return os.getpid()


def environment_and_output(variable: str) -> tuple[str | None, int]:
    """The rank's value of `variable`, its parent's pid; and a line on stdout and on stderr."""
    import sys

    print(f"rank {dist.get_rank()} says on stdout", flush=True)
    print(f"rank {dist.get_rank()} says on stderr", file=sys.stderr, flush=True)
    return os.environ.get(variable), os.getppid()


def nccl_step(kind: str, schedule: str, n_microbatches: int) -> dict:
    """One step on cuda:LOCAL_RANK over NCCL; gradients brought back to the CPU."""
    model = make_model(kind)
    x, y = pl.models.sample_batch(model, BATCH, seed=2)
    pipe = pl.DistributedPipeline(model, n_microbatches=n_microbatches, schedule=schedule,
                                  loss_fn=pl.models.default_loss(model))
    result = pipe.step(x, y)
    return {"loss": result.loss, "device": str(pipe.device), "source": result.trace.source,
            "grads": {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}}


def _io_threads() -> int:
    """gloo's I/O threads ("gloo_tcp_loop"): one per device, so one per connection to each peer."""
    found = 0
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as comm:
            found += comm.read().strip() == "gloo_tcp_loop"
    return found


def _tcp_bytes() -> dict[str, int]:
    """Per TCP socket of this process (by its /proc inode): the bytes it carried so far, sent (acknowledged) plus
    received, from the kernel's own count (TCP_INFO's tcpi_bytes_acked and tcpi_bytes_received, Linux 4.1+)."""
    import socket
    import struct

    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if not target.startswith("socket:"):
                continue
            with socket.socket(fileno=os.dup(int(fd))) as sock:
                if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                    continue
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        except OSError:  # closed meanwhile, or a listening socket
            continue
        if len(info) >= 136:
            acked, received = struct.unpack_from("QQ", info, 120)
            found[target] = acked + received
    return found


def gloo_connections(measure: bool = False) -> tuple:
    """This rank's GLOO_SOCKET_IFNAME, its number of gloo I/O threads and, with `measure`, the bytes each of
    its TCP sockets carried while 200 messages of 4000 bytes went 0 -> 1 under pipelab's activation tags, then
    under its gradient tags: which connection each direction really travels on.  Bytes, counted by the kernel,
    do not depend on how busy the machine is (the I/O threads' wakeups, counted before, did: under load a
    thread reads several messages per wakeup)."""
    from pipelab.runtime.p2p import _tag

    bursts = []
    if measure:
        m = 200
        for kind, stage in (("F", 0), ("B", 1)):
            dist.barrier()
            before = _tcp_bytes()
            message = torch.zeros(1000)
            for i in range(m):
                tag = _tag(pl.Action(kind, stage, i), m, 2)  # the message's first tensor
                (dist.send if dist.get_rank() == 0 else dist.recv)(message, 1 - dist.get_rank(), tag=tag)
            dist.barrier()  # every message received: the sender's last bytes acknowledged, counted in this burst
            after = _tcp_bytes()
            bursts.append({socket: after[socket] - before.get(socket, 0) for socket in after})
    return os.environ.get("GLOO_SOCKET_IFNAME"), _io_threads(), bursts


def shifted_clock(seconds: float) -> dict:
    """Rank 1's clock runs `seconds` ahead (its perf_counter shifted, as another machine's would be); one 1F1B
    step of the MLP, then what rank 0 sees: the offset estimate and the trace's events and messages."""
    import time

    if dist.get_rank() == 1:
        real = time.perf_counter
        time.perf_counter = lambda: real() + seconds
    model = pl.models.mlp(depth=4, width=64, seed=0)
    x, y = pl.models.sample_batch(model, 16)
    pipe = pl.DistributedPipeline(model, n_microbatches=4, schedule="1f1b", loss_fn=torch.nn.MSELoss())
    trace = pipe.step(x, y).trace
    return {"offset": pipe.clock_offset, "error": pipe.clock_error, "events": trace.events,
            "messages": trace.messages}


class Carry(torch.nn.Module):
    """A block whose input and output are a structure: (float tensor, boolean mask, {"scale": tensor, "n": 3}, None);
    the first block builds it from a tensor."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, parts):
        if isinstance(parts, torch.Tensor):
            parts = (parts, parts[:, :1] > 0, {"scale": parts.sum(-1, keepdim=True), "n": 3}, None)
        h, mask, extra, nothing = parts
        assert nothing is None and extra["n"] == 3 and mask.dtype == torch.bool
        h = torch.tanh(self.linear(h * mask + extra["scale"]))
        return h, mask, {"scale": h.mean(-1, keepdim=True), "n": 3}, None


class Head(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = torch.nn.Linear(width, 2)

    def forward(self, parts):
        return self.linear(parts[0])


def structured_model() -> torch.nn.Sequential:
    torch.manual_seed(3)
    return torch.nn.Sequential(*[Carry(8) for _ in range(7)], Head(8))


def run_structured(schedule: str, n_microbatches: int) -> dict:
    """One step of `structured_model` (structures cross every boundary): the loss and this rank's gradients."""
    model = structured_model()
    x, y = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(4)), torch.randn(
        BATCH, 2, generator=torch.Generator().manual_seed(5))
    pipe = pl.DistributedPipeline(model, n_microbatches=n_microbatches, schedule=schedule, loss_fn=torch.nn.MSELoss())
    pipe.step(x, y)  # the first step sends the layouts; the second only tensors
    for p in pipe.parameters():
        p.grad = None
    result = pipe.step(x, y)
    return {"loss": result.loss, "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


class TiedHead(torch.nn.Module):
    """The projection onto the vocabulary with the input embedding's own weight (a tied output layer)."""

    def __init__(self, embedding: torch.nn.Embedding):
        super().__init__()
        self.embedding = embedding

    def forward(self, hidden):
        return hidden @ self.embedding.weight.T


def tied_model() -> torch.nn.Sequential:
    """Embedding, Linear | Tanh, TiedHead: cut in two, the embedding's weight is used on both ranks."""
    torch.manual_seed(7)
    embedding = torch.nn.Embedding(11, 8)
    return torch.nn.Sequential(embedding, torch.nn.Linear(8, 8), torch.nn.Tanh(), TiedHead(embedding))


def tied_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(8)
    return torch.randint(0, 11, (6, 5), generator=generator), torch.randn(6, 5, 11, generator=generator)


def sums_on_two_ranks() -> dict:
    """On every rank, two sums a step must get right: `existing`, the largest difference of this rank's gradients
    from twice the plain step's, after a pipelined step onto one plain step's gradients (its first step: warmed up
    before it); `tied`, the gradients this rank holds after one step of `tied_model`."""
    model = pl.models.mlp(depth=4, width=16, seed=3)
    x, y = same_batch((12, 16), (12, 16))
    _, grads = pl.single_device_gradients(model, x, y, torch.nn.MSELoss())
    torch.nn.MSELoss()(model(x), y).backward()
    pipe = pl.DistributedPipeline(model, n_microbatches=3, schedule="1f1b", loss_fn=torch.nn.MSELoss())
    pipe.step(x, y)
    existing = max((p.grad - 2 * grads[n]).abs().max().item() for n, p in model.named_parameters()
                   if p.device.type != "meta")
    tied = tied_model()
    pipe = pl.DistributedPipeline(tied, n_microbatches=2, schedule="1f1b", loss_fn=torch.nn.MSELoss())
    pipe.step(*tied_batch())
    return {"existing": existing, "tied": {n: p.grad.clone() for n, p in tied.named_parameters() if p.grad is not None},
            "shared": pipe.shared.ranks}