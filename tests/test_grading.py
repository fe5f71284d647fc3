"""The graders are graded: tests of tests/tasks, exercises/, solutions/ and pipelab grade.

The plain ``python -m pytest`` does not collect tests/tasks (see tests/conftest.py).
These tests run it in subprocesses, through ``pipelab.course.grade.run_task_tests``, and check:

- on solutions/, every graded test passes;
- on the stubs of exercises/, every graded test fails with the NotImplementedError of
  its own task (a test that passes on a stub, or fails for another reason, is named);
- every mutant (a plausible wrong answer), tests/mutants/<task>/<name>.patch, fails at
  least one test of its task, for a reason other than an import error; at least three per
  task (a mutant named *_hangs is an infinite loop, stopped by a 2 s timeout).  A mutant is
  a small patch of its solution, its explanation before the diff; each is applied once
  per session to a copy of the solution, <tmp>/<task>/<name>/<module>.py, and that folder
  is graded as ``--impl`` (tests/mutant_patches.py; every patch must still apply);
- and it does so whatever hypothesis' seed: a test that draws nothing (no ``@given``)
  catches it under every seed, and each property test that catches it under the fixed
  profile is run again under 20 random seeds (one pytest process, no shrinking) and
  must catch it under each;
- grading writes nothing into the checkout (``pipelab grade`` run on a copy of it), and
  its report names the property that failed and hypothesis' failing example;
- exercises/ and solutions/ have the same functions (and methods of their classes),
  signatures and docstrings, the stubs are pristine, and the solutions' docstring
  examples hold;
- ``pipelab grade`` says ✅ on solutions; stops a test that hangs even where the
  timeout's signal is swallowed (by hypothesis), and still grades the other tasks.

Each task's tests run in one pytest subprocess against solutions, exercises and the
task's mutants at once (``--impl a,b,c`` parametrizes them), so torch is imported once
per task.  Tasks whose tests do not import torch share one subprocess (starting it costs
more than their tests), in which ``-k`` keeps each test file from meeting the other
tasks' mutants.  The subprocesses start together (as many at once as there are CPUs, at
most 4) when the first test needs one; the runs of tasks graded on several processes
(``pl.distributed.launch``, task 4.1) go first, as they take longest.

Once you work on exercises/ yourself, the stub checks are skipped (your work is graded
by ``pipelab grade``); with the environment variable CI set they always apply.

``python tests/test_grading.py [--seeds 20]`` prints the kill counts per task (minutes):
under the fixed profile, under each of 20 random seeds with every property test run
once per seed, and by the property tests alone.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import importlib.util
import inspect
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # python tests/test_grading.py: this checkout's pipelab, not an installed one
    sys.path.insert(0, str(ROOT))

from mutant_patches import Mutant, PatchError, all_mutants  # tests/ is on sys.path (pytest, or the script's folder)

from pipelab import grade

MUTANTS = all_mutants()  # tests/mutants/<task>/<name>.patch, named "task1_1/greedy"
MODULES = sorted(path.stem for path in (ROOT / "exercises").glob("*.py") if path.stem != "__init__")
TASKS = grade.tasks_with_tests()
META = ("--hypothesis-profile=pipelab-fixed",)  # registered in tests/tasks/conftest.py
SEEDS_PROFILE = "--hypothesis-profile=pipelab-seeds"
N_SEEDS = 20
LOAD_ERRORS = {"ImportError", "ModuleNotFoundError", "SyntaxError", "FileNotFoundError", "NotImplementedError"}


def mutant_name(mutant: Mutant) -> str:
    return mutant.name


def task_of(mutant: Mutant) -> str:
    return grade.task_id(mutant.task)


def hangs(mutant: Mutant) -> bool:
    """A mutant named *_hangs never returns: it runs alone, stopped by a 2 s timeout."""
    return mutant.short_name.endswith("_hangs")


def impl_name(impl: str) -> str:
    """What an outcome's ``impl`` names: "solutions", "exercises", or a mutant's name, from
    the folder it was written to (<tmp>/task1_1/greedy: "task1_1/greedy")."""
    return impl if impl in grade.PACKAGES else f"{Path(impl).parent.name}/{Path(impl).name}"


def materialize(mutants: list[Mutant], folder: Path) -> dict[Mutant, Path | PatchError]:
    """Each mutant's --impl directory, folder/<task>/<name>/ (its solution, patched), or
    the PatchError of a patch that no longer applies."""
    folders = {}
    for mutant in mutants:
        try:
            folders[mutant] = mutant.materialize(folder).resolve()
        except PatchError as error:
            folders[mutant] = error
    return folders


@pytest.fixture(scope="session")
def mutant_folders(tmp_path_factory) -> dict[Mutant, Path | PatchError]:
    """Every mutant written once per session, as <tmp>/<task>/<name>/<module>.py."""
    return materialize(MUTANTS, tmp_path_factory.mktemp("mutants"))


def folder_of(mutant_folders, mutant: Mutant) -> Path:
    """The mutant's --impl directory; the test fails with the PatchError if it has none."""
    folder = mutant_folders[mutant]
    if isinstance(folder, PatchError):
        pytest.fail(str(folder), pytrace=False)
    return folder


def task_test_source(task: str) -> str:
    return (ROOT / "tests" / "tasks" / f"test_{grade.marker(task)}.py").read_text(encoding="utf-8")


def run_of_task(task: str) -> str:
    """The run that holds a task's tests: its own when they import torch (those runs are
    the long ones, and go side by side), else the run shared by every such task."""
    source = task_test_source(task)
    return task if re.search(r"^(import|from) torch\b", source, flags=re.MULTILINE) else "without torch"


RUNS = {task: run_of_task(task) for task in TASKS}
# Runs whose tests start ranks (seconds per launch, one launch per implementation) take longest.
LAUNCHING_RUNS = {RUNS[task] for task in TASKS if "distributed.launch(" in task_test_source(task)}


def run_name(mutant: Mutant) -> str:
    """The run that holds a mutant: its task's run, or its own when it hangs."""
    return mutant_name(mutant) if hangs(mutant) else RUNS[task_of(mutant)]


@pytest.fixture(scope="module", autouse=True)
def runs(request, mutant_folders):
    """Future[TestRun] per task (solutions, exercises and the task's mutants in one pytest
    process) and per hanging mutant (alone, stopped at its first failure).  Autouse, so
    they start before this module's first test; but only the runs that the selected tests
    ask for (by a ``runs`` argument) are started.  A mutant whose patch does not apply is
    left out (its tests fail with the PatchError)."""
    folders = {mutant: str(folder) for mutant, folder in mutant_folders.items() if isinstance(folder, Path)}
    jobs = {}
    for name in dict.fromkeys(RUNS.values()):
        tasks = [task for task in TASKS if RUNS[task] == name]
        mutants = [folders[m] for m in MUTANTS if m in folders and task_of(m) in tasks and not hangs(m)]
        jobs[name] = dict(
            impl=["solutions", "exercises", *mutants], tasks=tasks, pytest_args=(*META, *own_mutants_only(tasks))
        )
    for mutant in filter(hangs, MUTANTS):
        if mutant in folders:
            jobs[mutant_name(mutant)] = dict(
                impl=folders[mutant], tasks=[task_of(mutant)], timeout_s=2.0, pytest_args=(*META, "-x")
            )
    needed = set()
    for item in request.session.items:
        if item.path != Path(__file__).resolve() or "runs" not in inspect.signature(item.obj).parameters:
            continue
        callspec = getattr(item, "callspec", None)
        mutant = callspec.params.get("mutant") if callspec else None
        needed |= {run_name(mutant)} if mutant else set(RUNS.values())
    pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 2))
    first = sorted(jobs, key=lambda name: name not in LAUNCHING_RUNS)  # stable: the rest in order
    yield {name: pool.submit(grade.run_task_tests, **jobs[name]) for name in first if name in needed}
    pool.shutdown(cancel_futures=True)


def own_mutants_only(tasks: list[str]) -> tuple[str, ...]:
    """-k for a run of several tasks, so that the tests of test_task1_1.py meet no mutant
    of another task: they would only fail to find their module, and slowly (tracebacks,
    hypothesis shrinking the error), for outcomes that ``outcomes_of`` leaves out anyway.
    A test's id ends with its implementation, e.g. ``[task2_1/last_stage_forgotten]``."""
    if len(tasks) < 2:
        return ()
    markers = [grade.marker(task) for task in tasks]
    clauses = [
        f"not (test_{mine}.py and ({' or '.join(f'{other}/' for other in markers if other != mine)}))"
        for mine in markers
    ]
    return ("-k", " and ".join(clauses))


def outcomes_of(runs, impl: str | Mutant) -> list[grade.TestOutcome]:
    """The outcomes of one implementation ("solutions", "exercises" or a mutant), over the
    runs that hold it (for a mutant, of its own task's tests only)."""
    mutant = impl if isinstance(impl, Mutant) else None
    names = [run_name(mutant)] if mutant else dict.fromkeys(RUNS.values())
    wanted = mutant.name if mutant else impl
    outcomes = []
    for name in names:
        run = runs[name].result()
        assert run.outcomes and not run.errors, "\n".join(run.errors) or run.output[-3000:]
        outcomes += [
            o for o in run.outcomes
            if impl_name(o.impl) == wanted and (not mutant or o.task == task_of(mutant))
        ]
    return outcomes


# ---- first, as it overlaps with the runs above: pipelab grade from end to end -------------


HANGS_ON_SOME_SIZES = """
from solutions.partition import balanced_bounds as right_answer


def balanced_bounds(costs, n_stages):
    while len(costs) in (6, 7) and n_stages == 2:  # cases that only the property test draws
        pass
    return right_answer(costs, n_stages)
"""


def test_grade_stops_a_hanging_test_and_grades_the_other_tasks(tmp_path, capsys):
    """The loop is reached inside a hypothesis test: hypothesis catches pytest-timeout's
    signal and retries the example, so the watchdog in pipelab.course.grade must kill the run and
    run the other tasks again."""
    (tmp_path / "partition.py").write_text(HANGS_ON_SOME_SIZES, encoding="utf-8")
    shutil.copy(ROOT / "exercises" / "microbatch.py", tmp_path)
    code = grade.main(["1.1", "1.2", "--impl", str(tmp_path), "--timeout", "4", "--", *META])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "still running after 8 s and stopped (probably an infinite loop)" in out, out
    passing, total = re.search(r"Task 1\.1 .*failing \((\d+) of (\d+) tests pass\)", out).groups()
    assert int(passing) == int(total) - 1, f"only the hanging test fails:\n{out}"
    assert "broken:  returns in time (no infinite loop)" in out, out
    assert any("Task 1.2" in line and "not started" in line for line in out.splitlines()), out
    assert "0 of 2 tasks pass." in out


WRONG_ONLY_FOR_A_TUPLE_OF_FIVE = """
from solutions.partition import balanced_bounds as right_answer


def balanced_bounds(costs, n_stages):
    if isinstance(costs, tuple) and len(costs) == 5:  # only an @example of the property test has it
        return [(0, 4), (4, 5)] if n_stages == 2 else right_answer(costs, n_stages)
    return right_answer(costs, n_stages)
"""


def test_grade_names_the_broken_property_and_the_failing_example(tmp_path, capsys):
    (tmp_path / "partition.py").write_text(WRONG_ONLY_FOR_A_TUPLE_OF_FIVE, encoding="utf-8")
    assert grade.main(["1.1", "--impl", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "broken:  balanced_bounds returns a split whose slowest stage is as fast as possible" in out, out
    assert "failing example:  costs=(4, 1, 1, 1, 1)" in out, out
    assert "test_bottleneck_is_the_smallest_possible" in out and "--hypothesis-seed=" in out, out


@pytest.mark.parametrize("message", ["ValueError: cannot assert shapes", "RuntimeError: device-side assert triggered"])
def test_first_failure_keeps_a_message_that_says_assert_mid_line(message):
    """Only a line that starts with "assert " is pytest's rendering of the assert; a
    learner's own error may say "assert" anywhere else, and is shown whole."""
    failed = grade.TestOutcome("tests/tasks/test_task1_1.py::test_x", "1.1", "failed", message=message, property="x")
    lines = grade._first_failure([failed], "exercises")
    assert f"        {message}" in lines, lines


def test_first_failure_cuts_pytests_rendering_of_the_assert():
    message = "AssertionError: x\n  got 3, expected 2\nassert 3 == 2\n +  where 3 = f()"
    failed = grade.TestOutcome("tests/tasks/test_task1_1.py::test_x", "1.1", "failed", message=message, property="x")
    lines = grade._first_failure([failed], "exercises")
    assert "        got 3, expected 2" in lines and not any("assert 3 == 2" in line for line in lines), lines


WRONG_ON_SEVEN_LAYERS_ON_TWO_STAGES = """
from solutions.partition import balanced_bounds as right_answer


def balanced_bounds(costs, n_stages):
    if len(costs) == 7 and n_stages == 2:  # no test or @example has it: hypothesis must draw it
        return [(0, 1), (1, 7)]
    return right_answer(costs, n_stages)
"""


def test_grading_writes_nothing_into_the_checkout(tmp_path):
    """pipelab grade on a copy of the course: a property test that fails on a drawn
    example (hypothesis saves it to its database, shrinks it, caches constants), the
    stubs of a torch task; not one file more afterwards."""
    copy = tmp_path / "course"
    skip = shutil.ignore_patterns("__pycache__", ".hypothesis", ".pytest_cache", "*.pyc")
    for name in ("pipelab", "exercises", "solutions", "tests/tasks"):
        shutil.copytree(ROOT / name, copy / name, ignore=skip)
    for name in ("pyproject.toml", "tests/conftest.py"):
        shutil.copy(ROOT / name, copy / name)
    impl = copy / "wrong"
    impl.mkdir()
    (impl / "partition.py").write_text(WRONG_ON_SEVEN_LAYERS_ON_TWO_STAGES, encoding="utf-8")
    shutil.copy(copy / "exercises/microbatch.py", impl)
    before = sorted(str(path.relative_to(copy)) for path in copy.rglob("*"))
    # -B: not the bytecode of pipelab itself, which any command of the package writes (and
    # .gitignore ignores); the grading subprocess must write none without being told.
    command = [sys.executable, "-B", "-m", "pipelab", "grade", "1.1", "1.2", "--impl", str(impl)]
    unset = ("HYPOTHESIS_STORAGE_DIRECTORY", "PYTHONDONTWRITEBYTECODE")  # as on a learner's machine
    env = {key: value for key, value in os.environ.items() if key not in unset}
    done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    assert "test_bottleneck_is_the_smallest_possible" in done.stdout and done.returncode == 1, (
        done.stdout + done.stderr
    )
    assert _grade_root(copy) == str(copy / "pipelab"), "the copy should grade with its own pipelab"
    after = sorted(str(path.relative_to(copy)) for path in copy.rglob("*"))
    assert after == before, f"grading wrote into the checkout: {sorted(set(after) - set(before))}"


def _grade_root(copy: Path) -> str:
    """Where pipelab.course.grade lives when imported in ``copy`` (the copy's own package)."""
    return subprocess.run(
        [sys.executable, "-c", "import pipelab.course.grade as g; print(g.ROOT / 'pipelab')"],
        cwd=copy, capture_output=True, text=True, timeout=60,
    ).stdout.strip()


# ---- solutions, stubs, mutants ---------------------------------------------------


def test_every_task_test_passes_on_the_solutions(runs):
    outcomes = outcomes_of(runs, "solutions")
    failing = [f"{o.nodeid}: {o.status}\n{o.message}" for o in outcomes if o.status != "passed"]
    assert not failing, "graded tests that fail on solutions/:\n" + "\n".join(failing)
    assert {o.task for o in outcomes} == set(TASKS), "each test file's tests need its task marker"


def test_every_task_test_fails_on_the_stubs_with_not_implemented_error(runs):
    skip_if_exercises_were_edited()
    outcomes = outcomes_of(runs, "exercises")
    wrong = [
        f"{o.nodeid}: {o.status} {o.error_type}: {o.message}"
        for o in outcomes
        if o.status != "not_implemented" or f"Task {o.task}" not in o.message
    ]
    assert not wrong, (
        "each graded test must fail on the stubs, with the NotImplementedError of its own "
        "task (so it cannot pass, or fail, before the learner writes code):\n" + "\n".join(wrong)
    )
    assert len(outcomes) == len(outcomes_of(runs, "solutions"))


@pytest.mark.parametrize("mutant", MUTANTS, ids=mutant_name)
def test_mutant_is_killed(runs, mutant_folders, mutant):
    folder_of(mutant_folders, mutant)  # its patch applies
    killers = [o for o in outcomes_of(runs, mutant) if o.status in ("failed", "timed_out")]
    assert killers, (
        f"mutant {mutant_name(mutant)} survived: every test of its task passes on it. "
        f"Add a test that catches it:\n{mutant.explanation()}"
    )
    first = killers[0]
    assert first.error_type not in LOAD_ERRORS, (
        f"mutant {mutant_name(mutant)} was killed by {first.error_type} in {first.nodeid}, "
        f"which says the mutant did not load, not that the tests caught it:\n{first.message}"
    )
    expected = "timed_out" if hangs(mutant) else "failed"  # timed out: pytest-timeout's signal
    assert first.status == expected, (
        f"mutant {mutant_name(mutant)}: {first.nodeid} {first.status}, expected {expected}"
    )


# ---- ... whatever the seed ------------------------------------------------------------


def property_tests(task: str) -> set[str]:
    """The names of a task's property tests: the functions under ``@given``."""
    return {
        node.name for node in ast.parse(task_test_source(task)).body
        if isinstance(node, ast.FunctionDef)
        and any(ast.unparse(decorator).startswith("given(") for decorator in node.decorator_list)
    }


def function_of(outcome: grade.TestOutcome) -> str:
    return outcome.nodeid.split("::")[1].split("[")[0]


def killers(runs, mutant: Mutant) -> set[str]:
    """The tests (function names) that caught the mutant under the fixed profile."""
    return {function_of(o) for o in outcomes_of(runs, mutant) if o.status in ("failed", "timed_out")}


@pytest.fixture(scope="module")
def seed_run(runs, mutant_folders, tmp_path_factory):
    """(seeds, {mutant: property tests}, TestRun): each mutant through the property tests
    that caught it under the fixed profile, once per seed, all in one pytest process."""
    seeds = sorted(random.SystemRandom().sample(range(2**32), N_SEEDS))
    rerun = {}
    for mutant in (m for m in MUTANTS if run_name(m) in runs and isinstance(mutant_folders[m], Path) and not hangs(m)):
        caught_by = killers(runs, mutant) & property_tests(task_of(mutant))
        if caught_by:
            rerun[mutant] = sorted(caught_by)
    if not rerun:
        return seeds, rerun, grade.TestRun()
    only = tmp_path_factory.mktemp("seeds") / "only.json"
    only.write_text(json.dumps({str(mutant_folders[m]): names for m, names in rerun.items()}), encoding="utf-8")
    run = grade.run_task_tests(
        [str(mutant_folders[m]) for m in rerun], sorted({task_of(m) for m in rerun}),
        pytest_args=(SEEDS_PROFILE, f"--seeds={','.join(map(str, seeds))}", f"--only={only}"),
    )
    assert run.outcomes and not run.errors, "\n".join(run.errors) or run.output[-3000:]
    return seeds, rerun, run


@pytest.mark.parametrize("mutant", MUTANTS, ids=mutant_name)
def test_mutant_is_killed_whatever_the_seed(runs, mutant_folders, seed_run, mutant):
    """Caught under every seed: by a test that draws nothing (no @given), whose outcome
    the seed cannot change; and by each property test that caught it under the fixed
    profile, run again under 20 random seeds (so their random part does not depend on
    luck either)."""
    folder_of(mutant_folders, mutant)  # its patch applies
    caught_by = killers(runs, mutant)
    assert caught_by, f"mutant {mutant_name(mutant)} was not caught at all"
    if hangs(mutant):
        assert caught_by - property_tests(task_of(mutant)), (
            f"mutant {mutant_name(mutant)} hangs, and only property tests ({sorted(caught_by)}) "
            "stop it: add a test without @given that reaches the loop"
        )
        return
    seeds, rerun, run = seed_run
    if mutant not in rerun:
        return  # caught only by tests that draw nothing: the seed cannot matter
    failed = {seed for o in run.outcomes if impl_name(o.impl) == mutant.name for seed in o.caught_under_seeds}
    survived = [seed for seed in seeds if seed not in failed]
    task_file = f"tests/tasks/test_{grade.marker(task_of(mutant))}.py"
    assert not survived, (
        f"mutant {mutant_name(mutant)}: the property tests {rerun[mutant]} caught it under the "
        f"fixed profile, not under the seeds {survived} (of {len(seeds)}): pin the case that "
        f"catches it with @example.  Rerun: python tests/mutant_patches.py /tmp/mutants "
        f"{mutant.name} && python -m pytest {task_file} --impl /tmp/mutants/{mutant.name} "
        f"{SEEDS_PROFILE} --seeds={survived[0]} -p no:cacheprovider"
    )


@pytest.mark.parametrize("task", TASKS)
def test_each_task_file_marks_all_its_tests(task):
    """The runs above select tests with -m taskX_Y: an unmarked test would never be checked."""
    path = ROOT / "tests" / "tasks" / f"test_{grade.marker(task)}.py"
    marks = [
        ast.unparse(node.value) for node in ast.parse(path.read_text(encoding="utf-8")).body
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "pytestmark"
    ]
    assert marks == [f"pytest.mark.{grade.marker(task)}"], (
        f"{path.name} must start with pytestmark = pytest.mark.{grade.marker(task)}"
    )


@pytest.mark.parametrize("task", TASKS)
def test_each_task_has_at_least_three_mutants(task):
    names = [mutant_name(mutant) for mutant in MUTANTS if mutant.task == grade.marker(task)]
    assert len(names) >= 3, (
        f"task {task} has {names}; add plausible wrong answers as tests/mutants/{grade.marker(task)}/<name>.patch"
    )


# ---- the mutants' patches -----------------------------------------------------------


@pytest.mark.parametrize("mutant", MUTANTS, ids=mutant_name)
def test_mutant_patch_applies(mutant_folders, mutant):
    """Each patch applies exactly to today's solution of its own task, changes it, and
    says what is wrong before its diff."""
    folder = folder_of(mutant_folders, mutant)
    solution = ROOT / "solutions" / f"{mutant.module}.py"
    solution_task = (ast.get_docstring(ast.parse(solution.read_text(encoding="utf-8"))) or "").split(":")[0]
    assert grade.task_id(solution_task) == task_of(mutant), (
        f"mutant {mutant_name(mutant)} patches solutions/{mutant.module}.py, a module of {solution_task}"
    )
    patched = (folder / f"{mutant.module}.py").read_text(encoding="utf-8")
    assert patched != solution.read_text(encoding="utf-8"), f"mutant {mutant_name(mutant)} changes nothing"
    compile(patched, f"{mutant_name(mutant)}/{mutant.module}.py", "exec")
    assert mutant.explanation(), f"mutant {mutant_name(mutant)}: say what is wrong before the diff"


def test_a_patch_that_no_longer_applies_names_the_mutant_and_the_hunk(tmp_path):
    """On a copy of the solutions: lines added above a hunk move it (it still applies, found
    by its lines); a line of a hunk changed under it fails with the mutant and the hunk."""
    mutant = max(MUTANTS, key=lambda m: (len(m.read().hunks), m.name))  # a patch of several hunks
    hunks = mutant.read().hunks
    solutions = tmp_path / "solutions"
    solutions.mkdir()
    copy = solutions / f"{mutant.module}.py"
    original = (ROOT / "solutions" / f"{mutant.module}.py").read_text(encoding="utf-8")

    copy.write_text("# a comment\n# and another\n" + original, encoding="utf-8")
    assert mutant.source(solutions) == "# a comment\n# and another\n" + mutant.source()

    last = "".join(hunks[-1].old)
    assert original.count(last) == 1
    copy.write_text(original.replace(last, last.replace("\n", "  # changed\n", 1)), encoding="utf-8")
    with pytest.raises(PatchError) as raised:
        mutant.materialize(tmp_path / "out", solutions)
    message = str(raised.value)
    assert f"mutant {mutant_name(mutant)}:" in message and f"hunk {len(hunks)} of {len(hunks)}" in message, message
    assert f"solutions/{mutant.module}.py" in message and "# changed" in message, message
    assert not (tmp_path / "out").exists(), "a patch that does not apply writes nothing"


# ---- exercises and solutions stay in step ---------------------------------------------


def public_functions(module) -> dict:
    """A module's public functions, and the public methods of the public classes it defines
    (as "Class.method"; a class it imports, such as torch's Tensor, is not its own)."""
    found = {}
    for name, value in vars(module).items():
        if name.startswith("_"):
            continue
        if inspect.isfunction(value):
            found[name] = value
        elif inspect.isclass(value) and value.__module__ == module.__name__:
            methods = {attr: getattr(value, attr) for attr in vars(value) if not attr.startswith("_")}
            found |= {f"{name}.{attr}": method for attr, method in methods.items() if inspect.isfunction(method)}
    return found


def test_exercises_and_solutions_have_the_same_modules():
    solution_modules = sorted(p.stem for p in (ROOT / "solutions").glob("*.py") if p.stem != "__init__")
    assert MODULES == solution_modules


@pytest.mark.parametrize("module_name", MODULES)
def test_same_signatures_and_docstrings(module_name):
    exercise = importlib.import_module(f"exercises.{module_name}")
    solution = importlib.import_module(f"solutions.{module_name}")
    exercise_functions, solution_functions = public_functions(exercise), public_functions(solution)
    assert exercise_functions.keys() == solution_functions.keys(), (
        f"{module_name}: public functions or methods differ (helpers of a solution start with _)"
    )
    for name, exercise_function in exercise_functions.items():
        solution_function = solution_functions[name]
        assert inspect.signature(exercise_function) == inspect.signature(solution_function), name
        assert inspect.getdoc(exercise_function) == inspect.getdoc(solution_function), (
            f"{module_name}.{name}: the docstrings of exercises/ and solutions/ differ"
        )


@pytest.mark.parametrize("mutant", MUTANTS, ids=mutant_name)
def test_mutants_keep_the_signatures(mutant_folders, mutant):
    (path,) = folder_of(mutant_folders, mutant).glob("*.py")
    spec = importlib.util.spec_from_file_location(f"_mutant_{mutant.task}_{mutant.short_name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    solution = importlib.import_module(f"solutions.{path.stem}")
    for name, function in public_functions(solution).items():
        found = module  # a function, or "Class.method"; any callable (an lru_cache wrapper, ...)
        for part in name.split("."):
            found = getattr(found, part, None)
        assert found is not None, f"mutant {mutant_name(mutant)} lacks {name}"
        assert inspect.signature(found) == inspect.signature(function), name


@pytest.mark.parametrize("module_name", MODULES)
def test_solution_docstring_examples_hold(module_name):
    solution = importlib.import_module(f"solutions.{module_name}")
    result = doctest.testmod(solution, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def stub_problems(module_name: str) -> list[str]:
    """Why exercises/<module_name>.py is not the pristine stub: '# TODO: Implement for
    Task X.Y.' then 'raise NotImplementedError("Task X.Y")' after each docstring (of a
    function; a public class's methods may have none), with X.Y the task named at the
    start of the module docstring."""
    source = (ROOT / "exercises" / f"{module_name}.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    task = (ast.get_docstring(tree) or "").removeprefix("Task ").split(":")[0]
    public = [(node.name, node, True) for node in tree.body if isinstance(node, ast.FunctionDef)]
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            public += [(f"{node.name}.{method.name}", method, False) for method in node.body
                       if isinstance(method, ast.FunctionDef)]
    problems = []
    for name, node, needs_docstring in public:
        if name.split(".")[-1].startswith("_"):
            continue
        indent = " " * (node.col_offset + 4)
        stub = f'# TODO: Implement for Task {task}.\n{indent}raise NotImplementedError("Task {task}")'
        has_docstring = ast.get_docstring(node) is not None
        body_is_docstring_and_raise = len(node.body) == 1 + has_docstring and (has_docstring or not needs_docstring)
        if not (body_is_docstring_and_raise and ast.get_source_segment(source, node).endswith(stub)):
            problems.append(f"exercises/{module_name}.py: {name} is not a stub of Task {task}")
    return problems


def skip_if_exercises_were_edited() -> None:
    problems = [problem for name in MODULES for problem in stub_problems(name)]
    if problems and not os.environ.get("CI"):
        pytest.skip("exercises/ holds your work (" + "; ".join(problems) + "): it is graded "
                    "by `pipelab grade`; the stub checks run on the course's own stubs")


@pytest.mark.parametrize("module_name", MODULES)
def test_exercises_are_stubs(module_name):
    skip_if_exercises_were_edited()
    assert not stub_problems(module_name)


# ---- collection and pipelab grade ---------------------------------------------------


def test_the_plain_run_does_not_collect_the_graded_tests(request):
    config = request.config
    asked = (
        config.getoption("impl") is not None
        or "task" in config.getoption("markexpr") + config.getoption("keyword")
        or any("tasks" in arg for arg in config.args)
    )
    tasks_dir = ROOT / "tests" / "tasks"
    collected = [item.nodeid for item in request.session.items if tasks_dir in item.path.parents]
    assert asked or not collected, "tests/tasks must only be collected when asked for"


@pytest.mark.parametrize(("text", "task"), [("1.1", "1.1"), ("task1_2", "1.2"), ("Task 1.3", "1.3"), ("x", None)])
def test_task_names(text, task):
    assert grade.task_id(text) == task


def test_grade_rejects_an_unknown_task(capsys):
    assert grade.main(["9.9"]) == 2
    assert "tasks with tests: " + ", ".join(TASKS) in capsys.readouterr().err


def test_grade_without_the_course_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(grade, "TASKS_DIR", tmp_path / "tests" / "tasks")
    assert grade.main([]) == 2
    assert "in a clone of the course" in capsys.readouterr().err


def test_grade_passes_the_solutions(runs, monkeypatch, capsys):
    """main's report and exit code on the solutions' outcomes from ``runs`` (main's own
    subprocess is covered by test_grade_stops_a_hanging_test_and_grades_the_other_tasks)."""
    calls = []

    def solutions_run(impl, tasks, **options):
        calls.append((impl, tasks))
        return grade.TestRun(outcomes=outcomes_of(runs, "solutions"))

    monkeypatch.setattr(grade, "run_task_tests", solutions_run)
    assert grade.main(["--impl", "solutions"]) == 0
    assert calls == [("solutions", TASKS)]
    out = capsys.readouterr().out
    assert f"{len(TASKS)} of {len(TASKS)} tasks pass." in out
    assert all(f"Task {task}" in out for task in TASKS)


# ---- the kill counts, by hand: python tests/test_grading.py [--seeds 20] --------------------


def kill_counts(n_seeds: int = N_SEEDS) -> str:
    """Per task: the mutants caught under the fixed profile, and under each of ``n_seeds``
    random seeds with every property test of the task run once per seed (no shortcut:
    what test_mutant_is_killed_whatever_the_seed skips is run here too).  The last
    columns count the mutants that the property tests alone catch under every seed, and
    name the others with the number of seeds under which they do."""
    seeds = sorted(random.SystemRandom().sample(range(2**32), n_seeds))
    lines = [
        f"seeds: {','.join(map(str, seeds))}", "",
        f"{'task':5} {'mutants':>7} {'fixed':>7} {f'{n_seeds} seeds':>9} {'property tests alone':>21}"
        "   (caught under k of the seeds by property tests alone)",
    ]
    totals = [0, 0, 0, 0]
    with tempfile.TemporaryDirectory(prefix="pipelab-mutants-") as folder:
        folders = materialize(MUTANTS, Path(folder))
        broken = [str(error) for error in folders.values() if isinstance(error, PatchError)]
        if broken:
            raise SystemExit("\n".join(broken))
        for task in TASKS:
            mutants = [mutant for mutant in MUTANTS if task_of(mutant) == task]
            others = [mutant for mutant in mutants if not hangs(mutant)]
            fixed = grade.run_task_tests([str(folders[m]) for m in others], [task], pytest_args=META)
            for mutant in filter(hangs, mutants):
                fixed.outcomes += grade.run_task_tests(
                    str(folders[mutant]), [task], timeout_s=2.0, pytest_args=(*META, "-x")
                ).outcomes
            seeded = grade.run_task_tests(
                [str(folders[m]) for m in others], [task],
                pytest_args=(SEEDS_PROFILE, f"--seeds={','.join(map(str, seeds))}"),
            ) if others and property_tests(task) else grade.TestRun()
            counts, weak = [len(mutants), 0, 0, 0], []
            for mutant in mutants:
                caught_by = {function_of(o) for o in fixed.outcomes
                             if impl_name(o.impl) == mutant.name and o.status in ("failed", "timed_out")}
                failed_seeds = {seed for o in seeded.outcomes if impl_name(o.impl) == mutant.name
                                for seed in o.caught_under_seeds}
                by_properties = failed_seeds >= set(seeds)
                counts[1] += bool(caught_by)
                if not caught_by:
                    statuses = sorted({o.status for o in fixed.outcomes if impl_name(o.impl) == mutant.name})
                    weak.append(f"{mutant.short_name} NOT CAUGHT ({', '.join(statuses) or 'no outcome'})")
                counts[2] += bool(caught_by - property_tests(task)) or by_properties
                counts[3] += by_properties
                if not by_properties and not hangs(mutant):
                    weak.append(f"{mutant.short_name} {len(failed_seeds)}/{n_seeds}")
            totals = [total + count for total, count in zip(totals, counts)]
            n = counts[0]
            lines.append(f"{task:5} {n:>7} {counts[1]:>4}/{n:<2} {counts[2]:>6}/{n:<2} {counts[3]:>18}/{n:<2}"
                         f"   {', '.join(weak)}")
    n = totals[0]
    lines.append(f"{'all':5} {n:>7} {totals[1]:>4}/{n:<2} {totals[2]:>6}/{n:<2} {totals[3]:>18}/{n:<2}")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    description = "Kill counts of the mutants (tests/mutants/*/*.patch): " + kill_counts.__doc__.split("\n")[0]
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seeds", type=int, default=N_SEEDS, help=f"random seeds (default {N_SEEDS})")
    print(kill_counts(parser.parse_args().seeds))
