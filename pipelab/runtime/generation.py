"""Pipelined generation (greedy decoding) of a tiny GPT: m lanes of sequences in flight, one token per lane per round.

The prompts are cut into m lanes (groups of sequences, `microbatch.split`).  In round r, lane j's
newest tokens (round 0: its whole prompt) go through every stage, each stage running its blocks
with lane j's own key/value cache (`model/kv_cache.py`); the last stage picks the next token
(argmax), which is lane j's input to stage 0 in round r + 1.  A stage runs (r, j) after
(r, j − 1), so with m ≥ p lanes every stage has work once the pipeline is full: a token
generation is a pipeline whose micro-batches come back around (PyTorch's torchchat calls the
groups in flight lanes).  With one lane, p − 1 of the p stages idle at every token.

Timing: each stage op is timed here, in one process on one thread, and the times are replayed
with the dependencies (one clock per stage, as the local engine replays a step): stage s may run
(r, j) once it is free and stage s − 1 has finished (r, j); stage 0 also waits for the token of
(r − 1, j) from the last stage.  The Trace has one E per (stage, round, lane), micro-batch index
r·m + j.  On ranks (`generate_on_ranks`, `DistributedPipeline.generate`) the same order runs for real:
one stage per process, messages between them, each rank's clock measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..model import microbatch
from ..model.kv_cache import cached_forward
from ..schedules.action import Kind
from ..schedules.trace import Event, MemorySample, Trace


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # the prompts followed by the new tokens: (batch, prompt length + new_tokens)
    trace: Trace  # one E per (stage, round, lane); micro-batch index round * lanes + lane
    new_tokens: int  # per sequence

    @property
    def tokens_per_second(self) -> float:
        """New tokens of every sequence over the replayed time: batch · new_tokens / makespan."""
        return self.tokens.shape[0] * self.new_tokens / self.trace.makespan if self.trace.makespan else 0.0


def _check(prompts: torch.Tensor, new_tokens: int, lanes: int) -> None:
    if not isinstance(prompts, torch.Tensor) or prompts.dim() != 2 or prompts.dtype not in (torch.int32, torch.int64):
        raise TypeError("prompts are token ids shaped (batch, prompt length), an integer tensor")
    for name, value in (("new_tokens", new_tokens), ("lanes", lanes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if lanes > prompts.shape[0]:
        raise ValueError(f"{lanes} lanes need at least {lanes} prompts, got {prompts.shape[0]}")


def generate(stages: list, devices: list, device_of_stage: dict[int, int], prompts: torch.Tensor, new_tokens: int,
             lanes: int) -> GenerationResult:
    """Greedy generation of `new_tokens` per prompt through `stages` (a split `pl.models.tiny_gpt`), `lanes` groups
    of sequences in flight (module docstring)."""
    _check(prompts, new_tokens, lanes)
    groups = microbatch.split(prompts, lanes)
    caches = [[{} for _ in stages] for _ in groups]  # lane -> stage -> its blocks' keys and values
    generated: list[list[torch.Tensor]] = [[] for _ in groups]
    seconds: dict[tuple[int, int, int], float] = {}  # (stage, round, lane) -> measured
    with torch.no_grad():
        for r in range(new_tokens):
            for j, group in enumerate(groups):
                x, start = (group, 0) if r == 0 else (generated[j][-1], group.shape[1] + r - 1)
                for s, stage in enumerate(stages):
                    x = x.to(devices[s])
                    begin = time.perf_counter()
                    x = cached_forward(stage, x, caches[j][s], start)
                    if s == len(stages) - 1:
                        x = x[:, -1:].argmax(dim=-1)  # greedy: the next token, (lane batch, 1)
                    if x.device.type == "cuda":
                        torch.cuda.synchronize(x.device)
                    seconds[s, r, j] = time.perf_counter() - begin
                generated[j].append(x.to(prompts.device))
    tokens = torch.cat([torch.cat([group, *new], dim=1) for group, new in zip(groups, generated)], dim=0)
    trace = _replay(seconds, len(stages), new_tokens, len(groups), device_of_stage)
    return GenerationResult(tokens, trace, new_tokens)


def _replay(seconds: dict, p: int, rounds: int, lanes: int, device_of_stage: dict[int, int]) -> Trace:
    """The measured op times on one clock per device, with generation's dependencies (module docstring)."""
    end: dict[tuple[int, int, int], float] = {}
    free = {d: 0.0 for d in set(device_of_stage.values())}
    events = []
    for r in range(rounds):  # (round, lane, stage) order: every dependency comes earlier in it
        for j in range(lanes):
            for s in range(p):
                device = device_of_stage[s]
                ready = end[s - 1, r, j] if s > 0 else (end[p - 1, r - 1, j] if r > 0 else 0.0)
                start = max(free[device], ready)
                end[s, r, j] = free[device] = start + seconds[s, r, j]
                events.append(Event(Kind.E, s, r * lanes + j, start, end[s, r, j], device))
    n_devices = len(free)
    memory = [MemorySample(d, 0.0, 0) for d in range(n_devices)]
    return Trace(events, memory, "replayed", p, rounds * lanes, n_devices, "generation")


def generate_on_ranks(stage, stage_index: int, n_stages: int, group, device: torch.device, prompts: torch.Tensor,
                      new_tokens: int, lanes: int) -> GenerationResult:
    """The same greedy generation with stage s on rank s of `group` (call it on every rank, the same prompts).

    Each rank runs its stage for (round, lane) in the same order as `generate`: stage s > 0 receives the
    lane's hidden states from rank s − 1 (a 3-int shape, then the values), stage 0 the lane's newest token
    from the last rank (round 0: the prompt), and the last rank sends each token back to rank 0, which
    closes the ring.  Sends do not block (`isend`), so rank 0 can go on with the next lanes.  The Trace
    holds every rank's E actions as measured on its own clock from a common barrier; the tokens go from
    the last rank to all."""
    _check(prompts, new_tokens, lanes)
    dist = torch.distributed
    groups = microbatch.split(prompts, lanes)
    ranks = [dist.get_global_rank(group, r) for r in range(n_stages)]
    first, last = stage_index == 0, stage_index == n_stages - 1
    caches = [{} for _ in groups]
    generated: list[list[torch.Tensor]] = [[] for _ in groups]
    sends, events = [], []

    def send(tensor: torch.Tensor, to: int) -> None:
        tensor = tensor.detach().to(device).contiguous()
        sends.append((dist.isend(tensor, ranks[to], group=group), tensor))  # the tensor kept until it is sent

    def receive(shape, dtype, source: int) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(buffer, ranks[source], group=group)
        return buffer

    dist.barrier(group)
    begin_all = time.perf_counter()
    with torch.no_grad():
        for r in range(new_tokens):
            for j, lane in enumerate(groups):
                start = 0 if r == 0 else lane.shape[1] + r - 1
                if not first:
                    shape = receive((3,), torch.int64, stage_index - 1).tolist()
                    x = receive(shape, torch.float32, stage_index - 1)
                elif r == 0:
                    x = lane
                else:
                    x = generated[j][-1] if last else receive((lane.shape[0], 1), torch.int64, n_stages - 1)
                begin = time.perf_counter()
                x = cached_forward(stage, x.to(device), caches[j], start)
                if last:
                    x = x[:, -1:].argmax(dim=-1)
                if x.device.type == "cuda":
                    torch.cuda.synchronize(x.device)
                events.append(Event(Kind.E, stage_index, r * len(groups) + j, begin - begin_all,
                                    time.perf_counter() - begin_all, stage_index))
                if last:
                    generated[j].append(x.cpu())
                    if not first and r + 1 < new_tokens:
                        send(x, 0)
                else:
                    send(torch.tensor(x.shape, dtype=torch.int64, device=x.device), stage_index + 1)
                    send(x.float(), stage_index + 1)
    for work, _ in sends:
        work.wait()
    width = prompts.shape[1] + new_tokens
    tokens = (torch.cat([torch.cat([lane, *new], dim=1) for lane, new in zip(groups, generated)], dim=0)
              if last else torch.empty(prompts.shape[0], width, dtype=torch.int64))
    tokens = tokens.to(device=device, dtype=torch.int64)  # NCCL broadcasts GPU tensors only
    dist.broadcast(tokens, ranks[-1], group=group)
    tokens = tokens.cpu()
    every = [None] * n_stages
    dist.all_gather_object(every, events, group=group)
    memory = [MemorySample(d, 0.0, 0) for d in range(n_stages)]
    trace = Trace([e for rank in every for e in rank], memory, "measured", n_stages, new_tokens * len(groups),
                  n_stages, "generation", n_processes=n_stages)
    return GenerationResult(tokens.to(prompts.dtype), trace, new_tokens)
