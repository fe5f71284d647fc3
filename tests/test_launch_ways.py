"""The three ways to start the distributed engine, from a shell: `pipelab run --backend distributed`,
`torchrun -m pipelab.launch`, and (in tests/test_distributed.py) `pl.distributed.launch`.
Each trains, reports, writes its JSON; each ends fast and names the rank when one fails."""

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

import distributed_cases as cases

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SMALL = ["--model", "mlp", "--stages", "2", "--microbatches", "4", "--width", "16", "--batch-size", "16"]


def run(command, timeout=180):
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *args]


def check_figures(path: Path, backend: str):
    figures = json.loads(path.read_text())
    assert figures["backend"] == backend and figures["world_size"] == 2
    assert (figures["n_stages"], figures["n_microbatches"], figures["schedule"]) == (2, 4, "1f1b")
    assert len(figures["losses"]) == len(figures["step_seconds"]) == 3
    assert figures["losses"][-1] < figures["losses"][0]
    assert figures["trace_source"] == "measured" and "2 processes" in figures["trace_source_label"]
    assert 0 < figures["bubble_fraction"] < 1 and len(figures["busy_seconds"]) == 2
    assert figures["peak_inflight"] == [2, 1]  # 1F1B: min(p - s, m)
    assert all(b > 0 for b in figures["peak_activation_bytes"])


def test_pipelab_run_distributed_trains_reports_and_writes_json(tmp_path):
    done = run([str(BIN / "pipelab"), "run", "--backend", "distributed", "--nproc", "2", *SMALL, "--steps", "3",
                "--out", str(tmp_path), "--json", str(tmp_path / "run.json")])
    assert done.returncode == 0, done.stderr
    assert "2 processes (torch.distributed)" in done.stdout and "measured (wall clock, 2 processes)" in done.stdout
    check_figures(tmp_path / "run.json", "distributed")
    assert (tmp_path / "timeline_1f1b_p2_m4.png").read_bytes()[:4] == b"\x89PNG"


def test_torchrun_runs_pipelab_launch_with_the_same_flags(tmp_path):
    done = run(torchrun("-m", "pipelab.launch", *SMALL, "--steps", "3", "--out", str(tmp_path),
                        "--json", str(tmp_path / "run.json")))
    assert done.returncode == 0, done.stderr
    check_figures(tmp_path / "run.json", "distributed")
    trace = json.loads((tmp_path / "trace_1f1b_p2_m4.json").read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert tracks == {"device 0 (rank 0 (cpu))", "device 1 (rank 1 (cpu))"}  # one track per rank


def test_local_backend_json(tmp_path):
    done = run([str(BIN / "pipelab"), "run", *SMALL, "--steps", "3", "--device", "cpu", "--out", str(tmp_path),
                "--json", str(tmp_path / "run.json")])
    assert done.returncode == 0, done.stderr
    figures = json.loads((tmp_path / "run.json").read_text())
    assert figures["backend"] == "local" and figures["world_size"] == 1 and figures["trace_source"] == "replayed"


def test_a_bad_launch_says_why_once():
    done = run([str(BIN / "pipelab"), "run", "--backend", "distributed", "--nproc", "2", *SMALL[:2],
                "--stages", "3", "--steps", "1", "--width", "16"])
    assert done.returncode == 2  # a usage error (a ValueError on every rank), as argparse's
    message = "the schedule has 3 devices but the process group has 2 ranks"
    assert done.stderr.count(message) == 1, done.stderr


RAISES_ON_RANK_1 = textwrap.dedent("""
    import torch, torch.distributed as dist, pipelab as pl
    dist.init_process_group("gloo")
    model = pl.models.mlp(depth=4, width=16)
    pipe = pl.DistributedPipeline(model, n_microbatches=4, schedule="1f1b", loss_fn=torch.nn.MSELoss())
    torch.manual_seed(0)  # every rank is given the same batch
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    pipe.step(x, y)
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 stops here on purpose")
    pipe.step(x, y)
""")


def test_under_torchrun_a_rank_that_raises_ends_the_run_with_its_message(tmp_path):
    script = tmp_path / "raises.py"
    script.write_text(RAISES_ON_RANK_1)
    begin = time.monotonic()
    done = run(torchrun(str(script)), timeout=120)
    assert time.monotonic() - begin < 60
    assert done.returncode != 0
    assert "rank 1 stops here on purpose" in done.stderr + done.stdout


def kill_a_rank_and_wait(command, tmp_path) -> tuple[subprocess.CompletedProcess, float]:
    """Start a long training run, SIGKILL the rank-1 process once training is under way, let the run end."""
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            victim = None
            deadline = time.monotonic() + 90
            while victim is None and time.monotonic() < deadline:
                time.sleep(0.5)
                if "step/s" in log.read_text():  # rank 0's progress bar: both ranks are training
                    victim = _rank_process(process.pid, 1)
            assert victim is not None, "training never started:\n" + log.read_text()
            victim.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            code = process.wait(timeout=90)
            elapsed = time.monotonic() - killed_at
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(command, code, log.read_text(), ""), elapsed


def _rank_process(parent_pid: int, rank: int):
    """torchrun's workers carry RANK in their environment; launch's ranks (forked or spawned) start in rank
    order."""
    workers = []
    for child in psutil.Process(parent_pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    workers = cases.launched_ranks(parent_pid)
    return workers[rank] if len(workers) > rank else None


LONG = [*SMALL, "--steps", "100000", "--timeout-seconds", "30"]


@pytest.mark.parametrize("way", ["pipelab run", "torchrun"])
def test_a_killed_rank_ends_the_run_naming_it_with_nothing_left_running(way, tmp_path):
    if way == "pipelab run":
        command = [str(BIN / "pipelab"), "run", "--backend", "distributed", "--nproc", "2", *LONG, "--out",
                   str(tmp_path)]
    else:
        command = torchrun("-m", "pipelab.launch", *LONG, "--out", str(tmp_path))
    done, elapsed = kill_a_rank_and_wait(command, tmp_path)
    assert done.returncode != 0
    assert elapsed < 60
    output = done.stdout
    assert ("rank 1 failed: the process was killed by signal 9 (SIGKILL)" in output if way == "pipelab run"
            else "SIGKILL" in output and "rank: 1" in output), output[-3000:]
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []
