"""Hypothesis settings of the graded tests, and the record of each outcome for ``pipelab grade``.

**Where hypothesis writes.**  Hypothesis keeps an example database and a cache of the
constants it finds in the code under test, by default in ``.hypothesis/`` in the
current folder.  Grading writes nothing into the checkout: unless
HYPOTHESIS_STORAGE_DIRECTORY names a folder (``pipelab grade`` sets it to its own
temporary one), this conftest points hypothesis at a temporary folder, removed at the end
of the run.

**Profiles** (``--hypothesis-profile``; tests set only max_examples and deadline):

    pipelab-grade   the default here: random examples, no explain phase (it costs
                    seconds per failing property and says little more than the example)
    pipelab-fixed   the same examples every run, no database (tests/test_grading.py)
    pipelab-seeds   no database, no shrinking: the first failing example is enough when
                    all that counts is whether a wrong answer is caught (with --seeds)

**Seeds.**  ``--seeds 3,17,...`` runs every property test (``@given``) once per seed,
with hypothesis' random generator seeded as ``--hypothesis-seed=17`` seeds a whole run,
and deselects the other tests; the record of each says under which seeds it failed
(``caught_under_seeds``).  ``--only FILE``
keeps only the tests named in FILE, a JSON object {implementation: [test function
names]}.  tests/test_grading.py uses both to show that each mutant is caught whatever
the seed.  Both options need a path under tests/tasks on the command line (they are
defined here).

**Assertion messages** start with the line of the contract they check, in the words of
the docstring ("returns a list of int (got float)"); ``pipelab grade`` shows that line as
the property that failed, with hypothesis' failing example.

**The record** is active only when the environment variable PIPELAB_GRADE_RECORD names a
file, which ``pipelab.course.grade.run_task_tests`` sets for the pytest subprocess it starts.
One JSON object per line:

    {"event": "collected", "tests": {nodeid: "1.1", ...}}     after collection
    {"event": "start", "nodeid": ..., "impl": ...}             as each test starts
    {"event": "result", "nodeid": ..., "status": ..., ...}     fields of grade.TestOutcome
                                                               (impl: --impl's choice, or the
                                                               one of a parametrized run)
    {"event": "collect_error", "message": ...}                 a test file did not load

status is passed, failed, not_implemented (every exception a NotImplementedError),
timed_out (pytest-timeout stopped it; the task's remaining tests on the same
implementation are then skipped, as they would most likely hang too) or skipped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import Phase, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.configuration import set_hypothesis_home_dir

RECORD = os.environ.get("PIPELAB_GRADE_RECORD")
ROOT = Path(__file__).resolve().parents[2]
_timed_out: set[tuple[str, str]] = set()  # (task, impl) pairs

NO_EXPLAIN = tuple(phase for phase in Phase if phase is not Phase.explain)
settings.register_profile("pipelab-grade", phases=NO_EXPLAIN)
settings.register_profile("pipelab-fixed", derandomize=True, database=None, phases=NO_EXPLAIN)
settings.register_profile(
    "pipelab-seeds", derandomize=False, database=None, phases=(Phase.explicit, Phase.generate),
    report_multiple_bugs=False,
)
_storage: list[str] = []  # the temporary hypothesis folder of this run, if this conftest made it


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--seeds", default=None,
                     help="comma-separated hypothesis seeds: run each property test once per seed "
                     "(and no other test)")
    parser.addoption("--only", default=None,
                     help="JSON file {implementation: [test names]}: run only those tests")


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        _storage.append(tempfile.mkdtemp(prefix="pipelab-hypothesis-"))
        set_hypothesis_home_dir(_storage[0])
    if not config.getoption("hypothesis_profile", None):
        settings.load_profile("pipelab-grade")


def pytest_unconfigure(config: pytest.Config) -> None:
    for folder in _storage:
        shutil.rmtree(folder, ignore_errors=True)


def _seeds(config: pytest.Config) -> list[int]:
    text = config.getoption("seeds")
    return [int(seed) for seed in text.split(",")] if text else []


def _is_property_test(function) -> bool:
    return bool(getattr(function, "is_hypothesis_test", False))


_CAUGHT_UNDER = pytest.StashKey[list]()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    """With --seeds, a property test runs once per seed inside its one test item (cheaper
    than an item per seed); the item fails if any seed fails, and its record lists the
    seeds that failed (``caught_under_seeds``)."""
    seeds = _seeds(pyfuncitem.config)
    test = pyfuncitem.obj
    if not seeds or not _is_property_test(test):
        return None
    arguments = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    caught = pyfuncitem.stash[_CAUGHT_UNDER] = []
    try:
        for seed in seeds:
            hypothesis_seed(seed)(test)  # hypothesis' generator seeded as --hypothesis-seed does
            try:
                test(**arguments)
            except Exception:  # noqa: BLE001  (any failure catches the answer; a timeout is no Exception)
                caught.append(seed)
    finally:
        test._hypothesis_internal_use_seed = None
    if caught:
        pytest.fail(f"failed under {len(caught)} of {len(seeds)} seeds", pytrace=False)
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep = None
    if config.getoption("only"):
        wanted = json.loads(Path(config.getoption("only")).read_text(encoding="utf-8"))
        keep = {(_impl_key(impl), name) for impl, names in wanted.items() for name in names}
    selected, deselected = [], []
    for item in items:
        wanted_here = keep is None or (_impl_key(_impl_of(item)), item.originalname) in keep
        seeded = not _seeds(config) or _is_property_test(getattr(item, "obj", None))
        (selected if wanted_here and seeded else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


def _impl_key(choice: str) -> str:
    return choice if choice in ("exercises", "solutions") else str(Path(choice).resolve())


def _record(**event) -> None:
    if RECORD:
        with open(RECORD, "a", encoding="utf-8") as stream:
            stream.write(json.dumps(event) + "\n")


def _task_of(item: pytest.Item) -> str:
    """'1.1' for a test marked task1_1."""
    for mark in item.iter_markers():
        match = re.fullmatch(r"task(\d+)_(\d+)", mark.name)
        if match:
            return f"{match[1]}.{match[2]}"
    return ""


def _impl_of(item: pytest.Item) -> str:
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "impl" in callspec.params:
        return callspec.params["impl"]
    return item.config.getoption("impl") or "exercises"


def pytest_collection_finish(session: pytest.Session) -> None:
    _record(event="collected", tests={item.nodeid: _task_of(item) for item in session.items})


def pytest_runtest_protocol(item: pytest.Item, nextitem) -> None:
    _record(event="start", nodeid=item.nodeid, impl=_impl_of(item))


def pytest_runtest_setup(item: pytest.Item) -> None:
    if RECORD and (_task_of(item), _impl_of(item)) in _timed_out:
        pytest.skip(f"not run: a test of task {_task_of(item)} timed out")


def pytest_exception_interact(node, call, report) -> None:
    if not isinstance(node, pytest.Item):
        _record(event="collect_error", message=str(report.longrepr)[-3000:])
        return
    excinfo = call.excinfo
    text = excinfo.exconly()
    if _any_exception(excinfo.value, lambda e: "from pytest-timeout" in str(e)):
        status = "timed_out"
        text = f"timed out after {node.config.getoption('timeout'):g} s (probably an infinite loop)"
        _timed_out.add((_task_of(node), _impl_of(node)))
    elif _all_exceptions(excinfo.value, lambda e: isinstance(e, NotImplementedError)):
        status = "not_implemented"
    else:
        status = "failed"
    raised_in, function = _deepest_code_frame(excinfo.traceback)
    broken = "returns in time (no infinite loop)" if status == "timed_out" else _property(node, excinfo.value)
    _record(event="result", nodeid=node.nodeid, impl=_impl_of(node), status=status,
            message=_short(text), error_type=excinfo.typename, raised_in=raised_in,
            function=function, property=broken, example=_failing_example(excinfo.value),
            caught_under_seeds=node.stash.get(_CAUGHT_UNDER, []))


def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> None:
    if call.excinfo is None and call.when == "call":
        _record(event="result", nodeid=item.nodeid, impl=_impl_of(item), status="passed",
                caught_under_seeds=item.stash.get(_CAUGHT_UNDER, []))
    elif call.excinfo is not None and call.excinfo.errisinstance(pytest.skip.Exception):
        reason = str(call.excinfo.value)
        _record(event="result", nodeid=item.nodeid, impl=_impl_of(item), status="skipped",
                message=reason)


def _deepest_code_frame(traceback) -> tuple[str, str]:
    """('exercises/partition.py:52', 'balanced_bounds'): the deepest frame outside Python
    and installed packages, so in the code under test or in the test itself."""
    libraries = {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}
    for entry in reversed(traceback):
        path = Path(str(entry.path)).resolve()
        if libraries.isdisjoint(path.parents) and "site-packages" not in path.parts:
            shown = path.relative_to(ROOT) if ROOT in path.parents else path
            return f"{shown}:{entry.lineno + 1}", entry.name
    return "", ""


def _leaf_exceptions(error: BaseException) -> list[BaseException]:
    """The exceptions inside ``error``: hypothesis may raise an ExceptionGroup (or a
    FlakyFailure group, when a timeout hit one run of an example but not another)."""
    group = getattr(error, "exceptions", None)
    return [leaf for inner in group for leaf in _leaf_exceptions(inner)] if group else [error]


def _any_exception(error: BaseException, predicate) -> bool:
    return any(predicate(leaf) for leaf in _leaf_exceptions(error))


def _all_exceptions(error: BaseException, predicate) -> bool:
    return all(predicate(leaf) for leaf in _leaf_exceptions(error))


def _short(text: str, max_lines: int = 5, max_chars: int = 600) -> str:
    """The message and the failing assert, without pytest's introspection ('+ where ...')."""
    lines = []
    for line in text.splitlines():
        if line.strip().startswith(("+", "Use -v")):
            break
        if line.strip():
            lines.append(line)
    return "\n".join(lines[:max_lines])[:max_chars]


def _property(item: pytest.Item, error: BaseException) -> str:
    """The contract line a failure breaks: the first line of the failing assertion's
    message (they start with it), else what the test's name says it checks."""
    for leaf in _leaf_exceptions(error):
        if isinstance(leaf, (AssertionError, pytest.fail.Exception)) and str(leaf).strip():
            first = str(leaf).strip().splitlines()[0]
            if not first.startswith("assert "):  # a bare assert has no message
                return first.removeprefix("AssertionError: ")
    name = getattr(item, "originalname", item.name).removeprefix("test_")
    return name.replace("_", " ")


def _failing_example(error: BaseException) -> str:
    """Hypothesis' failing example, as the test's arguments other than ``impl``:
    'case=([0, 3, 1, 3], 3)'; '' when the test is not a property test."""
    for leaf in _leaf_exceptions(error):
        for note in getattr(leaf, "__notes__", []):
            if re.match(r"(Falsifying|Failing)( explicit)? (example|test case):", note):
                lines = [line.strip().rstrip(",") for line in note.splitlines()[1:-1]]
                return ", ".join(line for line in lines if line and not line.startswith("impl="))
    return ""
