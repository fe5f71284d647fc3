"""What a launched rank is doing, where its launcher can read it: a heartbeat, and the action it is on.

`pl.distributed.launch` (`runtime/launcher/processes.py`) starts a `Reporter` on each rank; the loop
(`runtime/loop.py`) tells it each action, before its receive and again before its compute.
The rank's state lives in a small file the rank maps into its memory: a thread rewrites the
heartbeat every `BEAT_SECONDS`, the loop the action, and the launcher reads the file while
the rank runs, or after it died.  A memory-mapped page needs no system call to change and
is read as it was at the last instruction, so a rank stopped (SIGSTOP) in the middle of an
action still says which action; it no longer beats, while a rank blocked in a receive does.

Details: docs/distributed.md, "When a rank fails".
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path

BEAT_SECONDS = 0.5
SIZE = 512
_HEAD = 64  # [0, 64): "beat started pid", written by the heartbeat thread; the rest by the rank's main thread
_WHEN = 96  # [64, 96): "since steps"; [96, SIZE): "phase<TAB>action<TAB>waiting for"

_reporter: "Reporter | None" = None


class Reporter:
    """This rank's heartbeat and state in `path`.  Phases: starting, waiting (for a message), computing,
    between steps, returned, failed."""

    def __init__(self, path: Path):
        self.started, self.pid = time.time(), os.getpid()
        with open(path, "wb") as file:
            file.write(b" " * SIZE)
        with open(path, "r+b") as file:
            self.map = mmap.mmap(file.fileno(), SIZE)
        self.path, self.steps = path, 0
        self._schedule = self._texts = None  # the schedule last seen, and `_texts(schedule)`
        self.set("starting")
        self._beat()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._beating, name="pipelab-heartbeat", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        self.map[:_HEAD] = f"{time.time():.3f} {self.started:.3f} {self.pid}".ljust(_HEAD).encode()

    def _beating(self) -> None:
        while not self._stop.wait(BEAT_SECONDS):
            self._beat()

    def set(self, phase: str, action: str = "", waiting_for: str = "") -> None:
        """Enter `phase` (at `action`): with the time, and the steps done."""
        self.map[_HEAD:_WHEN] = f"{time.time():.3f} {self.steps}".encode().ljust(_WHEN - _HEAD)
        self.map[_WHEN:] = _text("\t".join((phase, action, waiting_for)))

    def waiting(self, schedule, action) -> None:
        """Before `action`'s receive: waiting for its message, when another device sends it; else computing.
        (The loop's call: one write of bytes made once per action, no clock read.)"""
        if schedule is not self._schedule:
            self._schedule, self._texts = schedule, _texts(schedule)
        texts = self._texts.get(action)
        if texts is None:  # an action of no device's list: computing, from the start
            texts = self._texts[action] = (_text(f"computing\t{action}\t"),) * 2
        self.map[_WHEN:] = texts[0]

    def computing(self, action) -> None:
        """After its receive (`waiting` was called for it first)."""
        self.map[_WHEN:] = self._texts[action][1]

    def step_done(self) -> None:
        """The device's list of actions ran to its end."""
        self.steps += 1
        self.set("between steps")

    def finish(self, phase: str) -> None:
        """The rank's function returned ("returned") or raised ("failed"): keep where it was, stop beating."""
        self._stop.set()
        current = read(self.path)
        self.set(phase, *((current["action"], current["waiting_for"]) if current else ("", "")))


def _text(text: str) -> bytes:
    return text.encode()[:SIZE - _WHEN].ljust(SIZE - _WHEN)


WAITS_FOR = {+1: "an activation", -1: "a gradient"}
"""What an action waits for, by where its producer sends (`KindSpec.sends`): forward to the next stage
(F, E: an activation from stage s-1), back to the previous one (B, I: a gradient from stage s+1)."""


def _texts(schedule) -> dict:
    """{action: (its bytes while it waits, while it computes)}; it waits for "a gradient from rank 1" when
    another device sends its message (`WAITS_FOR`), else it computes from the start."""
    import torch.distributed as dist

    from ...schedules.routes import Routes

    routes, device_of = Routes(schedule), schedule.device_of_stage()
    where = "rank" if dist.is_initialized() and dist.get_world_size() == schedule.n_devices else "pipeline device"
    found = {}
    for action in schedule.all_actions():
        computing = _text(f"computing\t{action}\t")
        producer = routes.producer(action)
        if producer is not None and device_of[producer.stage] != device_of[action.stage]:
            what = WAITS_FOR[producer.spec.sends]
            found[action] = (_text(f"waiting\t{action}\t{what} from {where} {device_of[producer.stage]}"), computing)
        else:
            found[action] = (computing, computing)
    return found


def start(path: Path) -> Reporter:
    """Report this process's progress in `path` (the loop finds it with `reporter()`)."""
    global _reporter
    _reporter = Reporter(path)
    return _reporter


def reporter() -> Reporter | None:
    """This process's reporter: None outside a rank of `pl.distributed.launch`."""
    return _reporter


def read(path: Path) -> dict | None:
    """A rank's state as the launcher reads it: beat, started, pid, phase, action, waiting_for, since, steps;
    None before the rank wrote it."""
    for _ in range(5):  # a read may meet a write halfway: read again
        try:
            data = Path(path).read_bytes()
        except OSError:
            return None
        try:
            beat, started, pid = data[:_HEAD].decode().split()
            since, steps = data[_HEAD:_WHEN].decode().split()
            phase, action, waiting_for = (data[_WHEN:].decode().rstrip(" ").split("\t") + ["", ""])[:3]
            return {"beat": float(beat), "started": float(started), "pid": int(pid), "phase": phase,
                    "action": action, "waiting_for": waiting_for, "since": float(since), "steps": int(steps)}
        except ValueError:
            pass
        time.sleep(0.01)
    return None
