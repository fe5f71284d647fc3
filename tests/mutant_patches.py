"""The mutants: plausible wrong answers to the graded tasks, each a small patch of its solution.

``tests/mutants/<task>/<name>.patch`` (e.g. ``tests/mutants/task1_1/greedy.patch``) is
the explanation of the bug, as free text, then a unified diff of one file of solutions/:

    Greedy filling instead of the optimal split.
    ...
    --- a/solutions/partition.py
    +++ b/solutions/partition.py
    @@ -41,3 +41,3 @@
    ...

(the layout of ``git format-patch``: ``git apply`` and ``patch -p1`` take it too).
:meth:`Mutant.materialize` writes the patched solution to ``<folder>/<task>/<name>/<module>.py``,
a directory that ``--impl`` grades like exercises/ (tests/test_grading.py does so for
every mutant).  Patches apply exactly, no fuzz: each hunk's old lines must be found as
they are, at the line the hunk names or elsewhere in the file; when a solution has
changed under a patch, :class:`PatchError` names the mutant and the hunk.

    python tests/mutant_patches.py FOLDER [task1_1/greedy ...]

writes the mutants (default: all) under FOLDER and prints their directories, e.g. to
rerun one: ``python -m pytest tests/tasks/test_task1_1.py --impl FOLDER/task1_1/greedy``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTANTS_DIR = ROOT / "tests" / "mutants"
HUNK_HEADER = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
SOLUTION_PATH = re.compile(r"solutions/(\w+)\.py")


class PatchError(Exception):
    """A mutant's patch is malformed, or no longer applies to its solution."""


@dataclass(frozen=True)
class Hunk:
    header: str  # "@@ -41,3 +41,3 @@"
    old_start: int  # 1-based line of the first old line (for an insertion: the line after which)
    old: tuple[str, ...]  # context and removed lines, with their line ends
    new: tuple[str, ...]  # context and added lines


@dataclass(frozen=True)
class Patch:
    header: str  # the free text before the diff: the mutant's explanation
    path: str  # "solutions/partition.py", the file it changes (a/ and b/ stripped)
    hunks: tuple[Hunk, ...]


@dataclass(frozen=True)
class Mutant:
    """tests/mutants/<task>/<name>.patch: ``name`` is "task1_1/greedy"."""

    patch_file: Path

    @property
    def name(self) -> str:
        return f"{self.task}/{self.short_name}"

    @property
    def task(self) -> str:
        """The task's marker, "task1_1"."""
        return self.patch_file.parent.name

    @property
    def short_name(self) -> str:
        return self.patch_file.stem

    def read(self) -> Patch:
        return parse(self.patch_file.read_text(encoding="utf-8"), self.name)

    @property
    def module(self) -> str:
        """The module it replaces: "partition" for a patch of solutions/partition.py."""
        return module_of(self.read(), self.name)

    def explanation(self) -> str:
        """The patch's header: what is wrong, and an example."""
        return self.read().header

    def source(self, solutions: Path | None = None) -> str:
        """The patched solution (from ``solutions``, default ROOT/solutions)."""
        patch = self.read()
        folder = solutions or ROOT / "solutions"
        original = (folder / f"{module_of(patch, self.name)}.py").read_text(encoding="utf-8")
        return apply(patch, original, self.name)

    def materialize(self, folder: Path, solutions: Path | None = None) -> Path:
        """Write ``folder/<task>/<name>/<module>.py`` and return that directory (an --impl)."""
        source = self.source(solutions)  # first: a patch that does not apply writes nothing
        directory = Path(folder) / self.task / self.short_name
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{self.module}.py").write_text(source, encoding="utf-8")
        return directory

    def __str__(self) -> str:
        return self.name


def all_mutants(mutants_dir: Path = MUTANTS_DIR) -> list[Mutant]:
    return [Mutant(path) for path in sorted(mutants_dir.glob("task*/*.patch"))]


def module_of(patch: Patch, name: str) -> str:
    match = SOLUTION_PATH.fullmatch(patch.path)
    if not match:
        raise PatchError(f"mutant {name}: the patch changes {patch.path}, not a module of solutions/")
    return match[1]


def parse(text: str, name: str = "patch") -> Patch:
    """Header, target file and hunks of a one-file unified diff (``name`` for the errors)."""
    lines = _lines(text)
    start = next(
        (i for i in range(len(lines) - 1) if lines[i].startswith("--- ") and lines[i + 1].startswith("+++ ")),
        None,
    )
    if start is None:
        raise PatchError(f"mutant {name}: no '--- a/...' and '+++ b/...' lines, so no diff")
    old_path, new_path = (_path_of(line) for line in lines[start:start + 2])
    if old_path != new_path:
        raise PatchError(f"mutant {name}: the diff renames {old_path} to {new_path}")
    hunks, i = [], start + 2
    while i < len(lines):
        match = HUNK_HEADER.match(lines[i])
        if not match:
            raise PatchError(f"mutant {name}: line {i + 1} of the patch should start a hunk: {lines[i]!r}")
        old_count = 1 if match[2] is None else int(match[2])
        new_count = 1 if match[4] is None else int(match[4])
        old, new, kind, i = [], [], "", i + 1
        while i < len(lines):
            line = lines[i]
            if line.startswith("\\"):  # "\ No newline at end of file": the line before has none
                for side, kinds in ((old, " -"), (new, " +")):
                    if kind in kinds:
                        side[-1] = side[-1].removesuffix("\n")
                i += 1
                continue
            if len(old) == old_count and len(new) == new_count:
                break
            kind, content = (" ", line) if line == "\n" else (line[:1], line[1:])  # "\n": empty context
            if kind not in (" ", "-", "+"):
                raise PatchError(f"mutant {name}: line {i + 1} of the patch is not part of a hunk: {line!r}")
            if kind in " -":
                old.append(content)
            if kind in " +":
                new.append(content)
            i += 1
        if (len(old), len(new)) != (old_count, new_count):
            raise PatchError(
                f"mutant {name}: hunk {len(hunks) + 1} ({match[0]}) says {old_count} old and "
                f"{new_count} new lines, but has {len(old)} and {len(new)}"
            )
        hunks.append(Hunk(match[0], int(match[1]), tuple(old), tuple(new)))
    if not hunks:
        raise PatchError(f"mutant {name}: the diff has no hunk")
    return Patch("".join(lines[:start]).strip(), new_path, tuple(hunks))


def _lines(text: str) -> list[str]:
    """The lines of ``text`` with their ends: split at "\\n" only (str.splitlines also
    splits at form feeds and other separators a source file may hold)."""
    return re.findall(r"[^\n]*\n|[^\n]+$", text)


def _path_of(line: str) -> str:
    path = line[4:].rstrip("\n").split("\t")[0]
    return path[2:] if path.startswith(("a/", "b/")) else path


def apply(patch: Patch, original: str, name: str = "patch") -> str:
    """``original`` with every hunk of ``patch`` applied: each hunk's old lines are looked
    for exactly, first at the line the hunk names, else the nearest place after the
    previous hunk; no fuzz.  PatchError names ``name`` and the hunk that does not apply."""
    lines = _lines(original)
    out, done = [], 0  # done: the lines of ``original`` consumed so far
    for number, hunk in enumerate(patch.hunks, 1):
        old = list(hunk.old)
        stated = hunk.old_start if not old else hunk.old_start - 1  # 0-based index of the old lines
        candidates = [at for at in range(done, len(lines) - len(old) + 1) if lines[at:at + len(old)] == old]
        if not candidates:
            raise PatchError(
                f"mutant {name}: hunk {number} of {len(patch.hunks)} ({hunk.header}) no longer applies "
                f"to {patch.path}: {_mismatch(lines, old, stated)}. Has {patch.path} changed? "
                f"Write the patch again against it (tests/mutants/{name}.patch)"
            )
        at = min(candidates, key=lambda candidate: abs(candidate - stated))
        out += lines[done:at] + list(hunk.new)
        done = at + len(old)
    return "".join(out + lines[done:])


def _mismatch(lines: list[str], old: list[str], at: int) -> str:
    """Where the hunk's old lines differ from the file at the line it names."""
    for offset, expected in enumerate(old):
        found = lines[at + offset] if 0 <= at + offset < len(lines) else "(end of file)"
        if found != expected:
            return f"line {at + offset + 1} should be {expected.rstrip()!r}, it is {found.rstrip()!r}"
    return f"its lines are at line {at + 1}, but before the previous hunk's"


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write mutants as --impl folders: FOLDER/<task>/<name>/<module>.py")
    parser.add_argument("folder", type=Path)
    parser.add_argument("names", nargs="*", help="task1_1/greedy ... (default: every mutant)")
    args = parser.parse_args()
    mutants = all_mutants()
    unknown = set(args.names) - {mutant.name for mutant in mutants}
    if unknown:
        parser.error(f"no such mutant: {', '.join(sorted(unknown))}")
    for mutant in mutants:
        if not args.names or mutant.name in args.names:
            print(mutant.materialize(args.folder))
