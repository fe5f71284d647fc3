"""The corpus and the character-level model of lesson 13 and scripts/train_corpus.py (pipelab/course/corpus.py,
char_lm.py, one_device.py), and lesson 12's padded loader (padding.py): two texts from the standard library, the
same under every Python 3.10+, a tokenizer that round-trips, windows of next-character targets; a few pipelined
training steps equal one device's, and a fine-tune with the first stage frozen leaves that stage's parameters bit
for bit while the loss on the second text falls."""

from __future__ import annotations

import copy
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pipelab as pl
from pipelab.common.threads import intra_op_threads
from pipelab.course import char_lm, corpus, one_device, padding

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "pipelab" / "course" / "corpus.py"


def test_the_corpus_and_the_zen_are_the_stated_texts():
    text, zen = corpus.corpus_text(), corpus.zen_text()
    assert (len(text), corpus.sha256(text)) == (corpus.CORPUS_CHARS, corpus.CORPUS_SHA256)
    assert (len(zen), corpus.sha256(zen)) == (corpus.ZEN_CHARS, corpus.ZEN_SHA256)
    assert f"{corpus.CORPUS_CHARS:,} characters" in corpus.__doc__
    assert f"{corpus.ZEN_CHARS} characters" in corpus.__doc__
    assert set(text) <= set(corpus.ALPHABET) and set(zen) <= set(corpus.ALPHABET)
    assert zen.startswith("The Zen of Python, by Tim Peters\n\nBeautiful is better than ugly.\n")
    assert not [line for line in zen.splitlines() if line and line in text]  # a distinct text
    assert text.startswith(corpus.docstrings("argparse")[0])  # the modules in order, module docstring first


def test_docstrings_are_read_from_the_source_not_imported():
    assert corpus.docstrings("textwrap")[0].startswith("Text wrapping and filling.")
    with pytest.raises(FileNotFoundError, match="'sys' has no .py source"):
        corpus.docstrings("sys")  # built in: no source to read


def _other_pythons() -> list[str]:
    """Python 3.10+ interpreters on this machine (PATH, pyenv's versions, /usr/bin), one per real file; pyenv's
    shims, which answer only for the selected version, left out."""
    found = [shutil.which(f"python3.{minor}") for minor in range(10, 16)]
    found += glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[0-9]*/bin/python3"))
    found += glob.glob("/usr/bin/python3.1[0-9]") + glob.glob("/usr/local/bin/python3.1[0-9]")
    unique = {}
    for path in filter(None, found):
        if "/shims/" in path:
            continue
        unique.setdefault(os.path.realpath(path), path)
    return sorted(unique.values())


def test_every_python_here_builds_the_same_texts_even_with_docstrings_stripped():
    expected = corpus.describe()
    runs = [[sys.executable, "-OO", str(SCRIPT)]] + [[python, str(SCRIPT)] for python in _other_pythons()]
    for command in runs:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd="/")
        assert done.returncode == 0, (command, done.stderr[-2000:])
        assert done.stdout.strip() == expected, command


def test_the_tokenizer_round_trips_and_names_a_stranger():
    tokenizer = char_lm.CharTokenizer()
    text = corpus.corpus_text()
    ids = tokenizer.encode(text)
    assert tokenizer.vocab_size == 96 and ids.dtype == torch.long and ids.shape == (len(text),)
    assert tokenizer.decode(ids) == text and tokenizer.decode(ids.tolist()) == text
    assert tokenizer.decode(torch.stack([ids[:5], ids[5:10]])) == [text[:5], text[5:10]]
    with pytest.raises(ValueError, match=r"character 'é' at position 3 \('caf\xe9'\)"):
        tokenizer.encode("café")
    with pytest.raises(ValueError, match="0..95"):
        tokenizer.decode([96])


def test_windows_hold_next_character_targets():
    ids = torch.arange(100)
    windows = char_lm.TextWindows(ids, seq_len=8, stride=4)
    assert len(windows) == (100 - 1 - 8) // 4 + 1 == 23
    inputs, targets = windows[22]
    assert inputs.tolist() == list(range(88, 96)) and targets.tolist() == list(range(89, 97))
    train, held = char_lm.held_out_split(ids, 0.1)
    assert (len(train), len(held)) == (90, 10) and torch.equal(torch.cat([train, held]), ids)
    batches = list(char_lm.windows_loader(ids[:96], seq_len=8, batch_size=4, shuffle=False))  # 11 windows
    assert [tuple(x.shape) for x, _ in batches] == [(4, 8), (4, 8), (3, 8)]  # the last batch partial
    with pytest.raises(ValueError, match="at least seq_len \\+ 1 = 9"):
        char_lm.TextWindows(ids[:8], seq_len=8)
    with pytest.raises(ValueError, match="equally long"):
        char_lm.prompts_tensor(char_lm.CharTokenizer(), ["ab", "abc"])


def _small_gpt(seed: int = 0) -> torch.nn.Sequential:
    return pl.models.tiny_gpt(n_layers=2, d_model=32, n_heads=2, vocab_size=96, seq_len=16, seed=seed)


def _loader(text: str, batch_size: int = 6, stride: int = 8):
    ids = char_lm.CharTokenizer().encode(text)
    return char_lm.windows_loader(ids, seq_len=16, batch_size=batch_size, stride=stride)


def test_pipelined_training_on_the_corpus_equals_one_device():
    model = _small_gpt()
    reference = copy.deepcopy(model)
    batches = _loader(corpus.corpus_text()[:1000])  # 123 windows: batches of 6, the last of 3 (smaller than m)
    pipe = pl.Pipeline(model, n_stages=3, n_microbatches=4, schedule="1f1b", loss_fn=pl.models.lm_loss, devices="cpu")
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    with pytest.warns(UserWarning, match="fewer than the pipeline's 4 micro-batches"), intra_op_threads(1):
        run = pl.train(pipe, batches, optimizer, epochs=1, clip=1.0, progress=False)  # (its optimizer: 1 thread)
    one = one_device.train(reference, batches, torch.optim.AdamW(reference.parameters(), lr=3e-3), epochs=1,
                           clip=1.0, loss_fn=pl.models.lm_loss)
    assert len(run.losses) == len(one.losses) == 21
    assert run.losses == pytest.approx(one.losses, rel=1e-5)
    assert one_device.relative_gap(run.losses, one.losses) < 1e-5 and one.tokens == 123 * 16
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
        if name.endswith("qkv.bias"):  # the key bias's gradient is 0 in exact arithmetic (softmax ignores a
            # constant added to a row of scores): AdamW scales its rounding noise up to a step of lr; compare the rest
            mine, theirs = torch.cat([mine[:32], mine[64:]]), torch.cat([theirs[:32], theirs[64:]])
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5, msg=name)


def test_a_fine_tune_with_the_first_stage_frozen_leaves_it_untouched_and_learns_the_zen():
    model = _small_gpt()
    reference = copy.deepcopy(model)
    pipe = pl.Pipeline(model, n_stages=3, n_microbatches=2, schedule="1f1b", loss_fn=pl.models.lm_loss, devices="cpu")
    first = pipe.partition.stages[0]
    first.requires_grad_(False)  # the embedding and the first block
    reference[:pipe.partition.bounds[0][1]].requires_grad_(False)
    kept = {name: p.detach().clone() for name, p in first.named_parameters()}
    rest = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    zen = _loader(corpus.zen_text(), batch_size=16, stride=8)  # 105 windows
    trainable = [p for p in pipe.parameters() if p.requires_grad]
    with intra_op_threads(1):
        run = pl.train(pipe, zen, torch.optim.AdamW(trainable, lr=1e-2), epochs=2, progress=False)
    one = one_device.train(reference, zen, torch.optim.AdamW(
        [p for p in reference.parameters() if p.requires_grad], lr=1e-2), epochs=2, loss_fn=pl.models.lm_loss)
    assert run.losses == pytest.approx(one.losses, rel=1e-5)
    assert all(torch.equal(p, kept[name]) and p.grad is None for name, p in first.named_parameters())
    assert all(not torch.equal(p, rest[name]) for name, p in model.named_parameters() if name in rest)
    assert run.losses[-1] < 0.8 * run.losses[0]
    trace = run.last.trace  # a frozen first stage keeps nothing for a backward
    assert trace.peak_memory[0] == 0 < min(trace.peak_memory[1:])


def test_continuations_are_what_follows_each_prompt_a_newline_shown():
    tokenizer = char_lm.CharTokenizer()
    tokens = char_lm.prompts_tensor(tokenizer, ["Beautiful is better", "Explicit is better "])
    assert char_lm.continuations(tokenizer, tokens, 12) == [" better", "better "]
    tokens = char_lm.prompts_tensor(tokenizer, ["ab\ncd"])
    assert char_lm.continuations(tokenizer, tokens, 1) == ["b⏎cd"]


def test_the_padded_loader_pads_each_batch_to_its_longest_row_and_labels_the_padding():
    sequences = padding.random_sequences(22, vocab_size=50, lengths=(3, 9), seed=0)
    assert len(sequences) == 22 and {len(s) for s in sequences} <= set(range(3, 10))
    assert all(int(s.min()) >= 1 and int(s.max()) < 50 for s in sequences)
    torch.manual_seed(0)
    batches = list(padding.padded_loader(sequences, batch_size=6))
    assert [len(b["input_ids"]) for b in batches] == [6, 6, 6, 4]
    for batch in batches:
        ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        assert ids.shape == mask.shape == labels.shape and int(mask.sum(dim=1).max()) == ids.shape[1]
        assert torch.equal(labels == -100, mask == 0) and torch.equal(ids[mask == 0], torch.zeros_like(ids[mask == 0]))
    assert len({b["input_ids"].shape for b in batches}) > 2  # the shape changes from step to step
    with pytest.raises(ValueError, match="lengths"):
        padding.random_sequences(3, vocab_size=10, lengths=(5, 2))


def test_one_device_train_takes_a_model_s_own_loss_and_stops_at_max_steps():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)

    class OwnLoss(torch.nn.Module):  # a model that computes its loss from labels in the batch, as Hugging Face's do
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x, labels):
            return type("Output", (), {"loss": torch.nn.functional.mse_loss(self.inner(x), labels)})()

    batches = [{"x": torch.randn(4, 3), "labels": torch.randn(4, 1)} for _ in range(5)]
    run = one_device.train(OwnLoss(), batches, torch.optim.SGD(model.parameters(), lr=0.1), epochs=2, max_steps=7)
    assert len(run.losses) == 7 and run.tokens == 7 * 12 and run.tokens_per_second > 0
    assert one_device.relative_gap([1.0, 2.0], [1.0, 2.0 + 2e-6]) < 1e-5
    assert one_device.relative_gap([1.0], [1.0, 2.0]) == float("inf")


@pytest.mark.slow
def test_the_training_script_checks_every_loss_the_checkpoint_and_the_frozen_stage(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("train_corpus", ROOT / "scripts" / "train_corpus.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    threads = torch.get_num_threads()
    try:
        status = script.main(["--epochs", "1", "--max-steps", "2", "--fine-tune-epochs", "1", "--every", "1",
                              "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert status == 0 and "all checks passed" in printed
    assert printed.count("(equal to 1e-5)") == 2 and "read back into a model of other weights: equal" in printed
    assert "bit for bit unchanged: True" in printed and "equal to plain greedy decoding: True" in printed
    assert (tmp_path / "pretrained").is_dir() and (tmp_path / "fine-tuned").is_dir()
