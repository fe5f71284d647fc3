"""The package's architecture, enforced: import-linter's contracts in pyproject.toml.

The layers run from the entry points down to the schedule IR (docs/architecture.md); the
engine never imports the course, the pictures, matplotlib or ipywidgets; and no modules or
subpackages import each other in a circle (import-linter counts an import inside a function
too, so a lazy import cannot hide a cycle).  The contracts are shown failing once each, on a
copy of the package with a planted import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: import-linter brings tomli
    import tomli as tomllib

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pipelab"
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(where: Path) -> subprocess.CompletedProcess:
    """`lint-imports` on the `pipelab` found in `where`, with the project's contracts."""
    env = {**os.environ, "PYTHONPATH": str(where)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", str(ROOT / "pyproject.toml")],
                          cwd=where, env=env, capture_output=True, text=True, timeout=120)


def test_the_contracts_are_kept():
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"Contracts: {len(CONFIG['contracts'])} kept, 0 broken." in done.stdout, done.stdout


@pytest.fixture
def copy_of_the_package(tmp_path) -> Path:
    shutil.copytree(PACKAGE, tmp_path / "pipelab", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def plant(root: Path, module: str, line: str) -> None:
    path = root / "pipelab" / module
    path.write_text(path.read_text(encoding="utf-8") + f"\n{line}  # planted by the test\n", encoding="utf-8")


def broken(done: subprocess.CompletedProcess) -> list[str]:
    """The names of the contracts `lint-imports` reports broken."""
    return [contract["name"] for contract in CONFIG["contracts"] if f"{contract['name']} BROKEN" in
            " ".join(done.stdout.split())]


def test_a_planted_upward_import_breaks_the_layers_and_makes_a_cycle(copy_of_the_package):
    """The schedule IR importing the engine: a layer imports one above it, and since the engine
    imports the IR, the two subpackages now import each other."""
    plant(copy_of_the_package, "schedules/action.py", "from ..runtime import local")
    done = lint_imports(copy_of_the_package)
    assert done.returncode != 0, done.stdout
    assert broken(done) == [CONFIG["contracts"][0]["name"], CONFIG["contracts"][2]["name"]], done.stdout
    assert "pipelab.schedules.action -> pipelab.runtime.local" in done.stdout, done.stdout


def test_a_lazy_import_inside_a_function_still_counts(copy_of_the_package):
    """Two modules of one subpackage importing each other, one of them inside a function."""
    plant(copy_of_the_package, "schedules/action.py", "def _dodge():\n    from .validate import validate")
    done = lint_imports(copy_of_the_package)
    assert broken(done) == [CONFIG["contracts"][2]["name"]], done.stdout
    assert "No cycles are allowed in pipelab.schedules" in done.stdout, done.stdout
    assert ".action -> .validate" in done.stdout or ".validate -> .action" in done.stdout, done.stdout


def test_the_engine_importing_a_picture_is_forbidden(copy_of_the_package):
    plant(copy_of_the_package, "runtime/loop.py", "import matplotlib")
    done = lint_imports(copy_of_the_package)
    assert broken(done) == [CONFIG["contracts"][1]["name"]], done.stdout


def test_every_module_is_in_a_layer():
    """A module outside every layer would escape the layers contract."""
    layers = {name.strip() for layer in CONFIG["contracts"][0]["layers"] for name in layer.split("|")}
    top_level = {f"pipelab.{path.stem}" for path in PACKAGE.glob("*.py") if path.stem != "__init__"}
    top_level |= {f"pipelab.{path.parent.name}" for path in PACKAGE.glob("*/__init__.py")}
    assert top_level == layers, f"outside the layers: {sorted(top_level - layers)}; gone: {sorted(layers - top_level)}"


def test_each_subpackage_says_what_it_holds_and_may_import():
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        text = init.read_text(encoding="utf-8")
        assert text.startswith('"""') and "import" in text.split('"""')[1].lower(), f"{init}: say what it may import"


def test_import_pipelab_loads_neither_matplotlib_nor_ipywidgets():
    """The engine's processes (every rank of a launch) import pipelab; the pictures load on first use."""
    code = ("import sys, pipelab as pl; print(sorted(m for m in ('matplotlib', 'ipywidgets') if m in sys.modules)); "
            "pl.plot; print('matplotlib' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["[]", "True"], done.stdout + done.stderr
