"""``pipelab grade [task]``: run the graded-task tests on your code, and say where you stand.

    pipelab grade                      every task that has tests
    pipelab grade 1.1                  one task (``task1_1`` works too)
    pipelab grade --impl solutions     the reference answers instead of exercises/
    pipelab grade 1.2 -- -x            arguments after -- go to pytest
    pipelab grade --json               for an autograder: one JSON object, one entry per task

For the chosen tasks it runs pytest on tests/tasks in a subprocess and prints one line per
task: ✅ passed, ❌ failing (with its first failure), or ⏳ not started (every test still
meets the stub's NotImplementedError); with ``--json``, one JSON document instead (`report_json`:
per task its status, its first failure and the test that failed).  ``run_task_tests`` is also what
tests/test_grading.py uses to check solutions, stubs and mutants.

Details (the pytest command, timeouts and the watchdog, how outcomes travel back, what is
written where): docs/course.md, "pipelab grade".
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TASKS_DIR = ROOT / "tests" / "tasks"
DEFAULT_TIMEOUT_S = 60.0
PACKAGES = ("exercises", "solutions")


@dataclass
class TestOutcome:
    """One test's result.  status: passed, failed, not_implemented, timed_out, skipped, not_run."""

    nodeid: str
    task: str  # "1.1"
    status: str
    impl: str = ""  # what --impl ran: exercises, solutions, or a directory
    message: str = ""
    error_type: str = ""
    raised_in: str = ""  # "exercises/partition.py:52": the deepest frame of non-library code
    function: str = ""  # the function of that frame
    property: str = ""  # the contract line the failure breaks (the assertion's first line)
    example: str = ""  # hypothesis' failing example: "case=([0, 3, 1, 3], 3)"; "" if none
    caught_under_seeds: list[int] = field(default_factory=list)  # with --seeds (tests/tasks/conftest.py)


@dataclass
class TestRun:
    outcomes: list[TestOutcome] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # tests that could not even be collected
    output: str = ""  # the last pytest run's console output


# ---- tasks: names, titles, lessons ---------------------------------------------------


def task_id(text: str) -> str | None:
    """'1.1', 'task1_1', 'Task 1.1' -> '1.1'; None when it is not a task name."""
    match = re.fullmatch(r"(?:task)?\s*(\d+)[._](\d+)", text.strip(), flags=re.IGNORECASE)
    return f"{match[1]}.{match[2]}" if match else None


def marker(task: str) -> str:
    return "task" + task.replace(".", "_")


def tasks_with_tests() -> list[str]:
    """Tasks with a tests/tasks/test_task<N>_<M>.py file, in order."""
    found = (task_id(path.stem.removeprefix("test_")) for path in TASKS_DIR.glob("test_task*.py"))
    return sorted((t for t in found if t), key=lambda t: tuple(map(int, t.split("."))))


def task_titles() -> dict[str, tuple[str, str]]:
    """task -> (title, lesson number), read from the markers registered in pyproject.toml."""
    pyproject = ROOT / "pyproject.toml"
    text = pyproject.read_text(encoding="utf-8") if pyproject.is_file() else ""
    pattern = r"task(\d+)_(\d+): graded task [\d.]+, (.+?) \(lesson (\d+)\)"
    return {f"{a}.{b}": (title, lesson) for a, b, title, lesson in re.findall(pattern, text)}


def lesson_path(lesson: str) -> str:
    matches = sorted(ROOT.glob(f"lessons/{lesson}*"), key=lambda p: p.suffix != ".ipynb")
    return str(matches[0].relative_to(ROOT)) if matches else f"lesson {lesson} (lessons/{lesson}...)"


# ---- running the tests -------------------------------------------------------------


def run_task_tests(
    impl: str | list[str] = "exercises",
    tasks: list[str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pytest_args: tuple[str, ...] = (),
) -> TestRun:
    """Run tests/tasks (only ``tasks``, default all) against ``impl`` and collect outcomes.

    Several implementations run in one pytest process, each test once per implementation
    (TestOutcome.impl tells them apart; directories are given as resolved paths)."""
    choices = [impl] if isinstance(impl, str) else list(impl)
    impl = ",".join(c if c in PACKAGES else str(Path(c).resolve()) for c in choices)
    run, collected, outcomes = TestRun(), {}, {}
    selected = tasks
    while selected is None or selected:
        attempt = _run_pytest_once(impl, selected, timeout_s, pytest_args)
        run.errors += attempt["errors"]
        run.output = attempt["output"]
        collected = collected or attempt["collected"]
        outcomes.update(attempt["outcomes"])
        if attempt["hung"] is None:
            break
        hung, hung_impl = attempt["hung"]
        hung_task = attempt["collected"][hung]
        outcomes[hung] = TestOutcome(
            hung, hung_task, "timed_out", hung_impl,
            f"timed out: still running after {_hard_limit_s(timeout_s):.0f} s and stopped "
            "(probably an infinite loop)", property="returns in time (no infinite loop)",
        )
        unfinished = {t for nodeid, t in attempt["collected"].items() if nodeid not in outcomes}
        for nodeid, t in attempt["collected"].items():
            if t == hung_task and nodeid not in outcomes:
                outcomes[nodeid] = TestOutcome(nodeid, t, "skipped", message="not run: a test of this task hung")
        selected = sorted(unfinished - {hung_task})
    run.outcomes = [
        outcomes.get(nodeid) or TestOutcome(nodeid, t, "not_run", message="not run")
        for nodeid, t in collected.items()
    ]
    return run


def _hard_limit_s(timeout_s: float) -> float:
    return 1.5 * timeout_s + 2


def _run_pytest_once(impl, tasks, timeout_s, pytest_args) -> dict:
    with tempfile.TemporaryDirectory(prefix="pipelab-grade-") as tmp:
        record, log = Path(tmp) / "record.jsonl", Path(tmp) / "output.txt"
        command = [
            sys.executable, "-m", "pytest", *_test_paths(tasks), "--impl", impl,
            # Only the graded tests: no addopts from pyproject (nbval's options), and no
            # nbval plugin (2 s of imports), no cache; -q, --timeout and -m set here.
            "-o", "addopts=", "-p", "no:nbval", "-p", "no:cacheprovider",
            f"--timeout={timeout_s}", "-q", "--hypothesis-profile=pipelab-grade", *pytest_args,
        ]
        if tasks is not None:
            command += ["-m", " or ".join(marker(t) for t in tasks)]
        state = {"collected": {}, "outcomes": {}, "errors": [], "hung": None, "running": None}
        with open(log, "wb") as output:
            env = {
                **os.environ,
                "PIPELAB_GRADE_RECORD": str(record),
                # Nothing written into the checkout: hypothesis' database and caches in
                # this temporary folder, no __pycache__ next to the code under test.
                "HYPOTHESIS_STORAGE_DIRECTORY": str(Path(tmp) / "hypothesis"),
                "PYTHONDONTWRITEBYTECODE": "1",
            }
            process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT
            )
            offset = 0
            while process.poll() is None:
                time.sleep(0.1)
                offset = _read_events(record, offset, state)
                running = state["running"]
                if running and time.monotonic() - running[2] > _hard_limit_s(timeout_s):
                    process.kill()
                    process.wait()
                    state["hung"] = running[:2]
            _read_events(record, offset, state)
        state["output"] = log.read_text(encoding="utf-8", errors="replace")
        return state


def _test_paths(tasks: list[str] | None) -> list[str]:
    """tests/tasks, or only the named tasks' files (test_task1_1.py for 1.1), so that a run
    of task 1.1 does not import torch for the other tasks' tests."""
    files = [TASKS_DIR / f"test_{marker(task)}.py" for task in tasks or []]
    if tasks is None or not all(path.is_file() for path in files):
        return [str(TASKS_DIR.relative_to(ROOT))]
    return [str(path.relative_to(ROOT)) for path in files]


def _read_events(record: Path, offset: int, state: dict) -> int:
    if not record.exists():
        return offset
    with open(record, "rb") as stream:
        stream.seek(offset)
        data = stream.read()
    complete = data[: data.rfind(b"\n") + 1]
    for line in complete.decode("utf-8").splitlines():
        event = json.loads(line)
        kind = event.pop("event")
        if kind == "collected":
            state["collected"].update(event["tests"])
        elif kind == "collect_error":
            state["errors"].append(event["message"])
        elif kind == "start":
            state["running"] = (event["nodeid"], event["impl"], time.monotonic())
        else:
            task = state["collected"].get(event["nodeid"], "")
            state["outcomes"][event["nodeid"]] = TestOutcome(task=task, **event)
            state["running"] = None
    return offset + len(complete)


# ---- the report ----------------------------------------------------------------------


def task_status(outcomes: list[TestOutcome]) -> str:
    """passed | not_started | failing, for the outcomes of one task."""
    if outcomes and all(o.status == "passed" for o in outcomes):
        return "passed"
    if outcomes and all(o.status == "not_implemented" for o in outcomes):
        return "not_started"
    return "failing"


def format_report(run: TestRun, tasks: list[str], impl: str, seed: int | None = None) -> str:
    symbols = _symbols()
    titles = task_titles()
    lines = [f"pipelab grade: {impl if impl in PACKAGES else Path(impl)}", ""]
    n_passed = 0
    for task in tasks:
        outcomes = [o for o in run.outcomes if o.task == task]
        status = task_status(outcomes)
        title, lesson = titles.get(task, ("", ""))
        n_ok = sum(o.status == "passed" for o in outcomes)
        head = f"{symbols[status]} Task {task}  {title}"
        if status == "passed":
            n_passed += 1
            lines.append(f"{head}: passed ({n_ok} tests)")
            continue
        if status == "not_started":
            stubs = _stubs(outcomes)
            lines.append(f"{head}: not started")
            lines.append(f"      still raising NotImplementedError: {', '.join(stubs)}")
        else:
            lines.append(f"{head}: failing ({n_ok} of {len(outcomes)} tests pass)")
            lines += _first_failure(outcomes, impl, seed)
        if lesson:
            lines.append(f"      read:  {lesson_path(lesson)}")
    for error in run.errors:
        lines += ["", "the tests could not be loaded:", error]
    if not run.outcomes and not run.errors:
        lines += ["", "no test ran; pytest said:", run.output[-3000:]]
    lines += ["", f"{n_passed} of {len(tasks)} tasks pass."]
    if n_passed < len(tasks) and impl == "exercises":
        lines.append("Edit the file in exercises/, then run `pipelab grade <task>` again.")
    return "\n".join(lines)


def _first_failing(outcomes: list[TestOutcome]) -> TestOutcome | None:
    """The test a failing task is reported by: the first that failed or timed out, else the first not passed."""
    failing = [o for o in outcomes if o.status in ("failed", "timed_out")]
    failing = failing or [o for o in outcomes if o.status not in ("passed", "skipped")]
    return failing[0] if failing else None


def _rerun(first: TestOutcome, impl: str, seed: int | None) -> str:
    impl_option = "" if impl == "exercises" else f" --impl {impl}"
    seed_option = f" --hypothesis-seed={seed}" if seed is not None and first.example else ""
    return f'python -m pytest "{first.nodeid}"{impl_option}{seed_option}'


def _stubs(outcomes: list[TestOutcome]) -> list[str]:
    return sorted({f"{o.function}() in {o.raised_in.split(':')[0]}" for o in outcomes})


def report_json(run: TestRun, tasks: list[str], impl: str, seed: int | None = None) -> dict:
    """The report for an autograder (GitHub Classroom, Gradescope): per task one object,

        {"task": "1.1", "title": ..., "lesson": "lessons/01_splitting.ipynb",
         "status": "passed" | "failing" | "not_started", "tests": 12, "passed": 11,
         "still_raising": ["balanced_bounds() in exercises/partition.py"],   # not_started: the stubs left
         "first_failure": null | {"test": nodeid, "status": "failed" | "timed_out" | ..., "property": ...,
                                  "example": ..., "message": ..., "at": "exercises/partition.py:52",
                                  "function": ..., "rerun": "python -m pytest ..."}}

    in {"impl": ..., "hypothesis_seed": ..., "tasks": [...], "passed": k, "total": n, "errors": [...]}.
    """
    titles = task_titles()
    entries = []
    for task in tasks:
        outcomes = [o for o in run.outcomes if o.task == task]
        status = task_status(outcomes)
        title, lesson = titles.get(task, ("", ""))
        entry = {"task": task, "title": title, "lesson": lesson_path(lesson) if lesson else "", "status": status,
                 "tests": len(outcomes), "passed": sum(o.status == "passed" for o in outcomes),
                 "still_raising": _stubs(outcomes) if status == "not_started" else [], "first_failure": None}
        first = _first_failing(outcomes) if status == "failing" else None
        if first is not None:
            entry["first_failure"] = {"test": first.nodeid, "status": first.status, "property": first.property,
                                      "example": first.example, "message": first.message, "at": first.raised_in,
                                      "function": first.function, "rerun": _rerun(first, impl, seed)}
        entries.append(entry)
    return {"impl": impl if impl in PACKAGES else str(Path(impl)), "hypothesis_seed": seed, "tasks": entries,
            "passed": sum(e["status"] == "passed" for e in entries), "total": len(entries), "errors": run.errors}


def _first_failure(outcomes: list[TestOutcome], impl: str, seed: int | None = None) -> list[str]:
    """The first failing test: the property it checks, hypothesis' failing example, what
    happened, and the command that reruns it (with the same seed, so the same examples)."""
    first = _first_failing(outcomes)
    if first is None:
        return []
    lines = []
    if first.property:
        lines.append(f"      broken:  {first.property}")
    if first.example:
        lines.append(f"      failing example:  {first.example}")
    happened = first.message.removeprefix("AssertionError: ").splitlines()
    if happened and first.property and happened[0].strip() == first.property:
        happened = happened[1:]
    if first.property:  # cut pytest's rendering of the assert, from its "assert ..." line on
        asserts = (i for i, line in enumerate(happened) if line.startswith("assert "))
        happened = happened[: next(asserts, len(happened))]
    if happened:
        lines.append("      what happened:")
        lines += [f"        {line}" for line in textwrap.dedent("\n".join(happened)).splitlines()]
    where = f"  (at {first.raised_in}, in {first.function})" if first.raised_in else ""
    lines.append(f"      test:  {first.nodeid}{where}")
    not_run = sum(o.status in ("skipped", "not_run") for o in outcomes)
    if not_run:
        lines.append(f"      ({not_run} other test{'s were' if not_run > 1 else ' was'} not run)")
    lines.append(f"      rerun it:  {_rerun(first, impl, seed)}")
    return lines


def _symbols() -> dict[str, str]:
    fancy = {"passed": "✅", "failing": "❌", "not_started": "⏳"}
    try:
        "".join(fancy.values()).encode(sys.stdout.encoding or "ascii")
        return fancy
    except (UnicodeEncodeError, LookupError):
        return {"passed": "[ok]  ", "failing": "[FAIL]", "not_started": "[todo]"}


# ---- the command ---------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pipelab grade", description=__doc__.split("\n")[0])
    parser.add_argument("tasks", nargs="*", metavar="task", help="e.g. 1.1 (default: all)")
    parser.add_argument("--impl", default="exercises",
                        help="exercises (default), solutions, or a directory of modules")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds a test may run before it is stopped (default 60)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document for an autograder: per task its status, first failure and "
                             "the test that failed")
    argv = sys.argv[1:] if argv is None else list(argv)
    pytest_args = []
    if "--" in argv:  # pipelab grade 1.1 -- -x: what follows -- goes to pytest
        argv, pytest_args = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)

    if not TASKS_DIR.is_dir():
        print(f"pipelab grade: no graded tests at {TASKS_DIR}.\nThey come with the course, "
              "not with the installed package: run `pipelab grade` in a clone of the course "
              "repository (after `make install`).", file=sys.stderr)
        return 2
    if args.impl == "solutions" and not (ROOT / "solutions").is_dir():
        print("pipelab grade: this copy of the course has no solutions/ (a student copy): grade your exercises/ "
              "with `pipelab grade`", file=sys.stderr)
        return 2
    missing = [name for name in ("pytest", "pytest_timeout", "hypothesis")
               if importlib.util.find_spec(name) is None]
    if missing:
        print(f"pipelab grade needs {', '.join(missing)}: pip install -e '.[dev]'", file=sys.stderr)
        return 2
    valid = tasks_with_tests()
    tasks = list(dict.fromkeys(task_id(text) for text in args.tasks)) or valid
    unknown = [text for text in args.tasks if task_id(text) not in valid]
    if unknown:
        print(f"pipelab grade: unknown task {', '.join(unknown)}; tasks with tests: "
              f"{', '.join(valid)} (write them as 1.1 or task1_1)", file=sys.stderr)
        return 2

    seed = None  # hypothesis draws new examples each time; the report's rerun line reuses them
    if not any(arg.startswith("--hypothesis-seed") for arg in pytest_args):
        seed = random.SystemRandom().randrange(2**32)
        pytest_args = [f"--hypothesis-seed={seed}", *pytest_args]
    run = run_task_tests(args.impl, tasks, timeout_s=args.timeout, pytest_args=tuple(pytest_args))
    if args.json:
        print(json.dumps(report_json(run, tasks, args.impl, seed), indent=1, ensure_ascii=False))
    else:
        print(format_report(run, tasks, args.impl, seed))
    passed = all(task_status([o for o in run.outcomes if o.task == t]) == "passed" for t in tasks)
    return 0 if passed and not run.errors else 1


if __name__ == "__main__":
    sys.exit(main())
