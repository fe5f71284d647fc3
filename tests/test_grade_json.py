"""`pipelab grade --json` (pipelab/course/grade.py, report_json): one object per task for an autograder."""

import json

from pipelab.course import grade



def test_one_object_per_task_with_its_status_and_first_failure():
    run = grade.TestRun(outcomes=[
        grade.TestOutcome("tests/tasks/test_task1_1.py::test_a", "1.1", "passed"),
        grade.TestOutcome("tests/tasks/test_task1_1.py::test_b", "1.1", "failed", message="AssertionError: it broke",
                    raised_in="exercises/partition.py:9", function="balanced_bounds", property="it holds",
                    example="case=([1], 1)"),
        grade.TestOutcome("tests/tasks/test_task1_2.py::test_c", "1.2", "not_implemented",
                    raised_in="exercises/microbatch.py:5", function="split"),
        grade.TestOutcome("tests/tasks/test_task2_1.py::test_d", "2.1", "passed"),
    ])
    report = grade.report_json(run, ["1.1", "1.2", "2.1"], "exercises", seed=7)
    json.dumps(report)  # plain JSON
    assert (report["passed"], report["total"], report["impl"], report["hypothesis_seed"]) == (1, 3, "exercises", 7)
    first, second, third = report["tasks"]
    assert (first["task"], first["status"], first["tests"], first["passed"]) == ("1.1", "failing", 2, 1)
    assert first["lesson"] == "lessons/01_splitting.ipynb" and first["title"] == "balanced split"
    assert first["first_failure"] == {
        "test": "tests/tasks/test_task1_1.py::test_b", "status": "failed", "property": "it holds",
        "example": "case=([1], 1)", "message": "AssertionError: it broke", "at": "exercises/partition.py:9",
        "function": "balanced_bounds",
        "rerun": 'python -m pytest "tests/tasks/test_task1_1.py::test_b" --hypothesis-seed=7'}
    assert second["status"] == "not_started" and second["first_failure"] is None
    assert second["still_raising"] == ["split() in exercises/microbatch.py"]
    assert third["status"] == "passed" and third["first_failure"] is None and third["still_raising"] == []
