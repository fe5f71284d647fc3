"""Records each graded test's outcome for ``pipelab grade`` (pipelab/grade.py).

Active only when the environment variable PIPELAB_GRADE_RECORD names a file, which
``pipelab.grade.run_task_tests`` sets for the pytest subprocess it starts.  One JSON
object per line:

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
import sys
from pathlib import Path

import pytest

RECORD = os.environ.get("PIPELAB_GRADE_RECORD")
ROOT = Path(__file__).resolve().parents[2]
_timed_out: set[tuple[str, str]] = set()  # (task, impl) pairs


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
    _record(event="result", nodeid=node.nodeid, impl=_impl_of(node), status=status,
            message=_short(text), error_type=excinfo.typename, raised_in=raised_in,
            function=function)


def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> None:
    if call.excinfo is None and call.when == "call":
        _record(event="result", nodeid=item.nodeid, impl=_impl_of(item), status="passed")
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
