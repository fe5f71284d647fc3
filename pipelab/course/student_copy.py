"""A student copy of the course: what an instructor hands out, without the answers.

    make student-copy DIR=../pipelab-student          # or: python -m pipelab.course.student_copy DIR

writes DIR with the engine (`pipelab/`), the lessons, the exercises (their stubs), the graded tests
(`tests/tasks/` and the `tests/conftest.py` that hands them `--impl`), `docs/`, `benchmarks/`, `README.md`,
`Makefile` and `pyproject.toml`.  Left out: `solutions/` (the reference answers), the rest of `tests/` (the
graders' own tests, and `tests/mutants/`: wrong answers written as patches of the reference answers), `.ci/`
and `scripts/`.  In the copy `pipelab grade` works as here and reports every task "not started"; `pipelab
grade --json` gives an autograder one object per task.

The files are those git tracks (`git ls-files`), as they are in the working tree; outside a git checkout, every
file under the same paths except caches.  In the README, what lies between ``<!-- instructors -->`` and
``<!-- /instructors -->`` is dropped and a note at the top says what the copy is.

Before it returns, `write` checks the copy for the reference answers' code (`answers_in`): no solution
function's body, and no run of `LEAK_LINES` consecutive lines of a solution that its stub does not have, in any
file.  An exercise solved in the working tree would otherwise go out with the course; `write` then refuses.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INCLUDED = ("pipelab/", "lessons/", "exercises/", "tests/tasks/", "tests/conftest.py", "docs/", "benchmarks/",
            "README.md", "Makefile", "pyproject.toml", ".gitignore")
SKIPPED_PARTS = {"__pycache__", ".ipynb_checkpoints", ".hypothesis", ".pytest_cache", ".venv"}
INSTRUCTORS = ("<!-- instructors -->", "<!-- /instructors -->")
NOTE = ("> **Student copy.** The reference answers and the graders' own tests are left out. Edit the stubs in\n"
        "> `exercises/`, then run `pipelab grade` (or `pipelab grade --json` for an autograder).\n\n")
LEAK_LINES = 4  # a run of this many lines of a reference answer (lines its stub lacks) counts as its code
MIN_BODY = 150  # characters of a function body's AST dump below which it is too small to be an answer (`return x`)


def course_files(root: Path = ROOT) -> list[str]:
    """The course's files under `INCLUDED`, relative to `root`: git's tracked files, or a walk outside git."""
    try:
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True,
                                text=True).stdout.split("\0")
    except (OSError, subprocess.CalledProcessError):
        listed = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]
    return sorted(f for f in listed if f and f.startswith(INCLUDED) and (root / f).is_file()
                  and not SKIPPED_PARTS.intersection(Path(f).parts))


def student_readme(text: str) -> str:
    """The README without its instructors' blocks, a note on top."""
    start, end = INSTRUCTORS
    while start in text:
        before, rest = text.split(start, 1)
        if end not in rest:
            raise ValueError(f"README.md: {start} without {end}")
        text = before.rstrip(" ") + rest.split(end, 1)[1].lstrip("\n")
    title, _, body = text.partition("\n\n")
    return f"{title}\n\n{NOTE}{body}"


def write(target: Path | str, root: Path = ROOT) -> Path:
    """Write the student copy into `target` (a new or empty directory) and check it for reference answers."""
    target = Path(target).resolve()
    if target.exists() and any(target.iterdir()):
        raise ValueError(f"{target} is not empty: a student copy goes into a new or empty directory")
    if root.resolve() in (target, *target.parents):
        raise ValueError(f"{target} is inside the course ({root}): write the student copy somewhere else")
    for name in course_files(root):
        destination = target / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        if name == "README.md":
            destination.write_text(student_readme((root / name).read_text(encoding="utf-8")), encoding="utf-8")
        else:
            shutil.copy2(root / name, destination)
    found = answers_in(target, root)
    if found:
        shutil.rmtree(target)
        raise ValueError("the copy would carry reference answers, so none was written:\n  " + "\n  ".join(found))
    return target


# ---- what counts as a reference answer's code -------------------------------------------------------------


def _norm(line: str) -> str:
    return " ".join(line.split())


def _body(function: ast.FunctionDef) -> str:
    """A function's body without its docstring, as the AST sees it (names, structure; not layout or comments)."""
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return ast.dump(ast.Module(body=body, type_ignores=[]))


def _functions(source: str, nested: bool = True) -> dict[str, str]:
    """name -> body of every function (`nested`), or of the module's functions and its classes' methods only."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    if nested:
        nodes = [node for node in ast.walk(tree) if isinstance(node, kinds)]
    else:
        nodes = [node for top in tree.body for node in ([top] + (top.body if isinstance(top, ast.ClassDef) else []))
                 if isinstance(node, kinds)]
    return {node.name: _body(node) for node in nodes}


def reference_answers(root: Path = ROOT) -> dict[str, tuple[dict[str, str], list[str | None]]]:
    """Per solutions/ module: the bodies of its functions and methods other than those its stub gives as they are
    (helpers nested inside count as part of them), and its lines, each normalised, None where it is short, a
    comment, or also in the stub.  An exercise with no NotImplementedError left is taken as solved, not as a stub."""
    answers = {}
    for solution in sorted((root / "solutions").glob("*.py")):
        stub_path = root / "exercises" / solution.name
        stub = stub_path.read_text(encoding="utf-8") if stub_path.is_file() else ""
        if "NotImplementedError" not in stub:  # solved in place: it says nothing of what the stub gives
            stub = ""
        stub_functions, stub_lines = _functions(stub, nested=False), {_norm(line) for line in stub.splitlines()}
        source = solution.read_text(encoding="utf-8")
        bodies = {name: body for name, body in _functions(source, nested=False).items()
                  if len(body) > MIN_BODY and body != stub_functions.get(name)}
        lines = [_norm(line) if len(_norm(line)) >= 12 and not _norm(line).startswith("#")
                 and _norm(line) not in stub_lines else None for line in source.splitlines()]
        answers[solution.name] = (bodies, lines)
    return answers


def _longest_common_run(text_lines: list[str], answer_lines: list[str | None]) -> int:
    """The most consecutive lines of `text_lines` that are consecutive answer lines too."""
    where: dict[str, list[int]] = {}
    for i, line in enumerate(answer_lines):
        if line is not None:
            where.setdefault(line, []).append(i)
    best, previous = 0, {}
    for line in text_lines:
        current = {i: previous.get(i - 1, 0) + 1 for i in where.get(_norm(line), [])}
        best, previous = max([best, *current.values()]), current
    return best


def answers_in(copy: Path, root: Path = ROOT) -> list[str]:
    """Where the copy holds a reference answer's code: "FILE: solutions/X.py's f()" or "FILE: N lines of
    solutions/X.py".  Empty for a clean copy."""
    answers = reference_answers(root)
    found = []
    for path in sorted(p for p in Path(copy).rglob("*") if p.is_file()):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        name = path.relative_to(copy)
        bodies_here = set(_functions(text).values()) if path.suffix == ".py" else set()
        lines = text.splitlines()
        for module, (bodies, answer_lines) in answers.items():
            for function, body in bodies.items():
                if body in bodies_here:
                    found.append(f"{name}: solutions/{module}'s {function}()")
            run = _longest_common_run(lines, answer_lines)
            if run >= LEAK_LINES:
                found.append(f"{name}: {run} consecutive lines of solutions/{module}")
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m pipelab.course.student_copy DIR   (or: make student-copy DIR=...)", file=sys.stderr)
        return 2
    try:
        target = write(argv[0])
    except ValueError as error:
        print(f"student copy: {error}", file=sys.stderr)
        return 1
    n_files = sum(1 for p in target.rglob("*") if p.is_file())
    print(f"wrote a student copy of the course to {target} ({n_files} files): "
          f"cd {target} && make install && .venv/bin/pipelab grade")
    return 0


if __name__ == "__main__":
    sys.exit(main())
