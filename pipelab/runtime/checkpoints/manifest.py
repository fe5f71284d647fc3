"""A checkpoint's manifest: what was written, so that a damaged file is found before its bytes are used.

`<checkpoint>/.pipelab-manifest.json` lists every file DCP wrote (`.metadata` and the
`.distcp` shards) with its size and sha256, and, for each item in a shard (a tensor, or a
number such as Adam's `step`), the zlib.crc32 of its bytes; also the optimizer's class. It
is written after every rank's files are complete and before the directory is renamed into
place (checkpoint.py), and ends with the sha256 of the rest, so that a damaged manifest is
told apart from a damaged checkpoint.

Loading checks the sizes of all files and the hash of `.metadata` before anything is read,
and the crc32 of each item as DCP reads it (`verifying_reader`): every byte loaded was
checked, and each rank reads only its own items once.  The shards' sha256 are for anyone who
wants to check a whole file (`sha256sum`).
"""

from __future__ import annotations

import hashlib
import io
import json
import zlib
from functools import cache
from pathlib import Path

NAME = ".pipelab-manifest.json"
FORMAT, VERSION = "pipelab-checkpoint", 1
METADATA = ".metadata"  # DCP's file of keys, shapes and places
_CHUNK = 1 << 22


class DamagedCheckpoint(Exception):
    """A file that differs from what the manifest says was written (checkpoint.py makes it a CheckpointError)."""


def files_of(metadata) -> list[str]:
    """Every file of a DCP checkpoint, from its metadata: `.metadata` and each shard an item is in."""
    return [METADATA] + sorted({info.relative_path for info in metadata.storage_data.values()})


def describe(directory: Path, names: list[str], metadata) -> dict[str, dict]:
    """The manifest's record of each of `names` (files in `directory`): bytes, sha256, crc32 of each item."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for info in metadata.storage_data.values():
        ranges.setdefault(info.relative_path, []).append((info.offset, info.length))
    return {name: _describe_file(directory / name, sorted(ranges.get(name, []))) for name in names}


def _describe_file(file: Path, ranges: list[tuple[int, int]]) -> dict:
    """One pass over the file: its sha256, and the crc32 of each (offset, length) item, in order."""
    sha, items = hashlib.sha256(), {}
    with open(file, "rb") as stream:
        for offset, length in ranges:
            if offset < stream.tell():
                raise ValueError(f"{file.name}: items overlap at byte {offset}")
            for chunk in _chunks(stream, offset - stream.tell(), file):  # (DCP leaves no gap; hashed if any)
                sha.update(chunk)
            crc = 0
            for chunk in _chunks(stream, length, file):
                sha.update(chunk)
                crc = zlib.crc32(chunk, crc)
            items[str(offset)] = crc
        for chunk in _chunks(stream, None, file):
            sha.update(chunk)
        size = stream.tell()
    record = {"bytes": size, "sha256": sha.hexdigest()}
    if ranges:
        record["items"] = items
    return record


def _chunks(stream, length: int | None, file: Path):
    """`length` bytes of `stream` (None: to the end), in chunks; a file that ends first is an error."""
    while length is None or length > 0:
        chunk = stream.read(_CHUNK if length is None else min(_CHUNK, length))
        if not chunk:
            if length is None:
                return
            raise ValueError(f"{file.name} ends at byte {stream.tell()}, before its last item")
        if length is not None:
            length -= len(chunk)
        yield chunk


def make(files: dict[str, dict], optimizer: str | None) -> dict:
    manifest = {"format": FORMAT, "version": VERSION, "optimizer": optimizer, "files": files}
    return {**manifest, "sha256": _digest(manifest)}


def _digest(manifest: dict) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def read(directory: Path) -> dict | None:
    """The manifest of the checkpoint in `directory`, checked against itself; None if it has none."""
    file = directory / NAME
    if not file.is_file():
        return None
    try:
        manifest = json.loads(file.read_bytes())
        body = {key: value for key, value in manifest.items() if key != "sha256"}
        whole = manifest["sha256"] == _digest(body) and manifest["format"] == FORMAT
    except (ValueError, KeyError, TypeError, AttributeError):
        whole = False
    if not whole:
        raise DamagedCheckpoint(f"its manifest {NAME} is damaged (it does not match its own checksum)")
    if manifest["version"] > VERSION:
        raise DamagedCheckpoint(f"its manifest {NAME} is version {manifest['version']}, from a newer pipelab "
                                f"(this one reads version {VERSION})")
    return manifest


def check_files(directory: Path, manifest: dict) -> None:
    """Every file the manifest lists is there with its size; `.metadata` has its hash (before it is unpickled)."""
    for name, record in manifest["files"].items():
        file = directory / name
        if not file.is_file():
            raise DamagedCheckpoint(f"{name} is missing (the manifest lists it)")
        size = file.stat().st_size
        if size != record["bytes"]:
            cut = "cut short" if size < record["bytes"] else "longer than it was"
            raise DamagedCheckpoint(f"{name} is {size} bytes but {record['bytes']} were written: the file was {cut}")
    record = manifest["files"].get(METADATA)
    if record is None:
        raise DamagedCheckpoint(f"its manifest {NAME} does not list {METADATA}")
    if hashlib.sha256((directory / METADATA).read_bytes()).hexdigest() != record["sha256"]:
        raise DamagedCheckpoint(f"{METADATA} fails its checksum: the file changed after it was saved")


def verifying_reader(path, manifest: dict, metadata):
    """DCP's reader, checking each item's bytes against the manifest as it reads them (then DCP parses them)."""
    return _reader_class()(path, manifest, metadata)


@cache
def _reader_class():
    """DCP's reader, subclassed when first used (importing DCP adds about a second to `import pipelab`)."""
    from torch.distributed.checkpoint import FileSystemReader

    class VerifyingReader(FileSystemReader):
        def __init__(self, path, manifest: dict, metadata):
            super().__init__(path)
            self.items = {name: record.get("items", {}) for name, record in manifest["files"].items()}
            self.key_of = {(info.relative_path, info.offset): index.fqn
                           for index, info in metadata.storage_data.items()}

        def _slice_file(self, file, sinfo):  # DCP reads every item through it (torch's FileSystemReader.read_data)
            data = super()._slice_file(file, sinfo).read(sinfo.length)
            name, key = sinfo.relative_path, self.key_of.get((sinfo.relative_path, sinfo.offset), "?")
            expected = self.items.get(name, {}).get(str(sinfo.offset))
            if expected is None:
                raise DamagedCheckpoint(f"{name} holds '{key}' (bytes {sinfo.offset}..) that its manifest "
                                        "does not list")
            if len(data) != sinfo.length or zlib.crc32(data) != expected:
                raise DamagedCheckpoint(f"{name} fails its checksum in '{key}' (bytes {sinfo.offset} to "
                                        f"{sinfo.offset + sinfo.length}): the file changed after it was saved")
            return io.BytesIO(data)

    return VerifyingReader
