"""`pipelab run`: trains, prints the table, writes the PNG and the Chrome trace."""

import json

import pytest
import torch

import pipelab as pl
from pipelab.commands import cli
from pipelab.commands.cli import main


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
    assert [int(row[2]) for row in table] == [8, 8, 8, 8]  # GPipe keeps all m micro-batches
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


def _first_loss(tmp_path, argv) -> dict:
    assert main(["run", *argv, "--steps", "1", "--device", "cpu", "--out", str(tmp_path),
                 "--json", str(tmp_path / "run.json")]) == 0
    return json.loads((tmp_path / "run.json").read_text())


@pytest.mark.parametrize("backend", ["local", "distributed"])
def test_run_trains_a_hugging_face_model_from_its_config_split_by_names(tmp_path, backend):
    transformers = pytest.importorskip("transformers")
    config = dict(n_layer=3, n_embd=32, n_head=2, vocab_size=96, n_positions=32)
    found = _first_loss(tmp_path, ["--model", "transformers:gpt2", "--config", ",".join(f"{k}={v}" for k, v in
                                   config.items()), "--split-points", "transformer.h.1,transformer.h.2",
                                   "--stages", "3", "--microbatches", "2", "--batch-size", "4", "--seq-len", "8",
                                   "--backend", backend])
    assert found["stages"][1:] == ["transformer.h.1 .. transformer.h.1.mlp.dropout", "transformer.h.2 .. lm_head"]
    torch.manual_seed(0)  # the model and the tokens as the run makes them, built here by hand
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config)).eval()
    ids = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(0))
    assert found["losses"][0] == pytest.approx(model(input_ids=ids, labels=ids).loss.item(), rel=1e-5)


@pytest.mark.parametrize("backend", ["local", "distributed"])
def test_run_decides_the_cut_and_schedule_with_auto(tmp_path, backend):
    """--split auto --schedule auto: the table lists the candidates priced, the chosen one first, and the run's
    first loss is the plain model's (the decision changes where and when, not what is computed)."""
    transformers = pytest.importorskip("transformers")
    config = dict(n_layer=3, n_embd=32, n_head=2, vocab_size=256, n_positions=32)
    found = _first_loss(tmp_path, ["--model", "transformers:gpt2", "--config", ",".join(f"{k}={v}" for k, v in
                                   config.items()), "--split", "auto", "--schedule", "auto", "--stages", "2",
                                   "--microbatches", "2", "--batch-size", "4", "--seq-len", "8", "--backend", backend])
    assert found["decision"].startswith("decided: the cut and schedule, from ")
    header, chosen = found["decision"].splitlines()[1:3]
    cut = chosen[:header.index("schedule")].strip().split(", ")  # where the chosen stages 1, 2, ... begin
    assert [stage.split(" ..")[0] for stage in found["stages"][1:]] == cut
    assert found["schedule"].split()[0] in ("gpipe", "1f1b", "zb-h1", "search", "interleaved-1f1b")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config)).eval()
    ids = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(0))
    assert found["losses"][0] == pytest.approx(model(input_ids=ids, labels=ids).loss.item(), rel=1e-5)


def test_run_trains_the_model_a_factory_returns_with_the_single_devices_gradients(tmp_path):
    """One SGD step (lr 1) of a factory's padded batch: the parameters it saves are the single device's minus its
    gradients, so weighing micro-batches by samples (not by the tokens the model's own loss counts) would fail."""
    pytest.importorskip("transformers")
    from your_model_cases import cli_factory

    found = _first_loss(tmp_path, ["--model", "your_model_cases:cli_factory", "--stages", "2", "--microbatches", "3",
                                   "--optimizer", "sgd", "--lr", "1", "--checkpoint", str(tmp_path / "saved")])
    model, batch, _ = cli_factory()
    assert found["split"] == "names" and found["stages"][1].startswith("model.layers.2 ")
    loss = model(**batch).loss
    loss.backward()
    assert found["losses"][0] == pytest.approx(loss.item(), rel=1e-5)
    expected = {name: (p - p.grad).detach() for name, p in model.named_parameters()}
    pl.distributed.load_checkpoint(model, tmp_path / "saved" / "step-000001")
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=1e-5, atol=1e-6, msg=lambda e: f"{name}: {e}")


@pytest.mark.parametrize("backend", ["local", pytest.param("distributed", marks=pytest.mark.slow)])
def test_run_trains_over_the_loader_a_factory_returns(tmp_path, backend):
    """Two epochs of a shuffled loader padded per batch (rows and length change every step, the last batch
    partial), clipped: every step's loss the CLI reports is the single device's, and so is the held-out loss at
    the end (two padded batches: their loss as one)."""
    pytest.importorskip("transformers")
    import training_run_cases as cases
    from your_model_cases import make_model

    assert main(["run", "--model", "training_run_cases:cli_loader_factory", "--stages", "2", "--microbatches", "3",
                 "--epochs", "2", "--clip", "0.5", "--lr", "1e-2", "--eval-every", "4", "--backend", backend,
                 "--device", "cpu",
                 "--out", str(tmp_path), "--json", str(tmp_path / "run.json")]) == 0
    found = json.loads((tmp_path / "run.json").read_text())
    model = make_model("gpt2")
    losses, parameters = cases.single_device_run(model, epochs=2, clip=0.5, optimizer_class=torch.optim.Adam)
    assert found["stages"][1].startswith("transformer.h.2 ")  # 4 blocks cut evenly
    assert len(found["losses"]) == len(found["step_seconds"]) == 8  # two epochs of 6, 6, 6, 3 rows
    assert found["losses"] == pytest.approx(losses, rel=1e-5)
    model.load_state_dict(parameters, strict=False)
    with torch.no_grad():
        held_out = model(**cases.pad(cases.sequences(seed=1)[:6])).loss  # cases.held_out()'s rows
    assert list(found["eval_losses"]) == ["4", "8"]
    assert found["eval_losses"]["8"] == pytest.approx(held_out.item(), rel=1e-5)


@pytest.mark.parametrize("argv, message", [
    (["--model", "resnet"], "--model is one of"),
    (["--model", "no_such_module:f"], "cannot find f in module no_such_module"),
    (["--model", "mlp", "--config", "n_layer=2"], "--config is for a Hugging Face model"),
    (["--model", "mlp", "--split-points", "0"], "--split-points is for a model split by module names"),
    (["--model", "transformers:gpt2", "--config", "n_layer"], "key=value pairs"),
    (["--model", "transformers:gpt2", "--config", "n_layr=2"],
     "GPT2Config has no key 'n_layr' (did you mean n_layer?)"),
    (["--model", "transformers:gpt2", "--config", "n_layer=two"], "--config n_layer=two: GPT2Config refuses it"),
    (["--model", "transformers:gtp2"], "transformers has no model type 'gtp2' (did you mean gpt2"),
    (["--model", "your_model_cases:cli_factory", "--epochs", "2"], "--epochs is for a factory that returns a loader"),
    (["--model", "json:dumps"], "dumps() cannot be called with no arguments (missing a required argument: 'obj'): "
                                "a factory takes none and returns (model, batch or loader"),
    (["--model", "json:decoder"], "decoder is a module, not a factory"),
])
def test_run_names_a_bad_model_flag(tmp_path, capsys, argv, message):
    assert main(["run", *argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_simulate_prints_grid_and_metrics(tmp_path, capsys):
    assert main(["simulate", "--stages", "8", "--microbatches", "32", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "device 7 |" in out
    assert "bubble fraction 17.95%" in out  # 7 / 39
    assert (tmp_path / "simulated_1f1b_p8_m32.png").exists() and (tmp_path / "simulated_1f1b_p8_m32.json").exists()
    assert main(["simulate", "--schedule", "zigzag", "--out", str(tmp_path)]) == 2
    assert "unknown schedule" in capsys.readouterr().err


def test_simulate_zero_bubble_prints_its_own_formula_and_runs_its_w(tmp_path, capsys):
    assert main(["simulate", "--schedule", "zb-h1", "--stages", "4", "--microbatches", "8", "--forward", "1",
                 "--backward", "2", "--weight", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    expected = pl.simulate(pl.schedules.zero_bubble_h1(4, 8), pl.Costs(forward=1.0, backward=2.0, weight=1.0))
    assert expected.makespan == 8 * (1 + 2 + 1) + 3 * (1 + 2 - 1)  # Zero Bubble PP, Table 2: 38, not t_W = 0's 30
    assert f"makespan {expected.makespan:.4g} " in out and f"bubble fraction {expected.bubble_fraction:.2%}" in out
    assert "t_W=1.0" in out and "Zero Bubble" in out
    assert f"bubble = (p-1)(t_F+t_B-t_W) / makespan = {expected.bubble_fraction:.2%}" in out
    assert "(p-1)/(m+p-1)" not in out  # not GPipe's formula
    assert main(["simulate", "--schedule", "zb-h1", "--weight", "3", "--out", str(tmp_path)]) == 0
    assert "makespan ≥" in capsys.readouterr().out  # t_W > t_F: the formula is a bound there
    assert main(["simulate", "--schedule", "gpipe", "--weight", "1", "--out", str(tmp_path)]) == 2
    assert "--weight is the weight-gradient half W" in capsys.readouterr().err


def test_lab_opens_jupyterlab_on_the_lessons(monkeypatch):
    import subprocess

    calls = []
    monkeypatch.setattr(subprocess, "call", lambda command: calls.append(command) or 0)
    assert main(["lab", "--no-browser", "--port", "8899"]) == 0
    command = calls[0]
    assert command[1:3] == ["-m", "jupyterlab"]
    assert any(part.startswith("--ServerApp.root_dir=") and part.endswith("lessons") for part in command)
    assert "--no-browser" in command and "8899" in command
