"""Activations and gradients between ranks: `torch.distributed` point-to-point.

The distributed engine's transport (the local engine's is `loop.InProcessTransport`): plain
`dist.isend` / `dist.irecv` pairs, never `dist.batch_isend_irecv` (it hangs on gloo); sends
never block (`finish` waits for them at the end of the step); receives are posted early, in
the order the sender sends on that link, and waited on only by the action that needs them.
NCCL matches point-to-point messages by order and gloo by tag; posting in the sender's order
satisfies both, so any schedule that `validate` accepts runs without deadlock.  Activations
get even tags and gradients odd ones, so with two gloo devices (`use_two_connections`) they
travel on separate connections.  A message is any structure of tensors and values; its layout
(`message_layout.py`) travels once per input shape, then only its tensors, one send each.

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
from torch.utils._pytree import tree_flatten

from ..common.errors import LostRankError, PipelineError
from ..schedules.action import Action
from ..schedules.routes import Routes
from ..schedules.schedule import Schedule
from . import peers
from .message_layout import MessageLayout, gradient_leaves

MAX_TENSORS = 64  # tensors in one message
SLOTS = MAX_TENSORS + 2  # tags per message: the layout's length, the layout, one per tensor
LOOKAHEAD = 2  # receives posted ahead of need, per sending rank


def _tag(action: Action, n_microbatches: int, slot: int, n_stages: int | None = None) -> int:
    """A tag unique to one message of one step: the producing action, and the slot: 0 for the layout's length,
    1 for the layout, 2 + k for the message's k-th tensor (`SLOTS`).

    Even for what goes forward (an F's activation), odd for what comes back (a B's or I's
    gradient; `KindSpec.sends`; and the token a generation's last stage sends round to stage 0,
    `KindSpec.wraps`): gloo picks the connection by tag modulo its number of devices, so with an
    even number of devices the two directions never share one (module docstring).  A stage runs
    B or I for a micro-batch, never both, so the tag stays unique.
    """
    back = action.spec.sends < 0 or (action.spec.wraps and n_stages is not None and action.stage == n_stages - 1)
    direction = 1 if back else 0
    return 2 * ((action.stage * n_microbatches + action.microbatch) * SLOTS + slot) + direction


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
        self.header: tuple[torch.Tensor, Any] | None = None  # (length buffer, work) while a layout is expected
        self.payload: tuple[MessageLayout, list[tuple[torch.Tensor, Any]]] | None = None  # once its receives are posted


class PointToPointTransport:
    """Moves activations and gradients between the ranks of `group` (rank d runs device d's actions)."""

    def __init__(self, schedule: Schedule, rank: int, group, device: torch.device):
        self.schedule, self.rank, self.group, self.device = schedule, rank, group, device
        self.group_size = dist.get_world_size(group)
        self.n_stages, self.n_microbatches = schedule.n_stages, schedule.n_microbatches
        self.exchange_tag = 2 * SLOTS * (self.n_stages * self.n_microbatches + 1)  # above every tag of `_tag`
        self.device_of_stage = schedule.device_of_stage()
        self.routes = Routes(schedule)
        # per sending rank, the messages it sends to this rank, in its order
        self.channels = {sender: [_Incoming(source, consumer) for source, consumer in messages]
                         for sender, messages in incoming(schedule, rank).items()}
        self.known_layouts: dict[tuple, MessageLayout] = {}  # (boundary stage, input signature) -> what arrives
        self.layouts_sent: dict[tuple, MessageLayout] = {}  # (boundary stage, input signature) -> what was announced
        self.observer = None  # a MemoryObserver, told of each receive buffer when it is posted

    def start_step(self, signatures: list[tuple]) -> None:
        """Reset for a step; `signatures[i]` describes micro-batch i's input (shapes and dtypes)."""
        self.signatures = signatures
        self.local: dict[Action, Any] = {}  # messages between two stages of this rank
        self.sent_layouts: dict[tuple[int, int], MessageLayout] = {}  # (stage, mb) -> the layout of the activation sent
        self.sends: list[tuple[Any, torch.Tensor, int]] = []  # (the isend, its tensor kept alive, to whom)
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
        layout, receives = self.channels[sender][k].payload
        for _, work in receives:
            self._wait(work, sender, f"waiting for {source} from rank {sender}")
        end = time.perf_counter()
        self.waits[action] = (begin, end)
        self.channels[sender][k].payload = None
        self._post(sender, k + LOOKAHEAD, block=False)
        return layout.rebuild([buffer for buffer, _ in receives])

    def _post(self, sender: int, upto: int, block: bool) -> None:
        """Post the receives from `sender` up to index `upto`, in order; without `block`, stop at an unknown shape."""
        queue = self.channels[sender]
        while self.next_to_post[sender] <= min(upto, len(queue) - 1):
            message = queue[self.next_to_post[sender]]
            layout = self._layout_of(message, block)
            if layout is None:
                return
            receives = [(buffer, dist.irecv(buffer, group=self.group, group_src=sender,
                                            tag=_tag(message.source, self.n_microbatches, 2 + k, self.n_stages)))
                        for k, buffer in enumerate(layout.empty(self.device))]
            message.payload = (layout, receives)
            self.next_to_post[sender] += 1
            if self.observer is not None:
                for buffer, _ in receives:
                    self.observer.keep(message.consumer.stage, buffer, "received")

    def _layout_of(self, message: _Incoming, block: bool) -> MessageLayout | None:
        """What `message` holds; an activation of a new input shape first receives its layout (a length, then the
        bytes); without `block`, None while the length has not arrived."""
        source = message.source
        if source.spec.sends < 0:  # a gradient: laid out like the activation this rank sent
            sent = self.sent_layouts.get((message.consumer.stage, source.microbatch))
            return None if sent is None else sent.of_gradient()
        key = (source.stage, self.signatures[source.microbatch])
        if key in self.known_layouts:
            return self.known_layouts[key]
        peer = self.device_of_stage[source.stage]
        if message.header is None:
            length = torch.zeros(1, dtype=torch.int64, device=self.device)
            message.header = (length, dist.irecv(length, group=self.group, group_src=peer,
                                                 tag=_tag(source, self.n_microbatches, 0, self.n_stages)))
        length, work = message.header
        if not block and not work.is_completed():
            return None
        self._wait(work, peer, f"waiting for the layout of {source}")
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        tag = _tag(source, self.n_microbatches, 1, self.n_stages)
        self._wait(dist.irecv(data, group=self.group, group_src=peer, tag=tag),
                   peer, f"waiting for the layout of {source}")
        self.known_layouts[key] = MessageLayout.decode(data.cpu())
        message.header = None
        return self.known_layouts[key]

    # -- sending -------------------------------------------------------------------------
    def send(self, action: Action, message: Any) -> None:
        target = self.routes.consumer_stage(action)
        if target is None:
            return
        destination = self.device_of_stage[target]
        if action.spec.sends > 0:  # an activation
            layout = MessageLayout.of(message)
            self.sent_layouts[(action.stage, action.microbatch)] = layout
            if destination != self.rank:
                self._announce(action, layout, destination)
            tensors = [leaf for leaf in tree_flatten(message)[0] if isinstance(leaf, torch.Tensor)]
        else:  # a gradient: laid out like the activation that stage sent here
            if destination != self.rank:  # zeros where a differentiable leaf got no gradient
                layout = self.known_layouts[(target, self.signatures[action.microbatch])]
                tensors = gradient_leaves(layout, message, self.device)
        if destination == self.rank:
            self.local[action] = message
            return
        if len(tensors) > MAX_TENSORS:
            raise PipelineError(f"{action.describe()} sends {len(tensors)} tensors; a message holds at most "
                                f"{MAX_TENSORS}: group them into fewer tensors")
        self.sent_at[action] = time.perf_counter()
        for k, tensor in enumerate(tensors):
            tensor = tensor.contiguous()
            work = dist.isend(tensor, group=self.group, group_dst=destination,
                              tag=_tag(action, self.n_microbatches, 2 + k, self.n_stages))
            self.sends.append((work, tensor, destination))

    def _announce(self, action: Action, layout: MessageLayout, destination: int) -> None:
        """Send the layout the first time a micro-batch input of this shape crosses this boundary; later, check
        that it is the same (values that are not tensors travel in the layout only)."""
        key = (action.stage, self.signatures[action.microbatch])
        announced = self.layouts_sent.get(key)
        if announced is not None:
            if announced != layout:
                raise PipelineError(f"{action.describe()} sends a message laid out otherwise than the one it sent "
                                    f"for a micro-batch of the same shape ({announced.leaves} then {layout.leaves}): a "
                                    "value that is not a tensor may not change between micro-batches")
            return
        data = layout.encode().to(self.device)
        length = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        for slot, tensor in ((0, length), (1, data)):
            self.sends.append((dist.isend(tensor, group=self.group, group_dst=destination,
                                          tag=_tag(action, self.n_microbatches, slot, self.n_stages)), tensor,
                                          destination))
        self.layouts_sent[key] = layout

    def finish(self) -> None:
        """Wait until every message this rank sent has gone (the tensors may then be freed)."""
        for work, _, destination in self.sends:  # the peer named: a cut link ends the run with its host's name
            self._wait(work, destination, f"sending its results to rank {destination}")
        self.sends.clear()

    def _wait(self, work, peer: int | None, doing: str) -> None:
        wait(work, self.rank, peer, doing, self.group)


def wait(work, rank: int, peer: int | None, doing: str, group=None) -> None:
    """Wait for one send or receive of `rank` (ranks of `group`); a peer that died or timed out becomes a
    `LostRankError` that says which, from the peer's heartbeat (`peers.py`): died, stopped responding
    (alive, not progressing), or alive and waiting too."""
    try:
        work.wait()
    except RuntimeError as error:
        lost = f"rank {peer}" if peer is not None else "a rank"
        why = None if peer is None else peers.describe(dist.get_global_rank(group or dist.group.WORLD, peer), error)
        said = f": {why}; " if why else f" ({lost} died, or timed out): "
        raise LostRankError(f"rank {rank} lost {lost} while {doing}{said}{error}", peer) from error
