"""One table of the lessons (pipelab/course/course_map.py), three readers: lesson 00's map, the README's course
table, docs/course.md's lesson section.  Each is checked against the table, so none goes stale alone."""

import json
from pathlib import Path

import pytest

from pipelab.course import course_map

ROOT = Path(__file__).resolve().parents[1]


def test_the_table_names_every_lesson_once():
    notebooks = sorted(p.name for p in (ROOT / "lessons").glob("*.ipynb"))
    assert [x.notebook for x in course_map.LESSONS] == notebooks
    assert all(x.notebook.startswith(x.number + "_") for x in course_map.LESSONS)
    assert all(x.title and x.line and x.detail and x.tasks for x in course_map.LESSONS)


def test_lesson_00s_map_is_the_table():
    cells = json.loads(course_map.TOUR.read_text(encoding="utf-8"))["cells"]
    (cell,) = [c for c in cells if c.get("id") == course_map.MAP_CELL]
    assert "".join(cell["source"]) == course_map.map_markdown(), "run: python -m pipelab.course.course_map"
    for x in course_map.LESSONS[1:]:  # every lesson after the tour, 12, 13, 14 and 99 included, linked
        assert f"| {x.number} | [{x.title}]({x.notebook}) |" in course_map.map_markdown()


def test_the_readmes_course_table_is_the_table():
    assert course_map.readme_table() in course_map.README.read_text(encoding="utf-8"), \
        "run: python -m pipelab.course.course_map"


def test_the_graded_tasks_named_are_the_tasks_with_tests():
    from pipelab.course import grade

    named = sorted({t for x in course_map.LESSONS for t in x.task_ids}, key=lambda t: tuple(map(int, t.split("."))))
    assert named == grade.tasks_with_tests()


def test_docs_course_md_lists_the_lessons_as_the_table_does():
    text = course_map.DOCS.read_text(encoding="utf-8")
    if course_map.DOCS_HEADING not in text:
        pytest.skip(f"docs/course.md has no {course_map.DOCS_HEADING!r} section yet: it should carry "
                    "course_map.docs_markdown() (python -m pipelab.course.course_map prints it)")
    assert course_map.docs_markdown() in text
    assert course_map.problems() == []
