"""Start local ranks, run a function on each, bring back their results or the first failure.

`launch(fn, nproc, *args)` is built on `torch.distributed.launcher.api.elastic_launch`, the
agent `torchrun` runs (a c10d rendezvous on a free loopback port; all ranks stopped as soon
as one fails).  pipelab adds functions from a notebook (`fn` and its arguments travel as
cloudpickle bytes), a deadline (a rank still running after `timeout_seconds` records where
every thread was and exits), and the cause, once (the earliest failure is re-raised in the
caller as `DistributedError` naming the rank, with that rank's traceback).

Details: docs/distributed.md, "Local ranks: `pl.distributed.launch`".
"""

from __future__ import annotations

import json
import logging
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

from ..common.errors import LostRankError


class DistributedError(RuntimeError):
    """A rank failed: `rank` is the one that failed first, `message` its own words, `details` its traceback;
    `usage_error` when it raised a `ValueError` or `TypeError` (a bad argument, the same on every rank)."""

    def __init__(self, rank: int | None, message: str, details: str = "", usage_error: bool = False):
        self.rank, self.message, self.details, self.usage_error = rank, message, details, usage_error
        where = f"rank {rank}" if rank is not None else "a rank"
        super().__init__(f"{where} failed: {message}")


def launch(fn: Callable, nproc: int, *args: Any, timeout_seconds: float | None = 120,
           wait_timeout_seconds: float | None = None, backend: str = "gloo", threads: int | None = 1) -> list:
    """Run `fn(*args)` on `nproc` fresh local ranks of one process group; return each rank's result, by rank.

    Inside `fn`, `torch.distributed` is initialised (`backend`) and torch uses `threads`
    intra-op threads per rank (None: PyTorch's default).  If a rank raises, is killed, or is
    still running after `timeout_seconds` (None: no deadline), every rank is stopped and
    `DistributedError` says which rank and why.  `wait_timeout_seconds` bounds one wait for
    a message or a collective (the process group's timeout; default `timeout_seconds`, or
    60 s without a deadline).  Call it from a script under `if __name__ == "__main__":`
    (the ranks are new Python processes that import the script's module).
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive int, got {nproc!r}")
    if not callable(fn):
        raise TypeError(f"launch runs a function on every rank; got {type(fn).__name__}")
    for name, value in (("timeout_seconds", timeout_seconds), ("wait_timeout_seconds", wait_timeout_seconds)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be positive (or None), got {value!r}")
    if wait_timeout_seconds is None:
        wait_timeout_seconds = 60 if timeout_seconds is None else timeout_seconds
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    payload = cloudpickle.dumps((fn, args))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"pipelab-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.05,
                          start_method="spawn")
    with tempfile.TemporaryDirectory(prefix="pipelab-launch-") as reports, _quiet_agent(), _own_signal_handlers():
        try:
            results = elastic_launch(config, _rank_main)(payload, reports, timeout_seconds, wait_timeout_seconds,
                                                         backend, threads)
        except ChildFailedError as failed:
            raise _first_failure(Path(reports), failed) from None
    return [results[rank] for rank in range(nproc)]


def _rank_main(payload: bytes, reports: str, timeout_seconds: float | None, wait_timeout_seconds: float,
               backend: str, threads: int | None):
    """What each rank runs: arm the watchdog, join the process group, run the function."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    watchdog = None
    if timeout_seconds is not None:
        watchdog = threading.Timer(timeout_seconds, _expire, (rank, reports, timeout_seconds))
        watchdog.daemon = True
        watchdog.start()
    if threads is not None:
        torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # one GPU per rank
    if backend == "gloo":
        from .p2p import use_two_connections
        use_two_connections()  # activations and gradients on separate connections (runtime/p2p.py)
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=wait_timeout_seconds))
        fn, args = cloudpickle.loads(payload)
        return fn(*args)
    except BaseException as error:
        _report(reports, rank, f"{type(error).__name__}: {error}", traceback.format_exc(),
                consequence=_is_consequence(error), usage_error=isinstance(error, (ValueError, TypeError)))
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


def _report(reports: str, rank: int, message: str, details: str, timed_out: bool = False,
            consequence: bool = False, usage_error: bool = False) -> None:
    record = {"rank": rank, "time": time.time(), "message": message, "details": details, "timed_out": timed_out,
              "consequence": consequence, "usage_error": usage_error}
    # written whole, then renamed: the agent may kill this rank mid-write, and a half file must never be read;
    # one name per thread, since the watchdog and the main thread (gloo's own timeout) can report at once
    partial = Path(reports, f".rank{rank}.{threading.get_ident()}.partial")
    partial.write_text(json.dumps(record))
    os.replace(partial, Path(reports, f"rank{rank}.json"))


def _first_failure(reports: Path, failed) -> DistributedError:
    """The cause among all failures: the earliest a rank raised or timed out on its own, else a rank
    killed by a signal, else the rest.

    A rank that loses a peer (`LostRankError`, or gloo's "connection closed") reports a
    consequence; a rank killed by a signal reports nothing, but the agent saw its exit code.
    """
    records = sorted((json.loads(p.read_text()) for p in reports.glob("rank*.json")), key=lambda r: r["time"])
    causes = [r for r in records if not r["consequence"]]
    if causes:
        cause = causes[0]
        return DistributedError(cause["rank"], cause["message"], cause["details"], cause.get("usage_error", False))
    killed = {rank: f.exitcode for rank, f in failed.failures.items() if f.exitcode < 0 and f.exitcode != -signal.SIGTERM}
    if killed:
        rank, code = min(killed.items())
        then = f"; then {records[0]['message']}" if records else ""
        return DistributedError(rank, f"the process was killed by signal {-code} ({_signal_name(-code)}){then}")
    if records:
        return DistributedError(records[0]["rank"], records[0]["message"], records[0]["details"])
    rank, failure = failed.get_first_failure()
    if failure.exitcode < 0:
        return DistributedError(rank, f"the process was killed by signal {-failure.exitcode} "
                                      f"({_signal_name(-failure.exitcode)})")
    return DistributedError(rank, f"the process exited with code {failure.exitcode}: {failure.message}")


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
    loggers = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing.spawn",
                                                    "torchelastic-events-null")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
