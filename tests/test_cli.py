"""`pipelab run`: trains, prints the table, writes the PNG and the Chrome trace."""

import json

import pytest

import pipelab as pl
from pipelab import cli
from pipelab.cli import main


def test_run_trains_and_reports(tmp_path, capsys):
    code = main(["run", "--model", "mlp", "--stages", "4", "--microbatches", "8", "--schedule", "gpipe",
                 "--steps", "5", "--device", "cpu", "--batch-size", "16", "--width", "32", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "bubble fraction" in out and "peak activations" in out
    first, last = (float(v) for v in out.split("loss ")[1].split(" over")[0].split(" -> "))
    assert last < first  # five Adam steps on a fixed batch lower the loss
    table = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and ".." in line]
    assert [row[0] for row in table] == ["0", "1", "2", "3"]
    assert [int(row[3]) for row in table] == [8, 8, 8, 8]  # GPipe keeps all m micro-batches
    png = tmp_path / "timeline_gpipe_p4_m8.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads((tmp_path / "trace_gpipe_p4_m8.json").read_text())
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == 2 * 4 * 8


def test_run_gpt_with_1f1b(tmp_path, capsys):
    assert main(["run", "--model", "gpt", "--stages", "3", "--microbatches", "2", "--steps", "2",
                 "--depth", "2", "--width", "16", "--batch-size", "4", "--out", str(tmp_path)]) == 0
    assert "1f1b" in capsys.readouterr().out


def test_run_explains_bad_settings(tmp_path, capsys):
    assert main(["run", "--stages", "9", "--depth", "8", "--out", str(tmp_path)]) == 2
    assert "cannot cut 8 blocks into 9 stages" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", "--stages", "0"])
    assert "must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("error, code", [(ValueError("bad value"), 2), (TypeError("bad type"), 2),
                                         (pl.PipelineError("F(stage 1, mb 0) failed"), 1),
                                         (pl.DistributedError(1, "RuntimeError: boom"), 1),
                                         (pl.DistributedError(0, "ValueError: bad", usage_error=True), 2)])
def test_run_exits_2_for_usage_errors_and_1_for_failures(monkeypatch, tmp_path, capsys, error, code):
    def fails(args):
        raise error

    monkeypatch.setattr(cli, "train_local", fails)
    assert main(["run", "--out", str(tmp_path)]) == code
    assert str(error) in capsys.readouterr().err


def test_simulate_prints_grid_and_metrics(tmp_path, capsys):
    assert main(["simulate", "--stages", "8", "--microbatches", "32", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "device 7 |" in out
    assert "bubble fraction 17.95%" in out  # 7 / 39
    assert (tmp_path / "simulated_1f1b_p8_m32.png").exists() and (tmp_path / "simulated_1f1b_p8_m32.json").exists()
    assert main(["simulate", "--schedule", "zigzag", "--out", str(tmp_path)]) == 2
    assert "unknown schedule" in capsys.readouterr().err


def test_lab_opens_jupyterlab_on_the_lessons(monkeypatch):
    import subprocess

    calls = []
    monkeypatch.setattr(subprocess, "call", lambda command: calls.append(command) or 0)
    assert main(["lab", "--no-browser", "--port", "8899"]) == 0
    command = calls[0]
    assert command[1:3] == ["-m", "jupyterlab"]
    assert any(part.startswith("--ServerApp.root_dir=") and part.endswith("lessons") for part in command)
    assert "--no-browser" in command and "8899" in command
