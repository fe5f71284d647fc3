"""Reference answers to the graded tasks.

Try the task in ``exercises/`` first: the tests tell you what is wrong, these files only
tell you one way to be right.  Check them yourself with
``python -m pytest tests/tasks --impl solutions``.
"""
