"""The lessons as files: committed clean, thin, complete.  (nbval runs them: see pyproject.toml.)"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

LESSONS = sorted((Path(__file__).resolve().parents[1] / "lessons").glob("*.ipynb"))


def code_cells(notebook):
    return [c for c in notebook["cells"] if c["cell_type"] == "code"]


def text(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def test_there_are_lessons():
    assert [p.name[:2] for p in LESSONS][:3] == ["00", "01", "02"]


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_lesson_is_committed_with_cleared_outputs(path):
    notebook = json.loads(path.read_text())
    dirty = [i for i, c in enumerate(code_cells(notebook)) if c.get("outputs") or c.get("execution_count")]
    assert not dirty, (f"{path.name}: code cells {dirty} carry outputs; clear them with "
                       f"`jupyter nbconvert --clear-output --inplace {path}`")


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_lesson_is_thin_and_complete(path):
    notebook = json.loads(path.read_text())
    code = "\n".join(text(c) for c in code_cells(notebook))
    prose = "\n".join(text(c) for c in notebook["cells"] if c["cell_type"] == "markdown")
    assert "import pipelab" in code
    assert not re.search(r"^\s*class\s", code, re.M), "lessons define no classes: put code in pipelab and test it there"
    assert len(re.findall(r"^\s*def\s", code, re.M)) <= 3, "lessons are thin: more than three functions defined"
    assert "ipywidgets" in code or "pl.widgets." in code, "every lesson has at least one widget"
    assert re.search(r"^#+ What you measured", prose, re.M), "every lesson ends with 'What you measured'"
    assert "pipelab grade" in prose or path.name.startswith("00"), "point to the lesson's graded tasks"


def test_widgets_are_enabled_in_jupyterlab():
    listing = subprocess.run([sys.executable, "-m", "jupyter", "labextension", "list"],
                             capture_output=True, text=True, timeout=120)
    assert "@jupyter-widgets/jupyterlab-manager" in listing.stdout + listing.stderr
