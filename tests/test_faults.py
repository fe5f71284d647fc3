"""When a rank stops, returns early, dies at start, or its launcher is interrupted or killed:
the launcher names the culprit (not the ranks that waited for it), ends the run soon after its
deadline, and leaves no process behind.  (The plain failures, a rank that raises, is killed or
deadlocks, are in tests/test_distributed.py; the three ways to start the ranks in
tests/test_launch_ways.py.)"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

import pipelab as pl
from distributed_cases import no_children_left

import distributed_cases as cases

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SMALL = ["--model", "mlp", "--stages", "2", "--microbatches", "4", "--width", "16", "--batch-size", "16"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_stopped_rank_is_named_where_it_stopped_and_killed_soon_after_the_deadline():
    """Rank 1 stops itself (SIGSTOP) at 1F2: it no longer beats, while rank 0, blocked in a receive, does.
    The launcher names rank 1 and what rank 0 was waiting for, and kills rank 1 (which the agent's SIGTERM
    could not end): the run ends within the deadline + 10 s, not after the agent's 30 s of grace."""
    begin = time.monotonic()
    with pytest.raises(pl.DistributedError) as caught:
        pl.distributed.launch(cases.stops_itself, 2, 1, timeout_seconds=15)
    elapsed = time.monotonic() - begin
    error = caught.value
    assert error.rank == 1, str(error)
    assert error.message.startswith("stopped making progress ") and " s ago, at 1F2 " in error.message, str(error)
    assert "(its process is stopped: SIGSTOP" in error.message
    # rank 0 is blocked in 0B2 (or in 0B1, when rank 1 stopped before its gloo thread sent 1B1's gradient)
    assert "; rank 0 was waiting at 0B" in error.message and "(a gradient from rank 1)" in error.message, str(error)
    assert elapsed < 15 + 10, elapsed
    assert no_children_left() == []


def test_a_rank_that_stops_beating_is_named_by_the_rank_left_waiting_in_a_collective():
    """Each rank beats into the process group's store (`runtime/peers.py`); rank 0, whose step's batch check
    times out (4 s), reads rank 1's heartbeat, unchanged, and names it as stalled, not as dead."""
    begin = time.monotonic()
    told = pl.distributed.launch(cases.hangs_before_a_step, 2, 7.0, timeout_seconds=60, wait_timeout_seconds=4)[0]
    assert told.startswith("LostRankError: rank 0 lost rank 1 while waiting with the other ranks: rank 1 stopped "
                           "responding "), told
    assert "s ago (alive, not progressing: process " in told and "runs but does not beat" in told, told
    assert "Timed out waiting 4000ms" in told
    assert time.monotonic() - begin < 40
    assert no_children_left() == []


def test_the_heartbeat_threads_are_joined_at_exit_even_inside_a_store_call():
    """A daemon thread still inside a store call when Python finalizes aborts the process (SIGABRT, "terminate
    called without an active exception": seen in CI as a rank killed by signal 6 after its steps).  The
    at-exit hook stops the heartbeat and waits for a thread blocked in the store until its read times out."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from pipelab.runtime import peers

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5))
    client = store.clone()
    client.set_timeout(timedelta(seconds=1))
    inside, outcome = threading.Event(), []

    def wait_in_the_store():
        inside.set()
        try:
            client.get("pipelab/never-set")  # blocks in C++ (GIL released) until its 1 s timeout
        except Exception as error:
            outcome.append(type(error).__name__)

    reader = threading.Thread(target=wait_in_the_store, daemon=True)
    peers._start(reader)
    inside.wait(5)
    begin = time.monotonic()
    peers._join_at_exit()
    assert not reader.is_alive() and outcome, "the thread inside the store call was not waited for"
    assert time.monotonic() - begin < peers.READ_SECONDS + 1.5


def test_a_rank_that_returns_early_is_named_with_the_steps_it_ran():
    with pytest.raises(pl.DistributedError) as caught:
        pl.distributed.launch(cases.returns_early, 2, 1, 3, timeout_seconds=60)
    assert caught.value.rank == 1, str(caught.value)
    assert caught.value.message == ("returned after 2 steps while rank 0 waited at the start of step 3 (the other "
                                    "ranks, to compare the batch)")
    assert no_children_left() == []


REFUSES_TO_LOAD_IN_A_RANK = textwrap.dedent('''
    import json
    import pipelab as pl

    if __name__ == "__mp_main__":  # how a rank imports the script, before any of pipelab's code runs in it
        raise RuntimeError("this script will not load in a rank")

    def work():
        return 1

    if __name__ == "__main__":
        try:
            pl.distributed.launch(work, 2, timeout_seconds=60)
        except pl.DistributedError as error:
            print(json.dumps({"rank": error.rank, "message": error.message, "details": error.details}))
''')


def test_a_rank_that_dies_as_it_starts_carries_the_stderr_of_the_ranks(tmp_path):
    """Nothing of pipelab ran in the rank to report its error: the ranks' stderr is all there is."""
    path = tmp_path / "script.py"
    path.write_text(REFUSES_TO_LOAD_IN_A_RANK)
    done = subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    error = json.loads(done.stdout.strip().splitlines()[-1])
    assert error["rank"] in (0, 1)
    assert error["message"] == ("the process exited with code 1 as it started, before it could report: "
                                "RuntimeError: this script will not load in a rank")
    assert error["details"].startswith("the ranks' stderr, last lines:\nTraceback (most recent call last)")
    assert 'script.py", line 6, in <module>' in error["details"]  # where the rank failed
    assert error["details"].endswith("RuntimeError: this script will not load in a rank")


def test_launch_called_as_a_rank_imports_the_main_module_says_where_to_call_it(monkeypatch):
    """A script without `if __name__ == "__main__":` calls launch again in every rank, as the rank imports it:
    that call fails at once, saying why (and the ranks' stderr brings the message to the real call)."""
    import multiprocessing.process

    monkeypatch.setattr(multiprocessing.process.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(RuntimeError, match='call it under `if __name__ == "__main__":`'):
        pl.distributed.launch(cases.report_pid, 2)


def session(leader: int) -> list[psutil.Process]:
    """The processes still running in the session `leader` started (zombies aside)."""
    found = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == leader and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
            pass
    return found


def running(processes: list[psutil.Process]) -> list[psutil.Process]:
    found = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.NoSuchProcess:
            pass
    return found


def start_training(command: list[str], log: Path) -> subprocess.Popen:
    """Start `command` in a session of its own, and return once rank 0's progress bar shows a step."""
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 90
    while "step/s" not in log.read_text():
        assert process.poll() is None and time.monotonic() < deadline, "training never started:\n" + log.read_text()
        time.sleep(0.3)
    return process


def test_ctrl_c_on_pipelab_run_stops_every_rank_and_says_so_in_one_line(tmp_path):
    log = tmp_path / "log.txt"
    process = start_training([str(BIN / "pipelab"), "run", "--backend", "distributed", "--nproc", "2", *SMALL,
                              "--steps", "100000", "--out", str(tmp_path)], log)
    try:
        process.send_signal(signal.SIGINT)  # what Ctrl-C sends the launcher
        code = process.wait(timeout=30)
        deadline = time.monotonic() + 10
        while session(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert session(process.pid) == []
    finally:
        if session(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
    output = log.read_text()
    assert code == 130, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert output.count("interrupted") == 1 and output.rstrip("\n").split("\n")[-1] == \
        "pipelab run: interrupted: ranks 0-1 stopped", output[-3000:]


def test_ctrl_c_on_torchrun_through_pipelabs_wrapper_says_interrupted_and_exits_130(tmp_path):
    """torchrun's agent (torch's code) ends a Ctrl-C with a SignalException traceback and exit code 1; its main
    run by `pipelab torchrun` (`runtime/launcher/torchrun.py`) says one line and exits 130, as `pipelab run` does."""
    log = tmp_path / "log.txt"
    process = start_training([sys.executable, "-m", "pipelab", "torchrun", "--nproc-per-node", "2",
                              "-m", "pipelab.launch", *SMALL, "--steps", "100000", "--out", str(tmp_path)], log)
    ranks = [p for p in psutil.Process(process.pid).children(recursive=True)
             if "pipelab.launch" in " ".join(p.cmdline())]
    try:
        process.send_signal(signal.SIGINT)  # what Ctrl-C sends torchrun
        code = process.wait(timeout=30)
        deadline = time.monotonic() + 10
        while running(ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert running(ranks) == []
    finally:
        for rank in running(ranks):
            rank.kill()
    output = log.read_text()
    assert code == 130, output[-3000:]
    assert "Traceback" not in output and "SignalException" not in output, output[-3000:]
    assert output.rstrip("\n").split("\n")[-1] == "torchrun: interrupted: the ranks were stopped", output[-3000:]


def test_killing_torchrun_with_sigkill_ends_its_ranks(tmp_path):
    """torchrun's agent cannot stop its ranks when it is SIGKILLed: each rank's parent-death signal does.
    (torchrun starts each rank in a session of its own: they are found as its children, before the kill.)"""
    log = tmp_path / "log.txt"
    process = start_training([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                              "-m", "pipelab.launch", *SMALL, "--steps", "100000", "--out", str(tmp_path)], log)
    ranks = [p for p in psutil.Process(process.pid).children(recursive=True)
             if "pipelab.launch" in " ".join(p.cmdline())]
    kill_and_check_the_ranks_end(process, ranks)


def test_a_stopped_rank_under_torchrun_is_named_by_the_rank_left_waiting_within_the_timeout(tmp_path):
    """SIGSTOP rank 1 of a torchrun run with --timeout-seconds 10: nothing watches the ranks there, so rank 0,
    whose wait times out, reads rank 1's heartbeat in torchrun's store and says, within the timeout and a few
    seconds, that rank 1 stopped responding: alive, its process stopped (not "died, or timed out").  torchrun
    itself then waits 30 s before it kills the stopped rank: the test ends it once rank 0 has said so."""
    log = tmp_path / "log.txt"
    process = start_training([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                              "-m", "pipelab.launch", *SMALL, "--steps", "100000", "--timeout-seconds", "10",
                              "--out", str(tmp_path)], log)
    ranks = {int(p.environ()["RANK"]): p for p in psutil.Process(process.pid).children(recursive=True)
             if "pipelab.launch" in " ".join(p.cmdline())}
    try:
        ranks[1].send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        said = "rank 0 lost rank 1 while "
        while said not in log.read_text() and time.monotonic() - stopped < 30:
            time.sleep(0.2)
        elapsed = time.monotonic() - stopped
        output = log.read_text()
    finally:
        kill_and_check_the_ranks_end(process, list(ranks.values()))
    line = next((line for line in output.splitlines() if said in line), output[-3000:])
    assert elapsed < 10 + 5, (elapsed, line)
    assert ": rank 1 stopped responding " in line and "s ago (alive, not progressing: process " in line, line
    assert f"process {ranks[1].pid} on " in line and " is stopped, by SIGSTOP or a debugger" in line, line
    assert "died, or timed out" not in line, line


LAUNCHER = '''
import sys
sys.path.insert(0, {tests!r})
import pipelab as pl
import distributed_cases as cases

if __name__ == "__main__":
    pl.distributed.launch(cases.waits_forever, 2, {folder!r}, timeout_seconds=300)
'''


def test_killing_the_launcher_with_sigkill_ends_its_ranks_even_inside_a_wait(tmp_path):
    """The ranks of `pl.distributed.launch`, both blocked in a receive (torch's own parent-death signal,
    SIGINT, would wait for the receive's 300 s timeout there)."""
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER.format(tests=str(Path(__file__).parent), folder=str(tmp_path)))
    process = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 90
    while not ((tmp_path / "rank0").exists() and (tmp_path / "rank1").exists()):
        assert process.poll() is None and time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.2)
    time.sleep(0.5)  # inside the receive now
    ranks = cases.launched_ranks(process.pid)
    kill_and_check_the_ranks_end(process, ranks)


def kill_and_check_the_ranks_end(launcher: subprocess.Popen, ranks: list[psutil.Process]) -> None:
    """SIGKILL `launcher`; every one of its 2 `ranks` must be gone within 10 s.  Whatever is left is killed."""
    try:
        assert len(ranks) == 2, ranks
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        while running(ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert running(ranks) == [], "ranks still running 10 s after their launcher was killed"
    finally:
        for rank in running(ranks):
            rank.kill()
        if session(launcher.pid):
            os.killpg(launcher.pid, signal.SIGKILL)
