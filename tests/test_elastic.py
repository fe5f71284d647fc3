"""Depth that follows the ranks: torchrun's elasticity with `pipelab.launch --stages auto --checkpoint DIR`.

Two torchrun agents on this machine (`--nnodes 1:2`, one rank each, c10d rendezvous) stand for two hosts.
Mid-run one agent is killed with its rank (a host gone): the other's rank loses its peer, torchrun restarts
it in a world of one, and it goes on at depth 1 from the newest checkpoint.  Then a new agent joins (the
host back): torchrun restarts both ranks in a world of two, depth 2 again, from the newest checkpoint.
The loss of every step equals plain single-device training with Adam on the same batch.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import pipelab as pl
from pipelab.commands.resume import logged_losses

STEPS, DEPTH, WIDTH, BATCH, LR = 500, 4, 64, 16, 1e-3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent(folder, port: int, name: str, hosts_store: bool = False) -> subprocess.Popen:
    """One torchrun agent with one rank, in its own session (so that it and its rank can be killed together)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
               "--max-restarts", "4", "--monitor-interval", "0.5", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "pipelab-elastic",
               "--rdzv-conf", f"is_host={int(hosts_store)},last_call_timeout=3,join_timeout=120",
               "-m", "pipelab.launch", "--model", "mlp", "--depth", str(DEPTH), "--width", str(WIDTH),
               "--batch-size", str(BATCH), "--lr", str(LR), "--microbatches", "4", "--stages", "auto",
               "--steps", str(STEPS), "--checkpoint", str(folder / "run"), "--checkpoint-every", "1",
               "--timeout-seconds", "20", "--out", str(folder / f"out-{name}")]
    log = open(folder / f"{name}.log", "w")
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: with torch's shared store, an agent that was rank 0 before a
    # membership change does not publish the store's address for the new round, and a joining agent waits
    # for it until its timeout (torch 2.13, dynamic_rendezvous.py); without sharing, every round publishes it
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def wait_for(folder, condition, what: str, agents, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (folder / "run" / "losses.jsonl").exists():
            logged = logged_losses(folder / "run")
            if condition(logged):
                return logged
        if all(a.poll() is not None for a in agents):
            break
        time.sleep(0.2)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(folder.glob("*.log")))
    pytest.fail(f"waited for {what}; logs:\n{logs}")


def single_device_losses() -> list[float]:
    torch.manual_seed(0)
    model = pl.models.mlp(depth=DEPTH, width=WIDTH, seed=0)
    x, y = pl.models.sample_batch(model, BATCH, seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_a_host_leaves_and_comes_back_and_the_loss_curve_goes_on(tmp_path):
    port = free_port()
    first = agent(tmp_path, port, "a", hosts_store=True)
    time.sleep(0.5)  # the first agent hosts the rendezvous store; the second joins within last_call_timeout
    second = agent(tmp_path, port, "b")
    agents = [first, second]
    try:
        wait_for(tmp_path, lambda log: any(e["world"] == 2 and k >= 5 for k, e in log.items()),
                 "five steps at depth 2", agents)
        os.killpg(second.pid, signal.SIGKILL)  # the host goes away, its rank with it
        second.wait(timeout=10)
        alone = wait_for(tmp_path, lambda log: sum(e["world"] == 1 for e in log.values()) >= 3,
                         "three steps at depth 1", agents)
        left_at = min(k for k, e in alone.items() if e["world"] == 1)
        back = agent(tmp_path, port, "b-again")  # the host comes back
        agents.append(back)
        wait_for(tmp_path, lambda log: any(e["world"] == 2 and k > left_at for k, e in log.items()),
                 "depth 2 again", agents)
        assert first.wait(timeout=180) == 0 and back.wait(timeout=60) == 0
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
    logged = logged_losses(tmp_path / "run")
    assert sorted(logged) == list(range(1, STEPS + 1))
    worlds = [logged[k]["world"] for k in range(1, STEPS + 1)]
    assert worlds[0] == 2 and 1 in worlds and worlds[-1] == 2  # depth 2, then 1, then 2 again
    assert [logged[k]["stages"] for k in range(1, STEPS + 1)] == worlds
    expected = single_device_losses()
    got = [logged[k]["loss"] for k in range(1, STEPS + 1)]
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-7)


def test_resuming_options_say_where_they_apply(tmp_path, capsys):
    from pipelab.commands.cli import main
    assert main(["run", "--stages", "auto"]) == 2
    assert "--stages auto is for the distributed engine" in capsys.readouterr().err  # --checkpoint: both engines
    assert main(["run", "--backend", "distributed", "--stages", "auto"]) == 2
    assert "give --nproc" in capsys.readouterr().err
    with pytest.raises(ValueError, match="checkpoint every must be a positive"):
        from pipelab.commands.resume import Resumable
        Resumable(tmp_path, every=0)


def test_a_finished_run_resumed_says_there_is_nothing_to_run(tmp_path, capsys):
    from pipelab.commands.cli import main
    args = ["run", "--backend", "distributed", "--nproc", "2", "--stages", "auto", "--depth", "2", "--width", "8",
            "--batch-size", "4", "--microbatches", "2", "--steps", "3", "--checkpoint", str(tmp_path / "run"),
            "--checkpoint-every", "2", "--out", str(tmp_path / "out")]
    assert main(args) == 0
    saved = sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("step-"))
    assert saved == ["step-000002", "step-000003"]  # every 2nd step and the last
    assert main(args) != 0
    assert "already holds all 3 steps" in capsys.readouterr().err
