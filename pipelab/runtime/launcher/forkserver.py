"""Local ranks forked from a server that has imported torch and pipelab once, instead of spawned anew.

A spawned rank is a new Python that imports torch and pipelab: about 2 s of CPU each, so a launch of 2
ranks took 2.4 s and one of 4 ranks 5.2 s on 2 cores, however short the work.  multiprocessing's
forkserver start method (Python's docs, "Contexts and start methods") forks each rank from a server
process started once per launcher, which imports `PRELOAD` first: after the first launch, 2 ranks take
0.33 s and 4 ranks 0.30 s (`python benchmarks/launch_start.py` prints both ways, measured in one run).

A forked rank inherits the *server's* state from when the server started, where a spawned one got the
launcher's at the launch; three things are handed over here so that it behaves as spawned:

- stdout and stderr: the server's fd 1 and 2 are pipes that a thread of the launcher copies to the
  launcher's fd 1 and 2 as they are at the time of writing (a notebook's, a test's capture), keeping
  stderr's last lines for the launch that listens (`StderrLines`: a rank that dies as it starts leaves
  only those);
- the environment: `adopt` gives the rank the launcher's, plus the variables torch's agent set for it;
- the parent: the server, which ends once the launcher and the ranks have closed its "alive" pipe; so a
  rank closes its copy (`adopt`), and dies with the server (`end_with_parent`) when the launcher dies.

Where there is no forkserver (Windows), or another one already runs in this process (started by other
code, without these pipes), or PIPELAB_START_METHOD=spawn is set (to compare, or should forking ever get
in your way), ranks are spawned as before, and stderr is not kept.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import sys
import threading
import uuid

PRELOAD = ["torch", "torch.distributed", "pipelab"]
_lock = threading.Lock()
_server: dict = {}  # "pid": the server's, "env": the environment it started with, "relays": {fd: _Relay}


def start_method() -> str:
    """"forkserver" once the server runs with this module's pipes (started here if need be), else "spawn"."""
    if "forkserver" not in multiprocessing.get_all_start_methods() or os.environ.get("PIPELAB_START_METHOD") == "spawn":
        return "spawn"
    from multiprocessing import forkserver, resource_tracker

    with _lock:
        running = forkserver._forkserver._forkserver_pid
        if running is not None and running != _server.get("pid"):
            return "spawn"  # someone else's server: its stdio and environment are not known here
        relays = _server.setdefault("relays", {fd: _Relay(fd) for fd in (1, 2)})
        # the resource tracker first, told to keep quiet (-W, from sys.warnoptions) about the semaphores of
        # ranks that were killed: it removes them, but warns of each "leaked semaphore" when the launcher exits
        options = list(sys.warnoptions)
        sys.warnoptions.append("ignore:resource_tracker:UserWarning")
        try:
            resource_tracker.ensure_running()
        finally:
            sys.warnoptions[:] = options
        environment = dict(os.environ)
        saved = {fd: os.dup(fd) for fd in relays}
        try:
            for fd, relay in relays.items():
                os.dup2(relay.write, fd)
            multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
            forkserver.ensure_running()  # nothing if it runs; started, or restarted, with the pipes as fd 1 and 2
        finally:
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
        if forkserver._forkserver._forkserver_pid != _server.get("pid"):
            _server.update(pid=forkserver._forkserver._forkserver_pid, env=environment)
        return "forkserver"


def server() -> tuple[int, dict] | None:
    """(pid, environment it started with) of the server ranks are forked from; None before the first."""
    return (_server["pid"], _server["env"]) if "pid" in _server else None


def adopt(launcher_env: dict, server_env: dict) -> None:
    """In a rank forked from the server: the launcher's environment, with the variables the agent set (those
    whose value differs from the server's), and the server's "alive" pipe closed (see the module's docstring)."""
    from multiprocessing import forkserver

    agent = {key: value for key, value in os.environ.items() if server_env.get(key) != value}
    os.environ.clear()
    os.environ.update({**launcher_env, **agent})
    alive = forkserver._forkserver._forkserver_alive_fd
    if alive is not None:
        try:
            os.close(alive)
        except OSError:
            pass
        forkserver._forkserver._forkserver_alive_fd = None


class StderrLines:
    """The last `LINES` lines the ranks write to stderr during a launch (with the server; else none), and a new
    line written after the launch when the ranks left one unfinished (a progress bar)."""

    LINES = 60

    def __enter__(self) -> "StderrLines":
        self.lines: collections.deque[str] = collections.deque(maxlen=self.LINES)
        self._partial = b""
        self._relay = _server.get("relays", {}).get(2)
        if self._relay is not None:
            self._relay.listeners.add(self)
        return self

    def feed(self, chunk: bytes) -> None:
        text = (self._partial + chunk).replace(b"\r", b"\n").split(b"\n")
        self._partial = text.pop()
        self.lines.extend(line.decode(errors="replace") for line in text if line.strip())

    def __exit__(self, *exc) -> None:
        if self._relay is None:
            return
        self._relay.drain()
        self._relay.listeners.discard(self)
        if self._partial.strip():
            self.lines.append(self._partial.decode(errors="replace"))
        if self._relay.last != b"\n":  # a progress bar left mid-line: what the launcher says next starts a line
            try:
                os.write(2, b"\n")
            except OSError:
                pass
            self._relay.last = b"\n"


class _Relay:
    """A pipe whose write end is the server's (so the ranks') fd `fd`; a daemon thread copies what comes to this
    process's fd `fd` and to the listeners.  `drain` returns once everything written before it was copied."""

    def __init__(self, fd: int):
        self.fd, self.listeners, self.last = fd, set(), b"\n"
        self.read, self.write = os.pipe()
        self._marks: dict[bytes, threading.Event] = {}
        self._pending = b""
        threading.Thread(target=self._copy, name=f"pipelab-ranks-fd{fd}", daemon=True).start()

    def drain(self, timeout: float = 5.0) -> None:
        mark, done = b"\0" + uuid.uuid4().hex.encode() + b"\0", threading.Event()
        self._marks[mark] = done
        os.write(self.write, mark)  # after every rank's writes (they have ended): the pipe keeps the order
        done.wait(timeout)
        self._marks.pop(mark, None)

    def _copy(self) -> None:
        while True:
            try:
                chunk = os.read(self.read, 1 << 16)
            except OSError:
                return
            if not chunk:
                return
            data, self._pending = self._pending + chunk, b""
            for mark, done in list(self._marks.items()):
                if mark in data:
                    data = data.replace(mark, b"")
                    done.set()
            start = data.rfind(b"\0")
            if start != -1 and data.count(b"\0") % 2:  # a mark cut in two by the read: keep its start
                data, self._pending = data[:start], data[start:]
            if not data:
                continue
            view = memoryview(data)
            while view:
                try:
                    view = view[os.write(self.fd, view):]
                except OSError:
                    break
            self.last = data[-1:]
            for listener in list(self.listeners):
                listener.feed(data)
