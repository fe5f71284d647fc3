"""Checkpoints that are whole or refused (issue 23, item 1).

One launch of 2 ranks (`checkpoint_cases.save_faults`) saves, is refused, fails in every way
a save can, and ends with rank 1 killed halfway through writing its file; the tests below read
what each rank saw and the files it left.  The damaged checkpoints and the wrong optimizers
are loaded here, in one process, from copies of what it saved.
"""

import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint

import pipelab as pl
import checkpoint_cases as cases

MANIFEST = ".pipelab-manifest.json"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    outside = Path(tempfile.mkdtemp(prefix="pipelab-read-only-"))  # where any user may look, but not write
    read_only = outside / "ro"
    read_only.mkdir()
    outside.chmod(0o755)
    read_only.chmod(0o555)
    killed = None
    try:
        pl.distributed.launch(cases.save_faults, 2, str(root), str(read_only), timeout_seconds=120)
    except pl.DistributedError as error:
        killed = error
    finally:
        read_only.chmod(0o755)
        shutil.rmtree(outside)
    if not all((root / f"seen-{rank}.pt").exists() for rank in range(2)):
        pytest.fail(f"the ranks failed before their last save: {killed}")
    seen = [torch.load(root / f"seen-{rank}.pt") for rank in range(2)]
    return root, seen, killed, read_only


def both(seen, key) -> dict:
    """What both ranks saw, which must be the same."""
    assert seen[0][key] == seen[1][key], key
    return seen[0][key]


def saved(seen, key) -> dict:
    return {part: {**seen[0][key][part], **seen[1][key][part]} for part in ("parameters", "optimizer")}


def load(path, optimizer_class=None, **options):
    """A fresh model (another seed) and optimizer, with the checkpoint at `path` loaded into them."""
    model = cases.make_model(seed=99)
    optimizer = None if optimizer_class is None else optimizer_class(model.parameters(), lr=5.0, **options)
    pl.distributed.load_checkpoint(model, path, optimizer)
    return model, optimizer


def assert_equal(model, optimizer, expected):
    for name, param in model.named_parameters():
        assert torch.equal(param, expected["parameters"][name]), name
        if optimizer is not None:
            for key, value in expected["optimizer"][name].items():
                assert torch.equal(torch.as_tensor(optimizer.state[param][key]), torch.as_tensor(value)), (name, key)


@pytest.fixture
def copy(run, tmp_path):
    """A copy of one of the run's checkpoints, to damage."""
    root = run[0]
    return lambda name: Path(shutil.copytree(root / name, tmp_path / name))


def item(path, key):
    """The file and (offset, length) of a key's bytes in a checkpoint, from its .metadata."""
    metadata = torch.distributed.checkpoint.FileSystemReader(path).read_metadata()
    (info,) = [info for index, info in metadata.storage_data.items() if index.fqn == key]
    return path / info.relative_path, info.offset, info.length


# ---- saving ---------------------------------------------------------------------------------------------------

def test_saving_over_a_checkpoint_is_refused_without_overwrite(run):
    root, seen, _, _ = run
    again = both(seen, "again")
    assert again["checkpoint error"], again
    assert again["message"].startswith(f"there is already a checkpoint at {root / 'adam'}: pass overwrite=True")
    refused = both(seen, "not a checkpoint")  # a directory of other files is never replaced, even with overwrite
    assert refused["checkpoint error"] and "exists and is not a checkpoint" in refused["message"], refused
    assert (root / "notes" / "todo.txt").read_text() == "not a checkpoint"


def test_overwrite_replaces_the_checkpoint_whole_and_leaves_nothing_beside_it(run):
    root, seen, _, _ = run
    assert both(seen, "files after overwrite") == ["adam"]  # no <path>.tmp-<id>, no <path>.old-<id>
    assert sorted(p.name for p in (root / "adam").iterdir()) == [".metadata", MANIFEST, "__0_0.distcp",
                                                                 "__1_0.distcp"]
    first, second = saved(seen, "adam"), saved(seen, "overwritten")
    assert not torch.equal(first["parameters"]["0.0.weight"], second["parameters"]["0.0.weight"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its manifest is there: no warning
        model, adam = load(root / "adam", torch.optim.Adam)
    assert_equal(model, adam, second)


def test_a_rank_killed_mid_save_leaves_the_old_checkpoint_loadable_and_unchanged(run):
    """Rank 1 is killed (SIGKILL) halfway through writing its file of a save with overwrite=True: the
    checkpoint at the path is the one saved before, whole; the ranks wrote only into <path>.tmp-<id>,
    which rank 0 removes if it lives to see DCP fail, and which is otherwise left beside the path."""
    root, seen, killed, _ = run
    assert killed is not None and killed.rank == 1 and "killed by signal 9" in str(killed), killed
    leftovers = sorted(p.name for p in root.iterdir() if p.name.startswith("adam."))
    assert all(name.startswith("adam.tmp-") for name in leftovers) and len(leftovers) <= 1, leftovers
    assert sorted(p.name for p in (root / "adam").iterdir()) == [".metadata", MANIFEST, "__0_0.distcp",
                                                                 "__1_0.distcp"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # checked against its manifest
        model, adam = load(root / "adam", torch.optim.Adam)  # the checkpoint the killed save was to replace
    assert_equal(model, adam, saved(seen, "overwritten"))


def test_a_missing_checkpoint_names_what_an_interrupted_save_left(tmp_path):
    (tmp_path / "step9.tmp-0123abcd").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*step9 \(step9\.tmp-0123abcd beside it: a save "
                                                r"that did not finish; delete it\)"):
        load(tmp_path / "step9")
    (tmp_path / "step9.old-0123abcd").mkdir()
    with pytest.raises(FileNotFoundError, match=r"but .*step9\.old-0123abcd is the checkpoint that was there, whole"):
        load(tmp_path / "step9")


def test_a_failure_inside_dcp_is_a_checkpoint_error_on_every_rank_with_the_cause_first(run):
    """Rank 1's writer raises PermissionError inside DCP, which raises its CheckpointException (a BaseException)
    on both ranks: both raise the same CheckpointError instead, the cause first, and nothing is left."""
    root, seen, _, _ = run
    denied = both(seen, "write denied")
    assert denied["checkpoint error"] and denied["cause"] == "PermissionError", denied
    assert denied["message"].startswith("PermissionError: [Errno 13] Permission denied"), denied["message"]
    assert denied["message"].endswith(f"(while saving the checkpoint at {root / 'denied'} on rank 1)")
    assert not [name for name in both(seen, "files after denied") if name.startswith("denied")]  # nor its .tmp-<id>


def test_a_read_only_directory_is_a_checkpoint_error_that_begins_with_permission_error(run):
    _, seen, _, read_only = run
    refused = both(seen, "read-only")
    if "skipped" in refused:
        pytest.skip(refused["skipped"])
    assert refused["checkpoint error"] and refused["cause"] == "PermissionError", refused
    assert refused["message"].startswith(f"PermissionError: [Errno 13] Permission denied: '{read_only}/ckpt.tmp-")
    assert refused["message"].endswith(f"(while saving the checkpoint at {read_only}/ckpt on rank 0)")
    assert both(seen, "files in read-only") == []


# ---- loading --------------------------------------------------------------------------------------------------

def test_a_flipped_bit_is_a_checkpoint_error_naming_the_file_and_the_tensor(run, copy):
    _, seen, _, _ = run
    path = copy("adam")
    file, offset, length = item(path, "model.6.0.weight")  # a tensor of the second stage, in rank 1's file
    data = bytearray(file.read_bytes())
    raw = saved(seen, "overwritten")["parameters"]["6.0.weight"].numpy().tobytes()
    at = data.index(raw, offset, offset + length) + 100  # a byte of the tensor's own values
    data[at] ^= 0x04
    file.write_bytes(bytes(data))
    with pytest.raises(pl.CheckpointError, match=rf"^the checkpoint at {path} is damaged: __1_0\.distcp fails its "
                                                 r"checksum in 'model\.6\.0\.weight' \(bytes \d+ to \d+\)"):
        load(path)
    with pytest.raises(pl.CheckpointError, match=r"__1_0\.distcp fails its checksum"):
        load(path, torch.optim.Adam)


def test_a_flipped_bit_in_the_metadata_is_found_before_it_is_unpickled(copy):
    path = copy("adam")
    data = bytearray((path / ".metadata").read_bytes())
    data[len(data) // 2] ^= 0x01
    (path / ".metadata").write_bytes(bytes(data))
    with pytest.raises(pl.CheckpointError, match=r"is damaged: \.metadata fails its checksum"):
        load(path)


def test_a_truncated_shard_is_a_checkpoint_error_naming_the_file(copy):
    path = copy("adam")
    shard = path / "__0_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size - 200)
    with pytest.raises(pl.CheckpointError, match=rf"is damaged: __0_0\.distcp is {size - 200} bytes but {size} "
                                                 "were written: the file was cut short"):
        load(path, torch.optim.Adam)


def test_a_checkpoint_without_a_manifest_loads_with_a_warning(run, copy):
    _, seen, _, _ = run
    path = copy("adam")
    (path / MANIFEST).unlink()  # as an older pipelab wrote it
    with pytest.warns(UserWarning, match="has no manifest .* saved by an older pipelab"):
        model, adam = load(path, torch.optim.Adam)
    assert_equal(model, adam, saved(seen, "overwritten"))


def test_dcp_failing_to_read_is_a_checkpoint_error_with_the_cause_first(copy):
    """Without a manifest nothing is checked before DCP reads: a truncated shard fails inside DCP, whose
    CheckpointException (a BaseException) comes out as a CheckpointError, the cause first, chained."""
    path = copy("adam")
    (path / MANIFEST).unlink()
    os.truncate(path / "__1_0.distcp", 300)
    with pytest.warns(UserWarning, match="no manifest"), pytest.raises(pl.CheckpointError) as refused:
        load(path)
    message = str(refused.value)
    cause = refused.value.__cause__
    assert cause is not None and not isinstance(cause, pl.CheckpointError)
    assert message.startswith(type(cause).__name__), message  # (EOFError has no words of its own)
    assert message.endswith(f"(while loading the checkpoint at {path})"), message


def test_adam_state_is_refused_by_sgd_and_sgd_state_by_adam_naming_both(run, copy):
    root, seen, _, _ = run
    for path, optimizer_class, options, was, here in [(root / "adam", torch.optim.SGD, {"momentum": 0.9}, "Adam", "SGD"),
                                                      (root / "sgd", torch.optim.Adam, {}, "SGD", "Adam")]:
        with pytest.raises(pl.CheckpointError, match=rf"^the checkpoint at {re.escape(str(path))} holds the state of "
                                                     rf"an? {was} optimizer \(torch\.optim\.\w+\.{was}\), not of "
                                                     rf"an? {here} \(torch\.optim\.\w+\.{here}\)"):
            load(path, optimizer_class, **options)
    model, sgd = load(root / "sgd", torch.optim.SGD, momentum=0.9)  # its own kind loads
    assert_equal(model, sgd, saved(seen, "sgd"))


def test_without_a_manifest_the_target_optimizers_own_state_keys_refuse_another_kind(copy):
    """An older checkpoint does not say its optimizer: the keys the target keeps (asked of the target, not
    read from the checkpoint) must be the saved ones.  SGD's momentum_buffer into Adam used to fail with
    KeyError: 'step' in Adam's load_state_dict, after the model's weights were overwritten; Adam's moments into
    SGD loaded, and SGD stepped without its momentum."""
    adam, sgd = copy("adam"), copy("sgd")
    for path in (adam, sgd):
        (path / MANIFEST).unlink()
    refusals = [(sgd, torch.optim.Adam, {}, (r"\['momentum_buffer'\] for 0\.0\.weight, but this Adam keeps "
                                             r"\['exp_avg', 'exp_avg_sq', 'step'\]")),
                (adam, torch.optim.SGD, {"momentum": 0.9}, (r"\['exp_avg', 'exp_avg_sq', 'step'\] for 0\.0\.weight, "
                                                            r"but this SGD keeps \['momentum_buffer'\]"))]
    for path, optimizer_class, options, words in refusals:
        model = cases.make_model(seed=99)
        before = model[0][0].weight.detach().clone()
        optimizer = optimizer_class(model.parameters(), lr=5.0, **options)
        with pytest.warns(UserWarning, match="no manifest"), pytest.raises(pl.CheckpointError, match=words):
            pl.distributed.load_checkpoint(model, path, optimizer)
        assert torch.equal(model[0][0].weight, before)  # refused before anything was read
        assert not optimizer.state


def test_except_exception_catches_every_checkpoint_failure(run, copy):
    """Every failure above, caught as a user would: `except Exception` (DCP's CheckpointException is not one)."""
    root, seen, _, _ = run
    for key in ("again", "not a checkpoint", "write denied", "read-only"):
        assert both(seen, key).get("checkpoint error", "skipped" in both(seen, key)), key  # (caught with
        # `except Exception` on the ranks: DCP's CheckpointException would have ended the launch)
    damaged = copy("adam")
    (damaged / MANIFEST).unlink()
    os.truncate(damaged / "__0_0.distcp", 10)
    flipped = copy("sgd")
    (flipped / MANIFEST).write_text("{}")
    failures = [lambda: load(damaged), lambda: load(flipped), lambda: load(root / "adam", torch.optim.SGD),
                lambda: load(root / "sgd", torch.optim.Adam)]
    for failure in failures:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                failure()
            except Exception as error:
                assert isinstance(error, pl.CheckpointError), error
            else:
                raise AssertionError("no failure")


@pytest.fixture
def small_disk(tmp_path):
    """A file system of 1 MiB (a tmpfs this test mounts, as root; skipped otherwise), unmounted after."""
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root, to mount a small tmpfs")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_during_a_save_says_so_and_keeps_the_checkpoint_that_was_there(small_disk):
    """torch.save on a full disk raises its zip writer's "[enforce fail at inline_container.cc:672] unexpected
    pos ..." (or an OSError ENOSPC): the CheckpointError says the disk is full, with the bytes free, the fix, and
    torch's words; the checkpoint saved before at the path loads, unchanged."""
    model = pl.models.mlp(depth=4, width=64, seed=0)
    pipe = pl.Pipeline(model, n_stages=2, n_microbatches=2, loss_fn=torch.nn.MSELoss(), devices="cpu")
    adam = torch.optim.Adam(pipe.parameters())
    x, y = pl.models.sample_batch(model, 8)
    pipe.step(x, y)
    adam.step()
    path = small_disk / "step1"
    pipe.save_checkpoint(path, adam)
    kept = {name: q.detach().clone() for name, q in model.named_parameters()}
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (shutil.disk_usage(small_disk).free - 4096))  # 4 KiB left
    pipe.step(x, y)
    adam.step()
    with pytest.raises(pl.CheckpointError) as caught:
        pipe.save_checkpoint(path, adam, overwrite=True)
    message = str(caught.value)
    assert message.startswith(f"the disk holding {path} is full, or refused a write ("), message
    assert (" free there as it failed): free space or save elsewhere; the checkpoint that was at the path, if any, "
            "is kept") in message, message
    assert "unexpected pos" in message or "No space left on device" in message, message
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "step1"]  # nothing half-written left beside
    filler.unlink()
    again = pl.models.mlp(depth=4, width=64, seed=1)
    pl.Pipeline(again, n_stages=2, n_microbatches=2, loss_fn=torch.nn.MSELoss(), devices="cpu").load_checkpoint(path)
    assert all(torch.equal(q, kept[name]) for name, q in again.named_parameters())
