"""Shared test set-up: how graded-task tests reach the code they grade.

The graded tests live in ``tests/tasks/`` (one file per task, each test marked
``task1_1``, ``task1_2``, ...).  They reach the code under test only through the ``impl``
fixture, never through ``pipelab``: ``impl("partition")`` is the ``partition`` module of
the implementation chosen with ``--impl``:

    --impl exercises    your code in exercises/ (the default)
    --impl solutions    the reference answers in solutions/
    --impl DIRECTORY    a directory of replacement modules (a mutant: <folder>/<task>/<name>/,
                        written by tests/mutant_patches.py from tests/mutants/<task>/<name>.patch)
    --impl A,B,...      several: each graded test runs once per implementation, with the
                        implementation's name in its id (tests/test_grading.py does this
                        to pay for importing torch once per task, not once per mutant)

When are the graded tests collected?  Only when you ask for them, so that the plain
``python -m pytest`` (``make test``) stays green while exercises/ still holds stubs:

    python -m pytest -m task1_1                  grades your task 1.1 (exercises/)
    python -m pytest tests/tasks                 grades all your tasks
    python -m pytest tests/tasks --impl solutions
    pipelab grade [1.1]                          the same, as a report with hints

They are asked for when ``--impl`` is given, when ``-m`` or ``-k`` mentions a task, or
when a path under ``tests/tasks`` is on the command line.  Otherwise (the plain run)
``tests/tasks`` is skipped, and ``tests/test_grading.py`` grades them instead, in
subprocesses: every test passes on solutions/, fails with NotImplementedError on the
stubs of exercises/, and kills every mutant (``tests/mutants/<task>/<name>.patch``).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
TASKS_DIR = ROOT / "tests" / "tasks"
PACKAGES = ("exercises", "solutions")

if str(ROOT) not in sys.path:  # so `import exercises` works under the bare `pytest` too
    sys.path.insert(0, str(ROOT))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--impl",
        default=None,
        help="code the graded tests in tests/tasks run against: exercises (default), "
        "solutions, or a directory of replacement modules",
    )


def impl_choices(config: pytest.Config) -> list[str]:
    """The implementations named by --impl; ["exercises"] when it is not given."""
    return (config.getoption("impl") or "exercises").split(",")


def impl_label(choice: str) -> str:
    """Short name for test ids: 'solutions', 'task1_2/torch_chunk' (a mutant's directory,
    <folder>/task1_2/torch_chunk), or the directory name."""
    path = Path(choice).resolve()
    return f"{path.parent.name}/{path.name}" if re.fullmatch(r"task\d+_\d+", path.parent.name) else path.name


def pytest_configure(config: pytest.Config) -> None:
    for choice in impl_choices(config):
        if choice not in PACKAGES and not _as_directory(config, choice).is_dir():
            raise pytest.UsageError(
                f"--impl {choice!r}: expected 'exercises', 'solutions' or a directory of modules"
            )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    choices = impl_choices(metafunc.config)
    if "impl" in metafunc.fixturenames and len(choices) > 1:
        ids = [impl_label(choice) for choice in choices]
        metafunc.parametrize("impl", choices, ids=ids, indirect=True, scope="session")


def grading_requested(config: pytest.Config) -> bool:
    """True when the command line asks for the graded tests (see the module docstring)."""
    if config.getoption("impl") is not None:
        return True
    if "task" in config.getoption("markexpr", "") or "task" in config.getoption("keyword", ""):
        return True
    for arg in config.args:
        path = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        if path == TASKS_DIR or TASKS_DIR in path.parents:
            return True
    return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path == TASKS_DIR and not grading_requested(config):
        config.stash[_TASKS_SKIPPED] = True
        return True
    return None


_TASKS_SKIPPED = pytest.StashKey[bool]()


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if config.stash.get(_TASKS_SKIPPED, False):
        terminalreporter.write_line(
            "graded tasks (tests/tasks) not run here: tests/test_grading.py checks them "
            "against solutions/; grade your own code with `pipelab grade` or "
            "`python -m pytest -m task1_1`."
        )


@pytest.fixture(scope="session")
def impl(request: pytest.FixtureRequest):
    """``impl(module_name)`` -> that module of the implementation chosen by ``--impl``."""
    choice = getattr(request, "param", None) or impl_choices(request.config)[0]

    def load(module_name: str) -> ModuleType:
        if choice in PACKAGES:
            return importlib.import_module(f"{choice}.{module_name}")
        return _load_from_directory(_as_directory(request.config, choice), module_name)

    return load


def _as_directory(config: pytest.Config, choice: str) -> Path:
    return (config.invocation_params.dir / choice).resolve()


def _load_from_directory(directory: Path, module_name: str) -> ModuleType:
    path = directory / f"{module_name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"--impl {directory}: there is no {module_name}.py in it")
    unique_name = f"_impl_{abs(hash(str(directory)))}_{module_name}"
    if unique_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(unique_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[unique_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[unique_name]  # so the next test shows the same error again
            raise
    return sys.modules[unique_name]


@pytest.fixture
def one_torch_thread():
    """Tiny models run faster on one thread (and far faster when other work shares the cores)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- for the figure tests (test_figures_fit.py, test_hybrid_lesson.py): every text drawn, to find one off its figure
@pytest.fixture
def drawn_texts(monkeypatch):
    """A list that fills with (text, window extent) of every text drawn from now on."""
    import matplotlib.text  # here, not at the top: the graders' runs of this conftest need no matplotlib

    drawn = []
    original = matplotlib.text.Text.draw

    def draw_and_record(self, renderer):
        original(self, renderer)
        if self.get_visible() and self.get_text().strip():
            drawn.append((self.get_text(), self.get_window_extent(renderer)))

    monkeypatch.setattr(matplotlib.text.Text, "draw", draw_and_record)
    return drawn
