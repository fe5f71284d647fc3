"""The release for instructors (pipelab/course/student_copy.py, `pipelab grade --json`): a student copy holds no
reference answer's code and none of the graders' own tests; in it `pipelab grade` reports every task "not
started", and a task solved there passes."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipelab.course import grade, student_copy

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    return student_copy.write(tmp_path_factory.mktemp("release") / "course")


def _files(folder: Path) -> dict[str, Path]:
    return {str(p.relative_to(folder)): p for p in folder.rglob("*") if p.is_file()}


def test_the_copy_has_the_course_without_the_answers_or_the_graders_own_tests(copy):
    files = _files(copy)
    assert not (copy / "solutions").exists() and not (copy / "tests" / "mutants").exists()
    assert sorted(p.name for p in (copy / "tests").iterdir()) == ["conftest.py", "tasks"]
    for folder in ("lessons", "exercises", "tests/tasks"):
        ours = {name for name in _files(ROOT / folder) if "__pycache__" not in name}
        assert {name for name in _files(copy / folder)} == ours
    assert all((copy / "exercises" / name).read_bytes() == (ROOT / "exercises" / name).read_bytes()
               for name in _files(copy / "exercises"))
    assert {"README.md", "Makefile", "pyproject.toml", "pipelab/__init__.py"} <= set(files)
    readme = (copy / "README.md").read_text(encoding="utf-8")
    assert "Student copy" in readme and "<!--" not in readme
    assert "--impl solutions" not in readme and "tests/mutants" not in readme and "## Graded tasks" in readme


def test_no_reference_answers_code_is_in_the_copy(copy):
    solutions = {p.read_text(encoding="utf-8") for p in (ROOT / "solutions").glob("*.py") if p.stat().st_size > 100}
    for name, path in _files(copy).items():
        text = path.read_text(encoding="utf-8", errors="replace")
        assert text not in solutions, f"{name} is a reference answer"
    assert student_copy.answers_in(copy) == []


def test_the_check_finds_an_answer_planted_anywhere(tmp_path):
    planted = tmp_path / "planted"
    shutil.copytree(ROOT / "exercises", planted / "exercises")
    shutil.copy(ROOT / "solutions" / "gpipe.py", planted / "exercises" / "gpipe.py")  # a task solved
    lines = (ROOT / "solutions" / "one_f_one_b.py").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("def one_f_one_b_schedule"))
    body = [line for line in lines[start:] if line.strip() and not line.strip().startswith(('"', "#"))][-6:]
    (planted / "notes.md").write_text("A hint:\n\n" + "\n".join(body) + "\n", encoding="utf-8")  # pasted in prose
    found = student_copy.answers_in(planted)
    assert any(f.startswith("exercises/gpipe.py: solutions/gpipe.py's gpipe_schedule()") for f in found), found
    assert any(f.startswith("notes.md:") and "solutions/one_f_one_b.py" in f for f in found), found


def test_write_refuses_a_copy_that_would_carry_an_answer(tmp_path):
    course = tmp_path / "course"  # not a git checkout: the files are found by walking
    for folder in ("exercises", "solutions"):
        shutil.copytree(ROOT / folder, course / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(course / "solutions" / "partition.py", course / "exercises" / "partition.py")  # solved in place
    with pytest.raises(ValueError, match=r"exercises/partition.py: solutions/partition.py's balanced_bounds\(\)"):
        student_copy.write(tmp_path / "out", root=course)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="inside the course"):
        student_copy.write(course / "copy", root=course)


def test_the_readme_keeps_its_instructors_paragraphs_apart():
    text = "# T\n\nintro\n\nA.\n\n<!-- instructors -->\nsecret\n\n<!-- /instructors -->\n\n## Next\n"
    assert student_copy.student_readme(text) == f"# T\n\n{student_copy.NOTE}intro\n\nA.\n\n## Next\n"
    with pytest.raises(ValueError, match="without"):
        student_copy.student_readme("# T\n\n<!-- instructors -->\nno end\n")


def _grade(course: Path, *args: str) -> tuple[int, dict]:
    env = {**os.environ, "PYTHONPATH": str(course)}
    done = subprocess.run([sys.executable, "-m", "pipelab", "grade", "--json", *args], cwd=course, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.stdout.strip(), done.stderr[-3000:]
    return done.returncode, json.loads(done.stdout)


@pytest.mark.slow
def test_in_the_copy_every_task_starts_not_started_and_a_solved_task_passes(tmp_path):
    course = student_copy.write(tmp_path / "course")
    code, report = _grade(course)
    assert code == 1 and report["errors"] == [] and report["passed"] == 0
    assert [t["task"] for t in report["tasks"]] == grade.tasks_with_tests()
    assert {t["status"] for t in report["tasks"]} == {"not_started"}
    assert all(t["still_raising"] and t["first_failure"] is None for t in report["tasks"])

    shutil.copy(ROOT / "solutions" / "partition.py", course / "exercises" / "partition.py")  # a student solves 1.1
    code, report = _grade(course, "1.1")
    (task,) = report["tasks"]
    assert code == 0 and task["status"] == "passed" and task["passed"] == task["tests"] > 0
    done = subprocess.run([sys.executable, "-m", "pipelab", "grade", "--impl", "solutions"], cwd=course,
                          env={**os.environ, "PYTHONPATH": str(course)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no solutions/" in done.stderr
