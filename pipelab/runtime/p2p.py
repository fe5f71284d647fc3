"""Activations and gradients between ranks: `torch.distributed` point-to-point.

The distributed engine's transport (the local engine's is `loop.InProcessTransport`): plain
`dist.isend` / `dist.irecv` pairs, never `dist.batch_isend_irecv` (it hangs on gloo); sends
never block (`finish` waits for them at the end of the step); receives are posted early, in
the order the sender sends on that link, and waited on only by the action that needs them.
NCCL matches point-to-point messages by order and gloo by tag; posting in the sender's order
satisfies both, so any schedule that `validate` accepts runs without deadlock.  Activations
get even tags and gradients odd ones, so with two gloo devices (`use_two_connections`) they
travel on separate connections.  A shape travels once, as a small int64 header.

Details: docs/distributed.md, "Point to point"; the step times on one connection and on two
(`benchmarks/vs_torch_pipelining.py --ranks 2 --connections 1` or `2`): the same page,
"Two connections per pair of ranks".
"""

from __future__ import annotations

import os
import socket
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from ..common.errors import LostRankError, PipelineError
from ..schedules.action import Action
from ..schedules.routes import Routes
from ..schedules.schedule import Schedule

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
HEADER_SIZE = 10  # dtype code, number of dimensions, up to 8 sizes
LOOKAHEAD = 2  # receives posted ahead of need, per sending rank


def _tag(action: Action, n_microbatches: int, header: bool = False) -> int:
    """A tag unique to one message of one step: the producing action, and whether it is the header.

    Even for what goes forward (an F's activation, or its header), odd for what comes back (a
    B's or I's gradient; `KindSpec.sends`): gloo picks the connection by tag modulo its number
    of devices, so with an even number of devices the two directions never share one (module
    docstring).  A stage runs B or I for a micro-batch, never both, so the tag stays unique.
    """
    direction = 0 if action.spec.sends > 0 else 1
    return 2 * (2 * (action.stage * n_microbatches + action.microbatch) + int(header)) + direction




def loopback_interface() -> str | None:
    """The name of this machine's loopback network interface ("lo" on Linux, "lo0" on macOS), or None."""
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)


def use_two_connections(environ=os.environ) -> str | None:
    """For gloo ranks all on this machine: two connections per pair of ranks (module docstring).

    Sets `GLOO_SOCKET_IFNAME` to the loopback interface twice ("lo,lo" on Linux, "lo0,lo0"
    on macOS) unless it is already set, and returns its value (None: no loopback interface
    found, nothing set).  Call it before `dist.init_process_group`.  Across machines set it
    yourself, to the interface that reaches the other machines, twice: `GLOO_SOCKET_IFNAME=eth0,eth0`.
    """
    if "GLOO_SOCKET_IFNAME" not in environ:
        loopback = loopback_interface()
        if loopback is None:
            return None
        environ["GLOO_SOCKET_IFNAME"] = f"{loopback},{loopback}"
    return environ["GLOO_SOCKET_IFNAME"]


def encode_header(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype not in DTYPES or tensor.dim() > HEADER_SIZE - 2:
        raise PipelineError(f"cannot send a {tensor.dtype} tensor of {tensor.dim()} dimensions between stages")
    values = [DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
    return torch.tensor(values + [0] * (HEADER_SIZE - len(values)), dtype=torch.int64)


def decode_header(header: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    values = header.tolist()
    return tuple(values[2:2 + values[1]]), DTYPES[values[0]]


def incoming(schedule: Schedule, rank: int) -> dict[int, list[tuple[Action, Action]]]:
    """{sending rank: [(its producing action, this rank's consumer), ...]} in the order the SENDER runs them.

    Receives are posted in this order: NCCL matches the messages between two ranks by order, so
    posting them in the receiver's own order would hang as soon as the two orders differ (a
    V-shaped table, where a rank's two stages talk to one neighbour in both directions)."""
    routes, device_of_stage = Routes(schedule), schedule.device_of_stage()
    found: dict[int, list[tuple[Action, Action]]] = defaultdict(list)
    for sender, row in enumerate(schedule.actions):
        if sender == rank:
            continue
        for action in row:
            target = routes.consumer_stage(action)
            if target is not None and device_of_stage[target] == rank:
                found[sender].append((action, routes.consumer(action)))
    return found


class _Incoming:
    """One message this rank will receive from another, and the state of its receive."""

    def __init__(self, source: Action, consumer: Action):
        self.source, self.consumer = source, consumer
        self.header: tuple[torch.Tensor, Any] | None = None  # (buffer, work) while a header is expected
        self.payload: tuple[torch.Tensor, Any] | None = None  # (buffer, work) once the receive is posted


class PointToPointTransport:
    """Moves activations and gradients between the ranks of `group` (rank d runs device d's actions)."""

    def __init__(self, schedule: Schedule, rank: int, group, device: torch.device):
        self.schedule, self.rank, self.group, self.device = schedule, rank, group, device
        self.group_size = dist.get_world_size(group)
        self.n_stages, self.n_microbatches = schedule.n_stages, schedule.n_microbatches
        self.exchange_tag = 4 * (self.n_stages * self.n_microbatches + 1)  # above every tag `_tag` gives in a step
        self.device_of_stage = schedule.device_of_stage()
        self.routes = Routes(schedule)
        # per sending rank, the messages it sends to this rank, in its order
        self.channels = {sender: [_Incoming(source, consumer) for source, consumer in messages]
                         for sender, messages in incoming(schedule, rank).items()}
        self.known_shapes: dict[tuple, tuple] = {}  # (boundary stage, input signature) -> (shape, dtype)
        self.headers_sent: set[tuple] = set()
        self.observer = None  # a MemoryObserver, told of each receive buffer when it is posted

    def start_step(self, signatures: list[tuple]) -> None:
        """Reset for a step; `signatures[i]` describes micro-batch i's input (shapes and dtypes)."""
        self.signatures = signatures
        self.local: dict[Action, Any] = {}  # messages between two stages of this rank
        self.sent_shapes: dict[tuple[int, int], tuple] = {}  # (stage, mb) -> (shape, dtype) of the activation sent
        self.sends: list[tuple[Any, torch.Tensor]] = []
        self.next_to_post = {sender: 0 for sender in self.channels}
        self.position = {m.consumer: (sender, k) for sender, queue in self.channels.items() for k, m in enumerate(queue)}
        self.waits: dict[Action, tuple[float, float]] = {}  # consumer action -> (start, end) of its wait
        self.sent_at: dict[Action, float] = {}  # producing action -> when its isend was posted
        for queue in self.channels.values():
            for message in queue:
                message.header = message.payload = None
        for sender in self.channels:
            self._post(sender, LOOKAHEAD - 1, block=False)

    # -- receiving -----------------------------------------------------------------------
    def receive(self, action: Action) -> Any:
        source = self.routes.producer(action)
        if source is None:
            return None
        if self.device_of_stage[source.stage] == self.rank:
            return self.local.pop(source)
        sender, k = self.position[action]
        begin = time.perf_counter()
        self._post(sender, k, block=True)
        buffer, work = self.channels[sender][k].payload
        self._wait(work, sender, f"waiting for {source} from rank {sender}")
        end = time.perf_counter()
        self.waits[action] = (begin, end)
        self.channels[sender][k].payload = None
        self._post(sender, k + LOOKAHEAD, block=False)
        return buffer

    def _post(self, sender: int, upto: int, block: bool) -> None:
        """Post the receives from `sender` up to index `upto`, in order; without `block`, stop at an unknown shape."""
        queue = self.channels[sender]
        while self.next_to_post[sender] <= min(upto, len(queue) - 1):
            message = queue[self.next_to_post[sender]]
            shape = self._shape_of(message, block)
            if shape is None:
                return
            buffer = torch.empty(shape[0], dtype=shape[1], device=self.device)
            work = dist.irecv(buffer, group=self.group, group_src=sender,
                              tag=_tag(message.source, self.n_microbatches))
            message.payload = (buffer, work)
            self.next_to_post[sender] += 1
            if self.observer is not None:
                self.observer.keep(message.consumer.stage, buffer, "received")

    def _shape_of(self, message: _Incoming, block: bool) -> tuple | None:
        source = message.source
        if source.spec.sends < 0:  # a gradient: shaped like the activation this rank sent
            return self.sent_shapes.get((message.consumer.stage, source.microbatch))
        key = (source.stage, self.signatures[source.microbatch])
        if key in self.known_shapes:
            return self.known_shapes[key]
        if message.header is None:
            buffer = torch.empty(HEADER_SIZE, dtype=torch.int64, device=self.device)
            work = dist.irecv(buffer, group=self.group, group_src=self.device_of_stage[source.stage],
                              tag=_tag(source, self.n_microbatches, header=True))
            message.header = (buffer, work)
        buffer, work = message.header
        if not block and not work.is_completed():
            return None
        self._wait(work, self.device_of_stage[source.stage], f"waiting for the shape of {source}")
        self.known_shapes[key] = decode_header(buffer)
        message.header = None
        return self.known_shapes[key]

    # -- sending -------------------------------------------------------------------------
    def send(self, action: Action, tensor: torch.Tensor | None) -> None:
        target = self.routes.consumer_stage(action)
        if target is None:
            return
        forward = action.spec.sends > 0  # an activation (else a gradient going back)
        if forward:
            self.sent_shapes[(action.stage, action.microbatch)] = (tuple(tensor.shape), tensor.dtype)
        destination = self.device_of_stage[target]
        if destination == self.rank:
            self.local[action] = tensor
            return
        if tensor is None:
            raise PipelineError(f"{action.describe()} produced no gradient to send to stage {target}: "
                                "the activation it received did not require grad")
        tensor = tensor.contiguous()
        if forward:
            key = (action.stage, self.signatures[action.microbatch])
            if key not in self.headers_sent:
                header = encode_header(tensor).to(self.device)
                self.sends.append((dist.isend(header, group=self.group, group_dst=destination,
                                              tag=_tag(action, self.n_microbatches, header=True)), header))
                self.headers_sent.add(key)
        self.sent_at[action] = time.perf_counter()
        work = dist.isend(tensor, group=self.group, group_dst=destination, tag=_tag(action, self.n_microbatches))
        self.sends.append((work, tensor))

    def finish(self) -> None:
        """Wait until every message this rank sent has gone (the tensors may then be freed)."""
        for work, _ in self.sends:
            self._wait(work, None, "sending its results")
        self.sends.clear()

    def _wait(self, work, peer: int | None, doing: str) -> None:
        wait(work, self.rank, peer, doing)


def wait(work, rank: int, peer: int | None, doing: str) -> None:
    """Wait for one send or receive of `rank`; a peer that died or timed out becomes a `LostRankError`."""
    try:
        work.wait()
    except RuntimeError as error:
        lost = f"rank {peer}" if peer is not None else "a rank"
        raise LostRankError(f"rank {rank} lost {lost} while {doing} ({lost} died, or timed out): {error}",
                            peer) from error
