"""Your code for the graded tasks.

Each module holds the functions of one task with their real signatures and docstrings;
replace each ``raise NotImplementedError`` with your answer.  Check your work with
``pipelab grade`` (all tasks, with hints) or ``python -m pytest -m task1_1`` (one task).
"""
