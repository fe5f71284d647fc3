"""Start local ranks, run a function on each, bring back their results or the first failure.

`launch(fn, nproc, *args)` is built on `torch.distributed.launcher.api.elastic_launch`, the
agent `torchrun` runs (a c10d rendezvous on a free loopback port; all ranks stopped as soon
as one fails).  pipelab adds functions from a notebook (`fn` and its arguments travel as
cloudpickle bytes), a deadline (a rank still running after `timeout_seconds` records where
every thread was and exits), and the cause, once (the earliest failure is re-raised in the
caller as `DistributedError` naming the rank, with that rank's traceback).

Each rank reports its progress (`runtime/launcher/progress.py`: a heartbeat, the action it is on), so
that the launcher names the rank that stopped making progress, not the ranks that timed out
waiting for it, and ends a stopped rank itself (SIGKILL: a stopped process ignores the
agent's SIGTERM); a rank that returned early is named with the steps it ran; a rank that
died before any of pipelab's code ran in it carries the last lines the ranks wrote to
stderr.  Every rank dies with its parent (`end_with_parent`), and an interrupt of the
launcher (Ctrl-C) ends every rank and raises `Interrupted`, one line.

Details: docs/distributed.md, "Local ranks: `pl.distributed.launch`" and "When a rank fails".
"""

from __future__ import annotations

import ctypes
import json
import logging
import multiprocessing.process
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import cloudpickle

from ...common.errors import LostRankError
from . import forkserver, progress


class DistributedError(RuntimeError):
    """A rank failed: `rank` is the one that failed first, `message` its own words, `details` its traceback;
    `usage_error` when it raised a `ValueError` or `TypeError` (a bad argument, the same on every rank)."""

    def __init__(self, rank: int | None, message: str, details: str = "", usage_error: bool = False):
        self.rank, self.message, self.details, self.usage_error = rank, message, details, usage_error
        where = f"rank {rank}" if rank is not None else "a rank"
        super().__init__(f"{where} failed: {message}")


class Interrupted(KeyboardInterrupt):
    """The launcher was interrupted (Ctrl-C: SIGINT; or SIGTERM, SIGHUP, SIGQUIT) and stopped every rank;
    `signal` is the signal's number.  A `KeyboardInterrupt`, so that a notebook or a script stops as on Ctrl-C."""

    def __init__(self, signal_number: int, message: str):
        super().__init__(message)
        self.signal = signal_number


def launch(fn: Callable, nproc: int, *args: Any, timeout_seconds: float | None = 120,
           wait_timeout_seconds: float | None = None, backend: str = "gloo", threads: int | None = 1) -> list:
    """Run `fn(*args)` on `nproc` fresh local ranks of one process group; return each rank's result, by rank.

    Inside `fn`, `torch.distributed` is initialised (`backend`) and torch uses `threads`
    intra-op threads per rank (None: PyTorch's default).  If a rank raises, is killed, or is
    still running `timeout_seconds` after this call (start-up included; None: no deadline),
    every rank is stopped and `DistributedError` says which rank and why.
    `wait_timeout_seconds` bounds one wait for a message or a collective (the process
    group's timeout; default `timeout_seconds`, or 60 s without a deadline).  Call it from a
    script under `if __name__ == "__main__":` (the ranks are new Python processes that import
    the script's module).

    A rank that stops making progress (its heartbeat stops: SIGSTOP, a hang holding the GIL)
    while the run fails, or past the deadline, is killed and named, with what the others
    were waiting for.  Ctrl-C stops every rank and raises `Interrupted` (a `KeyboardInterrupt`).
    """
    if getattr(multiprocessing.process.current_process(), "_inheriting", False):
        raise RuntimeError("pl.distributed.launch was called while a rank imported the main module: call it under "
                           "`if __name__ == \"__main__\":` (every rank imports the script's module)")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive int, got {nproc!r}")
    if not callable(fn):
        raise TypeError(f"launch runs a function on every rank; got {type(fn).__name__}")
    for name, value in (("timeout_seconds", timeout_seconds), ("wait_timeout_seconds", wait_timeout_seconds)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be positive (or None), got {value!r}")
    if wait_timeout_seconds is None:
        wait_timeout_seconds = 60 if timeout_seconds is None else timeout_seconds
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    payload = cloudpickle.dumps((fn, args))
    start_method = forkserver.start_method()  # forked from a server that imported torch once (forkserver.py)
    parent, server_env = forkserver.server() if start_method == "forkserver" else (os.getpid(), None)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"pipelab-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.05,
                          start_method=start_method, shutdown_timeout=_SHUTDOWN_SECONDS)
    failed = interrupted = None
    begin = time.time()  # the deadline counts from here, start-up included
    with tempfile.TemporaryDirectory(prefix="pipelab-launch-") as reports:
        watch = _Watch(Path(reports), nproc, None if timeout_seconds is None else begin + timeout_seconds)
        with _quiet_agent(), _own_signal_handlers(), forkserver.StderrLines() as stderr:
            try:
                results = elastic_launch(config, _rank_main)(payload, reports, parent, begin, timeout_seconds,
                                                             wait_timeout_seconds, backend, threads,
                                                             dict(os.environ), server_env)
            except ChildFailedError as failure:
                failed = failure
                if any(f.exitcode == -signal.SIGINT for f in failure.failures.values()):
                    failed, interrupted = None, signal.SIGINT  # Ctrl-C reached the ranks before the launcher
            except (KeyboardInterrupt, SignalException) as signalled:  # the agent has stopped the ranks
                interrupted = getattr(signalled, "sigval", signal.SIGINT)
            finally:
                watch.close(kill_the_rest=failed is not None or interrupted is not None)
        if failed is not None:  # read once the ranks' stderr is all in
            raise _first_failure(Path(reports), failed, nproc, watch.stopped, list(stderr.lines)) from None
    if interrupted is not None:
        ranks = "rank 0" if nproc == 1 else f"ranks 0-{nproc - 1}"
        what = "interrupted" if interrupted == signal.SIGINT else f"ended by {_signal_name(interrupted)}"
        raise Interrupted(int(interrupted), f"{what}: {ranks} stopped") from None
    return [results[rank] for rank in range(nproc)]


_SHUTDOWN_SECONDS = 5  # the agent's SIGTERM, then SIGKILL after this (a rank ends at SIGTERM: it has no handler)
_CONSEQUENCE_SECONDS = 1.0  # a forked rank's exit status reaches the agent through the forkserver, a moment late
_STALE_SECONDS = 3.0  # a rank whose heartbeat (every progress.BEAT_SECONDS) is older has stopped making progress


def end_with_parent(parent: int | None = None) -> None:
    """Have the kernel SIGKILL this process when its parent ends (Linux's parent-death signal; elsewhere
    nothing): a rank must not outlive its launcher or torchrun's agent, even one killed with SIGKILL.
    `parent` is the pid the parent should have; by default the parent's now."""
    if not sys.platform.startswith("linux"):
        return
    expected = os.getppid() if parent is None else parent
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        if libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0)) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != expected:  # the parent ended before the signal was set: it will never come
        os.kill(os.getpid(), signal.SIGKILL)


def _rank_main(payload: bytes, reports: str, parent: int, begin: float, timeout_seconds: float | None,
               wait_timeout_seconds: float, backend: str, threads: int | None, launcher_env: dict,
               server_env: dict | None):
    """What each rank runs: take the launcher's environment (when forked from the server), die with the launcher
    (or the server, which dies with it), report progress, arm the watchdog, join the process group, run the
    function."""
    if server_env is not None:
        forkserver.adopt(launcher_env, server_env)
    end_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends a rank at once, even inside a wait; no traceback
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    reporter = progress.start(Path(reports, f"progress{rank}"))
    watchdog = None
    if timeout_seconds is not None:
        left = max(begin + timeout_seconds - time.time(), 0.0)  # the launcher's clock: the same machine
        watchdog = threading.Timer(left, _expire, (rank, reports, timeout_seconds))
        watchdog.daemon = True
        watchdog.start()
    if threads is not None:
        torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # one GPU per rank
    if backend == "gloo":
        from ..p2p import use_two_connections
        use_two_connections()  # activations and gradients on separate connections (runtime/p2p.py)
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=wait_timeout_seconds))
        fn, args = cloudpickle.loads(payload)
        result = fn(*args)
        reporter.finish("returned")
        return result
    except BaseException as error:
        reporter.finish("failed")
        consequence = _is_consequence(error)
        _report(reports, rank, f"{type(error).__name__}: {error}", traceback.format_exc(),
                consequence=consequence, usage_error=isinstance(error, (ValueError, TypeError)),
                timed_out=isinstance(error, RuntimeError) and _TIMED_OUT in str(error))
        if consequence:  # the agent reports only the first exit it sees: the lost peer's (a kill) must come first
            time.sleep(_CONSEQUENCE_SECONDS)
        raise
    finally:
        if watchdog is not None:
            watchdog.cancel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _expire(rank: int, reports: str, timeout_seconds: float) -> None:
    stacks = "\n".join(f"thread {ident}:\n{''.join(traceback.format_stack(frame))}"
                       for ident, frame in sys._current_frames().items() if ident != threading.get_ident())
    _report(reports, rank, f"timed out: still running after {timeout_seconds:g} s (a deadlock, or a wait for a rank "
                           "that failed?)", stacks, timed_out=True)
    os._exit(3)


def _is_consequence(error: BaseException) -> bool:
    """True for an error that another rank's failure causes: a lost peer, a connection closed under us."""
    if isinstance(error, LostRankError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(sign in text for sign in _PEER_GONE)


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")  # gloo's words
_TIMED_OUT = "Timed out waiting"  # gloo's, when a receive or a collective waited past the process group's timeout


def _report(reports: str, rank: int, message: str, details: str, timed_out: bool = False,
            consequence: bool = False, usage_error: bool = False) -> None:
    record = {"rank": rank, "time": time.time(), "message": message, "details": details, "timed_out": timed_out,
              "consequence": consequence, "usage_error": usage_error}
    # written whole, then renamed: the agent may kill this rank mid-write, and a half file must never be read;
    # one name per thread, since the watchdog and the main thread (gloo's own timeout) can report at once
    partial = Path(reports, f".rank{rank}.{threading.get_ident()}.partial")
    partial.write_text(json.dumps(record))
    os.replace(partial, Path(reports, f"rank{rank}.json"))


def _first_failure(reports: Path, failed, nproc: int, stopped: dict | None = None,
                   stderr_lines: list[str] | None = None) -> DistributedError:
    """The cause among all failures, in this order: the earliest rank that raised on its own; a rank that
    stopped making progress (the watch killed it); a rank that returned while the others still ran; a rank
    killed by a signal; the earliest that timed out; the rest.  A rank that died before pipelab's code ran
    in it carries the last lines the ranks wrote to stderr.

    A rank that loses a peer (`LostRankError`, or gloo's "connection closed") reports a
    consequence; a rank killed by a signal reports nothing, but the agent saw its exit code.
    """
    records = sorted((json.loads(p.read_text()) for p in reports.glob("rank*.json")), key=lambda r: r["time"])
    states, stopped, stderr_lines = _states(reports, nproc), stopped or {}, stderr_lines or []
    # raised on its own: not a lost peer nor a wait past a timeout, and before any rank stopped beating
    first_stop = min((state["beat"] for _, state, _ in stopped.values()), default=float("inf"))
    raised = [r for r in records if not r["consequence"] and not r["timed_out"] and r["time"] < first_stop]
    if raised:
        cause = raised[0]
        return DistributedError(cause["rank"], cause["message"], cause["details"], cause.get("usage_error", False))
    if stopped:
        rank = min(stopped, key=lambda r: stopped[r][1]["beat"])  # the first to stop beating
        silent, state, how = stopped[rank]
        states[rank] = state
        message = f"stopped making progress {silent:.0f} s ago, {_where(state)}{how}"
        return DistributedError(rank, message + _others(states, rank), _details(states, records))
    returned = [r for r, state in states.items() if state["phase"] == "returned"
                and records and state["since"] <= records[0]["time"]]
    if returned:
        rank = min(returned, key=lambda r: states[r]["since"])
        steps = states[rank]["steps"]
        message = f"returned after {_steps(steps)}" if steps else "returned early"
        waits = _others(states, rank, past=True).removeprefix("; ")
        return DistributedError(rank, message + (f" while {waits}" if waits else " while the others still ran"),
                                _details(states, records))
    killed = {rank: f.exitcode for rank, f in failed.failures.items()
              if f.exitcode < 0 and f.exitcode != -signal.SIGTERM}
    if killed:
        rank, code = min(killed.items())
        where = f", {_where(states[rank])}" if rank in states else ""
        then = f"; then {records[0]['message']}" if records else ""
        return DistributedError(rank, f"the process was killed by signal {-code} ({_signal_name(-code)}){where}{then}",
                                _details(states, records))
    if records:
        cause = records[0]  # a rank that timed out, else the first consequence
        timed_out = [r for r in records if r["timed_out"]]
        cause = timed_out[0] if timed_out else cause
        return DistributedError(cause["rank"], cause["message"] + _others(states, None), cause["details"])
    rank, failure = failed.get_first_failure()
    if failure.exitcode < 0:
        return DistributedError(rank, f"the process was killed by signal {-failure.exitcode} "
                                      f"({_signal_name(-failure.exitcode)})")
    tail = _tail(stderr_lines)
    if rank not in states and tail:  # it died before _rank_main ran: importing the main module, say
        return DistributedError(rank, f"the process exited with code {failure.exitcode} as it started, before it "
                                      f"could report: {tail[-1].strip()}", "the ranks' stderr, last lines:\n"
                                + "\n".join(tail))
    return DistributedError(rank, f"the process exited with code {failure.exitcode}: {failure.message}",
                            "the ranks' stderr, last lines:\n" + "\n".join(tail) if tail else "")


def _tail(lines: list[str], count: int = 20) -> list[str]:
    """The last traceback, whole (of the last `forkserver.StderrLines.LINES` lines), else the last `count` lines."""
    starts = [k for k, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    return lines[starts[-1]:] if starts else lines[-count:]


def _states(reports: Path, nproc: int) -> dict[int, dict]:
    """{rank: its last reported state} (`progress.read`), for the ranks that began reporting."""
    found = {}
    for rank in range(nproc):
        state = progress.read(reports / f"progress{rank}")
        if state is not None:
            found[rank] = state
    return found


def _where(state: dict) -> str:
    """Where a rank was: "at 1F3", "at 0B2, waiting for a gradient from rank 1", "between steps (2 done)"."""
    phase, action, steps = state["phase"], state["action"], state["steps"]
    if phase in ("starting",) or (not action and not steps):
        return "before its first action"
    if phase == "between steps" or not action:
        return f"between steps ({steps} done)"
    if phase == "waiting" or state["waiting_for"]:
        return f"at {action}, waiting for {state['waiting_for']}"
    return f"at {action}"


def _steps(count: int) -> str:
    return f"{count} step" + "s" * (count != 1)


def _others(states: dict[int, dict], culprit: int | None, past: bool = False) -> str:
    """"; rank 0 was waiting at 0B2 (a gradient from rank 1)": what every other rank was doing, for those
    that reached the loop."""
    parts = []
    for rank, state in sorted(states.items()):
        if rank == culprit or state["phase"] == "returned" or not (state["action"] or state["steps"]):
            continue
        if state["action"] and state["waiting_for"]:
            doing = (f"waited at {state['action']}" if past else f"was waiting at {state['action']}") + \
                f" ({state['waiting_for']})"
        elif state["action"] and state["phase"] != "between steps":
            doing = f"was at {state['action']}"
        else:
            doing = f"was between steps ({state['steps']} done)"
        parts.append(f"rank {rank} {doing}")
    return "; " + ", ".join(parts) if parts else ""


def _details(states: dict[int, dict], records: list[dict]) -> str:
    """Each rank's last reported state, then what the others reported (a traceback, or every thread's stack)."""
    lines = [f"rank {rank}: {state['phase']}, {_where(state)}; {_steps(state['steps'])} done"
             for rank, state in sorted(states.items())]
    for record in records:
        lines += ["", f"rank {record['rank']}: {record['message']}", record["details"]]
    return "\n".join(lines)


class _Watch:
    """The launcher's eye on the ranks' heartbeats (`runtime/launcher/progress.py`).  Once the run is failing (a rank
    reported a failure) or past its deadline, a rank still alive whose heartbeat is older than
    `_STALE_SECONDS` has stopped making progress: it is noted, with how long and where, and SIGKILLed (a
    stopped process would ignore the agent's SIGTERM, and the agent then waits `_SHUTDOWN_SECONDS`)."""

    def __init__(self, reports: Path, nproc: int, deadline: float | None):
        self.reports, self.nproc, self.deadline = reports, nproc, deadline
        self.stopped: dict[int, tuple[float, dict, str]] = {}  # rank -> (seconds silent, its state, its process state)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipelab-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(0.2):
            try:
                self.check()
            except Exception:  # the watch must never be what fails a launch
                pass

    def check(self) -> None:
        now = time.time()
        states = _states(self.reports, self.nproc)
        # failing: a rank reported a failure, or the deadline passed and no rank's watchdog said so
        failing = any(self.reports.glob("rank*.json")) or (self.deadline is not None and now > self.deadline + 2)
        if not failing:
            return
        for rank, state in states.items():
            if (rank in self.stopped or state["phase"] in ("returned", "failed")
                    or (self.reports / f"rank{rank}.json").exists() or now - state["beat"] < _STALE_SECONDS):
                continue
            how = _process_state(state["pid"])
            if how is None:  # gone already (killed, or exited): the agent has its exit code
                continue
            self.stopped[rank] = (now - state["beat"], state, how)
            _kill(state["pid"])

    def close(self, kill_the_rest: bool) -> None:
        """Stop watching; with `kill_the_rest`, SIGKILL every rank still alive (after a failure or an interrupt)."""
        self._done.set()
        self._thread.join(timeout=5)
        if kill_the_rest:
            for state in _states(self.reports, self.nproc).values():
                if _process_state(state["pid"]) is not None:
                    _kill(state["pid"])


def _process_state(pid: int) -> str | None:
    """None for a process that is gone (or a zombie); else "" or, for a stopped one, a note saying so."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            return None
        return ""
    if state in ("Z", "X"):
        return None
    return " (its process is stopped: SIGSTOP, or a debugger)" if state in ("T", "t") else ""


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


@contextmanager
def _own_signal_handlers():
    """The agent installs handlers for SIGTERM, SIGINT, SIGHUP and SIGQUIT in the caller and leaves them;
    put the caller's back (a notebook kernel shut down later would otherwise print a traceback)."""
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    saved = {s: signal.getsignal(s) for s in (getattr(signal, n) for n in names if hasattr(signal, n))}
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            for number, handler in saved.items():
                if handler is not None:
                    signal.signal(number, handler)


@contextmanager
def _quiet_agent():
    """The agent logs every failure as a long table; pipelab raises one DistributedError instead."""
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing.spawn",
                "torchelastic-events-null")
    # each of the agent's modules sets its own logger's level (a parent's level would not reach them)
    names = {name for name in logging.Logger.manager.loggerDict if name.startswith(prefixes)} | set(prefixes)
    loggers = [logging.getLogger(name) for name in sorted(names)]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
