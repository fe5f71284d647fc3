"""Each rank's heartbeat where the other ranks read it, so that a rank left waiting names the one that stalled.

    peers.start()                  # every rank, once its process group is up (a DistributedPipeline does it)
    peers.describe(1, error)       # after a wait for rank 1 failed: why, in words (p2p.wait)
    with peers.naming_the_stalled(rank): ...   # a collective's timeout names the ranks that stalled

`pl.distributed.launch` watches its ranks from the launcher (`launcher/progress.py`, `processes.py`); under
torchrun nothing does, and a rank stopped by SIGSTOP, or hung holding Python's GIL, leaves the
others waiting until gloo's timeout says "Timed out waiting" and no more.  So every rank beats
into the process group's store (torchrun's c10d store, held by its agent: every host reads it):
a thread sets `pipelab/beat/<global rank>` to "<unix time> <pid> <host>" every `BEAT_SECONDS`,
through a client of its own (`Store.clone`).  A rank whose wait failed reads the peer's key,
then again `WATCH_SECONDS` later:

- the connection was closed or reset: the peer died;
- the key did not change: the peer stopped responding; on the same host its process tells
  how (`/proc/<pid>/stat`: T is stopped, by SIGSTOP or a debugger; running is hung; gone is
  dead); on another host it may also be cut off;
- the key changed: the peer is alive and beating, so it waits too (a deadlock), or its work
  takes longer than the timeout.

"N s ago" compares the peer's clock with this rank's: across hosts, as good as their clocks agree.

Both threads are stopped and joined when the interpreter exits (`_join_at_exit`): a daemon thread still
inside a store call when Python finalizes is ended by `pthread_exit` as it takes the GIL back, which
unwinds through C++ that may not unwind, and the process aborts ("terminate called without an active
exception", SIGABRT) after its work was done.

Details: docs/distributed.md, "When a rank fails".
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ..common.errors import LostRankError, PipelineError

BEAT_SECONDS = 0.5
WATCH_SECONDS = 3 * BEAT_SECONDS  # a heartbeat unchanged for this long has stopped
READ_SECONDS = 2.0  # a store that does not answer within this is said so, not waited for
SILENT_SECONDS = 4.0  # the store has not answered this rank's own heartbeat for this long: it is out of reach
# (a store call to a host that went silent waits on, whatever its timeout: only the time since the last answer tells)
_KEY = "pipelab/beat/{rank}"
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")  # gloo's words
_TIMED_OUT = "Timed out waiting"  # gloo's, when a wait outlasts the process group's timeout

_beating: dict = {}  # "store": the store it beats into, "stop": its Event
_threads: list[threading.Thread] = []  # the heartbeat and readers, joined at exit


def start() -> bool:
    """Beat into the default process group's store from a daemon thread, once per process group (a new group
    stops the old beat).  False where there is nothing to beat into (no group, one rank, a store without
    clients of its own)."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return False
    try:
        store = dist.distributed_c10d._get_default_store()  # private, as torch's own elastic code uses it
        if _beating.get("store") is store:
            return True
        client = store.clone()
        client.set_timeout(timedelta(seconds=READ_SECONDS))
    except Exception:  # a store that cannot make a client of its own: no heartbeat, errors say what gloo says
        return False
    if "stop" in _beating:
        _beating["stop"].set()
    stop, key = threading.Event(), _KEY.format(rank=dist.get_rank())
    value = f"{{:.3f}} {os.getpid()} {socket.gethostname()}"

    def beat():
        while True:
            try:
                client.set(key, value.format(time.time()))
                client.check([key])  # a set is sent unanswered; a reply shows the store still hears this rank
                _beating["answered"] = time.monotonic()
            except Exception:  # the store's host is cut off or gone, or the group was destroyed: none to tell
                _beating["failed"] = True
                return
            if stop.wait(BEAT_SECONDS):
                return

    _beating.pop("failed", None)
    _beating.update(store=store, stop=stop, answered=time.monotonic())
    _start(threading.Thread(target=beat, name="pipelab-peer-heartbeat", daemon=True))
    return True


def _start(thread: threading.Thread) -> None:
    if not _threads:
        atexit.register(_join_at_exit)
    _threads[:] = [t for t in _threads if t.is_alive()] + [thread]
    thread.start()


def _join_at_exit() -> None:
    """Stop the heartbeat and wait for the store calls under way, `READ_SECONDS` + 1 s at most: a call to a store
    that went silent may never return, and is left there (a thread blocked in it never takes the GIL back)."""
    if "stop" in _beating:
        _beating["stop"].set()
    deadline = time.monotonic() + READ_SECONDS + 1.0
    for thread in _threads:
        thread.join(max(0.0, deadline - time.monotonic()))


def describe(rank: int, error: BaseException) -> str | None:
    """Why the wait for global rank `rank` failed with `error`, from its heartbeat: "rank 1 died (...)", "rank 1
    stopped responding 10.3 s ago (...)", "rank 1 is alive and beating (...)"; None when nothing is known (no
    heartbeat: not started, or another store)."""
    if any(sign in str(error) for sign in _PEER_GONE):
        return f"rank {rank} died (its connection closed)"
    found = _watch([rank])
    return None if found is None else found[rank][0]


@contextlib.contextmanager
def naming_the_stalled(rank: int):
    """Around a rank's collectives (a step's batch check, a gather): a gloo timeout becomes a `LostRankError`
    naming the ranks that stopped responding, when some did (else it stays as it was)."""
    try:
        yield
    except PipelineError:
        raise
    except RuntimeError as error:
        if _TIMED_OUT not in str(error) or not dist.is_initialized():
            raise
        others = [r for r in range(dist.get_world_size()) if r != rank]
        found = _watch(others) or {}
        stalled = {r: text for r, (text, stopped) in found.items() if stopped}
        unread = len(others) == 1 and "could not be read" in found.get(others[0], ("", False))[0]
        if not stalled and unread:  # the one rank it waited with, and the store, out of reach: cut off, or gone
            stalled = {others[0]: found[others[0]][0]}
        if not stalled:
            raise
        raise LostRankError(f"rank {rank} lost rank {min(stalled)} while waiting with the other ranks: "
                            f"{'; '.join(stalled.values())}; {error}", min(stalled)) from error


def _watch(ranks: list[int]) -> dict[int, tuple[str, bool]] | None:
    """`_read_beats`, given at most `WATCH_SECONDS + 2 * READ_SECONDS`, and not tried at all once this rank's own
    heartbeat has failed or gone unanswered for `SILENT_SECONDS`: a store across a cut link is not waited for
    (connecting a client to it retries for longer than the rank has before its launcher, whose own store reads
    fail too, stops it; the error it is about to raise must come first)."""
    if "store" not in _beating:
        return None
    silent = time.monotonic() - _beating.get("answered", time.monotonic())
    if "failed" in _beating or silent > SILENT_SECONDS:  # this rank's own beat gets no answer: none can be read
        return {rank: (f"rank {rank}'s heartbeat could not be read (the store has not answered this rank's own "
                       f"heartbeat for {silent:.1f} s: its host does not answer: cut off, or gone)", False)
                for rank in ranks}
    found: list = []
    reader = threading.Thread(target=lambda: found.append(_read_beats(ranks)), name="pipelab-peer-read", daemon=True)
    _start(reader)
    reader.join(WATCH_SECONDS + 2 * READ_SECONDS)
    if found:
        return found[0]
    return {rank: (f"rank {rank}'s heartbeat could not be read within {WATCH_SECONDS + 2 * READ_SECONDS:g} s (the "
                   "store's host does not answer: cut off, or gone)", False) for rank in ranks}


def _read_beats(ranks: list[int]) -> dict[int, tuple[str, bool]]:
    """{rank: (what its heartbeat says, whether it stopped)}, from two readings `WATCH_SECONDS` apart."""
    try:
        client = _beating["store"].clone()
        client.set_timeout(timedelta(seconds=READ_SECONDS))
        keys = {rank: _KEY.format(rank=rank) for rank in ranks}
        never = [rank for rank, key in keys.items() if not client.check([key])]
        first = {rank: client.get(key).decode() for rank, key in keys.items() if rank not in never}
        time.sleep(WATCH_SECONDS)
        last = {rank: client.get(keys[rank]).decode() for rank in first}
    except Exception as failure:  # the store itself is gone or stopped
        return {rank: (f"rank {rank}'s heartbeat could not be read ({type(failure).__name__}: {failure})", False)
                for rank in ranks}
    found = {rank: (f"rank {rank} never beat (it died as it started, or runs no DistributedPipeline)", False)
             for rank in never}
    for rank, value in last.items():
        beat, pid, host = value.split(" ", 2)
        where = f"process {pid} on {host}"
        if value != first[rank]:
            found[rank] = (f"rank {rank} is alive and beating ({where}): it waits too (a deadlock?), or its work "
                           "takes longer than the timeout", False)
        else:
            found[rank] = (f"rank {rank} stopped responding {time.time() - float(beat):.1f} s ago "
                           f"({_state(int(pid), host, where)})", True)
    return found


def _state(pid: int, host: str, where: str) -> str:
    """What the stalled process is doing, when it runs on this host (else only that it does not beat)."""
    if host != socket.gethostname():  # its process cannot be looked at from here, nor a cut link told apart
        return f"its heartbeat stopped: stopped, hung, or cut off from this host; {where}"
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rpartition(")")[2].split()[0]
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"{where} is gone: it died"
        except PermissionError:
            pass
        return f"alive, not progressing: stopped or hung; {where}"
    if state in ("T", "t"):
        return f"alive, not progressing: {where} is stopped, by SIGSTOP or a debugger"
    if state in ("Z", "X"):
        return f"{where} is gone: it died"
    return f"alive, not progressing: {where} runs but does not beat (hung, holding Python's GIL?)"
